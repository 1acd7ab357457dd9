"""What a mode moved and waited for: the counters behind the trainers' figures.

:class:`~fastreduce.ZeroOptimizer`, :class:`~fastreduce.DecentralizedDataParallel`,
:class:`~fastreduce.LocalSGD` and :class:`~fastreduce.DiLoCo` each keep one as ``.stats``
(:class:`~fastreduce.FusedReducer`'s :class:`~fastreduce.ReducerStats` counts the same two
things as ``bytes_reduced`` and ``wait_seconds``). Bytes count as the fused reducer counts
them: each collective adds the bytes of the buffer it is handed, once, as encoded for the
wire (an all-reduce, a reduce-scatter or an all-gather of a buffer: its bytes; gossip's
exchange: the block this rank sends, whatever the number of peers).
"""

from __future__ import annotations

import time
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Iterator

__all__ = ["CommStats"]


@dataclass(slots=True)
class CommStats:
    """Cumulative counters of one mode object, from its construction."""

    wire_bytes: int = 0
    """Bytes handed to this rank's collectives (see the module doc)."""
    wait_seconds: float = 0.0
    """Seconds this rank's thread spent waiting for them to complete (with what finishes
    each on arrival: unpacking, decoding, the gossip mix)."""

    @contextmanager
    def waiting(self) -> Iterator[None]:
        """Count the time inside as waiting."""
        t0 = time.perf_counter()
        try:
            yield
        finally:
            self.wait_seconds += time.perf_counter() - t0
