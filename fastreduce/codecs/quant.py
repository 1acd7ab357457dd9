"""Block quantization: fp8 (e4m3, e5m2), int8 and int4 values with one fp32 scale per block.

A row of ``m`` values (``m`` a multiple of the block) encodes to ``m x bits / 8`` bytes
of codes followed by ``m / block`` fp32 scales, one ``uint8`` row: every chunk a rank
sends is self-contained, so an exchange (all-to-all) or an all-gather carries rows as
they are, on transports that have no fp8 (Gloo, shared memory) as well as on those that do.

Per block, with ``a`` the block's largest ``|x|``:

* ``fp8_e4m3`` / ``fp8_e5m2``: the scale is the power of two ``2^e`` of
  ``frexp(a / max)`` (``max`` = 448 / 57344), so ``x / scale`` is exact and at most
  ``max`` in magnitude; the code is that value rounded to the format (to nearest, ties
  to even; clamped to ``±max`` first, since casts of larger values saturate on some
  devices and give NaN or inf on others). Decoding multiplies back: exact.
* ``int8`` / ``int4``: symmetric, the scale is ``a / q`` (``q`` = 127 / 7, computed in
  fp32), the code ``round(x / scale)`` (ties to even) clamped to ``[-q, q]``; int4
  packs two codes a byte, the even element in the low nibble. An all-zero block has
  scale 1 and zero codes.

Non-finite values stay non-finite: a block holding NaN or inf decodes to NaN, so the
non-finite checks after a reduction still see it. Everything is one vectorized op per
step over all blocks of all rows (on CPU: of a piece of :data:`_PIECE` values of every
row at a time, so that the temporaries stay in cache); nothing loops over blocks.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = ["FORMATS", "BlockQuant", "check_wire", "divisor", "wire_format"]

FORMATS = ("fp8_e4m3", "fp8_e5m2", "int8", "int4")
_FP8 = {"fp8_e4m3": "float8_e4m3fn", "fp8_e5m2": "float8_e5m2"}
_INT_MAX = {"int8": 127, "int4": 7}
_BITS = {"fp8_e4m3": 8, "fp8_e5m2": 8, "int8": 8, "int4": 4}
_PIECE = 1 << 18
"""Values per piece of a row on CPU (a multiple of the block): see :meth:`BlockQuant._pieces`."""
_ALIASES = {"float8_e4m3fn": "fp8_e4m3", "float8_e5m2": "fp8_e5m2", "e4m3": "fp8_e4m3", "e5m2": "fp8_e5m2"}


def divisor(n: float, like: torch.Tensor) -> torch.Tensor:
    """``n`` as a 0-d tensor of ``like``'s dtype and device: ``x / divisor(n, x)`` is ``x / n``
    correctly rounded on every device. CUDA divides by a Python number as a product with its
    reciprocal (one bit off at times: an int8 scale ``a / 127`` then differs from the CPU's,
    and so does every value decoded with it), and the codecs and means here are defined bit
    for bit, the same on CPU and CUDA ranks. A fill, not a copy from the host: it can be
    recorded in a CUDA graph."""
    return torch.full((), n, dtype=like.dtype, device=like.device)


def wire_format(wire: object) -> str | None:
    """The quantized format a ``wire_dtype`` names (``torch.float8_e4m3fn``,
    ``torch.float8_e5m2``, ``"int8"``, ``"int4"``, or a format name), else ``None``."""
    if isinstance(wire, torch.dtype):  # the fp8 dtypes only: torch.int8 is no wire (the string "int8" is)
        name = str(wire).removeprefix("torch.")
        return _ALIASES.get(name) if name in _FP8.values() else None
    if isinstance(wire, str):
        name = wire
    else:
        return None
    name = _ALIASES.get(name, name)
    return name if name in FORMATS else None


def check_wire(wire: object, mode: str, *, int4: bool = False, compression: object = None,
               error_feedback: bool | None = None) -> BlockQuant | None:
    """A mode's ``wire_dtype`` checked, the one check every mode calls: the codec of a
    quantized wire, ``None`` for a float dtype or ``None``; ``ValueError`` naming the
    problem for anything else. ``int4``: the mode takes int4 (the local-update modes'
    exchange); ``compression``: the mode's codec, which a quantized wire cannot join;
    ``error_feedback``: where the setting needs a quantized wire (``None``: not checked)."""
    fmt = wire_format(wire)
    formats = "torch.float8_e4m3fn, torch.float8_e5m2, 'int8'" + (", 'int4'" if int4 else "")
    if fmt is None:
        if wire is not None and not (isinstance(wire, torch.dtype) and wire.is_floating_point):
            raise ValueError(f"{mode}: wire_dtype must be a floating dtype, a quantized wire ({formats}) or None, "
                             f"got {wire!r}")
        if error_feedback:
            raise ValueError(f"{mode}: error_feedback=True needs a quantized wire_dtype ({formats}); "
                             f"wire_dtype={wire!r} sends the values as they are")
        return None
    if fmt == "int4" and not int4:
        raise ValueError(f"{mode}: wire_dtype='int4' is too coarse for every step's gradients; use 'int8' or an fp8 "
                         "dtype (int4 is the local-update modes' exchange)")
    codec = BlockQuant(fmt)  # this torch has the dtype
    if compression is not None:
        raise ValueError(f"{mode}: wire_dtype={wire!r} (a quantized wire) cannot be combined with compression=: "
                         "the codec sends its own format (PowerSGD's factors in bf16 or fp32, SparseLoCo's bits)")
    return codec


@dataclass(frozen=True)
class BlockQuant:
    """One quantized wire format with one fp32 scale per ``block`` values.

    Args:
        fmt: one of :data:`FORMATS`.
        block: values per scale (a multiple of 8, at least 8).
    """

    fmt: str
    block: int = 256

    def __post_init__(self) -> None:
        if self.fmt not in FORMATS:
            raise ValueError(f"unknown quantized format {self.fmt!r}; the formats are {', '.join(FORMATS)}")
        if isinstance(self.block, bool) or not isinstance(self.block, int) or self.block < 8 or self.block % 8:
            raise ValueError(f"the quantization block must be a multiple of 8, at least 8; got {self.block!r}")

    @property
    def bits(self) -> int:
        """Bits per value (the scales aside)."""
        return _BITS[self.fmt]

    def row_bytes(self, m: int) -> int:
        """Bytes one encoded row of ``m`` values takes: codes, then scales."""
        self._check_len(m)
        return m * self.bits // 8 + 4 * (m // self.block)

    def bytes_per_value(self) -> float:
        """Wire bytes per value, the scales included."""
        return self.bits / 8 + 4 / self.block

    def _check_len(self, m: int) -> None:
        if m % self.block:
            raise ValueError(f"a quantized row must hold a multiple of the block ({self.block}) values; got {m}")

    def _split(self, out: torch.Tensor, m: int) -> tuple[torch.Tensor, torch.Tensor]:
        """``out`` (rows, row_bytes) uint8 as (codes, fp32 scales) views."""
        code_bytes = m * self.bits // 8
        return out[:, :code_bytes], out[:, code_bytes:].view(torch.float32)

    def _pieces(self, x: torch.Tensor, m: int) -> range:
        """Where each piece of a row starts: the whole row on a device; on CPU
        pieces of :data:`_PIECE` values, whose temporaries stay in cache and in the
        allocator's heap (a temporary as long as a whole bucket is fresh memory, page
        faults included, at every call)."""
        step = m if x.device.type != "cpu" else max(self.block, _PIECE // self.block * self.block)
        return range(0, m, step)

    def encode(self, x: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """Encode ``x`` (rows x m fp32, or 1-D: one row) into ``out`` (rows x
        :meth:`row_bytes` uint8, allocated when ``None``); return ``out``."""
        x2 = x.reshape(1, -1) if x.dim() == 1 else x
        rows, m = x2.shape
        row_bytes = self.row_bytes(m)
        if out is None:
            out = torch.empty(rows, row_bytes, dtype=torch.uint8, device=x.device)
        codes, scales = self._split(out.view(rows, row_bytes), m)
        starts = self._pieces(x2, m)
        for a in starts:
            b = min(a + starts.step, m)
            self._encode(x2[:, a:b], codes[:, a * self.bits // 8:b * self.bits // 8],
                         scales[:, a // self.block:b // self.block])
        return out

    def _encode(self, x2: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor) -> None:
        rows, m = x2.shape
        blocks = x2.reshape(rows, m // self.block, self.block).float()
        amax = blocks.abs().amax(-1)
        if self.fmt in _FP8:
            dtype = getattr(torch, _FP8[self.fmt])
            top = torch.finfo(dtype).max
            scale = torch.ldexp(torch.ones_like(amax), torch.frexp(amax / divisor(top, amax)).exponent)
            scale = torch.where(torch.isfinite(amax), scale, amax)  # inf/NaN blocks: a non-finite scale
            q = (blocks / scale.unsqueeze(-1)).clamp_(-top, top).to(dtype).view(torch.uint8)
            codes.copy_(q.view(rows, m))
        else:
            top = _INT_MAX[self.fmt]
            scale = amax / divisor(top, amax)
            scale = torch.where(scale == 0, torch.ones_like(scale), scale)
            q = torch.round(blocks / scale.unsqueeze(-1)).clamp_(-top, top).to(torch.int8).view(rows, m)
            if self.fmt == "int8":
                codes.copy_(q.view(torch.uint8))
            else:
                nib = q.view(torch.uint8) & 0x0F
                codes.copy_(nib[:, 0::2] | (nib[:, 1::2] << 4))
        scales.copy_(scale)

    def decode(self, payload: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """Decode ``payload`` (rows x row_bytes uint8, or 1-D: one row) into ``out``
        (rows x m fp32, allocated when ``None``); return ``out``."""
        p2 = payload.reshape(1, -1) if payload.dim() == 1 else payload
        rows, row_bytes = p2.shape
        m = row_bytes * 8 * self.block // (self.bits * self.block + 32)
        if self.row_bytes(m) != row_bytes:
            raise ValueError(f"{row_bytes} bytes is no encoded row of {self.fmt} in blocks of {self.block}")
        codes, scales = self._split(p2, m)
        if out is None:
            out = torch.empty(rows, m, dtype=torch.float32, device=payload.device)
        out2 = out.view(rows, m)
        starts = self._pieces(p2, m)
        for a in starts:
            b = min(a + starts.step, m)
            self._decode(codes[:, a * self.bits // 8:b * self.bits // 8], scales[:, a // self.block:b // self.block],
                         out2[:, a:b])
        return out.view(-1) if payload.dim() == 1 else out

    def _decode(self, codes: torch.Tensor, scales: torch.Tensor, out: torch.Tensor) -> None:
        rows = out.shape[0]
        blocks = out.view(rows, -1, self.block)
        if self.fmt == "fp8_e4m3" and out.device.type == "cpu":
            self._decode_e4m3_cpu(codes.contiguous(), scales, blocks)
            return
        if self.fmt in _FP8:
            blocks.copy_(codes.contiguous().view(getattr(torch, _FP8[self.fmt])).view(rows, -1, self.block))
        elif self.fmt == "int8":
            blocks.copy_(codes.contiguous().view(torch.int8).view(rows, -1, self.block))
        else:
            signed = codes.to(torch.int16)
            lo, hi = ((signed & 0x0F) ^ 8) - 8, ((signed >> 4) ^ 8) - 8
            blocks.copy_(torch.stack((lo, hi), -1).view(rows, -1, self.block))
        blocks.mul_(scales.unsqueeze(-1))

    @staticmethod
    def _decode_e4m3_cpu(codes: torch.Tensor, scales: torch.Tensor, blocks: torch.Tensor) -> None:
        """fp8 e4m3 ``codes`` into ``blocks`` (rows x blocks x block) on CPU, where torch
        casts e4m3fn to fp32 one value at a time (about 9 ns each; e5m2 and fp16 convert
        vectorized): a code's 7 low bits shifted into a float16's exponent and mantissa are
        its value / 2^8 exactly, subnormals included. Sign-extended to 16 bits and shifted
        by 7, the code has its sign in bits 15 and 14: clearing bit 14 leaves that float16."""
        half = (codes.view(torch.int8).to(torch.int16) << 7) & -16385
        blocks.copy_(half.view(torch.float16).view(blocks.shape))
        # x 2^8 folded into the scales where that is exact (powers of two below 2^120)
        exact = bool((scales < 2.0**120).all())
        blocks.mul_((scales * 256.0 if exact else scales).unsqueeze(-1))
        if not exact:
            blocks.mul_(256.0)
        low = codes & 0x7F  # S.1111.111 is NaN: the largest low 7 bits (a max is vectorized, == is not)
        if codes.numel() and int(low.max()) == 0x7F:
            blocks.masked_fill_((low == 0x7F).view(blocks.shape), float("nan"))

    def roundtrip(self, x: torch.Tensor) -> torch.Tensor:
        """``decode(encode(x))``, shaped as ``x``: what a receiver sees."""
        return self.decode(self.encode(x)).view_as(x)
