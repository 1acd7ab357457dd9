"""QuantMean: a flat fp32 buffer := the mean over ranks, through a quantized wire.

A quantized value is never summed in its own format (docs/design.md, "Compression"). With
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

from ..buffer import finite_residual
from ..codecs.quant import BlockQuant
from ..faults import wait_watched
from ..profiling import span

if TYPE_CHECKING:
    from .comm import Comm

__all__ = ["QuantMean", "QuantMeans", "QuantMix"]


PIECES = 8
"""At most this many pieces per launch on a process group (each row's columns cut alike)."""
PIECE_BYTES = 1 << 18
"""Encoded bytes per row and piece, at least (256 KiB): smaller buffers go whole."""


class _Piece:
    """Columns ``[a, b)`` of every chunk: encoded, exchanged, summed and gathered on its own."""

    def __init__(self, owner: QuantMean, a: int, b: int):
        self.q, self.a, self.b = owner, a, b
        world, codec, dev = owner.world, owner.codec, owner.buf.device
        self.row_bytes = codec.row_bytes(b - a)
        self.send = torch.empty(world, self.row_bytes, dtype=torch.uint8, device=dev)
        self.recv = torch.empty_like(self.send)
        self.gathered = torch.empty(world * self.row_bytes, dtype=torch.uint8, device=dev)
        self.decoded = torch.empty(world, b - a, dtype=torch.float32, device=dev)
        self.own = torch.empty(b - a, dtype=torch.float32, device=dev)  # this rank's encoded mean, decoded
        self.first: Any = None
        self.second: Any = None
        self.summed = False  # this launch's sum is done (and, unless scattering, its gather launched)

    def exchange(self) -> None:
        q, a, b = self.q, self.a, self.b
        self.summed = False
        with span("fastreduce::quantize"):
            q.codec.encode(q.rows[:, a:b], out=self.send)
            if q.residual is not None:
                q.codec.decode(self.send, out=self.decoded)
                finite_residual(q.residual.view(q.world, q.m)[:, a:b].sub_(self.decoded))
        with span("fastreduce::all_reduce"):
            self.first = q.comm.exchange(self.send, self.recv)

    def gather(self) -> None:
        q, a, b = self.q, self.a, self.b
        self.summed = True
        if self.first is not None:
            wait_watched(self.first)
            self.first = None
        mean = q.mean[a:b]
        with span("fastreduce::quantize"):
            q.codec.decode(self.recv, out=self.decoded)
            q.comm.sum_rows(self.decoded.view(-1), mean)
        if q.scatter:
            return
        with span("fastreduce::quantize"):
            res = None if q.mean_residual is None else q.mean_residual[a:b]
            if res is not None:
                mean.add_(res)
                res.copy_(mean)
            row = self.gathered.view(q.world, self.row_bytes)[q.rank]
            q.codec.encode(mean, out=row)
            if res is not None:
                finite_residual(res.sub_(q.codec.decode(row, out=self.own)))
        with span("fastreduce::all_gather"):
            self.second, _ = q.comm.all_gather(self.gathered)

    def decode(self) -> None:
        q = self.q
        wait_watched(self.second)
        self.second = None
        q.codec.decode(self.gathered.view(q.world, self.row_bytes), out=self.decoded)
        q.rows[:, self.a:self.b].copy_(self.decoded)


class QuantMean:
    """``buf`` := its mean over ``comm``'s ranks through ``codec``'s wire.

    ``buf`` is flat fp32 and splits into ``comm.world`` chunks of a whole number of
    ``codec.block`` values (pad it so). With ``error_feedback`` the two roundings'
    residuals carry into the next call (:meth:`state_dict`). On a process group the
    columns of the chunks are cut into pieces of at least ``piece_bytes`` encoded bytes
    a row (default :data:`PIECE_BYTES`, at most :data:`PIECES` pieces), each exchanged,
    summed and gathered on its own, so that one piece's sum and gather overlap the next
    one's exchange; the blocks and the result are the same whatever the pieces. Launch with :meth:`start`
    (a :data:`~.collectives.Pending`), every rank in the same order, one call in flight.
    """

    prescale = False
    """Nothing is divided before the exchange (the owner divides the fp32 sum)."""

    def __init__(self, comm: Comm, buf: torch.Tensor, codec: BlockQuant, error_feedback: bool = False,
                 piece_bytes: int | None = None, out: torch.Tensor | None = None,
                 gaps: torch.Tensor | None = None):
        world = comm.world
        if buf.dtype != torch.float32 or buf.dim() != 1 or buf.numel() % (world * codec.block):
            raise ValueError(f"a quantized mean needs a flat fp32 buffer of a multiple of {world} x "
                             f"{codec.block} elements; got {tuple(buf.shape)} x {buf.dtype}")
        self.comm, self.buf, self.codec, self.world, self.rank = comm, buf, codec, world, comm.rank
        self.gaps = gaps  # the elements no gradient lands in, zeroed at each start (FusedBuffer.gaps)
        self.m = buf.numel() // world
        self.rows = buf.view(world, self.m)
        self.row_bytes = codec.row_bytes(self.m)
        self.scatter = out is not None
        if out is not None and (out.shape != (self.m,) or out.dtype != torch.float32):
            raise ValueError(f"a quantized reduce-scatter's output must be {self.m} fp32 values, got "
                             f"{tuple(out.shape)} x {out.dtype}")
        self.residual = torch.zeros_like(buf) if error_feedback else None
        self.mean_residual = torch.zeros(self.m, dtype=torch.float32, device=buf.device) \
            if error_feedback and not self.scatter else None
        self.mean = torch.empty(self.m, dtype=torch.float32, device=buf.device) if out is None else out
        self.shm = comm.shm_of(buf)
        self.pieces: list[_Piece] = []
        if self.shm is None and self.m:  # pipelined: piece k's sum and gather overlap piece k+1's exchange
            blocks = self.m // codec.block
            count = max(1, min(PIECES, self.row_bytes // (piece_bytes or PIECE_BYTES), blocks))
            edges = [codec.block * (blocks * k // count) for k in range(count + 1)]
            self.pieces = [_Piece(self, a, b) for a, b in zip(edges, edges[1:])]

    def __repr__(self) -> str:
        return (f"QuantMean(world={self.world}, {self.codec.fmt} in blocks of {self.codec.block}, "
                f"{'shared memory' if self.shm is not None else 'exchange + all-gather'}"
                f"{', error feedback' if self.residual is not None else ''})")

    @property
    def wire_bytes(self) -> int:
        """The encoded buffer's bytes, every chunk's codes and scales: what an all-reduce
        of it would move (the measure ``ReducerStats.bytes_reduced`` counts every wire in)."""
        return self.world * self.row_bytes

    def start(self, pack: Callable[[], None] | None = None, unpack: Callable[[], None] | None = None,
              hold: bool = False) -> tuple[Any, Callable[[], None]]:
        """Fill ``buf`` (``pack``), encode it and launch the exchange: a
        :data:`~.collectives.Pending` whose ``then`` sums, encodes the mean, all-gathers
        it (waiting there) and runs ``unpack``: ``buf`` then holds the mean.

        The work returned is the first piece's exchange, for the caller to wait on (once:
        Gloo's point-to-point work takes one wait); with ``hold`` it is ``None`` and
        ``then`` waits for everything itself, so that :meth:`advance` may run before it.
        An empty buffer (a bucket of zero-size parameters, alone in their dtype) sends nothing."""
        if not self.m:
            return None, unpack
        if pack is not None:
            with span("fastreduce::pack"):
                pack()
        if self.gaps is not None:  # (a non-finite block of the last mean spread into them)
            self.buf.index_fill_(0, self.gaps, 0.0)
        if self.residual is not None:
            self.buf.add_(self.residual)
            self.residual.copy_(self.buf)
        if self.shm is not None:
            with span("fastreduce::quantize"):
                self.codec.decode(self.codec.encode(self.rows), out=self.rows)  # the round trip, in place
                if self.residual is not None:
                    finite_residual(self.residual.sub_(self.buf))
            with span("fastreduce::all_reduce"):
                work, then = self.comm.reduce_scatter(self.buf, out=self.mean)
            if hold:
                return None, lambda: self._finish_shm(then, unpack, work)
            return work, lambda: self._finish_shm(then, unpack)
        for piece in self.pieces:
            piece.exchange()
        if hold:
            return None, lambda: self._finish(unpack)
        first, self.pieces[0].first = self.pieces[0].first, None
        return first, lambda: self._finish(unpack)

    def advance(self) -> None:
        """Once the exchange is done, sum and launch the all-gather of every piece not yet
        gathered (a launch made with ``hold``; a no-op on shared memory, whose reduction
        is done in ``then``). The overlapped mode advances a bucket after launching the
        next, so one bucket's sum runs while the next one's exchange is on the wire."""
        for piece in self.pieces:
            if not piece.summed:
                piece.gather()

    def _finish(self, unpack: Callable[[], None] | None) -> None:
        """Once piece k's exchange is done: its owner's sum and second encoding, its
        all-gather (launched while the later pieces are still on the wire); then decode."""
        self.advance()
        if not self.scatter:
            for piece in self.pieces:
                piece.decode()
        if unpack is not None:
            unpack()

    def _finish_shm(self, then: Callable[[], None] | None, unpack: Callable[[], None] | None,
                    work: Any = None) -> None:
        if work is not None:
            wait_watched(work)
        if then is not None:
            then()
        if self.scatter:
            if unpack is not None:
                unpack()
            return
        mine = self.rows[self.rank]
        if self.mean_residual is not None:
            self.mean.add_(self.mean_residual)
            self.mean_residual.copy_(self.mean)
        self.codec.decode(self.codec.encode(self.mean), out=mine)
        if self.mean_residual is not None:
            finite_residual(self.mean_residual.sub_(mine))
        work, _ = self.comm.all_gather(self.buf)
        wait_watched(work)
        if unpack is not None:
            unpack()

    def _residuals(self) -> dict[str, torch.Tensor]:
        out = {} if self.residual is None else {"residual": self.residual}
        if self.mean_residual is not None:
            out["mean_residual"] = self.mean_residual
        return out

    def state_dict(self) -> dict[str, torch.Tensor]:
        """The residuals (copies): this rank's and (unless it scatters) its chunk's of the
        mean; empty without error feedback."""
        return {key: t.clone() for key, t in self._residuals().items()}

    def state_tensors(self) -> list[torch.Tensor]:
        """The residuals themselves (what a step changes and :meth:`state_dict` copies)."""
        return list(self._residuals().values())

    def check_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        """``ValueError`` where :meth:`load_state_dict` would refuse ``state``; nothing changes."""
        if not state:
            return
        for key, t in self._residuals().items():
            saved = state.get(key)
            if not torch.is_tensor(saved):
                raise ValueError(f"not a quantized wire's state: no tensor {key!r}")
            if saved.shape != t.shape:
                raise ValueError(f"quantized wire state {key!r} holds {tuple(saved.shape)} values, this "
                                 f"reducer {tuple(t.shape)}: resume on the same world size and model")

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        """Restore :meth:`state_dict` (same world size and buffer), checked first; an empty
        dict resets."""
        self.check_state_dict(state)
        for key, t in self._residuals().items():
            if state:
                t.copy_(state[key])
            else:
                t.zero_()


class QuantMeans:
    """The overlapped mode's quantized wire: a :class:`QuantMean` per bucket, one state.

    Its :meth:`state_dict` holds every bucket's residuals end to end, in bucket order
    (the same keys as one :class:`QuantMean`'s), so a checkpoint resumes on the same
    world size, model and buckets."""

    prescale = False

    def __init__(self, means: list[QuantMean]):
        self.means = means

    def __getitem__(self, b: int) -> QuantMean:
        return self.means[b]

    def __repr__(self) -> str:
        return f"{len(self.means)} x {self.means[0]!r}"

    @property
    def wire_bytes(self) -> int:
        return sum(m.wire_bytes for m in self.means)

    @property
    def shm(self) -> Any:
        """The shared-memory segment the buckets live in (``None``: a process group)."""
        return self.means[0].shm

    def state_tensors(self) -> list[torch.Tensor]:
        return [t for m in self.means for t in m.state_tensors()]

    def state_dict(self) -> dict[str, torch.Tensor]:
        """Each residual of every bucket, one after the other, and (``<key>.buckets``) how
        many of its values each bucket holds."""
        states = [m.state_dict() for m in self.means]
        return {k: v for key in states[0] for k, v in (
            (key, torch.cat([s[key] for s in states])),
            (f"{key}.buckets", torch.tensor([s[key].numel() for s in states], dtype=torch.int64)))}

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        """Put :meth:`state_dict` back; checked first (``ValueError``, nothing changed): saved
        in other buckets (another ``bucket_mb``), even as many values in all would hold other
        elements' residuals (each rank's chunk of each bucket)."""
        keys = list(self.means[0]._residuals())
        if not state or not keys:
            for m in self.means:
                m.load_state_dict({})
            return
        for key in keys:
            saved, sizes = state.get(key), state.get(f"{key}.buckets")  # (sizes: none in a state saved before)
            if not torch.is_tensor(saved):
                raise ValueError(f"not a quantized wire's state: no tensor {key!r}")
            mine = [m._residuals()[key].numel() for m in self.means]
            if saved.shape != (sum(mine),) or sizes is not None and sizes.tolist() != mine:
                held = tuple(saved.shape) if sizes is None else f"{tuple(saved.shape)} in buckets of {sizes.tolist()}"
                raise ValueError(f"quantized wire state {key!r} holds {held} values, this reducer ({len(mine)} "
                                 f"buckets) {sum(mine)} in buckets of {mine}: resume on the same world size, "
                                 "model and bucket_mb")
        for key in keys:
            parts = state[key].split([m._residuals()[key].numel() for m in self.means])
            for m, part in zip(self.means, parts):
                m._residuals()[key].copy_(part)


class QuantMix:
    """Gossip mixing through a quantized wire, with CHOCO-SGD's error compensation
    (Koloskova et al., 2019), per edge of a time-varying topology.

    For every directed edge ``a -> b`` that some round's matrix uses, ``a`` and ``b`` both
    keep the same fp32 *public copy* ``c[a->b]`` of ``a``'s parameters (zeros at first).
    In a round with mixing matrix ``W``, each rank ``r`` with parameters ``x``::

        for each peer p it sends to (W[p, r] != 0):   d = Q(x - c[r->p]);  c[r->p] += d;  send d
        for each peer q it hears from (W[r, q] != 0):  c[q->r] += the d received
        out = x + gamma (sum_q W[r, q] c[q->r] - sum_p W[p, r] c[r->p])

    Summed over ranks the two sums cancel edge by edge (each copy is added at its
    receiver and subtracted at its sender with the same weight), so the mean of the
    parameters is kept exactly, up to fp32 rounding, whatever ``Q`` rounds away; and as
    the copies approach the parameters ``out`` approaches the exact mix
    ``(1 - gamma) x + gamma sum_j W[r, j] x_j`` (with ``gamma = 1``, the mix itself). ``Q``
    quantizes a difference that shrinks as the ranks agree, so its error shrinks with it
    and consensus is reached; sending ``Q(x)`` itself (``compensate=False``, for
    comparison only) leaves an error of the parameters' own size, and consensus stalls
    there. Memory: one copy of the bucket per peer a rank sends to or hears from over
    the topology's period (2 log2(W) for ``one-peer-exp``).

    The encoded differences travel point to point over the process group (on one host
    too: the shared-memory transport has no place for per-edge messages), as ``uint8``.
    """

    def __init__(self, comm: Comm, numel: int, codec: BlockQuant, device: torch.device,
                 compensate: bool = True, gamma: float = 1.0):
        self.comm, self.codec, self.numel, self.device = comm, codec, numel, device
        self.compensate, self.gamma = compensate, gamma
        self.padded = -(-numel // codec.block) * codec.block
        self.nbytes = codec.row_bytes(self.padded)
        # Gloo moves host memory only: device tensors' codes are staged there.
        self.host = torch.device("cpu") if comm.pg_backend == "gloo" and device.type != "cpu" else None
        self.copies: dict[tuple[int, int], torch.Tensor] = {}  # (sender, receiver) -> public copy, padded
        self.diff = torch.zeros(self.padded, dtype=torch.float32, device=device)
        self.step = torch.empty(self.padded, dtype=torch.float32, device=device)
        self.sent: dict[int, torch.Tensor] = {}
        self.got: dict[int, torch.Tensor] = {}

    @property
    def wire_bytes(self) -> int:
        """Bytes of one encoded message (codes and scales)."""
        return self.nbytes

    def _copy(self, a: int, b: int) -> torch.Tensor:
        c = self.copies.get((a, b))
        if c is None:
            c = self.copies[(a, b)] = torch.zeros(self.padded, dtype=torch.float32, device=self.device)
        return c

    def _bytes(self, table: dict[int, torch.Tensor], j: int) -> torch.Tensor:
        t = table.get(j)
        if t is None:
            t = table[j] = torch.empty(self.nbytes, dtype=torch.uint8, device=self.host or self.device)
        return t

    def start(self, x: torch.Tensor, out: torch.Tensor, row: list[float], col: list[float]) -> tuple[Any, Any]:
        """Encode and send this round's differences, launch the receives: a
        :data:`~.collectives.Pending` whose ``then`` writes the mix into ``out`` (``x``
        must not change until then). ``row``/``col``: this rank's row and column of the
        round's matrix."""
        r, codec, n = self.comm.rank, self.codec, self.numel
        outs = [p for p, w in enumerate(col) if p != r and w != 0.0]
        ins = [q for q, w in enumerate(row) if q != r and w != 0.0]
        sends = {}
        with span("fastreduce::quantize"):
            for p in outs:
                c = self._copy(r, p) if self.compensate else None
                if c is None:
                    self.diff[:n].copy_(x)
                else:
                    torch.sub(x, c[:n], out=self.diff[:n])
                code = self._bytes(self.sent, p)
                if self.host is None:
                    codec.encode(self.diff.view(1, -1), out=code.view(1, -1))
                else:
                    code.copy_(codec.encode(self.diff.view(1, -1)).view(-1))
                if c is not None:
                    c.add_(codec.decode(code.view(1, -1).to(self.device), out=self.step.view(1, -1)).view(-1))
                sends[p] = code
        with span("fastreduce::mix"):
            work = self.comm.send_recv(sends, {q: self._bytes(self.got, q) for q in ins})

        def then() -> None:
            with span("fastreduce::quantize"):
                # out := x, then each term added as it is decoded; the first term is added
                # straight from x (one pass, where a copy of x and a copy back made three)
                fresh = self.compensate  # out does not hold x yet
                if not self.compensate:
                    torch.mul(x, row[r], out=out)

                def add(t: torch.Tensor, alpha: float) -> None:
                    nonlocal fresh
                    if fresh:
                        torch.add(x, t, alpha=alpha, out=out)
                        fresh = False
                    else:
                        out.add_(t, alpha=alpha)

                for q in ins:
                    got = codec.decode(self.got[q].view(1, -1).to(self.device), out=self.step.view(1, -1)).view(-1)
                    if self.compensate:
                        c = self._copy(q, r)
                        c.add_(got)
                        add(c[:n], self.gamma * row[q])
                    else:
                        add(got[:n], row[q])
                if self.compensate:
                    for p in outs:
                        add(self._copy(r, p)[:n], -self.gamma * col[p])
                if fresh:
                    out.copy_(x)
        return work, then

    def state_dict(self) -> dict[str, torch.Tensor]:
        """The public copies, keyed ``"a->b"`` (copies)."""
        return {f"{a}->{b}": c.clone() for (a, b), c in sorted(self.copies.items())}

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        """Restore :meth:`state_dict` (same world size and bucket); checked first."""
        parsed = {}
        for key, t in state.items():
            a, _, b = key.partition("->")
            if not (a.isdigit() and b.isdigit()) or not torch.is_tensor(t) or t.shape != (self.padded,):
                raise ValueError(f"not this bucket's quantized gossip state: {key!r} (expected 'a->b': "
                                 f"{self.padded} values); resume on the same world size and model")
            parsed[(int(a), int(b))] = t
        self.copies = {k: t.to(self.device, torch.float32).clone() for k, t in parsed.items()}
