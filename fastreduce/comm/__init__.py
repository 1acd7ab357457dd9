"""The communication layer: averaging all-reduce, reduce-scatter and all-gather of flat
buffers over one process group, on the transport that is fastest and correct for it.

:mod:`.comm` holds :class:`Comm`, the one object every mode talks to (:func:`get_comm`);
:mod:`.collectives` the process-group plans (AVG probe, divide-first, fp32
accumulation, renamed-collective compat); :mod:`.shm` the shared-memory transport for
CPU ranks on one host.
"""

from .collectives import (Fp32Accumulate, MeanPlan, Pending, Waitable, advance, all_gather_flat, broadcast_from_rank0,
                          complete, reduce_scatter_flat)
from .comm import Comm, get_comm
from .shm import ShmAllReduce
from .transport import TRANSPORT_ENV, TRANSPORTS, Transport, resolve_transport, wants_shm

__all__ = ["Comm", "Fp32Accumulate", "MeanPlan", "Pending", "ShmAllReduce", "TRANSPORTS", "TRANSPORT_ENV",
           "Transport", "Waitable", "advance", "all_gather_flat", "broadcast_from_rank0", "complete", "get_comm",
           "reduce_scatter_flat", "resolve_transport", "wants_shm"]
