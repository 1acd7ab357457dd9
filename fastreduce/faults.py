"""Lost ranks: a heartbeat per process, a diagnosis when a collective fails, :class:`RankLostError`.

When a rank's process dies mid-step, the survivors' collectives fail: Gloo at once
("Connection closed by peer") or at the process group's timeout, the shared-memory
transport within about a second (it watches the ranks' pids, :mod:`.comm.shm`). Such an
error names no rank, or the wrong one (whichever peer a survivor happened to read
from). fastreduce turns it into a :class:`RankLostError` that names the lost ranks and
says what the failed call left behind:

* **heartbeat**: from the first :class:`~fastreduce.comm.Comm` on, a daemon thread of
  every process adds 1 to ``fastreduce/heartbeat/<global rank>`` in the job's c10d store
  (the one ``init_process_group`` rendezvoused through; a connection of its own, cloned
  from it) every ``$FASTREDUCE_HEARTBEAT_S`` seconds (default 1; ``0`` turns it off),
  and registers ``"<host> <pid> <namespaces> <start>"`` once. One small store request per second per rank;
  it stops by itself when the process group is destroyed or the store is gone.
* **diagnosis** (:func:`diagnose`), only after a collective failed: read the counters
  this rank watches (:data:`WATCHED_SUCCESSORS`: every rank's in a world of up to 33), wait
  until each has moved again or ``$FASTREDUCE_LOST_AFTER_S`` (default 3 heartbeats) has
  passed; the ranks whose counter did not move are lost, and published on
  ``fastreduce/lost`` for the ranks that do not watch them. A silent rank whose process
  this one can see running (the same host and namespaces) is given :data:`LOCAL_GRACE`
  windows: many ranks on few cores are slow to beat, not lost. If the store
  itself stops answering and it lives in rank 0's process (``init_process_group``
  through ``MASTER_ADDR``, not torchrun's agent store), rank 0 is the lost one. A lost
  rank stays known: a later failing call raises at once.
* **watchdog** (:func:`wait_watched`): a partition (a host's link down, its process
  alive) fails no Gloo collective before the group's timeout; so the modes' waits on
  Gloo collectives read the watched counters (and ``fastreduce/lost``) while they last,
  and name a rank silent for ``$FASTREDUCE_LOST_AFTER_S`` at once.
* **guard** (:func:`guard`, :func:`guarded`): wraps each mode's calls that wait on
  collectives; a transport failure whose diagnosis finds a lost rank is re-raised as a
  :class:`RankLostError` with the mode's statement of what its state now is; any other
  error goes through unchanged.

So a survivor raises within the transport's detection time (Gloo: at once for a dead
peer, at most the process group's timeout) plus ``$FASTREDUCE_LOST_AFTER_S``.
"""

from __future__ import annotations

import atexit
import functools
import json
import os
import socket
import threading
import time
import weakref
from contextlib import contextmanager
from datetime import timedelta
from typing import Any, Callable, Iterator, TypeVar

import torch
import torch.distributed as dist

from .lifecycle import RESTING, Worker, disown, own

__all__ = ["HEARTBEAT_ENV", "LOCAL_GRACE", "LOST_AFTER_ENV", "WATCHED_SUCCESSORS", "RankLostError", "StoreCaller", "TransportError",
           "all_reduce_watched", "diagnose", "exited_here", "group_timeout", "group_token", "guard", "guarded",
           "heartbeat_interval", "lost_after", "note_lost", "start_heartbeat", "wait_watched"]

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
namespaces; neither stopped nor a zombie: :func:`_running_here`) is waited for this many
loss windows before it is called lost: there a late heartbeat is a process starved of its
share of the cores (64 ranks on 2 cores took more than 3 s), not a lost one; a process that
dies or stops meanwhile is called lost at the next read. The same goes for the store: one
served at an address of this host's network namespace (:func:`_served_here`) is given this
many windows to answer a read (a Membership of 64 members on 2 cores: 39 of them stopped
after its 1 s), since no link between can be cut; elsewhere, one window."""
DEFAULT_TIMEOUT_S = 1800.0  # torch's default process-group timeout
RESTART = ("Restart from the last checkpoint (fastreduce.checkpoint); under torchrun, "
           "--max-restarts=N restarts the job by itself.")
_KEY = "fastreduce/"
# Words of the transports' failures (Gloo raises plain RuntimeErrors; NCCL and the
# stores DistErrors): only such errors are diagnosed, a user error goes through at once.
_MARKERS = ("gloo", "nccl", "hccl", "connection", "closed by peer", "timed out", "broken pipe", "socket")

F = TypeVar("F", bound=Callable[..., Any])


class TransportError(RuntimeError):
    """A collective of fastreduce's own transport (shared memory) failed; the guard
    diagnoses it like a process group's failure."""


class RankLostError(RuntimeError):
    """A rank of the job was lost (its process died, or its host went away) while this
    rank waited on a collective with it.

    Attributes:
        ranks: the lost global ranks, sorted.
        where: the fastreduce call that failed (``"ZeroOptimizer.step()"``), or ``None``
            when raised below the modes.
        state: what that call left behind (gradients, parameters), in words.
        how: how the loss was seen (heartbeat, exited pid, the store).
        world: the job's world size.
        who: per lost rank, ``"pid P on host H"`` where known.
    """

    def __init__(self, ranks: list[int], where: str | None = None, state: str | None = None,
                 how: str = "", world: int | None = None, who: dict[int, str] | None = None):
        self.ranks, self.where, self.state, self.how = sorted(ranks), where, state, how
        self.world, self.who = world, dict(who or {})
        super().__init__(self._message())

    def __reduce__(self) -> tuple:
        return (type(self), (self.ranks, self.where, self.state, self.how, self.world, self.who))

    def _message(self) -> str:
        of = f" of {self.world}" if self.world else ""
        names = ", ".join(f"{r}" + (f" ({self.who[r]})" if self.who.get(r) else "") for r in self.ranks)
        head = (f"fastreduce: rank {names}{of} was lost" if len(self.ranks) == 1 else
                f"fastreduce: ranks {names}{of} were lost")
        head += f" during {self.where}" if self.where else ""
        head += f": {self.how}." if self.how else "."
        return " ".join(s for s in (head, self.state, RESTART) if s)

    def at(self, where: str, state: str) -> RankLostError:
        """The same loss, as seen by the call ``where`` that leaves ``state``."""
        return RankLostError(self.ranks, where, state, self.how, self.world, self.who)


# ---------------------------------------------------------------------- settings

def heartbeat_interval() -> float:
    """``$FASTREDUCE_HEARTBEAT_S`` (default 1 s)."""
    return _env_seconds(HEARTBEAT_ENV, 1.0)


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


def group_timeout(group: dist.ProcessGroup | None = None) -> float:
    """The process group's collective timeout in seconds (what ``init_process_group`` or
    ``new_group`` got as ``timeout``), or torch's default of 1800 s where this torch does
    not expose it."""
    pg = group or dist.group.WORLD
    for device in ("cpu", "cuda", "hpu"):
        try:
            timeout = pg._get_backend(torch.device(device)).options._timeout
        except Exception:  # noqa: BLE001 - no such backend here, or an older torch
            continue
        if isinstance(timeout, timedelta) and timeout.total_seconds() > 0:
            return timeout.total_seconds()
    timeout = getattr(getattr(pg, "options", None), "_timeout", None)
    if isinstance(timeout, timedelta) and timeout.total_seconds() > 0:
        return timeout.total_seconds()
    return DEFAULT_TIMEOUT_S


# ---------------------------------------------------------------------- heartbeat

def _default_store() -> Any:
    try:
        return dist.distributed_c10d._get_default_store()
    except Exception:  # noqa: BLE001 - not initialized, or destroyed
        return None


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
    thread that waits for collectives without futures (:func:`_waiter`)."""

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


class _Heartbeat:
    """This process's heartbeat thread and its own connection to the job's store."""

    _known_keys: list[str] | None = None  # the counters' keys known to exist (:meth:`counts`)
    rests = True  # lifecycle.shutdown() tells its stop() whether this rank rests or leaves

    def __init__(self, default: Any, interval: float):
        # The default store by a weak reference: holding it would keep rank 0's store server
        # alive after destroy_process_group(); and an id can come back as a later group's
        # store at the same address (a Membership's next epoch then went on with the last
        # epoch's heartbeat, its lost ranks and its counters, and named a live member lost).
        self.default, self.interval = weakref.ref(default), interval  # (a group_token of its group)
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        self.store_windows = LOCAL_GRACE if _served_here(default) else 1  # a read's deadline, in loss windows
        try:  # a connection of its own: never queued behind a long wait of Gloo's on the store
            store = default.clone()  # its own timeout past the reads' deadline (the deadline decides)
            store.set_timeout(timedelta(seconds=max(5.0, 2 * lost_after()) * self.store_windows))
        except Exception:  # noqa: BLE001 - an older torch, or a store that cannot clone
            store = default
        self.store = store
        self.caller = StoreCaller("fastreduce-store")  # the watchdog's and diagnosis's reads, bounded
        self.lost: dict[int, tuple[str, dict[int, str]]] = {}  # known lost rank -> (how, who)
        # whether the host waits inside a collective (Gloo), where :func:`wait_watched` watches
        self.host_waits = dist.get_backend() == "gloo"
        self.me = _identity()  # what _running_here compares a peer's registration with
        store.set(f"{_KEY}host/{self.rank}", self.me)
        if store.add(self.key, 1) >= RESTING:  # it rested (lifecycle.shutdown): awake again
            store.add(self.key, -RESTING)
        self.name, self._stopping = "fastreduce-heartbeat", threading.Event()
        self.thread = threading.Thread(target=self._run, name=self.name, daemon=True)
        self.thread.start()
        own(self)

    @property
    def key(self) -> str:
        return f"{_KEY}heartbeat/{self.rank}"

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

    def stop(self, timeout: float | None = None, rest: bool = True) -> bool:
        """Stop beating (:func:`~.lifecycle.shutdown`); ``rest``: the counter rests
        (:data:`~.lifecycle.RESTING`), so no watcher calls this rank lost for its silence
        (mid-run); without it (the process is leaving) its silence reads as a loss, as a crash's would."""
        global _beat
        self._stopping.set()
        if self.thread is not threading.current_thread():
            self.thread.join(timeout)
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
        """Whether this heartbeat's group is still this process's default group."""
        return _is_current(self.default)

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
        key, expected, value = f"{_KEY}lost", "", json.dumps(mine)
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
        key = f"{_KEY}lost"
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
        keys = [f"{_KEY}heartbeat/{r}" for r in ranks]
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
        """The ranks' registrations (:func:`_identity`), where the store has them: two
        requests where every one is there (``multi_get``, torch >= 2.5), else two a rank."""
        keys = [f"{_KEY}host/{r}" for r in ranks]
        try:
            if keys and self.store.check(keys):
                return {r: v.decode() for r, v in zip(ranks, read_all(self.store, keys))}
        except Exception:  # noqa: BLE001 - best effort: one by one below
            pass
        out = {}
        for r in ranks:
            key = f"{_KEY}host/{r}"
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
        return [r for r, rec in self.registered(ranks, records).items() if _running_here(rec, self.me)]


def _who(records: dict[int, str]) -> dict[int, str]:
    """``"pid P on host H"`` of each rank's registration (:func:`_identity`), where it has one."""
    return {r: "pid {1} on host {0}".format(*rec.split()) for r, rec in records.items() if len(rec.split()) >= 2}


def _identity() -> str:
    """This process as its peers find it: ``"<host> <pid> <network ns> <pid ns> <start>"``
    (the namespaces' inodes, the start time in clock ticks since boot; ``-`` where unknown)."""
    def read(what: Callable[[], Any]) -> str:
        try:
            return str(what())
        except (OSError, IndexError, ValueError):
            return "-"
    ns = [read(lambda k=k: os.stat(f"/proc/self/ns/{k}").st_ino) for k in ("net", "pid")]
    return " ".join([socket.gethostname(), str(os.getpid()), *ns, read(lambda: _stat(os.getpid())[19])])


def _stat(pid: int | str) -> list[str]:
    """``/proc/<pid>/stat``'s fields from the state on (the name, which may hold spaces, cut off)."""
    with open(f"/proc/{pid}/stat") as f:
        return f.read().rsplit(")", 1)[1].split()


def _running_here(record: str, me: str | None = None) -> bool:
    """Whether the process ``record`` (:func:`_identity`) names is one this process (``me``:
    its own registration, read here if not given) can see run: the same host, network and
    pid namespaces, that pid started then, and neither stopped nor a zombie."""
    fields, mine = record.split(), (me or _identity()).split()
    if len(fields) != 5 or "-" in fields or [fields[0], *fields[2:4]] != [mine[0], *mine[2:4]]:
        return False
    try:
        now = _stat(fields[1])
    except (OSError, IndexError):
        return False
    return now[0] not in ("T", "t", "Z", "X") and now[19] == fields[4]


def exited_here(record: str, me: str) -> bool:
    """Whether the process ``record`` (:func:`_identity`) names ran in
    this host's network and pid namespaces (``me``: this process's record) and has exited
    since: no such pid, another process under it, or a zombie. ``False`` where it cannot
    tell (another host, an unreadable record)."""
    fields, mine = record.split(), me.split()
    if len(fields) != 5 or "-" in fields or [fields[0], *fields[2:4]] != [mine[0], *mine[2:4]]:
        return False
    try:
        now = _stat(fields[1])
    except (OSError, IndexError):
        return True  # no such process
    return now[0] in ("Z", "X") or now[19] != fields[4]


def _served_here(store: Any) -> bool:
    """Whether ``store`` (a ``TCPStore``, or a ``PrefixStore`` over one) is served at an
    address of this process's own network namespace: one this process could bind."""
    while hasattr(store, "underlying_store"):
        store = store.underlying_store
    host = getattr(store, "host", None)
    if not host:
        return False
    try:
        addresses = {info[4][0] for info in socket.getaddrinfo(host, None, proto=socket.IPPROTO_TCP)}
    except OSError:
        return False
    for address in addresses:
        family = socket.AF_INET6 if ":" in address else socket.AF_INET
        try:
            with socket.socket(family, socket.SOCK_STREAM) as probe:
                probe.bind((address, 0))
            return True
        except OSError:
            continue
    return False


_lock = threading.Lock()
_beat: _Heartbeat | None = None


def _forget(beat: _Heartbeat) -> None:
    global _beat
    with _lock:
        if _beat is beat and not beat.current():
            _beat = None


def start_heartbeat() -> None:
    """Start this process's heartbeat (idempotent; a no-op without a process group of
    more than one rank, or with ``$FASTREDUCE_HEARTBEAT_S`` <= 0). Called by
    :func:`~fastreduce.comm.get_comm`."""
    global _beat
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return
    default = _default_store()
    beat = _beat
    if default is None or (beat is not None and beat.current()):
        return
    interval = heartbeat_interval()
    if interval <= 0:
        return
    with _lock:
        if _beat is None or not _beat.current():
            try:
                _beat = _Heartbeat(default, interval)
            except Exception:  # noqa: BLE001 - no heartbeat: diagnosis then finds nothing
                _beat = None


def _store_host_rank() -> int | None:
    """The rank whose process hosts the job's store: rank 0 when ``init_process_group``
    made a TCP store itself; ``None`` under torchrun's agent store or another store."""
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE", "").lower() in ("1", "true"):
        return None
    store = _default_store()
    base = getattr(store, "_underlying_non_prefix_store", None)
    if base is not None and not isinstance(base, dist.TCPStore):
        return None
    return 0


def group_token() -> Any:
    """This process's default group as its heartbeat knows it (a weak reference to the
    group's store; ``None`` without a group): what a transport built for the group hands
    back to :func:`note_lost`."""
    store = _default_store()
    return weakref.ref(store) if store is not None else None


def _is_current(token: Any) -> bool:
    """Whether the group of ``token`` (:func:`group_token`) is still this process's default one."""
    store = token() if token is not None else None
    return store is not None and store is _default_store()


def note_lost(lost: dict[int, str], how: str, group: Any) -> None:
    """Remember ranks found lost another way (the shared-memory transport's pid check) by
    the transport built for ``group`` (its :func:`group_token`), if that group is still
    this process's default one. A Membership's earlier epoch's transport may still wait
    on its segment after the next epoch's heartbeat started; its ranks are that group's,
    and noted here they named a live member of the new group lost (gossip, the chaos kill
    matrix: a second "loss" four steps after the real one)."""
    beat = _beat
    if beat is not None and beat.current() and _is_current(group):  # both the default group's: the same
        beat.mark_lost(lost, how, lost)


def diagnose(wait: float | None = None) -> tuple[list[int], str, dict[int, str]]:
    """Which ranks are lost: ``(ranks, how, who)``, ``ranks`` empty when none is (or
    when this process has no heartbeat to tell). Waits up to ``wait`` seconds
    (default :func:`lost_after`) for every watched rank's heartbeat to move; returns as
    soon as all have (in a world of more than :data:`WATCHED_SUCCESSORS` + 1, not before
    the window: see :func:`_silent`). Ranks found lost once are answered at once from then on."""
    beat = _beat
    if beat is None or not beat.current():
        return [], "", {}
    return _diagnose(beat, lost_after() if wait is None else wait)


def _diagnose(beat: _Heartbeat, wait: float) -> tuple[list[int], str, dict[int, str]]:
    """:func:`diagnose` by ``beat``'s rank."""
    if beat.lost:
        ranks = sorted(beat.lost)
        who = {r: w for r in ranks for w in beat.lost[r][1].values()}
        return ranks, beat.lost[ranks[0]][0], who
    try:
        found = beat.call(beat.verdict)
    except Exception:  # noqa: BLE001 - the store does not answer: see below
        found = None
    if found is not None:
        beat.mark_lost(*found, publish=False)
        return found
    me, watched = beat.rank, beat.watched()
    silent = [r for r in watched if r != me]
    start = None
    try:
        before = beat.call(beat.counts)
        start = time.monotonic()
        records: dict[int, str] = {}  # the silent ranks' registrations, read once (the grace, the message)
        found = _silent(beat, before, silent, start, wait, records)
        how = f"its heartbeat in the c10d store stopped for {wait:g} s (its process died, or its host is unreachable)"
        who = _who(beat.registered(silent, records))
    except Exception:  # noqa: BLE001 - the store itself does not answer
        # [Note: the store dies mid-diagnosis] The store's host (rank 0) may have exited
        # because it raised this very error first: ranks silent for two heartbeats while
        # the others beat are the lost ones; with less evidence, the store's host is.
        quiet = time.monotonic() - start if start is not None else 0.0
        host = _store_host_rank()
        if silent and quiet >= 2 * beat.interval and len(silent) < beat.world - 1:
            how = f"its heartbeat in the c10d store stopped for {quiet:.1f} s (its process died, or its host is unreachable)"
        elif host is None or host == me:
            return [], "", {}
        else:
            silent = [host]
            how = "the job's c10d store, which its process hosts, stopped answering"
        who, found, start = {}, None, None
    beat.mark_lost(silent, how, who)
    if start is not None and (silent or found) and len(watched) < beat.world - 1:
        time.sleep(beat.interval)  # a heartbeat more: the other watchers' findings, published at the
        try:  # end of their windows as this rank's at the end of its own (see _silent)
            found = beat.call(beat.verdict) or found
        except Exception:  # noqa: BLE001 - the store stopped answering: what is known is told
            pass
    if found is not None:  # the others' findings too: every lost rank named (see _silent)
        beat.mark_lost(*found, publish=False)
        ranks = sorted(set(silent) | set(found[0]))
        return ranks, how if silent else found[1], {**found[2], **who}
    return silent, how, who


def _silent(beat: _Heartbeat, before: dict[int, int], silent: list[int], start: float,
            wait: float, records: dict[int, str]) -> tuple[list[int], str, dict[int, str]] | None:
    """The diagnosis's wait: drops from ``silent`` (in place: what it holds when the store
    stops answering counts too) the ranks whose counters (``before``) moved within ``wait``
    seconds of ``start`` (or, for ranks whose process runs on this host, within
    :data:`LOCAL_GRACE` times that; ``records`` caches their registrations); returns the ranks other ranks published lost meanwhile
    (:meth:`_Heartbeat.verdict`; ``None`` in a world every rank reads whole: there it is not read).

    [Note: watching successors] Where this rank watches only its next k ranks, a lost rank
    elsewhere is seen by its own k watchers, which publish it on ``fastreduce/lost`` (a
    union: :meth:`_Heartbeat._publish`). Some live rank always sees a loss: from any lost
    rank, walk back the ring to the first live rank; its successor is lost and watched by
    it. So this rank waits its whole window (every rank's diagnosis began at the same
    failure, so the watchers' windows end with its own, give or take the failure's
    spread), publishes its own silent successors, and a heartbeat later (:func:`_diagnose`)
    names them together with every rank published by then; with none of either at the window's end, it reads
    ``fastreduce/lost`` up to one more window (a watcher whose diagnosis began later)
    before it calls the failure no loss. Ranks lost at once are named together: each one's
    watchers publish it at the end of their window, and a rank whose k successors are all
    lost names them itself and learns of the others from the key, read a heartbeat after
    the end of its own window (a watcher whose diagnosis began later than that is not
    waited for: this rank names the ranks known by then). The verdict comes before any survivor exits (a survivor raises only once its
    own window ended or it read the verdict), so an exited survivor is never silent for a
    window before this rank has read it."""
    sparse = len(beat.watched()) < beat.world - 1
    found = None
    while silent or sparse:
        now_s = time.monotonic()
        if now_s >= start + wait and (not sparse or silent or found is not None or now_s >= start + 2 * wait) \
                and not (silent and now_s < start + LOCAL_GRACE * wait and beat.slow_here(silent, records)):
            break
        time.sleep(min(0.25, beat.interval / 2))
        now = beat.call(beat.counts)
        silent[:] = [r for r in silent if now[r] == before[r] and now[r] < RESTING]  # at rest: not lost
        if sparse:
            found = beat.call(beat.verdict) or found
    return found


# ---------------------------------------------------------------------- watchdog

# [Note: no Python callback on a collective's future]
# A callable added to a torch future (``add_done_callback``, ``then``) is held by the future
# in a C++ guard whose destructor takes the GIL. A Gloo work's future is let go by the Gloo
# thread that ran the work, just after it completes. On a busy host that thread can be
# descheduled right there, and let go only after the main thread has left ``main()`` and
# Python has begun to finalize: taking the GIL then ends the thread by unwinding through that
# destructor, and the C++ runtime aborts the process ("terminate called without an active
# exception", SIGABRT): a run that trained, saved and printed exits -6, and torchrun calls it
# failed. (Shown deterministically by a rank that adds a callback to an async all-reduce and
# exits before its peer joins it: SIGABRT every time; without the callback, exit 0.) So a
# collective is waited for in timed slices on the caller's thread (:class:`_Timed`), other works
# on fastreduce's waiter thread (joined at exit by :func:`.lifecycle.shutdown`), and no callback
# is added to a future fastreduce does not complete itself.

def wait_watched(work: Any) -> Any:
    """``work.wait()`` for a process group's collective, watched for ranks that go silent
    (a bundle of works, e.g. point-to-point pieces, waits through its ``wait_unwatched``).

    A dead process fails the collective by itself (its sockets close); a partition (a
    link or a host down, every process alive) does not: Gloo waits out the group's
    timeout. So once a wait has lasted a heartbeat, it reads the heartbeat counters of
    the ranks it watches (:data:`WATCHED_SUCCESSORS`) and the ranks published lost each
    heartbeat; a rank whose counter has not moved for
    ``$FASTREDUCE_LOST_AFTER_S`` is lost, and the wait raises :class:`TransportError`
    naming it, leaving the collective abandoned (the guard of the calling mode turns it
    into a :class:`RankLostError`; the process can exit, or torchrun restart it). A
    rank that is busy, or slow to send over a slow link, keeps beating (its heartbeat is
    a thread of its own, on a store connection of its own). If the store itself stops
    answering for as long, this host is the one cut off, and the wait raises saying so.

    A backend's collective is waited for on this thread, a heartbeat at a time
    (``work.wait(timeout)``: a slice that runs out leaves the work pending), never through a
    Python callback on its future (see [Note: no Python callback on a collective's future]).
    Gloo's point-to-point work, which has no future and takes one ``wait()`` only, and a
    work of fastreduce's own are waited for on a waiter thread (:func:`_waiter`). A work made of works that
    it waits for through here itself (``watches_itself``, :class:`~.comm.Fp32Accumulate`)
    is waited on directly: on the waiter thread its own waits would queue behind it.
    Only where the host waits inside the collective (a Gloo default group): NCCL's and
    HCCL's ``wait()`` only orders the device's streams, and their own watchdogs (at the
    group's timeout) see a stuck collective there. Without a heartbeat, a plain wait."""
    if getattr(work, "watches_itself", False):  # a launch of several works, each waited through here
        return work.wait()
    wait = getattr(work, "wait_unwatched", None) or work.wait
    beat = _beat
    if beat is None or not beat.host_waits or not beat.current():
        return wait()
    try:
        if work.is_completed():
            return wait()
    except Exception:  # noqa: BLE001 - a work kind that cannot tell
        pass
    if beat.lost:  # a rank of this group is known lost: raise at once, not after a watchdog tick (its
        # neighbours' processes may live on, their sockets open: at 64 ranks the wait took a second)
        _abandon_groups()
        raise TransportError(f"fastreduce: rank(s) {sorted(beat.lost)} of this group were lost before this "
                             "collective; it is abandoned")
    if _is_collective(work, wait):  # waited here, a heartbeat at a time
        done = _Timed(work)
        if not done.wait(beat.interval):  # the common case: done within a heartbeat, no watching
            _watch(beat, done)
        return True
    done, box = _waiter().submit(wait)  # waited once, there: Gloo's point-to-point work takes one wait only
    if not done.wait(beat.interval):
        _watch(beat, done)
    if isinstance(box[0], BaseException):
        raise box[0]
    return True


def _is_collective(work: Any, wait: Callable[[], Any]) -> bool:
    """Whether ``work`` is a backend's collective (it has a future; Gloo's point-to-point
    work has none), whose ``wait`` takes a timeout and may be called again after one."""
    if not isinstance(work, dist.Work) or wait != work.wait:
        return False
    try:
        work.get_future()
    except Exception:  # noqa: BLE001 - no future: point-to-point
        return False
    return True


class _Timed:
    """A backend's collective waited for in slices (what :func:`_watch` takes as ``done``)."""

    def __init__(self, work: Any):
        self.work = work

    def wait(self, seconds: float) -> bool:
        """Whether the work is done within ``seconds``; its own error, if it failed."""
        try:
            self.work.wait(timedelta(seconds=seconds))
            return True
        except Exception:  # noqa: BLE001 - timed out, or failed: completed tells which
            if not self.work.is_completed():
                return False
        self.work.wait()  # done: its result, or its error
        return True


def all_reduce_watched(t: torch.Tensor, op: Any = dist.ReduceOp.SUM, group: dist.ProcessGroup | None = None) -> None:
    """A blocking ``dist.all_reduce`` of ``t``, waited through :func:`wait_watched`."""
    wait_watched(dist.all_reduce(t, op=op, group=group, async_op=True))


_waiter_caller: StoreCaller | None = None


def _waiter() -> StoreCaller:
    """A daemon thread that waits for works without futures, one at a time (an abandoned
    work may keep it for good: :func:`_abandon_groups` starts the next wait on a new one)."""
    global _waiter_caller
    with _lock:
        if _waiter_caller is None:
            _waiter_caller = StoreCaller("fastreduce-waiter")
        return _waiter_caller


def _watch(beat: _Heartbeat, done: threading.Event) -> None:
    """Until ``done``: raise if a rank's heartbeat stops for the window, or the store does."""
    window = lost_after()
    seen: dict[int, tuple[int, float]] = {}  # rank -> (its counter, when it was last seen to move)
    records: dict[int, str] = {}  # the silent ranks' registrations, read once (:meth:`_Heartbeat.slow_here`)
    unanswered = None  # since when the store has not answered
    while not done.wait(min(beat.interval, 1.0)):
        now = time.monotonic()
        try:
            silent = beat.silent(seen, window, records)
            found = beat.call(beat.verdict)
        except Exception as err:  # noqa: BLE001 - the store does not answer
            unanswered = unanswered or now
            if time.monotonic() - unanswered >= window:
                raise TransportError(f"fastreduce: the job's c10d store has not answered for "
                                     f"{time.monotonic() - unanswered:.0f} s while a collective waited "
                                     f"({type(err).__name__}): this host seems cut off from the others; the "
                                     "collective is abandoned") from err
            continue
        unanswered = None
        if found is not None:  # another rank named them first: the same names here
            beat.mark_lost(*found, publish=False)
            _abandon_groups()
            raise TransportError(f"fastreduce: rank(s) {found[0]} were found lost by another rank during a "
                                 "collective; the collective is abandoned")
        if silent:
            how = (f"its heartbeat in the c10d store stopped for {window:g} s while a collective waited for it "
                   "(seen by the watchdog: its host or link is down, or its process is stopped)")
            beat.mark_lost(silent, how, _who(beat.registered(silent, records)))
            _abandon_groups()
            raise TransportError(f"fastreduce: rank(s) {silent} went silent during a collective; the "
                                 "collective is abandoned")


_pinned: list[Any] = []


def _abandon_groups() -> None:
    """After a watchdog found a rank lost: let this process exit. A collective waiting on
    a peer that will never answer holds a Gloo thread in a socket read, and destroying
    its process group (at the latest, the interpreter's exit) joins that thread: the
    process would hang there. So every process group is aborted where the backend can
    (the pending work fails, its thread returns) and, where it cannot, pinned: never
    destroyed, its threads end with the process. The group is of no further use either
    way: a job that lost a rank restarts (torchrun --max-restarts), or under a Membership
    goes on in a new group."""
    global _waiter_caller
    import ctypes

    for pg in list(getattr(dist.distributed_c10d._world, "pg_map", {})):
        if any(p is pg for p in _pinned):
            continue
        _pinned.append(pg)
        ctypes.pythonapi.Py_IncRef(ctypes.py_object(pg))  # outlives the interpreter's teardown
        try:
            pg.abort()
        except Exception:  # noqa: BLE001 - not supported by this backend or torch
            pass
    with _lock:  # its thread may wait for good on an abandoned work: later groups' waits get a new one
        if _waiter_caller is not None:
            _waiter_caller.close()  # (it ends once free)
        _waiter_caller = None


# ---------------------------------------------------------------------- guard

def is_transport_failure(err: BaseException) -> bool:
    """Whether ``err`` looks like a failed collective (worth a diagnosis)."""
    if isinstance(err, (TransportError, RankLostError)):
        return True
    dist_error = getattr(dist, "DistError", None)
    if dist_error is not None and isinstance(err, dist_error):
        return True
    return isinstance(err, RuntimeError) and any(m in str(err).lower() for m in _MARKERS)


def as_rank_lost(err: BaseException, where: str, state: str) -> RankLostError | None:
    """``err`` as a :class:`RankLostError` of the call ``where`` leaving ``state``, or
    ``None`` when it is not a lost rank's doing (or is one already told)."""
    if isinstance(err, RankLostError):
        if err.where is not None:
            return None
        _linger_if_store_host()
        return err.at(where, state)
    beat = _beat
    known = beat is not None and bool(beat.lost)  # then any failure is the loss's doing (e.g. a
    # collective left in flight by the failed call), and every later call raises at once
    if not (known or is_transport_failure(err)) or not dist.is_initialized():
        return None
    ranks, how, who = diagnose()
    if not ranks:
        return None
    _linger_if_store_host()
    return RankLostError(ranks, where, state, how, dist.get_world_size(), who)


_lingering = False


def _linger_if_store_host() -> None:
    """On the rank that hosts the store: at exit, wait one diagnosis window, so that the
    other survivors finish theirs before the store goes (see [Note: the store dies
    mid-diagnosis]); a few seconds, only in a job that lost a rank."""
    global _lingering
    if _lingering or not dist.is_initialized() or _store_host_rank() != dist.get_rank():
        return
    _lingering = True
    atexit.register(time.sleep, lost_after() + heartbeat_interval())


@contextmanager
def guard(where: str, state: str) -> Iterator[None]:
    """Re-raise a collective failure inside the block as a :class:`RankLostError` of
    ``where`` (e.g. ``"ZeroOptimizer.step()"``), whose message says ``state`` (what the
    failure left behind), when a diagnosis finds a lost rank; else unchanged."""
    if _beat is None:
        start_heartbeat()
    try:
        yield
    except RuntimeError as err:
        lost = as_rank_lost(err, where, state)
        if lost is None:
            raise
        raise lost from err


def guarded(where: str, state: str) -> Callable[[F], F]:
    """:func:`guard` as a method decorator (a plain ``try``, no context manager on the
    hot path). ``where`` may hold ``{cls}`` (the instance's class name).

    Example::

        @guarded("{cls}.step()", "this step's gradients are lost; the parameters are as before it.")
        def step(self): ...
    """
    def wrap(fn: F) -> F:
        @functools.wraps(fn)
        def inner(self: Any, *args: Any, **kwargs: Any) -> Any:
            if _beat is None:  # a mode's first collectives may come before its Comm
                start_heartbeat()
            try:
                return fn(self, *args, **kwargs)
            except RuntimeError as err:
                lost = as_rank_lost(err, where.format(cls=type(self).__name__), state)
                if lost is None:
                    raise
                raise lost from err
        return inner  # type: ignore[return-value]
    return wrap
