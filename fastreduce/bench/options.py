"""``fastreduce bench``'s command line: a subcommand per suite, each with only its own options.

Every option is defined once, in :data:`OPTIONS` (how it parses, its flat default, the
spelling inside a suite), and each suite lists the options it reads in :data:`SUITE_OPTIONS`
with its own defaults for the help. Two spellings share that table:

* ``fastreduce bench SUITE [options]``: a subparser per suite (and ``all``), whose
  options' defaults are suppressed, so the namespace keeps the flat defaults below;
* ``fastreduce bench --suite SUITE [flat options]``: the old flat spelling, deprecated:
  ``--suite`` and every flat flag (``--chaos-modes``, ``--network-parts``, ...) are still
  accepted on ``fastreduce bench`` itself, the flags hidden from its help.

Both fill the same namespace, so the same config functions (:func:`network_config`,
:func:`chaos_config`, ...) read either, and their errors name the option as it was spelled
(:func:`flag`).
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass, field
from typing import Any, Iterable, Mapping

from .chaos import MODES as CHAOS_MODES
from .chaos import TRANSPORTS as CHAOS_TRANSPORTS
from .chaos import ChaosConfig
from .chaos import quick_config as chaos_quick_config
from .chaos_events import COORDINATORS as CHAOS_COORDINATORS
from .chaos_events import etcd_missing as chaos_etcd_missing
from .compression import CompressionConfig
from .convergence import DEFAULT_WORLD_SIZES as CONVERGENCE_WORLD_SIZES
from .convergence import METHODS as CONVERGENCE_METHODS
from .convergence import QUICK_WORLD_SIZES as CONVERGENCE_QUICK_WORLD_SIZES
from .convergence import ConvergenceConfig, quick_config, width_for
from .faults import CONTENDERS as FAULTS_CONTENDERS
from .faults import MODES as FAULTS_MODES
from .faults import WIRES as FAULTS_WIRES
from .faults import FaultsConfig
from .faults import quick_config as faults_quick_config
from .gossip import DEFAULT_BATCH as GOSSIP_BATCH
from .gossip import DEFAULT_PARAMS_M as GOSSIP_PARAMS_M
from .gossip import GossipConfig
from .local import DEFAULT_BATCH as LOCAL_BATCH
from .local import DEFAULT_PARAMS_M as LOCAL_PARAMS_M
from .local import DEFAULT_WORLD_SIZES as LOCAL_WORLD_SIZES
from .local import QUICK_LOSS_STEPS, LocalConfig
from .network import HOST, NetworkConfig
from .defaults import DefaultsConfig
from .growth import PLAN_MODES, GrowthConfig
from .network_modes import MODES, ModesConfig
from .optim import DEFAULT_WORLD_SIZES, QUICK_WORLD_SIZES, OptimConfig, parse_world_sizes
from .optim import MODELS as OPTIM_MODELS
from .reduce import BenchConfig
from .step import StepConfig
from .store import SCENARIOS as STORE_SCENARIOS
from .store import StoreConfig
from .exits import MODES as EXITS_MODES
from .exits import ExitsConfig
from .trainers import TrainersConfig

__all__ = ["OPTIONS", "SUITES", "SUITE_OPTIONS", "add_arguments", "chaos_config", "compression_config",
           "configs_from_args", "convergence_config", "exits_config", "faults_config", "flag", "modes_config",
           "network_config", "store_config", "suites_from_args", "trainers_config"]

SUITES = ("reduce", "step", "optim", "decentralized", "local", "network", "compression", "convergence", "trainers",
          "faults", "chaos", "store", "exits")
DEFAULT_SUITES = ("reduce", "step")
"""What ``fastreduce bench`` alone runs: the other suites are asked for by name or ``all``."""
DEFAULT_OUT = "bench-results"
STEP_BATCH = 64
"""Rows per rank and step: both compute and communication matter at 12M parameters."""


def _sizes(sizes: Iterable[int]) -> str:
    return ",".join(map(str, sizes))


@dataclass(frozen=True, slots=True)
class Option:
    """One option of ``fastreduce bench``, defined once for both spellings."""

    flat: str
    """The flat (old) spelling, ``--chaos-modes``; its dest is what the config functions read."""
    help: str
    """What it is, true in every suite that reads it; a suite may say it in its own words."""
    default: Any = None
    """What the config functions see when it is not given (the flat parser's default)."""
    inside: str | None = None
    """The spelling inside its suite's subcommand (``--modes``), where it drops the suite prefix."""
    kwargs: dict[str, Any] = field(default_factory=dict)
    """``type``, ``choices``, ``metavar``, ``action``: how argparse reads it."""

    @property
    def dest(self) -> str:
        return self.flat[2:].replace("-", "_")

    def add(self, parser: argparse.ArgumentParser, help: str, *, inside: bool) -> None:
        """Add to ``parser``: inside a suite's subcommand its own spelling and no default."""
        if inside:
            parser.add_argument(self.inside or self.flat, dest=self.dest, default=argparse.SUPPRESS, help=help,
                                **self.kwargs)
        else:
            parser.add_argument(self.flat, default=self.default, help=help, **self.kwargs)


OPTIONS: dict[str, Option] = {o.dest: o for o in (
    Option("--quick", "tiny models, few iterations: proves the benchmark runs (CI)", False,
           kwargs={"action": "store_true"}),
    Option("--json", "print one JSON object on stdout and nothing else", False, kwargs={"action": "store_true"}),
    Option("--out", "where the CSV, chart and JSON go", DEFAULT_OUT, kwargs={"metavar": "DIR"}),
    Option("--ranks", "Gloo ranks to spawn", 2, kwargs={"type": int}),
    Option("--iters", "timed steps per method", kwargs={"type": int}),
    Option("--params-m", "model size in millions of fp32 parameters", kwargs={"type": float}),
    Option("--batch", "input rows per rank", kwargs={"type": int}),
    Option("--bucket-mb", "bucket size of overlapped fastreduce (and of ZeroOptimizer) in MB",
           kwargs={"type": float}),
    Option("--threads", "intra-op threads per rank", kwargs={"type": int}),
    Option("--optim-ranks", "the world sizes to run, comma-separated", inside="--ranks", kwargs={"metavar": "N,N"}),
    Option("--zero-bucket-mb", "also time zero_adamw at each of these bucket sizes, side by side with its default "
           "(rows zero_adamw_<mb>mb)", kwargs={"metavar": "MB,MB"}),
    Option("--optim-model", "the step suite's model (many) or the decentralized suite's 48 x (Linear + LayerNorm) "
           f"(blocks; {GOSSIP_PARAMS_M:g}M params, batch {GOSSIP_BATCH} unless given)", "many", inside="--model",
           kwargs={"choices": OPTIM_MODELS}),
    Option("--set-to-none", "every method zeroes with zero_grad(set_to_none=True), torch's default", False,
           kwargs={"action": "store_true"}),
    Option("--gossip-ranks", "the world sizes to run, comma-separated", inside="--ranks", kwargs={"metavar": "N,N"}),
    Option("--gossip-optimizer", "every method's AdamW as users write it (plain) or with fused=True where torch "
           "has it", "plain", inside="--optimizer", kwargs={"choices": ("plain", "fused")}),
    Option("--local-ranks", "the world sizes to run, comma-separated", inside="--ranks", kwargs={"metavar": "N,N"}),
    Option("--rates", "link rates, tc's units, and 'host' (ranks on this host)", kwargs={"metavar": "RATE,RATE"}),
    Option("--hosts", "modes and growth parts: host counts", kwargs={"metavar": "N,N"}),
    Option("--network-parts", "the parts to run, comma-separated", inside="--parts", kwargs={"metavar": "PART,PART"}),
    Option("--network-modes", "modes and growth parts: the modes to run (ddp always runs in the modes part, the "
           "reference; no_comm in the growth part, the compute)", inside="--modes",
           kwargs={"metavar": "NAME,NAME"}),
    Option("--layers", "GPT-2 blocks of the one-host model", kwargs={"type": int}),
    Option("--convergence-ranks", "the world sizes (with --rates: host counts) to run, comma-separated",
           inside="--ranks", kwargs={"metavar": "N,N"}),
    Option("--convergence-methods", "the methods to train", inside="--methods", kwargs={"metavar": "NAME,NAME"}),
    Option("--steps", "committed steps per run", kwargs={"type": int}),
    Option("--faults-contenders", "which to run", inside="--contenders", kwargs={"metavar": "NAME,NAME"}),
    Option("--faults-mode", "fastreduce's mode under Membership (zero: ZeroOptimizer(redundant=True), "
           "fastreduce's contenders only)", "fused", inside="--mode", kwargs={"choices": FAULTS_MODES}),
    Option("--faults-wire", "fastreduce's wire dtype, Membership's and checkpoint-restart's", "fp32",
           inside="--wire", kwargs={"choices": tuple(FAULTS_WIRES)}),
    Option("--store-clients", "synthetic ranks on one TCPStore, a run per count", inside="--clients",
           kwargs={"metavar": "N,N"}),
    Option("--store-scenarios", "the synthetic runs' scenarios", inside="--scenarios", kwargs={"metavar": "NAME,NAME"}),
    Option("--store-seconds", "measured seconds per synthetic run", inside="--seconds", kwargs={"type": float}),
    Option("--store-real-ranks", "ranks of the real run (real heartbeats and watchdogs on Gloo; 0: none)",
           inside="--real-ranks", kwargs={"type": int}),
    Option("--chaos-modes", "the modes to run", inside="--modes", kwargs={"metavar": "NAME,NAME"}),
    Option("--exits-modes", "the modes to launch", inside="--modes", kwargs={"metavar": "NAME,NAME"}),
    Option("--exits-hf", "launches per mode of the HF Trainer script", inside="--hf", kwargs={"type": int, "metavar": "N"}),
    Option("--exits-lightning", "launches per mode of the Lightning script", inside="--lightning",
           kwargs={"type": int, "metavar": "N"}),
    Option("--exits-membership", "membership jobs (a member killed and replaced in each)", inside="--membership",
           kwargs={"type": int, "metavar": "N"}),
    Option("--chaos-transports", "the transports", inside="--transports", kwargs={"metavar": "NAME,NAME"}),
    Option("--chaos-members", "processes the job starts with (and returns to after each join)", inside="--members",
           kwargs={"type": int, "metavar": "N"}),
    Option("--chaos-joiner-runs", "instead of the chaos run: a replacement killed as it is admitted, as it is "
           "healed and in its first step, N jobs per mode, transport and point", inside="--joiner-runs",
           kwargs={"type": int, "metavar": "N"}),
    Option("--chaos-spares", "the replacements are warm spares (Membership(spare=True)), taken in at each loss",
           inside="--spares", kwargs={"action": "store_true"}),
    Option("--chaos-straggler", "a first member no kill takes works F times as long per step for a window of "
           "steps drawn from --seed", inside="--straggler", kwargs={"type": float, "metavar": "F"}),
    Option("--chaos-straggler-steps", "the straggler's window, in committed steps", inside="--straggler-steps",
           kwargs={"type": int, "metavar": "N"}),
    Option("--chaos-evict", "every member runs Membership(evict_slower_than=R, evict_for_s=S): the straggler is "
           "asked to leave (with --spares, a spare more takes its place)", inside="--evict",
           kwargs={"action": "store_true"}),
    Option("--chaos-evict-slower-than", "R: a member busy R times the members' median per step is evicted",
           inside="--evict-slower-than", kwargs={"type": float, "metavar": "R"}),
    Option("--chaos-evict-for-s", "seconds the straggler is named before it is asked to leave",
           inside="--evict-for-s", kwargs={"type": float, "metavar": "S"}),
    Option("--chaos-coordinator", "the job's coordinator: the launcher's, or a 3-member etcd cluster whose leader "
           "is killed (SIGKILL) mid-run (apt-get install etcd-server; pip install 'fastreduce[etcd]')",
           inside="--coordinator", kwargs={"choices": CHAOS_COORDINATORS}),
    Option("--chaos-freeze", "a first member no kill takes is stopped whole (SIGSTOP) for S seconds mid-step at a "
           "step drawn from --seed, left out by the others, and joins the job again in its process",
           inside="--freeze", kwargs={"type": float, "metavar": "S"}),
    Option("--seed", "draws the kills (steps, victims, order) and the data", kwargs={"type": int}),
    Option("--eval-every", "steps between held-out evaluations", kwargs={"type": int}),
    Option("--train-mb", "MiB of stdlib source to train on (the next MiB is held out)", kwargs={"type": float}),
    Option("--powersgd-warmup", "exact steps before both PowerSGD rows compress", kwargs={"type": int}),
    Option("--powersgd-rank", "PowerSGD's rank, torch's hook and fastreduce alike", kwargs={"type": int}),
)}

COMMON = (("quick", None), ("json", None), ("out", f"{DEFAULT_OUT}/"))
"""Every subcommand's options: (dest, its default in the help, or None for a flag)."""

_QUICK = f"{_sizes(QUICK_WORLD_SIZES)} with --quick"
SUITE_OPTIONS: dict[str, tuple[tuple[Any, ...], ...]] = {
    # suite: (dest, the default in this suite's help[, the help in this suite's words]), COMMON apart
    "reduce": (("ranks", "2"), ("iters", "20; 4 with --quick", "timed calls per method"),
               ("params_m", "12; 0.25 with --quick")),
    "step": (("ranks", "2"), ("iters", "20; 4 with --quick"), ("params_m", "12; 0.25 with --quick"),
             ("batch", f"{STEP_BATCH}; 8 with --quick"), ("bucket_mb", "the process-group backend's default"),
             ("threads", "cores / ranks")),
    "optim": (("optim_ranks", f"{_sizes(DEFAULT_WORLD_SIZES)}; {_QUICK}"), ("iters", "20; 4 with --quick"),
              ("params_m", f"12, {GOSSIP_PARAMS_M:g} with --model blocks; 0.25 with --quick"),
              ("batch", f"{STEP_BATCH}, {GOSSIP_BATCH} with --model blocks; 8 with --quick"),
              ("bucket_mb", "the process-group backend's default"), ("threads", "cores / ranks"),
              ("zero_bucket_mb", "none"), ("optim_model", "many"), ("set_to_none", None)),
    "decentralized": (("gossip_ranks", f"{_sizes(DEFAULT_WORLD_SIZES)}; {_QUICK}"),
                      ("iters", "10; 2 with --quick", "timed blocks per method"),
                      ("params_m", f"{GOSSIP_PARAMS_M:g}; 0.25 with --quick"), ("batch", f"{GOSSIP_BATCH}; 8 with "
                      "--quick"), ("threads", "cores / ranks"), ("gossip_optimizer", "plain")),
    "local": (("local_ranks", _sizes(LOCAL_WORLD_SIZES)), ("iters", "10; 2 with --quick", "timed blocks per method"),
              ("params_m", f"{LOCAL_PARAMS_M:g}; 0.25 with --quick"), ("batch", f"{LOCAL_BATCH}; 8 with --quick"),
              ("threads", "cores / ranks")),
    "network": (("network_parts", "steps,modes (growth, defaults: asked for by name)"),
                ("rates", "1gbit,100mbit,host for the steps part, 10gbit,1gbit,100mbit for the modes part, "
                 "1gbit,100mbit for the growth and defaults parts; 1gbit with --quick"), ("hosts", "2,4 for the modes part, 2,4,8,16 for the growth part; 2 with --quick"),
                ("network_modes", "all"),
                ("iters", f"{NetworkConfig().iters} for the steps part, {DefaultsConfig().iters} for the defaults "
                 "part; 2 and 1 with --quick", "timed blocks per method"),
                ("batch", f"{NetworkConfig().batch} for the steps part, {ModesConfig().batch} for the modes part; 64 "
                 "with --quick")),
    "compression": (("ranks", "2", "Gloo ranks on one host"),
                    ("rates", ",".join(CompressionConfig().rates) + "; none with --quick",
                     "link rates of the two namespace hosts, tc's units"),
                    ("layers", "12; 2 with --quick"), ("powersgd_rank", "4"),
                    ("iters", f"{CompressionConfig().iters}; 2 with --quick"),
                    ("batch", f"{CompressionConfig().batch}; 2 with --quick", "sequences per rank"),
                    ("bucket_mb", f"{CompressionConfig().bucket_mb:g}"), ("threads", "cores / ranks")),
    "convergence": (("convergence_ranks", f"{_sizes(CONVERGENCE_WORLD_SIZES)}; "
                     f"{_sizes(CONVERGENCE_QUICK_WORLD_SIZES)} with --quick"),
                    ("convergence_methods", "all: " + ",".join(CONVERGENCE_METHODS)),
                    ("rates", "one host", "namespace hosts (one rank each) at each link rate, tc's units"),
                    ("steps", "300; 40 with --quick", "training steps per method"),
                    ("eval_every", "25; 10 with --quick"), ("train_mb", "4"),
                    ("powersgd_warmup", "10%% of the steps, at least 2"), ("powersgd_rank", "4"),
                    ("params_m", "0.84", "model size in millions of parameters: the GPT-2's width is picked to "
                     "come nearest"), ("batch", "8; 4 with --quick", "sequences per rank"),
                    ("threads", "cores / ranks")),
    "trainers": (("rates", f"{','.join(TrainersConfig().rates)}; {HOST} with --quick",
                  "link rates of the DiLoCo runs, tc's units, and 'host' (ZeRO on this host)"),),
    "faults": (("faults_contenders", "all: " + ",".join(FAULTS_CONTENDERS) + "; with --mode zero, fastreduce's"),
               ("faults_mode", "fused"), ("faults_wire", "fp32, torchft's"),
               ("steps", "300; 24 with --quick", "committed steps per contender"),
               ("params_m", "1; 0.05 with --quick; 10 for the joiner target's model", "the MLP's size in millions "
                "of parameters"), ("batch", "32; 8 with --quick"),
               ("iters", "100; 3 with --quick", "steps per timed block with no failure")),
    "chaos": (("chaos_modes", "all: " + ",".join(CHAOS_MODES) + "; overlap with --quick"),
              ("chaos_transports", ",".join(CHAOS_TRANSPORTS) + "; shm with --quick"),
              ("chaos_members", "4; 3 with --quick"),
              ("steps", "300; 30 with --quick"), ("seed", "0"),
              ("params_m", "0.1; 0.05 with --quick", "the MLP's size in millions of parameters"),
              ("batch", "64; 32 with --quick"), ("chaos_joiner_runs", "0: the chaos run"),
              ("chaos_spares", None), ("chaos_straggler", "0: none"),
              ("chaos_straggler_steps", "a fifth of the steps"), ("chaos_evict", None),
              ("chaos_evict_slower_than", f"{ChaosConfig.evict_slower_than:g}"),
              ("chaos_evict_for_s", f"{ChaosConfig.evict_for_s:g}"), ("chaos_coordinator", "builtin"),
              ("chaos_freeze", "0: none")),
    "store": (("store_clients", "64,256,1024; 16 with --quick"),
              ("store_scenarios", "all: " + ",".join(STORE_SCENARIOS) + "; beat,watch with --quick"),
              ("store_seconds", f"{StoreConfig().seconds:g}; 2 with --quick"),
              ("store_real_ranks", f"{StoreConfig().real_ranks}; 4 with --quick")),
    "exits": (("exits_modes", "all: " + ",".join(EXITS_MODES)), ("exits_hf", "50; 2 with --quick"),
              ("exits_lightning", "20; 2 with --quick"), ("exits_membership", "20; 1 with --quick")),
    "all": (("ranks", "2"), ("iters", "each suite's"), ("params_m", "each suite's"), ("batch", "each suite's"),
            ("threads", "cores / ranks")),
}

SUITE_HELP = {
    "reduce": "the reduction call alone, against the bare collective and the per-parameter loop",
    "step": "whole steps (forward, backward, reduce) of fastreduce's reducers against DDP and the loops",
    "optim": "whole steps with AdamW: ZeroOptimizer against fused + AdamW, DDP + AdamW, ZeroRedundancyOptimizer",
    "decentralized": "gossip training steps (DecentralizedDataParallel) against the reducers",
    "local": "local-update steps (LocalSGD, DiLoCo) against DDP and no communication, and the loss each reaches",
    "network": "namespace hosts over tbf-limited links (root): whole steps on 2 hosts, every mode on --hosts hosts",
    "compression": "fastreduce's PowerSGD against DDP and DDP + torch's powerSGD_hook",
    "convergence": "what each method's bytes cost in loss: a byte-level GPT-2 trained with each",
    "trainers": "the Hugging Face Trainer in fastreduce's modes against the Trainer with DDP",
    "faults": "training that goes on when a member is lost and a replacement joins, side by side",
    "chaos": "each mode under fastreduce.Membership trains through three seeded kills and joins",
    "store": "the c10d store's load from the heartbeat, the watchdog and the vote: 64 real ranks, up to 1,024 "
             "synthetic ones (docs/scale.md)",
    "exits": "users' scripts in every mode (HF Trainer, Lightning, a Membership job) launched again and again: "
             "every exit code 0",
    "all": "every suite, each at its defaults",
}


def _help(option: Option, default: str | None, words: str | None = None) -> str:
    text = words or option.help
    return text if default is None else f"{text} (default: {default})"


def add_arguments(parser: argparse.ArgumentParser, network_parts: Mapping[str, str] | None = None) -> None:
    """``fastreduce bench``'s arguments: a subcommand per suite; the flat options hidden.

    ``fastreduce bench`` alone runs the reduce and step suites, so it shows their options.
    ``network_parts``: each part of the network suite and what it runs, for ``--parts``'s help."""
    parser.add_argument("--suite", choices=(*SUITES, "all"), default=None,
                        help="deprecated: run 'fastreduce bench SUITE' instead")
    shown = {dest: entry for dest, *entry in (*SUITE_OPTIONS["step"], *COMMON)}
    for option in OPTIONS.values():
        entry = shown.get(option.dest)
        option.add(parser, argparse.SUPPRESS if entry is None else _help(option, *entry), inside=False)
    parser.set_defaults(spelled={}, bench_suite=None)
    sub = parser.add_subparsers(dest="bench_suite", metavar="SUITE", parser_class=argparse.ArgumentParser,
                                title="suites (without one: reduce and step)")
    for suite in (*SUITES, "all"):
        p = sub.add_parser(suite, help=SUITE_HELP[suite], description=SUITE_HELP[suite])
        for dest, *entry in (*SUITE_OPTIONS[suite], *COMMON):
            if dest == "network_parts" and network_parts:
                entry = [entry[0], OPTIONS[dest].help + ": " + "; ".join(f"{name} ({what})"
                                                                         for name, what in network_parts.items())]
            OPTIONS[dest].add(p, _help(OPTIONS[dest], *entry), inside=True)
        p.set_defaults(spelled={dest: OPTIONS[dest].inside for dest, *_ in SUITE_OPTIONS[suite]
                                if OPTIONS[dest].inside})


def flag(args: argparse.Namespace, dest: str) -> str:
    """The option behind ``dest`` as the command line spelled it: ``--modes`` in ``bench chaos``,
    ``--chaos-modes`` in the flat spelling."""
    return getattr(args, "spelled", {}).get(dest, OPTIONS[dest].flat)


def suites_from_args(args: argparse.Namespace) -> tuple[str, ...]:
    """The suites to run; the flat ``--suite X`` prints one deprecation note on stderr."""
    chosen = getattr(args, "bench_suite", None)
    if args.suite is not None:
        if chosen is not None:
            raise ValueError(f"give the suite once: 'fastreduce bench {chosen} ...', without --suite")
        print(f"fastreduce bench: --suite {args.suite} is deprecated and will be removed in the next release; "
              f"run 'fastreduce bench {args.suite} ...' (its options: fastreduce bench {args.suite} --help)",
              file=sys.stderr, flush=True)
        chosen = args.suite
    return {None: DEFAULT_SUITES, "all": SUITES}.get(chosen, (chosen,))


def _names(args: argparse.Namespace, dest: str, known: Iterable[str]) -> tuple[str, ...] | None:
    """A comma-separated option's names, each among ``known``; None when it was not given."""
    text = getattr(args, dest)
    if text is None:
        return None
    names = tuple(n for n in text.split(",") if n)
    if not names or any(n not in known for n in names):
        raise ValueError(f"{flag(args, dest)} takes names among {', '.join(known)}, got {text!r}")
    return names


def network_parts(args: argparse.Namespace, parts: Mapping[str, Any]) -> list[str]:
    """``--parts``'s names, checked against ``parts`` (the network suite's, in the order they run;
    without ``--parts``, those whose ``default`` is true)."""
    known = list(parts)
    if args.network_parts is None:
        return [p for p in known if parts[p].default]
    chosen = args.network_parts.split(",")
    if not chosen or any(p not in known for p in chosen):
        raise ValueError(f"{flag(args, 'network_parts')} takes one or more of {', '.join(known)}, comma-separated, "
                         f"got {args.network_parts!r}")
    return [p for p in known if p in chosen]


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
    hosts = _host_counts(args, [2] if args.quick else ModesConfig().hosts)
    chosen: dict[str, object] = {}
    names = _names(args, "network_modes", MODES)
    if names is not None:
        chosen["modes"] = ["ddp"] + [m for m in names if m != "ddp"]
    if args.quick:
        return ModesConfig(hosts=hosts, rates=rates, steps=8, reach_factor=2, batch=args.batch or 64,
                           job_per_mode=False, **chosen)
    return ModesConfig(hosts=hosts, rates=rates, **({"batch": args.batch} if args.batch else {}), **chosen)


def _host_counts(args: argparse.Namespace, default: list[int]) -> list[int]:
    if not args.hosts:
        return default
    try:
        hosts = [int(h) for h in args.hosts.split(",")]
    except ValueError:
        raise ValueError(f"--hosts must be host counts like 2,4, got {args.hosts!r}") from None
    if any(h < 2 for h in hosts):
        raise ValueError(f"--hosts: every count must be at least 2, got {args.hosts!r}")
    return hosts


def defaults_config(args: argparse.Namespace) -> DefaultsConfig:
    """The defaults part of the network suite: ``--quick`` is one model at 1 Gbit/s, one
    hand-set bucket_mb (one bucket), one job."""
    from .hosts import check_rate
    rates = [r for r in args.rates.split(",") if r != HOST] if args.rates else \
        (["1gbit"] if args.quick else DefaultsConfig().rates)
    for rate in rates:
        check_rate(rate)
    if args.quick:
        return DefaultsConfig(rates=rates, models=["mlp_wide"], grid=["one"], iters=args.iters or 1, repeats=1)
    return DefaultsConfig(rates=rates, **({"iters": args.iters} if args.iters else {}))


def growth_config(args: argparse.Namespace) -> GrowthConfig:
    """The growth part of the network suite: ``--quick`` is 2 hosts at 1 Gbit/s, one job of 8 steps."""
    from .hosts import check_rate
    rates = [r for r in args.rates.split(",") if r != HOST] if args.rates else \
        (["1gbit"] if args.quick else GrowthConfig().rates)
    for rate in rates:
        check_rate(rate)
    given: dict[str, Any] = {"rates": rates, "hosts": _host_counts(args, [2] if args.quick else GrowthConfig().hosts)}
    names = _names(args, "network_modes", MODES)
    if names is not None:
        unpriced = [n for n in names if n not in PLAN_MODES and n != "no_comm"]
        if unpriced:
            raise ValueError(f"{flag(args, 'network_modes')}: the growth part runs {', '.join(PLAN_MODES)} (the "
                             f"modes the plan prices), not {', '.join(unpriced)}")
        given["modes"] = ["no_comm"] + [n for n in names if n != "no_comm"]
    if args.batch:
        given["batch"] = args.batch
    if args.quick:  # no one-host check: its 64 ranks take about 20 GB
        given.update(steps=8, repeats=1, one_host=0)
    return GrowthConfig(**given)


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
        given["world_sizes"] = list(parse_world_sizes(args.convergence_ranks, flag(args, "convergence_ranks")))
    methods = _names(args, "convergence_methods", CONVERGENCE_METHODS)
    if methods is not None:
        given["methods"] = list(methods)
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


def exits_config(args: argparse.Namespace) -> ExitsConfig:
    """The exits suite's settings: ``--quick`` is 2 launches a mode per trainer and one membership job."""
    modes = tuple(args.exits_modes.split(",")) if getattr(args, "exits_modes", None) else EXITS_MODES
    unknown = sorted(set(modes) - set(EXITS_MODES))
    if unknown:
        raise ValueError(f"--modes: unknown {', '.join(unknown)}; choose from {', '.join(EXITS_MODES)}")
    quick = dict(hf=2, lightning=2, membership=1) if args.quick else {}
    given = {k: getattr(args, f"exits_{k}", None) for k in ("hf", "lightning", "membership")}
    for k, v in given.items():
        if v is not None and v < 0:
            raise ValueError(f"--{k} must be 0 or more, got {v}")
    return ExitsConfig(modes=modes, **{**quick, **{k: v for k, v in given.items() if v is not None}})


def trainers_config(args: argparse.Namespace) -> TrainersConfig:
    """The trainers suite's settings: ``--quick`` is one job on this host."""
    rates = args.rates.split(",") if args.rates else ([HOST] if args.quick else TrainersConfig().rates)
    return TrainersConfig(rates=rates, **({"repeats": 1, "rounds": 1, "steps": 4, "batch": 64}
                                          if args.quick else {}))


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
        worlds = parse_world_sizes(args.optim_ranks, flag(args, "optim_ranks"))
    else:
        worlds = QUICK_WORLD_SIZES if args.quick else DEFAULT_WORLD_SIZES
    if args.gossip_ranks is not None:
        gossip_worlds = parse_world_sizes(args.gossip_ranks, flag(args, "gossip_ranks"))
    else:
        gossip_worlds = QUICK_WORLD_SIZES if args.quick else DEFAULT_WORLD_SIZES
    local_worlds = parse_world_sizes(args.local_ranks, flag(args, "local_ranks")) \
        if args.local_ranks is not None else LOCAL_WORLD_SIZES
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
        given["contenders"] = ("fastreduce_gloo", "fastreduce_shm", "fastreduce_spare")
    names = _names(args, "faults_contenders", FAULTS_CONTENDERS)
    if names is not None:
        given["contenders"] = names
    for key, value in (("steps", args.steps), ("params_m", args.params_m), ("batch", args.batch),
                       ("block", args.iters)):
        if value is not None:
            given[key] = value
    return faults_quick_config(**given) if args.quick else FaultsConfig(**given)


def chaos_config(args: argparse.Namespace) -> ChaosConfig:
    """The chaos suite's settings: ``--quick`` is :func:`~.chaos.quick_config`."""
    given: dict[str, Any] = {}
    for key, known in (("modes", CHAOS_MODES), ("transports", CHAOS_TRANSPORTS)):
        names = _names(args, f"chaos_{key}", known)
        if names is not None:
            given[key] = names
    for key, value in (("steps", args.steps), ("params_m", args.params_m), ("batch", args.batch),
                       ("seed", args.seed), ("joiner_runs", getattr(args, "chaos_joiner_runs", None)),
                       ("spares", getattr(args, "chaos_spares", None) or None),
                       ("straggler", getattr(args, "chaos_straggler", None)),
                       ("straggler_steps", getattr(args, "chaos_straggler_steps", None)),
                       ("evict", getattr(args, "chaos_evict", None) or None),
                       ("evict_slower_than", getattr(args, "chaos_evict_slower_than", None)),
                       ("evict_for_s", getattr(args, "chaos_evict_for_s", None)),
                       ("coordinator", getattr(args, "chaos_coordinator", None)),
                       ("freeze", getattr(args, "chaos_freeze", None)),
                       ("members", getattr(args, "chaos_members", None))):
        if value is not None:
            given[key] = value
    cfg = chaos_quick_config(**given) if args.quick else ChaosConfig(**given)
    if cfg.coordinator == "etcd" and (why := chaos_etcd_missing()):
        raise ValueError(why)  # before anything starts
    return cfg


def store_config(args: argparse.Namespace) -> StoreConfig:
    """The store suite's settings: ``--quick`` is 16 synthetic clients and 4 real ranks, 2 s each."""
    given: dict[str, Any] = {}
    if args.store_clients is not None:
        given["clients"] = parse_world_sizes(args.store_clients, flag(args, "store_clients"))
    scenarios = _names(args, "store_scenarios", STORE_SCENARIOS)
    if scenarios is not None:
        given["scenarios"] = scenarios
    for dest, key in (("store_seconds", "seconds"), ("store_real_ranks", "real_ranks")):
        if getattr(args, dest) is not None:
            given[key] = getattr(args, dest)
    if args.quick:
        given = {"clients": (16,), "scenarios": ("beat", "watch"), "seconds": 2.0, "real_ranks": 4,
                 "real_seconds": 3.0, "procs": 2, **given}
    try:
        return StoreConfig(**given)
    except ValueError as e:
        raise ValueError(f"fastreduce bench store: {e}") from None
