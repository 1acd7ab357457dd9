"""The ``network`` suite's steps part: every mode at its defaults against DDP at its defaults.

Two hosts (:mod:`.hosts`: network namespaces on a bridge, ``tbf`` on every link), one
torchrun node and one rank each, at each ``--rates`` entry, and ``host``: two ranks on
this host (``torchrun --standalone``, no namespaces). Default: 1 Gbit/s, 100 Mbit/s and
one host. The model is a 2.1M-parameter MLP (8 x Linear 512; a class of its own, as a
user's model is: dynamo leaves a bare ``nn.Sequential`` inside DDP uncompiled on torch
2.13, and the report names any compiled method that compiled nothing), batch 512 per rank,
``torch.optim.AdamW(params, lr)`` as users write it; a step is forward + backward +
reduce + AdamW + zero_grad. Methods, each eager and under a plain ``torch.compile``
(inductor; DDP compiled as ``torch.compile(ddp)``, where dynamo cuts the graph at DDP's
buckets; the fastreduce modes on ``torch.compile(model)``, which the living mode has
dynamo cut at its buckets: each mode's cut is its own, so the methods' models, each of a
class of its own, are cut as each would be alone in its process):

* ``ddp``: ``DistributedDataParallel(model)`` at its defaults (25 MB buckets, 1 MB first);
* ``fused``: ``FusedReducer(model, wire_dtype=torch.float32)``, one all-reduce after backward;
* ``overlapped``: ``FusedReducer(model, overlap=True, wire_dtype=torch.float32)``:
  ``bucket_mb="auto"`` (:mod:`fastreduce.sizing`);
* ``fused_bf16`` / ``overlapped_bf16``: ``FusedReducer(model)`` /
  ``FusedReducer(model, overlap=True)``, every setting its default, the wire too (bf16:
  half DDP's bytes);
* ``zero``: ``ZeroOptimizer(params, torch.optim.AdamW, lr=..., module=model)`` at its
  defaults (fp32 wire).

Every other fastreduce row sends fp32 (the reducers' default wire is bf16): equal bytes
with DDP, so those comparisons are of scheduling, not of bytes; the ``_bf16`` rows
are what a user who names nothing gets. Timed as every suite is (:mod:`.common`):
round-robin within a job, each timed call a block of :data:`BLOCK` steps ending with
the method's work in flight waited for, the slowest rank's time per step, median of
``iters`` blocks; ``warmup`` rounds first (compiling and the overlapped mode's sizing and refresh happen
there); ``repeats`` jobs per link, each ratio the median of the jobs' ratios. Targets
(issue 33): the overlapped (at both wires) and ZeRO steps at most DDP's, eager and
compiled (against DDP compiled), at every link; on one host the overlapped step at most
the fused one's at the same wire.

Needs root, iproute2 and util-linux (``unshare``) for the namespace hosts; without them
only ``host`` runs, with a note saying why.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable

__all__ = ["NetworkConfig", "format_text", "interleaved_jobs", "launch_here", "launch_on", "run_network_bench",
           "run_on_hosts", "worker_main"]

METHODS = ("ddp", "fused", "overlapped", "fused_bf16", "overlapped_bf16", "zero")
BLOCK = 4
"""Steps per timed call, ending with the method's work in flight waited for (ZeRO's
all-gather): a collective left in flight would otherwise run on during the next
methods' calls of the round-robin, and the method's time would leave it out."""
HOST = "host"
"""The ``rates`` entry for two ranks on this host (no namespaces, no link limit)."""
WIDTH, LAYERS = 512, 8


@dataclass
class NetworkConfig:
    rates: list[str] = field(default_factory=lambda: ["1gbit", "100mbit", HOST])
    iters: int = 5            # timed blocks (of BLOCK steps) per method
    warmup: int = 4           # untimed rounds (of BLOCK steps) of every method first (the overlapped mode
    #                           sizes its buckets at step 1 and refreshes them at step 10; a new cut drops
    #                           what dynamo compiled, and the methods before it in the round recompile
    #                           in the next)
    batch: int = 512
    repeats: int = 3          # jobs per link; ratios are the median of theirs
    compile: bool = True      # also the compiled methods
    timeout: float = 900.0    # per job


# ============================================================== in each rank

def _build(name: str, compiled: bool) -> tuple[Any, Callable[[], None], Callable[[], None],
                                               Callable[[], str | None]]:
    """``(module to call, what follows backward, what ends a block of steps, what the mode
    chose)`` for ``name``."""
    import torch
    from torch import nn

    import fastreduce

    class MLP(nn.Module):
        """A model class of the user's own, as models are: dynamo compiles its forward. (An
        ``nn.Sequential`` inside DDP would run uncompiled on torch 2.13: DDP's forward breaks
        its graph, and dynamo does not start a frame in torch's own ``nn`` code.)"""

        def __init__(self) -> None:
            super().__init__()
            self.layers = nn.Sequential(*[m for _ in range(LAYERS) for m in (nn.Linear(WIDTH, WIDTH), nn.ReLU())])

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.layers(x)

    torch.manual_seed(0)
    model = MLP()
    if name == "ddp":
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
        ddp = nn.parallel.DistributedDataParallel(model)
        run = torch.compile(ddp) if compiled else ddp
        return run, lambda: (opt.step(), opt.zero_grad()), lambda: None, \
            lambda: f"{ddp.bucket_bytes_cap / 2**20:g} MB buckets"
    run = torch.compile(model) if compiled else model
    if name == "zero":
        zopt = fastreduce.ZeroOptimizer(model.parameters(), torch.optim.AdamW, lr=1e-4, module=run)
        return run, lambda: (zopt.step(), zopt.zero_grad()), zopt.wait_params, \
            lambda: f"{zopt.num_buckets} bucket(s); {zopt.sizing.describe() if zopt.sizing else ''}"
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    wire = {} if name.endswith("_bf16") else {"wire_dtype": torch.float32}  # _bf16: every setting its default
    reducer = fastreduce.FusedReducer(run, overlap=name.startswith("overlapped"), **wire)
    sizing = lambda: reducer.stats.sizing.describe() if reducer.stats.sizing else None  # noqa: E731
    return run, lambda: (reducer.reduce(), opt.step(), opt.zero_grad()), lambda: None, sizing


def _ops_captured() -> int:
    """Ops dynamo has put into graphs in this process so far."""
    utils = sys.modules.get("torch._dynamo.utils")
    return int(utils.counters["stats"]["calls_captured"]) if utils is not None else 0


def worker(cfg: NetworkConfig, out: str) -> None:
    """One rank (under torchrun): time every method, rank 0 writes the result to ``out``."""
    import torch
    import torch.distributed as dist

    import fastreduce

    from .common import Method, slowest_rank, summary_ms, time_round_robin

    fastreduce.init_distributed()
    rank = dist.get_rank()
    x = torch.randn(cfg.batch, WIDTH, generator=torch.Generator().manual_seed(rank))
    methods, models, chose = [], [], []
    captured: dict[str, int] = {}
    for compiled in (False, True) if cfg.compile else (False,):
        for name in METHODS:
            run, finish, end, what = _build(name, compiled)
            label = f"{name}{', compiled' if compiled else ''}"

            def block(run=run, finish=finish, end=end, label=label) -> None:
                first = label not in captured
                before = _ops_captured() if first else 0
                for _ in range(BLOCK):
                    run(x).square().mean().backward()
                    finish()
                end()
                if first:  # what dynamo put into graphs: a "compiled" method left eager shows 0
                    captured[label] = _ops_captured() - before
            methods.append(Method(label, block))
            models.append(run)
            chose.append(what)
    times = time_round_robin(methods, cfg.iters, warmup_rounds=cfg.warmup)
    times = {k: [t / BLOCK for t in v] for k, v in times.items()}
    chosen = {m.name: what() for m, what in zip(methods, chose)}
    # Every method trained the same model from the same start: the ranks must hold one model.
    sums = {m.name: float(sum(p.double().sum() for p in model.parameters())) for m, model in zip(methods, models)}
    per_rank: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(per_rank, (times, sums))
    if rank == 0:
        result = {m.name: {**summary_ms(slowest_rank([t for t, _ in per_rank], m.name)), "chose": chosen[m.name],
                           "ops_compiled": captured.get(m.name, 0),
                           "ranks_agree": len({s[m.name] for _, s in per_rank}) == 1} for m in methods}
        Path(out).write_text(json.dumps(result))
    fastreduce.shutdown()  # (the backends' threads let finish: the DDP's group goes with this function's end)
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


TARGETS = [("overlapped", "ddp"), ("overlapped, compiled", "ddp, compiled"), ("overlapped_bf16", "ddp"),
           ("overlapped_bf16, compiled", "ddp, compiled"), ("zero", "ddp"), ("zero, compiled", "ddp, compiled")]
"""(method, reference): the method's step at most the reference's, at every link."""
HOST_TARGETS = [("overlapped", "fused"), ("overlapped, compiled", "fused, compiled"),
                ("overlapped_bf16", "fused_bf16"), ("overlapped_bf16, compiled", "fused_bf16, compiled")]
"""On one host also: the overlapped step at most the fused one's."""


def _one_job(cfg: NetworkConfig, rate: str) -> dict[str, Any]:
    if rate != HOST:
        return run_on_hosts(2, rate, "fastreduce.bench.network", asdict(cfg), cfg.timeout)
    return launch_here("fastreduce.bench.network", asdict(cfg), cfg.timeout, "the network suite on this host")


def interleaved_jobs(rates: list[str], repeats: int, one_job: Callable[[str], Any]
                     ) -> tuple[dict[str, list[Any]], dict[str, str]]:
    """``repeats`` results of ``one_job(rate)`` per rate, the rates interleaved (noise on
    this machine drifts: each rate's jobs are spread over the whole run); namespace rates
    are left out where hosts cannot be made here. Returns the results by rate, and the
    rates left out with why."""
    from .hosts import can_make_hosts

    why = can_make_hosts()
    kept = [r for r in rates if r == HOST or not why]
    jobs: dict[str, list[Any]] = {r: [] for r in kept}
    for _ in range(repeats):
        for rate in kept:
            jobs[rate].append(one_job(rate))
    return jobs, {r: str(why) for r in rates if r not in kept}


def launch_here(module: str, spec: dict[str, Any], timeout: float, where: str) -> Any:
    """``python -m module --worker SPEC OUT`` on two ranks of this host (``torchrun
    --standalone``, the cores split between them); the JSON it wrote to ``OUT``."""
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "result.json")
        argv = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                "-m", module, "--worker", json.dumps(spec), out]
        env = dict(os.environ, OMP_NUM_THREADS=str(max(1, (os.cpu_count() or 2) // 2)))
        try:
            proc = subprocess.run(argv, capture_output=True, text=True, timeout=timeout, env=env)
        except subprocess.TimeoutExpired:
            raise RuntimeError(f"{where}: no result within {timeout:.0f} s") from None
        if proc.returncode or not os.path.exists(out):
            raise RuntimeError(f"{where} failed:\n{(proc.stdout + proc.stderr)[-3000:]}")
        return json.loads(Path(out).read_text())


def run_network_bench(cfg: NetworkConfig) -> dict[str, Any]:
    """``repeats`` jobs per link, the links interleaved; namespace links are skipped (with
    the reason) where hosts cannot be made here, ``host`` still runs."""
    started = time.monotonic()
    jobs, skipped = interleaved_jobs(cfg.rates, cfg.repeats, lambda rate: _one_job(cfg, rate))
    if not jobs:
        return {"skipped": next(iter(skipped.values()))}
    report: dict[str, Any] = {"config": asdict(cfg), "rates": {}, "targets": [], "skipped_rates": skipped}
    for rate, runs in jobs.items():
        report["rates"][rate] = {
            name: {**{k: statistics.median(j[name][k] for j in runs) for k in ("median_ms", "p10_ms", "p90_ms")},
                   "jobs_ms": [j[name]["median_ms"] for j in runs], "chose": runs[-1][name]["chose"],
                   "ops_compiled": runs[-1][name].get("ops_compiled", 0),
                   "ranks_agree": all(j[name]["ranks_agree"] for j in runs)} for name in runs[0]}
        for what, ref in TARGETS + (HOST_TARGETS if rate == HOST else []):
            if what in runs[0] and ref in runs[0]:
                ratios = [j[what]["median_ms"] / j[ref]["median_ms"] for j in runs]
                report["targets"].append({"rate": rate, "what": f"{what} <= {ref}", "ratio": statistics.median(ratios),
                                          "ratios": ratios, "limit": 1.0})
    report["seconds"] = round(time.monotonic() - started, 1)
    return report


def format_text(report: dict[str, Any]) -> str:
    if not report.get("rates"):
        return f"network suite skipped: {report['skipped']}"
    cfg = report["config"]
    names = list(next(iter(report["rates"].values())))
    lines = [f"network suite, every mode at its defaults (fp32 wires but the _bf16 rows'): 2 ranks, "
             f"{LAYERS} x Linear {WIDTH} (2.1M params), batch {cfg['batch']}, torch.optim.AdamW; ms per step, "
             f"median of {cfg['iters']} "
             f"steps, median of {cfg['repeats']} jobs",
             f"{'link':<10}" + "".join(f"{n:>22}" for n in names)]
    for rate, r in report["rates"].items():
        lines.append(f"{rate:<10}" + "".join(f"{r[n]['median_ms']:>22.1f}" for n in names))
    for rate, r in report["rates"].items():
        lines.append(f"{rate}: overlapped {r['overlapped']['chose']}")
        compiled = [n for n in names if n.endswith("compiled")]
        if compiled:
            lines.append(f"{rate}: ops dynamo compiled per method: "
                         + ", ".join(f"{n} {r[n].get('ops_compiled', 0)}" for n in compiled))
    for rate, r in report["rates"].items():
        for n in names:
            if n.endswith("compiled") and not r[n].get("ops_compiled", 1):
                lines.append(f"WARNING {rate}: {n!r} put no op into a graph: it ran uncompiled")
    for t in report["targets"]:
        verdict = "PASS" if t["ratio"] <= t["limit"] else "FAIL"
        lines.append(f"{verdict} {t['rate']}: {t['what']}: {t['ratio']:.3f} "
                     f"(jobs {', '.join(f'{x:.3f}' for x in t['ratios'])})")
    for rate, why in report.get("skipped_rates", {}).items():
        lines.append(f"skipped {rate}: {why}")
    return "\n".join(lines)


def worker_main(config: Callable[..., Any], worker: Callable[[Any, str], None]) -> None:
    """A suite module's ``__main__`` under :func:`launch_on`: ``--worker SPEC OUT`` runs
    ``worker(config(**SPEC), OUT)``; the process then exits as any does (what fastreduce
    runs in the background stops at exit: :func:`fastreduce.shutdown`)."""
    parser = argparse.ArgumentParser()
    parser.add_argument("--worker", nargs=2, metavar=("CONFIG", "OUT"), required=True)
    a = parser.parse_args()
    worker(config(**json.loads(a.worker[0])), a.worker[1])


if __name__ == "__main__":
    worker_main(NetworkConfig, worker)
