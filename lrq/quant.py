"""Quantizer primitives: pure functions on tensors, shared by every method, module and kernel.

Conventions (METHOD.md section 1 and 4):
- weights are quantized asymmetrically per output row, optionally in groups of `group_size` consecutive
  input columns; a ragged last group is narrower (576 = 4 x 128 + 64), never straddling two rows;
- stored integers are unsigned levels q in [0, 2^b - 1]; w_hat = (q - z) * s, z an integer per row/group.
  This is the same grid as METHOD.md's W_int = clamp(round(W/s), -z, 2^b-1-z), w_hat = W_int * s, with q = W_int + z;
- scales and zero points have shape [rows, n_groups] (n_groups = 1 for per-channel).
"""

from __future__ import annotations

import math

import torch

from lrq.errors import UserError

SCALE_EPS = 1e-8


def check_bits(bits: int) -> None:
    if not isinstance(bits, int) or not 2 <= bits <= 8:
        raise UserError(f"bit width {bits!r} is not supported: use an integer from 2 to 8.")


def n_groups(in_features: int, group_size: int | None) -> int:
    """Number of column groups per row; a ragged last group counts as one."""
    if group_size is None:
        return 1
    if group_size <= 0 or group_size > in_features:
        raise UserError(
            f"group size {group_size} does not fit a layer with {in_features} input columns: "
            f"use a group size from 1 to {in_features}, or per-channel quantization (no group size)."
        )
    return math.ceil(in_features / group_size)


def expand_groups(t: torch.Tensor, group_size: int | None, in_features: int) -> torch.Tensor:
    """Broadcast per-group parameters [rows, n_groups] to per-weight [rows, in_features]."""
    if group_size is None or t.shape[-1] == 1:
        return t.expand(*t.shape[:-1], in_features) if t.shape[-1] == 1 else t
    return t.repeat_interleave(group_size, dim=-1)[..., :in_features]


def _group_view(w: torch.Tensor, group_size: int | None, pad_value: float) -> torch.Tensor:
    """View a [rows, cols] matrix as [rows, n_groups, group_size], padding the ragged last group."""
    rows, cols = w.shape
    g = cols if group_size is None else group_size
    ng = n_groups(cols, group_size)
    pad = ng * g - cols
    if pad:
        w = torch.nn.functional.pad(w, (0, pad), value=pad_value)
    return w.reshape(rows, ng, g)


def group_min_max(w: torch.Tensor, group_size: int | None) -> tuple[torch.Tensor, torch.Tensor]:
    """Row/group minimum (clamped to <= 0) and maximum (clamped to >= 0), each [rows, n_groups]."""
    w = w.float()
    lo = _group_view(w, group_size, math.inf).amin(dim=-1).clamp(max=0)
    hi = _group_view(w, group_size, -math.inf).amax(dim=-1).clamp(min=0)
    return lo, hi


def qparams_from_range(lo: torch.Tensor, hi: torch.Tensor, bits: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Asymmetric scale and integer zero point covering [lo, hi] (lo <= 0 <= hi)."""
    qmax = 2**bits - 1
    scale = ((hi - lo) / qmax).clamp(min=SCALE_EPS)
    zero = torch.round(-lo / scale).clamp(0, qmax)
    return scale, zero


def minmax_qparams(w: torch.Tensor, bits: int, group_size: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Round-to-nearest quantization parameters from each row's (or group's) min/max."""
    check_bits(bits)
    lo, hi = group_min_max(w, group_size)
    return qparams_from_range(lo, hi, bits)


def quantize(w: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, bits: int,
             group_size: int | None = None) -> torch.Tensor:
    """Integer levels q = clamp(round(w / s) + z, 0, 2^b - 1) as uint8."""
    cols = w.shape[-1]
    s = expand_groups(scale, group_size, cols)
    z = expand_groups(zero, group_size, cols)
    q = torch.clamp(torch.round(w.float() / s) + z, 0, 2**bits - 1)
    return q.to(torch.uint8)


def dequantize(q: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor,
               group_size: int | None = None, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """w_hat = (q - z) * s, computed in `dtype` (float32 by default)."""
    cols = q.shape[-1]
    return ((q.to(dtype) - expand_groups(zero.to(dtype), group_size, cols))
            * expand_groups(scale.to(dtype), group_size, cols))


def fake_quant(w: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, bits: int,
               group_size: int | None = None) -> torch.Tensor:
    return dequantize(quantize(w, scale, zero, bits, group_size), scale, zero, group_size).to(w.dtype)


def round_ste(x: torch.Tensor) -> torch.Tensor:
    """Round forward, identity backward (straight-through estimator)."""
    return (torch.round(x) - x).detach() + x


def per_token_fake_quant(x: torch.Tensor, bits: int = 8) -> torch.Tensor:
    """Dynamic asymmetric fake quantization with one scale/zero per token (last dimension).

    scale = max((max(t) - min(t)) / (2^b - 1), 1e-8), z = clamp(round(-min(t) / scale), 0, 2^b - 1),
    as in the authors' code, with the range widened to include 0 (min <= 0 <= max). That changes nothing
    for mixed-sign tokens (every real activation row) and keeps one-signed or constant tokens on the grid
    instead of clamping them.
    """
    qmax = 2**bits - 1
    xf = x.float()
    lo = xf.amin(dim=-1, keepdim=True).clamp(max=0)
    hi = xf.amax(dim=-1, keepdim=True).clamp(min=0)
    scale = ((hi - lo) / qmax).clamp(min=SCALE_EPS).detach()
    zero = torch.round(-lo / scale).clamp(0, qmax).detach()
    q = torch.clamp(round_ste(xf / scale) + zero, 0, qmax)
    return ((q - zero) * scale).to(x.dtype)


def per_tensor_fake_quant(x: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, bits: int = 8) -> torch.Tensor:
    """Static asymmetric fake quantization with one (calibrated) scale and zero point for the whole tensor."""
    qmax = 2**bits - 1
    q = torch.clamp(round_ste(x.float() / scale) + zero, 0, qmax)
    return ((q - zero) * scale).to(x.dtype)


def weight_bits_per_element(bits: int, group_size: int | None, in_features: int,
                            scale_bits: int = 16, zero_bits: int | None = None) -> float:
    """Storage bits per weight including per-row/group fp16 scales and `bits`-wide zero points."""
    zero_bits = bits if zero_bits is None else zero_bits
    return bits + n_groups(in_features, group_size) * (scale_bits + zero_bits) / in_features


def search_qparams(w: torch.Tensor, bits: int, group_size: int | None = None, grid: int = 100,
                   norm: float = 2.4, chunk_elems: int = 2**24) -> tuple[torch.Tensor, torch.Tensor]:
    """Clipping search for per-row (or per-group) scale and zero point (METHOD.md section 3).

    For i = 1..grid the candidate width is (max - min) * i / grid with step delta = width / (2^b - 1);
    for every zero point zp in 0..2^b - 1 the range is [-zp * delta, width - zp * delta]. The score is
    sum |W - W_hat|^norm over the row (or group); the best (delta, zp) per row/group wins (first on ties).
    Vectorised over rows, zero points and columns; rows are processed in chunks to bound memory.
    """
    check_bits(bits)
    rows, cols = w.shape
    qmax = 2**bits - 1
    wg = _group_view(w.float(), group_size, math.nan)            # [rows, ng, g], NaN = padding
    ng, g = wg.shape[1], wg.shape[2]
    flat = wg.reshape(rows * ng, g)
    valid = ~torch.isnan(flat)
    flat = torch.nan_to_num(flat, nan=0.0)
    lo = torch.where(valid, flat, torch.full_like(flat, math.inf)).amin(-1).clamp(max=0)
    hi = torch.where(valid, flat, torch.full_like(flat, -math.inf)).amax(-1).clamp(min=0)
    zps = torch.arange(qmax + 1, dtype=torch.float32)            # [Z]
    best_err = torch.full((flat.shape[0],), math.inf)
    best_scale = torch.ones(flat.shape[0])
    best_zero = torch.zeros(flat.shape[0])
    step = max(1, chunk_elems // max(1, (qmax + 1) * g))
    for a in range(0, flat.shape[0], step):
        x = flat[a:a + step]                                     # [R, g]
        m = valid[a:a + step].unsqueeze(1)                       # [R, 1, g]
        width = (hi[a:a + step] - lo[a:a + step])                # [R]
        for i in range(1, grid + 1):
            delta = (width * i / grid / qmax).clamp(min=SCALE_EPS)[:, None, None]    # [R, 1, 1]
            q = torch.clamp(torch.round(x.unsqueeze(1) / delta) + zps[None, :, None], 0, qmax)
            err = ((q - zps[None, :, None]) * delta - x.unsqueeze(1)).abs().pow(norm)
            err = torch.where(m, err, 0).sum(-1)                                   # [R, Z]
            e, z = err.min(dim=1)
            better = e < best_err[a:a + step]
            best_err[a:a + step] = torch.where(better, e, best_err[a:a + step])
            best_scale[a:a + step] = torch.where(better, delta[:, 0, 0], best_scale[a:a + step])
            best_zero[a:a + step] = torch.where(better, z.float(), best_zero[a:a + step])
    return best_scale.reshape(rows, ng), best_zero.reshape(rows, ng)
