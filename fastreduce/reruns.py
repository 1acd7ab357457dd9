"""A job started again at a coordinator that kept an earlier run's keys.

An etcd cluster keeps a job's keys (``/fastreduce/<job>/``) after the job ends, and so does a
built-in coordinator left running. A second run of the job at the same address (after etcd
lost its quorum, docs/faults.md says to restart the job from its last checkpoint) found the
first run's tickets and epochs, took tickets past ``world_size``, never formed its epoch 0,
and every member waited ``wait_s`` for an admission that could not come. So before a process
takes its ticket, :func:`start_clean` looks at what the coordinator holds:

* nothing: a new job;
* a run with a live process (a member of its last epoch, or before its epoch 0 a founder
  waiting for the others): this process joins it, or founds it with them, as before. Alive: its
  process runs on this host, or its heartbeat in that epoch or its pulse moved within
  :func:`window_s`;
* a run whose every process is gone (its process exited on this host, or its heartbeat and
  pulse stood still for :func:`window_s`): on etcd, every key of the job is deleted in one
  transaction that holds only while the tickets' count is as it was when the look began
  (several new founders at once: one deletes, the others find it done and look again; a ticket
  taken meanwhile: look again) and this run starts clean; a built-in coordinator cannot delete by prefix:
  :class:`MembershipError` at once, saying to restart it;
* a run whose members are all gone while a process still waits to join it (a warm spare):
  :class:`MembershipError` at once, naming them.

A look reads without waiting for any key (a key another new founder deleted meanwhile would
be waited for until this run wrote it again: this process's own record, never, while the other
founder waited for this one's ticket), and where the tickets' count changed during it (the
earlier run cleared, or a ticket taken) it looks again before it decides anything.

A member that can be told neither gone nor alive (its epoch's heartbeat never wrote:
``$FASTREDUCE_HEARTBEAT_S`` <= 0, or it died entering the epoch) or is at rest (its heartbeat
stopped on purpose, :data:`~.lifecycle.RESTING`) counts as alive: a job with a live member is
never cleared. Such a run is joined as before, and a process there waits ``wait_s``.
"""

from __future__ import annotations

import json
import logging
import time
from typing import Any, Callable

import fastreduce.faults as faults
import fastreduce.faults_heartbeat as faults_heartbeat
import fastreduce.process_identity as process_identity
import fastreduce.torch_internals as torch_internals

from .coordinator import (TICKETS, CoordinatorLink, Epoch, MembershipError, epoch_key, group_prefix, group_store,
                          ticket_key)
from .etcd_store import EtcdStore
from .lifecycle import RESTING
from .presence import pulse_key, who_key

__all__ = ["latest_epoch", "start_clean", "window_s"]

log = logging.getLogger("fastreduce.membership")

_GONE, _ALIVE, _UNKNOWN = "gone", "alive", "unknown"
_LOOK_S = 0.1  # between two reads of the counters
_LOOKS = 5  # a job whose tickets changed under each look: joined (its tickets are being taken)


def window_s() -> float:
    """How long a process's heartbeat and pulse stand still before it is gone: two loss
    windows (``$FASTREDUCE_LOST_AFTER_S``), at least 2 s."""
    return max(2.0, 2 * faults.lost_after())


def latest_epoch(link: CoordinatorLink) -> Epoch | None:
    """The job's newest epoch (``None``: none formed, or the job's keys were deleted while
    it was looked for), in a few requests (epochs are numbered from 0 without gaps, and only
    deleted with the whole job: doubling, then halving)."""
    def formed(n: int) -> bool:
        return bool(link.call(link.store.check, [epoch_key(n)]))

    if not formed(0):
        return None
    low, high = 0, 1
    while formed(high):
        low, high = high, 2 * high
    while high - low > 1:
        mid = (low + high) // 2
        low, high = (mid, high) if formed(mid) else (low, mid)
    found = _read(link, link.store, [epoch_key(low)])[0]
    return Epoch.from_json(found) if found is not None else None


def start_clean(link: CoordinatorLink) -> None:
    """Before this process takes its ticket: an earlier run of the job whose every process
    is gone is cleared (etcd), or refused with what to do (see the module doc)."""
    store, call = link.store, link.call
    etcd = store if isinstance(store, EtcdStore) else None
    for _ in range(_LOOKS):  # (another process cleared it, or took a ticket, meanwhile: look again)
        seen = call(etcd.modified, TICKETS) if etcd is not None else 0  # (first: a later change shows)

        def changed(seen: int = seen) -> bool:
            """Whether the tickets' count changed since the look began (a built-in coordinator's
            keys are never deleted: a ticket taken meanwhile is seen at the next look)."""
            return etcd is not None and call(etcd.modified, TICKETS) != seen

        count = _read(link, store, [TICKETS])[0]
        if count is None:
            return  # a new job
        epoch, taken = latest_epoch(link), int(count)
        if epoch is None and not taken:
            return  # a new job: no ticket taken yet (the count read as 0 made the key)
        members = list(epoch.members) if epoch is not None else []
        tickets = [*epoch.spares, *range(epoch.tickets + 1, taken + 1)] if epoch is not None else range(1, taken + 1)
        records = _read(link, store, [ticket_key(t) for t in tickets])
        if None in records:
            return  # a process taking its ticket now (or the job cleared meanwhile: its new run's)
        waiting = [json.loads(r)["member"] for r in records]
        if epoch is None:
            state = _judge(link, None, [], waiting, lambda st: _ALIVE in st.values(), changed)
        else:
            state = _judge(link, epoch, members, waiting,
                           lambda st: any(st.get(m) == _ALIVE for m in members), changed)
        if changed():
            continue  # (what was read may mix the earlier run and a new one)
        if epoch is None:
            if any(v != _GONE for v in state.values()):
                return  # founders gathering
        else:
            if any(state[m] != _GONE for m in members):
                return  # a running job: joined as before
            still = [m for m in waiting if state[m] != _GONE]
            if still:
                raise MembershipError(_waiting(link, etcd, epoch, still))
        if etcd is None:
            raise MembershipError(_gone(link, epoch, members or waiting))
        if call(etcd.clear_job, TICKETS, seen):
            log.warning("fastreduce: %s held an earlier run of this job whose processes are all gone (%s): its keys "
                        "(%s) are deleted, and this run starts clean", link.where, _named(epoch, members or waiting),
                        _root(etcd))
            return


def _judge(link: CoordinatorLink, epoch: Epoch | None, members: list[str], waiting: list[str],
           enough: Callable[[dict[str, str]], bool], changed: Callable[[], bool]) -> dict[str, str]:
    """Each process's state: gone, alive, or unknown (no heartbeat of its epoch, where a member;
    no pulse, where waiting). Looked at until ``enough(states)``, :func:`window_s` has passed or
    the job ``changed()``, a few requests a look however many processes (every key of a kind
    read in one)."""
    store = link.store
    names = list(dict.fromkeys([*members, *waiting]))
    me, state = process_identity.identity(), {}
    for m, record in zip(names, _read(link, store, [who_key(m) for m in names])):
        if record is not None and process_identity.exited_here(record.decode(), me):
            state[m] = _GONE
        elif record is not None and process_identity.running_here(record.decode(), me):
            state[m] = _ALIVE
    left = [m for m in names if m not in state]
    counters = [(store, {m: pulse_key(m) for m in left})]  # (a store, member -> its counter there)
    if epoch is not None:
        counters.append(_in_group(store, epoch, {m: f"{faults_heartbeat.STORE_PREFIX}heartbeat/"
                                                    f"{epoch.members.index(m)}" for m in left if m in members}))
    counters = [(s, {m: k for (m, k), v in zip(keys.items(), _read(link, s, list(keys.values()))) if v is not None})
                for s, keys in counters]  # the counters that exist
    beating = counters[1][1] if epoch is not None else {}
    told = {m: m in (beating if m in members and epoch is not None else counters[0][1]) for m in left}
    # (told: standing still says it is gone; a member's heartbeat says so, a waiting process's pulse)

    def read() -> dict[tuple[int, str], int]:
        return {(i, m): int(v) for i, (s, keys) in enumerate(counters)
                for m, v in zip(keys, _read(link, s, list(keys.values()))) if v is not None}

    seen = read()
    state.update({m: _ALIVE for (_, m), count in seen.items() if count >= RESTING})  # at rest, on purpose
    deadline = time.monotonic() + window_s()
    while not enough(state) and len(state) < len(names) and time.monotonic() < deadline and not changed():
        time.sleep(_LOOK_S)
        state.update({key[1]: _ALIVE for key, count in read().items() if count != seen.get(key, count)})
    over = time.monotonic() >= deadline
    for m in left:  # (the others told by their records)
        state.setdefault(m, _GONE if over and told[m] else _UNKNOWN)
    return state


def _in_group(store: Any, epoch: Epoch, keys: dict[str, str]) -> tuple[Any, dict[str, str]]:
    """Where to read ``keys`` (member -> key) of ``epoch``'s default group, and their names
    there: on etcd, the job's store and their whole names (:func:`_read` waits for none); else
    the group's store."""
    if isinstance(store, EtcdStore):
        return store, {m: torch_internals.default_group_key(group_prefix(epoch.number), k) for m, k in keys.items()}
    return group_store(epoch.number, store), keys


def _read(link: CoordinatorLink, store: Any, keys: list[str]) -> list[bytes | None]:
    """Each key's value, ``None`` where it is missing, never waited for: on etcd one request
    (where another process may delete the job's keys meanwhile); else two where all are set
    (a built-in coordinator's keys read here are never deleted)."""
    if not keys:
        return []
    if isinstance(store, EtcdStore):
        return link.call(store.values, keys)
    if link.call(store.check, keys):
        return list(link.call(faults_heartbeat.read_all, store, keys))
    return [link.call(store.get, k) if link.call(store.check, [k]) else None for k in keys]


def _root(etcd: EtcdStore) -> str:
    return f"/fastreduce/{etcd.job}/"


def _named(epoch: Epoch | None, names: list[str]) -> str:
    return f"{'its founders' if epoch is None else f'epoch {epoch.number}'}: {', '.join(names)}"


def _gone(link: CoordinatorLink, epoch: Epoch | None, names: list[str]) -> str:
    return (f"fastreduce: the coordinator ({link.where}) holds an earlier run of this job whose processes are all "
            f"gone ({_named(epoch, names)}; exited, or silent for {window_s():g} s), and a built-in coordinator "
            "cannot clear it: restart the coordinator (`fastreduce coordinator`) before the job, or run the job on "
            "etcd (coordinator='etcd://...'), where a new run clears an ended one by itself")


def _waiting(link: CoordinatorLink, etcd: EtcdStore | None, epoch: Epoch, still: list[str]) -> str:
    other = (f", give this run a job name of its own (etcd://.../<job>) or delete the old run's keys: "
             f"etcdctl del --prefix {_root(etcd)}") if etcd is not None else ", or restart the coordinator"
    return (f"fastreduce: the coordinator ({link.where}) holds an earlier run of this job whose members are all "
            f"gone ({_named(epoch, list(epoch.members))}), but {len(still)} process(es) still wait to join it "
            f"({', '.join(still)}): stop them and start the job again (it then starts clean){other}")
