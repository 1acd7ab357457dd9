"""The cost model (``fastreduce/plan.py``) and ``fastreduce plan``: the collectives' bytes
and times against the alpha-beta formulas worked by hand, the probe's inversion, the
recommendation, the CLI's errors, and ``--probe`` on a real torchrun group.

Whether the model predicts real steps is the network suite's growth part (``fastreduce
bench network --parts growth``, docs/scale.md): a measurement, not a test.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

from fastreduce import plan as P
from fastreduce import sizing
from fastreduce.cli import main

MB = 2**20
FAST = P.Link(1e-3, 100e6)  # 1 ms, 100 MB/s


def test_the_model_imports_without_torch() -> None:
    """plan.py is pure Python: loaded on its own with torch made unimportable."""
    path = Path(P.__file__)
    code = ("import importlib.util, sys; sys.modules['torch'] = None; "
            f"spec = importlib.util.spec_from_file_location('plan', {str(path)!r}); "
            "m = importlib.util.module_from_spec(spec); sys.modules['plan'] = m; spec.loader.exec_module(m); "
            "print(m.Cluster(4, m.Link(1e-3, 1e8)).all_reduce(4e6))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert float(out.stdout) == pytest.approx(2 * 2 * 1e-3 + 2 * 3 / 4 * 4e6 / 1e8)


@pytest.mark.parametrize("n", [2, 3, 4, 16, 64])
def test_flat_ring_bytes_and_time_are_the_alpha_beta_formula(n: int) -> None:
    c = P.Cluster(n, FAST)
    nbytes = 8e6
    hops = min(n - 1, math.ceil(math.log2(n)))
    assert c.ring_bytes(nbytes) == pytest.approx(2 * (n - 1) / n * nbytes)
    assert c.all_reduce(nbytes) == pytest.approx(2 * hops * 1e-3 + 2 * (n - 1) / n * nbytes / 100e6)
    assert c.reduce_scatter(nbytes) == pytest.approx(c.all_reduce(nbytes) / 2)
    assert P.Cluster(1, FAST).all_reduce(nbytes) == 0.0


def test_hosts_of_several_ranks_share_their_link() -> None:
    """64 ranks, 8 a host: 2 (H-1)/H of the buffer leaves each host, an eighth of it each rank's."""
    intra = P.Link(5e-6, 100e9)
    c = P.Cluster(64, FAST, 8, intra)
    assert c.hosts == 8
    assert c.ring_bytes(8e6) == pytest.approx(2 * 7 / 8 * 8e6 / 8)
    expect = 2 * 7 * 5e-6 + 2 * 7 / 8 * 8e6 / 100e9 + 2 * 3 * 1e-3 + 2 * 7 / 8 * 8e6 / 100e6
    assert c.all_reduce(8e6) == pytest.approx(expect)


@pytest.mark.parametrize("ranks,per_host", [(2, 1), (4, 1), (16, 1), (16, 4), (64, 8), (8, 8)])
def test_the_probe_is_turned_back_into_the_link(ranks: int, per_host: int) -> None:
    """What a group's all-reduce measured gives back the host link that would cost as much."""
    intra = P.Link(5e-6, 50e9)
    true = P.Cluster(ranks, P.Link(2e-4, 1.2e8), per_host, intra)
    back = P.Cluster.from_probe(true.as_link("all_reduce"), ranks, per_host, intra)
    for nbytes in (0.0, 4096.0, 64e6):
        assert back.all_reduce(nbytes) == pytest.approx(true.all_reduce(nbytes), rel=1e-9)
    if true.hosts > 1:
        assert back.link.bytes_per_s == pytest.approx(1.2e8) and back.link.latency_s == pytest.approx(2e-4)


def test_rates_times_and_counts_read_as_users_write_them() -> None:
    assert P.parse_rate("100gbit") == 1e11 and P.parse_rate("100mbit") == 1e8 and P.parse_rate("1gbps") == 8e9
    assert P.parse_seconds("20us") == pytest.approx(2e-5) and P.parse_seconds("1.5ms") == pytest.approx(1.5e-3)
    assert P.parse_bytes("7e9") == 7e9 and P.parse_bytes("7b") == 7e9 and P.parse_bytes("125M") == 125e6
    assert P.Link.of("1gbit", "0us", mtu=1500).bytes_per_s == pytest.approx(1e9 / 8 * 1448 / 1514)
    for bad, fn in (("1gb", P.parse_rate), ("-1gbit", P.parse_rate), ("20", P.parse_seconds), ("7x", P.parse_bytes)):
        with pytest.raises(ValueError, match="unit like"):
            fn(bad)
    with pytest.raises(ValueError, match="must divide"):
        P.Cluster(12, FAST, 8)


def _rows(cluster: P.Cluster, work: P.Workload) -> dict[str, P.Estimate]:
    return {r.mode: r for r in P.plan(cluster, work).rows}


def test_each_modes_bytes_per_step() -> None:
    """Per rank and step: the ring's 2 (N-1)/N for the reducing modes (ZeRO's reduce-scatter
    plus its all-gather of the fp32 parameters: the same), the wire's width, one peer's worth
    for one-peer-exp gossip, and 1/H of a sync for the local modes."""
    n, params = 8, 1e6
    rows = _rows(P.Cluster(n, FAST), P.Workload(params, backward_s=0.01))
    ring = 2 * (n - 1) / n * params
    for mode, per_value in (("ddp", 4), ("fused_fp32", 4), ("fused_bf16", 2), ("fused_int8", 1 + 4 / 256),
                            ("overlapped_fp32", 4), ("zero_fp32", 4)):
        assert rows[mode].bytes_per_step == pytest.approx(ring * per_value), mode
    assert rows["zero_bf16"].bytes_per_step == pytest.approx(ring * (2 + 4) / 2)  # bf16 reduce-scatter, fp32 gather
    assert rows["gossip_bf16"].bytes_per_step == pytest.approx(2 * params)
    assert rows["localsgd_H8"].bytes_per_step == pytest.approx(ring * 4 / 8)
    assert rows["diloco_H32_int4"].bytes_per_step == pytest.approx(ring * (0.5 + 4 / 256) / 32)


def test_exposed_time_follows_the_overlap_each_mode_has() -> None:
    c = P.Cluster(4, FAST)
    work = P.Workload(1e6, backward_s=0.05, forward_s=0.02, optimizer_s=0.01)
    rows = _rows(c, work)
    fused = rows["fused_fp32"]
    assert fused.exposed_s == pytest.approx(c.all_reduce(4e6)) and fused.step_s == pytest.approx(0.08 + fused.comm_s)
    assert rows["overlapped_fp32"].exposed_s < fused.exposed_s  # buckets sent during a 50 ms backward
    assert rows["ddp"].exposed_s < fused.exposed_s
    assert rows["gossip_fp32"].exposed_s == 0.0  # 41 ms: hidden behind the next forward and backward
    # a slower link (201 ms): the forward and backward hide 70 ms of it; the optimizer step
    # runs after the exchange ends (the mix is applied, then stepped, then sent), so it hides none
    gossip = _rows(P.Cluster(4, P.Link(1e-3, 20e6)), work)["gossip_fp32"]
    assert gossip.exposed_s == pytest.approx(gossip.comm_s - 0.07) and gossip.step_s == pytest.approx(gossip.comm_s + 0.01)
    local = rows["localsgd_H8"]
    assert local.exposed_s == pytest.approx(c.all_reduce(4e6) / 8)
    zero = rows["zero_fp32"]  # the optimizer steps a quarter of the parameters
    assert zero.step_s == pytest.approx(0.02 + 0.05 + 0.01 / 4 + zero.exposed_s)
    assert zero.memory_bytes < fused.memory_bytes


def test_bucketed_exposure_by_hand() -> None:
    """4 MB in 1 MB buckets over a 40 ms backward on a 10 ms + 1 MB/10 ms link: each bucket is
    full every 10 ms and takes 20 ms, so they queue; the last ends at 10 + 4 x 20 = 90 ms."""
    link = P.Link(0.01, MB / 0.01)
    exposed, n = P.bucketed_exposed(4 * MB, 0.04, link, MB, MB)
    assert n == 4 and exposed == pytest.approx(0.09 - 0.04)
    assert P.gathered_exposed(4 * MB, 0.04, link, MB) == pytest.approx(0.08 - 0.03)


def test_auto_buckets_are_the_plans_choice() -> None:
    """bucket_mb="auto" at run time and the plan choose with one function."""
    assert sizing.choose is P.choose and sizing.Link is P.Link


def test_recommendation_names_an_exact_mode_where_the_link_keeps_up_else_what_to_check() -> None:
    fast = P.plan(P.Cluster(8, P.Link.of("100gbit")), P.Workload(1e8, backward_s=0.5))
    assert fast.recommendation["mode"] in {"overlapped_fp32", "zero_fp32", "ddp", "fused_fp32"}
    slow = P.plan(P.Cluster(64, P.Link.of("1gbit"), 8), P.Workload(1e9, backward_s=0.1))
    rec = slow.recommendation
    assert not next(m for m in P.modes() if m.name == rec["mode"]).exact
    assert "held-out loss" in rec["reason"] and rec["exact"] in {m.name for m in P.modes() if m.exact}


def test_cli_table_and_json(capfd: pytest.CaptureFixture[str]) -> None:
    argv = ["plan", "--params", "7e9", "--ranks", "1024", "--ranks-per-host", "8", "--link", "100gbit",
            "--latency", "20us", "--backward-ms", "900"]
    assert main(argv) == 0
    text = capfd.readouterr().out
    assert "128 hosts of 8" in text and "recommended:" in text and "zero_fp32" in text
    assert main(argv + ["--json"]) == 0
    out = json.loads(capfd.readouterr().out)
    assert out["cluster"]["hosts"] == 128 and out["workload"]["backward_s"] == pytest.approx(0.9)
    rows = {r["mode"]: r for r in out["rows"]}
    assert rows["zero_fp32"]["memory_bytes"] < rows["ddp"]["memory_bytes"] / 2
    assert out["recommendation"]["mode"] in rows
    assert main(["plan", "--params", "1b", "--ranks", "8,64,1024", "--ranks-per-host", "8", "--link", "1gbit"]) == 0
    sweep = capfd.readouterr().out
    assert "1024" in sweep and sweep.count("\n") >= len(P.modes()) + 2
    assert main(["plan", "--params", "1b", "--ranks", "8,64", "--link", "1gbit", "--json"]) == 0
    assert [p["cluster"]["ranks"] for p in json.loads(capfd.readouterr().out)["plans"]] == [8, 64]


@pytest.mark.parametrize("argv,match", [
    (["--params", "7e9", "--ranks", "8"], "needs --ranks and --link"),
    (["--params", "7e9", "--ranks", "8,x", "--link", "1gbit"], "world sizes like"),
    (["--params", "7e9", "--ranks", "8", "--link", "fast"], "a link rate"),
    (["--params", "7e9", "--ranks", "8", "--link", "1gbit", "--modes", "nope"], "no mode matches"),
    (["--params", "7e9", "--ranks", "8", "--link", "1gbit", "--step-ms", "1", "--backward-ms", "5"], "shorter"),
])
def test_cli_errors_name_the_option(argv: list[str], match: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["plan", *argv]) == 2
    assert match in capsys.readouterr().err


def test_probe_on_a_real_torchrun_group() -> None:
    """``torchrun -m fastreduce plan --probe``: 2 Gloo ranks on this host measure their link; rank 0 prints."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "FASTREDUCE_DEVICE": "cpu"}
    torchrun = Path(sys.executable).with_name("torchrun")
    out = subprocess.run([str(torchrun), "--standalone", "--nproc-per-node", "2", "-m", "fastreduce", "plan",
                          "--probe", "--params", "1e6", "--backward-ms", "10", "--json"],
                         capture_output=True, text=True, timeout=120, env=env)
    assert out.returncode == 0, out.stderr[-3000:]
    lines = [ln for ln in out.stdout.splitlines() if ln.startswith("{")]
    assert len(lines) == 1  # rank 0 only
    result = json.loads(lines[0])
    assert result["probed"] and result["cluster"]["ranks"] == 2 and result["cluster"]["hosts"] == 1
    link = result["cluster"]["intra"]
    assert link["bytes_per_s"] > 1e7 and 0 < link["latency_s"] < 0.1
    assert len(result["rows"]) == len(P.modes())

