"""The ``network`` suite's defaults part: ``bucket_mb="auto"`` on models nobody tuned it on.

The steps part (:mod:`.network`) times the modes on the one MLP their defaults were
worked out on. This part asks whether those defaults hold elsewhere: four model shapes
of about a million parameters each (:data:`MODELS`: a deep narrow MLP with a large
batch, a wide shallow one with a small batch, a transformer encoder, a conv net), on
two namespace hosts (:mod:`.hosts`, one torchrun node and rank each) at each ``--rates``
entry (1 Gbit/s and 100 Mbit/s), ``torch.optim.AdamW(params, lr)`` as users write it.
Methods, all eager:

* ``ddp``: ``DistributedDataParallel(model)`` at its defaults;
* ``overlapped``: ``FusedReducer(model, overlap=True, wire_dtype=torch.float32)``, its
  buckets ``"auto"`` (:mod:`fastreduce.sizing`); fp32 so that its bytes are DDP's and the
  comparison is of scheduling alone; ``overlapped_bf16``: ``FusedReducer(model,
  overlap=True)``, every setting its default;
* ``zero``: ``ZeroOptimizer(params, torch.optim.AdamW, lr=..., module=model)`` at its
  defaults;
* ``overlapped@X`` and ``zero@X``: the same with ``bucket_mb=X`` for each X of
  :data:`GRID` (``one``: a single bucket), the best of which is what a user tuning by
  hand would find.

Timed as the steps part (:mod:`.common`'s round robin, the slowest rank's block of
:data:`BLOCK` steps, median of ``iters``; ``warmup`` untimed rounds first, past the
overlapped mode's refresh after 8 steps), ``repeats`` jobs per link interleaved, each
ratio the median of the jobs' ratios. Targets (issue 50): at every model and link the
overlapped (both wires) and ZeRO steps at their defaults at most DDP's, and the
overlapped and ZeRO steps at ``"auto"`` within 5% of their best ``bucket_mb``'s.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable

__all__ = ["DefaultsConfig", "GRID", "MODELS", "format_text", "run_defaults_bench"]

MODELS = {"mlp_deep": "16 x Linear 256, batch 256", "mlp_wide": "2 x Linear 768, batch 32",
          "transformer": "4-layer encoder, d_model 128, 4 heads, 64 tokens, batch 8",
          "convnet": "5 convolutions 3x3 to 256 channels, 32 x 32 images, batch 16"}
"""Each model shape and what it is (about 1M parameters each)."""
GRID = ("0.25", "1", "2", "one")
"""The hand-set ``bucket_mb`` values the ``"auto"`` choice is held against (``one``: one bucket)."""
ONE_BUCKET_MB = 1024.0
BLOCK = 2
DEFAULT_LIMIT, BEST_LIMIT = 1.0, 1.05


@dataclass
class DefaultsConfig:
    rates: list[str] = field(default_factory=lambda: ["1gbit", "100mbit"])
    models: list[str] = field(default_factory=lambda: list(MODELS))
    grid: list[str] = field(default_factory=lambda: list(GRID))
    iters: int = 4      # timed blocks (of BLOCK steps) per method
    warmup: int = 5     # untimed rounds first: 10 steps, past the overlapped mode's refresh
    repeats: int = 3    # jobs per link
    timeout: float = 1800.0  # per job


# ============================================================== in each rank

def _model(name: str) -> tuple[Any, Callable[[Any], Any]]:
    """``(model, batch of this rank)`` of the shape ``name``, the same weights on every rank."""
    import torch
    from torch import nn

    class MLP(nn.Module):
        def __init__(self, width: int, layers: int) -> None:
            super().__init__()
            self.layers = nn.Sequential(*[m for _ in range(layers) for m in (nn.Linear(width, width), nn.ReLU())])

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.layers(x)

    class Encoder(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.embed = nn.Embedding(1024, 128)
            layer = nn.TransformerEncoderLayer(128, 4, 512, dropout=0.0, batch_first=True)
            self.blocks = nn.TransformerEncoder(layer, 4, enable_nested_tensor=False)
            self.head = nn.Linear(128, 1024)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.head(self.blocks(self.embed(x)))

    class ConvNet(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            chans, convs = [3, 32, 64, 128, 256, 256], []
            for i, (a, b) in enumerate(zip(chans, chans[1:])):
                convs += [nn.Conv2d(a, b, 3, padding=1), nn.BatchNorm2d(b), nn.ReLU()]
                if i in (1, 2, 3):
                    convs.append(nn.MaxPool2d(2))
            self.features = nn.Sequential(*convs)
            self.head = nn.Linear(256, 10)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.head(self.features(x).mean((2, 3)))

    torch.manual_seed(0)
    if name == "mlp_deep":
        return MLP(256, 16), lambda g: torch.randn(256, 256, generator=g)
    if name == "mlp_wide":
        return MLP(768, 2), lambda g: torch.randn(32, 768, generator=g)
    if name == "transformer":
        return Encoder(), lambda g: torch.randint(0, 1024, (8, 64), generator=g)
    if name == "convnet":
        return ConvNet(), lambda g: torch.randn(16, 3, 32, 32, generator=g)
    raise ValueError(f"unknown model {name!r}; the models are {', '.join(MODELS)}")


def _bucket_mb(x: str) -> float:
    return ONE_BUCKET_MB if x == "one" else float(x)


def _method(name: str, model_name: str) -> tuple[Any, Callable[[], None], Callable[[], None], Callable[[], str]]:
    """``(model to call, what follows backward, what ends a block, what it chose)`` of ``name``
    (``mode@X``: ``bucket_mb=X``), built as every network part builds its modes."""
    from .network_modes import _build

    mode, _, x = name.partition("@")
    return _build(mode, _model(model_name)[0], bucket_mb=_bucket_mb(x) if x else "auto")


def methods_of(cfg: DefaultsConfig) -> list[str]:
    return ["ddp", "overlapped", "overlapped_bf16", "zero"] + [f"{m}@{x}" for m in ("overlapped", "zero")
                                                               for x in cfg.grid]


def worker(cfg: DefaultsConfig, out: str) -> None:
    """One rank (under torchrun): every model's methods timed, rank 0 writes the result to ``out``."""
    import torch
    import torch.distributed as dist

    import fastreduce

    from .common import Method, slowest_rank, summary_ms, time_round_robin

    fastreduce.init_distributed()
    rank = dist.get_rank()
    result: dict[str, Any] = {}
    for model_name in cfg.models:
        _, batch = _model(model_name)
        x = batch(torch.Generator().manual_seed(rank))
        methods, chose, models = [], [], []
        for name in methods_of(cfg):
            run, after, end, what = _method(name, model_name)

            def block(run=run, after=after, end=end) -> None:
                for _ in range(BLOCK):
                    run(x).float().square().mean().backward()
                    after()
                end()
            methods.append(Method(name, block))
            chose.append(what)
            models.append(run)
        times = time_round_robin(methods, cfg.iters, warmup_rounds=cfg.warmup)
        times = {k: [t / BLOCK for t in v] for k, v in times.items()}
        sums = {m.name: float(sum(p.double().sum() for p in model.parameters())) for m, model in zip(methods, models)}
        per_rank: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(per_rank, (times, sums))
        result[model_name] = {
            "params": sum(p.numel() for p in models[0].parameters()),
            "methods": {m.name: {**summary_ms(slowest_rank([t for t, _ in per_rank], m.name)), "chose": what(),
                                 "ranks_agree": len({s[m.name] for _, s in per_rank}) == 1}
                        for m, what in zip(methods, chose)}}
        del methods, models
    if rank == 0:
        import json
        Path(out).write_text(json.dumps(result))
    fastreduce.shutdown()  # the backends' threads let finish before the group goes (fastreduce/exit_quiet.py)
    dist.destroy_process_group()


# ============================================================== the runner

def _targets(cfg: DefaultsConfig, runs: list[dict[str, Any]], model: str, rate: str) -> list[dict[str, Any]]:
    """Each target's ratio per job (the method's step over DDP's, or over the fastest of the
    mode's hand-set ``bucket_mb`` in that job) and their median."""
    out = []
    for what, ref in [("overlapped", "ddp"), ("overlapped_bf16", "ddp"), ("zero", "ddp"),
                      ("overlapped", "best bucket_mb"), ("zero", "best bucket_mb")]:
        names = ["ddp"] if ref == "ddp" else [f"{what}@{x}" for x in cfg.grid]
        ratios = [j[model]["methods"][what]["median_ms"] / min(j[model]["methods"][n]["median_ms"] for n in names)
                  for j in runs]
        out.append({"model": model, "rate": rate, "what": f"{what} <= {ref}", "ratio": statistics.median(ratios),
                    "ratios": ratios, "limit": DEFAULT_LIMIT if ref == "ddp" else BEST_LIMIT})
    return out


def run_defaults_bench(cfg: DefaultsConfig) -> dict[str, Any]:
    """``repeats`` jobs per link, the links interleaved; skipped (with the reason) where
    namespace hosts cannot be made here."""
    from .network import interleaved_jobs, run_on_hosts

    started = time.monotonic()
    jobs, skipped = interleaved_jobs(cfg.rates, cfg.repeats, lambda rate: run_on_hosts(
        2, rate, "fastreduce.bench.defaults", asdict(cfg), cfg.timeout))
    if not jobs:
        return {"skipped": next(iter(skipped.values()))}
    report: dict[str, Any] = {"config": asdict(cfg), "table": {}, "targets": []}
    for rate, runs in jobs.items():
        for model in cfg.models:
            report["table"].setdefault(model, {"params": runs[0][model]["params"]})[rate] = {
                name: {"median_ms": statistics.median(j[model]["methods"][name]["median_ms"] for j in runs),
                       "jobs_ms": [j[model]["methods"][name]["median_ms"] for j in runs],
                       "chose": runs[-1][model]["methods"][name]["chose"],
                       "ranks_agree": all(j[model]["methods"][name]["ranks_agree"] for j in runs)}
                for name in methods_of(cfg)}
            report["targets"] += _targets(cfg, runs, model, rate)
    report["seconds"] = round(time.monotonic() - started, 1)
    return report


def format_text(report: dict[str, Any]) -> str:
    if "table" not in report:
        return f"network suite, defaults part skipped: {report['skipped']}"
    cfg = report["config"]
    names = methods_of(DefaultsConfig(**cfg))
    lines = [f"network suite, defaults on untuned models: 2 hosts, torch.optim.AdamW; ms per step, median of "
             f"{cfg['iters']} blocks of {BLOCK} steps, median of {cfg['repeats']} jobs (overlapped: fp32 wire)",
             f"{'model':<12}{'link':<9}" + "".join(f"{n:>16}" for n in names)]
    for model, row in report["table"].items():
        for rate in cfg["rates"]:
            if rate in row:
                lines.append(f"{model:<12}{rate:<9}" + "".join(f"{row[rate][n]['median_ms']:>16.1f}" for n in names))
    for model, row in report["table"].items():
        for rate in cfg["rates"]:
            if rate in row:
                lines.append(f"{model} at {rate}: overlapped chose {row[rate]['overlapped']['chose']}; "
                             f"zero {row[rate]['zero']['chose']}")
    for t in report["targets"]:
        verdict = "PASS" if t["ratio"] <= t["limit"] else "FAIL"
        lines.append(f"{verdict} {t['model']} at {t['rate']}: {t['what']}: {t['ratio']:.3f} (limit {t['limit']:g}; "
                     f"jobs {', '.join(f'{x:.3f}' for x in t['ratios'])})")
    return "\n".join(lines)


if __name__ == "__main__":
    from .network import worker_main
    worker_main(DefaultsConfig, worker)
