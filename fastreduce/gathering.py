"""How the survivors of an epoch find each other for the next one (a part of
:class:`~fastreduce.epochs.EpochChanges`): each announces itself through the coordinator
(its step, whether it holds the job's state) and waits for the others' word, telling a
slow survivor from a lost one by its heartbeat in the old epoch or its pulse; and how
often the members of an epoch poll the coordinator together.
"""

from __future__ import annotations

import json
import time
from typing import Any

import fastreduce.faults as faults
import fastreduce.faults_heartbeat as faults_heartbeat

from .coordinator import MEMBERS_PREFIX, CoordinatorLink, Epoch, epoch_key
from .member import Member
from .presence import heartbeats, pulses

__all__ = ["POLLS_PER_S", "Gathering", "moved", "poll_s"]

POLLS_PER_S = 4000.0
"""How many times a second the members of an epoch poll the coordinator together while they
gather for the next one (:meth:`Gathering.gather`) or enter it (``_rendezvous``): a member
polls every ``max(5 ms, members / POLLS_PER_S)``. At a fixed 5 ms, 1,024 members made 400k
requests a second to the one-threaded store, and their client threads on this 2-core machine
could not finish one formation in 8 s (``fastreduce bench store --scenarios form``)."""


def poll_s(members: int, polls: int | None = None) -> float:
    """Seconds between two polls of one member of an epoch of ``members``; ``polls``: after
    that many of a meeting's, whose members come within milliseconds of each other (one
    more after 1, 1, 2, 4 ms, then at the usual pace; never more often than the coordinator
    was sized for)."""
    pace = members / POLLS_PER_S  # the coordinator's sizing: no member polls more often
    usual = max(0.005, pace)
    if polls is None:
        return usual
    return min(usual, max(pace, 0.001 * 2 ** min(max(0, polls - 1), 20)))  # (a long wait: no float overflow)


def moved(now: dict[str, int], counted: dict[str, int]) -> bool:
    """Whether a count read ``now`` (a heartbeat's, a pulse's) moved since ``counted``
    (``True`` the first time: counted now, to compare a window later)."""
    first = not counted
    changed = any(m in counted and counted[m] != n for m, n in now.items())
    counted.update(now)
    return first or changed


class Gathering:
    """One member's part in gathering the survivors of an epoch (see the module doc):
    ``me`` (its :class:`~fastreduce.member.Member`) over ``link``."""

    def __init__(self, me: Member, link: CoordinatorLink):
        self.me, self.settings, self.store, self.call = me, me.settings, link.store, link.call

    def announce(self, old: Epoch, held: bool = False) -> None:
        """This member's word for the epoch after ``old``: its step, whether it holds the
        job's state (or its first members'), whether it holds a ZeRO step (``held``)."""
        alive = MEMBERS_PREFIX + f"e{old.number + 1}/alive"
        self.call(self.store.set, f"{alive}/{self.me.name}",
                  json.dumps({"step": self.me.step, "healed": self.me.healed, "founder": self.me.founder,
                              "held": held}))
        self.call(self.store.add, alive, 1)

    def name_self_lost(self) -> None:
        """This member's collective failed where it found no member lost (every heartbeat
        moved: its own link flapped), and it now leaves the epoch's group. The others may
        still wait on it in a collective there, and would see it silent; its process runs
        on their host (or seems to), so they would wait :data:`~fastreduce.faults.LOCAL_GRACE`
        loss windows (10.7 s at a 1 s window) before they named it. So it names itself on
        the epoch's heartbeat, as a finding of a loss: their watchdog reads that within a
        heartbeat, and they form the next epoch with it (announced already: :meth:`announce`)."""
        beat = faults_heartbeat.heartbeat_now()
        if beat is not None and beat.current():
            faults.note_lost({beat.rank: ""}, "its own collective failed while every member still beat (its link "
                             "flapped): it left this epoch and registered for the next", faults.group_token())

    def gather(self, old: Epoch, lost: set[str], why: str, beats: Any,
               announced: bool = False) -> dict[str, dict[str, Any]]:
        """Announce this member for the epoch after ``old`` (unless ``announced``: by
        :meth:`announce`) and wait for the other survivors' announcements: those of the
        members of ``old`` present (its step and whether it holds the job's state), in
        ``old``'s order: every member not ``lost``; fewer where the epoch was formed by
        others meanwhile, or a survivor stayed silent past the window and ``wait_s``.
        ``beats``: the old epoch's store, whose heartbeats tell a slow survivor from a lost one."""
        n = old.number + 1
        if not announced:
            self.announce(old)
        count, alive = MEMBERS_PREFIX + f"e{n}/alive", MEMBERS_PREFIX + f"e{n}/alive/"  # how many, and each one's word
        expected = [m for m in old.members if m not in lost]
        window = faults.lost_after() if why in ("loss", "end") else self.settings.timeout_s
        deadline, last = time.monotonic() + window, time.monotonic() + self.settings.wait_s
        counted: dict[str, int] = {}
        key = epoch_key(n)
        # Each tick reads the count (and whether the epoch was formed), not every member's key:
        # two requests a member, where a check per member made N^2 a tick at N members.
        while True:
            if int(self.call(self.store.add, count, 0)) >= len(expected) and \
                    self.call(self.store.check, [alive + m for m in expected]):
                present = [m for m in old.members if m not in lost or self.call(self.store.check, [alive + m])]
                break
            if self.call(self.store.check, [key]):
                # Formed already, by survivors that knew whom the failure lost (this one's
                # collective may fail without naming anyone): they waited for this member.
                present = self._present(old)
                break
            if time.monotonic() > deadline:
                # A survivor still beating in the old epoch (slow to see the loss: a long
                # forward, a loaded host) is waited for, a window at a time, up to wait_s.
                present = self._present(old)
                missing = [m for m in expected if m not in present]
                if beats is None or time.monotonic() > last or not self._beating(beats, old, missing, counted):
                    break
                deadline = time.monotonic() + window
            time.sleep(poll_s(old.world))
        return self._words(old, present)

    def announced(self, old: Epoch, members: list[str]) -> dict[str, dict[str, Any]]:
        """The word (:meth:`announce`) of each of ``members`` that announced itself for the
        epoch after ``old``."""
        return self._words(old, self._present(old, members))

    def _present(self, old: Epoch, members: list[str] | None = None) -> list[str]:
        """The members of ``old`` (of ``members``) that announced themselves for the next epoch
        (a request each)."""
        alive = MEMBERS_PREFIX + f"e{old.number + 1}/alive/"
        return [m for m in (old.members if members is None else members) if self.call(self.store.check, [alive + m])]

    def _words(self, old: Epoch, present: list[str]) -> dict[str, dict[str, Any]]:
        """The words of ``present``, every one announced (one request, torch >= 2.5)."""
        alive = MEMBERS_PREFIX + f"e{old.number + 1}/alive/"
        words = self.call(faults_heartbeat.read_all, self.store, [alive + m for m in present]) if present else []
        return dict(zip(present, map(json.loads, words)))

    def _beating(self, beats: Any, old: Epoch, members: list[str], counted: dict[str, int]) -> bool:
        """Whether a heartbeat of ``members`` in epoch ``old``, or a pulse of theirs, moved
        since last counted (``True`` the first time: counted now, to compare a window later).
        The pulse: a survivor whose entry into ``old`` failed before its heartbeat there
        started (a starved host) shows it lives by its pulse alone, up since it left the
        epoch before (:meth:`~fastreduce.epochs.EpochChanges.next_epoch`); read by the heartbeat only, it was left out."""
        beating = heartbeats(beats, old, self.call, members)
        pulsing = {f"pulse {m}": n for m, n in pulses(self.store, self.call, members).items()}
        return moved({**beating, **pulsing}, counted)
