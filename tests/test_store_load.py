"""The store suite (fastreduce/bench/store.py): its synthetic clients make the requests the
library's own heartbeat makes, and its figures are sane.

The pattern is not written down anywhere to compare with: a real rank's heartbeat (a
2-rank Gloo group, :func:`fastreduce.faults.start_heartbeat`) and one of the bench's
simulated ranks are both counted through :class:`Counted` connections, and their
requests must be the same.
"""

from __future__ import annotations

import threading
import time
from datetime import timedelta

import pytest
import torch.distributed as dist

import fastreduce.faults as faults
import fastreduce.faults_diagnosis as faults_diagnosis
import fastreduce.faults_heartbeat as faults_heartbeat
import fastreduce.faults_watchdog as faults_watchdog
import fastreduce.reach as reach
from fastreduce.bench import store as bench
from fastreduce.launch import run_ranks

pytestmark = pytest.mark.timeout(120)

BEAT_S = 0.05


class _ByThread(list):
    """A :class:`~fastreduce.bench.store.Counted` log that notes which thread made each request."""

    def append(self, entry: tuple) -> None:
        super().append((*entry, threading.get_ident()))


def _requests(beat: object, log: _ByThread) -> tuple[set, list]:
    """The requests ``beat`` made while beating a few times, then one read as the
    watchdog's: (the set of per-beat requests, the read's requests in order; the read's
    alone: a beat may land while it runs, on the heartbeat's thread, and did under load)."""
    time.sleep(6 * BEAT_S)
    beats = {(m, k) for m, k, *_ in log}
    del log[:]
    beat.counts()
    beat.verdict()
    me = threading.get_ident()
    return beats, [(m, k) for m, k, *_, who in log if who == me]


def _both(rank: int, world: int) -> dict:
    faults.start_heartbeat()
    dist.barrier()  # every rank's counter made (a read before a peer's start finds its key missing, and makes it)
    real = faults_heartbeat.heartbeat_now()
    assert real.connected.wait(30)  # its own connection made (until then it beats over the group's)
    log = _ByThread()
    real.store = bench.Counted(real.store, log)
    got = {"real": _requests(real, log), "real_beats": len(real.store.beats)}
    if rank == 0:  # the bench's simulated rank, on a store of its own
        server = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
        client = dist.TCPStore("127.0.0.1", server.port, is_master=False, wait_for_workers=False,
                               timeout=timedelta(seconds=10))
        sim_log = _ByThread()
        stop = threading.Event()
        conn = bench._Stoppable(client, sim_log, stop, publish=False)
        sims = [bench._heartbeat(conn.clone(), r, world, BEAT_S) for r in range(world)]
        del sim_log[:]
        for s in sims:
            threading.Thread(target=s._run, daemon=True).start()
        got["sim"] = _requests(sims[0], sim_log)
        got["sim_beats"] = len(sims[0].store.beats)
        stop.set()
    dist.barrier()
    return got


def test_the_simulated_rank_makes_the_real_heartbeats_requests(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(faults.HEARTBEAT_ENV, str(BEAT_S))
    got = run_ranks(_both, 2, timeout=60)
    real_beats, real_read = got[0]["real"]
    sim_beats, sim_read = got[0]["sim"]
    assert real_beats == sim_beats == {("add", 1)}, (real_beats, sim_beats)
    assert real_read == sim_read, (real_read, sim_read)  # every counter (2 keys) and the verdict
    assert [k for _, k in real_read].count(2) >= 1
    assert got[0]["real_beats"] >= 2 and got[0]["sim_beats"] >= 2


def test_synthetic_watch_figures_are_sane() -> None:
    n, seconds = 12, 2.0
    r = bench.run_synthetic("member_watch", n, seconds, procs=2)
    settings = bench.scenario_settings("member_watch")
    assert r["heartbeat_s"] == settings["heartbeat_s"] < r["window_s"] == settings["window_s"]
    beats = r["latency_ms"]["add"]["n"]
    expected = n * seconds / r["heartbeat_s"]
    assert 0.5 * expected <= beats <= 1.2 * expected + n, (beats, expected)
    reads = r["latency_ms"]["multi_get"]["n"]
    assert reads >= n and r["latency_ms"]["check"]["n"] >= 2 * reads - n  # counters' check, verdict's check
    assert r["keys_per_s"] > r["requests_per_s"] > 0
    for d in [r["all_ms"], *r["latency_ms"].values()]:
        assert 0 < d["p50"] <= d["p99"] <= d["max"]
    assert 0 < r["beat_gap_max_s"] and isinstance(r["false_losses"], int) and r["server_cpu"] >= 0
    assert "member_watch" in bench.format_text({"config": vars(bench.StoreConfig()) | {"clients": (n,)},
                                                "runs": [r]})


def test_synthetic_vote_runs_the_real_vote() -> None:
    r = bench.run_synthetic("vote", 4, 1.5, procs=2, step_rate=5.0)
    assert not r["membership_errors"], r["membership_errors"]
    assert r["vote_ms"]["n"] >= 4 * 3  # every member voted at (nearly) every step
    assert {"compare_set", "get"} <= set(r["latency_ms"])  # the decision written once, waited for by the others


def test_synthetic_formation_runs_the_real_gathering() -> None:
    """The ``form`` scenario: the members' real gathering for a next epoch, over and over;
    every survivor found each time, each epoch timed on every member."""
    n = 6
    r = bench.run_synthetic("form", n, 1.5, procs=2)
    assert not r["membership_errors"], r["membership_errors"]
    assert r["formations"] >= 3 and r["form_ms"]["n"] == n * r["formations"], r
    assert 0 <= r["form_ms"]["p50"] <= r["form_ms"]["max"] < 2000
    assert {"set", "add", "check"} <= set(r["latency_ms"])  # the announcement, the count, the keys


def test_config_is_checked() -> None:
    with pytest.raises(ValueError):
        bench.StoreConfig(scenarios=("nope",))
    with pytest.raises(ValueError):
        bench.StoreConfig(real_ranks=1)


def _on_this_host(beats: list) -> list:
    """The simulated heartbeats with the deadline the library gives a store served on this
    host (``process_identity.served_here``: ``LOCAL_GRACE`` windows), as this one is: the bench's
    default (one window, a store elsewhere) failed a read of 64 ranks' watchdogs in one
    process under CI's load ("the job's c10d store has not answered for 1 s")."""
    for b in beats:
        b.store_windows = faults.LOCAL_GRACE
    return beats


def _watch_until_lost(beat: object, out: dict, done: threading.Event) -> None:
    try:
        faults_watchdog.watch_heartbeats(beat, done)
    except faults.TransportError as err:
        out[beat.rank] = (time.monotonic(), sorted(beat.lost), str(err))


def _stacks(names: set[str]) -> dict[str, str]:
    """The Python stack of each live thread named in ``names``."""
    import sys
    import traceback

    frames = sys._current_frames()
    return {t.name: "".join(traceback.format_stack(frames[t.ident])[-6:]) for t in threading.enumerate()
            if t.name in names and t.ident in frames}


def test_at_a_large_world_each_rank_reads_its_successors_and_a_stopped_rank_is_named_by_all(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """64 simulated ranks watching k = 8 successors (faults.WATCHED_SUCCESSORS): each watchdog
    read carries k counters (their check made once) and the published verdict's key, k + 1
    keys a tick; a rank whose heartbeat stops is named, by its k watchers from its counter
    and by the others from the verdict, on every rank. Its last beat lands at most a tick
    before the stop, a watcher sees it within a tick, calls it silent a window later (to a
    tick) and the others read the verdict within a tick more: window + 3 ticks after the stop
    (plus slack for this loaded host)."""
    n, k, beat_s, window, victim = 64, 8, 0.25, 1.0, 37
    monkeypatch.setattr(faults_heartbeat, "WATCHED_SUCCESSORS", k)  # where Heartbeat.watched() reads it
    monkeypatch.setenv(faults.LOST_AFTER_ENV, str(window))
    server = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    client = dist.TCPStore("127.0.0.1", server.port, is_master=False, wait_for_workers=False,
                           timeout=timedelta(seconds=10))
    stop, stop_victim, done = threading.Event(), threading.Event(), threading.Event()
    logs: list[list] = [[] for _ in range(n)]
    beats = _on_this_host([bench._heartbeat(bench._Stoppable(reach.clone(client), logs[r], stop_victim if r == victim
                                                             else stop, True), r, n, beat_s) for r in range(n)])
    out: dict[int, tuple] = {}
    try:
        for b in beats:
            threading.Thread(target=b._run, daemon=True).start()
        for b in beats:
            threading.Thread(target=_watch_until_lost, args=(b, out, done), name=f"watch-{b.rank}", daemon=True).start()
        def reads_of(r: int) -> int:
            return sum(1 for m, *_ in list(logs[r]) if m == "multi_get")

        # the watchdogs' first read after a beat, then a few ticks each (a loaded host gets
        # 128 threads through them more slowly: waited for, within a limit)
        time.sleep(beat_s + 6 * beat_s)
        limit = time.monotonic() + 20
        while time.monotonic() < limit and min(reads_of(r) for r in range(n) if r != victim) < 3:
            time.sleep(beat_s)
        for r in range(n):
            if r == victim:
                continue
            reads = [(m, keys) for m, keys, *_ in logs[r] if m in ("check", "multi_get")]
            gets = [keys for m, keys in reads if m == "multi_get"]
            checks = [keys for m, keys in reads if m == "check"]
            assert len(gets) >= 3 and set(gets) == {k}, (r, reads)
            assert checks[0] == k and set(checks[1:]) == {1}, (r, reads)  # counters' check once, then the verdict's
            assert abs(len(checks) - 1 - len(gets)) <= 1, (r, reads)  # so k + 1 keys a tick (the last may be half-logged)
        assert not out, out  # no live rank named while every rank beat
        stopped = time.monotonic()
        stop_victim.set()
        bound = window + 3 * beat_s + 0.5
        live = [r for r in range(n) if r != victim]  # (the victim's own watch names its store silent: not counted)
        while any(r not in out for r in live) and time.monotonic() < stopped + bound + 30:  # (a limit; the bound is
            time.sleep(0.05)                                                                # asserted below)
        late = _stacks({f"watch-{r}" for r in range(n) if r != victim and r not in out})  # where a missing one waits
    finally:
        done.set()
        stop.set()
        stop_victim.set()
    named = {r: o for r, o in out.items() if r != victim}
    assert sorted(named) == live, (sorted(set(range(n)) - set(named)), late)
    watchers = {(victim - i) % n for i in range(1, k + 1)}
    for r, (at, lost, message) in named.items():
        assert lost == [victim], (r, lost, message)
        assert at - stopped <= bound, (r, round(at - stopped, 2), message)
        assert r in watchers or "found lost by another rank" in message, (r, message)
    assert sum("found lost by another rank" in m for _, _, m in named.values()) >= n - 1 - k  # the others: by the verdict


def test_at_a_large_world_a_diagnosis_names_every_rank_lost_at_once(monkeypatch: pytest.MonkeyPatch) -> None:
    """64 simulated ranks watching k = 8 successors; ranks 10-17 (all of rank 9's watched
    ranks) and 40 stop beating at once, and every live rank diagnoses (as after a failed
    collective): each names all nine, its own silent successors with those their watchers
    published on fastreduce/lost (rank 9 learns of 40 there; rank 1, which watches none of
    them, of all nine)."""
    n, k, beat_s, window = 64, 8, 0.25, 1.0
    lost = [*range(10, 18), 40]
    monkeypatch.setattr(faults_heartbeat, "WATCHED_SUCCESSORS", k)  # where Heartbeat.watched() reads it
    monkeypatch.setenv(faults.LOST_AFTER_ENV, str(window))
    server = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    client = dist.TCPStore("127.0.0.1", server.port, is_master=False, wait_for_workers=False,
                           timeout=timedelta(seconds=10))
    stop, stop_lost = threading.Event(), threading.Event()
    beats = _on_this_host([bench._heartbeat(bench._Stoppable(reach.clone(client), [], stop_lost if r in lost else stop,
                                                             True), r, n, beat_s) for r in range(n)])
    out: dict[int, tuple] = {}
    failed = threading.Barrier(n - len(lost))  # every survivor diagnoses the same failure

    def diagnose(b: object) -> None:
        failed.wait()
        out[b.rank] = faults_diagnosis._diagnose(b, window)

    try:
        for b in beats:
            threading.Thread(target=b._run, daemon=True).start()
        time.sleep(3 * beat_s)
        stop_lost.set()
        time.sleep(beat_s)  # a beat already on its way lands
        started = time.monotonic()
        threads = [threading.Thread(target=diagnose, args=(b,), daemon=True) for b in beats if b.rank not in lost]
        for t in threads:
            t.start()
        for t in threads:
            t.join(4 * window + 5)
    finally:
        stop.set()
    took = time.monotonic() - started
    assert sorted(out) == [r for r in range(n) if r not in lost], sorted(out)
    for r, (ranks, how, _) in out.items():
        assert ranks == lost, (r, ranks, how)
    assert took < 2 * window + 2, took
