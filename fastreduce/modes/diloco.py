"""DiLoCo, and Streaming DiLoCo's fragments, on the local-update mechanism (:mod:`.local`).

Douillard et al. 2023; streaming fragments after Douillard et al. 2025. Communication
pattern (step ``s`` counts the inner optimizer's steps from 1)::

    after step s, fragment k launched (s = t_k - tau mod H):
                               delta_k := anchor_k - x_k (the pseudo-gradient), cast to
                               the wire dtype, averaging all-reduce started (async)
    after step s = t_k mod H:  wait; x_k := anchor_k; x_k.grad := mean delta_k; the outer
                               optimizer steps fragment k; anchor_k := x_k;
                               x_k := alpha * (x_k before) + (1 - alpha) * x_k

with ``t_k = (k + 1) H / F`` (``F`` fragments, staggered; ``F = 1``: every ``H``). With
``fragment_delay = tau > 0`` the all-reduce runs during the ``tau`` inner steps before
it is applied. At most one fragment is on the wire at a time (``tau < H / F``). An
all-reduce in two collectives (``accumulate_dtype=torch.float32`` on a process group:
an all-to-all, a sum in fp32, a gather) issues its second one ``ceil(tau / 2)`` steps
after the launch, so that both run behind inner steps; issued at the apply, the gather
would be waited for there (``tau >= 2``).
"""

from __future__ import annotations

import logging
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from ..buffer import slot_view
from ..checks import check_int
from ..codecs.quant import check_wire, wire_format
from ..codecs.sparse import SparseLoCo
from ..engine import require_distributed
from ..faults import guarded
from ..grads import NonFinite, check_nonfinite, one_device
from ..layout import counted, wire_word
from .local import BUFFERS, SYNC_LOST, LocalUpdates, check_inner, optimizer_params, trainable
from .local_state import RESEND

__all__ = ["DiLoCo"]

log = logging.getLogger(__name__)


_RESENT_UNCOMPRESSED = ("DiLoCo's fragment_delay > 0 with a compressed wire (compression=, or a quantized "
                        "wire_dtype) cannot send a fragment in flight again over the survivors; use a float "
                        "wire_dtype, or fragment_delay=0")


class DiLoCo(LocalUpdates):
    """DiLoCo: ``sync_every`` inner steps on each rank, then an outer step on the averaged
    pseudo-gradient; with ``fragments``, Streaming DiLoCo (see the module doc).

    Args:
        model: the module every rank trains.
        inner_optimizer: the rank's optimizer (e.g. AdamW); its ``step()`` drives the mode,
            under a ``GradScaler`` too (as :class:`LocalSGD`'s ``optimizer``).
        outer_optimizer: a torch optimizer over exactly the model's trainable parameters
            (the paper: ``SGD(lr=0.7, momentum=0.9, nesterov=True)``); it steps each
            fragment's last synced parameters with the averaged pseudo-gradient as grad.
        sync_every: inner steps between a fragment's syncs (``H``).
        fragments: the trainable parameters, in model order, cut into this many runs of
            about equal size, synced at staggered steps (``H`` must be a multiple).
        fragment_delay: inner steps between starting a fragment's all-reduce and applying
            it (``tau < H / fragments``): the communication overlaps those steps.
        fragment_alpha: on apply, the fragment's parameters := ``alpha * local + (1 -
            alpha) * global``.
        group: process group (default: the world).
        wire_dtype: dtype the pseudo-gradient is sent in (default bf16); or a quantized
            wire, ``torch.float8_e4m3fn``, ``torch.float8_e5m2``, ``"int8"`` or ``"int4"``
            (two values a byte): one fp32 scale per block of 256, the owner of each chunk
            sums the decoded values in fp32 and the mean is encoded once more
            (:class:`~fastreduce.comm.quantized.QuantMean`).
        error_feedback: with a quantized wire, what each rank's encoding (and each
            chunk owner's encoding of the mean) rounded away is added to the next sync's
            pseudo-gradient; kept in :meth:`state_dict`.
        accumulate_dtype: ``torch.float32``: a bf16 wire is summed in fp32 on process
            groups too (shared memory always does).
        backup_device: where the last synced parameters live (default: the parameters'
            device; ``"cpu"`` frees a model's worth of accelerator memory).
        buffers: ``average`` (float buffers averaged every ``H`` steps) or ``local``.
        transport: the communication layer's transport.
        compression: ``fastreduce.SparseLoCo(...)``: each fragment's pseudo-gradient goes
            through an error-feedback accumulator, and only each chunk's top-k entries, in
            a few bits, travel (an all-gather; :mod:`fastreduce.codecs.sparse`). The
            dense pseudo-gradient is then staged in fp32 (``wire_dtype`` is unused). Pair
            it with an outer SGD without momentum (the accumulator takes its place).
        nonfinite: inf/NaN: ``ignore`` (no check), ``skip`` or ``raise``. An inner step
            checks this rank's gradients, as :class:`LocalSGD` does (``skip``: this rank
            skips it, still counted, :attr:`skipped_steps`; ``raise``: the same, then
            :class:`~fastreduce.NonFiniteGradError` on this rank only). A fragment's
            averaged pseudo-gradient is checked once it lands (one fused kernel; it is
            the same on every rank, so every rank decides alike with no collective):
            ``skip`` skips the outer step and every rank's parameters of the fragment
            return to the last synced ones (outer optimizer untouched, the quantized
            wire's residuals or SparseLoCo's accumulator as before the sync,
            :attr:`skipped_syncs` counts it); ``raise`` does the same and raises on every
            rank, naming the parameter.

    Example::

        >>> inner = torch.optim.AdamW(model.parameters(), lr=4e-4)
        >>> outer = torch.optim.SGD(model.parameters(), lr=0.7, momentum=0.9, nesterov=True)
        >>> diloco = fastreduce.DiLoCo(model, inner, outer, sync_every=500)
        >>> for x, y in batches:
        ...     loss_fn(model(x), y).backward()
        ...     inner.step()        # every 500th step: the outer step on the averaged delta
        ...     inner.zero_grad()
    """

    mode_name = "diloco"  # (modes/contract.py)
    _averages_params = False  # pseudo-gradients: divide_by_initial_world_size applies

    def __init__(self, model: nn.Module, inner_optimizer: torch.optim.Optimizer,
                 outer_optimizer: torch.optim.Optimizer, sync_every: int, *, fragments: int = 1,
                 fragment_delay: int = 0, fragment_alpha: float = 0.0, group: dist.ProcessGroup | None = None,
                 wire_dtype: torch.dtype = torch.bfloat16, accumulate_dtype: torch.dtype | None = None,
                 backup_device: str | torch.device | None = None, buffers: str = "average",
                 transport: str | None = None, nonfinite: NonFinite = "ignore",
                 compression: SparseLoCo | None = None, error_feedback: bool = False):
        self.sync_every = H = check_int("sync_every", sync_every, 1)
        quant = check_wire(wire_dtype, "DiLoCo", int4=True, compression=compression, error_feedback=error_feedback)
        if compression is not None:
            if not isinstance(compression, SparseLoCo):
                raise ValueError(f"compression must be None or a fastreduce.SparseLoCo(...), got "
                                 f"{type(compression).__name__}")
            if accumulate_dtype is not None:
                raise ValueError("compression= cannot be combined with accumulate_dtype: SparseLoCo's values "
                                 "are summed in fp32 after the all-gather anyway")
            wire_dtype = torch.float32  # the dense staging of the pseudo-gradient; the codec's bytes travel
        self.nonfinite = check_nonfinite(nonfinite)
        self.num_fragments = F = check_int("fragments", fragments, 1)
        self.fragment_delay = tau = check_int("fragment_delay", fragment_delay, 0)
        if F > 1 and H % F:
            raise ValueError(f"sync_every={H} is not a multiple of fragments={F}: the fragments' syncs are "
                             f"staggered every sync_every / fragments steps")
        if tau * F >= H:
            raise ValueError(f"fragment_delay={tau} must be less than sync_every / fragments = {H / F:g}: "
                             "one fragment's all-reduce must land before the next one starts")
        if not 0.0 <= float(fragment_alpha) <= 1.0:
            raise ValueError(f"fragment_alpha must be in [0, 1], got {fragment_alpha!r}")
        if buffers not in BUFFERS:
            raise ValueError(f"buffers must be one of {BUFFERS}, got {buffers!r}")
        if accumulate_dtype not in (None, torch.float32):
            raise ValueError(f"accumulate_dtype must be None or torch.float32, got {accumulate_dtype!r}")
        require_distributed()
        self._named = trainable(model)
        if outer_optimizer is inner_optimizer:
            raise ValueError("outer_optimizer is the inner optimizer; DiLoCo needs a second optimizer "
                             "over the same parameters (e.g. SGD(lr=0.7, momentum=0.9, nesterov=True))")
        check_inner(model, inner_optimizer, "inner optimizer")
        outer = {id(p) for p in optimizer_params(outer_optimizer, "outer_optimizer")}
        ours = {id(p): n for n, p in self._named}
        missing = [n for i, n in ours.items() if i not in outer]
        extra = len(outer - set(ours))
        if missing or extra:
            raise ValueError("outer_optimizer must hold exactly the model's trainable parameters: "
                             + (f"it lacks {missing[:3]}{' ...' if len(missing) > 3 else ''}" if missing else "")
                             + ("; " if missing and extra else "")
                             + (f"it holds {extra} other tensor(s)" if extra else "")
                             + "; build it over [p for p in model.parameters() if p.requires_grad]")
        device = one_device(self._named)
        if backup_device is not None:
            backup = torch.device(backup_device)
            if backup.type not in ("cpu", device.type):
                raise ValueError(f"backup_device must be 'cpu' or the parameters' device ({device}), got {backup}")
            backup_device = backup
        self.fragment_alpha = float(fragment_alpha)
        self.outer_optimizer = outer_optimizer
        self._delta = True
        on_cpu = backup_device is not None and backup_device != device
        # Scratch beside the live parameters: to keep them through the delay, or for alpha.
        scratch = tau > 0 or self.fragment_alpha > 0 or on_cpu
        self._setup(model, inner_optimizer, group=group, wire_dtype=wire_dtype,
                    accumulate_dtype=accumulate_dtype, buffers=buffers, fragments=F,
                    backup_device=backup_device, transport=transport, scratch=scratch, compression=compression,
                    quant=quant, error_feedback=error_feedback)
        # [Note: the outer step on the anchor] With the anchor beside the parameters, the
        # outer optimizer steps the anchor's storage in place (its parameters' .data point
        # there for the call) with the mean pseudo-gradient in the parameters' own storage
        # (their values are replaced after anyway): one copy out (x := anchor) per sync
        # instead of three. An anchor on the CPU cannot be stepped on the device: there the
        # parameters take the anchor's values, the gradient lands in device scratch, and
        # the anchor takes the result back.
        self._spare = self._blocks_per_dtype() if on_cpu and self.fragment_alpha > 0 else (
            self._scratch if on_cpu else {})
        self._outer_views: list[list[tuple[nn.Parameter, torch.Tensor | None, torch.Tensor]]] = []
        for k, segs in enumerate(self._frag_segments):
            homes = self._scratch_of(k, self._spare) if self._spare else [self._flats[j] for j in segs]
            self._outer_views.append([(s.param, None if on_cpu else slot_view(self._anchor[j], s), slot_view(home, s))
                                      for j, home in zip(segs, homes) for s in self.layout.segments[j].slots])
        self._apply_at = [((k + 1) * H // F) % H for k in range(F)]
        if self.rank == 0:
            log.info("fastreduce: DiLoCo: %s; %s every %d inner steps (delay %d, alpha %g), "
                     "%s wire, anchor on %s, %d ranks", self.layout.describe(), counted(F, "fragment"), H, tau,
                     self.fragment_alpha, wire_word(compression or wire_dtype), self._anchor[0].device, self.world_size)
        self._guard_steps()

    # ------------------------------------------------------------------ public

    @staticmethod
    def membership_refusal_for(settings: dict[str, Any]) -> str | None:
        """What a Membership cannot keep training, of these settings (modes/contract.py): a
        compressed fragment in flight across inner steps (after a loss each survivor sends
        its own payload again over the survivors: a float wire's, kept as it was sent)."""
        compressed = settings.get("compression") is not None or wire_format(settings.get("wire_dtype")) is not None
        return _RESENT_UNCOMPRESSED if settings.get("fragment_delay", 0) and compressed else None

    @property
    def membership_refusal(self) -> str | None:
        """:meth:`membership_refusal_for` this mode's own settings."""
        return _RESENT_UNCOMPRESSED if self.fragment_delay and (self._sparse or self._quant_means) else None

    @property
    def _sends_across_steps(self) -> bool:
        return self.fragment_delay > 0

    @guarded("{cls}.sync()", SYNC_LOST)
    @torch.no_grad()
    def sync(self) -> None:
        """An outer step of every fragment now (collective), the one on the wire first,
        without ``fragment_alpha``: every rank then holds the same global parameters
        (e.g. at the end of training). The schedule goes on counting as before."""
        self._check_model()
        landed = set(self._in_flight)
        for k in sorted(landed):
            self._land(k, mix=False)
        for k in range(self.num_fragments):
            if k not in landed:
                self._launch(k)
                self._land(k, mix=False)
        self._average_buffers(self.comm)

    def communicates_at(self, s: int) -> bool:
        """Whether inner step ``s`` (counted from 1) runs a collective: it launches or lands
        a fragment's sync, or, where the average is two collectives (a bf16 wire summed in
        fp32 over a process group, ``fragment_delay >= 2``), waits for a fragment's first
        and issues its second (:class:`fastreduce.Membership` puts a commit vote at those
        steps only)."""
        H, tau = self.sync_every, self.fragment_delay
        half = (tau + 1) // 2
        two_phase = half < tau and self._plan.fp32_accumulate and not (self._sparse or self._quant_means)
        return any((s + tau) % H == t or (tau and s % H == t) or (two_phase and (s + tau - half) % H == t)
                   for t in self._apply_at) or s % H == 0 or \
            any(pending is RESEND for pending in self._in_flight.values())  # sent again at its next advance or landing

    def state_dict(self) -> dict[str, Any]:
        """Everything to resume exactly: the step count (hence the fragment phase), the
        last synced parameters, this rank's parameters, the outer optimizer's state and
        the fragment on the wire (as its averaged pseudo-gradient)."""
        return {**self._header(), **self._state()}

    def _header(self) -> dict[str, Any]:
        return {"mode": "DiLoCo", "sync_every": self.sync_every, "fragment_delay": self.fragment_delay,
                "outer_optimizer": self.outer_optimizer.state_dict()}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Resume from :meth:`state_dict` (build the model, both optimizers and the mode first).
        Checked first (the outer optimizer's parameter groups against the saved ones, as
        torch's ``load_state_dict`` checks them): a state that does not fit raises
        ``ValueError`` and changes nothing."""
        if state_dict.get("mode") != "DiLoCo":
            raise ValueError(f"not a DiLoCo state_dict (mode {state_dict.get('mode')!r})")
        _check_outer(self.outer_optimizer, state_dict.get("outer_optimizer"))
        saved = (state_dict.get("sync_every"), state_dict.get("fragment_delay", self.fragment_delay))
        if (state_dict.get("in_flight") or state_dict.get("to_send")) and saved != (self.sync_every, self.fragment_delay):
            raise ValueError(f"this state_dict holds a fragment on the wire, due at the step its (sync_every, "
                             f"fragment_delay) = {saved} set, this mode's are {(self.sync_every, self.fragment_delay)}: "
                             "it would land at another step (or twice); build the mode with the settings it was saved "
                             "with (they may change at a resume saved with no fragment on the wire)")
        self._load(state_dict)
        self.outer_optimizer.load_state_dict(state_dict["outer_optimizer"])

    # ------------------------------------------------------------------ every inner step

    def _after_step(self, s: int) -> None:
        H, tau = self.sync_every, self.fragment_delay
        half = (tau + 1) // 2
        for k, t in enumerate(self._apply_at):
            if s % H == t and k in self._in_flight:
                self._land(k)
            elif half < tau and (s + tau - half) % H == t:
                self._advance(k)
        for k, t in enumerate(self._apply_at):
            if (s + tau) % H == t:
                self._launch(k)
                if tau == 0:
                    self._land(k)
        if s % H == 0:
            self._average_buffers(self.comm)

    def _apply(self, k: int, mix: bool) -> None:
        """The outer step of fragment ``k`` on its averaged pseudo-gradient (in the wire);
        ``mix``: then mix in the local parameters by ``fragment_alpha``."""
        segs = self._frag_segments[k]
        keep = self._scratch_of(k, self._scratch) if mix and self.fragment_alpha > 0 else None
        spare = self._scratch_of(k, self._spare) if self._spare else None
        for n, j in enumerate(segs):
            x = self._flats[j]
            if keep is not None:
                keep[n].copy_(x)
            if spare is None:
                x.copy_(self._wire[j])  # the grad, in the parameters' storage (see the note in __init__)
            else:
                x.copy_(self._anchor[j], non_blocking=True)  # an upload
                spare[n].copy_(self._wire[j])
        self._outer_step(self._outer_views[k])
        for n, j in enumerate(segs):
            x, a = self._flats[j], self._anchor[j]
            if spare is None:
                x.copy_(a)
            else:
                a.copy_(x)
            if keep is not None:
                x.lerp_(keep[n], self.fragment_alpha)

    def _outer_step(self, views: list[tuple[nn.Parameter, torch.Tensor | None, torch.Tensor]]) -> None:
        """Step the outer optimizer with each ``(param, at, grad)`` of ``views`` as the only
        gradients, on ``at``'s storage where given; there ``grad`` is a view of the
        parameter's own storage, which it gets back after (as do the inner gradients)."""
        params = [p for _, p in self._named]
        saved = [p.grad for p in params]
        try:
            for p in params:
                p.grad = None
            for p, at, g in views:
                if at is not None:
                    p.data = at
                p.grad = g
            self.outer_optimizer.step()
        finally:
            for p, at, g in views:
                if at is not None:
                    p.data = g
            for p, g in zip(params, saved):
                p.grad = g


def _check_outer(outer: torch.optim.Optimizer, saved: Any) -> None:
    """``ValueError`` where ``outer.load_state_dict(saved)`` would refuse ``saved`` for its
    parameter groups (torch's checks, made before the mode's own state is loaded)."""
    groups = saved.get("param_groups") if isinstance(saved, dict) else None
    if not isinstance(groups, list) or not isinstance(saved.get("state"), dict) or \
            not all(isinstance(g, dict) and isinstance(g.get("params"), list) for g in groups):
        raise ValueError("this state_dict holds no outer optimizer state ('outer_optimizer': an optimizer's "
                         "state_dict()); not a DiLoCo.state_dict()?")
    ours, theirs = [len(g["params"]) for g in outer.param_groups], [len(g["params"]) for g in groups]
    if ours != theirs:
        raise ValueError(f"the outer optimizer was saved with parameter groups of {theirs} parameters, this one "
                         f"has {ours}: build it with the parameter groups it was saved with")
