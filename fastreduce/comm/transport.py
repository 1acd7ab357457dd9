"""Which transport a mode's collectives take: ``"process_group"`` (the group's backend),
``"shm"`` (shared memory, CPU ranks of one host) or ``"auto"`` (shared memory where the
ranks share a ``/dev/shm``, else the group), from the mode's argument or
``$FASTREDUCE_TRANSPORT``.
"""

from __future__ import annotations

import os
from typing import Literal

import torch

__all__ = ["TRANSPORTS", "TRANSPORT_ENV", "Transport", "resolve_transport", "wants_shm"]

Transport = Literal["auto", "shm", "process_group"]
TRANSPORTS = ("auto", "shm", "process_group")
TRANSPORT_ENV = "FASTREDUCE_TRANSPORT"


def resolve_transport(transport: str | None) -> str:
    """``transport``, or ``$FASTREDUCE_TRANSPORT``, or ``auto``; validated."""
    value = transport if transport is not None else os.environ.get(TRANSPORT_ENV, "auto")
    if value not in TRANSPORTS:
        raise ValueError(f"unknown transport {value!r} (argument or ${TRANSPORT_ENV}); "
                         f"choose one of {', '.join(TRANSPORTS)}")
    return value


def wants_shm(transport: str | None, device: torch.device) -> bool:
    """Whether buffers on ``device`` go through shared memory where the ranks share a host
    (``transport`` as given to a mode; the segment's opening decides, collectively)."""
    transport = resolve_transport(transport)
    return transport == "shm" or (transport == "auto" and device.type == "cpu")
