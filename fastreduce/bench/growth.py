"""The network suite's growth part: each mode's bytes and step time against the number of
hosts, measured on namespace hosts and set beside what :mod:`fastreduce.plan` predicts.

``hosts`` (2, 4, 8, 16) namespace hosts (:mod:`.hosts`), one torchrun node and rank each,
at each rate; one torchrun job per (hosts, rate) runs every mode in turn, and the jobs
repeat ``repeats`` times interleaved (each repeat through every host count and rate, the
modes' order rotated). The model is an MLP (8 x Linear ``width``, ReLU; 0.53M parameters
at width 256) at a batch small enough that its compute is small beside the link, trained
on random regression batches (made before the steps, as a loader's workers would) with
``torch.optim.AdamW(params, lr=1e-3)``; the overlapped
mode and ZeRO at ``bucket_mb="auto"`` (their defaults), the others at theirs. Per mode and
job, over ``steps`` steps after ``warmup`` (whole periods of the local modes):

* ``ms_per_step``: the slowest rank's wall time over the window / ``steps``;
* ``mb_per_step``: bytes each host's interface sent (the kernel's counter: frames,
  headers and the ACKs of what it received included) / ``steps``, mean over hosts (and
  the largest host's);
* ``resent_mb_per_step``: TCP segments the host sent again (its namespace's
  ``RetransSegs``) x 1448 bytes: a full ``tbf`` queue drops, and what is sent again is in
  ``mb_per_step`` too;
* ``no_comm``'s forward, backward and optimizer milliseconds, the compute the plan is given.

Each row's figures are the medians of the repeats. Set beside them:

* ``formula_mb``: :func:`fastreduce.plan.estimate`'s payload bytes per rank and step on
  the wire (:func:`fastreduce.plan.on_the_wire`: in 1514-byte frames of 1448 bytes of
  payload; ``payload_mb`` without them). The veth's counter reads the wire's bytes where
  ``tbf`` cuts the packets to the MTU before counting (100 Mbit/s: its bucket is smaller
  than a 64 KB packet) and about the payload where it passes them whole (1 Gbit/s:
  segmentation offload, one set of headers per 64 KB), so at 1 Gbit/s it reads about 4%
  under the wire;
* ``predicted_ms``: the plan's step for that mode as ``fastreduce plan --probe`` would give
  it on that group: the host link solved from the group's all-reduce measured at the job's
  start (:func:`fastreduce.sizing.measure_link`, the median over the jobs), the compute
  ``no_comm``'s at the same host count (its backward and optimizer as timed, the rest of its
  step the forward). Nothing from the modes' own rows goes into it;
* ``from_2_hosts_ms``: the same from the 2-host jobs' link, extrapolated. On this 2-core
  machine the hosts share the cores, so a ring's hop waits for its rank to be scheduled: the
  latency the 16-host group measured per hop is about ten times the 2-host group's, which
  real hosts, each with its own cores, do not show.

Before the jobs, each (hosts, rate)'s testbed on its own (:func:`.hosts.ring_traffic`:
every host sending to the next at the rate, no rank running): ``testbed_cpu_busy``, the
share of this machine's CPU the kernel takes to move that traffic. The hosts share the
machine's cores, so where that share is large the step measured is this machine's CPU,
not the link (real hosts each move their own link's packets on their own cores).

Targets (issue 50): bytes within 5% of the formula and the predicted step within 20% of
the measured one, at every point.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

__all__ = ["GrowthConfig", "PLAN_MODES", "format_text", "run_growth_bench", "summarize", "write_growth_chart"]

PLAN_MODES = {"ddp": "ddp", "fused_fp32": "fused_fp32", "fused_bf16": "fused_bf16", "overlapped": "overlapped_fp32",
              "zero": "zero_fp32", "gossip_bf16": "gossip_bf16", "localsgd_H8": "localsgd_H8",
              "diloco_H8": "diloco_H8"}
"""Each measured mode (:func:`.network_modes._build`'s name) and its row in :func:`fastreduce.plan.modes`."""
BYTES_LIMIT, STEP_LIMIT = 0.05, 0.20
MSS = 1448
"""Payload bytes of a TCP segment at MTU 1500 (timestamps on): what one retransmission re-sends at most."""


@dataclass
class GrowthConfig:
    hosts: list[int] = field(default_factory=lambda: [2, 4, 8, 16])
    rates: list[str] = field(default_factory=lambda: ["1gbit", "100mbit"])
    modes: list[str] = field(default_factory=lambda: ["no_comm", *PLAN_MODES])
    width: int = 256
    batch: int = 32
    warmup: int = 12    # past the overlapped mode's refresh of its auto sizes (a probe, after 8 steps)
    steps: int = 16     # a multiple of 8
    repeats: int = 3
    timeout: float = 900.0  # per job
    rotate: int = 0     # set by the runner: the modes' order starts this far in
    one_host: int = 64  # ranks of the one-host collectives' check (0: none; about 20 GB of memory at 64)


# ============================================================== in each rank

def _retransmitted() -> int:
    """TCP segments this host (its network namespace) has sent again: ``/proc/net/snmp``'s RetransSegs."""
    try:
        lines = [ln.split() for ln in Path("/proc/net/snmp").read_text().splitlines() if ln.startswith("Tcp:")]
        return int(lines[1][lines[0].index("RetransSegs")])
    except (OSError, ValueError, IndexError):
        return 0


def worker(cfg: GrowthConfig, out: str) -> None:
    import json

    import torch
    import torch.distributed as dist

    import fastreduce

    from ..sizing import measure_link
    from .network_modes import _build, _mlp, _tx_bytes

    fastreduce.init_distributed()
    rank, world = dist.get_rank(), dist.get_world_size()
    link = measure_link(None, torch.device("cpu"))
    k = cfg.rotate % len(cfg.modes)
    results: dict[str, Any] = {}
    for name in cfg.modes[k:] + cfg.modes[:k]:
        model = _mlp(0, cfg.width)
        forward, after, finish, _ = _build(name, model, bucket_mb="auto")
        gen = torch.Generator().manual_seed(1000 * rank + 7)
        data = [torch.randn(2, cfg.batch, cfg.width, generator=gen) for _ in range(cfg.warmup + cfg.steps)]
        phases = [0.0, 0.0, 0.0]
        for i, (x, y) in enumerate(data):  # made beforehand: a loader's work is not the step's
            if i == cfg.warmup:  # nothing in flight, on either side of the window: an exchange
                finish()         # done on one rank may be queued on its link still
                dist.barrier()
                tx0, re0, t0 = _tx_bytes(), _retransmitted(), time.perf_counter()
            a = time.perf_counter()
            loss = torch.nn.functional.mse_loss(forward(x), y)
            b = time.perf_counter()
            loss.backward()
            c = time.perf_counter()
            after()
            if i >= cfg.warmup:
                for j, d in enumerate((b - a, c - b, time.perf_counter() - c)):
                    phases[j] += d
        finish()
        elapsed = time.perf_counter() - t0
        dist.barrier()  # every rank's receives done: every send is off this host's link
        tx, resent = _tx_bytes() - tx0, _retransmitted() - re0
        per_rank: list[Any] = [None] * world
        dist.all_gather_object(per_rank, (elapsed, tx, phases, resent))
        results[name] = {"ms_per_step": max(r[0] for r in per_rank) / cfg.steps * 1e3,
                         "mb_per_step": statistics.mean(r[1] for r in per_rank) / cfg.steps / 1e6,
                         "mb_per_step_max": max(r[1] for r in per_rank) / cfg.steps / 1e6,
                         "resent_segments_per_step": statistics.mean(r[3] for r in per_rank) / cfg.steps,
                         "phase_ms": [statistics.mean(r[2][j] for r in per_rank) / cfg.steps * 1e3
                                      for j in range(3)]}
        del forward, after, finish, model
    if rank == 0:
        params = sum(p.numel() for p in _mlp(0, cfg.width).parameters())
        Path(out).write_text(json.dumps({"params": params, "probe": {"latency_s": link.latency_s,
                                                                     "bytes_per_s": link.bytes_per_s},
                                         "modes": results}))
    fastreduce.shutdown()  # the backends' threads let finish before the group goes (fastreduce/exit_quiet.py)
    dist.destroy_process_group()


COLLECTIVE_MB = (16, 64)
"""The one-host check's collectives: all-reduce, reduce-scatter and all-gather of these
sizes, beyond the probe's 4 MB."""


def collectives_worker(rank: int, world: int) -> dict[str, Any] | None:
    """One rank of the one-host check (:func:`fastreduce.launch.run_ranks`, Gloo on this host):
    the group's all-reduce probed as ``fastreduce plan --probe`` does, then each collective of
    :data:`COLLECTIVE_MB` as the modes send it on a process group (the fused mode's
    ``all_reduce``, ZeRO's reduce-scatter and all-gather through :class:`~fastreduce.comm.Comm`)
    timed: the fastest of three, each after a barrier; rank 0's figures."""
    import torch
    import torch.distributed as dist

    from ..comm import complete, get_comm
    from ..sizing import fastest, measure_link

    cpu = torch.device("cpu")
    link = measure_link(None, cpu)
    comm = get_comm(None, cpu, "process_group")
    out: dict[str, Any] = {"probe": {"latency_s": link.latency_s, "bytes_per_s": link.bytes_per_s}, "times": {}}
    for mb in COLLECTIVE_MB:
        buf = torch.zeros(mb * 2**20 // 4 // world * world)
        for name, call in (("all_reduce", lambda: dist.all_reduce(buf)),
                           ("reduce_scatter", lambda: complete(comm.reduce_scatter(buf))),
                           ("all_gather", lambda: complete(comm.all_gather(buf)))):
            out["times"][f"{name}_{mb}"] = fastest(call, None, cpu, 3)
    return out if rank == 0 else None


def one_host_table(raw: dict[str, Any], ranks: int) -> dict[str, Any]:
    """Each collective measured beside the plan's, the cluster solved from the group's probe."""
    from ..plan import Cluster, Link

    probe = Link(raw["probe"]["latency_s"], raw["probe"]["bytes_per_s"])
    cluster = Cluster.from_probe(probe, ranks, ranks, probe)
    rows = {}
    for key, seconds in raw["times"].items():
        name, mb = key.rsplit("_", 1)
        nbytes = int(mb) * 2**20
        predicted = getattr(cluster, name)(nbytes)
        rows[key] = {"ms": seconds * 1e3, "predicted_ms": predicted * 1e3, "error": predicted / seconds - 1}
    return {"ranks": ranks, "probe": raw["probe"], "rows": rows}


# ============================================================== the runner

def run_growth_bench(cfg: GrowthConfig) -> dict[str, Any]:
    """Every (hosts, rate), ``repeats`` times interleaved; ``{"skipped": why}`` where hosts
    cannot be made here."""
    from .hosts import can_make_hosts, check_rate, namespace_hosts, ring_traffic
    from .network import run_on_hosts

    why = can_make_hosts()
    if why:
        return {"skipped": why}
    if any(n < 2 for n in cfg.hosts) or cfg.steps % 8 or cfg.warmup < 1:
        raise ValueError(f"growth: hosts at least 2, steps a multiple of 8, a warm-up step; got {cfg}")
    for rate in cfg.rates:
        check_rate(rate)
    started = time.monotonic()
    testbed = {}  # the kernel's share of this machine moving a ring's traffic, before any rank runs
    for n in cfg.hosts:
        for rate in cfg.rates:
            with namespace_hosts(n, rate) as hosts:
                testbed[f"{n}x{rate}"] = ring_traffic(hosts, rate)
    jobs: dict[str, list[Any]] = {}
    for rep in range(cfg.repeats):
        for n in cfg.hosts:
            for rate in cfg.rates:
                spec = {**asdict(cfg), "rotate": rep}
                jobs.setdefault(f"{n}x{rate}", []).append(
                    run_on_hosts(n, rate, "fastreduce.bench.growth", spec, cfg.timeout))
    if cfg.one_host:
        from ..launch import run_ranks

        raw = run_ranks(collectives_worker, cfg.one_host, timeout=cfg.timeout, threads=1)[0]
        one_host = one_host_table(raw, cfg.one_host)
    report = {"config": asdict(cfg), "jobs": jobs, "testbed": testbed, "seconds": round(time.monotonic() - started, 1),
              **({"one_host": one_host} if cfg.one_host else {})}
    report.update(summarize(report))
    return report


def summarize(report: dict[str, Any]) -> dict[str, Any]:
    """The table (medians of the jobs, the formula's bytes, the plan's step) and the targets,
    from the jobs' raw figures: pure Python, so it can be redone from a saved ``bench.json``."""
    from ..plan import Cluster, Link, Workload, estimate, modes, on_the_wire

    cfg = report["config"]
    jobs = report["jobs"]
    by_name = {m.name: m for m in modes()}
    rows: dict[str, dict[str, Any]] = {}
    never = Link(0.0, float("inf"))  # one rank a host: no intra-host link

    def probed(runs: list[Any]) -> Link:  # the median of the jobs' probes
        return Link(statistics.median(j["probe"]["latency_s"] for j in runs),
                    statistics.median(j["probe"]["bytes_per_s"] for j in runs))

    for rate in cfg["rates"]:
        two = jobs.get(f"2x{rate}")
        link2 = Cluster.from_probe(probed(two), 2, 1, never).link if two else None
        for n in cfg["hosts"]:
            runs = jobs.get(f"{n}x{rate}")
            if not runs:
                continue
            med = lambda mode, key: statistics.median(j["modes"][mode][key] for j in runs)  # noqa: E731
            step = med("no_comm", "ms_per_step") / 1e3
            bwd, opt = (statistics.median(j["modes"]["no_comm"]["phase_ms"][i] for j in runs) / 1e3 for i in (1, 2))
            work = Workload(params=runs[0]["params"], backward_s=bwd, forward_s=step - bwd - opt, optimizer_s=opt)
            cluster = Cluster.from_probe(probed(runs), n, 1, never)
            from_two = Cluster(n, link2) if link2 else None
            bed = report.get("testbed", {}).get(f"{n}x{rate}")
            row: dict[str, Any] = {"no_comm_ms": step * 1e3, "testbed_cpu_busy": bed and bed["cpu_busy"], "link": {
                "latency_ms": cluster.link.latency_s * 1e3, "mb_per_s": cluster.link.bytes_per_s / 1e6}, "modes": {}}
            for mode, plan_name in PLAN_MODES.items():
                if mode not in runs[0]["modes"]:
                    continue
                e = estimate(by_name[plan_name], cluster, work)
                ms, mb = med(mode, "ms_per_step"), med(mode, "mb_per_step")
                formula = on_the_wire(e.bytes_per_step) / 1e6
                row["modes"][mode] = {
                    "ms_per_step": ms, "ms_runs": [j["modes"][mode]["ms_per_step"] for j in runs],
                    "predicted_ms": e.step_s * 1e3, "step_error": e.step_s * 1e3 / ms - 1,
                    "from_2_hosts_ms": from_two and estimate(by_name[plan_name], from_two, work).step_s * 1e3,
                    "mb_per_step": mb, "mb_per_step_max": med(mode, "mb_per_step_max"), "formula_mb": formula,
                    "payload_mb": e.bytes_per_step / 1e6,
                    "resent_mb_per_step": statistics.median(j["modes"][mode].get("resent_segments_per_step", 0)
                                                            for j in runs) * MSS / 1e6,
                    "bytes_error": mb / formula - 1 if formula else None}
            rows[f"{n}x{rate}"] = row
    worst_bytes = max((abs(m["bytes_error"]), f"{k} {name}") for k, r in rows.items()
                      for name, m in r["modes"].items() if m["bytes_error"] is not None)
    worst_step = max((abs(m["step_error"]), f"{k} {name}") for k, r in rows.items() for name, m in r["modes"].items())
    targets = {
        "bytes_vs_formula": {"what": f"largest |measured / formula - 1| ({worst_bytes[1]})", "value": worst_bytes[0],
                             "limit": BYTES_LIMIT, "op": "<=", "pass": worst_bytes[0] <= BYTES_LIMIT},
        "step_vs_plan": {"what": f"largest |predicted / measured - 1| ({worst_step[1]})", "value": worst_step[0],
                         "limit": STEP_LIMIT, "op": "<=", "pass": worst_step[0] <= STEP_LIMIT}}
    one = report.get("one_host")
    if one:
        worst = max((abs(r["error"]), k) for k, r in one["rows"].items())
        targets["one_host_collectives"] = {"what": f"{one['ranks']} ranks on one host: largest |predicted / measured "
                                                   f"- 1| ({worst[1]})", "value": worst[0], "limit": STEP_LIMIT,
                                           "op": "<=", "pass": worst[0] <= STEP_LIMIT}
    return {"table": rows, "targets": targets}


def format_text(report: dict[str, Any]) -> str:
    from .report import target_lines

    if "skipped" in report:
        return f"network suite (growth) skipped: {report['skipped']}"
    cfg = report["config"]
    lines = [f"network suite, growth: {', '.join(map(str, cfg['hosts']))} hosts (1 rank each) at "
             f"{', '.join(cfg['rates'])}; MLP width {cfg['width']}, batch {cfg['batch']}; medians of "
             f"{cfg['repeats']} jobs, {cfg['steps']} steps each; {report['seconds']:.0f} s",
             "  per mode and host count: measured ms/step (plan's prediction from the group's probe, error; "
             "from the 2-host link) | MB a rank sent/step (formula's, error)"]
    for rate in cfg["rates"]:
        lines.append(f"  {rate}:")
        for mode in PLAN_MODES:
            cells = []
            for n in cfg["hosts"]:
                m = report["table"].get(f"{n}x{rate}", {}).get("modes", {}).get(mode)
                if m:
                    two = f"; 2h {m['from_2_hosts_ms']:.0f}" if m.get("from_2_hosts_ms") else ""
                    cells.append(f"{n}: {m['ms_per_step']:.0f} ({m['predicted_ms']:.0f}, {m['step_error']:+.0%}{two})"
                                 f" | {m['mb_per_step']:.2f} ({m['formula_mb']:.2f}, {m['bytes_error']:+.1%}"
                                 + (f"; resent {m['resent_mb_per_step']:.2f}" if m.get("resent_mb_per_step", 0) >= 0.01
                                    else "") + ")")
            lines.append(f"    {mode:<12} " + "; ".join(cells))
        busy = [(n, report["table"].get(f"{n}x{rate}", {}).get("testbed_cpu_busy")) for n in cfg["hosts"]]
        if any(b is not None for _, b in busy):
            lines.append("    the bridge alone (every host sending to the next at the rate, no rank running): "
                         + ", ".join(f"{n} hosts {b:.0%}" for n, b in busy if b is not None) + " of this machine's CPU")
    one = report.get("one_host")
    if one:
        lines.append(f"  one host, {one['ranks']} Gloo ranks: measured ms (plan's from the group's probe, error): "
                     + "; ".join(f"{k} {r['ms']:.0f} ({r['predicted_ms']:.0f}, {r['error']:+.0%})"
                                 for k, r in one["rows"].items()))
    lines += target_lines(report["targets"])
    return "\n".join(lines)


def write_growth_chart(report: dict[str, Any], path: Path) -> str | None:
    """Measured (markers) and predicted (lines) step time against hosts, a panel per rate."""
    from .report import pyplot

    plt = pyplot()
    if plt is None:
        return "no chart: pip install 'fastreduce[plot]'"
    cfg = report["config"]
    fig, axes = plt.subplots(1, len(cfg["rates"]), figsize=(6.5 * len(cfg["rates"]), 4.8), squeeze=False)
    colors = plt.get_cmap("tab10").colors
    for ax, rate in zip(axes[0], cfg["rates"]):
        for k, mode in enumerate(PLAN_MODES):
            pts = [(n, report["table"][f"{n}x{rate}"]["modes"][mode]) for n in cfg["hosts"]
                   if mode in report["table"].get(f"{n}x{rate}", {}).get("modes", {})]
            if not pts:
                continue
            ax.plot([n for n, _ in pts], [m["predicted_ms"] for _, m in pts], color=colors[k % 10], alpha=0.7)
            ax.plot([n for n, _ in pts], [m["ms_per_step"] for _, m in pts], "os^Dv<>p"[k % 8],
                    color=colors[k % 10], linestyle="none", label=mode)
        ax.set(xscale="log", yscale="log", xlabel="hosts (1 rank each)", ylabel="ms per step",
               title=f"{rate}: measured (markers), fastreduce plan (lines)")
        ax.set_xticks(cfg["hosts"], [str(n) for n in cfg["hosts"]])
        ax.grid(True, which="both", alpha=0.3)
    axes[0][-1].legend(fontsize=7, loc="upper left")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return None


if __name__ == "__main__":
    from .network import worker_main

    worker_main(GrowthConfig, worker)
