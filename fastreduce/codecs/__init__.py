"""Codecs: wire formats between the flat buffer and the comm layer (docs/design.md, "Compression").

A codec turns a group of gradients into the buffers a mode sends and back, and keeps
what it must carry between steps (residuals, warm starts). It knows neither modes nor
transports: the mode launches the collectives around the codec's encode and decode.

* :mod:`.powersgd`: low-rank (PowerSGD), ``compression=`` of the fused and overlapped
  reducers;
* :mod:`.sparse`: chunk-wise top-k with few-bit values (SparseLoCo), ``compression=`` of
  DiLoCo.
"""

from .powersgd import LowRank, PowerSGD, initial_q
from .sparse import SparseLoCo, SparseState

__all__ = ["LowRank", "PowerSGD", "SparseLoCo", "SparseState", "initial_q"]
