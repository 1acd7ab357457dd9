"""The hooks the modes put on a user's model, its parameters and its optimizer: registered
and removed here, so that one place says what runs when, and what each does under
``torch.compile``.

Every hook body is Python with side effects (a collective started or waited on, a
gradient re-attached, a counter moved), none of which dynamo can put in a graph. So:

* gradient hooks (:func:`on_grad_ready`) run in eager autograd, outside any compiled
  graph, between the compiled backward's pieces (:mod:`fastreduce.compiling` cuts the
  graph at bucket boundaries so that they fire during backward, not after it). Compiled
  autograd (``torch._dynamo.config.compiled_autograd``) would trace them: not supported.
* forward pre-hooks (:func:`before_forward`) and optimizer step hooks (:func:`on_step`)
  are ``torch.compiler.disable``-d: where dynamo traces the module or the step, the hook
  is a graph break and runs eagerly, never traced into a no-op.
* dynamo does not guard on a module's hooks (``torch._dynamo.config.skip_nnmodule_hook_guards``):
  code compiled before a forward pre-hook was registered would never call it, and a
  mode's wait would silently not happen. :func:`before_forward` therefore drops dynamo's
  compiled code if any exists (one recompile, at the mode's construction).

Modes keep the handles these functions return and hand them back to :func:`remove_hooks`.
"""

from __future__ import annotations

import logging
import re
import sys
from functools import partial
from typing import Any, Callable

import torch

from .torch_internals import compiled_in_place, compiled_inner

__all__ = ["before_forward", "compiled", "eager", "eager_methods", "forward_waits", "on_grad_ready", "on_step",
           "optional_before_forward", "remove_hooks", "stand_down"]

log = logging.getLogger("fastreduce")
_BREAK_KEEPS_FRAME = tuple(int(x) for x in re.findall(r"\d+", torch.__version__)[:2]) >= (2, 13)
"""Whether dynamo compiles the rest of a frame whose forward pre-hook broke its graph: seen
on torch 2.13; not on 2.9 (the Gaudi 1.23 stack) nor 2.11 (an H200), where the whole
forward ran uncompiled; 2.12 not run, taken as the older."""


def eager(fn: Callable[..., Any]) -> Callable[..., Any]:
    """``fn`` run eagerly wherever it is called from compiled code (a graph break)."""
    return torch.compiler.disable(fn, recursive=True)


def eager_methods(cls: type, *names: str) -> None:
    """:func:`eager` on methods of ``cls``, for its constructor to call: the class is
    patched once, before any instance can be compiled, rather than decorated at import,
    since ``torch.compiler.disable`` imports torch._dynamo (about a second of
    ``import fastreduce``, and of every process that only imports it: ``fastreduce info``,
    a torchrun worker that never compiles)."""
    for name in names:
        fn = cls.__dict__[name]
        if not getattr(fn, "_fastreduce_eager", False):
            fn = eager(fn)
            fn._fastreduce_eager = True
            setattr(cls, name, fn)


def on_grad_ready(params: tuple[torch.nn.Parameter, ...] | list[torch.nn.Parameter],
                  fn: Callable[[int], None]) -> list[Any]:
    """Call ``fn(i)`` when ``params[i]``'s grad is accumulated; returns the hook handles."""
    index = {p: i for i, p in enumerate(params)}
    return [p.register_post_accumulate_grad_hook(lambda q: fn(index[q])) for p in params]


def before_forward(module: torch.nn.Module, fn: Callable[[torch.nn.Module, Any], None], *,
                   traced: bool = False, needed: bool = True) -> Any:
    """Call ``fn(module, args)`` before each forward of ``module``: eagerly, or, with
    ``traced``, as dynamo traces it (``fn`` branches on ``torch.compiler.is_compiling()``
    and calls only :func:`eager` functions there). Returns the handle, or ``None`` where
    the hook is not ``needed`` for correctness and code compiled before it exists (that
    code would not call it, and dropping the code costs a recompile)."""
    if not needed and _compiled_something():
        log.info("fastreduce: torch.compile ran before this mode was built; its optional forward "
                 "hook is left out rather than drop dynamo's compiled code")
        return None
    handle = module.register_forward_pre_hook(fn if traced else eager(fn))
    forget_compiled_code()
    return handle


def optional_before_forward(module: torch.nn.Module, fn: Callable[[], None]) -> Any:
    """:func:`before_forward` for a hook the mode can do without (``needed=False``):
    ``fn()`` before each eager forward; where dynamo traces the forward, a graph break
    into ``fn`` on torch 2.13 and later, and nothing on older ones (2.9, 2.11), which run a
    frame whose pre-hook broke its graph eagerly for good (the whole forward left
    uncompiled to save what the hook saves)."""
    run = eager(fn)

    def hook(_module: torch.nn.Module, _args: Any) -> None:
        if not torch.compiler.is_compiling():
            fn()
        elif _BREAK_KEEPS_FRAME:
            run()

    return before_forward(module, hook, traced=True, needed=False)


def compiled(module: torch.nn.Module) -> bool:
    """Whether ``module`` is ``torch.compile``-d (the returned wrapper, or ``module.compile()``)."""
    return compiled_inner(module) is not module or compiled_in_place(module)


def on_step(optimizer: torch.optim.Optimizer, *, pre: Callable[..., Any] | None = None,
            post: Callable[..., Any] | None = None) -> list[Any]:
    """Optimizer step hooks, run eagerly (also where the step is compiled); returns the handles."""
    handles = []
    if pre is not None:
        handles.append(optimizer.register_step_pre_hook(eager(pre)))
    if post is not None:
        handles.append(optimizer.register_step_post_hook(eager(post)))
    return handles


def forward_waits(module: torch.nn.Module, bucket_of: dict[int, int], wait: Callable[[Any], None], mode: str,
                  what: str, on_compiled: Callable[[], None] | None = None,
                  in_graphs: bool = False) -> tuple[list[Any], bool]:
    """Before each submodule's forward, ``wait(buckets)`` for the buckets (``bucket_of``:
    ``id(param) -> bucket``) of its own parameters, so that the rest stay in flight during
    the forward; before ``state_dict`` and ``load_state_dict``, ``wait(None)`` (all).
    Returns the handles and whether the forward waits.

    ``in_graphs``: compiled code waits too (the caller registered ``wait`` with
    :func:`fastreduce.compiling.wait_in_graphs`, which has dynamo's DDP pass put each
    bucket's wait before the first compiled piece that reads it); the pre-hooks, where
    dynamo traces them, are traced into nothing, and still wait wherever the module runs
    eagerly. Where that pass is off (``torch._dynamo.config.optimize_ddp = False``) a
    compiled forward cannot wait per bucket (a wait per submodule would be a graph break
    per submodule): with ``module`` compiled already nothing waits in the forward and the
    caller waits for all itself; where the hooks end up traced all the same (the module
    compiled after this), the first traced hook waits for everything, eagerly, and the
    hooks stand down for good: ``on_compiled()`` tells the caller to wait for all itself
    from then on."""
    state = {"off": False}

    @eager
    def compiled_after() -> None:
        wait(None)
        if not state["off"]:
            state["off"] = True
            log.info("fastreduce: %s(module=...): the model's forward is compiled; %s is waited for "
                     "outside it from now on, not overlapped with it", mode, what)
            if on_compiled is not None:
                on_compiled()

    run_wait = eager(wait) if in_graphs else wait  # eagerly, also from a frame dynamo runs as is

    def before(buckets: tuple[int, ...]) -> None:
        if state["off"]:
            return
        if not torch.compiler.is_compiling():
            run_wait(buckets)
        elif not in_graphs:  # being traced, with no waits put into the graph
            compiled_after()

    handles = [module.register_state_dict_pre_hook(lambda *_: wait(None)),
               module.register_load_state_dict_pre_hook(lambda *_: wait(None))]
    if compiled(module) and not in_graphs:
        log.info("fastreduce: %s(module=...) got a compiled model and dynamo's DDP pass is off: %s is "
                 "waited for outside the compiled forward, not overlapped with it", mode, what)
        return handles, False
    def hook(_m: torch.nn.Module, _a: Any, mine: tuple[int, ...]) -> None:
        before(mine)

    if in_graphs:
        # Traced inside a module's frame, the hook is nothing and the graph waits; but dynamo
        # may convert the hook as a frame of its own (torch 2.9 compiling a torch.nn
        # container in place starts at the first frame outside torch.nn: this one), whose
        # empty graph would skip the wait while the module's ops run eagerly. Such a frame
        # runs as it is, and waits.
        from torch._dynamo.eval_frame import skip_code

        skip_code(before.__code__)
        skip_code(hook.__code__)
    for m in compiled_inner(module).modules():
        mine = tuple(sorted({bucket_of[id(p)] for p in m.parameters(recurse=False) if id(p) in bucket_of}))
        if mine:
            handles.append(before_forward(m, partial(hook, mine=mine), traced=True))
    return handles, True


def stand_down(handles: list[Any]) -> bool:
    """Take :func:`forward_waits`'s forward hooks off (its first two, the state-dict
    waits, stay) once they stood down, outside any compiled frame, and drop dynamo's code:
    torch 2.9 runs a frame whose pre-hook broke its graph eagerly for good (nothing
    compiled), 2.13 kept the break; both compile the forward whole on the next call.
    Returns ``False`` (the forward no longer waits)."""
    remove_hooks(handles[2:])
    del handles[2:]
    forget_compiled_code()
    return False


def remove_hooks(handles: list[Any]) -> None:
    for h in handles:
        if h is not None:
            h.remove()


def _compiled_something() -> bool:
    """Whether dynamo holds compiled code (frames seen since the last ``torch._dynamo.reset()``)."""
    convert_frame = sys.modules.get("torch._dynamo.convert_frame")
    return bool(getattr(convert_frame, "FRAME_COUNTER", 0))


def forget_compiled_code() -> bool:
    """Drop what dynamo has compiled so far, so that the next call retraces and sees the
    hooks just registered; nothing to do (and nothing done) before the first compile.
    Whether there was something to drop."""
    if not _compiled_something():
        return False
    log.info("fastreduce: dynamo's compiled code is dropped (torch._dynamo.reset()) so that the next call "
             "compiles what changed since (a hook registered after torch.compile ran, or a new cut at the buckets)")
    torch._dynamo.reset()
    return True
