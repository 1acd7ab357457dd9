"""How a :class:`~fastreduce.Membership` member's end is confirmed as the job's (a part of
the facade, behind :meth:`~fastreduce.Membership.close` and :meth:`~fastreduce.Membership.confirm`).

A step's reduction can complete on some members and fail on others: a member lost in the
middle of it, or a link cut one way. Mid-run that is settled at the next epoch (the members
holding the step send it to the others), since every member's next collective fails too.
After the last step there is no next collective: a member whose last step completed would
close with a step that the others, whose reduction failed, discard as they form the next
epoch without it. So an ending member writes the steps it ended with at the coordinator
(``done/e<epoch>/<member>``) and waits until every other member of its epoch has done as
much, or went on to the next epoch (its announcement there says at which step), or stopped
(its process exited on this host, or neither its heartbeat nor its pulse moved for the
loss window), or the next epoch formed. Where another went on with fewer steps (its last
step failed), this member goes on with it, as a survivor holding a step does mid-run: it
joins the next epoch, sends the others the step they lack, and ends again there. Its steps
are the job's where no member ended with fewer steps and the next epoch (if formed without
it) began at its step or later; else the text of :meth:`Ending.unconfirmed` says why not.
"""

from __future__ import annotations

import logging
import time

import fastreduce.faults_heartbeat as faults_heartbeat

from .coordinator import MEMBERS_PREFIX, CoordinatorLink, Epoch, MembershipError, epoch_key, group_store
from .epochs import EpochChanges, LeftOut
from .faults_errors import RankLostError
from .gathering import poll_s
from .member import Member
from .presence import Watch

__all__ = ["SAY_AFTER_S", "Ending", "done_key"]

log = logging.getLogger("fastreduce")
SAY_AFTER_S = 30.0
"""How long an ending member waits for another's word before it says (a warning) whom it
waits for: a member alive that has not ended (its loop runs on, or it evaluates after its
last step before it closes) is waited for up to ``timeout_s``, which is 10 minutes by default."""


def done_key(epoch: int, member: str) -> str:
    """The coordinator's key of the steps ``member`` ended ``epoch`` with."""
    return MEMBERS_PREFIX + f"done/e{epoch}/{member}"


class Ending:
    """One member's end (see the module doc): ``me`` over ``link``, going on to the next
    epoch through ``epochs`` where another member's last step failed."""

    def __init__(self, me: Member, link: CoordinatorLink, epochs: EpochChanges):
        self.me, self.link, self.epochs = me, link, epochs

    def confirm(self, doing: str) -> None:
        """:class:`MembershipError` where this member's steps are not confirmed as the job's
        (:meth:`unconfirmed`; a trainer's last step: before the trainer saves anything)."""
        with self.me.telling():
            unconfirmed = self.unconfirmed(doing)
            if unconfirmed:
                raise MembershipError(unconfirmed)

    def unconfirmed(self, doing: str, why: str = "", leaving: bool = False) -> str:
        """Why this member's committed steps are not confirmed as the job's, as an error's
        text (``""``: they are): the coordinator silent (``why``: what a request found), or
        another member ended with fewer steps, or the next epoch formed without it at fewer
        steps (see the module doc). Where another went on to the next epoch with fewer steps,
        this member goes on with it and sends it the step it lacks, as a survivor holding a
        step does mid-run, then ends again there. ``leaving``: its heartbeat ends first (a
        close: a member still in a collective with it sees it go), its pulse beating instead
        until the close ends (a member gathering for the next epoch waits for its word)."""
        behind = True
        while behind and not why:
            if self.link.silent:
                why = "the coordinator stopped answering"
                break
            try:
                if leaving:  # (its pulse up instead: a member that went on waits for its word, not for a lost one's)
                    faults_heartbeat.stop_leaving(self.link.stop_s())
                    self.epochs.pulse.up()
                why, behind = self._settled(self.me.current())
                if behind:  # (its steps then are the job's too: the epoch formed holds them)
                    self.epochs.next_epoch(set(), "end", time.perf_counter())
            except (MembershipError, RankLostError) as err:
                why = str(err)
            except LeftOut:
                why = "the others formed the next epoch without it, and it took their state"
        if not why:
            return ""
        return (f"fastreduce: member {self.me.name} {doing} with its {self.me.step} committed steps not confirmed by "
                f"the job ({why}). A link lost during a step's reduction can leave the step completed here and "
                "discarded by the members that reach the coordinator: this member's parameters may be one step "
                "ahead of the job's, not the job's. Take the job's from a member whose close() returned, or from its "
                "last complete checkpoint")

    def _settled(self, epoch: Epoch) -> tuple[str, bool]:
        """Wait for the others' word on this epoch's end (the module doc): ``("", False)``
        where this member's steps are the job's, ``(why, False)`` where not, ``("", True)``
        where another went on to the next epoch with fewer steps. Each poll reads three keys
        (the next epoch, how many went on to it, how many ended); each member's own keys are
        read only where one went on, or where the count of those ended stood still."""
        store, call, n, e = self.link.store, self.link.call, self.me.step, epoch.number
        self.tell(epoch)
        others, went_on = [m for m in epoch.members if m != self.me.name], MEMBERS_PREFIX + f"e{e + 1}/alive"
        watch = Watch(store, call, others, beats=(group_store(e, store), epoch))  # (who of them stopped)
        nxt, every = epoch_key(e + 1), max(0.25, epoch.world / 1000)
        began, counted, said = time.monotonic(), -1, False
        deadline, looked = began + self.me.settings.timeout_s, began
        while True:
            gone_on = {m: int(w["step"]) for m, w in self.epochs.gathering.announced(epoch, others).items()} \
                if int(call(store.add, went_on, 0)) else {}
            if any(s < n for s in gone_on.values()):
                return "", True
            if call(store.check, [nxt]):
                formed = Epoch.from_json(call(store.get, nxt))
                if formed.step < n and self.me.name not in formed.members:
                    return (f"the others formed epoch {formed.number} at step {formed.step} without it: its last step "
                            "failed on them"), False
                return "", False
            ended, now = int(call(store.add, _ended(e), 0)), time.monotonic()
            if ended >= epoch.world:
                return self._fewer(epoch, others, n), False
            if ended != counted:
                counted, looked = ended, now
            if ended + len(gone_on) >= epoch.world or now - looked >= every:  # (none ended for a while: alive?)
                looked = now
                out = [m for m in others if m not in gone_on and not call(store.check, [done_key(e, m)])]
                stopped = watch.lost()
                if set(out) <= stopped:
                    return self._fewer(epoch, [m for m in others if m not in out and m not in gone_on], n), False
                if not said and now - began >= SAY_AFTER_S:
                    said = True
                    log.warning("fastreduce: member %s ended epoch %d with %d steps and waits for the word of %s, "
                                "alive and not ended (each member's close(), or confirm() after its last step), up to "
                                "timeout_s=%g s", self.me.name, e, n, ", ".join(m for m in out if m not in stopped),
                                self.me.settings.timeout_s)
            if now > deadline:
                return (f"members of epoch {e} neither ended nor stopped within timeout_s="
                        f"{self.me.settings.timeout_s:g} s: close every member after the same last step"), False
            time.sleep(max(0.05, poll_s(epoch.world)))

    def tell(self, epoch: Epoch) -> None:
        """Write at the coordinator that this member ended ``epoch`` with its committed steps
        (counted once: a trainer's last step, then its close())."""
        store, call = self.link.store, self.link.call
        if not call(store.check, [done_key(epoch.number, self.me.name)]):
            call(store.set, done_key(epoch.number, self.me.name), str(self.me.step))
            call(store.add, _ended(epoch.number), 1)

    def _fewer(self, epoch: Epoch, ended: list[str], n: int) -> str:
        """Why not, where one of ``ended`` (members that wrote their end) ended with fewer than
        ``n`` steps (``""``: none did)."""
        keys = [done_key(epoch.number, m) for m in ended]
        steps = [int(v) for v in self.link.call(faults_heartbeat.read_all, self.link.store, keys)] if keys else []
        fewer = [(m, s) for m, s in zip(ended, steps) if s < n]
        if not fewer:
            return ""
        m, s = fewer[0]
        return f"member {m} ended at step {s}: its last step failed where this member's completed"


def _ended(epoch: int) -> str:
    """The coordinator's count of the members that ended ``epoch``."""
    return MEMBERS_PREFIX + f"ended/e{epoch}"
