"""``fastreduce bench convergence``: a real language model trained with each
data-parallel method on the same data and seeds; held-out loss against steps and wall time.

Every compression claim is a claim about loss (docs/design.md, invariant 10), so this suite
trains before it times. Each method of :data:`METHODS` (a registry: a name and a builder,
so a new method is one entry) trains the same model from the same initial weights on the
same batches for ``--steps`` steps (300), one method after another in one launch per
world size (``--convergence-ranks``, 2 and 4; ``--quick``: 2).

* **Model**: GPT-2 from ``transformers`` (``GPT2LMHeadModel`` built from a
  ``GPT2Config``, not downloaded): byte vocabulary (256), 4 layers of width 128 (head
  size 32), 128 positions, 0.84M parameters (tied embeddings, as GPT-2 has them),
  dropout 0. ``--params-m`` picks the width (a multiple of 32) nearest to that many
  million parameters; the depth stays 4.
* **Data**: text every machine has without a download, the running Python's own
  standard library: the ``.py`` files under ``sysconfig.get_paths()["stdlib"]``
  (``site-packages`` and ``dist-packages`` left out), sorted by path, concatenated as
  bytes. The first ``--train-mb`` MiB (4) are cut into sequences of 128 bytes; at step
  ``s`` a generator seeded by ``(seed, s)`` draws ``world x batch`` distinct sequences
  and rank ``r`` takes the ``r``-th ``batch`` of them (``--batch``, 8 per rank): disjoint
  across ranks, identical for every method. The next MiB is held out: 64 sequences
  evenly spaced in it, the same for every run.
* **Optimizer**: ``torch.optim.AdamW(params, lr=1e-3)`` as users write it, with a
  ``LambdaLR`` schedule: linear warm-up over the first 10% of the steps, then cosine
  down to 0.1x. The same for every method (DiLoCo's inner optimizer included).
* **Held-out loss**: mean cross-entropy over the held-out sequences before the first
  step, every ``--eval-every`` steps (25) and after the last, evaluated on rank 0 on
  its own model where every rank holds the same one (checked at the end:
  ``ranks_agree``), on the ranks' averaged parameters where they differ between syncs
  (DiLoCo). Evaluation is not counted in the wall time.

Methods (rank 4, error feedback and warm start wherever PowerSGD compresses; both
PowerSGD rows send exact gradients for their first ``--powersgd-warmup`` steps, 10% of
the steps by default; torch's hook needs at least 2):

* ``ddp_fp32``: ``DistributedDataParallel``, fp32 gradients: the reference.
* ``ddp_powersgd``: DDP with torch's own ``powerSGD_hook`` and ``PowerSGDState(
  process_group=None, matrix_approximation_rank=4, start_powerSGD_iter=<warm-up>,
  use_error_feedback=True, warm_start=True)``, in ONE bucket (``bucket_cap_mb`` above the
  model's size): with two or more buckets on Gloo the hook aborts the process ("Received
  data size doesn't match expected size"; see :mod:`.compression`).
* ``fused_bf16``: ``fastreduce.all_reduce_gradients(model)`` after backward (bf16 wire).
* ``fused_fp8`` / ``fused_int8``: ``fastreduce.FusedReducer(model,
  wire_dtype=torch.float8_e4m3fn`` (or ``"int8"``) ``, error_feedback=True)``: quantized
  wires, one fp32 scale per 256 values, fp32 sums (:mod:`fastreduce.comm.quantized`).
* ``powersgd``: ``fastreduce.FusedReducer(model, wire_dtype=torch.float32,
  compression=fastreduce.PowerSGD(rank=4, warmup_steps=<warm-up>, error_feedback=True,
  warm_start=True))``, ``reducer.reduce()`` after backward; skipped with a note where
  this fastreduce has no ``PowerSGD``.
* ``diloco_h32``: ``fastreduce.DiLoCo(model, adamw, outer, sync_every=32)``, default bf16
  wire, the outer optimizer the network suite's (:mod:`.network_modes`): Nesterov SGD,
  lr 0.7, momentum 0.5 (the paper's momentum 0.9 diverged on short runs).
* ``diloco_h32_fp32`` / ``diloco_h32_int4``: the same with an fp32 wire, or an int4 one
  (two values a byte, one fp32 scale per 256) with error feedback.
* ``gossip_fp32`` / ``gossip_fp8``: ``fastreduce.DecentralizedDataParallel`` on
  ``one-peer-exp``, an AdamW per bucket with the suite's lr, weight decay and schedule, which
  the mode steps in backward (the loop's AdamW, schedule and ``zero_grad()`` are left out,
  as the gossip suite's loop is forward and backward alone); fp32, or an fp8
  (e4m3) wire with CHOCO's public copies (:class:`~fastreduce.comm.quantized.QuantMix`).
  Bytes: one message a round (the bucket blocks, or their encodings).
* ``diloco_h32_sparseloco``: the same with ``compression=fastreduce.SparseLoCo()`` (density
  1/64, 2 bits, chunks of 4096, decay 0.95) and, as the paper pairs it, an outer SGD
  without momentum, lr 1.0 (the accumulator takes the momentum's place). Its bytes are
  the all-gather's buffer, every rank's payload (``bytes_per_sync / 32``).

Per method and run: the held-out curve against steps and wall time (the slowest rank's
cumulative step time), the final held-out loss, bytes sent per rank per step (the
payload of a ring all-reduce, as the other suites count it: DDP fp32 ``4 x params``;
the fastreduce reducers' own ``stats.bytes_reduced / stats.calls``, over the compressed
steps for ``powersgd``; torch's hook by its rule, fp32 P and Q of each matrix it
compresses; DiLoCo ``bytes_per_sync / 32``; ``bytes_per_step_mean`` is over the whole run,
warm-up included), the median step time (per step the slowest rank's, as :mod:`.common`),
and the wall time to ddp_fp32's final held-out loss (the first evaluation at or below it;
``None``: not reached).

Where: one host by default (:func:`~fastreduce.launch.run_ranks`; the fastreduce rows
exchange through shared memory, DDP over Gloo on loopback). With ``--rates``, namespace
hosts instead (:mod:`.hosts`, :func:`.network.run_on_hosts`): one rank per host, a host per
rank of each world size, every link limited to the rate, Gloo for everything.
"""

from __future__ import annotations

import copy
import gc
import hashlib
import itertools
import json
import math
import os
import statistics
import sys
import sysconfig
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable

from .common import HEAD_SIZE, VOCAB, byte_gpt2

__all__ = ["ConvergenceConfig", "METHODS", "TextData", "format_text", "heldout_batch", "load_text",
           "run_convergence_bench", "train_batch", "width_for", "write_convergence_chart"]

MiB = 2**20
RANK = 4          # PowerSGD's rank, both rows, unless --powersgd-rank
H = 32            # DiLoCo's sync period
SPARSE_OUTER_LR = 1.0  # SparseLoCo's outer SGD (no momentum)
LR_WARMUP = 0.1   # fraction of the steps
LR_FLOOR = 0.1    # the cosine ends at this fraction of the lr
SKIP_DIRS = ("site-packages", "dist-packages", "__pycache__")
DEFAULT_WORLD_SIZES = (2, 4)
QUICK_WORLD_SIZES = (2,)


@dataclass
class ConvergenceConfig:
    world_sizes: list[int] = field(default_factory=lambda: list(DEFAULT_WORLD_SIZES))
    rates: list[str] = field(default_factory=list)  # empty: one host; else namespace hosts at each rate
    methods: list[str] = field(default_factory=lambda: list(METHODS))
    steps: int = 300
    eval_every: int = 25
    eval_seqs: int = 64
    train_mb: float = 4.0
    heldout_mb: float = 1.0
    layers: int = 4
    width: int = 128
    positions: int = 128
    batch: int = 8            # sequences per rank and step
    lr: float = 1e-3
    powersgd_warmup: int | None = None  # None: 10% of the steps (at least 2)
    powersgd_rank: int = RANK  # both PowerSGD rows
    seed: int = 0
    threads: int | None = None
    quick: bool = False
    timeout: float = 7200.0   # per run (world size, rate)

    @property
    def psgd_warmup(self) -> int:
        return self.powersgd_warmup if self.powersgd_warmup is not None else max(2, round(0.1 * self.steps))


def quick_config(**overrides: Any) -> ConvergenceConfig:
    """``--quick``: a few seconds per method (GPT-2 4 x 32, 40 steps: one DiLoCo sync)."""
    return ConvergenceConfig(**{"world_sizes": list(QUICK_WORLD_SIZES), "steps": 40, "eval_every": 10,
                                "eval_seqs": 32, "width": 32, "positions": 64, "batch": 4, "quick": True,
                                "timeout": 300.0, **overrides})


def width_for(params_m: float, layers: int, positions: int) -> int:
    """The width (a multiple of :data:`HEAD_SIZE`) whose GPT-2 is nearest ``params_m`` million."""
    return min((HEAD_SIZE * k for k in range(1, 257)),
               key=lambda d: abs(gpt2_params(layers, d, positions) - params_m * 1e6))


def gpt2_params(layers: int, width: int, positions: int) -> int:
    """GPT-2's parameter count: per block 12 d^2 + 13 d, embeddings (tied head), final norm."""
    return layers * (12 * width * width + 13 * width) + (VOCAB + positions) * width + 2 * width


# ============================================================== data

@dataclass(frozen=True)
class TextData:
    """The stdlib text: ``train`` and ``heldout`` bytes (uint8 tensors) and where they came from."""

    train: Any
    heldout: Any
    info: dict[str, Any]


def stdlib_files(root: str | None = None) -> list[Path]:
    """The standard library's ``.py`` files, sorted by their path below ``root``."""
    base = Path(root or sysconfig.get_paths()["stdlib"])
    found = []
    for folder, dirs, files in os.walk(base):
        dirs[:] = [d for d in dirs if d not in SKIP_DIRS]
        found += [Path(folder, f).relative_to(base).as_posix() for f in files if f.endswith(".py")]
    return [base / rel for rel in sorted(found)]


def load_text(train_mb: float, heldout_mb: float = 1.0, root: str | None = None) -> TextData:
    """The first ``train_mb`` MiB of the concatenated stdlib source for training, the next
    ``heldout_mb`` MiB held out. Raises ValueError where the stdlib holds less."""
    import torch

    n_train, n_held = int(train_mb * MiB), int(heldout_mb * MiB)
    chunks, size, used = [], 0, 0
    for path in stdlib_files(root):
        if size >= n_train + n_held:
            break
        data = path.read_bytes()
        chunks.append(data)
        size += len(data)
        used += 1
    text = b"".join(chunks)[:n_train + n_held]
    if len(text) < n_train + n_held:
        raise ValueError(f"the standard library's source holds {len(text) / MiB:.1f} MiB, fewer than the "
                         f"{(n_train + n_held) / MiB:g} MiB asked for (--train-mb + 1)")
    raw = torch.frombuffer(bytearray(text), dtype=torch.uint8)
    info = {"source": str(Path(root or sysconfig.get_paths()["stdlib"])), "python": sys.version.split()[0],
            "files": used, "train_bytes": n_train, "heldout_bytes": n_held,
            "sha256": hashlib.sha256(text).hexdigest()}
    return TextData(raw[:n_train], raw[n_train:], info)


def _sequences(data: Any, length: int) -> Any:
    n = data.numel() // length
    return data[:n * length].view(n, length)


def train_batch(data: TextData, length: int, batch: int, seed: int, step: int, rank: int, world: int) -> Any:
    """Rank ``rank``'s ``batch`` training sequences of step ``step``: a function of
    ``(seed, step, rank)`` (and the world size), disjoint from the other ranks'."""
    import torch

    seqs = _sequences(data.train, length)
    if world * batch > seqs.shape[0]:
        raise ValueError(f"{world} x {batch} sequences of {length} bytes a step: more than the "
                         f"{seqs.shape[0]} the training text holds")
    gen = torch.Generator().manual_seed(seed * 1_000_003 + step)
    pick = torch.randperm(seqs.shape[0], generator=gen)[rank * batch:(rank + 1) * batch]
    return seqs[pick].long()


def heldout_batch(data: TextData, length: int, count: int) -> Any:
    """``count`` held-out sequences, evenly spaced in the held-out text."""
    seqs = _sequences(data.heldout, length)
    if count > seqs.shape[0]:
        raise ValueError(f"{count} held-out sequences of {length} bytes: the held-out text holds {seqs.shape[0]}")
    return seqs[::seqs.shape[0] // count][:count].long()


# ============================================================== the methods

class Unavailable(Exception):
    """A method this installation cannot run; its message is the one-line note."""


@dataclass
class Trainer:
    """One method on one rank's model."""

    run: Any                              # what the step calls: DDP's wrapper or the model itself
    reduce: Callable[[], None]            # after backward, before the optimizer step
    wire: Callable[[], tuple[float, float]]  # bytes sent per rank per step: (steady, mean over the run)
    synced: bool = True                   # every rank holds the same model after every step
    keep: Any = None                      # what must live as long as the training (a mode, a state)
    steps_itself: bool = False            # the mode steps, schedules and zeroes its own optimizers
    # in backward (gossip): the loop then leaves its AdamW, its LambdaLR and its zero_grad() out


@dataclass(frozen=True)
class Setup:
    steps: int
    psgd_warmup: int
    numel: int
    psgd_rank: int = RANK


def _nothing() -> None:
    pass


def _ddp_fp32(model: Any, opt: Any, s: Setup) -> Trainer:
    from torch.nn.parallel import DistributedDataParallel
    return Trainer(DistributedDataParallel(model), _nothing, lambda: (4.0 * s.numel, 4.0 * s.numel))


def _ddp_powersgd(model: Any, opt: Any, s: Setup) -> Trainer:
    from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as psgd
    from torch.nn.parallel import DistributedDataParallel

    from .compression import _hook_bytes

    ddp = DistributedDataParallel(model, bucket_cap_mb=4 * s.numel / MiB + 1)  # one bucket: see the module doc
    state = psgd.PowerSGDState(process_group=None, matrix_approximation_rank=s.psgd_rank,
                               start_powerSGD_iter=s.psgd_warmup, use_error_feedback=True, warm_start=True)
    ddp.register_comm_hook(state, psgd.powerSGD_hook)
    hook = float(_hook_bytes(model, s.psgd_rank))
    exact = min(s.psgd_warmup, s.steps)
    return Trainer(ddp, _nothing, lambda: (hook, (exact * 4.0 * s.numel + (s.steps - exact) * hook) / s.steps),
                   keep=state)


def _on_reducer(model: Any, reducer: Any, call: Callable[[], Any]) -> Trainer:
    """A fastreduce reducer's method: ``call`` after backward; the wire from the reducer's
    stats, ``stats.bytes_reduced / stats.calls`` over the steps that compressed (all of
    them where none did)."""
    compressed_bytes: list[int] = []

    def reduce() -> None:
        st = reducer.stats
        before, compressed = st.bytes_reduced, st.compressed
        call()
        if st.compressed > compressed:
            compressed_bytes.append(st.bytes_reduced - before)

    def wire() -> tuple[float, float]:
        st = reducer.stats
        mean = st.bytes_reduced / max(1, st.calls)
        return (statistics.fmean(compressed_bytes) if compressed_bytes else mean), mean
    return Trainer(model, reduce, wire, keep=reducer)


def _fused_bf16(model: Any, opt: Any, s: Setup) -> Trainer:
    import fastreduce

    reducer = fastreduce.gradient_reducer(model)  # the one all_reduce_gradients(model) uses: its stats
    return _on_reducer(model, reducer, lambda: fastreduce.all_reduce_gradients(model))


def _quantized(wire: Any) -> Callable[[Any, Any, Setup], Trainer]:
    def build(model: Any, opt: Any, s: Setup) -> Trainer:
        import torch

        import fastreduce

        dtype = getattr(torch, wire) if "float" in wire else wire  # "int8" is a string, not torch.int8
        reducer = fastreduce.FusedReducer(model, wire_dtype=dtype, error_feedback=True)
        return _on_reducer(model, reducer, reducer.reduce)
    return build


def _powersgd(model: Any, opt: Any, s: Setup) -> Trainer:
    import torch

    import fastreduce

    if not hasattr(fastreduce, "PowerSGD"):
        raise Unavailable("skipped: this fastreduce has no PowerSGD")
    reducer = fastreduce.FusedReducer(model, wire_dtype=torch.float32, compression=fastreduce.PowerSGD(
        rank=s.psgd_rank, warmup_steps=s.psgd_warmup, error_feedback=True, warm_start=True))
    return _on_reducer(model, reducer, reducer.reduce)


def _diloco(wire: str | None) -> Callable[[Any, Any, Setup], Trainer]:
    """DiLoCo at H = 32: its default bf16 wire (``None``), or ``wire`` (a quantized one
    with error feedback)."""
    def build(model: Any, opt: Any, s: Setup) -> Trainer:
        import torch

        import fastreduce
        from fastreduce.codecs.quant import wire_format

        from .network_modes import OUTER_LR, OUTER_MOMENTUM

        outer = torch.optim.SGD(model.parameters(), lr=OUTER_LR, momentum=OUTER_MOMENTUM, nesterov=True)
        kw: dict[str, Any] = {}
        if wire is not None:
            kw = {"wire_dtype": getattr(torch, wire) if "float" in wire else wire,
                  "error_feedback": wire_format(wire) is not None}
        mode = fastreduce.DiLoCo(model, opt, outer, sync_every=H, **kw)
        per_step = mode.bytes_per_sync / H
        return Trainer(model, _nothing, lambda: (per_step, mode.bytes_per_sync * (s.steps // H) / s.steps),
                       synced=False, keep=mode)
    return build


def _gossip(wire: str) -> Callable[[Any, Any, Setup], Trainer]:
    """Gossip on ``one-peer-exp``: an AdamW of the suite's settings and schedule per bucket,
    stepped (and its ``LambdaLR`` stepped, the gradients zeroed) by the mode in backward, so
    the Trainer ``steps_itself``: the loop's own AdamW never steps these parameters (its
    gradients are zeroed, not None, so AdamW would apply its weight decay a second time, and
    write into a block whose exchange may be in flight); ``wire`` fp32, or quantized with
    CHOCO's public copies."""
    def build(model: Any, opt: Any, s: Setup) -> Trainer:
        import torch

        import fastreduce

        lr = opt.param_groups[0]["lr"]
        net = fastreduce.DecentralizedDataParallel(
            model, lambda named: torch.optim.AdamW([p for _, p in named], lr=lr),
            lambda o: torch.optim.lr_scheduler.LambdaLR(o, lambda k: lr_factor(k, s.steps)),
            topology="one-peer-exp", wire_dtype=getattr(torch, wire) if "float" in wire else wire)

        def wire_bytes() -> tuple[float, float]:
            mixes = getattr(net, "_qmix", None)
            sent = sum(q.wire_bytes for q in mixes) if mixes else 4.0 * s.numel  # one peer a round
            return sent, sent
        return Trainer(net, _nothing, wire_bytes, synced=False, keep=net, steps_itself=True)
    return build


def _diloco_h32_sparseloco(model: Any, opt: Any, s: Setup) -> Trainer:
    import torch

    import fastreduce

    if not hasattr(fastreduce, "SparseLoCo"):
        raise Unavailable("skipped: this fastreduce has no SparseLoCo")
    outer = torch.optim.SGD(model.parameters(), lr=SPARSE_OUTER_LR)  # no momentum: the accumulator is the memory
    mode = fastreduce.DiLoCo(model, opt, outer, sync_every=H, compression=fastreduce.SparseLoCo())
    per_step = mode.bytes_per_sync / H
    return Trainer(model, _nothing, lambda: (per_step, mode.bytes_per_sync * (s.steps // H) / s.steps),
                   synced=False, keep=mode)


METHODS: dict[str, Callable[[Any, Any, Setup], Trainer]] = {
    "ddp_fp32": _ddp_fp32,
    "ddp_powersgd": _ddp_powersgd,
    "fused_bf16": _fused_bf16,
    "fused_fp8": _quantized("float8_e4m3fn"),
    "fused_int8": _quantized("int8"),
    "powersgd": _powersgd,
    "diloco_h32": _diloco(None),
    "diloco_h32_fp32": _diloco("float32"),
    "diloco_h32_int4": _diloco("int4"),
    "diloco_h32_sparseloco": _diloco_h32_sparseloco,
    "gossip_fp32": _gossip("float32"),
    "gossip_fp8": _gossip("float8_e4m3fn"),
}
"""Name -> builder ``(model, adamw, setup) -> Trainer`` (raises :class:`Unavailable` to skip)."""
REFERENCE = "ddp_fp32"


# ============================================================== in each rank

def gpt2(cfg: ConvergenceConfig) -> Any:
    """The model, the same initial weights on every rank and for every method."""
    return byte_gpt2(cfg.layers, cfg.width, cfg.positions, seed=cfg.seed)


def lr_factor(step: int, steps: int) -> float:
    """Linear warm-up over :data:`LR_WARMUP` of the steps, then cosine down to :data:`LR_FLOOR`."""
    warm = max(1, round(LR_WARMUP * steps))
    if step < warm:
        return (step + 1) / warm
    done = (step - warm) / max(1, steps - warm)
    return LR_FLOOR + (1 - LR_FLOOR) * 0.5 * (1 + math.cos(math.pi * min(1.0, done)))


def _heldout_loss(model: Any, held: Any) -> float:
    import torch

    with torch.no_grad():
        losses = [model(input_ids=x, labels=x).loss for x in held.split(16)]
    return float(torch.stack(losses).mean())


def train_one(name: str, cfg: ConvergenceConfig, data: TextData, held: Any) -> dict[str, Any] | None:
    """Train ``name`` for ``cfg.steps`` steps on this rank; rank 0's summary (others: None)."""
    import torch
    import torch.distributed as dist

    from .common import slowest_rank, summary_ms

    rank, world = dist.get_rank(), dist.get_world_size()
    model = gpt2(cfg)
    numel = sum(p.numel() for p in model.parameters())
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr)
    try:
        trainer = METHODS[name](model, opt, Setup(cfg.steps, cfg.psgd_warmup, numel, cfg.powersgd_rank))
    except Unavailable as why:
        return {"skipped": str(why)} if rank == 0 else None
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: lr_factor(s, cfg.steps))
    scratch = copy.deepcopy(model) if not trainer.synced and rank == 0 else None
    evals: list[tuple[int, float]] = []

    def evaluate(step: int) -> None:
        target = model
        if not trainer.synced:  # the ranks' averaged parameters
            flat = torch.nn.utils.parameters_to_vector(model.parameters()).detach().clone()
            dist.all_reduce(flat)
            if scratch is not None:
                torch.nn.utils.vector_to_parameters(flat / world, scratch.parameters())
            target = scratch
        if rank == 0:
            evals.append((step, _heldout_loss(target, held)))
        dist.barrier()

    times, train_loss = [], []
    dist.barrier()
    evaluate(0)
    for step in range(cfg.steps):
        x = train_batch(data, cfg.positions, cfg.batch, cfg.seed, step, rank, world)
        t0 = time.perf_counter()
        loss = trainer.run(input_ids=x, labels=x).loss
        loss.backward()
        trainer.reduce()
        if not trainer.steps_itself:
            opt.step()
            sched.step()
            opt.zero_grad()
        times.append(time.perf_counter() - t0)
        train_loss.append(float(loss.detach()))
        if (step + 1) % cfg.eval_every == 0 or step + 1 == cfg.steps:
            evaluate(step + 1)
    checksum = float(sum(p.detach().double().sum() for p in model.parameters()))
    per_rank: list[Any] = [None] * world
    dist.all_gather_object(per_rank, (times, checksum))
    if rank != 0:
        return None
    wall = [max(c) for c in zip(*(itertools.accumulate(t) for t, _ in per_rank))]  # slowest rank, since the start
    steady, mean = trainer.wire()
    return {"skipped": None,
            "evals": [[s, wall[s - 1] if s else 0.0, loss] for s, loss in evals],
            "final_loss": evals[-1][1], "train_loss": train_loss,
            **summary_ms(slowest_rank([{name: t} for t, _ in per_rank], name)),
            "train_seconds": wall[-1], "bytes_per_step": steady, "bytes_per_step_mean": mean,
            "ranks_agree": len({c for _, c in per_rank}) == 1, "synced": trainer.synced}


def train_all(cfg: ConvergenceConfig) -> dict[str, Any] | None:
    """Every method of ``cfg`` in turn on this rank's group; rank 0's results (others: None)."""
    import torch
    import torch.distributed as dist

    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    data = load_text(cfg.train_mb, cfg.heldout_mb)
    held = heldout_batch(data, cfg.positions, cfg.eval_seqs)
    methods = {}
    for name in cfg.methods:
        methods[name] = train_one(name, cfg, data, held)
        gc.collect()
        dist.barrier()
    if dist.get_rank() != 0:
        return None
    model = gpt2(cfg)
    return {"world": dist.get_world_size(), "methods": summarize(methods), "data": data.info,
            "model": {"layers": cfg.layers, "width": cfg.width, "heads": model.config.n_head,
                      "positions": cfg.positions, "params": sum(p.numel() for p in model.parameters())},
            "threads": torch.get_num_threads()}


def summarize(methods: dict[str, Any]) -> dict[str, Any]:
    """Each method's wall time and steps to ddp_fp32's final held-out loss (None: not reached)."""
    ref = methods.get(REFERENCE)
    target = ref["final_loss"] if ref and not ref["skipped"] else None
    for m in methods.values():
        if m["skipped"]:
            continue
        hit = next((e for e in m["evals"] if target is not None and e[2] <= target), None)
        m["target_loss"] = target
        m["s_to_ddp_loss"] = hit[1] if hit else None
        m["steps_to_ddp_loss"] = hit[0] if hit else None
    return methods


def _one_host_rank(rank: int, world: int, cfg: ConvergenceConfig) -> dict[str, Any] | None:
    os.dup2(2, 1)  # stdout stays the report's
    return train_all(cfg)


def worker(cfg: ConvergenceConfig, out: str) -> None:
    """One rank of a namespace-host job (under torchrun): rank 0 writes the result to ``out``."""
    import torch.distributed as dist

    import fastreduce

    fastreduce.init_distributed()
    result = train_all(cfg)
    if result is not None:
        Path(out).write_text(json.dumps(result))
    fastreduce.shutdown()  # the backends' threads let finish before the group goes (fastreduce/exit_quiet.py)
    dist.destroy_process_group()


# ============================================================== the runner

def run_convergence_bench(cfg: ConvergenceConfig) -> dict[str, Any]:
    """Every world size (and rate) in turn; the report (JSON-able)."""
    from ..launch import run_ranks
    from .hosts import can_make_hosts
    from .network import run_on_hosts

    unknown = [m for m in cfg.methods if m not in METHODS]
    if unknown:
        raise ValueError(f"unknown convergence method(s) {', '.join(unknown)}; the methods are {', '.join(METHODS)}")
    started = time.monotonic()
    report: dict[str, Any] = {"config": {**asdict(cfg), "powersgd_warmup": cfg.psgd_warmup}, "runs": {}}
    if cfg.rates:
        why = can_make_hosts()
        if why:
            report["skipped"] = why
            return report
        for world in cfg.world_sizes:
            for rate in cfg.rates:
                report["runs"][f"{world}x{rate}"] = {
                    "rate": rate, **run_on_hosts(world, rate, "fastreduce.bench.convergence", asdict(cfg), cfg.timeout)}
    else:
        for world in cfg.world_sizes:
            r = run_ranks(_one_host_rank, world, cfg, timeout=cfg.timeout, threads=cfg.threads)[0]
            report["runs"][str(world)] = {"rate": None, **r}
    first = next(iter(report["runs"].values()))
    report["model"], report["data"] = first["model"], first["data"]
    report["seconds"] = round(time.monotonic() - started, 1)
    return report


def _run_title(key: str, r: dict[str, Any]) -> str:
    where = f"{r['world']} namespace hosts at {r['rate']}, 1 rank each" if r["rate"] else \
        f"{r['world']} ranks on one host"
    return f"{where}, {r['threads']} thread(s) per rank"


def format_text(report: dict[str, Any]) -> str:
    if "skipped" in report:
        return f"convergence suite skipped: {report['skipped']}"
    from .network_modes import OUTER_LR, OUTER_MOMENTUM

    c, mod, data = report["config"], report["model"], report["data"]
    lines = [f"convergence suite: GPT-2 {mod['layers']} x {mod['width']} ({mod['params'] / 1e6:.2f}M params, "
             f"{mod['heads']} heads, byte vocabulary, {mod['positions']} positions), batch {c['batch']} x "
             f"{c['positions']} bytes per rank, AdamW lr {c['lr']:g} (warm-up {LR_WARMUP:.0%} of the steps, "
             f"cosine to {LR_FLOOR:g}x), {c['steps']} steps, seed {c['seed']}",
             f"data: Python {data['python']}'s stdlib source ({data['files']} files, sorted by path): "
             f"{data['train_bytes'] / MiB:g} MiB trained on, held-out loss on {c['eval_seqs']} sequences of the "
             f"next {data['heldout_bytes'] / MiB:g} MiB; PowerSGD rank {c['powersgd_rank']} after {c['powersgd_warmup']} exact "
             f"steps; DiLoCo H {H}, outer Nesterov SGD lr {OUTER_LR:g}, momentum {OUTER_MOMENTUM:g}, bf16 wire",
             "bytes: sent per rank per step (steady state, ring all-reduce payload); ms: median step, slowest "
             "rank; s: training wall time (evaluation excluded); to ddp: wall time to the first evaluation at or "
             "below ddp_fp32's final loss"]
    for key, r in report["runs"].items():
        ms = r["methods"]
        ref = ms.get(REFERENCE) or {}
        ref_loss = ref.get("final_loss")
        lines += ["", _run_title(key, r) + (f" (ddp_fp32's final held-out loss {ref_loss:.5f})" if ref_loss else ""),
                  f"  {'method':<14}{'held-out':>10}{'x ddp':>8}{'bytes/step':>13}{'x ddp':>8}{'ms/step':>9}"
                  f"{'p10':>8}{'p90':>8}{'train s':>9}{'to ddp s':>13}{'at step':>9}"]
        for name, m in ms.items():
            if m["skipped"]:
                lines.append(f"  {name:<14}{m['skipped']}")
                continue
            vs_loss = f"{m['final_loss'] / ref_loss:.3f}" if ref_loss else "-"
            vs_bytes = f"{m['bytes_per_step'] / ref['bytes_per_step']:.3f}" if ref_loss else "-"
            reach = f"{m['s_to_ddp_loss']:.1f}" if m["s_to_ddp_loss"] is not None else "not reached"
            at = str(m["steps_to_ddp_loss"]) if m["steps_to_ddp_loss"] is not None else "-"
            lines.append(f"  {name:<14}{m['final_loss']:>10.5f}{vs_loss:>8}{m['bytes_per_step']:>13,.0f}"
                         f"{vs_bytes:>8}{m['median_ms']:>9.1f}{m['p10_ms']:>8.1f}{m['p90_ms']:>8.1f}"
                         f"{m['train_seconds']:>9.1f}{reach:>13}{at:>9}")
        split = [n for n, m in ms.items() if not m["skipped"] and m["synced"] and not m["ranks_agree"]]
        if split:
            lines.append(f"  WARNING: the ranks' models differ after {', '.join(split)}")
    if c["quick"]:
        lines.append("(--quick: a tiny model for a few steps proves the suite runs; its losses say little)")
    return "\n".join(lines)


def write_convergence_chart(report: dict[str, Any], path: Path) -> str | None:
    """Held-out loss against steps and against wall time, a row of two panels per run,
    one line per method (PNG); returns a note instead where matplotlib is missing."""
    from .report import pyplot

    plt = pyplot()
    if plt is None:
        return "no convergence chart: pip install 'fastreduce[plot]'"
    runs = report["runs"]
    fig, axes = plt.subplots(len(runs), 2, figsize=(12, 4.2 * len(runs)), squeeze=False)
    for row, (key, r) in zip(axes, runs.items()):
        for name, m in r["methods"].items():
            if m["skipped"]:
                continue
            ev = m["evals"]
            style = {"linestyle": "-" if m["synced"] else "--", "marker": ".", "label": name}
            row[0].plot([e[0] for e in ev], [e[2] for e in ev], **style)
            row[1].plot([e[1] for e in ev], [e[2] for e in ev], **style)
        for ax, xlabel in zip(row, ("step", "wall time, s (slowest rank, evaluation excluded)")):
            ax.set(xlabel=xlabel, ylabel="held-out loss (nats per byte)", title=_run_title(key, r))
            ax.grid(True, alpha=0.3)
        row[1].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return None


if __name__ == "__main__":
    from .network import worker_main

    worker_main(ConvergenceConfig, worker)
