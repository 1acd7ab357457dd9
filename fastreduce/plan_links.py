"""The link and the collectives of :mod:`fastreduce.plan`'s cost model: what a message
costs (:class:`Link`), TCP's share of an Ethernet link, and the hierarchical ring's
all-reduce, reduce-scatter, all-gather and gossip's exchange (:class:`Cluster`)."""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass, field
from typing import Callable

from .plan_inputs import LIMITS, MB, parse_rate, parse_seconds

__all__ = ["MTU", "TCP_PAYLOAD", "Cluster", "Link", "on_the_wire"]

MTU = 1500
ETHERNET, IP_TCP = 14, 52
"""Bytes of frame header (Ethernet) and of IP + TCP header (with timestamps, Linux's default)."""


def TCP_PAYLOAD(mtu: int = MTU) -> float:  # noqa: N802 (a constant of the MTU)
    """The share of an Ethernet link's bytes that is TCP payload at this MTU."""
    LIMITS["mtu"].check(mtu)
    return (mtu - IP_TCP) / (mtu + ETHERNET)


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
