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
loss window), or the next epoch formed. Its steps are the job's where no member ended, or
went on, at fewer steps and the next epoch (if formed) began at its step or later; else
the text of :meth:`Ending.unconfirmed` says why not.
"""

from __future__ import annotations

import json
import time

import fastreduce.faults as faults
import fastreduce.faults_heartbeat as faults_heartbeat
import fastreduce.process_identity as process_identity

from .coordinator import MEMBERS_PREFIX, CoordinatorLink, Epoch, MembershipError, epoch_key, group_store
from .gathering import poll_s
from .member import Member
from .presence import Watch, pulses

__all__ = ["Ending", "done_key"]


def done_key(epoch: int, member: str) -> str:
    """The coordinator's key of the steps ``member`` ended ``epoch`` with."""
    return MEMBERS_PREFIX + f"done/e{epoch}/{member}"


class Ending:
    """One member's end (see the module doc): ``me`` over ``link``."""

    def __init__(self, me: Member, link: CoordinatorLink):
        self.me, self.link = me, link

    def confirm(self, doing: str) -> None:
        """:class:`MembershipError` where this member's steps are not confirmed as the job's
        (:meth:`unconfirmed`; a trainer's last step: before the trainer saves anything)."""
        with self.me.telling():
            unconfirmed = self.unconfirmed(doing)
            if unconfirmed:
                raise MembershipError(unconfirmed)

    def unconfirmed(self, doing: str, why: str = "") -> str:
        """Why this member's committed steps are not confirmed as the job's, as an error's
        text (``""``: they are): the coordinator silent (``why``: what a request found), or
        another member ended, or went on, at fewer steps, or the next epoch formed without it
        at fewer steps (see the module doc). Mid-run a member's next request raises where the
        others went on without it; at the end this one is that request."""
        epoch = self.me.current()
        why = why or ("the coordinator stopped answering" if self.link.silent else "")
        if not why:
            try:
                why = self._settled(epoch)
            except MembershipError as err:
                why = str(err)
        if not why:
            return ""
        return (f"fastreduce: member {self.me.name} {doing} with its {self.me.step} committed steps not confirmed by "
                f"the job ({why}). A link lost during a step's reduction can leave the step completed here and "
                "discarded by the members that reach the coordinator: this member's parameters may be one step "
                "ahead of the job's, not the job's. Take the job's from a member whose close() returned, or from its "
                "last complete checkpoint")

    def _settled(self, epoch: Epoch) -> str:
        """Wait for the others' word on this epoch's end (the module doc); ``""`` where this
        member's steps are the job's, else why not."""
        store, call, n = self.link.store, self.link.call, self.me.step
        call(store.set, done_key(epoch.number, self.me.name), str(n))
        open_ = [m for m in epoch.members if m != self.me.name]
        quiet = _Quiet(self.link, epoch)
        deadline, nxt = time.monotonic() + self.me.settings.timeout_s, epoch_key(epoch.number + 1)
        while open_:
            if call(store.check, [nxt]):
                formed = Epoch.from_json(call(store.get, nxt))
                if formed.step < n and self.me.name not in formed.members:
                    return (f"the others formed epoch {formed.number} at step {formed.step} without it: its last step "
                            "failed on them")
                return ""
            words = self._words(epoch, open_)
            for m, (went, s) in words.items():
                if s < n:
                    return (f"member {m} {'ended' if went == 'ended' else 'went on to the next epoch'} at step {s}: "
                            "its last step failed where this member's completed")
            open_ = [m for m in open_ if m not in words]
            open_ = [m for m in open_ if m not in quiet.stopped(open_)]
            if open_ and time.monotonic() > deadline:
                return (f"{', '.join(open_)} neither ended nor stopped within timeout_s={self.me.settings.timeout_s:g} "
                        "s: close every member after the same last step")
            if open_:
                time.sleep(max(0.05, poll_s(epoch.world)))
        return ""

    def _words(self, epoch: Epoch, members: list[str]) -> dict[str, tuple[str, int]]:
        """What each of ``members`` said of its end: ``("ended", step)`` or ``("went on",
        step)`` (it announced itself for the next epoch with its steps); none where it said nothing."""
        store, call = self.link.store, self.link.call
        done = [done_key(epoch.number, m) for m in members]
        if call(store.check, done):  # (every one ended: one request for all)
            return {m: ("ended", int(v)) for m, v in zip(members, call(faults_heartbeat.read_all, store, done))}
        words = {}
        for m, key in zip(members, done):
            alive = MEMBERS_PREFIX + f"e{epoch.number + 1}/alive/{m}"
            if call(store.check, [key]):
                words[m] = ("ended", int(call(store.get, key)))
            elif call(store.check, [alive]):
                words[m] = ("went on", int(json.loads(call(store.get, alive))["step"]))
        return words


class _Quiet:
    """Which members of ``epoch`` stopped: their process exited on this host, or neither
    their heartbeat in ``epoch`` nor their pulse moved for the loss window (for
    :data:`~fastreduce.faults.LOCAL_GRACE` windows where their process still runs here)."""

    def __init__(self, link: CoordinatorLink, epoch: Epoch):
        self.link, self.epoch = link, epoch
        self.beats = group_store(epoch.number, link.store)
        self.watch = Watch(link.store, link.call, list(epoch.members))
        self.seen: dict[str, tuple[tuple[int, int], float]] = {}
        self.read_at = 0.0

    def stopped(self, members: list[str]) -> set[str]:
        gone = self.watch.exited() & set(members)
        now = time.monotonic()
        if now - self.read_at < min(faults.heartbeat_interval() or 0.25, 0.25):
            return gone
        self.read_at, call = now, self.link.call
        beat = {m: int(call(self.beats.add, f"{faults_heartbeat.STORE_PREFIX}heartbeat/{self.epoch.members.index(m)}", 0))
                for m in members}
        pulse = pulses(self.link.store, call, members)
        window = faults.lost_after()
        for m in members:
            counts = (beat[m], pulse.get(m, 0))
            if m not in self.seen or self.seen[m][0] != counts:
                self.seen[m] = (counts, now)
            here = process_identity.running_here(self.watch.records.get(m, ""), self.watch.me)
            if now - self.seen[m][1] >= window * (faults.LOCAL_GRACE if here else 1):
                gone.add(m)
        return gone
