"""``fastreduce plan``: what each data-parallel mode will cost on a cluster (:mod:`fastreduce.plan`).

    fastreduce plan --params 7e9 --ranks 1024 --ranks-per-host 8 --link 100gbit \\
        [--latency 20us] [--backward-ms 900] [--json]
    torchrun --nproc-per-node 8 --nnodes 2 ... -m fastreduce plan --probe --params 7e9 --ranks 1024

prints, per mode and wire, the bytes each rank sends on its host's link per step, the
predicted time on the wire and exposed per step, the step, the memory per rank, and a
recommendation with its reason. ``--probe``, on a live group (torchrun's environment),
measures the link first: the group's all-reduce (as ``bucket_mb="auto"`` probes it),
turned back into the host link and latency of the model, then priced at ``--ranks``
(default: the group's size). Only rank 0 prints.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

from .plan import Cluster, Link, Plan, Workload, parse_bytes, plan

__all__ = ["add_arguments", "format_text", "run"]

TOKENS, FLOPS = 2048, 1e14
"""Without --backward-ms: 2048 tokens a rank and step at 100 TFLOP/s (a backward's FLOPs: 4 x params a token)."""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--params", required=True, metavar="N",
                        help="the model's parameters: 7e9, 7b, 125m")
    parser.add_argument("--ranks", default=None, metavar="N[,N...]",
                        help="world size (default: the live group's with --probe; else required); several, "
                             "comma-separated: a table of each mode's step against the world size")
    parser.add_argument("--ranks-per-host", type=int, default=None,
                        help="ranks on each host (default: 1; with --probe, LOCAL_WORLD_SIZE)")
    parser.add_argument("--link", default=None, metavar="RATE",
                        help="each host's link, tc's units: 100gbit, 1gbit, 100mbit (required without --probe)")
    parser.add_argument("--latency", default="20us", metavar="TIME",
                        help="one message's latency on the link (default: 20us)")
    parser.add_argument("--intra-link", default="1tbit", metavar="RATE",
                        help="the link between ranks of one host (default: 1tbit, NVLink- or Gaudi-class; "
                             "about 100gbit for PCIe, and CPU ranks' shared memory)")
    parser.add_argument("--intra-latency", default="5us", metavar="TIME", help="its latency (default: 5us)")
    parser.add_argument("--mtu", type=int, default=1500, help="the link's MTU: the payload share of its bytes "
                                                              "(default: 1500)")
    parser.add_argument("--backward-ms", type=float, default=None,
                        help="one backward's milliseconds (default: its 4 x params x 2048 FLOPs, 2048 tokens a "
                             "rank, at 100 TFLOP/s)")
    parser.add_argument("--forward-ms", type=float, default=None, help="one forward's (default: half the backward)")
    parser.add_argument("--step-ms", type=float, default=None,
                        help="one whole step's without communication (forward + backward + optimizer); "
                             "overrides --forward-ms")
    parser.add_argument("--grad-dtype", choices=("fp32", "bf16"), default="fp32",
                        help="the gradients' dtype, what DDP sends (default: fp32)")
    parser.add_argument("--modes", default=None, metavar="NAME,NAME",
                        help="only these rows (names or kinds: ddp, fused, overlapped, zero, gossip, localsgd, "
                             "diloco, streaming_diloco)")
    parser.add_argument("--probe", action="store_true",
                        help="on a live group (torchrun): measure the link first")
    parser.add_argument("--chart", default=None, metavar="PNG",
                        help="with several --ranks: each mode's step against the world size, drawn to PNG "
                             "(matplotlib, the plot extra)")
    parser.add_argument("--json", action="store_true", help="one JSON object on stdout and nothing else")


def _positive(value: float | None, flag: str) -> None:
    if value is not None and not value > 0:
        raise ValueError(f"{flag} must be positive, got {value}")


def workload(args: argparse.Namespace) -> Workload:
    for flag in ("backward_ms", "forward_ms", "step_ms"):
        _positive(getattr(args, flag), "--" + flag.replace("_", "-"))
    params = parse_bytes(args.params)
    backward = args.backward_ms / 1e3 if args.backward_ms else 4 * params * TOKENS / FLOPS
    forward = args.forward_ms / 1e3 if args.forward_ms else None
    if args.step_ms:
        forward = args.step_ms / 1e3 - backward
        if forward < 0:
            raise ValueError(f"--step-ms ({args.step_ms}) is shorter than the backward ({backward * 1e3:g} ms)")
    return Workload(params=params, backward_s=backward, forward_s=forward,
                    grad_bytes=4.0 if args.grad_dtype == "fp32" else 2.0)


def world_sizes(args: argparse.Namespace) -> list[int]:
    """``--ranks 8,64,1024`` -> ``[8, 64, 1024]`` (``[]``: not given)."""
    if args.ranks is None:
        return []
    try:
        sizes = [int(r) for r in str(args.ranks).split(",") if r.strip()]
    except ValueError:
        raise ValueError(f"--ranks must be world sizes like 1024 or 8,64,1024, got {args.ranks!r}") from None
    if not sizes or any(n < 1 for n in sizes):
        raise ValueError(f"--ranks must be world sizes of at least 1, got {args.ranks!r}")
    return sizes


def cluster(args: argparse.Namespace, probed: Cluster | None = None, ranks: int | None = None) -> Cluster:
    intra = Link.of(args.intra_link, args.intra_latency, args.mtu)
    if probed is not None:
        per_host = args.ranks_per_host or probed.ranks_per_host
        link = Link.of(args.link, args.latency, args.mtu) if args.link else probed.link
        return Cluster(ranks or probed.ranks, link, per_host, probed.intra if probed.hosts == 1 else intra)
    if ranks is None or args.link is None:
        raise ValueError("fastreduce plan needs --ranks and --link (or --probe on a live group)")
    return Cluster(ranks, Link.of(args.link, args.latency, args.mtu), args.ranks_per_host or 1, intra)


def probe(args: argparse.Namespace) -> Cluster:
    """Collective (every rank of the torchrun job): the group's all-reduce measured, as a
    :class:`~fastreduce.plan.Cluster` of its own size (the host link, or with one host the
    intra-host one, solved from it)."""
    import torch.distributed as dist

    from .engine import init_distributed
    from .sizing import agree, measure_link

    device = init_distributed().device
    measured, _ = agree(measure_link(None, device), 0.0, None, device)
    return Cluster.from_probe(measured, dist.get_world_size(), int(os.environ.get("LOCAL_WORLD_SIZE", "1")),
                              Link.of(args.intra_link, args.intra_latency, args.mtu))


def format_text(p: Plan) -> str:
    c, w = p.cluster, p.workload
    gib = 2**30
    lines = [f"fastreduce plan: {w.params / 1e9:g}B parameters on {c.ranks} ranks ({c.hosts} hosts of "
             f"{c.ranks_per_host}); link {c.link.bytes_per_s * 8 / 1e9:.3g} Gbit/s payload, "
             f"{c.link.latency_s * 1e6:.3g} us; within a host {c.intra.bytes_per_s * 8 / 1e9:.3g} Gbit/s; compute "
             f"{w.compute_s * 1e3:.0f} ms a step (backward {w.backward_s * 1e3:.0f} ms)",
             f"{'mode':<22} {'MB/rank/step':>12} {'wire ms':>9} {'exposed ms':>10} {'step ms':>9} "
             f"{'vs ddp':>7} {'GiB/rank':>8}  note"]
    ddp = next((r.step_s for r in p.rows if r.mode == "ddp"), None)
    for r in p.rows:
        vs = f"{r.step_s / ddp:.2f}x" if ddp else "-"
        lines.append(f"{r.mode:<22} {r.bytes_per_step / 2**20:>12.1f} {r.comm_s * 1e3:>9.1f} "
                     f"{r.exposed_s * 1e3:>10.1f} {r.step_s * 1e3:>9.1f} {vs:>7} {r.memory_bytes / gib:>8.2f}  "
                     f"{'' if r.exact else '(changes the arithmetic) '}{r.note}")
    rec = p.recommendation
    lines.append(f"recommended: {rec['mode']}: {rec['reason']}")
    lines.append("model: alpha-beta over a hierarchical ring, communication taking no compute "
                 "(docs/scale.md); bytes are payload on each host's link, memory is weights, gradients, "
                 "AdamW's state and the mode's buffers")
    return "\n".join(lines)


def format_sweep(plans: list[Plan]) -> str:
    """Each mode's step (ms) against the world size, one column a size."""
    first = plans[0]
    c, w = first.cluster, first.workload
    lines = [f"fastreduce plan: {w.params / 1e9:g}B parameters, {c.ranks_per_host} ranks a host, link "
             f"{c.link.bytes_per_s * 8 / 1e9:.3g} Gbit/s payload, {c.link.latency_s * 1e6:.3g} us; compute "
             f"{w.compute_s * 1e3:.0f} ms a step. Step (ms) at each world size:",
             f"{'mode':<22}" + "".join(f"{p.cluster.ranks:>10}" for p in plans)]
    for k, row in enumerate(first.rows):
        lines.append(f"{row.mode:<22}" + "".join(f"{p.rows[k].step_s * 1e3:>10.0f}" for p in plans))
    lines.append("recommended: " + "; ".join(f"{p.cluster.ranks}: {p.recommendation['mode']}" for p in plans))
    return "\n".join(lines)


def write_sweep_chart(plans: list[Plan], path: str) -> str | None:
    """Each mode's predicted step against the world size (log-log); a note instead without matplotlib."""
    from .bench.report import pyplot

    plt = pyplot()
    if plt is None:
        return "no chart: pip install 'fastreduce[plot]'"
    fig, ax = plt.subplots(figsize=(7, 4.8))
    ranks = [p.cluster.ranks for p in plans]
    for k, row in enumerate(plans[0].rows):
        ax.plot(ranks, [p.rows[k].step_s * 1e3 for p in plans], marker="os^Dv<>p"[k % 8],
                linestyle="-" if row.exact else "--", label=row.mode)
    w, c = plans[0].workload, plans[0].cluster
    ax.set(xscale="log", yscale="log", xlabel="ranks", ylabel="predicted ms per step",
           title=f"{w.params / 1e9:g}B params, {c.link.bytes_per_s * 8 / 1e9:.3g} Gbit/s links, "
                 f"{c.ranks_per_host} ranks a host")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=6, ncol=2)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return None


def run(args: argparse.Namespace) -> int:
    only = [m for m in args.modes.split(",") if m] if args.modes else None
    sizes = world_sizes(args)
    work = workload(args)
    probed = probe(args) if args.probe else None
    plans = [plan(cluster(args, probed, n), work, only) for n in (sizes or [None])]
    if probed is not None:
        import torch.distributed as dist

        rank = dist.get_rank()
        dist.destroy_process_group()
        if rank:
            return 0
    out = getattr(args, "stdout", sys.stdout)
    note = write_sweep_chart(plans, args.chart) if args.chart else None
    if note:
        print(f"fastreduce plan: {note}", file=sys.stderr)
    if args.json:
        body = plans[0].to_json() if len(plans) == 1 else {"plans": [p.to_json() for p in plans]}
        print(json.dumps({**body, "probed": probed is not None}), file=out, flush=True)
    else:
        print(format_text(plans[0]) if len(plans) == 1 else format_sweep(plans), file=out, flush=True)
    return 0
