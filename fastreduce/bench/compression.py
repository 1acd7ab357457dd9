"""The ``compression`` suite: PowerSGD's training step against DDP's and DDP + torch's own
``powerSGD_hook``, side by side in one run.

Methods (each a whole step: forward + backward + reduce + ``torch.optim.AdamW(params,
lr)`` as users write it + zero_grad), every one with rank 4, error feedback and warm
start where it compresses:

* ``no communication``: the same step without any reduction (the floor);
* ``ddp``: ``DistributedDataParallel``, fp32;
* ``ddp + powerSGD_hook``: DDP with ``powerSGD_hook`` and ONE bucket (``bucket_cap_mb``
  above the model's size): on Gloo with two or more buckets the hook aborts the process
  ("Received data size doesn't match expected size"), most likely because one bucket's P
  all-reduce and the previous bucket's Q all-reduce, launched from a future callback,
  leave in different orders on different ranks;
* ``powersgd``: :class:`~fastreduce.FusedReducer` with
  ``compression=fastreduce.PowerSGD(rank=4)``, as a user writes it: the reducer's default
  bf16 wire carries the factors (their rounding lands in the error feedback);
* ``powersgd, fp32 wire``: the same with ``wire_dtype=torch.float32`` (the hook's bytes);
* ``powersgd, overlapped``: the default, its P collectives started from the backward
  hooks (``overlap=True``, ``--bucket-mb``).

Where: one host, ``--ranks`` ranks (2; shared memory for fastreduce, Gloo over loopback
for DDP), on a GPT-2 from transformers (``--layers``, 12 by default, width 128, byte
vocabulary: 50 matrices, where the hook's Python loop over tensors costs most; one
sequence of 32 tokens per rank, so that the reduction is a visible part of the step: with
4 layers of width 256 and 4 x 64 tokens the forward and backward take most of the step
and every method is within 10% of another), and two namespace hosts
at each ``--rates`` entry (tbf links, :mod:`.hosts`) on the network suite's 2.1M-parameter
MLP (8 x Linear 512), batch 256. Both compressed methods start compressing after the same
two exact steps (torch's hook needs ``start_powerSGD_iter`` >= 2); the warm-up rounds are
more than that. Bytes per step: what each rank sends once compressing, counted as the
payload of a ring all-reduce (fastreduce's own count, ``stats.bytes_reduced``, over one
more step after the timing; the hook's from its rule, fp32).

Targets (issue 31): on one host the fused step at most 0.7x the hook's; at 100 Mbit/s at
most 0.8x the hook's and at most 0.1x DDP fp32's.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from typing import Any, Callable

__all__ = ["CompressionConfig", "format_text", "run_compression_bench"]

RANK = 4          # PowerSGD's rank (both rows) unless --powersgd-rank says otherwise
WARMUP_STEPS = 2  # exact steps before compressing (both methods): torch's hook needs >= 2
METHODS = ("no communication", "ddp", "ddp + powerSGD_hook", "powersgd", "powersgd, fp32 wire", "powersgd, overlapped")


@dataclass
class CompressionConfig:
    ranks: int = 2
    rates: list[str] = field(default_factory=lambda: ["100mbit"])
    layers: int = 12          # GPT-2 blocks on one host: many matrices (50)
    width: int = 128          # GPT-2 width on one host
    seq: int = 32
    batch: int = 1            # sequences per rank (one host): the step's reduction shows; the hosts' MLP takes 256
    iters: int = 10
    warmup: int = 3           # untimed rounds of every method (> WARMUP_STEPS)
    bucket_mb: float = 2.0    # the overlapped method's buckets
    rank: int = RANK          # PowerSGD's rank, torch's hook and fastreduce alike
    threads: int | None = None
    timeout: float = 900.0


# ============================================================== in each rank

def _model(kind: str, cfg: CompressionConfig) -> tuple[Any, Callable[[Any], Any], Any]:
    """(model, loss of a batch, batch) with the same weights on every rank and for every method."""
    import torch
    from torch import nn

    torch.manual_seed(0)
    rank = torch.distributed.get_rank()
    gen = torch.Generator().manual_seed(rank)
    if kind == "mlp":
        model = nn.Sequential(*[m for _ in range(8) for m in (nn.Linear(512, 512), nn.ReLU())])
        return model, lambda run: run(x).square().mean(), (x := torch.randn(256, 512, generator=gen))
    from .common import byte_gpt2

    model = byte_gpt2(cfg.layers, cfg.width, cfg.seq, head_size=64)
    ids = torch.randint(0, 256, (cfg.batch, cfg.seq), generator=gen)
    return model, lambda run: run(input_ids=ids, labels=ids).loss, ids


def _build(name: str, kind: str, cfg: CompressionConfig) -> tuple[Any, Callable[[], None], Callable[[], int]]:
    """(the module the step runs, the step, bytes it sent per step)."""
    import torch
    import torch.distributed as dist
    from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as psgd

    import fastreduce

    model, loss_of, _ = _model(kind, cfg)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    numel = sum(p.numel() for p in model.parameters() if p.requires_grad)
    if name == "no communication":
        def alone() -> None:
            loss_of(model).backward()
            opt.step()
            opt.zero_grad()
        return model, alone, lambda: 0
    if name.startswith("ddp"):
        hook = name != "ddp"
        mb = 4 * numel / 2**20 + 1 if hook else None  # one bucket for the hook (see the module doc)
        run = torch.nn.parallel.DistributedDataParallel(model, **({"bucket_cap_mb": mb} if hook else {}))
        if hook:
            state = psgd.PowerSGDState(process_group=None, matrix_approximation_rank=cfg.rank,
                                       start_powerSGD_iter=WARMUP_STEPS, use_error_feedback=True, warm_start=True)
            run.register_comm_hook(state, psgd.powerSGD_hook)

        def step() -> None:
            loss_of(run).backward()
            opt.step()
            opt.zero_grad()
        return run, step, lambda: 4 * numel if not hook else _hook_bytes(model, cfg.rank)
    overlap = name.endswith("overlapped")
    wire = {"wire_dtype": torch.float32} if name.endswith("fp32 wire") else {}
    reducer = fastreduce.FusedReducer(model, overlap=overlap, **wire,
                                      compression=fastreduce.PowerSGD(cfg.rank, warmup_steps=WARMUP_STEPS),
                                      **({"bucket_mb": cfg.bucket_mb} if overlap else {}))

    def step() -> None:
        loss_of(model).backward()
        reducer.reduce()
        opt.step()
        opt.zero_grad()
    assert dist.is_initialized()
    def nbytes() -> int:
        before = reducer.stats.bytes_reduced
        step()
        return reducer.stats.bytes_reduced - before
    return model, step, nbytes


def _hook_bytes(model: Any, rank: int) -> int:
    """What torch's hook sends per step once compressing: fp32 P and Q of each matrix it
    compresses (its rule: ``(n + m) r * 2 < n m``), the other gradients whole."""
    total = 0
    for p in model.parameters():
        n, m = (p.shape[0], p.numel() // p.shape[0]) if p.dim() > 1 else (1, p.numel())
        r = min(rank, n, m)
        total += 4 * ((n + m) * r if p.dim() > 1 and (n + m) * r * 2 < n * m else n * m)
    return total


def measure(kind: str, cfg: CompressionConfig) -> dict[str, Any]:
    """Time every method in this rank's group, round-robin; rank 0's dict of results."""
    import torch.distributed as dist

    from .common import Method, slowest_rank, summary_ms, time_round_robin

    methods, built = [], {}
    for name in METHODS:
        run, step, nbytes = _build(name, kind, cfg)
        methods.append(Method(name, step))
        built[name] = (run, nbytes)
    times = time_round_robin(methods, cfg.iters, warmup_rounds=cfg.warmup)
    sums = {n: float(sum(p.detach().double().sum() for p in run.parameters())) for n, (run, _) in built.items()}
    per_rank: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(per_rank, (times, sums))
    result = {}
    for name in METHODS:
        result[name] = {**summary_ms(slowest_rank([t for t, _ in per_rank], name)),
                        "bytes_per_step": built[name][1](),  # after the timing: one more step
                        "ranks_agree": len({s[name] for _, s in per_rank}) == 1}
    result["params"] = sum(p.numel() for p in built["ddp"][0].parameters())
    return result


def _one_host_rank(rank: int, world: int, cfg: CompressionConfig) -> dict[str, Any]:
    return measure("gpt2", cfg)


def worker(cfg: CompressionConfig, out: str) -> None:
    """One rank of a namespace-host job (under torchrun): rank 0 writes the result to ``out``."""
    from pathlib import Path

    import torch.distributed as dist

    import fastreduce

    fastreduce.init_distributed()
    result = measure("mlp", cfg)
    if dist.get_rank() == 0:
        Path(out).write_text(json.dumps(result))
    fastreduce.shutdown()  # the backends' threads let finish before the group goes (fastreduce/exit_quiet.py)
    dist.destroy_process_group()


# ============================================================== the runner

def run_compression_bench(cfg: CompressionConfig) -> dict[str, Any]:
    import time

    from ..launch import run_ranks
    from .hosts import can_make_hosts
    from .network import run_on_hosts

    started = time.monotonic()
    report: dict[str, Any] = {"config": asdict(cfg), "targets": []}
    report["one_host"] = run_ranks(_one_host_rank, cfg.ranks, cfg, timeout=cfg.timeout, threads=cfg.threads)[0]
    why = can_make_hosts() if cfg.rates else "no --rates"
    report["hosts"] = {"skipped": why} if why else {
        rate: run_on_hosts(2, rate, "fastreduce.bench.compression", asdict(cfg), cfg.timeout) for rate in cfg.rates}
    one = report["one_host"]
    report["targets"].append(_target("one host", "powersgd <= 0.7x ddp + powerSGD_hook", one, "powersgd",
                                     "ddp + powerSGD_hook", 0.7))
    for rate, r in report["hosts"].items() if not why else ():
        if rate == "100mbit":
            report["targets"].append(_target(rate, "powersgd <= 0.8x ddp + powerSGD_hook", r, "powersgd",
                                             "ddp + powerSGD_hook", 0.8))
            report["targets"].append(_target(rate, "powersgd <= 0.1x ddp", r, "powersgd", "ddp", 0.1))
    report["seconds"] = round(time.monotonic() - started, 1)
    return report


def _target(where: str, what: str, r: dict[str, Any], a: str, b: str, limit: float) -> dict[str, Any]:
    return {"where": where, "what": what, "ratio": r[a]["median_ms"] / r[b]["median_ms"], "limit": limit}


def format_text(report: dict[str, Any]) -> str:
    cfg = report["config"]
    lines = [f"compression suite: rank {cfg['rank']}, error feedback, warm start; AdamW; ms per step (median of "
             f"{cfg['iters']}, slowest rank), bytes sent per rank per step"]

    def table(title: str, r: dict[str, Any]) -> None:
        lines.append(title)
        lines.append(f"  {'method':<24}{'ms':>10}{'p10':>9}{'p90':>9}{'bytes/step':>14}{'vs ddp':>9}")
        for name in METHODS:
            m = r[name]
            lines.append(f"  {name:<24}{m['median_ms']:>10.1f}{m['p10_ms']:>9.1f}{m['p90_ms']:>9.1f}"
                         f"{m['bytes_per_step']:>14,}{m['median_ms'] / r['ddp']['median_ms']:>9.3f}")
    table(f"one host, {cfg['ranks']} ranks, GPT-2 {cfg['layers']} layers x {cfg['width']} "
          f"({report['one_host']['params'] / 1e6:.2f}M params), batch {cfg['batch']} x {cfg['seq']} tokens",
          report["one_host"])
    if "skipped" in report["hosts"]:
        lines.append(f"namespace hosts skipped: {report['hosts']['skipped']}")
    for rate, r in report["hosts"].items() if "skipped" not in report["hosts"] else ():
        table(f"2 namespace hosts at {rate}, 1 rank each, 8 x Linear 512 (2.1M params), batch 256", r)
    for t in report["targets"]:
        verdict = "PASS" if t["ratio"] <= t["limit"] else "FAIL"
        lines.append(f"{verdict} {t['where']}: {t['what']}: {t['ratio']:.3f}")
    return "\n".join(lines)


if __name__ == "__main__":
    from .network import worker_main
    worker_main(CompressionConfig, worker)
