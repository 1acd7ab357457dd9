"""Members come and go; training goes on (DESIGN, invariant 11).

A job's processes (its *members*) agree through a **coordinator** on numbered **epochs**:
who is in, in rank order, and at which committed step the epoch began. The coordinator
is a c10d ``TCPStore`` that no member hosts (``fastreduce coordinator --port P``, or any
``TCPStore(is_master=True)``); it is the job's one documented single point: a member that
cannot reach it raises :class:`MembershipError` within the store's timeout, and a network
partition never splits the job in two, as only the side that reaches the coordinator can
form the next epoch. Each epoch gets a process group of its own (the default group, made
again on a fresh store prefix), so every fastreduce mode, built over the default group,
runs in it unchanged; the mode is rebuilt at each new epoch from the builder the members
gave (each survivor keeping its own mode state: error-feedback residuals).

Per step, :meth:`Membership.commit` runs the mode's reduction and, where it succeeded,
the optimizer's step: no request to the coordinator on the way. A step is still **committed
on every member or on none**, decided when the epoch ends: a member is lost, the
survivors' reductions fail (some survivors may have completed that step's reduction before
the loss, with every member's gradients in it, and stepped), and each survivor registers
for the next epoch with its committed steps. The members holding the most (at most one
more than the others: a step's reduction needs every member) send their state to the
others as to a joiner, so every survivor enters the next epoch at that step; where none
completed it, the step is discarded on every member (its gradients lost with the batch;
the caller steps only on ``True``). At most one step is discarded per loss.

**Losses.** A failed reduction (a :class:`~fastreduce.RankLostError`, or the transport's
error) ends the epoch: every survivor registers for the next epoch, waits until every
member not known lost has registered (at most ``$FASTREDUCE_LOST_AFTER_S``, longer for one
whose heartbeat still beats in the old epoch, up to ``wait_s``), and the first
proposal written wins (``compare_set``); a member left out of it (registered too late)
raises :class:`MembershipError`, and may rejoin as a new process.

**Polls.** Every ``poll_s`` seconds (a number of steps agreed at the previous poll, from
the step time) the members vote through the coordinator at the end of a step: each adds 1
to the step's counter, and the member whose vote completes the count looks for joiners and
writes the decision (go on, or admit them) and the step of the next poll. A member silent
for ``$FASTREDUCE_LOST_AFTER_S`` during a poll ends the epoch as a failed reduction does.
LocalSGD and DiLoCo, whose collectives run in the optimizer's step, vote at every sync
instead: a sync that fails on any member is put back and run again on every survivor.
Gossip, which steps and exchanges inside forward and backward, gives ``commit()`` them (a
closure): at a loss each survivor drops the exchanges in flight and keeps its own
parameters and optimizer state (a gossip rank's are its own anyway), and the ring or
graph is rebuilt over the survivors at one round they agree on.

**Joining.** A new process, started like the others with the same coordinator, takes a
ticket and is admitted at the members' next poll (the voter that completes the count sees
the ticket and decides ``"join"``): after that step is committed, the next epoch holds the
members then the joiners, and rank 0 (a member) sends the whole training state (every
``state_dict`` of ``state`` and the committed step count) over the new group; the joiner
loads it, so it equals the members bit for bit, and the world grows. A joiner whose
fastreduce version, ``tag`` (the mode and its settings) or model layout (names, shapes,
dtypes) differs from the members' is refused before admission, with an error naming the
difference, and the members are not disturbed.

**Leaving.** :meth:`Membership.leave` asks to leave at the next poll: the voter that
completes the count sees it, and the others form the next epoch without the member, with
no loss (a spot instance's preemption notice, or a member out of data).

The data: :attr:`Membership.rank` and :attr:`Membership.world` change with the epoch; a
sampler re-shards from them at each epoch (:attr:`Membership.epoch`). A discarded step's
batches are skipped, not re-run.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import socket
import time
import uuid
import warnings
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any, Callable, Mapping

import torch
import torch.distributed as dist

import fastreduce.faults as faults

from .faults import RankLostError
from .heal import broadcast_state
from .version import __version__

__all__ = ["COORDINATOR_ENV", "Epoch", "Membership", "MembershipError", "connect", "serve"]

log = logging.getLogger(__name__)

COORDINATOR_ENV = "FASTREDUCE_COORDINATOR"
"""``host:port`` of the coordinator, where :class:`Membership` is given none."""
_P = "fastreduce/members/"
_HEARTBEAT_S = 0.25  # a member's heartbeat period unless $FASTREDUCE_HEARTBEAT_S is set


class MembershipError(RuntimeError):
    """This process cannot be (or stay) a member: refused as a joiner, left out of an
    epoch, or the coordinator is unreachable. The message says which and what to do."""


@dataclass(frozen=True)
class Epoch:
    """One membership: ``members`` in rank order, from committed step ``step`` on."""

    number: int
    members: tuple[str, ...]
    step: int
    admitted: int  # joiner tickets handled so far
    joined: tuple[str, ...] = ()  # members new in this epoch (they receive the state)

    @property
    def world(self) -> int:
        return len(self.members)

    def to_json(self) -> str:
        return json.dumps({"number": self.number, "members": list(self.members), "step": self.step,
                           "admitted": self.admitted, "joined": list(self.joined)})

    @classmethod
    def from_json(cls, text: str | bytes) -> Epoch:
        d = json.loads(text)
        return cls(d["number"], tuple(d["members"]), d["step"], d["admitted"], tuple(d["joined"]))


def connect(coordinator: str, timeout_s: float = 30.0) -> dist.TCPStore:
    """A client connection to the coordinator at ``host:port``."""
    host, _, port = coordinator.rpartition(":")
    if not host or not port.isdigit():
        raise ValueError(f"coordinator must be 'host:port', got {coordinator!r}")
    try:
        return dist.TCPStore(host, int(port), is_master=False, timeout=timedelta(seconds=timeout_s),
                             wait_for_workers=False)
    except Exception as err:  # noqa: BLE001 - torch raises several kinds
        raise MembershipError(f"fastreduce: cannot reach the coordinator at {coordinator} ({err}); start it "
                              "first (`fastreduce coordinator --port PORT`) and pass its address") from err


def serve(port: int = 0, host: str = "0.0.0.0") -> dist.TCPStore:
    """The coordinator: a ``TCPStore`` server (``port`` 0: any free one, ``.port``)."""
    return dist.TCPStore(host, port, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=30))


@dataclass
class _Counters:
    discarded_steps: int = 0
    resyncs: int = 0  # syncs of a local-update mode run again over the survivors
    losses: int = 0
    joins: int = 0
    leaves: int = 0  # members that left at a poll (Membership.leave)
    stalls: list[tuple[str, float]] = field(default_factory=list)
    """Per new epoch: why (``"loss"``, ``"join"``; a joiner's own: ``"joined"``) and the
    seconds the step that ended the old one took (detection, agreement, healing)."""


class Membership:
    """This process's membership of a fault-tolerant job (see the module doc).

    Args:
        coordinator: ``"host:port"`` of the coordinator, or a store; default
            ``$FASTREDUCE_COORDINATOR``.
        world_size: the members the job starts with (epoch 0 forms when they have all
            joined); later joiners grow it.
        min_ranks: below this many members the survivors wait up to ``wait_s`` for
            joiners, then raise :class:`~fastreduce.RankLostError`.
        backend: each epoch's process group backend (``"gloo"``; ``"nccl"``/``"hccl"``
            where each member has its own device).
        tag: the mode and its settings, in words (e.g. ``"fused bf16"``): a joiner with
            another tag is refused.
        timeout_s: each epoch's process-group timeout.
        wait_s: how long a joiner waits for admission, and survivors below
            ``min_ranks`` wait for joiners.
        poll_s: about how often the members look for joiners (a vote through the
            coordinator every so many steps; the per-step modes' only request to it).
            A joiner waits up to this long for admission, plus a step.

    Use::

        m = Membership("10.0.0.1:29400", world_size=4, min_ranks=2, tag="fused bf16")
        m.join({"model": model, "optimizer": opt},
               lambda: fastreduce.FusedReducer(model, wire_dtype=torch.bfloat16))
        while m.step < steps:
            loss_fn(model(*batch_for(m.rank, m.world, m.step))).backward()
            m.commit(opt.step)    # the mode's reduce(), the vote, the step if committed
            opt.zero_grad()
    """

    def __init__(self, coordinator: str | dist.Store | None = None, *, world_size: int, min_ranks: int = 1,
                 backend: str = "gloo", tag: str = "", timeout_s: float = 600.0, wait_s: float = 60.0,
                 poll_s: float = 0.2, member: str | None = None):
        if world_size < 1 or not 1 <= min_ranks:
            raise ValueError(f"world_size and min_ranks must be >= 1, got {world_size} and {min_ranks}")
        if not poll_s >= 0:
            raise ValueError(f"poll_s must be >= 0 seconds (0: a poll at every step), got {poll_s}")
        coordinator = coordinator if coordinator is not None else os.environ.get(COORDINATOR_ENV)
        if coordinator is None:
            raise ValueError(f"no coordinator: pass coordinator='host:port' or set ${COORDINATOR_ENV} "
                             "(start one with `fastreduce coordinator --port PORT`)")
        self.where = coordinator if isinstance(coordinator, str) else "the coordinator store"
        # A loss must end a step within a second or two, whatever the group's timeout: beat
        # every 0.25 s (lost after 3 silent beats) unless the job says otherwise.
        os.environ.setdefault(faults.HEARTBEAT_ENV, str(_HEARTBEAT_S))
        self.store = connect(coordinator) if isinstance(coordinator, str) else coordinator
        self._caller = faults.StoreCaller("fastreduce-coordinator")  # every request bounded (a partition)
        self._waiter: Any = None  # a connection for the vote's waiting get
        self.world_size, self.min_ranks, self.backend, self.tag = world_size, min_ranks, backend, tag
        self.timeout_s, self.wait_s, self.poll_s = timeout_s, wait_s, poll_s
        self._poll_at = 0  # the step index of the members' next poll (agreed at the last one)
        self._polled: tuple[int, int] | None = None  # (epoch, step) of this member's last poll
        self._leaves_seen = 0  # requests to leave counted when this member last looked
        self.left = False  # this member left the job (leave())
        self._step_s: float | None = None  # a running mean of the seconds between commits
        self._last_commit: float | None = None
        self.member = member or f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:6]}"
        self.epoch: Epoch | None = None
        self.step = 0  # committed steps
        self.mode: Any = None  # the mode object of this epoch
        self.counters = _Counters()
        self._state: dict[str, Any] = {}
        self._build: Callable[[], Any] | None = None
        self._refused: set[int] = set()  # joiner tickets refused here
        self._healed = False  # whether this process holds the job's state (a member's, or a joiner's once sent)
        self._kept_mode: tuple[dict[str, Any] | None, bool] = (None, False)  # (the mode's state, per rank)

    # ------------------------------------------------------------------ reading

    @property
    def rank(self) -> int:
        return self._epoch().members.index(self.member)

    @property
    def world(self) -> int:
        return self._epoch().world

    def _epoch(self) -> Epoch:
        if self.epoch is None:
            raise RuntimeError("not a member yet: call join() first")
        return self.epoch

    # ------------------------------------------------------------------ joining

    def join(self, state: Mapping[str, Any], build: Callable[[], Any] | None = None) -> Epoch:
        """Enter the job: epoch 0 with the first ``world_size`` processes, else admitted
        at the members' next step and given their whole state (``state``: name -> object
        with ``state_dict``/``load_state_dict``, e.g. the model and its optimizer; the
        same names on every member). ``build()`` makes the mode over the current default
        group (again at each new epoch). Returns the epoch joined."""
        self._state, self._build = dict(state), build
        mine = self._fingerprint()
        ticket = self._call(self.store.add, _P + "tickets", 1)
        self._call(self.store.set, _P + f"ticket/{ticket}", json.dumps({"member": self.member, "print": mine}))
        if ticket == self.world_size:  # the last of the first members lays out epoch 0
            checked = [(t, self._ticket(t)) for t in range(1, ticket + 1)]
            refusals = {t: self._differs(j["print"], mine) for t, j in checked}
            members = tuple(j["member"] for t, j in checked if refusals[t] is None)
            self._propose(Epoch(0, members, 0, ticket, members), refusals)
        answer = self._await_key(_P + f"admit/{ticket}", self.wait_s, "admission")
        if answer.startswith("refused"):
            raise MembershipError(f"fastreduce: this process was refused as a joiner: {answer[len('refused: '):]}")
        epoch = Epoch.from_json(self._call(self.store.get, _P + f"epoch/{int(answer)}"))
        start = time.perf_counter()
        self._enter(epoch)
        self.counters.stalls.append(("joined", time.perf_counter() - start))
        return epoch

    def _fingerprint(self) -> dict[str, Any]:
        tensors = []
        for name, obj in sorted(self._state.items()):
            if isinstance(obj, torch.nn.Module):
                tensors += [[f"{name}.{k}", list(v.shape), str(v.dtype)] for k, v in obj.state_dict().items()]
            else:
                tensors.append([name, type(obj).__name__, ""])
        return {"version": __version__, "tag": self.tag, "tensors": tensors}

    @staticmethod
    def _differs(theirs: dict[str, Any], ours: dict[str, Any]) -> str | None:
        """Why a joiner (``theirs``) cannot join members like ``ours``, or ``None``."""
        if theirs["version"] != ours["version"]:
            return f"fastreduce {theirs['version']} joining members on fastreduce {ours['version']}: install the same"
        if theirs["tag"] != ours["tag"]:
            return f"tag {theirs['tag']!r} (mode and settings) joining members with tag {ours['tag']!r}"
        for a, b in zip(theirs["tensors"], ours["tensors"]):
            if a != b:
                return f"its state holds {' '.join(map(str, a))} where the members hold {' '.join(map(str, b))}"
        if len(theirs["tensors"]) != len(ours["tensors"]):
            return (f"its state holds {len(theirs['tensors'])} entries where the members hold "
                    f"{len(ours['tensors'])}: the same model and optimizer are needed")
        return None

    def _ticket(self, t: int) -> dict[str, Any]:
        return json.loads(self._await_key(_P + f"ticket/{t}", self.wait_s, f"joiner ticket {t}"))

    # ------------------------------------------------------------------ every step

    def commit(self, step: Callable[[], Any]) -> bool:
        """Commit this step on every member or on none; ``True`` when committed.

        ``step``: the optimizer's (``opt.step``), run here once the reduction succeeded, so
        that a joiner admitted at this step takes the state after it (the members form
        the next epoch right after it, before any backward of the next step).

        The fused and overlapped modes: the mode's ``reduce()``, then ``step()``, then,
        at a poll, the vote. ``False``: a member was lost and no survivor completed this
        step's reduction, so every member discarded it; ``True`` after a loss: another
        survivor completed it (with this member's gradients in it) and this member took
        its state. Either way the next epoch is formed already: read :attr:`rank` and
        :attr:`world` again.

        Gossip (:class:`~fastreduce.DecentralizedDataParallel`): ``step`` is the step's
        forward and backward through :attr:`mode` (``m.commit(lambda:
        loss_fn(m.mode(x), y).backward())``), as the mode steps and exchanges inside them;
        at a loss every survivor keeps its own state and the exchanges in flight are dropped.

        LocalSGD and DiLoCo (their collectives run inside the optimizer's step): an
        inner step without a collective just runs. At a sync,
        the mode's state and the optimizer's are kept first; if a member is lost during
        the sync or before the vote completes, every survivor puts them back and runs
        the same step (the same gradients) again over the next epoch: the sync is redone
        over the survivors, nothing is discarded (``counters.resyncs``)."""
        if not callable(step):
            raise TypeError(f"commit() takes the optimizer's step (membership.commit(optimizer.step)), got "
                            f"{type(step).__name__}")
        if self.left:
            raise RuntimeError("this member left the job (leave()); start a new process to join again")
        joined = getattr(self.mode, "_join_config", None)
        if joined is not None and joined.enable:  # each member alone, before any collective
            raise RuntimeError("fastreduce.Membership does not run a mode under torch's Join (uneven inputs): the "
                               "members re-shard the data at every epoch, so each has a batch at every step; a "
                               "member out of data calls membership.leave() and is out at the next poll")
        start = time.perf_counter()  # a stall counts from here: detection, the new epoch, healing
        kind, s = _kind(self.mode), self.step
        if kind == "local":
            return self._commit_local(step, start)
        try:
            if kind == "gossip":
                step()  # the step's forward and backward: the mode steps and exchanges inside them
            elif kind == "reduce":
                self.mode.reduce()
        except RuntimeError as err:
            return self._lost_step(self._aborted_by(err), start)
        self.step += 1
        if kind != "gossip":
            step()
        if s >= self._poll_at:
            decision, who = self._vote(s)
            if decision == "abort":  # a member went silent after this step's reduction: the step stands
                self.counters.losses += 1
                self._next_epoch(who, "loss", start)
            elif decision == "join":
                self._change(who, start)
        self._timed()
        return True

    def leave(self) -> None:
        """Leave the job at the members' next poll (LocalSGD, DiLoCo: their next sync),
        with no loss: :meth:`commit` runs the steps as before until then, and
        :attr:`left` turns ``True`` once this member is out (its group and mode closed).
        The others go on without it, nothing discarded and no loss window waited. For a
        member told it will be preempted (a spot instance's notice) or out of data."""
        self._epoch()
        self._call(self.store.set, _P + f"leaving/{self.member}", "1")
        self._call(self.store.add, _P + "leaving", 1)

    def _change(self, leavers: set[str], start: float) -> None:
        """A poll decided a new epoch: joiners admitted, ``leavers`` gone (this one too?)."""
        self.counters.leaves += len(leavers)
        if self.member not in leavers:
            self._next_epoch(leavers, "leave" if leavers else "join", start)
            return
        self._stash_mode(after_loss=False)  # as the others do (gossip completes its exchanges with them)
        self._leave_group(abandon=False)
        self._kept_mode = (None, False)
        self.left = True
        log.info("fastreduce: member %s left the job at step %d", self.member, self.step)

    def _timed(self) -> None:
        """The running mean of the seconds between commits (the next poll's distance)."""
        now = time.perf_counter()
        if self._last_commit is not None:
            gap = now - self._last_commit
            self._step_s = gap if self._step_s is None else 0.8 * self._step_s + 0.2 * gap
        self._last_commit = now

    def _lost_step(self, lost: set[str], start: float) -> bool:
        """This step's reduction failed: the next epoch, at the step the survivors reached.
        ``True`` where another survivor completed this step (this member took its state)."""
        before = self.step
        self.counters.losses += 1
        log.warning("fastreduce: step %d failed (lost: %s); forming the next epoch", before,
                    ", ".join(sorted(lost)) or "a silent member")
        self._next_epoch(lost, "loss", start)
        if self.step > before:
            return True
        self.counters.discarded_steps += 1
        log.warning("fastreduce: step %d discarded on every member", before)
        return False

    def _commit_local(self, step: Callable[[], Any], start: float) -> bool:
        mode = self.mode
        if not mode.communicates_at(mode.steps + 1):
            step()
            self.step += 1
            return True
        kept = self._keep()
        while True:
            try:
                step()
            except RuntimeError as err:
                self._again(kept, self._aborted_by(err), start)
                continue
            decision, who = self._vote(self.step)
            if decision != "abort":
                break
            self._again(kept, who, start)
        self.step += 1
        if decision == "join":
            self._change(who, start)
        return True

    def _keep(self) -> dict[str, Any]:
        """What a sync changes, to put back if it fails: the mode's state (parameters,
        anchor, outer optimizer, counters), every object of ``state`` but the model, and
        the gradients (LocalSGD's warm-up averages them in the step)."""
        grads = [(p, p.grad.clone()) for v in self._state.values() if isinstance(v, torch.nn.Module)
                 for p in v.parameters() if p.grad is not None]
        return {"mode": _clone(self.mode.state_dict()), "grads": grads,
                "state": {k: _clone(v.state_dict()) for k, v in self._state.items()
                          if not isinstance(v, torch.nn.Module)}}

    def _again(self, kept: dict[str, Any], lost: set[str], start: float) -> None:
        """The sync failed: state back as before the step, the next epoch, then the step again."""
        for k, v in self._state.items():
            if k in kept["state"]:
                v.load_state_dict(kept["state"][k])
        self.mode.load_state_dict(kept["mode"])
        with torch.no_grad():
            for p, g in kept["grads"]:
                if p.grad is None:
                    p.grad = g.clone()
                else:
                    p.grad.copy_(g)
        self.counters.losses += 1
        self.counters.resyncs += 1
        log.warning("fastreduce: the sync at step %d failed (lost: %s); every survivor goes back to before it and "
                    "syncs again over the next epoch", self.step, ", ".join(sorted(lost)) or "a silent member")
        self._next_epoch(lost, "loss", start)

    def _vote(self, s: int) -> tuple[str, set[str]]:
        """The members' vote at step index ``s``: ``"go"``, ``"abort"`` (and the silent
        members) or ``"join"``: a new epoch, for joiners or for the members leaving
        (returned); the voter completing the count also sets the next poll's step."""
        epoch = self._epoch()
        key = _P + f"e{epoch.number}/s{s}"
        if self._call(self.store.add, key, 1) == epoch.world:
            every = 1 if not self._step_s else max(1, min(10_000, int(self.poll_s / self._step_s)))
            leavers = self._leavers()
            decision = "join" if self._joiners_waiting() or leavers else "go"
            self._call(self.store.compare_set, key + "/done", "", f"{decision} {s + every} {','.join(leavers)}")
            if self._polled is not None and self._polled[0] == epoch.number:  # every member read it: gone
                old = _P + f"e{epoch.number}/s{self._polled[1]}"
                for k in (old, old + "/done"):
                    self._call(self.store.delete_key, k)
        self._polled = (epoch.number, s)
        value, silent = self._await_decision(key + "/done")
        if value == "abort":
            return value, silent
        decision, at, leavers = value.split(" ")
        self._poll_at = int(at)
        return decision, set(filter(None, leavers.split(",")))

    def _leavers(self) -> list[str]:
        """The members that asked to leave (:meth:`leave`), looked for when the count of
        such requests changed since this member last looked."""
        asked = int(self._call(self.store.add, _P + "leaving", 0))
        if asked == self._leaves_seen:
            return []
        self._leaves_seen = asked
        return [m for m in self._epoch().members if self._call(self.store.check, [_P + f"leaving/{m}"])]

    def _joiners_waiting(self) -> bool:
        """Whether a process waits to join with this layout; one with another layout is
        refused here, so the members never leave their epoch for it."""
        epoch, mine = self._epoch(), None
        waiting = False
        for t in range(epoch.admitted + 1, int(self._call(self.store.add, _P + "tickets", 0)) + 1):
            if t in self._refused or self._call(self.store.check, [_P + f"admit/{t}"]):
                continue
            mine = mine or self._fingerprint()
            bad = self._differs(self._ticket(t)["print"], mine)
            if bad is None:
                waiting = True
            else:
                self._refused.add(t)
                self._call(self.store.set, _P + f"admit/{t}", f"refused: {bad}")
        return waiting

    def _await_decision(self, done: str) -> tuple[str, set[str]]:
        """The vote's decision; ``"abort"`` (and the silent members) where a member's
        heartbeat stops for ``$FASTREDUCE_LOST_AFTER_S`` first."""
        epoch = self._epoch()
        beat, window = faults._beat, faults.lost_after()
        if beat is not None and beat.default != id(faults._default_store()):
            beat = None  # an earlier epoch's
        slice_s = min(faults.heartbeat_interval(), 0.25) if beat is not None else 1.0
        # One request waits for the decision (a get on a connection of its own, no timeout
        # of its own to print every slice); meanwhile this thread watches the heartbeats
        # through the heartbeat's connection and, if a member goes silent, writes "abort".
        finished, box = self._caller.submit(self._vote_connection().get, done)
        seen: dict[int, tuple[int, float]] = {}
        silent: set[str] = set()
        while not finished.wait(slice_s):
            if beat is None or silent:
                continue
            now = time.monotonic()
            try:
                counts = beat.call(beat.counts)
                for r, c in enumerate(counts):
                    if r not in seen or seen[r][0] != c:
                        seen[r] = (c, now)
                silent = {epoch.members[r] for r, (_, since) in seen.items() if now - since >= window}
                if silent:
                    beat.call(self.store.compare_set, done, "", "abort")  # the waiting get returns it too
            except faults.TransportError as err:
                raise self._unreachable(err) from err
        if isinstance(box[0], BaseException):
            raise self._unreachable(box[0]) from box[0]
        value = box[0].decode()
        return value, silent if value == "abort" else set()

    def _lost_in(self, err: RuntimeError) -> set[str] | None:
        """The members a failed reduction lost, or ``None`` if it was no loss."""
        epoch = self._epoch()
        if isinstance(err, RankLostError):
            return {epoch.members[r] for r in err.ranks if r < epoch.world}
        if not faults.is_transport_failure(err):
            return None
        ranks, _, _ = faults.diagnose()
        return {epoch.members[r] for r in ranks}

    def _aborted_by(self, err: RuntimeError) -> set[str]:
        """The members whose loss failed this step's collective (the step then aborted for
        every member); ``err`` itself again where it is no loss."""
        lost = self._lost_in(err)
        if lost is None:
            raise err
        self._abort_step()
        return lost

    def _abort_step(self) -> None:
        """Wake the members waiting in this step's vote: the step is aborted."""
        epoch = self._epoch()
        self._call(self.store.compare_set, _P + f"e{epoch.number}/s{self.step}/done", "", "abort")

    # ------------------------------------------------------------------ epochs

    def _next_epoch(self, lost: set[str], why: str, start: float) -> None:
        """With the other survivors: the next epoch, without ``lost`` and with the
        joiners waiting; then its group, the state for the joiners and the mode
        (``start``: when the step that ends the epoch began, for :attr:`counters`)."""
        old = self._epoch()
        n = old.number + 1
        self._stash_mode(after_loss=why == "loss")
        beats = faults._default_store()  # the old epoch's: its members' heartbeats stay readable
        self._leave_group(abandon=why == "loss")
        alive = _P + f"e{n}/alive/"
        self._call(self.store.set, alive + self.member, json.dumps({"step": self.step, "healed": self._healed}))
        expected = [m for m in old.members if m not in lost]
        window = faults.lost_after() if why == "loss" else self.timeout_s
        deadline, last = time.monotonic() + window, time.monotonic() + self.wait_s
        counted: dict[str, int] = {}
        while True:
            present = [m for m in old.members if self._call(self.store.check, [alive + m])]
            missing = [m for m in expected if m not in present]
            if not missing:
                break
            if time.monotonic() > deadline:
                # A survivor still beating in the old epoch (slow to see the loss: a long
                # forward, a loaded host) is waited for, a window at a time, up to wait_s.
                if beats is None or time.monotonic() > last or not self._beating(beats, old, missing, counted):
                    break
                deadline = time.monotonic() + window
            time.sleep(0.005)
        mine, key = self._fingerprint(), _P + f"epoch/{n}"
        # The members holding the job's state at its latest step come first (rank 0 sends
        # it); the survivors one step behind (their reduction failed where these completed
        # it) and a joiner whose healing failed (its source lost) receive it. Only members
        # that held the state propose (a joiner's step count is not the job's yet).
        said = {m: json.loads(self._call(self.store.get, alive + m)) for m in present}
        healed = [m for m in present if said[m]["healed"]]
        top = max((said[m]["step"] for m in healed), default=self.step)
        behind = tuple(m for m in healed if said[m]["step"] != top)
        healed = [m for m in healed if m not in behind]
        unhealed = behind + tuple(m for m in present if not said[m]["healed"])
        deadline = time.monotonic() + self.wait_s
        while not self._healed:
            if self._wait(key, 0.25):
                break
            if time.monotonic() > deadline:
                raise MembershipError(f"fastreduce: no member holding the job's state formed epoch {n} within "
                                      f"{self.wait_s:g} s (the members were lost while this process joined)")
        while self._healed:  # below min_ranks: wait for joiners (unless another survivor proposed already)
            tickets = int(self._call(self.store.add, _P + "tickets", 0))
            checked = [(t, self._ticket(t)) for t in range(old.admitted + 1, tickets + 1)
                       if not self._call(self.store.check, [_P + f"admit/{t}"])]  # not refused already
            refusals = {t: self._differs(j["print"], mine) for t, j in checked}
            joiners = tuple(j["member"] for t, j in checked if refusals[t] is None)
            proposal = Epoch(n, tuple(healed) + unhealed + joiners, top, tickets, unhealed + joiners)
            if proposal.world >= self.min_ranks or self._call(self.store.check, [key]):
                break
            if time.monotonic() > deadline:
                raise RankLostError(sorted(old.members.index(m) for m in set(old.members) - set(present)),
                                    "Membership", f"{len(present)} member(s) are left, below min_ranks="
                                    f"{self.min_ranks}, and no process joined within {self.wait_s:g} s",
                                    "members were lost", old.world)
            time.sleep(0.05)
        epoch = self._propose(proposal, refusals) if self._healed else \
            Epoch.from_json(self._call(self.store.get, key))
        if self.member not in epoch.members:
            raise MembershipError(f"fastreduce: this member ({self.member}) was left out of epoch {epoch.number} "
                                  "(it registered after the others had formed it); start it again to rejoin")
        if self._healed and self.member not in epoch.joined and epoch.step != self.step:
            raise MembershipError(f"fastreduce: epoch {epoch.number} begins at step {epoch.step} but this member "
                                  f"committed {self.step}: the members disagree on the committed steps (a bug: "
                                  "please report it)")
        self.counters.joins += sum(m not in old.members for m in epoch.joined)  # not a survivor healed forward
        self._enter(epoch)
        self.counters.stalls.append((why, time.perf_counter() - start))

    def _beating(self, beats: Any, old: Epoch, members: list[str], counted: dict[str, int]) -> bool:
        """Whether a heartbeat of ``members`` in epoch ``old`` moved since last counted
        (``True`` the first time: counted now, to compare a window later)."""
        first, moved = not counted, False
        for m in members:
            n = int(self._call(beats.add, f"{faults._KEY}heartbeat/{old.members.index(m)}", 0))
            moved |= m in counted and counted[m] != n
            counted[m] = n
        return first or moved

    def _propose(self, proposal: Epoch, refusals: dict[int, str | None]) -> Epoch:
        """Write ``proposal`` unless another member's for that epoch was first; then admit
        the joiners of the epoch written and refuse the tickets it handled with another
        layout (the rest wait for a later epoch). Returns the epoch written."""
        key = _P + f"epoch/{proposal.number}"
        epoch = Epoch.from_json(self._call(self.store.compare_set, key, "", proposal.to_json()))
        for t, bad in refusals.items():
            if t > epoch.admitted:
                continue
            joined = bad is None and self._ticket(t)["member"] in epoch.joined
            if joined or bad is not None:
                self._call(self.store.set, _P + f"admit/{t}", str(epoch.number) if joined else f"refused: {bad}")
        return epoch

    def _enter(self, epoch: Epoch) -> None:
        """This epoch's process group; the state from rank 0 where it has joiners; the mode.
        A member lost meanwhile (the joiners' source, say): the next epoch, without it."""
        self.epoch = epoch
        try:
            self._set_up(epoch)
        except (RuntimeError, _Missing) as err:
            lost = err.members if isinstance(err, _Missing) else self._lost_in(err) if dist.is_initialized() else None
            if lost is None:
                raise
            self.counters.losses += 1
            log.warning("fastreduce: entering epoch %d failed (lost: %s); forming the next one", epoch.number,
                        ", ".join(sorted(lost)) or "a silent member")
            self._next_epoch(lost, "loss", time.perf_counter())
            return
        self._healed = True
        self._kept_mode = (None, False)
        self._poll_at, self._last_commit = epoch.step, None  # every epoch polls at its first step

    def _set_up(self, epoch: Epoch) -> None:
        own, per_rank = self._kept_mode
        self._rendezvous(epoch)
        store = dist.PrefixStore(_P + f"e{epoch.number}/pg/", self.store)
        dist.init_process_group(self.backend, store=store, rank=epoch.members.index(self.member),
                                world_size=epoch.world, timeout=timedelta(seconds=self.timeout_s))
        faults.start_heartbeat()  # this epoch's: the vote watches it
        joining = self.member in epoch.joined
        fresh = joining and not self._healed  # a new process (a survivor one step behind keeps its mode's state)
        if epoch.joined:  # a per-rank mode's state too (a fused mode's is rank 0's own residuals: not sent)
            got = self._sync_state(joining, own if per_rank else None)
            if fresh:  # rank 0's mode state came only if its mode keeps one per rank
                own, per_rank = got, got is not None
        if self._build is not None:
            with _quiet() if own is not None and per_rank else contextlib.nullcontext():
                self.mode = self._build()  # (it starts every rank from rank 0's: each loads its own next)
            _check_mode(self.mode)
            if own is not None and (per_rank or not fresh):
                self.mode.load_state_dict(own)  # a member's own state goes on; a joiner's: rank 0's
            if _kind(self.mode) == "gossip":  # the members' rounds may differ by one after a loss
                self.mode.set_round(epoch.step)

    def _rendezvous(self, epoch: Epoch) -> None:
        """Wait until every member of ``epoch`` is entering it, at most a few loss windows
        (they all read the epoch within milliseconds of each other): a member that died
        meanwhile is named here (:class:`_Missing`), not after the process group's own
        rendezvous waited its whole timeout for it."""
        key = _P + f"e{epoch.number}/ready"
        self._call(self.store.set, f"{key}/{self.member}", "1")
        self._call(self.store.add, key, 1)
        deadline = time.monotonic() + max(5.0, 4 * faults.lost_after())
        while int(self._call(self.store.add, key, 0)) < epoch.world:
            if time.monotonic() > deadline:
                raise _Missing({m for m in epoch.members if not self._call(self.store.check, [f"{key}/{m}"])})
            time.sleep(0.005)

    def _sync_state(self, joining: bool, mode_state: dict[str, Any] | None) -> dict[str, Any] | None:
        """Rank 0's whole state (and its mode's, ``mode_state``) to every rank, its tensors
        as one flat broadcast per dtype (:func:`~fastreduce.heal.broadcast_state`); a
        joiner loads it and gets the mode's state back, to load once its mode is built."""
        first = next((p for v in self._state.values() if isinstance(v, torch.nn.Module) for p in v.parameters()), None)
        device = torch.device("cpu") if dist.get_backend() == "gloo" or first is None else first.device
        mine = None
        if dist.get_rank() == 0:
            mine = {"step": self.step, "state": {k: v.state_dict() for k, v in self._state.items()}, "mode": mode_state}
        got = broadcast_state(mine, device)
        if not joining or dist.get_rank() == 0:
            return None
        for k, obj in self._state.items():
            obj.load_state_dict(got["state"][k])
        self.step = int(got["step"])
        return got["mode"]

    def _stash_mode(self, after_loss: bool) -> None:
        """Keep the mode's state until the next epoch is entered (a failed entry must not
        lose it), then take the mode off: after a loss without a collective (gossip's
        exchanges in flight are dropped), else as it saves it (they are completed)."""
        if self.mode is None:
            return
        kind = _kind(self.mode)
        save = self.mode.local_state_dict if after_loss and kind == "gossip" else \
            getattr(self.mode, "state_dict", None)
        self._kept_mode = (_clone(save()) if save is not None else None, kind in ("local", "gossip"))
        self._close_mode(drain=not after_loss)

    def _close_mode(self, drain: bool = True) -> None:
        if _kind(self.mode) == "gossip":
            self.mode.close(drain=drain)
        elif (close := getattr(self.mode, "close", None) or getattr(self.mode, "remove", None)) is not None:
            close()
        self.mode = None

    def _leave_group(self, abandon: bool) -> None:
        if dist.is_initialized():
            if abandon:  # a collective may still wait on a lost peer: never join its thread
                faults._abandon_groups()
            dist.destroy_process_group()

    def close(self) -> None:
        """Leave: take the mode's hooks off and end this epoch's group."""
        self._close_mode()
        if dist.is_initialized():
            dist.destroy_process_group()

    # ------------------------------------------------------------------ the coordinator

    def _call(self, fn: Callable[..., Any], *args: Any, seconds: float | None = None) -> Any:
        """A request to the coordinator, answered within ``seconds`` (default: twice the loss
        window, at least 5 s) or :class:`MembershipError` (a TCPStore request on a silent
        link would block for minutes)."""
        try:
            return self._caller.call(fn, *args, seconds=seconds or max(5.0, 2 * faults.lost_after()))
        except Exception as err:  # noqa: BLE001 - the store raises several kinds
            raise self._unreachable(err) from err

    def _wait(self, key: str, seconds: float) -> bool:
        """Whether ``key`` is set within ``seconds`` (``False``: not yet)."""
        try:
            self._caller.call(self.store.wait, [key], timedelta(seconds=seconds),
                              seconds=seconds + max(5.0, 2 * faults.lost_after()))
            return True
        except Exception as err:  # noqa: BLE001 - the store's timeout (not yet), or it is gone
            if isinstance(err, faults.TransportError) or "timeout" not in str(err).lower():
                raise self._unreachable(err) from err
            return False

    def _vote_connection(self) -> Any:
        """A connection of its own for the vote's waiting get (the other requests go on
        the first while it waits), with the epoch's timeout."""
        if self._waiter is None:
            try:
                self._waiter = self.store.clone()
            except Exception:  # noqa: BLE001 - a store that cannot clone (an older torch): a second client
                self._waiter = connect(self.where, self.timeout_s) if ":" in self.where else self.store
            self._waiter.set_timeout(timedelta(seconds=self.timeout_s))
        return self._waiter

    def _await_key(self, key: str, timeout_s: float, what: str) -> str:
        if not self._wait(key, timeout_s):
            raise MembershipError(f"fastreduce: no {what} within {timeout_s:g} s: the members did not reach "
                                  "a step boundary, or the job is not running (wait_s= waits longer)")
        return self._call(self.store.get, key).decode()

    def _unreachable(self, err: BaseException) -> MembershipError:
        faults._abandon_groups()  # this member ends here: never join a thread stuck on a silent peer at exit
        return MembershipError(f"fastreduce: the coordinator ({self.where}) stopped answering ({type(err).__name__}: "
                               f"{err}): it is the job's single point; this member cannot go on. Restart the "
                               "coordinator and the job from the last checkpoint")


class _Missing(Exception):
    """Members of an epoch that never came to enter it (lost as it formed)."""

    def __init__(self, members: set[str]):
        super().__init__(", ".join(sorted(members)))
        self.members = members


def _kind(mode: Any) -> str:
    """How :meth:`Membership.commit` runs ``mode``: ``local`` (LocalSGD, DiLoCo: their
    collectives in the optimizer's step), ``gossip`` (steps and exchanges inside forward and
    backward), ``reduce`` (the fused and overlapped reducers), else ``other``."""
    if hasattr(mode, "communicates_at"):
        return "local"
    if hasattr(mode, "local_state_dict"):
        return "gossip"
    return "reduce" if hasattr(mode, "reduce") else "other"


def _check_mode(mode: Any) -> None:
    """Refuse, on every member alike, a mode Membership cannot keep training."""
    if _kind(mode) == "other":
        raise TypeError(f"fastreduce.Membership runs the fused, overlapped, gossip, LocalSGD and DiLoCo modes so far, "
                        f"not {type(mode).__name__} (ZeRO's shards would be lost with their rank: not yet)")
    if getattr(mode, "fragment_delay", 0):
        raise ValueError("DiLoCo's fragment_delay > 0 (a sync in flight across inner steps) is not supported "
                         "under fastreduce.Membership yet: use fragment_delay=0")
    if _kind(mode) == "gossip" and getattr(mode, "_quant", None) is not None:
        raise ValueError("gossip with a quantized wire keeps a public copy of each neighbour's parameters, which a "
                         "new membership's topology would not match: under fastreduce.Membership use a float "
                         "wire_dtype (bfloat16 halves the bytes)")


def _clone(state: Any) -> Any:
    """A deep copy of a ``state_dict``'s tensors (torch's optimizers return their own)."""
    if isinstance(state, torch.Tensor):
        return state.clone()
    if isinstance(state, dict):
        return {k: _clone(v) for k, v in state.items()}
    if isinstance(state, list):
        return [_clone(v) for v in state]
    return state


@contextlib.contextmanager
def _quiet() -> Any:
    """Without the modes' warning that the ranks' parameters differed (they do, in a
    per-rank mode rebuilt mid-run: each rank loads its own right after)."""
    logger = logging.getLogger("fastreduce")
    level = logger.level
    logger.setLevel(logging.ERROR)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)
            yield
    finally:
        logger.setLevel(level)
