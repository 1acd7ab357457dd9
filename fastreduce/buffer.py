"""FusedBuffer: persistent flat storage for a layout, gradients as views, one wire buffer.

Memory, for a layout with an fp32 and a bf16 segment and ``wire_dtype=torch.bfloat16``::

    wire  (bf16) [ bf16 segment | cast of the fp32 segment ]   <- the collective's buffer
    flats        [ = wire[0:n0] ][ fp32 storage, n1 elems   ]   <- grads are views of these

A segment whose dtype equals the wire dtype *is* its slice of the wire buffer, so it
needs no pack or unpack at all; every other segment is cast in with one ``copy_`` and
cast back with one more. Pack and unpack therefore cost one op per dtype, never one
per parameter, and touch only memory this object owns (what graph capture needs).
"""

from __future__ import annotations

import operator
from typing import Callable, Sequence

import torch

from .layout import GradLayout, Slot
from .torch_internals import buffer_slots

__all__ = ["FloatBuffers", "FusedBuffer", "TensorBlock", "attached", "cast_in", "foreach_copy", "params_as_views"]

_get_grad = operator.attrgetter("grad")


class FloatBuffers:
    """A module's floating-point buffers, read by name at each use (:meth:`now`): a module may
    replace one (``self.ema = 0.9 * self.ema + 0.1 * x``) rather than update it in place, and
    the one a mode averages must be the module's now, not the one it had at construction."""

    def __init__(self, module: torch.nn.Module):
        seen: set[int] = set()
        slots = [(d, k) for m in module.modules() for d in [buffer_slots(m)] for k, b in d.items()
                 if b is not None and b.is_floating_point() and not (id(b) in seen or seen.add(id(b)))]
        self.dicts, self.keys = tuple(d for d, _ in slots), tuple(k for _, k in slots)

    def now(self) -> list[torch.Tensor]:
        """Each buffer as its module holds it now (one C-speed pass)."""
        return list(map(dict.get, self.dicts, self.keys))


def attached(params: Sequence[torch.nn.Parameter], views: Sequence[torch.Tensor]) -> bool:
    """True while every ``param.grad`` is still its view: the per-step fast path, checked
    at C speed (identity only, no kernels)."""
    return all(map(operator.is_, map(_get_grad, params), views))


def _dense(t: torch.Tensor) -> bool:
    """True when ``t``'s elements fill ``t.numel()`` consecutive slots in some dim order."""
    expected = 1
    for stride, size in sorted(zip(t.stride(), t.shape)):
        if size == 1:
            continue
        if stride != expected:
            return False
        expected *= size
    return True


def slot_view(flat: torch.Tensor, slot: Slot) -> torch.Tensor:
    """``slot``'s piece of ``flat``, with the parameter's own strides when it is dense."""
    piece = flat[slot.offset:slot.offset + slot.numel]
    p = slot.param
    if p.is_contiguous() or not _dense(p):
        return piece.view(p.shape)
    return piece.as_strided(p.shape, p.stride())


class FusedBuffer:
    """Flat storage for every gradient of ``layout`` plus the ``wire_dtype`` buffer sent.

    ``wire``, if given, is zeroed storage for the wire buffer (e.g. a shared-memory
    region, :meth:`~fastreduce.shm.ShmAllReduce.region`) of :meth:`wire_numel` elements.
    """

    def __init__(self, layout: GradLayout, wire_dtype: torch.dtype, device: torch.device,
                 pad_multiple: int = 1, wire: torch.Tensor | None = None, error_feedback: bool = False):
        numel = self.wire_numel(layout, pad_multiple)
        if wire is None:
            wire = torch.zeros(numel, dtype=wire_dtype, device=device)
        elif wire.shape != (numel,) or wire.dtype != wire_dtype or wire.device != device:
            raise ValueError(f"wire storage must be {numel} x {wire_dtype} on {device}, got "
                             f"{tuple(wire.shape)} x {wire.dtype} on {wire.device}")
        self.wire = wire
        self._spans = [(start, slot.offset, slot.numel) for start, seg in zip(
            [sum(s.numel for s in layout.segments[:k]) for k in range(len(layout.segments))], layout.segments)
            for slot in seg.slots]  # (segment start, offset, numel): where gradients land (gaps())
        self.flats: list[torch.Tensor] = []  # per segment: the grads' storage
        self.wires: list[torch.Tensor] = []  # per segment: its slice of the wire buffer
        self.casts: list[tuple[torch.Tensor, torch.Tensor]] = []  # (flat, wire) pairs that differ
        start = 0
        for seg in layout.segments:
            wire_part = self.wire[start:start + seg.numel]
            if seg.dtype == wire_dtype:
                flat = wire_part
            else:
                flat = torch.zeros(seg.numel, dtype=seg.dtype, device=device)
                self.casts.append((flat, wire_part))
            self.flats.append(flat)
            self.wires.append(wire_part)
            start += seg.numel
        # Error feedback: per segment whose cast to the wire can round (a wire that does not
        # hold every value of the segment's dtype: fp32 or fp16 on bf16, bf16 on fp16), what
        # the last cast rounded away, added back before the next one (persistent, zero at first).
        self.residuals: list[torch.Tensor | None] = [
            torch.zeros_like(flat) if error_feedback and flat is not wire_part
            and torch.promote_types(flat.dtype, wire_dtype) != wire_dtype else None
            for flat, wire_part in zip(self.flats, self.wires)]
        self.views: tuple[torch.Tensor, ...] = tuple(
            slot_view(flat, slot) for seg, flat in zip(layout.segments, self.flats) for slot in seg.slots)
        # Each gradient's place in the wire buffer (its view itself where no cast is
        # needed): where fresh gradients replace the views, they are cast straight in.
        self.wire_views: tuple[torch.Tensor, ...] = tuple(
            slot_view(wire_part, slot) for seg, wire_part in zip(layout.segments, self.wires) for slot in seg.slots)
        self.cast: tuple[bool, ...] = tuple(
            flat is not wire_part for seg, flat, wire_part in zip(layout.segments, self.flats, self.wires)
            for _ in seg.slots)
        """Per gradient: does its segment need a cast between the flat buffer and the wire?"""

    @staticmethod
    def wire_numel(layout: GradLayout, pad_multiple: int = 1) -> int:
        """Elements of the wire buffer: the layout, padded with a zero tail so that it
        splits into ``pad_multiple`` equal chunks."""
        return -(-layout.numel // pad_multiple) * pad_multiple

    def gaps(self, part: torch.Tensor) -> torch.Tensor | None:
        """The elements of ``part`` (a slice of the wire) no gradient lands in (alignment and
        the padding tail), as indices into it; ``None`` where there are none. A block codec
        spreads an inf or NaN over its whole block, gaps included: a quantized wire zeroes
        them before each encoding (:class:`~fastreduce.comm.quantized.QuantMean`), or one
        non-finite step would leave them NaN, and every later step's mean with them."""
        data = torch.zeros(self.wire.numel(), dtype=torch.bool)
        for start, offset, numel in self._spans:
            data[start + offset:start + offset + numel] = True
        at = part.storage_offset() - self.wire.storage_offset()
        gaps = (~data[at:at + part.numel()]).nonzero().flatten()
        return gaps.to(part.device) if gaps.numel() else None

    @property
    def nbytes(self) -> int:
        """Bytes on the wire per reduction."""
        return self.wire.numel() * self.wire.element_size()

    def pack(self, prescale_by: int | None = None) -> None:
        """Cast every non-wire-dtype segment into its slice of the wire buffer (with
        error feedback: plus the residual the last cast left, see :func:`cast_in`),
        then divide the whole wire buffer by ``prescale_by`` if given."""
        for flat, wire_part, residual in zip(self.flats, self.wires, self.residuals):
            if flat is not wire_part:
                cast_in(wire_part, flat, residual)
        if prescale_by is not None:
            self.wire.div_(prescale_by)

    def unpack(self) -> None:
        """Cast the reduced wire buffer back into the non-wire-dtype segments."""
        for flat, wire_part in self.casts:
            flat.copy_(wire_part)

    def zero_(self) -> None:
        """Zero every gradient (one op per dtype); the cast-only part of the wire is
        scratch that the next pack overwrites, so it is left alone."""
        for flat in self.flats:
            flat.zero_()

    def residual_state(self, layout: GradLayout) -> dict[str, torch.Tensor]:
        """Each gradient's error-feedback residual (a copy, flat), by parameter name; empty
        without error feedback. ``layout`` is the one this buffer was made for."""
        return {s.name: res[s.offset:s.offset + s.numel].clone()
                for seg, res in zip(layout.segments, self.residuals) if res is not None for s in seg.slots}

    @torch.no_grad()
    def load_residuals(self, layout: GradLayout, residuals: dict[str, torch.Tensor]) -> None:
        """Copy :meth:`residual_state`'s entries (by name) into the residuals; names this
        buffer has no residual for are ignored, and a residual the state has none for is
        zero (as before a first step: a state saved then has none)."""
        for seg, res in zip(layout.segments, self.residuals):
            if res is not None:
                for s in seg.slots:
                    part = res[s.offset:s.offset + s.numel]
                    if s.name in residuals:
                        part.copy_(residuals[s.name].reshape(-1))
                    else:
                        part.zero_()


def cast_in(wire: torch.Tensor, flat: torch.Tensor, residual: torch.Tensor | None) -> None:
    """``wire`` := ``flat`` cast to the wire's dtype. With a ``residual`` (error feedback,
    1-bit-Adam style): ``wire`` := cast(``flat`` + residual), and residual := what that
    cast rounded away, so a rank's rounding errors cancel over steps instead of adding
    up. An inf or NaN (an fp16 overflow a GradScaler skips) leaves 0 in the residual, not
    a NaN that would poison every later step. In-place ops on persistent buffers
    (graph-safe), never an allocation."""
    if residual is None:
        wire.copy_(flat)
        return
    residual.add_(flat)
    wire.copy_(residual)
    finite_residual(residual.sub_(wire))


def finite_residual(residual: torch.Tensor) -> torch.Tensor:
    """An error-feedback residual after its update, with 0 where a non-finite value went
    through (inf - inf is NaN, kept it would be sent at every later step), in place."""
    return residual.nan_to_num_(0.0, 0.0, 0.0)


def params_as_views(layout: GradLayout, alloc: Callable[[int, torch.dtype], torch.Tensor]) -> list[torch.Tensor]:
    """Make every parameter of ``layout`` a view of one flat buffer per dtype (from
    ``alloc(numel, dtype)``, zeroed) laid out like the layout; return each segment's
    slice. The parameters keep their values, identities, shapes and strides."""
    sizes: dict[torch.dtype, int] = {}
    for seg in layout.segments:
        sizes[seg.dtype] = sizes.get(seg.dtype, 0) + seg.numel
    flats = {d: alloc(n, d) for d, n in sizes.items()}
    offsets = dict.fromkeys(sizes, 0)
    out = []
    with torch.no_grad():
        for seg in layout.segments:
            o = offsets[seg.dtype]
            offsets[seg.dtype] += seg.numel
            flat = flats[seg.dtype][o:o + seg.numel]
            for slot in seg.slots:
                view = slot_view(flat, slot)
                view.copy_(slot.param)
                slot.param.data = view
            out.append(flat)
    return out


def foreach_copy(dsts: Sequence[torch.Tensor], srcs: Sequence[torch.Tensor]) -> None:
    """One fused ``_foreach_copy_`` of ``srcs`` into ``dsts``."""
    torch._foreach_copy_(list(dsts), list(srcs))


class TensorBlock:
    """Copies of several tensors side by side in one flat ``dtype`` block (from
    ``alloc(numel, dtype)``), to move them with one collective: e.g. a model's float
    buffers, which modules replace or update in place, so they cannot be views of it."""

    def __init__(self, tensors: Sequence[torch.Tensor], alloc: Callable[[int, torch.dtype], torch.Tensor],
                 dtype: torch.dtype = torch.float32):
        self.tensors = list(tensors)
        self.flat = alloc(sum(t.numel() for t in self.tensors), dtype)
        self.views = [v.view_as(t) for v, t in zip(self.flat.split([t.numel() for t in self.tensors]), self.tensors)]

    @classmethod
    def per_dtype(cls, tensors: Sequence[torch.Tensor], alloc: Callable[[int, torch.dtype], torch.Tensor]
                  ) -> list[TensorBlock]:
        """One block per dtype of ``tensors`` (in the order they first appear), each in that
        dtype: nothing is rounded on its way in."""
        return [cls([t for t in tensors if t.dtype == dtype], alloc, dtype)
                for dtype in dict.fromkeys(t.dtype for t in tensors)]

    @staticmethod
    def follow(blocks: Sequence[TensorBlock], tensors: Sequence[torch.Tensor], owner: str) -> None:
        """``blocks`` (:meth:`per_dtype`'s) hold ``tensors`` from now on: the same tensors, or
        ones that replaced them (a module's ``self.ema = ...``), of the same dtypes and shapes."""
        for block in blocks:
            now = [t for t in tensors if t is not None and t.dtype == block.flat.dtype]  # (None: one set to None)
            if len(now) != len(block.tensors) or any(t.shape != v.shape for t, v in zip(now, block.views)):
                raise RuntimeError(f"the model's floating-point buffers changed dtype or shape (or one was set to "
                                   f"None) since {owner} was built: call close() on every rank and build {owner} "
                                   "again; nothing was averaged")
            block.tensors = now

    def load(self) -> None:
        """The block := the tensors (one fused copy, casting to the block's dtype)."""
        foreach_copy(self.views, self.tensors)

    def store(self, other: TensorBlock | None = None) -> None:
        """The tensors := this block (or ``other``, a block of the same tensors)."""
        foreach_copy(self.tensors, (other or self).views)
