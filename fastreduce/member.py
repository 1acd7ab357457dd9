"""What one member of a :class:`~fastreduce.Membership` holds: its settings, the epoch it is
in, its committed steps, its mode and the training state it shares with the others. The
parts of a membership (:mod:`.admission`, :mod:`.votes`, :mod:`.epochs`, :mod:`.commits`)
each own their own bookkeeping and change this one object.
"""

from __future__ import annotations

import contextlib
import math

from dataclasses import dataclass, field
from typing import Any, Callable, Iterator

from . import reach
from .coordinator import Epoch, MembershipError
from .faults_errors import RankLostError

__all__ = ["FAULT_POINTS", "Counters", "Member", "MembershipSettings"]

FAULT_POINTS = ("enter", "set_up", "sync_state", "build", "reshard", "voted")
"""Where :meth:`fastreduce.Membership.at` calls its callables, and what they are given:

* ``"enter"``: an epoch about to be entered (a joiner's first: as it is admitted);
* ``"set_up"``: an epoch whose group is about to be made (after the entry is agreed on);
* ``"sync_state"``: an epoch whose joiners are about to get the state (rank 0 sends it);
* ``"build"``: an epoch whose mode is about to be built (every member came to build it);
* ``"reshard"``: an epoch whose ZeRO mode is built and about to take its shards;
* ``"voted"``: the step index whose vote just completed (before anything steps)."""


@dataclass(frozen=True)
class MembershipSettings:
    """A membership's settings, in one place (what :class:`~fastreduce.Membership` takes as
    keywords; their meanings are there)."""

    world_size: int
    min_ranks: int = 1
    backend: str = "gloo"
    tag: str = ""
    timeout_s: float = 600.0
    wait_s: float = 60.0
    poll_s: float = 0.2
    heartbeat_s: float = 0.25
    """A member's heartbeat period, unless ``$FASTREDUCE_HEARTBEAT_S`` says otherwise: a loss
    ends a step within a second or two (3 silent beats), whatever the group's timeout."""
    checkpoints: Any = None
    """Where and how often the job saves itself (a :class:`~fastreduce.job_checkpoints.JobCheckpoints`)."""
    evict_slower_than: float | None = None
    """A member working this many times the members' median per step (:mod:`fastreduce.status`)
    for ``evict_for_s`` is asked to leave; ``None``: never (the default)."""
    evict_for_s: float = 30.0
    spare: bool = False
    """A warm spare: admitted only where a member is missing (below ``world_size``), at once at
    a loss; it waits registered until then, without a limit."""

    def __post_init__(self) -> None:
        if self.world_size < 1 or not 1 <= self.min_ranks <= self.world_size:
            raise ValueError(f"world_size and min_ranks must be >= 1, min_ranks at most world_size (the job starts "
                             f"with world_size members), got {self.world_size} and {self.min_ranks}")
        if not 0 <= self.poll_s < math.inf:
            raise ValueError(f"poll_s must be a finite number of seconds >= 0 (0: a poll at every step), got {self.poll_s}")
        if self.evict_slower_than is not None and not (self.evict_slower_than > 1 and self.evict_for_s > 0):
            raise ValueError(f"evict_slower_than must be > 1 (times the median member's work) and evict_for_s > 0 "
                             f"seconds, got {self.evict_slower_than} and {self.evict_for_s}")
        problem = reach.transport_problem(self.backend)
        if problem:  # (found here, before the coordinator: else the others wait for it in the group's creation)
            raise ValueError(f"fastreduce: backend={self.backend!r} cannot make its transport on this host: {problem}")


@dataclass
class Counters:
    discarded_steps: int = 0
    resyncs: int = 0  # syncs of a local-update mode run again over the survivors
    losses: int = 0
    joins: int = 0
    leaves: int = 0  # members that left at a poll (Membership.leave)
    rejoins: int = 0  # times this member, left out of an epoch (found silent), joined the job again
    stalls: list[tuple[str, float]] = field(default_factory=list)
    """Per new epoch: why (``"loss"``, ``"join"``; a joiner's own: ``"joined"``) and the
    seconds the step that ended the old one took (detection, agreement, healing)."""
    lost: list[list[str]] = field(default_factory=list)
    """Per loss, the members this one named lost (sorted; empty: a silent one it could not name)."""

    def lose(self, members: set[str]) -> None:
        """Count a loss of ``members``."""
        self.losses += 1
        self.lost.append(sorted(members))


class Member:
    """This process as a member of the job: ``name`` (its id at the coordinator), the
    ``epoch`` it is in, the ``step`` count committed, the ``mode`` built for the epoch, the
    ``state`` it shares (name -> object with ``state_dict``) and the ``build`` that makes the
    mode; whether it holds the job's state (``healed``: a first member, or a joiner once sent
    it), whether it founded epoch 0, and the mode's state kept across an epoch change."""

    def __init__(self, name: str, settings: MembershipSettings):
        if not name or any(c.isspace() or c == "," for c in name):  # (a vote's decision lists leavers by ",")
            raise ValueError(f"a member's name must be non-empty, without spaces or commas, got {name!r}")
        self.name, self.settings = name, settings
        self.epoch: Epoch | None = None
        self.step = 0
        self.mode: Any = None
        self.counters = Counters()
        self.state: dict[str, Any] = {}
        self.build: Callable[[], Any] | None = None
        self.healed = False
        self.founder = False  # admitted to epoch 0: it holds the job's start until an epoch is entered
        self.kept_mode: tuple[Any, str] = (None, "")  # (the mode's state, its commit_style)
        self.left_why = ""  # why this member left the job (Membership.leave, evicted: status.Evictions), in words: out()
        self.leaving = False  # it asked to leave itself (Membership.leave): not evicted
        self.put_away: Any = None  # the mode a leave or an epoch change put away, closed (Membership.mode once it left)
        self.failed = False  # an error ended its membership, raised to the caller (telling()): close() adds none
        self._points: dict[str, list[Callable[[Any], Any]]] = {}

    @contextlib.contextmanager
    def telling(self) -> Iterator[None]:
        """Where an error that ends the membership reaches the caller (``join()``,
        ``commit()``): :attr:`failed` set, so that ``close()`` raises none over it."""
        try:
            yield
        except (MembershipError, RankLostError):
            self.failed = True
            raise

    def out(self, why: str) -> None:
        """This member is out of the job (:attr:`fastreduce.Membership.left`), for ``why``."""
        self.left_why = why

    @property
    def left(self) -> bool:
        """Whether it is out of the job (:meth:`out`)."""
        return bool(self.left_why)

    def current(self) -> Epoch:
        if self.epoch is None:
            raise RuntimeError("not a member yet: call join() first")
        return self.epoch

    @property
    def rank(self) -> int:
        return self.current().members.index(self.name)

    def at(self, point: str, fn: Callable[[Any], Any]) -> None:
        """See :meth:`fastreduce.Membership.at`."""
        if point not in FAULT_POINTS:
            raise ValueError(f"unknown fault point {point!r}; choose one of {', '.join(FAULT_POINTS)}")
        self._points.setdefault(point, []).append(fn)

    def passing(self, point: str, arg: Any) -> None:
        """This member passes ``point``: its callables are called with ``arg``."""
        for fn in self._points.get(point, ()):
            fn(arg)
