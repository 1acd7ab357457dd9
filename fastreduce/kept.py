"""What a :class:`~fastreduce.Membership` member keeps of its mode across an epoch change,
and at which step it stands once the next epoch forms (:mod:`.epochs`): its mode's state by
how the mode's steps commit (:func:`.modes.contract.commit_style`), and the step a ZeRO
member holds (its members' meeting failed on it, not on every survivor).
"""

from __future__ import annotations

from typing import Any

from .modes import zero_mirror
from .modes.contract import commit_style
from .nested import clone_state

__all__ = ["kept_state", "settled_step"]


def kept_state(mode: Any, after_loss: bool) -> tuple[Any, str]:
    """What an epoch change keeps of ``mode``'s state, a copy, and its commit style (what a
    job checkpoint's part holds too: :mod:`fastreduce.job_checkpoints`): ZeRO's shard and its
    copy of the previous rank's (no collective); the others' ``state_dict`` (after a loss,
    the per-rank modes' ``local_state_dict``: nothing in flight waited for)."""
    kind = commit_style(mode)
    if kind == "zero":
        return zero_mirror.held(mode), kind
    save = mode.local_state_dict if after_loss and kind in ("gossip", "local") else mode.state_dict
    return clone_state(save()), kind


def settled_step(word: dict[str, Any], top: int) -> int:
    """A member's step once the next epoch forms (``word``: its announcement): one more
    where it holds a ZeRO step that a survivor committed (at ``top``)."""
    return word["step"] + 1 if word.get("held") and word["step"] + 1 == top else word["step"]
