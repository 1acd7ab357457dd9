"""CUDA graphs for pack and unpack. Imported only when gradients live on a CUDA device.

Verified on CPU only through the checked backend's contract; not yet run on a GPU.
"""

from __future__ import annotations

from typing import Callable

import torch

from .eager import warn_once

WARMUP = 2


class CudaGraphBackend:
    """Warm ``fn`` up on a side stream, capture it once, replay it on the current stream.

    The collective stays outside the graph: the reducer issues it between the pack and
    unpack replays. Capture failures fall back to eager with one warning.
    """

    name = "cuda"

    def __init__(self, device: torch.device):
        self.device = device

    def capture(self, fn: Callable[[], None]) -> Callable[[], None]:
        try:
            side = torch.cuda.Stream(self.device)
            side.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(side):
                for _ in range(WARMUP):
                    fn()
            torch.cuda.current_stream(self.device).wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                fn()
        except RuntimeError as e:  # capture unsupported here: stay correct, lose speed
            warn_once(f"CUDA graph capture failed ({e}); running pack/unpack eagerly")
            return fn
        return graph.replay
