"""``fastreduce bench``: what gradient reduction costs, alone and inside a training step.

Three suites, each on real Gloo ranks the command launches itself (``--ranks``, 2 by
default; the optim suite: ``--optim-ranks``, 2 and 4). ``reduce`` and ``step`` run unless
``--suite`` picks one (``all``: all three):

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
  (``DecentralizedDataParallel``) against the reducers, at ``--gossip-ranks``.
* ``local`` (:mod:`.local`): local-update training steps (``LocalSGD``, ``DiLoCo`` at
  H = 1, 8, 32) against DDP and a step without communication, at ``--local-ranks``
  (2 by default): step time and bytes on the wire per step, and a table of the loss
  each reaches after the same number of steps on a small model.
* ``network``: hosts as network namespaces (needs root) over links limited with
  ``tbf``. Two parts: whole training steps between two hosts and on one (:mod:`.network`:
  DDP, fused, overlapped and ZeRO at their defaults, each eager and under a plain
  ``torch.compile``, at 1 Gbit/s, 100 Mbit/s and on this host, three jobs each), and every mode training one task on ``--hosts`` hosts (2 and 4) at 10 Gbit/s,
  1 Gbit/s and 100 Mbit/s (:mod:`.network_modes`: step time, bytes on the wire, the loss
  reached, the time to reach DDP's loss; ``network_modes.png``). ``--rates`` sets both
  parts' rates.
* ``compression`` (:mod:`.compression`): ``fastreduce.PowerSGD`` against DDP and DDP + torch's
  ``powerSGD_hook`` (rank 4, error feedback, warm start, one bucket), side by side: on one
  host (``--ranks``, a GPT-2 of ``--layers`` blocks) and on two namespace hosts at each
  ``--rates`` entry (default 100 Mbit/s; ``--quick``: one host only).
* ``convergence`` (:mod:`.convergence`): what each method's bytes cost in loss. A byte-level
  GPT-2 (0.84M parameters) trained on the running Python's standard-library source with
  each data-parallel method (DDP fp32, DDP + torch's ``powerSGD_hook``, fused bf16,
  fastreduce's PowerSGD, DiLoCo H = 32) from the same weights on the same batches, one
  whole run after another (not interleaved), ``--steps`` (300) steps at each world size of
  ``--convergence-ranks`` (2 and 4): held-out loss against steps and wall time
  (``convergence.png``), the final loss, bytes per step, step time and the wall time to
  DDP fp32's final loss. One host, or namespace hosts (one rank each) at each ``--rates``
  entry. Also ``--eval-every``, ``--train-mb``, ``--powersgd-warmup``, ``--powersgd-rank``
  (this suite and the compression suite), ``--convergence-methods``, ``--params-m``, ``--batch`` (sequences per rank);
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
  per-step cost with no failure. Also ``--faults-contenders``, ``--faults-wire``, ``--faults-mode``
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
  against wall time, a panel per mode). Also ``--chaos-modes``, ``--chaos-transports``,
  ``--params-m`` (0.1), ``--batch`` (64); ``--quick``: 3 members, 30 steps, one kill and one
  join, the overlapped mode on shared memory.

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
from pathlib import Path
from typing import Any

from .chaos import MODES as CHAOS_MODES
from .chaos import TRANSPORTS as CHAOS_TRANSPORTS
from .chaos import ChaosConfig, run_chaos_bench
from .chaos import format_text as format_chaos
from .chaos import quick_config as chaos_quick_config
from .chaos import write_outputs as write_chaos_outputs
from .common import machine_info
from .compression import CompressionConfig, run_compression_bench
from .compression import format_text as format_compression
from .convergence import DEFAULT_WORLD_SIZES as CONVERGENCE_WORLD_SIZES
from .convergence import METHODS as CONVERGENCE_METHODS
from .convergence import QUICK_WORLD_SIZES as CONVERGENCE_QUICK_WORLD_SIZES
from .convergence import ConvergenceConfig, quick_config, run_convergence_bench, width_for, write_convergence_chart
from .convergence import format_text as format_convergence
from .faults import CONTENDERS as FAULTS_CONTENDERS
from .faults import MODES as FAULTS_MODES
from .faults import WIRES as FAULTS_WIRES
from .faults import FaultsConfig, run_faults_bench
from .faults import format_text as format_faults
from .faults import quick_config as faults_quick_config
from .gossip import DEFAULT_BATCH as GOSSIP_BATCH
from .gossip import DEFAULT_PARAMS_M as GOSSIP_PARAMS_M
from .gossip import GossipConfig, run_gossip_bench
from .gossip import format_text as format_gossip
from .local import DEFAULT_BATCH as LOCAL_BATCH
from .local import DEFAULT_PARAMS_M as LOCAL_PARAMS_M
from .local import DEFAULT_WORLD_SIZES as LOCAL_WORLD_SIZES
from .local import QUICK_LOSS_STEPS, LocalConfig, run_local_bench
from .local import format_text as format_local
from .network import HOST, NetworkConfig, run_network_bench
from .network import format_text as format_network
from .network_modes import ModesConfig, run_modes_bench, write_modes_chart
from .network_modes import format_text as format_modes
from .optim import DEFAULT_WORLD_SIZES, QUICK_WORLD_SIZES, OptimConfig, parse_world_sizes, run_optim_bench
from .optim import MODELS as OPTIM_MODELS
from .optim import csv_rows as optim_csv_rows
from .optim import format_text as format_optim
from .reduce import BenchConfig, run_bench
from .reduce import format_text as format_reduce
from .report import write_chart, write_csv
from .step import REFERENCE as STEP_REFERENCE
from .step import StepConfig, chart_title, csv_rows, run_step_bench
from .step import format_text as format_step
from .trainers import TrainersConfig, run_trainers_bench
from .trainers import format_text as format_trainers

__all__ = ["BenchConfig", "LocalConfig", "OptimConfig", "StepConfig", "add_arguments", "run", "run_bench",
           "run_local_bench", "run_optim_bench", "run_step_bench"]

SUITES = ("reduce", "step", "optim", "decentralized", "local", "network", "compression", "convergence", "trainers",
          "faults", "chaos")
DEFAULT_SUITES = ("reduce", "step")
"""What runs without ``--suite``: the optim, decentralized, local, network, compression and
convergence suites are asked for by name or ``all``."""
DEFAULT_OUT = "bench-results"
STEP_BATCH = 64
"""Rows per rank and step: both compute and communication matter at 12M parameters."""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--suite", choices=(*SUITES, "all"), default=None,
                        help="which suite to run (default: reduce and step; all: every suite)")
    parser.add_argument("--ranks", type=int, default=2, help="Gloo ranks to spawn (default: 2)")
    parser.add_argument("--iters", type=int, default=None,
                        help="timed calls (reduce) / steps (step, optim) per method (default: 20; 4 with --quick); "
                             "faults suite: steps per timed block (default: 100; 3 with --quick)")
    parser.add_argument("--params-m", type=float, default=None,
                        help="model size in millions of fp32 parameters (default: 12, the local suite "
                             f"{LOCAL_PARAMS_M:g}, the decentralized suite {GOSSIP_PARAMS_M:g}; 0.25 with --quick; "
                             "the convergence suite: its GPT-2's width is picked to come nearest, default 0.84; the faults "
                             "suite: its MLP's, default 1, 0.05 with --quick; the chaos suite's: 0.1, 0.05 with --quick)")
    parser.add_argument("--batch", type=int, default=None,
                        help=f"step, optim, decentralized and local suites: input rows per rank (default: "
                             f"{STEP_BATCH}, the local suite {LOCAL_BATCH}, the decentralized suite "
                             f"{GOSSIP_BATCH}; 8 with --quick; the convergence suite: sequences per rank, 8, "
                             "4 with --quick; the chaos suite: 64, 32 with --quick)")
    parser.add_argument("--bucket-mb", type=float, default=None,
                        help="step and optim suites: bucket size of overlapped fastreduce (and of "
                             "ZeroOptimizer) in MB (default: the process-group backend's default)")
    parser.add_argument("--threads", type=int, default=None,
                        help="step, optim and convergence suites: intra-op threads per rank (default: "
                             "cores / ranks)")
    parser.add_argument("--optim-ranks", default=None, metavar="N,N",
                        help="optim suite: the world sizes to run, comma-separated (default: "
                             + ",".join(map(str, DEFAULT_WORLD_SIZES)) + "; "
                             + ",".join(map(str, QUICK_WORLD_SIZES)) + " with --quick)")
    parser.add_argument("--zero-bucket-mb", default=None, metavar="MB,MB",
                        help="optim suite: also time zero_adamw at each of these bucket sizes, side by side "
                             "with its default (rows zero_adamw_<mb>mb)")
    parser.add_argument("--optim-model", default="many", choices=OPTIM_MODELS,
                        help="optim suite: the step suite's model (many, the default) or the decentralized "
                             f"suite's 48 x (Linear + LayerNorm) (blocks; {GOSSIP_PARAMS_M:g}M params, batch "
                             f"{GOSSIP_BATCH} unless given)")
    parser.add_argument("--set-to-none", action="store_true",
                        help="optim suite: every method zeroes with zero_grad(set_to_none=True), torch's "
                             "default (default: in place)")
    parser.add_argument("--gossip-ranks", default=None, metavar="N,N",
                        help="decentralized suite: the world sizes to run (default: 2,4; 2 with --quick)")
    parser.add_argument("--gossip-optimizer", default="plain", choices=("plain", "fused"),
                        help="decentralized suite: every method's AdamW as users write it (plain, the default) "
                             "or with fused=True where torch has it")
    parser.add_argument("--local-ranks", default=None, metavar="N,N",
                        help="local suite: the world sizes to run (default: "
                             + ",".join(map(str, LOCAL_WORLD_SIZES)) + ")")
    parser.add_argument("--rates", default=None, metavar="RATE,RATE",
                        help="network and trainers suites: link rates, tc's units, and 'host' (two ranks on "
                             "this host) (default: 1gbit,100mbit,host for the steps part, 1gbit,100mbit for the "
                             "modes part; 1gbit with --quick); the convergence suite: namespace hosts at each rate "
                             "instead of one host")
    parser.add_argument("--hosts", default=None, metavar="N,N",
                        help="network suite, modes part: host counts (default: 2,4; 2 with --quick)")
    parser.add_argument("--network-parts", default="steps,modes", metavar="PART,PART",
                        help="network suite: steps (every mode at its defaults against DDP's, eager and "
                             "compiled), modes (every mode's "
                             "step time, bytes and loss), or both (default)")
    parser.add_argument("--network-modes", default=None, metavar="NAME,NAME",
                        help="network suite, modes part: the modes to run (default: all; ddp always runs, "
                             "the reference)")
    parser.add_argument("--layers", type=int, default=None,
                        help="compression suite: GPT-2 blocks of the one-host model (default: 12; 2 with --quick)")
    parser.add_argument("--convergence-ranks", default=None, metavar="N,N",
                        help="convergence suite: the world sizes (with --rates: host counts) to run (default: "
                             + ",".join(map(str, CONVERGENCE_WORLD_SIZES)) + "; "
                             + ",".join(map(str, CONVERGENCE_QUICK_WORLD_SIZES)) + " with --quick)")
    parser.add_argument("--convergence-methods", default=None, metavar="NAME,NAME",
                        help="convergence suite: the methods to train (default: all: "
                             + ",".join(CONVERGENCE_METHODS) + ")")
    parser.add_argument("--steps", type=int, default=None,
                        help="convergence suite: training steps per method (default: 300; 40 with --quick); "
                             "faults suite: committed steps per contender (default: 300; 24 with --quick); "
                             "chaos suite: committed steps per run (default: 300; 30 with --quick)")
    parser.add_argument("--faults-contenders", default=None, metavar="NAME,NAME",
                        help="faults suite: which to run (default: all: " + ",".join(FAULTS_CONTENDERS) + ")")
    parser.add_argument("--faults-mode", default="fused", choices=FAULTS_MODES,
                        help="faults suite: fastreduce's mode under Membership (zero: ZeroOptimizer(redundant=True),"
                             " fastreduce's contenders only; default: fused)")
    parser.add_argument("--faults-wire", default="fp32", choices=tuple(FAULTS_WIRES),
                        help="faults suite: fastreduce's wire dtype, Membership's and checkpoint-restart's "
                             "(default: fp32, torchft's)")
    parser.add_argument("--chaos-modes", default=None, metavar="NAME,NAME",
                        help="chaos suite: the modes to run (default: all: " + ",".join(CHAOS_MODES) + "; "
                             "overlap with --quick)")
    parser.add_argument("--chaos-transports", default=None, metavar="NAME,NAME",
                        help="chaos suite: the transports (default: " + ",".join(CHAOS_TRANSPORTS) + "; shm with "
                             "--quick)")
    parser.add_argument("--seed", type=int, default=None,
                        help="chaos suite: draws the kills (steps, victims, order) and the data (default: 0)")
    parser.add_argument("--eval-every", type=int, default=None,
                        help="convergence suite: steps between held-out evaluations (default: 25; 10 with --quick)")
    parser.add_argument("--train-mb", type=float, default=None,
                        help="convergence suite: MiB of stdlib source to train on (default: 4; the next MiB "
                             "is held out)")
    parser.add_argument("--powersgd-warmup", type=int, default=None,
                        help="convergence suite: exact steps before both PowerSGD rows compress (default: 10%% "
                             "of the steps, at least 2)")
    parser.add_argument("--powersgd-rank", type=int, default=None,
                        help="compression and convergence suites: PowerSGD's rank, torch's hook and fastreduce "
                             "alike (default: 4)")
    parser.add_argument("--quick", action="store_true",
                        help="tiny models, few iterations: proves the benchmark runs (CI)")
    parser.add_argument("--json", action="store_true",
                        help="print one JSON object on stdout and nothing else")
    parser.add_argument("--out", default=DEFAULT_OUT, metavar="DIR",
                        help=f"where the CSV, chart and JSON go (default: {DEFAULT_OUT}/)")


def network_config(args: argparse.Namespace) -> NetworkConfig:
    """The network suite's settings: ``--quick`` is one rate, two steps, nothing compiled."""
    from .hosts import check_rate
    rates = args.rates.split(",") if args.rates else (["1gbit"] if args.quick else NetworkConfig().rates)
    for rate in rates:
        if rate != HOST:
            check_rate(rate)
    if args.quick:
        return NetworkConfig(rates=rates, iters=args.iters or 2, warmup=1, batch=args.batch or 64, compile=False,
                             repeats=1)
    return NetworkConfig(rates=rates, **({"iters": args.iters} if args.iters else {}),
                         **({"batch": args.batch} if args.batch else {}))


def modes_config(args: argparse.Namespace) -> ModesConfig:
    """The modes part of the network suite: ``--quick`` is 2 hosts at 1 Gbit/s, 8 steps, one job."""
    from .hosts import check_rate
    rates = [r for r in args.rates.split(",") if r != HOST] if args.rates else \
        (["1gbit"] if args.quick else ModesConfig().rates)
    for rate in rates:
        check_rate(rate)
    hosts = [2] if args.quick and not args.hosts else ModesConfig().hosts
    if args.hosts:
        try:
            hosts = [int(h) for h in args.hosts.split(",")]
        except ValueError:
            raise ValueError(f"--hosts must be host counts like 2,4, got {args.hosts!r}") from None
        if any(h < 2 for h in hosts):
            raise ValueError(f"--hosts: every count must be at least 2, got {args.hosts!r}")
    chosen: dict[str, object] = {}
    if args.network_modes is not None:
        from .network_modes import MODES
        names = [m for m in args.network_modes.split(",") if m]
        unknown = [m for m in names if m not in MODES]
        if unknown or not names:
            raise ValueError(f"--network-modes takes names among {', '.join(MODES)}, got {args.network_modes!r}")
        chosen["modes"] = ["ddp"] + [m for m in names if m != "ddp"]
    if args.quick:
        return ModesConfig(hosts=hosts, rates=rates, steps=8, reach_factor=2, batch=args.batch or 64,
                           job_per_mode=False, **chosen)
    return ModesConfig(hosts=hosts, rates=rates, **({"batch": args.batch} if args.batch else {}), **chosen)


def _psgd_rank(args: argparse.Namespace) -> int | None:
    if args.powersgd_rank is not None and args.powersgd_rank < 1:
        raise ValueError(f"--powersgd-rank must be at least 1, got {args.powersgd_rank}")
    return args.powersgd_rank


def compression_config(args: argparse.Namespace) -> CompressionConfig:
    """The compression suite's settings: ``--quick`` is a small GPT-2 on one host, 2 steps."""
    from .hosts import check_rate
    rank = {"rank": args.powersgd_rank} if _psgd_rank(args) else {}
    rates = [r for r in args.rates.split(",") if r != HOST] if args.rates else \
        ([] if args.quick else CompressionConfig().rates)
    for rate in rates:
        check_rate(rate)
    if args.layers is not None and args.layers < 1:
        raise ValueError(f"--layers must be at least 1, got {args.layers}")
    if args.quick:
        return CompressionConfig(ranks=args.ranks, rates=rates, layers=args.layers or 2, width=64, seq=16,
                                 batch=args.batch or 2, iters=args.iters or 2, warmup=3, threads=args.threads,
                                 **rank)
    return CompressionConfig(ranks=args.ranks, rates=rates, threads=args.threads, **rank,
                             **({"layers": args.layers} if args.layers else {}),
                             **({"iters": args.iters} if args.iters else {}),
                             **({"batch": args.batch} if args.batch else {}),
                             **({"bucket_mb": args.bucket_mb} if args.bucket_mb else {}))


def convergence_config(args: argparse.Namespace) -> ConvergenceConfig:
    """The convergence suite's settings: ``--quick`` is :func:`~.convergence.quick_config`;
    with ``--rates``, namespace hosts."""
    from .hosts import check_rate

    given: dict[str, object] = {}
    if args.convergence_ranks is not None:
        given["world_sizes"] = list(parse_world_sizes(args.convergence_ranks, "--convergence-ranks"))
    if args.convergence_methods is not None:
        methods = [m for m in args.convergence_methods.split(",") if m]
        unknown = [m for m in methods if m not in CONVERGENCE_METHODS]
        if unknown or not methods:
            raise ValueError(f"--convergence-methods takes names among {', '.join(CONVERGENCE_METHODS)}, "
                             f"got {args.convergence_methods!r}")
        given["methods"] = methods
    if args.rates and [r for r in args.rates.split(",") if r != HOST]:  # 'host': the one-host default
        rates = [r for r in args.rates.split(",") if r != HOST]
        for rate in rates:
            check_rate(rate)
        given["rates"] = rates
    for key, value in (("steps", args.steps), ("eval_every", args.eval_every), ("train_mb", args.train_mb),
                       ("powersgd_warmup", args.powersgd_warmup), ("powersgd_rank", _psgd_rank(args)),
                       ("batch", args.batch), ("threads", args.threads)):
        if value is not None:
            given[key] = value
    cfg = quick_config(**given) if args.quick else ConvergenceConfig(**given)  # type: ignore[arg-type]
    if args.params_m is not None:
        if not args.params_m > 0:
            raise ValueError(f"--params-m must be positive, got {args.params_m}")
        cfg.width = width_for(args.params_m, cfg.layers, cfg.positions)
    if cfg.steps < 1 or cfg.eval_every < 1 or cfg.batch < 1:
        raise ValueError("--steps, --eval-every and --batch must be at least 1")
    if not 0 < cfg.train_mb:
        raise ValueError(f"--train-mb must be positive, got {cfg.train_mb}")
    if not 2 <= cfg.psgd_warmup < cfg.steps:
        raise ValueError(f"--powersgd-warmup must be at least 2 (torch's powerSGD_hook with error feedback or "
                         f"warm start) and less than --steps ({cfg.steps}), got {cfg.psgd_warmup}")
    return cfg


def _bucket_sizes(text: str | None) -> tuple[float, ...]:
    """``--zero-bucket-mb "0.5,1,2"`` -> ``(0.5, 1.0, 2.0)``: positive, no repeats."""
    if text is None:
        return ()
    try:
        sizes = tuple(float(s) for s in text.split(",") if s.strip())
    except ValueError:
        raise ValueError(f"--zero-bucket-mb must be comma-separated sizes in MB, got {text!r}") from None
    if not sizes or not all(s > 0 for s in sizes) or len(set(sizes)) != len(sizes):
        raise ValueError(f"--zero-bucket-mb needs distinct positive sizes, got {text!r}")
    return sizes


def configs_from_args(args: argparse.Namespace) -> tuple[BenchConfig, StepConfig, OptimConfig, GossipConfig,
                                                         LocalConfig]:
    iters = args.iters if args.iters is not None else (4 if args.quick else 20)
    params_m = args.params_m if args.params_m is not None else (0.25 if args.quick else 12.0)
    batch = args.batch if args.batch is not None else (8 if args.quick else STEP_BATCH)
    if args.ranks < 2:
        raise ValueError(f"--ranks must be at least 2 (one rank has nothing to reduce), got {args.ranks}")
    if iters < 1 or params_m <= 0 or batch < 1:
        raise ValueError("--iters and --batch must be >= 1 and --params-m > 0")
    if args.bucket_mb is not None and not args.bucket_mb > 0:
        raise ValueError(f"--bucket-mb must be positive, got {args.bucket_mb}")
    if args.threads is not None and args.threads < 1:
        raise ValueError(f"--threads must be at least 1, got {args.threads}")
    if args.optim_ranks is not None:
        worlds = parse_world_sizes(args.optim_ranks)
    else:
        worlds = QUICK_WORLD_SIZES if args.quick else DEFAULT_WORLD_SIZES
    if args.gossip_ranks is not None:
        gossip_worlds = parse_world_sizes(args.gossip_ranks)
    else:
        gossip_worlds = QUICK_WORLD_SIZES if args.quick else DEFAULT_WORLD_SIZES
    local_worlds = parse_world_sizes(args.local_ranks) if args.local_ranks is not None else LOCAL_WORLD_SIZES
    # the local suite's own default model size and batch, unless asked for or --quick
    local_params_m = params_m if args.quick or args.params_m is not None else LOCAL_PARAMS_M
    local_batch = batch if args.quick or args.batch is not None else LOCAL_BATCH
    gossip_params_m = params_m if args.quick or args.params_m is not None else GOSSIP_PARAMS_M
    gossip_batch = batch if args.quick or args.batch is not None else GOSSIP_BATCH
    blocks = args.optim_model == "blocks"
    sweep = _bucket_sizes(args.zero_bucket_mb)
    return (BenchConfig(ranks=args.ranks, iters=iters, params_m=params_m, quick=args.quick),
            StepConfig(ranks=args.ranks, iters=iters, params_m=params_m, batch=batch,
                       bucket_mb=args.bucket_mb, threads=args.threads, quick=args.quick),
            OptimConfig(world_sizes=worlds, iters=iters, params_m=gossip_params_m if blocks else params_m,
                        batch=gossip_batch if blocks else batch, bucket_mb=args.bucket_mb, threads=args.threads,
                        quick=args.quick, zero_bucket_mbs=sweep, model=args.optim_model,
                        set_to_none=args.set_to_none),
            GossipConfig(world_sizes=gossip_worlds, iters=-(-iters // 2), params_m=gossip_params_m, batch=gossip_batch,
                         threads=args.threads, quick=args.quick, optimizer=args.gossip_optimizer),
            LocalConfig(world_sizes=local_worlds, iters=-(-iters // 2),
                        params_m=local_params_m, batch=local_batch, threads=args.threads, quick=args.quick,
                        **({"loss_steps": QUICK_LOSS_STEPS} if args.quick else {})))


def faults_config(args: argparse.Namespace) -> FaultsConfig:
    """The faults suite's settings: ``--quick`` is :func:`~.faults.quick_config`."""
    given: dict[str, Any] = {"wire": args.faults_wire, "mode": args.faults_mode}
    if args.faults_mode == "zero" and args.faults_contenders is None:
        given["contenders"] = ("fastreduce_gloo", "fastreduce_shm")
    if args.faults_contenders is not None:
        names = tuple(n for n in args.faults_contenders.split(",") if n)
        if not names or any(n not in FAULTS_CONTENDERS for n in names):
            raise ValueError(f"--faults-contenders takes names among {', '.join(FAULTS_CONTENDERS)}, "
                             f"got {args.faults_contenders!r}")
        given["contenders"] = names
    for key, value in (("steps", args.steps), ("params_m", args.params_m), ("batch", args.batch),
                       ("block", args.iters)):
        if value is not None:
            given[key] = value
    return faults_quick_config(**given) if args.quick else FaultsConfig(**given)


def chaos_config(args: argparse.Namespace) -> ChaosConfig:
    """The chaos suite's settings: ``--quick`` is :func:`~.chaos.quick_config`."""
    given: dict[str, Any] = {}
    for key, text, names in (("modes", args.chaos_modes, CHAOS_MODES),
                             ("transports", args.chaos_transports, CHAOS_TRANSPORTS)):
        if text is not None:
            chosen = tuple(n for n in text.split(",") if n)
            if not chosen or any(n not in names for n in chosen):
                raise ValueError(f"--chaos-{key} takes names among {', '.join(names)}, got {text!r}")
            given[key] = chosen
    for key, value in (("steps", args.steps), ("params_m", args.params_m), ("batch", args.batch),
                       ("seed", args.seed)):
        if value is not None:
            given[key] = value
    return chaos_quick_config(**given) if args.quick else ChaosConfig(**given)


def write_outputs(out: Path, result: dict[str, Any]) -> dict[str, Any]:
    """``bench.json`` always; ``step.csv`` and ``step.png`` when the step suite ran, ``optim.csv``
    when the optim suite did."""
    out.mkdir(parents=True, exist_ok=True)
    files: dict[str, Any] = {"json": str(out / "bench.json")}
    modes = result.get("network_modes")
    if modes is not None and "runs" in modes:
        files["network_png"] = str(out / "network_modes.png")
        files["network_chart_note"] = write_modes_chart(modes, out / "network_modes.png")
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
    if result.get("chaos") is not None:
        files.update(write_chaos_outputs(result["chaos"], out))
    optim = result.get("optim")
    if optim is not None:
        rows = optim_csv_rows(optim)
        write_csv(out / "optim.csv", rows)
        files["optim_csv"] = str(out / "optim.csv")
    result["outputs"] = files
    (out / "bench.json").write_text(json.dumps(result, indent=1))
    return files


def run(args: argparse.Namespace) -> int:
    """The ``bench`` subcommand: returns 0 whether targets pass or fail (it is a report)."""
    reduce_cfg, step_cfg, optim_cfg, gossip_cfg, local_cfg = configs_from_args(args)
    network_cfg, modes_cfg = network_config(args), modes_config(args)
    convergence_cfg = convergence_config(args)
    parts = args.network_parts.split(",")
    if not parts or any(p not in ("steps", "modes") for p in parts):
        raise ValueError(f"--network-parts takes steps, modes or both, got {args.network_parts!r}")
    suites = {None: DEFAULT_SUITES, "all": SUITES}.get(args.suite, (args.suite,))
    faults_cfg = faults_config(args) if "faults" in suites else None
    chaos_cfg = chaos_config(args) if "chaos" in suites else None
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
            if "steps" in parts:
                note(f"network suite: 2 ranks at {', '.join(network_cfg.rates)} (namespace hosts, or this "
                     f"host), {network_cfg.repeats} x {network_cfg.iters} steps/method ...")
                result["network"] = run_network_bench(network_cfg)
                say(format_network(result["network"]) + "\n")
            if "modes" in parts:
                note(f"network suite, modes: {', '.join(map(str, modes_cfg.hosts))} hosts at "
                     f"{', '.join(modes_cfg.rates)}, {modes_cfg.steps} steps/mode ...")
                result["network_modes"] = run_modes_bench(modes_cfg)
                say(format_modes(result["network_modes"]) + "\n")
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
            rates = args.rates.split(",") if args.rates else ([HOST] if args.quick else TrainersConfig().rates)
            cfg = TrainersConfig(rates=rates, **({"repeats": 1, "rounds": 1, "steps": 4, "batch": 64}
                                                 if args.quick else {}))
            note(f"trainers suite: the HF Trainer on 2 ranks at {', '.join(cfg.rates)}, {cfg.repeats} jobs ...")
            result["trainers"] = run_trainers_bench(cfg)
            say(format_trainers(result["trainers"]) + "\n")
        elif suite == "faults" and faults_cfg is not None:
            c = faults_cfg
            note(f"faults suite: {', '.join(c.contenders)}; {c.members} members, {c.params_m:g}M params, "
                 f"{c.steps} committed steps, a loss at step {c.kill_step} ...")
            result["faults"] = run_faults_bench(c)
            say(format_faults(result["faults"]) + "\n")
        elif suite == "chaos" and chaos_cfg is not None:
            c = chaos_cfg
            note(f"chaos suite: {', '.join(c.modes)} on {', '.join(c.transports)}; {c.members} members, "
                 f"{c.params_m:g}M params, {c.steps} committed steps, {len(c.kinds)} kills, each run and a "
                 "failure-free one ...")
            result["chaos"] = run_chaos_bench(c)
            say(format_chaos(result["chaos"]) + "\n")
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
    for key in ("chart_note", "network_chart_note", "convergence_chart_note", "chaos_chart_note"):
        if files.get(key):
            note(files[key])
    say("wrote " + ", ".join(v for k, v in files.items() if not k.endswith("chart_note") and v))
    if args.json:
        print(json.dumps(result), file=getattr(args, "stdout", sys.stdout), flush=True)
    return 0
