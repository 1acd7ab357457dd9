"""Device dispatch: how pack/unpack run on each device (graph replay or plain eager).

A backend has one job: ``capture(fn)`` turns a function that only reads and writes
persistent buffers into a replayable callable. :func:`select_backend` picks one from
the gradients' device; :func:`detect_device` picks the device and process-group
backend for :func:`fastreduce.init_distributed`. Device-specific modules
(``habana_frameworks``, ``torch.cuda`` graphs) are imported lazily inside the
backends that need them, so ``import fastreduce`` works on any machine.

======== ============================ =====================================
 name     device                       capture
======== ============================ =====================================
 eager    any                          none: ``fn`` itself
 cuda     cuda                         ``torch.cuda.CUDAGraph``
 hpu      hpu (lazy mode only)         ``habana_frameworks`` ``HPUGraph``
 checked  any (tests)                  records addresses, fails bad replays
======== ============================ =====================================
"""

from __future__ import annotations

import os
from typing import Callable, Protocol

import torch

from .checked import CheckedBackend, GraphContractError
from .eager import EagerBackend, warn_once

__all__ = ["Backend", "BACKENDS", "CheckedBackend", "EagerBackend", "GraphContractError",
           "detect_device", "select_backend", "warn_once"]

BACKENDS = ("auto", "eager", "cuda", "hpu", "checked")


class Backend(Protocol):
    """What the reducer needs from a device backend."""

    name: str

    def capture(self, fn: Callable[[], None]) -> Callable[[], None]:
        """Return a callable that does ``fn``'s work on the buffers ``fn`` touched.

        ``fn`` must only touch memory that outlives the returned callable (the
        reducer's persistent buffers); a graph backend replays the captured kernels on
        exactly those addresses, whatever ``fn`` would read if called again.
        """
        ...


def select_backend(name: str, device: torch.device, use_graphs: bool = True) -> Backend:
    """The backend for gradients on ``device``.

    ``name="auto"`` takes the device's graph backend when ``use_graphs`` is true and
    the device can capture (CUDA; HPU in lazy mode), else eager, warning once when
    graphs were asked for but cannot be used. An explicit name that does not fit the
    device raises ``ValueError``.
    """
    if name not in BACKENDS:
        raise ValueError(f"unknown backend {name!r}; choose one of {', '.join(BACKENDS)}")
    if name == "eager":
        return EagerBackend()
    if name == "checked":
        return CheckedBackend()
    if name in ("cuda", "hpu") and device.type != name:
        raise ValueError(f"backend {name!r} needs gradients on a {name} device, "
                         f"but they are on {device}; use backend='auto'")
    if name == "auto" and (not use_graphs or device.type not in ("cuda", "hpu")):
        return EagerBackend()
    if device.type == "cuda":
        from .cuda import CudaGraphBackend

        return CudaGraphBackend(device)
    from . import hpu

    if not hpu.lazy_mode():
        warn_once("HPU graphs need lazy mode (PT_HPU_LAZY_MODE=1); fastreduce packs and "
                  "unpacks gradients eagerly instead")
        return EagerBackend()
    return hpu.HpuGraphBackend()


def detect_device(local_rank: int) -> tuple[torch.device, str]:
    """``(device, process-group backend)`` for this process: HPU, then CUDA, then CPU.

    HPU is used when ``habana_frameworks`` imports and reports a device; CUDA when
    ``torch.cuda.is_available()``. ``FASTREDUCE_DEVICE=cpu|cuda|hpu`` overrides.
    """
    forced = os.environ.get("FASTREDUCE_DEVICE", "")
    if forced not in ("", "cpu", "cuda", "hpu"):
        raise ValueError(f"FASTREDUCE_DEVICE={forced!r}: use cpu, cuda or hpu")
    if forced in ("", "hpu"):
        from . import hpu

        if hpu.available():
            return torch.device("hpu", local_rank), "hccl"
        if forced == "hpu":
            raise RuntimeError("FASTREDUCE_DEVICE=hpu but no Gaudi device is available "
                               "(is habana_frameworks installed?)")
    if forced in ("", "cuda") and torch.cuda.is_available():
        return torch.device("cuda", local_rank % torch.cuda.device_count()), "nccl"
    if forced == "cuda":
        raise RuntimeError("FASTREDUCE_DEVICE=cuda but torch.cuda.is_available() is False")
    return torch.device("cpu"), "gloo"
