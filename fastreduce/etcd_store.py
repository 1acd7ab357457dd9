"""A c10d ``Store`` over an etcd v3 cluster: a coordinator for :class:`~fastreduce.Membership`
with no single point of failure.

etcd replicates every write to a quorum of its members (Raft) before it answers, and answers a
read only from a quorum's view, so the job's epochs, tickets, votes and heartbeats outlive any
minority of etcd's members: a lost leader costs the election (about a second), a lost follower
the client's move to another endpoint. Losing the quorum stops every request, and so every
member, with :class:`~fastreduce.coordinator.MembershipError`: nothing is ever read from a
minority's stale copy. fastreduce runs no consensus of its own; this module only maps the
store's requests onto etcd's (through etcd3gw, the maintained client of etcd's JSON gateway:
``pip install 'fastreduce[etcd]'``):

* ``set``, ``get`` (waiting for a missing key, as a ``TCPStore`` does), ``check``, ``wait``,
  ``delete_key``, ``num_keys``, ``multi_get`` and ``multi_set``: puts, ranges and
  transactions of ranges (one request for many keys);
* ``compare_set``: one transaction comparing the value (or the key's absence, and then its
  empty value: as a ``TCPStore``, which stores ``desired`` over an empty value);
* ``add``: a transaction comparing the key's revision with the one this client last saw
  (one request for a counter only it adds to, a heartbeat's), which on a conflict answers the
  key's value and revision for the next try. A request whose answer was lost (its endpoint
  died after applying it) is not applied twice: each ``add`` writes a record of its own beside
  the key in the same transaction (``ops/<key>`` and a NUL and ``<client>``, deleted with the
  key), which a failed try reads back.

Every request goes to one endpoint; an endpoint that refuses, times out or answers that it has
no leader is left for the next, until one answers or none has for ``unavailable_after_s``
(then :class:`~fastreduce.faults_errors.StoreUnreachable`). A missing key waited for past the
store's timeout raises torch's ``DistStoreError`` ("wait timeout"), as a ``TCPStore`` does. A
write refused because etcd's database is over its space quota (its NOSPACE alarm: an etcd whose
history is never compacted fills up) raises :class:`EtcdSpaceExceeded` at once.

The address form is ``etcd://host:port[,host:port...][/job]``: the job's keys live under
``/fastreduce/<job>/`` (default job ``default``), so that jobs can share one etcd cluster.
"""

from __future__ import annotations

import base64
import importlib.util
import itertools
import threading
import time
import uuid
from collections import OrderedDict
from datetime import timedelta
from typing import Any, Callable, Sequence

import torch.distributed as dist

from .faults_errors import StoreUnreachable

__all__ = ["ETCD_SCHEME", "EtcdSpaceExceeded", "EtcdStore", "parse_address"]

ETCD_SCHEME = "etcd://"
REQUEST_TIMEOUT_S = 1.0
"""One request's bound at one endpoint (a member that lost its quorum holds a request until
its own timeout, several seconds: the next endpoint is asked instead)."""
UNAVAILABLE_AFTER_S = 4.0
"""How long no endpoint answering means the cluster is unavailable (an election takes about a
second at etcd's default 1 s election timeout)."""
_POLL_S = (0.005, 0.1)  # a missing key is read again after 5 ms, then up to every 100 ms


class EtcdSpaceExceeded(StoreUnreachable):
    """etcd refuses every write: its database reached its space quota (``--quota-backend-bytes``,
    2 GiB by default) and its NOSPACE alarm is raised. Reads are still answered. A job's every
    heartbeat, vote and status is a write, each kept as a revision until etcd compacts its
    history (``--auto-compaction-retention``): an etcd that never compacts fills up."""


def parse_address(address: str) -> tuple[list[str], str]:
    """``etcd://h1:2379,h2:2379/job`` -> (``["h1:2379", "h2:2379"]``, ``"job"``)."""
    if not address.startswith(ETCD_SCHEME):
        raise ValueError(f"an etcd address starts with {ETCD_SCHEME!r}, got {address!r}")
    hosts, _, job = address[len(ETCD_SCHEME):].partition("/")
    endpoints = [h.strip() for h in hosts.split(",") if h.strip()]
    for e in endpoints:
        host, _, port = e.rpartition(":")
        if not host or not port.isdigit():
            raise ValueError(f"etcd endpoint {e!r} of {address!r} is not 'host:port'")
    if not endpoints:
        raise ValueError(f"no etcd endpoint in {address!r}: etcd://host:port[,host:port...][/job]")
    job = job.strip("/") or "default"
    if "/" in job:
        raise ValueError(f"the job name of {address!r} must not contain '/'")
    return endpoints, job


def _b64(data: str | bytes) -> str:
    return base64.b64encode(data.encode() if isinstance(data, str) else bytes(data)).decode()


def _bytes(value: Any) -> bytes:
    """A value as the store keeps it (c10d hands over str, bytes or a list of ints)."""
    if isinstance(value, str):
        return value.encode()
    return bytes(value)


class EtcdStore(dist.Store):
    """A ``torch.distributed.Store`` over the etcd cluster at ``endpoints`` (``"host:port"``
    each), its keys under ``/fastreduce/<job>/``. ``timeout``: how long ``get`` and ``wait``
    wait for a missing key (c10d's store timeout).

    A clone (c10d's ``clone()``: connections of its own, for a thread that must not queue behind
    another's requests) is kept by the store it was cloned from: a Python store held by c10d
    alone loses its Python half (pybind11) at its next collection."""

    def __init__(self, endpoints: Sequence[str], job: str = "default", timeout: timedelta = timedelta(seconds=30),
                 *, request_timeout_s: float = REQUEST_TIMEOUT_S, unavailable_after_s: float = UNAVAILABLE_AFTER_S,
                 _conn: _Connection | None = None):
        super().__init__()
        self._conn = _conn or _Connection(list(endpoints), request_timeout_s, unavailable_after_s)
        self.job = job
        self._kept_by: list[EtcdStore] | None = None  # a clone: its origin's list that keeps it (see close)
        self._root = f"/fastreduce/{job}/"
        self.set_timeout(timeout)  # (c10d's own: a PrefixStore over this one sets it too)

    endpoints = property(lambda self: self._conn.endpoints, doc="The etcd members' client addresses.")

    # ------------------------------------------------------------------ c10d's Store

    def set(self, key: str, value: Any) -> None:
        self._conn.request("kv/put", {"key": _b64(self._k(key)), "value": _b64(_bytes(value))})

    def get(self, key: str) -> bytes:
        return self.multi_get([key])[0]

    def multi_get(self, keys: list[str]) -> list[bytes]:
        """The values of ``keys``, once every one is set (one request per poll)."""
        found: list[bytes | None] = []

        def ready() -> bool:
            found[:] = self._read(keys)
            return all(v is not None for v in found)

        self._until(ready, self.timeout, keys)
        return [v for v in found if v is not None]

    def multi_set(self, keys: list[str], values: list[Any]) -> None:
        ops = [{"request_put": {"key": _b64(self._k(k)), "value": _b64(_bytes(v))}} for k, v in zip(keys, values)]
        self._conn.request("kv/txn", {"compare": [], "success": ops, "failure": []})

    def check(self, keys: list[str]) -> bool:
        return all(v is not None for v in self._read(keys))

    def wait(self, keys: list[str], timeout: timedelta | None = None) -> None:
        self._until(lambda: self.check(keys), timeout if timeout is not None else self.timeout, keys)

    def add(self, key: str, amount: int) -> int:
        k, op = self._k(key), f"{self._ops(key)}{self._conn.client_id}"
        conn = self._conn
        with conn.add_lock:
            mine = f"{next(conn.seq)}:"
            value, revision = conn.seen.get(k, (0, 0))  # (a counter only this client adds to: one request)
            while True:
                new = value + amount
                got = conn.request("kv/txn", {
                    "compare": [{"key": _b64(k), "result": "EQUAL", "target": "MOD", "mod_revision": revision}],
                    "success": [{"request_put": {"key": _b64(k), "value": _b64(str(new))}},
                                {"request_put": {"key": _b64(op), "value": _b64(f"{mine}{new}")}}],
                    "failure": [{"request_range": {"key": _b64(k)}}, {"request_range": {"key": _b64(op)}}]})
                if got.get("succeeded"):
                    conn.saw(k, new, int(got["header"]["revision"]))
                    return new
                kv, record = (next(iter(self._kvs(r)), None) for r in got["responses"])
                value, revision = (int(_value(kv)), int(kv["mod_revision"])) if kv else (0, 0)
                conn.saw(k, value, revision)
                if record is not None and _value(record).decode().startswith(mine):
                    return int(_value(record).decode()[len(mine):])  # applied on a first try whose answer was lost

    def compare_set(self, key: str, expected: Any, desired: Any) -> bytes:
        """c10d's, as a ``TCPStore`` answers it: ``desired`` stored where the value is
        ``expected`` (an empty value too), or where the key is missing and ``expected`` is
        empty; the value stored after the call (a missing key left missing: ``expected``).
        etcd compares a value only on a key that exists, so an empty ``expected`` is one
        transaction for a missing key and, where the key holds an empty value, a second."""
        k, expected, desired = self._k(key), _bytes(expected), _bytes(desired)
        absent = {"key": _b64(k), "result": "EQUAL", "target": "CREATE", "create_revision": 0}
        holds = {"key": _b64(k), "result": "EQUAL", "target": "VALUE", "value": _b64(expected)}
        put, read = {"request_put": {"key": _b64(k), "value": _b64(desired)}}, {"request_range": {"key": _b64(k)}}
        while True:
            for compare in ([absent, holds] if not expected else [holds]):
                got = self._conn.request("kv/txn", {"compare": [compare], "success": [put], "failure": [read]})
                if got.get("succeeded"):
                    return desired
                kvs = self._kvs(got["responses"][0])
                if not kvs and expected:
                    return expected  # missing, and not to be created
                if kvs and _value(kvs[0]) != expected:
                    return _value(kvs[0])
                # (an empty value where the key was to be missing: compared next; a key deleted meanwhile: again)

    def delete_key(self, key: str) -> bool:
        """The key, and every client's record of its adds (one transaction: a vote's
        counter per poll left them behind, a key a member a poll, for good)."""
        ops = self._ops(key)
        got = self._conn.request("kv/txn", {"compare": [], "failure": [], "success": [
            {"request_delete_range": {"key": _b64(self._k(key))}},
            {"request_delete_range": {"key": _b64(ops), "range_end": _b64(ops[:-1] + "\x01")}}]})
        first = (got.get("responses") or [{}])[0].get("response_delete_range") or {}
        return int(first.get("deleted", 0)) > 0

    def num_keys(self) -> int:
        start = f"{self._root}kv/"
        got = self._conn.request("kv/range", {"key": _b64(start), "range_end": _b64(start[:-1] + chr(ord(start[-1]) + 1)),
                                         "count_only": True})
        return int(got.get("count", 0))

    def values(self, keys: list[str]) -> list[bytes | None]:
        """Each key's value, ``None`` where it is missing, in one request: never waits (a key
        deleted meanwhile is not waited for until it is written again, as ``get`` would)."""
        return self._read(keys)

    def modified(self, key: str) -> int:
        """The etcd revision at which ``key`` was last written (0: it is missing)."""
        kvs = self._conn.request("kv/range", {"key": _b64(self._k(key))}).get("kvs") or []
        return int(kvs[0].get("mod_revision", 0)) if kvs else 0

    def clear_job(self, key: str, modified: int) -> bool:
        """Every key of this job (``/fastreduce/<job>/``) deleted, in one transaction, where
        ``key`` was still as written at revision ``modified`` (:meth:`modified`, read before: no
        other process cleared the job, started it again or added to ``key`` since); whether it was."""
        if not modified:
            return False  # (etcd compares a missing key's revision as 0: nothing read, nothing cleared)
        root = self._root
        got = self._conn.request("kv/txn", {
            "compare": [{"key": _b64(self._k(key)), "result": "EQUAL", "target": "MOD",
                         "mod_revision": modified}],
            "success": [{"request_delete_range": {"key": _b64(root), "range_end": _b64(root[:-1] + "0")}}],
            "failure": []})  # ('0' follows '/': every key under the root)
        self._conn.seen.clear()
        return bool(got.get("succeeded"))

    def clone(self) -> EtcdStore:
        """The same job over connections of its own (see the class)."""
        conn = self._conn
        twin = EtcdStore(self.endpoints, self.job, self.timeout,
                         _conn=_Connection(conn.endpoints, conn.request_timeout_s, conn.unavailable_after_s))
        conn.clones.append(twin)
        twin._kept_by = conn.clones
        return twin

    def close(self) -> None:
        """Let go of this client's connections to etcd (their sockets; a later request opens
        them again). A clone closed is no longer kept by the store it was cloned from: whoever
        closes it keeps it while c10d's stores over it may still be asked."""
        self._conn.close()
        if self._kept_by is not None:
            self._kept_by[:] = [s for s in self._kept_by if s is not self]
            self._kept_by = None

    @property
    def host(self) -> str:
        """The endpoint this client asks now (where the coordinator is, for the deadlines)."""
        return self.endpoints[self._conn.at].rpartition(":")[0].strip("[]")

    def __repr__(self) -> str:
        return f"EtcdStore({ETCD_SCHEME}{','.join(self.endpoints)}/{self.job})"

    # ------------------------------------------------------------------ requests

    def _k(self, key: str) -> str:
        return f"{self._root}kv/{key}"

    def _ops(self, key: str) -> str:
        """The prefix of the clients' records of their adds to ``key`` (a NUL ends the key: no
        other key's records share it)."""
        return f"{self._root}ops/{key}\x00"

    def _kvs(self, response: dict[str, Any]) -> list[dict[str, Any]]:
        return (response.get("response_range") or {}).get("kvs") or []

    def _read(self, keys: list[str]) -> list[bytes | None]:
        """Each key's value or ``None``, in one request."""
        ranges = [{"request_range": {"key": _b64(self._k(k))}} for k in keys]
        got = self._conn.request("kv/txn", {"compare": [], "success": ranges, "failure": []})
        return [_value(kv) if (kv := next(iter(self._kvs(r)), None)) else None for r in got.get("responses", [])]

    def _until(self, ready: Callable[[], bool], timeout: timedelta, keys: list[str]) -> None:
        deadline, pause = time.monotonic() + timeout.total_seconds(), _POLL_S[0]
        while not ready():
            if time.monotonic() >= deadline:
                raise dist.DistStoreError(f"wait timeout after {timeout.total_seconds() * 1000:.0f}ms, "
                                          f"keys: {keys} ({self!r})")
            time.sleep(pause)
            pause = min(pause * 1.5, _POLL_S[1])


class _Connection:
    """A client's HTTP connections to ``endpoints``: one request at a time, at the endpoint that
    answered last; its name for its ``add`` records; the counters' revisions it last saw.
    (Each clone has one of its own: an epoch's heartbeat clones once and closes it at its end.)"""

    def __init__(self, endpoints: list[str], request_timeout_s: float, unavailable_after_s: float):
        if importlib.util.find_spec("etcd3gw") is None:  # the optional extra, named where it is missing
            raise ImportError("fastreduce: an etcd coordinator needs etcd3gw: pip install 'fastreduce[etcd]'")
        self.endpoints, self.request_timeout_s, self.unavailable_after_s = endpoints, request_timeout_s, \
            unavailable_after_s
        self.client_id = uuid.uuid4().hex[:12]
        self.seq = itertools.count(1)
        self.lock = threading.Lock()  # one request at a time on the HTTP sessions
        self.add_lock = threading.Lock()  # one add at a time: its record is this client's, per key
        self.at = int(self.client_id, 16) % len(endpoints)  # clients spread over the endpoints
        self.clones: list[EtcdStore] = []  # kept alive (see EtcdStore)
        self.seen: OrderedDict[str, tuple[int, int]] = OrderedDict()  # counter -> (value, revision) last seen
        self.down: StoreUnreachable | None = None  # the last request found no endpoint answering
        self._clients: dict[str, Any] = {}

    def saw(self, key: str, value: int, revision: int) -> None:
        """A counter's value and revision as this client last saw them (its next add's guess)."""
        self.seen[key] = (value, revision)
        self.seen.move_to_end(key)
        if len(self.seen) > 1024:
            self.seen.popitem(last=False)

    def close(self) -> None:
        """Close the HTTP sessions (their sockets); the next request makes new ones."""
        with self.lock:
            clients, self._clients = self._clients, {}
        for client in clients.values():
            client.session.close()
        self.seen.clear()

    def _client(self, endpoint: str) -> Any:
        if endpoint not in self._clients:
            import etcd3gw
            host, _, port = endpoint.rpartition(":")
            self._clients[endpoint] = etcd3gw.Etcd3Client(host=host.strip("[]"), port=int(port),
                                                          timeout=self.request_timeout_s, api_path="/v3/")
        return self._clients[endpoint]

    def request(self, path: str, body: dict[str, Any]) -> dict[str, Any]:
        """``body`` posted to ``/v3/<path>`` at the first endpoint that answers (from the one
        that answered last), or :class:`StoreUnreachable` once none has for ``unavailable_after_s``
        and each has been asked (a request that waited for the connection, or whose process was
        stopped as it was made, is not given up after one endpoint: a member frozen past the
        bound, its connection closed meanwhile, stopped in the chaos run that way); after
        one, each endpoint is asked once: a member stopping makes its last requests in about a
        second each, not in ``unavailable_after_s``."""
        start, tried, last = time.monotonic(), 0, ""
        while True:
            endpoint = self.endpoints[self.at]
            try:
                with self.lock:
                    client = self._client(endpoint)
                    answer = client.post(client.get_url(path), json=body)
                self.down = None
                return answer
            except Exception as err:  # noqa: BLE001 - etcd3gw's and requests' errors, sorted below
                detail = getattr(err, "detail_text", None) or str(err)
                if "space exceeded" in detail:  # (a quota of the cluster's: no other endpoint takes it either)
                    raise EtcdSpaceExceeded(
                        f"fastreduce: the etcd cluster refuses every write: its database is over its space quota "
                        f"(etcd's NOSPACE alarm, at {endpoint}: {detail[:200]}). Compact and defragment it and disarm "
                        "the alarm (etcdctl compact <revision>, etcdctl defrag, etcdctl alarm disarm), and run etcd "
                        "with --auto-compaction-retention so that it stays bounded (docs/faults.md)") from err
                if not _retryable(err):
                    raise RuntimeError(f"fastreduce: etcd refused a request at {endpoint}: "
                                       f"{getattr(err, 'detail_text', None) or err}") from err
                last = f"{endpoint}: {type(err).__name__} {(getattr(err, 'detail_text', None) or str(err))[:200]}"
            tried += 1
            self.at = (self.at + 1) % len(self.endpoints)
            if self.down is not None and tried >= len(self.endpoints):
                raise self.down
            if time.monotonic() - start >= self.unavailable_after_s and tried >= len(self.endpoints):
                self.down = StoreUnreachable(
                    f"fastreduce: no etcd endpoint of {', '.join(self.endpoints)} answered for "
                    f"{self.unavailable_after_s:g} s ({tried} tries; last {last}): the etcd cluster lost its "
                    "quorum or cannot be reached from here")
                raise self.down
            if tried % len(self.endpoints) == 0:
                time.sleep(0.05)  # every endpoint asked once: a pause before the next round


def _value(kv: dict[str, Any]) -> bytes:
    return base64.b64decode(kv.get("value", ""))


def _retryable(err: Exception) -> bool:
    """An endpoint that is down, slow, cut off mid-answer or without a leader (etcd's 5xx);
    not a bad request."""
    import requests
    from etcd3gw import exceptions

    if isinstance(err, (exceptions.ConnectionFailedError, exceptions.ConnectionTimeoutError,
                        exceptions.InternalServerError, requests.RequestException, ValueError)):
        return True  # (ValueError: an answer cut short, not JSON)
    if not isinstance(err, exceptions.Etcd3Exception):
        return False
    text = f"{getattr(err, 'detail_text', '')} {err}".lower()
    return any(w in text for w in ("leader", "unavailable", "timed out", "stopped", "too many requests"))
