"""The members' vote at the end of a step, through the coordinator (the only request a
per-step mode makes to it, and only at a poll): each member adds 1 to the step's counter;
the one whose vote completes the count looks for joiners and leavers and writes the
decision (go on, a new epoch, and the step of the next poll); a member gone silent
meanwhile turns it into ``"abort"``. Also what a failed collective lost, and the word
that aborts a step for every member.
"""

from __future__ import annotations

import time

import fastreduce.faults as faults
import fastreduce.faults_errors as faults_errors
import fastreduce.faults_heartbeat as faults_heartbeat

from .admission import Admission
from .coordinator import MEMBERS_PREFIX, CoordinatorLink
from .faults import RankLostError
from .member import Member
from .modes.contract import leaving_now
from .presence import EXIT_CHECK_S, Watch
from .process_identity import who_of
from .status import Evictions, StatusReport

__all__ = ["Votes"]

_LEAVING = MEMBERS_PREFIX + "leaving"


def done_key(epoch: int, step: int) -> str:
    """The key of the decision of step index ``step``'s vote in epoch ``epoch``."""
    return MEMBERS_PREFIX + f"e{epoch}/s{step}/done"


class Votes:
    """One member's votes: it owns when the next poll is (agreed at the last one), the
    running step time that spaces the polls, and the requests to leave it has counted."""

    def __init__(self, me: Member, link: CoordinatorLink, admission: Admission):
        self.me, self.link, self.admission = me, link, admission
        self.poll_at = 0  # the step index of the members' next poll (agreed at the last one)
        self.step_s: float | None = None  # a running mean of the seconds between commits
        self._polled: tuple[int, int] | None = None  # (epoch, step) of this member's last poll
        self._leaves_seen = 0  # requests to leave counted when this member last looked
        self._last_commit: float | None = None
        self.status = StatusReport(me, link)  # this member's figures at the coordinator, about once a second
        self.evictions = Evictions(me, link, self.ask_to_leave, admission)  # rank 0's (evict_slower_than)

    def restart(self, first_step: int) -> None:
        """A new epoch, entered at ``first_step``: every epoch polls at its first step."""
        self.poll_at, self._last_commit = first_step, None

    def timed(self) -> None:
        """The running mean of the seconds between commits (the next poll's distance)."""
        now = time.perf_counter()
        if self._last_commit is not None:
            gap = now - self._last_commit
            self.step_s = gap if self.step_s is None else 0.8 * self.step_s + 0.2 * gap
        self._last_commit = now

    def vote(self, s: int) -> tuple[str, set[str]]:
        """The members' vote at step index ``s``: ``"go"``, ``"abort"`` (and the silent
        members) or ``"join"``: a new epoch, for joiners or for the members leaving
        (returned); the voter completing the count also sets the next poll's step."""
        epoch, store = self.me.current(), self.link.store
        key = MEMBERS_PREFIX + f"e{epoch.number}/s{s}"
        self.status.publish(self.step_s)
        self.evictions.look(self.step_s)
        value = None
        if self.link.call(store.add, key, 1) == epoch.world:
            if s >= self.poll_at:  # a poll: joiners, leavers, the next poll's step
                every = 1 if not self.step_s else max(1, min(10_000, int(self.me.settings.poll_s / self.step_s)))
                leavers = self._leavers()
                decision = "join" if self.admission.waiting() or leavers else "go"
                mine = f"{decision} {s + every} {','.join(leavers)}"
            else:  # a local mode's vote at a sync between polls: go on
                mine = f"go {self.poll_at} "
            written = self.link.call(store.compare_set, key + "/done", "", mine)
            value = mine if (written.decode() if isinstance(written, bytes) else written) == mine else None
            if value is not None and decision == "join":  # the requests served: a process that joins
                for m in leavers:  # later under a leaver's name is not taken for it
                    self.link.submit(store.delete_key, f"{_LEAVING}/{m}")
            if self._polled is not None and self._polled[0] == epoch.number:  # every member read it: gone
                old = MEMBERS_PREFIX + f"e{epoch.number}/s{self._polled[1]}"
                for k in (old, old + "/done"):  # off the step's path (the next request queues behind)
                    self.link.submit(store.delete_key, k)
        self._polled = (epoch.number, s)
        silent: set[str] = set()
        if value is None:  # (the completing voter knows it: its own was written)
            value, silent = self._await_decision(key + "/done")
        self.me.passing("voted", s)
        if value == "abort":
            return value, silent
        decision, at, leavers = value.split(" ")
        self.poll_at = int(at)
        return decision, set(filter(None, leavers.split(",")))

    def ask_to_leave(self, member: str | None = None) -> None:
        """This member (or ``member``: evicted) asks to be out at the next poll
        (:meth:`fastreduce.Membership.leave`)."""
        self.me.leaving = self.me.leaving or member is None
        self.link.call(self.link.store.set, f"{_LEAVING}/{member or self.me.name}", "1")
        self.link.call(self.link.store.add, _LEAVING, 1)

    def asked_to_leave(self) -> bool:
        """Whether this member asked to leave, or was asked to (the straggler policy's request
        under its name, :class:`~fastreduce.status.Evictions`), and no poll let it go yet."""
        return self.me.leaving or bool(self.link.call(self.link.store.check, [f"{_LEAVING}/{self.me.name}"]))

    def forget_leave_request(self) -> None:
        """Delete a request to leave under this member's name: an earlier process's of that
        name (``member=``), lost before the poll that would have let it go, which would vote
        this one out at its first poll. Before this process's first vote."""
        self.link.call(self.link.store.delete_key, f"{_LEAVING}/{self.me.name}")

    def _leavers(self) -> list[str]:
        """The members that leave at this poll: those that asked, looked for when the count of
        such requests changed since this member last looked (or it kept some for a later poll),
        less those the mode keeps for a later poll (:func:`~.modes.contract.leaving_now`: a
        ZeRO shard and its only copy, asked away together, go one poll apart)."""
        asked = int(self.link.call(self.link.store.add, _LEAVING, 0))
        if asked == self._leaves_seen:
            return []
        epoch = self.me.current()
        found = [r for r, m in enumerate(epoch.members) if self.link.call(self.link.store.check, [f"{_LEAVING}/{m}"])]
        now = leaving_now(self.me.mode, found, epoch.world)
        if len(now) == len(found):  # (otherwise looked for again at the next poll)
            self._leaves_seen = asked
        return [epoch.members[r] for r in now]

    def _await_decision(self, done: str) -> tuple[str, set[str]]:
        """The vote's decision; ``"abort"`` (and the silent members) where a member's
        heartbeat stops for ``$FASTREDUCE_LOST_AFTER_S`` first, or its process ran on this
        host and has exited (looked at every :data:`~fastreduce.presence.EXIT_CHECK_S`: a
        member that died after the step's collectives, before its vote)."""
        epoch = self.me.current()
        beat, window = faults_heartbeat.heartbeat_now(), faults.lost_after()
        if beat is not None and not beat.current():
            beat = None  # an earlier epoch's
        every = min(faults.heartbeat_interval(), 0.25) if beat is not None else 1.0
        slice_s = EXIT_CHECK_S if beat is not None else every
        # One request waits for the decision (a get on a connection of its own, no timeout
        # of its own to print every slice); meanwhile this thread watches the heartbeats
        # through the heartbeat's connection and, if a member goes silent, writes "abort".
        finished, box = self.link.submit(self.link.vote_connection().get, done)
        seen: dict[int, tuple[int, float]] = {}
        records: dict[int, str] = {}
        silent: set[str] = set()
        read_at = 0.0
        while not finished.wait(slice_s):
            if beat is None or silent:
                continue
            try:  # the watched members' (faults_heartbeat.WATCHED_SUCCESSORS): a member lost elsewhere
                # is seen by its own watchers, whose "abort" wakes this get
                ranks: list[int] = []
                if time.monotonic() - read_at >= every:
                    read_at = time.monotonic()
                    ranks = beat.silent(seen, window, records)
                ranks = ranks or beat.exited(sorted(seen), records)
                if ranks:
                    silent = {epoch.members[r] for r in ranks}
                    beat.call(self.link.store.compare_set, done, "", "abort")  # the waiting get returns it too
                    # published on the heartbeat, as a diagnosis's finding (see lost_in)
                    faults.note_lost({r: "" for r in ranks} | who_of({r: records.get(r, "") for r in ranks}),
                                     f"silent for {window:g} s at the vote of a step", faults.group_token())
            except Exception as err:  # noqa: BLE001 - the store raises several kinds (its own
                # timeout, or a reset connection where the coordinator died as it was read)
                raise self.link.unreachable(err) from err
        if isinstance(box[0], BaseException):
            raise self.link.unreachable(box[0]) from box[0]
        value = box[0].decode()
        return value, silent if value == "abort" else set()

    def lost_in(self, err: RuntimeError) -> set[str] | None:
        """The members a failed collective lost, or ``None`` if it was no loss. A member
        whose process ran on this host and has exited is named at once (a joiner that died
        as it was healed), without the diagnosis's window, and published on the epoch's
        heartbeat as a diagnosis publishes what it finds (:func:`fastreduce.faults.note_lost`):
        this member leaves the epoch's group next, and a member still waiting on it in a
        collective there (a gossip ring's far side, a mode's set-up) would otherwise see it
        silent and name it lost too, :data:`~fastreduce.faults.LOCAL_GRACE` windows later."""
        epoch = self.me.current()
        if isinstance(err, RankLostError):
            return {epoch.members[r] for r in err.ranks if r < epoch.world}
        if not faults_errors.is_transport_failure(err):
            return None
        watch = Watch(self.link.store, self.link.call, [m for m in epoch.members if m != self.me.name])
        exited = watch.exited()
        if exited:
            faults.note_lost(who_of({epoch.members.index(m): watch.records[m] for m in exited}),
                             "its process exited (seen on its host)", faults.group_token())
            return exited
        ranks, _, _ = faults.diagnose()
        return {epoch.members[r] for r in ranks}

    def aborted_by(self, err: RuntimeError) -> set[str]:
        """The members whose loss failed this step's collective (the step then aborted for
        every member: the waiting ones are woken); ``err`` itself again where it is no loss."""
        lost = self.lost_in(err)
        if lost is None:
            raise err
        epoch = self.me.current()
        self.link.call(self.link.store.compare_set, done_key(epoch.number, self.me.step), "", "abort")
        return lost
