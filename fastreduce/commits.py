"""How a :class:`~fastreduce.Membership` commits a step in each style a mode declares
(:func:`.modes.contract.commit_style`): a reduction (or gossip's forward and backward),
then the vote at a poll; LocalSGD's and DiLoCo's syncs, kept and run again over the
survivors when one fails; ZeRO's vote between its reduce-scatter and its shards' step;
and a step lost to a member's loss.

LocalSGD and DiLoCo, whose collectives run in the optimizer's step, vote at every sync
instead of at the polls: a sync that fails on any member is put back and run again on every survivor.
ZeRO (:class:`~fastreduce.ZeroOptimizer` with ``redundant=True``: each shard also kept and
stepped on the next rank) votes at every step, after its reduce-scatter and before any
shard steps: a loss before the vote completes discards the step; after it, the step stands
(every shard's averaged gradients were on two members), and the next epoch joins the
survivors' shards and reshards them over the new world (:mod:`.modes.zero_mirror`); two
neighbouring ranks lost at once lose a shard: :class:`~fastreduce.MembershipError`.
Gossip, which steps and exchanges inside forward and backward, gives ``commit()`` them (a
closure): at a loss each survivor drops the exchanges in flight and keeps its own
parameters and optimizer state (a gossip rank's are its own anyway), and the ring or
graph is rebuilt over the survivors at one round they agree on.
"""

from __future__ import annotations

import logging
import time
from typing import Any, Callable

import torch

from .epochs import EpochChanges, kept_state
from .member import Member
from .modes.contract import commit_style
from .nested import clone_state
from .votes import Votes

__all__ = ["StepCommits"]

log = logging.getLogger("fastreduce.membership")


class StepCommits:
    """How one member commits its steps (:meth:`fastreduce.Membership.commit`): it changes
    ``me``, votes through ``votes`` and goes to the next epoch through ``epochs``."""

    def __init__(self, me: Member, votes: Votes, epochs: EpochChanges):
        self.me, self.votes, self.epochs = me, votes, epochs

    def commit(self, step: Callable[[], Any]) -> bool:
        """See :meth:`fastreduce.Membership.commit`."""
        me = self.me
        start = time.perf_counter()  # a stall counts from here: detection, the new epoch, healing
        kind, s = commit_style(me.mode), me.step
        if kind == "local":
            return self._commit_local(step, start)
        lost = self.epochs.reach_first_step()  # (a new epoch's first step: every member alive and here)
        if lost is not None:
            return self._lost_step(lost, start)
        if kind == "zero":
            return self._commit_zero(step, start)
        try:
            if kind == "gossip":
                step()  # the step's forward and backward: the mode steps and exchanges inside them
            elif kind == "reduce":
                me.mode.reduce()
        except RuntimeError as err:
            return self._lost_step(self.votes.aborted_by(err), start)
        me.step += 1
        if kind != "gossip":
            step()
        self._save()
        if s >= self.votes.poll_at:
            decision, who = self.votes.vote(s)
            if decision == "abort":  # a member went silent after this step's reduction: the step stands
                me.counters.lose(who)
                self.epochs.next_epoch(who, "loss", start)
            elif decision == "join":
                self._change(who, start)
        self.votes.timed()
        return True

    def _change(self, leavers: set[str], start: float) -> None:
        """A poll decided a new epoch: joiners admitted, ``leavers`` gone (this one too?)."""
        self.me.counters.leaves += len(leavers)
        if self.me.name not in leavers:
            self.epochs.next_epoch(leavers, "leave" if leavers else "join", start)
            return
        self.epochs.depart()
        log.info("fastreduce: member %s left the job at step %d", self.me.name, self.me.step)

    def _lost_step(self, lost: set[str], start: float) -> bool:
        """This step's reduction failed: the next epoch, at the step the survivors reached.
        ``True`` where another survivor completed this step (this member took its state)."""
        before = self.me.step
        self.me.counters.lose(lost)
        log.warning("fastreduce: step %d failed (lost: %s); forming the next epoch", before,
                    ", ".join(sorted(lost)) or "a silent member")
        self.epochs.next_epoch(lost, "loss", start)
        if self.me.step > before:
            return True
        self.me.counters.discarded_steps += 1
        log.warning("fastreduce: step %d discarded on every member", before)
        return False

    def _commit_local(self, step: Callable[[], Any], start: float) -> bool:
        mode = self.me.mode
        if not mode.communicates_at(mode.steps + 1):
            step()
            self.me.step += 1
            self._save()
            return True
        kept = self._keep()
        while True:
            lost = self.epochs.reach_first_step()  # (a new epoch's first sync: every member alive and here)
            if lost is not None:
                self._again(kept, lost, start)
                continue
            try:
                step()
            except RuntimeError as err:
                self._again(kept, self.votes.aborted_by(err), start)
                continue
            decision, who = self.votes.vote(self.me.step)
            if decision != "abort":
                break
            self._again(kept, who, start)
        self.me.step += 1
        self._save()
        if decision == "join":
            self._change(who, start)
        return True

    def _commit_zero(self, step: Callable[[], Any], start: float) -> bool:
        """ZeRO: ``step`` (the user's, calling the mode's ``step()``) reduce-scatters, sends
        each rank's chunk of the mean to the next (its copy of the shard), then, before any
        shard steps, the members vote (every step). A loss before the vote completes:
        nothing stepped anywhere, the step is discarded. After it: the step stands, as
        every shard's averaged gradients were on two members, and each survivor steps what
        it holds; the next epoch joins the survivors' shards (:mod:`.modes.zero_mirror`)."""
        mode, voted = self.me.mode, []

        def vote() -> None:
            decision, who = self.votes.vote(self.me.step)
            if decision == "abort":
                raise _Aborted(who)
            voted.append((decision, who))

        try:
            with mode.commit_point(vote):
                step()
                mode.wait_params()  # a peer lost during the all-gather fails here, not in the next forward
        except _Aborted as aborted:  # a member went silent before every member voted: no shard stepped
            return self._lost_step(aborted.members, start)
        except RuntimeError as err:
            if not voted:
                return self._lost_step(self.votes.aborted_by(err), start)
            lost = self.votes.lost_in(err)
            if lost is None:
                raise
            self.me.step += 1  # every shard stepped on a survivor: the step stands
            self.me.counters.lose(lost)
            self.epochs.next_epoch(lost, "loss", start)
            return True
        if not voted:
            raise RuntimeError("commit(step) with a ZeroOptimizer: step must call its step() (membership.commit("
                               "membership.mode.step)); nothing was committed")
        self.me.step += 1
        self._save()
        if voted[0][0] == "join":
            self._change(voted[0][1], start)
        self.votes.timed()
        return True

    def _save(self) -> None:
        """Right after a committed step, before any epoch change at it: this member's part of
        the job's checkpoint, where one is due (:mod:`fastreduce.job_checkpoints`). A part that
        cannot be written (the disk; a collective the mode's ``state_dict`` waits on failed on
        a lost member) is left out with a warning: that step's checkpoint stays incomplete and
        is never loaded, and training goes on."""
        saves = self.me.settings.checkpoints
        if saves is None or not saves.due(self.me.step):
            return
        try:
            saves.write(self.me, kept_state(self.me.mode, after_loss=False), self.epochs.admission.fingerprint())
        except (OSError, RuntimeError) as err:
            log.warning("fastreduce: member %s could not write its part of the checkpoint of step %d (%s: %s); "
                        "training goes on, that checkpoint is incomplete", self.me.name, self.me.step,
                        type(err).__name__, err)

    def _keep(self) -> dict[str, Any]:
        """What a sync changes, to put back if it fails: the mode's state (parameters,
        anchor, outer optimizer, counters), every object of ``state`` but the model, and
        the gradients (LocalSGD's warm-up averages them in the step)."""
        grads = [(p, p.grad.clone()) for v in self.me.state.values() if isinstance(v, torch.nn.Module)
                 for p in v.parameters() if p.grad is not None]
        return {"mode": clone_state(self.me.mode.local_state_dict()), "grads": grads,  # nothing in flight waited for
                "state": {k: clone_state(v.state_dict()) for k, v in self.me.state.items()
                          if not isinstance(v, torch.nn.Module)}}

    def _again(self, kept: dict[str, Any], lost: set[str], start: float) -> None:
        """The sync failed: state back as before the step, the next epoch, then the step again."""
        for k, v in self.me.state.items():
            if k in kept["state"]:
                v.load_state_dict(kept["state"][k])
        self.me.mode.load_state_dict(kept["mode"])
        with torch.no_grad():
            for p, g in kept["grads"]:
                if p.grad is None:
                    p.grad = g.clone()
                else:
                    p.grad.copy_(g)
        self.me.counters.lose(lost)
        self.me.counters.resyncs += 1
        log.warning("fastreduce: the sync at step %d failed (lost: %s); every survivor goes back to before it and "
                    "syncs again over the next epoch", self.me.step, ", ".join(sorted(lost)) or "a silent member")
        self.epochs.next_epoch(lost, "loss", start)


class _Aborted(Exception):
    """A ZeRO step's vote ended in ``abort``: a member went silent before every member voted."""

    def __init__(self, members: set[str]):
        super().__init__(", ".join(sorted(members)))
        self.members = members
