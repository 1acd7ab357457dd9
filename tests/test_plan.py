"""The cost model (``fastreduce/plan.py``) and ``fastreduce plan``: the collectives' bytes
and times against the alpha-beta formulas worked by hand, the buckets' closed forms against
the buckets played out one by one, the probe's inversion, the recommendation, an answer at
every model size from 1e6 to 1e15 parameters, no negative or non-finite figure for random
settings in range, every setting out of its range refused with that range, the table's
words, and ``--probe`` on a real torchrun group.

Whether the model predicts real steps is the network suite's growth part (``fastreduce
bench network --parts growth``, docs/scale.md): a measurement, not a test.
"""

from __future__ import annotations

import json
import math
import os
import random
import re
import subprocess
import sys
from pathlib import Path
from typing import Any, Iterator

import pytest

from fastreduce import plan as P
from fastreduce import sizing
from fastreduce.cli import main

MB = 2**20
FAST = P.Link(1e-3, 100e6)  # 1 ms, 100 MB/s


def test_the_model_imports_without_torch() -> None:
    """plan.py (and the plan_* modules it imports) is pure Python: imported with torch made unimportable."""
    root = Path(P.__file__).parent.parent
    code = ("import sys; sys.modules['torch'] = None; import fastreduce.plan as m; "
            "print(m.Cluster(4, m.Link(1e-3, 1e8)).all_reduce(4e6))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, cwd=root)
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
    assert "1,024" in sweep and "128x8" in sweep and sweep.count("\n") >= len(P.modes()) + 4
    assert main(["plan", "--params", "1b", "--ranks", "8,64", "--link", "1gbit", "--json"]) == 0
    assert [p["cluster"]["ranks"] for p in json.loads(capfd.readouterr().out)["plans"]] == [8, 64]


@pytest.mark.parametrize("argv,match", [
    (["--params", "7e9", "--ranks", "8"], "needs --ranks and --link"),
    (["--params", "7e9", "--ranks", "8", "--link", "1gbit", "--modes", "nope"], "no mode matches"),
    # A typo beside a name that matches was dropped silently (exit 0, the other row alone).
    (["--params", "7e9", "--ranks", "8", "--link", "1gbit", "--modes", "ddp,zero_fp16, fused"],
     "no mode matches ['zero_fp16']; the modes are ddp, fused_fp32"),
    (["--params", "7e9", "--ranks", "8", "--link", "1gbit", "--step-ms", "1", "--backward-ms", "5"],
     "--step-ms 1 is shorter than the backward (5 ms)"),
    (["--params", "7e9", "--ranks", "8", "--link", "1gbit", "--step-ms", "10", "--forward-ms", "5"],
     "give --forward-ms or --step-ms, not both"),
    (["--params", "7e9", "--ranks", "12", "--link", "1gbit"],
     "--ranks 12 is not a whole number of hosts of 8 GPUs: set --gpus-per-host to a divisor of 12"),
    (["--params", "7e9", "--ranks", "8,12", "--gpus-per-host", "8", "--link", "1gbit"], "--ranks 12"),
])
def test_settings_that_clash_are_refused_in_one_line(argv: list[str], match: str,
                                                     capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["plan", *argv]) == 2
    err = capsys.readouterr().err
    assert match in err and err.count("\n") == 1 and "Traceback" not in err, err


def _refused(argv: list[str], capsys: pytest.CaptureFixture[str]) -> str:
    """argparse's error for ``fastreduce plan ARGV``: exit status 2, two lines (the usage, the error)."""
    with pytest.raises(SystemExit) as stop:
        main(["plan", *argv])
    err = capsys.readouterr().err
    assert stop.value.code == 2 and err.count("\n") == 2 and "Traceback" not in err, err
    return err.splitlines()[1]


RATE, LATENCY = "1mbit to 100tbit", "0 to 1s"


@pytest.mark.parametrize("flag,value,bounds", [
    ("--params", "0.5", "1 to 1e15"), ("--params", "2e15", "1 to 1e15"), ("--params", "1e400", "1 to 1e15"),
    ("--params", "7x", "1 to 1e15"),
    ("--ranks", "0", "from 1 to 1,000,000"), ("--ranks", "8,2000000", "from 1 to 1,000,000"),
    ("--ranks", "8.5", "from 1 to 1,000,000"), ("--ranks", "8,x", "from 1 to 1,000,000"),
    ("--gpus-per-host", "0", "from 1 to 1,024"), ("--ranks-per-host", "2048", "from 1 to 1,024"),
    ("--link", "5kbit", RATE), ("--link", "1000tbit", RATE), ("--link", "fast", RATE),
    ("--intra-link", "0.5mbit", RATE), ("--latency", "2s", LATENCY), ("--latency", "-1us", LATENCY),
    ("--intra-latency", "5", LATENCY),
    ("--mtu", "10", "from 68"), ("--mtu", "1500.5", "from 68"), ("--mtu", "70000", "to 65536"),
    ("--backward-ms", "0", "above 0 and at most 86400000"), ("--backward-ms", "nan", "above 0"),
    ("--forward-ms", "-1", "above 0"), ("--step-ms", "inf", "at most 86400000"),
])
def test_every_setting_out_of_its_range_is_refused_with_the_range(
        flag: str, value: str, bounds: str, capsys: pytest.CaptureFixture[str]) -> None:
    argv = {"--params": "7e9", "--ranks": "1024", "--link": "100gbit", flag: value}
    line = _refused([f"{k}={v}" for k, v in argv.items()], capsys)  # "=": a value may start with "-"
    shown = repr(value.split(",")[-1])  # of several world sizes, the one refused
    named = "--gpus-per-host/--ranks-per-host" if flag.endswith("-per-host") else flag  # the alias's own name too
    assert line.startswith(f"fastreduce plan: error: argument {named}:") and bounds in line and shown in line, line


def test_the_api_refuses_what_the_command_refuses() -> None:
    link = P.Link.of("1gbit")
    for call, match in [
        (lambda: P.Link.of("1gbit", mtu=10), "the MTU must be a whole number of bytes from 68"),
        (lambda: P.TCP_PAYLOAD(70000), "the MTU must be"),
        (lambda: P.Link.of("5kbit"), "a link's rate must be 1mbit to 100tbit"),
        (lambda: P.Link.of(1e9, 2.0), "a link's latency must be 0 to 1s, got 2.0"),
        (lambda: P.Link(-1e-3, 1e9), "latency must be finite and at least 0"),
        (lambda: P.Link(0.0, 0.0), "bandwidth must be above 0"),
        (lambda: P.Link(0.0, math.nan), "bandwidth must be above 0"),
        (lambda: P.Cluster(0, link), "the world size must be a whole number of ranks from 1 to 1,000,000, got 0"),
        (lambda: P.Cluster(2_000_000, link), "from 1 to 1,000,000"),
        (lambda: P.Cluster(2048, link, 2048), "the ranks (GPUs) per host must be a whole number from 1 to 1,024"),
        (lambda: P.Cluster(12, link, 8), "must divide"),
        (lambda: P.Workload(0.5, 1.0), "the parameter count must be 1 to 1e15, got 0.5"),
        (lambda: P.Workload(math.inf, 1.0), "the parameter count must be 1 to 1e15"),
        (lambda: P.Workload(1e9, 0.0), "the backward's time must be above 0"),
        (lambda: P.Workload(1e9, 1.0, forward_s=-0.1), "a compute time must be 0 to a day"),
        (lambda: P.Workload(1e9, 1.0, optimizer_s=math.nan), "a compute time must be 0 to a day"),
        (lambda: P.Workload(1e9, 1.0, grad_bytes=0), "the bytes of a value must be 0.5 (int4) to 8 (fp64)"),
    ]:
        with pytest.raises(ValueError, match=re.escape(match)):
            call()


def test_a_selection_of_rows_is_each_name_it_gives() -> None:
    """``only=`` by name or kind, spaces around a name stripped (``--modes "ddp, fused"``),
    a generator read once (it was read up by the first row, and then no mode matched), a
    string one name; a name that matches no mode is refused, naming it, even beside ones that do."""
    cluster, work = P.Cluster(16, P.Link.of("100gbit"), 8), P.Workload(7e9, 0.57)
    fused = [m.name for m in P.modes() if m.kind == "fused"]
    for only in (["ddp", " fused"], (m for m in ["ddp", "fused "]), {"fused", "ddp"}):
        assert [r.mode for r in P.plan(cluster, work, only).rows] == ["ddp", *fused]
    assert [r.mode for r in P.plan(cluster, work, "zero_fp32").rows] == ["zero_fp32"]
    for only, match in [(["ddp", "zero_fp16"], "no mode matches ['zero_fp16']; the modes are ddp, "),
                        ((m for m in ["nope", "ddp", "also"]), "no mode matches ['also', 'nope']"),
                        ([], "no mode matches an empty selection"), ([" "], "no mode matches an empty selection")]:
        with pytest.raises(ValueError, match=re.escape(match)):
            P.plan(cluster, work, only)


# ============================================================== any model size, any setting in range

def _played_out(nbytes: float, backward_s: float, link: P.Link, first: float, size: float) -> tuple[float, int]:
    """The buckets one by one: each full at its share of the backward, started when it is full
    and the one before it is done."""
    cuts, left = [], nbytes
    while left > nbytes * 1e-12:
        cuts.append(min(first if not cuts else size, left))
        left -= cuts[-1]
    done = end = 0.0
    for take in cuts:
        done += take
        end = max(backward_s * done / nbytes, end) + link.seconds(take)
    return max(end - backward_s, 0.0), len(cuts)


def _gathered_played_out(nbytes: float, forward_s: float, link: P.Link, size: float) -> float:
    cuts, left = [], nbytes
    while left > nbytes * 1e-12:
        cuts.append(min(size, left))
        left -= cuts[-1]
    done = end = wait = 0.0
    for take in cuts:
        end += link.seconds(take)
        wait = max(wait, end - forward_s * done / nbytes)
        done += take
    return wait


def test_the_buckets_closed_forms_equal_the_buckets_played_out_one_by_one() -> None:
    rng = random.Random(7)
    for _ in range(2000):
        nbytes = rng.choice([rng.uniform(1, 300) * MB, float(rng.randint(1, 300) * MB), rng.uniform(1, 5000)])
        first = rng.choice([1.0, 2.0, 4.0, rng.uniform(0.1, 64)]) * MB
        size = rng.choice([1.0, 8.0, 25.0, 128.0, nbytes / MB, rng.uniform(0.1, 64)]) * MB
        backward = rng.choice([0.0, rng.uniform(0, 2)])
        link = P.Link(rng.choice([0.0, rng.uniform(0, 0.01)]), rng.choice([rng.uniform(1e5, 1e11), math.inf]))
        exposed, n = P.bucketed_exposed(nbytes, backward, link, first, size)
        want, want_n = _played_out(nbytes, backward, link, first, size)
        assert n == want_n and exposed == pytest.approx(want, rel=1e-9, abs=1e-12)
        assert P.gathered_exposed(nbytes, backward, link, size) == pytest.approx(
            _gathered_played_out(nbytes, backward, link, size), rel=1e-9, abs=1e-12)


def _numbers(value: Any, where: str = "") -> Iterator[tuple[str, float]]:
    if isinstance(value, dict):
        for k, v in value.items():
            yield from _numbers(v, f"{where}.{k}")
    elif isinstance(value, list):
        for k, v in enumerate(value):
            yield from _numbers(v, f"{where}[{k}]")
    elif isinstance(value, (int, float)) and not isinstance(value, bool):
        yield where, float(value)


PARAMS = ["1e6", "1e7", "1e8", "1e9", "1e10", "1e11", "1e12", "1e13", "1e14", "1e15"]


@pytest.mark.parametrize("params", PARAMS)
def test_every_model_size_from_a_million_to_a_quadrillion_parameters_answers(
        params: str, capfd: pytest.CaptureFixture[str]) -> None:
    """Each size, the table and the JSON: every mode priced, one host in 128 a link of its own."""
    argv = ["plan", "--params", params, "--ranks", "1024", "--link", "100gbit"]
    assert main(argv) == 0
    lines = capfd.readouterr().out.splitlines()
    assert lines[0].startswith("fastreduce plan: 1,024 ranks: 128 hosts of 8 GPUs"), lines[0]
    assert all(any(ln.startswith(m.name + " ") for ln in lines) for m in P.modes())
    assert any(ln.startswith("recommended: ") for ln in lines)
    assert main(argv + ["--json"]) == 0
    out = json.loads(capfd.readouterr().out)
    assert out["workload"]["params"] == float(params) and len(out["rows"]) == len(P.modes())
    bad = [(k, v) for k, v in _numbers(out) if not (math.isfinite(v) and v >= 0)]
    assert not bad, bad


def _log_uniform(rng: random.Random, lo: float, hi: float) -> float:
    return math.exp(rng.uniform(math.log(lo), math.log(hi)))


def _random_setting(rng: random.Random) -> tuple[P.Cluster, P.Workload]:
    per_host = rng.choice([1, 2, 4, 8, 16, 72, 1024, rng.randint(1, 1024)])
    hosts = rng.choice([1, 2, 3, 128, rng.randint(1, 1_000_000 // per_host)])
    link = P.Link.of(_log_uniform(rng, 1e6, 1e14), rng.choice([0.0, 1.0, rng.uniform(0, 1)]),
                     rng.choice([68, 1500, 9000, 65536, rng.randint(68, 65536)]))
    intra = P.Link.of(_log_uniform(rng, 1e6, 1e14), rng.uniform(0, 1e-3), mtu=None)
    backward = _log_uniform(rng, 1e-6, 86400)
    work = P.Workload(_log_uniform(rng, 1, 1e15), backward,
                      forward_s=rng.choice([None, 0.0, rng.uniform(0, 86400)]),
                      optimizer_s=rng.choice([0.0, rng.uniform(0, 10)]), grad_bytes=rng.choice([4.0, 2.0]))
    return P.Cluster(hosts * per_host, link, per_host, intra), work


def test_no_setting_in_range_gives_a_negative_or_non_finite_figure() -> None:
    """300 random settings across every range: every time, byte count and memory in the plan is
    finite and at least 0, every step at least its compute, and the table prints."""
    from fastreduce.plan_cli import format_text

    rng = random.Random(20240611)
    for _ in range(300):
        cluster, work = _random_setting(rng)
        p = P.plan(cluster, work)
        bad = [(k, v) for k, v in _numbers(p.to_json()) if not (math.isfinite(v) and v >= 0)]
        assert not bad, (cluster, work, bad)
        for r in p.rows:
            least = work.forward + work.backward_s  # ZeRO's optimizer steps 1/N of the parameters
            assert r.step_s >= least * (1 - 1e-12) and r.host_bytes_per_step >= r.bytes_per_step, (cluster, work, r)
        assert p.recommendation["mode"] in {r.mode for r in p.rows}
        assert "nan" not in format_text(p) and "inf" not in format_text(p).replace("info", "")


def test_random_command_lines_in_range_answer_with_finite_figures(capfd: pytest.CaptureFixture[str]) -> None:
    """The same through the command: 40 random command lines, every setting given."""
    rng = random.Random(5)
    for _ in range(40):
        per_host = rng.choice([1, 4, 8, 1024])
        argv = ["plan", "--params", f"{_log_uniform(rng, 1, 1e15):.6g}",
                "--ranks", str(per_host * rng.choice([1, 2, 16, 976])), "--gpus-per-host", str(per_host),
                "--link", f"{_log_uniform(rng, 1e6, 1e14):.6g}bit", "--latency", f"{rng.uniform(0, 1e6):.6g}us",
                "--intra-link", f"{_log_uniform(rng, 1e6, 1e14):.6g}bit", "--intra-latency", f"{rng.uniform(0, 1):.6g}s",
                "--mtu", str(rng.randint(68, 65536)), "--backward-ms", f"{_log_uniform(rng, 1e-3, 8.64e7):.6g}",
                "--grad-dtype", rng.choice(["fp32", "bf16"]), "--json"]
        assert main(argv) == 0, argv
        out = json.loads(capfd.readouterr().out)
        bad = [(k, v) for k, v in _numbers(out) if not (math.isfinite(v) and v >= 0)]
        assert not bad, (argv, bad)


# ============================================================== what the output says

def test_gpus_per_host_is_asked_in_the_users_words_and_said_first(capfd: pytest.CaptureFixture[str]) -> None:
    base = ["plan", "--params", "7e9", "--link", "100gbit"]
    assert main(base + ["--ranks", "1024"]) == 0
    first = capfd.readouterr().out.splitlines()[0]
    assert "1,024 ranks: 128 hosts of 8 GPUs (8 a host assumed: --gpus-per-host sets it)" in first, first
    for flag in ("--gpus-per-host", "--ranks-per-host"):
        assert main(base + ["--ranks", "1024", flag, "4"]) == 0
        first = capfd.readouterr().out.splitlines()[0]
        assert "1,024 ranks: 256 hosts of 4 GPUs;" in first and "assumed" not in first, first
    assert main(base + ["--ranks", "64", "--gpus-per-host", "1"]) == 0
    assert "64 ranks: 64 hosts of 1 GPU;" in capfd.readouterr().out.splitlines()[0]
    assert main(base + ["--ranks", "4"]) == 0  # a world smaller than a host is one host
    assert "4 ranks: 1 host of 4 GPUs" in capfd.readouterr().out.splitlines()[0]


def test_the_columns_say_what_they_count(capfd: pytest.CaptureFixture[str]) -> None:
    """The MB column is each host's link (its 8 GPUs together, 8 times a rank's share); the
    memory column is one GPU's."""
    argv = ["plan", "--params", "7e9", "--ranks", "1024", "--gpus-per-host", "8", "--link", "100gbit",
            "--backward-ms", "900"]
    assert main(argv) == 0
    lines = capfd.readouterr().out.splitlines()
    head = lines.index(next(ln for ln in lines if ln.startswith("mode ")))
    top, low = lines[head - 1], lines[head]
    for words in ("host link", "on the wire", "exposed", "step", "memory"):
        assert words in top, top
    for words in ("MB per step", "ms per step", "vs ddp", "GiB per GPU", "note"):
        assert words in low, low
    assert "MB/rank" not in "\n".join(lines)
    assert main(argv + ["--json"]) == 0
    rows = {r["mode"]: r for r in json.loads(capfd.readouterr().out)["rows"]}
    ddp = rows["ddp"]
    assert ddp["host_bytes_per_step"] == pytest.approx(8 * ddp["bytes_per_step"])
    assert ddp["host_bytes_per_step"] == pytest.approx(2 * 127 / 128 * 7e9 * 4)  # the ring's bytes out of a host
    table = next(ln for ln in lines if ln.startswith("ddp "))
    assert f"{ddp['host_bytes_per_step'] / MB:.1f}" in table.split() and \
        f"{ddp['memory_bytes'] / 2**30:.2f}" in table.split(), table


def test_the_link_within_a_host_carries_no_tcp_framing(capfd: pytest.CaptureFixture[str]) -> None:
    """--mtu is the host link's: NVLink, PCIe and shared memory carry their rate as payload."""
    assert main(["plan", "--params", "1e9", "--ranks", "16", "--link", "100gbit", "--mtu", "9000", "--json"]) == 0
    cluster = json.loads(capfd.readouterr().out)["cluster"]
    assert cluster["intra"]["bytes_per_s"] == pytest.approx(1e12 / 8)
    assert cluster["link"]["bytes_per_s"] == pytest.approx(1e11 / 8 * (9000 - 52) / (9000 + 14))


def test_help_is_plain_text(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as stop:
        main(["plan", "--help"])
    text = capsys.readouterr().out
    assert stop.value.code == 0
    for markup in ("``", ":mod:", ":func:", ":class:", ":data:", "\\"):
        assert markup not in text, markup
    assert text.startswith("usage: fastreduce plan --params N (--ranks N[,N...] --link RATE | --probe) [options]")
    assert "--gpus-per-host N, --ranks-per-host N" in text and "What each data-parallel mode will cost" in text
    words = " ".join(text.split())
    for bounds in ("1 to 1e15", "1 to 1,000,000", "1 to 1,024", "1mbit to 100tbit", "0 to 1s", "68 to 65536"):
        assert bounds in words, bounds


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

