"""The ``exits`` suite: every run that finishes exits 0, as launchers read it.

torchrun, Slurm and Kubernetes read a process's exit code: a job that trained, logged and
saved but whose process then aborted (a thread still inside a torch call as the
interpreter finalized: "terminate called without an active exception", SIGABRT) is marked
failed, and ``--max-restarts`` relaunches it. This suite launches the scripts users write
(:mod:`.user`: no ``fastreduce.shutdown()``, no ``destroy_process_group()``, no ``os._exit``)
again and again and counts every exit that is not 0:

* ``hf``: the HF ``Trainer`` in each mode (``FastReduceTrainer(fastreduce_mode=...)``, a tiny
  Llama, 16 steps, ``save_steps=8``), ``torchrun --standalone --nproc-per-node 2``;
* ``lightning``: Lightning's ``Trainer(strategy="fastreduce_<mode>")``, 16 steps, a
  checkpoint every 8, the same launch;
* ``membership``: a job of plain processes (docs/faults.md): ``fastreduce coordinator``, 3
  members (:mod:`.user.member`, the fused reducer or ZeRO (``redundant=True``), the jobs
  alternating over those of ``--modes``), one SIGKILLed from outside mid-run and a replacement
  started; every surviving member, the replacement and the coordinator (stopped with
  SIGTERM, as Kubernetes stops a pod) must exit 0, and the final members' parameters agree.

Target: no non-zero exit at all. ``--quick``: 2 launches a mode per trainer, one
membership job (what ``tests/test_exits.py`` runs in CI).
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

__all__ = ["MODES", "ExitsConfig", "format_text", "launch_member_job", "launch_trainer", "run_exits_bench"]

MODES = ("fused", "overlap", "zero", "gossip", "localsgd", "diloco")
SCRIPTS = {"hf": "hf_trainer.py", "lightning": "lightning_fit.py"}
USER = Path(__file__).with_name("user")


@dataclass(frozen=True)
class ExitsConfig:
    modes: tuple[str, ...] = MODES
    hf: int = 50                # launches per mode of the HF Trainer script
    lightning: int = 20         # launches per mode of the Lightning script
    membership: int = 20        # membership jobs (a kill and a replacement each)
    steps: int = 300            # the membership job's committed steps (0.05 s each: the replacement joins in time)
    timeout: float = 300.0      # per launch or job


def _env() -> dict[str, str]:
    # PYTHONFAULTHANDLER: a process that aborts prints every thread's Python stack first (whose
    # thread was still in a torch call as the interpreter finalized), shown in the launch's tail
    env = dict(os.environ, OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false", PYTHONUNBUFFERED="1",
               PYTHONFAULTHANDLER="1")
    env.pop("FASTREDUCE_TRANSPORT", None)  # the default transport, as a user has it
    return env


def launch_trainer(trainer: str, mode: str, timeout: float = 300.0) -> dict[str, Any]:
    """One ``torchrun --standalone --nproc-per-node 2`` launch of the ``trainer`` script in
    ``mode``: its exit code, seconds and, where it is not 0, the output's last lines."""
    with tempfile.TemporaryDirectory(prefix="fastreduce-exits-") as out:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
               str(USER / SCRIPTS[trainer]), mode, out]
        start = time.perf_counter()
        try:
            run = subprocess.run(cmd, env=_env(), capture_output=True, text=True, timeout=timeout)
            rc, text = run.returncode, run.stdout + run.stderr
        except subprocess.TimeoutExpired as err:
            rc, text = "timeout", f"{err.stdout or ''}{err.stderr or ''}"
    seconds = time.perf_counter() - start
    return {"rc": rc, "seconds": seconds, "tail": "" if rc == 0 else _tail(text)}


def _tail(text: Any, lines: int = 25) -> str:
    """The first traceback's 80 lines (the failing process's own, before torchrun's report of
    it; after an abort, every thread's stack) and the last ``lines`` lines."""
    text = text.decode(errors="replace") if isinstance(text, bytes) else str(text)
    all_lines = text.splitlines()
    first = next((k for k, line in enumerate(all_lines) if "Traceback" in line or "terminate called" in line), None)
    head = all_lines[first:first + 80] if first is not None and first < len(all_lines) - lines else []
    return "\n".join([*head, *(["..."] if head else []), *all_lines[-lines:]])


def _start(cmd: list[str], env: dict[str, str]) -> subprocess.Popen:
    return subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, bufsize=1)


def _read_until(proc: subprocess.Popen, pattern: str, deadline: float, lines: list[str]) -> re.Match | None:
    """Lines of ``proc`` (kept in ``lines``) until one matches ``pattern`` (or it ends, or the deadline)."""
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        if not line:
            return None
        lines.append(line.rstrip())
        found = re.search(pattern, line)
        if found:
            return found
    return None


MEMBER_MODES = ("fused", "zero")
"""The modes of the membership job's user script (:mod:`.user.member`)."""


def launch_member_job(steps: int = 300, kill_at: int = 10, timeout: float = 300.0, mode: str = "fused") -> dict[str, Any]:
    """A coordinator, 3 members, member 2 SIGKILLed once it committed ``kill_at`` steps and a
    replacement started: every process's exit code (the killed one's is -9 by design, not
    counted), the members' final digests and, where an exit is not 0, its last lines."""
    import threading

    deadline = time.monotonic() + timeout
    env = _env()
    cli = [sys.executable, "-m", "fastreduce"]
    coord = _start([*cli, "coordinator", "--host", "127.0.0.1", "--port", "0"], env)
    out: dict[str, list[str]] = {"coordinator": []}
    procs: dict[str, subprocess.Popen] = {"coordinator": coord}
    try:
        found = _read_until(coord, r"serving on [^:]+:(\d+)", deadline, out["coordinator"])
        if found is None:
            return {"codes": {"coordinator": coord.poll()}, "digests": {}, "tails": {"coordinator": _tail("\n".join(out["coordinator"]))}}
        env["FASTREDUCE_COORDINATOR"] = f"127.0.0.1:{found.group(1)}"
        env["FASTREDUCE_HEARTBEAT_S"] = "0.25"
        member = [sys.executable, str(USER / "member.py"), str(steps), mode]
        for i in range(3):
            procs[f"member{i}"], out[f"member{i}"] = _start(member, env), []
        # member 2 is read here until it has committed kill_at steps; the others by threads
        readers = [threading.Thread(target=_drain, args=(procs[k], out[k]), daemon=True) for k in ("member0", "member1")]
        for t in readers:
            t.start()
        _read_until(procs["member2"], rf"^step {kill_at}\b", deadline, out["member2"])
        procs["member2"].kill()
        procs["member2"].wait()
        procs["replacement"], out["replacement"] = _start(member, env), []
        readers.append(threading.Thread(target=_drain, args=(procs["replacement"], out["replacement"]), daemon=True))
        readers[-1].start()
        for key in ("member0", "member1", "replacement"):
            procs[key].wait(max(1.0, deadline - time.monotonic()))
        for t in readers:
            t.join(5)
        coord.send_signal(signal.SIGTERM)
        coord.wait(max(1.0, deadline - time.monotonic()))
    except subprocess.TimeoutExpired:
        pass
    finally:
        for p in procs.values():
            if p.poll() is None:
                p.kill()
                p.wait()
    codes = {k: p.returncode for k, p in procs.items()}
    digests = {k: line.split()[1] for k in ("member0", "member1", "replacement")
               for line in out.get(k, []) if line.startswith("digest ")}
    tails = {k: _tail("\n".join(out.get(k, []))) for k, rc in codes.items() if rc != 0 and k != "member2"}
    return {"mode": mode, "codes": codes, "digests": digests, "tails": tails}


def _drain(proc: subprocess.Popen, lines: list[str]) -> None:
    for line in proc.stdout:
        lines.append(line.rstrip())


def run_exits_bench(cfg: ExitsConfig) -> dict[str, Any]:
    """Every launch of :class:`ExitsConfig`, interleaved over the modes (a bad minute of the
    machine does not fall on one mode); the counts of exits that were not 0."""
    runs: dict[str, dict[str, list[dict[str, Any]]]] = {t: {m: [] for m in cfg.modes} for t in SCRIPTS}
    for trainer, launches in (("hf", cfg.hf), ("lightning", cfg.lightning)):
        for k in range(launches):
            for mode in cfg.modes:
                run = launch_trainer(trainer, mode, cfg.timeout)
                runs[trainer][mode].append(run)
                print(f"exits: {trainer} {mode} launch {k + 1}/{launches}: exit {run['rc']} in {run['seconds']:.1f} s",
                      file=sys.stderr, flush=True)
    jobs = []
    member_modes = [m for m in MEMBER_MODES if m in cfg.modes] or ["fused"]
    for k in range(cfg.membership):
        job = launch_member_job(cfg.steps, timeout=cfg.timeout, mode=member_modes[k % len(member_modes)])
        jobs.append(job)
        print(f"exits: membership job {k + 1}/{cfg.membership} ({job['mode']}): exits {job['codes']}",
              file=sys.stderr, flush=True)
    return {"config": asdict(cfg), "runs": runs, "membership": jobs, "summary": summarize(runs, jobs)}


def summarize(runs: dict[str, dict[str, list[dict[str, Any]]]], jobs: list[dict[str, Any]]) -> dict[str, Any]:
    """Per trainer and mode: launches, non-zero exits, median seconds; the membership jobs'
    non-zero exits (the killed member's -9 apart) and jobs whose members' digests differ."""
    import statistics

    table = {f"{t} {m}": {"launches": len(rs), "failed": sum(r["rc"] != 0 for r in rs),
                          "median_s": statistics.median(r["seconds"] for r in rs) if rs else None}
             for t, by_mode in runs.items() for m, rs in by_mode.items() if rs}
    bad = sum(any(rc != 0 for k, rc in j["codes"].items() if k != "member2") for j in jobs)
    differ = sum(len(set(j["digests"].values())) > 1 or len(j["digests"]) < 3 for j in jobs)
    return {"trainers": table, "membership_jobs": len(jobs), "membership_failed": bad,
            "membership_digests_differ": differ,
            "all_zero": all(v["failed"] == 0 for v in table.values()) and bad == 0 and differ == 0}


def format_text(result: dict[str, Any]) -> str:
    s = result["summary"]
    lines = ["exits: every finished run's exit code (target: all 0)", "",
             f"{'script':<22} {'launches':>8} {'non-zero':>8} {'median s':>9}"]
    for name, row in s["trainers"].items():
        lines.append(f"{name:<22} {row['launches']:>8} {row['failed']:>8} {row['median_s']:>9.1f}")
    if s["membership_jobs"]:
        lines.append(f"{'membership job':<22} {s['membership_jobs']:>8} {s['membership_failed']:>8} {'':>9}"
                     f"  (members' digests differ in {s['membership_digests_differ']})")
    lines.append("")
    lines.append("every exit 0: " + ("yes" if s["all_zero"] else "NO"))
    for trainer, by_mode in result["runs"].items():
        for mode, rs in by_mode.items():
            for r in rs:
                if r["rc"] != 0:
                    lines += [f"--- {trainer} {mode}: exit {r['rc']}", r["tail"]]
    for j in result["membership"]:
        for k, tail in j["tails"].items():
            lines += [f"--- membership {k}: exit {j['codes'][k]}", tail]
    return "\n".join(lines)
