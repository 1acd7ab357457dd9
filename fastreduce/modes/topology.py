"""Gossip topologies: the mixing matrices of decentralized data parallelism.

In the gossip (decentralized) mode every rank keeps its own parameters and, in
round ``t``, replaces them by a weighted average of what some ranks sent:

    x_r' = sum_j W_t[r, j] x_j

A :class:`Topology` is nothing but the sequence of N x N mixing matrices
``W_0, W_1, ...``: pure math on small float64 tensors, no processes and no
``torch.distributed``. The transport reads from it which ranks exchange with
whom (:meth:`Topology.peers`, :meth:`Topology.senders_to`) and whether a round
can be done as subgroup means (:meth:`Topology.groups`).

Design
------
- A topology is periodic: ``mixing(t) == mixing(t % period)``. The ``period``
  matrices are built once, at construction, checked doubly stochastic (rows and
  columns sum to 1, entries >= 0: the mean of all ranks is preserved) and
  cached; everything else is derived from them and cached per round too.
  Symmetry is not required.
- New topologies subclass :class:`Topology` (set ``period``, implement
  :meth:`Topology.build`) and register under a name with
  :func:`register_topology`; :func:`make_topology` builds one by name.

Built-in topologies
-------------------
``complete``
    ``W = 11^T / N`` every round: exact average, the all-reduce.
``ring``
    Each rank averages itself and its two neighbours with weight 1/3 each
    (N = 2: 1/2 each). Never exact, but converges geometrically.
``one-peer-exp``
    At most one peer per rank per round; the product of one period's
    matrices ``W_{T-1} ... W_1 W_0`` is exactly ``J = 11^T / N``. For N = 2^p
    it is the hypercube: in round t rank r averages with ``r XOR 2^t``.
    For other N (this construction, not the Base-(k+1) graph of Takezawa et
    al., 2023): N = 2^p + q with 0 < q < 2^p; block A = ranks [0, 2^p),
    block B = ranks [2^p, N).

    1. A runs the hypercube (p rounds) while B recursively reaches its own
       consensus (T(q) rounds), in parallel; now A holds its mean a, B its
       mean b everywhere.
    2. Merge: B's member k pairs with A's member k (k < q) with weights
       ``[[q/N, 2^p/N], [2^p/N, q/N]]``; B's member becomes
       ``(2^p a + q b) / N``, the global mean m, and A's mean becomes m too
       (a doubly stochastic round preserves the total).
    3. A runs the hypercube again (p rounds): all of A holds m.

    T(1) = 0, T(2^p) = p, T(N) = max(p, T(q)) + 1 + p:

    ======  ==  ==  ==  ==  ==  ==  ==  ==  ==  ==  ==  ==  ==  ==  ==
    N        2   3   4   5   6   7   8   9  10  11  12  13  14  15  16
    rounds   1   3   2   5   5   6   3   7   7   7   7   9   9  10   4
    worst    1   5   2   9   8  11   3  13  12  13  11  17  16  19   4
    ======  ==  ==  ==  ==  ==  ==  ==  ==  ==  ==  ==  ==  ==  ==  ==

    "rounds" (the period) counts from a period's first round, where mixing starts.
    "worst" counts from any round: how long a disagreement that appears mid-period
    (a rank's gradient step) takes to be averaged out exactly. For a power of two the
    hypercube's rounds commute, so every window of one period is exact; for other N
    the merge round needs both blocks at their own means, so a window that starts
    mid-period is exact only at the end of the next period (up to 2T - 1 rounds).
    No one-peer schedule whose every window of T rounds is exact is known for these
    N (at N = 3 none exists with T = 3: each window's last round would have to be an
    equal-weight pair, and equal-weight pairs never make thirds).

``alternating-exp-ring``
    For several nodes of L ranks each (rank = node * L + local index, M = N/L
    nodes). Even rounds average within each node (clique, 1/L); odd round
    2s+1 applies round s of ``one-peer-exp`` over the M nodes to each local
    index separately. After an even round every node is uniform, so a period
    of 2 * T(M) rounds (1 if M == 1) is an exact average.

Example::

    topo = make_topology("one-peer-exp", world_size=6)
    topo.period                 # 5
    topo.peers(0, rank=1)       # [(0, 0.5), (1, 0.5)]
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from functools import lru_cache
from typing import ClassVar, TypeVar

import torch

from ..checks import check_int

__all__ = [
    "TOPOLOGIES",
    "AlternatingExpRing",
    "Complete",
    "OnePeerExp",
    "Ring",
    "Topology",
    "consensus_rounds",
    "make_topology",
    "register_topology",
]

TOL = 1e-12
"""Tolerance of the doubly-stochastic check and of the group detection."""

Pair = tuple[int, int, float]
"""``(a, b, w)``: ranks a and b average with ``[[1-w, w], [w, 1-w]]``."""

Schedule = tuple[tuple[Pair, ...], ...]
"""One tuple of disjoint pairs per round; ranks in no pair keep their value."""


@dataclass(eq=False)
class Topology(ABC):
    """The periodic mixing matrices of a gossip data-parallel mode.

    Subclasses set ``period`` (a class attribute or a property) and implement
    :meth:`build`; construction builds, validates and caches every round.
    The returned tensors are shared caches: do not modify them in place.
    """

    world_size: int
    """Number of ranks N."""
    local_world_size: int | None = None
    """Ranks per node (torchrun's LOCAL_WORLD_SIZE); only node-aware topologies use it."""

    name: ClassVar[str] = ""
    """Registry name, set by :func:`register_topology`."""

    _matrices: tuple[torch.Tensor, ...] = field(init=False, repr=False, default=())
    _peers: dict[tuple[int, int], list[tuple[int, float]]] = field(
        init=False, repr=False, default_factory=dict
    )
    _senders: dict[tuple[int, int], list[int]] = field(init=False, repr=False, default_factory=dict)
    _groups: dict[int, list[tuple[int, ...]] | None] = field(
        init=False, repr=False, default_factory=dict
    )

    def __post_init__(self) -> None:
        check_int("world_size", self.world_size, 1)
        if self.local_world_size is not None:
            check_int("local_world_size", self.local_world_size, 1)
        self.check_sizes()
        check_int("period", self.period, 1)
        self._matrices = tuple(self._validated(step) for step in range(self.period))

    @property
    @abstractmethod
    def period(self) -> int:
        """Number of rounds after which the schedule repeats."""

    @abstractmethod
    def build(self, step: int) -> torch.Tensor:
        """The N x N mixing matrix of round ``step``, ``0 <= step < period``."""

    def check_sizes(self) -> None:
        """Raise ValueError if the sizes do not suit this topology (hook)."""

    def mixing(self, round: int) -> torch.Tensor:
        """The cached float64 mixing matrix W_t of round ``round`` (row r: rank r's weights)."""
        return self._matrices[self._step(round)]

    def peers(self, round: int, rank: int) -> list[tuple[int, float]]:
        """``(rank j, W_t[rank, j])`` for the nonzero entries of row ``rank``, itself included."""
        key = (self._step(round), self._rank(rank))
        if key not in self._peers:
            row = self._matrices[key[0]][rank]
            self._peers[key] = [(j, float(row[j])) for j in row.nonzero().flatten().tolist()]
        return self._peers[key]

    def senders_to(self, round: int, rank: int) -> list[int]:
        """Ranks whose row uses ``rank``'s parameters (the ranks it must send to), itself excluded."""
        key = (self._step(round), self._rank(rank))
        if key not in self._senders:
            col = self._matrices[key[0]][:, rank]
            self._senders[key] = [j for j in col.nonzero().flatten().tolist() if j != rank]
        return self._senders[key]

    def groups(self, round: int) -> list[tuple[int, ...]] | None:
        """The round's partition into mixing groups, or None if it has none.

        Each group is a uniform clique (all entries 1/|g|, singletons included)
        or a weighted pair ``[[1-v, v], [v, 1-v]]``; the transport may then do
        the round as subgroup means (the weights of a pair are in ``mixing``).
        """
        step = self._step(round)
        if step not in self._groups:
            self._groups[step] = _partition(self._matrices[step])
        return self._groups[step]

    def _step(self, round: int) -> int:
        if round < 0:
            raise ValueError(f"round must be >= 0, got {round}")
        return round % self.period

    def _rank(self, rank: int) -> int:
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank must be in [0, {self.world_size}), got {rank}")
        return rank

    def _validated(self, step: int) -> torch.Tensor:
        w = self.build(step)
        problem = _stochastic_problem(w, self.world_size)
        if problem:
            label = self.name or type(self).__name__
            raise ValueError(f"topology {label!r}: round {step} mixing matrix {problem}")
        return w.to(torch.float64)


def _stochastic_problem(w: torch.Tensor, n: int) -> str:
    """Why ``w`` is not an n x n doubly stochastic matrix, or '' if it is."""
    if not isinstance(w, torch.Tensor) or w.shape != (n, n):
        return f"must be a {n}x{n} tensor, got {getattr(w, 'shape', type(w).__name__)}"
    w = w.to(torch.float64)
    if not torch.isfinite(w).all():
        return "has non-finite entries"
    if (w < 0).any():
        return f"has a negative entry ({w.min().item():.3g}): not doubly stochastic"
    for axis, what in ((1, "row"), (0, "column")):
        err = (w.sum(axis) - 1).abs()
        if err.max() > TOL:
            i = int(err.argmax())
            return f"is not doubly stochastic: {what} {i} sums to {w.sum(axis)[i].item():.17g}"
    return ""


def _partition(w: torch.Tensor) -> list[tuple[int, ...]] | None:
    """Connected components of ``w``'s pattern if each is a clique or a weighted pair."""
    seen: set[int] = set()
    parts: list[tuple[int, ...]] = []
    for r in range(w.shape[0]):
        if r in seen:
            continue
        group = tuple(w[r].nonzero().flatten().tolist())
        if r not in group or not _is_block(w, group):
            return None
        seen.update(group)
        parts.append(group)
    return parts


def _is_block(w: torch.Tensor, group: tuple[int, ...]) -> bool:
    """Whether ``group`` is closed in ``w`` and mixes as a clique or a weighted pair."""
    idx = torch.tensor(group)
    block = w[idx][:, idx]
    if (block.sum(1) - 1).abs().max() > TOL or (block.sum(0) - 1).abs().max() > TOL:
        return False  # rows or columns leak out of the group
    if len(group) == 2:
        (a, v), (v2, b) = block.tolist()
        return abs(a - b) <= TOL and abs(v - v2) <= TOL
    return bool(((block - 1 / len(group)).abs() <= TOL).all())


# --------------------------------------------------------------------------- registry

TOPOLOGIES: dict[str, type[Topology]] = {}
"""Registered topology classes by name; extend it with :func:`register_topology`."""

T = TypeVar("T", bound=type[Topology])


def register_topology(name: str) -> Callable[[T], T]:
    """Class decorator: register a :class:`Topology` subclass under ``name``.

    The class is constructed as ``cls(world_size=N, local_world_size=L)``.

    Example::

        @register_topology("star")
        class Star(Topology):
            period = 1
            def build(self, step):
                ...
    """

    def decorate(cls: T) -> T:
        if not (isinstance(cls, type) and issubclass(cls, Topology)):
            raise TypeError(f"register_topology({name!r}) needs a Topology subclass, got {cls!r}")
        if name in TOPOLOGIES and TOPOLOGIES[name] is not cls:
            raise ValueError(f"topology {name!r} is already registered ({TOPOLOGIES[name].__name__})")
        cls.name = name
        TOPOLOGIES[name] = cls
        return cls

    return decorate


def make_topology(
    name_or_instance: str | Topology, world_size: int, local_world_size: int | None = None
) -> Topology:
    """Build the registered topology ``name`` for these sizes, or check a given instance.

    Example::

        topo = make_topology("alternating-exp-ring", world_size=16, local_world_size=8)
        W = topo.mixing(round=3)
    """
    check_int("world_size", world_size, 1)
    if local_world_size is not None:
        check_int("local_world_size", local_world_size, 1)
    if isinstance(name_or_instance, Topology):
        return _checked_instance(name_or_instance, world_size, local_world_size)
    cls = TOPOLOGIES.get(name_or_instance)
    if cls is None:
        known = ", ".join(sorted(TOPOLOGIES))
        raise ValueError(f"unknown topology {name_or_instance!r}; known topologies: {known}")
    return cls(world_size=world_size, local_world_size=local_world_size)


def _checked_instance(topo: Topology, world_size: int, local_world_size: int | None) -> Topology:
    if topo.world_size != world_size:
        raise ValueError(f"topology built for world_size {topo.world_size}, but world_size is {world_size}")
    mismatch = topo.local_world_size not in (None, local_world_size)
    if local_world_size is not None and mismatch:
        raise ValueError(
            f"topology built for local_world_size {topo.local_world_size}, "
            f"but local_world_size is {local_world_size}"
        )
    return topo


# --------------------------------------------------------------------------- schedules


def _pairs_matrix(n: int, pairs: Sequence[Pair]) -> torch.Tensor:
    """Identity except each pair ``(a, b, w)`` mixing as ``[[1-w, w], [w, 1-w]]``."""
    w = torch.eye(n, dtype=torch.float64)
    for a, b, v in pairs:
        w[a, a] = w[b, b] = 1 - v
        w[a, b] = w[b, a] = v
    return w


def _hypercube(size: int, offset: int = 0) -> list[tuple[Pair, ...]]:
    """The log2(size) rounds of the hypercube over ranks [offset, offset + size)."""
    rounds = []
    for t in range(size.bit_length() - 1):
        bit = 1 << t
        rounds.append(tuple((offset + r, offset + (r | bit), 0.5) for r in range(size) if not r & bit))
    return rounds


@lru_cache(maxsize=None)
def _one_peer_schedule(n: int) -> Schedule:
    """The one-peer exact-consensus schedule over n ranks (see the module docstring)."""
    if n == 1:
        return ()
    a = 1 << (n.bit_length() - 1)
    if a == n:
        return tuple(_hypercube(n))
    q = n - a
    cube = _hypercube(a)
    sub = [tuple((i + a, j + a, v) for i, j, v in step) for step in _one_peer_schedule(q)]
    phase1 = [
        (cube[t] if t < len(cube) else ()) + (sub[t] if t < len(sub) else ())
        for t in range(max(len(cube), len(sub)))
    ]
    merge = tuple((k, a + k, a / n) for k in range(q))
    return tuple(phase1 + [merge] + cube)


def consensus_rounds(n: int) -> int:
    """Rounds T(n) after which ``one-peer-exp`` over n ranks is an exact average (T(1) = 0)."""
    check_int("n", n, 1)
    return len(_one_peer_schedule(n))


# --------------------------------------------------------------------------- topologies


@register_topology("complete")
class Complete(Topology):
    """Every rank averages all ranks every round: ``W = 11^T / N``, period 1."""

    period = 1

    def build(self, step: int) -> torch.Tensor:
        n = self.world_size
        return torch.full((n, n), 1 / n, dtype=torch.float64)


@register_topology("ring")
class Ring(Topology):
    """Each rank averages itself and its two ring neighbours, 1/3 each (N = 2: 1/2), period 1."""

    period = 1

    def build(self, step: int) -> torch.Tensor:
        n = self.world_size
        w = torch.zeros(n, n, dtype=torch.float64)
        for r in range(n):
            for j in {(r - 1) % n, r, (r + 1) % n}:
                w[r, j] = 1 / min(n, 3)
        return w


@register_topology("one-peer-exp")
class OnePeerExp(Topology):
    """At most one peer per rank per round; one period is an exact average (see module doc)."""

    @property
    def period(self) -> int:
        return max(1, consensus_rounds(self.world_size))

    def build(self, step: int) -> torch.Tensor:
        schedule = _one_peer_schedule(self.world_size)
        return _pairs_matrix(self.world_size, schedule[step] if schedule else ())


@register_topology("alternating-exp-ring")
class AlternatingExpRing(Topology):
    """Even rounds: clique within each node; odd rounds: ``one-peer-exp`` across nodes.

    Rank = node * L + local index. Odd round 2s+1 pairs rank (i, j) with (i', j)
    whenever node i pairs with node i' in round s of ``one-peer-exp`` over the
    M = N / L nodes. Period 2 * T(M), or 1 (the node clique) if M == 1.
    """

    def check_sizes(self) -> None:
        if self.local_world_size is None:
            raise ValueError(
                "alternating-exp-ring needs local_world_size (ranks per node, "
                "e.g. torchrun's LOCAL_WORLD_SIZE); pass local_world_size=..."
            )
        if self.world_size % self.local_world_size:
            raise ValueError(
                f"alternating-exp-ring: local_world_size {self.local_world_size} "
                f"does not divide world_size {self.world_size}"
            )

    @property
    def nodes(self) -> int:
        """Number of nodes M = N / L."""
        assert self.local_world_size is not None
        return self.world_size // self.local_world_size

    @property
    def period(self) -> int:
        return 1 if self.nodes == 1 else 2 * consensus_rounds(self.nodes)

    def build(self, step: int) -> torch.Tensor:
        if step % 2 == 0:
            return self._intra_node()
        size = self.local_world_size
        assert size is not None
        node_pairs = _one_peer_schedule(self.nodes)[step // 2]
        pairs = [(i * size + j, k * size + j, v) for i, k, v in node_pairs for j in range(size)]
        return _pairs_matrix(self.world_size, pairs)

    def _intra_node(self) -> torch.Tensor:
        size = self.local_world_size
        assert size is not None
        block = torch.full((size, size), 1 / size, dtype=torch.float64)
        return torch.block_diag(*[block] * self.nodes)

