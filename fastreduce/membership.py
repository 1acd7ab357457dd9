"""Members come and go; training goes on (docs/design.md, invariant 11).

A job's processes (its *members*) agree through a **coordinator** on numbered **epochs**:
who is in, in rank order, and at which committed step the epoch began. The coordinator
is a c10d ``TCPStore`` that no member hosts (``fastreduce coordinator --port P``) or an
etcd cluster (``etcd://h1:2379,h2:2379,...``: no single point); a member that cannot reach
it raises :class:`MembershipError` within the store's timeout, and a network partition
never splits the job in two, as only the side that reaches it can form the next epoch.
Each epoch gets a process group of its own (the default group, made again on a fresh store
prefix), so every fastreduce mode, built over the default group, runs in it unchanged; the
mode is rebuilt at each new epoch from the builder the members gave (each survivor keeping
its own mode state: error-feedback residuals).

Per step, :meth:`Membership.commit` runs the mode's reduction and, where it succeeded,
the optimizer's step: no request to the coordinator on the way. A step is still **committed
on every member or on none**, decided when the epoch ends by the members that reach the
coordinator: a member is lost, the survivors' reductions fail (some may have completed it,
with every member's gradients in it, and stepped), and each registers for the next epoch
with its committed steps. The members holding the most (at most one more) send their state
to the others as to a joiner; where none completed it, the step is discarded on every
member (the caller steps only on ``True``; at most one step per loss). After the last
step, :meth:`Membership.close` settles it so (:mod:`.ending`).

The protocol in full (losses and the window a survivor waits, the polls, admission and
what a joiner is refused for, leaving, the commit in each mode's style): docs/faults.md and
:mod:`fastreduce.commits`.

The data: :attr:`Membership.rank` and :attr:`Membership.world` change with the epoch (a sampler
re-shards from them at each :attr:`Membership.epoch`); a discarded step's batches are skipped.
"""

from __future__ import annotations

import os
import socket
import uuid
from typing import Any, Callable, Mapping

import torch.distributed as dist

import fastreduce.faults_heartbeat as faults_heartbeat

from .admission import Admission
from .commits import StepCommits
from .coordinator import COORDINATOR_ENV, CoordinatorLink, Epoch, MembershipError, connect, default_poll_s, serve
from .ending import Ending
from .epochs import EpochChanges
from .job_checkpoints import JobCheckpoints
from .lifecycle import shutdown
from .member import Member, MembershipSettings
from .presence import Pulse
from .status import read_status
from .votes import Votes

__all__ = ["COORDINATOR_ENV", "Epoch", "JobCheckpoints", "Membership", "MembershipError", "MembershipSettings", "connect",
           "serve"]


class Membership:
    """This process's membership of a fault-tolerant job (see the module doc): a facade over
    its parts, each owning its own bookkeeping: the link to the coordinator
    (:class:`~fastreduce.coordinator.CoordinatorLink`), the tickets (:class:`~.admission.Admission`),
    the vote (:class:`~.votes.Votes`), the epoch changes (:class:`~.epochs.EpochChanges`), the
    commits (:class:`~.commits.StepCommits`) and its end (:class:`~.ending.Ending`), over one
    :class:`~.member.Member`.

    Args:
        coordinator: ``"host:port"`` of the coordinator, or a store; default
            ``$FASTREDUCE_COORDINATOR``.
        world_size: the members the job starts with (epoch 0 forms when they have all
            joined); later joiners grow it.
        min_ranks: below this many members the survivors wait up to ``wait_s`` for
            joiners, then raise :class:`~fastreduce.RankLostError` (:class:`MembershipError`
            where members left rather than were lost).
        backend: each epoch's process group backend (``"gloo"``; ``"nccl"``/``"hccl"``
            where each member has its own device).
        tag: the mode and its settings, in words (e.g. ``"fused bf16"``): a joiner with
            another tag is refused.
        timeout_s: each epoch's process-group timeout.
        wait_s: how long a joiner waits for admission, and survivors below
            ``min_ranks`` wait for joiners.
        poll_s: about how often the members look for joiners (a vote through the
            coordinator every so many steps; the per-step modes' only request to it).
            A joiner waits up to this long for admission, plus a step. Default 0.2 s; 1 s on
            etcd, where each request is a quorum's write or read.
        member: this member's name at the coordinator (default: host, pid and a random tag).
        checkpoints: a :class:`~.job_checkpoints.JobCheckpoints`: the job saved as it trains,
            no collective, and a new job started from the newest complete save.
        evict_slower_than, evict_for_s: a member working ``evict_slower_than`` times the
            members' median per step for ``evict_for_s`` seconds is asked to leave (out at
            the next poll; :mod:`fastreduce.status`). ``None`` (the default): never.
        spare: a warm spare: :meth:`join` returns once a member is missing (at a loss: in the
            survivors' next epoch, with the state); while the job is whole it waits, unbounded.

    The settings are kept as one :class:`~.member.MembershipSettings` (:attr:`settings`).

    Use::

        m = Membership("10.0.0.1:29400", world_size=4, min_ranks=2, tag="fused bf16")
        m.join({"model": model, "optimizer": opt},
               lambda: fastreduce.FusedReducer(model, wire_dtype=torch.bfloat16))
        while m.step < steps and not m.left:  # (left: its leave(), or evicted as a straggler)
            loss_fn(model(*batch_for(m.rank, m.world, m.step))).backward()
            m.commit(opt.step)    # the mode's reduce(), the vote, the step if committed
            opt.zero_grad()
    """

    def __init__(self, coordinator: str | dist.Store | None = None, *, world_size: int, min_ranks: int = 1,
                 backend: str = "gloo", tag: str = "", timeout_s: float = 600.0, wait_s: float = 60.0,
                 poll_s: float | None = None, member: str | None = None, checkpoints: JobCheckpoints | None = None,
                 evict_slower_than: float | None = None, evict_for_s: float = 30.0, spare: bool = False):
        coordinator = coordinator if coordinator is not None else os.environ.get(COORDINATOR_ENV)
        poll_s = poll_s if poll_s is not None else default_poll_s(coordinator)
        self.settings = MembershipSettings(world_size, min_ranks, backend, tag, timeout_s, wait_s, poll_s,
                                           checkpoints=checkpoints, evict_slower_than=evict_slower_than,
                                           evict_for_s=evict_for_s, spare=spare)
        if coordinator is None:
            raise ValueError(f"no coordinator: pass coordinator='host:port' or set ${COORDINATOR_ENV} "
                             "(start one with `fastreduce coordinator --port PORT`)")
        faults_heartbeat.default_interval(self.settings.heartbeat_s)
        self.link = CoordinatorLink(coordinator, timeout_s)
        self.me = Member(member or f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:6]}", self.settings)
        pulse = Pulse(self.link.store, self.me.name, self.link.call)  # alive to the others while it has no heartbeat
        self.admission = Admission(self.me, self.link, pulse)
        self.votes = Votes(self.me, self.link, self.admission)
        self.epochs = EpochChanges(self.me, self.link, self.admission, self.votes, pulse)
        self.commits = StepCommits(self.me, self.votes, self.epochs)
        self.ending = Ending(self.me, self.link, self.epochs)

    # ------------------------------------------------------------------ reading

    member = property(lambda self: self.me.name, doc="This member's name at the coordinator.")
    epoch = property(lambda self: self.me.epoch, doc="The epoch this member is in (``None`` before join()).")
    step = property(lambda self: self.me.step, doc="The steps committed.")
    mode = property(lambda self: self.me.put_away if self.me.left else self.me.mode, doc="The mode built for "
                    "this epoch; once this member left (:attr:`left`), the last one, put away (closed).")
    counters = property(lambda self: self.me.counters, doc="Losses (and whom each named), joins, leaves, discarded steps, stalls.")
    left = property(lambda self: self.me.left, doc="Whether this member left the job (leave(), or asked to by the "
                    "straggler policy, ``evict_slower_than``; a spare: the job ended without needing it, "
                    ":attr:`epoch` ``None``; left out and back, it found the job over): its training loop ends there.")
    rank = property(lambda self: self.me.rank, doc="This member's rank in the current epoch.")
    world = property(lambda self: self.me.current().world, doc="The current epoch's number of members.")

    def status(self) -> dict[str, Any]:
        """The job as the coordinator sees it (:func:`fastreduce.status.read_status`: the epoch,
        each member's step, seconds per step, waiting and working, the slowest named)."""
        return read_status(self.link.store)

    # ------------------------------------------------------------------ joining

    def join(self, state: Mapping[str, Any], build: Callable[[], Any] | None = None, *, start_step: int = 0) -> Epoch:
        """Enter the job: epoch 0 with the first ``world_size`` processes, else admitted
        at the members' next step and given their whole state (``state``: name -> object
        with ``state_dict``/``load_state_dict``, e.g. the model and its optimizer; the
        same names on every member). ``build()`` makes the mode over the current default
        group (again at each new epoch). ``start_step``: the committed steps a job resumed
        from a checkpoint starts at (every first member the same, else refused; a joiner's
        is the members'; with ``checkpoints``, its newest complete save's). Returns the epoch joined
        (a spare the job ended without needing: the job's last, not entered, :attr:`left` set)."""
        if start_step < 0:
            raise ValueError(f"start_step must be >= 0 (the committed steps of the checkpoint resumed), got {start_step}")
        saves = self.settings.checkpoints
        found = saves.newest(start_step) if saves is not None else None
        start_step = found.step if found is not None else start_step
        self.me.state, self.me.build = dict(state), build
        epoch = self.admission.admitted(start_step, resumed=found is not None)
        if self.me.left:  # a spare, and the job ended without needing it: no epoch entered
            return epoch
        self.me.founder = epoch.number == 0
        if self.me.founder:
            self.me.step = epoch.step
            if found is not None:  # each first member holds its own part of the job: none is sent the state
                saves.resume(self.me, found, epoch, self.admission)
        return self.epochs.first_entry(epoch)

    def at(self, point: str, fn: Callable[[Any], Any]) -> None:
        """Call ``fn`` at ``point`` of this member's life (one of
        :data:`~fastreduce.member.FAULT_POINTS`, which says what ``fn`` is given there), every
        time it passes there: for fault drills and chaos runs (a process that kills itself
        there, or stalls), the one way in: nothing of a member is replaced from outside."""
        self.me.at(point, fn)

    # ------------------------------------------------------------------ every step

    def commit(self, step: Callable[[], Any]) -> bool:
        """Commit this step on every member or on none; ``True`` when committed.

        ``step``, in the style the mode declares (:mod:`.commits`: how each commits, and
        what a loss does to it):

        * the fused and overlapped modes, LocalSGD and DiLoCo: the optimizer's step
          (``m.commit(opt.step)``), run once the reduction (a sync) succeeded, so that a
          joiner admitted at this step takes the state after it;
        * ZeRO (:class:`~fastreduce.ZeroOptimizer` with ``redundant=True``, the mode and the
          optimizer in one): the mode's ``step()``, clipping inside it as it is collective
          (``m.commit(lambda: (m.mode.clip_grad_norm_(1.0), m.mode.step()))``);
        * gossip (:class:`~fastreduce.DecentralizedDataParallel`): the step's forward and
          backward through :attr:`mode` (``m.commit(lambda: loss_fn(m.mode(x), y).backward())``).

        ``False``: a member was lost and no survivor completed this step, so every member
        discarded it (LocalSGD and DiLoCo run a failed sync again over the survivors
        instead: ``counters.resyncs``); ``True`` after a loss: another survivor completed it
        and this member took its state. Either way the next epoch is formed already: read
        :attr:`rank` and :attr:`world` again. ``False`` also where the others found this
        member silent (its process stopped, its host cut off) and went on without it: back,
        it joined the job again, its state and :attr:`step` theirs (``counters.rejoins``;
        job over: :attr:`left`)."""
        if not callable(step):
            raise TypeError(f"commit() takes the optimizer's step (membership.commit(optimizer.step)), got "
                            f"{type(step).__name__}")
        if self.me.mode is not None and self.me.mode.under_join:  # each member alone, before any collective
            raise RuntimeError("fastreduce.Membership does not run a mode under torch's Join (uneven inputs): the "
                               "members re-shard the data at every epoch, so each has a batch at every step; a "
                               "member out of data calls membership.leave() and is out at the next poll")
        return self.commits.commit(step)

    def leave(self) -> None:
        """Leave the job at the members' next poll (LocalSGD, DiLoCo: their next sync),
        with no loss: :meth:`commit` runs the steps as before until then, and
        :attr:`left` turns ``True`` once this member is out (its group and mode closed).
        The others go on without it, nothing discarded and no loss window waited. For a
        member told it will be preempted (a spot instance's notice) or out of data."""
        self.me.current()
        self.votes.ask_to_leave()

    def confirm(self) -> None:
        """Confirm this member's committed steps as the job's, now: after its last step and
        before it saves anything as the job's result (a trainer's last step does it). Waits
        for every other member of its epoch to end too, go on or stop; then
        :class:`MembershipError` where its steps are not the job's (:mod:`.ending`)."""
        self.ending.confirm("ended its training")

    def close(self) -> None:
        """Leave: end its heartbeat (a member still counting on it sees it go), confirm its
        steps as :meth:`confirm` does, take the mode's hooks off, stop fastreduce's threads
        (:func:`fastreduce.shutdown`) and end this epoch's group; then :class:`MembershipError`
        where its steps were not confirmed."""
        ending = self.me.epoch is not None and not self.me.left and not self.me.failed
        try:
            unconfirmed = self.ending.unconfirmed("closed", leaving=True) if ending else ""
        finally:
            if self.me.mode is not None:
                self.epochs.close_mode()
            self.admission.closed()  # (every member closed: a spare still waiting stops)
            self.epochs.pulse.stop(timeout=min(self.link.stop_s(), self.link.deadline()))  # (a beat on a silent link)
            shutdown(self.link.stop_s(), rest=False)  # this member leaves: a member still counting on it sees it go
            if dist.is_initialized():
                dist.destroy_process_group()
        if unconfirmed:
            raise MembershipError(unconfirmed)
