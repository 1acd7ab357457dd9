"""Decentralized (gossip) data parallelism: each rank mixes its parameters with a few peers.

No global all-reduce: in round t rank r replaces its parameters by
``sum_j W_t[r, j] x_j`` over what the ranks sent, ``W_t`` the round's doubly stochastic
mixing matrix from a :mod:`~fastreduce.modes.topology` (``complete``, ``ring``,
``one-peer-exp``, ``alternating-exp-ring``, or your own). The exchange of a bucket
overlaps the next step's forward and backward. Communication pattern, per step::

    backward:  (the first time, as it ends: build buckets in rank 0's backward order,
               step every bucket's optimizer on the first gradients, launch round 0's
               exchanges; the next forward, where that backward ran compiled)
    backward:  bucket b's last grad ready -> hook: wait for b's exchange of round t-1,
               parameters := the mixed result, b's optimizer (and scheduler) step on
               the gradients (taken at the pre-mix parameters), zero them, send the new
               parameters: launch b's exchange of round t (async)

so a step's update is ``x <- mix(x) - lr * grad(x)``: with a doubly stochastic ``W`` the
mean over ranks follows SGD on the mean of the local gradients. Buckets launch in the
same order on every rank (the overlapped mode's schedule), a bucket whose gradients did
not all arrive (unused parameters) is stepped as the backward ends, before a ``zero_grad()``
can clear them (a compiled backward's: at the next forward). Parameters are views of one flat block
per bucket, and the mix lands in a second block, so the next forward never reads
memory being written; applying the mix swaps the two blocks (the parameters become
views of the other one: no copy). A rank sends its parameter block itself (both blocks
live in the communication layer's buffers: shared memory on one host, where the peers
read it in place); a ``wire_dtype`` other than the parameters' sends a cast copy.

Unlike decent-dp (whose API this mirrors): any world size, any device (no ``.cuda()``),
everything needed to resume in :meth:`DecentralizedDataParallel.state_dict`, float
buffers averaged by :meth:`~DecentralizedDataParallel.global_avg`, a parameter used twice
in one forward is fine (autograd accumulates it once).
"""

from __future__ import annotations

import os
from contextlib import contextmanager
from functools import partial
from typing import Any, Callable, Iterator

import torch
import torch.distributed as dist
from torch import nn

from ..buckets import OrderRecorder, agreed_order
from ..buffer import FloatBuffers, TensorBlock
from ..codecs.quant import check_wire
from ..comm import Pending, complete, get_comm
from ..compiling import cut_graphs, keep_cut, uncut_graphs
from ..engine import require_distributed
from ..faults import guarded
from ..grads import FiniteCheck, NonFinite, NonFiniteGradError, check_nonfinite, one_device, start_from_rank0
from ..hooks import eager_methods, on_grad_ready, remove_hooks
from ..join import JoinableMode
from ..layout import FrozenAtBuild, verify_model
from ..sizing import AUTO, Sizing, check_bucket_mb
from ..torch_internals import at_backward_end, in_backward
from .comm_stats import CommStats
from .gossip_average import GossipAverage
from .gossip_buckets import GossipBuckets
from .gossip_state import DONE, GossipState
from .gossip_step import GossipStep
from .topology import Topology, make_topology

__all__ = ["DecentralizedDataParallel"]

OptimFn = Callable[[list[tuple[str, nn.Parameter]]], torch.optim.Optimizer]
SchedulerFn = Callable[[torch.optim.Optimizer], Any]


class DecentralizedDataParallel(GossipState, GossipAverage, GossipBuckets, GossipStep, nn.Module, JoinableMode):
    """Gossip data parallelism over a time-varying topology (see the module doc).

    Args:
        model: the module to train; ``forward`` calls it.
        optim_fn: ``optim_fn([(name, param), ...]) -> Optimizer``, called once per bucket.
        lr_scheduler_fn: ``lr_scheduler_fn(optimizer) -> scheduler``, per bucket, or ``None``.
        topology: a name in :data:`fastreduce.modes.topology.TOPOLOGIES` or a
            :class:`~fastreduce.modes.topology.Topology`.
        scaler: a ``torch.amp.GradScaler`` (each rank steps it on its own buckets, but for a
            bucket no gradient reached; it is updated once per step).
        grad_clip_norm: clip each bucket's gradients to this norm before its step (0: off).
        group: process group (default: the world).
        bucket_mb: bucket size in MB; ``"auto"`` (the default; ``None`` is the same):
            one bucket. A bucket's exchange is waited for at that bucket's step in the
            next backward, one whole step after its launch whatever the bucket count, so
            more buckets hide no more of it; one bucket pays one launch, one optimizer
            step and one mix per step (:attr:`sizing` says so). A number cuts buckets
            of that size, as the overlapped mode does (a compiled model's graph is then
            cut at them too).
        wire_dtype: dtype the parameters are sent in (default: their own); mixing sums
            in fp32 either way. A quantized wire (``torch.float8_e4m3fn``,
            ``torch.float8_e5m2``, ``"int8"``: one fp32 scale per block of 256) sends each
            peer the quantized *difference* between the parameters and the public copy
            both sides keep of them (CHOCO-SGD, :class:`~fastreduce.comm.quantized.QuantMix`):
            the ranks still reach consensus, and the mean over ranks is kept exactly.
        error_feedback: with a quantized wire, the public copies above (default); ``False``
            sends the quantized parameters themselves, which leaves the ranks apart by
            about the format's relative error (for comparison only).
        local_world_size: ranks per node, for ``alternating-exp-ring`` (default:
            ``$LOCAL_WORLD_SIZE``, as torchrun sets it).
        buffers: ``mix``: float buffers (BatchNorm statistics) are mixed with the same
            topology as each step closes (in the next forward, before the model runs);
            ``local``: each rank keeps its own until :meth:`global_avg` (decent-dp's way).
        nonfinite: gradients holding inf/NaN: ``ignore`` (no check), ``skip`` or
            ``raise``. Gradients never leave their rank here (only parameters go to a
            few neighbours), so there is no average for all ranks to judge alike: each
            rank checks its own gradients of each bucket before stepping that bucket
            (one fused kernel over the bucket's gradients), and the verdict is that
            rank's. ``skip``: the bucket's optimizer step is skipped on that rank (its
            parameters are the mixed ones, its optimizer state untouched), its gradients
            are zeroed and its exchange goes on as usual, so the rounds stay matched and
            no inf/NaN reaches a neighbour; :attr:`skipped_steps` counts such bucket
            steps. ``raise``: the same, then :class:`~fastreduce.NonFiniteGradError`
            (naming the first such parameter) on that rank only, as its backward ends
            (every exchange of the step launched), or from the forward that closes the
            step. With a ``scaler``, the scaler's own check decides.

    The optimizers ``optim_fn`` builds step with torch's fused kernel where torch has one
    for that optimizer and device and ``optim_fn`` chose no implementation (neither
    ``foreach`` nor ``fused`` given): the same update in one kernel per bucket rather
    than torch's per-tensor loop, the CPU default (:mod:`fastreduce.optim_kernels`).
    ``foreach=False`` or ``fused=False`` keeps torch's loop.

    Example::

        >>> ddp = fastreduce.DecentralizedDataParallel(
        ...     model, lambda named: torch.optim.SGD([p for _, p in named], lr=0.1, momentum=0.9),
        ...     topology="one-peer-exp")
        >>> for x, y in batches:
        ...     loss_fn(ddp(x), y).backward()   # each bucket mixes, steps and sends in backward
        >>> ddp.global_avg()                    # exact average of parameters and buffers, to evaluate
    """

    commit_style = "gossip"  # under a Membership (modes/contract.py)
    state_scope = "per_rank"
    optimizer_role = "own"
    mode_name = "gossip"

    def __init__(self, model: nn.Module, optim_fn: OptimFn, lr_scheduler_fn: SchedulerFn | None = None,
                 topology: str | Topology = "complete", scaler: Any = None, grad_clip_norm: float = 0.0, *,
                 group: dist.ProcessGroup | None = None, bucket_mb: float | str | None = AUTO,
                 wire_dtype: torch.dtype | None = None, local_world_size: int | None = None,
                 buffers: str = "mix", nonfinite: NonFinite = "ignore", error_feedback: bool = True):
        super().__init__()
        eager_methods(DecentralizedDataParallel, "_before_forward")
        self.nonfinite = check_nonfinite(nonfinite)
        self.skipped_steps = 0  # bucket steps skipped on this rank for inf/NaN gradients
        self.stats = CommStats()
        """Bytes this rank's exchanges were handed (each block sent, once), seconds waited on them."""
        self._nonfinite_error: NonFiniteGradError | None = None  # raised at the end of the backward
        if buffers not in ("mix", "local"):
            raise ValueError(f"buffers must be 'mix' or 'local', got {buffers!r}")
        self._quant = check_wire(wire_dtype, "DecentralizedDataParallel")
        check_bucket_mb(bucket_mb)  # before any buffer or hook exists
        self._compensate = bool(error_feedback)
        require_distributed()
        if grad_clip_norm < 0:
            raise ValueError(f"grad_clip_norm must be >= 0, got {grad_clip_norm}")
        self.module = model
        self.optim_fn, self.lr_scheduler_fn = optim_fn, lr_scheduler_fn
        self.scaler, self.grad_clip_norm = scaler, grad_clip_norm
        self.group = group
        self.world_size, self.rank = dist.get_world_size(group), dist.get_rank(group)
        if local_world_size is None and os.environ.get("LOCAL_WORLD_SIZE"):
            local_world_size = int(os.environ["LOCAL_WORLD_SIZE"])
        self.topology = make_topology(topology, self.world_size, local_world_size)
        named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
        if not named:
            raise ValueError("no parameter of the model requires grad: nothing to train")
        self.device = one_device(named)
        self.comm = get_comm(group, self.device, None)  # its checks before the all-gather: a rank raises them alone
        verify_model(named, group, self.device, type(self).__name__)
        self._init_join(group, self.device)
        self._join_owes_close = False  # a joined rank's shadow step is closed at the next one
        self.wire_dtype = wire_dtype
        self.bucket_mb = None if bucket_mb in (None, AUTO) else float(bucket_mb)  # None: "auto"
        self.sizing: Sizing | None = None  # "auto"'s choice, once built
        self._named = named
        self._frozen = FrozenAtBuild(model.parameters())  # in no bucket: checked at every step's forward
        self.buffer_mode = buffers  # not "buffers": that is nn.Module.buffers(), which torch and users call
        self._check = FiniteCheck(self.device)  # nonfinite's one fused check
        self._float_buffers = FloatBuffers(model)
        self._buffer_blocks: list[tuple[TensorBlock, TensorBlock]] | None = None  # per dtype: (sent, mixed)
        self._comm_blocks: list[torch.Tensor] = []  # what comm.buffer gave the buckets' layout
        self._buffer_comm_blocks: list[torch.Tensor] = []  # and the float buffers' mix
        self._round = 0  # the round of the next exchange
        self._accumulating = False
        self._built = False
        self._broadcast_from_rank0()
        if self.bucket_mb is not None:  # one bucket ("auto") steps after the backward: nothing to cut
            cut_graphs(self, self.bucket_mb, (p for _, p in named))  # steps during a compiled backward
        # The hooks last, once nothing can raise: a failed build leaves the model unhooked.
        self._recorder: OrderRecorder | None = OrderRecorder([p for _, p in named])
        self._synced_backward = False  # the first step is taken after a backward outside no_sync
        self._first_queued = False  # the first step is taken as that backward ends
        self._end_queued = False  # a synced backward's end is to finish its step (_end_backward)
        self._owes_close = False  # a step taken as its backward ended, closed in the next forward
        self._marks = on_grad_ready([p for _, p in named], self._mark_synced)

    # ------------------------------------------------------------------ public

    @property
    def membership_refusal(self) -> str | None:
        """What a Membership cannot keep training (modes/contract.py): a quantized wire keeps a
        public copy of each neighbour's parameters, which a new epoch's topology would not match."""
        return None if self._quant is None else ("gossip with a quantized wire (use a float wire_dtype: bfloat16 "
                                                 "halves the bytes)")

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return self.forward_through(self.module, *args, **kwargs)

    def forward_through(self, module: nn.Module, *args: Any, **kwargs: Any) -> Any:
        """The wrapper's forward, calling ``module`` in place of the module it wraps: the same
        module compiled (``torch.compile(model)``, as a trainer compiles it), its parameters
        the wrapped module's. A forward with grad enabled closes the last step, whatever
        the module's ``training`` (a model fine-tuned in ``eval()``, BatchNorm frozen, steps
        as in ``train()``); one under ``no_grad`` (an evaluation) leaves it open."""
        if torch.is_grad_enabled():
            self._before_forward()  # eager (eager_methods): a graph break where the wrapper is compiled
        return module(*args, **kwargs)

    @guarded("{cls}.forward() (closing the last step)", "The parameters are lost: some buckets "
             "took the last step and others did not.")
    def _before_forward(self) -> None:
        if self.under_join and self._step_open():
            self._join_notify()  # under Join: this rank is active; closing the step opens the next
        self._check_model()  # (after Join's notify: a joined rank's shadow checks too)
        self._catch_up()
        self._raise_nonfinite()
        keep_cut()

    @contextmanager
    def no_sync(self) -> Iterator[None]:
        """Accumulate gradients: backward under this block updates and sends nothing."""
        before = self._accumulating
        self.set_accumulate_grad(True)
        try:
            yield
        finally:
            self.set_accumulate_grad(before)

    def set_accumulate_grad(self, enable: bool = True) -> None:
        """decent-dp's switch: while ``True``, backward only accumulates gradients."""
        self._accumulating = enable
        if self._built:
            self._schedule.sync = not enable

    @property
    def step(self) -> int:
        """Rounds of exchange launched so far."""
        return self._round

    @property
    def num_buckets(self) -> int:
        """Buckets (0 before the first step is closed)."""
        return len(self._buckets) if self._built else 0

    def wait_exchanges(self) -> None:
        """Finish the step in progress and wait for every exchange in flight (their mixes
        are still applied at each bucket's next step, as without the wait)."""
        self._drain()

    def close(self, drain: bool = True) -> None:
        """Take every hook of this mode off the model and its parameters (the order
        recorder, the gradient hooks, the compiled backward's cuts) and give the
        communication layer back the blocks it gave the mode (shared memory on one host);
        the parameters keep their values, moved to memory of their own, so that the
        shared memory is freed with the mode. The mode must not be used afterwards.
        ``drain=False``: the exchanges in flight are dropped, not waited for (a peer is
        gone). Once closed, a second call does nothing (it would finish a step over a
        group a peer left)."""
        if self.__dict__.get("_closed"):
            return
        self._closed = True
        if drain:
            self._drain()
        if self._recorder is not None:
            self._recorder.remove()
            self._recorder = None
        remove_hooks(self._marks)
        self._marks = []
        if self._built:
            self._schedule.remove()
            self._own_memory()
        self._give_back(self._comm_blocks)
        self._give_back(self._buffer_comm_blocks)
        uncut_graphs(self)

    # ------------------------------------------------------------------ build

    @torch.no_grad()
    def _broadcast_from_rank0(self) -> None:
        start_from_rank0(list(self.module.parameters()) + list(self.module.buffers()), self.group,
                         "DecentralizedDataParallel")  # frozen ones too

    def _mark_synced(self, _i: int) -> None:
        if self._accumulating:
            return
        self._synced_backward = True
        if not self._first_queued and in_backward() and not torch.compiler.is_compiling():  # compiled
            self._first_queued = True  # autograd: at the next forward
            at_backward_end(self._first_step)

    @guarded("{cls}'s first step (as the first synced backward ends)", "The parameters are lost: some "
             "buckets took the first step and others did not.")
    def _first_step(self) -> None:
        """The first synced backward's end: lay out the buckets in the order every rank
        agrees on and step each one on these gradients, before the caller may zero them
        (``zero_grad()`` before the next forward, as trainers do); the next forward closes it."""
        if self._built or self._recorder is None:
            return
        order = agreed_order(self._recorder.remove(), len(self._named), self.group)
        self._recorder = None
        self._build(order)
        for b in range(len(self._buckets)):
            self._update(b, False)
        self._owes_close = True

    def _grad_arrived(self, _i: int) -> None:
        """Every gradient hook of the built schedule: the first of a synced backward has
        :meth:`_end_backward` run as that backward ends (a compiled backward's step is
        finished by the next forward instead, as :meth:`_mark_synced` leaves its first)."""
        if self._accumulating or self._end_queued:
            return
        if self._owes_close:  # nothing changed yet: the step taken stands, this backward adds nothing
            raise RuntimeError("a second backward before the next forward: every step of "
                               "DecentralizedDataParallel is one forward and one backward; run every "
                               "backward but the last of an accumulation under no_sync()")
        if in_backward() and not torch.compiler.is_compiling():
            self._end_queued = True
            at_backward_end(self._end_backward)

    def _end_backward(self) -> None:
        """A synced backward's end: step the buckets whose gradients did not all arrive
        (unused parameters) on this backward's gradients, before the caller may zero them
        (``zero_grad()`` before the next forward); the next forward closes the step."""
        self._end_queued = False
        self._schedule.finish(quiet=True)
        self._owes_close = True

    def _catch_up(self) -> None:
        """Close the last step: build after the first backward, or step the buckets whose
        gradients did not all arrive where the backward's end did not (a compiled backward),
        then mix the float buffers and advance the round."""
        self._end_queued = False  # (a backward that raised never ran its end)
        if not self._built:
            if self._recorder is None or not self._synced_backward:
                return
            self._first_step()
            self._close_step()
            return
        if self._owes_close or self._join_owes_close:
            self._owes_close = self._join_owes_close = False
            self._close_step()
            return
        sched = self._schedule
        if any(sched.fired) or sched.next:
            sched.finish(quiet=True)
            self._close_step()

    def _check_model(self) -> None:
        """Before a step is closed (its collectives): a parameter replaced or added since the
        buckets were laid out (:class:`~fastreduce.layout.ParamsHeld`: their hooks and blocks
        hold the old one), or frozen at construction and requiring grad now, is in no bucket
        (raised on every rank that made the change)."""
        if self._built:
            self._held.check()
        if self._frozen.params:
            self._frozen.check(self.module.named_parameters, "DecentralizedDataParallel was built", "no bucket "
                               "holds them: they would never be stepped nor mixed", "call close() on every rank and "
                               "build DecentralizedDataParallel again after changing requires_grad")

    def _step_open(self) -> bool:
        """Whether :meth:`_catch_up` has a step to close (collectives to run)."""
        if not self._built:
            return self._recorder is not None and self._synced_backward
        return (self._owes_close or self._join_owes_close or any(self._schedule.fired)
                or bool(self._schedule.next))

    def _join_shadow(self) -> None:
        """A joined rank's step under Join: close its last step, then every bucket
        exchanges as on the active ranks, with no optimizer step (the rank keeps mixing
        its parameters with its peers', it adds no gradient); closed at the next one."""
        self._check_model()
        self._catch_up()
        if not self._built:
            raise RuntimeError("a rank joined before its first synced step: under Join every rank "
                               "must train at least one step (the first one lays out the buckets)")
        self._schedule.finish(quiet=True)
        self._join_owes_close = True

    def _close_step(self) -> None:
        self._mix_buffers()
        self._round += 1

    @torch.no_grad()
    def _mix_buffers(self) -> None:
        """``buffers="mix"``: this round's mix of the float buffers, synchronously (they
        are small, and the forward about to run reads them), one block per dtype (each
        mixed in its own: a float64 mean is not rounded to float32)."""
        bufs = self._float_buffers.now()  # (the module's now: one it replaced is mixed, not the first)
        if self.buffer_mode != "mix" or not bufs:
            return
        if self._buffer_blocks is None:  # made on the first step
            private = lambda n, d: torch.zeros(n, dtype=d, device=self.device)  # noqa: E731
            self._buffer_blocks = list(zip(TensorBlock.per_dtype(bufs, self._taking(self._buffer_comm_blocks)),
                                           TensorBlock.per_dtype(bufs, private)))
        for blocks in zip(*self._buffer_blocks):
            TensorBlock.follow(blocks, bufs, type(self).__name__)
        matrix = self.topology.mixing(self._round)
        for send, out in self._buffer_blocks:
            send.load()
            pending = self.comm.mix(send.flat, out.flat, matrix)
            self.stats.wire_bytes += send.flat.nbytes
            with self.stats.waiting():
                complete(pending)
            out.store()

    # ------------------------------------------------------------------ every bucket, every step

    @guarded("{cls}'s exchange of a bucket (in backward, or closing the step in forward)", "The parameters "
             "are lost: the buckets before this one took this step, this one and those after it did not.")
    @torch.no_grad()
    def _update(self, b: int, _packed: bool) -> Pending:
        """Bucket ``b``'s step: apply the mix of its last exchange, step its optimizer,
        send the new parameters (the next round's exchange)."""
        flat, mixed = self._flats[b], self._mixed[b]
        pending = self._exchanges[b]
        if pending is not None:
            with self.stats.waiting():
                complete(pending)
            flat, mixed = self._swap(b)
        if not self._join_joined:  # a joined rank (Join) mixes but does not step
            self._step_optimizer(b)
        matrix = self.topology.mixing(self._round)
        if self._qmix is not None:
            row, col, _, _ = self.comm.rows_of(matrix)  # read once per matrix, not per bucket and step
            self._exchanges[b] = self._qmix[b].start(flat, mixed, row, col)
            self.stats.wire_bytes += self._qmix[b].wire_bytes
            return DONE
        send = self._sends[b] if self._sends is not None else flat  # (the block itself)
        pack = None if send is flat else partial(send.copy_, flat)
        self._exchanges[b] = self.comm.mix(send, mixed, matrix, pack)
        self.stats.wire_bytes += send.nbytes
        return DONE

    def _swap(self, b: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Apply bucket ``b``'s mix: its parameters become views of the mixed block, and
        the block they used takes the next mix."""
        flat, mixed = self._mixed[b], self._flats[b]
        self._flats[b], self._mixed[b] = flat, mixed
        views = self._views[b]
        for k, (p, a, m) in enumerate(views):
            p.data = m
            views[k] = (p, m, a)
        return flat, mixed

    @guarded("the wait for {cls}'s exchanges in flight", "The exchange in flight is lost; the parameters are this "
             "rank's own, unmixed with the other ranks' since the last exchange that completed.")
    def _drain(self) -> None:
        """Finish the step in progress and wait for every exchange in flight (its mixed
        result stays pending, to be applied at the bucket's next step)."""
        self._catch_up()
        if not self._built:
            return
        for b, pending in enumerate(self._exchanges):
            if pending is not None and pending is not DONE:
                with self.stats.waiting():
                    complete(pending)
                self._exchanges[b] = DONE

    def _state_tensors(self) -> list[torch.Tensor]:
        """What global_avg averages: the flat parameter blocks (or the parameters, before
        the first step) and the float buffers."""
        params = list(self._flats) if self._built else [p.data for _, p in self._named]
        return params + [b for b in self.module.buffers() if b.is_floating_point()]
