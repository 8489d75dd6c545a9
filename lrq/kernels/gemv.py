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

Reduction across K splits: float32 atomic adds, not a two-pass partial-sum buffer: at decode the output is N
floats (44 KB at N = 11008), the split is at most 32 so contention per address is small, and it saves the
second launch and the [split, M, N] buffer a two-pass reduction reads back; the price is a summation order
that may differ run to run (float32, far below the bf16 output's rounding). The 16-token kernel adds into a
zeroed float32 output (then one cast); the M = 1 kernel adds into a workspace that stays zero between calls
and its last split per tile writes y itself (a counter per tile, `split_workspace`), so a decode step's layer
is one launch, not three. Without a split (enough tiles in N) the kernels store the activations' dtype
directly.

M = 1 (`_gemv1_kernel`) multiplies elementwise without any int-to-float conversion instruction (each level is
masked into the mantissa of the float 2^23 and one FMA takes the offset and the zero point off, exactly), keeps
a [WB, BLOCK_N] float32 accumulator per thread's rows and sums the rows once per group, so its loop has no
barrier, shuffle or conversion: about 3.7 machine instructions a weight at 4 bits on sm_90 (the old M = 1 path:
8.5, with 24 barriers, 64 shuffles and 128 conversions per K block), counted offline by `lrq.kernels.aot`.
1 < M <= 16 uses tl.dot with the tokens padded to 16 rows (mma's smallest N side). M > 16 is refused: larger M
is the GEMM's (lrq.kernels.wq_gemm) territory, chosen by lrq.kernels.dispatch.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from lrq.kernels.common import INTERPRET, cdiv, check_activation, device_sms, tl, triton
from lrq.packing import unpack_planar
from lrq.quant import n_groups

MAGIC = 0x4B000000  # the float 2^23's bits: 2^23 + i for an integer i < 2^23 OR-ed into its mantissa
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


# M = 1: elementwise, one warp holding all WB rows of 128 columns (about 250 registers: 8 warps an SM);
# 1 < M <= 16: tl.dot with 16 token rows
GEMV_CONFIGS = {1: GemvConfig(1, 128, 1, 1), 16: GemvConfig(16, 64, 4, 3)}


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
    """K splits; 1 without SMs. M = 1: enough one-warp programs for the 8 warps an SM holds at its register use
    (each split at least one K block, at most 32); M > 1: about four programs per SM, each with at least two K
    blocks, at most 16."""
    nkb = cdiv(k, elems_per_word(bits) * WB)
    if sms <= 0:
        return 1
    tiles = cdiv(n, config.block_n) * cdiv(m, config.block_m)
    if config.block_m == 1:
        return max(1, min(cdiv(8 * sms, config.num_warps * max(tiles, 1)), nkb, 32))
    want = max(1, (4 * sms) // max(tiles, 1))
    return max(1, min(want, nkb // 2, 16))


if triton is not None:
    @triton.jit
    def _levels_f32(z, magic):
        """Small unsigned integers (zero points, < 2^23) as float32 without a conversion instruction."""
        return (z.to(tl.uint32) | magic).to(tl.float32, bitcast=True) - 8388608.0

    @triton.jit
    def _row_sums(acc, s_ptr, mask, out):
        """out + s * (the accumulator's rows summed): a group's (or per channel, the whole K range's) scale."""
        return tl.fma(tl.load(s_ptr, mask=mask, other=0.0).to(tl.float32), tl.sum(acc, axis=0, keep_dims=True), out)

    @triton.jit
    def _tile_levels_minus_zero(w, zz, e: tl.constexpr, BITS: tl.constexpr, magic):
        """Field e of every word of a [WB, BLOCK_N] tile minus the zero points zz, as float32, exactly, without a
        conversion instruction: the field, masked in place (the fields above bit 23 - b after one shift of the
        word, placed so that the shift and mask do not become a bit-field extract), is OR-ed under the exponent
        of 2^23 (`magic` = 0x4B000000), so the word reads as 2^23 + lev * 2^P, and one FMA by 2^-P minus
        (2^(23-P) + z) leaves lev - z. The shift of the high fields is the same expression every step, so the
        compiler computes it once per word."""
        E: tl.constexpr = 32 // BITS
        N1: tl.constexpr = 23 // BITS            # fields below a float's exponent bits, read without a shift
        TOP: tl.constexpr = 23 - (E - N1) * BITS  # the other fields' lowest bit after the word's one shift
        MASK: tl.constexpr = (1 << BITS) - 1
        P = e * BITS if e < N1 else TOP + (e - N1) * BITS
        ws = w if e < N1 else w >> (N1 * BITS - TOP)
        v = ((ws & (MASK << P)) | magic).to(tl.float32, bitcast=True)                     # 2^23 + lev * 2^P
        return tl.fma(v, 1.0 / (1 << P), -(zz + (1 << (23 - P))))

    @triton.jit
    def _gemv1_store(out, b_ptr, y_ptr, ws_ptr, cnt_ptr, cn, c_ok, pid_n, pid_k,
                     HAS_BIAS: tl.constexpr, ATOMIC: tl.constexpr, BLOCK_N: tl.constexpr):
        """The M = 1 kernel's epilogue. Split K finishes in this one launch: every split adds into a float32
        workspace, then counts itself done on its tile's counter (after a barrier, with release/acquire order);
        the last one takes the sums while zeroing the workspace (one exchange, on the words' int32 view: 0.0 is
        0 either way and the interpreter has no float exchange), writes y in the activations' dtype and resets
        the counter, so the workspace is zero again for the next call or CUDA-graph replay and no zero-fill or
        cast kernel runs around this one."""
        if HAS_BIAS:
            out += tl.load(b_ptr + cn, mask=c_ok & (pid_k == 0), other=0.0).to(tl.float32)
        if ATOMIC:
            tl.atomic_add(ws_ptr + cn, out, mask=c_ok, sem="relaxed")
            tl.debug_barrier()
            done = tl.atomic_add(cnt_ptr + pid_n, 1, sem="acq_rel")
            if done == tl.num_programs(2) - 1:
                tot = tl.atomic_xchg(ws_ptr.to(tl.pointer_type(tl.int32)) + cn,
                                     tl.zeros((1, BLOCK_N), dtype=tl.int32), mask=c_ok, sem="acquire")
                tl.store(y_ptr + cn, tot.to(tl.float32, bitcast=True).to(y_ptr.dtype.element_ty), mask=c_ok)
                tl.atomic_xchg(cnt_ptr + pid_n, 0, sem="relaxed")
        else:
            tl.store(y_ptr + cn, out.to(y_ptr.dtype.element_ty), mask=c_ok)

    @triton.jit
    def _gemv1_kernel(x_ptr, w_ptr, s_ptr, z_ptr, b_ptr, y_ptr, ws_ptr, cnt_ptr, N, K, kb_per_split, magic,
                      BITS: tl.constexpr, GROUP: tl.constexpr, HAS_BIAS: tl.constexpr, ATOMIC: tl.constexpr,
                      EVEN: tl.constexpr, BLOCK_N: tl.constexpr, WBC: tl.constexpr):
        """M = 1 (the module docstring says how). `magic` is 0x4B000000 passed at run time: in a register, mask
        and OR are one LOP3 (two immediates take two). EVEN: N a multiple of BLOCK_N and K of the K block, no
        mask. Groups inside a K block end where known statically; groups of whole blocks at a block's end;
        other sizes (3 bits' 160-column blocks, groups of 128) are tested at every run of WB columns."""
        E: tl.constexpr = 32 // BITS
        KB: tl.constexpr = E * WBC
        pid_n = tl.program_id(0)
        pid_k = tl.program_id(2)
        rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        rj = tl.arange(0, WBC)
        # per-column values load as [1, BLOCK_N] rows, in the accumulator's layout (a 1-D load would be
        # converted every step: shuffles or shared memory inside the loop)
        cn = rn[None, :]
        c_ok = (rn < N)[None, :]
        z_n = tl.zeros((1, BLOCK_N), dtype=tl.float32)
        if GROUP == 0:
            z_n = _levels_f32(tl.load(z_ptr + cn, mask=c_ok, other=0), magic)
        acc = tl.zeros((WBC, BLOCK_N), dtype=tl.float32)
        out = tl.zeros((1, BLOCK_N), dtype=tl.float32)
        b_lo = pid_k * kb_per_split
        b_hi = tl.minimum(b_lo + kb_per_split, tl.cdiv(K, KB))
        for b in range(b_lo, b_hi):
            wp = w_ptr + (b * WBC + rj)[:, None] * N + cn
            w = (tl.load(wp) if EVEN else tl.load(wp, mask=c_ok, other=0)).to(tl.uint32, bitcast=True)
            for e in tl.static_range(E):
                k0 = b * KB + e * WBC
                rk = k0 + rj
                if GROUP != 0:
                    g = k0 // GROUP
                    g_ok = c_ok & (g * GROUP < K)       # steps past K in the last block: no group to read
                    if (KB % GROUP == 0 and (e * WBC) % GROUP == 0) or (GROUP % KB == 0 and e == 0) or \
                            (KB % GROUP != 0 and GROUP % KB != 0):   # a group's first run (or not known)
                        z_n = _levels_f32(tl.load(z_ptr + g * N + cn, mask=g_ok, other=0), magic)
                d = _tile_levels_minus_zero(w, z_n, e, BITS, magic)
                xv = (tl.load(x_ptr + rk) if EVEN else tl.load(x_ptr + rk, mask=rk < K, other=0.0)).to(tl.float32)
                if GROUP != 0 and KB % GROUP == 0 and (e * WBC) % GROUP == 0:
                    acc = xv[:, None] * d                  # a group's first run: a product, no zeroing
                else:
                    acc = tl.fma(xv[:, None], d, acc)
                if GROUP != 0:
                    if KB % GROUP == 0:
                        if ((e + 1) * WBC) % GROUP == 0:   # the group's last run of WB columns: its scale
                            out = _row_sums(acc, s_ptr + g * N + cn, g_ok, out)
                    elif GROUP % KB == 0:
                        if e == E - 1:                     # groups of whole blocks end at a block's end
                            if ((b + 1) * KB) % GROUP == 0:
                                out = _row_sums(acc, s_ptr + g * N + cn, g_ok, out)
                                acc = tl.zeros((WBC, BLOCK_N), dtype=tl.float32)
                    elif (k0 + WBC) % GROUP == 0:
                        out = _row_sums(acc, s_ptr + g * N + cn, g_ok, out)
                        acc = tl.zeros((WBC, BLOCK_N), dtype=tl.float32)
        if GROUP == 0:
            out = _row_sums(acc, s_ptr + cn, c_ok, out)
        elif KB % GROUP != 0:   # a group cut by the end of this split (or of K): the last step's group's scale
            out = _row_sums(acc, s_ptr + (tl.minimum(b_hi * KB, K) - 1) // GROUP * N + cn, c_ok, out)
        _gemv1_store(out, b_ptr, y_ptr, ws_ptr, cnt_ptr, cn, c_ok, pid_n, pid_k, HAS_BIAS, ATOMIC, BLOCK_N)

    @triton.jit
    def _gemv_kernel(x_ptr, w_ptr, s_ptr, z_ptr, b_ptr, y_ptr, M, N, K, stride_xm, stride_ym, kb_per_split,
                     BITS: tl.constexpr, GROUP: tl.constexpr, HAS_BIAS: tl.constexpr, ATOMIC: tl.constexpr,
                     UPCAST: tl.constexpr, PREC: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                     WBC: tl.constexpr):
        """1 < M <= 16: tl.dot on 16 token rows. Per channel and for groups inside a K block, lev - z (exact in
        bf16/fp16) goes to the tensor cores and the scale multiplies the float32 product once per group and
        column; groups across blocks round (lev - z) * s once per weight. Below 8 bits the levels become floats
        as in the M = 1 kernel (masked into the mantissa of 2^23, no conversion instruction) but with the
        constant 0x4B000000 as an immediate and the words never reassigned: a run-time constant (as the M = 1
        kernel passes) or a reassigned word made Triton stage every step's weights through shared memory (16
        barriers an iteration, not 2) instead of reading the words straight into the tensor cores' operand
        layout."""
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
        acc_g = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)    # groups inside a K block: unscaled sums
        z_g = tl.zeros((1, BLOCK_N), dtype=tl.float32)
        b_lo = pid_k * kb_per_split
        b_hi = tl.minimum(b_lo + kb_per_split, tl.cdiv(K, KB))
        for b in range(b_lo, b_hi):
            w = tl.load(w_ptr + (b * WBC + rj)[:, None] * N + rn[None, :], mask=n_ok[None, :], other=0)
            for e in tl.static_range(E):
                k0 = b * KB + e * WBC
                rk = k0 + rj
                if GROUP == 0:
                    zz = z_row[None, :]
                else:
                    g = k0 // GROUP
                    g_ok = n_ok & (g * GROUP < K)     # steps past K in the last block: no group to read
                    if KB % GROUP != 0:               # groups across blocks: the scale per weight
                        s = tl.load(s_ptr + g * N + rn, mask=g_ok, other=0.0).to(tl.float32)
                        zz = tl.load(z_ptr + g * N + rn, mask=g_ok, other=0).to(tl.float32)[None, :]
                    else:                             # groups inside a block: the zero point at its first run
                        if (e * WBC) % GROUP == 0:
                            z_g = tl.load(z_ptr + g * N + rn, mask=g_ok, other=0).to(tl.float32)[None, :]
                        zz = z_g
                if BITS < 8:   # the constant as an immediate (see the docstring)
                    wq = _tile_levels_minus_zero(w, zz, e, BITS, 0x4B000000)
                else:          # four fields a word: the conversion costs less than the two-immediate mask (counted)
                    wq = ((w >> (e * BITS)) & ((1 << BITS) - 1)).to(tl.float32) - zz
                if GROUP != 0 and KB % GROUP != 0:
                    wq = wq * s[None, :]
                xt = tl.load(x_ptr + rm[:, None] * stride_xm + rk[None, :],
                             mask=m_ok[:, None] & (rk[None, :] < K), other=0.0)
                if UPCAST:   # the interpreter's tl.dot is wrong for bf16: multiply in float32 there
                    xt = xt.to(tl.float32)
                if GROUP != 0 and KB % GROUP == 0:
                    # lev - z is exact in bf16/fp16 (|lev - z| < 256): the group's dot, then its scale once per
                    # group and column at the group's last run (not once per weight)
                    acc_g = tl.dot(xt, wq.to(xt.dtype), acc_g, input_precision=PREC)
                    if ((e + 1) * WBC) % GROUP == 0:
                        sg = tl.load(s_ptr + g * N + rn, mask=g_ok, other=0.0).to(tl.float32)
                        acc += sg[None, :] * acc_g
                        acc_g = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
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


def _config(m: int, n: int = 0, k: int = 0, aligned: bool = True) -> GemvConfig:
    """M = 1 on shapes whose sizes are multiples of 16 (every LLM layer's) and 16-byte aligned tensors: the
    one-row kernel; otherwise (and for M > 1) the 16-token one: the one-row kernel's ~250 registers have no room
    for the index arithmetic of odd sizes (it spills there, see lrq.kernels.aot)."""
    return GEMV_CONFIGS[1] if m == 1 and aligned and n % 16 == 0 and k % 16 == 0 else GEMV_CONFIGS[16]


def _even(n: int, k: int, bits: int, config: GemvConfig) -> bool:
    return n % config.block_n == 0 and k % (elems_per_word(bits) * WB) == 0


def compilations(m: int, n: int, k: int, bits: int, group_size: int | None, dtype: torch.dtype, sms: int = 132):
    """(kernel, config, constexprs) a call at this shape compiles on a GPU with `sms` SMs (for the AOT check)."""
    c = _config(m, n, k)
    split = gemv_split(m, n, k, bits, sms, c)
    group = 0 if group_size is None or group_size >= k else group_size
    ce = {"BITS": bits, "GROUP": group, "HAS_BIAS": True, "ATOMIC": split > 1, "BLOCK_N": c.block_n, "WBC": WB}
    if c.block_m == 1:
        return [("gemv", c, {**ce, "EVEN": _even(n, k, bits, c)})]
    return [("gemv", c, {**ce, "UPCAST": False, "PREC": "ieee" if dtype == torch.float32 else "tf32",
                         "BLOCK_M": c.block_m})]


_WORKSPACES: dict[tuple, tuple[torch.Tensor, torch.Tensor]] = {}


def split_workspace(device: torch.device, n: int, tiles: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The split-K M = 1 kernel's float32 sums [n] and per-tile counters [tiles], zero between calls (the
    kernel's last split of each tile leaves them so); one pair per (device, n), made at a shape's first call (a
    warm-up before any CUDA-graph capture). Calls on one stream share it in turn; calls of the same N running
    concurrently on two streams would not (the decode path runs on one)."""
    key = (str(device), n, tiles)
    if key not in _WORKSPACES:
        _WORKSPACES[key] = (torch.zeros(n, device=device, dtype=torch.float32),
                            torch.zeros(tiles, device=device, dtype=torch.int32))
    return _WORKSPACES[key]


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
    ptrs = (x2, w.words, w.scale, w.zero) + ((bias,) if bias is not None else ())
    aligned = all(t.data_ptr() % 16 == 0 for t in ptrs)
    c = config or _config(m, n, k, aligned)
    nkb = cdiv(k, elems_per_word(w.bits) * WB)
    split = max(1, min(split if split is not None else gemv_split(m, n, k, w.bits, device_sms(x2.device), c), nkb))
    kbs = cdiv(nkb, split)
    sk = cdiv(nkb, kbs)
    atomic = sk > 1
    group = w.group_size or 0
    b = bias if bias is not None else w.scale
    grid = (cdiv(n, c.block_n), cdiv(m, c.block_m), sk)
    if c.block_m == 1:   # one launch, y written in the activations' dtype (see _gemv1_kernel's epilogue)
        y = torch.empty(m, n, device=x2.device, dtype=x2.dtype)
        ws, cnt = split_workspace(x2.device, n, grid[0])
        _gemv1_kernel[grid](x2, w.words, w.scale, w.zero, b, y, ws, cnt, n, k, kbs, MAGIC, BITS=w.bits,
                            GROUP=group, HAS_BIAS=bias is not None, ATOMIC=atomic, EVEN=_even(n, k, w.bits, c),
                            BLOCK_N=c.block_n, WBC=WB, num_warps=c.num_warps, num_stages=c.num_stages)
        return y.reshape(*x.shape[:-1], n)
    y = (torch.zeros if atomic else torch.empty)(m, n, device=x2.device,
                                                 dtype=torch.float32 if atomic else x2.dtype)
    _gemv_kernel[grid](x2, w.words, w.scale, w.zero, b, y, m, n, k, x2.stride(0), y.stride(0), kbs,
                       BITS=w.bits, GROUP=group, HAS_BIAS=bias is not None, ATOMIC=atomic,
                       UPCAST=INTERPRET and x2.dtype == torch.bfloat16,
                       PREC="ieee" if x2.dtype == torch.float32 else "tf32",
                       BLOCK_M=c.block_m, BLOCK_N=c.block_n, WBC=WB, num_warps=c.num_warps,
                       num_stages=c.num_stages)
    return y.to(x2.dtype).reshape(*x.shape[:-1], n)
