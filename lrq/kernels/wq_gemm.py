"""Weight-only GEMM for packed low-bit weights (W4A16, W3A16, any 2..8 bits; per channel or in groups).

    y[m, n] = sum_k x[m, k] * (q[n, k] - z[n, g(k)]) * s[n, g(k)]  (+ bias[n])

Weights are in the planar layout (lrq.packing.pack_planar: 2/4/8 bits are compressed-tensors' own
stream; 3 bits a 2-bit and a 1-bit plane, and so on), so no element straddles a word.

The fused kernel computes the transposed product, acc[BLOCK_N, BLOCK_M] = W_tile @ x_tile^T, so the
weights (many rows) fill the MMA's M side and the tokens (few at decode) its N side: M = 1 wastes no
tensor-core rows, and the dequantized weight tile is the register operand (wgmma's A on Hopper) with
no shared-memory round trip of its own. Per K step a program loads each packed word of its
[BLOCK_N, BLOCK_K * p / 32] tile once (lrq.kernels.common.load_levels), the tile's scale and zero point
once per row (when the tile lies in one group), and x's [BLOCK_M, BLOCK_K] tile; multiplies in the
activations' dtype (bf16/fp16) with float32 accumulation. Per channel, the integer (q - z) is exact in
bf16 and the scale is applied once in the epilogue; in groups, the weight is dequantized per tile.
At decode sizes (M <= 16) programs split K (`split_k`) and add into a float32 output with atomics.

Large M (>= LARGE_M, prefill): by default `dequantize_packed` writes the bf16/fp16 weight in one kernel
and the vendor GEMM multiplies (the weight read is amortised over M rows); `large_m="fused"` keeps the
fused kernel instead. `python -m bench.studies.gpu_check` times both on a GPU.

`reference_wq_matmul` is the plain-torch definition every path must equal.
"""

from __future__ import annotations

from dataclasses import replace

import torch
import torch.nn.functional as F

from lrq.kernels.common import (INTERPRET, Buckets, TileConfig, Tuner, cdiv, check_activation, dtype_name,
                                load_levels, load_qparams, split_output, tl, triton)
from lrq.packing import plane_bits, plane_offsets, planar_words, unpack_planar
from lrq.quant import dequantize, n_groups

LARGE_M = 256
LARGE_M_STRATEGY = "dequant"   # or "fused"

# Tile configurations per M range. BLOCK_N is the MMA's M side (the weight rows), BLOCK_M its N side.
WQ_BUCKETS = Buckets(
    bounds=(16, 64),
    configs=(
        (TileConfig(16, 64, 128, 4, 4), TileConfig(16, 128, 128, 4, 4)),     # decode: M <= 16, split K
        (TileConfig(32, 128, 64, 4, 4), TileConfig(64, 128, 64, 8, 3)),      # 16 < M <= 64
        (TileConfig(128, 128, 32, 8, 4), TileConfig(64, 128, 32, 4, 4)),     # M > 64
    ),
    names=("decode", "small", "large"),
)
DEQUANT_CONFIG = TileConfig(0, 64, 128, 4, 2)
_TUNER = Tuner()


def reference_wq_matmul(x: torch.Tensor, packed: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, bits: int,
                        group_size: int | None, in_features: int, bias: torch.Tensor | None = None) -> torch.Tensor:
    w = dequantize(unpack_planar(packed, bits, in_features), scale.float(), zero.float(), group_size)
    y = x.float() @ w.t()
    if bias is not None:
        y = y + bias.float()
    return y.to(x.dtype)


def kernel_group(group_size: int | None, k: int) -> int:
    """The kernels' GROUP constexpr: 0 per channel (one group spanning the row counts as per channel)."""
    return 0 if group_size is None or group_size >= k else group_size


def fit_group(c: TileConfig, group: int) -> TileConfig:
    """The configuration with its K tile shrunk (halving, down to one 32-column word of a 1-bit plane)
    until it lies inside one group, so scales and zero points are loaded once per row and tile. Group
    sizes that are not a multiple of 32 keep the tile and load them per element (correct, slower)."""
    if group == 0 or group % c.block_k == 0:
        return c
    bk = c.block_k
    while bk > 32 and group % bk:
        bk //= 2
    return replace(c, block_k=bk) if group % bk == 0 else c


def check_layout(packed: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, bits: int, group_size: int | None,
                 k: int) -> None:
    if packed.dtype != torch.int32 or packed.dim() != 2 or packed.shape[1] != planar_words(k, bits) \
            or packed.stride(1) != 1:
        raise ValueError(f"packed weights {tuple(packed.shape)} {packed.dtype} are not the row-major planar layout "
                         f"of {k} {bits}-bit columns ({planar_words(k, bits)} int32 words per row)")
    ng = n_groups(k, group_size)
    if scale.shape != (packed.shape[0], ng) or zero.shape != scale.shape or scale.stride(1) != 1 \
            or zero.stride() != scale.stride():
        raise ValueError(f"scale {tuple(scale.shape)} / zero {tuple(zero.shape)} must be row-major "
                         f"[{packed.shape[0]}, {ng}] with the same strides")


if triton is not None:
    @triton.jit
    def _wq_gemm_kernel(x_ptr, w_ptr, s_ptr, z_ptr, b_ptr, y_ptr, M, N, K, off1, off2,
                        stride_xm, stride_wn, stride_sn, stride_ym, k_split,
                        P0: tl.constexpr, P1: tl.constexpr, P2: tl.constexpr, GROUP: tl.constexpr,
                        HAS_BIAS: tl.constexpr, ATOMIC: tl.constexpr, UPCAST: tl.constexpr, PREC: tl.constexpr,
                        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
        pid_n = tl.program_id(0)
        pid_m = tl.program_id(1)
        pid_k = tl.program_id(2)
        rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        n_ok = rn < N
        m_ok = rm < M
        if GROUP == 0:
            s_row = tl.load(s_ptr + rn * stride_sn, mask=n_ok, other=0.0).to(tl.float32)
            z_row = tl.load(z_ptr + rn * stride_sn, mask=n_ok, other=0).to(tl.float32)
        acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
        k_lo = pid_k * k_split
        k_hi = tl.minimum(k_lo + k_split, K)
        for k0 in range(k_lo, k_hi, BLOCK_K):
            rk = k0 + tl.arange(0, BLOCK_K)
            x = tl.load(x_ptr + rm[:, None] * stride_xm + rk[None, :], mask=m_ok[:, None] & (rk[None, :] < K),
                        other=0.0)
            q = load_levels(w_ptr, rn, n_ok, stride_wn, K, k0, off1, off2, P0, P1, P2, BLOCK_K).to(tl.float32)
            if GROUP == 0:
                w = q - z_row[:, None]              # an integer in [-255, 255]: exact in bf16/fp16
            else:
                s, z = load_qparams(s_ptr, z_ptr, rn, n_ok, rk, K, k0, stride_sn, GROUP, BLOCK_K)
                w = (q - z) * s
            if UPCAST:    # the interpreter's tl.dot is wrong for bf16: multiply in float32 there
                acc += tl.dot(w, tl.trans(x.to(tl.float32)), input_precision=PREC)
            else:
                acc += tl.dot(w.to(x.dtype), tl.trans(x), input_precision=PREC)
        if GROUP == 0:
            acc = acc * s_row[:, None]
        if HAS_BIAS:
            acc += tl.load(b_ptr + rn, mask=n_ok & (pid_k == 0), other=0.0).to(tl.float32)[:, None]
        ptrs = y_ptr + rm[None, :] * stride_ym + rn[:, None]
        ok = n_ok[:, None] & m_ok[None, :]
        if ATOMIC:
            tl.atomic_add(ptrs, acc, mask=ok, sem="relaxed")
        else:
            tl.store(ptrs, acc.to(y_ptr.dtype.element_ty), mask=ok)

    @triton.jit
    def _wq_dequant_kernel(w_ptr, s_ptr, z_ptr, o_ptr, N, K, off1, off2, stride_wn, stride_sn, stride_on,
                           P0: tl.constexpr, P1: tl.constexpr, P2: tl.constexpr, GROUP: tl.constexpr,
                           BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
        rn = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
        k0 = tl.program_id(1) * BLOCK_K
        rk = k0 + tl.arange(0, BLOCK_K)
        n_ok = rn < N
        q = load_levels(w_ptr, rn, n_ok, stride_wn, K, k0, off1, off2, P0, P1, P2, BLOCK_K).to(tl.float32)
        if GROUP == 0:
            s = tl.load(s_ptr + rn * stride_sn, mask=n_ok, other=0.0).to(tl.float32)[:, None]
            z = tl.load(z_ptr + rn * stride_sn, mask=n_ok, other=0).to(tl.float32)[:, None]
        else:
            s, z = load_qparams(s_ptr, z_ptr, rn, n_ok, rk, K, k0, stride_sn, GROUP, BLOCK_K)
        w = (q - z) * s
        tl.store(o_ptr + rn[:, None] * stride_on + rk[None, :], w.to(o_ptr.dtype.element_ty),
                 mask=n_ok[:, None] & (rk[None, :] < K))


def _planes(bits: int) -> dict:
    p = plane_bits(bits) + (0, 0)
    return {"P0": p[0], "P1": p[1], "P2": p[2]}


def _constexprs(bits: int, group_size: int | None, k: int, dtype: torch.dtype, has_bias: bool,
                interpret: bool = INTERPRET) -> dict:
    return dict(**_planes(bits), GROUP=kernel_group(group_size, k), HAS_BIAS=has_bias,
                UPCAST=interpret and dtype == torch.bfloat16, PREC="ieee" if dtype == torch.float32 else "tf32")


def _strategy(large_m: str | None) -> str:
    strategy = large_m or LARGE_M_STRATEGY
    if strategy not in ("dequant", "fused"):
        raise ValueError(f"large_m must be 'dequant' or 'fused', not {strategy!r}")
    return strategy


def compilations(m: int, n: int, k: int, bits: int, group_size: int | None, dtype: torch.dtype,
                 has_bias: bool = False, sms: int = 132, large_m: str | None = None,
                 tune: bool = True) -> list[tuple[str, TileConfig, dict]]:
    """The (kernel, configuration, constexprs) a wq_matmul call of this shape compiles on a GPU with `sms`
    SMs (the GPU check's compile-time estimate; the dispatcher below takes the same decisions)."""
    ce = {"DT": dtype_name(dtype)}
    group = kernel_group(group_size, k)
    if m >= LARGE_M and _strategy(large_m) == "dequant":
        d = fit_group(DEQUANT_CONFIG, group)
        return [("wq_dequant", d, {**_planes(bits), "GROUP": group, **ce, "BLOCK_N": d.block_n, "BLOCK_K": d.block_k})]
    out = []
    for c in WQ_BUCKETS.candidates(WQ_BUCKETS.bucket(m), tune):
        c = fit_group(c, group)
        _, sk = WQ_BUCKETS.split(c, m, n, k, sms)
        out.append(("wq_gemm", c, {**_constexprs(bits, group_size, k, dtype, has_bias, False), **ce, "ATOMIC": sk > 1,
                                   **c.kwargs()}))
    return out


def dequantize_packed(packed: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, bits: int,
                      group_size: int | None, in_features: int, dtype: torch.dtype) -> torch.Tensor:
    """The [N, K] weight (q - z) * s in `dtype`, written by one kernel (the large-M path's first half)."""
    k = in_features
    check_layout(packed, scale, zero, bits, group_size, k)
    if triton is None or not (packed.is_cuda or INTERPRET):
        return dequantize(unpack_planar(packed, bits, k), scale.float(), zero.float(), group_size).to(dtype)
    n = packed.shape[0]
    out = torch.empty(n, k, dtype=dtype, device=packed.device)
    c = fit_group(DEQUANT_CONFIG, kernel_group(group_size, k))
    off1, off2 = plane_offsets(k, bits)
    grid = (cdiv(n, c.block_n), cdiv(k, c.block_k))
    _wq_dequant_kernel[grid](packed, scale, zero, out, n, k, off1, off2, packed.stride(0), scale.stride(0),
                             out.stride(0), **_planes(bits), GROUP=kernel_group(group_size, k),
                             BLOCK_N=c.block_n, BLOCK_K=c.block_k, **({} if INTERPRET else c.options()))
    return out


def wq_matmul(x: torch.Tensor, packed: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, bits: int,
              group_size: int | None, in_features: int, bias: torch.Tensor | None = None, *,
              large_m: str | None = None, config: TileConfig | None = None, split: int | None = None) -> torch.Tensor:
    """x [..., K] @ dequant(packed)^T -> [..., N]. On a GPU (or under the interpreter): the fused kernel, or
    for M >= LARGE_M the dequantize kernel + the vendor GEMM (`large_m`: "dequant" or "fused"). Elsewhere the
    torch reference. `config` / `split` pin a tile configuration and split-K factor (tests, benchmarks)."""
    if triton is None or not (x.is_cuda or INTERPRET):
        return reference_wq_matmul(x, packed, scale, zero, bits, group_size, in_features, bias)
    x2 = check_activation(x, in_features)
    m, k = x2.shape
    n = packed.shape[0]
    check_layout(packed, scale, zero, bits, group_size, k)
    if m >= LARGE_M and _strategy(large_m) == "dequant" and config is None:
        w = dequantize_packed(packed, scale, zero, bits, group_size, k, x.dtype)
        y = F.linear(x2, w, None if bias is None else bias.to(x.dtype))
        return y.reshape(*x.shape[:-1], n)
    if m == 0:
        return x.new_zeros(*x.shape[:-1], n)
    bucket = WQ_BUCKETS.bucket(m)
    off1, off2 = plane_offsets(k, bits)
    fixed = _constexprs(bits, group_size, k, x.dtype, bias is not None)

    def launch(c: TileConfig) -> torch.Tensor:
        c = fit_group(c, fixed["GROUP"])
        k_split, atomic, y, grid = split_output(WQ_BUCKETS, c, m, n, k, x.device, x.dtype, split)
        _wq_gemm_kernel[grid](x2, packed, scale, zero, bias if bias is not None else scale, y, m, n, k, off1, off2,
                              x2.stride(0), packed.stride(0), scale.stride(0), y.stride(0), k_split,
                              ATOMIC=atomic, **fixed, **c.kwargs(), **({} if INTERPRET else c.options()))
        return y.to(x.dtype) if atomic else y

    c = config or _TUNER.pick(("wq", bucket, n, k, x.dtype, tuple(sorted(fixed.items()))),
                              WQ_BUCKETS.candidates(bucket), launch)
    return launch(c).reshape(*x.shape[:-1], n)
