"""What each data-parallel mode will cost on a cluster, before it runs: the cost model
behind ``fastreduce plan`` and ``bucket_mb="auto"``. Pure Python: no torch at import.

**The link** (:class:`Link`): a message of ``n`` bytes takes ``latency + n / bandwidth``.
``bandwidth`` is what one host can send per second as payload: a rate in bits per second
(``--link 100gbit``) carries ``(MTU - 52) / (MTU + 14)`` of it as payload over TCP on
Ethernet (:data:`TCP_PAYLOAD`; 0.956 at MTU 1500); measured (``--probe``,
:meth:`Cluster.from_probe`), it is what the group's all-reduce moved. The plan's bytes
are payload; on the wire each 1448 bytes of it travel in a 1514-byte frame
(:func:`on_the_wire`). An interface's counter reads the wire's bytes where the packets are
cut to the MTU before it, and fewer where they are not (segmentation offload: one set of
headers per 64 KB; 0.3% over the payload on the namespace hosts at 1 Gbit/s, where
``tbf`` passes them whole, and the wire's bytes at 100 Mbit/s, where it cuts them).

**The collectives** (:class:`Cluster`), ``N`` ranks on ``H = N / R`` hosts of ``R`` ranks:
a hierarchical ring (the bandwidth-optimal algorithm of the collectives' papers: NCCL's and
Gloo's rings move these bytes). An all-reduce of ``n`` bytes is a reduce-scatter and an
all-gather; within a host it moves ``2 (R-1)/R n`` over the intra-host link, across hosts
``2 (H-1)/H n`` leave each host over its link (the ``R`` ranks' shards share it), in
``R - 1`` latency-bound rounds per half within a host and ``k = min(H - 1, ceil(log2 H))``
across (the ring's hops, or a tree's where fewer: NCCL's tuner picks trees at scale; Gloo,
at the 2 to 16 hosts measured, runs the ring, and the two differ there by under a
millisecond)::

    all_reduce(n) = 2 (R-1) a_intra + 2 (R-1)/R n / B_intra + 2 k a + 2 (H-1)/H n / B

(a reduce-scatter or an all-gather alone: half of it). With one rank a host this is the
flat ring, ``2 (N-1)/N`` of the buffer sent by every rank. Gossip's exchange sends the
buffer to its peers point to point; a round whose peer is on the same host (``one-peer-exp``
pairs ranks ``2^k`` apart) uses the intra-host link.

**The step** (:func:`estimate`): ``compute + exposed``, where ``compute`` is one step
without communication (forward + backward + optimizer: measured by the user, or the
backward given and the forward taken as half of it) and ``exposed`` the communication left
after the compute it overlaps:

* ``fused``: one all-reduce after backward, all exposed;
* ``ddp``: torch's buckets (the first 1 MB, the rest 25 MB) started as backward fills them,
  each after the one before (:func:`bucketed_exposed`);
* ``overlapped``: the buckets ``bucket_mb="auto"`` chooses (:func:`choose`, the same
  function the runtime calls with the link it probed);
* ``zero``: the reduce-scatter overlapped with backward as ``overlapped``'s buckets, the
  all-gather of the updated parameters with the next forward (:func:`gathered_exposed`),
  the optimizer stepping ``1/N`` of the parameters;
* ``gossip``: a bucket's exchange has the next forward and backward to finish; its
  optimizer step is not cover, since it runs between one exchange's end and the next's
  launch (the mix applied, then the step, then the new parameters sent);
* ``localsgd`` / ``diloco``: a blocking all-reduce every ``H`` steps (fp32 parameters for
  LocalSGD, the pseudo-gradients on DiLoCo's wire), ``1/H`` of it per step; streaming
  DiLoCo's ``F`` fragments each have ``delay`` steps of compute to hide in.

Every bucketed sum above is in closed form (a run of equal buckets contributes at its two
ends only), so a plan costs the same at a million parameters and at a quadrillion.

**The settings' ranges** (:data:`LIMITS`, checked by :class:`Link`, :class:`Cluster`,
:class:`Workload` and ``fastreduce plan`` alike): 1 to 1e15 parameters, 1 to 1,000,000 ranks,
1 to 1,024 ranks a host, links of 1 Mbit/s to 100 Tbit/s, latencies of 0 to 1 s, an MTU of
68 (IPv4's smallest) to 65,536 bytes (a loopback's), compute times above 0 and at most a day.

Communication is assumed to take no compute from the step (true of accelerators with
their own DMA; on CPU ranks the collective's reduction runs on the cores the backward
runs on). Nothing here is fitted from a benchmark's results: the inputs are the link (a
rate, or measured: ``fastreduce plan --probe``), the model's size and one step's compute.

The pieces: :mod:`.plan_inputs` (the ranges, the units), :mod:`.plan_links` (the link, the
collectives), :mod:`.plan_overlap` (the closed forms, ``bucket_mb="auto"``); this module
prices the modes and recommends one.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any, Iterable

from .plan_inputs import LIMITS, MB, Bounds, parse_bytes, parse_rate, parse_seconds
from .plan_links import MTU, TCP_PAYLOAD, Cluster, Link, on_the_wire
from .plan_overlap import Sizing, bucketed_exposed, choose, gathered_exposed

__all__ = ["DDP_BUCKET_MB", "DDP_FIRST_BUCKET_MB", "LIMITS", "MB", "MTU", "TCP_PAYLOAD", "WIRE_BYTES", "Bounds",
           "Cluster", "Estimate", "Link", "Mode", "Plan", "Sizing", "Workload", "bucketed_exposed", "choose",
           "estimate", "gathered_exposed", "modes", "on_the_wire", "parse_bytes", "parse_rate", "parse_seconds", "plan",
           "recommend", "selected"]

BLOCK_SCALE = 4 / 256
"""A quantized wire's fp32 scale per block of 256 values (:class:`~fastreduce.codecs.quant.BlockQuant`)."""
WIRE_BYTES = {"fp32": 4.0, "bf16": 2.0, "fp16": 2.0, "fp8": 1 + BLOCK_SCALE, "int8": 1 + BLOCK_SCALE,
              "int4": 0.5 + BLOCK_SCALE}
"""Bytes on the wire per gradient value, the quantized wires' scales included."""
DDP_FIRST_BUCKET_MB, DDP_BUCKET_MB = 1.0, 25.0
"""``DistributedDataParallel``'s defaults: ``bucket_cap_mb=25``, the first bucket 1 MB."""


# ============================================================== the modes

@dataclass(frozen=True)
class Mode:
    """A data-parallel mode as the plan prices it."""

    name: str           # the row's name: mode_wire[_H<h>]
    kind: str           # ddp, fused, overlapped, zero, gossip, localsgd, diloco, streaming_diloco
    wire: str = "fp32"
    every: int = 1      # H: the local-update modes' steps between syncs
    fragments: int = 1  # streaming DiLoCo
    delay: int = 0      # streaming DiLoCo: steps a fragment's exchange may take

    @property
    def exact(self) -> bool:
        """Trains as DDP does (to rounding): the mean gradient every step, on an fp32 wire."""
        return self.kind in ("ddp", "fused", "overlapped", "zero") and self.wire == "fp32"


def modes() -> list[Mode]:
    """The rows ``fastreduce plan`` prices, in the order it prints them."""
    out = [Mode("ddp", "ddp")]
    out += [Mode(f"fused_{w}", "fused", w) for w in ("fp32", "bf16", "fp8", "int8")]
    out += [Mode(f"overlapped_{w}", "overlapped", w) for w in ("fp32", "bf16")]
    out += [Mode(f"zero_{w}", "zero", w) for w in ("fp32", "bf16")]
    out += [Mode(f"gossip_{w}", "gossip", w) for w in ("fp32", "bf16")]
    out += [Mode("localsgd_H8", "localsgd", every=8), Mode("diloco_H8", "diloco", "bf16", every=8),
            Mode("diloco_H32_int4", "diloco", "int4", every=32),
            Mode("streaming_diloco_H32", "streaming_diloco", "bf16", every=32, fragments=4, delay=7)]
    return out


@dataclass(frozen=True)
class Workload:
    """The model: ``params`` values (fp32 gradients), and one step's compute without communication."""

    params: float
    backward_s: float
    forward_s: float | None = None  # default: half the backward
    optimizer_s: float = 0.0
    grad_bytes: float = 4.0         # what DDP's buckets and the fp32 wires carry per value
    param_bytes: float = 4.0

    def __post_init__(self) -> None:
        LIMITS["params"].check(self.params)
        LIMITS["backward_s"].check(self.backward_s)
        for name in ("forward_s", "optimizer_s"):
            if getattr(self, name) is not None:
                LIMITS["seconds"].check(getattr(self, name))
        LIMITS["value_bytes"].check(self.grad_bytes)
        LIMITS["value_bytes"].check(self.param_bytes)

    @property
    def forward(self) -> float:
        return self.backward_s / 2 if self.forward_s is None else self.forward_s

    @property
    def compute_s(self) -> float:
        return self.forward + self.backward_s + self.optimizer_s


@dataclass
class Estimate:
    """One mode's row, per step (the local modes' averaged over their H steps): the payload
    bytes one rank sends on its host's link (``bytes_per_step``: its share) and that the host
    sends on it in all (``host_bytes_per_step``: the ranks of a host together), seconds on the
    wire and exposed, the step; and the memory of one rank."""

    mode: str
    wire: str
    exact: bool
    bytes_per_step: float
    host_bytes_per_step: float
    comm_s: float
    exposed_s: float
    step_s: float
    memory_bytes: float
    note: str = ""


def _memory(mode: Mode, w: Workload, n: int) -> float:
    """Bytes per rank of parameters, gradients, AdamW's state and the mode's own buffers."""
    p = w.params
    weights, grads, adam = p * w.param_bytes, p * w.grad_bytes, 8 * p
    wire = p * WIRE_BYTES[mode.wire]
    if mode.kind == "zero":
        return weights + grads + adam / n + (wire / n if mode.wire != "fp32" else 0)
    extra = {"ddp": grads, "fused": wire, "overlapped": wire, "gossip": 2 * wire, "localsgd": 0.0,
             "diloco": 2 * weights + wire, "streaming_diloco": 2 * weights + wire / mode.fragments}[mode.kind]
    return weights + grads + adam + extra


def estimate(mode: Mode, cluster: Cluster, w: Workload) -> Estimate:
    """``mode``'s row on ``cluster`` for workload ``w`` (see the module doc for the model)."""
    c, wire = cluster, WIRE_BYTES[mode.wire]
    grads = w.params * (w.grad_bytes if mode.kind == "ddp" else wire)
    ar = c.as_link("all_reduce")
    note = ""
    if mode.kind in ("ddp", "fused", "overlapped"):
        comm, sent = c.all_reduce(grads), c.ring_bytes(grads)
        if mode.kind == "fused":
            exposed = comm
        elif mode.kind == "ddp":
            exposed = bucketed_exposed(grads, w.backward_s, ar, DDP_FIRST_BUCKET_MB * MB, DDP_BUCKET_MB * MB)[0]
        else:
            sizing = choose(grads, w.backward_s, ar)
            exposed = sizing.exposed_s or 0.0
            note = sizing.describe().split(" (")[0].replace("bucket_mb='auto': ", "auto: ")
    elif mode.kind == "zero":
        params = w.params * w.param_bytes
        comm = c.reduce_scatter(grads) + c.all_gather(params)
        sent = (c.ring_bytes(grads) + c.ring_bytes(params)) / 2
        sizing = choose(grads, w.backward_s, c.as_link("reduce_scatter"))
        per_bucket = sizing.bucket_mb * MB * w.param_bytes / wire  # the same parameters, gathered in their dtype
        exposed = (sizing.exposed_s or 0.0) + gathered_exposed(params, w.forward, c.as_link("all_gather"), per_bucket)
        note = sizing.describe().split(" (")[0].replace("bucket_mb='auto': ", "auto: ")
    elif mode.kind == "gossip":
        comm, sent = c.exchange(grads)
        exposed = max(0.0, comm - w.forward - w.backward_s)  # the optimizer waits for the exchange
        note = "one-peer-exp: one peer a round"
    else:
        nbytes = w.params * (w.param_bytes if mode.kind == "localsgd" else wire)
        sync = c.all_reduce(nbytes / mode.fragments)
        comm, sent = mode.fragments * sync / mode.every, c.ring_bytes(nbytes) / mode.every
        exposed = mode.fragments * max(0.0, sync - mode.delay * w.compute_s) / mode.every
        note = f"a sync every {mode.every} steps" + (f", {mode.fragments} fragments, delay {mode.delay}"
                                                     if mode.fragments > 1 else "")
    compute = w.compute_s - (w.optimizer_s * (1 - 1 / c.ranks) if mode.kind == "zero" else 0.0)
    return Estimate(mode.name, mode.wire, mode.exact, sent, sent * c.ranks_per_host, comm, exposed, compute + exposed,
                    _memory(mode, w, c.ranks), note)


# ============================================================== the plan

@dataclass
class Plan:
    cluster: Cluster
    workload: Workload
    rows: list[Estimate]
    recommendation: dict[str, str]

    def to_json(self) -> dict[str, Any]:
        return {"cluster": {**asdict(self.cluster), "hosts": self.cluster.hosts},
                "workload": {**asdict(self.workload), "compute_s": self.workload.compute_s},
                "rows": [asdict(r) for r in self.rows], "recommendation": self.recommendation,
                "model": "alpha-beta, hierarchical ring (fastreduce/plan.py)"}


def recommend(rows: Iterable[Estimate], compute_s: float) -> dict[str, str]:
    """The exact mode with the shortest step (ZeRO where it is within 5% of it, for its
    memory); where even that leaves over a tenth of the step on the wire, the fastest
    mode that changes the arithmetic, named with what to check."""
    rows = list(rows)
    exact = [r for r in rows if r.exact]
    best = min(exact, key=lambda r: r.step_s)
    zero = next((r for r in exact if r.mode.startswith("zero")), None)
    if zero is not None and zero.step_s <= 1.05 * best.step_s and zero is not best:
        best = zero
        why = (f"within 5% of the fastest exact step ({zero.step_s * 1e3:.0f} ms) with 1/N of AdamW's state "
               f"({zero.memory_bytes / 2**30:.1f} GiB a rank)")
    else:
        why = f"the fastest step that trains as DDP does ({best.step_s * 1e3:.0f} ms)"
    if best.exposed_s <= 0.1 * compute_s:
        return {"mode": best.mode, "reason": why + f"; {best.exposed_s * 1e3:.0f} ms of communication exposed"}
    fastest = min(rows, key=lambda r: r.step_s)
    if fastest.step_s >= 0.9 * best.step_s:
        return {"mode": best.mode, "reason": why + "; nothing that changes the arithmetic saves a tenth"}
    return {"mode": fastest.mode,
            "reason": (f"the exact modes leave {best.exposed_s * 1e3:.0f} ms of communication exposed "
                       f"({best.exposed_s / best.step_s:.0%} of {best.mode}'s step); {fastest.mode} steps in "
                       f"{fastest.step_s * 1e3:.0f} ms ({fastest.step_s / best.step_s:.2f}x) but changes the "
                       "optimization: check its held-out loss against DDP's (docs/compression.md, docs/local.md)"),
            "exact": best.mode}


def selected(only: Iterable[str] | str) -> list[Mode]:
    """The modes ``only`` names, by name or kind (``"zero"``: each ZeRO row), surrounding
    spaces stripped, a string one name; a name that matches no mode is a ``ValueError``
    naming it and listing the names, as is a selection of none."""
    names = {n.strip() for n in ([only] if isinstance(only, str) else only)} - {""}
    known = modes()
    unknown = sorted(n for n in names if not any(n in (m.name, m.kind) for m in known))
    if unknown or not names:
        kinds = ", ".join(dict.fromkeys(m.kind for m in known))
        raise ValueError(f"no mode matches {unknown or 'an empty selection'}; the modes are "
                         f"{', '.join(m.name for m in known)} (or a kind: {kinds})")
    return [m for m in known if m.name in names or m.kind in names]


def plan(cluster: Cluster, workload: Workload, only: Iterable[str] | None = None) -> Plan:
    chosen = modes() if only is None else selected(only)
    rows = [estimate(m, cluster, workload) for m in chosen]
    exact_rows = rows if any(r.exact for r in rows) else \
        [estimate(m, cluster, workload) for m in modes() if m.exact] + rows
    return Plan(cluster, workload, rows, recommend(exact_rows, workload.compute_s))
