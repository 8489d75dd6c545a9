"""The CPU form of packed weights: each format held once, in the layout the torch CPU kernel for it reads.

A PackedLinear converts its levels into one of these when it is packed or loaded on the CPU, never per call:

* `Int4Weights` (weights of 4 bits or fewer whose activations reach the kernel in floating point): torch's
  int4 GEMM (`_weight_int4pack_mm_for_cpu`) on its own packing (`_convert_weight_to_int4pack_for_cpu`, half a
  byte a weight; 3- and 2-bit levels are 4-bit levels that leave the top values unused). The kernel computes
  (q - 8) * scale + zero per group of 32/64/128/256 columns; ours, (q - z) * s, is that with zero = (8 - z) * s.
  Our groups, a ragged last one included, map exactly onto the largest kernel group dividing them; where none
  divides K, K is padded (zero input columns: exact). N is padded to the kernel's block of 16 and sliced off.
* `Int8Weights` (5 to 8 bits weight-only, and any group size the int4 kernel cannot represent): q - 2^(b-1) as
  int8 through `_weight_int8pack_mm`, one call per group (one in all per channel); the zero points add
  rowsum(x) * (2^(b-1) - z) * s.
* `Int4Int8Weights` (W4A8 with integer activations, per channel): an Int4Weights; at decode the dequantized
  activations through the int4 kernel, at prefill its levels as a transient int8 weight through oneDNN's quantized
  inner product (OneDNNOperand) or torch._int_mm (see the class).
* `Int8GemmWeights` (W8A8, more than 4 bits with integer activations, per channel): q - 2^(b-1) as int8,
  multiplied with the activation levels exactly (oneDNN's quantized inner product on a blocked copy of the levels
  made per call, OneDNNOperand, or torch._int_mm: int8 x int8 -> int32); the zero points are corrected in float32
  after it.

On a CPU with AMX (Intel Xeon 4th generation and later) a W8A8 or W4A8 prefill call runs lrq.native's own tile
kernel instead (`native_int8_linear`): the same exact integer product and float32 corrections, bit for bit, in one
call that reads the held weight a panel of 64 features at a time (no per-call copy of the whole weight, no float32
product in memory); a 4-bit weight-only bf16 prefill call likewise (`Int4Weights._amx_mm`: each panel dequantized
to the bf16 operand's values in cache, bf16 tile products). `LRQ_AMX=0` turns them off (an A/B measurement).
On a CPU whose oneDNN int8 GEMM is not exact (no VNNI or AMX: AMD Zen 2/3, Intel before Ice Lake; int_mm_ok) the
same call runs lrq.native's AVX2 integer kernel (`native_int8_linear`, the same values bit for bit: int16 products
for W8A8, unsigned-by-4-bit byte products for W4A8, neither able to saturate), instead of float32 GEMMs over slices;
a float32 W4A8 prefill then multiplies the activation levels too. `LRQ_AVX2_INT8=0` turns it off.

torch's int4/int8 weight kernels take bf16, fp16 or float32 inputs and return that dtype; each form holds its
scales in bf16 and float32 (they are small), and a float16 input runs in float32. Measured on a Zen 4 (AVX512-BF16),
one thread: bf16 is vectorized (the int4 GEMM 2x faster than bf16 BLAS at batch 1, 2.5x slower at 512 tokens);
float32 takes a scalar path, exact but 10 to 100x slower than float32 BLAS. The bf16 kernels round their output
to bf16, so a float32 input cannot be run as bf16 pieces to float32 accuracy.

So the 4-bit and int8 weight-only forms choose per call by the number of tokens (`DEQUANTIZE_FROM_M`,
`INT8_DEQUANTIZE_FROM_M`): below it torch's kernel; from it (prefill; every call in float32) the levels are read
straight out of the kernel's form into a transient float32 buffer, dequantized in place and run through the dense
GEMM (BLAS), the buffer dropped after the call. Still one copy of the weights held; the transient one is one
layer's, at prefill. A bf16 prefill call of a 4-bit layer writes that transient weight straight into oneDNN's own
blocked layout (`OneDNNOperand`, one reused buffer per shape) and runs oneDNN's inner product on it, as the
prepacked dense model does, where oneDNN lays weights out as lrq.native writes them (checked at a shape's first use).

Decode steps run lrq's own kernels where they are built (lrq.native, C compiled on the machine; torch's kernels
otherwise, and `LRQ_NATIVE=0` turns them off): a 4-bit layer's call of up to NATIVE_MAX_M tokens reads torch's
int4 packing as it is held (float32 inputs exactly, bf16 ones through AVX512-VNNI 16-bit integer dot products
where the CPU has them), and a W8A8 step on a static grid quantizes its activations, multiplies the levels exactly (VNNI or AVX2) and
corrects the zero points in one call (NATIVE_INT8_MAX_M). The scales they read are the (s, zc) pairs each
Int4Weights holds beside torch's bf16 (scale, zero) form, per group of the quantizer (`scale_group`: a 576-wide
layer at g128 has 5 such rows, the last one 64 wide, where torch's kernel repeats its scales per group of 64: 9
rows, 1 bit a weight read per token instead of 0.5), block by block, compactly where they fit (compact_scale_zero:
the packed model's fp16 scales and uint8 zero points, 3 bytes a feature and group against float32's 8; the C
kernels decode a block's at a time, the same values bit for bit: SmolLM2-135M's 210 g128 layers from huge pages on
a Zen 4 3.31 -> 2.67 ms a token); torch's float32 form is made only where its float32 kernel runs (a packing that
cannot be read back).
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import math
import os
import threading
import time
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

import lrq.native as native
from lrq.quant import _group_view

KERNEL_GROUPS = (256, 128, 64, 32)   # the group sizes torch's int4 CPU kernel accepts
N_BLOCK = 16                         # its output features come in blocks of 16
INT8_K_MULTIPLE = 16                 # _weight_int8pack_mm crashes or errs on other depths (torch 2.13, Zen 4)
# From how many tokens a 4-bit layer dequantizes its weight into a transient buffer and runs the dense GEMM instead
# of the int4 kernel, per activation dtype. Measured on a Zen 4 (AVX512-BF16), one thread, 576 x 1536 g128,
# interleaved (docs/packed-weights-and-export.md): bf16 int4 kernel 0.99 ms against 0.97 ms at 48 tokens, 2.6
# against 1.6 at 128, 10.5 against 5.0 at 512; float32 (the int4 kernel's scalar path) 1.5 against 0.44 ms already
# at 1 token. With the dequantization in lrq.native (one pass in C, 47 us for 1536 x 576 against torch's ops' 310),
# on a Zen 5 (cpu family 26, AVX512-BF16), one thread, 1536 x 576 g128, medians of 30 calls beside a long run on
# the other core: int4 kernel 0.16 / 0.32 / 0.47 ms at 16 / 32 / 48 tokens against 0.20 / 0.25 / 0.30 dequantized
# + GEMM (576 x 576: 0.061 / 0.119 against 0.080 / 0.103); so bf16 from 32 where lrq.native is built.
DEQUANTIZE_FROM_M = {torch.bfloat16: 48, torch.float32: 1}
NATIVE_DEQUANTIZE_FROM_M = {torch.bfloat16: 32, torch.float32: 1}
# The same for the int8 form (5-8-bit weight-only; W8A8/W4A8 where `_int_mm` is refused): `_weight_int8pack_mm` at
# 16 / 64 / 512 tokens 0.42 / 4.4 / 39.6 ms against 0.57 / 3.6 / 15.8 ms dequantized + GEMM (576 x 1536, loaded).
INT8_DEQUANTIZE_FROM_M = {torch.bfloat16: 32, torch.float32: 1}
# How a 4-bit layer runs a float32 call below DEQUANTIZE_FROM_M[bf16] tokens (a decode step of a model held in
# float32, what `--precision auto` picks on a CPU without native bf16): "exact" dequantizes a transient float32
# weight per call (torch's float32 int4 kernel is scalar); "bf16" rounds the activations to bf16 and runs the
# vectorized bf16 int4 kernel (AVX512 and AVX2 paths in torch), its output rounded to bf16: the rounding of a bf16
# model in those layers, several times faster; "i16" runs lrq.native's integer kernel (where it is built: AVX512-VNNI
# with VBMI, or AVX2 on torch's AVX2 packing; elsewhere "exact"), the bf16 models' path there: each token's
# activations as 16-bit integers per chunk of 256 (each rounded to within 2^-15 of its chunk's largest magnitude, 2^7
# finer than a bf16 rounding), the products summed exactly in int32, the output float32. On an Intel Xeon held to AVX2 its
# 4-bit layers took 4.1 ms a token against 5.1 "exact" (SmolLM2-135M g128, one thread). Set per model with
# lrq.packed.set_float32_decode.
FLOAT32_DECODE = ("exact", "bf16", "i16")
# Up to how many tokens a 4-bit layer runs lrq's own decode kernel (lrq.native) where it is built, per activation
# dtype: it streams the weight once per token, torch's bf16 int4 kernel and the dequantized GEMM reuse it across
# tokens. Measured on a Zen 4, one thread, 1536 x 576 g128 (interleaved): bf16 45.6 against torch's 47.7 us at one
# token, 82 against 60 at two; float32 156 us at 4 tokens against 440 dequantized + GEMM at one.
NATIVE_MAX_M = {torch.bfloat16: 1, torch.float32: 8}
# the batch OneDNNOperand asks oneDNN's reorder to lay a weight out for (any above one gives the same layout here)
PROBE_BATCH = 512
PROBE_PIECE = 1 << 20   # positions OneDNNOperand's probe compares at once
# the feature blocks of oneDNN's weight layouts lrq.native writes (OneDNNOperand.block_width): bf16 32 (an Intel Xeon
# with AMX) or 64 (AVX512-BF16 without AMX: an AMD Zen 4); int8 64
BLOCK_WIDTHS = {"bf16": (32, 64), "int8": (64,)}
# OneDNNOperand's check that oneDNN runs a kernel on it, not its reference implementation: rows it times, and how
# many times the plain operand's GEMM's time it may take (a reference implementation took 4,000x)
REFERENCE_ROWS, REFERENCE_RATIO = 2, 20
# The same for the W8A8 integer form (Int8GemmWeights): its decode step through lrq's int8 kernel up to this many
# tokens, torch._int_mm above.
NATIVE_INT8_MAX_M = 4
# The same for the 8-bit weight-only form per channel (Int8Weights: w8a16, an int8 output head): lrq's kernel up to
# this many tokens, torch's `_weight_int8pack_mm` or the dequantized GEMM above.
NATIVE_INT8W_MAX_M = 4
# lrq.native's AMX tile kernels for prefill calls (W8A8/W4A8: native_int8_linear; 4-bit weight-only bf16:
# Int4Weights._amx_mm), where the CPU and build have them; LRQ_AMX=0 keeps oneDNN's GEMMs. From AMX_FROM_M tokens
# (below it the call is a decode step).
AMX_PREFILL = os.environ.get("LRQ_AMX", "1") != "0"
# lrq.native's AVX2 integer kernel for W8A8/W4A8 prefill calls where oneDNN's int8 GEMM is not exact (not int_mm_ok):
# on an Intel Xeon held to AVX2 (ATEN/oneDNN/MKL capped, the C file built for haswell), 512 tokens, one thread, against
# the dense float32 GEMM (MKL at AVX2), interleaved medians: W8A8 1.40-1.45x, W4A8 2.1-2.3x (float32 GEMMs over
# slices: 0.8x).
AVX2_INT8_PREFILL = os.environ.get("LRQ_AVX2_INT8", "1") != "0"
AMX_FROM_M = NATIVE_INT8_MAX_M + 1
# 4-bit layers hold their scales and zero points compactly (compact_scale_zero: fp16 and uint8, 3 bytes a feature and
# group against float32's 8) where they fit; LRQ_COMPACT_SCALES=0 keeps float32 (an A/B measurement)
COMPACT_SCALES = os.environ.get("LRQ_COMPACT_SCALES", "1") != "0"
# float32 values per chunk when a 4-bit weight is dequantized into bf16 (Int4Weights.dequantized_t): 256 KiB.
DEQUANTIZE_CHUNK = 1 << 16


def _nbytes(*tensors: torch.Tensor) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def run_dtype(x: torch.Tensor) -> torch.Tensor:
    """x as a dtype the forms hold scales for (bf16 or float32), contiguous."""
    return (x if x.dtype == torch.bfloat16 else x.float()).contiguous()


def by_dtype(t: torch.Tensor) -> dict[torch.dtype, torch.Tensor]:
    return {torch.bfloat16: t.bfloat16().contiguous(), torch.float32: t.float().contiguous()}


def int4_grouping(k: int, group_size: int | None) -> tuple[int, int] | None:
    """(kernel group, padded K) representing our groups exactly, or None where no kernel group divides them."""
    fits = [g for g in KERNEL_GROUPS if group_size is None or group_size % g == 0]
    exact = [g for g in fits if k % g == 0]
    if exact or not fits:
        return (exact[0], k) if exact else None
    k_pad = -(-k // 32) * 32
    return next(g for g in fits if k_pad % g == 0), k_pad


def _int4pack(q: torch.Tensor) -> torch.Tensor:
    return torch.ops.aten._convert_weight_to_int4pack_for_cpu(q.to(torch.int32).contiguous(), 2)


def _nibbles(packed: torch.Tensor) -> torch.Tensor:
    p = packed.to(torch.int64)
    return torch.stack([p & 15, p >> 4], dim=-1).reshape(-1)


def _int4pack_source(n: int, k: int) -> torch.Tensor:
    """For each nibble of torch's int4 packing of an [n, k] matrix (low nibble first), the flat index of the level
    it holds: the packing is a permutation of nibbles, found by packing the base-16 digits of every index (so it
    follows whatever layout this torch and CPU use)."""
    idx = torch.arange(n * k, dtype=torch.int64).view(n, k)
    src = torch.zeros(n * k, dtype=torch.int64)
    for d in range(max(1, math.ceil(math.log2(n * k) / 4))):
        src |= _nibbles(_int4pack((idx >> 4 * d) & 15)) << 4 * d
    return src


def _unpack_int4pack_t(packed: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """The levels of torch's int4 CPU packing of an [n, k] matrix written, transposed, into out [k, n] (any dtype:
    the copy converts; default a new uint8 one). The packing, as torch 2.13 lays it out on the CPU: output features
    in blocks of B (k rows of B / 2 bytes, the low nibble feature j and the high one j + B / 2), then one block of
    the remaining n mod B features (k rows, the low nibble feature 2j and the high one 2j + 1); B is 64 where torch
    runs its AVX512 kernels and 32 with its AVX2 ones (`_pack_block`, found once per process by packing a probe).
    Int4Weights.build checks this reading against the levels it packed and keeps the int4 kernel alone where it
    differs (another torch's layout)."""
    return _unpack_blocks(packed, _pack_block() or LAYOUT_BLOCKS[0], out)


LAYOUT_BLOCKS = (64, 32)   # torch's int4 CPU packing: output features per block (AVX512, AVX2 kernels)


@functools.lru_cache(maxsize=None)
def _pack_block() -> int | None:
    """The block of torch's int4 CPU packing in this process (its kernels' instruction set decides), or None where
    neither known layout reads a probe back."""
    n, k = 2 * 64 + 16, 64
    q = (torch.arange(n * k).view(n, k) * 7 % 16).to(torch.int32)
    packed, levels = _int4pack(q), q.t().to(torch.uint8)
    return next((b for b in LAYOUT_BLOCKS if torch.equal(_unpack_blocks(packed, b), levels)), None)


def _unpack_blocks(packed: torch.Tensor, block: int, out: torch.Tensor | None = None) -> torch.Tensor:
    if out is None:
        out = torch.empty(packed.shape[1] * 2, packed.shape[0], dtype=torch.uint8)
    k, n = out.shape
    half, flat, full = block // 2, packed.reshape(-1), n // block * block
    if full:
        v = flat[:full * k // 2].view(full // block, k, half).transpose(0, 1)    # [k, blocks, B / 2]
        o = out[:, :full].view(k, full // block, 2, half)
        o[:, :, 0].copy_(v & 15)
        o[:, :, 1].copy_(v >> 4)
    if n > full:
        v = flat[full * k // 2:].view(k, (n - full) // 2)
        o = out[:, full:].view(k, (n - full) // 2, 2)
        o[..., 0].copy_(v & 15)
        o[..., 1].copy_(v >> 4)
    return out


def _block_order(fields: list[torch.Tensor], block: int) -> torch.Tensor:
    """Per-feature fields (uint8 [groups, n_pad, bytes a feature] each) in lrq.native's block order
    (cpu_gemv.c's block_scales): per block of `block` output features (the last one the n_pad mod block left), its
    groups one after the other, each the block's features' bytes of one field, then of the next; one uint8 vector."""
    ng, n_pad = fields[0].shape[:2]
    nb, cut = n_pad // block, n_pad // block * block
    full = torch.cat([f[:, :cut].reshape(ng, nb, block * f.shape[2]) for f in fields], dim=2).transpose(0, 1)
    rest = torch.cat([f[:, cut:].reshape(ng, (n_pad - cut) * f.shape[2]) for f in fields], dim=1)   # [groups, ...]
    return torch.cat([full.reshape(-1), rest.reshape(-1)])


def _block_fields(held: torch.Tensor, sizes: tuple[int, ...], groups: int, n_pad: int, block: int) -> list:
    """_block_order's vector (uint8) back as its fields, uint8 [groups, n_pad, size] each (`sizes`: their bytes a
    feature)."""
    nb, cut, step = n_pad // block, n_pad // block * block, sum(sizes)
    full = held[:groups * step * cut].view(nb, groups, step * block).transpose(0, 1)   # [groups, nb, ...]
    rest = held[groups * step * cut:].view(groups, step * (n_pad - cut))
    out, at = [], 0
    for size in sizes:
        a = full[..., at * block:(at + size) * block].reshape(groups, cut, size)
        b = rest[:, at * (n_pad - cut):(at + size) * (n_pad - cut)].reshape(groups, n_pad - cut, size)
        out.append(torch.cat([a, b], dim=1))
        at += size
    return out


def _bytes(t: torch.Tensor) -> torch.Tensor:
    """[groups, n_pad] values as uint8 [groups, n_pad, their bytes]."""
    return t.contiguous().view(torch.uint8).view(*t.shape, t.element_size())


def blocked_scale_zero(s: torch.Tensor, zc: torch.Tensor, block: int) -> torch.Tensor:
    """s and zc [groups, n_pad] as lrq.native's 4-bit kernels read them (_block_order): per block of `block` output
    features, its groups one after the other, each the block's s then its zc; one float32 vector. A decode step then
    reads a block's scales as one stream beside its levels (against two [groups, n_pad] arrays: 0.97x the time of a
    g128 model's 4-bit layers on a Zen 4)."""
    return _block_order([_bytes(s.float()), _bytes(zc.float())], block).view(torch.float32)


def compact_scale_zero(s: torch.Tensor, z: torch.Tensor, block: int) -> torch.Tensor | None:
    """s (scales) and z (zero points) [groups, n_pad] in blocked_scale_zero's order, compactly: per block and group its
    scales as fp16 then its zero points as uint8 (3 bytes a feature against 8; lrq.native decodes them a block at a
    time, zc = -z * s, exact in float32), as one uint8 vector; None where the values do not fit: scales that are not
    fp16 values (a checkpoint read back with float32 ones) or zero points that are not integers of 0..255."""
    s16 = s.to(torch.float16)
    if not (torch.equal(s16.float(), s.float()) and torch.equal(z.round(), z) and bool((z >= 0).all())
            and bool((z <= 255).all())):
        return None
    return _block_order([_bytes(s16), _bytes(z.to(torch.uint8))], block)


def scale_zero_rows(blocked: torch.Tensor, groups: int, n_pad: int, block: int) -> torch.Tensor:
    """blocked_scale_zero's vector (or compact_scale_zero's, decoded: zc = 0 - z * s, lrq.native's values) back as
    float32 [2, groups, n_pad] (s, zc)."""
    if blocked.dtype == torch.uint8:
        h, z = _block_fields(blocked, (2, 1), groups, n_pad, block)
        s = h.contiguous().view(torch.float16).view(groups, n_pad).float()
        return torch.stack([s, 0.0 - z.view(groups, n_pad).float() * s])
    s, zc = _block_fields(blocked.view(torch.uint8), (4, 4), groups, n_pad, block)
    return torch.stack([f.contiguous().view(torch.float32).view(groups, n_pad) for f in (s, zc)])


@dataclass
class Int4Weights:
    packed: torch.Tensor                          # uint8 [n_pad, k_pad / 2], torch's int4 CPU layout
    scales: torch.Tensor                          # bf16 [k_pad / group, n_pad, 2]: torch's (scale, zero) per group
    scale_zero: torch.Tensor                      # s and zc (weight = q * s + zc) block by block: uint8, fp16 s
    #                                               and uint8 z, 3 bytes a feature and group (compact_scale_zero),
    #                                               or where they do not fit so float32 [2 * groups * n_pad]
    #                                               (blocked_scale_zero); scale_zero_rows() gives [2, groups, n_pad]
    group: int                                    # torch's kernel group (its `scales` repeat ours where it is smaller)
    n: int
    k: int
    decodable: bool = False                       # the packing read back equals the levels (checked when built)
    float32_decode: str = "exact"                 # FLOAT32_DECODE: how a float32 call below the threshold runs
    block: int = LAYOUT_BLOCKS[0]                 # the packing's block of output features (_pack_block)
    scale_group: int = 0                          # scale_zero's group: the quantizer's (k_pad per channel; the last
    #                                               row of a layer it does not divide is shorter); 0: `group`
    native_args: tuple | None = field(default=None, repr=False, compare=False)   # native_mm's, made at its first call

    @classmethod
    def build(cls, q: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, group_size: int | None,
              compact: bool | None = None) -> "Int4Weights":
        """`compact`: the scales held as compact_scale_zero's fp16 and uint8 where they fit, else float32 (None:
        COMPACT_SCALES)."""
        n, k = q.shape
        g, k_pad = int4_grouping(k, group_size)
        n_pad = -(-n // N_BLOCK) * N_BLOCK
        levels = torch.full((n_pad, k_pad), 8, dtype=torch.int32)
        levels[:n, :k] = q
        ours = (torch.arange(k_pad // g) * g // (group_size or k_pad)).clamp(max=scale.shape[1] - 1)
        s, z = scale.float()[:, ours], zero.float()[:, ours]           # [n, kernel groups]
        sz = F.pad(torch.stack([s.t(), ((8 - z) * s).t()], dim=-1), (0, 0, 0, n_pad - n))   # [groups, n_pad, 2]
        packed = _int4pack(levels)
        decodable = torch.equal(_unpack_int4pack_t(packed), levels.t().to(torch.uint8))
        sg = group_size or k_pad
        mine = torch.arange(-(-k_pad // sg)).clamp(max=scale.shape[1] - 1)
        s, z = scale.float()[:, mine], zero.float()[:, mine]            # [n, our groups]
        s, z = F.pad(s.t(), (0, n_pad - n)), F.pad(z.t(), (0, n_pad - n))
        block = _pack_block() or LAYOUT_BLOCKS[0]
        held = compact_scale_zero(s, z, block) if (COMPACT_SCALES if compact is None else compact) else None
        if held is None:
            held = blocked_scale_zero(s, (8 - z) * s - 8 * s, block)
        return cls(packed, sz.bfloat16().contiguous(), held, g, n, k, decodable, block=block, scale_group=sg)

    def scale_zero_rows(self) -> torch.Tensor:
        """s and zc as [2, groups, n_pad] (a copy: scale_zero holds them block by block)."""
        n_pad, k_pad = self.packed.shape[0], self.packed.shape[1] * 2
        return scale_zero_rows(self.scale_zero, -(-k_pad // (self.scale_group or self.group)), n_pad, self.block)

    def native_for(self, m: int, dtype: torch.dtype) -> bool:
        """Whether a call of m tokens in `dtype` runs lrq's own decode kernel (lrq.native): m up to NATIVE_MAX_M
        (float32_decode "bf16" keeps torch's bf16 kernel), where it is built."""
        return (self.decodable and m <= NATIVE_MAX_M.get(dtype, 0) and not self.bf16_kernel_for(dtype, m)
                and native.library() is not None)

    def _native_layer(self) -> tuple:
        """The layer's constant arguments for lrq.native (a struct of pointers into the tensors it keeps alive), made
        once and remade only if the tensors are replaced."""
        args = self.native_args
        if args is None or args[3] is not self.packed or args[4] is not self.scale_zero:
            st = native.Int4Layer(self.packed.data_ptr(), self.scale_zero.data_ptr(), self.n, self.packed.shape[0],
                                  self.k, self.packed.shape[1] * 2, self.scale_group or self.group, self.block, 0,
                                  self.scale_zero.dtype == torch.uint8)
            args = self.native_args = (st, ctypes.addressof(st), native.library().lrq_int4_gemv, self.packed,
                                       self.scale_zero)
        # set on every call, in place: a fused decoder layer points at this struct, so a mode changed later reaches it
        args[0].x16 = self.float32_decode == "i16"
        return args

    def native_mm(self, x: torch.Tensor) -> torch.Tensor:
        """x [m, k] (bf16 or float32, rows of unit stride) through lrq's own kernel: [m, n] in x's dtype, each
        output summed in float32 (the levels' products exact) and rounded once."""
        args = self._native_layer()
        y = torch.empty(x.shape[0], self.n, dtype=x.dtype)
        rc = args[2](args[1], x.data_ptr(), x.dtype == torch.bfloat16, x.stride(0), y.data_ptr(), x.shape[0],
                     torch.get_num_threads())
        native.checked(rc, "int4 kernel")
        return y

    def _float32_scales(self) -> torch.Tensor:
        """torch's float32 (scale, zero) form [groups, n_pad, 2], made when asked (its float32 kernel runs only
        where the packing cannot be read back)."""
        s, zc = self.kernel_group_scale_zero()
        return torch.stack([s, zc + 8 * s], dim=-1).contiguous()

    def kernel_group_scale_zero(self) -> torch.Tensor:
        """scale_zero per torch's kernel group ([2, k_pad / group, n_pad]): its rows repeated where the quantizer's
        group is wider (each kernel group lies in one of ours: the kernel group divides both ours and k_pad)."""
        k_pad, sg = self.packed.shape[1] * 2, self.scale_group or self.group
        rows = self.scale_zero_rows()
        return rows if sg == self.group else rows[:, torch.arange(0, k_pad, self.group) // sg]

    def mm(self, x: torch.Tensor) -> torch.Tensor:
        xr = run_dtype(x)
        if xr.stride(-1) == 1 and self.native_for(xr.shape[0], xr.dtype):
            return self.native_mm(xr).to(x.dtype)
        k_pad = self.packed.shape[1] * 2
        if k_pad != self.k:
            xr = F.pad(xr, (0, k_pad - self.k))
        if self.bf16_kernel_for(xr.dtype, xr.shape[0]):
            y = torch._weight_int4pack_mm_for_cpu(xr.bfloat16(), self.packed, self.group, self.scales)
        elif self.decodable and xr.shape[0] >= self.dequantize_from(xr.dtype):
            y = self._amx_mm(xr)
            if y is None:
                y = self._blocked_mm(xr)
            if y is None:
                y = xr @ self.dequantized_t(xr.dtype)      # a transient [k_pad, n_pad] copy, dropped after the call
        else:
            scales = self.scales if xr.dtype == torch.bfloat16 else self._float32_scales()
            y = torch._weight_int4pack_mm_for_cpu(xr, self.packed, self.group, scales)
        return (y if y.shape[1] == self.n else y[:, :self.n]).to(x.dtype)

    @staticmethod
    def dequantize_from(dtype: torch.dtype) -> int:
        """From how many tokens a call dequantizes a transient operand for the dense GEMM (DEQUANTIZE_FROM_M, or
        NATIVE_DEQUANTIZE_FROM_M where lrq.native makes the operand)."""
        return (NATIVE_DEQUANTIZE_FROM_M if native.library() is not None else DEQUANTIZE_FROM_M)[dtype]

    def bf16_kernel_for(self, dtype: torch.dtype, m: int) -> bool:
        """Whether a float32 call of m tokens runs the bf16 int4 kernel (float32_decode "bf16", below the bf16
        dequantization threshold) instead of dequantizing per call."""
        return dtype == torch.float32 and self.float32_decode == "bf16" and m < DEQUANTIZE_FROM_M[torch.bfloat16]

    def dequantized_t(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The weight, transposed ([k_pad, n_pad], contiguous, the GEMM's operand as is): q * s + (zero - 8 s) per
        kernel group in float32, rounded once to `dtype`. Through lrq.native where it is built (one pass over the
        packed bytes, about 8x faster than torch's ops on a Zen 5: a prefill call's transient operand), else
        torch's ops (`dequantized_t_torch`); the two are equal bit for bit (a test checks)."""
        if dtype not in (torch.float32, torch.bfloat16):
            return self.dequantized_t_torch(dtype)
        out = self._native_unpack_t(native.UNPACK_BF16 if dtype == torch.bfloat16 else native.UNPACK_F32, dtype)
        return self.dequantized_t_torch(dtype) if out is None else out

    def _amx_mm(self, x: torch.Tensor) -> torch.Tensor | None:
        """x [m, k_pad] bf16 times the weight on AMX tiles (lrq.native's lrq_amx_bf16_linear: each panel of 64
        features dequantized into the tiles' order as the bf16 prefill operand's values, bf16 tile products summed in
        float32, rounded once): [m, n] bf16, or None where it does not run (no AMX here, LRQ_AMX=0, not bf16, a
        packing it does not take)."""
        if x.dtype != torch.bfloat16 or x.stride(-1) != 1 or x.shape[0] < AMX_FROM_M or not amx_ready():
            return None
        y = torch.empty(x.shape[0], self.n, dtype=torch.bfloat16)
        rc = native.library().lrq_amx_bf16_linear(self._native_layer()[1], x.data_ptr(), x.stride(0), x.shape[0],
                                                  self.n, y.data_ptr(), torch.get_num_threads())
        if rc == 1:
            return None
        native.checked(rc, "AMX bf16 kernel")
        return y

    def _blocked_mm(self, x: torch.Tensor) -> torch.Tensor | None:
        """x [m, k_pad] bf16 times the weight through oneDNN's bf16 inner product on an operand in its own blocked
        layout (OneDNNOperand), dequantized into it by lrq.native (UNPACK_BF16_BLOCKED): the GEMM the prepacked
        dense model runs, without oneDNN reordering a plain transient operand first. [m, n_pad], or None where this
        cannot run (not bf16, lrq.native or the oneDNN ops missing, another layout)."""
        lib = native.library()
        if x.dtype != torch.bfloat16 or lib is None or not x.is_contiguous():
            return None
        forms = {32: native.UNPACK_BF16_BLOCKED, 64: native.UNPACK_BF16_BLOCKED64}
        return OneDNNOperand.product("bf16", x, self.packed.shape[0], self.packed.shape[1] * 2,
                                     lambda at, width: self._unpack_into(at, forms[width]))

    def _unpack_into(self, address: int, form: int) -> None:
        """lrq_int4_unpack_t's `form` of this layer written at `address` (lrq.native built)."""
        native.checked(native.library().lrq_int4_unpack_t(self._native_layer()[1], address, form,
                                                          torch.get_num_threads()), "int4 unpacking")

    def offset_levels_t(self) -> torch.Tensor:
        """The levels less 8, transposed (int8 [k_pad, n_pad]): W4A8's transient operand for the int8 GEMM, through
        lrq.native where it is built, else read by torch's ops."""
        out = self._native_unpack_t(native.UNPACK_I8, torch.int8)
        if out is None:
            n_pad, k_pad = self.packed.shape[0], self.packed.shape[1] * 2
            out = _unpack_int4pack_t(self.packed, torch.empty(k_pad, n_pad, dtype=torch.int8)).sub_(8)
        return out

    def _native_unpack_t(self, form: int, dtype: torch.dtype) -> torch.Tensor | None:
        """lrq_int4_unpack_t's `form` of the packing ([k_pad, n_pad] in `dtype`, one pass in C), or None where
        lrq.native is not built or the packing cannot be read back."""
        lib = native.library() if self.decodable else None
        if lib is None:
            return None
        out = torch.empty(self.packed.shape[1] * 2, self.packed.shape[0], dtype=dtype)
        native.checked(lib.lrq_int4_unpack_t(self._native_layer()[1], out.data_ptr(), form, torch.get_num_threads()),
                       "int4 unpacking")
        return out

    def dequantized_t_torch(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """dequantized_t with torch's ops: the levels read straight from the kernel's packing, then
        q * s + (zero - 8 s) per kernel group (addcmul, float32 scales). In float32 in one pass, in place; in another
        dtype in chunks of whole kernel groups (as many as fit DEQUANTIZE_CHUNK float32 values, one at least: a
        float32 piece the core's L2 cache holds) written into the output, each value rounded once: the same values
        as the float32 weight cast (a test checks), in half the time of the cast on a Zen 4. (Computing in bf16 from
        the kernel's bf16 scales was as slow and erred 1.5x more: not kept.)"""
        n_pad, k_pad = self.packed.shape[0], self.packed.shape[1] * 2
        sz = self.kernel_group_scale_zero()
        s, zero = sz[0], sz[1][:, None]                                 # [k_pad / group, n_pad] each, contiguous
        if dtype == torch.float32:
            w = _unpack_int4pack_t(self.packed, torch.empty(k_pad, n_pad))
            v = w.view(-1, self.group, n_pad)
            torch.addcmul(zero, v, s[:, None], out=v)
            return w
        levels = _unpack_int4pack_t(self.packed).view(-1, self.group, n_pad)
        out = torch.empty(k_pad, n_pad, dtype=dtype)
        o, step = out.view(-1, self.group, n_pad), max(1, DEQUANTIZE_CHUNK // (self.group * n_pad))
        for i in range(0, levels.shape[0], step):
            o[i:i + step] = torch.addcmul(zero[i:i + step], levels[i:i + step], s[i:i + step, None])
        return out

    def levels(self) -> torch.Tensor:
        n_pad, k_pad = self.packed.shape[0], self.packed.shape[1] * 2
        if self.decodable:
            return _unpack_int4pack_t(self.packed)[:self.k, :self.n].t().contiguous()
        q = torch.empty(n_pad * k_pad, dtype=torch.uint8)
        q[_int4pack_source(n_pad, k_pad)] = _nibbles(self.packed).to(torch.uint8)
        return q.view(n_pad, k_pad)[:self.n, :self.k].contiguous()

    def nbytes(self) -> int:
        return _nbytes(self.packed, self.scales, self.scale_zero)


class OneDNNOperand:
    """A weight operand in oneDNN's own blocked layout, one per kind and shape, reused by every layer of that
    shape at prefill (one for the process; a call while another thread holds it runs its plain operand): lrq.native
    writes each layer's weight into it and oneDNN reads it as it is, as a prepacked
    weight, instead of reordering a plain transient operand on every call. It holds no weight of its own: a buffer of
    one layer's size per shape, like an activation buffer, kept for the process once made (SmolLM2-135M's four
    shapes: 5.3 MB in bf16 and 2.7 MB in int8; a 7B model's largest bf16 shape alone is 86 MB, the size of the
    transient operand it replaces). Two kinds:

    * "bf16": a 4-bit layer's dequantized weight (UNPACK_BF16_BLOCKED, [n / 32][k / 2][32][2], on an Intel Xeon with
      AMX; UNPACK_BF16_BLOCKED64, [n / 64][k / 2][64][2], where oneDNN runs AVX512-BF16 without AMX, an AMD Zen 4)
      or an 8-bit one's (lrq_int8w_unpack's forms 2 and 3) for oneDNN's bf16 inner product
      (torch.ops.mkldnn._linear_pointwise, the op torch.compile's frozen CPU graphs and the prepacked dense baseline
      run). On a 2-core Intel Xeon with AMX a 512 x 576 x 1536 GEMM took 842 us from the plain
      operand against 697 from the blocked one;
    * "int8": the int8 levels of W8A8 (lrq_int8_blocked) or W4A8 (UNPACK_I8_BLOCKED), [n / 64][k / 4][64][4] and
      the negated sums of each feature's levels, for oneDNN's quantized inner product
      (torch.ops.onednn.qlinear_pointwise with unit scales and no zero points: the exact int32 product, returned as
      float32, exact where it is below 2^24 in size and else rounded once, 6e-8 relative, as the float32
      corrections after it are). The same GEMM took 631 us there against torch._int_mm's 1,137.

    The layout is read off, not assumed: at a shape's first use, four reorders of weights whose values encode their
    own row and column (integers below 128, exact in bf16 and int8) must place every value where lrq.native writes
    it (and, for int8, a weight's compensation must be its negated row sums), and oneDNN's product on it must not be
    its reference implementation (`_runs_a_kernel`); a torch or oneDNN that lays it out otherwise, lacks the ops or
    runs no kernel of its own on it gets None, and the caller its plain operand."""
    _ok: dict[tuple[str, int, int], int] = {}
    _operands: dict[tuple[str, int, int], tuple] = {}
    _lock = threading.Lock()

    @staticmethod
    def _ops_exist(kind: str) -> bool:
        try:
            mk = torch.ops.mkldnn
            if not (torch.backends.mkldnn.is_available() and hasattr(mk, "data_ptr") and hasattr(mk, "_nbytes")):
                return False
            if kind == "bf16":
                return (mk._is_mkldnn_bf16_supported() and hasattr(mk, "_reorder_linear_weight")
                        and hasattr(mk, "_linear_pointwise"))
            return (hasattr(torch.ops.onednn, "qlinear_prepack") and hasattr(torch.ops.onednn, "qlinear_pointwise")
                    and int_mm_ok())   # oneDNN's int8 products exact here (VNNI/AMX; not AVX2's int16 sums)
        except (AttributeError, RuntimeError):
            return False

    @staticmethod
    def reorder(kind: str, w: torch.Tensor, batch: int = PROBE_BATCH) -> torch.Tensor:
        """oneDNN's own reorder of a plain [n, k] weight for `batch` rows: "int8" for its quantized inner product,
        "bf16" for its floating-point one (a bf16 or float32 weight; the prepacked dense baseline's too)."""
        if kind == "bf16":
            return torch.ops.mkldnn._reorder_linear_weight(w, batch)
        return torch.ops.onednn.qlinear_prepack(w, [batch, w.shape[1]])

    @staticmethod
    def linear(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        """x [m, k] (bf16 or float32) times a bf16/float32 weight in oneDNN's layout (`reorder`), plus bias."""
        return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")

    @classmethod
    def layout_matches(cls, kind: str, n: int, k: int) -> bool:
        return cls.block_width(kind, n, k) > 0

    @classmethod
    def block_width(cls, kind: str, n: int, k: int) -> int:
        """How many features a block of oneDNN's layout of an [n, k] weight of `kind` holds where lrq.native writes
        that layout (bf16: 32 on an Intel Xeon with AMX, 64 with AVX512-BF16 alone, an AMD Zen 4; int8: 64), else 0
        (probed once per shape)."""
        key = (kind, n, k)
        if key not in cls._ok:
            shape_ok = n % 32 == 0 and k % 2 == 0 if kind == "bf16" else n % 64 == 0 and k % 4 == 0
            width = cls._probe(kind, n, k) if shape_ok and cls._ops_exist(kind) else 0
            cls._ok[key] = width if width and cls._runs_a_kernel(kind, n, k) else 0
        return cls._ok[key]

    @classmethod
    def _runs_a_kernel(cls, kind: str, n: int, k: int) -> bool:
        """Whether oneDNN's product on this blocked operand runs one of its kernels rather than its reference
        implementation, read off the time of a few rows against the plain operand's GEMM (torch._int_mm for "int8",
        torch's bf16 matmul), the fastest of three calls each after one to warm up: refused where above
        REFERENCE_RATIO times it. With int8 activations on a CPU with VNNI but no AMX (an AMD Zen 4) this torch's
        oneDNN runs its reference: 9.5 s for a 512 x 576 x 1536 product torch._int_mm makes in 2.2 ms."""
        dtype = torch.bfloat16 if kind == "bf16" else torch.int8
        op = cls.reorder(kind, torch.zeros(n, k, dtype=dtype))
        x, w_t = torch.zeros(REFERENCE_ROWS, k, dtype=dtype), torch.zeros(k, n, dtype=dtype)
        if kind == "bf16":
            blocked, plain = (lambda: cls.linear(x, op)), (lambda: x @ w_t)
        else:
            ones, zeros = torch.ones(n), torch.zeros(n, dtype=torch.long)
            blocked = lambda: torch.ops.onednn.qlinear_pointwise(x, 1.0, 0, op, ones, zeros, None, 1.0, 0,  # noqa: E731
                                                                 torch.float32, "none", [], "")
            plain = lambda: _int_mm(x, w_t)                                                             # noqa: E731

        def fastest(fn) -> float:
            times = []
            for _ in range(4):
                t0 = time.perf_counter()
                fn()
                times.append(time.perf_counter() - t0)
            return min(times[1:])
        return fastest(blocked) <= REFERENCE_RATIO * fastest(plain)

    @staticmethod
    def _raw(t: torch.Tensor, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
        nbytes = torch.ops.mkldnn._nbytes(t)
        buf = (ctypes.c_uint8 * nbytes).from_address(torch.ops.mkldnn.data_ptr(t))
        return torch.frombuffer(bytearray(buf), dtype=torch.uint8).view(dtype)

    @classmethod
    def _probe(cls, kind: str, n: int, k: int) -> int:
        """The block width (BLOCK_WIDTHS) with which oneDNN lays an [n, k] weight of `kind` out as lrq.native writes
        it, or 0: four reorders, one at a time, of weights holding their row mod 128, row // 128, column mod 128,
        column // 128 (exact in bf16 and int8), each compared in pieces with where each candidate's blocked order
        puts them (a 7B model's largest layer at a time, not four)."""
        dtype = torch.bfloat16 if kind == "bf16" else torch.int8
        kb = 2 if kind == "bf16" else 4
        widths = [nb for nb in BLOCK_WIDTHS[kind] if n % nb == 0]
        rows, cols = torch.arange(n, dtype=torch.int32)[:, None], torch.arange(k, dtype=torch.int32)[None, :]
        for of_rows, part in ((True, lambda v: v % 128), (True, lambda v: v // 128), (False, lambda v: v % 128),
                              (False, lambda v: v // 128)):
            w = part(rows if of_rows else cols).expand(n, k).to(dtype).contiguous()
            raw = cls._raw(cls.reorder(kind, w), dtype)
            del w
            if raw.numel() != n * k + (0 if kind == "bf16" else 4 * n):
                return 0
            for p0 in range(0, n * k, PROBE_PIECE):
                if not widths:
                    return 0
                p1 = min(p0 + PROBE_PIECE, n * k)
                pos, got = torch.arange(p0, p1, dtype=torch.int64), raw[p0:p1].to(torch.int64)
                widths = [nb for nb in widths
                          if torch.equal(got, part((pos // (nb * k)) * nb + (pos // kb) % nb if of_rows
                                                   else ((pos // (kb * nb)) % (k // kb)) * kb + pos % kb))]
        if not widths:
            return 0
        if kind == "int8":   # the compensation after the levels: each feature's negated sum
            w = torch.randint(-128, 128, (n, k), dtype=torch.int8, generator=torch.Generator().manual_seed(0))
            tail = cls._raw(cls.reorder(kind, w), torch.uint8)[n * k:].view(torch.int32)
            if not torch.equal(tail, -w.sum(dim=1, dtype=torch.int32)):
                return 0
        return widths[0]

    @classmethod
    def scratch(cls, kind: str, n: int, k: int) -> tuple | None:
        """The process's (operand, its data address, unit scales, zero points) for an [n, k] weight of `kind` (made
        at the shape's first use), or None where the layout does not match. A caller writes it only while it holds
        it (`borrowed`)."""
        if not cls.layout_matches(kind, n, k):
            return None
        if (kind, n, k) not in cls._operands:
            t = cls.reorder(kind, torch.zeros(n, k, dtype=torch.bfloat16 if kind == "bf16" else torch.int8))
            cls._operands[(kind, n, k)] = (t, torch.ops.mkldnn.data_ptr(t), torch.ones(n),
                                           torch.zeros(n, dtype=torch.long))
        return cls._operands[(kind, n, k)]

    @classmethod
    @contextlib.contextmanager
    def borrowed(cls, kind: str, n: int, k: int):
        """The operand (`scratch`'s tuple) for the duration of one call, or None where the layout does not match or
        another thread holds the operands (that call then runs its plain operand: one buffer per shape for the
        process, never one per thread)."""
        if not cls.layout_matches(kind, n, k) or not cls._lock.acquire(blocking=False):
            yield None
            return
        try:
            yield cls.scratch(kind, n, k)
        finally:
            cls._lock.release()

    @classmethod
    def product(cls, kind: str, x: torch.Tensor, n: int, k: int, write) -> torch.Tensor | None:
        """x (contiguous [m, k]: bf16, or int8 for "int8") times the [n, k] weight that `write(address, width)` puts
        into the operand (width: its block_width): bf16 [m, n] from oneDNN's bf16 inner product, or the exact integer
        product as float32 from its quantized one (unit scales, no zero points). None where the operand is not to be
        had (`borrowed`)."""
        with cls.borrowed(kind, n, k) as entry:
            if entry is None:
                return None
            op, address, ones, zeros = entry
            write(address, cls.block_width(kind, n, k))
            if kind == "bf16":
                return cls.linear(x, op)
            return torch.ops.onednn.qlinear_pointwise(x, 1.0, 0, op, ones, zeros, None, 1.0, 0, torch.float32,
                                                      "none", [], "")


def _offset_weights(q: torch.Tensor, bits: int) -> tuple[torch.Tensor, int]:
    """q - 2^(b-1) as int8 (any b <= 8), and the offset."""
    offset = 1 << (bits - 1)
    return (q.to(torch.int16) - offset).to(torch.int8), offset


@dataclass
class Int8Weights:
    chunks: tuple[torch.Tensor, ...]              # int8 [n, group width padded to 16] per group: q - offset
    widths: tuple[int, ...]                       # each group's true width (the padding: zero weights)
    scales: torch.Tensor                          # float32 [n_groups, n]
    unit: dict[torch.dtype, torch.Tensor]         # ones [n]: the kernel's scales (ours multiply its output)
    zero_term: torch.Tensor                       # float32 [n_groups, n]: (offset - z) * s
    group_size: int | None
    offset: int

    @classmethod
    def build(cls, q: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, bits: int,
              group_size: int | None) -> "Int8Weights":
        k = q.shape[1]
        w, offset = _offset_weights(q, bits)
        edges = list(range(0, k, group_size or k)) + [k]
        chunks = tuple(F.pad(w[:, a:b], (0, -(b - a) % INT8_K_MULTIPLE)).contiguous() for a, b in zip(edges, edges[1:]))
        widths = tuple(b - a for a, b in zip(edges, edges[1:]))
        s = scale.float()
        return cls(chunks, widths, s.t().contiguous(), by_dtype(torch.ones(q.shape[0])),
                   ((offset - zero.float()) * s).t().contiguous(), group_size, offset)

    @property
    def per_channel(self) -> bool:
        """One group a row (w8a16, an int8 head): the form lrq.native's int8 weight-only kernels take."""
        return len(self.chunks) == 1

    def _native_weight(self) -> tuple:
        """lrq.native's int8 weight-only arguments for a per-channel form: levels, their row stride, scales, zero
        terms."""
        (w,) = self.chunks
        return w.data_ptr(), w.stride(0), self.scales.data_ptr(), self.zero_term.data_ptr()

    def native_for(self, m: int, dtype: torch.dtype) -> bool:
        """Whether a call of m tokens in `dtype` runs lrq's own int8 weight-only kernel (per channel only)."""
        return (self.per_channel and m <= NATIVE_INT8W_MAX_M and dtype in (torch.bfloat16, torch.float32)
                and native.library() is not None)

    def native_mm(self, x: torch.Tensor) -> torch.Tensor:
        """x [m, k] (bf16 or float32, unit stride) -> [m, n] in x's dtype: lrq_int8w_gemv, the products and
        the zero points' term summed in float32 and rounded once."""
        m, n = x.shape[0], self.chunks[0].shape[0]
        y = torch.empty(m, n, dtype=x.dtype)
        rc = native.library().lrq_int8w_gemv(*self._native_weight(), x.data_ptr(), x.dtype == torch.bfloat16,
                                             x.stride(0), y.data_ptr(), m, n, self.widths[0], torch.get_num_threads())
        native.checked(rc, "int8 weight-only kernel")
        return y

    def mm(self, x: torch.Tensor) -> torch.Tensor:
        if self.native_for(x.shape[0], x.dtype) and x.stride(-1) == 1:
            return self.native_mm(x)
        xr, y, a = run_dtype(x), 0, 0
        if xr.shape[0] >= INT8_DEQUANTIZE_FROM_M[xr.dtype]:   # a transient dense weight, dropped after the call
            y = self._amx_mm(xr)
            y = self._blocked_mm(xr) if y is None else y
            return (F.linear(xr, self.dequantized(xr.dtype)) if y is None else y).to(x.dtype)
        for j, (w, width) in enumerate(zip(self.chunks, self.widths)):
            xj = F.pad(xr[:, a:a + width], (0, w.shape[1] - width)).contiguous()
            y = y + torch._weight_int8pack_mm(xj, w, self.unit[xr.dtype]).float() * self.scales[j]
            a += width
        sums = _group_view(x.float(), self.group_size, 0.0).sum(-1)     # [m, n_groups]
        return (y + sums @ self.zero_term).to(x.dtype)

    def _amx_mm(self, x: torch.Tensor) -> torch.Tensor | None:
        """A bf16 prefill call per channel on AMX tiles (lrq_amx_bf16_int8w_linear: each panel of 64 features
        dequantized in cache into the tiles' order, `dequantized`'s bf16 values, tile products summed in float32,
        rounded once): [m, n] bf16, or None where it does not run (no AMX, LRQ_AMX=0, n not a multiple of 64 or k of
        32, a decode-sized call)."""
        n, k = self.chunks[0].shape[0], self.widths[0]
        if (x.dtype != torch.bfloat16 or not self.per_channel or x.stride(-1) != 1 or x.shape[0] < AMX_FROM_M
                or n % 64 or k % 32 or not amx_ready()):
            return None
        y = torch.empty(x.shape[0], n, dtype=torch.bfloat16)
        rc = native.library().lrq_amx_bf16_int8w_linear(*self._native_weight(), x.data_ptr(), x.stride(0), x.shape[0],
                                                        n, k, y.data_ptr(), torch.get_num_threads())
        if rc == 1:
            return None
        native.checked(rc, "AMX bf16 int8 kernel")
        return y

    def _blocked_mm(self, x: torch.Tensor) -> torch.Tensor | None:
        """A bf16 prefill call per channel through oneDNN's bf16 inner product on an operand in its blocked layout
        (OneDNNOperand), dequantized into it by lrq.native (lrq_int8w_unpack's form 2: the values `dequantized`
        makes, rounded to bf16): the GEMM the prepacked dense model runs. [m, n] bf16, or None where it cannot run."""
        if x.dtype != torch.bfloat16 or native.library() is None or not self.per_channel or not x.is_contiguous():
            return None
        return OneDNNOperand.product("bf16", x, self.chunks[0].shape[0], self.widths[0],
                                     lambda at, width: self._unpack_into(at, 3 if width == 64 else 2))

    def _unpack_into(self, address: int, form: int) -> None:
        """lrq_int8w_unpack's `form` of this per-channel weight written at `address` (lrq.native built)."""
        native.checked(native.library().lrq_int8w_unpack(*self._native_weight(), self.chunks[0].shape[0],
                                                         self.widths[0], address, form, torch.get_num_threads()),
                       "int8 unpacking")

    def dequantized(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The weight [n, k]: (q - offset) * s + (offset - z) * s per group, in float32, cast once to `dtype`: one
        lrq.native pass per channel (lrq_int8w_unpack, the same values), else torch's ops (`dequantized_torch`)."""
        if native.library() is None or not self.per_channel or dtype not in (torch.float32, torch.bfloat16):
            return self.dequantized_torch(dtype)
        out = torch.empty(self.chunks[0].shape[0], self.widths[0], dtype=dtype)
        self._unpack_into(out.data_ptr(), int(dtype == torch.bfloat16))
        return out

    def dequantized_torch(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """`dequantized` with torch's ops."""
        out = torch.empty(self.chunks[0].shape[0], sum(self.widths))
        a = 0
        for j, (w, width) in enumerate(zip(self.chunks, self.widths)):
            out[:, a:a + width].copy_(w[:, :width]).mul_(self.scales[j][:, None]).add_(self.zero_term[j][:, None])
            a += width
        return out if dtype == torch.float32 else out.to(dtype)

    def levels(self) -> torch.Tensor:
        w = torch.cat([c[:, :width] for c, width in zip(self.chunks, self.widths)], dim=1)
        return (w.to(torch.int16) + self.offset).to(torch.uint8)

    def nbytes(self) -> int:
        return _nbytes(*self.chunks, self.scales, *self.unit.values(), self.zero_term)


def _int8_corrected(acc: torch.Tensor, rowsum: torch.Tensor, x_zero: torch.Tensor, x_scale: torch.Tensor,
                    col_term: torch.Tensor, zero_term: torch.Tensor, scale: torch.Tensor,
                    asymmetric: bool, out_dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The float32 output of an int8 x int8 -> int32 GEMM acc = xa @ wa (wa = q - offset; or its float32 value, as
    oneDNN's quantized inner product returns it: OneDNNOperand):
    sum_k (xq - az)(q - z) = sum xa*wa + (offset - z) sum xa - (az - 128) (sum wa + k (offset - z)).
    The GEMM is exact in int32; the two corrections are added in float32 (one rounding each, relative 6e-8) and
    the scales multiplied: four operations after the GEMM (rowsum = sum xa per row, float32 [m, 1], is computed
    once for every linear reading the same activations), because at one token a layer's cost is the count of its
    operations. Where lrq.native is built the same operations run in one pass (lrq_int8_correct, bit for bit: a
    test checks), written in `out_dtype` (bf16: the float32 result rounded once, as its cast would); else torch's,
    in float32 (the caller casts)."""
    lib = native.library()
    m, n = acc.shape
    xz, xs = (torch.as_tensor(v, dtype=torch.float32).reshape(-1) for v in (x_zero, x_scale))
    if (lib is not None and acc.dtype in (torch.int32, torch.float32) and acc.stride(-1) == 1 and acc.device.type == "cpu"
            and out_dtype in (torch.float32, torch.bfloat16) and xz.numel() in (1, m) and xs.numel() in (1, m)):
        xz, xs, rs = xz.contiguous(), xs.contiguous(), rowsum.reshape(-1).float().contiguous()
        y = torch.empty(m, n, dtype=out_dtype)
        lib.lrq_int8_correct(acc.data_ptr(), acc.stride(0), m, n, rs.data_ptr(), xz.data_ptr(), xz.numel() > 1,
                             xs.data_ptr(), xs.numel() > 1, col_term.data_ptr(), zero_term.data_ptr(), asymmetric,
                             scale.data_ptr(), y.data_ptr(), out_dtype == torch.bfloat16, torch.get_num_threads(),
                             acc.dtype == torch.float32)
        return y
    return _int8_corrected_torch(acc, rowsum, x_zero, x_scale, col_term, zero_term, scale, asymmetric)


def _int8_corrected_torch(acc: torch.Tensor, rowsum: torch.Tensor, x_zero: torch.Tensor, x_scale: torch.Tensor,
                          col_term: torch.Tensor, zero_term: torch.Tensor, scale: torch.Tensor,
                          asymmetric: bool) -> torch.Tensor:
    """_int8_corrected with torch's ops (float32)."""
    y = torch.addcmul(acc.float(), x_zero, col_term, value=-1)   # |acc| < k 2^14: int32 to k = 131,072
    if asymmetric:
        y.addcmul_(rowsum, zero_term)
    return y.mul_(x_scale).mul_(scale)


def amx_ready() -> bool:
    """Whether prefill calls run lrq.native's AMX tile kernels here (AMX_PREFILL, the build and the CPU)."""
    lib = native.library()
    return AMX_PREFILL and lib is not None and bool(lib.lrq_amx_ready())


def int8_prefill_kernel() -> str | None:
    """Which lrq.native kernel runs a W8A8/W4A8 prefill call here: "amx" (AMX tiles), "avx2" (AVX2 integer products
    that cannot saturate, where oneDNN's int8 GEMM is not exact: int_mm_ok), or None (oneDNN's GEMM or torch's)."""
    if amx_ready():
        return "amx"
    if AVX2_INT8_PREFILL and native.library() is not None and not int_mm_ok():
        return "avx2"
    return None


def native_int8_linear(xa: torch.Tensor, x_zero, x_scale, rowsum: torch.Tensor, n: int, col_term: torch.Tensor,
                       zero_term: torch.Tensor, scale: torch.Tensor, asymmetric: bool, out_dtype: torch.dtype,
                       weight: torch.Tensor | None = None, layer: int | None = None) -> torch.Tensor | None:
    """_int8_corrected(xa @ w.T, ...) in one lrq.native call (int8_prefill_kernel's: lrq_amx_int8_linear on AMX
    tiles or lrq_avx2_int8_linear; bit for bit the same values): w the int8 levels `weight` [n, k] (W8A8) or the
    4-bit packing whose native layer struct is at `layer` (W4A8, its levels less 8). [m, n] in `out_dtype` (bf16 or
    float32), or None where no such kernel runs (neither here, LRQ_AMX=0 / LRQ_AVX2_INT8=0, a shape or packing it
    does not take: AMX k a multiple of 64, AVX2 of 4, n_pad of 64 for both; a decode-sized call, another dtype)."""
    m, k = xa.shape
    kernel = int8_prefill_kernel()
    if (kernel is None or m < AMX_FROM_M or k % (64 if kernel == "amx" else 4) or xa.stride(-1) != 1
            or out_dtype not in (torch.float32, torch.bfloat16)):
        return None
    xz, xs = (torch.as_tensor(v, dtype=torch.float32).reshape(-1).contiguous() for v in (x_zero, x_scale))
    if xz.numel() not in (1, m) or xs.numel() not in (1, m):
        return None
    rs = rowsum.reshape(-1).float().contiguous()
    y = torch.empty(m, n, dtype=out_dtype)
    lib = native.library()
    fn = lib.lrq_amx_int8_linear if kernel == "amx" else lib.lrq_avx2_int8_linear
    rc = fn(xa.data_ptr(), xa.stride(0), m, k, None if weight is None else weight.data_ptr(), layer, n, rs.data_ptr(),
            xz.data_ptr(), xz.numel() > 1, xs.data_ptr(), xs.numel() > 1, col_term.data_ptr(), zero_term.data_ptr(),
            asymmetric, scale.data_ptr(), y.data_ptr(), out_dtype == torch.bfloat16, torch.get_num_threads())
    if rc == 1:
        return None
    native.checked(rc, f"{kernel} int8 kernel")
    return y


EXACT_FLOAT_K = 1024   # int8 x int8 products summed over 1024 terms stay below 2^24: exact in float32


def _int_mm_available() -> bool:
    """Whether torch._int_mm exists here and is exact over the full int8 range. Without AVX-512 VNNI/AMX
    (an AMD Zen 3, or any CPU at AVX2) oneDNN multiplies u8 x s8 pairs with vpmaddubsw, whose int16 sums
    saturate: products of large activations and weights come out wrong with no error. So the probe uses
    extreme values and a depth like a real layer's, and compares with an exact int64 product."""
    try:
        g = torch.Generator().manual_seed(0)
        a = torch.randint(-128, 128, (33, 576), dtype=torch.int8, generator=g)
        b = torch.randint(-128, 128, (576, 40), dtype=torch.int8, generator=g)
        a[:, :64], b[:64, :] = 127, 127            # the worst case on AVX2: (127 + 128) * 127 * 2 > 32767
        a[0, 64:], b[64:, 0] = -128, -128
        return torch.equal(torch._int_mm(a, b).long(), a.long() @ b.long())
    except Exception:  # noqa: BLE001 - any failure means: use the float path
        return False


_INT_MM = None


def int_mm_ok() -> bool:
    global _INT_MM
    if _INT_MM is None:
        _INT_MM = _int_mm_available()
    return _INT_MM


def _int_mm(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """The exact int32 product of int8 [m, k] and [k, n]: torch._int_mm where this CPU's is exact (int_mm_ok),
    with oneDNN on (its CPU implementation: without it a scalar loop, 40x slower; the lean runtime turns oneDNN off
    for one-token steps, where torch's own bf16 kernels are the faster ones). Elsewhere (a CPU without VNNI/AMX, whose
    oneDNN sums in saturating int16) float32 GEMMs over slices of EXACT_FLOAT_K: every partial sum an integer below
    2^24, so exact whatever order BLAS adds in, summed in int32 (the layers take this path only where lrq's own
    decode kernel exists, so it runs at prefill)."""
    if not int_mm_ok():
        acc = None
        for c in range(0, a.shape[1], EXACT_FLOAT_K):
            part = (a[:, c:c + EXACT_FLOAT_K].float() @ b[c:c + EXACT_FLOAT_K].float()).to(torch.int32)
            acc = part if acc is None else acc.add_(part)
        return acc
    with onednn(True):
        return torch._int_mm(a, b)


class onednn:
    """torch.backends.mkldnn.enabled set to `enabled` inside the block and restored after it, an error included (a
    plain class: a decode step enters one)."""

    def __init__(self, enabled: bool):
        self.enabled = enabled

    def __enter__(self):
        self.before = torch.backends.mkldnn.enabled
        torch.backends.mkldnn.enabled = self.enabled

    def __exit__(self, *exc):
        torch.backends.mkldnn.enabled = self.before


@dataclass
class Int8GemmWeights:
    weight: torch.Tensor       # int8 [n, k]: q - offset
    zero_term: torch.Tensor    # float32 [n]: offset - z (integers, exact)
    col_term: torch.Tensor     # float32 [n]: sum_k (q - offset) + k (offset - z) (integers, exact below 2^24)
    scale: torch.Tensor        # float32 [n]
    offset: int
    asymmetric: bool = True    # some zero_term != 0 (a symmetric grid skips the activations' row sums)
    wsum: torch.Tensor | None = None   # int32 [n]: sum_k (q - offset), for lrq's own decode kernel

    @classmethod
    def build(cls, q: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, bits: int) -> "Int8GemmWeights":
        w, offset = _offset_weights(q, bits)
        zt = offset - zero[:, 0].round().to(torch.int32)   # zero: uint8 levels (or float ones)
        wsum = w.sum(dim=1, dtype=torch.int32)
        col = wsum + q.shape[1] * zt
        return cls(w, zt.float(), col.float(), scale[:, 0].float(), offset, bool(zt.any()), wsum.contiguous())

    def mm(self, xa: torch.Tensor, x_zero: torch.Tensor, x_scale: torch.Tensor,
           rowsum: torch.Tensor | None = None, out_dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """xa = activation levels - 128 (int8 [m, k]); x_zero = their zero point(s) - 128 and x_scale their
        scale(s), float32 scalars or [m, 1] per token; rowsum = xa's row sums (float32 [m, 1]; computed here where
        not given). Float32 out (a GEMM call: `out_dtype` where lrq.native writes it, _int8_corrected). A decode
        call (m <= NATIVE_INT8_MAX_M) runs lrq's own kernel where it is built: the same exact int32 product and
        corrections in one call (torch._int_mm at one token: oneDNN's GEMM); a prefill call runs lrq.native's AMX
        tile kernel where the CPU has it, its AVX2 integer kernel where oneDNN's int8 GEMM is not exact
        (native_int8_linear: the same values in one call)."""
        if xa.shape[0] <= NATIVE_INT8_MAX_M and xa.stride(-1) == 1 and native.library() is not None:
            return self.native_mm(xa, x_zero, x_scale)
        rowsum = xa.sum(dim=1, keepdim=True, dtype=torch.float32) if rowsum is None else rowsum
        y = native_int8_linear(xa, x_zero, x_scale, rowsum, self.weight.shape[0], self.col_term, self.zero_term,
                               self.scale, self.asymmetric, out_dtype, weight=self.weight)
        if y is not None:
            return y
        return _int8_corrected(self._product(xa), rowsum, x_zero, x_scale, self.col_term,
                               self.zero_term, self.scale, self.asymmetric, out_dtype)

    def _product(self, xa: torch.Tensor) -> torch.Tensor:
        """xa @ weight.t(), exact: through oneDNN's quantized inner product on the levels written into its blocked
        layout (OneDNNOperand "int8", float32 out) where it runs here, else torch._int_mm (int32)."""
        lib = native.library()
        n, k = self.weight.shape
        acc = None
        if lib is not None and xa.is_contiguous():
            acc = OneDNNOperand.product("int8", xa, n, k, lambda at, _width: native.checked(
                lib.lrq_int8_blocked(self.weight.data_ptr(), self.wsum.data_ptr(), n, k, at, torch.get_num_threads()),
                "int8 blocking"))
        return _int_mm(xa, self.weight.t()) if acc is None else acc

    def native_mm(self, xa: torch.Tensor, x_zero, x_scale) -> torch.Tensor:
        """mm through lrq's own int8 kernel (lrq.native): float32 [m, n]."""
        m, (n, k) = xa.shape[0], self.weight.shape
        xz = torch.as_tensor(x_zero, dtype=torch.float32).reshape(-1).contiguous()
        xs = torch.as_tensor(x_scale, dtype=torch.float32).reshape(-1).contiguous()
        y = torch.empty(m, n)
        rc = native.library().lrq_int8_gemv(
            self.weight.data_ptr(), self.wsum.data_ptr(), xa.data_ptr(), xa.stride(0), xz.data_ptr(),
            xz.numel() > 1, xs.data_ptr(), xs.numel() > 1, self.col_term.data_ptr(), self.zero_term.data_ptr(),
            self.asymmetric, self.scale.data_ptr(), y.data_ptr(), m, n, k, torch.get_num_threads())
        native.checked(rc, "int8 kernel")
        return y

    def native_static_mm(self, x: torch.Tensor, a_scale: float, a_zero: float, a_hi: float) -> torch.Tensor:
        """The decode step from floating-point activations x [m, k] (bf16 or float32, unit stride) on a static grid:
        quantized in the kernel as PackedLinear._int8_activations does (x / a_scale rounded half to even, plus
        a_zero = zero point - 128, clamped to [-128, a_hi]), then native_mm's product: one call where the torch
        path makes about ten. Float32 [m, n]."""
        m, (n, k) = x.shape[0], self.weight.shape
        y = torch.empty(m, n)
        rc = native.library().lrq_w8a8_gemv(
            self.weight.data_ptr(), self.wsum.data_ptr(), x.data_ptr(), x.dtype == torch.bfloat16, x.stride(0),
            a_scale, a_zero, a_hi, self.col_term.data_ptr(), self.zero_term.data_ptr(), self.asymmetric,
            self.scale.data_ptr(), y.data_ptr(), m, n, k, torch.get_num_threads())
        native.checked(rc, "w8a8 kernel")
        return y

    def levels(self) -> torch.Tensor:
        return (self.weight.to(torch.int16) + self.offset).to(torch.uint8)

    def nbytes(self) -> int:
        return _nbytes(self.weight, self.zero_term, self.col_term, self.scale, self.wsum)


@dataclass
class Int4Int8Weights:
    """Weights of 4 bits or fewer, per channel, with integer activations (W4A8): held once, as Int4Weights (half
    a byte a weight, where Int8GemmWeights would hold one).

    * decode (fewer than DEQUANTIZE_FROM_M tokens; every call in float32): the activations on their grid,
      dequantized in the model's dtype (the fake-quant path's own values), through the 4-bit form (torch's int4
      kernel in bf16): a decode step reads half the bytes of an int8 weight;
    * prefill: the levels read out of the int4 packing as int8 (q - 8) into oneDNN's blocked int8 layout
      (OneDNNOperand, one reused buffer per shape) for its quantized inner product, or where that does not run
      into a transient [k, n] for torch._int_mm; the exact integer product, then Int8GemmWeights' corrections."""
    int4: Int4Weights
    zero_term: torch.Tensor    # float32 [n]: 8 - z
    col_term: torch.Tensor     # float32 [n]: sum_k (q - 8) + k (8 - z)
    scale: torch.Tensor        # float32 [n]
    asymmetric: bool = True

    @classmethod
    def build(cls, q: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor) -> "Int4Int8Weights":
        g = Int8GemmWeights.build(q, scale, zero, 4)      # its exact integer terms, offset 8
        return cls(Int4Weights.build(q, scale, zero, None), g.zero_term, g.col_term, g.scale, g.asymmetric)

    def integer_call(self, m: int, dtype: torch.dtype) -> bool:
        """Whether a call of m tokens in `dtype` (the model's) runs the int8 GEMM (`mm`) rather than the 4-bit
        form on the dequantized activations (`int4.mm`): bf16 prefill, and float32 prefill where lrq.native's AVX2
        integer kernel takes the packing (a CPU without VNNI, where a float32 model is what --precision auto
        holds: 2.1-2.3x the dense float32 GEMM there, the float path 0.8x)."""
        w = self.int4
        if not w.decodable:
            return False
        if dtype == torch.bfloat16:
            return m >= DEQUANTIZE_FROM_M[torch.bfloat16]
        return (dtype == torch.float32 and m >= AMX_FROM_M and int8_prefill_kernel() == "avx2"
                and w.packed.shape[1] * 2 == w.k and w.packed.shape[0] % 64 == 0 and w.block in (32, 64))

    def mm(self, xa: torch.Tensor, x_zero: torch.Tensor, x_scale: torch.Tensor,
           rowsum: torch.Tensor | None = None, out_dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The int8 GEMM path, arguments as Int8GemmWeights.mm: the levels as a transient int8 weight."""
        rowsum = xa.sum(dim=1, keepdim=True, dtype=torch.float32) if rowsum is None else rowsum
        w = self.int4
        n_pad, k_pad = w.packed.shape[0], w.packed.shape[1] * 2
        acc = None
        if native.library() is not None and w.decodable:   # a packing lrq.native reads
            y = None if k_pad != w.k else native_int8_linear(xa, x_zero, x_scale, rowsum, w.n, self.col_term,
                                                             self.zero_term, self.scale, self.asymmetric, out_dtype,
                                                             layer=w._native_layer()[1])
            if y is not None:
                return y
            if w.block == 64:
                xp = xa if k_pad == w.k else F.pad(xa, (0, k_pad - w.k))   # the levels less 8, oneDNN's GEMM
                acc = OneDNNOperand.product("int8", xp.contiguous(), n_pad, k_pad,
                                            lambda at, _width: w._unpack_into(at, native.UNPACK_I8_BLOCKED))
        if acc is None:
            acc = _int_mm(xa, w.offset_levels_t()[:w.k])
        return _int8_corrected(acc[:, :w.n] if n_pad != w.n else acc, rowsum, x_zero, x_scale, self.col_term,
                               self.zero_term, self.scale, self.asymmetric, out_dtype)

    def levels(self) -> torch.Tensor:
        return self.int4.levels()

    def nbytes(self) -> int:
        return self.int4.nbytes() + _nbytes(self.zero_term, self.col_term, self.scale)


def int4_form(w) -> Int4Weights | None:
    """The Int4Weights a CPU form runs its 4-bit kernel on (itself, or an Int4Int8Weights' own), else None."""
    w = w.int4 if isinstance(w, Int4Int8Weights) else w
    return w if isinstance(w, Int4Weights) else None


def cpu_weights(q: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, bits: int, group_size: int | None,
                integer_activations: bool) -> Int4Weights | Int8Weights | Int8GemmWeights | Int4Int8Weights:
    """The CPU form of levels q [n, k] with their scales and zero points [n, n_groups]."""
    if integer_activations and group_size is None:
        if bits <= 4:
            return Int4Int8Weights.build(q, scale, zero)
        return Int8GemmWeights.build(q, scale, zero, bits)
    if bits <= 4 and int4_grouping(q.shape[1], group_size) is not None:
        return Int4Weights.build(q, scale, zero, group_size)
    return Int8Weights.build(q, scale, zero, bits, group_size)
