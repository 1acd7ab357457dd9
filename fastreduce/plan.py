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
"""

from __future__ import annotations

import math
import numbers
import re
from dataclasses import asdict, dataclass, field
from typing import Any, Callable, Iterable

__all__ = ["DDP_BUCKET_MB", "DDP_FIRST_BUCKET_MB", "LIMITS", "MB", "TCP_PAYLOAD", "WIRE_BYTES", "Bounds", "Cluster",
           "Estimate", "Link", "Mode", "Plan", "Sizing", "Workload", "bucketed_exposed", "choose", "estimate",
           "gathered_exposed", "modes", "on_the_wire", "parse_bytes", "parse_rate", "parse_seconds", "plan",
           "recommend"]

MB = 2**20
BLOCK_SCALE = 4 / 256
"""A quantized wire's fp32 scale per block of 256 values (:class:`~fastreduce.codecs.quant.BlockQuant`)."""
WIRE_BYTES = {"fp32": 4.0, "bf16": 2.0, "fp16": 2.0, "fp8": 1 + BLOCK_SCALE, "int8": 1 + BLOCK_SCALE,
              "int4": 0.5 + BLOCK_SCALE}
"""Bytes on the wire per gradient value, the quantized wires' scales included."""
DDP_FIRST_BUCKET_MB, DDP_BUCKET_MB = 1.0, 25.0
"""``DistributedDataParallel``'s defaults: ``bucket_cap_mb=25``, the first bucket 1 MB."""
MTU = 1500
ETHERNET, IP_TCP = 14, 52
"""Bytes of frame header (Ethernet) and of IP + TCP header (with timestamps, Linux's default)."""


@dataclass(frozen=True)
class Bounds:
    """A setting's physical range, both ends included (``above``: the low end excluded)."""

    what: str
    lo: float
    hi: float
    text: str  # the range as a user reads it
    whole: bool = False
    above: bool = False

    def check(self, value: object, shown: object = None) -> float:
        """``value``, or a ValueError naming the setting, the value (as ``shown``) and the range."""
        ok = isinstance(value, numbers.Real) and not isinstance(value, bool) and math.isfinite(value) and \
            (value > self.lo if self.above else value >= self.lo) and value <= self.hi and \
            (not self.whole or float(value).is_integer())
        if not ok:
            raise ValueError(f"{self.what} must be {self.text}, got {value if shown is None else shown!r}")
        return value  # type: ignore[return-value]


LIMITS = {
    "params": Bounds("the parameter count", 1, 1e15, "1 to 1e15"),
    "ranks": Bounds("the world size", 1, 1_000_000, "a whole number of ranks from 1 to 1,000,000", whole=True),
    "ranks_per_host": Bounds("the ranks (GPUs) per host", 1, 1024, "a whole number from 1 to 1,024", whole=True),
    "rate": Bounds("a link's rate", 1e6, 1e14, "1mbit to 100tbit (1 Mbit/s to 100 Tbit/s)"),
    "latency": Bounds("a link's latency", 0.0, 1.0, "0 to 1s"),
    "mtu": Bounds("the MTU", 68, 65536, "a whole number of bytes from 68 (IPv4's smallest) to 65536 (a loopback's)",
                  whole=True),
    "backward_s": Bounds("the backward's time", 0.0, 86400.0, "above 0 and at most a day (86400 s)", above=True),
    "seconds": Bounds("a compute time", 0.0, 86400.0, "0 to a day (86400 s)"),
    "value_bytes": Bounds("the bytes of a value", 0.5, 8.0, "0.5 (int4) to 8 (fp64)"),
}
"""Each setting's physical range: what ``fastreduce plan`` and the classes here accept."""


def TCP_PAYLOAD(mtu: int = MTU) -> float:  # noqa: N802 (a constant of the MTU)
    """The share of an Ethernet link's bytes that is TCP payload at this MTU."""
    LIMITS["mtu"].check(mtu)
    return (mtu - IP_TCP) / (mtu + ETHERNET)


# ============================================================== units

_RATE_UNITS = {"tbit": 1e12, "gbit": 1e9, "mbit": 1e6, "kbit": 1e3, "bit": 1.0,
               "tbps": 8e12, "gbps": 8e9, "mbps": 8e6, "kbps": 8e3, "bps": 8.0}
_TIME_UNITS = {"ns": 1e-9, "us": 1e-6, "ms": 1e-3, "s": 1.0}
_SIZE_UNITS = {"": 1.0, "k": 1e3, "m": 1e6, "b": 1e9, "g": 1e9, "t": 1e12}


def _number_with_unit(text: str, units: dict[str, float], what: str, example: str, zero: bool = False) -> float:
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:e[+-]?[0-9]+)?)\s*([a-z]*)\s*", str(text).lower())
    if m and m.group(2) in units and (float(m.group(1)) > 0 or zero):
        return float(m.group(1)) * units[m.group(2)]
    raise ValueError(f"{what} must be a {'non-negative' if zero else 'positive'} number with a unit like {example}, got {text!r} "
                     f"(units: {', '.join(u for u in units if u)})")


def parse_rate(text: str) -> float:
    """A link rate in bits per second, in tc's units: ``100gbit``, ``1gbit``, ``100mbit``, ``10gbps`` (bytes)."""
    return _number_with_unit(text, _RATE_UNITS, "a link rate", "100gbit or 100mbit")


def parse_seconds(text: str) -> float:
    """``20us``, ``1.5ms``, ``2s`` -> seconds."""
    return _number_with_unit(text, _TIME_UNITS, "a time", "20us or 1.5ms", zero=True)


def parse_bytes(text: str | float) -> float:
    """A parameter count: ``7e9``, ``7b``, ``125m``, ``2.1M``."""
    return _number_with_unit(str(text), _SIZE_UNITS, "a parameter count", "7e9, 7b or 125m")


# ============================================================== links and collectives

@dataclass(frozen=True)
class Link:
    """What one message costs: ``latency_s + bytes / bytes_per_s``. Also an all-reduce's
    cost over a whole group, as ``bucket_mb="auto"`` probes it (:func:`choose`)."""

    latency_s: float
    bytes_per_s: float  # may be infinite: a link that costs only its latency

    def __post_init__(self) -> None:
        if not (isinstance(self.latency_s, numbers.Real) and 0 <= self.latency_s < math.inf):
            raise ValueError(f"a link's latency must be finite and at least 0 seconds, got {self.latency_s!r}")
        if not (isinstance(self.bytes_per_s, numbers.Real) and self.bytes_per_s > 0):
            raise ValueError(f"a link's bandwidth must be above 0 bytes per second, got {self.bytes_per_s!r}")

    def seconds(self, nbytes: float) -> float:
        return self.latency_s + nbytes / self.bytes_per_s

    @classmethod
    def of(cls, rate: str | float, latency: str | float = "20us", mtu: int | None = MTU) -> "Link":
        """A link given as users state it: its rate (``"100gbit"``, or bits per second) and
        latency (``"20us"``, or seconds), in :data:`LIMITS`; TCP over Ethernet at ``mtu``
        (``None``: all of the rate is payload, as within a host)."""
        bits = LIMITS["rate"].check(parse_rate(rate) if isinstance(rate, str) else rate, rate)
        lat = LIMITS["latency"].check(parse_seconds(latency) if isinstance(latency, str) else latency, latency)
        return cls(lat, bits / 8 * (1.0 if mtu is None else TCP_PAYLOAD(mtu)))


def on_the_wire(payload: float, mtu: int = MTU) -> float:
    """Bytes on an Ethernet link for ``payload`` bytes sent over TCP: every frame's headers too."""
    return payload / TCP_PAYLOAD(mtu)


@dataclass(frozen=True)
class Cluster:
    """``ranks`` on hosts of ``ranks_per_host``; ``link`` is each host's, ``intra`` within a host."""

    ranks: int
    link: Link
    ranks_per_host: int = 1
    intra: Link = field(default_factory=lambda: Link(5e-6, 1e12 / 8))  # 1 Tbit/s: NVLink / Gaudi's on-board links

    def __post_init__(self) -> None:
        LIMITS["ranks"].check(self.ranks)
        LIMITS["ranks_per_host"].check(self.ranks_per_host)
        if self.ranks % self.ranks_per_host:
            raise ValueError(f"ranks_per_host ({self.ranks_per_host}) must divide ranks ({self.ranks})")
        if not (isinstance(self.link, Link) and isinstance(self.intra, Link)):
            raise ValueError(f"link and intra must be Links, got {self.link!r}, {self.intra!r}")

    @property
    def hosts(self) -> int:
        return self.ranks // self.ranks_per_host

    def _half(self, nbytes: float) -> tuple[float, float]:
        """(latency, seconds per byte) of a reduce-scatter (or an all-gather) of ``nbytes``:
        across hosts the ring's ``H - 1`` hops or a tree's ``log2 H``, whichever is fewer."""
        h, r = self.hosts, self.ranks_per_host
        hops = min(h - 1, math.ceil(math.log2(h))) if h > 1 else 0
        lat = hops * self.link.latency_s + (r - 1) * self.intra.latency_s
        per_byte = (h - 1) / h / self.link.bytes_per_s + (r - 1) / r / self.intra.bytes_per_s
        return lat, per_byte

    def all_reduce(self, nbytes: float) -> float:
        lat, per_byte = self._half(nbytes)
        return 0.0 if self.ranks == 1 else 2 * (lat + nbytes * per_byte)

    def reduce_scatter(self, nbytes: float) -> float:
        lat, per_byte = self._half(nbytes)
        return 0.0 if self.ranks == 1 else lat + nbytes * per_byte

    all_gather = reduce_scatter

    @classmethod
    def from_probe(cls, measured: Link, ranks: int, ranks_per_host: int, intra: Link) -> "Cluster":
        """The cluster whose all-reduce costs what ``measured`` says a group of ``ranks`` took
        (``bucket_mb="auto"``'s probe, :func:`fastreduce.sizing.probe_link`: its latency and its
        bytes all-reduced per second): the host link solved from it, ``intra`` taken as given;
        with one host, the intra-host link solved (and used as the host link too)."""
        hosts = ranks // ranks_per_host
        if ranks < 2:
            raise ValueError("a probe needs at least 2 ranks")
        if hosts == 1:
            steps = 2 * (ranks - 1)
            inside = Link(measured.latency_s / steps, measured.bytes_per_s * steps / ranks)
            return cls(ranks, inside, ranks_per_host, inside)
        probe = cls(ranks, Link(0.0, math.inf), ranks_per_host, intra)
        lat_intra, per_byte_intra = probe._half(0.0)
        hops = min(hosts - 1, math.ceil(math.log2(hosts)))
        share = (hosts - 1) / hosts
        per_byte = 1 / (2 * measured.bytes_per_s) - per_byte_intra
        link = Link(max(measured.latency_s / 2 - lat_intra, 0.0) / hops,
                    share / per_byte if per_byte > 0 else 2 * share * measured.bytes_per_s)
        return cls(ranks, link, ranks_per_host, intra)

    def as_link(self, collective: str = "all_reduce") -> Link:
        """The collective's cost as one :class:`Link` (it is affine in its bytes)."""
        f: Callable[[float], float] = getattr(self, collective)
        lat = f(0.0)
        slope = f(float(MB)) - lat
        return Link(lat, MB / slope if slope > 0 else math.inf)

    def ring_bytes(self, nbytes: float) -> float:
        """Payload each rank sends on its host's link in an all-reduce of ``nbytes`` (its share
        of what the host sends: ``2 (H-1)/H`` of the buffer, over ``R`` ranks)."""
        return 2 * (self.hosts - 1) / self.hosts * nbytes / self.ranks_per_host

    def exchange(self, nbytes: float, peers: int = 1) -> tuple[float, float]:
        """Gossip's round: every rank sends ``nbytes`` to each of ``peers`` and receives as much;
        (seconds, payload bytes a rank sends on its host's link), averaged over ``one-peer-exp``'s rounds
        (``2^k`` apart: ``log2 R`` of ``log2 N`` rounds stay within a host)."""
        if self.ranks == 1:
            return 0.0, 0.0
        rounds = max(1, math.ceil(math.log2(self.ranks)))
        inside = min(rounds, math.ceil(math.log2(self.ranks_per_host))) if self.ranks_per_host > 1 else 0
        across = (rounds - inside) / rounds
        t_in = peers * nbytes / self.intra.bytes_per_s + self.intra.latency_s
        t_out = peers * self.ranks_per_host * nbytes / self.link.bytes_per_s + self.link.latency_s
        return across * t_out + (1 - across) * t_in, across * peers * nbytes


# ============================================================== overlap with the compute

@dataclass(frozen=True)
class Sizing:
    """The buckets chosen, and why (logged once, kept in the mode's ``stats``)."""

    bucket_mb: float
    first_bucket_mb: float
    buckets: int  # as modelled (in bytes; whole parameters make the real count differ)
    why: str
    link: Link | None = None
    backward_s: float | None = None
    exposed_s: float | None = None  # the model's communication left after backward

    def describe(self) -> str:
        size = "one bucket" if self.buckets == 1 else \
            f"buckets of {self.bucket_mb:g} MB, the first {self.first_bucket_mb:g} MB"
        return f"bucket_mb='auto': {size} ({self.why})"


_FIRSTS = (1.0, 2.0, 4.0)  # not below DDP's 1 MB first bucket: a launch costs host time too
_SIZES = (1.0, 2.0, 4.0, 8.0, 16.0, 32.0, 64.0, 128.0)
_NEAR = 0.02  # within 2% of the cheapest: take the fewest buckets


def _layout(nbytes: float, first: float, size: float) -> tuple[float, int, float]:
    """``nbytes`` cut into a bucket of ``first`` bytes, then buckets of ``size``, the last of
    what is left: (the first bucket's bytes, how many buckets follow it, the last one's bytes).
    The ones between the first and the last hold ``size`` each."""
    head = min(first, nbytes)
    rest = nbytes - head
    if rest <= nbytes * 1e-12:  # the first holds it all (to rounding)
        return nbytes, 0, 0.0
    after = max(1, math.ceil(rest / size * (1 - 1e-12)))
    return head, after, max(rest - (after - 1) * size, 0.0)


def bucketed_exposed(nbytes: float, backward_s: float, link: Link, first: float, size: float) -> tuple[float, int]:
    """Communication left after a backward of ``backward_s`` when ``nbytes`` of gradients,
    arriving evenly over it, go in buckets (``first`` bytes, then ``size``), each collective
    started when its bucket is full and the one before it is done; and the bucket count.

    The last collective ends at the latest, over the buckets, of one's being full plus the
    wire times of it and every one after it (a queue served in order); over the run of
    equal buckets that sum is linear in the bucket's place, so only the run's two ends, the
    first bucket and the last need counting: no loop over the buckets."""
    if nbytes <= 0:
        return 0.0, 0
    head, after, last = _layout(nbytes, first, size)
    if after == 0:
        return link.seconds(nbytes), 1
    full, wire, t = link.seconds(size), link.seconds(last), backward_s / nbytes
    ends = [t * head + link.seconds(head) + (after - 1) * full + wire, backward_s + wire]
    if after > 1:  # the equal buckets: from the first of them, and from the last
        ends += [t * (head + size) + (after - 1) * full + wire, t * (nbytes - last) + full + wire]
    return max(max(ends) - backward_s, 0.0), 1 + after


def gathered_exposed(nbytes: float, forward_s: float, link: Link, size: float) -> float:
    """The next forward's wait for ZeRO's all-gathers: every bucket's started at once, first
    layers first, back to back; the forward needs bucket k when it has run through the bytes
    before it. As in :func:`bucketed_exposed`, the wait is largest at the first bucket, the
    last, or an end of the run of equal ones between them."""
    if nbytes <= 0:
        return 0.0
    head, after, last = _layout(nbytes, size, size)
    first, full, t = link.seconds(head), link.seconds(size), forward_s / nbytes
    waits = [first]
    if after:
        waits.append(first + (after - 1) * full + link.seconds(last) - t * (nbytes - last))
    if after > 1:
        waits += [first + full - t * head, first + (after - 1) * full - t * (head + (after - 2) * size)]
    return max(max(waits), 0.0)


def choose(wire_bytes: float, backward_s: float, link: Link) -> Sizing:
    """``bucket_mb="auto"``: the sizes that leave the least communication after a backward of
    ``backward_s`` over ``link`` (an all-reduce's cost over the group), deterministic in its inputs.

    Every pair of sizes on a grid (first bucket 1 to 4 MB or as the rest; the rest 1 to
    128 MB or everything in one) is played out (:func:`bucketed_exposed`); among those within
    2% of the cheapest, the fewest buckets none of which is longer on the wire than a
    backward, or where every bucket is (a slow link), the smallest buckets: one large message
    pacing a slow link is at the mercy of its own stalls."""
    whole = wire_bytes / MB
    sizes = sorted({s for s in _SIZES if s < whole} | {whole})
    tried = []
    for size in sizes:
        for first in sorted({f for f in _FIRSTS if f < size} | {size}):
            cost, n = bucketed_exposed(wire_bytes, backward_s, link, first * MB, size * MB)
            tried.append((cost, n, size, first))
    best = min(c for c, *_ in tried)
    near = [t for t in tried if t[0] <= best * (1 + _NEAR) + 1e-6]
    steady = [t for t in near if link.seconds(t[2] * MB) <= backward_s]
    if steady:  # the fewest buckets, none on the wire longer than a backward
        cost, n, size, first = min(steady, key=lambda t: (t[1], t[0]))
    else:  # a slow link: the smallest buckets (then the fewest) among the near-cheapest
        cost, n, size, first = min(near, key=lambda t: (t[2], t[1], t[0]))
    comm = link.seconds(wire_bytes)
    why = (f"link {link.latency_s * 1e3:.2f} ms + {link.bytes_per_s / MB:.0f} MB/s per all-reduce, "
           f"{whole:.1f} MB of gradients ({comm * 1e3:.0f} ms in one), backward {backward_s * 1e3:.0f} ms: "
           f"{cost * 1e3:.0f} ms left after it")
    return Sizing(size, min(first, size), n, why, link, backward_s, cost)


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


def plan(cluster: Cluster, workload: Workload, only: Iterable[str] | None = None) -> Plan:
    chosen = [m for m in modes() if only is None or m.name in set(only) or m.kind in set(only)]
    if not chosen:
        raise ValueError(f"no mode matches {sorted(only or [])}; the modes are "
                         f"{', '.join(m.name for m in modes())}")
    rows = [estimate(m, cluster, workload) for m in chosen]
    exact_rows = rows if any(r.exact for r in rows) else \
        [estimate(m, cluster, workload) for m in modes() if m.exact] + rows
    return Plan(cluster, workload, rows, recommend(exact_rows, workload.compute_s))
