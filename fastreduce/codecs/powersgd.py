"""PowerSGD: low-rank gradients (Vogels, Karimireddy and Jaggi, NeurIPS 2019, Algorithm 1).

Per gradient matrix ``M`` (a gradient of two or more dimensions, its memory viewed as
``shape[0] x rest``), with this rank's error-feedback residual ``e`` and a warm-started
``Q`` (``m x r``, the same on every rank)::

    M := grad + e
    P  = M Q                      -> mean over ranks (collective 1, with every
                                     uncompressed gradient of the group beside it)
    P := orthonormalize(P)           QR, batched over the matrices of one shape
    Q  = M^T P                    -> mean over ranks (collective 2)
    grad := P Q^T;  e := M - P Q^T;  Q is the next step's warm start

Both means are linear in ``M``, so ``P Q^T`` is the same on every rank; at full rank
(``r = min(n, m)``) it is the exact mean. A matrix is compressed only where it pays
(``min_compression_rate (n + m) r < n m``, torch's rule); vectors, small matrices and
gradients that are not fp32 travel uncompressed in collective 1.

Memory, per group of gradients (the whole model in the fused mode, one bucket in the
overlapped one): the reducer lays out each group's gradients with the uncompressed
ones first and the matrices sorted by shape, so the matrices of one shape are evenly
spaced in the flat gradient buffer and one strided ``(B, n, m)`` view of it serves the
batched matmuls: no copy of a matrix, one ``bmm`` per shape for each of ``P``, ``Q``
and ``P Q^T``. ``wire_p = [uncompressed | every P]`` and ``wire_q = [every Q]`` are the
two buffers sent (from the comm layer's allocator, e.g. shared memory); where the wire
dtype is fp32 the factors are computed straight into them.

:class:`PowerSGD` is the user's setting (``compression=`` of the reducer);
:class:`LowRank` is the state one reducer builds from it: its groups, step count, the
``Q`` memory and the residuals; :meth:`LowRank.state_dict` is what a checkpoint keeps.
The codec knows neither modes nor transports: the mode launches its collectives and
calls :meth:`LowRankGroup.encode`, :meth:`~LowRankGroup.between` and
:meth:`~LowRankGroup.decode` around them.
"""

from __future__ import annotations

import math
import zlib
from dataclasses import KW_ONLY, dataclass
from typing import Any, Callable, Iterable, Sequence

import torch

from ..buffer import foreach_copy

__all__ = ["LowRank", "LowRankGroup", "PowerSGD", "check_state", "initial_q", "orthonormalize_", "orthonormalize_scratch"]


@dataclass(frozen=True)
class PowerSGD:
    """Low-rank compression of the gradients' matrices, as ``compression=`` of
    :class:`~fastreduce.FusedReducer` (fused or overlapped) and
    :func:`~fastreduce.all_reduce_gradients`.

    Args:
        rank: the approximation's rank ``r`` (per matrix at most ``min(n, m)``).
        warmup_steps: reductions averaged exactly before compression starts (as torch's
            ``start_powerSGD_iter``): early gradients change fast and a low-rank
            approximation loses most of them.
        error_feedback: each rank adds what the approximation left out of its own
            gradient to its next one (``e := M - P Q^T``), so nothing is lost over time.
        warm_start: start each step's power iteration from the last step's averaged
            ``Q`` (one iteration per step then tracks the top subspace); ``False`` draws
            a new random ``Q`` every step (the same on every rank).
        min_compression_rate: compress an ``n x m`` matrix only if it sends more than this
            many times fewer values (``n m / ((n + m) r)``, as torch's ``powerSGD_hook``);
            others go uncompressed.
        seed: seeds the initial ``Q`` of every matrix (:func:`initial_q`).

    Example::

        >>> reducer = fastreduce.FusedReducer(model, wire_dtype=torch.float32,
        ...                                   compression=fastreduce.PowerSGD(rank=4, warmup_steps=100))
    """

    rank: int = 4
    _: KW_ONLY
    warmup_steps: int = 0
    error_feedback: bool = True
    warm_start: bool = True
    min_compression_rate: float = 2.0
    seed: int = 0

    def __post_init__(self) -> None:
        if isinstance(self.rank, bool) or not isinstance(self.rank, int) or self.rank < 1:
            raise ValueError(f"PowerSGD rank must be an integer >= 1, got {self.rank!r}")
        if isinstance(self.warmup_steps, bool) or not isinstance(self.warmup_steps, int) or self.warmup_steps < 0:
            raise ValueError(f"PowerSGD warmup_steps must be an integer >= 0, got {self.warmup_steps!r}")
        if not isinstance(self.min_compression_rate, (int, float)) or not self.min_compression_rate >= 0:
            raise ValueError(f"PowerSGD min_compression_rate must be a number >= 0, got "
                             f"{self.min_compression_rate!r}")
        if not isinstance(self.seed, int):
            raise ValueError(f"PowerSGD seed must be an integer, got {self.seed!r}")

    def matrix_rank(self, shape: Sequence[int], dtype: torch.dtype) -> int:
        """The rank a gradient of ``shape`` and ``dtype`` is compressed at; 0: sent whole."""
        if dtype != torch.float32 or len(shape) < 2:
            return 0
        n, m = shape[0], math.prod(shape[1:])
        r = min(self.rank, n, m)
        if r == 0 or not self.min_compression_rate * (n + m) * r < n * m:  # torch's rule (_should_compress)
            return 0
        return r

    def state_sizes(self, named: Iterable[tuple[str, torch.Tensor]]) -> dict[str, tuple[int, int | None]]:
        """Per matrix this setting compresses among ``named`` (the trainable parameters), the
        values of its ``Q`` and of its residual (``None``: no error feedback): what
        :meth:`LowRank.load_state_dict` takes, known before the layout exists."""
        sizes = {}
        for name, p in named:
            r = self.matrix_rank(p.shape, p.dtype)
            if r:
                n, m = p.shape[0], p.numel() // p.shape[0]
                sizes[name] = (m * r, n * m if self.error_feedback else None)
        return sizes

    def order_key(self, param: torch.Tensor) -> tuple[int, ...]:
        """Where the layout puts ``param`` in its group: uncompressed ones first (model
        order kept by a stable sort), then the matrices by shape."""
        r = self.matrix_rank(param.shape, param.dtype)
        if not r:
            return (0,)
        return (1, param.shape[0], param.numel() // param.shape[0], r)


def initial_q(name: str, m: int, r: int, seed: int = 0) -> torch.Tensor:
    """The first ``Q`` (``m x r``, standard normal, fp32, CPU) of the matrix of parameter
    ``name``: a function of the name and the seed only, so it is the same on every rank,
    in every bucketing and after a rebuild."""
    gen = torch.Generator().manual_seed((seed * 0x9E3779B1 + zlib.crc32(name.encode())) % (1 << 63))
    return torch.randn(m, r, generator=gen)


def orthonormalize_(p: torch.Tensor, scratch: tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]) -> None:
    """Orthonormalize the columns of every matrix of ``p`` (``B x n x r``) in place: the Q of
    a Householder QR, its columns' signs chosen so that R's diagonal is positive, which is
    what Gram-Schmidt (the paper's choice) gives wherever P has full column rank. Unlike
    Gram-Schmidt it stays orthonormal where P does not (a gradient of rank below r: a
    batch smaller than the layer), which keeps the full-rank approximation exact.
    ``scratch`` (from :func:`orthonormalize_scratch`) makes it allocate nothing."""
    q, r, sign, one = scratch
    torch.linalg.qr(p, out=(q, r))
    torch.copysign(one, torch.diagonal(r, dim1=-2, dim2=-1).unsqueeze(1), out=sign)
    torch.mul(q, sign, out=p)


def orthonormalize_scratch(p: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Scratch buffers for :func:`orthonormalize_` of ``p``."""
    b, _, r = p.shape
    return (torch.empty_like(p), p.new_empty(b, r, r), p.new_empty(b, 1, r), p.new_ones(b, 1, r))


@dataclass
class _Batch:
    """The compressed matrices of one shape in one group: strided views of the flat
    gradient buffer (``m``), of the factor buffers (``p``, ``q``) and the residuals."""

    names: tuple[str, ...]
    m: torch.Tensor  # B x n x m, the gradients themselves
    p: torch.Tensor  # B x n x r (fp32)
    qt: torch.Tensor  # B x r x m (fp32): Q transposed, so that M is read in its own order; the warm start
    e: torch.Tensor | None  # B x n x m residuals (error feedback)
    scratch: tuple[torch.Tensor, ...]  # orthonormalize_'s


class LowRankGroup:
    """The gradients one pair of collectives carries (see the module doc).

    The mode calls, in order: :meth:`encode` (fills ``wire_p``), the averaging
    all-reduce of ``wire_p``, :meth:`between` (fills ``wire_q``), the all-reduce of
    ``wire_q``, :meth:`decode` (the gradients := ``P Q^T``). Each touches only
    persistent buffers and allocates nothing, so a graph backend may record it.
    """

    def __init__(self, batches: list[_Batch], plain: list[tuple[torch.Tensor, torch.Tensor]],
                 wire_p: torch.Tensor, wire_q: torch.Tensor, p_flat: torch.Tensor, q_flat: torch.Tensor,
                 p_wire: torch.Tensor, q_wire: torch.Tensor):
        self.batches = batches
        self.plain = plain  # (gradient storage, its place in wire_p), sent whole
        self.wire_p, self.wire_q = wire_p, wire_q
        self._p_flat, self._q_flat = p_flat, q_flat  # fp32 factors
        self._p_wire, self._q_wire = p_wire, q_wire  # their places on the wire (the same tensors for an fp32 wire)
        self.scale = torch.ones((), device=wire_p.device)  # what each rank's part is multiplied by before the sum

    @property
    def nbytes(self) -> int:
        """Bytes sent per reduction (both collectives)."""
        return self.wire_p.numel() * self.wire_p.element_size() + self.wire_q.numel() * self.wire_q.element_size()

    def encode(self) -> None:
        """``wire_p`` := [uncompressed gradients | P = (grad + e) Q per matrix]."""
        if self.plain:
            foreach_copy([w for _, w in self.plain], [g for g, _ in self.plain])
        for b in self.batches:
            if b.e is not None:
                b.m.add_(b.e)
            torch.bmm(b.m, b.qt.transpose(1, 2), out=b.p)
        if self._p_wire is not self._p_flat:
            self._p_wire.copy_(self._p_flat)
        self.wire_p.mul_(self.scale)

    def between(self) -> None:
        """After ``wire_p``'s mean: the uncompressed gradients back; P orthonormalized;
        ``wire_q`` := Q = M^T P per matrix."""
        if self.plain:
            foreach_copy([g for g, _ in self.plain], [w for _, w in self.plain])
        if self._p_wire is not self._p_flat:
            self._p_flat.copy_(self._p_wire)
        for b in self.batches:
            orthonormalize_(b.p, b.scratch)
            torch.bmm(b.p.transpose(1, 2), b.m, out=b.qt)  # Q^T = P^T M: M read in its own order
        if self._q_wire is not self._q_flat:
            self._q_wire.copy_(self._q_flat)
        self.wire_q.mul_(self.scale)

    def decode(self) -> None:
        """After ``wire_q``'s mean: each gradient := P Q^T; with error feedback the
        residual := M - P Q^T (what was left out of this rank's M, to rounding)."""
        if self._q_wire is not self._q_flat:
            self._q_flat.copy_(self._q_wire)
        for b in self.batches:
            if b.e is not None:
                b.e.copy_(b.m)
            torch.bmm(b.p, b.qt, out=b.m)
            if b.e is not None:  # copy, product, subtract: faster than one baddbmm (1.1 against 1.9 ms
                b.e.sub_(b.m)    # for 8 x 512 x 512 on one CPU thread; a rank-4 product is a poor GEMM)

    def draw_q(self, generator: torch.Generator) -> None:
        """A fresh random Q for every matrix (``warm_start=False``)."""
        if self._q_flat.numel():
            fresh = torch.randn(self._q_flat.shape, generator=generator)
            self._q_flat.copy_(fresh)


class LowRank:
    """One reducer's PowerSGD state: its groups, the step count, Q and the residuals.

    Args:
        config: the user's :class:`PowerSGD`.
        groups: per group, its gradients as ``(name, parameter, storage)``: ``storage``
            is the gradient's place in the flat gradient buffer (a 1-D slice), in the
            layout's order (uncompressed first within each flat buffer, then matrices by
            shape: :meth:`PowerSGD.order_key`).
        wire_dtype: the dtype both collectives send.
        alloc: ``alloc(numel, dtype)`` -> zeroed storage for a buffer the collectives
            move (collective: every rank calls it in the same order).

    A group's ``scale`` (a 0-dim tensor each rank's factors and uncompressed gradients
    are multiplied by before the sum: 1 / world for a backend without an averaging
    collective; world / active ranks under ``Join``) is the mode's to fill each step.
    """

    def __init__(self, config: PowerSGD, groups: list[list[tuple[str, torch.Tensor, torch.Tensor]]],
                 wire_dtype: torch.dtype, alloc: Callable[[int, torch.dtype], torch.Tensor]):
        self.config = config
        self.step = 0
        self.groups: list[LowRankGroup] = []
        self._names: dict[str, tuple[_Batch, int]] = {}  # matrix name -> (its batch, index in it)
        self._generator: torch.Generator | None = None
        self.later: list[Any] = []  # the mode's launched second collectives, waited at the end of a step
        for members in groups:
            self.groups.append(self._group(members, wire_dtype, alloc))

    @property
    def compressing(self) -> bool:
        """Whether this step compresses (the warm-up's steps are averaged exactly)."""
        return self.step >= self.config.warmup_steps

    @property
    def matrices(self) -> int:
        return len(self._names)

    def _group(self, members: list[tuple[str, torch.Tensor, torch.Tensor]], wire_dtype: torch.dtype,
               alloc: Callable[[int, torch.dtype], torch.Tensor]) -> LowRankGroup:
        cfg = self.config
        plain_runs: list[list[torch.Tensor]] = []  # uncompressed storage, merged where adjacent
        shapes: list[tuple[int, int, int, list[tuple[str, torch.Tensor]]]] = []
        for name, param, storage in members:
            r = cfg.matrix_rank(param.shape, param.dtype)
            if not r:
                last = plain_runs[-1][-1] if plain_runs else None
                if last is not None and last.dtype == storage.dtype and _follows(last, storage):
                    plain_runs[-1].append(storage)
                else:
                    plain_runs.append([storage])
                continue
            n, m = param.shape[0], param.numel() // param.shape[0]
            if shapes and shapes[-1][:3] == (n, m, r):
                shapes[-1][3].append((name, storage))
            else:
                shapes.append((n, m, r, [(name, storage)]))
        plain_src = [_span(run) for run in plain_runs]
        n_plain = sum(t.numel() for t in plain_src)
        n_p = sum(len(ms) * n * r for n, _, r, ms in shapes)
        n_q = sum(len(ms) * m * r for _, m, r, ms in shapes)
        device = members[0][2].device
        wire_p, wire_q = alloc(n_plain + n_p, wire_dtype), alloc(n_q, wire_dtype)
        p_wire, q_wire = wire_p[n_plain:], wire_q
        fp32 = wire_dtype == torch.float32
        p_flat = p_wire if fp32 else torch.zeros(n_p, device=device)
        q_flat = q_wire if fp32 else torch.zeros(n_q, device=device)
        n_e = sum(len(ms) * n * m for n, m, _, ms in shapes) if cfg.error_feedback else 0
        e_flat = torch.zeros(n_e, device=device)
        plain, at = [], 0
        for src in plain_src:
            plain.append((src, wire_p[at:at + src.numel()]))
            at += src.numel()
        batches, ap, aq, ae = [], 0, 0, 0
        for n, m, r, ms in shapes:
            b = len(ms)
            first = ms[0][1]
            step = ms[1][1].storage_offset() - first.storage_offset() if b > 1 else n * m
            for k, (name, storage) in enumerate(ms):
                if storage.storage_offset() != first.storage_offset() + k * step or not storage.is_contiguous():
                    raise AssertionError(f"fastreduce: PowerSGD's matrices of shape {n}x{m} are not evenly "
                                         f"spaced in the gradient buffer ({name!r}); the layout is not sorted")
            mats = first.as_strided((b, n, m), (step, m, 1), first.storage_offset())
            batch = _Batch(tuple(nm for nm, _ in ms), mats,
                           p_flat[ap:ap + b * n * r].view(b, n, r), q_flat[aq:aq + b * m * r].view(b, r, m),
                           e_flat[ae:ae + b * n * m].view(b, n, m) if cfg.error_feedback else None, ())
            batch.scratch = orthonormalize_scratch(batch.p)
            ap, aq = ap + b * n * r, aq + b * m * r
            ae += b * n * m if cfg.error_feedback else 0
            with torch.no_grad():
                for k, name in enumerate(batch.names):
                    batch.qt[k].copy_(initial_q(name, m, r, cfg.seed).T)
                    self._names[name] = (batch, k)
            batches.append(batch)
        if not fp32:
            q_wire.copy_(q_flat)
        return LowRankGroup(batches, plain, wire_p, wire_q, p_flat, q_flat, p_wire, q_wire)

    def before_step(self) -> None:
        """Once per compressed step before the first encode: a fresh Q where warm start is off."""
        if not self.config.warm_start:
            if self._generator is None:
                self._generator = torch.Generator()
            self._generator.manual_seed(self.config.seed * 1_000_003 + self.step)
            for g in self.groups:
                g.draw_q(self._generator)

    # ------------------------------------------------------------------ checkpoint

    def state_dict(self) -> dict[str, Any]:
        """``{"step", "q": {name: m x r}, "error": {name: n x m}}``: this rank's residuals
        (its own), the Q memory (the same on every rank), copies."""
        q, e = {}, {}
        for name, (batch, k) in self._names.items():
            q[name] = batch.qt[k].T.clone()
            if batch.e is not None:
                e[name] = batch.e[k].detach().clone()
        return {"step": self.step, "q": q, "error": e}

    def initial_state(self) -> dict[str, Any]:
        """:meth:`state_dict` as it is before a first step: step 0, each matrix's first ``Q``
        (:func:`initial_q`), no residual."""
        q = {name: initial_q(name, batch.qt.shape[2], batch.qt.shape[1], self.config.seed)
             for name, (batch, _) in self._names.items()}
        return {"step": 0, "q": q, "error": {}}

    def state_tensors(self) -> list[torch.Tensor]:
        """The Q memory and the residuals themselves (what a compressed step changes besides
        :attr:`step` and the gradients), per group and shape."""
        return [t for g in self.groups for b in g.batches for t in (b.qt, b.e) if t is not None]

    @torch.no_grad()
    def load_state_dict(self, state: dict[str, Any], strict: bool = True) -> None:
        """Restore :meth:`state_dict`; checked first (``ValueError``, nothing changed).
        ``strict=False`` (a rebuild after the model changed) keeps what still fits and
        starts the rest afresh."""
        sizes = {name: (b.qt[k].numel(), None if b.e is None else b.e[k].numel()) for name, (b, k) in self._names.items()}
        if not strict and isinstance(state, dict) and {"step", "q", "error"} <= set(state):
            state = {"step": state["step"], **{key: {n: t for n, t in state[key].items() if _fits(sizes, key, n, t)}
                                               for key in ("q", "error")}}
            state["q"].update({n: batch.qt[k].T.clone() for n, (batch, k) in self._names.items()
                               if n not in state["q"]})
        check_state(state, sizes)
        for name, (batch, k) in self._names.items():
            batch.qt[k].copy_(state["q"][name].reshape(batch.qt[k].T.shape).T)
            if batch.e is not None:
                if name in state["error"]:
                    batch.e[k].copy_(state["error"][name].reshape(batch.e[k].shape))
                else:
                    batch.e[k].zero_()
        for g in self.groups:
            if g._q_wire is not g._q_flat:
                g._q_wire.copy_(g._q_flat)
        self.step = int(state["step"])



def check_state(state: Any, sizes: dict[str, tuple[int, int | None]]) -> None:
    """``ValueError`` unless ``state`` is a PowerSGD state that fits ``sizes`` (per compressed
    matrix, its Q's values and its residual's: :meth:`PowerSGD.state_sizes`)."""
    if not isinstance(state, dict) or not {"step", "q", "error"} <= set(state):
        raise ValueError("not a PowerSGD state (it needs 'step', 'q' and 'error')")
    for key in ("q", "error"):
        for name, t in state[key].items():
            if not _fits(sizes, key, name, t):
                raise ValueError(f"the PowerSGD {key} saved for {name!r} does not fit this model and "
                                 f"setting (rank, min_compression_rate, error_feedback); build the "
                                 f"reducer as it was saved")
    missing = set(sizes) - set(state["q"])
    if missing:
        raise ValueError(f"the PowerSGD state has no Q for {sorted(missing)[:3]}: saved with another rank "
                         "or min_compression_rate?")


def _fits(sizes: dict[str, tuple[int, int | None]], key: str, name: str, t: Any) -> bool:
    want = sizes.get(name, (None, None))[0 if key == "q" else 1]
    return want is not None and torch.is_tensor(t) and t.numel() == want


def _follows(a: torch.Tensor, b: torch.Tensor) -> bool:
    """``b`` starts where ``a`` (1-D, in the same storage) ends, give or take the layout's
    alignment gap (zeros, sent along)."""
    gap = b.storage_offset() - (a.storage_offset() + a.numel())
    return a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr() and 0 <= gap < 64


def _span(run: list[torch.Tensor]) -> torch.Tensor:
    """One 1-D tensor from the first of ``run`` to the end of the last (same storage)."""
    first, last = run[0], run[-1]
    n = last.storage_offset() + last.numel() - first.storage_offset()
    return first.as_strided((n,), (1,), first.storage_offset())
