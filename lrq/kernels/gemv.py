"""Weight-only decode kernel (M <= 16): a split-K GEMV / skinny GEMM over weights repacked once for it.

    y[m, n] = sum_k x[m, k] * (q[n, k] - z[n, g(k)]) * s[n, g(k)]  (+ bias[n])

Layout (`repack_gemv`, done once when a layer is packed or moved to the GPU, never per call). b-bit levels
(b = 2..8) go E = 32 // b to an int32 word (4 bits: 8, 8 bits: 4, 3 bits: 10 using 30 of the 32 bits,
3.2 bits per weight instead of the planar layout's 3). K is cut into blocks of KB = E * WB columns
(WB = 16 words); inside a block, column r lives in word r % WB at bit (r // WB) * b. Words are stored
K-major, transposed: `words[kw, n]` with kw = block * WB + r % WB, so a program's [WB, BLOCK_N] tile is
WB rows of BLOCK_N consecutive int32 (consecutive threads read consecutive words along N; Triton vectorises
four per thread into 16-byte loads), and each shift step e of a word unpacks the CONTIGUOUS run of
columns block * KB + e * WB + [0, WB) -- so x is read as contiguous slices and no interleave or gather
is needed for any bit width. Scales (fp16) and zero points (uint8) are stored transposed too, [groups, N],
so their per-step loads are coalesced along N; group sizes must be multiples of WB (a run of WB columns
then lies in one group); per channel, the integer (q - z) is accumulated and the scale applied once.

Reduction across K splits: float32 atomic adds into a zeroed output (then one cast), not a two-pass
partial-sum buffer: at decode the output is N floats (44 KB at N = 11008), the split is at most 16 so
contention per address is small, and it saves the second launch and the [split, M, N] buffer a two-pass
reduction reads back; the price is a summation order that may differ run to run (float32, far below the
bf16 output's rounding). Without a split (enough tiles in N) the kernel stores the activations' dtype
directly.

M = 1 multiplies elementwise and sums over K in registers (no tensor cores, nothing padded); 1 < M <= 16
uses tl.dot with the tokens padded to 16 rows (mma's smallest N side). M > 16 is refused: larger M is the
GEMM's (lrq.kernels.wq_gemm) territory, chosen by lrq.kernels.dispatch.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from lrq.kernels.common import INTERPRET, cdiv, check_activation, device_sms, tl, triton
from lrq.packing import unpack_planar
from lrq.quant import n_groups

WB = 16            # words per K block and row: the layout's one free parameter, fixed at repack time
MAX_M = 16


@dataclass(frozen=True)
class GemvConfig:
    block_m: int
    block_n: int
    num_warps: int
    num_stages: int

    def __str__(self) -> str:
        return f"m{self.block_m} n{self.block_n} w{self.num_warps} s{self.num_stages}"


# M = 1: elementwise; 1 < M <= 16: tl.dot with 16 token rows
GEMV_CONFIGS = {1: GemvConfig(1, 128, 4, 3), 16: GemvConfig(16, 64, 4, 3)}


def elems_per_word(bits: int) -> int:
    if not isinstance(bits, int) or not 2 <= bits <= 8:
        raise ValueError(f"the GEMV layout holds 2- to 8-bit levels, not {bits!r}")
    return 32 // bits


@dataclass
class GemvWeights:
    """A layer's weights in the GEMV layout (see the module docstring)."""
    words: torch.Tensor      # int32 [cdiv(K, KB) * WB, N]
    scale: torch.Tensor      # fp16 [groups, N]
    zero: torch.Tensor       # uint8 [groups, N]
    bits: int
    group_size: int | None   # None: per channel
    in_features: int

    @property
    def out_features(self) -> int:
        return self.words.shape[1]

    def to(self, device) -> "GemvWeights":
        return GemvWeights(self.words.to(device), self.scale.to(device), self.zero.to(device), self.bits,
                           self.group_size, self.in_features)


def repack_levels(q: torch.Tensor, bits: int) -> torch.Tensor:
    """[N, K] levels in [0, 2^b) -> int32 [cdiv(K, KB) * WB, N], the GEMV layout."""
    e = elems_per_word(bits)
    if q.dim() != 2:
        raise ValueError(f"repack_levels expects [N, K] levels, got shape {tuple(q.shape)}")
    n, k = q.shape
    v = q.to(torch.int64)
    if v.numel() and (v.min() < 0 or v.max() >= 1 << bits):
        raise ValueError(f"levels outside [0, {(1 << bits) - 1}] cannot be stored in {bits} bits")
    kb = e * WB
    nb = cdiv(k, kb)
    pad = torch.zeros(n, nb * kb, dtype=torch.int64, device=q.device)
    pad[:, :k] = v
    pad = pad.view(n, nb, e, WB)                       # column r = step * WB + word
    shifts = (torch.arange(e, device=q.device, dtype=torch.int64) * bits).view(1, 1, e, 1)
    words = (pad << shifts).sum(dim=2)                 # [n, nb, WB], disjoint bit ranges: sum == or
    words = torch.where(words >= 1 << 31, words - (1 << 32), words).to(torch.int32)
    return words.reshape(n, nb * WB).t().contiguous()


def repack_gemv(packed: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, bits: int, group_size: int | None,
                in_features: int) -> GemvWeights:
    """Planar packed weights (lrq.packing.pack_planar) and their [N, groups] scales / zero points -> GemvWeights.
    Refuses group sizes the kernel cannot read (not a multiple of WB columns)."""
    group = 0 if group_size is None or group_size >= in_features else group_size
    if group and group % WB:
        raise ValueError(f"the GEMV kernel needs groups of a multiple of {WB} columns, not {group_size}")
    ng = n_groups(in_features, group_size)
    if scale.shape != (packed.shape[0], ng) or zero.shape != scale.shape:
        raise ValueError(f"scale {tuple(scale.shape)} / zero {tuple(zero.shape)} must be [{packed.shape[0]}, {ng}]")
    q = unpack_planar(packed, bits, in_features)
    return GemvWeights(repack_levels(q, bits), scale.t().contiguous().to(torch.float16),
                       zero.t().contiguous().to(torch.uint8), bits, group or None, in_features)


def reference_gemv(x: torch.Tensor, w: GemvWeights, bias: torch.Tensor | None = None) -> torch.Tensor:
    """The float definition, from the GEMV layout itself (unpacked in torch): dequantized weight @ x."""
    e, kb = elems_per_word(w.bits), elems_per_word(w.bits) * WB
    n, k = w.out_features, w.in_features
    words = w.words.t().to(torch.int64) & 0xFFFFFFFF                       # [n, nb * WB]
    nb = words.shape[1] // WB
    shifts = (torch.arange(e, device=words.device) * w.bits).view(1, 1, e, 1)
    q = ((words.view(n, nb, 1, WB) >> shifts) & ((1 << w.bits) - 1)).reshape(n, nb * kb)[:, :k]
    g = w.group_size or k
    s = w.scale.t().float().repeat_interleave(g, dim=1)[:, :k]
    z = w.zero.t().float().repeat_interleave(g, dim=1)[:, :k]
    y = x.float() @ ((q.float() - z) * s).t()
    if bias is not None:
        y = y + bias.float()
    return y.to(x.dtype)


def gemv_split(m: int, n: int, k: int, bits: int, sms: int, config: GemvConfig) -> int:
    """K splits: enough programs for about four per SM, each with at least two K blocks; 1 without SMs."""
    nkb = cdiv(k, elems_per_word(bits) * WB)
    if sms <= 0:
        return 1
    tiles = cdiv(n, config.block_n) * cdiv(m, config.block_m)
    want = max(1, (4 * sms) // max(tiles, 1))
    return max(1, min(want, nkb // 2, 16))


if triton is not None:
    @triton.jit
    def _gemv_kernel(x_ptr, w_ptr, s_ptr, z_ptr, b_ptr, y_ptr, M, N, K, stride_xm, stride_ym, kb_per_split,
                     BITS: tl.constexpr, GROUP: tl.constexpr, HAS_BIAS: tl.constexpr, ATOMIC: tl.constexpr,
                     UPCAST: tl.constexpr, PREC: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                     WBC: tl.constexpr):
        E: tl.constexpr = 32 // BITS
        KB: tl.constexpr = E * WBC
        pid_n = tl.program_id(0)
        pid_m = tl.program_id(1)
        pid_k = tl.program_id(2)
        rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        rj = tl.arange(0, WBC)
        n_ok = rn < N
        m_ok = rm < M
        if GROUP == 0:
            s_row = tl.load(s_ptr + rn, mask=n_ok, other=0.0).to(tl.float32)
            z_row = tl.load(z_ptr + rn, mask=n_ok, other=0).to(tl.float32)
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        b_lo = pid_k * kb_per_split
        b_hi = tl.minimum(b_lo + kb_per_split, tl.cdiv(K, KB))
        for b in range(b_lo, b_hi):
            w = tl.load(w_ptr + (b * WBC + rj)[:, None] * N + rn[None, :], mask=n_ok[None, :], other=0)
            for e in tl.static_range(E):
                k0 = b * KB + e * WBC
                rk = k0 + rj
                lev = ((w >> (e * BITS)) & ((1 << BITS) - 1)).to(tl.float32)      # [WB, BLOCK_N]
                if GROUP == 0:
                    wq = lev - z_row[None, :]
                else:
                    g = k0 // GROUP
                    s = tl.load(s_ptr + g * N + rn, mask=n_ok, other=0.0).to(tl.float32)
                    z = tl.load(z_ptr + g * N + rn, mask=n_ok, other=0).to(tl.float32)
                    wq = (lev - z[None, :]) * s[None, :]
                if BLOCK_M == 1:
                    xv = tl.load(x_ptr + pid_m * stride_xm + rk, mask=(rk < K) & (pid_m < M), other=0.0)
                    acc += tl.sum(xv.to(tl.float32)[:, None] * wq, axis=0)[None, :]
                else:
                    xt = tl.load(x_ptr + rm[:, None] * stride_xm + rk[None, :],
                                 mask=m_ok[:, None] & (rk[None, :] < K), other=0.0)
                    if UPCAST:   # the interpreter's tl.dot is wrong for bf16: multiply in float32 there
                        acc += tl.dot(xt.to(tl.float32), wq, input_precision=PREC)
                    else:
                        acc += tl.dot(xt, wq.to(xt.dtype), input_precision=PREC)
        if GROUP == 0:
            acc = acc * s_row[None, :]
        if HAS_BIAS:
            bias = tl.load(b_ptr + rn, mask=n_ok & (pid_k == 0), other=0.0).to(tl.float32)
            acc += bias[None, :]
        ptrs = y_ptr + rm[:, None] * stride_ym + rn[None, :]
        ok = m_ok[:, None] & n_ok[None, :]
        if ATOMIC:
            tl.atomic_add(ptrs, acc, mask=ok, sem="relaxed")
        else:
            tl.store(ptrs, acc.to(y_ptr.dtype.element_ty), mask=ok)


def _config(m: int) -> GemvConfig:
    return GEMV_CONFIGS[1] if m == 1 else GEMV_CONFIGS[16]


def compilations(m: int, n: int, k: int, bits: int, group_size: int | None, dtype: torch.dtype, sms: int = 132):
    """(kernel, config, constexprs) a call at this shape compiles on a GPU with `sms` SMs (for the AOT check)."""
    c = _config(m)
    split = gemv_split(m, n, k, bits, sms, c)
    group = 0 if group_size is None or group_size >= k else group_size
    return [("gemv", c, {"BITS": bits, "GROUP": group, "HAS_BIAS": True, "ATOMIC": split > 1, "UPCAST": False,
                         "PREC": "ieee" if dtype == torch.float32 else "tf32", "BLOCK_M": c.block_m,
                         "BLOCK_N": c.block_n, "WBC": WB})]


def gemv_matmul(x: torch.Tensor, w: GemvWeights, bias: torch.Tensor | None = None, split: int | None = None,
                config: GemvConfig | None = None) -> torch.Tensor:
    """x [..., K] (M = prod of leading dims <= 16) times the GEMV-layout weight; the activations' dtype out.
    Without triton (CPU wheels) the float reference runs."""
    x2 = check_activation(x, w.in_features)
    m, n, k = x2.shape[0], w.out_features, w.in_features
    if m > MAX_M:
        raise ValueError(f"the GEMV kernel takes at most {MAX_M} tokens per call, not {m}: use the GEMM (wq_gemm)")
    if x2.dtype not in (torch.bfloat16, torch.float16, torch.float32):
        raise ValueError(f"activations must be bf16, fp16 or fp32, not {x2.dtype}")
    if triton is None or (x2.device.type != "cuda" and not INTERPRET) or m == 0:
        return reference_gemv(x2, w, bias).reshape(*x.shape[:-1], n)
    c = config or _config(m)
    nkb = cdiv(k, elems_per_word(w.bits) * WB)
    split = max(1, min(split if split is not None else gemv_split(m, n, k, w.bits, device_sms(x2.device), c), nkb))
    kbs = cdiv(nkb, split)
    sk = cdiv(nkb, kbs)
    atomic = sk > 1
    y = (torch.zeros if atomic else torch.empty)(m, n, device=x2.device,
                                                 dtype=torch.float32 if atomic else x2.dtype)
    group = w.group_size or 0
    b = bias if bias is not None else w.scale
    grid = (cdiv(n, c.block_n), cdiv(m, c.block_m), sk)
    _gemv_kernel[grid](x2, w.words, w.scale, w.zero, b, y, m, n, k, x2.stride(0), y.stride(0), kbs,
                       BITS=w.bits, GROUP=group, HAS_BIAS=bias is not None, ATOMIC=atomic,
                       UPCAST=INTERPRET and x2.dtype == torch.bfloat16,
                       PREC="ieee" if x2.dtype == torch.float32 else "tf32",
                       BLOCK_M=c.block_m, BLOCK_N=c.block_n, WBC=WB, num_warps=c.num_warps,
                       num_stages=c.num_stages)
    return y.to(x2.dtype).reshape(*x.shape[:-1], n)
