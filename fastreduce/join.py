"""Uneven inputs: every mode under ``torch.distributed.algorithms.Join``.

A rank that runs out of batches leaves its training loop and waits in ``Join``'s exit,
which repeats, until every rank has left::

    joined rank:   count := all-reduce(0)      (Join's own loop)
                   count == 0: all joined -> post_hook(is_last_joiner) of each joinable
                   else: main_hook() of each joinable: the collectives of one iteration
    active rank:   per iteration, before its first collective: all-reduce(1) (the notify,
                   which the joined ranks' count matches; its result is the number of
                   active ranks), then the iteration's collectives

so the ranks always issue the same collectives in the same order. :class:`JoinableMode`
holds that protocol for every mode: :meth:`~JoinableMode._join_notify` (active ranks,
once per iteration), :meth:`~JoinableMode._join_factor` (``world / active``, read once
the count is needed) and the hook, which sets :attr:`~JoinableMode._join_joined` and
calls the mode's ``_join_shadow()`` (one iteration with nothing of its own: zero
gradients, no optimizer step) and, as ``Join`` exits, ``_join_finish(is_last_joiner)``.

Averages: a joined rank contributes zeros, so an average over the group is the sum
over the active ranks divided by the initial world size; by default (as DDP's Join with
``divide_by_initial_world_size=False``) the active ranks rescale it by ``world /
active`` (one flat op, only when the two differ), and
``Join([...], divide_by_initial_world_size=True)`` keeps the division by the world.

Not under ``Join`` (or after it exits: the post-hook switches the protocol off again)
a mode issues no collective of its own for it: ``_join_notify`` returns at once.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.algorithms.join import Joinable, JoinHook

from .faults import wait_watched
from .torch_internals import disabled_join_config

__all__ = ["JoinableMode", "sync_from_last_joiner"]


class JoinableMode(Joinable):
    """The ``Joinable`` side shared by every fastreduce mode (see the module doc).

    A mode calls :meth:`_init_join` in its constructor, :meth:`_join_notify` once per
    iteration before its first collective (only where that iteration communicates),
    and implements ``_join_shadow()`` (a joined rank's one iteration: the same
    collectives in the same order, contributing zeros; :attr:`_join_joined` is set
    meanwhile) and optionally ``_join_finish(is_last_joiner)`` and ``_join_check()``.
    """

    _join_config: Any  # torch's _JoinConfig
    _join_group: dist.ProcessGroup | None
    _join_dev: torch.device

    def __init__(self) -> None:  # Joinable's constructor is abstract; modes call _init_join
        self._init_join(None, torch.device("cpu"))

    @property
    def under_join(self) -> bool:
        """Whether the mode runs inside torch's ``Join`` now (uneven inputs)."""
        return self._join_config.enable

    def _init_join(self, group: dist.ProcessGroup | None, device: torch.device) -> None:
        self._join_config = disabled_join_config()
        self._join_group = group
        self._join_dev = torch.device(device)
        self._join_count: tuple[Any, torch.Tensor] | None = None  # (work, ones) of this iteration
        self._join_ratio = 1.0  # world / active of the last counted iteration
        self._join_joined = False  # inside this rank's main_hook
        self._join_divide_by_world = False

    # ------------------------------------------------------------------ Joinable

    def join_hook(self, **kwargs: Any) -> JoinHook:
        """The hook ``Join`` runs on a joined rank. ``divide_by_initial_world_size``
        (default ``False``): average over the initial world size instead of over the
        ranks still active."""
        self._join_check()
        self._join_divide_by_world = bool(kwargs.get("divide_by_initial_world_size", False))
        return _ModeJoinHook(self)

    @property
    def join_device(self) -> torch.device:
        return self._join_dev

    @property
    def join_process_group(self) -> Any:
        return self._join_group if self._join_group is not None else dist.group.WORLD

    # ------------------------------------------------------------------ for the modes

    def _join_check(self) -> None:
        """Raise if this mode's settings cannot run under ``Join`` (override)."""

    def _join_shadow(self) -> None:
        raise NotImplementedError

    def _join_finish(self, is_last_joiner: bool) -> None:
        """After every rank joined (override where ranks must end alike)."""

    def _join_notify(self) -> None:
        """Active ranks, once per iteration before its first collective: tell ``Join``
        this rank has not joined and start counting the active ranks (async).

        The first joinable of a ``Join`` does what ``Join.notify_join_context`` does
        (its all-reduce of 1 is what the joined ranks' loop counts), keeping the count
        tensor; any other fastreduce joinable counts with an all-reduce of its own,
        which its hook matches on the joined ranks. Under
        ``throw_on_early_termination=True`` it raises on every rank once one joined."""
        cfg = self._join_config
        if not cfg.enable or self._join_joined:
            return
        pg = self.join_process_group
        ones = torch.ones(1, device=self._join_dev)
        self._join_count = (dist.all_reduce(ones, group=pg, async_op=True), ones)
        if cfg.is_first_joinable and cfg.throw_on_early_termination:
            flag = torch.zeros(1, device=self._join_dev)
            dist.all_reduce(flag, group=pg)  # a joined rank sends 1 here before it raises
            if flag.item():
                self._join_count = None
                raise RuntimeError("Detected at least one rank that exhausted inputs. "
                                   "Throwing across all ranks.")

    def _join_factor(self, active_only: bool = False) -> float:
        """``world / active`` for this iteration: what the active ranks multiply an
        average over the group by (1.0 not under ``Join``, when every rank is active,
        or under ``divide_by_initial_world_size=True`` unless ``active_only``: a mean of
        parameters or statistics is over the active ranks always). Waits for the count
        once per iteration."""
        if self._join_count is not None:
            work, count = self._join_count
            self._join_count = None
            wait_watched(work)
            world = dist.get_world_size(self._join_group)
            active = int(count.item())
            self._join_ratio = world / active if 0 < active < world else 1.0
        return 1.0 if self._join_divide_by_world and not active_only else self._join_ratio

    def _join_contribute(self, bufs: list[torch.Tensor], active_only: bool = False) -> None:
        """What this rank puts into an average it is about to take, in place: zeros on a
        joined rank; ``x * world / active`` on an active one (nothing when they agree),
        so that the group's mean is the mean over the active ranks on every rank."""
        if self._join_joined:
            torch._foreach_zero_(bufs)
            return
        factor = self._join_factor(active_only)
        if factor != 1.0:
            torch._foreach_mul_(bufs, factor)

    def _join_reset(self) -> None:
        self._join_config = disabled_join_config()
        self._join_count = None
        self._join_ratio = 1.0
        self._join_joined = False


class _ModeJoinHook(JoinHook):
    """Runs a mode's shadow iteration on a joined rank, and its finish as ``Join`` exits."""

    def __init__(self, mode: JoinableMode):
        self.mode = mode

    def main_hook(self) -> None:
        mode = self.mode
        if not mode._join_config.is_first_joinable:  # matches _join_notify's own count
            dist.all_reduce(torch.zeros(1, device=mode.join_device), group=mode.join_process_group)
        mode._join_joined = True
        try:
            mode._join_shadow()
        finally:
            mode._join_joined = False

    def post_hook(self, is_last_joiner: bool) -> None:
        mode = self.mode
        mode._join_reset()  # out of Join: no notify, no count from here on
        mode._join_finish(is_last_joiner)


@torch.no_grad()
def sync_from_last_joiner(tensors: list[torch.Tensor], group: dist.ProcessGroup | None,
                          is_last_joiner: bool) -> int:
    """Every rank's ``tensors`` := those of one last joiner (the highest such rank),
    as DDP's join post-hook does; returns that rank (in ``group``). One MAX all-reduce
    to agree on it, then one broadcast per dtype of the tensors flattened together."""
    if not tensors:
        return 0
    rank = dist.get_rank(group)
    device = tensors[0].device
    pick = torch.tensor([rank if is_last_joiner else -1], device=device)
    dist.all_reduce(pick, op=dist.ReduceOp.MAX, group=group)
    src = int(pick.item())
    by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
    for t in tensors:
        by_dtype.setdefault(t.dtype, []).append(t)
    src_global = dist.get_global_rank(group, src) if group is not None else src
    for ts in by_dtype.values():
        flat = torch.cat([t.detach().reshape(-1) for t in ts])
        dist.broadcast(flat, src=src_global, group=group)
        if rank != src:
            torch._foreach_copy_([t.detach() for t in ts],
                                 [v.view_as(t) for v, t in zip(flat.split([t.numel() for t in ts]), ts)])
    return src
