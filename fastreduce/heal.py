"""Healing a joiner: a nested state (``state_dict``\\ s) from one rank to others.

What :class:`~fastreduce.membership.Membership` sends a process that joins a running job:
the model's and optimizer's ``state_dict``, the mode's, the step count. Pickled whole
(``torch.save`` into ``broadcast_object_list``) a 10M-parameter model with AdamW is 120 MB
copied four times and sent as bytes; here only the state's skeleton (its keys, the small
values, and each tensor's place) is pickled, and the tensors travel as one flat
``broadcast`` per dtype, straight out of a ``torch.cat`` and back through views.

To every rank of the group (:func:`broadcast_state`, where every rank but the sender
receives: a job's first epoch) or point to point to the ranks that need it
(:func:`send_state`, :func:`recv_state`: joiners among members that hold it already, who
then take no part). Every transfer is waited through :func:`fastreduce.faults.wait_watched`:
a rank lost while the state travels (the joiner, or the member sending it) is named by the
heartbeat within the loss window. Unwatched, only the ranks exchanging with it directly
would fail, and a rank waiting on a live peer that gave up (the sender, whose send to the
dead joiner failed first) would wait for the group's timeout.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

import fastreduce.faults as faults
from .faults_watchdog import pickled, unpickled
from .nested import map_leaves

if TYPE_CHECKING:
    from .coordinator import Epoch
    from .member import Member

__all__ = ["broadcast_state", "recv_state", "send_state", "sync_state"]


class _Slot:
    """Where a tensor was in the state: its dtype's flat block, offset, shape."""

    __slots__ = ("dtype", "offset", "shape")

    def __init__(self, dtype: torch.dtype, offset: int, shape: tuple[int, ...]):
        self.dtype, self.offset, self.shape = dtype, offset, shape

    def __reduce__(self) -> tuple:
        return (_Slot, (self.dtype, self.offset, self.shape))


def _strip(state: Any, tensors: dict[torch.dtype, list[torch.Tensor]], sizes: dict[torch.dtype, int]) -> Any:
    """``state`` with each tensor replaced by its :class:`_Slot` (collected in ``tensors``)."""
    def slot(t: torch.Tensor) -> _Slot:
        t, at = t.detach(), sizes.get(t.dtype, 0)
        tensors.setdefault(t.dtype, []).append(t.reshape(-1))
        sizes[t.dtype] = at + t.numel()
        return _Slot(t.dtype, at, tuple(t.shape))
    return map_leaves(state, slot)


def _block(parts: list[torch.Tensor], device: torch.device) -> torch.Tensor:
    """One dtype's tensors as one flat block on ``device``. They may live on several devices
    (AdamW's step counts stay on the CPU beside moments on the GPU): then each is moved first."""
    if len({t.device for t in parts}) > 1:
        parts = [t.to(device) for t in parts]
    return torch.cat(parts).to(device)


def _fill(skeleton: Any, blocks: dict[torch.dtype, torch.Tensor]) -> Any:
    def view(s: _Slot) -> torch.Tensor:
        return blocks[s.dtype][s.offset:s.offset + math.prod(s.shape)].view(s.shape)
    return map_leaves(skeleton, view, leaf=lambda x: isinstance(x, _Slot))


def _broadcast(t: torch.Tensor, src: int) -> None:
    faults.wait_watched(dist.broadcast(t, src=src, async_op=True))


def _pack(state: Any, device: torch.device) -> list[torch.Tensor]:
    """``state`` as tensors to send in order: the skeleton's length and pickled bytes, then
    one flat block per dtype (the empty ones left out)."""
    tensors: dict[torch.dtype, list[torch.Tensor]] = {}
    sizes: dict[torch.dtype, int] = {}
    skeleton = _strip(state, tensors, sizes)
    data = pickled((skeleton, sizes)).to(device)
    out = [torch.tensor([data.numel()], dtype=torch.int64, device=device), data]
    return out + [_block(tensors[d], device) for d in sorted(sizes, key=str) if sizes[d]]


def send_state(state: Any, device: torch.device, dsts: list[int]) -> None:
    """``state`` (as :func:`broadcast_state` takes it) to each rank of ``dsts`` of the
    default group in turn, point to point; each takes it with :func:`recv_state`."""
    pieces = _pack(state, device)
    for dst in dsts:
        for work in [dist.isend(t, dst) for t in pieces]:
            faults.wait_watched(work)


def _recv(t: torch.Tensor, src: int) -> torch.Tensor:
    faults.wait_watched(dist.irecv(t, src))
    return t


def recv_state(device: torch.device, src: int = 0) -> Any:
    """The state :func:`send_state` sends from ``src``; its tensors are views of the
    received blocks."""
    size = _recv(torch.zeros(1, dtype=torch.int64, device=device), src)
    raw = _recv(torch.empty(int(size.item()), dtype=torch.uint8, device=device), src)
    skeleton, sizes = unpickled(raw)
    blocks = {d: torch.empty(sizes[d], dtype=d, device=device) for d in sorted(sizes, key=str)}
    for work in [dist.irecv(b, src) for b in blocks.values() if b.numel()]:  # (the order they were sent in)
        faults.wait_watched(work)
    return _fill(skeleton, blocks)


def broadcast_state(state: Any, device: torch.device, src: int = 0) -> Any:
    """``state`` (nested dicts, lists and tensors; meaningful on ``src`` only) on every rank
    of the default group: the skeleton pickled, the tensors as one flat broadcast per
    dtype on ``device`` (the backend's: CPU for Gloo). Collective. On ``src`` it returns
    ``state`` itself; elsewhere the tensors are views of the received blocks."""
    tensors: dict[torch.dtype, list[torch.Tensor]] = {}
    sizes: dict[torch.dtype, int] = {}
    head = (_strip(state, tensors, sizes), sizes) if dist.get_rank() == src else None
    skeleton, sizes = faults.broadcast_object_watched(head, src)
    blocks = {}
    for dtype in sorted(sizes, key=str):  # the same order on every rank
        if dist.get_rank() == src:
            block = _block(tensors[dtype], device)
        else:
            block = torch.empty(sizes[dtype], dtype=dtype, device=device)
        if sizes[dtype]:
            _broadcast(block, src)
        blocks[dtype] = block
    return state if dist.get_rank() == src else _fill(skeleton, blocks)


def _device(me: Member) -> torch.device:
    """Where the state travels: the model's device (Gloo: the CPU)."""
    first = next((p for v in me.state.values() if isinstance(v, torch.nn.Module) for p in v.parameters()), None)
    return torch.device("cpu") if dist.get_backend() == "gloo" or first is None else first.device


def sync_state(me: Member, epoch: Epoch, mode_state: dict[str, Any] | None, kind: str) -> tuple[Any, str]:
    """Rank 0's whole state (``me.state``'s, its mode's, ``mode_state``, and the mode's
    kind) to the members of ``epoch`` that join it: a broadcast where every other rank
    joins (the first epoch), else point to point to each, the other members going on to
    build the mode. A joiner loads it into ``me`` and gets the mode's state and kind back,
    to load once its mode is built; the others get ``(None, kind)``."""
    me.passing("sync_state", epoch)
    rank, device = dist.get_rank(), _device(me)
    to = [r for r in map(epoch.members.index, epoch.receivers) if r != 0]
    mine = None
    if rank == 0:
        mine = {"step": me.step, "state": {k: v.state_dict() for k, v in me.state.items()},
                "mode": mode_state, "kind": kind}
    if len(to) == epoch.world - 1:
        got = broadcast_state(mine, device)
    elif rank == 0:
        send_state(mine, device, to)
    elif rank in to:
        got = recv_state(device, 0)
    if rank not in to:
        return None, kind
    for k, obj in me.state.items():
        obj.load_state_dict(got["state"][k])
    me.step = int(got["step"])
    return got["mode"], got["kind"]
