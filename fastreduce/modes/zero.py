"""ZeRO-sharded optimizer step: each rank keeps 1/N of the optimizer state and steps 1/N.

Communication pattern, per step (N ranks, rank r)::

    backward:  grad of p ready -> hook: pending[bucket] -= 1; bucket complete ->
               reduce-scatter it: chunk r of its mean lands in rank r's shard grad
    step():    launch the buckets left, wait for all; (GradScaler: unscale the shard,
               one MAX all-reduce of the inf flag); which parameters some rank's
               backward reached (a flag each, MAX; in clip_grad_norm_'s all-reduce where
               it ran); the wrapped torch optimizer steps the shard's pieces of those
               (fp32 master weights for bf16/fp16 params), as torch.optim skips a
               parameter without a gradient; copy the shard
               back into the parameters; all-gather every bucket of parameters, async,
               the last bucket (the first layers, read first by the next forward) first
    forward:   (``module=`` given) a pre-hook waits for the buckets of the module's
               own parameters; else step() waited before returning; gradients that
               ``zero_grad()`` set to None come back as zeroed views of the buffer

Layout: the trainable parameters of each param group, in reverse registration order
(the order backward tends to produce their grads), are cut per dtype into buckets of
about ``bucket_mb``; every bucket is padded to a multiple of ``N x 64`` elements and
split into N equal chunks, so the shards are exactly balanced (a parameter may span
two ranks) and each chunk is whole cache lines. Parameters become views of one flat
buffer per dtype, gradients views of the communication layer's wire buffer (see
:class:`~fastreduce.buffer.FusedBuffer`): a reduce-scatter and an all-gather move the
bytes of one all-reduce, and the optimizer touches 1/N of the elements.

What a rank holds is in :mod:`.zero_shard`, the torch optimizer over its pieces of the
parameters in :mod:`.zero_pieces`, inf/NaN and a GradScaler in :mod:`.zero_finite`, the
gradients' buckets and hooks in :mod:`.zero_grads`, the checkpoints (torch.optim's format,
DCP ranges that load onto any world size) in :mod:`.zero_state`; docs/zero.md: the peers' designs.
"""

from __future__ import annotations

import itertools
import logging
import math
from contextlib import contextmanager
from functools import partial
from typing import Any, Callable, Iterable, Iterator

import torch
import torch.distributed as dist

from ..buckets import make_buckets
from ..buffer import FusedBuffer, params_as_views
from ..codecs.quant import BlockQuant
from ..comm import Pending, complete, get_comm
from ..compiling import graphs_wait, keep_cut, recut, uncut_graphs, wait_in_graphs
from ..engine import GroupSnapshot, require_distributed
from ..faults import all_reduce_watched, guarded
from ..grads import FiniteCheck, NonFinite, check_grad, check_nonfinite, one_device
from ..hooks import forward_waits, remove_hooks, stand_down
from ..layout import FrozenAtBuild, GradLayout, bucket_runs, counted, holding_dtype, verify_across_ranks, wire_word
from ..profiling import span
from ..optim_kernels import fused_if_possible
from .comm_stats import CommStats
from .zero_pieces import ShardOptimizer, kinds
from .zero_shard import make_shards
from .zero_config import ELEMENTWISE_OPTIMIZERS, check_settings, trainable, zero_bucket_mb, zero_buckets
from .zero_finite import ZeroFinite
from .zero_grads import ZeroGradients
from .zero_join import ZeroJoin
from .zero_mirror import Placement, ZeroMirror, copies_of
from .zero_state import ZeroCheckpointing

__all__ = ["ELEMENTWISE_OPTIMIZERS", "ZeroOptimizer", "zero_bucket_mb"]

log = logging.getLogger(__name__)


class ZeroOptimizer(ZeroGradients, ZeroCheckpointing, ZeroFinite, torch.optim.Optimizer, ZeroJoin):
    """A torch optimizer whose state, step and master weights are sharded across ranks.

    It averages the gradients itself (no DDP): build it over the model's parameters,
    then per step ``loss.backward(); opt.step(); opt.zero_grad()``. It steps as
    ``optimizer_class`` steps the whole model on the mean gradient: a parameter that no
    rank's backward reached this step (``grad`` ``None`` everywhere: an expert given no
    token) is skipped, with its state.

    Args:
        params: tensors or param-group dicts, as for any torch optimizer.
        optimizer_class: an element-wise torch optimizer (:data:`ELEMENTWISE_OPTIMIZERS`
            or a subclass): SGD, Adam, AdamW, Adagrad, RMSprop, ...
        group: process group (default: the world).
        wire_dtype: dtype of the reduce-scatter (``None``: the gradients' own; where they differ, the
            one that holds them all, float32 for fp16 with bf16); bf16/fp16 halve the bytes; ``torch.float8_e4m3fn``,
            ``torch.float8_e5m2`` or ``"int8"`` quarter them (encoded chunks, a scale per
            256, summed in fp32 by each shard's owner: one rounding).
        gather_dtype: dtype of the parameters' all-gather (default: their own); bf16
            for fp32 parameters halves it: the parameters then hold the fp32 masters
            (kept apart, in :meth:`state_dict`) rounded to bf16, as FSDP2's
            ``param_dtype=torch.bfloat16`` computes. Never fp8; ignored on one rank.
        error_feedback: with a quantized wire, each rank adds what its last encoding
            rounded away to the next step's gradients (per rank; ``Checkpointer`` keeps it).
        accumulate_dtype: ``torch.float32`` sums a low-precision wire in fp32 on NCCL
            and HCCL too (all-to-all and a local sum: the same bytes, two roundings at
            any world size); the shared-memory and Gloo paths always do.
        overlap: reduce-scatter each bucket from backward hooks as soon as its grads
            are ready (else all at ``step()``).
        bucket_mb: bucket size on the wire, MB; ``"auto"`` or ``None`` (default): chosen when built (``.sizing``).
        transport: ``auto`` / ``shm`` / ``process_group`` (see :class:`~fastreduce.comm.Comm`).
        module: the model (compiled or not); with it the parameter all-gather after
            ``step()`` is waited per bucket where the next forward first reads it (forward
            pre-hooks; compiled, before each piece), overlapping the forward, and in full
            before ``module.state_dict()`` / ``load_state_dict()``; read parameters any
            other way after :meth:`wait_params`. Without it ``step()`` waits before returning.
            With it, too, gradients that ``zero_grad()`` set to ``None`` come back as zeroed
            views of the flat buffer at the next forward in grad mode (:mod:`.zero_grads`),
            so backward allocates none (and ``bucket_mb="auto"`` on one host is one bucket).
        redundant: keep each shard on ``k`` more ranks (``True``: 1; at most every other
            rank) and step the copies alongside (:mod:`.zero_mirror`): no shard is lost with
            any k ranks, nor with a whole host where the group spans more than k hosts (the
            copies go to other hosts first), what :class:`~fastreduce.Membership` needs to
            train on after a loss. Costs 4P/N more memory per rank and copy with AdamW and
            kP/N more bytes sent per step; no ``scaler``.
        scaler: the ``torch.amp.GradScaler`` that drives this optimizer, if any: the
            inf/NaN check then spans every rank's shard.
        nonfinite: averaged gradients holding inf/NaN at :meth:`step`: ``ignore`` (no
            check); ``raise`` (:class:`~fastreduce.NonFiniteGradError` on every rank,
            naming the first such parameter; nothing is stepped); ``skip`` (the step is
            skipped on every rank: parameters and optimizer state stay as they were;
            :attr:`last_step_skipped` says so and :attr:`skipped_steps` counts it, as
            ``GradScaler`` skips). A rank holds only its shard of the average, so the
            verdict costs one fused check of the shard and a one-element MAX all-reduce
            per step (about 0.1 ms on Gloo); naming the parameter takes a second one, on
            the error path only. A step driven by a ``scaler`` is left to the scaler's own check.
        **defaults: the optimizer's hyperparameters (``lr``, ``weight_decay``, ...).

    Example::

        >>> opt = fastreduce.ZeroOptimizer(model.parameters(), torch.optim.AdamW, lr=1e-3,
        ...                                weight_decay=0.1, module=model)
        >>> sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, s / 100))
        >>> for x, y in batches:
        ...     loss_fn(model(x), y).backward()   # buckets reduce-scatter during backward
        ...     opt.clip_grad_norm_(1.0)          # global norm over every rank's shard
        ...     opt.step()                        # 1/N of AdamW, then all-gather
        ...     opt.zero_grad()                   # None now, views again at the next forward
        ...     sched.step()
    """

    _step_supports_amp_scaling = True  # GradScaler calls step() itself, see _scaled()
    commit_style = "zero"  # under a Membership (modes/contract.py)
    state_scope = "sharded"
    optimizer_role = "self"
    mode_name = "zero"
    membership_settings = {"redundant": True}
    membership_why = ("each rank's optimizer shard is then also kept on another rank (redundant=k: on k others), "
                      "so it is not lost with its rank (4P/N more memory per rank and copy with AdamW)")

    def __init__(self, params: Iterable[torch.Tensor] | Iterable[dict[str, Any]],
                 optimizer_class: type[torch.optim.Optimizer] = torch.optim.AdamW, *,
                 group: dist.ProcessGroup | None = None, wire_dtype: torch.dtype | str | None = None,
                 accumulate_dtype: torch.dtype | None = None, overlap: bool = True,
                 bucket_mb: float | str | None = None, transport: str | None = None,
                 module: torch.nn.Module | None = None, scaler: Any = None, nonfinite: NonFinite = "ignore",
                 error_feedback: bool = False, gather_dtype: torch.dtype | None = None, redundant: bool | int = False,
                 **defaults: Any):
        quant = check_settings(optimizer_class, wire_dtype, accumulate_dtype, bucket_mb, error_feedback, gather_dtype)
        copies = copies_of(redundant)
        if copies and scaler is not None:
            raise ValueError("ZeroOptimizer(redundant=...) takes no GradScaler (a shard's copies would need "
                             "the scaler's verdict too): train in bf16, or without redundant=")
        self.gather_dtype = gather_dtype
        self.nonfinite = check_nonfinite(nonfinite)
        self.skipped_steps = 0  # steps skipped on every rank for inf/NaN (nonfinite="skip")
        self.last_step_skipped = False  # the last step() was skipped (nonfinite="skip", or the scaler's inf)
        self.stats = CommStats()
        """Bytes this rank's reduce-scatters and all-gathers were handed, seconds waited on them."""
        require_distributed()
        params = [{**g, "params": _listed(g["params"])} if isinstance(g, dict) and "params" in g else g
                  for g in params]  # (read more than once below: a group's generator too)
        probe = optimizer_class([torch.zeros(1, requires_grad=True)], **defaults)  # checks defaults
        if dist.get_world_size(group) > 1:  # one rank: the plain optimizer, its own kernel
            defaults = fused_if_possible(optimizer_class, params, defaults)  # (the shards' kernel: not in
            # param_groups, which a torch optimizer loading this one's state_dict() takes as its own)
        self._ready = False
        super().__init__(params, dict(probe.defaults))
        self._ready = True
        self._shadowing = False  # a joined rank's step (Join): it used no parameter
        self._used_mask: torch.Tensor | None = None  # this step's parameters with a gradient on some rank
        self.optimizer_class = optimizer_class
        self.inner_kwargs = defaults
        self.group = group
        self.world_size = dist.get_world_size(group)
        self.group_built = GroupSnapshot(group)
        self.rank = dist.get_rank(group)
        self.overlap = overlap
        self.scaler = scaler
        self._syncing = True
        self._reduced = False  # this step's reduce-scatter is done
        self._spent: int | None = None  # the last step reduced the gradients: the buffer's version then, until zero_grad()
        self._found: torch.Tensor | None = None  # set when the shard was unscaled this step
        self._gathers: list[Pending | None] = []
        self._module_hooks: list[Any] = []
        self._forward_waits: bool | None = False  # module= given: forward pre-hooks (and compiled code) wait
        self._graph_waits = False  # dynamo's DDP pass puts the waits into compiled code
        self.redundant = redundant
        self.mirrors: list[ZeroMirror] = []  # this rank's copies of other ranks' shards (redundant=)
        self.placement: Placement | None = None
        self._commit_point: Callable[[], None] | None = None  # commit_point(): e.g. Membership's vote
        self._held: tuple[bool, list[bool] | None] | None = None  # (skip, used) of a step its commit point ended
        self.params_stale = False
        """The shards stepped but their all-gather has not completed: the parameters are
        partly the last step's (what :func:`.zero_mirror.reshard` mends)."""
        self._build(module, wire_dtype, accumulate_dtype, bucket_mb, transport, quant, error_feedback)
        if copies and self.world_size > 1:
            self.placement = Placement.of_group(group, copies)
            self.mirrors = [ZeroMirror(self, j) for j in range(1, self.placement.copies + 1)]
        self._check = FiniteCheck(self.device)  # nonfinite's and the scaler's one fused check
        self._init_join(group, self.device)
        self._clip_args: tuple[float, float] | None = None  # this step's clip_grad_norm_, for Join
        self._last_clip: tuple[float, float] | None = None  # the last step's: a joined rank repeats it

    # ------------------------------------------------------------------ build

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        if getattr(self, "_ready", False):
            raise RuntimeError("ZeroOptimizer cannot take a param group after construction: its "
                               "shards are laid out then; pass every group to the constructor")
        super().add_param_group(param_group)

    def _build(self, module: torch.nn.Module | None, wire_dtype: torch.dtype | None,
               accumulate_dtype: torch.dtype | None, bucket_mb: float | None, transport: str | None,
               quant: BlockQuant | None, error_feedback: bool) -> None:
        names = {id(p): n for n, p in module.named_parameters()} if module is not None else {}
        named, group_of = trainable(self.param_groups, names)  # ValueError: a parameter listed twice
        if not named:
            raise ValueError("no parameter given to ZeroOptimizer requires grad: nothing to optimize")
        self.frozen = FrozenAtBuild(p for pg in self.param_groups for p in pg["params"])
        device = one_device(named)
        for n, p in named:
            if p.grad is not None:
                check_grad(n, p, device)
        self.device = device
        comm = self.comm = get_comm(self.group, device, transport)
        wire = torch.float32 if quant else wire_dtype or holding_dtype(p.dtype for _, p in named)
        # Reverse registration order: roughly the order backward produces the grads.
        order = list(range(len(named)))[::-1]
        named = [named[i] for i in order]
        group_of = [group_of[i] for i in order]
        views = self._hook_forward(module)  # dropped gradients come back as views before each forward
        mb, first, cut, self.sizing = zero_buckets(bucket_mb, comm, named, wire, fixed=quant is not None,
                                                   views=views)
        recut(self, cut, (p for _, p in named))  # reduce-scatters in a compiled backward too (no cut: 1 bucket)
        segments = bucket_runs(named, group_of, int(mb * 2**20) // wire.itemsize, int(first * 2**20) // wire.itemsize)
        pad = math.lcm(comm.shard_multiple, self.world_size * quant.block) if quant else comm.shard_multiple
        self.layout = layout = GradLayout(named, wire, segments=segments, pad_to=pad)
        verify_across_ranks(layout, self.group, device)
        self.buffer = FusedBuffer(layout, wire, device, 1, comm.buffer(layout.numel, wire))
        self.buckets = make_buckets(layout, self.buffer, 2**62)  # one per segment, in segment order
        assert [b.slots[0] for b in self.buckets] == list(itertools.accumulate(
            [0] + [len(seg.slots) for seg in layout.segments[:-1]]))
        # On one host the parameters are this rank's region of a shared segment: the
        # all-gather pulls the other ranks' chunks straight into them.
        flats = params_as_views(layout, comm.buffer)
        self.shards = make_shards(layout, flats, self.buckets, [group_of[m[0]] for m in segments], self.rank,
                                  self.world_size, separate_out=self.scaler is not None,
                                  gather=self.gather_dtype if self.world_size > 1 else None, alloc=comm.buffer)
        self.inner = ShardOptimizer(self.optimizer_class, self.param_groups, [s.group for s in self.shards],
                                    [s.master for s in self.shards],
                                    [self.pieces_of(s, self.rank) for s in range(len(self.shards))], self.inner_kwargs)
        self._build_grads(module, accumulate_dtype, quant, error_feedback)
        if module is not None:  # its forward waits for the gathers, compiled or not
            bucket_of = {id(p): b for b, bucket in enumerate(self.buckets) for p in bucket.params}
            self._graph_waits = wait_in_graphs(self._wait_gathers, bucket_of)
            self._module_hooks, self._forward_waits = forward_waits(  # compiled after all: step() waits (None)
                module, bucket_of, self._wait_gathers, "ZeroOptimizer", "the parameter all-gather",
                lambda: setattr(self, "_forward_waits", None), self._graph_waits)
        if self.rank == 0:
            log.info("fastreduce: ZeroOptimizer(%s): %s in %s, %s wire, %d ranks, "
                     "%.1f MB of optimizer shard per rank", self.optimizer_class.__name__, layout.describe(),
                     counted(len(self.buckets), "bucket"), wire_word(wire), self.world_size,
                     sum(s.master.numel() for s in self.shards) * 4 / 2**20)

    # ------------------------------------------------------------------ public

    @property
    def num_buckets(self) -> int:
        return len(self.buckets)

    def state_bytes(self) -> int:
        """Bytes of optimizer state this rank holds (its shard's state and fp32 masters;
        with ``redundant=`` also its copies of other ranks': masters, state, gradients)."""
        n = sum(t.nbytes for st in self.inner.state.values() for t in st.values() if torch.is_tensor(t))
        n += sum(s.master.nbytes for s in self.shards if s.low)
        for m in self.mirrors:
            n += sum(t.nbytes for st in m.inner.state.values() for t in st.values() if torch.is_tensor(t))
            n += sum(x.nbytes for x in m.masters) + sum(b.nbytes for b in m.recv.values())
            n += sum(b.nbytes for b in m.send.values())
        return n

    @guarded("{cls}.clip_grad_norm_()", "This step's gradients are averaged but not clipped; the "
             "parameters and optimizer state are as before the step.")
    @torch.no_grad()
    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        """Clip the averaged gradients by their global norm; return that norm.

        Call after backward and before :meth:`step`, on every rank: it finishes the
        reduce-scatter, takes the norm of every rank's shard (one all-reduce of a
        scalar), and scales the shard, as ``torch.nn.utils.clip_grad_norm_`` would on
        the full averaged gradients. Under a ``scaler`` it unscales the shard first.
        """
        self._reduce()
        self._unscale_for_scaler()
        grads = [s.master.grad for s in self.shards]
        mirrored = grads + [g for m in self.mirrors for g in m.grads()]  # scaled alike
        norm_type = float(norm_type)
        self._clip_args = (max_norm, norm_type)
        norms = torch.stack(torch._foreach_norm(grads, norm_type)).float()
        inf = norm_type == float("inf")
        local, op = (norms.max(), dist.ReduceOp.MAX) if inf else (norms.pow(norm_type).sum(), dist.ReduceOp.SUM)
        if self.world_size > 1:
            all_reduce_watched(local, op, self.group)
        total = local if inf else local.pow(1.0 / norm_type)
        coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
        torch._foreach_mul_(mirrored, coef.to(grads[0].dtype))
        return total

    @guarded("{cls}.step()", "The step did not complete: its gradients are lost and the parameters "
             "may be partly updated.")
    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:  # type: ignore[override]
        """Average the gradients (if :meth:`clip_grad_norm_` has not), step the shard and
        all-gather the parameters. Collective. ``closure`` re-evaluates the loss once,
        before the step, as for SGD/Adam (optimizers that call it repeatedly, such as
        LBFGS, are not element-wise and refused at construction)."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self._wait_gathers()
        keep_cut()
        if self._forward_waits is None:  # outside any compiled frame: the hooks come off
            self._forward_waits = stand_down(self._module_hooks)
        self._held = None
        self._reduce()
        try:
            skip = self._scaled() or self._nonfinite()
            self.last_step_skipped = skip
            used = None if skip else self._used()
            if self._commit_point is not None:  # the last collective is behind (commit_point())
                self._held = (skip, used)
                self._commit_point()
                self._held = None
            if not skip:
                self._step_shards(used)
                self.gather_params()
            self._last_clip = self._clip_args  # a joined rank repeats a step's clip only if it completed
        finally:  # done or raised, this step's gradients are spent: the next step reduces its own
            self._spent = self._grads_version() if self._reduced else None
            self._reduced, self._found, self._clip_args, self._used_mask = False, None, None, None
        return loss

    def close(self, drain: bool = True) -> None:
        """Take every hook of this optimizer off the model and its parameters (gradient
        hooks, forward pre-hooks); it must not be stepped afterwards. ``drain``: the last
        all-gather is waited for first (``False``: dropped, a peer was lost)."""
        if drain:
            self._wait_gathers()
        self._gathers = []
        remove_hooks(self._module_hooks + ([self._forward_reattach] if self._forward_reattach is not None else []))
        self._module_hooks, self._forward_reattach = [], None
        self._forward_waits = False  # no forward waits for a gather now: a step() after this waits itself
        uncut_graphs(self)
        self._reattach.remove()
        if self._schedule is not None:
            self._schedule.remove()
        self._let_go()

    @contextmanager
    def commit_point(self, fn: Callable[[], None]) -> Iterator[None]:
        """Within this block, each :meth:`step` calls ``fn()`` once every gradient
        collective of the step is behind it and before any shard steps (even one that is
        then skipped for a non-finite gradient). What ``fn`` raises ends the step there:
        nothing stepped on this rank, the parameters and optimizer state as before, the
        step's gradients held until the next step (:meth:`step_held` steps them; the next
        backward's are reduced at the next step). :class:`~fastreduce.Membership` makes
        sure here that every rank got this far (:meth:`all_arrived`; with ``redundant=True``
        every shard's averaged gradients are then on two ranks, so the step can stand
        through a loss)."""
        if self._commit_point is not None:
            raise RuntimeError("ZeroOptimizer.commit_point() is already in use: blocks do not nest")
        self._commit_point = fn
        try:
            yield
        finally:
            self._commit_point = None

    def step_held(self) -> None:
        """Step the shards (this rank's and its copy) with the averaged gradients of the last
        :meth:`step`, which its :meth:`commit_point` ended (it raised); the parameters are
        not gathered (:attr:`params_stale`). Local: for a :class:`~fastreduce.Membership`
        whose survivors learn that another survivor committed that step."""
        if self._held is None:
            raise RuntimeError("ZeroOptimizer.step_held(): no step is held (only one that its commit_point "
                               "ended, before the next step)")
        (skip, used), self._held = self._held, None
        if not skip:
            self._step_shards(used)

    @property
    def holds_step(self) -> bool:
        """Whether the last :meth:`step` was ended by its :meth:`commit_point` with its
        averaged gradients complete (:meth:`step_held` would step them)."""
        return self._held is not None

    def kept_without(self, ranks: set[int]) -> bool:
        """Whether every shard keeps a holder (its rank, or one holding a copy) outside ``ranks``
        (modes/contract.py: which members may leave at one poll)."""
        return not ranks or self.placement is not None and self.placement.kept_without(ranks)

    def _step_shards(self, used: list[bool] | None) -> None:
        self._sync_hyperparameters()
        self._drop_template()
        self.params_stale = True  # until every bucket's all-gather has completed
        with span("fastreduce::shard_step"):
            self.inner.step(used)
            for m in self.mirrors:  # (their hyperparameters synced above)
                m.inner.step(used)

    def wait_params(self) -> None:
        """Wait for the parameter all-gather launched by the last :meth:`step`."""
        self._wait_gathers()

    def hold_launches(self, hold: bool) -> None:
        """``hold``: the buckets' reduce-scatters wait for :meth:`step` instead of launching
        from backward hooks (a Membership's first step of an epoch, so that the members meet
        before any collective); ``False``: as built again."""
        if self._schedule is not None:
            self._schedule.sync = not hold and self.overlap
            self._schedule.late = self._schedule.late or hold  # (launched at step() on purpose: not logged)

    # ------------------------------------------------------------------ every step

    def gather_params(self) -> None:
        """Copy the updated shard into the parameters and launch every bucket's all-gather
        (:meth:`wait_params` waits for them)."""
        W, r = self.world_size, self.rank
        for s in self.shards:
            if s.low:
                c = s.params.numel() // W
                (s.params if s.send is None else s.send)[r * c:(r + 1) * c].copy_(s.master)
        if W == 1:
            self.params_stale = False
            return
        # Last bucket first: the buckets are in backward order, so the next forward reads
        # the last one first, and a transport that moves the gathers in launch order (Gloo
        # point to point) lands what the forward waits for first.
        gathers: list[Pending | None] = [None] * len(self.shards)
        for b in reversed(range(len(self.shards))):
            s = self.shards[b]
            if s.send is None:
                gathers[b] = self.comm.all_gather(s.params)
            else:  # in gather_dtype, then into the parameters (every chunk: this rank's rounded too)
                gathers[b] = (self.comm.all_gather(s.send)[0], partial(s.params.copy_, s.send))
        self._gathers = gathers
        self.stats.wire_bytes += sum((s.params if s.send is None else s.send).nbytes for s in self.shards)
        if self._graph_waits and not graphs_wait():  # dynamo's DDP pass turned off: what it compiles
            self._graph_waits, self._forward_waits = False, None  # now would not wait; step() waits from now on
        if not self._forward_waits:
            self._wait_gathers()

    @guarded("the parameter all-gather after {cls}.step()", "The parameters are lost: the step "
             "updated this rank's shard, but the other ranks' shards are stale or partly gathered.")
    def _wait_gathers(self, which: Iterable[int] | None = None) -> None:
        gathers = self._gathers
        if not gathers:
            return
        with span("fastreduce::wait"), self.stats.waiting():
            for b in (range(len(gathers)) if which is None else which):
                pending = gathers[b]
                if pending is not None:
                    gathers[b] = None
                    complete(pending)
        if which is None or all(p is None for p in gathers):
            self._gathers = []
            self.params_stale = False

    def _sync_hyperparameters(self) -> None:
        """Carry lr, weight decay, ... (set by the user or a scheduler) to the shard's groups
        (and to those of its copies of other ranks', ``redundant=``)."""
        kind = kinds(self.param_groups)  # (momentum set from 0: its buffer is state to keep from now on)
        for inner in [self.inner, *(m.inner for m in self.mirrors)]:
            for ours, theirs in zip(self.param_groups, inner.param_groups):
                for k, v in ours.items():
                    if k != "params" and (k != "fused" or v is not None):  # (no kernel chosen: the shards' stays)
                        theirs[k] = v
            inner.probe_keys(grow=True, kind=kind)


def _listed(params: Any) -> Any:
    """A param group's ``params`` as torch.optim takes them, read once: an iterator or a
    generator (``model.parameters()``) made a list; a tensor and a set left to torch's checks."""
    return params if torch.is_tensor(params) or isinstance(params, (set, list, tuple)) else list(params)
