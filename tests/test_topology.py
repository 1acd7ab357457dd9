"""Gossip topologies as pure math: stochasticity, exact consensus, groups, registry."""

from __future__ import annotations

import re
from collections.abc import Iterator

import pytest
import torch

from fastreduce.modes import topology
from fastreduce.modes.topology import (
    TOPOLOGIES,
    Topology,
    consensus_rounds,
    make_topology,
    register_topology,
)

SIZES = range(2, 17)
EXACT = ("complete", "one-peer-exp", "alternating-exp-ring")
ROUNDS = {2: 1, 3: 3, 4: 2, 5: 5, 6: 5, 7: 6, 8: 3, 9: 7, 10: 7, 11: 7, 12: 7, 13: 9, 14: 9, 15: 10, 16: 4}
"""T(N) of one-peer-exp, as the module docstring documents it."""
WORST = {2: 1, 3: 5, 4: 2, 5: 9, 6: 8, 7: 11, 8: 3, 9: 13, 10: 12, 11: 13, 12: 11, 13: 17, 14: 16, 15: 19, 16: 4}
"""Rounds to exact consensus of one-peer-exp started at its worst round, as documented."""


def cases(names: tuple[str, ...]) -> list[tuple[str, int, int | None]]:
    """(name, N, L) for every N in SIZES; every divisor L of N for alternating-exp-ring."""
    out: list[tuple[str, int, int | None]] = []
    for name in names:
        for n in SIZES:
            locals_ = [d for d in range(1, n + 1) if n % d == 0] if name == "alternating-exp-ring" else [None]
            out += [(name, n, lw) for lw in locals_]
    return out


def build(name: str, n: int, lw: int | None) -> Topology:
    return make_topology(name, world_size=n, local_world_size=lw)


def period_product(topo: Topology) -> torch.Tensor:
    """W_{T-1} ... W_1 W_0 over one period."""
    prod = torch.eye(topo.world_size, dtype=torch.float64)
    for t in range(topo.period):
        prod = topo.mixing(t) @ prod
    return prod


def averaging(n: int) -> torch.Tensor:
    return torch.full((n, n), 1 / n, dtype=torch.float64)


@pytest.mark.parametrize("name,n,lw", cases(tuple(TOPOLOGIES)))
def test_every_round_doubly_stochastic(name: str, n: int, lw: int | None) -> None:
    topo = build(name, n, lw)
    for t in range(topo.period):
        w = topo.mixing(t)
        assert w.dtype == torch.float64 and w.shape == (n, n)
        assert (w >= 0).all()
        torch.testing.assert_close(w.sum(0), torch.ones(n, dtype=torch.float64), atol=1e-12, rtol=0)
        torch.testing.assert_close(w.sum(1), torch.ones(n, dtype=torch.float64), atol=1e-12, rtol=0)
        assert topo.mixing(t + topo.period) is w  # periodic and cached


@pytest.mark.parametrize("name,n,lw", cases(EXACT))
def test_one_period_is_exact_average(name: str, n: int, lw: int | None) -> None:
    topo = build(name, n, lw)
    torch.testing.assert_close(period_product(topo), averaging(n), atol=1e-12, rtol=0)
    x = torch.randn(n, 5, dtype=torch.float64, generator=torch.Generator().manual_seed(n))
    mean = x.mean(0)
    for t in range(topo.period):
        x = topo.mixing(t) @ x
    torch.testing.assert_close(x, mean.expand(n, 5), atol=1e-12, rtol=0)


@pytest.mark.parametrize("n", SIZES)
def test_one_peer_exp_rounds_and_peers(n: int) -> None:
    topo = build("one-peer-exp", n, None)
    assert topo.period == consensus_rounds(n) == ROUNDS[n]
    if n & (n - 1) == 0:
        assert topo.period == n.bit_length() - 1
    for t in range(topo.period):
        for r in range(n):
            others = [j for j, _ in topo.peers(t, r) if j != r]
            assert len(others) <= 1
            assert topo.senders_to(t, r) == others


def rounds_from(topo: Topology, start: int) -> int:
    """Rounds of mixing, from round ``start`` on, until their product is the exact average."""
    n, prod = topo.world_size, torch.eye(topo.world_size, dtype=torch.float64)
    for k in range(1, 4 * topo.period + 1):
        prod = topo.mixing(start + k - 1) @ prod
        if torch.allclose(prod, averaging(n), atol=1e-12, rtol=0):
            return k
    raise AssertionError(f"no exact average within 4 periods from round {start}")


def test_documented_table_matches() -> None:
    doc = topology.__doc__ or ""
    ns = re.search(r"^\s*N((?:\s+\d+)+)\s*$", doc, re.M)
    rounds = re.search(r"^\s*rounds((?:\s+\d+)+)\s*$", doc, re.M)
    worst = re.search(r"^\s*worst((?:\s+\d+)+)\s*$", doc, re.M)
    assert ns and rounds and worst
    sizes = list(map(int, ns.group(1).split()))
    assert dict(zip(sizes, map(int, rounds.group(1).split()))) == ROUNDS == {n: consensus_rounds(n) for n in SIZES}
    assert dict(zip(sizes, map(int, worst.group(1).split()))) == WORST


@pytest.mark.parametrize("n", SIZES)
def test_one_peer_exp_from_any_round(n: int) -> None:
    """From its first round one period is exact; from the worst round it takes WORST[n]
    rounds, at most 2T - 1 (the end of the next period), and for a power of two every
    window of one period is exact."""
    topo = build("one-peer-exp", n, None)
    per_start = [rounds_from(topo, s) for s in range(topo.period)]
    assert per_start[0] == topo.period and max(per_start) == WORST[n] <= 2 * topo.period - 1, per_start
    if n & (n - 1) == 0:
        assert per_start == [topo.period] * topo.period


@pytest.mark.parametrize("n", SIZES)
def test_alternating_period(n: int) -> None:
    for lw in (d for d in range(1, n + 1) if n % d == 0):
        nodes = n // lw
        expected = 1 if nodes == 1 else 2 * consensus_rounds(nodes)
        assert build("alternating-exp-ring", n, lw).period == expected


@pytest.mark.parametrize("n", SIZES)
def test_ring_converges_but_not_exactly(n: int) -> None:
    topo = build("ring", n, None)
    w = topo.mixing(0)
    assert topo.period == 1
    torch.testing.assert_close(w, w.T, atol=0, rtol=0)
    weights = sorted(v for _, v in topo.peers(0, 0))
    assert weights == pytest.approx([1 / min(n, 3)] * min(n, 3))
    gap = torch.linalg.eigvalsh(w - averaging(n)).abs().max().item()  # second-largest |eigenvalue|
    assert gap < 1 - 1e-6
    if n >= 4:
        assert not torch.allclose(period_product(topo), averaging(n), atol=1e-3)
        assert topo.groups(0) is None
    x = torch.randn(n, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    for _ in range(2000):
        x = w @ x
    assert (x - x.mean()).abs().max() < 1e-8


@pytest.mark.parametrize("name,n,lw", cases(EXACT))
def test_groups_partition_every_rank(name: str, n: int, lw: int | None) -> None:
    topo = build(name, n, lw)
    for t in range(topo.period):
        groups = topo.groups(t)
        assert groups is not None
        assert sorted(r for g in groups for r in g) == list(range(n))
        w = topo.mixing(t)
        for g in groups:
            block = w[list(g)][:, list(g)]
            assert torch.allclose(block.sum(1), torch.ones(len(g), dtype=torch.float64), atol=1e-12)


def test_senders_to_is_the_column() -> None:
    topo = build("alternating-exp-ring", 12, 2)
    for t in range(topo.period):
        w = topo.mixing(t)
        for r in range(12):
            assert topo.senders_to(t, r) == [j for j in range(12) if j != r and w[j, r] != 0]
            assert [j for j, _ in topo.peers(t, r)] == [j for j in range(12) if w[r, j] != 0]


def test_registry_errors() -> None:
    with pytest.raises(ValueError, match="unknown topology 'torus'.*complete.*one-peer-exp.*ring"):
        make_topology("torus", 4)
    for bad in (0, -1, 2.0, True):
        with pytest.raises(ValueError, match="world_size"):
            make_topology("ring", bad)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="LOCAL_WORLD_SIZE"):
        make_topology("alternating-exp-ring", 8)
    with pytest.raises(ValueError, match="does not divide"):
        make_topology("alternating-exp-ring", 8, local_world_size=3)
    with pytest.raises(ValueError, match="local_world_size"):
        make_topology("alternating-exp-ring", 8, local_world_size=0)
    ring = make_topology("ring", 4)
    assert make_topology(ring, 4) is ring
    with pytest.raises(ValueError, match="world_size 4"):
        make_topology(ring, 8)
    with pytest.raises(ValueError, match="round must be >= 0"):
        ring.mixing(-1)
    with pytest.raises(ValueError, match="rank must be in"):
        ring.peers(0, 4)
    with pytest.raises(TypeError):
        register_topology("nope")(int)  # type: ignore[type-var]
    with pytest.raises(ValueError, match="already registered"):
        register_topology("ring")(type("OtherRing", (topology.Ring,), {}))


@pytest.fixture
def registry() -> Iterator[dict[str, type[Topology]]]:
    saved = dict(TOPOLOGIES)
    yield TOPOLOGIES
    TOPOLOGIES.clear()
    TOPOLOGIES.update(saved)


def test_custom_topology(registry: dict[str, type[Topology]]) -> None:
    @register_topology("star")
    class Star(Topology):
        """A 2-round toy: identity, then ranks 0 and 1 average."""

        period = 2

        def build(self, step: int) -> torch.Tensor:
            n = self.world_size
            w = torch.eye(n, dtype=torch.float64)
            if step == 1 and n >= 2:
                w[:2, :2] = 0.5
            return w

    assert registry["star"] is Star and Star.name == "star"
    topo = make_topology("star", 5)
    assert isinstance(topo, Star) and topo.period == 2
    assert topo.peers(1, 0) == [(0, 0.5), (1, 0.5)]
    assert topo.groups(1) == [(0, 1), (2,), (3,), (4,)]
    assert topo.groups(0) == [(0,), (1,), (2,), (3,), (4,)]


def test_non_doubly_stochastic_rejected(registry: dict[str, type[Topology]]) -> None:
    @register_topology("leaky")
    class Leaky(Topology):
        period = 3

        def build(self, step: int) -> torch.Tensor:
            n = self.world_size
            if step < 2:
                return torch.eye(n, dtype=torch.float64)
            w = torch.zeros(n, n, dtype=torch.float64)
            w[:, 0] = 1.0  # row stochastic only: everyone copies rank 0
            return w

    with pytest.raises(ValueError, match=r"'leaky': round 2 .*not doubly stochastic: column 0"):
        make_topology("leaky", 4)

    @register_topology("negative")
    class Negative(Topology):
        period = 1

        def build(self, step: int) -> torch.Tensor:
            return torch.tensor([[1.5, -0.5], [-0.5, 1.5]], dtype=torch.float64)

    with pytest.raises(ValueError, match="round 0 .*negative"):
        make_topology("negative", 2)
