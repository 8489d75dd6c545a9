"""Integer GEMM for W8A8 (per-tensor static activations) and W4A8 (per-token dynamic activations).

Activations are quantized asymmetrically to levels xq in [0, 255] with a scale sx and zero point zx per
row (one pair for the whole tensor under static W8A8, one per token under W4A8), and shifted to int8:
xa = xq - 128. Weights are the packed levels q with per-row scale sw and zero point wz:

* 8-bit weights: wa = q - 128 (int8), and the zero points are corrected in the epilogue:
      sum_k (xq - zx)(q - wz) = sum xa*wa + (128 - wz) sum_k xa + (128 - zx) sum_k wa + K (128 - zx)(128 - wz)
* 2..7-bit weights: wa = q - wz already fits int8 (|q - wz| <= 127), so
      sum_k (xq - zx)(q - wz) = sum xa*wa + (128 - zx) sum_k wa
  y = that * sx * sw (+ bias). int8 x int8 -> int32 accumulation throughout (tensor cores on a GPU).

`quantize_activations` is the light prologue (torch ops); `int8_matmul` the fused GEMM + epilogue;
`reference_int8_matmul` the plain-torch definition (fake quantization in float64).
Per-channel weights only (the schemes that quantize activations are per-channel).
"""

from __future__ import annotations

import torch

from lrq.kernels.wq_gemm import INTERPRET, jit_or_autotune, triton
from lrq.packing import unpack_bits

if triton is not None:
    import triton.language as tl


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
    q = unpack_bits(packed, bits, k).to(torch.int32)
    wa = q - 128 if bits == 8 else q - zero[:, :1].to(torch.int32)
    return wa.sum(dim=1, dtype=torch.int32)


def reference_int8_matmul(x: torch.Tensor, packed: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, bits: int,
                          k: int, bias: torch.Tensor | None = None,
                          static: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
    shape = x.shape
    xa, sx, zx = quantize_activations(x.reshape(-1, shape[-1]), static)
    xd = (xa.double() + 128 - zx.double()[:, None]) * sx.double()[:, None]
    w = (unpack_bits(packed, bits, k).double() - zero[:, :1].double()) * scale[:, :1].double()
    y = xd @ w.t()
    if bias is not None:
        y = y + bias.double()
    return y.to(x.dtype).reshape(*shape[:-1], packed.shape[0])


def _int8_configs():
    return [triton.Config({"BLOCK_M": bm, "BLOCK_N": bn, "BLOCK_K": bk}, num_warps=w, num_stages=st)
            for bm, bn, bk, w, st in [(16, 64, 128, 4, 4), (16, 128, 128, 4, 4), (32, 128, 128, 4, 4),
                                      (64, 128, 128, 4, 4), (128, 128, 128, 8, 3), (128, 256, 128, 8, 3)]]


INTERPRET_CONFIG = {"BLOCK_M": 16, "BLOCK_N": 32, "BLOCK_K": 32}

if triton is not None:
    @jit_or_autotune(_int8_configs, key=["M", "N", "K"])
    def _int8_gemm_kernel(xa_ptr, sx_ptr, zx_ptr, w_ptr, sw_ptr, wz_ptr, wsum_ptr, b_ptr, y_ptr, M, N, K, n_words,
                          stride_xm, stride_wn, stride_sn, stride_ym,
                          BITS: tl.constexpr, HAS_BIAS: tl.constexpr,
                          BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
        pid_m = tl.program_id(0)
        pid_n = tl.program_id(1)
        rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        m_ok = rm < M
        n_ok = rn < N
        wz = tl.load(wz_ptr + rn * stride_sn, mask=n_ok, other=0).to(tl.int32)
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.int32)
        xsum = tl.zeros((BLOCK_M,), dtype=tl.int32)
        for k0 in range(0, K, BLOCK_K):
            rk = k0 + tl.arange(0, BLOCK_K)
            k_ok = rk < K
            xa = tl.load(xa_ptr + rm[:, None] * stride_xm + rk[None, :], mask=m_ok[:, None] & k_ok[None, :], other=0)
            xsum += tl.sum(xa.to(tl.int32), axis=1)
            bit = rk * BITS
            word = bit // 32
            off = (bit % 32).to(tl.uint32)
            wmask = k_ok[:, None] & n_ok[None, :]
            w0 = tl.load(w_ptr + rn[None, :] * stride_wn + word[:, None], mask=wmask, other=0).to(tl.uint32,
                                                                                                   bitcast=True)
            w1 = tl.load(w_ptr + rn[None, :] * stride_wn + word[:, None] + 1,
                         mask=wmask & ((word[:, None] + 1) < n_words), other=0).to(tl.uint32, bitcast=True)
            straddle = (off[:, None] + BITS) > 32
            hi = tl.where(straddle, w1 << (32 - tl.where(straddle, off[:, None], 0)), 0)
            q = ((w0 >> off[:, None]) | hi) & ((1 << BITS) - 1)
            if BITS == 8:
                wa = q.to(tl.int32) - 128
            else:
                wa = q.to(tl.int32) - wz[None, :]
            wa = tl.where(wmask, wa, 0).to(tl.int8)
            acc += tl.dot(xa, wa, out_dtype=tl.int32)
        sx = tl.load(sx_ptr + rm, mask=m_ok, other=0.0)
        zx = tl.load(zx_ptr + rm, mask=m_ok, other=0.0)
        sw = tl.load(sw_ptr + rn * stride_sn, mask=n_ok, other=0.0).to(tl.float32)
        wsum = tl.load(wsum_ptr + rn, mask=n_ok, other=0).to(tl.float32)
        total = acc.to(tl.float32) + (128.0 - zx)[:, None] * wsum[None, :]
        if BITS == 8:
            wzf = wz.to(tl.float32)
            total += xsum.to(tl.float32)[:, None] * (128.0 - wzf)[None, :]
            total += K * (128.0 - zx)[:, None] * (128.0 - wzf)[None, :]
        y = total * sx[:, None] * sw[None, :]
        if HAS_BIAS:
            y += tl.load(b_ptr + rn, mask=n_ok, other=0.0).to(tl.float32)[None, :]
        tl.store(y_ptr + rm[:, None] * stride_ym + rn[None, :], y, mask=m_ok[:, None] & n_ok[None, :])


def int8_matmul(x: torch.Tensor, packed: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, bits: int, k: int,
                bias: torch.Tensor | None = None, static: tuple[torch.Tensor, torch.Tensor] | None = None,
                wsum: torch.Tensor | None = None) -> torch.Tensor:
    if scale.shape[1] != 1:
        raise ValueError("the integer GEMM takes per-channel weights (one scale per row)")
    if triton is None or not (x.is_cuda or INTERPRET):
        return reference_int8_matmul(x, packed, scale, zero, bits, k, bias, static)
    shape = x.shape
    x2 = x.reshape(-1, shape[-1])
    if x2.shape[1] != k:
        raise ValueError(f"activation width {x2.shape[1]} does not match the layer's {k} input features")
    xa, sx, zx = quantize_activations(x2, static)
    xa = xa.contiguous()
    if wsum is None:
        wsum = weight_sums(packed, zero, bits, k)
    m, n = x2.shape[0], packed.shape[0]
    y = torch.empty(m, n, device=x.device, dtype=torch.float32)
    grid = lambda meta: (triton.cdiv(m, meta["BLOCK_M"]), triton.cdiv(n, meta["BLOCK_N"]))  # noqa: E731
    _int8_gemm_kernel[grid](xa, sx, zx, packed, scale, zero, wsum, bias if bias is not None else scale, y,
                            m, n, k, packed.shape[1], xa.stride(0), packed.stride(0), scale.stride(0), y.stride(0),
                            BITS=bits, HAS_BIAS=bias is not None, **(INTERPRET_CONFIG if INTERPRET else {}))
    return y.to(x.dtype).reshape(*shape[:-1], n)
