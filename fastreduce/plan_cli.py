"""``fastreduce plan``: what each data-parallel mode will cost on a cluster (:mod:`fastreduce.plan`).

    fastreduce plan --params 7e9 --ranks 1024 --gpus-per-host 8 --link 100gbit \\
        [--latency 20us] [--backward-ms 900] [--json]
    torchrun --nproc-per-node 8 --nnodes 2 ... -m fastreduce plan --probe --params 7e9 --ranks 1024

prints, per mode and wire, the payload each host sends on its link per step, the predicted
time on the wire and exposed per step, the step, the memory per GPU, and a recommendation
with its reason. ``--probe``, on a live group (torchrun's environment), measures the link
first: the group's all-reduce (as ``bucket_mb="auto"`` probes it), turned back into the host
link and latency of the model, then priced at ``--ranks`` (default: the group's size). Only
rank 0 prints.

Every setting is checked against its range (:data:`fastreduce.plan.LIMITS`) as it is parsed:
an argparse error that names the option, the value and the range. Settings that only clash
with each other (a world size that is not a whole number of hosts) are refused as the plan
is made, with the same exit status (2).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import textwrap
from typing import Any, Callable

from .plan import LIMITS, TCP_PAYLOAD, Bounds, Cluster, Link, Plan, Workload, parse_bytes, parse_rate, parse_seconds, \
    plan, selected

__all__ = ["DEFAULT_GPUS_PER_HOST", "add_arguments", "format_sweep", "format_text", "pyplot", "run"]

TOKENS, FLOPS = 2048, 1e14
"""Without --backward-ms: 2048 tokens a rank and step at 100 TFLOP/s (a backward's FLOPs: 4 x params a token)."""
DEFAULT_GPUS_PER_HOST = 8
"""Without --gpus-per-host: the 8 accelerators of most training servers (DGX/HGX, Gaudi, MI300X platforms)."""
MS = Bounds("a time in milliseconds", 0.0, 86_400_000.0, "above 0 and at most 86400000 (a day)", above=True)

DESCRIPTION = (
    "What each data-parallel mode will cost on a cluster, before it runs: per mode and gradient wire, "
    "the megabytes each host sends on its network link per step, the time on the wire and the part of it the "
    "compute does not hide, the step time, the memory per GPU, and which mode to use and why. Give the model "
    "(--params), the cluster (--ranks, --gpus-per-host, --link) and, if you know it, one backward's time "
    "(--backward-ms); or run it under torchrun with --probe to measure the link.")
EPILOG = """\
examples:
  fastreduce plan --params 7e9 --ranks 1024 --gpus-per-host 8 --link 100gbit
  fastreduce plan --params 1b --ranks 8,64,1024 --link 1gbit --latency 100us
  torchrun --nnodes 2 --nproc-per-node 8 ... -m fastreduce plan --probe --params 7e9 --ranks 1024

The model (alpha-beta costs over a hierarchical ring, communication taking no compute)
and its assumptions: docs/scale.md."""


def _argument(convert: Callable[[str], Any]) -> Callable[[str], Any]:
    """``convert`` as an argparse type: its ValueError becomes argparse's error, word for word."""
    def parse(text: str) -> Any:
        try:
            return convert(text)
        except ValueError as e:
            raise argparse.ArgumentTypeError(str(e)) from None
    parse.__name__ = convert.__name__
    return parse


def _number(text: str, bounds: Bounds) -> float:
    try:
        value = float(text)
    except ValueError:
        raise ValueError(f"{bounds.what} must be {bounds.text}, got {text!r}") from None
    return bounds.check(value, text)


def _whole(text: str, bounds: Bounds) -> int:
    return int(_number(text, bounds))


def _parsed(text: str, parse: Callable[[str], float], bounds: Bounds, form: str) -> float:
    """``parse(text)`` in ``bounds``; one error for a value out of range and for one not understood."""
    try:
        value = parse(text)
    except ValueError:
        raise ValueError(f"{bounds.what} must be {bounds.text}, written like {form}, got {text!r}") from None
    return bounds.check(value, text)


@_argument
def params(text: str) -> float:
    return _parsed(text, parse_bytes, LIMITS["params"], "7e9, 7b or 125m")


@_argument
def world_sizes(text: str) -> list[int]:
    """``8,64,1024`` -> ``[8, 64, 1024]``."""
    sizes = [_whole(n.strip(), LIMITS["ranks"]) for n in str(text).split(",") if n.strip()]
    if not sizes:
        raise ValueError(f"the world size must be one or more numbers like 1024 or 8,64,1024, got {text!r}")
    return sizes


@_argument
def per_host(text: str) -> int:
    return _whole(text, LIMITS["ranks_per_host"])


@_argument
def rate(text: str) -> float:
    return _parsed(text, parse_rate, LIMITS["rate"], "100gbit or 100mbit (or in bytes: 10gbps)")


@_argument
def latency(text: str) -> float:
    return _parsed(text, parse_seconds, LIMITS["latency"], "20us, 1.5ms or 0s")


@_argument
def mtu(text: str) -> int:
    return _whole(text, LIMITS["mtu"])


@_argument
def milliseconds(text: str) -> float:
    return _number(text, MS)


@_argument
def chart(text: str) -> str:
    folder = os.path.dirname(os.path.abspath(text))
    if not os.path.isdir(folder):
        raise ValueError(f"the chart's folder must exist, got {text!r} ({folder} is not a folder)")
    return text


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.description = textwrap.fill(DESCRIPTION, 79)
    parser.epilog = EPILOG
    parser.formatter_class = argparse.RawDescriptionHelpFormatter
    parser.usage = "%(prog)s --params N (--ranks N[,N...] --link RATE | --probe) [options]"
    add = parser.add_argument
    add("--params", required=True, metavar="N", type=params,
        help="the model's parameter count: 7e9, 7b, 125m (1 to 1e15)")
    add("--ranks", default=None, metavar="N[,N...]", type=world_sizes,
        help="the world size: ranks in all, one per GPU (1 to 1,000,000); several, comma-separated, print each "
             "mode's step against the world size. Required unless --probe (then: the live group's size)")
    add("--gpus-per-host", "--ranks-per-host", dest="gpus_per_host", type=per_host, default=None, metavar="N",
        help="GPUs (or other accelerators: one rank each) on each host, sharing its link (1 to 1,024). "
             f"Default: {DEFAULT_GPUS_PER_HOST}, as on most training servers; 1 for one rank a host; with --probe, "
             "the group's LOCAL_WORLD_SIZE. A world smaller than a host is one host")
    add("--link", default=None, metavar="RATE", type=rate,
        help="each host's network link in bits per second, all its NICs together: 100gbit, 400gbit, 1gbit, "
             "100mbit (1mbit to 100tbit). Required unless --probe")
    add("--latency", default="20us", metavar="TIME", type=latency,
        help="one message's latency between hosts: 20us, 1ms (0 to 1s; default: 20us)")
    add("--intra-link", default="1tbit", metavar="RATE", type=rate,
        help="the link between the GPUs of one host (1mbit to 100tbit; default: 1tbit, NVLink or Gaudi class; "
             "about 100gbit for PCIe, and for CPU ranks' shared memory)")
    add("--intra-latency", default="5us", metavar="TIME", type=latency,
        help="its latency (0 to 1s; default: 5us)")
    add("--mtu", type=mtu, default=1500, metavar="BYTES",
        help="the host link's MTU, which sets how much of its rate is TCP payload (68 to 65536; default: 1500; "
             "9000 with jumbo frames)")
    add("--backward-ms", type=milliseconds, default=None, metavar="MS",
        help="one backward pass, in milliseconds (above 0, at most a day). Default: its 4 x params x 2,048 "
             "FLOPs (2,048 tokens per GPU) at 100 TFLOP/s")
    add("--forward-ms", type=milliseconds, default=None, metavar="MS",
        help="one forward pass, in milliseconds (default: half the backward)")
    add("--step-ms", type=milliseconds, default=None, metavar="MS",
        help="one whole step without communication, in milliseconds: forward + backward + optimizer (at least "
             "the backward; instead of --forward-ms)")
    add("--grad-dtype", choices=("fp32", "bf16"), default="fp32",
        help="the gradients' dtype, what DDP sends (default: fp32)")
    add("--modes", default=None, metavar="NAME,NAME",
        help="only these rows (names or kinds: ddp, fused, overlapped, zero, gossip, localsgd, diloco, "
             "streaming_diloco)")
    add("--probe", action="store_true", help="on a live group (under torchrun): measure the link first")
    add("--chart", default=None, metavar="PNG", type=chart,
        help="with several --ranks: each mode's step against the world size, drawn to this PNG file (needs "
             "matplotlib: the plot extra)")
    add("--json", action="store_true", help="one JSON object on stdout and nothing else")


def workload(args: argparse.Namespace) -> Workload:
    backward = args.backward_ms / 1e3 if args.backward_ms else 4 * args.params * TOKENS / FLOPS
    forward = args.forward_ms / 1e3 if args.forward_ms else None
    if args.step_ms is not None:
        if args.forward_ms is not None:
            raise ValueError("give --forward-ms or --step-ms, not both (--step-ms is forward + backward + optimizer)")
        forward = args.step_ms / 1e3 - backward
        if forward < 0:
            raise ValueError(f"--step-ms {args.step_ms:g} is shorter than the backward ({backward * 1e3:g} ms): "
                             "a step without communication is forward + backward + optimizer")
    return Workload(params=args.params, backward_s=backward, forward_s=forward,
                    grad_bytes=4.0 if args.grad_dtype == "fp32" else 2.0)


def hosts_of(args: argparse.Namespace, ranks: int, default: int) -> int:
    """The ranks a host for a world of ``ranks``: --gpus-per-host (or ``default``), or the whole world
    where it is smaller than one host."""
    given = args.gpus_per_host or default
    per = min(given, ranks)
    if ranks % per:
        said = "" if args.gpus_per_host else f", {given} when not given"
        raise ValueError(f"--ranks {ranks} is not a whole number of hosts of {given} GPUs: set --gpus-per-host to a "
                         f"divisor of {ranks} (1 for one rank a host{said})")
    return per


def cluster(args: argparse.Namespace, probed: Cluster | None = None, ranks: int | None = None) -> Cluster:
    intra = Link.of(args.intra_link, args.intra_latency, mtu=None)  # NVLink, PCIe, shared memory: no TCP framing
    if probed is not None:
        n = ranks or probed.ranks
        link = Link.of(args.link, args.latency, args.mtu) if args.link else probed.link
        return Cluster(n, link, hosts_of(args, n, probed.ranks_per_host), probed.intra if probed.hosts == 1 else intra)
    if ranks is None or args.link is None:
        raise ValueError("fastreduce plan needs --ranks and --link (or --probe on a live group)")
    return Cluster(ranks, Link.of(args.link, args.latency, args.mtu), hosts_of(args, ranks, DEFAULT_GPUS_PER_HOST),
                   intra)


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
                              Link.of(args.intra_link, args.intra_latency, mtu=None))


# ============================================================== the report

def _count(n: float) -> str:
    """7e9 -> 7B, 125e6 -> 125M, 1e15 -> 1000T."""
    for scale, unit in ((1e12, "T"), (1e9, "B"), (1e6, "M"), (1e3, "K")):
        if n >= scale:
            return f"{n / scale:.4g}{unit}"
    return f"{n:g}"


def _bits(per_s: float) -> str:
    for scale, unit in ((1e12, "Tbit/s"), (1e9, "Gbit/s"), (1e6, "Mbit/s")):
        if per_s >= scale:
            return f"{per_s / scale:.3g} {unit}"
    return f"{per_s:.3g} bit/s"


def _fixed(x: float, digits: int = 1) -> str:
    """A column's number: fixed point up to a million, then 4 significant digits."""
    return f"{x:.{digits}f}" if abs(x) < 1e6 else f"{x:.4g}"


def _hosts(c: Cluster) -> str:
    """``1,024 ranks: 128 hosts of 8 GPUs``."""
    gpus = "GPU" if c.ranks_per_host == 1 else "GPUs"
    hosts = "host" if c.hosts == 1 else "hosts"
    return f"{c.ranks:,} rank{'s' if c.ranks > 1 else ''}: {c.hosts:,} {hosts} of {c.ranks_per_host} {gpus}"


def setting_lines(c: Cluster, w: Workload, setting: dict[str, Any] | None = None) -> list[str]:
    """The link and the compute, as the plan took them (``setting``: the command's own words for them)."""
    s = setting or {}
    if s.get("link_measured"):
        link = f"the host link {_bits(c.link.bytes_per_s * 8)} of payload, {c.link.latency_s * 1e6:.3g} us (measured)"
    elif "rate" in s:
        link = (f"each host's link {_bits(s['rate'])} ({_bits(c.link.bytes_per_s * 8)} of TCP payload at MTU "
                f"{s['mtu']}), {c.link.latency_s * 1e6:.3g} us")
    else:
        link = f"each host's link {_bits(c.link.bytes_per_s * 8)} of payload, {c.link.latency_s * 1e6:.3g} us"
    within = f"; within a host {_bits(c.intra.bytes_per_s * 8)}, {c.intra.latency_s * 1e6:.3g} us" \
        if c.ranks_per_host > 1 else ""
    source = "" if s.get("backward_given", True) else \
        f"; the backward: 4 x params x {TOKENS:,} tokens of FLOPs at {FLOPS / 1e12:g} TFLOP/s, --backward-ms sets it"
    forward = "forward and optimizer" if s.get("step_given") else "forward"
    optimizer = f", optimizer {w.optimizer_s * 1e3:,.0f} ms" if w.optimizer_s else ""
    return [f"  link: {link}{within}",
            f"  compute: {w.compute_s * 1e3:,.0f} ms a step without communication ({forward} "
            f"{w.forward * 1e3:,.0f} ms, backward {w.backward_s * 1e3:,.0f} ms{optimizer}{source})"]


COLUMNS = [("", "mode", 22), ("host link", "MB per step", 12), ("on the wire", "ms per step", 12),
           ("exposed", "ms per step", 12), ("step", "ms", 12), ("step", "vs ddp", 7), ("memory", "GiB per GPU", 12)]


def format_text(p: Plan, setting: dict[str, Any] | None = None) -> str:
    c, w = p.cluster, p.workload
    assumed = f" ({DEFAULT_GPUS_PER_HOST} a host assumed: --gpus-per-host sets it)" \
        if (setting or {}).get("per_host_assumed") else ""
    lines = [f"fastreduce plan: {_hosts(c)}{assumed}; {_count(w.params)} parameters", *setting_lines(c, w, setting),
             " ".join(f"{top:<{n}}" if k == 0 else f"{top:>{n}}" for k, (top, _, n) in enumerate(COLUMNS)),
             " ".join(f"{low:<{n}}" if k == 0 else f"{low:>{n}}" for k, (_, low, n) in enumerate(COLUMNS)) + "  note"]
    ddp = next((r.step_s for r in p.rows if r.mode == "ddp"), None)
    for r in p.rows:
        vs = f"{r.step_s / ddp:.2f}x" if ddp else "-"
        cells = [_fixed(r.host_bytes_per_step / 2**20), _fixed(r.comm_s * 1e3), _fixed(r.exposed_s * 1e3),
                 _fixed(r.step_s * 1e3), vs, _fixed(r.memory_bytes / 2**30, 2)]
        lines.append(f"{r.mode:<22} " + " ".join(f"{v:>{n}}" for v, (_, _, n) in zip(cells, COLUMNS[1:])) +
                     f"  {'' if r.exact else '(changes the arithmetic) '}{r.note}".rstrip())
    rec = p.recommendation
    lines.append(f"recommended: {rec['mode']}: {rec['reason']}")
    share = f" (its {c.ranks_per_host} GPUs together; each GPU's share is 1/{c.ranks_per_host})" \
        if c.ranks_per_host > 1 else ""
    lines += textwrap.wrap(
        f"host link MB: the payload each host sends on its link a step{share}; on the wire: the communication's "
        "time a step; exposed: the part of it the compute does not hide (for localsgd and diloco, both averaged "
        "over their H steps); memory: weights, gradients, AdamW's state and the mode's buffers on each GPU. "
        "Model: alpha-beta over a hierarchical ring, communication taking no compute (docs/scale.md)", 119)
    return "\n".join(lines)


def format_sweep(plans: list[Plan], setting: dict[str, Any] | None = None) -> str:
    """Each mode's step (ms) against the world size, one column a size."""
    first = plans[0]
    c, w = first.cluster, first.workload
    per = max(p.cluster.ranks_per_host for p in plans)
    assumed = " (assumed: --gpus-per-host sets it)" if (setting or {}).get("per_host_assumed") else ""
    lines = [f"fastreduce plan: {_count(w.params)} parameters on hosts of {per} GPUs{assumed}; step (ms) at each "
             "world size", *setting_lines(c, w, setting),
             f"{'ranks':<22}" + "".join(f"{p.cluster.ranks:>12,}" for p in plans),
             f"{'hosts x GPUs':<22}" + "".join(f"{f'{p.cluster.hosts:,}x{p.cluster.ranks_per_host}':>12}"
                                               for p in plans)]
    for k, row in enumerate(first.rows):
        lines.append(f"{row.mode:<22}" + "".join(f"{_fixed(p.rows[k].step_s * 1e3, 0):>12}" for p in plans))
    lines.append("recommended: " + "; ".join(f"{p.cluster.ranks:,} ranks: {p.recommendation['mode']}" for p in plans))
    return "\n".join(lines)


def pyplot() -> Any | None:
    """``matplotlib.pyplot`` drawing to files (the Agg backend), or ``None`` without matplotlib."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    return plt


def write_sweep_chart(plans: list[Plan], path: str) -> str | None:
    """Each mode's predicted step against the world size (log-log); a note instead without matplotlib."""
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
           title=f"{_count(w.params)} params, {_bits(c.link.bytes_per_s * 8)} links (payload), "
                 f"{c.ranks_per_host} GPUs a host")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=6, ncol=2)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return None


def _setting(args: argparse.Namespace, probed: Cluster | None) -> dict[str, Any]:
    """What the report says of the settings: as given, assumed or measured."""
    out: dict[str, Any] = {"link_measured": probed is not None and args.link is None,
                           "per_host_assumed": args.gpus_per_host is None and probed is None,
                           "backward_given": args.backward_ms is not None, "step_given": args.step_ms is not None}
    if args.link is not None:
        out.update(rate=args.link, mtu=args.mtu, payload_share=TCP_PAYLOAD(args.mtu))
    return out


def _finite(value: Any) -> Any:
    """JSON has no infinity: an infinite bandwidth (a link that costs only its latency) as null."""
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_finite(v) for v in value]
    return None if isinstance(value, float) and not math.isfinite(value) else value


def run(args: argparse.Namespace) -> int:
    only = args.modes.split(",") if args.modes else None  # (names stripped, each one checked: plan.selected)
    work = workload(args)
    if not args.probe and (args.ranks is None or args.link is None):
        raise ValueError("fastreduce plan needs --ranks and --link (or --probe on a live group)")
    if only is not None:
        selected(only)  # a name that matches no mode refused before a probe
    probed = probe(args) if args.probe else None
    plans = [plan(cluster(args, probed, n), work, only) for n in (args.ranks or [None])]
    if probed is not None:
        import torch.distributed as dist

        from .lifecycle import shutdown

        rank = dist.get_rank()
        shutdown()  # (a Gloo thread still to let go of the last work: exit_quiet's note; 1 run in 5 hung on torch 2.6)
        dist.destroy_process_group()
        if rank:
            return 0
    out = getattr(args, "stdout", sys.stdout)
    note = write_sweep_chart(plans, args.chart) if args.chart else None
    if note:
        print(f"fastreduce plan: {note}", file=sys.stderr)
    setting = _setting(args, probed)
    if args.json:
        body = plans[0].to_json() if len(plans) == 1 else {"plans": [p.to_json() for p in plans]}
        print(json.dumps(_finite({**body, "setting": setting, "probed": probed is not None})), file=out, flush=True)
    else:
        print(format_text(plans[0], setting) if len(plans) == 1 else format_sweep(plans, setting), file=out,
              flush=True)
    return 0
