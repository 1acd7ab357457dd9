"""Members come and go; training goes on (docs/design.md, invariant 11).

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
ZeRO (:class:`~fastreduce.ZeroOptimizer` with ``redundant=True``: each shard also kept and
stepped on the next rank) votes at every step, after its reduce-scatter and before any
shard steps: a loss before the vote completes discards the step; after it, the step stands
(every shard's averaged gradients were on two members), and the next epoch joins the
survivors' shards and reshards them over the new world (:mod:`.modes.zero_mirror`); two
neighbouring ranks lost at once lose a shard: :class:`MembershipError`.
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

import json
import logging
import os
import socket
import time
import uuid
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping

import torch
import torch.distributed as dist

import fastreduce.faults as faults
import fastreduce.faults_errors as faults_errors
import fastreduce.faults_heartbeat as faults_heartbeat

from .coordinator import MEMBERS_PREFIX, COORDINATOR_ENV, Epoch, MembershipError, epoch_key, connect, serve
from .commits import StepCommits
from .epochs import EpochChanges
from .faults import RankLostError
from .lifecycle import shutdown
from .modes.contract import commit_style
from .presence import EXIT_CHECK_S, Pulse, Watch
from .version import __version__

__all__ = ["COORDINATOR_ENV", "Epoch", "Membership", "MembershipError", "connect", "serve"]

log = logging.getLogger(__name__)

_HEARTBEAT_S = 0.25  # a member's heartbeat period unless $FASTREDUCE_HEARTBEAT_S is set


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



class Membership(StepCommits, EpochChanges):
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
        self.member = member or f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:6]}"
        self._pulse = Pulse(self.store, self.member, self._call)  # alive to the others while it has no epoch heartbeat
        self._waiter: Any = None  # a connection for the vote's waiting get
        self.world_size, self.min_ranks, self.backend, self.tag = world_size, min_ranks, backend, tag
        self.timeout_s, self.wait_s, self.poll_s = timeout_s, wait_s, poll_s
        self._poll_at = 0  # the step index of the members' next poll (agreed at the last one)
        self._polled: tuple[int, int] | None = None  # (epoch, step) of this member's last poll
        self._leaves_seen = 0  # requests to leave counted when this member last looked
        self.left = False  # this member left the job (leave())
        self._step_s: float | None = None  # a running mean of the seconds between commits
        self._last_commit: float | None = None
        self.epoch: Epoch | None = None
        self.step = 0  # committed steps
        self.mode: Any = None  # the mode object of this epoch
        self.counters = _Counters()
        self._state: dict[str, Any] = {}
        self._build: Callable[[], Any] | None = None
        self._refused: set[int] = set()  # joiner tickets refused here
        self._points = {}  # fault points' callables (at())
        self._healed = False  # whether this process holds the job's state (a member's, or a joiner's once sent)
        self._kept_mode: tuple[Any, str] = (None, "")  # (the mode's state, its commit_style)

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
        self._pulse.up()  # from the ticket on: admitted, it is watched before its group exists
        ticket = self._call(self.store.add, MEMBERS_PREFIX + "tickets", 1)
        self._call(self.store.set, MEMBERS_PREFIX + f"ticket/{ticket}", json.dumps({"member": self.member, "print": mine}))
        if ticket == self.world_size:  # the last of the first members lays out epoch 0
            checked = [(t, self._ticket(t)) for t in range(1, ticket + 1)]
            refusals = {t: self._differs(j["print"], mine) for t, j in checked}
            members = tuple(j["member"] for t, j in checked if refusals[t] is None)
            self._propose(Epoch(0, members, 0, ticket, members), refusals)
        answer = self._await_key(MEMBERS_PREFIX + f"admit/{ticket}", self.wait_s, "admission")
        if answer.startswith("refused"):
            raise MembershipError(f"fastreduce: this process was refused as a joiner: {answer[len('refused: '):]}")
        epoch = Epoch.from_json(self._call(self.store.get, epoch_key(int(answer))))
        self._founder = epoch.number == 0
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
        return json.loads(self._await_key(MEMBERS_PREFIX + f"ticket/{t}", self.wait_s, f"joiner ticket {t}"))

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

        ZeRO (:class:`~fastreduce.ZeroOptimizer` with ``redundant=True``, the mode and the
        optimizer in one): ``step`` calls the mode's ``step()``
        (``m.commit(m.mode.step)``), and clipping goes inside it too, as it is collective
        (``m.commit(lambda: (m.mode.clip_grad_norm_(1.0), m.mode.step()))``): the vote
        runs between the reduce-scatter (and clipping) and the shards' step; ``False``: a
        member was lost before it, nothing stepped. The all-gather is waited for here.

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
        if self.mode is not None and self.mode.under_join:  # each member alone, before any collective
            raise RuntimeError("fastreduce.Membership does not run a mode under torch's Join (uneven inputs): the "
                               "members re-shard the data at every epoch, so each has a batch at every step; a "
                               "member out of data calls membership.leave() and is out at the next poll")
        start = time.perf_counter()  # a stall counts from here: detection, the new epoch, healing
        kind, s = commit_style(self.mode), self.step
        if kind == "local":
            return self._commit_local(step, start)
        lost = self._reach_first_step()  # (a new epoch's first step: every member alive and here)
        if lost is not None:
            return self._lost_step(lost, start)
        if kind == "zero":
            return self._commit_zero(step, start)
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
        self._call(self.store.set, MEMBERS_PREFIX + f"leaving/{self.member}", "1")
        self._call(self.store.add, MEMBERS_PREFIX + "leaving", 1)

    def _change(self, leavers: set[str], start: float) -> None:
        """A poll decided a new epoch: joiners admitted, ``leavers`` gone (this one too?)."""
        self.counters.leaves += len(leavers)
        if self.member not in leavers:
            self._next_epoch(leavers, "leave" if leavers else "join", start)
            return
        self._stash_mode(after_loss=False)  # as the others do (gossip completes its exchanges with them)
        self._leave_group(abandon=False)
        self._pulse.down()
        self._kept_mode = (None, "")
        self.left = True
        log.info("fastreduce: member %s left the job at step %d", self.member, self.step)

    def _timed(self) -> None:
        """The running mean of the seconds between commits (the next poll's distance)."""
        now = time.perf_counter()
        if self._last_commit is not None:
            gap = now - self._last_commit
            self._step_s = gap if self._step_s is None else 0.8 * self._step_s + 0.2 * gap
        self._last_commit = now

    def _vote(self, s: int) -> tuple[str, set[str]]:
        """The members' vote at step index ``s``: ``"go"``, ``"abort"`` (and the silent
        members) or ``"join"``: a new epoch, for joiners or for the members leaving
        (returned); the voter completing the count also sets the next poll's step."""
        epoch = self._epoch()
        key = MEMBERS_PREFIX + f"e{epoch.number}/s{s}"
        value = None
        if self._call(self.store.add, key, 1) == epoch.world:
            if s >= self._poll_at:  # a poll: joiners, leavers, the next poll's step
                every = 1 if not self._step_s else max(1, min(10_000, int(self.poll_s / self._step_s)))
                leavers = self._leavers()
                decision = "join" if self._joiners_waiting() or leavers else "go"
                mine = f"{decision} {s + every} {','.join(leavers)}"
            else:  # ZeRO's vote between polls: go on
                mine = f"go {self._poll_at} "
            written = self._call(self.store.compare_set, key + "/done", "", mine)
            value = mine if (written.decode() if isinstance(written, bytes) else written) == mine else None
            if self._polled is not None and self._polled[0] == epoch.number:  # every member read it: gone
                old = MEMBERS_PREFIX + f"e{epoch.number}/s{self._polled[1]}"
                for k in (old, old + "/done"):  # off the step's path (the next request queues behind)
                    self._caller.submit(self.store.delete_key, k)
        self._polled = (epoch.number, s)
        silent: set[str] = set()
        if value is None:  # (the completing voter knows it: its own was written)
            value, silent = self._await_decision(key + "/done")
        self._at("voted", s)
        if value == "abort":
            return value, silent
        decision, at, leavers = value.split(" ")
        self._poll_at = int(at)
        return decision, set(filter(None, leavers.split(",")))

    def _leavers(self) -> list[str]:
        """The members that asked to leave (:meth:`leave`), looked for when the count of
        such requests changed since this member last looked."""
        asked = int(self._call(self.store.add, MEMBERS_PREFIX + "leaving", 0))
        if asked == self._leaves_seen:
            return []
        self._leaves_seen = asked
        return [m for m in self._epoch().members if self._call(self.store.check, [MEMBERS_PREFIX + f"leaving/{m}"])]

    def _joiners_waiting(self) -> bool:
        """Whether a process waits to join with this layout; one with another layout is
        refused here, so the members never leave their epoch for it."""
        epoch, mine = self._epoch(), None
        waiting = False
        for t in range(epoch.admitted + 1, int(self._call(self.store.add, MEMBERS_PREFIX + "tickets", 0)) + 1):
            if t in self._refused or self._call(self.store.check, [MEMBERS_PREFIX + f"admit/{t}"]):
                continue
            mine = mine or self._fingerprint()
            bad = self._differs(self._ticket(t)["print"], mine)
            if bad is None:
                waiting = True
            else:
                self._refused.add(t)
                self._call(self.store.set, MEMBERS_PREFIX + f"admit/{t}", f"refused: {bad}")
        return waiting

    def _await_decision(self, done: str) -> tuple[str, set[str]]:
        """The vote's decision; ``"abort"`` (and the silent members) where a member's
        heartbeat stops for ``$FASTREDUCE_LOST_AFTER_S`` first, or its process ran on this
        host and has exited (looked at every :data:`~fastreduce.presence.EXIT_CHECK_S`: a
        member that died after the step's collectives, before its vote)."""
        epoch = self._epoch()
        beat, window = faults_heartbeat.heartbeat_now(), faults.lost_after()
        if beat is not None and not beat.current():
            beat = None  # an earlier epoch's
        every = min(faults.heartbeat_interval(), 0.25) if beat is not None else 1.0
        slice_s = EXIT_CHECK_S if beat is not None else every
        # One request waits for the decision (a get on a connection of its own, no timeout
        # of its own to print every slice); meanwhile this thread watches the heartbeats
        # through the heartbeat's connection and, if a member goes silent, writes "abort".
        finished, box = self._caller.submit(self._vote_connection().get, done)
        seen: dict[int, tuple[int, float]] = {}
        records: dict[int, str] = {}
        silent: set[str] = set()
        read_at = 0.0
        while not finished.wait(slice_s):
            if beat is None or silent:
                continue
            try:  # the watched members' (faults_heartbeat.WATCHED_SUCCESSORS): a member lost elsewhere
                # is seen by its own watchers, whose "abort" wakes this get
                if time.monotonic() - read_at >= every:
                    read_at = time.monotonic()
                    silent = {epoch.members[r] for r in beat.silent(seen, window, records)}
                silent = silent or {epoch.members[r] for r in beat.exited(sorted(seen), records)}
                if silent:
                    beat.call(self.store.compare_set, done, "", "abort")  # the waiting get returns it too
            except faults.TransportError as err:
                raise self._unreachable(err) from err
        if isinstance(box[0], BaseException):
            raise self._unreachable(box[0]) from box[0]
        value = box[0].decode()
        return value, silent if value == "abort" else set()

    def _lost_in(self, err: RuntimeError) -> set[str] | None:
        """The members a failed collective lost, or ``None`` if it was no loss. A member
        whose process ran on this host and has exited is named at once (a joiner that died
        as it was healed), without the diagnosis's window."""
        epoch = self._epoch()
        if isinstance(err, RankLostError):
            return {epoch.members[r] for r in err.ranks if r < epoch.world}
        if not faults_errors.is_transport_failure(err):
            return None
        exited = Watch(self.store, self._call, [m for m in epoch.members if m != self.member]).exited()
        if exited:
            return exited
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
        self._call(self.store.compare_set, MEMBERS_PREFIX + f"e{epoch.number}/s{self.step}/done", "", "abort")

    def close(self) -> None:
        """Leave: take the mode's hooks off, stop fastreduce's background threads
        (:func:`fastreduce.shutdown`: the heartbeat, the coordinator's requests, the
        transport's workers) and then end this epoch's group."""
        self._close_mode()
        self._pulse.stop()
        shutdown(rest=False)  # this member leaves: a member still counting on it sees it go
        if dist.is_initialized():
            dist.destroy_process_group()
