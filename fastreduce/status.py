"""What a :class:`~fastreduce.Membership` job is doing, as every member and the coordinator
see it: each member publishes at the coordinator, about once a second (at its polls, off the
step's path), its epoch, rank, committed step, seconds per step and seconds of each step it
spent waiting for the others (its mode's ``stats.wait_seconds``); :func:`read_status` reads
them and names the slowest member.

In a job that steps together every member takes the same time per step, and all but the
slowest wait for it: the slowest is the member that works longest between its waits (its
``busy_s``, a step's seconds less its waits). :func:`read_status` names it, and calls it a
straggler when it works :data:`STRAGGLER_RATIO` times the members' median or more.
``fastreduce status HOST:PORT`` prints it (``--watch S``: again every ``S`` seconds).

With ``Membership(..., evict_slower_than=R, evict_for_s=T)`` the epoch's rank 0 looks about
once a second (off its step's path) and asks a member named the straggler at ratio ``R`` in
every look for ``T`` seconds to leave: it is out at the members' next poll, and the others
go on without it (:class:`Evictions`). Not where the job would then be below ``min_ranks``
with no process waiting to take its place: it stays, watched. Off by default.
"""

from __future__ import annotations

import json
import logging
import statistics
import time
from typing import Any, Callable

from .admission import Admission
from .coordinator import MEMBERS_PREFIX, CoordinatorLink, Epoch, epoch_key
from .faults_heartbeat import read_all
from .member import Member
from .modes.contract import wait_seconds

__all__ = ["EVERY_S", "STATUS_PREFIX", "STRAGGLER_RATIO", "Evictions", "StatusReport", "format_status", "read_status"]

log = logging.getLogger("fastreduce.membership")

STATUS_PREFIX = MEMBERS_PREFIX + "status/"
EVERY_S = 1.0
"""About how often a member publishes its figures (at the first poll this long after the last)."""
STRAGGLER_RATIO = 1.25
"""A member busy this many times the members' median per step is a straggler."""
QUIET_READS = 3
"""Two status reads further apart than this many :data:`EVERY_S` (or steps of the job's, where
a step is longer) have no evidence between them (a pause: an evaluation, a checkpoint written):
the eviction policy's count of a straggler's time starts again there."""


class StatusReport:
    """One member's publication of its figures (:mod:`fastreduce.status`), owned by its
    :class:`~fastreduce.votes.Votes` and called at every poll."""

    def __init__(self, me: Member, link: CoordinatorLink):
        self.me, self.link = me, link
        self._last: tuple[float, int, Any, float | None] | None = None  # (when, step, mode, its wait) last published

    def publish(self, step_s: float | None) -> None:
        """Publish this member's figures where :data:`EVERY_S` has passed since the last
        time, without waiting: the seconds per step and the waits in them over the steps
        since that time (one window for both: their difference is the member's own work;
        a running mean of the steps beside this window's waits named a member slowed by its
        peers a straggler, the running mean still short of the waits just begun), else
        ``step_s`` (the running seconds per committed step) and no waits."""
        now, last = time.monotonic(), self._last
        if last is not None and now - last[0] < EVERY_S:
            return
        mode = self.me.mode
        waited = wait_seconds(mode) if mode is not None else None
        self._last = (now, self.me.step, mode, waited)
        steps = self.me.step - last[1] if last is not None and last[2] is mode and waited is not None else 0
        wait_s = (waited - last[3]) / steps if steps > 0 else None  # the epoch's mode is new: its stats too
        step_s = (now - last[0]) / steps if steps > 0 else step_s
        epoch = self.me.current()
        figures = {"epoch": epoch.number, "rank": self.me.rank, "step": self.me.step, "step_s": step_s,
                   "wait_s": wait_s, "at": time.time()}
        self.link.submit(self.link.store.set, STATUS_PREFIX + self.me.name, json.dumps(figures))


class Evictions:
    """The epoch's rank 0's eviction policy (``evict_slower_than``, ``evict_for_s`` of
    :class:`~fastreduce.member.MembershipSettings`): :meth:`look` at every poll reads the
    status in the background about once a second, and ``ask(name)`` is called once for a
    member named the straggler in every read for ``evict_for_s``, unless the job would then
    be below ``min_ranks`` with no process waiting to take its place (``admission``'s
    :meth:`~fastreduce.admission.Admission.standing_by`): it stays, watched, until one waits.
    The time is the reads': each is judged at the moment it was taken, and reads within one
    epoch no further apart than :data:`QUIET_READS` count on (a pause between two restarts it)."""

    def __init__(self, me: Member, link: CoordinatorLink, ask: Callable[[str], None], admission: Admission):
        self.me, self.link, self.ask, self.admission = me, link, ask, admission
        self._reading: tuple[Any, list[Any]] | None = None  # a read in flight: (done event, its box)
        self._read_at = 0.0
        self._since: tuple[str, float] | None = None  # the straggler every read has named, since when
        self._last: tuple[int | None, float] | None = None  # the last read judged: its epoch, when taken
        self._asked: set[str] = set()
        self._kept: set[str] = set()  # the stragglers kept for min_ranks (said once each)

    def look(self, step_s: float | None = None) -> None:
        """At a poll (``step_s``: the running seconds per step, which spaces the polls)."""
        ratio = self.me.settings.evict_slower_than
        if ratio is None or self.me.rank != 0:
            return
        now = time.monotonic()
        if self._reading is not None and self._reading[0].is_set():
            box, self._reading = self._reading[1], None
            if not isinstance(box[0], BaseException):
                self._judge(*box[0], QUIET_READS * max(EVERY_S, step_s or 0.0))
        if self._reading is None and now - self._read_at >= EVERY_S:
            self._read_at = now
            epoch = self.me.current()
            left = epoch.world - 1 - len(self._asked & set(epoch.members))  # the members an eviction leaves
            self.admission.fingerprint()  # (made here, on the member's thread: the read compares with it)
            self._reading = self.link.submit(self._read, ratio, epoch, left)

    def _read(self, ratio: float, epoch: Epoch, left: int) -> tuple[float, dict[str, Any], tuple[str, ...] | None]:
        """When it was taken, the status, and, where an eviction would leave fewer than
        ``min_ranks`` members (``left``), the processes waiting to take a place (else
        ``None``). On the link's thread."""
        at = time.monotonic()
        status = read_status(self.link.store, ratio, epoch.number)
        short = status["straggler"] is not None and left < self.me.settings.min_ranks
        return at, status, self.admission.standing_by(self.link.store, epoch) if short else None

    def _judge(self, now: float, status: dict[str, Any], waiting: tuple[str, ...] | None, quiet: float) -> None:
        """The read taken at ``now``; ``quiet``: the seconds past which the one before it is no
        evidence for it (:data:`QUIET_READS`)."""
        straggler, number = status["straggler"], (status["epoch"] or {}).get("number")
        if self._last is None or self._last[0] != number or now - self._last[1] > quiet:
            self._since = None  # a new epoch, or nothing read since a pause: its time starts again
        self._last = (number, now)
        if straggler is None or (self._since is not None and self._since[0] != straggler):
            self._since = None if straggler is None else (straggler, now)
            return
        if self._since is None:
            self._since = (straggler, now)
            return
        if now - self._since[1] < self.me.settings.evict_for_s or straggler in self._asked:
            return
        settings, epoch = self.me.settings, self.me.current()
        left = epoch.world - 1 - len(self._asked & set(epoch.members))
        if waiting is not None and left + len(waiting) < settings.min_ranks:  # (the read's figure: it said short)
            if straggler not in self._kept:
                self._kept.add(straggler)
                log.warning("fastreduce: member %s has worked %gx the members' median per step or more for %g s, but "
                            "it stays: without it the job would have %d member(s), below min_ranks=%d, and no process "
                            "waits to take its place (a warm spare, spare=True, is taken as it leaves); it is asked "
                            "to leave once one waits", straggler, settings.evict_slower_than, now - self._since[1],
                            left, settings.min_ranks)
            return
        self._asked.add(straggler)
        log.warning("fastreduce: member %s has worked %gx the members' median per step or more for %g s: it is "
                    "asked to leave (evict_slower_than)", straggler, settings.evict_slower_than, now - self._since[1])
        self.ask(straggler)


def read_status(store: Any, ratio: float = STRAGGLER_RATIO, since: int = 0) -> dict[str, Any]:
    """The job's status from its coordinator's ``store``: the current epoch (number, step at
    which it began, members in rank order), each member's last published figures (and how
    old they are), and ``slowest``/``straggler`` (a member's name, or ``None``; a straggler
    works ``ratio`` times the members' median or more). ``since``: an epoch known formed
    (the search for the current one starts there)."""
    n, epoch = since, None
    while store.check([epoch_key(n)]):
        n += 1
    if n:
        epoch = Epoch.from_json(store.get(epoch_key(n - 1)))
    keys = [STATUS_PREFIX + name for name in (epoch.members if epoch is not None else ())]
    if keys and store.check(keys):  # every member has published: one request
        words = dict(zip(keys, read_all(store, keys)))
    else:
        words = {k: store.get(k) for k in keys if store.check([k])}
    members: dict[str, dict[str, Any]] = {}
    for name, key in zip(epoch.members if epoch is not None else (), keys):
        figures = json.loads(words[key]) if key in words else {}
        if figures:
            figures["age_s"] = max(0.0, time.time() - figures["at"])
            if figures.get("step_s") is not None and figures.get("wait_s") is not None:
                figures["busy_s"] = max(0.0, figures["step_s"] - figures["wait_s"])
        members[name] = figures
    busy = {m: f["busy_s"] for m, f in members.items() if "busy_s" in f}
    slowest = max(busy, key=busy.__getitem__) if len(busy) > 1 else None
    median = statistics.median(busy.values()) if busy else 0.0
    straggler = slowest if slowest is not None and busy[slowest] > 0 and busy[slowest] >= ratio * median \
        else None  # (all busy 0: no one is slower; a median of 0 names no one but a busy member)
    return {"epoch": None if epoch is None else {"number": epoch.number, "step": epoch.step,
                                                  "members": list(epoch.members), "spares": len(epoch.spares)},
            "members": members, "slowest": slowest, "straggler": straggler}


def format_status(status: dict[str, Any]) -> str:
    """:func:`read_status`'s answer as ``fastreduce status`` prints it."""
    epoch = status["epoch"]
    if epoch is None:
        return "no epoch formed yet (no member has joined)"
    members = status["members"]
    steps = [f["step"] for f in members.values() if f]
    rates = [1.0 / f["step_s"] for f in members.values() if f and f.get("step_s")]
    rate = f"{statistics.median(rates):.2f}" if rates else "-"
    spares = f" ({epoch['spares']} warm spare{'s' * (epoch['spares'] != 1)} waiting)" if epoch.get("spares") else ""
    lines = [f"epoch {epoch['number']} (from step {epoch['step']}): {len(epoch['members'])} members{spares}, "
             f"step {max(steps) if steps else '-'}, {rate} steps/s",
             f"{'rank':>4}  {'member':32}  {'step':>7}  {'step ms':>8}  {'wait ms':>8}  {'busy ms':>8}  {'seen':>6}"]

    def ms(v: Any) -> str:
        return "-" if v is None else f"{1e3 * v:8.1f}"
    for rank, name in enumerate(epoch["members"]):
        f = members.get(name) or {}
        mark = "  <- straggler" if name == status["straggler"] else "  <- slowest" if name == status["slowest"] else ""
        lines.append(f"{rank:>4}  {name[:32]:32}  {f.get('step', '-'):>7}  {ms(f.get('step_s')):>8}  "
                     f"{ms(f.get('wait_s')):>8}  {ms(f.get('busy_s')):>8}  "
                     f"{'-' if 'age_s' not in f else format(f['age_s'], '5.1f') + 's':>6}{mark}")
    return "\n".join(lines)
