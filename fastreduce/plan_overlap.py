"""Communication overlapped with the compute, in closed form (:mod:`fastreduce.plan`):
what a bucketed backward or ZeRO's gathers leave exposed, and the buckets
``bucket_mb="auto"`` chooses (:func:`choose`)."""

from __future__ import annotations

import math
from dataclasses import dataclass

from .plan_inputs import MB
from .plan_links import Link

__all__ = ["Sizing", "bucketed_exposed", "choose", "gathered_exposed"]


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
