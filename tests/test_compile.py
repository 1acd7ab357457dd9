"""Every mode under ``torch.compile``, against the same mode on the uncompiled model.

The reference is the mode itself on the plain model: each mode is checked against its
own reference (DDP, torch.optim, torch's averagers) in its own suite, so here the only
variable is compilation. On 2 real Gloo ranks (both transports: ``make test`` runs this
file again on the process group's), per backend (``aot_eager`` and ``inductor``), each
rank runs every case twice from the same seed, plain and compiled, and returns the
largest parameter difference and dynamo's graph counts after each step:

* parity: ``aot_eager`` runs the same aten ops, but AOT autograd's backward graph
  may arrange them differently, so 1e-6; inductor fuses and reorders float ops, so
  1e-5. AdamW runs with ``eps=ADAM_EPS`` (1e-3, not torch's 1e-8): Adam's first step
  is ``lr * g / (|g| + eps)``, whose slope in ``g`` reaches ``lr / eps``, so with
  eps=1e-8 (slope 1e6) a rounding difference in a gradient element near zero becomes
  a parameter difference of any size up to ``lr``. Averaging over ranks makes such
  elements: on torch 2.6, ``model[4].weight[13, 26]``'s gradient is -3.3196e-4 on
  rank 0 and +3.3200e-4 on rank 1, a mean of 2.13e-8, which inductor's 3.5e-10 (a few
  ulps) moved by 1.6%; the first step moved that weight 3.6e-5 apart, in every
  reducing mode and in torch's own ``DDP(torch.compile(model))`` alike (identical
  data on both ranks: 2.9e-6, as in one process). With eps=1e-3 (slope at most 10)
  the same runs are about 1e-7 apart, and a mis-reduced gradient (a stale bucket, a
  missing one, a sum for a mean) still moves parameters 1.7e-2 or more. The reducing
  modes use an fp32 wire: on a bf16 one, a gradient that inductor moved by an ulp can
  round to the next bf16 value, which says nothing about the mode;
* no recompilation per step: the number of graphs dynamo compiled stops growing
  after the second step (the first step builds the modes, the second may add their
  steady state), checked on the last four;
* what users write: the model compiled before or after the mode is built, the
  gossip wrapper compiled (``torch.compile(DecentralizedDataParallel(...))``), a
  compiled model that already ran before the mode was built (its forward hooks would
  be invisible to the compiled code), and ``fastreduce.compile_backend`` (overlap kept:
  the backward is cut into pieces at bucket boundaries);
* ``ZeroOptimizer(module=)`` in any order: the compiled wrapper or the inner module passed,
  the model compiled before or after the optimizer (in place, too, with an all-gather in
  flight).

With CUDA tensors (``$FASTREDUCE_TEST_DEVICE=cuda``, default ``cpu``): the same cases,
the model built on CPU from the seed and the batches drawn on CPU, both then moved to
cuda:0, which the two Gloo ranks share (as in ``tests/gpu/test_cuda.py``); the ``auto``
transport takes the process group for CUDA buffers. Skipped where there is no GPU. On a
GPU machine: ``FASTREDUCE_TEST_DEVICE=cuda python3 -m pytest -q tests/test_compile.py``.
"""

from __future__ import annotations

import os
from typing import Any, Callable

import pytest
import torch
from torch import nn

import fastreduce
from fastreduce.launch import run_ranks

from models import stepper

STEPS = 6
BUCKET_MB = 5000 / 2**20  # ~ one Linear(32, 32) per bucket: 7 buckets
TOL = {"aot_eager": 1e-6, "inductor": 1e-5}
# A bf16 wire: where inductor's fp32 result differs from eager's by an ulp, a pseudo-gradient
# element g on a bf16 rounding boundary rounds the other way, and the outer Nesterov step
# (lr 0.7, momentum 0.9) moves its parameter by about 1.9 * 0.7 * 2**-8 * |g| = 5e-3 |g|: on
# torch 2.6, 4.05e-5 (within TOL on torch 2.13; plain DiLoCo's fp32 wire within it on both).
TOL_BF16_WIRE = {"aot_eager": TOL["aot_eager"], "inductor": 1e-4}
ADAM_EPS = 1e-3  # not 1e-8: see the module docstring (parity)
BACKENDS = tuple(TOL)
pytestmark = pytest.mark.timeout(600)
DEVICE = os.environ.get("FASTREDUCE_TEST_DEVICE", "cpu")
if DEVICE not in ("cpu", "cuda"):
    raise ValueError(f"FASTREDUCE_TEST_DEVICE must be 'cpu' or 'cuda', got {DEVICE!r}")
if DEVICE == "cuda" and not torch.cuda.is_available():
    pytest.skip("FASTREDUCE_TEST_DEVICE=cuda, but torch sees no CUDA GPU", allow_module_level=True)


def on_device() -> None:
    """At the start of each worker: both ranks share cuda:0 (Gloo, not NCCL)."""
    if DEVICE == "cuda":
        torch.cuda.set_device(0)


def make_model(width: int = 32) -> nn.Module:
    torch.manual_seed(0)
    model = nn.Sequential(*[m for _ in range(6) for m in (nn.Linear(width, width), nn.Tanh())], nn.Linear(width, 1))
    return model.to(DEVICE)


def batch(rank: int, step: int, width: int = 32) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * step + rank)
    return torch.randn(16, width, generator=g).to(DEVICE), torch.randn(16, 1, generator=g).to(DEVICE)


def adamw(params: Any) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, lr=1e-2, weight_decay=0.1, eps=ADAM_EPS)


def graphs() -> int:
    from torch._dynamo.utils import counters
    return counters["stats"]["unique_graphs"]


# ============================================================== the cases, run in ranks
# Each case: (model, compile) -> (the module to call, step function, finish function).
# ``compile(module)`` is the identity for the plain run.

Compile = Callable[[nn.Module], nn.Module]


def case_fused(model: nn.Module, comp: Compile, overlap: bool = False, backend: Any = None):
    m = comp(model) if backend is None else torch.compile(model, backend=backend)
    reducer = fastreduce.FusedReducer(m, overlap=overlap, bucket_mb=BUCKET_MB, wire_dtype=torch.float32)
    opt = adamw(model.parameters())
    return m, stepper(opt, reducer.reduce), lambda: None


def case_functional(model: nn.Module, comp: Compile):
    m = comp(model)
    opt = adamw(model.parameters())
    return m, stepper(opt, lambda: fastreduce.all_reduce_gradients(m, torch.float32)), lambda: None


def case_zero(model: nn.Module, comp: Compile, module: bool = True):
    m = comp(model)
    opt = fastreduce.ZeroOptimizer(model.parameters(), torch.optim.AdamW, module=m if module else None,
                                   lr=1e-2, weight_decay=0.1, eps=ADAM_EPS, bucket_mb=BUCKET_MB)
    return m, stepper(opt), lambda: opt.state_dict()  # the state dict waits for the last all-gather


def case_gossip(model: nn.Module, comp: Compile, wrapper: bool = False):
    if wrapper:
        m = comp(fastreduce.DecentralizedDataParallel(model, adamw, bucket_mb=BUCKET_MB))
        ddp = getattr(m, "_orig_mod", m)
    else:
        m = ddp = fastreduce.DecentralizedDataParallel(comp(model), adamw, bucket_mb=BUCKET_MB)
    return m, lambda: None, ddp.wait_exchanges


def case_localsgd(model: nn.Module, comp: Compile):
    m = comp(model)
    opt = adamw(model.parameters())
    fastreduce.LocalSGD(m, opt, sync_every=2)
    return m, stepper(opt), lambda: None


def case_diloco(model: nn.Module, comp: Compile):
    m = comp(model)
    opt = adamw(model.parameters())
    outer = torch.optim.SGD(model.parameters(), lr=0.7, momentum=0.9, nesterov=True)
    fastreduce.DiLoCo(m, opt, outer, sync_every=2, wire_dtype=torch.float32)
    return m, stepper(opt), lambda: None


def case_streaming_diloco(model: nn.Module, comp: Compile):
    """Two fragments, delay 2, a bf16 wire summed in fp32: on a process group each average
    is two collectives, the second issued a step after the launch (from the step hook)."""
    m = comp(model)
    opt = adamw(model.parameters())
    outer = torch.optim.SGD(model.parameters(), lr=0.7, momentum=0.9, nesterov=True)
    fastreduce.DiLoCo(m, opt, outer, sync_every=6, fragments=2, fragment_delay=2, accumulate_dtype=torch.float32)
    return m, stepper(opt), lambda: None


def case_zero_inner(model: nn.Module, comp: Compile):
    """The model compiled first, the optimizer given the inner module (a natural way to
    write it, as FSDP2 and DDP accept): its hooks are traced, stand down, step() waits."""
    m = comp(model)
    opt = fastreduce.ZeroOptimizer(model.parameters(), torch.optim.AdamW, module=model,
                                   lr=1e-2, weight_decay=0.1, eps=ADAM_EPS, bucket_mb=BUCKET_MB)
    return m, stepper(opt), lambda: opt.state_dict()


def case_zero_after(model: nn.Module, comp: Compile):
    """The optimizer built on the model first, the model compiled after."""
    opt = fastreduce.ZeroOptimizer(model.parameters(), torch.optim.AdamW, module=model,
                                   lr=1e-2, weight_decay=0.1, eps=ADAM_EPS, bucket_mb=BUCKET_MB)
    return comp(model), stepper(opt), lambda: opt.state_dict()


CASES: dict[str, Callable[..., Any]] = {
    "fused": case_fused,
    "overlapped": lambda model, comp: case_fused(model, comp, overlap=True),
    "all_reduce_gradients": case_functional,
    "zero": case_zero,
    "zero-no-module": lambda model, comp: case_zero(model, comp, module=False),
    "zero-inner-module": case_zero_inner,
    "zero-compiled-after": case_zero_after,
    "gossip": case_gossip,
    "gossip-wrapper-compiled": lambda model, comp: case_gossip(model, comp, wrapper=True),
    "localsgd": case_localsgd,
    "diloco": case_diloco,
    "streaming-diloco-bf16acc": case_streaming_diloco,
}
PREWARMED = ("fused", "zero", "gossip")  # compiled model run once before the mode is built
HOOKS_STAND_DOWN = ("zero-inner-module", "zero-compiled-after")  # ZeRO's forward hooks traced, then off


def train(rank: int, name: str, comp: Compile, prewarm: bool = False,
          width: int = 32) -> tuple[list[torch.Tensor], list[int]]:
    model = make_model(width)
    start = graphs()  # dynamo's counters outlive torch._dynamo.reset()
    if prewarm:  # a user's first forward (e.g. an evaluation) before the mode exists
        compiled = comp(model)
        compiled(batch(rank, 99)[0]).sum().backward()
        model.zero_grad(set_to_none=True)
        comp = lambda _m: compiled  # noqa: E731 - the same compiled module, already run
    m, step, finish = CASES[name](model, comp)
    counts = []
    for s in range(STEPS):
        x, y = batch(rank, s, width)
        ((m(x) - y) ** 2).mean().backward()
        step()
        counts.append(graphs() - start)
    finish()
    return [p.detach().clone() for p in model.parameters()], counts


def parity_worker(rank: int, world: int, backend: str) -> dict[str, Any]:
    on_device()
    out: dict[str, Any] = {}

    def comp(model: nn.Module) -> nn.Module:
        return torch.compile(model, backend=backend)

    for name in CASES:
        for prewarm in (False, True) if name in PREWARMED else (False,):
            key = f"{name}-prewarmed" if prewarm else name
            torch._dynamo.reset()
            ref, _ = train(rank, name, lambda m: m)
            torch._dynamo.reset()
            got, counts = train(rank, name, comp, prewarm)
            out[key] = (max((a - b).abs().max().item() for a, b in zip(ref, got)), counts)
    return out


@pytest.fixture(scope="module", params=BACKENDS)
def parity(request: pytest.FixtureRequest) -> tuple[str, list[dict[str, Any]]]:
    return request.param, run_ranks(parity_worker, 2, request.param, timeout=560)


@pytest.mark.parametrize("case", [*CASES, *(f"{n}-prewarmed" for n in PREWARMED)])
@pytest.mark.cell("loop", "compile", modes=("fused", "overlap", "zero", "gossip", "localsgd", "diloco"))
def test_compiled_matches_plain(parity: tuple[str, list[dict[str, Any]]], case: str) -> None:
    backend, ranks = parity
    for rank, out in enumerate(ranks):
        diff, counts = out[case]
        tol = (TOL_BF16_WIRE if case.startswith("streaming-diloco-bf16") else TOL)[backend]
        assert diff <= tol, f"{case} under torch.compile({backend}), rank {rank}: parameters {diff:.2e} " \
                            f"off the uncompiled run (tolerance {tol:.0e})"
        # where ZeRO's forward hooks stand down at the first compiled forward, torch 2.9 runs
        # that one frame eagerly (a graph break in a module's pre-hook) and compiles from the next
        first = 1 if case in HOOKS_STAND_DOWN else 0
        assert counts[first] > 0, f"{case}: nothing was compiled (graphs per step {counts})"
        assert len(set(counts[2:])) == 1, f"{case}: dynamo compiled again in a later step (graphs per step {counts})"


# ============================================================== overlap: the split backend

SPLITS = {  # how the model is compiled -> the mode's reference case
    "compile_backend": "overlapped",   # fastreduce.compile_backend(...), before the mode
    "plain-before": "overlapped",      # torch.compile(model), then the mode
    "plain-after": "overlapped",       # the mode, then torch.compile(model)
    "zero-plain": "zero",
    "gossip-plain": "gossip",
}


WIDE = 512  # 1 MB layers: a plain compile is cut in pieces of 1 MB at least (DDP's first)
# Inductor's rounding grows with the layers' width: on torch 2.6, torch's own
# DDP(torch.compile(model)) of this model (in a module class of its own) ends 1.086e-5 off
# eager DDP after the 6 steps, and every compiled reducing mode here by the same
# 1.086e-5; 1.3e-6 on torch 2.13. A missing reduction moves the parameters 8e-2.
TOL_WIDE = {"aot_eager": TOL["aot_eager"], "inductor": 3e-5}


def split_worker(rank: int, world: int, backend_name: str, how: str) -> dict[str, Any]:
    """A mode that starts collectives during backward on a compiled model: parity with
    the plain model, and the backward cut into pieces (one compiled autograd node each),
    by ``compile_backend`` or, with a plain ``torch.compile``, by the mode itself."""
    on_device()
    torch._dynamo.reset()
    name = SPLITS[how]
    ref, _ = train(rank, name, lambda m: m, width=WIDE)
    torch._dynamo.reset()
    backend = fastreduce.compile_backend(backend_name, bucket_mb=BUCKET_MB) if how == "compile_backend" \
        else backend_name
    model = make_model(WIDE)
    if how == "plain-after":
        reducer = fastreduce.FusedReducer(model, overlap=True, bucket_mb=BUCKET_MB, wire_dtype=torch.float32)
        m, step, finish = torch.compile(model, backend=backend), stepper(adamw(model.parameters()), reducer.reduce), None
    else:
        m, step, finish = CASES[name](model, lambda mod: torch.compile(mod, backend=backend))
    nodes = []
    for s in range(STEPS):
        x, y = batch(rank, s, WIDE)
        loss = ((m(x) - y) ** 2).mean()
        nodes.append(compiled_nodes(loss))
        loss.backward()
        step()
    if finish is not None:
        finish()
    diff = max((a - b).abs().max().item() for a, b in zip(ref, model.parameters()))
    return {"diff": diff, "nodes": nodes, "pieces": getattr(backend, "pieces", None)}


def compiled_nodes(loss: torch.Tensor) -> int:
    """Compiled autograd nodes in ``loss``'s backward graph (one per compiled piece)."""
    seen, stack, n = set(), [loss.grad_fn], 0
    while stack:
        fn = stack.pop()
        if fn is None or fn in seen:
            continue
        seen.add(fn)
        n += "Compiled" in type(fn).__name__
        stack.extend(f for f, _ in fn.next_functions)
    return n


@pytest.mark.parametrize("backend,how", [(b, h) for b in BACKENDS for h in SPLITS
                                         if b == "aot_eager" or h in ("compile_backend", "plain-before")])
def test_backward_is_cut_at_buckets(backend: str, how: str) -> None:
    ranks = run_ranks(split_worker, 2, backend, how, timeout=300)
    for rank, out in enumerate(ranks):
        assert out["diff"] <= TOL_WIDE[backend], f"rank {rank}: {out['diff']:.2e} off the uncompiled run"
        # 7 Linear layers of ~1 MB, buckets of one each, pieces of 1 MB or more: 3 or more, each its own node.
        assert all(n >= 3 for n in out["nodes"]), f"rank {rank}: compiled backward nodes per step {out['nodes']}"
        assert how != "compile_backend" or out["pieces"] >= 3


def pieces_of_a_fresh_compile(grad: bool = True, model: nn.Module | None = None) -> int:
    """Graphs the backend was handed for one forward of a freshly compiled model."""
    torch._dynamo.reset()
    pieces = []

    def backend(gm: torch.fx.GraphModule, example_inputs: list[Any]) -> Any:
        pieces.append(gm)
        return gm.forward

    compiled = torch.compile(make_model(WIDE) if model is None else model, backend=backend)
    with torch.set_grad_enabled(grad):
        compiled(batch(0, 0, WIDE)[0])
    return len(pieces)


class Mode:
    """Stands for a living mode that asks for the cut."""


def test_cut_lasts_while_its_mode_lives() -> None:
    """In one process, no group: a plain torch.compile of a model is cut while an owner
    of its parameters lives and asks for it, at its size; whole again once it is gone,
    and under no_grad. Another model's graphs are never cut: the cut is its owner's."""
    from fastreduce.compiling import cut_graphs, uncut_graphs

    mode, other, bystander = Mode(), Mode(), Mode()
    model, elsewhere = make_model(WIDE), make_model(WIDE)
    assert pieces_of_a_fresh_compile(model=model) == 1
    cut_graphs(mode, BUCKET_MB, model.parameters())
    assert pieces_of_a_fresh_compile(model=model) >= 3
    assert pieces_of_a_fresh_compile(model=elsewhere) == 1  # not the mode's parameters: whole
    cut_graphs(bystander, BUCKET_MB, elsewhere.parameters())
    assert pieces_of_a_fresh_compile(model=elsewhere) >= 3  # now it is a mode's
    uncut_graphs(bystander)
    assert pieces_of_a_fresh_compile(model=elsewhere) == 1
    assert pieces_of_a_fresh_compile(grad=False, model=model) == 1  # an evaluation forward: no graph to cut
    cut_graphs(other, 16.0, model.parameters())  # a larger size does not coarsen the living mode's cut
    assert pieces_of_a_fresh_compile(model=model) >= 3
    uncut_graphs(mode)  # closed: only ``other`` is left: DDP's 1 MB first piece, then the other 6 MB
    assert pieces_of_a_fresh_compile(model=model) == 2
    del other
    import gc
    gc.collect()
    from torch.nn.parallel import DistributedDataParallel
    assert DistributedDataParallel._active_ddp_module is None
    assert pieces_of_a_fresh_compile(model=model) == 1


def model_of_its_own_class(inner: nn.Module) -> nn.Module:
    """``inner`` in a model class of its own, as distinct models are: dynamo shares one
    graph between instances of a class (the parameters are its inputs)."""

    class Model(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.inner = inner

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.inner(x)
    return Model()


def test_compile_backend_made_while_a_mode_lives_cuts_at_its_own_sizes() -> None:
    """``compile_backend(bucket_mb=...)`` made while a mode asks for its cut keeps the
    sizes it was given: each of the mode's pieces is cut further."""
    from fastreduce.compiling import cut_graphs, uncut_graphs

    mode, model = Mode(), make_model(WIDE)
    cut_graphs(mode, 16.0, model.parameters())  # 7 layers of ~1 MB: the mode's cut alone is 2 pieces
    try:
        assert pieces_of_a_fresh_compile(model=model) == 2
        pieces = []

        def counting(gm: torch.fx.GraphModule, example_inputs: list[Any]) -> Any:
            pieces.append(gm)
            return gm.forward
        torch._dynamo.reset()
        compiled = torch.compile(model, backend=fastreduce.compile_backend(counting, bucket_mb=1.0))
        compiled(batch(0, 0, WIDE)[0])
        assert len(pieces) >= 6, len(pieces)
    finally:
        uncut_graphs(mode)


def own_cut_worker(rank: int, world: int) -> dict[str, Any]:
    """Three compiled models in one process, trained in turn: one under the overlapped
    mode, one under the fused mode, one in DDP (1 MB buckets). Compiled backward nodes
    per step of each, and the fused model's largest gradient difference from
    ``dist.all_reduce``'s mean of its local gradients."""
    import torch.distributed as dist

    on_device()
    torch._dynamo.reset()
    models = {name: model_of_its_own_class(make_model(WIDE)) for name in ("overlapped", "fused", "ddp")}
    over = fastreduce.FusedReducer(models["overlapped"], overlap=True, bucket_mb=BUCKET_MB, wire_dtype=torch.float32)
    fused = fastreduce.FusedReducer(models["fused"], wire_dtype=torch.float32)
    ddp = nn.parallel.DistributedDataParallel(models["ddp"], bucket_cap_mb=1)
    runs = {"overlapped": torch.compile(models["overlapped"], backend="aot_eager"),
            "fused": torch.compile(models["fused"], backend="aot_eager"),
            "ddp": torch.compile(ddp, backend="aot_eager")}
    nodes: dict[str, list[int]] = {name: [] for name in runs}
    off = 0.0
    for s in range(3):
        x, y = batch(rank, s, WIDE)
        for name, run in runs.items():
            loss = ((run(x) - y) ** 2).mean()
            nodes[name].append(compiled_nodes(loss))
            loss.backward()
            if name == "fused":
                want = [p.grad.clone() for p in models[name].parameters()]
                for g in want:
                    dist.all_reduce(g)
                    g /= world
                fused.reduce()
                off = max(off, *((p.grad - g).abs().max().item() for p, g in zip(models[name].parameters(), want)))
            elif name == "overlapped":
                over.reduce()
            models[name].zero_grad()
    return {"nodes": nodes, "off": off}


def test_cut_is_the_modes_own() -> None:
    """A living overlapped mode cuts the graphs of its own model only: another compiled
    model in the process (a fused mode's) is compiled whole, and a compiled DDP keeps
    DDP's cut. Before, the cut was global to the process: every graph dynamo compiled
    with grad on was cut at the overlapped mode's size."""
    for rank, out in enumerate(run_ranks(own_cut_worker, 2, timeout=300)):
        assert all(n >= 3 for n in out["nodes"]["overlapped"]), (rank, out)
        assert out["nodes"]["fused"] == [1, 1, 1], (rank, out)
        assert all(n >= 3 for n in out["nodes"]["ddp"]), (rank, out)
        assert out["off"] <= 1e-6, (rank, out)


def view_cut_worker(rank: int, world: int) -> dict[str, Any]:
    """In a fresh process (the test's spawned rank), where dynamo has not yet imported
    its DDP pass: the first compile is the one that imports it."""
    import sys

    from fastreduce.compiling import cut_graphs, uncut_graphs

    name = "torch._dynamo.backends.distributed"
    out: dict[str, Any] = {"fresh": name not in sys.modules}
    flat_model = make_model(WIDE)
    with torch.no_grad():
        flat = torch.cat([p.reshape(-1) for p in flat_model.parameters()])
        at = 0
        for module in flat_model.modules():
            for pname, p in list(module.named_parameters(recurse=False)):
                setattr(module, pname, nn.Parameter(flat[at:at + p.numel()].view_as(p)))
                at += p.numel()
    out["views"] = all(p.untyped_storage().data_ptr() == flat.data_ptr() for p in flat_model.parameters())
    mode, own_model = Mode(), make_model(WIDE)
    cut_graphs(mode, 3.0, [*flat_model.parameters(), *own_model.parameters()])  # 7 layers of ~1 MB: DDP's
    try:  # 1 MB first piece, then ~3 MB each
        out["flat"] = pieces_of_a_fresh_compile(model=flat_model)  # the process's first compile
        out["own"] = pieces_of_a_fresh_compile(model=own_model)
    finally:
        uncut_graphs(mode)
    out["torchs_back"] = sys.modules[name].DDPOptimizer.__module__ == name
    return out


def test_cut_counts_a_view_parameter_by_its_own_bytes() -> None:
    """ZeRO's and gossip's parameters are views of one flat buffer (``params_as_views``).
    torch's DDPOptimizer counts a parameter's storage, so each counted as the whole
    buffer and every layer became a piece of its own whatever the bucket size (a compiled
    6-layer GPT-2 under ZeRO: 38 pieces at 6 MB buckets). The cut counts the view's own
    bytes: the same pieces as the same model with parameters of their own, from a
    process's first compile on, and torch's DDPOptimizer is back once no mode asks for
    the cut."""
    (out,) = run_ranks(view_cut_worker, 1, timeout=300)
    assert out["fresh"] and out["views"], out  # else this would not test the first import
    assert 2 <= out["own"] <= 4, out
    assert out["flat"] == out["own"], out
    assert out["torchs_back"], out


def test_pieces_end_where_parameters_are_read() -> None:
    """A piece closes before an op that reads parameters, never after an activation: each
    piece of a Linear/ReLU stack cut at 1 MB hands on a linear layer's output, and its ReLU
    opens the next piece (closed after the ReLU, as torch's DDPOptimizer does, every piece's
    forward also saved the ReLU's mask, 2.7 ms each on CPU inductor). Same pieces, same
    gradients as the uncompiled model."""
    from fastreduce.compiling import _reads_params

    torch._dynamo.reset()
    torch.manual_seed(0)
    layers = [m for _ in range(4) for m in (nn.Linear(WIDE, WIDE), nn.ReLU())]

    class Stack(nn.Module):  # a class of its own: dynamo compiles its forward afresh
        def __init__(self) -> None:
            super().__init__()
            self.layers = nn.Sequential(*layers)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.layers(x)

    model, pieces = Stack(), []

    def inner(gm: torch.fx.GraphModule, example_inputs: list[Any]) -> Any:
        pieces.append(gm)
        return gm.forward

    x = torch.randn(8, WIDE)
    reference = [g.clone() for g in torch.autograd.grad(model(x).square().mean(), list(model.parameters()))]
    compiled = torch.compile(model, backend=fastreduce.compile_backend(inner, bucket_mb=1))
    grads = torch.autograd.grad(compiled(x).square().mean(), list(model.parameters()))
    assert len(pieces) == 4, [gm.graph for gm in pieces]  # one 1 MB layer each
    for gm in pieces[:-1]:
        (output,) = [n for n in gm.graph.nodes if n.op == "output"]
        handed_on = [n for n in output.all_input_nodes if n.op != "placeholder"]
        assert handed_on and all(_reads_params(gm, n) for n in handed_on), gm.graph
    for got, want in zip(grads, reference):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


def test_compile_backend_names_a_missing_backend() -> None:
    with pytest.raises(ValueError, match="no torch.compile backend named 'hpu_backend'.*habana_frameworks"):
        fastreduce.compile_backend("hpu_backend")
    with pytest.raises(ValueError, match="bucket_mb must be positive"):
        fastreduce.compile_backend("inductor", bucket_mb=0)
    with pytest.raises(ValueError, match=r"first_bucket_mb in \(0, bucket_mb\]"):
        fastreduce.compile_backend("inductor", bucket_mb=1, first_bucket_mb=2)


# ============================================================== compiled after, in place

def zero_compiled_after_worker(rank: int, world: int, how: str) -> dict[str, Any]:
    """ZeroOptimizer(module=model) first, a step (its all-gather in flight), then the model
    compiled (in place or wrapped) and 3 more steps; against the same without compiling."""
    on_device()
    out = {}
    for compile_it in (False, True):
        torch._dynamo.reset()
        model = make_model()
        opt = fastreduce.ZeroOptimizer(model.parameters(), torch.optim.AdamW, module=model, lr=1e-2,
                                       eps=ADAM_EPS, bucket_mb=BUCKET_MB)
        m = model
        for s in range(4):
            if s == 1 and compile_it:  # the first step's all-gather is still in flight
                if how == "in-place":
                    model.compile(backend="aot_eager")
                else:
                    m = torch.compile(model, backend="aot_eager")
            x, y = batch(rank, s)
            ((m(x) - y) ** 2).mean().backward()
            opt.step()
            opt.zero_grad()
        opt.state_dict()  # waits for the last gather
        out[compile_it] = [p.detach().clone() for p in model.parameters()]
    return {"diff": max((a - b).abs().max().item() for a, b in zip(out[False], out[True]))}


@pytest.mark.parametrize("how", ["in-place", "wrapper"])
def test_zero_module_compiled_after_the_optimizer_matches_plain(how: str) -> None:
    """The model compiled after ZeroOptimizer(module=model) was built, with an all-gather in
    flight: its forward hooks are traced, wait for every gather once and stand down (step()
    waits from then on); the parameters are the uncompiled run's."""
    for out in run_ranks(zero_compiled_after_worker, 2, how, timeout=240):
        assert out["diff"] <= TOL["aot_eager"], out


def zero_forward_waits_worker(rank: int, world: int, ddp_pass: bool) -> dict[str, Any]:
    """ZeroOptimizer(module=) on a compiled model of 7 layers of ~1 MB (a bucket each,
    pieces of 1 MB or more): what the optimizer waits for and when, over 4 steps, then an
    evaluation forward (no_grad, compiled whole) with the last all-gather in flight."""
    from fastreduce.modes.zero import ZeroOptimizer

    on_device()
    torch._dynamo.reset()
    calls: list[Any] = []
    wait = ZeroOptimizer._wait_gathers

    def spy(self: Any, which: Any = None) -> None:  # the class's: compiled code holds a weak bound method
        calls.append(None if which is None else tuple(which))
        wait(self, which)

    ZeroOptimizer._wait_gathers = spy  # this spawned process's class only
    out: dict[str, Any] = {"forward": [], "in_flight": []}
    with torch._dynamo.config.patch(optimize_ddp=ddp_pass):
        model = make_model(WIDE)
        m = torch.compile(model, backend="aot_eager")
        opt = fastreduce.ZeroOptimizer(model.parameters(), torch.optim.AdamW, module=m, lr=1e-2,
                                       eps=ADAM_EPS, bucket_mb=BUCKET_MB)
        out["buckets"] = opt.num_buckets
        for s in range(4):
            x, y = batch(rank, s, WIDE)
            del calls[:]
            loss = ((m(x) - y) ** 2).mean()
            out["forward"].append(list(calls))
            loss.backward()
            opt.step()
            opt.zero_grad()
            out["in_flight"].append(sum(g is not None for g in opt._gathers))
        x, _ = batch(rank, 9, WIDE)
        with torch.no_grad():
            del calls[:]
            got = m(x)
            out["eval_waits"] = sorted({b for which in calls if which is not None for b in which})
            opt.wait_params()
            want = model(x)  # uncompiled, every gather done
        out["eval_diff"] = (got - want).abs().max().item()
    return out


@pytest.mark.parametrize("ddp_pass", [True, False], ids=["ddp-pass", "ddp-pass-off"])
def test_zero_compiled_forward_waits_for_each_bucket_where_it_reads_it(ddp_pass: bool) -> None:
    """A compiled forward under ZeroOptimizer(module=) waits for each bucket's all-gather
    before the first compiled piece that reads it (dynamo's DDP pass puts the waits in),
    so that the rest of the gather overlaps the forward, as the eager pre-hooks do: the
    gathers are in flight when step() returns, and the next forward waits a bucket or two
    at a time, last bucket (first layers) first. An evaluation forward (no_grad, compiled
    whole) with the gathers in flight waits too, and computes the uncompiled model's
    output. With the pass off (``optimize_ddp=False``) step() waits for all, as before."""
    for rank, out in enumerate(run_ranks(zero_forward_waits_worker, 2, ddp_pass, timeout=300)):
        assert out["eval_diff"] <= 1e-6, (rank, out)
        if not ddp_pass:
            assert out["in_flight"] == [0] * 4 and all(f == [] for f in out["forward"]), (rank, out)
            continue
        assert out["buckets"] >= 5 and out["in_flight"] == [out["buckets"]] * 4, (rank, out)
        assert out["eval_waits"] == list(range(out["buckets"])), (rank, out)
        for waits in out["forward"][1:]:  # the first forward has nothing in flight yet
            order = [b for which in waits for b in which]
            assert len(waits) >= 3 and order == sorted(order, reverse=True) \
                and set(order) == set(range(out["buckets"])), (rank, out)


if os.environ.get("FASTREDUCE_TRANSPORT") == "process_group" or DEVICE == "cuda":  # only what reduces
    del test_compile_backend_names_a_missing_backend
