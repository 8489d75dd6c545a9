"""Integer GEMM for W8A8 (per-tensor static activations) and W4A8 (per-token dynamic activations).

Activations are quantized asymmetrically to levels xq in [0, 255] with a scale sx and zero point zx per
row (one pair for the whole tensor under static W8A8, one per token under W4A8), and shifted to int8:
xa = xq - 128. Weights are the packed levels q (planar layout) with per-row scale sw and zero point wz:

* 8-bit weights: wa = q - 128 (int8), and the zero points are corrected in the epilogue:
      sum_k (xq - zx)(q - wz) = sum xa*wa + (128 - wz) sum_k xa + (128 - zx) sum_k wa + K (128 - zx)(128 - wz)
* 2..7-bit weights: wa = q - wz already fits int8 (|q - wz| <= 127), unpacked from the packed words
  inside the GEMM, so
      sum_k (xq - zx)(q - wz) = sum xa*wa + (128 - zx) sum_k wa
  y = that * sx * sw (+ bias). int8 x int8 -> int32 accumulation (tensor cores on a GPU).

Two kernels: `_act_quant_kernel` quantizes the activations in one pass per row (range, scale, zero
point, int8 levels and their row sum sum_k xa); `_int8_gemm_kernel` is the GEMM with the epilogue,
computed transposed like the weight-only kernel (weights on the MMA's M side), with split K and float32
atomics at decode sizes. sum_k wa is a per-layer constant (`weight_sums`).
`quantize_activations` and `reference_int8_matmul` are the plain-torch definitions they must equal
(levels bit for bit: IEEE division and round-half-to-even as torch does).
Per-channel weights only (the schemes that quantize activations are per-channel).
"""

from __future__ import annotations

import torch

from lrq.kernels.common import (INTERPRET, Buckets, TileConfig, Tuner, check_activation, dtype_name, load_levels,
                                split_output, tl, triton)
from lrq.kernels.wq_gemm import _planes, check_layout
from lrq.packing import plane_offsets, unpack_planar

if triton is not None:
    from triton.language.extra import libdevice

INT8_BUCKETS = Buckets(
    bounds=(16, 64),
    configs=(
        (TileConfig(16, 64, 128, 4, 4), TileConfig(16, 128, 64, 4, 4)),      # decode: M <= 16, split K
        (TileConfig(32, 128, 64, 4, 4), TileConfig(64, 128, 128, 8, 3)),     # 16 < M <= 64
        (TileConfig(128, 128, 64, 8, 4), TileConfig(64, 256, 64, 8, 4)),     # M > 64
    ),
    names=("decode", "small", "large"),
)
ACT_QUANT_CONFIG = TileConfig(0, 0, 1024, 4, 1)
_TUNER = Tuner()


def quantize_activations(x2: torch.Tensor, static: tuple[torch.Tensor, torch.Tensor] | None
                         ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """x [M, K] -> (xa int8 [M, K], sx [M] fp32, zx [M] fp32); per token unless a static (scale, zero)."""
    xf = x2.float()
    if static is not None:
        sx = static[0].float().reshape(1).expand(xf.shape[0])
        zx = static[1].float().reshape(1).expand(xf.shape[0])
    else:
        lo = xf.amin(dim=1).clamp(max=0)
        hi = xf.amax(dim=1).clamp(min=0)
        sx = ((hi - lo) / 255).clamp(min=1e-8)
        zx = torch.round(-lo / sx).clamp(0, 255)
    xq = torch.clamp(torch.round(xf / sx[:, None]) + zx[:, None], 0, 255)
    return (xq - 128).to(torch.int8), sx.contiguous(), zx.contiguous()


def weight_sums(packed: torch.Tensor, zero: torch.Tensor, bits: int, k: int) -> torch.Tensor:
    """sum_k wa per output row (int32), a per-layer constant for the epilogue."""
    q = unpack_planar(packed, bits, k).to(torch.int32)
    wa = q - 128 if bits == 8 else q - zero[:, :1].to(torch.int32)
    return wa.sum(dim=1, dtype=torch.int32)


def reference_int8_matmul(x: torch.Tensor, packed: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, bits: int,
                          k: int, bias: torch.Tensor | None = None,
                          static: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
    shape = x.shape
    xa, sx, zx = quantize_activations(x.reshape(-1, shape[-1]), static)
    xd = (xa.double() + 128 - zx.double()[:, None]) * sx.double()[:, None]
    w = (unpack_planar(packed, bits, k).double() - zero[:, :1].double()) * scale[:, :1].double()
    y = xd @ w.t()
    if bias is not None:
        y = y + bias.double()
    return y.to(x.dtype).reshape(*shape[:-1], packed.shape[0])


if triton is not None:
    @triton.jit
    def _div(a, b, INTERPRET: tl.constexpr):
        """IEEE division as torch does it (Triton's `/` is approximate on a GPU; the interpreter's is numpy's)."""
        if INTERPRET:
            return a / b
        else:
            return tl.math.div_rn(a, b)

    @triton.jit
    def _rint(v, INTERPRET: tl.constexpr):
        """Round half to even (torch.round); the interpreter has no libdevice: 1.5 * 2^23 does it for |v| < 2^22."""
        if INTERPRET:
            return (v + 12582912.0) - 12582912.0
        else:
            return libdevice.rint(v)

    @triton.jit
    def _act_quant_kernel(x_ptr, xa_ptr, sx_ptr, zx_ptr, xsum_ptr, ss_ptr, sz_ptr, K, stride_xm, stride_am,
                          STATIC: tl.constexpr, INTERPRET: tl.constexpr, BLOCK_K: tl.constexpr):
        row = tl.program_id(0)
        x_row = x_ptr + row.to(tl.int64) * stride_xm
        if STATIC:
            sx = tl.load(ss_ptr).to(tl.float32)
            zx = tl.load(sz_ptr).to(tl.float32)
        else:
            lo = tl.zeros((BLOCK_K,), dtype=tl.float32)
            hi = tl.zeros((BLOCK_K,), dtype=tl.float32)
            for k0 in range(0, K, BLOCK_K):
                rk = k0 + tl.arange(0, BLOCK_K)
                v = tl.load(x_row + rk, mask=rk < K, other=0.0).to(tl.float32)
                lo = tl.minimum(lo, v)
                hi = tl.maximum(hi, v)
            lo = tl.min(lo, axis=0)          # <= 0: the range always includes 0
            hi = tl.max(hi, axis=0)
            sx = tl.maximum(_div(hi - lo, 255.0, INTERPRET), 1e-8)
            zx = tl.minimum(tl.maximum(_rint(_div(-lo, sx, INTERPRET), INTERPRET), 0.0), 255.0)
        acc = tl.zeros((BLOCK_K,), dtype=tl.int32)
        for k0 in range(0, K, BLOCK_K):
            rk = k0 + tl.arange(0, BLOCK_K)
            v = tl.load(x_row + rk, mask=rk < K, other=0.0).to(tl.float32)
            xq = tl.minimum(tl.maximum(_rint(_div(v, sx, INTERPRET), INTERPRET) + zx, 0.0), 255.0)
            xa = (xq - 128.0).to(tl.int32)
            tl.store(xa_ptr + row.to(tl.int64) * stride_am + rk, xa.to(tl.int8), mask=rk < K)
            acc += tl.where(rk < K, xa, 0)
        tl.store(sx_ptr + row, sx)
        tl.store(zx_ptr + row, zx)
        tl.store(xsum_ptr + row, tl.sum(acc, axis=0))

    @triton.jit
    def _int8_gemm_kernel(xa_ptr, sx_ptr, zx_ptr, xsum_ptr, w_ptr, sw_ptr, wz_ptr, wsum_ptr, b_ptr, y_ptr,
                          M, N, K, off1, off2, stride_xm, stride_wn, stride_sn, stride_ym, k_split,
                          P0: tl.constexpr, P1: tl.constexpr, P2: tl.constexpr, HAS_BIAS: tl.constexpr,
                          ATOMIC: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
        EIGHT: tl.constexpr = P0 == 8
        pid_n = tl.program_id(0)
        pid_m = tl.program_id(1)
        pid_k = tl.program_id(2)
        rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        n_ok = rn < N
        m_ok = rm < M
        wz = tl.load(wz_ptr + rn * stride_sn, mask=n_ok, other=0).to(tl.int32)
        acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.int32)
        k_lo = pid_k * k_split
        k_hi = tl.minimum(k_lo + k_split, K)
        for k0 in range(k_lo, k_hi, BLOCK_K):
            rk = k0 + tl.arange(0, BLOCK_K)
            xa = tl.load(xa_ptr + rm[:, None] * stride_xm + rk[None, :], mask=m_ok[:, None] & (rk[None, :] < K),
                         other=0)
            q = load_levels(w_ptr, rn, n_ok, stride_wn, K, k0, off1, off2, P0, P1, P2, BLOCK_K)
            if EIGHT:
                wa = (q - 128).to(tl.int8)
            else:
                wa = (q - wz[:, None]).to(tl.int8)
            acc += tl.dot(wa, tl.trans(xa), out_dtype=tl.int32)
        sx = tl.load(sx_ptr + rm, mask=m_ok, other=0.0)
        zx = tl.load(zx_ptr + rm, mask=m_ok, other=0.0)
        sw = tl.load(sw_ptr + rn * stride_sn, mask=n_ok, other=0.0).to(tl.float32)
        total = acc.to(tl.float32)
        if pid_k == 0:   # the terms that do not depend on the K range, once
            wsum = tl.load(wsum_ptr + rn, mask=n_ok, other=0).to(tl.float32)
            total += wsum[:, None] * (128.0 - zx)[None, :]
            if EIGHT:
                xsum = tl.load(xsum_ptr + rm, mask=m_ok, other=0).to(tl.float32)
                wzf = wz.to(tl.float32)
                total += (128.0 - wzf)[:, None] * xsum[None, :]
                total += K * (128.0 - wzf)[:, None] * (128.0 - zx)[None, :]
        y = total * sw[:, None] * sx[None, :]
        if HAS_BIAS:
            y += tl.load(b_ptr + rn, mask=n_ok & (pid_k == 0), other=0.0).to(tl.float32)[:, None]
        ptrs = y_ptr + rm[None, :] * stride_ym + rn[:, None]
        ok = n_ok[:, None] & m_ok[None, :]
        if ATOMIC:
            tl.atomic_add(ptrs, y, mask=ok, sem="relaxed")
        else:
            tl.store(ptrs, y.to(y_ptr.dtype.element_ty), mask=ok)


def compilations(m: int, n: int, k: int, bits: int, dtype: torch.dtype, static: bool, has_bias: bool = False,
                 sms: int = 132, tune: bool = True) -> list[tuple[str, TileConfig, dict]]:
    """The (kernel, configuration, constexprs) an int8_matmul call of this shape compiles on a GPU."""
    out = [("act_quant", ACT_QUANT_CONFIG, {"STATIC": static, "INTERPRET": False, "DT": dtype_name(dtype),
                                            "BLOCK_K": ACT_QUANT_CONFIG.block_k})]
    for c in INT8_BUCKETS.candidates(INT8_BUCKETS.bucket(m), tune):
        _, sk = INT8_BUCKETS.split(c, m, n, k, sms)
        out.append(("int8_gemm", c, {**_planes(bits), "HAS_BIAS": has_bias, "ATOMIC": sk > 1, "DT": "int8",
                                     **c.kwargs()}))
    return out


def quantize_activations_gpu(x2: torch.Tensor, static: tuple[torch.Tensor, torch.Tensor] | None
                             ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The kernel form of quantize_activations, plus sum_k xa per row (int32): one launch."""
    if triton is None or not (x2.is_cuda or INTERPRET):
        xa, sx, zx = quantize_activations(x2, static)
        return xa, sx, zx, xa.sum(dim=1, dtype=torch.int32)
    m, k = x2.shape
    xa = torch.empty(m, k, dtype=torch.int8, device=x2.device)
    sx = torch.empty(m, dtype=torch.float32, device=x2.device)
    zx = torch.empty_like(sx)
    xsum = torch.empty(m, dtype=torch.int32, device=x2.device)
    ss, sz = (static[0].float().reshape(1), static[1].float().reshape(1)) if static is not None else (sx, zx)
    c = ACT_QUANT_CONFIG
    if m:
        _act_quant_kernel[(m,)](x2, xa, sx, zx, xsum, ss, sz, k, x2.stride(0), xa.stride(0),
                                STATIC=static is not None, INTERPRET=INTERPRET, BLOCK_K=c.block_k,
                                **({} if INTERPRET else c.options()))
    return xa, sx, zx, xsum


def int8_matmul(x: torch.Tensor, packed: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, bits: int, k: int,
                bias: torch.Tensor | None = None, static: tuple[torch.Tensor, torch.Tensor] | None = None,
                wsum: torch.Tensor | None = None, *, config: TileConfig | None = None,
                split: int | None = None) -> torch.Tensor:
    if scale.shape[1] != 1:
        raise ValueError("the integer GEMM takes per-channel weights (one scale per row)")
    if triton is None or not (x.is_cuda or INTERPRET):
        return reference_int8_matmul(x, packed, scale, zero, bits, k, bias, static)
    x2 = check_activation(x, k)
    check_layout(packed, scale, zero, bits, None, k)
    m, n = x2.shape[0], packed.shape[0]
    if m == 0:
        return x.new_zeros(*x.shape[:-1], n)
    if wsum is None:
        wsum = weight_sums(packed, zero, bits, k)
    off1, off2 = plane_offsets(k, bits)
    bucket = INT8_BUCKETS.bucket(m)

    def launch(c: TileConfig) -> torch.Tensor:
        xa, sx, zx, xsum = quantize_activations_gpu(x2, static)
        k_split, atomic, y, grid = split_output(INT8_BUCKETS, c, m, n, k, x.device, x.dtype, split)
        _int8_gemm_kernel[grid](xa, sx, zx, xsum, packed, scale, zero, wsum, bias if bias is not None else scale, y,
                                m, n, k, off1, off2, xa.stride(0), packed.stride(0), scale.stride(0), y.stride(0),
                                k_split, **_planes(bits), HAS_BIAS=bias is not None, ATOMIC=atomic,
                                **c.kwargs(), **({} if INTERPRET else c.options()))
        return y.to(x.dtype) if atomic else y

    c = config or _TUNER.pick(("int8", bucket, n, k, bits, x.dtype, static is not None, bias is not None),
                              INT8_BUCKETS.candidates(bucket), launch)
    return launch(c).reshape(*x.shape[:-1], n)
