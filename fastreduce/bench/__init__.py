"""``fastreduce bench``: what gradient reduction costs, alone and inside a training step.

Suites, each a subcommand with its own options (:mod:`.options`; ``fastreduce bench SUITE
--help``), each on real Gloo ranks the command launches itself (``--ranks``, 2 by default;
the optim suite: ``fastreduce bench optim --ranks 2,4``). ``fastreduce bench`` alone runs
``reduce`` and ``step``, ``fastreduce bench all`` every suite. The old flat spelling,
``fastreduce bench --suite SUITE`` with prefixed options (``--chaos-modes``), still runs
for this release, with a deprecation note on stderr:

* ``reduce`` (:mod:`.reduce`): the reduction call alone, against the bare collective,
  the unavoidable flat cast+all-reduce+cast and the per-parameter loop; plus the
  ops-per-call count for 50 and 500 gradient tensors.
* ``step`` (:mod:`.step`): whole steps (forward + backward + reduce + zero_grad, no
  optimizer step) of fastreduce fused and overlapped, the per-parameter loops, DDP and
  DDP with the fp16 compression hook, on a many-tensor and a few-tensor model.
* ``optim`` (:mod:`.optim`): whole training steps with the AdamW step (forward +
  backward + reduce + AdamW + zero_grad) of ``fastreduce.ZeroOptimizer`` (sharded
  AdamW state), fastreduce's fused reducer + AdamW, DDP + AdamW and PyTorch's
  ``ZeroRedundancyOptimizer``, at each world size; also each one's optimizer-state
  bytes per rank.
* ``decentralized`` (:mod:`.gossip`): gossip training steps
  (``DecentralizedDataParallel``) against the reducers, at its ``--ranks``.
* ``local`` (:mod:`.local`): local-update training steps (``LocalSGD``, ``DiLoCo`` at
  H = 1, 8, 32) against DDP and a step without communication, at its ``--ranks``
  (2 by default): step time and bytes on the wire per step, and a table of the loss
  each reaches after the same number of steps on a small model.
* ``network``: hosts as network namespaces (needs root) over links limited with
  ``tbf``. Two parts (``--parts``): whole training steps between two hosts and on one (:mod:`.network`:
  DDP, fused, overlapped and ZeRO at their defaults, each eager and under a plain
  ``torch.compile``, at 1 Gbit/s, 100 Mbit/s and on this host, three jobs each), and every mode training one task on ``--hosts`` hosts (2 and 4) at 10 Gbit/s,
  1 Gbit/s and 100 Mbit/s (:mod:`.network_modes`: step time, bytes on the wire, the loss
  reached, the time to reach DDP's loss; ``network_modes.png``). ``--rates`` sets both
  parts' rates. A third part, run only when named (``--parts growth``, :mod:`.growth`):
  each mode's bytes and step on 2 to 16 hosts beside ``fastreduce plan``'s (``growth.png``). A
  fourth, also only when named (``--parts defaults``, :mod:`.defaults`): the overlapped mode's
  and ZeRO's ``bucket_mb="auto"`` on four untuned model shapes against DDP and their best
  hand-set ``bucket_mb``.
* ``compression`` (:mod:`.compression`): ``fastreduce.PowerSGD`` against DDP and DDP + torch's
  ``powerSGD_hook`` (rank 4, error feedback, warm start, one bucket), side by side: on one
  host (``--ranks``, a GPT-2 of ``--layers`` blocks) and on two namespace hosts at each
  ``--rates`` entry (default 100 Mbit/s; ``--quick``: one host only).
* ``convergence`` (:mod:`.convergence`): what each method's bytes cost in loss. A byte-level
  GPT-2 (0.84M parameters) trained on the running Python's standard-library source with
  each data-parallel method (DDP fp32, DDP + torch's ``powerSGD_hook``, fused bf16,
  fastreduce's PowerSGD, DiLoCo H = 32) from the same weights on the same batches, one
  whole run after another (not interleaved), ``--steps`` (300) steps at each world size of
  its ``--ranks`` (2 and 4): held-out loss against steps and wall time
  (``convergence.png``), the final loss, bytes per step, step time and the wall time to
  DDP fp32's final loss. One host, or namespace hosts (one rank each) at each ``--rates``
  entry. Also ``--eval-every``, ``--train-mb``, ``--powersgd-warmup``, ``--powersgd-rank``
  (this suite and the compression suite), ``--methods``, ``--params-m``, ``--batch`` (sequences per rank);
  ``--quick``: a 4 x 32 model, 40 steps, 2 ranks.
* ``trainers`` (:mod:`.trainers`): the Hugging Face ``Trainer`` in fastreduce's modes
  against the ``Trainer`` with DDP: ZeRO at its defaults on this host (step and optimizer
  state per rank), DiLoCo (H = 32, bf16) on two namespace hosts at each ``--rates`` entry
  other than ``host`` (default: ``host`` and 100 Mbit/s), three jobs each, with the
  Trainer's own ``train_samples_per_second`` beside; ``--quick``: one job, ``host`` only.
* ``faults`` (:mod:`.faults`): training that goes on when a member is lost and a replacement
  joins, side by side on the same MLP, data and failure schedule: ``fastreduce.Membership`` +
  the fused reducer on Gloo and on shared memory, torchft 0.2.0 (where it imports) and
  checkpoint-restart (``Checkpointer`` every 20 steps, the whole job relaunched): the stall at
  the loss, the steps discarded, the joiner's first commit (process start and imports apart),
  the members' stall at the join, the wall time to ``--steps`` (300) committed steps and the
  per-step cost with no failure. Also ``--contenders``, ``--wire``, ``--mode``
  (``zero``: ``ZeroOptimizer(redundant=True)``, fastreduce's contenders only),
  ``--params-m`` (1 by default; 10 for the joiner target's model); ``--quick``: 3 members,
  a 0.05M model, 24 steps.
* ``chaos`` (:mod:`.chaos`): the modes ``fastreduce.Membership`` runs (fused with a bf16
  wire, overlapped with small buckets, DiLoCo, gossip over a ring; ZeRO, which it refuses, is
  listed as not run) on Gloo and on shared memory: 4 members train a seeded MLP regression to
  ``--steps`` (300) committed steps through three seeded kills (mid-step, in flight: inside
  backward or the reduction or the sync, and between steps; ``--seed``), each replaced 20
  steps later. Per mode and transport: the losses, joins, steps discarded and stall per loss,
  every member's parameter digests equal after each heal, the final held-out loss against a
  failure-free run of the same data and seeds (within 1%), the wall time; ``chaos.csv``,
  ``chaos_steps.csv`` (every member's every step) and ``chaos.png`` (loss and world size
  against wall time, a panel per mode). Also ``--modes``, ``--transports``,
  ``--params-m`` (0.1), ``--batch`` (64); ``--quick``: 3 members, 30 steps, one kill and one
  join, the overlapped mode on shared memory.
* ``exits`` (:mod:`.exits`): the scripts users write (the HF Trainer and Lightning in every
  mode under ``torchrun``, a ``Membership`` job with a member killed and replaced) launched
  again and again: every exit code 0.
* ``store`` (:mod:`.store`): the c10d store's load from the heartbeat, the watchdog and the
  membership vote: 64 real Gloo ranks and up to 1,024 synthetic ones running the library's
  own loops on counted connections (requests and keys per second, latency, false losses,
  the server's CPU).

Each prints a table (median, p10, p90; methods interleaved round-robin) and PASS/FAIL
target lines; the exit code is 0 whatever the targets say (it is a report). The step
suite also writes ``step.csv`` and ``step.png`` (matplotlib, the ``plot`` extra; without
it the chart is skipped with a one-line note) into ``--out``, the optim suite
``optim.csv`` (the same columns, one row per world size and method); every run writes the
whole result as ``bench.json`` there too. ``--json`` prints that same object, and
nothing else, on stdout: what torch, Gloo or the ranks print goes to stderr.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from .chaos import format_text as format_chaos
from .chaos import run_chaos_bench
from .chaos import write_outputs as write_chaos_outputs
from .joiner_kills import format_text as format_joiner_kills
from .joiner_kills import run_joiner_kills
from .joiner_kills import write_outputs as write_joiner_kills_outputs
from .common import machine_info
from .compression import format_text as format_compression
from .compression import run_compression_bench
from .convergence import format_text as format_convergence
from .convergence import run_convergence_bench, write_convergence_chart
from .defaults import format_text as format_defaults
from .defaults import run_defaults_bench
from .faults import format_text as format_faults
from .faults import run_faults_bench
from .gossip import GossipConfig, run_gossip_bench
from .gossip import format_text as format_gossip
from .growth import format_text as format_growth
from .growth import run_growth_bench, write_growth_chart
from .local import LocalConfig, run_local_bench
from .local import format_text as format_local
from .network import format_text as format_network
from .network import run_network_bench
from .network_modes import format_text as format_modes
from .network_modes import run_modes_bench, write_modes_chart
from .optim import OptimConfig, run_optim_bench
from .optim import csv_rows as optim_csv_rows
from .optim import format_text as format_optim
from . import options
from .exits import format_text as format_exits
from .exits import run_exits_bench
from .options import (SUITES, chaos_config, compression_config, configs_from_args, convergence_config,
                      defaults_config, exits_config, faults_config, growth_config, modes_config, network_config, network_parts,
                      store_config, suites_from_args, trainers_config)
from .reduce import BenchConfig, run_bench
from .store import format_text as format_store
from .store import run_store_bench
from .reduce import format_text as format_reduce
from .report import write_chart, write_csv
from .step import REFERENCE as STEP_REFERENCE
from .step import StepConfig, chart_title, csv_rows, run_step_bench
from .step import format_text as format_step
from .trainers import run_trainers_bench
from .trainers import format_text as format_trainers

__all__ = ["BenchConfig", "GossipConfig", "LocalConfig", "NETWORK_PARTS", "NetworkPart", "OptimConfig", "StepConfig", "SUITES",
           "add_arguments", "run", "run_bench", "run_local_bench", "run_optim_bench", "run_step_bench"]

@dataclass(frozen=True, slots=True)
class NetworkPart:
    """One part of the network suite (``--parts``)."""

    key: str
    """Its report's key in ``bench.json``."""
    help: str
    """What it runs, for ``--parts``'s help."""
    config: Callable[[argparse.Namespace], Any]
    """Its settings from the options (:mod:`.options`); raises ValueError on a bad one."""
    bench: Callable[[Any], dict[str, Any]]
    text: Callable[[dict[str, Any]], str]
    progress: Callable[[Any], str]
    """The line on stderr as it starts, from its settings."""
    default: bool = True
    """Runs without ``--parts`` (else only when named)."""


NETWORK_PARTS: dict[str, NetworkPart] = {
    "steps": NetworkPart("network", "every mode at its defaults against DDP's, eager and compiled, on 2 hosts",
                         network_config, run_network_bench, format_network,
                         lambda c: f"network suite: 2 ranks at {', '.join(c.rates)} (namespace hosts, or this "
                                   f"host), {c.repeats} x {c.iters} steps/method ..."),
    "modes": NetworkPart("network_modes", "every mode's step time, bytes and loss on --hosts hosts",
                         modes_config, run_modes_bench, format_modes,
                         lambda c: f"network suite, modes: {', '.join(map(str, c.hosts))} hosts at "
                                   f"{', '.join(c.rates)}, {c.steps} steps/mode ..."),
    "growth": NetworkPart("network_growth", "each mode's bytes and step against 2 to 16 hosts beside fastreduce "
                          "plan's formula and prediction, docs/scale.md; runs only when named", growth_config, run_growth_bench, format_growth,
                          lambda c: f"network suite, growth: {', '.join(map(str, c.hosts))} hosts at "
                                    f"{', '.join(c.rates)}, {c.repeats} jobs each ...", default=False),
    "defaults": NetworkPart("network_defaults", "bucket_mb=\"auto\" on untuned model shapes against DDP and the best "
                            "hand-set bucket_mb; runs only when named", defaults_config, run_defaults_bench,
                            format_defaults, lambda c: f"network suite, defaults: {', '.join(c.models)} at "
                                                       f"{', '.join(c.rates)}, {c.repeats} jobs each ...", default=False),
}
"""The network suite's parts, in the order they run: a part is an entry here."""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """``fastreduce bench``'s arguments (:mod:`.options`): a subcommand per suite, and the
    deprecated flat spelling."""
    options.add_arguments(parser, {name: part.help for name, part in NETWORK_PARTS.items()})


def write_outputs(out: Path, result: dict[str, Any]) -> dict[str, Any]:
    """``bench.json`` always; ``step.csv`` and ``step.png`` when the step suite ran, ``optim.csv``
    when the optim suite did."""
    out.mkdir(parents=True, exist_ok=True)
    files: dict[str, Any] = {"json": str(out / "bench.json")}
    modes = result.get("network_modes")
    if modes is not None and "runs" in modes:
        files["network_png"] = str(out / "network_modes.png")
        files["network_chart_note"] = write_modes_chart(modes, out / "network_modes.png")
    growth = result.get("network_growth")
    if growth is not None and "table" in growth:
        note = write_growth_chart(growth, out / "growth.png")
        files["growth_png"] = None if note else str(out / "growth.png")
        files["growth_chart_note"] = note
    step = result.get("step")
    convergence = result.get("convergence")
    if convergence is not None and convergence.get("runs"):
        note = write_convergence_chart(convergence, out / "convergence.png")
        files["convergence_png"] = None if note else str(out / "convergence.png")
        files["convergence_chart_note"] = note
    if step is not None:
        rows = csv_rows(step)
        write_csv(out / "step.csv", rows)
        files["csv"] = str(out / "step.csv")
        note = write_chart(out / "step.png", rows, chart_title(step), reference=STEP_REFERENCE)
        files["png"] = None if note else str(out / "step.png")
        files["chart_note"] = note
    chaos = result.get("chaos")
    if chaos is not None:  # the chaos run, or (--joiner-runs) the joiner-kill scenario
        joiner = chaos.get("scenario") == "joiner_kills"
        files.update((write_joiner_kills_outputs if joiner else write_chaos_outputs)(chaos, out))
    optim = result.get("optim")
    if optim is not None:
        rows = optim_csv_rows(optim)
        write_csv(out / "optim.csv", rows)
        files["optim_csv"] = str(out / "optim.csv")
    result["outputs"] = files
    (out / "bench.json").write_text(json.dumps(result, indent=1))
    return files


def run(args: argparse.Namespace) -> int:
    """The ``bench`` subcommand: returns 0 whether targets pass or fail (it is a report).
    SIGTERM (``kill``, ``timeout``) ends it as Ctrl-C would, through every ``finally``: the
    namespace hosts it made are deleted and their processes killed (Python's default for
    SIGTERM ends the process at once and leaves them behind)."""
    import signal
    import threading
    if threading.current_thread() is not threading.main_thread():
        return _run(args)
    before = signal.signal(signal.SIGTERM, lambda signum, _frame: sys.exit(128 + signum))
    try:
        return _run(args)
    finally:
        signal.signal(signal.SIGTERM, before)


def _run(args: argparse.Namespace) -> int:
    suites = suites_from_args(args)  # first: the deprecation note comes before any error
    reduce_cfg, step_cfg, optim_cfg, gossip_cfg, local_cfg = configs_from_args(args)
    network_cfgs = {name: part.config(args) for name, part in NETWORK_PARTS.items()}  # checked before spawning
    convergence_cfg = convergence_config(args)
    parts = network_parts(args, NETWORK_PARTS)
    faults_cfg = faults_config(args) if "faults" in suites else None
    chaos_cfg = chaos_config(args) if "chaos" in suites else None
    exits_cfg = exits_config(args) if "exits" in suites else None
    out = Path(args.out)

    def note(text: str) -> None:  # progress and notes: stderr, so stdout stays the report
        print(text, file=sys.stderr, flush=True)

    def say(text: str) -> None:  # the report itself: stdout, unless --json
        if not args.json:
            print(text, file=getattr(args, "stdout", sys.stdout), flush=True)

    result: dict[str, Any] = {"suites": list(suites), "machine": machine_info()}
    for suite in suites:
        if suite == "reduce":
            note(f"reduce suite: {reduce_cfg.ranks} ranks, {reduce_cfg.params_m:g}M params, "
                f"{reduce_cfg.iters} calls/method ...")
            result["reduce"] = run_bench(reduce_cfg)
            say(format_reduce(result["reduce"]) + "\n")
        elif suite == "decentralized":
            note(f"decentralized suite: {', '.join(map(str, gossip_cfg.world_sizes))} ranks, "
                 f"{gossip_cfg.params_m:g}M params, batch {gossip_cfg.batch}, {gossip_cfg.iters} blocks/method ...")
            result["decentralized"] = run_gossip_bench(gossip_cfg)
            say(format_gossip(result["decentralized"]) + "\n")
        elif suite == "local":
            note(f"local suite: {', '.join(map(str, local_cfg.world_sizes))} ranks, "
                 f"{local_cfg.params_m:g}M params, batch {local_cfg.batch}, {local_cfg.iters} blocks/method, "
                 f"loss table of {local_cfg.loss_steps} steps ...")
            result["local"] = run_local_bench(local_cfg)
            say(format_local(result["local"]) + "\n")
        elif suite == "network":
            for name in parts:
                part, cfg = NETWORK_PARTS[name], network_cfgs[name]
                note(part.progress(cfg))
                result[part.key] = part.bench(cfg)
                say(part.text(result[part.key]) + "\n")
        elif suite == "compression":
            cfg = compression_config(args)
            hosts = f", 2 namespace hosts at {', '.join(cfg.rates)}" if cfg.rates else ""
            note(f"compression suite: one host ({cfg.ranks} ranks, GPT-2 {cfg.layers} layers){hosts}, "
                 f"{cfg.iters} steps/method ...")
            result["compression"] = run_compression_bench(cfg)
            say(format_compression(result["compression"]) + "\n")
        elif suite == "convergence":
            c = convergence_cfg
            where = f"namespace hosts at {', '.join(c.rates)}" if c.rates else "one host"
            note(f"convergence suite: {', '.join(map(str, c.world_sizes))} ranks ({where}), GPT-2 "
                 f"{c.layers} x {c.width}, batch {c.batch} x {c.positions}, {c.steps} steps/method, "
                 f"{', '.join(c.methods)} ...")
            result["convergence"] = run_convergence_bench(c)
            say(format_convergence(result["convergence"]) + "\n")
        elif suite == "trainers":
            cfg = trainers_config(args)
            note(f"trainers suite: the HF Trainer on 2 ranks at {', '.join(cfg.rates)}, {cfg.repeats} jobs ...")
            result["trainers"] = run_trainers_bench(cfg)
            say(format_trainers(result["trainers"]) + "\n")
        elif suite == "faults" and faults_cfg is not None:
            c = faults_cfg
            note(f"faults suite: {', '.join(c.contenders)}; {c.members} members, {c.params_m:g}M params, "
                 f"{c.steps} committed steps, a loss at step {c.kill_step} ...")
            result["faults"] = run_faults_bench(c)
            say(format_faults(result["faults"]) + "\n")
        elif suite == "store":
            c = store_config(args)
            note(f"store suite: {c.real_ranks} real ranks, then {', '.join(map(str, c.clients))} synthetic ones "
                 f"({', '.join(c.scenarios)}), {c.seconds:g} s each ...")
            result["store"] = run_store_bench(c)
            say(format_store(result["store"]) + "\n")
        elif suite == "chaos" and chaos_cfg is not None:
            c = chaos_cfg
            note(f"chaos suite: {', '.join(c.modes)} on {', '.join(c.transports)}; {c.members} members, "
                 f"{c.params_m:g}M params, {c.steps} committed steps, {len(c.kinds)} kills, each run and a "
                 "failure-free one ...")
            joiner = bool(c.joiner_runs)  # --joiner-runs: replacements killed as they join, instead
            result["chaos"] = run_joiner_kills(c) if joiner else run_chaos_bench(c)
            say((format_joiner_kills if joiner else format_chaos)(result["chaos"]) + "\n")
        elif suite == "exits" and exits_cfg is not None:
            c = exits_cfg
            note(f"exits suite: {', '.join(c.modes)}; {c.hf} HF Trainer and {c.lightning} Lightning launches a mode, "
                 f"{c.membership} membership jobs ...")
            result["exits"] = run_exits_bench(c)
            say(format_exits(result["exits"]) + "\n")
        elif suite == "optim":
            note(f"optim suite: {', '.join(map(str, optim_cfg.world_sizes))} ranks, "
                 f"{optim_cfg.params_m:g}M params, batch {optim_cfg.batch}, {optim_cfg.iters} steps/method ...")
            result["optim"] = run_optim_bench(optim_cfg)
            say(format_optim(result["optim"]) + "\n")
        else:
            note(f"step suite: {step_cfg.ranks} ranks, 2 models of {step_cfg.params_m:g}M params, "
                f"batch {step_cfg.batch}, {step_cfg.iters} steps/method ...")
            result["step"] = run_step_bench(step_cfg)
            say(format_step(result["step"]) + "\n")
    files = write_outputs(out, result)
    for key in ("chart_note", "network_chart_note", "growth_chart_note", "convergence_chart_note", "chaos_chart_note"):
        if files.get(key):
            note(files[key])
    say("wrote " + ", ".join(v for k, v in files.items() if not k.endswith("chart_note") and v))
    if args.json:
        print(json.dumps(result), file=getattr(args, "stdout", sys.stdout), flush=True)
    return 0
