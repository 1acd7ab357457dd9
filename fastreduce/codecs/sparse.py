"""SparseLoCo: chunk-wise top-k of an error-feedback accumulator, few-bit values (Sarfi et al. 2025).

For the local-update modes' exchange (DiLoCo's pseudo-gradient ``anchor - x``), per rank
and per fragment::

    e := decay e + delta                 the accumulator (replaces DiLoCo's outer momentum)
    per chunk of ``chunk`` elements:     the k = density x chunk entries of largest |e|,
                                         each rounded to one of 2^bits levels evenly
                                         spread over [-s, s], s = the chunk's largest |kept|
    e := e - what was sent               error feedback: nothing is lost, only delayed
    all-gather (codes, indices, scales)  no dense collective; every rank then sums the
                                         ranks' sparse chunks in rank order and divides
                                         by the world size: the same mean on every rank

Per chunk a rank sends ``k bits / 8`` bytes of values, ``k`` indices (12 bits each for
chunks of up to 4096 elements, packed two into three bytes; else 16) and one fp32
scale: at the defaults (1/64, 2 bits, 4096) 116 bytes for 4096 values (16384 bytes in
fp32), 141x fewer, then once per ``sync_every`` inner steps.

Everything is vectorized over chunks (and ranks): a top-k, a gather, a scatter-add, a
few integer ops to pack; no Python loop over chunks.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import torch

from .quant import divisor

__all__ = ["SparseLoCo", "SparseState"]


@dataclass(frozen=True)
class SparseLoCo:
    """Sparse, few-bit pseudo-gradients as ``compression=`` of :class:`~fastreduce.DiLoCo`.

    Args:
        density: the share of each chunk sent (rounded to a multiple of 8 entries, at
            least 8): the paper uses 1-3 %.
        bits: bits per value sent (1, 2, 4 or 8).
        chunk: elements per chunk (at most 65536; up to 4096 the indices take 12 bits).
        decay: the accumulator's decay ``e := decay e + delta`` (the paper's beta).

    Use it with an outer SGD without momentum (the accumulator plays that part), e.g.
    ``torch.optim.SGD(params, lr=1.0)``.
    """

    density: float = 1 / 64
    bits: int = 2
    chunk: int = 4096
    decay: float = 0.95

    def __post_init__(self) -> None:
        if not isinstance(self.density, (int, float)) or not 0 < self.density <= 1:
            raise ValueError(f"SparseLoCo density must be in (0, 1], got {self.density!r}")
        if self.bits not in (1, 2, 4, 8):
            raise ValueError(f"SparseLoCo bits must be 1, 2, 4 or 8, got {self.bits!r}")
        if isinstance(self.chunk, bool) or not isinstance(self.chunk, int) or not 8 <= self.chunk <= 65536:
            raise ValueError(f"SparseLoCo chunk must be an integer in [8, 65536], got {self.chunk!r}")
        if not isinstance(self.decay, (int, float)) or not 0 <= self.decay <= 1:
            raise ValueError(f"SparseLoCo decay must be in [0, 1], got {self.decay!r}")

    @property
    def k(self) -> int:
        """Entries sent per chunk."""
        return min(self.chunk // 8 * 8, max(8, round(self.chunk * self.density / 8) * 8))

    def payload_bytes(self, numel: int) -> int:
        """Bytes one rank contributes for ``numel`` values."""
        chunks = -(-numel // self.chunk)
        return chunks * (self.k * self.bits // 8 + self.k * self._index_bits // 8 + 4)

    @property
    def _index_bits(self) -> int:
        return 12 if self.chunk <= 4096 else 16


class SparseState:
    """One fragment's SparseLoCo: its accumulator and its slice of the all-gather buffer.

    Args:
        config: the user's :class:`SparseLoCo`.
        numel: the fragment's values (its dense pseudo-gradient).
        alloc: ``alloc(numel, dtype)`` -> zeroed storage the collectives move (collective).
        world, rank: the group's.
    """

    def __init__(self, config: SparseLoCo, numel: int, device: torch.device,
                 alloc: Callable[[int, torch.dtype], torch.Tensor], world: int, rank: int):
        self.config, self.numel, self.world, self.rank = config, numel, world, rank
        c = config
        self.chunks = -(-numel // c.chunk)
        self.acc = torch.zeros(self.chunks * c.chunk, device=device)  # the error-feedback accumulator
        self.payload = c.payload_bytes(numel)
        self.gathered = alloc(world * self.payload, torch.uint8)  # every rank's payload, rank order
        self.mine = self.gathered[rank * self.payload:(rank + 1) * self.payload]
        self._dense = torch.zeros(self.chunks, c.chunk, device=device)
        k = c.k
        self._codes_n = self.chunks * k * c.bits // 8
        self._index_n = self.chunks * k * c._index_bits // 8
        self._shifts = torch.arange(0, 8, c.bits, device=device, dtype=torch.int32)

    # ------------------------------------------------------------------ encode

    @torch.no_grad()
    def encode(self, delta: torch.Tensor) -> None:
        """Accumulate ``delta`` (this fragment's pseudo-gradient, fp32, flat), take each
        chunk's top-k, quantize, subtract what is sent from the accumulator, and write
        this rank's payload into its slice of the gather buffer."""
        c, k = self.config, self.config.k
        acc = self.acc
        acc[:self.numel].mul_(c.decay).add_(delta)
        rows = acc.view(self.chunks, c.chunk)
        idx = rows.abs().topk(k, dim=1, sorted=False).indices
        idx = idx.sort(dim=1).values  # sorted: the payload is a function of the set, not of topk's order
        kept = rows.gather(1, idx)
        scale = kept.abs().amax(dim=1, keepdim=True).clamp_min(torch.finfo(torch.float32).tiny)
        codes = self._quantize(kept, scale)
        rows.scatter_add_(1, idx, -self._levels(codes, scale))  # error feedback
        acc[self.numel:].zero_()  # the last chunk's padding, if kept and sent, owes nothing
        self._pack(codes, idx, scale)

    def _quantize(self, values: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
        top = (1 << self.config.bits) - 1
        return ((values / scale + 1.0) * (top / 2)).round_().clamp_(0, top).to(torch.uint8)

    def _levels(self, codes: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
        """Code j of 2^bits levels: -s + j 2s / (2^bits - 1)."""
        top = (1 << self.config.bits) - 1
        return (codes.to(torch.float32) * (2.0 / top) - 1.0) * scale

    def _pack(self, codes: torch.Tensor, idx: torch.Tensor, scale: torch.Tensor) -> None:
        c = self.config
        out = self.mine
        per = 8 // c.bits
        packed = (codes.view(-1, per).to(torch.int32) << self._shifts).sum(dim=1)
        out[:self._codes_n].copy_(packed)
        at = self._codes_n
        if c._index_bits == 12:
            a, b = idx[:, 0::2].to(torch.int32), idx[:, 1::2].to(torch.int32)
            tri = torch.stack((a & 255, (a >> 8) | ((b & 15) << 4), b >> 4), dim=-1)
            out[at:at + self._index_n].copy_(tri.view(-1))
        else:  # two bytes, unsigned (chunks up to 65536)
            i = idx.to(torch.int32)
            out[at:at + self._index_n].copy_(torch.stack((i & 255, i >> 8), dim=-1).view(-1))
        at += self._index_n
        out[at:at + 4 * self.chunks].copy_(scale.view(-1).contiguous().view(torch.uint8))

    # ------------------------------------------------------------------ decode

    @torch.no_grad()
    def decode(self, out: torch.Tensor) -> None:
        """After the all-gather: ``out`` (flat, this fragment) := the mean over ranks of
        what each sent, summed in rank order (the same on every rank)."""
        c, k, w = self.config, self.config.k, self.world
        payloads = self.gathered.view(w, self.payload)
        packed = payloads[:, :self._codes_n].to(torch.int32)
        codes = ((packed.unsqueeze(-1) >> self._shifts) & ((1 << c.bits) - 1)).view(w, self.chunks, k)
        raw = payloads[:, self._codes_n:self._codes_n + self._index_n]
        if c._index_bits == 12:
            tri = raw.to(torch.int32).view(w, self.chunks, k // 2, 3)
            a = tri[..., 0] | ((tri[..., 1] & 15) << 8)
            b = (tri[..., 1] >> 4) | (tri[..., 2] << 4)
            idx = torch.stack((a, b), dim=-1).view(w, self.chunks, k)
        else:
            two = raw.to(torch.int32).view(w, self.chunks, k, 2)
            idx = two[..., 0] | (two[..., 1] << 8)
        at = self._codes_n + self._index_n
        scale = payloads[:, at:at + 4 * self.chunks].contiguous().view(torch.float32).view(w, self.chunks, 1)
        values = self._levels(codes, scale)  # w x chunks x k
        dense = self._dense.zero_()
        idx = idx.long()
        for r in range(w):  # a rank at a time: two ranks' indices may meet, and CUDA's scatter_add
            # adds the values meeting in one call in any order (replicas a rounding apart at 3 ranks);
            # one rank's indices are distinct, so each call adds one value per element
            dense.scatter_add_(1, idx[r], values[r])
        out.copy_(dense.view(-1)[:self.numel]).div_(divisor(w, out))

    # ------------------------------------------------------------------ checkpoint

    def state_dict(self) -> dict[str, Any]:
        return {"acc": self.acc[:self.numel].clone()}

    def state_tensors(self) -> list[torch.Tensor]:
        """The accumulator itself (what an encode changes and :meth:`state_dict` copies)."""
        return [self.acc]

    def fits(self, state: Any) -> bool:
        acc = state.get("acc") if isinstance(state, dict) else None
        return torch.is_tensor(acc) and acc.numel() == self.numel

    @torch.no_grad()
    def load_state_dict(self, state: dict[str, Any]) -> None:
        if not self.fits(state):
            raise ValueError(f"the SparseLoCo accumulator saved does not fit this fragment ({self.numel} values)")
        self.acc[:self.numel].copy_(state["acc"].reshape(-1))
