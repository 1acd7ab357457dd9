"""``bucket_mb="auto"``: bucket sizes chosen from the link and the backward, agreed by all ranks.

A bucketed mode starts each bucket's collective when its last gradient is accumulated,
and the step waits for whatever is still on the wire when backward ends. Few large
buckets pay the collective's fixed cost (launch, round trips) few times but start late;
many small ones start early and pay it often; the first bucket (the model's last
layers, whose gradients come first) sets when the wire starts working at all. Which
wins depends on the link, so the mode measures it:

* **probe** (:func:`probe_link`, when the mode builds its buckets and again at the
  refresh, on every rank):
  all-reduces of 4 KB (three) and 256 KB (two; 4 MB as well where 256 KB took under
  5 ms) through the process group, the fastest of each, give the latency ``a`` (the
  small one) and the bandwidth ``B`` (bytes all-reduced per second beyond it). About
  5 ms on one host, 60 ms at 100 Mbit/s;
* **backward** time ``T``: from the first to the last gradient hook of a step;
* **model** (:func:`fastreduce.plan.choose`, the cost model ``fastreduce plan`` prices
  the modes with): gradients arrive evenly over ``T`` in layout order; a
  bucket starts when its bytes are in and the one before it is done, and takes
  ``a + size / B``; the cost is what is left after ``T``. Every pair of sizes on a grid
  (first bucket 1 to 4 MB or as the rest; the rest 1 to 128 MB or everything in one)
  is played out; among those within 2% of the cheapest, the fewest buckets none of
  which is longer on the wire than a backward, or where every bucket is (a slow link),
  the smallest buckets. One large message pacing a slow link is at the mercy of its
  own stalls: at 100 Mbit/s eight 1 MB all-reduces in flight together took 713 ms
  (median of 12) against 729 for one of 8 MB, and the overlapped step with 1 MB
  buckets was 0.985x DDP's compiled against 1.022x with one 1 MB and one 7 MB bucket,
  though the model counts them within 1% of each other.
* **shared memory** (CPU ranks on one host): one bucket, no probe (the overlapped mode
  then sends it after backward as the fused mode does; ZeRO too with ``module=``, else buckets of
  :data:`ZERO_SHM_BUCKET_MB`, :func:`fastreduce.modes.zero_config.shared_memory_buckets`). Its collective runs
  on the same cores as the backward, so what overlap hides it takes from the compute
  (measured: the overlapped step was 1.27x a no-communication one against the fused
  step's 1.15x).

Every input is agreed (the largest ``a`` and ``T``, the smallest ``B`` over the ranks)
before choosing, so every rank lays the buckets out the same. The inputs are refreshed
from real steps: the overlapped mode probes the link again and chooses again from the
backward times of its first steps (the first step's includes one-off costs such as
compiling, and the probe after it reads them too), and re-lays its buckets once if the
choice changed.
"""

from __future__ import annotations

import math
import statistics
import time
from typing import Callable

import torch
import torch.distributed as dist

from .faults import all_reduce_watched, wait_watched
from .plan import MB, Link, Sizing, choose

__all__ = ["AUTO", "AUTO_RULE", "GOSSIP_AUTO_RULE", "GOSSIP_AUTO_WHY", "ZERO_AUTO_RULE", "ZERO_SHM_BUCKET_MB",
           "AutoSizer", "Link", "Sizing", "agree", "check_bucket_mb", "choose", "measure_link", "probe_link",
           "shared_memory"]

AUTO = "auto"
AUTO_RULE = ("one bucket on shared memory, sent after backward as the fused mode's; over a process group, the "
             "least communication left after backward for the probed link and the timed backward (agreed, "
             "refreshed after 8 steps; one bucket then is sent as the fused mode's too); "
             "fixed_bucket_mb with a quantized or compressed wire or accumulate_dtype")
ZERO_SHM_BUCKET_MB = 2.0
"""ZeRO's bucket on shared memory without ``module=`` (:func:`fastreduce.modes.zero_config.shared_memory_buckets`)."""
ZERO_AUTO_RULE = ("one bucket on shared memory with module= (the gradients zero_grad() set to None are re-attached "
                  "as views of the flat buffer before each forward: backward allocates none), buckets of "
                  f"{ZERO_SHM_BUCKET_MB:g} MB there without it (those backward allocates are copied and freed per "
                  "bucket, not page-faulted in again each step); over a process group as the "
                  "overlapped mode's, chosen when the optimizer is built, the backward taken to be as long as "
                  "the gradients' communication; not refreshed")
GOSSIP_AUTO_WHY = ("a bucket's exchange has a whole step to finish, whatever the bucket count: it is waited for "
                   "only at that bucket's step in the next backward; so one bucket hides as much as several and "
                   "pays for one launch, one optimizer step and one mix")
GOSSIP_AUTO_RULE = "one bucket: " + GOSSIP_AUTO_WHY
def check_bucket_mb(bucket_mb: object) -> None:
    """``bucket_mb`` is ``"auto"``, ``None`` (the same) or a positive finite number (inf and
    NaN are refused here, before a mode builds anything: a size becomes a count of bytes)."""
    if bucket_mb is None or bucket_mb == AUTO:
        return
    if isinstance(bucket_mb, bool) or not isinstance(bucket_mb, (int, float)) or not 0 < bucket_mb < math.inf:
        why = (" (one bucket: a size at least the gradients' megabytes, as a bucket is cut once it reaches "
               "its size)") if bucket_mb == math.inf else ""
        raise ValueError(f"bucket_mb must be a positive finite number of megabytes or 'auto', got {bucket_mb!r}{why}")


def shared_memory(wire_bytes: int) -> Sizing:
    mb = max(wire_bytes / MB, 1e-6)
    return Sizing(mb, mb, 1, "shared memory: the collective runs on the cores the backward runs on, "
                  "so overlap would take from the compute what it hides")


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    elif device.type == "hpu":
        torch.hpu.synchronize()  # type: ignore[attr-defined]


def fastest(call: Callable[[], object], group: dist.ProcessGroup | None, device: torch.device,
            repeats: int) -> float:
    """Fewest seconds of ``repeats`` runs of the collective ``call``, each started after a
    barrier (the least disturbed: a busy host only adds time). Each collective waited
    through the watchdog (a Membership's member lost in the probe is named at once)."""
    times = []
    for _ in range(repeats):
        wait_watched(dist.barrier(group=group, async_op=True))
        _sync(device)
        t = time.perf_counter()
        call()
        _sync(device)
        times.append(time.perf_counter() - t)
    return min(times)


def _timed(group: dist.ProcessGroup | None, buf: torch.Tensor, repeats: int) -> float:
    """:func:`fastest` of ``repeats`` all-reduces of ``buf``."""
    return fastest(lambda: all_reduce_watched(buf, dist.ReduceOp.SUM, group), group, buf.device, repeats)


def probe_link(group: dist.ProcessGroup | None, device: torch.device) -> Link:
    """Measure the group's all-reduce (collective: every rank, same order). Not agreed:
    :func:`agree` the result before choosing."""
    small = torch.zeros(1024, device=device)  # 4 KB
    _timed(group, small, 1)  # the first collective of a group sets up connections
    latency = _timed(group, small, 3)
    big = torch.zeros(64 * 1024, device=device)  # 256 KB
    t_big = _timed(group, big, 2)
    fast = torch.tensor([float(t_big < 0.005)], device=device)
    all_reduce_watched(fast, dist.ReduceOp.MIN, group)  # every rank takes the same branch
    if fast.item():
        big = torch.zeros(MB, device=device)  # 4 MB: a fast link needs more bytes to show its bandwidth
        t_big = _timed(group, big, 2)
    nbytes = big.numel() * big.element_size()
    # where noise hides the bytes' own time (the big one no slower than twice the small), all of
    # the big one's time is counted as bandwidth: slower than the truth, never absurdly fast
    return Link(latency, nbytes / (t_big - latency if t_big > 2 * latency else t_big))


def measure_link(group: dist.ProcessGroup | None, device: torch.device,
                 sizes: tuple[int, ...] = (4 * 1024, MB, 4 * MB), repeats: int = 3) -> Link:
    """The group's all-reduce measured with more care than :func:`probe_link` (``fastreduce
    plan --probe``, the network suite's growth part): the fastest of ``repeats`` all-reduces
    of each of ``sizes`` bytes, and the line ``latency + bytes / bandwidth`` fitted through
    them (least squares). Collective; not agreed (:func:`agree` it)."""
    _timed(group, torch.zeros(1024, device=device), 1)  # the first collective sets up connections
    points = [(float(n), _timed(group, torch.zeros(n // 4, device=device), repeats)) for n in sizes]
    mean_n = sum(n for n, _ in points) / len(points)
    mean_t = sum(t for _, t in points) / len(points)
    slope = sum((n - mean_n) * (t - mean_t) for n, t in points) / sum((n - mean_n) ** 2 for n, _ in points)
    if slope <= 0:  # noise over the bytes' own time: all of the largest one's time as bandwidth
        return Link(points[0][1], points[-1][0] / points[-1][1])
    intercept = mean_t - slope * mean_n  # below zero in noise: then the smallest message's time, all latency
    return Link(intercept if intercept > 0 else points[0][1], 1.0 / slope)


def agree(link: Link, backward_s: float, group: dist.ProcessGroup | None,
          device: torch.device) -> tuple[Link, float]:
    """The slowest rank's view (largest latency and backward, smallest bandwidth), on every rank."""
    t = torch.tensor([link.latency_s, 1.0 / link.bytes_per_s, backward_s], dtype=torch.float64)
    t = t.to(device) if device.type != "hpu" else t.float().to(device)
    all_reduce_watched(t, dist.ReduceOp.MAX, group)
    lat, inv_bw, back = t.double().cpu().tolist()
    return Link(lat, 1.0 / inv_bw), back


class AutoSizer:
    """A mode's ``bucket_mb="auto"``: the sizes chosen when it builds its buckets, and
    chosen once more from the backward times of its next :attr:`REFRESH_AFTER` steps."""

    REFRESH_AFTER = 8

    def __init__(self) -> None:
        self.sizing: Sizing | None = None
        self.refreshed = False
        self.hold = False  # the next build keeps the sizes (the mode lays them out again, in a new order)
        self._link: Link | None = None

    def build(self, shm: bool, wire_bytes: int, backward_s: float | None, group: dist.ProcessGroup | None,
              device: torch.device) -> Sizing:
        """Collective (unless ``shm`` or refreshed): the sizes for the buckets built now.
        ``backward_s=None`` (none has run yet, ZeRO's case): taken to be as long as the
        gradients' communication."""
        if self.hold:
            self.hold = False
        elif self.sizing is None or not self.refreshed:  # a re-lay after the refresh keeps its choice
            if shm:
                self.sizing = shared_memory(wire_bytes)
            else:
                self._link, agreed = agree(probe_link(group, device), backward_s or 0.0, group, device)
                guess = self._link.seconds(wire_bytes) if backward_s is None else agreed
                self.sizing = choose(wire_bytes, guess, self._link)
        return self.sizing

    @property
    def one_bucket(self) -> bool:
        """One bucket for good: it will not be chosen again (shared memory: never probed; or refreshed)."""
        return self.sizing is not None and self.sizing.buckets == 1 and (self._link is None or self.refreshed)

    def refresh(self, backward_s: list[float], wire_bytes: int, group: dist.ProcessGroup | None,
                device: torch.device) -> bool:
        """Collective, at the same step on every rank: once ``backward_s`` (per step since
        the build) holds :attr:`REFRESH_AFTER` steps, choose again from their median
        (the first left out), and the link probed again (the first probe runs just after the
        first step, while a compiled model's pieces have just been compiled: on this 2-core
        machine it read 3.5 ms a launch there against 0.45 ms in steady steps); whether the
        buckets should be laid out again (also where one bucket is kept: the mode then runs it as
        the fused collective)."""
        if self.refreshed or self._link is None or len(backward_s) < self.REFRESH_AFTER:
            return False
        self.refreshed = True
        self._link, median = agree(probe_link(group, device), statistics.median(backward_s[1:]), group, device)
        old, self.sizing = self.sizing, choose(wire_bytes, median, self._link)
        return self.sizing.buckets == 1 or \
            (self.sizing.bucket_mb, self.sizing.first_bucket_mb) != (old.bucket_mb, old.first_bucket_mb)
