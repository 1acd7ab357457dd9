"""The ``trainers`` suite: fastreduce's modes inside the Hugging Face ``Trainer``, against the
``Trainer`` with DDP, as a user runs them (``FastReduceTrainer(fastreduce_mode=...)`` at
the mode's defaults, ``optim="adamw_torch"``: ``torch.optim.AdamW`` with the Trainer's
defaults).

Two ranks, the network suite's model (a 2.1M-parameter MLP, 8 x Linear 512, as a
``forward(x, labels) -> {"loss"}`` module), batch ``batch`` per rank, no accumulation,
no clipping, nothing saved. Per link:

* ``host`` (two ranks on this host, shared memory): ``ddp`` against ``zero`` (ZeRO at
  its defaults); targets: ZeRO's step at most DDP's, and its optimizer state per rank
  (``ZeroOptimizer.state_bytes()`` against the bytes of AdamW's state tensors) at most
  0.6x DDP's;
* a rate (two namespace hosts, :mod:`.hosts`): ``ddp`` against ``diloco`` (``sync_every``
  32, DiLoCo's default bf16 wire and the paper's outer Nesterov SGD); target at 100 Mbit/s:
  DiLoCo's step at most 0.15x DDP's.

A job runs the methods in turn, ``rounds`` times (a fresh ``Trainer`` and model each
time, the same start); a method's step is the mean wall time of the steps after
``warmup`` (``on_step_end`` to ``on_step_end``, on rank 0; DiLoCo's window holds whole
periods of 32, so its syncs are in it), the median over its rounds. ``repeats`` jobs per
link; each ratio is the median of the jobs' ratios. The Trainer's own
``train_samples_per_second`` (over the whole run, warm-up included) is reported beside.
"""

from __future__ import annotations

import json
import statistics
import time
from dataclasses import asdict, dataclass, field
from typing import Any

from .network import HOST, interleaved_jobs, launch_here, run_on_hosts, worker_main

__all__ = ["TrainersConfig", "format_text", "run_trainers_bench"]

WIDTH, LAYERS = 512, 8
METHODS = {HOST: ("ddp", "zero")}
"""The methods per link; every namespace link runs :data:`LINK_METHODS`."""
LINK_METHODS = ("ddp", "diloco")
H = 32
TARGETS = {("zero", "ddp", "step"): 1.0, ("zero", "ddp", "optimizer_bytes"): 0.6,
           ("diloco", "ddp", "step"): 0.15}
"""(method, reference, figure): the largest ratio allowed (DiLoCo's at 100 Mbit/s only)."""


@dataclass
class TrainersConfig:
    rates: list[str] = field(default_factory=lambda: [HOST, "100mbit"])
    batch: int = 512
    warmup: int = 2           # untimed steps at the start of each run
    steps: int = 8            # timed steps per run (DiLoCo: rounded up to whole periods of H)
    rounds: int = 2           # runs of each method per job, interleaved
    repeats: int = 3          # jobs per link
    timeout: float = 900.0    # per job


def _model(seed: int) -> Any:
    import torch
    from torch import nn

    class Regressor(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.net = nn.Sequential(*[m for _ in range(LAYERS) for m in (nn.Linear(WIDTH, WIDTH), nn.ReLU())][:-1])

        def forward(self, x, labels=None):
            y = self.net(x)
            return {"loss": nn.functional.mse_loss(y, labels)}

    torch.manual_seed(seed)
    return Regressor()


def _optimizer_bytes(optimizer: Any) -> int:
    inner = getattr(optimizer, "optimizer", optimizer)  # Accelerate's wrapper
    if hasattr(inner, "state_bytes"):
        return int(inner.state_bytes())
    return sum(t.numel() * t.element_size() for s in inner.state.values() for t in s.values() if hasattr(t, "numel"))


def worker(cfg: TrainersConfig, out: str) -> None:
    """One job (every rank): each method of this link ``rounds`` times; rank 0 writes the figures."""
    import logging

    import torch
    import torch.distributed as dist
    from torch.utils.data import Dataset
    from transformers import Trainer, TrainerCallback, TrainingArguments
    from transformers.utils import logging as hf_logging

    from ..integrations.transformers import FastReduceTrainer

    hf_logging.set_verbosity_error()
    logging.getLogger("fastreduce").setLevel(logging.WARNING)
    dist.init_process_group("gloo")
    world = dist.get_world_size()
    methods = METHODS.get(cfg.rates[0], LINK_METHODS)  # a job runs one link: _one_job

    class Data(Dataset):
        def __init__(self, n: int) -> None:
            g = torch.Generator().manual_seed(1)
            self.x, self.y = torch.randn(n, WIDTH, generator=g), torch.randn(n, WIDTH, generator=g)

        def __len__(self) -> int:
            return len(self.x)

        def __getitem__(self, i: int) -> dict:
            return {"x": self.x[i], "labels": self.y[i]}

    class Clock(TrainerCallback):
        def __init__(self) -> None:
            self.ends: list[float] = []

        def on_step_end(self, args, state, control, **kw):
            self.ends.append(time.perf_counter())

    def run(method: str) -> dict[str, Any]:
        timed = cfg.steps if method != "diloco" else -(-cfg.steps // H) * H
        steps = cfg.warmup + timed
        args = TrainingArguments(output_dir="/tmp/fastreduce-bench-trainers", use_cpu=True, report_to="none",
                                 per_device_train_batch_size=cfg.batch, max_steps=steps, learning_rate=1e-3,
                                 optim="adamw_torch", max_grad_norm=0.0, save_strategy="no", logging_steps=10**6,
                                 disable_tqdm=True, dataloader_num_workers=0, seed=0)
        data = Data(steps * cfg.batch * world)
        if method == "ddp":
            trainer = Trainer(model=_model(0), args=args, train_dataset=data)
        else:
            config = {"sync_every": H} if method == "diloco" else {}
            trainer = FastReduceTrainer(model=_model(0), args=args, train_dataset=data, fastreduce_mode=method,
                                        fastreduce_config=config)
        clock = Clock()
        trainer.add_callback(clock)
        metrics = trainer.train().metrics
        ends = clock.ends[cfg.warmup - 1:]
        return {"step_ms": 1e3 * (ends[-1] - ends[0]) / (len(ends) - 1),
                "samples_per_second": metrics["train_samples_per_second"],
                "optimizer_bytes": _optimizer_bytes(trainer.optimizer)}

    results: dict[str, list[dict[str, Any]]] = {m: [] for m in methods}
    for _ in range(cfg.rounds):
        for m in methods:
            results[m].append(run(m))
    if dist.get_rank() == 0:
        summary = {m: {"step_ms": statistics.median(r["step_ms"] for r in rs),
                       "samples_per_second": statistics.median(r["samples_per_second"] for r in rs),
                       "optimizer_bytes": rs[-1]["optimizer_bytes"]} for m, rs in results.items()}
        with open(out, "w") as f:
            json.dump(summary, f)
    dist.barrier()


def _one_job(cfg: TrainersConfig, rate: str) -> dict[str, Any]:
    spec = {**asdict(cfg), "rates": [rate]}
    if rate == HOST:
        return launch_here("fastreduce.bench.trainers", spec, cfg.timeout, "the trainers suite on this host")
    return run_on_hosts(2, rate, "fastreduce.bench.trainers", spec, cfg.timeout)


def run_trainers_bench(cfg: TrainersConfig) -> dict[str, Any]:
    """``repeats`` jobs per link, the links interleaved; namespace links are skipped (with the
    reason) where hosts cannot be made here."""
    started = time.monotonic()
    jobs, skipped = interleaved_jobs(cfg.rates, cfg.repeats, lambda rate: _one_job(cfg, rate))
    report: dict[str, Any] = {"config": asdict(cfg), "rates": {}, "targets": [], "skipped_rates": skipped}
    for rate, runs in jobs.items():
        report["rates"][rate] = {m: {k: statistics.median(j[m][k] for j in runs) for k in runs[0][m]}
                                 | {"jobs_step_ms": [j[m]["step_ms"] for j in runs]} for m in runs[0]}
        for (what, ref, figure), limit in TARGETS.items():
            if what not in runs[0] or (what == "diloco" and rate != "100mbit"):
                continue
            key = "step_ms" if figure == "step" else figure
            ratios = [j[what][key] / j[ref][key] for j in runs]
            report["targets"].append({"rate": rate, "what": f"{what} / {ref} {figure}", "limit": limit,
                                      "ratio": statistics.median(ratios), "ratios": ratios})
    report["seconds"] = round(time.monotonic() - started, 1)
    return report


def format_text(report: dict[str, Any]) -> str:
    cfg = report["config"]
    lines = [f"trainers suite: the HF Trainer, 2 ranks, {LAYERS} x Linear {WIDTH} (2.1M params), batch "
             f"{cfg['batch']}, optim adamw_torch; ms per step (mean of {cfg['steps']} steps after {cfg['warmup']}, "
             f"DiLoCo whole periods of {H}), median of {cfg['rounds']} rounds, median of {cfg['repeats']} jobs"]
    for rate, r in report["rates"].items():
        for m, v in r.items():
            lines.append(f"{rate:<10} {m:<8} {v['step_ms']:>9.1f} ms/step  (jobs "
                         f"{', '.join(f'{x:.1f}' for x in v['jobs_step_ms'])})  Trainer's train_samples_per_second "
                         f"{v['samples_per_second']:.0f}  optimizer state {v['optimizer_bytes'] / 2**20:.1f} MiB/rank")
    for t in report["targets"]:
        verdict = "PASS" if t["ratio"] <= t["limit"] else "FAIL"
        lines.append(f"{verdict} {t['rate']}: {t['what']} {t['ratio']:.3f} <= {t['limit']} "
                     f"(jobs {', '.join(f'{x:.3f}' for x in t['ratios'])})")
    for rate, why in report.get("skipped_rates", {}).items():
        lines.append(f"skipped {rate}: {why}")
    return "\n".join(lines)


if __name__ == "__main__":
    worker_main(TrainersConfig, worker)
