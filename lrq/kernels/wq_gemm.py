"""Fused dequantize-GEMM for packed low-bit weights (W4A16, W3A16, any 2..8 bits; per-channel or groups).

    y[m, n] = sum_k x[m, k] * (q[n, k] - z[n, k // g]) * s[n, k // g]  (+ bias[n])

The weight stays packed in memory (lrq.packing's dense LSB-first bit stream, so a 3-bit element may
straddle two int32 words); each program loads a [BLOCK_K, BLOCK_N] tile of words, extracts the levels
with shifts, applies zero point and scale in registers and feeds tl.dot. Small M (decode) splits K over
programs (SPLIT_K) and sums with atomics so the whole GPU works on one row.

`wq_matmul` is the entry point; `reference_wq_matmul` is the plain-torch definition it must equal.
Under TRITON_INTERPRET=1 (CPU) one fixed configuration is used; on a GPU the configuration is autotuned
per (M, N, K) over tile shapes and split-K factors.
For large M a dequantize + vendor GEMM wins (the weight read is amortised), so the dispatcher uses it
there and the quantized model is never slower than bf16.
"""

from __future__ import annotations

import os

import torch

from lrq.packing import unpack_bits
from lrq.quant import dequantize

try:
    import triton
    import triton.language as tl
except ImportError:   # CPU wheels without triton: the torch path is used
    triton = None

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
LARGE_M = 256   # from here on, dequantize + the vendor GEMM


def reference_wq_matmul(x: torch.Tensor, packed: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, bits: int,
                        group_size: int | None, in_features: int, bias: torch.Tensor | None = None) -> torch.Tensor:
    w = dequantize(unpack_bits(packed, bits, in_features), scale.float(), zero.float(), group_size)
    y = x.float() @ w.t()
    if bias is not None:
        y = y + bias.float()
    return y.to(x.dtype)


def jit_or_autotune(configs_fn, key, reset_to_zero=None):
    """@triton.jit under the interpreter (one fixed configuration: autotuning needs a driver), else
    @triton.autotune over configs_fn() on top of it."""
    def wrap(fn):
        kernel = triton.jit(fn)
        if INTERPRET:
            return kernel
        return triton.autotune(configs=configs_fn(), key=key, reset_to_zero=reset_to_zero)(kernel)
    return wrap


def _wq_configs():
    out = []
    for bm, bn, bk, sk, warps, stages in [(16, 64, 128, 1, 4, 4), (16, 128, 128, 2, 4, 4), (16, 64, 256, 4, 4, 3),
                                          (16, 128, 64, 8, 4, 4), (32, 128, 128, 1, 4, 4), (64, 128, 64, 1, 4, 4),
                                          (128, 128, 64, 1, 8, 3), (128, 256, 64, 1, 8, 3)]:
        out.append(triton.Config({"BLOCK_M": bm, "BLOCK_N": bn, "BLOCK_K": bk, "SPLIT_K": sk},
                                 num_warps=warps, num_stages=stages))
    return out


if triton is not None:
    @jit_or_autotune(_wq_configs, key=["M", "N", "K"], reset_to_zero=["y_ptr"])
    def _wq_gemm_kernel(x_ptr, w_ptr, s_ptr, z_ptr, b_ptr, y_ptr, M, N, K, n_words,
                        stride_xm, stride_xk, stride_wn, stride_sn, stride_ym,
                        BITS: tl.constexpr, GROUP: tl.constexpr, HAS_BIAS: tl.constexpr,
                        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                        SPLIT_K: tl.constexpr):
        pid_m = tl.program_id(0)
        pid_n = tl.program_id(1)
        pid_k = tl.program_id(2)
        rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        k_per = tl.cdiv(K, SPLIT_K * BLOCK_K) * BLOCK_K
        k_lo = pid_k * k_per
        for k0 in range(k_lo, k_lo + k_per, BLOCK_K):
            rk = k0 + tl.arange(0, BLOCK_K)
            k_ok = rk < K
            x = tl.load(x_ptr + rm[:, None] * stride_xm + rk[None, :] * stride_xk,
                        mask=(rm[:, None] < M) & k_ok[None, :], other=0.0).to(tl.float32)
            bit = rk * BITS
            word = bit // 32
            off = (bit % 32).to(tl.uint32)
            wmask = k_ok[:, None] & (rn[None, :] < N)
            w0 = tl.load(w_ptr + rn[None, :] * stride_wn + word[:, None], mask=wmask, other=0)
            w1 = tl.load(w_ptr + rn[None, :] * stride_wn + word[:, None] + 1,
                         mask=wmask & ((word[:, None] + 1) < n_words), other=0)
            w0 = w0.to(tl.uint32, bitcast=True)
            w1 = w1.to(tl.uint32, bitcast=True)
            lo = w0 >> off[:, None]
            straddle = (off[:, None] + BITS) > 32
            hi = tl.where(straddle, w1 << (32 - tl.where(straddle, off[:, None], 0)), 0)
            q = ((lo | hi) & ((1 << BITS) - 1)).to(tl.float32)
            g = rk // GROUP
            s = tl.load(s_ptr + rn[None, :] * stride_sn + g[:, None], mask=wmask, other=0.0).to(tl.float32)
            z = tl.load(z_ptr + rn[None, :] * stride_sn + g[:, None], mask=wmask, other=0).to(tl.float32)
            w = (q - z) * s
            acc += tl.dot(x, w)
        if HAS_BIAS:
            bias = tl.load(b_ptr + rn, mask=(rn < N) & (pid_k == 0), other=0.0).to(tl.float32)
            acc += bias[None, :]
        ptrs = y_ptr + rm[:, None] * stride_ym + rn[None, :]
        ymask = (rm[:, None] < M) & (rn[None, :] < N)
        if SPLIT_K == 1:
            tl.store(ptrs, acc, mask=ymask)
        else:
            tl.atomic_add(ptrs, acc, mask=ymask)


INTERPRET_CONFIG = {"BLOCK_M": 16, "BLOCK_N": 64, "BLOCK_K": 64, "SPLIT_K": 1}


def wq_matmul(x: torch.Tensor, packed: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, bits: int,
              group_size: int | None, in_features: int, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [..., K] @ dequant(packed)^T -> [..., N] through the fused kernel (Triton on a GPU or under the
    interpreter), else the torch reference."""
    if triton is None or not (x.is_cuda or INTERPRET):
        return reference_wq_matmul(x, packed, scale, zero, bits, group_size, in_features, bias)
    shape = x.shape
    x2 = x.reshape(-1, shape[-1])
    m, k = x2.shape
    if k != in_features:
        raise ValueError(f"activation width {k} does not match the layer's {in_features} input features")
    n = packed.shape[0]
    if m >= LARGE_M and not INTERPRET:
        return reference_wq_matmul(x, packed, scale, zero, bits, group_size, in_features, bias)
    y = torch.zeros(m, n, device=x.device, dtype=torch.float32)
    grid = lambda meta: (triton.cdiv(m, meta["BLOCK_M"]), triton.cdiv(n, meta["BLOCK_N"]), meta["SPLIT_K"])  # noqa: E731
    _wq_gemm_kernel[grid](x2, packed, scale, zero, bias if bias is not None else scale, y, m, n, k, packed.shape[1],
                          x2.stride(0), x2.stride(1), packed.stride(0), scale.stride(0), y.stride(0),
                          BITS=bits, GROUP=group_size or k, HAS_BIAS=bias is not None,
                          **(INTERPRET_CONFIG if INTERPRET else {}))
    return y.to(x.dtype).reshape(*shape[:-1], n)
