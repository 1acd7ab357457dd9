"""QuantMean: a flat fp32 buffer := the mean over ranks, through a quantized wire.

A quantized value is never summed in its own format (DESIGN.md, "Compression"). With
the buffer cut into W chunks (chunk r owned by rank r), each a whole number of the
codec's blocks::

    encode every chunk            (with error feedback: plus this rank's residual, which
                                   then becomes what the encoding rounded away)
    exchange the encoded chunks   (an all-to-all: rank r receives every rank's chunk r)
    owner decodes them, sums in fp32 in sum_order, divides by W
                                  (with error feedback: plus the owner's residual of the
                                   last mean's encoding, which then becomes this one's)
    owner encodes the mean        the second rounding
    all-gather the encoded means, decode every chunk into the buffer

Two roundings at any world size, and the bytes of one quantized ring all-reduce (each
rank sends and receives W - 1 encoded chunks twice). On the shared-memory transport
nothing travels, but the result must not depend on the transport (bit for bit), so the
same roundings happen in place: every chunk is replaced by its round trip, the shared
segment's reduce-scatter sums them in fp32 in the same order, the owner adds its
residual and replaces its chunk of the mean by that chunk's round trip, and the
all-gather copies the owners' chunks.

The residuals are the codec's error-feedback state: this rank's (one buffer's worth)
and, for the chunk it owns, the mean's (one chunk's worth). Nothing is lost over time:
what a step's two roundings drop is added to the next step's values.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable

import torch

from ..codecs.quant import BlockQuant
from ..faults import wait_watched
from ..profiling import span

if TYPE_CHECKING:
    from .comm import Comm

__all__ = ["QuantMean"]


class QuantMean:
    """``buf`` := its mean over ``comm``'s ranks through ``codec``'s wire.

    ``buf`` is flat fp32 and splits into ``comm.world`` chunks of a whole number of
    ``codec.block`` values (pad it so). With ``error_feedback`` the two roundings'
    residuals carry into the next call (:meth:`state_dict`). Launch with :meth:`start`
    (a :data:`~.collectives.Pending`), every rank in the same order, one call in flight.
    """

    collectives = 2
    """Collectives per launch (for counters)."""
    prescale = False
    """Nothing is divided before the exchange (the owner divides the fp32 sum)."""

    def __init__(self, comm: Comm, buf: torch.Tensor, codec: BlockQuant, error_feedback: bool = False):
        world = comm.world
        if buf.dtype != torch.float32 or buf.dim() != 1 or buf.numel() % (world * codec.block):
            raise ValueError(f"a quantized mean needs a flat fp32 buffer of a multiple of {world} x "
                             f"{codec.block} elements; got {tuple(buf.shape)} x {buf.dtype}")
        self.comm, self.buf, self.codec, self.world, self.rank = comm, buf, codec, world, comm.rank
        self.group = comm.group
        self.m = buf.numel() // world
        self.rows = buf.view(world, self.m)
        self.row_bytes = codec.row_bytes(self.m)
        self.residual = torch.zeros_like(buf) if error_feedback else None
        self.mean_residual = torch.zeros(self.m, dtype=torch.float32, device=buf.device) if error_feedback else None
        self.mean = torch.empty(self.m, dtype=torch.float32, device=buf.device)
        self.shm = comm.shm_of(buf)
        if self.shm is None:
            u8 = {"dtype": torch.uint8, "device": buf.device}
            self.send = torch.empty(world, self.row_bytes, **u8)
            self.recv = torch.empty(world, self.row_bytes, **u8)
            self.gathered = torch.empty(world * self.row_bytes, **u8)
            self.decoded = torch.empty(world, self.m, dtype=torch.float32, device=buf.device)

    def __repr__(self) -> str:
        return (f"QuantMean(world={self.world}, {self.codec.fmt} in blocks of {self.codec.block}, "
                f"{'shared memory' if self.shm is not None else 'exchange + all-gather'}"
                f"{', error feedback' if self.residual is not None else ''})")

    @property
    def wire_bytes(self) -> int:
        """The encoded buffer's bytes, every chunk's codes and scales: what an all-reduce
        of it would move (the measure ``ReducerStats.bytes_reduced`` counts every wire in)."""
        return self.world * self.row_bytes

    def start(self, pack: Callable[[], None] | None = None,
              unpack: Callable[[], None] | None = None) -> tuple[Any, Callable[[], None]]:
        """Fill ``buf`` (``pack``), encode it and launch the exchange: a
        :data:`~.collectives.Pending` whose ``then`` sums, encodes the mean, all-gathers
        it (waiting there) and runs ``unpack``: ``buf`` then holds the mean."""
        if pack is not None:
            with span("fastreduce::pack"):
                pack()
        with span("fastreduce::quantize"):
            if self.residual is not None:
                self.buf.add_(self.residual)
                self.residual.copy_(self.buf)
            if self.shm is not None:
                self.codec.decode(self.codec.encode(self.rows), out=self.rows)  # the round trip, in place
                if self.residual is not None:
                    self.residual.sub_(self.buf)
            else:
                self.codec.encode(self.rows, out=self.send)
                if self.residual is not None:
                    self.codec.decode(self.send, out=self.decoded)
                    self.residual.sub_(self.decoded.view(-1))
        with span("fastreduce::all_reduce"):
            if self.shm is not None:
                work, then = self.comm.reduce_scatter(self.buf, out=self.mean)
            else:
                work, then = self.comm.exchange(self.send, self.recv), None
        return work, lambda: self._finish(then, unpack)

    def _finish(self, then: Callable[[], None] | None, unpack: Callable[[], None] | None) -> None:
        """Once the exchange is done: the owner's sum and second encoding, the all-gather."""
        if then is not None:
            then()
        mine = self.rows[self.rank]
        if self.shm is None:
            self.codec.decode(self.recv, out=self.decoded)
            self.comm.sum_rows(self.decoded.view(-1), self.mean)
        if self.mean_residual is not None:
            self.mean.add_(self.mean_residual)
            self.mean_residual.copy_(self.mean)
        if self.shm is None:
            row = self.gathered.view(self.world, self.row_bytes)[self.rank]
            self.codec.encode(self.mean, out=row)
            self.codec.decode(row, out=mine)
        else:
            self.codec.decode(self.codec.encode(self.mean), out=mine)
        if self.mean_residual is not None:
            self.mean_residual.sub_(mine)
        work, _ = self.comm.all_gather(self.buf if self.shm is not None else self.gathered)
        wait_watched(work)
        if self.shm is None:
            self.codec.decode(self.gathered.view(self.world, self.row_bytes), out=self.rows)
        if unpack is not None:
            unpack()

    def state_dict(self) -> dict[str, torch.Tensor]:
        """The residuals (copies): this rank's and its chunk's of the mean; empty
        without error feedback."""
        if self.residual is None or self.mean_residual is None:
            return {}
        return {"residual": self.residual.clone(), "mean_residual": self.mean_residual.clone()}

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        """Restore :meth:`state_dict` (same world size and buffer); an empty dict resets."""
        if self.residual is None or self.mean_residual is None:
            return
        if not state:
            self.residual.zero_()
            self.mean_residual.zero_()
            return
        for key, mine in (("residual", self.residual), ("mean_residual", self.mean_residual)):
            saved = state.get(key)
            if not torch.is_tensor(saved):
                raise ValueError(f"not a quantized wire's state: no tensor {key!r}")
            if saved.shape != mine.shape:
                raise ValueError(f"quantized wire state {key!r} holds {tuple(saved.shape)} values, this "
                                 f"reducer {tuple(mine.shape)}: resume on the same world size and model")
        self.residual.copy_(state["residual"])
        self.mean_residual.copy_(state["mean_residual"])
