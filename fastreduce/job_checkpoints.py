"""A Membership's own checkpoints (:class:`JobCheckpoints`): the job's state saved by its
members as it trains, with no collective and nobody waiting on anybody, and a new job
started from it on any number of members (the per-rank modes: on the number it was saved at).

Why not :class:`~fastreduce.checkpoint.Checkpointer` under a Membership: its saves are
plain collectives (DCP's gathers and broadcasts), which Gloo cannot interrupt, so a member
lost in the middle of one can leave a survivor waiting in it until the group's timeout.
Here each member of the epoch that committed step ``S`` (a multiple of ``every``) writes
its own *part* right after committing it, before any epoch change at that step (a joiner
admitted there writes none): its ``state`` objects (the model, the optimizer, a trainer's
sampler and schedulers), its mode's state as an epoch change keeps it (ZeRO: the shard it
holds and its copy of the previous rank's; the others: their ``state_dict``) and its random
generators; the state objects, where they are the same on every member (all but the
per-rank modes), in rank 0's part only. One file per member, ``step-<S>/e<E>-<r>-of-<W>.pt``,
written apart and renamed. A step's checkpoint is complete once every rank of one epoch has
written its part; a member lost before writing leaves it incomplete, and it is never loaded.

Resuming (:meth:`fastreduce.Membership.join`): the first members of a new job find the
newest complete checkpoint and start at its step (a first member that finds another is
refused, the two steps named); each takes the part of its rank in epoch 0, and the mode's
state is put back as after any epoch change (:meth:`~fastreduce.epochs.EpochChanges.enter`):
ZeRO's shards resharded onto the new world, of any size (each first member takes the parts
of the old ranks ``r``, ``r + world``, ...); the fused modes' on any size too; the per-rank
modes' (gossip, LocalSGD, DiLoCo) only on the number of members that saved it, else
:class:`~fastreduce.MembershipError` on every first member before anything is changed. The
directory must be one every member reaches (a shared file system, or one host). The files
are pickles (``torch.load(weights_only=False)``): load only a directory you wrote.
"""

from __future__ import annotations

import logging
import os
import re
import shutil
from dataclasses import dataclass
from typing import Any

import torch

from .admission import Admission
from .checkpoint_folders import step_folder, step_folders
from .checks import check_int
from .checkpoint_state import capture_rng_state, restore_rng_state
from .coordinator import Epoch, MembershipError
from .member import Member
from .modes.contract import PER_RANK_ONLY_AT_ITS_WORLD

__all__ = ["Found", "JobCheckpoints"]

log = logging.getLogger("fastreduce.membership")

FORMAT = 1
_PART = re.compile(r"e(\d+)-(\d+)-of-(\d+)\.pt$")
PER_RANK = ("local", "gossip")  # the commit styles whose state is each rank's own


@dataclass(frozen=True)
class Found:
    """A complete checkpoint: its committed ``step`` and its parts' paths in rank order (one
    per member of the epoch that wrote it: :attr:`world`)."""

    step: int
    parts: tuple[str, ...]

    @property
    def world(self) -> int:
        return len(self.parts)


class JobCheckpoints:
    """Where and how often a :class:`~fastreduce.Membership` saves the job (see the module
    doc): ``directory`` (shared by the members), every ``every`` committed steps, the newest
    ``keep`` complete checkpoints kept (the member of rank 0 removes older ones)."""

    def __init__(self, directory: str | os.PathLike, every: int, *, keep: int = 2):
        for name, v in (("every", every), ("keep", keep)):
            check_int(f"JobCheckpoints: {name}", v, 1)
        self.directory, self.every, self.keep = os.fspath(directory), every, keep

    def due(self, step: int) -> bool:
        """Whether committed step ``step`` is saved."""
        return step > 0 and step % self.every == 0

    # ------------------------------------------------------------------ saving

    def write(self, me: Member, mode_state: tuple[Any, str], layout: dict[str, Any]) -> str:
        """This member's part of the checkpoint of its committed step (no collective):
        ``mode_state`` the mode's state as an epoch change keeps it, and its commit style;
        ``layout`` the member's fingerprint (what a joiner's is compared with)."""
        epoch, rank = me.current(), me.rank
        folder = step_folder(self.directory, me.step)
        os.makedirs(folder, exist_ok=True)
        own = rank == 0 or mode_state[1] in PER_RANK  # the state objects: the same on every member, else each one's
        part = {"format": FORMAT, "step": me.step, "epoch": epoch.number, "rank": rank, "world": epoch.world,
                "layout": layout, "state": {k: v.state_dict() for k, v in me.state.items()} if own else None,
                "mode": mode_state[0], "kind": mode_state[1], "rng": capture_rng_state()}
        path = os.path.join(folder, f"e{epoch.number}-{rank}-of-{epoch.world}.pt")
        tmp = f"{path}.{os.getpid()}.tmp"
        torch.save(part, tmp)
        os.replace(tmp, path)
        if rank == 0:
            self._prune(me.step)
        return path

    def _prune(self, writing: int) -> None:
        """Folders older than the ``keep`` newest complete checkpoints (``writing``, the one
        being written, is not counted: it may never complete), and incomplete ones older than
        the newest complete one."""
        steps = step_folders(self.directory)
        complete = [s for s, _ in steps if s != writing and self._complete(s) is not None]
        oldest = min(complete[-self.keep:], default=writing)
        newest = max(complete, default=-1)
        for s, folder in steps:
            if s < oldest or (s < newest and s not in complete):
                shutil.rmtree(folder, ignore_errors=True)

    # ------------------------------------------------------------------ finding

    def _complete(self, step: int) -> Found | None:
        folder = step_folder(self.directory, step)
        groups: dict[tuple[int, int], dict[int, str]] = {}
        for n in os.listdir(folder) if os.path.isdir(folder) else ():
            m = _PART.match(n)
            if m:
                e, r, w = map(int, m.groups())
                groups.setdefault((e, w), {})[r] = os.path.join(folder, n)
        for (_, w), parts in sorted(groups.items(), reverse=True):  # the newest epoch first
            if len(parts) == w:
                return Found(step, tuple(parts[r] for r in range(w)))
        return None

    def newest(self, start_step: int = 0) -> Found | None:
        """The newest complete checkpoint in :attr:`directory`, or ``None``; a job told to
        start at ``start_step`` as well is refused."""
        found = self._newest()
        if found is not None and start_step:
            raise ValueError(f"join(start_step={start_step}) where {self.directory} holds the job's checkpoint of step "
                             f"{found.step}, which the job resumes from: pass no start_step (or another directory)")
        return found

    def _newest(self) -> Found | None:
        for step, _ in reversed(step_folders(self.directory)):
            found = self._complete(step)
            if found is not None:
                return found
        return None

    # ------------------------------------------------------------------ resuming

    def resume(self, me: Member, found: Found, epoch: Epoch, admission: Admission) -> None:
        """A first member of ``epoch`` (epoch 0, whose members all resume ``found``) takes its
        part: its ``state`` objects loaded, its step, its random generators, and the mode's
        state kept for :meth:`~fastreduce.epochs.EpochChanges.enter` to put back."""
        rank, world = epoch.members.index(me.name), epoch.world
        mine = [k for k in range(found.world) if k % world == rank]
        parts = [_read(found.parts[k]) for k in mine or [rank % found.world]]
        head, layout = parts[0], admission.fingerprint()
        why = f"it is in format {head.get('format')}, this fastreduce reads {FORMAT}" if head.get("format") != FORMAT \
            else admission.differs({**head["layout"], "version": layout["version"]}, layout)  # (any fastreduce reads it)
        if why is None and head["kind"] in PER_RANK and world != found.world:
            why = (f"{PER_RANK_ONLY_AT_ITS_WORLD}: it holds the state of {found.world} members and this job starts with "
                   f"{world}; start it with world_size={found.world}")
        if why is not None:
            raise MembershipError(f"fastreduce: the job's checkpoint {os.path.dirname(found.parts[0])} does not fit: "
                                  f"{why}. Nothing was loaded")
        state = head["state"] if head["state"] is not None else _read(found.parts[0])["state"]
        for k, obj in me.state.items():
            obj.load_state_dict(state[k])
        me.step = found.step
        mode, kind = head["mode"], head["kind"]
        if kind == "zero":  # the shards of every old rank it takes, as one holding (none: it takes them as a joiner)
            mode = None if not mine else {**mode, "stale": any(p["mode"]["stale"] for p in parts),
                                          "chunks": {c: h for p in parts for c, h in p["mode"]["chunks"].items()}}
        elif world != found.world:  # the fused modes' error-feedback residuals start at zero, as a Checkpointer's do
            mode = None
        me.kept_mode = (mode, kind)
        if mine:
            restore_rng_state(head["rng"])
        log.info("fastreduce: member %s resumes the job at step %d from %s", me.name, found.step,
                 ", ".join(os.path.basename(found.parts[k]) for k in mine))


def _read(path: str) -> dict[str, Any]:
    """A part, its tensors mapped rather than read (only what is loaded from them is read:
    rank 0's part, whose shared state every first member takes, holds its shards too)."""
    return torch.load(path, map_location="cpu", weights_only=False, mmap=True)
