"""How a :class:`~fastreduce.Membership` commits a step in each style a mode declares
(:func:`.modes.contract.commit_style`): a reduction (or gossip's forward and backward),
then the vote at a poll; LocalSGD's and DiLoCo's syncs, kept and run again over the
survivors when one fails; ZeRO's in-band meeting between its reduce-scatter and its shards' step;
and a step lost to a member's loss.

LocalSGD and DiLoCo, whose collectives run in the optimizer's step, vote at every sync
instead of at the polls: a sync that fails on any member is put back and run again on every survivor.
ZeRO (:class:`~fastreduce.ZeroOptimizer` with ``redundant=True``: each shard also kept and
stepped on the next rank) meets in-band at every step, after its reduce-scatter and before
any shard steps (``all_arrived()``), and polls as the reducing modes do: a loss before that
meeting completes anywhere discards the step; once it has completed on a survivor, the step
stands (every shard's averaged gradients were on two members; a survivor whose wait failed
steps them as the next epoch forms), and the next epoch reshards the survivors' shards over
the new world (:mod:`.modes.zero_mirror`); a shard lost with every holder (``redundant=k``: more
than k ranks at once, its copies' holders among them) is a :class:`~fastreduce.MembershipError`.
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

from .epochs import EpochChanges, LeftOut
from .kept import kept_state
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
        if me.left:
            raise RuntimeError(f"this member left the job ({me.left_why}); end the training loop once m.left is True "
                               "(while m.step < steps and not m.left: ...); start a new process to join again")
        start = time.perf_counter()  # a stall counts from here: detection, the new epoch, healing
        try:
            with me.telling():
                return self._commit(step, start)
        except LeftOut:  # left out of the next epoch: in the job again (or out, where it asked to leave)
            return False

    def _commit(self, step: Callable[[], Any], start: float) -> bool:
        me = self.me
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
        if kind != "gossip":
            step()  # (one that raises counts no step: m.step stays the optimizer's count)
        me.step += 1
        self._save()
        self._poll(s, start)
        return True

    def _poll(self, s: int, start: float) -> None:
        """After committed step index ``s``: the members' vote where a poll is due."""
        if s >= self.votes.poll_at:
            decision, who = self.votes.vote(s)
            if decision == "abort":  # a member went silent after this step's collectives: the step stands
                self.me.counters.lose(who)
                self.epochs.next_epoch(who, "loss", start)
            elif decision == "join":
                self._change(who, start)
        self.votes.timed()

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
        shard steps, every member waits for every other to have got that far
        (``all_arrived()``: one one-element all-reduce on the step's transport, no request
        to the coordinator). A loss before it completes anywhere: nothing stepped, the step
        is discarded. Completed on some survivor: every shard's averaged gradients were on
        two members, so the step stands: a survivor whose wait failed holds them and steps
        them when the next epoch forms (:meth:`EpochChanges.next_epoch`), and the next
        epoch reshards the survivors' shards (:mod:`.modes.zero_mirror`). The members poll
        as the reducing modes do."""
        mode, s, arrived = self.me.mode, self.me.step, []

        def all_arrived() -> None:
            mode.all_arrived()
            self.me.passing("voted", s)
            arrived.append(True)

        try:
            with mode.commit_point(all_arrived):
                step()
                mode.wait_params()  # a peer lost during the all-gather fails here, not in the next forward
        except RuntimeError as err:
            if not arrived:  # (this member holds the step if its wait failed: kept with its mode)
                return self._lost_step(self.votes.aborted_by(err), start)
            lost = self.votes.lost_in(err)
            if lost is None:
                raise
            self.me.step += 1  # every shard stepped on a survivor: the step stands
            self.me.counters.lose(lost)
            self.epochs.next_epoch(lost, "loss", start)
            return True
        if not arrived:
            raise RuntimeError("commit(step) with a ZeroOptimizer: step must call its step() (membership.commit("
                               "membership.mode.step)); nothing was committed")
        self.me.step += 1
        self._save()
        self._poll(s, start)
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
