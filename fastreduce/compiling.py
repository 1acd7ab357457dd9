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
the user's backend, as it does for a frame compiled inside a DDP forward. The cut is the
mode's own: a graph is cut at the size of the modes whose parameters it reads, and a
graph of another model in the process (a second model with a fused reducer, a teacher,
a loss function) is compiled whole.

The same pass puts waits into compiled code (:func:`wait_in_graphs`): ZeRO's parameters
are all-gathered after its step and read by the next forward, so each compiled piece
first waits for the buckets of the parameters it reads (a call in the graph that
stitches the pieces, or a wrapper of a graph compiled whole), and the rest of the gather
stays in flight behind it, as the eager forward's pre-hooks leave it.
"""

from __future__ import annotations

import re
import sys
import weakref
from typing import Any, Callable, Iterable

import torch
import torch.distributed as dist

from .buckets import default_bucket_mb
from .hooks import forget_compiled_code
from .torch_internals import ddp_first_bucket_bytes

__all__ = ["compile_backend", "cut_graphs", "graphs_wait", "keep_cut", "recut", "uncut_graphs", "wait_in_graphs"]

_WHOLE = 2**62  # a piece size that never cuts


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
    splitter = _splitter()(int(bucket_mb * 2**20), compile_fn, first_bucket_cap=int(first_bucket_mb * 2**20),
                           scoped=False)  # the sizes given here, even where made while a mode asks for its cut
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
            def __init__(self, bucket_bytes_cap: int, backend_compile_fn: Any, first_bucket_cap: int | None = None,
                         scoped: bool | None = None):
                first = _first_cap(bucket_bytes_cap) if first_bucket_cap is None else first_bucket_cap
                super().__init__(bucket_bytes_cap, backend_compile_fn, first_bucket_cap=first)
                from torch.nn.parallel import DistributedDataParallel as DDP

                # Made by dynamo for the modes' hook (scoped: each graph at its modes' size), or for a
                # real DDP's forward or by compile_backend (the sizes given, as torch's).
                self.scoped = DDP._active_ddp_module is _CUT if scoped is None else scoped

            def add_param(self, bucket: Any, param: torch.nn.Parameter, name: str) -> None:
                before = bucket.size
                super().add_param(bucket, param, name)
                bucket.size = before  # counted by _Deferred once the piece may end
                if not isinstance(bucket.nodes, _Deferred):
                    bucket.nodes = _Deferred(bucket.nodes, bucket, self.next_reads)
                bucket.nodes.owed += param.numel() * param.element_size()

            def compile_fn(self, gm: torch.fx.GraphModule, example_inputs: list[Any], **kwargs: Any) -> Any:
                if self.scoped and self.bucket_bytes_cap < _WHOLE:  # the cut of the modes whose parameters gm reads
                    self.bucket_bytes_cap = cap = _CUT.cap_for(gm)
                    self.first_bucket_cap = _first_cap(cap)
                walk = [n for n in reversed(gm.graph.nodes) if n.op not in ("output", "placeholder")]
                self.next_reads = {n: nxt is None or _reads_params(gm, nxt) for n, nxt in zip(walk, walk[1:] + [None])}
                compiled = super().compile_fn(gm, example_inputs, **kwargs)
                return _with_waits(gm, self.buckets, compiled)

        _SPLITTER.extend((DDPOptimizer, Splitter))
    return _SPLITTER[1]


class _Deferred(list):
    """A piece's node list (in reverse graph order, as DDPOptimizer walks the graph) that
    counts the piece's parameters toward its size only once the node after the one just
    added reads parameters. DDPOptimizer checks the size before each node, so a piece can
    only close before an op that reads parameters: it ends with that op's output, and the
    parameter-free ops between two such ops (an activation) open the next piece. Closed
    just after an activation instead, as torch's pass does, each piece's compiled forward
    saves the activation's mask for its backward besides the output the next piece saves
    anyway; on CPU inductor (torch 2.13) that mask costs about 2.7 ms per 512 x 512 ReLU,
    most of a 512-wide linear layer's forward (measured: ``relu(linear(x))`` compiled 5.9 ms,
    ``linear(relu(x))`` 3.4 ms, the linear alone 3.3)."""

    def __init__(self, nodes: list[Any], bucket: Any, next_reads: dict[Any, bool]):
        super().__init__(nodes)
        self.bucket, self.next_reads = bucket, next_reads
        self.owed = 0  # parameter bytes added, not yet in the bucket's size

    def append(self, node: Any) -> None:
        super().append(node)
        if self.next_reads.get(node, True):
            self.bucket.size += self.owed
            self.owed = 0


def _reads_params(gm: torch.fx.GraphModule, node: torch.fx.Node) -> bool:
    """Whether DDPOptimizer counts parameters at ``node`` (an op with a parameter among its
    inputs, a parameter attribute, a submodule with parameters)."""
    if node.op == "call_module":
        return any(True for _ in gm.get_submodule(str(node.target)).parameters())
    if node.op == "get_attr":
        return _param_of(gm, node) is not None
    return any(isinstance(a, torch.fx.Node) and _param_of(gm, a) is not None for a in node.all_input_nodes)


def _first_cap(cap: int) -> int:
    """The first piece's size for pieces of ``cap``: DDP's 1 MB where smaller, and none
    for a frame to wait in, not to cut (``_WHOLE``)."""
    return cap if cap >= _WHOLE else min(cap, ddp_first_bucket_bytes())


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
    """What dynamo reads as "the active DDP module" while a mode that overlaps lives, or a
    mode whose parameters compiled code must wait for: the piece size, and (``bool``)
    whether the frame being compiled now goes through :func:`_splitter`'s pass."""

    def __init__(self) -> None:
        self.owners: dict[int, tuple[int, frozenset[int]]] = {}  # id(mode) -> (bucket bytes, ids of its params)
        self.waits: dict[int, Callable[[], Any]] = {}  # key -> weak wait(buckets)
        self.bucket_at: dict[int, tuple[int, int]] = {}  # id(param) -> (key, bucket), for every key of waits

    @property
    def bucket_bytes_cap(self) -> int:
        if not (self.owners and torch.is_grad_enabled()):
            return _WHOLE  # one piece, with its waits
        # at least DDP's first piece (1 MB), which DDPOptimizer requires of the others
        return max(min(size for size, _ in self.owners.values()), ddp_first_bucket_bytes())

    def cap_for(self, gm: torch.fx.GraphModule) -> int:
        """The piece size for ``gm``: the smallest of the modes whose parameters it reads
        (at least DDP's first piece); whole where it reads none (another model's frame,
        a loss function)."""
        ids = {id(p) for n in gm.graph.nodes if (p := _param_of(gm, n)) is not None}
        sizes = [size for size, params in self.owners.values() if params & ids]
        return max(min(sizes), ddp_first_bucket_bytes()) if sizes else _WHOLE

    def __bool__(self) -> bool:
        # Forwards that train run with grad on; an evaluation forward or an optimizer's
        # compiled step (no_grad) compiles whole, in one piece that waits where a mode asks.
        cut = bool(self.owners) and torch.is_grad_enabled() or bool(self.waits)
        if cut:
            _use_splitter(True)
        return cut


_CUT = _Cut()


def cut_graphs(owner: object, bucket_mb: float, params: Iterable[torch.Tensor]) -> None:
    """From now until ``owner`` is garbage collected, dynamo compiles every graph that
    reads one of ``params`` (run with grad enabled) in pieces of ``bucket_mb`` megabytes
    of parameters (the smallest of the living owners of the parameters it reads, at
    least 1 MB), the last piece 1 MB as DDP's, each with the user's own backend (its DDP
    pass, ``torch._dynamo.config.optimize_ddp``; off there, nothing is cut). Graphs of
    other parameters (another model in the process) are not cut. Code compiled before is
    kept as it was. Called again, it moves the owner's size (and puts the hook back if a
    DDP forward took it off)."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    key = id(owner)
    if key not in _CUT.owners:
        weakref.finalize(owner, _release, key)
    _CUT.owners[key] = max(1, int(bucket_mb * 2**20)), frozenset(map(id, params))
    if DDP._active_ddp_module is None:
        DDP._active_ddp_module = _CUT


def graphs_wait() -> bool:
    """Whether dynamo runs its DDP pass (``torch._dynamo.config.optimize_ddp``, on by
    default), through which :func:`wait_in_graphs` puts its waits into compiled code."""
    dynamo = sys.modules.get("torch._dynamo")
    mode = dynamo.config.optimize_ddp if dynamo is not None else True
    return mode is True or mode == "ddp_optimizer"


def wait_in_graphs(wait: Callable[[tuple[int, ...]], None], bucket_of: dict[int, int]) -> bool:
    """From now until ``wait``'s object is garbage collected, every graph dynamo compiles
    (in a frame it converts from now on) calls ``wait(buckets)`` before the first of its
    pieces that reads a parameter of one of ``buckets`` (``bucket_of``: ``id(param) ->
    bucket``): a compiled forward waits for each bucket of parameters where it first needs
    it, as an eager one does in forward pre-hooks. Returns whether dynamo's DDP pass is on
    (:func:`graphs_wait`); where it is off nothing is registered and compiled code does not
    wait. Code compiled before this does not wait either: the caller drops it."""
    if not graphs_wait():
        return False
    from torch.nn.parallel import DistributedDataParallel as DDP

    owner = wait.__self__  # type: ignore[attr-defined]
    key = id(owner)
    if key not in _CUT.owners and key not in _CUT.waits:
        weakref.finalize(owner, _release, key)
    _forget_waits(key)  # a mode built again: its old buckets go
    _CUT.waits[key] = weakref.WeakMethod(wait)  # type: ignore[arg-type]
    _CUT.bucket_at.update((pid, (key, b)) for pid, b in bucket_of.items())
    if DDP._active_ddp_module is None:
        DDP._active_ddp_module = _CUT
    return True


def _forget_waits(key: int) -> None:
    if _CUT.waits.pop(key, None) is not None:
        _CUT.bucket_at = {pid: hit for pid, hit in _CUT.bucket_at.items() if hit[0] != key}


def _graph_wait(static: tuple[tuple[int, int], ...], *params: Any) -> None:
    """Run by compiled code before a piece (see :func:`_with_waits`): wait for the buckets
    ``static`` (``(key, bucket)`` pairs) and those of ``params``, the piece's parameter
    inputs of this call. Looked up per call: dynamo reuses a graph for every module of
    the same code and shapes (``Linear.forward`` of each layer), the parameters its inputs."""
    hits = set(static)
    hits.update(filter(None, map(_CUT.bucket_at.get, map(id, params))))
    for key in {k for k, _ in hits}:
        ref = _CUT.waits.get(key)
        wait = ref() if ref is not None else None
        if wait is not None:
            wait(tuple(sorted(b for k, b in hits if k == key)))


def _param_of(gm: torch.fx.GraphModule, node: torch.fx.Node) -> Any:
    """The parameter a graph input or attribute node is (at compile time), else ``None``."""
    if node.op == "get_attr":
        found = getattr(gm, str(node.target), None)
    elif node.op == "placeholder":
        arg = node.meta.get("grapharg")  # dynamo's record of the input: .example is the real tensor
        found = getattr(arg, "example", None) if arg is not None else None
    else:
        return None
    return found if isinstance(found, torch.nn.Parameter) else None


def _with_waits(gm: torch.fx.GraphModule, pieces: list[Any], compiled: Any) -> Any:
    """``compiled`` (``gm`` compiled in ``pieces``, DDPOptimizer's buckets in forward
    order) with a call of :func:`_graph_wait` before each piece, given the parameter
    inputs it reads first (and the registered buckets of the parameters it holds as
    attributes): a node of the stitching graph where ``gm`` was cut, else a wrapper."""
    if not _CUT.waits:
        return compiled
    piece_of = {node: i for i, piece in enumerate(pieces) for node in piece.nodes}
    inputs: dict[int, list[torch.fx.Node]] = {}  # piece -> parameter inputs it reads first
    static: dict[int, set[tuple[int, int]]] = {}  # piece -> registered (key, bucket) of its attributes
    seen: set[torch.fx.Node] = set()
    for node in gm.graph.nodes:
        if node.op in ("placeholder", "output"):
            continue
        piece = piece_of.get(node, 0)
        for src in (node, *node.all_input_nodes):
            param = None if src in seen else _param_of(gm, src)
            if param is None:
                continue
            seen.add(src)
            if src.op == "placeholder":
                inputs.setdefault(piece, []).append(src)
            elif (hit := _CUT.bucket_at.get(id(param))) is not None:
                static.setdefault(piece, set()).add(hit)
    if not (inputs or static):
        return compiled

    def args(piece: int, nodes: list[Any]) -> tuple[Any, ...]:
        return (tuple(sorted(static.get(piece, ()))), *nodes)

    if isinstance(compiled, torch.fx.GraphModule) and len(pieces) > 1:
        outer = {str(n.target): n for n in compiled.graph.nodes if n.op == "placeholder"}
        placed = set()
        for node in list(compiled.graph.nodes):  # submod_<piece>, compiled_submod_<piece> once compiled
            found = re.fullmatch(r"(?:.*_)?submod_(\d+)", str(node.target)) if node.op == "call_module" else None
            piece = int(found[1]) if found else -1
            if piece in inputs or piece in static:
                placed.add(piece)
                with compiled.graph.inserting_before(node):
                    compiled.graph.call_function(_graph_wait, args(piece, [outer[str(n.target)]
                                                                           for n in inputs.get(piece, ())]))
        if placed != set(inputs) | set(static):
            raise RuntimeError("fastreduce: torch's DDPOptimizer cut the graph into pieces it did not name "
                               "submod_<n>; the waits cannot be placed. Please report it with your torch version")
        compiled.recompile()
        return compiled
    where = {n: i for i, n in enumerate(n for n in gm.graph.nodes if n.op == "placeholder")}
    positions = sorted(where[n] for nodes in inputs.values() for n in nodes)
    fixed = tuple(sorted(set().union(*static.values()))) if static else ()

    def run(*call_args: Any) -> Any:
        _graph_wait(fixed, *(call_args[i] for i in positions))
        return compiled(*call_args)
    return run


def recut(owner: object, bucket_mb: float | None, params: Iterable[torch.Tensor]) -> bool:
    """``owner`` asks for another size (``None``: no cut); whether that changed anything
    (code compiled at the old size keeps it: the caller may drop it)."""
    old = _CUT.owners.get(id(owner), (None,))[0]
    if bucket_mb is None:
        uncut_graphs(owner)
        return old is not None
    cut_graphs(owner, bucket_mb, params)
    return _CUT.owners[id(owner)][0] != old


class ModeCut:
    """An overlapped mode's cut through its sizes' life. Built, the mode cuts at a first
    size (``None``: not at all, where "auto" expects shared memory); its choice moves the
    cut, and where that drops compiled code the mode learns its backward order again on a
    step of the new pieces (each piece hands its gradients over at its end, in its own
    order: buckets laid out in the old pieces' order wait for the last piece and launch
    together); built again (``close()`` took the cut off), the cut compiled code has
    goes back. The methods take the mode (``owner``): the cut lives as long as it does."""

    def __init__(self, owner: object, mb: float | None, params: Iterable[torch.Tensor]):
        self.now, self.ran_uncut = mb, mb is None
        self.params = list(params)  # the graphs that read these are cut
        self.relearn = False  # compiled code was dropped for a new cut: the mode lays its buckets out again
        self.again(owner)

    def again(self, owner: object) -> None:
        if self.now is not None:
            cut_graphs(owner, self.now, self.params)

    def move(self, owner: object, mb: float | None) -> None:
        """Cut at ``mb`` (``None``: no cut); :attr:`relearn` if compiled code was dropped for a new cut
        (not for none: its one bucket, or the fused step, launches once every gradient is in, in any order)."""
        changed, self.now = recut(owner, mb, self.params), mb
        self.relearn = changed and forget_compiled_code() and mb is not None


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
    _forget_waits(key)
    if not (_CUT.owners or _CUT.waits):
        from torch.nn.parallel import DistributedDataParallel as DDP

        if DDP._active_ddp_module is _CUT:
            DDP._active_ddp_module = None
        _use_splitter(False)
