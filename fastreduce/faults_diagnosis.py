"""The diagnosis of a failed collective (:mod:`fastreduce.faults`): which ranks are lost,
read from the heartbeat counters this rank watches and the ranks others published lost."""

from __future__ import annotations

import os
import time

import torch.distributed as dist

import fastreduce.faults_heartbeat as heartbeat
from .faults_heartbeat import LOCAL_GRACE, Heartbeat, lost_after
from .lifecycle import RESTING
from .process_identity import who_of
from .torch_internals import default_store, store_base

__all__ = ["diagnose"]


def store_host_rank() -> int | None:
    """The rank whose process hosts the job's store: rank 0 when ``init_process_group``
    made a TCP store itself; ``None`` under torchrun's agent store or another store."""
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE", "").lower() in ("1", "true"):
        return None
    store = default_store()
    base = store_base(store)
    if base is not None and not isinstance(base, dist.TCPStore):
        return None
    return 0


def diagnose(wait: float | None = None) -> tuple[list[int], str, dict[int, str]]:
    """Which ranks are lost: ``(ranks, how, who)``, ``ranks`` empty when none is (or
    when this process has no heartbeat to tell). Waits up to ``wait`` seconds
    (default :func:`lost_after`) for every watched rank's heartbeat to move; returns as
    soon as all have (in a world of more than :data:`WATCHED_SUCCESSORS` + 1, not before
    the window: see :func:`_silent`). Ranks found lost once are answered at once from then on."""
    beat = heartbeat.heartbeat_now()
    if beat is None or not beat.current():
        return [], "", {}
    return _diagnose(beat, lost_after() if wait is None else wait)


def _diagnose(beat: Heartbeat, wait: float) -> tuple[list[int], str, dict[int, str]]:
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
        if silent and len(beat.exited(silent, records)) == len(silent):
            how = "its process exited (seen on its host)"
        who = who_of(beat.registered(silent, records))
    except Exception:  # noqa: BLE001 - the store itself does not answer
        # [Note: the store dies mid-diagnosis] The store's host (rank 0) may have exited
        # because it raised this very error first: ranks silent for two heartbeats while
        # the others beat are the lost ones; with less evidence, the store's host is.
        quiet = time.monotonic() - start if start is not None else 0.0
        host = store_host_rank()
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


def _silent(beat: Heartbeat, before: dict[int, int], silent: list[int], start: float,
            wait: float, records: dict[int, str]) -> tuple[list[int], str, dict[int, str]] | None:
    """The diagnosis's wait: drops from ``silent`` (in place: what it holds when the store
    stops answering counts too) the ranks whose counters (``before``) moved within ``wait``
    seconds of ``start`` (or, for ranks whose process runs on this host, within
    :data:`LOCAL_GRACE` times that; ``records`` caches their registrations); returns the ranks other ranks published lost meanwhile
    (:meth:`Heartbeat.verdict`), if any.

    In a world every rank reads whole, a silent rank that ran on this host and has exited
    (:meth:`Heartbeat.exited`: a crash, an OOM kill) ends the wait at once, named lost alone
    (a rank lost elsewhere at the same time is named at the next failure, or by a
    Membership's next epoch), and the others read it published. Another rank's finding ends the wait, and of the
    ranks silent here only those it names are kept: a rank that found the loss first (a
    peer's process exited, a silent member at the vote) publishes it and leaves the
    group, its heartbeat stopping there; counted silent too, it was named lost with the
    dead one after :data:`LOCAL_GRACE` windows (a 10 s stall in tests; at the entry of a
    Membership's epoch, a live member left out of the next one).

    [Note: watching successors] Where this rank watches only its next k ranks, a lost rank
    elsewhere is seen by its own k watchers, which publish it on ``fastreduce/lost`` (a
    union: :meth:`Heartbeat._publish`). Some live rank always sees a loss: from any lost
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
        if found is not None and not sparse:  # another rank named the lost first; one silent here but not
            silent[:] = [r for r in silent if r in found[0]]  # named by it left the group after (see above)
            break
        gone = beat.exited(silent, records) if silent and not sparse else []
        if gone:  # ran on this host and exited: lost, no window waited (the live ones not waited for)
            found = beat.call(beat.verdict) or found  # read after the exits: a survivor that published
            if found is None:  # its finding and exited is named by it, not taken for lost
                silent[:] = gone
                break
            continue
        if now_s >= start + wait and (not sparse or silent or found is not None or now_s >= start + 2 * wait) \
                and not (silent and now_s < start + LOCAL_GRACE * wait and beat.slow_here(silent, records)):
            break
        time.sleep(min(0.25, beat.interval / 2))
        now = beat.call(beat.counts)
        silent[:] = [r for r in silent if now[r] == before[r] and now[r] < RESTING]  # at rest: not lost
        found = beat.call(beat.verdict) or found
    return found
