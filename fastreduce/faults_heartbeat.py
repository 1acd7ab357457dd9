"""The heartbeat (:mod:`fastreduce.faults`): a daemon thread of every process adds 1 to its
counter in the job's c10d store, on a connection of its own; its settings, and the reads of
the counters that the watchdog and the diagnosis make.
"""

from __future__ import annotations

import json
import logging
import os
import threading
import time
import weakref
from typing import Any, Callable

import torch.distributed as dist

from .faults_errors import TransportError
from .lifecycle import RESTING, Worker, disown, own
from .process_identity import exited_here, identity, running_here, served_here
from .reach import SecondConnection
from .torch_internals import default_store

__all__ = ["HEARTBEAT_ENV", "LOCAL_GRACE", "LOST_AFTER_ENV", "WATCHED_SUCCESSORS", "StoreCaller", "group_token",
           "Heartbeat", "STORE_PREFIX", "default_interval", "heartbeat_interval", "heartbeat_now", "lost_after", "note_lost", "read_all",
           "start_heartbeat", "stop_leaving"]

HEARTBEAT_ENV = "FASTREDUCE_HEARTBEAT_S"
"""Seconds between two heartbeats of a process (default 1; 0 or less: no heartbeat)."""
LOST_AFTER_ENV = "FASTREDUCE_LOST_AFTER_S"
"""Seconds a diagnosis waits for a silent rank's heartbeat before calling it lost
(default 3 heartbeats)."""
WATCHED_SUCCESSORS = 32
"""How many ring successors each rank's readers watch (ranks ``r+1 .. r+k`` mod N): the
watchdog, a Membership vote's wait and the diagnosis read only these counters, plus the
``fastreduce/lost`` key where the watchers of a lost rank publish it (so every rank still
learns of a loss within one more read). Reading every counter costs the store 2N keys per
read per rank: at 1,024 ranks on a Membership's schedule (a read every 0.25 s) ~8M keys/s,
about 4 cores of a TCPStore server, which is single-threaded: it saturates and calls live
ranks lost (fastreduce/bench/store.py). With k successors it is k + 1 keys per read. Every
rank still has k watchers, so a loss is seen unless k + 1 consecutive ranks are lost, and
even then the first live rank before them sees its lost successor (below). In a world of
up to k + 1 ranks every rank reads every counter, as before."""
LOCAL_GRACE = 10
"""A silent rank whose process runs on this host (same host name, network and pid
namespaces; neither stopped nor a zombie: :func:`~.process_identity.running_here`) is
waited for this many loss windows before it is called lost: there a late heartbeat is a
process starved of its share of the cores (64 ranks on 2 cores took more than 3 s), not a
lost one; a process that dies or stops meanwhile is called lost at the next read. The same
goes for the store: one served at an address of this host's network namespace
(:func:`~.process_identity.served_here`) is given this many windows to answer a read (a
Membership of 64 members on 2 cores: 39 of them stopped after its 1 s), since no link
between can be cut; elsewhere, one window."""
STORE_PREFIX = "fastreduce/"

log = logging.getLogger("fastreduce")


# ---------------------------------------------------------------------- settings

_interval_default = 1.0


def heartbeat_interval() -> float:
    """``$FASTREDUCE_HEARTBEAT_S``; where it is unset, 1 s, or what this process's
    :class:`~fastreduce.Membership` asked for (:func:`default_interval`)."""
    return _env_seconds(HEARTBEAT_ENV, _interval_default)


def default_interval(seconds: float) -> None:
    """The heartbeat period of this process where ``$FASTREDUCE_HEARTBEAT_S`` is unset (a
    Membership's: a member lost must end a step within a second or two). The environment
    is left as it is, so no child process inherits it."""
    global _interval_default
    _interval_default = float(seconds)


def lost_after() -> float:
    """``$FASTREDUCE_LOST_AFTER_S`` (default: 3 heartbeats, at least 1 s)."""
    return _env_seconds(LOST_AFTER_ENV, max(1.0, 3 * heartbeat_interval()))


def _env_seconds(name: str, default: float) -> float:
    raw = os.environ.get(name)
    if not raw:
        return default
    try:
        return float(raw)
    except ValueError:
        raise ValueError(f"${name} must be a number of seconds, got {raw!r}") from None


# ---------------------------------------------------------------------- heartbeat

def read_all(store: Any, keys: list[str]) -> list[bytes]:
    """The values of ``keys``, every one of which is set (a missing one would be waited
    for): one request where the store has ``multi_get`` (torch >= 2.5), else one a key."""
    multi_get = getattr(store, "multi_get", None)
    return multi_get(keys) if multi_get is not None else [store.get(k) for k in keys]


class StoreCaller(Worker):
    """Store requests with a deadline, made on a thread of their own (a :class:`~.lifecycle.Worker`).

    A ``TCPStore`` client whose link went silent (a partition: no reset, no error) blocks
    in its request far past its own timeout (measured: over 100 s with a 5 s timeout), so
    a thread that must decide in seconds never makes the request itself: it hands it to
    this caller's thread and waits at most ``seconds``. A request still blocked there
    makes every later one fail at its deadline too (the store is unreachable). Also the
    thread that waits for collectives without futures (:func:`~.faults_watchdog.waiter`)."""

    def close(self) -> None:
        """End the thread once the requests queued before are done (not waited for)."""
        self.stop(timeout=0)

    def submit(self, fn: Callable[..., Any], *args: Any) -> tuple[threading.Event, list[Any]]:
        """Queue ``fn(*args)``; the event is set once its result (or error) is in the list."""
        done, box = threading.Event(), []

        def run() -> None:
            try:
                box.append(fn(*args))
            except BaseException as err:  # noqa: BLE001 - handed to the caller
                box.append(err)
            done.set()

        self.put(run)
        return done, box

    def call(self, fn: Callable[..., Any], *args: Any, seconds: float) -> Any:
        done, box = self.submit(fn, *args)
        if not done.wait(seconds):
            raise TransportError(f"fastreduce: the job's c10d store did not answer within {seconds:g} s (its host, "
                                 "or the link to it, is down)")
        if isinstance(box[0], BaseException):
            raise box[0]
        return box[0]


class Heartbeat:
    """This process's heartbeat thread and its own connection to the job's store."""

    _known_keys: list[str] | None = None  # the counters' keys known to exist (:meth:`counts`)
    rests = True  # lifecycle.shutdown() tells its stop() whether this rank rests or leaves

    def __init__(self, default: Any, interval: float, connection: Any = None):
        # The default store by a weak reference: holding it would keep rank 0's store server
        # alive after destroy_process_group(); and an id can come back as a later group's
        # store at the same address (a Membership's next epoch then went on with the last
        # epoch's heartbeat, its lost ranks and its counters, and named a live member lost).
        self.default, self.interval = weakref.ref(default), interval  # (a group_token of its group)
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        self.store_windows = LOCAL_GRACE if served_here(default) else 1  # a read's deadline, in loss windows
        self.store = default  # until its own connection is made (:meth:`_connect`)
        self.caller = StoreCaller("fastreduce-store")  # the watchdog's and diagnosis's reads, bounded
        self.lost: dict[int, tuple[str, dict[int, str]]] = {}  # known lost rank -> (how, who)
        # whether the host waits inside a collective (Gloo), where :func:`wait_watched` watches
        self.host_waits = dist.get_backend() == "gloo"
        self.me = identity()  # what running_here compares a peer's registration with
        default.set(f"{STORE_PREFIX}host/{self.rank}", self.me)
        if default.add(self.key, 1) >= RESTING:  # it rested (lifecycle.shutdown): awake again
            default.add(self.key, -RESTING)
        self.name, self._stopping = "fastreduce-heartbeat", threading.Event()
        # a connection of its own for the beats and reads: never queued behind a long wait on
        # the group's; its timeout past the reads' deadline (the deadline decides). ``connection``:
        # the group's store on one its caller made and keeps (a Membership's, one for every epoch);
        # else made apart (reach.SecondConnection: it can take 10 s), the rank beating meanwhile.
        self._own: SecondConnection | None = None
        if connection is not None:
            self.store, self.connected = connection, threading.Event()
            self.connected.set()
        else:
            self._own = SecondConnection(default, max(5.0, 2 * lost_after()) * self.store_windows,
                                         "fastreduce-store-connect", then=self._take)
            self.connected = self._own.done
        """Set once the beats and reads go over a connection of their own (or it could not be made)."""
        self.thread = threading.Thread(target=self._run, name=self.name, daemon=True)
        self.thread.start()
        own(self)

    @classmethod
    def simulated(cls, store: Any, rank: int, world: int, interval: float, me: str) -> "Heartbeat":
        """A heartbeat of ``rank`` of ``world`` that is not this process's (``fastreduce bench
        store`` runs many in one process, with no process group): ``store`` is its connection
        of its own already, it counts as current whatever the default group, its thread is
        not started (the caller runs :meth:`_run`), registered as ``__init__`` registers a rank."""
        beat = cls.__new__(cls)
        beat.default, beat.interval, beat.rank, beat.world, beat.me = None, interval, rank, world, me
        beat.store, beat.store_windows, beat.lost, beat.host_waits = store, 1, {}, True
        beat.caller = StoreCaller("bench-store")
        beat.name, beat._stopping = "bench-heartbeat", threading.Event()
        beat._own, beat.connected = None, threading.Event()  # (its caller owns ``store``)
        beat.connected.set()
        store.set(f"{STORE_PREFIX}host/{rank}", me)
        store.add(beat.key, 1)
        return beat

    @property
    def key(self) -> str:
        return f"{STORE_PREFIX}heartbeat/{self.rank}"

    def _take(self, own: Any) -> None:
        """Beat and read over ``own`` from now on (its own connection, made), unless stopped."""
        if own is not None and not self._stopping.is_set() and self.store is self.default():
            self.store = own  # (one assignment: a reader takes the one or the other)

    def _run(self) -> None:
        while not self._stopping.wait(self.interval):
            if not self.current():  # destroyed, or another group's
                break
            try:
                self.store.add(self.key, 1)
            except Exception:  # noqa: BLE001 - the store is gone: so is the job
                break
        _forget(self)
        disown(self)
        self.caller.close()  # its thread and this connection end with the heartbeat (one per group made)
        if self._own is not None:
            self._own.close()

    def stop(self, timeout: float | None = None, rest: bool = True) -> bool:
        """Stop beating (:func:`~.lifecycle.shutdown`); ``rest``: the counter rests
        (:data:`~.lifecycle.RESTING`), so no watcher calls this rank lost for its silence
        (mid-run); without it (the process is leaving) its silence reads as a loss, as a crash's would."""
        global _beat
        self._stopping.set()
        if self.thread is not threading.current_thread():
            self.thread.join(timeout)
            if self._own is not None:
                self._own.wait(0 if timeout is None else timeout)  # (a stopped one takes no connection it makes)
        with _lock:
            if _beat is self:
                _beat = None
        if rest and self.current():
            try:
                self.caller.call(self.store.add, self.key, RESTING, seconds=max(lost_after(), 1.0))
            except Exception:  # noqa: BLE001 - the store is gone: no one is left to watch
                pass
        self.caller.stop(timeout)
        return not self.thread.is_alive()

    def current(self) -> bool:
        """Whether this heartbeat's group is still this process's default group (a
        :meth:`simulated` one's always is)."""
        return self.default is None or _is_current(self.default)

    def call(self, fn: Callable[..., Any], *args: Any) -> Any:
        """``fn(*args)`` (a read of the store) within the loss window (:data:`LOCAL_GRACE` of
        them where the store is served on this host), else :class:`TransportError`."""
        return self.caller.call(fn, *args, seconds=max(lost_after(), 1.0) * self.store_windows)

    def mark_lost(self, ranks: Any, how: str, who: dict[int, str], publish: bool = True) -> None:
        """Remember ``ranks`` as lost (the first word on a rank stays) and, found here
        (``publish``), tell the other ranks through the store (:meth:`verdict`). A rank
        can only see a peer go quiet: once a survivor has raised and exited, a rank that
        was waiting on it (a ring's next rank) would see it quiet too, and name it."""
        new = sorted(r for r in ranks if r not in self.lost)
        for r in ranks:
            self.lost.setdefault(r, (how, {r: who[r]} if who.get(r) else {}))
        if new and publish:
            try:
                self.call(self._publish, {"by": self.rank, "ranks": new, "how": how,
                                          "who": {str(r): who[r] for r in new if who.get(r)}})
            except Exception:  # noqa: BLE001 - best effort: the others then look for themselves
                pass

    def _publish(self, mine: dict[str, Any]) -> None:
        """Add ``mine`` to the ranks published on ``fastreduce/lost``: the key holds the union
        of every publisher's (the first one's ``by`` and ``how``), written by compare-and-set,
        so watchers of different lost ranks publishing at once lose none of them."""
        key, expected, value = f"{STORE_PREFIX}lost", "", json.dumps(mine)
        for _ in range(16):  # each retry: another publisher's record landed in between
            got = self.store.compare_set(key, expected, value)
            got = got.decode() if isinstance(got, bytes) else got
            if got == value:
                return
            found = json.loads(got)
            if set(mine["ranks"]) <= set(found["ranks"]):
                return
            expected = got
            value = json.dumps({**found, "ranks": sorted(set(found["ranks"]) | set(mine["ranks"])),
                                "who": {**mine["who"], **found["who"]}})

    def verdict(self) -> tuple[list[int], str, dict[int, str]] | None:
        """The ranks other ranks found lost and published (:meth:`mark_lost`), if any:
        ``(ranks, how, who)``; ``None`` where only this rank's own finding is there."""
        key = f"{STORE_PREFIX}lost"
        if not self.store.check([key]):
            return None
        found = json.loads(self.store.get(key))
        if found["by"] == self.rank and all(r in self.lost for r in found["ranks"]):
            return None
        return (found["ranks"], f"{found['how']}; found by rank {found['by']}",
                {int(r): w for r, w in found["who"].items()})

    def watched(self) -> list[int]:
        """The ranks whose counters this rank reads: every rank (its own too) in a world of up
        to :data:`WATCHED_SUCCESSORS` + 1, else its next :data:`WATCHED_SUCCESSORS` on the ring."""
        k = WATCHED_SUCCESSORS
        if self.world <= k + 1:
            return list(range(self.world))
        return [(self.rank + i) % self.world for i in range(1, k + 1)]

    def counts(self) -> dict[int, int]:
        """The watched ranks' heartbeat counters (:meth:`watched`), by rank. Where this rank
        watches only successors, the keys' ``check`` is made once: a counter exists from its
        rank's start (``__init__`` adds 1 before anyone can wait on that rank), a missing one
        is made here (``add(k, 0)``), and none is ever deleted; so after one read every key
        read exists, and ``multi_get`` (which would wait for a missing key) reads them alone."""
        ranks = self.watched()
        keys = [f"{STORE_PREFIX}heartbeat/{r}" for r in ranks]
        multi_get = getattr(self.store, "multi_get", None)  # one round trip (torch >= 2.5)
        if multi_get is not None and self._known_keys == keys:
            return dict(zip(ranks, (int(v) for v in multi_get(keys))))
        if multi_get is not None and self.store.check(keys):
            got = [int(v) for v in multi_get(keys)]
        else:
            got = [self.store.add(k, 0) for k in keys]
        if len(ranks) < self.world - 1:  # successors only (a small world reads as it always did)
            self._known_keys = keys
        return dict(zip(ranks, got))

    def records(self, ranks: list[int]) -> dict[int, str]:
        """The ranks' registrations (:func:`~.process_identity.identity`), where the store has
        them: two requests where every one is there (``multi_get``, torch >= 2.5), else two a rank."""
        keys = [f"{STORE_PREFIX}host/{r}" for r in ranks]
        try:
            if keys and self.store.check(keys):
                return {r: v.decode() for r, v in zip(ranks, read_all(self.store, keys))}
        except Exception:  # noqa: BLE001 - best effort: one by one below
            pass
        out = {}
        for r in ranks:
            key = f"{STORE_PREFIX}host/{r}"
            try:
                if self.store.check([key]):
                    out[r] = self.store.get(key).decode()
            except Exception:  # noqa: BLE001 - best effort
                pass
        return out

    def silent(self, seen: dict[int, tuple[int, float]], window: float, records: dict[int, str]) -> list[int]:
        """A watcher's read (the watchdog's, a Membership vote's): ``seen`` (rank -> its
        counter and when it last moved) updated from the counters now; the ranks silent for
        ``window`` (:data:`LOCAL_GRACE` windows where their process runs here)."""
        now, counts = time.monotonic(), self.call(self.counts)
        for r, c in counts.items():
            if r != self.rank and (r not in seen or seen[r][0] != c or c >= RESTING):  # at rest: not silent
                seen[r] = (c, now)
        silent = [r for r, (_, since) in seen.items() if now - since >= window]
        slow = self.slow_here(silent, records) if silent else []
        return sorted(r for r in silent if r not in slow or now - seen[r][1] >= LOCAL_GRACE * window)

    def registered(self, ranks: list[int], records: dict[int, str]) -> dict[int, str]:
        """``ranks``' registrations from the cache ``records``, those not in it read first
        (``""`` where the store has none)."""
        missing = [r for r in ranks if r not in records]
        if missing:
            records.update({r: "" for r in missing})
            records.update(self.call(self.records, missing))
        return {r: records[r] for r in ranks}

    def exited(self, ranks: list[int], records: dict[int, str]) -> list[int]:
        """Of ``ranks``, those whose process ran on this host and has exited (seen at once, no
        window waited: a crash, an OOM kill); ``records``: the registrations' cache."""
        return [r for r, rec in self.registered(ranks, records).items() if rec and exited_here(rec, self.me)]

    def slow_here(self, ranks: list[int], records: dict[int, str]) -> list[int]:
        """Of ``ranks``, those running on this host (:data:`LOCAL_GRACE`); ``records``: the
        registrations' cache (:meth:`registered`)."""
        return [r for r, rec in self.registered(ranks, records).items() if running_here(rec, self.me)]


_lock = threading.Lock()
_beat: Heartbeat | None = None


def heartbeat_now() -> Heartbeat | None:
    """This process's heartbeat, where one beats (its group may have ended since)."""
    return _beat


def stop_leaving(timeout: float) -> None:
    """Stop this process's heartbeat as a leaving rank's: its silence then reads as a loss
    to the others, as a crash's would (:meth:`Heartbeat.stop`); none beating: nothing."""
    beat = _beat
    if beat is not None:
        beat.stop(timeout, rest=False)


def _forget(beat: Heartbeat) -> None:
    global _beat
    with _lock:
        if _beat is beat and not beat.current():
            _beat = None


def start_heartbeat(connection: Any = None) -> None:
    """Start this process's heartbeat (idempotent; a no-op without a process group of
    more than one rank, or with ``$FASTREDUCE_HEARTBEAT_S`` <= 0). Called by
    :func:`~fastreduce.comm.get_comm`; ``connection``: the default group's store on a
    connection its caller keeps, to beat over (:class:`Heartbeat`)."""
    global _beat
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return
    default = default_store()
    beat = _beat
    if default is None or (beat is not None and beat.current()):
        return
    interval = heartbeat_interval()
    if interval <= 0:
        return
    with _lock:
        if _beat is None or not _beat.current():
            try:
                _beat = Heartbeat(default, interval, connection)
            except Exception as err:  # noqa: BLE001 - no heartbeat: diagnosis then finds nothing
                log.warning("fastreduce: this rank's heartbeat did not start (%s: %s): a rank lost in this group is "
                            "found by the group's timeout only", type(err).__name__, err)
                _beat = None


def group_token() -> Any:
    """This process's default group as its heartbeat knows it (a weak reference to the
    group's store; ``None`` without a group): what a transport built for the group hands
    back to :func:`note_lost`."""
    store = default_store()
    return weakref.ref(store) if store is not None else None


def _is_current(token: Any) -> bool:
    """Whether the group of ``token`` (:func:`group_token`) is still this process's default one."""
    store = token() if token is not None else None
    return store is not None and store is default_store()


def note_lost(lost: dict[int, str], how: str, group: Any) -> None:
    """Remember ranks found lost another way (the shared-memory transport's pid check; a
    Membership member's own finding, published for the members still waiting: a peer's
    exited process, a member silent at the vote) by the transport or member that holds
    ``group`` (its :func:`group_token`), if that group is still
    this process's default one. A Membership's earlier epoch's transport may still wait
    on its segment after the next epoch's heartbeat started; its ranks are that group's,
    and noted here they named a live member of the new group lost (gossip, the chaos kill
    matrix: a second "loss" four steps after the real one)."""
    beat = _beat
    if beat is not None and beat.current() and _is_current(group):  # both the default group's: the same
        beat.mark_lost(lost, how, lost)
