"""The quick tier (``make test-quick``, ``pytest -m quick``): every mode once against its
reference on 2 ranks, both transports' collectives, checkpoints, Join, and the checks
that start no process; under 5 minutes on a 2-core machine, where the full suite (what
CI runs) takes about 25. The tier is this list of node-id patterns (relative to tests/,
``*`` a wildcard), so it is read in one place. ``tests/test_imports.py`` checks that it
names a test of every mode, and ``-m quick`` refuses to run while a pattern matches no test.
"""

from __future__ import annotations

import re

import pytest

QUICK: dict[str, tuple[str, ...]] = {
    "fused": ("test_fused.py::test_grads_match_ddp[world2-*", "test_fused.py::test_training_matches_ddp*"),
    "overlap": ("test_overlap.py::test_grads_match_ddp[world2-*", "test_overlap.py::test_training_matches_ddp*"),
    "functional": ("test_join.py::test_functional_all_reduce_gradients_under_join[*-2]",),
    "zero": ("test_zero.py::test_params_match_reference[world2-*",),
    "gossip": ("test_decentralized.py::test_mean_over_ranks_follows_sgd_on_the_mean_gradient[world2-*",),
    "localsgd": ("test_local.py::test_sync_every_1_matches_torch_ddp",
                 "test_local.py::test_periodic_averaging_matches_reference_loop[odd-*"),
    "diloco": ("test_local.py::test_diloco_matches_reference_from_the_equations*",),
    "join": ("test_join.py::test_reducer_matches_ddp_join[*-2]",),
    "checkpoint": ("test_elastic.py::test_resume_equals_uninterrupted*",),
    "comm": ("test_comm.py::*w2*",),
    "faults": ("test_faults.py::test_survivors_name_the_dead_rank[fused-*",),
    "static": ("test_imports.py::*", "test_docs.py::*", "test_topology.py::*", "test_buckets.py::*"),
}
"""Per mode or concern, the node ids (patterns) of its quick tests."""


def quick_patterns() -> list[str]:
    return [p for patterns in QUICK.values() for p in patterns]


def matches(node: str, pattern: str) -> bool:
    """``*`` matches anything; every other character, brackets too, stands for itself."""
    return re.fullmatch(".*".join(map(re.escape, pattern.split("*"))), node) is not None


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    patterns = quick_patterns()
    unmatched = set(patterns)
    for item in items:
        node = item.nodeid.split("tests/", 1)[-1]
        hits = {p for p in patterns if matches(node, p)}
        if hits:
            item.add_marker(pytest.mark.quick)
            unmatched -= hits
    if config.getoption("markexpr") == "quick" and unmatched:  # a renamed test must not drop out silently
        raise pytest.UsageError(f"tests/conftest.py QUICK names tests that no longer exist: {sorted(unmatched)}")
