"""Every use of torch's private internals in fastreduce, behind public functions.

What torch does not expose (the default group's store and its registry of groups, a
backend's timeout, the profiler's state, a few hooks of tensor subclasses) is read here and
nowhere else, so a torch release that moves one is mended in one place. Tested on torch
2.13; the project supports torch 2.6, 2.7 and 2.9 as well (``make stack-floor`` runs the
tests on 2.6, ``make stack-gaudi-1.23`` on 2.9). Where a torch lacks one, the function says
what it answers instead.
"""

from __future__ import annotations

import threading
import time
from contextlib import AbstractContextManager
from datetime import timedelta
from typing import Any, Callable

import torch
import torch.distributed as dist
from torch.autograd import profiler as _autograd_profiler
from torch.utils._python_dispatch import TorchDispatchMode  # (a mode that sees every op: backends/checked.py)
from torch.utils._pytree import tree_flatten  # (the tensors in an op's nested arguments)

__all__ = ["DEFAULT_TIMEOUT_S", "TorchDispatchMode", "abandon_groups", "at_backward_end", "compiled_in_place", "compiled_inner",
           "ddp_first_bucket_bytes", "ddp_ignored_names", "default_group_key", "default_group_store", "default_store",
           "disabled_join_config", "disabled_torch_function", "group_timeout", "in_backward", "is_abandoned",
           "make_wrapper_subclass", "non_finite_check_and_unscale_", "op_schema", "parameter_slots", "buffer_slots", "submodule_slots",
           "profiler_enabled", "release_abandoned", "scale_handed", "scale_handed_back", "scaler_always_steps",
           "scaler_found_inf", "scaler_scale", "scaler_steps_fused", "store_base", "sync_params_and_buffers",
           "tree_flatten", "unsafe_preserve_version_counter", "version", "with_metadata_of"]

DEFAULT_TIMEOUT_S = 1800.0  # torch's default process-group timeout


# ---------------------------------------------------------------------- process groups

def default_store() -> Any:
    """The default group's c10d store, or ``None`` (not initialized, or destroyed)."""
    try:
        return dist.distributed_c10d._get_default_store()
    except Exception:  # noqa: BLE001 - not initialized, or destroyed
        return None


def default_group_store(store: Any) -> dist.PrefixStore:
    """The store that ``init_process_group(store=store)`` gives its default group, for a
    reader outside that group (an epoch's heartbeats, read by a process that never joined
    it): torch keeps a group's keys under its name, and names the first group a process
    makes (again after ``destroy_process_group()``, as every epoch's is) ``"0"``."""
    return dist.PrefixStore("0/", store)


def default_group_key(prefix: str, key: str) -> str:
    """The name ``key`` has in ``store`` as ``default_group_store(PrefixStore(prefix, store))``
    keeps it (torch's ``PrefixStore`` joins its prefix and a key with ``/``): for a reader that
    must not wait for a missing key, as a ``PrefixStore``'s reads do."""
    return f"{prefix}/0//{key}"


def store_base(store: Any) -> Any:
    """The store under ``store``'s prefixes (a ``PrefixStore``'s innermost one), or ``None``
    where it has none to tell."""
    return getattr(store, "_underlying_non_prefix_store", None)


def group_timeout(group: dist.ProcessGroup | None = None) -> float:
    """The process group's collective timeout in seconds (what ``init_process_group`` or
    ``new_group`` got as ``timeout``), or torch's default of 1800 s where this torch does
    not expose it."""
    pg = group or dist.group.WORLD
    for device in ("cpu", "cuda", "hpu"):
        try:
            timeout = pg._get_backend(torch.device(device)).options._timeout
        except Exception:  # noqa: BLE001 - no such backend here, or an older torch
            continue
        if isinstance(timeout, timedelta) and timeout.total_seconds() > 0:
            return timeout.total_seconds()
    timeout = getattr(getattr(pg, "options", None), "_timeout", None)
    if isinstance(timeout, timedelta) and timeout.total_seconds() > 0:
        return timeout.total_seconds()
    return DEFAULT_TIMEOUT_S


RELEASE_AFTER_S = 5.0
"""How long past its timeout an abandoned group is kept (:func:`release_abandoned`)."""

_pinned: list[list[Any]] = []  # [an abandoned group, when it may be let go, gone(): whether it may be now]
_pinning = threading.Lock()


def abandon_groups(gone: Callable[[], bool] | None = None) -> None:
    """Every process group of this process aborted where the backend can and pinned: not
    destroyed while a collective of it may still wait on a peer gone silent (destroying it
    joins that thread, and Gloo's abort does not end it: torch 2.13), so neither a group
    destroyed now nor one let go of at the interpreter's teardown hangs the process
    (:func:`fastreduce.faults_watchdog.abandon_groups` says why). Pinned, each keeps its
    sockets (4 descriptors on 2 ranks) and threads until :func:`release_abandoned` lets it go:
    its timeout past, or sooner where ``gone()`` says every peer of these groups (the groups
    of this process now: one epoch's, under a Membership) has exited, so that no thread of
    theirs can wait on one (a peer's sockets close with its process)."""
    import ctypes

    release_abandoned()
    with _pinning:
        for pg in list(getattr(dist.distributed_c10d._world, "pg_map", {})):
            entry = next((e for e in _pinned if e[0] is pg), None)
            if entry is not None:  # (pinned by a watchdog earlier in the step)
                entry[2] = entry[2] or gone
                continue
            _pinned.append([pg, time.monotonic() + group_timeout(pg) + RELEASE_AFTER_S, gone])
            ctypes.pythonapi.Py_IncRef(ctypes.py_object(pg))  # outlives the interpreter's teardown
            try:
                pg.abort()
            except Exception:  # noqa: BLE001 - not supported by this backend or torch
                pass


def is_abandoned(pg: Any) -> bool:
    """Whether ``pg`` was abandoned (:func:`abandon_groups`) and not let go of yet."""
    with _pinning:
        return any(entry[0] is pg for entry in _pinned)


def _may_go(entry: list[Any], now: float) -> bool:
    if entry[1] <= now:
        return True
    try:
        return entry[2] is not None and bool(entry[2]())
    except Exception:  # noqa: BLE001 - a peer's record unreadable: its timeout then
        return False


def release_abandoned() -> int:
    """Let go of the abandoned groups whose timeout has passed since they were abandoned, or
    whose peers have all exited (:func:`abandon_groups`): by then every collective of theirs
    has returned or failed, so destroying one joins no thread that waits (milliseconds), and
    its sockets and threads are freed (a process that loses members again and again keeps
    the descriptors of one timeout's losses at most, and none of peers known to have exited).
    Returns how many are still pinned. Called at each abandonment and each new epoch."""
    import ctypes

    now = time.monotonic()
    with _pinning:
        due = [entry for entry in _pinned if _may_go(entry, now)]
        for entry in due:
            _pinned.remove(entry)
            ctypes.pythonapi.Py_DecRef(ctypes.py_object(entry[0]))
        left = len(_pinned)
    del due  # the last references to them: destroyed here, or with the last holder's
    return left


def scaler_steps_fused(optimizer: torch.optim.Optimizer) -> None:
    """Mark ``optimizer``, switched to its fused kernel after construction, as torch's
    constructor marks one built with ``fused=True``: a ``GradScaler`` hands it the scale
    and the inf flag instead of unscaling its gradients first."""
    optimizer._step_supports_amp_scaling = True


_MARK = "_step_supports_amp_scaling"
_UNSET = object()


def scaler_always_steps(optimizer: torch.optim.Optimizer) -> Callable[[], None]:
    """Mark ``optimizer`` as one that handles a ``GradScaler``'s scale itself (the mark
    :func:`scaler_steps_fused` sets): the scaler then calls its ``step()`` every time, an
    inf found or not, with ``optimizer.grad_scale`` (``None`` where ``scaler.unscale_``
    ran) and ``optimizer.found_inf`` set for the call, and ``update()`` reads the inf
    flags it recorded itself. Returns what puts the optimizer's own mark back."""
    before = optimizer.__dict__.get(_MARK, _UNSET)
    optimizer._step_supports_amp_scaling = True

    def undo() -> None:
        if before is _UNSET:
            optimizer.__dict__.pop(_MARK, None)
        else:
            setattr(optimizer, _MARK, before)
    return undo


def scale_handed(optimizer: torch.optim.Optimizer) -> tuple[torch.Tensor | None, torch.Tensor] | None:
    """What a ``GradScaler`` stepping ``optimizer`` (marked by :func:`scaler_always_steps`)
    handed it for this ``step()`` call: ``(grad_scale, found_inf)``, taken off the
    optimizer (torch's optimizers that do not scale themselves refuse a step that has
    them) until :func:`scale_handed_back`; ``None`` where no scaler steps it now."""
    found_inf = optimizer.__dict__.get("found_inf")
    if found_inf is None:
        return None
    grad_scale = optimizer.__dict__.pop("grad_scale", None)
    del optimizer.found_inf
    return grad_scale, found_inf


def scale_handed_back(optimizer: torch.optim.Optimizer, handed: tuple[torch.Tensor | None, torch.Tensor]) -> None:
    """Put back what :func:`scale_handed` took (the scaler deletes both after the step)."""
    optimizer.grad_scale, optimizer.found_inf = handed


def scaler_scale(scaler: Any) -> torch.Tensor | None:
    """A ``GradScaler``'s scale as the tensor it multiplies by (``get_scale()`` would wait for
    the device and return a float), or ``None`` before it has scaled a loss."""
    return scaler._scale


def scaler_found_inf(scaler: Any, optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    """The inf flags (one per device) that ``scaler`` recorded for ``optimizer`` this step:
    what its ``update()`` reads to lower the scale."""
    return list(scaler._per_optimizer_states[id(optimizer)]["found_inf_per_device"].values())


non_finite_check_and_unscale_ = torch._amp_foreach_non_finite_check_and_unscale_
"""``GradScaler``'s own kernel, ``(tensors, found, inv_scale)`` over tensors of one dtype and
device: ``found`` set to 1.0 where any holds an inf or NaN, each multiplied by ``inv_scale``
in place (the op itself: no call added on the step's path)."""


def sync_params_and_buffers(group: Any, tensors: list[torch.Tensor], bucket_bytes: int, src: int) -> None:
    """DDP's broadcast of ``tensors`` from rank ``src`` of ``group`` in buckets of
    ``bucket_bytes`` (what it runs over a module's buffers)."""
    from torch.distributed.utils import _sync_params_and_buffers
    _sync_params_and_buffers(group, tensors, bucket_bytes, src=src)


def ddp_ignored_names(module: torch.nn.Module) -> set[str]:
    """The names of the parameters and buffers DDP is told to leave alone on ``module``
    (``DistributedDataParallel._set_params_and_buffers_to_ignore_for_model``)."""
    return set(getattr(module, "_ddp_params_and_buffers_to_ignore", ()))


def with_metadata_of(state: Any, module: torch.nn.Module) -> Any:
    """``state`` (an ``OrderedDict`` for ``module.load_state_dict``) given the version
    metadata that ``module.state_dict()`` carries, by which a module converts an older
    layout as it loads."""
    state._metadata = getattr(module.state_dict(), "_metadata", None)
    return state


def disabled_join_config() -> Any:
    """What ``Joinable.join_config`` holds outside torch's ``Join`` context (every
    Join-aware operation off)."""
    from torch.distributed.algorithms.join import _JoinConfig
    return _JoinConfig.construct_disabled_join_config()


def op_schema(func: Any) -> Any:
    """The schema of an ATen operator as a dispatch mode receives it (which arguments it
    writes: ``is_mutable``, ``arguments[i].alias_info``)."""
    return func._schema


def compiled_inner(module: Any) -> Any:
    """The module a ``torch.compile`` wrapper (``OptimizedModule``) wraps, else ``module``
    itself: the wrapper names each parameter ``_orig_mod.<its name>``."""
    return getattr(module, "_orig_mod", module) if type(module).__name__ == "OptimizedModule" else module


def compiled_in_place(module: torch.nn.Module) -> bool:
    """Whether ``module.compile()`` compiled ``module`` in place (its compiled call kept on it)."""
    return getattr(module, "_compiled_call_impl", None) is not None


def parameter_slots(module: torch.nn.Module) -> dict[str, Any]:
    """The dict in which ``module`` holds its own parameters by name (``Module._parameters``):
    the entry that ``setattr`` and ``load_state_dict(assign=True)`` replace, read at C speed."""
    return module._parameters


def buffer_slots(module: torch.nn.Module) -> dict[str, Any]:
    """The dict in which ``module`` holds its own buffers by name (``Module._buffers``): the
    entry that ``self.ema = ...`` replaces, read at C speed."""
    return module._buffers


def submodule_slots(module: torch.nn.Module) -> dict[str, Any]:
    """The dict in which ``module`` holds its direct submodules by name (``Module._modules``):
    the entry that ``setattr`` and ``add_module`` add to, read at C speed."""
    return module._modules


def ddp_first_bucket_bytes() -> int:
    """The size of DDP's first bucket (1 MB), which dynamo's ``DDPOptimizer`` requires of the others."""
    return dist._DEFAULT_FIRST_BUCKET_BYTES


# ---------------------------------------------------------------------- autograd and tensors

def in_backward() -> bool:
    """Whether autograd's engine is running a backward on this thread now."""
    return torch._C._current_graph_task_id() != -1


def at_backward_end(fn: Any) -> None:
    """Call ``fn()`` once the backward running now ends (on its thread)."""
    torch.autograd.Variable._execution_engine.queue_callback(fn)


def profiler_enabled() -> bool:
    """Whether a profiler records on this thread, or anywhere in the process (one taken
    with ``profile_all_threads=True``; a torch without it: this thread only)."""
    return torch._C._autograd._profiler_enabled() or getattr(_autograd_profiler, "_is_profiler_enabled", False)


def version(t: torch.Tensor) -> int:
    """``t._version``: how many in-place writes ``t``'s storage has seen through torch's ops
    (a view shares its base's), to tell whether anything wrote it between two points."""
    return t._version


def unsafe_preserve_version_counter(tensors: Any) -> AbstractContextManager:
    """``torch.autograd._unsafe_preserve_version_counter(tensors)``: a tuple of tensors on
    torch 2.7 and newer, one tensor on 2.6 (:func:`fastreduce.compat.preserve_version_counters`)."""
    return torch.autograd._unsafe_preserve_version_counter(tensors)


disabled_torch_function = torch._C._disabled_torch_function_impl
"""The ``__torch_function__`` of a tensor subclass that has none of its own: torch's functions
reach its ``__torch_dispatch__`` directly."""


def make_wrapper_subclass(cls: type, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> Any:
    """A tensor of subclass ``cls`` with ``shape``, ``dtype`` and ``device`` and no storage of its own."""
    return torch.Tensor._make_wrapper_subclass(cls, shape, dtype=dtype, device=device)
