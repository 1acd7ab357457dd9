"""Mutation check: does the test suite catch real bugs in fastreduce?

Each *mutant* below breaks fastreduce in one small, realistic way (one exact text
substitution in one file of ``fastreduce/``). For every mutant this script copies the
repository to a temporary directory, applies the substitution there (never to the
checkout itself), and runs a small, named set of existing tests against the copy; at
least one of them must fail. Before any mutant, the same tests run once on the
unmutated copy and must all pass (otherwise a failure under a mutant proves nothing).

Run it (``make test-mutations`` calls the first form)::

    python tests/mutations.py                     # every mutant, against this checkout
    python tests/mutations.py --only mean_divided_twice shm_sum_order_rank_order
    python tests/mutations.py --list              # the table: file, tests, why it matters
    python tests/mutations.py --root /tmp/base    # another checkout, with its own tests

It prints one line per mutant: its name, ``caught by <first failing test id>`` or
``SURVIVED``, the seconds it took and the tests it ran. A hang is reported as
``caught (timed out)`` and named as such. The exit status is 0 only if the unmutated
tests pass and every mutant is caught; 1 if a mutant survived, its patch no longer
applies (the original text must occur exactly once in its file: a patch that does not
apply is an error naming the file and the snippet, never skipped) or a run failed
otherwise; 2 if the check could not be set up (the unmutated tests fail, the copy is
not what the tests import).

How the tests run: ``python -m pytest -x -q -p no:cacheprovider -p no:randomly <ids>``
(``-p no:randomly`` only where pytest-randomly is installed), one pytest at a time, with
the copy as working directory and ``PYTHONPATH=<copy>`` prepended, so that every process
(the ranks that ``fastreduce.launch.run_ranks`` forks, torchrun's children) imports the
mutant and not the installed (editable) fastreduce; the script checks this once by
importing fastreduce in the copy's environment from outside the copy.
``FASTREDUCE_TRANSPORT`` and ``PYTEST_ADDOPTS`` are cleared, so the tests use the
default transport (shared memory for CPU ranks on one host) unless a mutant names
another. Each pytest run has a timeout (``--timeout``, 600 s); the process group it
started is killed when it expires.

The mutants, and why each is a bug users would suffer:

1. ``overlap_bucket_never_reduced`` (modes/overlap.py): the overlapped reducer never
   launches the last bucket's all-reduce. Those gradients stay each rank's own: the
   replicas drift apart silently while the loss still falls.
2. ``mean_divided_twice`` (comm/shm.py, ``weighted_sum``): the average that the fused
   and overlapped modes get on the default transport (and gossip's uniform mixes) is
   divided by the number of ranks twice: the effective learning rate shrinks by the
   world size, a run that "trains, just worse" with no error.
3. ``zero_shard_not_gathered`` (comm/shm.py, the all-gather's pulls; ZeRO is its only
   user): the parameter all-gather after ``ZeroOptimizer.step()`` omits the last rank's
   chunk, so the other ranks train on stale values of the parameters that rank owns.
4. ``gossip_stale_peer`` (comm/comm.py, ``Comm.mix`` point to point): each rank sends
   its peers the block it will mix into, which still holds its parameters of the
   previous round, so every rank mixes its fresh parameters with its peers' stale ones
   (the first round: zeros). Process-group transport only (the shared-memory mix reads
   the peers' blocks in place): its test runs with ``FASTREDUCE_TRANSPORT=process_group``,
   as ``make test`` runs the decentralized suite.
5. ``diloco_outer_step_skipped`` (modes/diloco.py): the outer optimizer never steps;
   every sync puts the parameters back to the anchor, so DiLoCo never learns anything
   beyond one sync period.
6. ``error_feedback_residual_dropped`` (buffer.py, ``cast_in``): the rounding left by a
   cast to the wire dtype is kept but not added into the next step's cast, so error
   feedback silently does nothing and the bf16 wire's rounding bias accumulates.
7. ``checkpoint_missing_residual`` (modes/fused.py, ``FusedReducer.state_dict``): a
   checkpoint lacks the error-feedback residual of one parameter; a resumed job starts
   it from zero and no longer ends where the uninterrupted one would (silently: the load
   ignores names it does not find).
8. ``shm_sum_order_rank_order`` (comm/shm.py, the shared-memory plan): at 3 or more
   ranks the shared-memory transport sums each chunk in rank order 0..N-1 instead of
   :func:`~fastreduce.comm.shm.sum_order`, so its results differ in the last bits from
   the process group's: runs stop being reproducible across transports (docs/design.md,
   invariant 10: the same bits on every transport).
9. ``sum_order_reversed`` (comm/shm.py, ``sum_order`` itself): every transport that
   follows ``sum_order`` sums in reversed order, while the Gloo ring reduce-scatter
   (ZeRO's, at 3 or more ranks) keeps the ring's order: bits differ by transport again.

Each mutant's tests are the fewest and fastest existing tests that catch it, preferring
those whose module fixture spawns little; the whole check takes a few minutes on a
2-core machine.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from dataclasses import dataclass
from pathlib import Path

DEFAULT_TIMEOUT = 600.0
"""Seconds one pytest run may take before it is killed (and reported as timed out)."""

SKIP_TOP = {".venv", ".git", ".stacks", ".pytest_cache", ".benchmarks", ".durations", "build", "dist",
            "bench-results", ".mypy_cache", ".ruff_cache"}
"""Top-level entries of the root that are not copied (environments, caches, outputs)."""


@dataclass(frozen=True)
class Mutant:
    """One bug: ``old`` (found exactly once in ``file``) replaced by ``new``; ``tests``
    (pytest node ids, relative to the root) must fail with it; ``env``: extra
    environment for the run; ``why``: what a user would suffer."""

    name: str
    file: str
    old: str
    new: str
    tests: tuple[str, ...]
    why: str
    env: tuple[tuple[str, str], ...] = ()


MUTANTS: list[Mutant] = [
    Mutant(
        name="overlap_bucket_never_reduced",
        file="fastreduce/modes/overlap.py",
        old="        return comm.all_reduce(buckets[b].wire, plan, None if packed else packs[b], unpacks[b])\n",
        new=("        if b == len(buckets) - 1:  # MUTANT: the last bucket's all-reduce is never launched\n"
             "            return None, None\n"
             "        return comm.all_reduce(buckets[b].wire, plan, None if packed else packs[b], unpacks[b])\n"),
        tests=("tests/test_numerics.py::test_every_choice_is_within_its_rounding_bound[world2]",),
        why="the overlapped mode leaves one bucket of gradients unreduced: replicas drift apart silently",
    ),
    Mutant(
        name="mean_divided_twice",
        file="fastreduce/comm/shm.py",
        old="        else:\n            acc.div_(m)\n    else:\n",
        new=("        else:\n            acc.div_(m)\n"
             "        acc.div_(m)  # MUTANT: the mean is divided by the number of ranks a second time\n"
             "    else:\n"),
        tests=("tests/test_numerics.py::test_fp32_wire_is_exact_to_fp32_rounding[world2]",),
        why="the fused mode's average (shared memory, the default for CPU ranks) is grad/N^2: "
            "the learning rate silently shrinks by the world size",
    ),
    Mutant(
        name="zero_shard_not_gathered",
        file="fastreduce/comm/shm.py",
        old="                          for k in range(self.world) if k != r or out is not None)\n",
        new=("                          for k in range(self.world - 1) if k != r or out is not None)"
             "  # MUTANT: the last rank's chunk is never pulled\n"),
        tests=("tests/test_zero.py::test_params_match_reference[world2-sgd]",),
        why="ZeRO's parameter all-gather omits one rank's shard: the others train on stale parameters",
    ),
    Mutant(
        name="gossip_stale_peer",
        file="fastreduce/comm/comm.py",
        old=('            send = buf if host is None else '
             'self._scratch_like(buf, "send_host", device=host).copy_(buf)\n'),
        new=('            send = out if host is None else self._scratch_like(buf, "send_host", device=host).copy_(buf)'
             "  # MUTANT: peers get the block mixed into, last round's parameters\n"),
        tests=("tests/test_decentralized.py::test_one_peer_exp_reaches_the_exact_mean_after_its_period[6]",),
        why="gossip mixes each rank's parameters with its peers' values of the previous round: "
            "consensus is never reached exactly and training follows the wrong recursion",
        env=(("FASTREDUCE_TRANSPORT", "process_group"),),
    ),
    Mutant(
        name="diloco_outer_step_skipped",
        file="fastreduce/modes/diloco.py",
        old="        self._outer_step(self._outer_views[k])\n",
        new="        pass  # MUTANT: the outer step is skipped (was: self._outer_step(self._outer_views[k]))\n",
        tests=("tests/test_local.py::test_diloco_matches_reference_from_the_equations[lr1-fp32]",),
        why="DiLoCo never applies its outer step: every sync resets the parameters to the anchor",
    ),
    Mutant(
        name="error_feedback_residual_dropped",
        file="fastreduce/buffer.py",
        old="    residual.add_(flat)\n",
        new="    residual.copy_(flat)  # MUTANT: the last step's residual is dropped, not carried into this cast\n",
        tests=("tests/test_error_feedback.py::test_residual_is_what_the_cast_rounded_away[eager]",),
        why="error feedback silently does nothing: the narrow wire's rounding accumulates over steps",
    ),
    Mutant(
        name="checkpoint_missing_residual",
        file="fastreduce/modes/fused_state.py",
        old="                                 else built.buffer.residual_state(built.layout)}  # not yet placed: as loaded)\n",
        new=("                                 else dict(list(built.buffer.residual_state(built.layout).items())[1:])}"
             "  # MUTANT: one parameter's residual is not saved\n"),
        # one spawned group serves all three (the same cost); each catches it on its own, by a
        # thin margin: 1.7-2.3e-6 against the test's atol of 1e-6 (measured)
        tests=("tests/test_elastic.py::test_resume_equals_uninterrupted[reducer]",
               "tests/test_elastic.py::test_resume_equals_uninterrupted[fused]",
               "tests/test_elastic.py::test_resume_equals_uninterrupted[overlap]"),
        why="a checkpoint lacks one entry resume needs (a residual): the resumed run silently differs",
    ),
    Mutant(
        name="powersgd_residual_not_added",
        file="fastreduce/codecs/powersgd.py",
        old="                b.m.add_(b.e)\n",
        new="                pass  # MUTANT: the residual is kept but never added to the next gradient\n",
        tests=("tests/test_powersgd.py::test_grads_match_algorithm_1[fused-shm-rank=4-bf16]",),
        why="PowerSGD's error feedback silently does nothing: what the approximation leaves out is lost",
    ),
    Mutant(
        name="sparseloco_sent_not_subtracted",
        file="fastreduce/codecs/sparse.py",
        old="        rows.scatter_add_(1, idx, -self._levels(codes, scale))  # error feedback\n",
        new="        pass  # MUTANT: what was sent stays in the accumulator and is sent again\n",
        tests=("tests/test_sparseloco.py::test_error_feedback_loses_nothing[2-1.0]",),
        why="SparseLoCo's accumulator keeps what it already sent: the same values go out sync after sync",
    ),
    Mutant(
        name="shm_sum_order_rank_order",
        file="fastreduce/comm/shm.py",
        old="        order = tuple(slices[k][b[r]:b[r + 1]] for k in sum_order(r, self.world))\n",
        new=("        order = tuple(slices[k][b[r]:b[r + 1]] for k in range(self.world))"
             "  # MUTANT: rank order 0..N-1, not sum_order\n"),
        tests=("tests/test_comm.py::test_reduce_scatter_sums_in_one_order_on_every_transport[w3-shm-rs_fp32]",),
        why="at 3+ ranks shared memory sums in another order than the process group: "
            "results differ by transport, runs are not reproducible",
    ),
    Mutant(
        name="sum_order_reversed",
        file="fastreduce/comm/shm.py",
        old="    return [(rank + 1 + k) % world for k in range(world)]\n",
        new="    return [(rank - k) % world for k in range(world)]  # MUTANT: reversed\n",
        tests=("tests/test_comm.py::test_reduce_scatter_sums_in_one_order_on_every_transport"
               "[w3-process_group-rs_fp32]",),
        why="the transports that follow sum_order and Gloo's ring reduce-scatter (ZeRO at 3+ ranks) "
            "sum in different orders: results differ by transport",
    ),
]


class PatchError(Exception):
    """A mutant's original text is not found exactly once in its file."""


class SetupError(Exception):
    """The check cannot run as it must (the copy is not what Python imports)."""


# ============================================================== the copy


def copy_tree(root: Path, dest: Path) -> None:
    """Copy ``root`` to ``dest``: everything but environments, VCS data and caches."""
    dest.mkdir(parents=True)
    for entry in sorted(root.iterdir()):
        if entry.name in SKIP_TOP or entry.name.endswith(".egg-info"):
            continue
        target = dest / entry.name
        if entry.is_dir() and not entry.is_symlink():
            shutil.copytree(entry, target, symlinks=True,
                            ignore=shutil.ignore_patterns("__pycache__", "*.pyc", ".pytest_cache"))
        else:
            shutil.copy2(entry, target, follow_symlinks=False)


def patched(text: str, m: Mutant) -> str:
    count = text.count(m.old)
    if count != 1:
        raise PatchError(f"{m.name}: the original text occurs {count} times in {m.file} (must be exactly once); "
                         f"the snippet:\n{indent(m.old)}")
    return text.replace(m.old, m.new, 1)


def indent(s: str) -> str:
    return "\n".join("    | " + line for line in s.rstrip("\n").split("\n"))


def check_patch(copy: Path, m: Mutant) -> None:
    path = copy / m.file
    if not path.is_file():
        raise PatchError(f"{m.name}: {m.file} does not exist; the snippet:\n{indent(m.old)}")
    patched(path.read_text(), m)


# ============================================================== running pytest


def environment(copy: Path, extra: tuple[tuple[str, str], ...] = ()) -> dict[str, str]:
    env = dict(os.environ)
    for name in ("FASTREDUCE_TRANSPORT", "PYTEST_ADDOPTS"):
        env.pop(name, None)
    env["PYTHONPATH"] = os.pathsep.join([str(copy)] + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else []))
    env["PYTHONDONTWRITEBYTECODE"] = "1"
    env.update(dict(extra))
    return env


def verify_imports_copy(copy: Path, env: dict[str, str], cwd: Path) -> None:
    """``import fastreduce`` in this environment, from outside the copy (so that only
    PYTHONPATH can lead to it), must find the copy's package."""
    code = "import os, fastreduce; print(os.path.realpath(fastreduce.__file__))"
    try:
        res = subprocess.run([sys.executable, "-c", code], cwd=cwd, env=env, capture_output=True, text=True,
                             timeout=300)
    except subprocess.TimeoutExpired as err:
        raise SetupError(f"importing fastreduce from the copy took over {err.timeout:g} s") from err
    got = res.stdout.strip().splitlines()[-1] if res.stdout.strip() else ""
    want = os.path.realpath(copy / "fastreduce" / "__init__.py")
    if res.returncode != 0 or got != want:
        raise SetupError(f"the copy is not what Python imports: fastreduce came from {got or '?'} "
                         f"(expected {want}); stderr:\n{res.stderr[-2000:]}")


@dataclass
class Run:
    rc: int | None  # None: timed out (killed)
    seconds: float
    cases: list[tuple[str, str, str]]  # (node id, outcome, message) per test case reported
    log: str

    @property
    def failed(self) -> list[tuple[str, str, str]]:
        return [c for c in self.cases if c[1] in ("failure", "error")]

    def count(self, outcome: str) -> int:
        return sum(c[1] == outcome for c in self.cases)


def pytest_cmd(ids: list[str], junit: Path) -> list[str]:
    cmd = [sys.executable, "-m", "pytest", "-x", "-q", "-p", "no:cacheprovider"]
    if importlib.util.find_spec("pytest_randomly") is not None:  # -p no:randomly only where it is installed
        cmd += ["-p", "no:randomly"]
    return cmd + ["-rfE", f"--junitxml={junit}", *ids]


def run_pytest(copy: Path, ids: list[str], env: dict[str, str], timeout: float, logs: Path, tag: str) -> Run:
    junit, log_path = logs / f"{tag}.xml", logs / f"{tag}.log"
    junit.unlink(missing_ok=True)
    t0 = time.monotonic()
    with open(log_path, "w") as log:
        proc = subprocess.Popen(pytest_cmd(ids, junit), cwd=copy, env=env, stdout=log, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL, start_new_session=True)
        try:
            rc: int | None = proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            rc = None
        except BaseException:
            kill_group(proc)
            raise
        finally:
            kill_group(proc)  # the ranks and servers it left behind, if any
    seconds = time.monotonic() - t0
    return Run(rc, seconds, read_junit(junit, copy), log_path.read_text(errors="replace"))


def kill_group(proc: subprocess.Popen) -> None:
    """SIGKILL the process group this script started for ``proc`` (its session)."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    try:
        proc.wait(timeout=30)
    except subprocess.TimeoutExpired:
        pass


def read_junit(path: Path, copy: Path) -> list[tuple[str, str, str]]:
    if not path.is_file():
        return []
    try:
        tree = ET.parse(path)
    except ET.ParseError:
        return []
    cases = []
    for case in tree.iter("testcase"):
        node = node_id(case.get("classname", ""), case.get("name", ""), copy)
        outcome, message = "passed", ""
        for child in case:
            if child.tag in ("failure", "error", "skipped"):
                outcome, message = child.tag, child.get("message", "") or ""
                break
        cases.append((node, outcome, message))
    return cases


def node_id(classname: str, name: str, copy: Path) -> str:
    """A pytest node id from JUnit's ``classname`` (dotted module path, then classes) and name."""
    parts = classname.split(".") if classname else []
    for k in range(len(parts), 0, -1):
        rel = "/".join(parts[:k]) + ".py"
        if (copy / rel).is_file():
            return "::".join([rel, *parts[k:], name])
    return "::".join([p for p in (classname, name) if p])


def first_failure(run: Run) -> tuple[str, str]:
    """(node id, message) of the first failing test, from JUnit, else from the log's summary."""
    if run.failed:
        node, _, message = run.failed[0]
        return node, message
    for line in run.log.splitlines():
        if line.startswith(("FAILED ", "ERROR ")):
            return line.split(" ", 1)[1].split(" - ", 1)[0], line
    return "?", ""


# ============================================================== main


def describe(m: Mutant) -> str:
    env = "".join(f" {k}={v}" for k, v in m.env)
    return (f"{m.name}\n  file:  {m.file}\n  tests:{env} {' '.join(m.tests)}\n  why:   {m.why}\n"
            f"  old:\n{indent(m.old)}\n  new:\n{indent(m.new)}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--root", type=Path, default=Path(__file__).resolve().parent.parent,
                        help="the repository to mutate a copy of, and whose tests run (default: this one)")
    parser.add_argument("--only", nargs="+", metavar="NAME", help="run only these mutants")
    parser.add_argument("--list", action="store_true", help="print the mutants and exit")
    parser.add_argument("--timeout", type=float, default=DEFAULT_TIMEOUT, help="seconds per pytest run (600)")
    parser.add_argument("--keep", action="store_true", help="keep the temporary copy and the logs")
    args = parser.parse_args(argv)

    names = [m.name for m in MUTANTS]
    if args.only:
        unknown = [n for n in args.only if n not in names]
        if unknown:
            parser.error(f"unknown mutant(s) {unknown}; choose from {names}")
    mutants = [m for m in MUTANTS if not args.only or m.name in args.only]
    if args.list:
        print("\n\n".join(describe(m) for m in mutants))
        return 0

    root = args.root.resolve()
    if not (root / "fastreduce").is_dir() or not (root / "tests").is_dir():
        print(f"mutations: {root} has no fastreduce/ and tests/ to mutate and run", file=sys.stderr)
        return 2
    print(f"mutations: {len(mutants)} mutant(s) of {root}, python {sys.executable}", flush=True)

    work = Path(tempfile.mkdtemp(prefix="fastreduce-mutations-"))
    copy, logs = work / "repo", work / "logs"
    logs.mkdir()
    try:
        copy_tree(root, copy)
        try:
            verify_imports_copy(copy, environment(copy), cwd=work)
        except SetupError as err:
            print(f"mutations: FAILED: {err}", flush=True)
            return 2
        print(f"mutations: copy at {copy} (imported from there: checked)", flush=True)
        patch_errors: dict[str, str] = {}
        for m in mutants:  # checked on the copy: what is mutated is what was copied
            try:
                check_patch(copy, m)
            except PatchError as err:
                patch_errors[m.name] = str(err)
                print(f"PATCH ERROR {err}", flush=True)

        # The unmutated copy first: every chosen test must pass, or a failure means nothing.
        runnable = [m for m in mutants if m.name not in patch_errors]
        by_env: dict[tuple[tuple[str, str], ...], list[str]] = {}
        for m in runnable:
            ids = by_env.setdefault(m.env, [])
            ids += [t for t in m.tests if t not in ids]
        for k, (env_extra, ids) in enumerate(by_env.items()):
            run = run_pytest(copy, ids, environment(copy, env_extra), args.timeout, logs, f"baseline{k}")
            label = "unmutated" + "".join(f" {a}={b}" for a, b in env_extra)
            ok = (run.rc == 0 and run.count("passed") >= len(ids) and not run.failed and not run.count("skipped"))
            if not ok:
                why = ("timed out" if run.rc is None else
                       f"pytest exit code {run.rc}, {run.count('passed')} passed of {len(ids)}, "
                       f"{run.count('skipped')} skipped, {len(run.failed)} failed")
                print(f"mutations: FAILED: the chosen tests do not pass on the {label} code ({why}); "
                      f"the check means nothing until they do. Tests: {' '.join(ids)}\n"
                      f"--- pytest output (last 4000 characters):\n{run.log[-4000:]}", flush=True)
                return 2
            print(f"{label:<34} passed  {run.seconds:6.1f}s  {len(ids)} tests", flush=True)

        failures = len(patch_errors)
        width = max(len(m.name) for m in mutants)
        for m in mutants:
            if m.name in patch_errors:
                print(f"{m.name:<{width}}  PATCH ERROR (see above)", flush=True)
                continue
            path = copy / m.file
            original = path.read_text()
            path.write_text(patched(original, m))
            try:
                run = run_pytest(copy, list(m.tests), environment(copy, m.env), args.timeout, logs, m.name)
            finally:
                path.write_text(original)
            env = "".join(f"{a}={b} " for a, b in m.env)
            if run.rc is None:
                status = "caught (timed out)"
            elif run.rc == 1:  # tests failed
                node, message = first_failure(run)
                status = f"caught by {node}"
                if "Timeout" in message:  # pytest-timeout ended a hung test
                    status = f"caught (timed out, pytest-timeout) by {node}"
            elif run.rc == 0:
                status = "SURVIVED"
                failures += 1
            else:
                status = f"ERROR: pytest exit code {run.rc} (see {logs / (m.name + '.log')})"
                failures += 1
                args.keep = True
            print(f"{m.name:<{width}}  {status}  {run.seconds:6.1f}s  tests: {env}{' '.join(m.tests)}", flush=True)
        if failures:
            print(f"mutations: {failures} of {len(mutants)} mutant(s) not caught or not applied", flush=True)
            return 1
        print(f"mutations: all {len(mutants)} mutants caught", flush=True)
        return 0
    finally:
        if args.keep:
            print(f"mutations: kept {work}", flush=True)
        else:
            shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
