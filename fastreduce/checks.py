"""The argument check the modes, the checkpoints and the codecs share."""

from __future__ import annotations

from typing import Any

__all__ = ["check_int"]


def check_int(name: str, value: Any, least: int) -> int:
    """``value``, an ``int`` (not a ``bool``) of at least ``least``; else ``ValueError`` naming ``name``."""
    if isinstance(value, bool) or not isinstance(value, int) or value < least:
        raise ValueError(f"{name} must be an integer >= {least}, got {value!r}")
    return value
