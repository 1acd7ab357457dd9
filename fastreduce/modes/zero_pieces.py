"""The torch optimizer over a rank's ZeRO chunks, one view per parameter piece, so that
it steps as ``torch.optim`` steps the whole model: a parameter that no rank's backward
gave a gradient this step is skipped (no weight decay, no moment update, its step count
unchanged), and every parameter has a state of its own, made when it is first stepped.

Chunk k of a bucket holds a contiguous range of each parameter that overlaps it (a
:class:`Piece`, possibly a whole parameter, possibly one element). :class:`ShardOptimizer`
gives the torch optimizer one view of the chunk's master per piece; its gradient is the
matching view of the chunk's averaged gradient, or ``None`` for a parameter unused on
every rank. The state is torch's own, per piece. Which tensors it holds depends on the
param group's hyperparameters (Adam's ``max_exp_avg_sq`` only with ``amsgrad=True``): a
chunk is one param group's, and :attr:`ShardOptimizer.group_keys` says each group's, the
same on every rank. :meth:`ShardOptimizer.pack` lays one chunk's state out flat (per key
of its group one tensor of the chunk's length, zero where a piece has no state; a table
of the pieces' scalars such as ``step``, and whether each has state):
the form in which ranks send it to each other and checkpoints gather it;
:meth:`ShardOptimizer.unpack` puts such a form back.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Collection, Iterable, Sequence

import torch

from ..layout import GradLayout

__all__ = ["Piece", "ShardOptimizer", "chunk_pieces", "kinds"]


@dataclass(frozen=True, slots=True)
class Piece:
    """The elements ``[start, start + n)`` of a parameter (flattened), at ``at`` in a chunk."""

    slot: int  # the parameter's layout slot
    index: int  # its torch.optim index
    start: int
    n: int
    at: int
    numel: int  # the parameter's elements


def chunk_pieces(layout: GradLayout, slots: Iterable[int], index_of: dict[int, int], s: int, k: int,
                 world: int) -> list[Piece]:
    """The pieces of chunk ``k`` of bucket ``s`` (whose parameters are layout ``slots``), in
    bucket order; ``index_of``: layout slot -> torch.optim index."""
    c = layout.segments[s].numel // world
    out = []
    for i in slots:
        slot = layout.slots[i]
        lo, hi = slot.offset, slot.offset + slot.numel
        a, b = max(lo, k * c), min(hi, (k + 1) * c)
        if a < b:
            out.append(Piece(i, index_of[i], a - lo, b - a, a - k * c, slot.numel))
    return out


class ShardOptimizer:
    """``optimizer_class`` over the pieces of ``masters`` (one chunk per bucket: a rank's own,
    or its copy of another rank's), one torch param group per ``param_groups`` entry
    (``groups``: each chunk's), gradients the matching views of each master's ``grad``."""

    def __init__(self, optimizer_class: type[torch.optim.Optimizer], param_groups: list[dict[str, Any]],
                 groups: Sequence[int], masters: Sequence[torch.Tensor], pieces: Sequence[list[Piece]],
                 defaults: dict[str, Any]):
        self.masters, self.pieces = list(masters), list(pieces)
        self.views = [[m[p.at:p.at + p.n] for p in ps] for m, ps in zip(masters, pieces)]
        self._grads = [[m.grad[p.at:p.at + p.n] for p in ps] for m, ps in zip(masters, pieces)]
        hypers = [{k: v for k, v in pg.items() if k != "params" and (k != "fused" or v is not None)}
                  for pg in param_groups]  # (no kernel chosen in a group: ``defaults``' choice)
        self.optimizer = optimizer_class(
            [{**h, "params": [v for vs, g in zip(self.views, groups) if g == i for v in vs]} for i, h in enumerate(hypers)],
            **defaults)
        self._defaults = defaults
        self._probed: tuple[Any, ...] | None = None
        self.probe_keys()
        self.groups, self._count = list(groups), sum(map(len, self.views))
        self._attached: bool | None = None  # every view's gradient attached (True), or as some mask left them

    def probe_keys(self, grow: bool = False, kind: tuple[Any, ...] | None = None) -> None:
        """Which state keys each param group keeps (:attr:`group_keys`, :attr:`keys`: every
        group's, :attr:`scalar_keys`), from its hyperparameters as they are now: at
        construction, and after a load replaced them (``amsgrad`` may be another's).

        ``grow``: at a step, where the hyperparameters changed in kind since the last probe
        (:func:`_kind`: SGD's ``momentum`` set from 0 by a warm-up or ``OneCycleLR``), the
        keys they add join the kept ones; none is dropped, as torch keeps a momentum buffer
        that a momentum set back to 0 no longer reads. ``kind``: :func:`kinds` of the param
        groups, where the caller has it (the same for the shard and its copies)."""
        kind = kinds(self.optimizer.param_groups) if kind is None else kind
        if grow and kind == self._probed:
            return
        hypers = [{k: v for k, v in g.items() if k != "params"} for g in self.optimizer.param_groups]
        group_keys, scalars = _probe(type(self.optimizer), hypers, self._defaults, self.masters[0])
        if grow:
            group_keys = [sorted({*old, *new}) for old, new in zip(self.group_keys, group_keys)]
            scalars = {**self._scalars, **scalars}
        self.group_keys, self._scalars, self._probed = group_keys, scalars, kind
        self.keys = sorted({k for keys in self.group_keys for k in keys})
        self.scalar_keys = sorted(self._scalars)

    @property
    def state(self) -> Any:
        return self.optimizer.state

    @property
    def param_groups(self) -> list[dict[str, Any]]:
        return self.optimizer.param_groups

    def step(self, used: Sequence[bool] | None = None) -> None:
        """Step every piece whose parameter (layout slot) is ``used`` (``None``: all).

        A fused kernel steps a param group's list as one: torch's fused SGD cannot step a
        list where some parameters have a momentum buffer and others none yet (their first
        gradient), so where the kernel is fused such a group's pieces without state are
        stepped apart, after those with state (the same update: a piece's step reads only
        its own state)."""
        if used is not None and all(used):
            used = None
        new = self._unstated(used)
        if new:
            self._attach(used, leave=new)
            self.optimizer.step()
            self._attach(used, only=new)
        elif used is not None:
            self._attach(used)
        elif self._attached is not True:
            self._attach(None)
        self.optimizer.step()

    def _unstated(self, used: Sequence[bool] | None) -> set[tuple[int, int]]:
        """The pieces, as (chunk, piece), stepped now without state in a fused param group
        where others stepped now have state (none at all once every piece has state)."""
        state, groups = self.optimizer.state, self.optimizer.param_groups
        if not state or len(state) >= self._count or not any(g.get("fused") for g in groups):
            return set()
        has: dict[int, set[bool]] = {}
        stepped = []
        for s, (ps, vs) in enumerate(zip(self.pieces, self.views)):
            g = self.groups[s]
            for j, (p, v) in enumerate(zip(ps, vs)):
                if groups[g].get("fused") and (used is None or used[p.slot]):
                    stated = bool(state.get(v))
                    stepped.append((g, s, j, stated))
                    has.setdefault(g, set()).add(stated)
        return {(s, j) for g, s, j, stated in stepped if not stated and len(has[g]) == 2}

    def _attach(self, used: Sequence[bool] | None, leave: Collection[tuple[int, int]] = (),
                only: Collection[tuple[int, int]] | None = None) -> None:
        """Each view's gradient: attached where its parameter is ``used`` (``None``: every
        one), but not for the pieces ``leave``, and (``only``) for those alone."""
        for s, (ps, vs, gs) in enumerate(zip(self.pieces, self.views, self._grads)):
            for j, (p, v, g) in enumerate(zip(ps, vs, gs)):
                on = (used is None or used[p.slot]) and (s, j) not in leave and (only is None or (s, j) in only)
                v.grad = g if on else None
        self._attached = used is None and not leave and only is None

    def keys_of(self, s: int) -> list[str]:
        """The tensor keys of chunk ``s``'s state: those its param group keeps."""
        return self.group_keys[self.groups[s]]

    def state_of(self, s: int, j: int) -> dict[str, Any]:
        """Piece ``j`` of chunk ``s``'s state (empty: never stepped)."""
        return self.optimizer.state.get(self.views[s][j], {})

    def drop(self, indices: Iterable[int] | None = None) -> None:
        """Forget the state of the pieces of torch.optim ``indices`` (``None``: all)."""
        gone = None if indices is None else set(indices)
        for ps, vs in zip(self.pieces, self.views):
            for p, v in zip(ps, vs):
                if gone is None or p.index in gone:
                    self.optimizer.state.pop(v, None)

    def scalar(self, key: str, value: float) -> Any:
        """``value`` of scalar state ``key`` as this optimizer keeps it (a tensor, or a number)."""
        kind = self._scalars[key]
        return value if kind is None else torch.tensor(value, dtype=kind[0], device=kind[1])

    # ------------------------------------------------------------------ flat form

    def table(self, s: int) -> torch.Tensor:
        """Chunk ``s``'s pieces' scalars: a float32 row per piece: has state (1/0), then each
        of :attr:`scalar_keys` (NaN where the piece has state but not that scalar)."""
        table = torch.zeros(len(self.pieces[s]), 1 + len(self.scalar_keys), dtype=torch.float32)
        for j in range(len(self.pieces[s])):
            st = self.state_of(s, j)
            if st:
                table[j] = torch.tensor([1.0] + [float(st[k]) if k in st else float("nan") for k in self.scalar_keys])
        return table

    def pack(self, s: int) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
        """Chunk ``s``'s state, flat: per tensor key of :meth:`keys_of` the chunk's length
        (zero where a piece has no state, or no such key), and :meth:`table`."""
        keys = self.keys_of(s)
        flats = {k: torch.zeros_like(self.masters[s]) for k in keys}
        for j, p in enumerate(self.pieces[s]):
            st = self.state_of(s, j)
            for k in keys:
                if k in st:
                    flats[k][p.at:p.at + p.n].copy_(st[k])
        return flats, self.table(s)

    def unpack(self, s: int, flats: dict[str, torch.Tensor], table: torch.Tensor) -> None:
        """Put :meth:`pack`'s form of chunk ``s`` back: each piece's state a copy of its range."""
        for j, (p, v) in enumerate(zip(self.pieces[s], self.views[s])):
            if not table[j, 0]:
                self.optimizer.state.pop(v, None)
                continue
            st = {k: flats[k][p.at:p.at + p.n].to(v.dtype, copy=True) for k in self.keys_of(s)}
            st.update({k: self.scalar(k, float(table[j, c])) for c, k in enumerate(self.scalar_keys, 1)
                       if table[j, c] == table[j, c]})  # NaN: the piece has no such scalar
            self.optimizer.state[v] = st

    def materialize(self, exclude: Iterable[int] = ()) -> set[int]:
        """Give every piece without state one (a step at lr=0 of those pieces alone, on zero
        gradients), except those of torch.optim indices ``exclude``; return their indices."""
        skip = set(exclude)
        made = {p.index for s, ps in enumerate(self.pieces) for j, p in enumerate(ps)
                if not self.state_of(s, j) and p.index not in skip}
        if not made:
            return made
        lrs = [g["lr"] for g in self.optimizer.param_groups]
        try:
            for ps, vs in zip(self.pieces, self.views):
                for p, v in zip(ps, vs):
                    v.grad = torch.zeros_like(v) if p.index in made else None
            for g in self.optimizer.param_groups:
                g["lr"] = 0.0
            self.optimizer.step()
        finally:
            for g, lr in zip(self.optimizer.param_groups, lrs):
                g["lr"] = lr
            self._attach(None)
        return made


def kinds(param_groups: Sequence[dict[str, Any]]) -> tuple[Any, ...]:
    """What of each param group's hyperparameters can change which state torch keeps: each
    flag and choice as it is, each number (a tensor's too) only zero or not (a momentum
    buffer exists where ``momentum`` is not 0): a scheduler moving ``lr`` every step changes
    none. Not the kernel (``fused``: the shards' own choice, the user's groups hold theirs)."""
    def of(v: Any) -> Any:
        if isinstance(v, (tuple, list)):
            return tuple(map(of, v))
        if isinstance(v, bool) or v is None or isinstance(v, str):
            return v
        if isinstance(v, (int, float)) or torch.is_tensor(v) and v.numel() == 1:
            return bool(v != 0)
        return type(v).__name__
    return tuple(tuple((k, of(v)) for k, v in sorted(g.items()) if k not in ("params", "fused")) for g in param_groups)


def _probe(optimizer_class: type[torch.optim.Optimizer], hypers: list[dict[str, Any]], defaults: dict[str, Any],
           like: torch.Tensor) -> tuple[list[list[str]], dict[str, tuple[torch.dtype, torch.device] | None]]:
    """The state keys ``optimizer_class`` keeps per parameter, from one step on one element
    per param group: per group those of the parameter's shape, and every group's scalars
    (``step``, ...), with their dtype and device (``None``: a Python number)."""
    keys: list[list[str]] = []
    scalars: dict[str, tuple[torch.dtype, torch.device] | None] = {}
    for h in hypers:
        x = torch.zeros(1, dtype=like.dtype, device=like.device)
        x.grad = torch.zeros_like(x)
        probe = optimizer_class([{**h, "params": [x]}], **defaults)
        probe.step()
        state = probe.state[x]
        keys.append(sorted(k for k, v in state.items() if torch.is_tensor(v) and v.dim() > 0))
        scalars.update({k: (v.dtype, v.device) if torch.is_tensor(v) else None
                        for k, v in state.items() if k not in keys[-1]})
    return keys, scalars
