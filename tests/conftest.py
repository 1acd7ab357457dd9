"""The quick tier (``make test-quick``, ``pytest -m quick``): every mode once against its
reference on 2 ranks, Join, checkpoints, a lost rank named, a ``Membership`` replacing a
member, both transports' collectives, and the checks that start no process; about 45 s on a
quiet 2-core machine, where the full suite (what CI runs) takes about 20 minutes
(docs/testing.md, "The quick tier"). The tier is this list of node-id patterns (relative to
tests/, ``*`` a wildcard), so it is read in one place. ``tests/test_imports.py`` checks that
it names a test of every mode, and ``-m quick`` refuses to run while a pattern matches no
test; under ``-m quick`` only the files it names are collected.
"""

from __future__ import annotations

import os

import re
from typing import Any

import pytest

# Every process a test starts prints every thread's Python stack if it aborts (which thread was
# where: an abort at exit named nothing else in CI's log).
os.environ.setdefault("PYTHONFAULTHANDLER", "1")

QUICK: dict[str, tuple[str, ...]] = {
    # A rank group costs the same whichever of its tests are selected (a module fixture runs
    # every case of its world size), so the tier is a few groups that check the most each:
    # test_join's 2 ranks on shared memory check the overlapped reducer, ZeRO and full-rank
    # PowerSGD against DDP's Join and their reference loops; test_fused's, all_reduce_gradients
    # too; test_local's, LocalSGD and DiLoCo. make test runs the rest: each mode's own suite
    # (training runs, both transports, 3 and 4 ranks), quantized wires, and the
    # integrations' imports (transformers, Lightning: seconds each).
    "fused": ("test_fused.py::test_grads_match_ddp[world2-object-*",),
    "functional": ("test_fused.py::test_grads_match_ddp[world2-function-*",),
    "overlap": ("test_join.py::test_reducer_matches_ddp_join[*-overlap-shm-2]",),
    "zero": ("test_join.py::test_zero_matches_reference[*-shm-2]",),
    "gossip": ("test_decentralized.py::test_mean_over_ranks_follows_sgd_on_the_mean_gradient[world2-*",),
    "gossip_state": ("test_decentralized.py::test_state_dict_resume_in_new_processes_continues_the_run[2]",),
    "localsgd": ("test_local.py::test_sync_every_1_matches_torch_ddp",
                 "test_local.py::test_periodic_averaging_matches_reference_loop[odd-*"),
    "diloco": ("test_local.py::test_diloco_matches_reference_from_the_equations[F*",),
    "fused_join": ("test_join.py::test_reducer_matches_ddp_join[*-fused-shm-2]",),
    "contract": ("test_imports.py::test_every_mode_declares_the_contract",),
    "compressed": ("test_join.py::test_full_rank_powersgd_matches_ddp_join[*-shm-2]",),
    "join": ("test_join.py::*-shm-2]",),
    "checkpoint": ("test_elastic.py::test_resume_equals_uninterrupted*",),
    "comm": ("test_comm.py::*w2*",),
    "faults": ("test_faults.py::test_survivors_name_the_dead_rank[fused-process_group]",),
    "membership": ("test_membership.py::test_a_lost_member_is_replaced_and_training_goes_on[shm-mid-step-False]",),
    "static": ("test_imports.py::test_module_imports[fastreduce.modes*", "test_imports.py::test_public_names_resolve",
               "test_imports.py::test_the_device_tests_name_what_exists", "test_imports.py::test_*circle*",
               "test_imports.py::test_modes_are_thin", "test_imports.py::test_quick_tier_runs_every_mode",
               "test_docs.py::*", "test_topology.py::*", "test_buckets.py::*"),
}
"""Per mode or concern, the node ids (patterns) of its quick tests."""


# ============================================================== the product's other cells (make test-all)
# Some suites are a product: mode x trainer x fault, mode x host count. make test (CI) runs a
# covering of it: every mode and every trainer in every aspect at least once, the cells an
# issue named (gossip under a Membership in both trainers, ZeRO's sharded state) always; these
# patterns are the product's other cells, each a few tens of seconds of launches on 2 cores
# with nothing a CI cell does not already exercise. make test-all (FASTREDUCE_TEST_ALL=1) runs
# them too; docs/testing.md says when it last ran whole.
def _cells(test: str, *ids: str) -> tuple[str, ...]:
    return tuple(f"{test}[{i}]" for i in ids)


FULL: dict[str, tuple[str, ...]] = {
    # kept: hf-{fused,zero,localsgd}, lightning-{diloco,gossip} (gossip in the HF Trainer: the
    # GaudiTrainer's, below, and its job resumed)
    "trainers under a Membership": _cells("test_trainers_membership.py::test_a_trainer_goes_on_through_a_loss_and_a_join",
                                          "hf-overlap", "hf-diloco", "lightning-fused", "lightning-zero",
                                          "lightning-localsgd", "lightning-overlap", "hf-gossip"),
    # kept: hf-{fused,zero,gossip,diloco}, lightning-{overlap,zero,localsgd} (every mode, ZeRO's
    # sharded state in both trainers; gossip under a Membership in both: through a loss, above)
    "a trainer's job resumed": _cells(
        "test_trainers_membership.py::test_a_trainer_job_saved_as_it_trains_resumes_as_if_it_had_never_stopped",
        "hf-overlap", "hf-localsgd", "lightning-fused", "lightning-gossip", "lightning-diloco"),
    # kept: each mode on one transport (fused on both), every point of a joiner's admission in each
    "a joiner lost as it joins": _cells(
        "test_membership.py::test_a_joiner_lost_as_it_is_admitted_healed_or_in_its_first_step_is_a_loss_like_any_other",
        "overlap-process_group", "zero-shm", "localsgd-process_group", "diloco-shm", "gossip-process_group"),
    # kept: gossip through a loss (the HF Trainer runs the others above); zero resumed
    "the GaudiTrainer under a Membership": _cells(
        "test_gaudi_trainer_membership.py::test_the_gaudi_trainer_under_a_membership_goes_on_through_a_loss_and_a_join",
        "fused", "zero", "localsgd", "overlap", "diloco") + _cells(
        "test_gaudi_trainer_membership.py::test_the_gaudi_trainer_under_a_membership_resumes_the_jobs_checkpoint",
        "fused", "overlap", "localsgd", "diloco", "gossip"),
    # kept: zero (sharded state; every mode's loop under a Membership: test_a_mode_under_a_membership_...)
    "Accelerate under a Membership": _cells(
        "test_membership.py::test_an_accelerate_loop_under_a_membership_equals_the_hand_written_one_and_resumes",
        "fused", "overlap", "localsgd", "gossip", "diloco-streaming"),
    # kept: zero (sharded state); every mode's resume: test_resume_equals_uninterrupted
    "torchrun restarts a killed rank": _cells("test_elastic.py::test_killed_rank_restarts_and_ends_as_uninterrupted",
                                              "fused", "overlap", "local", "diloco", "gossip"),
    # kept: gossip (threads of its own); every mode exits 0 in make demo
    "a user's trainer script exits 0": _cells("test_exits.py::test_a_users_trainer_script_exits_0",
                                              "fused", "overlap", "localsgd", "diloco", "zero"),
    # kept: zero over 3 hosts, gossip over 2 (a collective mode and the peer-to-peer one)
    "a partitioned host named": _cells("test_partition.py::test_partitioned_host_is_named_by_the_others_within_seconds",
                                       "fused-2hosts", "overlap-2hosts", "local-2hosts", "diloco-2hosts", "zero-2hosts"),
    # kept: inductor's cut in these two splits, aot_eager's in every other (the cut is made before the backend)
    "the backward cut by each backend": _cells("test_compile.py::test_backward_is_cut_at_buckets",
                                               "aot_eager-compile_backend", "aot_eager-plain-before"),
    # kept: a partition named within seconds (above); a minute of waiting on a 4 Mbit/s link
    "a long collective is no partition": ("test_partition.py::test_a_minute_long_collective_over_a_slow_link_is_no_partition",),
    # kept: 2+2 (the coordinator's side trains on without a majority)
    "a Membership partitioned": _cells("test_membership_partition.py::test_only_the_side_with_the_coordinator_trains_on",
                                       "3+1"),
    # kept: the fused default (every mode in the Accelerate loop: test_accelerate_modes.py)
    # kept: 4 hosts of 2 with one copy (a copy on another host is what outlives a host)
    "a host lost whole under ZeRO": ("test_membership_hosts.py::test_a_whole_host_lost_at_once_loses_no_zero_shard[8hosts-k2]",),
    # kept: the HF Trainer compiled by aot_eager, Lightning by inductor (the HF Trainer's inductor run
    # is a run of the compile fixture's launch: tests/test_transformers.py COMPILE_RUNS)
    "a trainer compiled by each backend": ("test_transformers.py::test_compiled_*[fused_inductor]",),
    "the Accelerate example per mode": _cells("test_transformers.py::test_accelerate_example", "zero", "diloco"),
    # The bench's own suites (the library is tested above; a smoke proves a suite still runs over
    # its public API): CI runs those whose figures the open issues name (reduce, step, optim,
    # faults, chaos); these run their --quick configs in make test-all and at every
    # fastreduce bench.
    "the bench's other suites": tuple(f"test_bench.py::{t}" for t in (
        "test_trainers_suite_quick_smoke", "test_local_suite_quick_smoke", "test_network_suite_quick_smoke",
        "test_network_steps_on_one_host_smoke",
        "test_convergence_suite_quick_smoke", "test_compression_suite_quick_smoke",
        "test_decentralized_suite_runs_and_reports_the_like_for_like_row",
        "test_chaos_quick_with_a_straggler_slows_it_for_its_window_and_ends_the_unused_spare")),
}
"""Per product, the node ids (patterns) make test leaves to make test-all."""


# ============================================================== several workers (make test: xdist)
# Each test file runs on one worker, so that its module fixtures start each rank group once
# as in a plain run; the files whose tests share nothing (each starts its own processes)
# are spread test by test. The longest groups start first (in this order: seconds on the
# default stack, make test-durations), so that none of them is the tail of the run; the
# rest follow in pytest-randomly's order.

INDEPENDENT = ("test_partition.py", "test_stress.py", "test_faults.py",
               "test_error_feedback.py", "test_multihost.py", "test_backends.py", "test_compat.py",
               "test_optimum_habana.py", "test_membership.py", "test_membership_partition.py",
               "test_trainers_membership.py", "test_gaudi_trainer_membership.py", "test_store_load.py",
               "test_exits.py", "test_membership_hosts.py")
"""Files whose tests share no module fixture or cache: a group per test."""

FIRST = ("test_partition.py::test_a_minute_long*",  # ~70 s, mostly waiting on a 4 Mbit/s link
         "test_scale.py", "test_stress.py::*-4]", "test_decentralized.py", "test_bench.py", "test_elastic.py",
         "test_transformers.py", "test_trainer_modes.py", "test_compile.py", "test_zero.py*", "test_fused.py*",
         "test_stress.py::*", "test_shm.py", "test_overlap.py", "test_lightning.py", "test_readme.py", "test_partition.py::*")
"""Patterns of the groups that start first, longest first (30-70 s each, the rest under 25)."""


LAUNCHES_MEMBERS = ("test_membership.py", "test_trainers_membership.py", "test_gaudi_trainer_membership.py",
                    "test_gaudi_trainer.py")
"""Files whose tests fork members that import the trainers (examples/keep_training*.py)."""
MEMBER_PRELOAD = ("torch._dynamo", "accelerate", "transformers.trainer", "fastreduce.integrations.transformers",
                  "lightning.pytorch", "fastreduce.integrations.lightning", "keep_training", "keep_training_trainers")
"""What those members import, in the fork server of a process that runs any of them (once, not
in every launch's own server: about 10 s of CPU a launch on 2 cores). A module that does not
import there (an extra not installed) is left to the members, as the fork server does."""


BY_WORLD = ("test_zero.py", "test_fused.py")
"""Files whose rank groups per world size are module fixtures of their own (``world2``,
``world3`` in the test ids), shared with no test of another id: a group per world size and
one for the rest (test_zero's alone was the process-group pass's longest group, 247 of its
295 s). (test_overlap.py's 2-rank group serves tests of both kinds.)"""


def xdist_group(node: str) -> str:
    """The file, or the test itself where its file's tests share nothing (:data:`INDEPENDENT`),
    or the file's tests of one world size (:data:`BY_WORLD`). (The bench's smoke runs stay on
    one worker: each spawns its ranks, and three of them at once on 2 cores took twice as long
    each, for no earlier end.)"""
    file = node.split("::", 1)[0]
    if file in INDEPENDENT:
        return node
    world = re.search(r"[\[-](world\d+)[-\]]", node) if file in BY_WORLD else None
    return f"{file}/{world.group(1)}" if world else file  # (no "]" after the "@": xdist's split would drop the group)


def _node(item: pytest.Item) -> str:
    return item.nodeid.split("tests/", 1)[-1].split("@", 1)[0]


def _start_rank(item: pytest.Item) -> int:
    group = xdist_group(_node(item))
    return next((k for k, p in enumerate(FIRST) if matches(group, p)), len(FIRST))


@pytest.hookimpl(trylast=True, specname="pytest_collection_modifyitems")
def pytest_start_longest_first(items: list[pytest.Item]) -> None:
    """After pytest-randomly's shuffle and pytest's grouping by fixture (a stable sort)."""
    items.sort(key=_start_rank)


@pytest.hookimpl(optionalhook=True)  # xdist's hook: unknown, and so an error, under -p no:xdist (make test-scale)
def pytest_xdist_node_collection_finished(node: Any, ids: list[str]) -> None:
    """Under ``--dist loadgroup``, each test's group is in the node id a worker collected
    (xdist's own hook puts it there): how xdist keeps a file on one worker. Where a pytest
    and xdist pair drops it (pytest 9.2 with xdist 3.8), every worker would start the
    module fixtures again, the run silently the slower for it: stop instead."""
    if node.config.getvalue("dist") == "loadgroup" and not all("@" in i for i in ids):
        pytest.exit(f"pytest-xdist's --dist loadgroup did not group the tests (pytest {pytest.__version__} with this "
                    "pytest-xdist: the group is no longer in the node id); install pytest<9.2 (pyproject.toml)", 4)


def quick_patterns() -> list[str]:
    return [p for patterns in QUICK.values() for p in patterns]


def full_patterns() -> list[str]:
    return [p for patterns in FULL.values() for p in patterns]


def pytest_ignore_collect(collection_path: Any, config: pytest.Config) -> bool | None:
    """Under ``-m quick`` only the files the tier names are collected (and imported): every
    xdist worker collects what it is given, and the others' imports (transformers,
    Lightning, the bench) cost seconds each for no test."""
    name = collection_path.name
    if config.getoption("markexpr") != "quick" or not (name.startswith("test_") and name.endswith(".py")):
        return None
    return True if name not in {p.split("::", 1)[0] for p in quick_patterns()} else None


def matches(node: str, pattern: str) -> bool:
    """``*`` matches anything; every other character, brackets too, stands for itself."""
    return re.fullmatch(".*".join(map(re.escape, pattern.split("*"))), node) is not None


def pytest_configure(config: pytest.Config) -> None:
    # One inductor cache for every process of this run (the ranks, torchrun's workers, an
    # xdist worker's): a graph compiled by one is loaded by the next, and nothing left in
    # the machine's default cache by an earlier run makes this one look faster.
    import os
    import tempfile
    if "TORCHINDUCTOR_CACHE_DIR" not in os.environ and not hasattr(config, "workerinput"):
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = tempfile.mkdtemp(prefix="fastreduce-inductor-")
        config._fastreduce_inductor_cache = os.environ["TORCHINDUCTOR_CACHE_DIR"]


def pytest_unconfigure(config: pytest.Config) -> None:
    import shutil
    made = getattr(config, "_fastreduce_inductor_cache", None)
    if made:
        shutil.rmtree(made, ignore_errors=True)


MATRIX_TEST = "test_matrix.py::test_the_trainers_support_matrix"
MATRIX_CELLS = pytest.StashKey[Any]()
"""The cell marks of this run's own collection (tests/matrix.py's Collector), read by
tests/test_matrix.py: every worker collects every test, so no second collection is needed."""


@pytest.hookimpl(tryfirst=True)  # before xdist's own, which reads the xdist_group marks
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    patterns = quick_patterns()
    unmatched = set(patterns)
    for item in items:
        node = item.nodeid.split("tests/", 1)[-1]
        item.add_marker(pytest.mark.xdist_group(xdist_group(node)))
        hits = {p for p in patterns if matches(node, p)}
        if hits:
            item.add_marker(pytest.mark.quick)
            unmatched -= hits
    if config.getoption("markexpr") == "quick" and unmatched:  # a renamed test must not drop out silently
        raise pytest.UsageError(f"tests/conftest.py QUICK names tests that no longer exist: {sorted(unmatched)}")
    if any(_node(i).startswith(MATRIX_TEST) for i in items):  # before make test-all's cells are left out
        import matrix

        collector = matrix.Collector()
        collector.pytest_collection_modifyitems(items)
        config.stash[MATRIX_CELLS] = collector
    if os.environ.get("FASTREDUCE_TEST_ALL") != "1":
        full = [i for i in items if any(matches(_node(i), p) for p in full_patterns())]
        if full:
            config.hook.pytest_deselected(items=full)
            items[:] = [i for i in items if i not in full]
    if any(_node(i).split("::", 1)[0] in LAUNCHES_MEMBERS for i in items):
        from fastreduce.launch import rank_context

        rank_context(*MEMBER_PRELOAD)  # before this process's fork server starts: imported there once
    if os.environ.get("FASTREDUCE_TEST_PASS") == "transports":  # make test's second pass (the Makefile sets it)
        # The compiled cases under inductor, the backend users run; aot_eager (the same
        # graphs without code generation) runs in the first pass, on the default transport.
        # Outside make test-all, the reducers' groups of 3 ranks and more run on the default
        # transport only, ZeRO's excepted: a collective is the same call at 2 ranks as at 3
        # (the layouts that differ with the count of ranks are the modes', tested on both
        # worlds in the first pass); ZeRO's reduce-scatter of uneven shards runs at 3 here.
        left = [i for i in items if ("test_compile.py" in i.nodeid and "aot_eager" in i.nodeid)
                or (not os.environ.get("FASTREDUCE_TEST_ALL") == "1" and "test_zero.py" not in i.nodeid
                    and re.search(r"world[3-9]", i.nodeid))]
        if left:
            config.hook.pytest_deselected(items=left)
            items[:] = [i for i in items if i not in left]


# ============================================================== durations (make test-durations)
# With FASTREDUCE_DURATIONS=PATH every test's setup, call and teardown seconds are appended
# to PATH as JSON lines; ``python -m tests.durations`` (tests/durations.py) reports them.

_durations_file = None


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    global _durations_file
    import json
    import os
    path = os.environ.get("FASTREDUCE_DURATIONS")
    if not path or getattr(report, "node", None) is not None:  # under xdist, the worker writes it
        return
    if _durations_file is None:
        _durations_file = open(path, "a", buffering=1)
    _durations_file.write(json.dumps({
        "node": report.nodeid, "when": report.when, "seconds": round(report.duration, 4),
        "outcome": report.outcome, "pass": os.environ.get("FASTREDUCE_TRANSPORT", "default"),
    }) + "\n")


def pytest_terminal_summary(terminalreporter: Any, config: pytest.Config) -> None:
    seed = getattr(config.option, "randomly_seed", None)  # pytest-randomly's, where it is active
    if isinstance(seed, int) and config.pluginmanager.has_plugin("randomly"):
        terminalreporter.write_line(f"tests ran in a random order: --randomly-seed={seed} repeats it")
