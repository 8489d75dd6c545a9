"""Weight-only decode kernel (M <= 16): a split-K GEMV / skinny GEMM over weights repacked once for it.

    y[m, n] = sum_k x[m, k] * (q[n, k] - z[n, g(k)]) * s[n, g(k)]  (+ bias[n])

Layout (`repack_gemv`, done once when a layer is packed or moved to the GPU, never per call). b-bit levels
(b = 2..8) fill the two 16-bit halves of an int32 word, H = 16 // b a half, E = 2H a word (4 bits: 8,
3 bits: 10 in 30 of the 32 bits, 8 bits: 4; 6 bits: 4, so 8 bits a weight, the one width that wastes room).
K is cut into blocks of KB = E * WB columns (WB = 16 words); inside a block, pair h covers the 2 WB columns
h * 2WB + [0, 2WB), and column h * 2WB + 2j + t lives in word j at bit h * b + 16 t (t = 0: the low half,
1: the high half). Words are stored K-major, transposed: `words[kw, n]` with kw = block * WB + j, so a
program's [WB, BLOCK_N] tile is WB rows of BLOCK_N consecutive int32 (consecutive threads read consecutive
words along N; Triton vectorises four per thread into 16-byte loads), and pair h of the tile holds the
CONTIGUOUS run of columns block * KB + h * 2WB + [0, 2WB), x read as contiguous slices. The pairing is for
the tensor cores: the pair's two fields of a word, masked and OR-ed under the exponent of a 16-bit float
(one LOP3), read as the two floats 2^p + lev for columns 2j and 2j + 1, the two k a tensor-core operand
register holds, and one HFMA2 takes off 2^p + z exactly (see `_pair_tile`). Scales (fp16) and zero points
(uint8) are stored transposed too, [groups, N], so their loads are coalesced along N; group sizes must be
multiples of 2 WB (a pair then lies in one group); per channel, the integer (q - z) is accumulated and the
scale applied once.

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
barrier, shuffle or conversion: about 3.6 machine instructions a weight at 4 bits on sm_90 (the first M = 1
path: 8.5, with 24 barriers, 64 shuffles and 128 conversions per K block), counted offline by
`lrq.kernels.aot`. 1 < M <= 16 (`_gemv_kernel`) uses tl.dot computed transposed (the weights on the MMA's M
side, as its A operand from registers; the tokens padded to 16 on its N side), its weight tiles built two
weights to an LOP3 and an HFMA2 (about 2.5 instructions a weight at 4 bits on sm_90; 6.9 with one float
conversion a weight and the weights as the B operand). M > 16 is refused: larger M is the GEMM's (lrq.kernels.wq_gemm)
territory, chosen by lrq.kernels.dispatch.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from lrq.kernels.common import INTERPRET, cdiv, check_activation, device_sms, tl, triton
from lrq.packing import unpack_planar
from lrq.quant import n_groups

MAGIC = 0x4B000000  # the float 2^23's bits: 2^23 + i for an integer i < 2^23 OR-ed into its mantissa
WB = 16            # words per K block and row: the layout's one free parameter, fixed at repack time
GROUP_MULTIPLE = 2 * WB   # a pair of fields covers 2 WB columns: groups must hold whole pairs
MAX_M = 16
# the 16-bit pair path (`_pair_tile`): per activation dtype, the float 2^p whose last mantissa bit is 1 (bf16: 2^7
# = 0x4300, 8 significant bits; fp16: 2^10 = 0x6400, 11), 1.0, and the packed FMA that takes 2^p + z off both halves
PAIR_FLOATS = {torch.bfloat16: (0x4300, 0x3F80, "fma.rn.bf16x2"), torch.float16: (0x6400, 0x3C00, "fma.rn.f16x2")}


def pair_asm(dtype: torch.dtype) -> str:
    """The inline PTX of `_pair_tile` for bf16 / fp16 activations: $1 the word (shifted to the pair), $3 the pair's
    mask in both halves, $2 -(2^p + z) in both halves; LOP3 0xEA is (a & b) | c."""
    magic, one, fma = PAIR_FLOATS[dtype]
    return (f"{{.reg .b32 t, o; mov.b32 o, 0x{one * 65537:08X}; lop3.b32 t, $1, $3, 0x{magic * 65537:08X}, 0xEA; "
            f"{fma} $0, t, o, $2;}}")


@dataclass(frozen=True)
class GemvConfig:
    block_m: int
    block_n: int
    num_warps: int
    num_stages: int

    def __str__(self) -> str:
        return f"m{self.block_m} n{self.block_n} w{self.num_warps} s{self.num_stages}"


# M = 1: elementwise, one warp holding all WB rows of 128 columns (130-250 registers: 8 warps an SM or more),
# the next K block's words in flight (2 stages); 1 < M <= 16: tl.dot, weights on the MMA's M side (2 warps
# of 64 rows: mma.sync on sm_90 too, 2.5 instructions a weight at 4 bits; 4 warps would take wgmma at 3.2)
GEMV_CONFIGS = {1: GemvConfig(1, 128, 1, 2), 16: GemvConfig(16, 128, 2, 3)}


def elems_per_word(bits: int) -> int:
    if not isinstance(bits, int) or not 2 <= bits <= 8:
        raise ValueError(f"the GEMV layout holds 2- to 8-bit levels, not {bits!r}")
    return 2 * (16 // bits)


def fast_pairs(bits: int, dtype: torch.dtype) -> bool:
    """Whether the 16-token kernel builds its tiles with the 16-bit pair trick (`_pair_tile`): 2^p + lev must be
    exact in the activations' type (bf16: 8 significant bits, levels to 7 bits; fp16: 11, all widths)."""
    return dtype == torch.float16 or (dtype == torch.bfloat16 and bits <= 7)


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
    pad = pad.view(n, nb, e // 2, WB, 2)               # column r = pair * 2 WB + 2 * word + half
    words = (pad << _field_shifts(bits, q.device)).sum(dim=(2, 4))   # [n, nb, WB]: disjoint bits, sum == or
    words = torch.where(words >= 1 << 31, words - (1 << 32), words).to(torch.int32)
    return words.reshape(n, nb * WB).t().contiguous()


def _field_shifts(bits: int, device) -> torch.Tensor:
    """[1, 1, H, 1, 2]: field (pair h, half t) of a word sits at bit h * bits + 16 * t."""
    h = 16 // bits
    return (torch.arange(h, device=device, dtype=torch.int64).view(1, 1, h, 1, 1) * bits
            + 16 * torch.arange(2, device=device, dtype=torch.int64).view(1, 1, 1, 1, 2))


def repack_gemv(packed: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, bits: int, group_size: int | None,
                in_features: int) -> GemvWeights:
    """Planar packed weights (lrq.packing.pack_planar) and their [N, groups] scales / zero points -> GemvWeights.
    Refuses group sizes the kernel cannot read (not a multiple of WB columns)."""
    group = 0 if group_size is None or group_size >= in_features else group_size
    if group and group % GROUP_MULTIPLE:
        raise ValueError(f"the GEMV kernel needs groups of a multiple of {GROUP_MULTIPLE} columns, not "
                         f"{group_size} (the GEMM, lrq.kernels.wq_gemm, takes any group size)")
    ng = n_groups(in_features, group_size)
    if scale.shape != (packed.shape[0], ng) or zero.shape != scale.shape:
        raise ValueError(f"scale {tuple(scale.shape)} / zero {tuple(zero.shape)} must be [{packed.shape[0]}, {ng}]")
    q = unpack_planar(packed, bits, in_features)
    return GemvWeights(repack_levels(q, bits), scale.t().contiguous().to(torch.float16),
                       zero.t().contiguous().to(torch.uint8), bits, group or None, in_features)


def reference_gemv(x: torch.Tensor, w: GemvWeights, bias: torch.Tensor | None = None) -> torch.Tensor:
    """The float definition, from the GEMV layout itself (unpacked in torch): dequantized weight @ x."""
    kb = elems_per_word(w.bits) * WB
    n, k = w.out_features, w.in_features
    words = w.words.t().to(torch.int64) & 0xFFFFFFFF                       # [n, nb * WB]
    nb = words.shape[1] // WB
    fields = words.view(n, nb, 1, WB, 1) >> _field_shifts(w.bits, words.device)   # [n, nb, H, WB, 2]
    q = (fields & ((1 << w.bits) - 1)).reshape(n, nb * kb)[:, :k]
    g = w.group_size or k
    s = w.scale.t().float().repeat_interleave(g, dim=1)[:, :k]
    z = w.zero.t().float().repeat_interleave(g, dim=1)[:, :k]
    y = x.float() @ ((q.float() - z) * s).t()
    if bias is not None:
        y = y + bias.float()
    return y.to(x.dtype)


def gemv_split(m: int, n: int, k: int, bits: int, sms: int, config: GemvConfig) -> int:
    """K splits; 1 without SMs. M = 1: enough one-warp programs for the 8 warps an SM holds at its register use
    (each split at least one K block, at most 32); M > 1: about 16 warps an SM (8 two-warp programs at ~140
    registers), each program with at least two K blocks, at most 16 splits."""
    nkb = cdiv(k, elems_per_word(bits) * WB)
    if sms <= 0:
        return 1
    tiles = cdiv(n, config.block_n) * cdiv(m, config.block_m)
    if config.block_m == 1:
        return max(1, min(cdiv(8 * sms, config.num_warps * max(tiles, 1)), nkb, 32))
    want = max(1, (16 * sms) // (config.num_warps * max(tiles, 1)))
    return max(1, min(want, nkb // 2, 16))


if triton is not None:
    _ASM_BF16 = tl.constexpr(pair_asm(torch.bfloat16))
    _ASM_F16 = tl.constexpr(pair_asm(torch.float16))
    _MAGIC2_BF16 = tl.constexpr(PAIR_FLOATS[torch.bfloat16][0] * 65537)
    _MAGIC2_F16 = tl.constexpr(PAIR_FLOATS[torch.float16][0] * 65537)
    _MAGIC_F32 = tl.constexpr(MAGIC)   # where the constant must be an immediate (the 16-token kernel's fields)

    @triton.jit
    def _levels_f32(z, magic):
        """Small unsigned integers (zero points, < 2^23) as float32 without a conversion instruction."""
        return (z.to(tl.uint32) | magic).to(tl.float32, bitcast=True) - 8388608.0

    @triton.jit
    def _row_sums(acc, s_ptr, mask, out):
        """out + s * (the accumulator's rows summed): a group's (or per channel, the whole K range's) scale."""
        return tl.fma(tl.load(s_ptr, mask=mask, other=0.0).to(tl.float32), tl.sum(acc, axis=0, keep_dims=True), out)

    @triton.jit
    def _tile_levels_minus_zero(w, zz, e: tl.constexpr, BITS: tl.constexpr, magic, ONE_SHIFT: tl.constexpr = True):
        """Field e (pair e // 2, half e % 2) of every word of a [WB, BLOCK_N] tile minus the zero points zz, as
        float32, exactly, without a conversion instruction: the field, masked in place, is OR-ed under the
        exponent of 2^23 (`magic` = 0x4B000000), so the word reads as 2^23 + lev * 2^P, and one FMA by 2^-P minus
        (2^(23-P) + z) leaves lev - z. Fields that reach past bit 23 are read after one shift of the word that
        ends the top field at bit 23 (the same expression every step: computed once per word; the fields stay
        above bit 0, so shift and mask do not become a bit-field extract). Not ONE_SHIFT: each such field is
        shifted to bit 23 - b on its own (one instruction more a field, but no second copy of the word tile
        held in registers: the M = 1 kernel's irregular groups spilled on sm_80 with it)."""
        H: tl.constexpr = 16 // BITS
        MASK: tl.constexpr = (1 << BITS) - 1
        SH: tl.constexpr = 16 + H * BITS - 23
        P0: tl.constexpr = (e // 2) * BITS + 16 * (e % 2)
        P = P0 if P0 + BITS <= 23 else (P0 - SH if ONE_SHIFT else 23 - BITS)
        ws = w if P0 + BITS <= 23 else w >> (P0 - P)
        v = ((ws & (MASK << P)) | magic).to(tl.float32, bitcast=True)                     # 2^23 + lev * 2^P
        return tl.fma(v, 1.0 / (1 << P), -(zz + (1 << (23 - P))))

    @triton.jit
    def _zero_operands(zz, DTX: tl.constexpr):
        """-(2^p + z) for the 16-bit pair path (2^p = 1024 in fp16, 128 in bf16: the float whose last mantissa
        bit is 1) as float32 and, for the inline PTX, in both halves of an int32 (bf16's for float32
        activations, which do not take the pair path)."""
        HALF: tl.constexpr = tl.float16 if DTX == tl.float16 else tl.bfloat16
        zn = -(zz + (1024.0 if DTX == tl.float16 else 128.0))
        u = zn.to(HALF).to(tl.uint16, bitcast=True).to(tl.uint32)
        return zn, (u | (u << 16)).to(tl.int32, bitcast=True)

    @triton.jit
    def _pair_tile(w, zq, zn, h: tl.constexpr, BITS: tl.constexpr, ASM: tl.constexpr, DTX: tl.constexpr,
                   WBC: tl.constexpr, BLOCK_N: tl.constexpr):
        """Pair h of a [BLOCK_N, WB] word tile (output rows by words) as the [BLOCK_N, 2 WB] tile of lev - z in the
        activations' 16-bit float type, columns the pair's 2 WB consecutive k (2j and 2j + 1 sit in word j's
        halves: joined, they are already in k order). The pair's two fields, masked and OR-ed under the exponent
        of 2^p (one LOP3), read as the two floats 2^p + lev, and one HFMA2 adds -(2^p + z) to both, exactly:
        already the two-k register a tensor-core operand takes. On a GPU both as inline PTX (Triton emits two instructions for the mask and the exponent, two immediates, and
        its half-precision subtraction after the join costs two byte permutes a pair: counted by
        lrq.kernels.aot); the interpreter runs no PTX and computes the same values with Triton operations.
        zq: -(2^p + z) in both halves of an int32 (the PTX's operand); zn: the same in float32."""
        MASK2: tl.constexpr = ((1 << BITS) - 1) * 65537
        ws = w >> (h * BITS) if h > 0 else w
        if ASM:
            mask = tl.full((1, 1), MASK2, tl.int32)
            v = tl.inline_asm_elementwise(_ASM_F16 if DTX == tl.float16 else _ASM_BF16, "=r,r,r,r", [ws, zq, mask],
                                          dtype=tl.int32, is_pure=True, pack=1)
            lo = (v & 0xFFFF).to(tl.uint16).to(DTX, bitcast=True)
            hi = (v >> 16).to(tl.uint16).to(DTX, bitcast=True)
        else:
            v = (ws & MASK2) | (_MAGIC2_F16 if DTX == tl.float16 else _MAGIC2_BF16)
            lo = ((v & 0xFFFF).to(tl.uint16).to(DTX, bitcast=True).to(tl.float32) + zn).to(DTX)
            hi = ((v >> 16).to(tl.uint16).to(DTX, bitcast=True).to(tl.float32) + zn).to(DTX)
        return tl.reshape(tl.join(lo, hi), (BLOCK_N, 2 * WBC))

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
                      EVEN: tl.constexpr, BLOCK_N: tl.constexpr, WBC: tl.constexpr, STAGES: tl.constexpr):
        """M = 1 (the module docstring says how). `magic` is 0x4B000000 passed at run time: in a register, mask
        and OR are one LOP3 (two immediates take two). EVEN: N a multiple of BLOCK_N and K of the K block, no
        mask. Groups inside a K block end where known statically; groups of whole blocks at a block's end;
        other sizes (3 bits' 160-column blocks, groups of 128) are tested at every pair of 2 WB columns. STAGES:
        the K blocks' words go through shared memory by asynchronous copies, STAGES - 1 blocks ahead (a loop
        without tl.dot is pipelined only when asked), so a warp's next 8 KB are in flight while it computes."""
        H: tl.constexpr = 16 // BITS
        PW: tl.constexpr = 2 * WBC
        KB: tl.constexpr = H * PW
        ONE_SHIFT: tl.constexpr = GROUP == 0 or KB % GROUP == 0 or GROUP % KB == 0
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
        for b in tl.range(b_lo, b_hi, num_stages=STAGES):
            wp = w_ptr + (b * WBC + rj)[:, None] * N + cn
            w = (tl.load(wp) if EVEN else tl.load(wp, mask=c_ok, other=0)).to(tl.uint32, bitcast=True)
            for h in tl.static_range(H):
                k0 = b * KB + h * PW
                if GROUP != 0:
                    g = k0 // GROUP
                    g_ok = c_ok & (g * GROUP < K)       # pairs past K in the last block: no group to read
                    if (KB % GROUP == 0 and (h * PW) % GROUP == 0) or (GROUP % KB == 0 and h == 0) or \
                            (KB % GROUP != 0 and GROUP % KB != 0):   # a group's first pair (or not known)
                        z_n = _levels_f32(tl.load(z_ptr + g * N + cn, mask=g_ok, other=0), magic)
                # the pair's columns k0 + 2j (word j's low half) and k0 + 2j + 1 (its high half)
                if x_ptr.dtype.element_ty == tl.bfloat16:  # both as one 32-bit word: a bf16 is a float's top half
                    xi = b * (KB // 2) + h * WBC + rj        # (K is even here: this kernel takes K % 16 == 0)
                    xp = x_ptr.to(tl.pointer_type(tl.uint32)) + xi
                    xw = tl.load(xp) if EVEN else tl.load(xp, mask=xi < K // 2, other=0)
                    x_lo = (xw << 16).to(tl.float32, bitcast=True)
                    x_hi = (xw & 0xFFFF0000).to(tl.float32, bitcast=True)
                else:
                    xk = k0 + 2 * rj
                    if EVEN:
                        x_lo = tl.load(x_ptr + xk).to(tl.float32)
                        x_hi = tl.load(x_ptr + xk + 1).to(tl.float32)
                    else:
                        x_lo = tl.load(x_ptr + xk, mask=xk < K, other=0.0).to(tl.float32)
                        x_hi = tl.load(x_ptr + xk + 1, mask=xk + 1 < K, other=0.0).to(tl.float32)
                d = _tile_levels_minus_zero(w, z_n, 2 * h, BITS, magic, ONE_SHIFT)
                if GROUP != 0 and KB % GROUP == 0 and (h * PW) % GROUP == 0:
                    acc = x_lo[:, None] * d                # a group's first pair: a product, no zeroing
                else:
                    acc = tl.fma(x_lo[:, None], d, acc)
                acc = tl.fma(x_hi[:, None], _tile_levels_minus_zero(w, z_n, 2 * h + 1, BITS, magic, ONE_SHIFT),
                             acc)
                if GROUP != 0:
                    if KB % GROUP == 0:
                        if ((h + 1) * PW) % GROUP == 0:    # the group's last pair: its scale
                            out = _row_sums(acc, s_ptr + g * N + cn, g_ok, out)
                    elif GROUP % KB == 0:
                        if h == H - 1:                     # groups of whole blocks end at a block's end
                            if ((b + 1) * KB) % GROUP == 0:
                                out = _row_sums(acc, s_ptr + g * N + cn, g_ok, out)
                                acc = tl.zeros((WBC, BLOCK_N), dtype=tl.float32)
                    elif (k0 + PW) % GROUP == 0:
                        out = _row_sums(acc, s_ptr + g * N + cn, g_ok, out)
                        acc = tl.zeros((WBC, BLOCK_N), dtype=tl.float32)
        if GROUP == 0:
            out = _row_sums(acc, s_ptr + cn, c_ok, out)
        elif KB % GROUP != 0:   # a group cut by the end of this split (or of K): the last pair's group's scale
            out = _row_sums(acc, s_ptr + (tl.minimum(b_hi * KB, K) - 1) // GROUP * N + cn, c_ok, out)
        _gemv1_store(out, b_ptr, y_ptr, ws_ptr, cnt_ptr, cn, c_ok, pid_n, pid_k, HAS_BIAS, ATOMIC, BLOCK_N)

    @triton.jit
    def _group_zero(z_ptr, g, N, rn, g_ok, DTX: tl.constexpr):
        """Group g's zero points for the 16-token kernel: float32 [BLOCK_N, 1] and the pair path's operands."""
        zz = tl.load(z_ptr + g * N + rn, mask=g_ok, other=0).to(tl.float32)[:, None]
        zn, zq = _zero_operands(zz, DTX)
        return zz, zn, zq

    @triton.jit
    def _fields_tile(w, zz, h: tl.constexpr, BITS: tl.constexpr, DTX: tl.constexpr, BLOCK_N: tl.constexpr,
                     PW: tl.constexpr):
        """Pair h as [BLOCK_N, 2 WB] lev - z without the 16-bit pair trick (fp32 activations, 8 bits with bf16):
        each field a float (below 8 bits masked into the mantissa of 2^23 with the constant as an immediate: a
        run-time one staged the tile through shared memory; at 8 bits converted, which costs less than the
        two-immediate mask), the two fields joined in k order."""
        if BITS < 8:
            d0 = _tile_levels_minus_zero(w, zz, 2 * h, BITS, _MAGIC_F32)
            d1 = _tile_levels_minus_zero(w, zz, 2 * h + 1, BITS, _MAGIC_F32)
        else:
            d0 = ((w >> (h * BITS)) & 255).to(tl.float32) - zz
            d1 = ((w >> (16 + h * BITS)) & 255).to(tl.float32) - zz
        return tl.reshape(tl.join(d0, d1), (BLOCK_N, PW)).to(DTX)

    @triton.jit
    def _add_group(acc, acc_g, s_ptr, g, N, rn, g_ok):
        """acc + group g's scale (once per output column) times the group's unscaled sums."""
        return acc + tl.load(s_ptr + g * N + rn, mask=g_ok, other=0.0).to(tl.float32)[:, None] * acc_g

    @triton.jit
    def _gemv_kernel(x_ptr, w_ptr, s_ptr, z_ptr, b_ptr, y_ptr, M, N, K, stride_xm, stride_ym, kb_per_split,
                     BITS: tl.constexpr, GROUP: tl.constexpr, HAS_BIAS: tl.constexpr, ATOMIC: tl.constexpr,
                     UPCAST: tl.constexpr, PREC: tl.constexpr, FAST: tl.constexpr, ASM: tl.constexpr,
                     BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, WBC: tl.constexpr):
        """1 < M <= 16: y^T = W x^T, the weight tile built in registers as the MMA's A operand (the tokens, padded
        to 16, on its N side); one dot per pair of 2 WB columns, [BLOCK_N, 2 WB] of lev - z (exact in bf16/fp16)
        times x's contiguous [2 WB, 16] slice. FAST: the tile by `_pair_tile` (ASM: its inline PTX, the GPU's
        path); else `_fields_tile`. The scale multiplies the float32 product once per column: per channel at the
        end; groups (whole pairs) where they end (known statically when a K block holds whole groups)."""
        H: tl.constexpr = 16 // BITS
        PW: tl.constexpr = 2 * WBC
        KB: tl.constexpr = H * PW
        DTX: tl.constexpr = x_ptr.dtype.element_ty
        pid_n = tl.program_id(0)
        pid_m = tl.program_id(1)
        pid_k = tl.program_id(2)
        rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        rj = tl.arange(0, WBC)
        rp = tl.arange(0, PW)
        n_ok = rn < N
        m_ok = rm < M
        acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
        acc_g = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)    # groups: the current group's unscaled sums
        b_lo = pid_k * kb_per_split
        b_hi = tl.minimum(b_lo + kb_per_split, tl.cdiv(K, KB))
        zz = tl.zeros((BLOCK_N, 1), dtype=tl.float32)
        s_col = tl.zeros((BLOCK_N,), dtype=tl.float32)
        if GROUP == 0:
            s_col = tl.load(s_ptr + rn, mask=n_ok, other=0.0).to(tl.float32)
            zz = tl.load(z_ptr + rn, mask=n_ok, other=0).to(tl.float32)[:, None]
        zn, zq = _zero_operands(zz, DTX)
        for b in range(b_lo, b_hi):
            w = tl.load(w_ptr + (b * WBC + rj)[None, :] * N + rn[:, None], mask=n_ok[:, None], other=0)
            for h in tl.static_range(H):
                k0 = b * KB + h * PW
                rk = k0 + rp
                if GROUP != 0:
                    g = k0 // GROUP
                    g_ok = n_ok & (g * GROUP < K)     # pairs past K in the last block: no group to read
                    if KB % GROUP == 0:
                        if (h * PW) % GROUP == 0:     # the group's first pair: its zero points
                            zz, zn, zq = _group_zero(z_ptr, g, N, rn, g_ok, DTX)
                    else:   # every pair (a conditional load made Triton stage the tile through shared memory)
                        zz, zn, zq = _group_zero(z_ptr, g, N, rn, g_ok, DTX)
                if FAST:
                    wt = _pair_tile(w, zq, zn, h, BITS, ASM, DTX, WBC, BLOCK_N)
                else:
                    wt = _fields_tile(w, zz, h, BITS, DTX, BLOCK_N, PW)
                xt = tl.load(x_ptr + rm[None, :] * stride_xm + rk[:, None],
                             mask=m_ok[None, :] & (rk[:, None] < K), other=0.0)
                if UPCAST:   # the interpreter's tl.dot is wrong for bf16: multiply in float32 there
                    xt = xt.to(tl.float32)
                    wt = wt.to(tl.float32)
                if GROUP == 0:
                    acc = tl.dot(wt, xt, acc, input_precision=PREC)
                else:
                    acc_g = tl.dot(wt, xt, acc_g, input_precision=PREC)
                    if KB % GROUP == 0:
                        if ((h + 1) * PW) % GROUP == 0:   # the group's last pair: its scale, once per column
                            acc = _add_group(acc, acc_g, s_ptr, g, N, rn, g_ok)
                            acc_g = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
                    elif (k0 + PW) % GROUP == 0:
                        acc = _add_group(acc, acc_g, s_ptr, g, N, rn, g_ok)
                        acc_g = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
        if GROUP == 0:
            acc = acc * s_col[:, None]
        elif KB % GROUP != 0:   # a group cut by the end of this split (or of K): the last pair's group's scale
            acc = _add_group(acc, acc_g, s_ptr, (tl.minimum(b_hi * KB, K) - 1) // GROUP, N, rn, n_ok)
        if HAS_BIAS:
            bias = tl.load(b_ptr + rn, mask=n_ok & (pid_k == 0), other=0.0).to(tl.float32)
            acc += bias[:, None]
        ptrs = y_ptr + rm[None, :] * stride_ym + rn[:, None]
        ok = m_ok[None, :] & n_ok[:, None]
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
        return [("gemv", c, {**ce, "EVEN": _even(n, k, bits, c), "STAGES": c.num_stages})]
    fast = fast_pairs(bits, dtype)
    return [("gemv", c, {**ce, "UPCAST": False, "PREC": "ieee" if dtype == torch.float32 else "tf32",
                         "FAST": fast, "ASM": fast, "BLOCK_M": c.block_m})]


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
                            BLOCK_N=c.block_n, WBC=WB, STAGES=c.num_stages, num_warps=c.num_warps,
                            num_stages=c.num_stages)
        return y.reshape(*x.shape[:-1], n)
    y = (torch.zeros if atomic else torch.empty)(m, n, device=x2.device,
                                                 dtype=torch.float32 if atomic else x2.dtype)
    fast = fast_pairs(w.bits, x2.dtype)
    _gemv_kernel[grid](x2, w.words, w.scale, w.zero, b, y, m, n, k, x2.stride(0), y.stride(0), kbs,
                       BITS=w.bits, GROUP=group, HAS_BIAS=bias is not None, ATOMIC=atomic,
                       UPCAST=INTERPRET and x2.dtype == torch.bfloat16,
                       PREC="ieee" if x2.dtype == torch.float32 else "tf32", FAST=fast, ASM=fast and not INTERPRET,
                       BLOCK_M=c.block_m, BLOCK_N=c.block_n, WBC=WB, num_warps=c.num_warps,
                       num_stages=c.num_stages)
    return y.to(x2.dtype).reshape(*x.shape[:-1], n)
