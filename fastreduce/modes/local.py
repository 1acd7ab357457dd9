"""Local-update data parallelism: every rank steps on its own, and the ranks average now and then.

The mechanism shared by :class:`~fastreduce.modes.localsgd.LocalSGD` and
:class:`~fastreduce.modes.diloco.DiLoCo` (each module states its own communication
pattern): both are driven by the inner optimizer's ``step()`` (step hooks: nothing else
for the user to call); step ``s`` counts the inner optimizer's steps from 1 (under a
``GradScaler``, every ``scaler.step()``, an inf found or not: :mod:`.local_scaler`).

What both keep, beside the model (``P`` = the trainable parameters' bytes):

* the parameters, as views of one flat block per dtype (no copy, no per-sync
  allocation: every sync is a constant number of flat ops, however many tensors);
* ``anchor``, the last synced parameters (DiLoCo, and LocalSGD with a low-precision
  ``wire_dtype``): ``P``, on the parameters' device unless ``backup_device="cpu"``;
* a wire buffer of the largest fragment in the wire dtype (bf16: ``P / 2F``);
* a scratch block of the largest fragment, only where the pseudo-gradient must be
  computed beside the live parameters (``fragment_delay > 0``, ``fragment_alpha > 0``,
  an anchor on the CPU).

Unlike torch's averagers (``PeriodicModelAverager``, ``HierarchicalModelAverager``,
``PostLocalSGDOptimizer``): no flattening into a new buffer per sync and no device
synchronization, float buffers averaged too, the step counter and warm-up saved with
:meth:`state_dict` (pytorch#74556), one ``warmup_steps`` argument (no second one to keep
in agreement, PR #73285's review), and warm-up is true DDP (averaged gradients). Unlike
torchft's DiLoCo: any device, the anchor on the parameters' device by default, the
pseudo-gradient's sign pinned by a test against the paper's equations.
"""

from __future__ import annotations

from typing import Any, Callable

import torch
import torch.distributed as dist
from torch import nn

from ..buffer import FloatBuffers, TensorBlock, params_as_views
from ..codecs.quant import BlockQuant
from ..codecs.sparse import SparseLoCo, SparseState
from ..comm import Comm, Pending, advance, complete, get_comm
from ..comm.quantized import QuantMean
from ..faults import guarded
from ..grads import one_device, start_from_rank0
from ..hooks import on_step, remove_hooks
from ..join import JoinableMode
from ..layout import FrozenAtBuild, GradLayout, ParamsHeld, verify_model
from .comm_stats import CommStats
from .local_nonfinite import LocalNonFinite
from .local_scaler import LocalScaler
from .local_state import RESEND, LocalState

__all__ = ["BUFFERS", "SYNC_LOST", "LocalUpdates", "check_inner", "optimizer_params",
           "trainable"]

BUFFERS = ("average", "local")


# ---------------------------------------------------------------------- checks


def trainable(model: nn.Module) -> list[tuple[str, nn.Parameter]]:
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    if not named:
        raise ValueError("no parameter of the model requires grad: nothing to train")
    return named


def optimizer_params(optimizer: torch.optim.Optimizer, what: str) -> list[torch.Tensor]:
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(f"{what} must be a torch.optim.Optimizer, got {type(optimizer).__name__}")
    return [p for g in optimizer.param_groups for p in g["params"]]


def check_inner(model: nn.Module, optimizer: torch.optim.Optimizer, what: str) -> None:
    ours = {id(p) for p in model.parameters()}
    foreign = sum(id(p) not in ours for p in optimizer_params(optimizer, what))
    if foreign:
        raise ValueError(f"the {what} holds {foreign} parameter(s) that are not the model's: build it "
                         "over model.parameters() (the mode averages the model it is given)")


def _fragments(named: list[tuple[str, nn.Parameter]], count: int) -> list[list[int]]:
    """Cut ``named`` (model order) into ``count`` contiguous runs of about equal numel."""
    if count > len(named):
        raise ValueError(f"fragments={count} is more than the model's {len(named)} trainable parameters; "
                         "a fragment holds whole parameters")
    total = sum(p.numel() for _, p in named)
    cuts, seen = [0], 0
    for k, (_, p) in enumerate(named):
        seen += p.numel()
        # cut after parameter k once this fragment has its share, leaving one per fragment left
        if len(cuts) < count and seen >= total * len(cuts) / count and len(named) - (k + 1) >= count - len(cuts):
            cuts.append(k + 1)
    while len(cuts) < count:  # tiny tails: take one parameter each from the end
        cuts.insert(len(cuts), cuts[-1] + 1)
    cuts.append(len(named))
    return [list(range(a, b)) for a, b in zip(cuts, cuts[1:])]


# ---------------------------------------------------------------------- the shared mechanism

SYNC_LOST = ("The parameters are lost: the sync may have left them partly averaged, or holding "
              "its pseudo-gradient (anchor - x) instead of weights.")


class LocalUpdates(LocalState, LocalNonFinite, LocalScaler, JoinableMode):
    """Parameters as flat blocks, cut into fragments; anchors, wire, step hooks, state.

    The modes subclass it with :meth:`_after_step` (when to sync) and, for DiLoCo, how
    an averaged pseudo-gradient is applied.
    """

    commit_style = "local"  # under a Membership (modes/contract.py)
    state_scope = "per_rank"
    optimizer_role = "inner"

    @property
    def trained_module(self) -> nn.Module:
        """The model it trains (modes/contract.py)."""
        return self.model

    _delta: bool  # average the change since the last sync (through ``anchor``)
    _averages_params = True  # under Join a sync is a mean over the active ranks, whatever the divisor asked

    def _setup(self, model: nn.Module, optimizer: torch.optim.Optimizer, *, group: dist.ProcessGroup | None,
               wire_dtype: torch.dtype | None, accumulate_dtype: torch.dtype | None, buffers: str,
               fragments: int, backup_device: str | torch.device | None, transport: str | None,
               scratch: bool, compression: SparseLoCo | None = None, quant: BlockQuant | None = None,
               error_feedback: bool = False) -> None:
        """Build everything (after the mode's own checks: this changes the model)."""
        named = self._named
        self.model, self.optimizer, self.group = model, optimizer, group
        self.world_size, self.rank = dist.get_world_size(group), dist.get_rank(group)
        self.device = one_device(named)
        members = _fragments(named, fragments)  # checks a rank does alone (get_comm's too) before the all-gather
        self.comm: Comm = get_comm(group, self.device, transport)
        verify_model(named, group, self.device, type(self).__name__)
        self._buffers: list[tuple[Comm, torch.Tensor]] = []  # what comm.buffer gave: close() releases it
        self.buffers = buffers
        self.wire_dtype = wire_dtype
        self.steps = 0
        self.syncs = 0
        self.stats = CommStats()
        """Bytes this rank's averages were handed (as encoded for the wire), seconds waited on them."""
        # One segment per (fragment, dtype), fragments in model order: a fragment is a run
        # of segments, and in the wire buffer one contiguous slice.
        segments = [[k for k in frag if named[k][1].dtype == d]
                    for frag in members for d in sorted({named[k][1].dtype for k in frag}, key=str)]
        # fp32 accumulation splits the wire in chunks; a quantized one, in whole blocks per rank
        pad = (self.world_size * quant.block if quant else self.comm.shard_multiple) if self._delta else 1
        self.layout = GradLayout(named, named[0][1].dtype, segments=[s for s in segments if s], pad_to=pad)
        self.fragment_names: list[list[str]] = [[named[k][0] for k in frag] for frag in members]
        first = 0
        self._frag_segments: list[range] = []
        for frag in members:
            n = len({named[k][1].dtype for k in frag})
            self._frag_segments.append(range(first, first + n))
            first += n
        # The parameters: views of one block per dtype. Averaged in place, the block is the
        # communication layer's (shared memory on one host: the peers read it where it is).
        alloc = self._param_alloc() if not self._delta else self._zeros
        self._blocks: list[torch.Tensor] = []  # one per dtype: what a collective over all of them takes
        self._flats = params_as_views(self.layout, lambda n, d: self._blocks.append(alloc(n, d)) or self._blocks[-1])
        self._float_buffers = FloatBuffers(model)
        self._frozen = FrozenAtBuild(model.parameters())  # broadcast once, never averaged: checked before each sync
        name = type(self).__name__  # the parameters, views of the blocks now: checked before each sync
        self._held = ParamsHeld(self.layout, model, f"Call close() on every rank and build {name} again after "
                                "changing the model's parameters (sync() first keeps what the ranks trained "
                                "since the last sync); nothing was averaged", whole=True)
        frozen = [p.data for p in self._frozen.params]
        start_from_rank0(self._whole_flats() + frozen + list(model.buffers()), group, type(self).__name__)
        self._anchor: list[torch.Tensor] = []
        self._wire: list[torch.Tensor] = []
        self._frag_wire: list[torch.Tensor] = []
        self._scratch: dict[torch.dtype, torch.Tensor] = {}
        self._in_flight: dict[int, Pending] = {}
        self._sent: torch.Tensor | None = None  # the payload of the fragment in flight, where kept (keep_sent)
        self._keeps_sent = False
        self._sparse: list[SparseState] = []
        self._quant_means: list[QuantMean] = []
        if self._delta:
            where = torch.device(backup_device) if backup_device is not None else self.device
            pin = where.type == "cpu" and self.device.type == "cuda"  # page-locked: fast, async uploads
            self._anchor = [f.detach().to(where, copy=True) for f in self._flats]
            if pin:
                self._anchor = [a.pin_memory() for a in self._anchor]
            sizes = [sum(self.layout.segments[j].numel for j in segs) for segs in self._frag_segments]
            assert wire_dtype is not None
            wire = self._buffer_of(self.comm)(max(sizes), torch.float32 if quant else wire_dtype)
            self._frag_wire = [wire[:n] for n in sizes]
            for segs in self._frag_segments:
                at = 0
                for j in segs:
                    n = self.layout.segments[j].numel
                    self._wire.append(wire[at:at + n])
                    at += n
            self._plan = self.comm.plan(wire.dtype, accumulate_dtype, wire)
            # A quantized wire: each fragment's pseudo-gradient, staged in fp32, is averaged
            # through its codec (:class:`QuantMean`: an exchange, an fp32 sum, an all-gather).
            self._quant_means = [QuantMean(self.comm, w, quant, error_feedback) for w in self._frag_wire] if quant else []
            # A codec: each fragment's dense pseudo-gradient is staged in the wire, and what
            # travels is the codec's (an all-gather of every rank's sparse payload).
            self._sparse = [SparseState(compression, n, self.device, self._buffer_of(self.comm), self.world_size,
                                        self.rank) for n in sizes] if compression is not None else []
            if scratch:
                self._scratch = self._blocks_per_dtype()
        self._buffer_blocks: list[TensorBlock] | None = None
        self._hooks = on_step(optimizer, post=self._on_step)
        # Under Join: every inner step is an iteration; its notify precedes any collective
        # of the step (the warm-up's gradient average runs in a later pre-hook).
        self._init_join(group, self.device)
        self._join_hook = on_step(optimizer, pre=self._before_inner_step)
        self._take_scaler_steps()  # a GradScaler steps it every time (modes/local_scaler.py)

    def _zeros(self, n: int, dtype: torch.dtype) -> torch.Tensor:
        return torch.zeros(n, dtype=dtype, device=self.device)

    def _param_alloc(self) -> Callable[[int, torch.dtype], torch.Tensor]:
        return self._buffer_of(self.comm)

    def _buffer_of(self, comm: Comm) -> Callable[[int, torch.dtype], torch.Tensor]:
        """``comm.buffer``, each buffer it gives noted for :meth:`close` to release."""
        def alloc(n: int, dtype: torch.dtype) -> torch.Tensor:
            buf = comm.buffer(n, dtype)
            self._buffers.append((comm, buf))
            return buf
        return alloc

    def _blocks_per_dtype(self) -> dict[torch.dtype, torch.Tensor]:
        """Device scratch as long as the largest fragment's part of each dtype."""
        most: dict[torch.dtype, int] = {}
        for segs in self._frag_segments:
            per: dict[torch.dtype, int] = {}
            for j in segs:
                seg = self.layout.segments[j]
                per[seg.dtype] = per.get(seg.dtype, 0) + seg.numel
            for d, n in per.items():
                most[d] = max(most.get(d, 0), n)
        return {d: self._zeros(n, d) for d, n in most.items()}

    def _scratch_of(self, k: int, pool: dict[torch.dtype, torch.Tensor]) -> list[torch.Tensor]:
        """Fragment ``k``'s segments' slices of a per-dtype scratch ``pool``."""
        out, used = [], {}
        for j in self._frag_segments[k]:
            seg = self.layout.segments[j]
            at = used.get(seg.dtype, 0)
            out.append(pool[seg.dtype][at:at + seg.numel])
            used[seg.dtype] = at + seg.numel
        return out

    def _whole_flats(self) -> list[torch.Tensor]:
        """The parameters' per-dtype blocks (what a collective over all of them takes)."""
        return self._blocks

    # ------------------------------------------------------------------ hooks

    @guarded("the sync after {cls}'s optimizer step", SYNC_LOST)
    def _on_step(self, _optimizer: torch.optim.Optimizer, _args: Any, _kwargs: Any) -> None:
        self._scale_back()
        self._unstash()  # a step skipped for inf/NaN gradients: they come back for the user
        self.steps += 1
        with torch.no_grad():
            self._after_step(self.steps)

    def _after_step(self, s: int) -> None:
        raise NotImplementedError

    def _before_inner_step(self, *_: Any) -> None:
        """The mode's first pre-step hook: under Join, this rank is active (the joined ranks'
        shadow then checks as below); a step that communicates, the unfrozen check."""
        self._join_notify()
        self._check_model(self.steps + 1)

    def _check_model(self, s: int | None = None) -> None:
        """Before inner step ``s`` where it communicates (``None``: a sync now), before any
        of its work: a parameter replaced, moved to new storage or added since construction
        (:class:`~fastreduce.layout.ParamsHeld`), or frozen then and requiring grad now, would
        train on every rank and never be averaged (the layout is the construction's). Raised
        on every rank that made the change, leaving parameters and optimizer state alone."""
        if s is not None and not self.communicates_at(s):
            return
        self._held.check()  # replaced, moved to new storage or added: the blocks averaged would be stale
        if self._frozen.params:
            name = type(self).__name__
            self._frozen.check(self.model.named_parameters, f"{name} was built", "they would train on each rank and "
                               "never be averaged", f"call close() on every rank and build {name} again after "
                               "changing requires_grad (to keep what the ranks trained since the last sync, call "
                               "sync() before close(), with requires_grad as it was)")

    def communicates_at(self, s: int) -> bool:
        raise NotImplementedError

    def close(self, drain: bool = True) -> None:
        """Take the step hooks off: the optimizer steps without syncing from here on, and
        the mode must not be used afterwards. ``drain``: a fragment's sync in flight
        (DiLoCo's ``fragment_delay > 0``) is waited for first (``False``: dropped, a peer
        was lost). The buffers the communication layer gave (the parameter blocks, the
        wire) are released to it: a shared-memory segment goes with the last tensor that
        maps it (LocalSGD's parameters view theirs until they are rebuilt or dropped).
        Once closed, a second call does nothing (it would wait for what the first dropped)."""
        if self.__dict__.get("_closed"):
            return
        self._closed = True
        if drain:
            self._drain()
        remove_hooks(self._hooks + self._join_hook + self._nonfinite_hooks)
        self._hooks, self._join_hook = [], []
        self._nonfinite_hooks = []
        self._release_scaler()
        for comm, buf in self._buffers:
            comm.release(buf)
        self._buffers = []

    def remove(self) -> None:
        """The step hooks off, a sync in flight dropped: ``close(drain=False)``, under the
        name it had before every mode closed alike."""
        self.close(drain=False)

    def _join_shadow(self) -> None:
        """A joined rank's inner step under Join: no update of its own, the step's
        collectives as on the active ranks (it sends zeros into every average)."""
        if not self._hooks:
            return
        self._check_model(self.steps + 1)  # as the active ranks' pre-step hook does
        reducer = getattr(self, "_reducer", None)
        if reducer is not None and self.steps < getattr(self, "warmup_steps", 0):
            reducer._join_shadow()  # the warm-up's gradient average
        self._on_step(self.optimizer, (), {})

    # ------------------------------------------------------------------ averaging

    def _average(self, bufs: list[torch.Tensor], comm: Comm) -> None:
        """Each of ``bufs`` := its mean over ``comm``'s group (in place, all launched, then waited)."""
        self._join_contribute(bufs, active_only=True)  # under Join: zeros from joined ranks
        pendings = []
        for b in bufs:
            plan = comm.plan(b.dtype, None, b)
            pack = (lambda b=b: b.div_(comm.world)) if plan.prescale else None
            pendings.append(comm.all_reduce(b, plan, pack))
            self.stats.wire_bytes += b.nbytes
        with self.stats.waiting():
            for p in pendings:
                complete(p)

    def _average_buffers(self, comm: Comm) -> None:
        bufs = self._float_buffers.now()  # (the module's now: one it replaced is averaged, not the first)
        if self.buffers != "average" or not bufs:
            return
        if self._buffer_blocks is None:  # one per dtype: a float64 buffer is averaged in float64
            self._buffer_blocks = TensorBlock.per_dtype(bufs, self._buffer_of(self.comm))
        TensorBlock.follow(self._buffer_blocks, bufs, type(self).__name__)
        for block in self._buffer_blocks:
            block.load()
        self._average([block.flat for block in self._buffer_blocks], comm)
        for block in self._buffer_blocks:
            block.store()

    def _launch(self, k: int) -> None:
        """Start averaging fragment ``k``'s pseudo-gradient ``anchor - x`` through the wire.

        Computed here, on the caller's thread (a shared-memory job runs on a worker
        thread while training goes on), into the parameters themselves when nothing
        needs them before the apply overwrites them, else into scratch."""
        segs = self._frag_segments[k]
        deltas = self._scratch_of(k, self._scratch) if self._scratch else [self._flats[j] for j in segs]
        for j, d in zip(segs, deltas):
            x, a = self._flats[j], self._anchor[j]
            if a.device == x.device:
                torch.sub(a, x, out=d)
            else:
                d.copy_(a, non_blocking=True)
                d.sub_(x)
            self._wire[j].copy_(d)
        wire = self._frag_wire[k]
        self._join_contribute([wire], active_only=self._averages_params)
        if self._sparse:  # a joined rank's payload is all zeros: scale 0, so it adds nothing
            sparse = self._sparse[k]
            if self._join_joined:
                sparse.mine.zero_()
            else:
                sparse.encode(wire)
            work, _ = self.comm.all_gather(sparse.gathered)
            self._in_flight[k] = (work, lambda: sparse.decode(wire))
            self.stats.wire_bytes += sparse.gathered.nbytes
            return
        if self._quant_means:
            self._in_flight[k] = self._quant_means[k].start()
            self.stats.wire_bytes += self._quant_means[k].wire_bytes
            return
        if self._keeps_sent:
            self._sent = wire.clone()
        self._send(k)

    def _send(self, k: int) -> None:
        """Fragment ``k``'s payload, in the wire, averaged over the group (launched)."""
        wire = self._frag_wire[k]
        if self._plan.prescale:
            wire.div_(self.world_size)
        self._in_flight[k] = self.comm.all_reduce(wire, self._plan)
        self.stats.wire_bytes += wire.nbytes

    def _resend(self, k: int) -> None:
        """Fragment ``k`` loaded as this rank's own payload (:meth:`local_state_dict`):
        averaged now, over this mode's group."""
        if self._in_flight.get(k) is RESEND:
            self._frag_wire[k].copy_(self._sent)
            self._send(k)

    def _advance(self, k: int) -> None:
        """Fragment ``k``'s all-reduce, if in flight in two phases (a bf16 wire summed in
        fp32 over a process group): issue its second collective now."""
        if k in self._in_flight:
            self._resend(k)
            advance(self._in_flight[k])

    def _land(self, k: int, mix: bool = True) -> None:
        """Wait for fragment ``k``'s average and apply it (:meth:`_apply`), unless
        ``nonfinite`` finds inf/NaN in it (:meth:`_average_finite`)."""
        self._resend(k)
        with self.stats.waiting():
            complete(self._in_flight.pop(k))
        if not self._average_finite(k):
            return
        self._apply(k, mix)
        self.syncs += 1

    def _apply(self, k: int, mix: bool) -> None:
        raise NotImplementedError

    @property
    def bytes_per_sync(self) -> int:
        """Bytes one full sync averages, per rank: every fragment's wire (or parameter
        block) once, as sent (alignment padding included: a few hundred elements per
        dtype and fragment); a step costs ``bytes_per_sync / sync_every`` on average."""
        if self._sparse:  # an all-gather: every rank's payload
            return sum(s.gathered.numel() for s in self._sparse)
        if self._quant_means:  # the encoded wire (codes and scales), as an all-reduce of it would move
            return sum(q.wire_bytes for q in self._quant_means)
        if self._delta:
            return sum(w.numel() * w.element_size() for w in self._frag_wire)
        return sum(f.numel() * f.element_size() for f in self._whole_flats())

