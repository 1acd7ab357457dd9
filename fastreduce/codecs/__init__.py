"""Codecs: wire formats between the flat buffer and the comm layer (DESIGN.md, "Compression").

A codec turns a group of gradients into the buffers a mode sends and back, and keeps
what it must carry between steps (residuals, warm starts). It knows neither modes nor
transports: the mode launches the collectives around the codec's encode and decode.

* :mod:`.powersgd`: low-rank (PowerSGD), ``compression=`` of the fused and overlapped
  reducers.
"""

from .powersgd import LowRank, PowerSGD, initial_q

__all__ = ["LowRank", "PowerSGD", "initial_q"]
