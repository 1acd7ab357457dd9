"""The fused reducer: one averaging all-reduce over every gradient, after backward.

Per call, once warm::

    parameters still the ones learned?     (identity and storage, no kernels; else: rebuild())
    grads still views of the flat buffer?  (identity check, no kernels)
      no  -> copy the re-allocated ones in with one _foreach_copy_, re-attach views
    pack    (replayed graph: cast each non-wire-dtype segment into the wire buffer)
    all-reduce the wire buffer (AVG, or divided first), wait for it
    unpack  (replayed graph: cast back)

With ``zero_grad(set_to_none=False)`` (or :meth:`FusedReducer.zero_grad`) and a wire
dtype equal to the gradients' dtype, that is the collective and nothing else.

After ``zero_grad(set_to_none=True)`` (what trainers and most loops call) the next
forward (a pre-hook, under grad mode) re-attaches zeroed views of the flat buffer, so
backward accumulates straight into it: no allocation, no copy in ``reduce()``. One that
backward never wrote (an unused parameter) is ``None`` again before the reduction.

With ``overlap=True`` the same buffer is cut into buckets laid out in backward order
and each bucket's all-reduce starts from a gradient hook during backward
(:mod:`.overlap`); ``reduce()`` (alias ``finish()``) then only waits and unpacks.
``all_reduce_gradients(model)`` keeps one of these on the model (:mod:`.functional`).
"""

from __future__ import annotations

import logging
import time
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Iterator

import torch
import torch.distributed as dist

from ..backends import Backend
from ..buckets import OrderRecorder, default_bucket_mb
from ..buffer import attached
from ..comm import Pending, wants_shm
from ..comm.quantized import QuantMean
from ..compiling import ModeCut, keep_cut, uncut_graphs
from ..engine import GroupSnapshot, require_distributed
from ..faults import guarded, wait_watched
from ..hooks import optional_before_forward, remove_hooks
from ..grads import FiniteCheck, NonFiniteGradError, adopt, attach_used, first_nonfinite, nonfinite_error
from ..layout import GradLayout
from ..profiling import span
from ..sizing import AUTO, AutoSizer, Sizing
from ..torch_internals import compiled_inner
from .fused_build import FusedBuild, Built
from .fused_config import ReducerConfig, UnusedGrads
from .fused_join import FusedJoin
from .fused_state import ReducerState

__all__ = ["FusedReducer", "NonFiniteGradError", "ReducerConfig", "ReducerStats", "UnusedGrads"]

log = logging.getLogger(__name__)


@dataclass(slots=True)
class ReducerStats:
    """Cheap counters, updated on every reduction."""

    calls: int = 0
    collectives: int = 0
    bytes_reduced: int = 0
    wait_seconds: float = 0.0
    reattached: int = 0
    """Gradients found re-allocated (e.g. by ``zero_grad(set_to_none=True)``) and copied back."""
    launched_in_backward: int = 0
    """Overlap mode: buckets whose all-reduce started during backward, not at finish()."""
    nonfinite: int = 0
    """Reductions whose average held inf or NaN (``nonfinite`` ``raise`` or ``skip``)."""
    preattached: int = 0
    """Gradients that were ``None`` at a forward and were re-attached as zeroed views."""
    compressed: int = 0
    """Reductions that sent compressed gradients (``compression=``, after its warm-up)."""
    sizing: Sizing | None = None
    """Overlap mode with ``bucket_mb="auto"``: the bucket sizes chosen, and why."""


class FusedReducer(ReducerState, FusedBuild, FusedJoin):
    """Averages a model's gradients across a process group with fused collectives.

    Call :meth:`reduce` on every rank after ``backward()`` and before the optimizer
    step. The first call learns the layout (which parameters, in which order),
    checks it is the same on every rank, allocates one flat buffer per gradient dtype
    and makes each ``param.grad`` a view of it; later calls cost a constant number of
    ops, however many parameters the model has. Parameters that do not require grad
    are left alone; tied parameters are reduced once.

    Args:
        model: the module whose parameters' gradients are averaged.
        group: process group (default: the world group).
        **config: fields of :class:`ReducerConfig` (``wire_dtype``, ``use_graphs``,
            ``backend``, ``unused_grads``, ``accumulate_dtype``, ``overlap``,
            ``bucket_mb``, ``transport``).

    Example::

        >>> reducer = fastreduce.FusedReducer(model, wire_dtype=torch.bfloat16, overlap=True)
        >>> for step, (x, y) in enumerate(batches):
        ...     with reducer.no_sync() if step % 4 != 3 else contextlib.nullcontext():
        ...         loss_fn(model(x), y).backward()   # buckets reduce during backward
        ...     if step % 4 == 3:
        ...         reducer.finish()                  # wait, unpack
        ...         opt.step()
        ...         reducer.zero_grad()               # grads stay views: no copy next step
    """

    commit_style = "reduce"  # under a Membership (modes/contract.py)
    state_scope = "replicated"
    optimizer_role = "user"
    _cut: ModeCut | None = None  # overlap: the compiled graphs' cut (see _cut_graphs)

    @property
    def mode_name(self) -> str:
        """``overlap`` or ``fused`` (modes/contract.py)."""
        return "overlap" if self.config.overlap else "fused"

    @property
    def trained_module(self) -> torch.nn.Module:
        return self.model

    def __init__(self, model: torch.nn.Module, *, group: dist.ProcessGroup | None = None, **config: Any):
        if not isinstance(model, torch.nn.Module):
            raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
        require_distributed()
        self.config = ReducerConfig(**config)
        self.model = model
        self.group = group
        self.world_size = dist.get_world_size(group)
        self.group_built = GroupSnapshot(group)
        self.stats = ReducerStats()
        self._built: Built | None = None
        self._syncing = True
        self._warned_missing = False
        self._recorder: OrderRecorder | None = None
        self._check: FiniteCheck | None = None  # nonfinite="raise"/"skip": made on first use
        self._record_order()
        self._forward_hook = optional_before_forward(model, self.reattach)
        self._fixed_mb = None if self.config.bucket_mb in (None, AUTO) else float(self.config.bucket_mb)
        self._sizer = AutoSizer() if self.config.overlap and not (self._fixed_mb or self.config.per_bucket) else None
        self._cut_graphs()
        self._init_join(group, next((p.device for p in model.parameters()), torch.device("cpu")))

    # ------------------------------------------------------------------ public

    @property
    def layout(self) -> GradLayout | None:
        """The learned layout, or ``None`` before the first :meth:`reduce`."""
        return self._built.layout if self._built else None

    @property
    def backend(self) -> Backend | None:
        """The device backend in use, or ``None`` before the first :meth:`reduce`."""
        return self._built.backend if self._built else None

    @property
    def num_buckets(self) -> int:
        """Buckets per step: 1 in fused mode (0 before the first reduce)."""
        if self._built is None:
            return 0
        return len(self._built.schedule.buckets) if self._built.schedule else 1

    @torch.no_grad()
    def reduce(self) -> bool:
        """Average every participating gradient over the group, in place; return whether
        to step (``False`` only under ``nonfinite="skip"`` when the average is not
        finite, the same on every rank).

        Collective: every rank of the group must call it. In overlap mode it waits for
        the buckets launched during backward (launching any left). Invalid gradients
        (sparse, on another device, missing under ``unused_grads="error"``) raise
        before any gradient is touched. Calling it inside :meth:`no_sync` is an error
        (the accumulated gradients would step unaveraged): call it after the block.
        """
        if not self._syncing:
            raise RuntimeError("reduce() was called inside no_sync(): nothing would be averaged "
                               "and each rank would step on its own gradients. Call reduce() "
                               "after the no_sync() block, once per accumulation window; the "
                               "gradients are left as they were")
        if self.world_size == 1:  # nothing to average: the gradients themselves checked
            return self.config.nonfinite == "ignore" or self._alone_finite()
        self.group_built.check("FusedReducer")
        built = self._built
        if built is not None and not built.held():  # replaced or moved parameters: raised before any collective
            if built.schedule is not None:
                built.schedule.drop()  # (what backward launched, waited for and not unpacked)
            raise built.held.error()
        try:
            return self._reduce(self._check_alone() if built is None else None)
        finally:
            if self._built is not None:
                self._built.held.expire()

    @guarded("{cls}.reduce()", "This step's gradients are lost: param.grad may hold this rank's own "
             "gradients, a partial average or stale values (do not step the optimizer); the parameters "
             "and optimizer state are as before the step.")
    def _reduce(self, checked: tuple | None) -> bool:
        keep_cut()
        built = self._built
        first = built is None
        if built is None:
            built = self._built = self._build(*checked)
        built.reattach.settle(done=True)  # re-attached but never written by backward: None again
        built.frozen.check(self._named_parameters, "fastreduce learned the layout", "their gradients would not be "
                           "reduced", "call reducer.rebuild() on every rank after changing requires_grad")
        if built.schedule is not None:  # the first step learns the order: all at finish()
            self.stats.launched_in_backward += built.schedule.next
            missing, works = built.schedule.finish(quiet=first)
        else:
            self._join_notify()  # under Join: this rank is active (overlap: at bucket 0's launch)
            missing, works = self._start_fused(built)
        self._complete(built, works, missing)  # (a compressed step's sums were scaled already)
        self._scale_grads(built, 1.0 if built.compressed and built.compressed.scaled else self._join_factor())
        ok = self._finite(built) if self.config.nonfinite != "ignore" else True
        self._refresh_sizes(built)
        return ok

    def _cut_graphs(self, sizing: Sizing | None = None) -> None:
        """Cut compiled graphs at the buckets (:class:`~fastreduce.compiling.ModeCut`): the backend's size (none
        where "auto" expects shared memory) until "auto" chooses; with no segment after all, until it has measured."""
        if not (self.config.overlap and self.world_size > 1):
            return
        default_mb = self._fixed_mb or default_bucket_mb(dist.get_backend(self.group))
        if sizing is None:
            if self._cut is not None and self._sizer is not None and self._sizer.sizing is not None:
                return self._cut.again(self)  # built again: the cut compiled code has
            device = next((p.device for p in self.model.parameters()), torch.device("cpu"))
            self._cut = ModeCut(self, None if self._sizer and wants_shm(self.config.transport, device) else default_mb,
                               self.model.parameters())
            return
        blind = sizing.link is not None and self._cut.ran_uncut and not self._sizer.refreshed
        self._cut.move(self, sizing.bucket_mb if sizing.buckets > 1 else default_mb if blind else None)

    def _refresh_sizes(self, built: Built) -> None:
        """``bucket_mb="auto"``: the sizes chosen again from the steps' backward times, once (not
        under Join, whose joined ranks run no backward); laid out again if they changed."""
        if self._sizer is None or built.schedule is None or self.under_join:
            return
        if self._cut is not None and self._cut.relearn:  # the next step learns the new pieces' order
            self._cut.relearn, self._sizer.hold = False, True
            return self.rebuild()
        if self._sizer.refresh(built.schedule.backward_s, built.buffer.nbytes, self.group, built.buffer.wire.device):
            if dist.get_rank(self.group) == 0:
                log.info("fastreduce: %s; the buckets are laid out again", self._sizer.sizing.describe())
            self.rebuild()
        self.stats.sizing = self._sizer.sizing

    finish = reduce

    def _finite(self, built: Built) -> bool:
        """One check of the averaged wire buffer; on inf/NaN, ``raise`` or ``skip``."""
        if self._check is None:
            self._check = FiniteCheck(built.buffer.wire.device)
        with span("fastreduce::nonfinite_check"):
            finite = self._check(tuple(built.buffer.flats) if built.compressed else (built.buffer.wire,))
        if finite:
            if built.undo is not None:  # the residuals and PowerSGD's state, for a later skipped step
                built.undo.keep()
            return True
        if built.undo is not None:  # as before this step
            built.undo.undo()
        return self._not_finite("the averaged gradients", built.buffer.wire_views, built.layout.names,
                                "some rank's gradient was not finite, or overflowed the wire dtype; this step's "
                                "gradients are lost (error-feedback residuals and PowerSGD's state are as before "
                                "it).")

    def _alone_finite(self) -> bool:
        """At one rank (a Membership down to one member, LocalSGD's warm-up): the dense
        gradients checked as :meth:`_finite` checks an average; ``raise`` or ``skip``."""
        named = [(n, p.grad) for n, p in self._named_parameters()
                 if p.requires_grad and p.grad is not None and p.grad.layout == torch.strided]
        if not named:
            return True
        if self._check is None:
            self._check = FiniteCheck(named[0][1].device)
        if self._check(tuple(g for _, g in named)):
            return True
        return self._not_finite("the gradients", [g for _, g in named], [n for n, _ in named],
                                "they are as the backward left them.")

    def _not_finite(self, what: str, tensors: list[torch.Tensor], names: list[str], state: str) -> bool:
        """``what`` (``tensors``, named ``names``) held inf or NaN: counted; ``skip``: ``False``
        and a warning; ``raise``: the error naming the first such tensor."""
        self.stats.nonfinite += 1
        if self.config.nonfinite == "skip":
            log.warning("fastreduce: %s hold inf or NaN; reduce() returns False: skip this optimizer step "
                        "(nonfinite='skip')", what)
            return False
        i = first_nonfinite(tensors)
        raise nonfinite_error(what, None if i is None else names[i], state)

    @contextmanager
    def no_sync(self) -> Iterator[None]:
        """Accumulate gradients locally: nothing is communicated inside this block.

        The first :meth:`reduce` after it averages the accumulated gradients once.
        """
        sched = self._built.schedule if self._built else None
        self._syncing = False
        if sched is not None:
            sched.sync = False
        try:
            yield
        finally:
            self._syncing = True
            if sched is not None:
                sched.sync = True

    @torch.no_grad()
    def zero_grad(self) -> None:
        """Zero every gradient in place (one op per dtype) and keep them as views.

        Cheaper than ``optimizer.zero_grad()``: nothing is freed, so the next backward
        accumulates straight into the flat buffer and :meth:`reduce` copies nothing.
        Gradients that are ``None`` stay ``None``, as with ``zero_grad(set_to_none=False)``.
        Before the first :meth:`reduce` it falls back to zeroing each ``param.grad``.
        """
        built = self._built
        if built is None:
            for p in self.model.parameters():
                if p.grad is not None:
                    p.grad.zero_()
            return
        built.buffer.zero_()
        for p, v in zip(built.layout.params, built.buffer.views):
            if p.grad is not None and p.grad is not v:
                p.grad = v

    def reattach(self) -> None:
        """Re-attach gradients freed by ``zero_grad(set_to_none=True)`` as zeroed views of
        the flat buffer now. The model's forward does this by itself (a pre-hook); call
        it before a backward whose forward did not go through the model's own
        ``forward`` (e.g. a trainer that runs a submodule), or the next :meth:`reduce`
        copies the fresh gradients in instead (correct, one copy slower)."""
        if self._built is not None and torch.is_grad_enabled():
            self._built.reattach.before_forward()

    def close(self, drain: bool = True) -> None:
        """Take every hook of this reducer off the model and its parameters (forward
        pre-hook, gradient hooks, the order recorder); :attr:`stats` stay readable. The
        reducer must not be used afterwards. ``drain`` is every mode's (``close(drain)``):
        here nothing is left to wait for, as :meth:`reduce` waits for every reduction
        it launches, and the ones a backward launched that no ``reduce()`` waited for end
        with their group, on their own."""
        remove_hooks([self._forward_hook])
        uncut_graphs(self)
        if self._built is not None:
            self._built.reattach.remove()
            if self._built.schedule is not None:
                self._built.schedule.remove()
            self._built.comm.release(self._built.buffer.wire)  # (its shared-memory segment, if any)
        if self._recorder is not None:
            self._recorder.remove()
            self._recorder = None

    def rebuild(self) -> None:
        """Forget the layout; the next :meth:`reduce` learns it again (collective: all ranks).
        The error-feedback residuals carry over by parameter, a quantized wire's where the
        gradients keep their places, PowerSGD's state where it still fits."""
        log.info("fastreduce: rebuilding the gradient layout on the next reduce()")
        self._keep_state()
        self.close()
        self._built = None
        self._record_order()
        self._forward_hook = optional_before_forward(self.model, self.reattach)
        self._cut_graphs()

    # ------------------------------------------------------------------ every call

    def _adopt(self, built: Built, indices: list[int] | range, direct: bool = False) -> tuple[list[int], bool]:
        """:func:`~fastreduce.grads.adopt` under this reducer's ``unused_grads``; a parameter
        replaced or moved since the layout was learned is an error (in overlap mode from
        backward's hook, before that bucket launches)."""
        if not built.held():
            raise built.held.error()
        missing, moved, direct = adopt(built.layout, built.buffer, indices, direct=direct,
                                       missing_ok=self.config.unused_grads == "zero")
        self.stats.reattached += moved
        return missing, direct

    def _start_fused(self, built: Built) -> tuple[list[int], list[Pending]]:
        missing: list[int] = []
        direct = False
        if not attached(built.layout.params, built.buffer.views):
            # Straight into the wire only where the pack would do nothing else (no
            # divide); it then replaces the pack, graph or not.
            missing, direct = self._adopt(built, range(len(built.layout)),
                                          direct=not (built.plan.prescale or self.config.error_feedback
                                                      or built.compressed))
        if built.compressed and built.compressed.compressing:
            return missing, [built.compressed.launch(0)]
        with span("fastreduce::pack"):
            if built.pack is not None and not direct:
                built.pack()
        if isinstance(built.plan, QuantMean):  # its ``then`` finishes the mean, then unpacks
            return missing, [built.plan.start(unpack=built.unpack)]
        work, _ = built.comm.all_reduce(built.buffer.wire, built.plan)  # unpacked by _complete
        return missing, [(work, built.unpack)]

    def _complete(self, built: Built, works: list[Pending], missing: list[int]) -> None:
        """Wait for each collective in launch order and unpack what it delivered."""
        if built.flags is not None:
            built.flags.fill_(1.0)
            if missing:
                built.flags[missing] = 0.0
            works.append((dist.all_reduce(built.flags, group=self.group, async_op=True), None))
        waited = 0.0
        path = built.compressed
        compressed = path is not None and path.compressing
        with span("fastreduce::wait"):
            for pendings in (works, path.codec.later if compressed else ()):  # the codec's second ones, launched
                for work, then in pendings:                               # by the first ones' ``then``
                    if work is not None:
                        t0 = time.perf_counter()
                        wait_watched(work)
                        waited += time.perf_counter() - t0
                    if then is not None:
                        with span("fastreduce::unpack"):
                            then()
        if missing:
            attach_used(built.layout, built.buffer, built.flags, missing)
            if not self._warned_missing:
                self._warned_missing = True
                names = ", ".join(repr(built.layout.names[i]) for i in missing[:5])
                log.warning("fastreduce: %d parameter(s) got no gradient in this step (%s%s); "
                            "counting them as zero, as unused_grads='zero' asks (logged once)",
                            len(missing), names, ", ..." if len(missing) > 5 else "")
        st = self.stats
        st.calls += 1
        st.wait_seconds += waited
        st.collectives += sum(getattr(w, "collectives", 1) for w, _ in works if w is not None)
        if path is not None:
            st.collectives += path.end_step()
            st.compressed += compressed
        st.bytes_reduced += path.nbytes if compressed else getattr(built.plan, "wire_bytes", built.buffer.nbytes)

    def _named_parameters(self) -> Iterator[tuple[str, torch.nn.Parameter]]:
        """The model's parameters by name: a ``torch.compile`` wrapper's under the names of the
        module it wraps, so that a compiled model and the plain one are reduced alike (PowerSGD
        seeds each matrix's first Q from its name) and load each other's states."""
        return compiled_inner(self.model).named_parameters()
