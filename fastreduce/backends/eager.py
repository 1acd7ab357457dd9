"""The eager backend: no capture, ``fn`` runs as plain PyTorch ops (CPU, and anything else)."""

from __future__ import annotations

import logging
from typing import Callable

log = logging.getLogger("fastreduce.backends")
_warned: set[str] = set()


def warn_once(msg: str) -> None:
    """Log ``msg`` as a warning the first time it is seen in this process (a graph
    backend that falls back to eager says so once)."""
    if msg not in _warned:
        _warned.add(msg)
        log.warning(msg)


class EagerBackend:
    """Runs pack and unpack as ordinary ops."""

    name = "eager"

    def capture(self, fn: Callable[[], None]) -> Callable[[], None]:
        return fn
