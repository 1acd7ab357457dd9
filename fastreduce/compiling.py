"""``torch.compile`` with the overlap kept: a backend that cuts the graph at bucket boundaries.

Compiled whole, a model's backward is one autograd node: every gradient becomes ready
when it returns, so the modes' gradient hooks (which start each bucket's collective)
all fire after the backward's compute is over, and nothing is overlapped. Cut into
pieces of about one bucket of parameters each, the backward runs piece after piece,
and the gradients of one piece are accumulated (their hooks fire, their bucket's
collective starts) while the pieces before it still compute::

    model = torch.compile(model, backend=fastreduce.compile_backend("inductor"))
    reducer = fastreduce.FusedReducer(model, overlap=True)   # or ZeroOptimizer, gossip

The cutting is torch's own ``DDPOptimizer`` (``torch._dynamo.backends.distributed``, the
pass dynamo applies to a DDP-wrapped model): it walks the graph backwards, closes a piece
once its parameters pass the cap, and hands each piece to the backend. fastreduce's
subclass of it (:func:`_splitter`) counts each parameter's own bytes where torch's
counts its storage's, which for the flat-buffer views of ZeRO and gossip is the whole
buffer. The other way to
overlap under compile, compiled autograd with traced hooks and functional collectives,
would need every collective traced into the graph; the modes' collectives (shared-memory
transport, Gloo work handles, Join) cannot be. Measured on a 48-layer MLP, 1 process, CPU,
inductor: the first gradient is ready at 100% of the backward's time compiled whole and at
11% cut into 6 MB pieces (eager: 2%), with the same backward time (93 ms against 95).

Any backend works: a name (``"inductor"``, ``"aot_eager"``, ``"hpu_backend"`` on Gaudi
once ``habana_frameworks.torch`` is imported) or a callable.

A plain ``torch.compile(model)`` gets the same cut with nothing to name (:func:`cut_graphs`):
while a mode that starts collectives during backward lives, dynamo's own hook for DDP
(``DistributedDataParallel._get_active_ddp_module()``, read as each frame is compiled)
answers with the mode's bucket size, so dynamo cuts the graph with ``DDPOptimizer`` around
the user's backend, as it does for a frame compiled inside a DDP forward.
"""

from __future__ import annotations

import weakref
from typing import Any, Callable

import torch
import torch.distributed as dist

from .buckets import default_bucket_mb

__all__ = ["compile_backend", "cut_graphs", "keep_cut", "recut", "uncut_graphs"]


def compile_backend(backend: str | Callable[..., Any] = "inductor", *, bucket_mb: float | None = None,
                    first_bucket_mb: float | None = None) -> Callable[..., Any]:
    """A ``torch.compile`` backend that compiles the graph in pieces of ``bucket_mb`` of
    parameters each (with ``backend``), so that gradient hooks fire during the compiled
    backward and the modes' bucket collectives overlap it.

    Args:
        backend: the backend that compiles each piece: a registered name or a callable
            ``(GraphModule, example_inputs) -> callable``.
        bucket_mb: parameter megabytes per piece; give the mode's own ``bucket_mb``
            (default: the overlapped mode's default on the default process group's
            backend, 6 MB on Gloo, 25 on NCCL, 64 on HCCL; 16 without a process group).
        first_bucket_mb: the last piece of the forward (the first of the backward), if
            it should be smaller: its gradients start the first collective. A piece
            costs little, except where a ReLU sits at its end on CPU with inductor: the
            piece then saves the ReLU's mask, which inductor's CPU code writes slowly
            (8 pieces of an MLP of Linear 512 + ReLU, batch 512: a 40.8 ms forward
            against 24.7 in one piece; with GELU or Tanh 24.6 against 24.1). On a slow
            link only the first piece's head start matters.

    Returns:
        a callable to pass as ``torch.compile(model, backend=...)``.
    """
    if bucket_mb is None:
        pg = dist.get_backend() if dist.is_available() and dist.is_initialized() else ""
        bucket_mb = default_bucket_mb(pg)
    first_bucket_mb = bucket_mb if first_bucket_mb is None else first_bucket_mb
    if not (bucket_mb > 0 and 0 < first_bucket_mb <= bucket_mb):
        raise ValueError(f"bucket_mb must be positive and first_bucket_mb in (0, bucket_mb], got {bucket_mb!r} "
                         f"and {first_bucket_mb!r}")
    if isinstance(backend, str):
        from torch._dynamo import list_backends, lookup_backend
        try:
            compile_fn = lookup_backend(backend)
        except Exception as err:  # noqa: BLE001 - dynamo's own error type varies by version
            hint = " (on Gaudi: import habana_frameworks.torch first)" if backend.startswith("hpu") else ""
            raise ValueError(f"fastreduce.compile_backend: no torch.compile backend named {backend!r}{hint}; "
                             f"registered: {', '.join(list_backends(exclude_tags=()))}") from err
    elif callable(backend):
        compile_fn = backend
    else:
        raise TypeError(f"backend must be a backend name or a callable, got {type(backend).__name__}")
    splitter = _splitter()(int(bucket_mb * 2**20), compile_fn, first_bucket_cap=int(first_bucket_mb * 2**20))
    return _Split(splitter, backend, bucket_mb)


_SPLITTER: list[type] = []  # [torch's DDPOptimizer, ours], once made


def _splitter() -> type:
    """torch's ``DDPOptimizer``, counting each parameter's own bytes toward a piece.

    torch's counts the bytes of the parameter's storage: the same for DDP's parameters,
    each of which owns its storage, but ZeRO's and gossip's parameters are views of one
    flat buffer, so each counted as the whole buffer, and every op that reads a parameter
    (a linear layer, a LayerNorm) closed a piece of its own whatever the bucket size.
    """
    if not _SPLITTER:
        from torch._dynamo.backends.distributed import DDPOptimizer

        class Splitter(DDPOptimizer):
            def add_param(self, bucket: Any, param: torch.nn.Parameter, name: str) -> None:
                before = bucket.size
                super().add_param(bucket, param, name)
                bucket.size = before + param.numel() * param.element_size()

        _SPLITTER.extend((DDPOptimizer, Splitter))
    return _SPLITTER[1]


def _use_splitter(ours: bool) -> None:
    """Where dynamo looks up ``DDPOptimizer`` when it cuts a frame for "the active DDP
    module": ours while a mode asks for the cut, torch's again once none does. Dynamo
    imports the name just after it asked ``bool(_CUT)``, where ours is put, and in a
    process's first compile that import is the module's first, so it is made here."""
    if ours:
        import torch._dynamo.backends.distributed as module  # dynamo is compiling: cheap

        module.DDPOptimizer = _splitter()
    elif _SPLITTER:
        import sys

        module = sys.modules["torch._dynamo.backends.distributed"]
        module.DDPOptimizer = _SPLITTER[0]


class _Split:
    """The backend callable; its repr names what it splits for (dynamo logs it)."""

    def __init__(self, splitter: Any, backend: str | Callable[..., Any], bucket_mb: float):
        self.splitter, self.backend, self.bucket_mb = splitter, backend, bucket_mb
        self.pieces = 0  # pieces compiled so far (all graphs)

    def __call__(self, gm: torch.fx.GraphModule, example_inputs: list[Any], **kwargs: Any) -> Any:
        compiled = self.splitter.compile_fn(gm, example_inputs, **kwargs)
        self.pieces += sum(1 for n in compiled.graph.nodes if n.op == "call_module") \
            if isinstance(compiled, torch.fx.GraphModule) else 1
        return compiled

    def __repr__(self) -> str:
        return f"fastreduce.compile_backend({self.backend!r}, bucket_mb={self.bucket_mb})"


class _Cut:
    """What dynamo reads as "the active DDP module" while a mode that overlaps lives: its
    bucket size, and (``bool``) whether the frame being compiled now should be cut."""

    def __init__(self) -> None:
        self.owners: dict[int, int] = {}  # id(mode) -> bucket bytes

    @property
    def bucket_bytes_cap(self) -> int:
        # at least DDP's first piece (1 MB), which DDPOptimizer requires of the others
        return max(min(self.owners.values()), dist._DEFAULT_FIRST_BUCKET_BYTES)

    def __bool__(self) -> bool:
        # Forwards that train run with grad on; an evaluation forward or an optimizer's
        # compiled step (no_grad) compiles whole.
        cut = bool(self.owners) and torch.is_grad_enabled()
        if cut:
            _use_splitter(True)
        return cut


_CUT = _Cut()


def cut_graphs(owner: object, bucket_mb: float) -> None:
    """From now until ``owner`` is garbage collected, dynamo compiles every frame run with
    grad enabled in pieces of ``bucket_mb`` megabytes of parameters (the smallest of the
    living owners', at least 1 MB), the last piece 1 MB as DDP's, each with the user's own backend (its
    DDP pass, ``torch._dynamo.config.optimize_ddp``; off there, nothing is cut). Code
    compiled before is kept as it was. Called again, it moves the owner's size (and
    puts the hook back if a DDP forward took it off)."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    key = id(owner)
    if key not in _CUT.owners:
        weakref.finalize(owner, _release, key)
    _CUT.owners[key] = max(1, int(bucket_mb * 2**20))
    if DDP._active_ddp_module is None:
        DDP._active_ddp_module = _CUT


def recut(owner: object, bucket_mb: float | None) -> bool:
    """``owner`` asks for another size (``None``: no cut); whether that changed anything
    (code compiled at the old size keeps it: the caller may drop it)."""
    old = _CUT.owners.get(id(owner))
    if bucket_mb is None:
        uncut_graphs(owner)
        return old is not None
    cut_graphs(owner, bucket_mb)
    return _CUT.owners[id(owner)] != old


def keep_cut() -> None:
    """Put dynamo's hook back if a DDP forward took it off (torch 2.9 and older set it to
    ``None`` after each): the modes call this once a step."""
    if _CUT.owners:
        from torch.nn.parallel import DistributedDataParallel as DDP

        if DDP._active_ddp_module is None:
            DDP._active_ddp_module = _CUT


def uncut_graphs(owner: object) -> None:
    """``owner`` no longer asks for the cut (a mode closed)."""
    _release(id(owner))


def _release(key: int) -> None:
    _CUT.owners.pop(key, None)
    if not _CUT.owners:
        from torch.nn.parallel import DistributedDataParallel as DDP

        if DDP._active_ddp_module is _CUT:
            DDP._active_ddp_module = None
        _use_splitter(False)
