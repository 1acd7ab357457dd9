"""ZeRO's gradients: the buckets they are reduce-scattered in, when each launches, and
what ``zero_grad()`` leaves (the gradient half of :class:`~fastreduce.ZeroOptimizer`, a mixin).

Every trainable parameter's gradient is a view of the communication layer's wire buffer
(:class:`~fastreduce.buffer.FusedBuffer`), cut into one bucket per layout segment. Each
gradient's post-accumulate hook (:class:`~fastreduce.buckets.OverlapSchedule`) counts it
in; a complete bucket is reduce-scattered at once (``overlap``), and ``step()`` launches
the rest and waits for all.

Gradients that ``zero_grad()`` (``set_to_none=True``, torch's default) dropped: with
``module=`` they come back as zeroed views of the buffer before the next forward that
records a graph (:class:`~fastreduce.grads.Reattach`, the fused reducer's mechanism), so
backward accumulates into the buffer as after ``zero_grad(set_to_none=False)`` and
allocates no gradient of its own; one that backward then leaves unwritten is ``None``
again when it ends. Between ``zero_grad()`` and that forward every gradient is ``None``,
as torch's; from the forward to its backward they are zeroed views (torch's stay
``None`` until backward writes them). Without ``module=`` (or where no pre-hook runs: a
forward compiled before the optimizer was made, or on torch 2.9 and older) autograd
allocates them and each bucket copies its own in at its launch (:func:`~fastreduce.grads.adopt`).
"""

from __future__ import annotations

import logging
import weakref
from contextlib import contextmanager
from dataclasses import dataclass
from functools import partial
from typing import Any, Callable, Iterator

import torch

from ..buckets import OverlapSchedule
from ..buffer import attached
from ..comm import Pending, complete
from ..comm.quantized import QuantMean, QuantMeans
from ..faults import guarded
from ..grads import Reattach, adopt
from ..layout import ParamsHeld
from ..hooks import optional_before_forward
from ..profiling import span
from ..torch_internals import version
from .zero_mirror import exchange

__all__ = ["GradStats", "ZeroGradients"]

log = logging.getLogger(__name__)

_HOLDERS: weakref.WeakValueDictionary[int, Any] = weakref.WeakValueDictionary()
"""id(parameter) -> the open ZeroOptimizer whose flat buffers it is a view of."""

_REBUILD = ("After changing the model's parameters, close() this optimizer and build the ZeroOptimizer "
            "again on every rank (this one's state_dict() loads into it); nothing was stepped")


@dataclass(slots=True)
class GradStats:
    """Counters of a :class:`~fastreduce.ZeroOptimizer`'s gradients."""

    preattached: int = 0
    """Gradients that were ``None`` at a forward and were re-attached as zeroed views."""


class ZeroGradients:
    """The gradient half of :class:`~fastreduce.ZeroOptimizer` (a mixin).

    It reads what the optimizer built: ``layout``, ``buffer``, ``buckets``, ``shards``,
    ``comm``, ``world_size``, ``rank``, ``overlap``, ``frozen``, ``group_built``, ``mirrors``, ``stats``, and
    the Join protocol (``_join_notify``, ``_join_factor``); it owns ``_schedule``,
    ``quantized``, ``_reattach``, ``grad_stats``, ``_syncing`` and ``_reduced``, and sets
    ``_used_mask`` in :meth:`_reduce` (which parameters some rank's backward reached this step;
    ``step()`` clears it with the step's other per-step state).
    """

    def _hook_forward(self, module: torch.nn.Module | None) -> bool:
        """Re-attach dropped gradients before each forward of ``module``; whether a hook
        was registered (the persistent views then hold for the whole run)."""
        self.grad_stats = GradStats()
        self._reattach: Reattach | None = None
        self._forward_reattach = None if module is None else optional_before_forward(module, self.reattach)
        return self._forward_reattach is not None

    def _build_grads(self, module: torch.nn.Module | None, accumulate_dtype: torch.dtype | None, quant: Any,
                     error_feedback: bool) -> None:
        """The re-attach and (several ranks) the schedule of the buckets' reduce-scatters;
        ``module``: whose parameters the layout's are (watched with their storage: the
        parameters are views of the flat buffers now)."""
        layout, comm, W = self.layout, self.comm, self.world_size
        self._schedule: OverlapSchedule | None = None
        self.quantized: QuantMeans | None = None
        self._take_over(layout.params)
        self._params_held = held = ParamsHeld(layout, module, _REBUILD)
        self._reattach = reattach = Reattach(layout, self.buffer, self.grad_stats, grad_hooks=W == 1, held=held)
        # one flat per storage (flats that are views of one wire share their base's write count)
        self._grad_storages = tuple({f.untyped_storage().data_ptr(): f for f in self.buffer.flats}.values())
        if W == 1:
            return
        # A flag per parameter, > 0 where some rank's backward reached it: summed with the last
        # bucket (in its own messages on Gloo's point to point, between its own barriers on
        # shared memory; the last launch comes once backward is over: from a hook only if
        # every parameter had its gradient), else (NCCL, HCCL, a quantized wire) averaged
        # right behind it on the step's transport.
        last = len(self.buckets) - 1
        self._riding = quant is None and comm.carries_riders(self.buckets[last].wire)
        self._used_flags = comm.buffer(len(layout), torch.float32)
        self._used_plan = None if self._riding else comm.plan(torch.float32, buf=self._used_flags)
        self._arrived = comm.buffer(1, torch.float32)  # all_arrived()'s one element
        self._arrived_plan = comm.plan(torch.float32, buf=self._arrived)
        packs = [None if b.flat is b.wire else b.pack for b in self.buckets]
        outs = [s.out for s in self.shards]
        fp32_sum = accumulate_dtype == torch.float32
        if quant is not None:  # the shard's gradient: its chunk of the wire, or its own out
            c = [seg.numel // W for seg in layout.segments]
            self.quantized = means = QuantMeans([
                QuantMean(comm, b.wire, quant, error_feedback,
                          out=b.wire[self.rank * n:(self.rank + 1) * n] if o is None else o)
                for b, o, n in zip(self.buckets, outs, c)])

        def launch(b: int, packed: bool) -> Pending:
            if b == 0:  # under Join: this rank is active; bucket 0 opens the step's collectives
                self._join_notify()
            pack = self._join_prescale(self.buckets[b].wire, None if packed else packs[b])
            if self.quantized is None:
                rider = (self._local_used(), self._used_flags) if self._riding and b == last else None
                return comm.reduce_scatter(self.buckets[b].wire, outs[b], pack, fp32_sum, rider)
            pending = means[b].start(pack, hold=True)  # and the last bucket's sum, while this is out
            if b:
                means[b - 1].advance()
            return pending

        self._schedule = OverlapSchedule(layout, self.buckets, launch, self._adopt, on_grad=reattach.grad_ready,
                                         version=self._accumulating_version)
        self._schedule.sync = self.overlap

    def _param_names(self) -> Iterator[tuple[str, torch.nn.Parameter]]:
        """Each parameter given, named by its place in ``param_groups`` (the error path's)."""
        for g, pg in enumerate(self.param_groups):
            for k, p in enumerate(pg["params"]):
                yield f"param_groups[{g}][{k}]", p

    def _take_over(self, params: tuple[torch.nn.Parameter, ...]) -> None:
        """These parameters are views of this optimizer's buffers now: one built before over
        any of them and still open (a new optimizer where torch.optim's would simply be
        replaced) can no longer reduce or step them, and its hooks would raise at the next
        backward; it is closed (what it gathers waited for), with a warning."""
        # (an open holder keeps its parameters alive, so the id it registered is still that parameter's)
        earlier = {id(old): old for old in map(_HOLDERS.get, map(id, params)) if old is not None and old is not self}
        for old in earlier.values():
            log.warning("fastreduce: a new ZeroOptimizer took over parameters an earlier one still held; the "
                        "earlier one is closed (call close() on it first to leave it no work)")
            old.close()
        _HOLDERS.update((id(p), self) for p in params)

    def _let_go(self) -> None:
        """Closed: no parameter is held by this optimizer any more (the next one built over
        them takes them over without a warning)."""
        for key in [k for k, holder in _HOLDERS.items() if holder is self]:
            del _HOLDERS[key]

    # ------------------------------------------------------------------ public

    def reattach(self) -> None:
        """Re-attach gradients freed by ``zero_grad(set_to_none=True)`` as zeroed views of
        the flat buffer now. With ``module=`` the model's forward does this by itself (a
        pre-hook); call it before a backward whose forward did not go through that
        module's own ``forward``, or its buckets copy the fresh gradients in instead
        (correct, one copy slower, and freed memory that may page-fault in again)."""
        if self._reattach is not None and torch.is_grad_enabled():
            self._reattach.before_forward()

    @contextmanager
    def no_sync(self) -> Iterator[None]:
        """Accumulate gradients locally: nothing is communicated inside this block; the
        next backward outside it, then :meth:`step`, averages the accumulated grads."""
        self._syncing = False
        launching = self._schedule is not None and self._schedule.sync  # (off already where launches are held)
        if self._schedule is not None:
            self._schedule.sync = False
        try:
            yield
        finally:
            self._syncing = True
            if self._schedule is not None:
                self._schedule.sync = launching

    @torch.no_grad()
    def zero_grad(self, set_to_none: bool = True) -> None:
        """Reset the gradients: ``set_to_none=False`` zeroes the flat buffer in place (one
        op per bucket) and keeps every ``param.grad`` a view of it; ``True`` (torch's
        default) sets them to ``None``, and with ``module=`` the next forward re-attaches
        them as zeroed views (the same memset, moved), so neither allocates gradients in
        backward. It does not wait for the parameters' all-gather (the gradients are
        other memory), so that stays overlapped with what follows."""
        self._spent = None
        for p, v in zip(self.layout.params, self.buffer.views):
            if set_to_none:
                p.grad = None
            elif p.grad is not v and p.grad is not None:
                p.grad = v
        if not set_to_none:
            self.buffer.zero_()

    # ------------------------------------------------------------------ every step

    def _join_prescale(self, wire: torch.Tensor, pack: Callable[[], None] | None) -> Callable[[], None] | None:
        """Under Join with fewer active ranks: the bucket's pack, then x world / active, so
        that the reduce-scatter (joined ranks send zeros) lands the mean over the active
        ranks in every shard, the joined ranks' too (they step theirs with it)."""
        factor = self._join_factor()
        if factor == 1.0:
            return pack

        def scaled() -> None:
            if pack is not None:
                pack()
            wire.mul_(factor)
        return scaled

    def _adopt(self, indices: list[int], direct: bool) -> tuple[list[int], bool]:
        if not self._params_held():  # (overlapped: from backward's hook, before this bucket launches)
            raise self._params_held.error()
        missing, _, direct = adopt(self.layout, self.buffer, indices, direct=direct)
        return missing, direct

    @guarded("the reduce-scatter of {cls}.step()", "This step's gradients are lost (partly averaged); "
             "the parameters and optimizer state are as before the step.")
    def _reduce(self) -> None:
        """This step's reduce-scatter: launch what is left, wait for every bucket."""
        if self._reduced:
            return
        if not self._syncing:
            raise RuntimeError("ZeroOptimizer.step() (or clip_grad_norm_()) was called inside "
                               "no_sync(): nothing would be averaged. Step after the no_sync() "
                               "block, once per accumulation window; nothing was changed")
        self.group_built.check("ZeroOptimizer")
        self._refuse_spent()
        self.frozen.check(self._param_names, "ZeroOptimizer was built", "no shard holds them", "close() this "
                          "optimizer and build it again on every rank after changing requires_grad")
        if not self._params_held():  # replaced or moved parameters: raised before any collective of step()
            if self._schedule is not None:
                self._schedule.drop()  # (what backward launched: waited for, left unused)
            raise self._params_held.error()
        self._params_held.expire()  # (the next step looks again)
        self._reattach.settle(done=True)  # re-attached but never written by backward: None again
        if self._schedule is None:  # one rank: the grads are the average
            self._used_mask = self._local_used() > 0
            adopt(self.layout, self.buffer, range(len(self.layout)))
            self.buffer.pack()
            for s, b in zip(self.shards, self.buckets):
                if s.out is not None:
                    s.out.copy_(b.wire)
        else:
            _, works = self._schedule.finish(quiet=not self.overlap)
            flags = self._used_flags
            used = None if self._riding else \
                self.comm.all_reduce(flags, self._used_plan, partial(flags.copy_, self._local_used()))
            with span("fastreduce::wait"), self.stats.waiting():
                for pending in works:
                    complete(pending)
                if used is not None:
                    complete(used)
                self._used_mask = flags > 0
                if self.mirrors:  # my chunk of the mean to the holders of my shard's copies
                    exchange(self)
            self.stats.wire_bytes += self.quantized.wire_bytes if self.quantized is not None else \
                sum(b.wire.nbytes for b in self.buckets)
            self.stats.wire_bytes += sum(r.nbytes for m in self.mirrors for r in m.recv.values())
        self._reduced = True

    @guarded("{cls}.all_arrived()", "Some rank may not have got this far; nothing was stepped here.")
    def all_arrived(self) -> None:
        """Return once every rank has called this (after its step's gradient collectives,
        within :meth:`commit_point`): one one-element all-reduce on the step's transport
        (microseconds on shared memory). Completed on any rank, every rank had arrived,
        so every shard's averaged gradients were complete on its holders. Collective."""
        if self.world_size > 1:
            with span("fastreduce::wait"), self.stats.waiting():
                complete(self.comm.all_reduce(self._arrived, self._arrived_plan))

    def _refuse_spent(self) -> None:
        """Raise where this step's gradients are the last step's, which its reduce-scatter spent
        (each rank's buffer holds its own shard's mean and, elsewhere, its own gradients), with
        nothing written since (a second step on one backward) or a backward accumulated onto them
        (no ``zero_grad()`` between: every gradient a view of the buffer at the backward's first
        hook, and that gradient's accumulation the only write since, where a zeroing in place,
        the model's, writes every one; gradients set to ``None`` are allocated afresh)."""
        schedule = self._schedule
        if self._spent is None or schedule is None or self._shadowing or \
                not attached(self.layout.params, self.buffer.views):
            return
        if not schedule.got_grads and self._grads_version() == self._spent:
            raise RuntimeError("ZeroOptimizer.step() (or clip_grad_norm_()) was called again with no backward "
                               "since the last step, whose reduce-scatter spent the gradients (each rank's "
                               "buffer now holds its own shard's mean and, elsewhere, its own gradients): "
                               "run backward before each step (zero_grad() in between); nothing was changed")
        if schedule.got_grads and schedule.first_version is not None and schedule.first_version - self._spent <= 1:
            schedule.drop()  # (what backward launched: waited for, left unused)
            raise RuntimeError("this backward accumulated onto the last step's gradients, which its "
                               "reduce-scatter spent (each rank's buffer holds its own shard's mean and, "
                               "elsewhere, its own gradients): ZeroOptimizer cannot accumulate across steps. "
                               "Call zero_grad() after each step (no_sync() accumulates within one); nothing "
                               "was stepped: zero_grad(), then run this step's backward again")

    def _accumulating_version(self) -> int | None:
        """At a backward's first gradient: :meth:`_grads_version` where every gradient is a view
        of the buffer (backward accumulates into it), else ``None`` (some were set to ``None``:
        backward allocated them afresh, and a launch copies them in)."""
        return self._grads_version() if attached(self.layout.params, self.buffer.views) else None

    def _grads_version(self) -> int:
        """How many in-place writes the gradient buffer has seen (:func:`~.torch_internals.version`)."""
        return sum(map(version, self._grad_storages))

    def _local_used(self) -> torch.Tensor:
        """1.0 for each parameter (layout order) this rank's backward gave a gradient (after
        backward: re-attached views it never wrote are ``None`` again), else 0.0."""
        return torch.tensor([not self._shadowing and p.grad is not None for p in self.layout.params],
                            dtype=torch.float32)

    def _used(self) -> list[bool] | None:
        """Which parameters (layout order) some rank's backward gave a gradient this step
        (``None``: all); the others are not stepped, as torch.optim skips a parameter whose
        ``grad`` is ``None``."""
        used = self._used_mask
        return None if used is None or bool(used.all()) else used.tolist()
