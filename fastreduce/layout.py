"""GradLayout: which gradients take part, in which order, and where each lives in the flat buffer.

The layout is learned once from the model and fixed. Parameters are grouped by dtype
(each dtype gets one contiguous segment of the flat buffer, the wire dtype's segment
first), and inside a segment they keep ``named_parameters()`` order, so tied
parameters appear once. Every offset is aligned to :data:`ALIGN` elements.

The layout's signature (names, shapes, strides, dtypes) is hashed and compared across
ranks with one small all-gather (:func:`verify_across_ranks`); a mismatch raises
:class:`LayoutMismatchError` on every rank, naming the first differing parameter.
"""

from __future__ import annotations

import functools
import hashlib
import operator
from dataclasses import dataclass
from typing import Any, Callable, Iterable

import torch
import torch.distributed as dist

from .faults_watchdog import all_gather_object_watched, wait_watched
from .torch_internals import parameter_slots, submodule_slots

__all__ = ["ALIGN", "FrozenAtBuild", "GradLayout", "LayoutMismatchError", "ParamsHeld", "Slot", "Segment", "bucket_runs", "counted",
           "holding_dtype", "verify_across_ranks", "verify_model", "wire_word"]

ALIGN = 32
"""Every parameter's offset in its segment is a multiple of this many elements."""


class LayoutMismatchError(RuntimeError):
    """The ranks do not agree on which gradients to reduce (names, shapes, dtypes or order)."""


@dataclass(frozen=True, slots=True)
class Slot:
    """One parameter's place: ``numel`` elements at ``offset`` of its dtype's segment."""

    name: str
    param: torch.nn.Parameter
    offset: int
    numel: int

    def signature(self) -> str:
        p = self.param
        return f"{self.name}:{tuple(p.shape)}:{p.stride()}:{p.dtype}"


@dataclass(frozen=True, slots=True)
class Segment:
    """All parameters of one dtype: one contiguous run of the flat buffer."""

    dtype: torch.dtype
    slots: tuple[Slot, ...]
    numel: int  # padded to ALIGN


def _align(n: int) -> int:
    return (n + ALIGN - 1) // ALIGN * ALIGN


class GradLayout:
    """The fixed set of parameters a reducer serves, grouped into one segment per dtype.

    Args:
        named_params: ``(name, parameter)`` pairs in model order, tied ones once.
        first_dtype: the dtype whose segment comes first (the wire dtype, so that its
            segment can alias the wire buffer).
        segments: explicit segments instead, as lists of indices into ``named_params``
            (each of one dtype): the ZeRO mode makes one per bucket.
        pad_to: each segment's length is padded to a multiple of this (equal shards).
    """

    def __init__(self, named_params: list[tuple[str, torch.nn.Parameter]], first_dtype: torch.dtype, *,
                 segments: list[list[int]] | None = None, pad_to: int = 1):
        if not named_params:
            raise ValueError("no parameter requires a gradient: nothing to reduce")
        if segments is None:  # one per dtype, the first dtype's first
            dtypes = sorted({p.dtype for _, p in named_params}, key=lambda d: (d != first_dtype, str(d)))
            segments = [[k for k, (_, p) in enumerate(named_params) if p.dtype == d] for d in dtypes]
        built = []
        for members in segments:
            dtype = named_params[members[0]][1].dtype
            slots, offset = [], 0
            for k in members:
                name, p = named_params[k]
                if p.dtype != dtype:
                    raise ValueError(f"segment mixes {dtype} and {p.dtype} ({name!r})")
                slots.append(Slot(name, p, offset, p.numel()))
                offset = _align(offset + p.numel())
            built.append(Segment(dtype, tuple(slots), -(-offset // pad_to) * pad_to))
        segments = built
        self.segments: tuple[Segment, ...] = tuple(segments)
        # Slots in segment order: index i of every per-parameter list below.
        self.slots: tuple[Slot, ...] = tuple(s for seg in self.segments for s in seg.slots)
        # Each slot's position in ``named_params`` (the backward order, in overlap mode).
        where = {id(p): k for k, (_, p) in enumerate(named_params)}
        self.position: tuple[int, ...] = tuple(where[id(s.param)] for s in self.slots)
        self.params: tuple[torch.nn.Parameter, ...] = tuple(s.param for s in self.slots)
        self.names: tuple[str, ...] = tuple(s.name for s in self.slots)
        self.numel: int = sum(seg.numel for seg in self.segments)
        self.signature: tuple[str, ...] = tuple(s.signature() for s in self.slots)

    def __len__(self) -> int:
        return len(self.slots)

    def describe(self) -> str:
        """``20 float32 grads, 72,328 elements``; with several dtypes ``20 grads (7 bfloat16,
        13 float32), ...``: counted per dtype, however many segments (buckets, fragments) hold them."""
        per: dict[str, int] = {}
        for seg in self.segments:
            name = str(seg.dtype).removeprefix("torch.")
            per[name] = per.get(name, 0) + len(seg.slots)
        n = sum(s.numel for s in self.slots)
        what = f"{len(self.slots)} {next(iter(per))} grads" if len(per) == 1 else \
            f"{len(self.slots)} grads ({', '.join(f'{k} {d}' for d, k in per.items())})"
        return f"{what}, {n:,} elements"


_data_ptr = torch.Tensor.data_ptr
_REBUILD = ("Call reducer.rebuild() on every rank after changing the model's parameters (for "
            "all_reduce_gradients(model): fastreduce.gradient_reducer(model, <the same arguments>).rebuild()); "
            "nothing was reduced in this call and the gradients are as they were")


class ParamsHeld:
    """Whether a layout's parameters are still ``root``'s, on the storage they had when the
    layout was learned: a call is two C-speed passes (each parameter's ``data_ptr`` against
    the one noted, each owner's entry by identity), no Python loop per parameter.

    What it catches: a parameter replaced by another object (``load_state_dict(assign=True)``,
    ``module.weight = nn.Parameter(...)``), or given new storage (``model.double()``,
    ``model.to(device)``, ``p.data = t``: the gradient keeps its identity but not its place in
    the flat buffer). A gradient layout keeps the parameters it learned; reduced as they
    were, such parameters would never be averaged. Without ``root`` (or for a parameter
    ``root`` does not hold under its layout name) only the storage is watched.

    ``whole``: the layout is every parameter of ``root`` that trains (a reducer's), so one
    added to ``root`` since (``model.head = nn.Linear(...)``, ``register_parameter``) that
    requires grad would train outside it, each rank on its own: caught too, by one more
    C-speed pass (the sizes of ``root``'s modules' parameter and submodule dicts); one added
    frozen is watched until it is unfrozen.

    ``remedy``: what the error tells the user to do (the owner's way to learn the layout again);
    ``storage=False``: the storage is not watched (an owner that moves the parameters itself:
    gossip swaps them between two blocks at each step)."""

    __slots__ = ("params", "names", "owned", "owners", "keys", "ptrs", "fresh", "remedy", "root", "known", "dicts",
                 "count", "added")

    def __init__(self, layout: GradLayout, root: torch.nn.Module | None, remedy: str = _REBUILD,
                 whole: bool = False, storage: bool = True):
        self.params, self.names, self.remedy = layout.params, layout.names, remedy
        found = [] if root is None else [(p, owner, key) for p, (path, _, key) in
                                         zip(self.params, (n.rpartition(".") for n in self.names))
                                         for owner in [_slots_at(root, path)] if owner.get(key) is p]
        self.owned, self.owners, self.keys = (tuple(x) for x in zip(*found)) if found else ((), (), ())
        self.ptrs = tuple(map(_data_ptr, self.params)) if storage else None
        self.fresh = False  # checked already this step (every bucket's adopt asks; one pass a step)
        self.root = root if whole else None
        self.known = tuple(self.root.parameters()) if self.root is not None else ()  # (held: their ids stay theirs)
        self.added: tuple[torch.nn.Parameter, ...] = ()  # root's parameters since: frozen, or raised
        self._look()

    def _look(self) -> None:
        """Note the dicts of ``root``'s modules (their parameters, their submodules) and their sizes."""
        modules = () if self.root is None else tuple(self.root.modules())
        self.dicts = tuple(map(parameter_slots, modules)) + tuple(map(submodule_slots, modules))
        self.count = sum(map(len, self.dicts))

    def __call__(self) -> bool:
        """True while every parameter is the one learned, on the same storage, and none that
        trains was added: looked at once a step (until :meth:`expire`)."""
        if not self.fresh:
            self.fresh = (self.ptrs is None or tuple(map(_data_ptr, self.params)) == self.ptrs) and \
                all(map(operator.is_, map(dict.get, self.owners, self.keys), self.owned)) and self._none_added()
        return self.fresh

    def _none_added(self) -> bool:
        if self.root is not None and sum(map(len, self.dicts)) != self.count:  # a parameter or module came or went
            known = set(map(id, self.known))
            self.added = tuple(p for p in self.root.parameters() if id(p) not in known)
            self._look()
        return not any(map(_requires_grad, self.added))

    def expire(self) -> None:
        """The step is over: the next call looks again (the model may change between steps)."""
        self.fresh = False

    def check(self) -> None:
        """Look now (not once a step) and raise :meth:`error` where a parameter changed: for an
        owner that checks once per collective of its own (a local mode's sync, gossip's step)."""
        self.fresh = False
        if not self():
            raise self.error()

    def changed(self) -> list[str]:
        """The names of the parameters replaced or moved (the error path)."""
        replaced = {id(p) for p, owner, key in zip(self.owned, self.owners, self.keys) if owner.get(key) is not p}
        ptrs = self.ptrs or (None,) * len(self.params)
        return [n for n, p, ptr in zip(self.names, self.params, ptrs)
                if id(p) in replaced or ptr is not None and p.data_ptr() != ptr]

    def error(self) -> RuntimeError:
        """What :meth:`__call__` found, and what to do."""
        names = self.changed()
        if not names and self.root is not None:
            training = {id(p) for p in self.added if p.requires_grad}
            added = [n for n, p in self.root.named_parameters() if id(p) in training]
            return RuntimeError(
                f"parameter(s) {_shown(added)} were added to the model (or unfrozen after being added frozen) "
                "since fastreduce learned the gradient layout, so they would not be averaged: each "
                f"rank would train them on its own. {self.remedy}")
        return RuntimeError(
            f"parameter(s) {_shown(names)} changed since fastreduce learned the gradient layout: replaced by new "
            "Parameter objects (e.g. load_state_dict(..., assign=True)) or moved to new storage (e.g. "
            f"model.double(), model.to(...), p.data = t), so they would not be averaged. {self.remedy}")


def _shown(names: list[str]) -> str:
    return ", ".join(repr(n) for n in names[:5]) + (f" and {len(names) - 5} more" if len(names) > 5 else "")


def _slots_at(root: torch.nn.Module, path: str) -> dict[str, Any]:
    """The parameter dict of ``root``'s submodule at ``path`` (empty where there is none:
    a name that is not a module path, e.g. an optimizer's ``param_groups[0][1]``)."""
    try:
        return parameter_slots(root.get_submodule(path))
    except AttributeError:
        return {}


_requires_grad = operator.attrgetter("requires_grad")


class FrozenAtBuild:
    """The parameters frozen (``requires_grad=False``) when a mode fixed the ones it reduces,
    averages or steps (every mode's): left out of its layout. One unfrozen since (gradual
    unfreezing) would train outside it, each rank on its own; :meth:`check`, one C-speed
    pass over the frozen ones (nothing where none is), raises before a collective."""

    __slots__ = ("params",)

    def __init__(self, params: Iterable[torch.nn.Parameter]):
        self.params = tuple(p for p in params if not p.requires_grad)

    def check(self, named: Callable[[], Iterable[tuple[str, torch.nn.Parameter]]], when: str, consequence: str,
              remedy: str) -> None:
        """Raise where one of them now requires grad: the same error on every rank that made
        the same change, naming the parameters (``named()``: the names to show); the caller has
        changed nothing yet."""
        if not (self.params and any(map(_requires_grad, self.params))):
            return
        names = {id(p): n for n, p in named()}
        thawed = [names.get(id(p), "?") for p in self.params if p.requires_grad]
        raise RuntimeError(f"parameter(s) {_shown(thawed)} now require grad but were frozen when {when}, so {consequence}; "
                           f"{remedy}; nothing was changed by this call")


def counted(n: int, noun: str) -> str:
    """``1 bucket``, ``3 buckets``: a count as the logs say it."""
    return f"{n} {noun}" if n == 1 else f"{n} {noun}s"


def holding_dtype(dtypes: Iterable[torch.dtype]) -> torch.dtype:
    """The narrowest dtype that holds every one of ``dtypes`` (the wire of ``wire_dtype=None``
    on a mixed model): the widest of them where it holds the others, float32 for float16
    with bfloat16, neither of which holds the other (fp16 lacks bf16's range, bf16 fp16's
    precision): torch's type promotion."""
    return functools.reduce(torch.promote_types, dtypes)


def wire_word(wire: object) -> str:
    """A wire as the logs say it: ``bfloat16`` for ``torch.bfloat16``, a codec as it prints."""
    return str(wire).removeprefix("torch.")


def verify_across_ranks(layout: GradLayout, group: dist.ProcessGroup | None, device: torch.device,
                        present: tuple[bool, ...] | None = None) -> None:
    """Raise :class:`LayoutMismatchError` on every rank unless all ranks hold the same layout.

    ``present``, when given, marks which parameters have a gradient now; it must agree
    too. One all-gather of a 32-byte digest; only on a mismatch are the full
    signatures gathered to say which parameter differs. Every rank takes the same
    branch, so a mismatch never leaves one rank waiting in a collective.
    """
    signature = layout.signature
    if present is not None:
        signature = tuple(s if ok else s + " (no grad)" for s, ok in zip(signature, present))
    _agree(signature, group, device, "gradient layouts differ across ranks (this is rank {rank}); every "
           "rank must reduce the same parameters with the same shapes, strides, dtypes and order:",
           "Build the same model on every rank (same requires_grad flags, dtypes and memory formats) "
           "before the first reduction.")


def verify_model(named: list[tuple[str, torch.Tensor]], group: dist.ProcessGroup | None,
                 device: torch.device, mode: str) -> None:
    """Raise :class:`LayoutMismatchError` on every rank unless every rank's ``named``
    tensors (a model's trainable parameters, in order) have the same names, shapes and
    dtypes: what a mode that exchanges whole parameters checks before it touches them.
    One digest all-gather, as :func:`verify_across_ranks`."""
    signature = tuple(f"{n}:{tuple(t.shape)}:{t.dtype}" for n, t in named)
    _agree(signature, group, device, "the models differ across ranks (this is rank {rank}); every rank "
           "must hold the same trainable parameters, with the same names, shapes, dtypes and order:",
           f"Build the same model on every rank before building {mode}; nothing was changed.")


def _agree(signature: tuple[str, ...], group: dist.ProcessGroup | None, device: torch.device,
           head: str, tail: str) -> None:
    digest = hashlib.sha256("\n".join(signature).encode()).digest()
    mine = torch.frombuffer(bytearray(digest), dtype=torch.uint8).to(device=device, dtype=torch.int32)
    gathered = [torch.empty_like(mine) for _ in range(dist.get_world_size(group))]
    # (watched: a Membership's member lost as the others build their modes names itself silent,
    # where a plain gather waited the group's timeout on live members that had given the epoch up)
    wait_watched(dist.all_gather(gathered, mine, group=group, async_op=True))
    if all(torch.equal(g, gathered[0]) for g in gathered):
        return
    signatures = all_gather_object_watched(signature, group)
    raise LayoutMismatchError(_explain(signatures, dist.get_rank(group), head, tail))


def _explain(signatures: list[tuple[str, ...]], rank: int, head: str, tail: str) -> str:
    lines = [head.format(rank=rank)]
    ref = signatures[0]
    for r, sig in enumerate(signatures[1:], start=1):
        for i in range(max(len(ref), len(sig))):
            a = ref[i] if i < len(ref) else "<none>"
            b = sig[i] if i < len(sig) else "<none>"
            if a != b:
                lines.append(f"  position {i}: rank 0 has {a!r}, rank {r} has {b!r}")
                break
    lines.append(tail)
    return "\n".join(lines)


def bucket_runs(named: list[tuple[str, torch.nn.Parameter]], group_of: list[int], limit: int,
                first_limit: int | None = None) -> list[list[int]]:
    """Cut ``named`` into buckets: runs of one group (``group_of[k]``, e.g. a param group)
    and dtype, in ``named`` order, of about ``limit`` elements (the first one closed, of
    ``first_limit`` if given); ordered by their last member (when its gradient is
    expected, if ``named`` is in backward order). Zero-size parameters never make a run
    of their own (an empty bucket is an empty collective, which a quantized wire cannot
    encode): they join the next run of their group and dtype, or, left over at the end,
    the one before them; alone in theirs, they stay a run of their own."""
    open_runs: dict[tuple[int, torch.dtype], list[int]] = {}
    sizes: dict[tuple[int, torch.dtype], int] = {}
    last: dict[tuple[int, torch.dtype], list[int]] = {}  # each key's last closed run
    done: list[list[int]] = []
    for k, (_, p) in enumerate(named):
        key = (group_of[k], p.dtype)
        run = open_runs.setdefault(key, [])
        run.append(k)
        sizes[key] = sizes.get(key, 0) + p.numel()
        if sizes[key] and sizes[key] >= (limit if done or first_limit is None else first_limit):
            last[key] = open_runs.pop(key)
            done.append(last[key])
            sizes[key] = 0
    for key, run in open_runs.items():
        if run and not sizes[key] and key in last:
            last[key] += run  # zero-size parameters left over: into the run before them
        elif run:
            done.append(run)
    return sorted(done, key=max)  # by when the last grad of each is expected
