"""The training data under a :class:`fastreduce.Membership`, as the trainers draw it
(:mod:`.membership`): one stream of seeded data epochs that every member draws from at the
same position, interleaved by its rank of the current epoch, so that a new epoch re-shards
at once and a discarded step's samples are drawn again over the survivors."""

from __future__ import annotations

import math
from typing import Any, Iterator, Mapping

import torch
from torch.utils.data import DistributedSampler

__all__ = ["MembershipSampler"]


class MembershipSampler(DistributedSampler):
    """A training sampler that re-shards at every epoch of a :class:`fastreduce.Membership`.

    The samples form one stream: data epoch ``e`` is a permutation of the dataset (seeded by
    ``seed + e`` where ``shuffle``, else in order), followed by epoch ``e + 1``'s. Every member
    draws, for the step it trains, its ``j``-th sample since the last committed step at
    stream position ``position + j * world + rank`` (the rank and world of the member's
    current epoch); a committed step moves ``position`` past what every member drew
    (:meth:`advance`), a discarded step does not, so its samples are drawn again over the
    survivors. The position travels to a joiner with the state.

    A subclass of ``DistributedSampler``, so that trainers leave it in place; its draws
    follow the step, so a data loader must not draw ahead of it (no worker processes).

    Args:
        dataset: a map-style dataset (its length).
        step_samples: the samples each member draws per step (batch size times gradient
            accumulation): one pass (``iter``) draws whole steps only.
        sized: whether ``len()`` answers (the samples per member in a data epoch at
            ``world_size``, in whole steps; a pass draws that many): Lightning counts its
            epochs by it. ``False``: a pass never ends (the HF Trainer then runs to
            ``max_steps``).
    """

    def __init__(self, dataset: Any, membership: Any, *, step_samples: int, world_size: int,
                 shuffle: bool = True, seed: int = 0, sized: bool = True):
        self.dataset, self.membership, self.shuffle, self.seed = dataset, membership, shuffle, seed
        self.size = len(dataset)
        if self.size == 0:
            raise ValueError("MembershipSampler: the training dataset is empty")
        self.step_samples, self.world_size, self.sized = step_samples, world_size, sized
        self.drop_last, self.epoch = False, 0  # DistributedSampler's attributes, for those who read them
        self.position = 0  # stream position of the first sample of the step being drawn
        self.through = 0  # the last step whose samples moved the position
        self._drawn = 0  # samples this member drew since the last commit
        self._world = 1  # the world they were drawn in
        self._perm: tuple[int, torch.Tensor] | None = None

    # DistributedSampler's names, read live
    @property
    def num_replicas(self) -> int:  # type: ignore[override]
        return self.membership.world if self.membership.epoch is not None else 1

    @property
    def rank(self) -> int:  # type: ignore[override]
        return self.membership.rank if self.membership.epoch is not None else 0

    @property
    def data_epoch(self) -> float:
        """Data epochs drawn, as a fraction (the trainers' logged ``epoch``)."""
        return self.position / self.size

    def __len__(self) -> int:
        if not self.sized:
            raise TypeError("MembershipSampler(sized=False) has no length: the trainer runs to max_steps")
        steps = math.ceil(self.size / (self.world_size * self.step_samples))
        return steps * self.step_samples

    def __iter__(self) -> Iterator[int]:
        n = len(self) if self.sized else None
        k = 0
        while n is None or k < n:
            if self._drawn == 0:
                self._world = self.num_replicas
            p = self.position + self._drawn * self._world + self.rank
            self._drawn += 1
            k += 1
            yield self._at(p)

    def _at(self, p: int) -> int:
        e, i = divmod(p, self.size)
        if self._perm is None or self._perm[0] != e:
            if self.shuffle:
                g = torch.Generator().manual_seed(self.seed + e)
                self._perm = (e, torch.randperm(self.size, generator=g))
            else:
                self._perm = (e, torch.arange(self.size))
        return int(self._perm[1][i])

    def set_epoch(self, epoch: int) -> None:
        """Ignored: the data epoch follows the stream position, the same on every member."""

    def advance(self, step: int) -> None:
        """Step ``step`` committed: move the position past what every member drew for it
        (once per step: a sync redone over the survivors does not move it again)."""
        if step > self.through:
            self.position += self._drawn * self._world
            self.through = step
        self._drawn = 0

    def redraw(self) -> None:
        """After a commit: the next step draws afresh (a discarded step's samples again)."""
        self._drawn = 0

    def state_dict(self) -> dict[str, int]:
        """The position, and what this member drew since the last commit (a sync redone over
        the survivors puts this state back, then moves the position past those draws)."""
        return {"position": self.position, "through": self.through, "seed": self.seed, "size": self.size,
                "drawn": self._drawn, "world": self._world}

    def load_state_dict(self, state: Mapping[str, int]) -> None:
        if state["size"] != self.size or state["seed"] != self.seed:
            raise ValueError(f"MembershipSampler: the members' dataset has {state['size']} samples and seed "
                             f"{state['seed']}, this process's {self.size} and {self.seed}: the same data is needed")
        self.position, self.through = int(state["position"]), int(state["through"])
        self._drawn, self._world = int(state.get("drawn", 0)), int(state.get("world", self._world))
