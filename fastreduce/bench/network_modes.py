"""The network suite's modes table: which mode fits which link.

Two and four hosts (:mod:`.hosts`: network namespaces on a bridge, ``tbf`` on every
link), one torchrun node and rank each, at each rate; each mode in a torchrun job of its
own (DDP's first), so no mode runs in a process an earlier one went through. Every mode
trains the same task from the same start on the same data stream: a 2.1M-parameter MLP
(8 x Linear 512, ReLU) regressing a fixed random teacher (two tanh layers, outputs of
unit variance) plus noise (std 0.3), batch ``batch`` per rank, AdamW (lr 1e-3). Per mode:

* ``ms_per_step``: wall time of the first ``steps`` steps / ``steps`` (the slowest
  rank; a whole number of the local modes' periods, so their syncs are in it); for the
  ``TIMED`` modes the median over ``repeats`` jobs (``ms_per_step_runs``);
* ``mb_per_step``: bytes this host's interface sent per step (the kernel's counter:
  everything on the wire, TCP headers included), mean over hosts; for a local-update mode
  (``_H<H>``) also ``mb_per_step_synced``: the window's bytes per step of its whole
  periods (48 steps hold one sync at H = 32, so ``mb_per_step`` reads 2/3 of it);
* ``loss``: held-out loss after ``steps`` steps of the ranks' averaged parameters
  (``no_comm``: the mean of each rank's own model's loss);
* ``s_to_ddp_loss``: wall time until the training loss (the ranks' mean, over the last
  8 steps) first reaches DDP's at its ``steps``-th step. The local-update modes go on
  training up to ``reach_factor`` x ``steps`` steps to get there; ``None``: not reached.

Modes: ``no_comm`` (AdamW alone), ``ddp`` (DistributedDataParallel), ``fused_fp32`` /
``fused_bf16`` (:class:`~fastreduce.FusedReducer`, one all-reduce after backward),
``fused_fp8`` / ``fused_int8`` (the same with a quantized wire, ``torch.float8_e4m3fn`` or
``"int8"``, and ``error_feedback=True``: encoded chunks exchanged and all-gathered),
``overlapped`` (fp32, 1 MB buckets during backward; ``overlapped_fp8`` /
``overlapped_int8``: quantized per bucket, with error feedback), ``zero`` (fp32 wire, 1 MB
buckets: reduce-scattered during backward, all-gathered first layers first and waited per
bucket in the next forward; ``zero_fp8`` / ``zero_int8``: a quantized reduce-scatter with
error feedback, the parameters all-gathered in bf16, ``gather_dtype=torch.bfloat16``),
``gossip_fp32`` / ``gossip_bf16`` (``one-peer-exp``), ``localsgd_H8``, ``diloco_H8``,
``diloco_H32_int4`` (H = 32, an int4 wire with error feedback),
``streaming_diloco_H8`` (4 fragments, delay 1) and ``streaming_diloco_H32`` (4 fragments,
delay 7: a fragment every 8 steps, its exchange spread over 7 of them): DiLoCo's default
bf16 wire, outer Nesterov SGD, lr 0.7, momentum 0.5 (:data:`OUTER_MOMENTUM`).

Targets (issue 20, two hosts at 100 Mbit/s unless said): streaming DiLoCo's step (H = 32:
at H = 8 its bytes alone take longer than a step at 100 Mbit/s, and at H = 16 moving them
costs this machine's two shared cores about a fifth of a step, see docs/bench.md) within
1.1x ``no_comm``'s; DiLoCo at DDP's final loss in at most a fifth of DDP's time; the
bf16 gossip step at most 0.6x DDP's on four hosts; at equal bytes the overlapped step
at most DDP's. Issue 32: the fused and overlapped fp8 and int8 steps at most 0.33x DDP's,
ZeRO's with an fp8 reduce-scatter at most 0.4x (DDP + AdamW, as every row here); DiLoCo
H = 32 with an int4 wire at least 256x fewer bytes a step than DDP.
"""

from __future__ import annotations

import json
import os
import re
import statistics
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable

__all__ = ["MODES", "ModesConfig", "format_text", "run_modes_bench", "write_modes_chart"]

MODES = ("no_comm", "ddp", "fused_fp32", "fused_bf16", "fused_fp8", "fused_int8", "overlapped", "overlapped_fp8",
         "overlapped_int8", "zero", "zero_fp8", "zero_int8", "gossip_fp32", "gossip_bf16", "localsgd_H8", "diloco_H8",
         "diloco_H32_int4", "streaming_diloco_H8", "streaming_diloco_H32")
WIRES = {"fp32": "float32", "bf16": "bfloat16", "fp8": "float8_e4m3fn", "int8": "int8"}
"""The fused modes' wires by suffix (fp8 and int8 with error feedback)."""
LOCAL = ("no_comm", "localsgd_H8", "diloco_H8", "diloco_H32_int4", "streaming_diloco_H8", "streaming_diloco_H32")
"""The modes that train on to reach DDP's loss."""
TIMED = ("ddp", "no_comm", "overlapped", "streaming_diloco_H32")
"""The modes whose step times a target compares closely (streaming DiLoCo within 1.1x
``no_comm``'s, the overlapped step at most DDP's): each runs ``repeats`` jobs, the extra
ones interleaved after the others (``steps`` steps each, step time only), and its
``ms_per_step`` is their median. On this 2-core VM one job's ``no_comm`` step moves by
54-74 ms from a job to the next, as much as the first target's margin, and the
overlapped and DDP steps at 4 hosts and 100 Mbit/s came out 0.991x and 1.0003x in two
runs of one job each."""
OUTER_LR, OUTER_MOMENTUM = 0.7, 0.5
"""DiLoCo's outer Nesterov SGD. The paper's momentum 0.9 is tuned for hundreds of inner
steps; at H = 8 on this task it never reached DDP's loss in 192 steps, momentum 0.5 did
in 63 (lr 1 without momentum, i.e. LocalSGD: 60), 2 ranks on one host."""
WIDTH, LAYERS, SMOOTH = 512, 8, 8


@dataclass
class ModesConfig:
    hosts: list[int] = field(default_factory=lambda: [2, 4])
    rates: list[str] = field(default_factory=lambda: ["10gbit", "1gbit", "100mbit"])
    steps: int = 48           # compared steps per mode: a multiple of 8 (the local modes' period)
    reach_factor: int = 4     # the local modes train up to this many x steps to reach DDP's loss
    batch: int = 256
    modes: list[str] = field(default_factory=lambda: list(MODES))
    timeout: float = 1800.0   # per (hosts, rate)
    target: float | None = None  # DDP's final training loss: set by the runner for the modes after DDP
    job_per_mode: bool = True  # False (--quick): every mode in one torchrun job, a start instead of 12
    repeats: int = 3          # jobs of each ``TIMED`` mode (with a job per mode): ms/step is their median


# ============================================================== in each rank

def _tx_bytes() -> int:
    ifname = os.environ.get("GLOO_SOCKET_IFNAME", "")
    try:
        return int(Path(f"/sys/class/net/{ifname}/statistics/tx_bytes").read_text())
    except (OSError, ValueError):
        return 0


def _build(name: str, model: Any, bucket_mb: float | str = 1.0
           ) -> tuple[Callable[[Any], Any], Callable[[], None], Callable[[], None], Callable[[], str]]:
    """``(forward, after_backward, finish, what it chose)`` of ``name`` on ``model`` (the
    overlapped and ZeRO modes with buckets of ``bucket_mb``; what they chose: their buckets)."""
    import torch
    from torch import nn

    import fastreduce

    adamw = lambda params: torch.optim.AdamW(params, lr=1e-3)  # noqa: E731
    nothing = lambda: None  # noqa: E731
    none_chosen = lambda: ""  # noqa: E731 - a mode without buckets to choose
    if name.startswith("gossip"):
        wire = torch.bfloat16 if name.endswith("bf16") else torch.float32
        net = fastreduce.DecentralizedDataParallel(model, lambda named: adamw([p for _, p in named]),
                                                   topology="one-peer-exp", wire_dtype=wire)
        return net, nothing, net.wait_exchanges, none_chosen
    if name.startswith("zero"):
        wire = WIRES[name.split("_")[1] if "_" in name else "fp32"]
        quant = wire in ("float8_e4m3fn", "int8")  # with error feedback, the parameters gathered in bf16
        zopt = fastreduce.ZeroOptimizer(model.parameters(), torch.optim.AdamW, lr=1e-3, module=model,
                                        wire_dtype=getattr(torch, wire) if "float" in wire else wire,
                                        error_feedback=quant, gather_dtype=torch.bfloat16 if quant else None,
                                        bucket_mb=bucket_mb)
        return model, lambda: (zopt.step(), zopt.zero_grad()), zopt.wait_params, \
            lambda: f"{zopt.num_buckets} bucket(s)" + (f"; {zopt.sizing.describe()}" if zopt.sizing else "")
    opt = adamw(model.parameters())
    step = lambda: (opt.step(), opt.zero_grad())  # noqa: E731
    if name == "ddp":
        ddp = nn.parallel.DistributedDataParallel(model)
        return ddp, step, nothing, lambda: f"{ddp.bucket_bytes_cap / 2**20:g} MB buckets"
    if name.startswith(("fused", "overlapped")):
        overlap = name.startswith("overlapped")
        wire = WIRES["fp32" if name == "overlapped" else name.rsplit("_", 1)[1]]
        dtype = getattr(torch, wire) if "float" in wire else wire  # "int8" is a string, not torch.int8
        reducer = fastreduce.FusedReducer(model, overlap=overlap, wire_dtype=dtype,
                                          error_feedback=wire in ("float8_e4m3fn", "int8"),
                                          **({"bucket_mb": bucket_mb} if overlap else {}))
        return model, lambda: (reducer.reduce(), step()), nothing, \
            lambda: reducer.stats.sizing.describe() if reducer.stats.sizing else f"{bucket_mb} MB buckets"
    if name == "localsgd_H8":
        keep = fastreduce.LocalSGD(model, opt, sync_every=8)
        return model, step, lambda: keep is not None, none_chosen
    if "diloco" in name:
        outer = torch.optim.SGD(model.parameters(), lr=OUTER_LR, momentum=OUTER_MOMENTUM, nesterov=True)
        h = int(name.rsplit("_H", 1)[1].split("_")[0])
        streaming = name.startswith("streaming")
        quant = {"wire_dtype": "int4", "error_feedback": True} if name.endswith("_int4") else {}
        keep = fastreduce.DiLoCo(model, opt, outer, sync_every=h, fragments=4 if streaming else 1,
                                 fragment_delay=h // 4 - 1 if streaming else 0, **quant)
        return model, step, lambda: keep is not None, none_chosen
    if name == "no_comm":
        return model, step, nothing, none_chosen
    raise ValueError(f"unknown mode {name!r}; the modes are {', '.join(MODES)}")


def _mlp(seed: int, width: int = WIDTH) -> Any:
    import torch
    from torch import nn

    torch.manual_seed(seed)
    return nn.Sequential(*[m for _ in range(LAYERS) for m in (nn.Linear(width, width), nn.ReLU())][:-1])


def worker(cfg: ModesConfig, out: str) -> None:
    """One rank (under torchrun): the modes of ``cfg`` in turn (the runner gives one per
    job: DDP's, then each other mode's with DDP's final loss as ``cfg.target``); rank 0
    writes ``out``."""
    import torch
    import torch.distributed as dist

    import fastreduce

    fastreduce.init_distributed()
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(1234)  # the teacher: two tanh layers, outputs of unit variance
    teacher = torch.nn.Sequential(torch.nn.Linear(WIDTH, WIDTH), torch.nn.Tanh(), torch.nn.Linear(WIDTH, WIDTH))
    teacher.requires_grad_(False)
    held_x = torch.randn(2048, WIDTH, generator=torch.Generator().manual_seed(99))
    with torch.no_grad():
        teacher[2].weight.div_(teacher(held_x).std())
        teacher[2].bias.zero_()
    held_y = teacher(held_x)

    def batch(gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
        x = torch.randn(cfg.batch, WIDTH, generator=gen)
        return x, teacher(x) + 0.3 * torch.randn(x.shape[0], WIDTH, generator=gen)

    @torch.no_grad()
    def held_out(model: Any, own: bool) -> float:
        if own:  # no_comm: each rank's own model, the loss averaged
            loss = torch.nn.functional.mse_loss(model(held_x), held_y).reshape(1)
            dist.all_reduce(loss)
            return float(loss.item()) / world
        flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
        dist.all_reduce(flat)
        avg = _mlp(0)
        torch.nn.utils.vector_to_parameters(flat / world, avg.parameters())
        return float(torch.nn.functional.mse_loss(avg(held_x), held_y).item())

    target = cfg.target
    results: dict[str, Any] = {}
    for name in cfg.modes:
        model = _mlp(0)
        forward, after, finish, _ = _build(name, model)
        gen = torch.Generator().manual_seed(1000 * rank + 7)  # the same stream for every mode
        limit = cfg.steps * (cfg.reach_factor if name in LOCAL and target is not None else 1)
        times, losses, paused = [], [], 0.0
        dist.barrier()
        tx0, t0 = _tx_bytes(), time.perf_counter()
        for i in range(limit):
            x, y = batch(gen)
            loss = torch.nn.functional.mse_loss(forward(x), y)
            loss.backward()
            after()
            losses.append(float(loss.item()))
            times.append(time.perf_counter() - t0 - paused)
            if i + 1 == cfg.steps:
                tx = _tx_bytes() - tx0
                p0 = time.perf_counter()
                finish()
                held = held_out(model, own=name == "no_comm")
                paused += time.perf_counter() - p0
            if i + 1 >= cfg.steps and (i + 1) % 8 == 0 and i + 1 < limit:
                p0 = time.perf_counter()  # reached DDP's loss (the ranks' mean)? one tiny all-reduce
                mean = torch.tensor([sum(losses[-SMOOTH:]) / SMOOTH])
                dist.all_reduce(mean)
                paused += time.perf_counter() - p0
                if float(mean.item()) / world <= target:
                    break
        finish()
        per_rank: list[Any] = [None] * world
        dist.all_gather_object(per_rank, (times, losses, tx))
        if name == "ddp":
            curve = [sum(ls[i] for _, ls, _ in per_rank) / world for i in range(cfg.steps)]
            target = sum(curve[-SMOOTH:]) / SMOOTH
            flag = torch.tensor([target])
            dist.broadcast(flag, 0)  # every rank the same target, to the bit
            target = float(flag.item())
        results[name] = {"per_rank": per_rank, "loss": held}
        del forward, after, finish, model
    if rank == 0:
        Path(out).write_text(json.dumps({"target": target, "modes": {n: _summary(r, cfg, target, n)
                                                                     for n, r in results.items()}}))
    fastreduce.shutdown()  # the backends' threads let finish before the group goes (fastreduce/exit_quiet.py)
    dist.destroy_process_group()


def _summary(r: dict[str, Any], cfg: ModesConfig, target: float | None, name: str = "") -> dict[str, Any]:
    """A mode's figures; a local-update mode's (``_H<H>``) bytes also per step of its whole
    periods in the window (``mb_per_step_synced``: at H = 32, 48 steps hold one sync)."""
    per_rank = r["per_rank"]
    n = min(len(t) for t, _, _ in per_rank)
    slowest = [max(t[i] for t, _, _ in per_rank) for i in range(n)]
    mean_loss = [sum(ls[i] for _, ls, _ in per_rank) / len(per_rank) for i in range(n)]
    reach = None
    for i in range(SMOOTH - 1, n):
        if target is not None and sum(mean_loss[i - SMOOTH + 1:i + 1]) / SMOOTH <= target:
            reach = slowest[i]
            break
    sent = sum(tx for _, _, tx in per_rank) / len(per_rank) / 1e6
    period = re.search(r"_H(\d+)", name)
    whole = period and cfg.steps // int(period.group(1)) * int(period.group(1))
    return {"ms_per_step": slowest[cfg.steps - 1] / cfg.steps * 1e3,
            "mb_per_step": sent / cfg.steps, **({"mb_per_step_synced": sent / whole} if whole else {}),
            "loss": r["loss"], "train_loss": sum(mean_loss[cfg.steps - SMOOTH:cfg.steps]) / SMOOTH,
            "s_to_ddp_loss": reach, "steps_run": n}


# ============================================================== the runner

def run_modes_bench(cfg: ModesConfig) -> dict[str, Any]:
    """Every (hosts, rate) in turn; ``{"skipped": why}`` where hosts cannot be made here."""
    from .hosts import can_make_hosts

    why = can_make_hosts()
    if why:
        return {"skipped": why}
    started = time.monotonic()
    runs = {f"{n}x{rate}": _one_link(cfg, n, rate) for n in cfg.hosts for rate in cfg.rates}
    report: dict[str, Any] = {"config": asdict(cfg), "runs": runs, "targets": {},
                              "seconds": round(time.monotonic() - started, 1)}
    report["targets"] = _targets(runs)
    return report


def _one_link(cfg: ModesConfig, hosts_n: int, rate: str) -> dict[str, Any]:
    """Every mode on ``hosts_n`` hosts at ``rate``, each in a torchrun job of its own
    (DDP's first, for its final loss): no mode runs in a process that an earlier mode's
    threads, process groups and allocations went through."""
    from .hosts import namespace_hosts
    from .network import launch_on

    deadline = time.monotonic() + cfg.timeout
    where = f"{hosts_n} hosts at {rate}"
    modes: dict[str, Any] = {}
    target = None
    order = ["ddp"] + [m for m in cfg.modes if m != "ddp"]
    again = [m for m in order if m in TIMED] * (cfg.repeats - 1) if cfg.job_per_mode else []
    with namespace_hosts(hosts_n, rate) as hosts:
        for names in ([m] for m in order) if cfg.job_per_mode else [order]:
            spec = {**asdict(cfg), "modes": names, "target": target}
            r = launch_on(hosts, "fastreduce.bench.network_modes", spec, deadline - time.monotonic(), where)
            target = r["target"]
            modes.update(r["modes"])
        for m in again:  # step time only: no training on to DDP's loss
            spec = {**asdict(cfg), "modes": [m], "target": None}
            r = launch_on(hosts, "fastreduce.bench.network_modes", spec, deadline - time.monotonic(), where)
            modes[m].setdefault("ms_per_step_runs", [modes[m]["ms_per_step"]]).append(r["modes"][m]["ms_per_step"])
    for m in modes.values():
        if "ms_per_step_runs" in m:
            m["ms_per_step"] = statistics.median(m["ms_per_step_runs"])
    return {"target": target, "modes": modes}


def _targets(runs: dict[str, Any]) -> dict[str, dict[str, Any]]:
    out: dict[str, dict[str, Any]] = {}

    def ratio(name: str, run: str, num: str, den: str, key: str, limit: float, den_key: str | None = None) -> None:
        r = runs.get(run, {}).get("modes", {})
        if num in r and den in r and r[num].get(key) is not None and r[den][den_key or key]:
            value = r[num][key] / r[den][den_key or key]
            out[name] = {"what": f"{run}: {num} / {den} ({key})", "value": value, "limit": limit,
                         "op": "<=", "pass": value <= limit}
        elif num in r and den in r:
            out[name] = {"what": f"{run}: {num} / {den} ({key})", "value": "not reached", "limit": limit,
                         "op": "<=", "pass": False}

    ratio("streaming_hidden", "2x100mbit", "streaming_diloco_H32", "no_comm", "ms_per_step", 1.1)
    ratio("diloco_to_ddp_loss", "2x100mbit", "diloco_H8", "ddp", "s_to_ddp_loss", 0.2)
    ratio("gossip_bf16_4hosts", "4x100mbit", "gossip_bf16", "ddp", "ms_per_step", 0.6)
    for run in runs:
        ratio(f"overlapped_vs_ddp_{run}", run, "overlapped", "ddp", "ms_per_step", 1.0)
    for mode in ("fused_fp8", "fused_int8", "overlapped_fp8", "overlapped_int8"):  # issue 32
        ratio(f"{mode}_vs_ddp", "2x100mbit", mode, "ddp", "ms_per_step", 0.33)
    ratio("zero_fp8_vs_ddp", "2x100mbit", "zero_fp8", "ddp", "ms_per_step", 0.4)
    ratio("diloco_int4_bytes_vs_ddp", "2x100mbit", "diloco_H32_int4", "ddp", "mb_per_step_synced", 1 / 256,
          "mb_per_step")
    return out


def format_text(report: dict[str, Any]) -> str:
    from .report import target_lines

    if "skipped" in report:
        return f"network suite (modes) skipped: {report['skipped']}"
    cfg = report["config"]
    lines = [f"network suite, modes: namespace hosts (tbf), 1 rank each, {LAYERS} x Linear {WIDTH} (2.1M params), "
             f"batch {cfg['batch']}/rank, AdamW, {cfg['steps']} steps; ms/step, MB sent/step/host, held-out loss, "
             "s to DDP's final training loss"]
    for run, r in report["runs"].items():
        lines += ["", f"{run} (DDP's loss at step {cfg['steps']}: {r['target']:.4f})",
                  f"  {'mode':<22}{'ms/step':>10}{'MB/step':>10}{'loss':>10}{'s to DDP':>10}{'x DDP':>8}"]
        ddp = r["modes"]["ddp"]["ms_per_step"]
        for name, m in r["modes"].items():
            reach = f"{m['s_to_ddp_loss']:.1f}" if m["s_to_ddp_loss"] is not None else "-"
            lines.append(f"  {name:<22}{m['ms_per_step']:>10.1f}{m['mb_per_step']:>10.2f}{m['loss']:>10.4f}"
                         f"{reach:>10}{m['ms_per_step'] / ddp:>8.2f}")
        lines += [f"  {name}: ms/step the median of {len(m['ms_per_step_runs'])} jobs: "
                  + ", ".join(f"{t:.1f}" for t in m["ms_per_step_runs"])
                  for name, m in r["modes"].items() if "ms_per_step_runs" in m]
    if report["targets"]:
        lines += ["", "targets:"] + target_lines(report["targets"])
    return "\n".join(lines)


def write_modes_chart(report: dict[str, Any], path: Path) -> str | None:
    """Step time against link rate, one line per mode, a panel per host count (PNG);
    returns a note instead where matplotlib is missing."""
    from .hosts import check_rate
    from .report import pyplot

    plt = pyplot()
    if plt is None:
        return "no chart: pip install 'fastreduce[plot]'"

    hosts = sorted({int(k.split("x")[0]) for k in report["runs"]})
    fig, axes = plt.subplots(1, len(hosts), figsize=(6 * len(hosts), 4.5), squeeze=False)
    for ax, n in zip(axes[0], hosts):
        runs = sorted(((check_rate(k.split("x", 1)[1]), r) for k, r in report["runs"].items()
                       if k.startswith(f"{n}x")), key=lambda t: t[0])
        colors = plt.get_cmap("tab20").colors
        for k, mode in enumerate(report["config"]["modes"]):
            pts = [(bits / 1e6, r["modes"][mode]["ms_per_step"]) for bits, r in runs if mode in r["modes"]]
            ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="os^"[k % 3], color=colors[(2 * k) % 20 + k // 10],
                    linestyle="-" if k % 2 == 0 else "--", label=mode)
        ax.set(xscale="log", yscale="log", xlabel="link rate (Mbit/s)", ylabel="ms per step",
               title=f"{n} hosts, 1 rank each")
        ax.grid(True, which="both", alpha=0.3)
    axes[0][-1].legend(fontsize=7, loc="upper right")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return None


if __name__ == "__main__":
    from .network import worker_main

    worker_main(ModesConfig, worker)
