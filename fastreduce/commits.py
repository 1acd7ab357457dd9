"""How a :class:`~fastreduce.Membership` commits a step in each style a mode declares
(:func:`.modes.contract.commit_style`) beyond a plain reduction: LocalSGD's and DiLoCo's
syncs, kept and run again over the survivors when one fails; ZeRO's vote between its
reduce-scatter and its shards' step; and a step lost to a member's loss.
"""

from __future__ import annotations

import logging
from typing import Any, Callable

import torch

from .nested import clone_state

__all__ = ["StepCommits"]

log = logging.getLogger("fastreduce.membership")


class StepCommits:
    """The per-style commits of :class:`~fastreduce.Membership` (a mixin: it reads the
    membership's mode, step, counters and ``_state``, and calls its ``_vote``,
    ``_reach_first_step``, ``_aborted_by``, ``_lost_in``, ``_next_epoch``, ``_change`` and
    ``_timed``)."""

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
            lost = self._reach_first_step()  # (a new epoch's first sync: every member alive and here)
            if lost is not None:
                self._again(kept, lost, start)
                continue
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

    def _commit_zero(self, step: Callable[[], Any], start: float) -> bool:
        """ZeRO: ``step`` (the user's, calling the mode's ``step()``) reduce-scatters, sends
        each rank's chunk of the mean to the next (its copy of the shard), then, before any
        shard steps, the members vote (every step). A loss before the vote completes:
        nothing stepped anywhere, the step is discarded. After it: the step stands, as
        every shard's averaged gradients were on two members, and each survivor steps what
        it holds; the next epoch joins the survivors' shards (:mod:`.modes.zero_mirror`)."""
        mode, voted = self.mode, []

        def vote() -> None:
            decision, who = self._vote(self.step)
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
                return self._lost_step(self._aborted_by(err), start)
            lost = self._lost_in(err)
            if lost is None:
                raise
            self.step += 1  # every shard stepped on a survivor: the step stands
            self.counters.losses += 1
            self._next_epoch(lost, "loss", start)
            return True
        if not voted:
            raise RuntimeError("commit(step) with a ZeroOptimizer: step must call its step() (membership.commit("
                               "membership.mode.step)); nothing was committed")
        self.step += 1
        if voted[0][0] == "join":
            self._change(voted[0][1], start)
        self._timed()
        return True

    def _keep(self) -> dict[str, Any]:
        """What a sync changes, to put back if it fails: the mode's state (parameters,
        anchor, outer optimizer, counters), every object of ``state`` but the model, and
        the gradients (LocalSGD's warm-up averages them in the step)."""
        grads = [(p, p.grad.clone()) for v in self._state.values() if isinstance(v, torch.nn.Module)
                 for p in v.parameters() if p.grad is not None]
        return {"mode": clone_state(self.mode.state_dict()), "grads": grads,
                "state": {k: clone_state(v.state_dict()) for k, v in self._state.items()
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


class _Aborted(Exception):
    """A ZeRO step's vote ended in ``abort``: a member went silent before every member voted."""

    def __init__(self, members: set[str]):
        super().__init__(", ".join(sorted(members)))
        self.members = members
