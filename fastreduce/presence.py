"""A :class:`~fastreduce.Membership` member's sign of life while it enters an epoch.

An epoch's heartbeat (:mod:`.faults`) starts once its process group exists, and only a
collective waited through :func:`~fastreduce.faults.wait_watched` is watched by it. Between
two groups there is neither: a joiner waiting for admission or entering its first epoch, a
survivor gathering for the next one, every member building the mode over the new group and
running its first step there (a mode's first use of a group checks the layout and sets up
its buffers with plain collectives, which Gloo cannot interrupt). A member that dies there
used to be seen by no one: the others waited in a collective on a live peer that had given
up on it, for the group's timeout.

So a member shows it lives at the coordinator from the moment it takes a ticket or leaves
an epoch until it has entered the next one and every member of that epoch has reached its
first step (:meth:`Pulse.up`, :meth:`Pulse.down`): a thread of its own, on a connection of
its own, adds 1 to ``pulse/<member>`` every heartbeat, and ``who/<member>`` names its
process (host, pid, namespaces, start time: :func:`fastreduce.process_identity.identity`). A
:class:`Watch` reads them while its member waits for the others (to enter the epoch, or to
reach its first step): a member whose process ran on this host and has exited is lost at
once (a crash, an OOM kill: what the shared-memory transport sees through pids), one whose
pulse stood still for ``$FASTREDUCE_LOST_AFTER_S`` is lost (:data:`~fastreduce.faults.LOCAL_GRACE`
windows where its process still runs here: a starved process, not a lost one).
"""

from __future__ import annotations

import threading
import time
from typing import Any, Callable

import fastreduce.faults as faults
import fastreduce.faults_heartbeat as faults_heartbeat
import fastreduce.process_identity as process_identity

from .coordinator import MEMBERS_PREFIX, Epoch
from .faults import exited_here
from .lifecycle import disown, own
from .reach import SecondConnection

__all__ = ["EXIT_CHECK_S", "Pulse", "Watch", "all_exited", "exited_here", "heartbeats", "pulse_key", "pulses",
           "who_key"]

EXIT_CHECK_S = 0.02
"""How often a waiting member looks whether a watched member's process on this host has
exited (a read of ``/proc/<pid>/stat`` each)."""


def pulse_key(member: str) -> str:
    """The coordinator's key of ``member``'s pulse (a count)."""
    return MEMBERS_PREFIX + f"pulse/{member}"


def who_key(member: str) -> str:
    """The coordinator's key of ``member``'s process record (:func:`~.process_identity.identity`)."""
    return MEMBERS_PREFIX + f"who/{member}"


class Pulse:
    """This member's sign of life at the coordinator (see the module doc): beating between
    :meth:`up` and :meth:`down` on a thread that lives only that long, over a connection
    of its own (made once, on a thread of its own: until it is, over the member's).
    ``call``: the member's requests to the coordinator, each within a deadline."""

    def __init__(self, store: Any, member: str, call: Callable[..., Any]):
        self.store, self.member, self.call = store, member, call
        self.name = "fastreduce-pulse"
        self._lock = threading.Lock()
        self._stopping: threading.Event | None = None
        self._thread: threading.Thread | None = None
        self._said = False  # who/<member> written
        self._own: SecondConnection | None = None  # the connection of its own (made once, at the first up)

    def up(self) -> None:
        """Beat from now on (idempotent): the first beat and the record are written before
        this returns, so a reader never finds this member without them."""
        with self._lock:
            if self._stopping is not None and self._thread is not None and self._thread.is_alive():
                return  # (a thread told to stop and still in its last beat: a new one beats)
            if not self._said:
                self.call(self.store.set, who_key(self.member), process_identity.identity())
                self._said = True
            self.call(self.store.add, pulse_key(self.member), 1)
            if self._own is None:  # the member's requests (a long wait for admission) never delay a beat
                self._own = SecondConnection(self.store, max(5.0, 2 * faults.lost_after()), "fastreduce-pulse-connect")
            self._stopping = threading.Event()
            self._thread = threading.Thread(target=self._run, args=(self._stopping,), name=self.name, daemon=True)
            self._thread.start()
            own(self)

    def said_again(self) -> None:
        """This member's record and a beat written once more: another process clearing an
        earlier run of the job (:mod:`.reruns`) between this member's :meth:`up` and its ticket
        deleted them with that run's keys (after the ticket, such a clear no longer holds)."""
        self.call(self.store.set, who_key(self.member), process_identity.identity())
        self.call(self.store.add, pulse_key(self.member), 1)

    def down(self) -> None:
        """Stop beating (the epoch's heartbeat shows this member alive from here on)."""
        self.stop(timeout=0)

    def stop(self, timeout: float | None = None) -> bool:
        """Stop beating; wait up to ``timeout`` seconds for the thread to end (``0``: do not
        wait). ``False`` where it has not: it is inside a beat on a coordinator that does not
        answer (c10d's own timeout does not end a request on a silent link). Such a thread is
        still listed (:func:`~.lifecycle.running`; a later stop waits for it again) until it
        ends, and it un-lists itself then."""
        with self._lock:
            thread, stopping = self._thread, self._stopping
            self._stopping = None
        if stopping is not None:
            stopping.set()
        if thread is not None and timeout != 0 and thread is not threading.current_thread():
            thread.join(timeout)
        self._ended(thread)
        return thread is None or not thread.is_alive()

    def _ended(self, thread: threading.Thread | None) -> None:
        """Un-list this pulse where ``thread`` is its thread and has ended (or is this one, ending)."""
        with self._lock:
            if self._thread is thread and (thread is None or thread is threading.current_thread()
                                           or not thread.is_alive()):
                self._thread = None
                disown(self)

    def _run(self, stopping: threading.Event) -> None:
        beat = faults.heartbeat_interval()
        interval = beat if beat > 0 else 0.25  # (the heartbeat off, 0 or less: the pulse still beats)
        key = pulse_key(self.member)
        own = self._own  # (made before the first thread starts)
        while not stopping.wait(interval):
            try:
                (own.conn or self.store).add(key, 1)
            except Exception:  # noqa: BLE001 - the coordinator is gone: the member's own requests say so
                break
        self._ended(threading.current_thread())


class Watch:
    """One wait's view of other members' pulses (:class:`Pulse`): :meth:`lost` names those
    that stopped. ``call`` makes a request to the coordinator within a deadline (a
    :class:`~fastreduce.coordinator.CoordinatorLink`'s ``call``). ``beats``: an epoch's group
    store and the epoch, whose heartbeats count as a sign of life too (:func:`heartbeats`)."""

    def __init__(self, store: Any, call: Callable[..., Any], members: list[str],
                 beats: tuple[Any, Epoch] | None = None):
        self.store, self.call, self.members, self.beats = store, call, list(members), beats
        self.me = process_identity.identity()
        self.window = faults.lost_after()
        self.every = min(faults.heartbeat_interval() or 0.25, 0.25)  # between two reads of the pulses
        self.seen: dict[str, tuple[int, float]] = {}  # member -> (pulse, when it last moved)
        self.records: dict[str, str] = {}  # member -> its process's record ("" where none yet)
        self.read_at = self.looked_at = 0.0

    def exited(self) -> set[str]:
        """The watched members whose process ran on this host and has exited."""
        self._records()
        self.looked_at = time.monotonic()
        return {m for m, rec in self.records.items() if rec and exited_here(rec, self.me)}

    def lost(self) -> set[str]:
        """The watched members whose process exited on this host (looked at every
        :data:`EXIT_CHECK_S`) or whose pulse stood still for the loss window (read at most
        every heartbeat)."""
        now = time.monotonic()
        gone = self.exited() if now - self.looked_at >= EXIT_CHECK_S else set()
        if now - self.read_at < self.every:
            return gone
        self.read_at = now
        pulses = self._pulses()
        for m, n in pulses.items():
            if m not in self.seen or self.seen[m][0] != n:
                self.seen[m] = (n, now)
        for m, (_, since) in self.seen.items():
            quiet = now - since
            if quiet >= self.window and (quiet >= faults.LOCAL_GRACE * self.window
                                         or not process_identity.running_here(self.records.get(m, ""), self.me)):
                gone.add(m)
        return gone

    def _records(self) -> None:
        missing = [m for m in self.members if not self.records.get(m)]
        if not missing:
            return
        keys = [who_key(m) for m in missing]
        if self.call(self.store.check, keys):
            self.records.update(zip(missing, (v.decode() for v in self.call(faults_heartbeat.read_all, self.store, keys))))
        else:  # (a member that never beat: its pulse reads 0 below and stands still)
            for m, k in zip(missing, keys):
                if self.call(self.store.check, [k]):
                    self.records[m] = self.call(self.store.get, k).decode()

    def _pulses(self) -> dict[str, int]:
        counts = pulses(self.store, self.call, self.members)
        if self.beats is not None:  # (both only grow: their sum moves where either does)
            for m, n in heartbeats(*self.beats, self.call, self.members).items():
                counts[m] += n
        return counts


def heartbeats(store: Any, epoch: Epoch, call: Callable[..., Any], members: list[str]) -> dict[str, int]:
    """Each of ``members``' heartbeat count in ``epoch`` (``store``: its group's store)."""
    return {m: int(call(store.add, f"{faults_heartbeat.STORE_PREFIX}heartbeat/{epoch.members.index(m)}", 0))
            for m in members}


def pulses(store: Any, call: Callable[..., Any], members: list[str]) -> dict[str, int]:
    """Each member's pulse count (0 where it never beat): one request where all have beaten."""
    keys = [pulse_key(m) for m in members]
    if keys and call(store.check, keys):
        return dict(zip(members, (int(v) for v in call(faults_heartbeat.read_all, store, keys))))
    return {m: int(call(store.add, k, 0)) for m, k in zip(members, keys)}


def all_exited(store: Any, call: Callable[..., Any], members: list[str]) -> Callable[[], bool] | None:
    """Whether every one of ``members`` has exited, from their processes' records (read once,
    now): a check on this host alone (a process that ran here and is gone), or ``None`` where
    one has no record or the coordinator does not answer. An abandoned group's resources go
    once it says so (:func:`fastreduce.torch_internals.release_abandoned`)."""
    watch = Watch(store, call, members)
    try:
        watch.exited()  # (reads their records)
    except Exception:  # noqa: BLE001 - the coordinator unreachable: the groups' timeout then
        return None
    records, me = dict(watch.records), watch.me
    if not members or not all(records.get(m) for m in members):
        return None
    return lambda: all(exited_here(records[m], me) for m in members)
