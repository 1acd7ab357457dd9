"""The eager backend: no capture, ``fn`` runs as plain PyTorch ops (CPU, and anything else)."""

from __future__ import annotations

from typing import Callable


class EagerBackend:
    """Runs pack and unpack as ordinary ops."""

    name = "eager"

    def capture(self, fn: Callable[[], None]) -> Callable[[], None]:
        return fn
