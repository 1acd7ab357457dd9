"""The engine: a torch.distributed process group for this process, set up from torchrun's environment."""

from __future__ import annotations

import logging
import os
import weakref
from dataclasses import dataclass
from datetime import timedelta
from typing import Mapping

import torch
import torch.distributed as dist

from .backends import detect_device
from .reach import CONNECT_TIMEOUT_ENV, connect_timeout, wait_for_listener

__all__ = ["DistInfo", "GroupSnapshot", "init_distributed", "require_distributed"]


@dataclass(frozen=True, slots=True)
class DistInfo:
    """Where this process stands: its ranks, its device and the process-group backend."""

    rank: int
    world_size: int
    local_rank: int
    device: torch.device
    backend: str


def require_distributed() -> None:
    """``RuntimeError`` unless torch.distributed is initialized (what every mode needs first)."""
    if not (dist.is_available() and dist.is_initialized()):
        raise RuntimeError("torch.distributed is not initialized: call fastreduce.init_distributed() (or "
                           "torch.distributed.init_process_group) on every rank first, e.g. in a script "
                           "launched with torchrun")


def init_distributed(backend: str | None = None, *, timeout: timedelta = timedelta(minutes=10),
                     connect_timeout_s: float | None = None) -> DistInfo:
    """Join the default process group as torchrun describes it, on the best device here.

    The device is an HPU (process-group backend ``hccl``) when ``habana_frameworks``
    sees one, else a CUDA device (``nccl``, ``cuda:LOCAL_RANK``, made current), else
    the CPU (``gloo``); ``backend`` overrides the process-group backend and
    ``FASTREDUCE_DEVICE`` the device. Without torchrun's variables (``RANK``,
    ``WORLD_SIZE``) it starts a world of one on 127.0.0.1. Calling it again returns the
    same answer without re-initializing.

    A rank that connects to the job's store (every rank but 0, and rank 0 too under
    torchrun, whose agent hosts it) first waits up to ``connect_timeout_s`` (default
    ``$FASTREDUCE_CONNECT_TIMEOUT_S``, else 5 s) for something to listen at
    ``MASTER_ADDR:MASTER_PORT``, then raises ``torch.distributed.DistNetworkError`` (a
    ``RuntimeError``) naming the address and what should be serving it, with nothing of
    c10d's on stderr. ``timeout`` bounds the rest (every rank arriving, each collective).

    Example::

        >>> info = fastreduce.init_distributed()   # under torchrun --nproc-per-node 2
        >>> model = Net().to(info.device)
    """
    env = os.environ
    local_rank = int(env.get("LOCAL_RANK", "0"))
    device, pg_backend = detect_device(local_rank)
    backend = backend or pg_backend
    if device.type == "cuda":
        torch.cuda.set_device(device)
    if not dist.is_initialized():
        if "RANK" not in env or "WORLD_SIZE" not in env:
            from .launch import free_port

            env.setdefault("MASTER_ADDR", "127.0.0.1")
            env.setdefault("MASTER_PORT", str(free_port()))
            env.setdefault("RANK", "0")
            env.setdefault("WORLD_SIZE", "1")
        if env.get("TORCHELASTIC_USE_AGENT_STORE") == "True" and env.get("TORCHELASTIC_RESTART_COUNT", "0") != "0":
            logging.getLogger(__name__).warning(
                "fastreduce: a torchrun restart on the store its failed attempt used: a rank may read an "
                "address that attempt left there and fail to connect (pytorch#135712); launch torchrun "
                "with TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 so that every attempt gets a fresh store")
        if backend == "hccl":
            from .backends.hpu import import_hccl

            import_hccl()
        _reach_master(env, connect_timeout_s)
        dist.init_process_group(backend, rank=int(env["RANK"]), world_size=int(env["WORLD_SIZE"]),
                                timeout=timeout)
    return DistInfo(dist.get_rank(), dist.get_world_size(), local_rank, device, dist.get_backend())


def _reach_master(env: Mapping[str, str], connect_timeout_s: float | None) -> None:
    """Raise ``DistNetworkError`` where this rank would connect to ``MASTER_ADDR:MASTER_PORT``
    and nothing listens there within the connect timeout (c10d would retry for the group's
    whole timeout, a C++ backtrace on stderr at each try)."""
    agent = env.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
    addr, port, rank = env.get("MASTER_ADDR"), env.get("MASTER_PORT", ""), env["RANK"]
    if not addr or not port.isdigit() or (int(rank) == 0 and not agent):
        return  # rank 0 hosts the store itself; torch names a missing variable
    waited = connect_timeout(connect_timeout_s)
    why = wait_for_listener(addr.strip("[]"), int(port), waited)
    if why is None:
        return
    if agent:
        what = ("torchrun's agent serves it there, up before its workers start: check that the agent runs and "
                "this host reaches it; after a restart, launch torchrun with TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1")
    else:
        what = ("rank 0's process serves it: start the process with RANK=0 and the same MASTER_PORT on the host "
                "that MASTER_ADDR names (an address of that host which this one reaches), or launch every rank "
                "with torchrun")
    raise dist.DistNetworkError(
        f"fastreduce: rank {rank} of {env['WORLD_SIZE']} cannot reach the job's store at MASTER_ADDR:MASTER_PORT = "
        f"{addr}:{port} ({why}; tried for {waited:g} s): {what} (a slow start or network: "
        f"${CONNECT_TIMEOUT_ENV}=SECONDS or connect_timeout_s= waits longer)")


class GroupSnapshot:
    """The process group a mode was built on, to tell later whether it is still the same.

    A layout, its buffers and its shared-memory segments belong to one group: when the
    default group is destroyed and made again (an in-process restart), or resized, they
    must not be used. :meth:`check` costs two Python calls. The default group is held
    weakly: a mode must not keep alive a group its user has destroyed (its Gloo threads
    would then live on into the interpreter's exit; see :mod:`.exit_quiet`).
    """

    __slots__ = ("group", "world_size", "world")

    def __init__(self, group: dist.ProcessGroup | None):
        self.group = group
        self.world_size = dist.get_world_size(group)
        self.world = weakref.ref(dist.group.WORLD)  # what group=None meant then

    def changed(self) -> bool:
        try:
            return (not dist.is_initialized() or dist.get_world_size(self.group) != self.world_size
                    or (self.group is None and dist.group.WORLD is not self.world()))
        except (RuntimeError, ValueError):  # a subgroup destroyed since
            return True

    def check(self, owner: str) -> None:
        """Raise if the group changed since ``owner`` (e.g. ``"FusedReducer"``) was built."""
        if not self.changed():
            return
        try:
            now: object = dist.get_world_size(self.group)
        except (RuntimeError, ValueError):
            now = "none (the group is gone)"
        raise RuntimeError(f"the process group changed since this {owner} was built (world size "
                           f"{self.world_size} then, {now} now): its layout and buffers belong to "
                           f"the old group. Build a new {owner} on the current group and, after a "
                           "restart, load the training state from a checkpoint (fastreduce.checkpoint)")
