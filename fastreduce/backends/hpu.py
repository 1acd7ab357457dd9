"""HPU graphs for pack and unpack on Gaudi. Imported only when gradients live on an HPU.

HPU graphs work in lazy mode only (``PT_HPU_LAZY_MODE=1``); under eager mode or
``torch.compile`` the reducer falls back to the eager backend with one warning.
Written against the Habana documentation; verified on CPU only through the checked
backend's contract, not yet on a Gaudi.
"""

from __future__ import annotations

import os
from typing import Callable

from .eager import warn_once


def available() -> bool:
    """True when ``habana_frameworks`` imports and sees at least one HPU."""
    try:
        import habana_frameworks.torch.hpu as hthpu  # noqa: PLC0415 - lazy by design
    except ImportError:
        return False
    try:
        return bool(hthpu.is_available())
    except RuntimeError:
        return False


def lazy_mode() -> bool:
    """Whether the HPU bridge runs in lazy mode (the only mode HPU graphs support)."""
    try:
        from habana_frameworks.torch.utils.internal import is_lazy  # noqa: PLC0415

        return bool(is_lazy())
    except (ImportError, AttributeError):
        return os.environ.get("PT_HPU_LAZY_MODE", "1") == "1"


def import_hccl() -> None:
    """Register the ``hccl`` process-group backend with torch.distributed."""
    import habana_frameworks.torch.distributed.hccl  # noqa: F401, PLC0415


class HpuGraphBackend:
    """Capture ``fn`` into an ``HPUGraph`` on a side stream and replay it each call."""

    name = "hpu"

    def capture(self, fn: Callable[[], None]) -> Callable[[], None]:
        import habana_frameworks.torch as ht  # noqa: PLC0415

        try:
            graph = ht.hpu.HPUGraph()
            with ht.hpu.stream(ht.hpu.Stream()):
                graph.capture_begin()
                fn()
                graph.capture_end()
        except RuntimeError as e:
            warn_once(f"HPU graph capture failed ({e}); running pack/unpack eagerly")
            return fn
        return graph.replay
