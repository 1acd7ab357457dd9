"""The reducer's compressed path, ``FusedReducer(compression=PowerSGD(...))``, fused or overlapped.

Communication pattern, per step once the codec's warm-up is over (before it, the plain
all-reduce of the gradients)::

    per group (the whole model, or one bucket launched from the backward hooks):
        encode: wire_p := [uncompressed grads | P = M Q]   -> all-reduce (mean)
    reduce(), per group in order, once its P is averaged:
        between: orthonormalize P, wire_q := Q = M^T P      -> all-reduce (mean)
    then per group in order, once its Q is averaged:
        decode: grads := P Q^T (and the residual)

Every rank issues every P's collective, then every Q's, in group order, so ranks agree
on the sequence whatever the bucket count (torch's PowerSGD hook launches a bucket's Q
from a future callback, racing the next bucket's P). The codec
(:mod:`fastreduce.codecs.powersgd`) owns the buffers and the math; this module plans and
launches their collectives and, in the fused mode, has the backend record the codec's
encode and decode (graphs on CUDA and lazy-mode HPU; the QR between them runs eagerly).
"""

from __future__ import annotations

from typing import Callable

import torch

from ..backends import Backend
from ..buckets import OverlapSchedule
from ..buffer import FusedBuffer
from ..codecs.powersgd import LowRank, PowerSGD
from ..comm import Comm, Pending, complete
from ..layout import GradLayout

__all__ = ["Compressed", "check_compression"]


def check_compression(compression: object, accumulate_dtype: torch.dtype | None, error_feedback: bool) -> None:
    """``ValueError`` unless ``compression`` is ``None`` or a codec the reducer can use with
    these settings."""
    if compression is None:
        return
    if not isinstance(compression, PowerSGD):
        raise ValueError(f"compression must be None or a fastreduce.PowerSGD(...), got {type(compression).__name__}")
    if accumulate_dtype is not None:
        raise ValueError("compression= cannot be combined with accumulate_dtype: PowerSGD's factors are "
                         "averaged by the collective itself; for an exact sum of them pass wire_dtype=torch.float32")
    if error_feedback:
        raise ValueError("error_feedback=True is the wire cast's; with compression= pass "
                         "PowerSGD(error_feedback=True) instead (its residual holds the wire's rounding too)")


class Compressed:
    """PowerSGD over a reducer's groups: in overlap mode the buckets of ``schedule``, whose
    launches it takes over once the warm-up is over (``opened`` runs before bucket 0's, as
    before the plain launch's: Join's notice), each group a bucket; else one group of
    every gradient, whose steps the backend records (not where a fresh random Q is drawn
    each step: a replay would repeat it). ``factor()``: Join's world / active for the
    step (:attr:`scaled` says whether it was not 1)."""

    def __init__(self, comp: PowerSGD, layout: GradLayout, buffer: FusedBuffer, comm: Comm, backend: Backend,
                 wire_dtype: torch.dtype, schedule: OverlapSchedule | None, opened: Callable[[], None],
                 factor: Callable[[], float]):
        groups = [b.slots for b in schedule.buckets] if schedule else [range(len(layout))]
        eager = schedule is not None or not comp.warm_start
        storage = [flat[s.offset:s.offset + s.numel] for seg, flat in zip(layout.segments, buffer.flats)
                   for s in seg.slots]
        self.comm = comm
        self.codec = codec = LowRank(comp, [[(layout.names[i], layout.params[i], storage[i]) for i in g]
                                            for g in groups], wire_dtype, comm.buffer)
        self.plans: list[tuple] = []  # per group: (plan_p, plan_q, encode, between, decode)
        for g in codec.groups:
            plan_p, plan_q = comm.plan(wire_dtype, None, g.wire_p), comm.plan(wire_dtype, None, g.wire_q)
            # The QR in between stays eager: whether cuSOLVER's and HPU's QR can be recorded in a
            # graph is not established (not run on either); encode and decode are matmuls and casts.
            capture = (lambda f: f) if eager else backend.capture
            self.plans.append((plan_p, plan_q, capture(g.encode), g.between, capture(g.decode)))
        self.nbytes = sum(g.nbytes for g in codec.groups)
        self.divide = plan_p.world if plan_p.prescale else 1  # one plan kind for every group's buffers
        self.factor = factor
        self.scaled = False  # this step's sums were scaled for Join's active ranks
        self._scale = 1.0 / self.divide  # what every group's ``scale`` holds now
        for g in codec.groups:
            g.scale.fill_(self._scale)
        if schedule is not None:
            plain = schedule.launch

            def launch(b: int, packed: bool) -> Pending:
                if not codec.compressing:
                    return plain(b, packed)
                if b == 0:  # the step's first collective: Join's notice, as the plain launch gives it
                    opened()
                return self.launch(b)
            schedule.launch = launch

    @property
    def compressing(self) -> bool:
        return self.codec.compressing

    def launch(self, b: int) -> Pending:
        """Group ``b``: encode and launch its P; the returned ``then`` (run once P is
        averaged) launches its Q, queued on ``codec.later`` for :meth:`FusedReducer` to
        wait on after every group's P."""
        codec = self.codec
        if b == 0:  # under Join every part is scaled by world / active before the sums, so that each
            codec.before_step()  # residual is against the mean over the active ranks
            factor = self.factor()
            self.scaled = factor != 1.0
            if factor / self.divide != self._scale:  # only when Join's count changes: no op a step
                self._scale = factor / self.divide
                for g in codec.groups:
                    g.scale.fill_(self._scale)
        group = codec.groups[b]
        plan_p, plan_q, encode, between, decode = self.plans[b]
        work, _ = self.comm.all_reduce(group.wire_p, plan_p, encode)

        def then() -> None:
            between()
            codec.later.append(self.comm.all_reduce(group.wire_q, plan_q, None, decode))
        return work, then

    def shadow(self) -> list[Pending]:
        """A joined rank's part (Join): the same collectives on zeros, Q's launched as P's finish."""
        codec, works = self.codec, []
        for g, (plan_p, plan_q, *_) in zip(codec.groups, self.plans):
            def then(g=g, plan_q=plan_q) -> None:
                codec.later.append(self.comm.all_reduce(g.wire_q.zero_(), plan_q))
            works.append((self.comm.all_reduce(g.wire_p.zero_(), plan_p)[0], then))
        return works

    def end_shadow(self) -> None:
        """A joined rank's step, after its P's: wait for its Q's (launched meanwhile)."""
        for pending in self.codec.later:
            complete(pending)
        self.end_step()

    def end_step(self) -> int:
        """After every collective of a step was waited on: count it; return the Q
        collectives it ran."""
        later = len(self.codec.later)
        self.codec.later.clear()
        self.codec.step += 1
        return later

    def describe(self) -> str:
        comp = self.codec.config
        return (f"PowerSGD rank {comp.rank}: {self.codec.matrices} matrices compressed, {self.nbytes / 2**20:.2f} MB "
                f"sent per step after {comp.warmup_steps} exact steps")

