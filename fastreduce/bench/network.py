"""The ``network`` suite: whole training steps between hosts joined by a rate-limited link.

Two hosts (:mod:`.hosts`: network namespaces on a bridge, ``tbf`` on every link), one
torchrun node and one rank each, at each ``--rates`` entry (default 1 Gbit/s and
100 Mbit/s). The model is a 2.1M-parameter MLP (8 x Linear 512), batch 512 per rank,
AdamW, fp32 wire; a step is forward + backward + reduce + AdamW + zero_grad. Methods,
each eager and under ``torch.compile`` (inductor):

* ``ddp``: ``DistributedDataParallel`` (compiled: ``torch.compile(ddp)``, where dynamo
  splits the graph at DDP's buckets itself);
* ``fused``: :class:`~fastreduce.FusedReducer`, one all-reduce after backward
  (compiled: ``torch.compile(model)``);
* ``overlapped``: the reducer's overlapped mode, 1 MB buckets all-reduced during
  backward (compiled: ``torch.compile(model, backend=fastreduce.compile_backend(...))``,
  the first piece of the backward one bucket, the others 4 MB: on CPU each inductor
  piece costs about 2 ms, and on a slow link only the first piece's head start counts).

Timed as every suite is (:mod:`.common`): round-robin, the slowest rank's time per
step, medians; ``--warmup`` rounds first (compiling happens there). Targets (issue 18):
the overlapped step at most DDP's and DDP + compile's at every rate, and the compiled
overlapped step at most 0.95x the compiled fused step at 100 Mbit/s.

Needs root, iproute2 and util-linux (``unshare``); elsewhere the suite is skipped with
a note saying why.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable

__all__ = ["NetworkConfig", "format_text", "launch_on", "run_network_bench", "run_on_hosts", "worker_main"]

METHODS = ("ddp", "fused", "overlapped")
WIDTH, LAYERS = 512, 8


@dataclass
class NetworkConfig:
    rates: list[str] = field(default_factory=lambda: ["1gbit", "100mbit"])
    iters: int = 10           # timed steps per method
    warmup: int = 3           # untimed rounds of every method first
    batch: int = 512
    bucket_mb: float = 1.0    # the overlapped mode's buckets (and the first compiled piece)
    piece_mb: float = 4.0     # the other compiled pieces
    compile: bool = True      # also the compiled methods
    timeout: float = 900.0    # per rate


# ============================================================== in each rank

def _build(name: str, compiled: bool, cfg: NetworkConfig) -> tuple[Any, Callable[[], None]]:
    import torch
    from torch import nn

    import fastreduce

    torch.manual_seed(0)
    model = nn.Sequential(*[m for _ in range(LAYERS) for m in (nn.Linear(WIDTH, WIDTH), nn.ReLU())])
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    if name == "ddp":
        ddp = nn.parallel.DistributedDataParallel(model)
        run = torch.compile(ddp) if compiled else ddp
        return run, lambda: (opt.step(), opt.zero_grad())
    overlap = name == "overlapped"
    if compiled:
        backend = fastreduce.compile_backend("inductor", bucket_mb=max(cfg.piece_mb, cfg.bucket_mb),
                                             first_bucket_mb=cfg.bucket_mb) if overlap else "inductor"
        run = torch.compile(model, backend=backend)
    else:
        run = model
    reducer = fastreduce.FusedReducer(run, overlap=overlap, wire_dtype=torch.float32,
                                      **({"bucket_mb": cfg.bucket_mb} if overlap else {}))
    return run, lambda: (reducer.reduce(), opt.step(), opt.zero_grad())


def worker(cfg: NetworkConfig, out: str) -> None:
    """One rank (under torchrun): time every method, rank 0 writes the result to ``out``."""
    import torch
    import torch.distributed as dist

    import fastreduce

    from .common import Method, slowest_rank, summary_ms, time_round_robin

    fastreduce.init_distributed()
    rank = dist.get_rank()
    x = torch.randn(cfg.batch, WIDTH, generator=torch.Generator().manual_seed(rank))
    methods, models = [], []
    for compiled in (False, True) if cfg.compile else (False,):
        for name in METHODS:
            run, finish = _build(name, compiled, cfg)

            def step(run=run, finish=finish) -> None:
                run(x).square().mean().backward()
                finish()
            methods.append(Method(f"{name}{', compiled' if compiled else ''}", step))
            models.append(run)
    times = time_round_robin(methods, cfg.iters, warmup_rounds=cfg.warmup)
    # Every method trained the same model from the same start: the ranks must hold one model.
    sums = {m.name: float(sum(p.double().sum() for p in model.parameters())) for m, model in zip(methods, models)}
    per_rank: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(per_rank, (times, sums))
    if rank == 0:
        result = {m.name: {**summary_ms(slowest_rank([t for t, _ in per_rank], m.name)),
                           "ranks_agree": len({s[m.name] for _, s in per_rank}) == 1} for m in methods}
        Path(out).write_text(json.dumps(result))
    dist.destroy_process_group()


# ============================================================== the runner

def run_on_hosts(hosts_n: int, rate: str, module: str, spec: dict[str, Any], timeout: float) -> Any:
    """``python -m module --worker SPEC OUT`` on ``hosts_n`` namespace hosts linked at
    ``rate``, one torchrun node and rank each (rendezvous on the first); returns the JSON
    the worker wrote to ``OUT``. Everything started is killed on the way out."""
    from .hosts import namespace_hosts

    with namespace_hosts(hosts_n, rate) as hosts:
        return launch_on(hosts, module, spec, timeout, f"{hosts_n} hosts at {rate}")


_launches = itertools.count()


def launch_on(hosts: list[Any], module: str, spec: dict[str, Any], timeout: float, where: str) -> Any:
    """One torchrun job of ``python -m module --worker SPEC OUT`` on ``hosts`` (made by
    :func:`~.hosts.namespace_hosts`), one node and rank each; the JSON it wrote to ``OUT``.
    Each job of a process rendezvouses on a port of its own."""
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "result.json")
        threads = str(max(1, (os.cpu_count() or 2) // len(hosts)))
        argv = ["-m", module, "--worker", json.dumps(spec), out]
        k = next(_launches)
        port = 29000 + (os.getpid() + 7 * k) % 1000
        procs = [subprocess.Popen(h.torchrun(hosts, argv, f"frnet{os.getpid()}x{k}", {"OMP_NUM_THREADS": threads},
                                             port=port),
                                  stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
                 for h in hosts]
        logs = []
        deadline = time.monotonic() + timeout
        try:
            for p in procs:
                log, _ = p.communicate(timeout=max(1.0, deadline - time.monotonic()))
                logs.append(log)
        except subprocess.TimeoutExpired:
            raise RuntimeError(f"{module} on {where}: no result within {timeout:.0f} s") from None
        finally:
            for p in procs:  # the launchers; their workers go with the namespaces
                try:
                    os.killpg(p.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
        if any(p.returncode for p in procs) or not os.path.exists(out):
            raise RuntimeError(f"{module} on {where} failed:\n" + "\n".join(x[-3000:] for x in logs))
        return json.loads(Path(out).read_text())


def _one_rate(cfg: NetworkConfig, rate: str) -> dict[str, Any]:
    return run_on_hosts(2, rate, "fastreduce.bench.network", asdict(cfg), cfg.timeout)


def run_network_bench(cfg: NetworkConfig) -> dict[str, Any]:
    """Every rate in turn; ``{"skipped": why}`` where hosts cannot be made here."""
    from .hosts import can_make_hosts

    why = can_make_hosts()
    if why:
        return {"skipped": why}
    started = time.monotonic()
    rates = {rate: _one_rate(cfg, rate) for rate in cfg.rates}
    report: dict[str, Any] = {"config": asdict(cfg), "rates": rates, "targets": [],
                              "seconds": round(time.monotonic() - started, 1)}
    for rate, r in rates.items():
        ov = r["overlapped"]["median_ms"]
        for ref in ("ddp", "ddp, compiled"):
            if ref in r:
                report["targets"].append({"rate": rate, "what": f"overlapped <= {ref}",
                                          "ratio": ov / r[ref]["median_ms"], "limit": 1.0})
        if rate == "100mbit" and "fused, compiled" in r:
            ratio = r["overlapped, compiled"]["median_ms"] / r["fused, compiled"]["median_ms"]
            report["targets"].append({"rate": rate, "what": "overlapped, compiled <= 0.95x fused, compiled",
                                      "ratio": ratio, "limit": 0.95})
    return report


def format_text(report: dict[str, Any]) -> str:
    if "skipped" in report:
        return f"network suite skipped: {report['skipped']}"
    cfg = report["config"]
    names = list(next(iter(report["rates"].values())))
    lines = [f"network suite: 2 hosts (namespaces, tbf), 1 rank each, {LAYERS} x Linear {WIDTH} "
             f"(2.1M params), batch {cfg['batch']}, AdamW, fp32 wire; ms per step, median of {cfg['iters']}",
             f"{'link':<10}" + "".join(f"{n:>22}" for n in names)]
    for rate, r in report["rates"].items():
        lines.append(f"{rate:<10}" + "".join(f"{r[n]['median_ms']:>22.1f}" for n in names))
    for t in report["targets"]:
        verdict = "PASS" if t["ratio"] <= t["limit"] else "FAIL"
        lines.append(f"{verdict} {t['rate']}: {t['what']}: {t['ratio']:.3f}")
    return "\n".join(lines)


def worker_main(config: Callable[..., Any], worker: Callable[[Any, str], None]) -> None:
    """A suite module's ``__main__`` under :func:`launch_on`: ``--worker SPEC OUT`` runs
    ``worker(config(**SPEC), OUT)``, then exits without finalizing: a Gloo worker thread
    may still be releasing the last collective's tensors, and doing so while the
    interpreter finalizes aborts the process (std::terminate in AsyncAllgatherWork's
    destructor, seen with torch 2.13 under load)."""
    parser = argparse.ArgumentParser()
    parser.add_argument("--worker", nargs=2, metavar=("CONFIG", "OUT"), required=True)
    a = parser.parse_args()
    worker(config(**json.loads(a.worker[0])), a.worker[1])
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    worker_main(NetworkConfig, worker)
