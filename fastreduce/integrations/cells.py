"""The support matrix: every mode in every way in, plain and under a Membership, and what each
cell can do, with the refusals the code raises, told from the mode contract.

A cell is (mode, way, membership, aspect). The ways in (:data:`WAYS`): the user's own loop
over the core classes, the HF Trainer, Lightning, Accelerate and optimum-habana's
GaudiTrainer. The aspects (:data:`ASPECTS`): training, a checkpoint saved and resumed,
resumed on another world size, and ``torch.compile``. :func:`refusal` says why a cell
cannot exist (the words the code raises there), or ``None``; the trainers ask it where they
refuse, and the table in docs/trainers.md is generated from it and from the tests that
cover each cell (``tests/matrix.py``), so a cell is either a passing test or a refusal with
its reason, and the table cannot go stale unnoticed.
"""

from __future__ import annotations

from ..modes.contract import PER_RANK_ONLY_AT_ITS_WORLD, state_scope
from .modes import MODES

__all__ = ["ASPECTS", "WAYS", "refusal"]

WAYS: dict[str, str] = {
    "loop": "your own loop",
    "hf": "HF `Trainer`",
    "lightning": "Lightning",
    "accelerate": "Accelerate",
    "gaudi": "`GaudiTrainer`",
}
"""The ways in, with their names in the table."""

ASPECTS: dict[str, str] = {
    "train": "trains",
    "resume": "save, resume",
    "reshard": "resume on another world size",
    "compile": "`torch.compile`",
}
"""What a cell is asked to do, with its name in the table."""

def refusal(mode: str, way: str, membership: bool, aspect: str) -> str | None:
    """Why the cell (``mode``, ``way``, under a Membership or not, ``aspect``) cannot exist, in
    the words the code refuses it with; ``None`` where it can."""
    cls = MODES[mode].cls
    if way not in WAYS or aspect not in ASPECTS:
        raise ValueError(f"no such cell: way {way!r} (one of {sorted(WAYS)}), aspect {aspect!r} (one of {sorted(ASPECTS)})")
    if aspect == "reshard" and state_scope(cls) == "per_rank":
        return PER_RANK_ONLY_AT_ITS_WORLD
    return None

