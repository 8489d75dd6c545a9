"""Dense bit packing of b-bit integer weights (b = 2..8) into int32 words.

Layout (the one compressed-tensors' "pack-quantized" format uses, so exports need no repacking):
each row is one bit stream; element j of the row occupies bits [j*b, (j+1)*b) of the stream, least
significant bit first; the stream is cut into 32-bit words (word k holds stream bits [32k, 32k + 32)), so
an element may straddle two words. No bits are wasted: a row of n elements takes ceil(n*b/32) words
(4 bits: 8 per word; 3 bits: 32 elements in exactly 3 words; 8 bits: 4 per word). The stored values are
the unsigned levels q in [0, 2^b - 1]; compressed-tensors' signed convention (q - 2^(b-1)) differs only by
that constant offset, applied at export.

Packing along dim 0 (the zero points of compressed-tensors) is packing of the transpose.

The planar layout (`pack_planar`) is what a PackedLinear holds in memory and what the GPU kernels read.
A b-bit level is split into power-of-two bit planes (b = 3: a 2-bit plane of the low bits and a 1-bit
plane of the high bit; 5 = 4 + 1, 6 = 4 + 2, 7 = 4 + 2 + 1); each plane is packed as above, with no
element straddling a word (2, 4 and 8 bits are a single plane, so for them the planar layout IS the
compressed-tensors stream, word for word). The planes of a row follow each other: [plane 0 | plane 1 | ...].
A kernel loads a [BLOCK_N, BLOCK_K * p / 32] word tile per plane once and unpacks it with shifts, for any
b, with no cross-word handling. Storage is the same b bits per element (plus at most one partly filled
word per plane and row).
"""

from __future__ import annotations

import math

import torch

from lrq.errors import UserError

_MASK32 = (1 << 32) - 1


def _check(bits: int) -> None:
    if not isinstance(bits, int) or not 2 <= bits <= 8:
        raise UserError(f"cannot pack {bits!r}-bit integers: packing supports 2 to 8 bits.")


def packed_words(n: int, bits: int) -> int:
    return math.ceil(n * bits / 32)


def _positions(n: int, bits: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    start = torch.arange(n, device=device, dtype=torch.int64) * bits
    return start // 32, start % 32   # word index, bit offset within it


def _levels(q: torch.Tensor, bits: int, who: str) -> torch.Tensor:
    """q as int64, checked: 2-D, every value in [0, 2^b)."""
    _check(bits)
    if q.dim() != 2:
        raise ValueError(f"{who} expects a 2-D tensor, got shape {tuple(q.shape)}")
    v = q.to(torch.int64)
    if v.numel() and (v.min() < 0 or v.max() >= 1 << bits):
        raise ValueError(f"values outside [0, {(1 << bits) - 1}] cannot be packed into {bits} bits")
    return v


def pack_bits(q: torch.Tensor, bits: int) -> torch.Tensor:
    """[rows, n] unsigned levels (any integer dtype, values in [0, 2^b)) -> [rows, ceil(n*b/32)] int32."""
    return _pack(_levels(q, bits, "pack_bits"), bits)


def _pack(v: torch.Tensor, bits: int) -> torch.Tensor:
    rows, n = v.shape
    n_words = packed_words(n, bits)
    word, off = _positions(n, bits, v.device)
    acc = torch.zeros(rows, n_words + 1, dtype=torch.int64, device=v.device)   # +1: spill of the last element
    acc.index_add_(1, word, (v << off) & _MASK32)
    acc.index_add_(1, word + 1, v >> (32 - off))          # the high part of straddling elements (0 otherwise)
    acc = acc[:, :n_words]
    return torch.where(acc >= 1 << 31, acc - (1 << 32), acc).to(torch.int32)   # reinterpret as signed 32-bit


def plane_bits(bits: int) -> tuple[int, ...]:
    """The bit planes, low bits first, a b-bit level is stored in by the planar layout."""
    _check(bits)
    return (bits,) if bits in (2, 4, 8) else tuple(p for p in (4, 2, 1) if bits & p)


def planar_words(n: int, bits: int) -> int:
    """int32 words per row of n b-bit elements in the planar layout."""
    return sum(packed_words(n, p) for p in plane_bits(bits))


def plane_offsets(n: int, bits: int) -> tuple[int, int]:
    """Word offsets of planes 1 and 2 within a row (0 where the plane does not exist)."""
    p = plane_bits(bits) + (0, 0)
    w0, w1 = packed_words(n, p[0]), packed_words(n, p[1]) if p[1] else 0
    return (w0 if p[1] else 0), (w0 + w1 if p[2] else 0)


def pack_planar(q: torch.Tensor, bits: int) -> torch.Tensor:
    """[rows, n] levels -> [rows, planar_words(n, bits)] int32, planes concatenated along each row."""
    v = _levels(q, bits, "pack_planar")
    out, shift = [], 0
    for p in plane_bits(bits):
        out.append(_pack((v >> shift) & ((1 << p) - 1), p))
        shift += p
    return out[0] if len(out) == 1 else torch.cat(out, dim=1)


def unpack_planar(packed: torch.Tensor, bits: int, n: int) -> torch.Tensor:
    """Inverse of pack_planar: [rows, words] int32 -> [rows, n] uint8 levels."""
    planes = plane_bits(bits)
    if len(planes) == 1:
        return unpack_bits(packed, bits, n)
    if packed.dtype != torch.int32 or packed.dim() != 2 or packed.shape[1] != planar_words(n, bits):
        raise ValueError(f"a {tuple(packed.shape)} {packed.dtype} tensor is not the planar layout of {n} "
                         f"{bits}-bit values ({planar_words(n, bits)} int32 words per row expected)")
    q = torch.zeros(packed.shape[0], n, dtype=torch.uint8, device=packed.device)
    start = shift = 0
    for p in planes:
        w = packed_words(n, p)
        q |= _unpack(packed[:, start:start + w].contiguous(), p, n) << shift
        start, shift = start + w, shift + p
    return q


def planar_to_stream(packed: torch.Tensor, bits: int, n: int) -> torch.Tensor:
    """The planar layout as compressed-tensors' dense stream (pack_bits); a no-op for 2, 4 and 8 bits."""
    return packed if len(plane_bits(bits)) == 1 else pack_bits(unpack_planar(packed, bits, n), bits)


def stream_to_planar(packed: torch.Tensor, bits: int, n: int) -> torch.Tensor:
    return packed if len(plane_bits(bits)) == 1 else pack_planar(unpack_bits(packed, bits, n), bits)


def unpack_bits(packed: torch.Tensor, bits: int, n: int) -> torch.Tensor:
    """Inverse of pack_bits: [rows, words] int32 -> [rows, n] uint8 levels."""
    _check(bits)
    return _unpack(packed, bits, n)


def _unpack(packed: torch.Tensor, bits: int, n: int) -> torch.Tensor:
    if packed.dtype != torch.int32 or packed.dim() != 2:
        raise ValueError(f"unpack_bits expects a 2-D int32 tensor, got {packed.dtype} {tuple(packed.shape)}")
    if packed.shape[1] != packed_words(n, bits):
        raise ValueError(f"{packed.shape[1]} words cannot hold {n} {bits}-bit values "
                         f"(expected {packed_words(n, bits)})")
    if 8 % bits == 0 and packed.is_contiguous():
        # no element straddles a byte: the little-endian bytes of the words are the stream itself
        per = 8 // bits
        b = packed.view(torch.uint8)                                   # [rows, 4 * words]
        if per == 1:
            return b[:, :n].clone()
        shifts = torch.arange(0, 8, bits, dtype=torch.uint8, device=packed.device)
        v = (b.unsqueeze(-1) >> shifts) & ((1 << bits) - 1)            # [rows, bytes, per]
        return v.reshape(packed.shape[0], -1)[:, :n]
    # 32 elements fill exactly `bits` words: work chunk by chunk with int32 arithmetic
    rows, words = packed.shape
    chunks = math.ceil(n / 32)
    w = torch.nn.functional.pad(packed, (0, chunks * bits - words)).view(rows, chunks, bits)
    out = torch.empty(rows, chunks, 32, dtype=torch.int32, device=packed.device)
    mask = (1 << bits) - 1
    for j in range(32):   # static positions: scalar shifts on [rows, chunks] slices (fast), no gathers
        k, o = divmod(j * bits, 32)
        v = (w[:, :, k] >> o) & ((1 << (32 - o)) - 1)   # logical shift of a signed int32
        if o + bits > 32:
            v = v | (w[:, :, k + 1] << (32 - o))
        out[:, :, j] = v & mask
    return out.reshape(rows, chunks * 32)[:, :n].to(torch.uint8)
