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
from fastreduce.bench import store as bench
from fastreduce.launch import run_ranks

pytestmark = pytest.mark.timeout(120)

BEAT_S = 0.05


def _requests(beat: object, log: list) -> tuple[set, list]:
    """The requests ``beat`` made while beating a few times, then one read as the
    watchdog's: (the set of per-beat requests, the read's requests in order)."""
    time.sleep(6 * BEAT_S)
    beats = {(m, k) for m, k, *_ in log}
    del log[:]
    beat.counts()
    beat.verdict()
    return beats, [(m, k) for m, k, *_ in log]


def _both(rank: int, world: int) -> dict:
    faults.start_heartbeat()
    real = faults._beat
    log: list = []
    real.store = bench.Counted(real.store, log)
    got = {"real": _requests(real, log), "real_beats": len(real.store.beats)}
    if rank == 0:  # the bench's simulated rank, on a store of its own
        server = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
        client = dist.TCPStore("127.0.0.1", server.port, is_master=False, wait_for_workers=False,
                               timeout=timedelta(seconds=10))
        sim_log: list = []
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
    assert not r["vote_errors"], r["vote_errors"]
    assert r["vote_ms"]["n"] >= 4 * 3  # every member voted at (nearly) every step
    assert {"compare_set", "get"} <= set(r["latency_ms"])  # the decision written once, waited for by the others


def test_config_is_checked() -> None:
    with pytest.raises(ValueError):
        bench.StoreConfig(scenarios=("nope",))
    with pytest.raises(ValueError):
        bench.StoreConfig(real_ranks=1)
