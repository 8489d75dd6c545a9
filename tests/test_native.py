"""lrq's own CPU decode kernels (lrq.native, lrq/csrc/cpu_gemv.c): built here, exact against the float64 product of
the dequantized weight for every layout torch packs in and both vector branches, used where they pay, and a clean
fall back to torch's kernels where they cannot be built."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from lrq import native
from lrq.cpu_kernels import (NATIVE_INT8W_MAX_M, NATIVE_MAX_M, Int4Weights, Int8GemmWeights, Int8Weights,
                              _int8_corrected, _int8_corrected_torch)

ROOT = Path(__file__).resolve().parents[1]


def _weights(n: int, k: int, group: int | None, seed: int = 0, fp32_scales: bool = False) -> Int4Weights:
    """A random 4-bit layer; its scales fp16 values as a packed model's are (held compactly), or with
    `fp32_scales` float32 ones that are not (held as float32)."""
    g = torch.Generator().manual_seed(seed)
    ng = -(-k // (group or k))
    q = torch.randint(0, 16, (n, k), generator=g)
    s = torch.rand(n, ng, generator=g) * 0.02 + 1e-3
    return Int4Weights.build(q, s if fp32_scales else s.half().float(),
                             torch.randint(0, 16, (n, ng), generator=g).float(), group)


# (n, k, group): whole blocks of 64; a remainder block (n mod 64 = 16, 48); K padded (100, 264 -> 128, 288)
SHAPES = [(1536, 576, 128), (48, 100, 32), (80, 96, None), (208, 264, 64), (576, 1536, None), (16, 64, 64)]


def _relative_error(w: Int4Weights, x: torch.Tensor, y: torch.Tensor) -> float:
    """max |y - x W| over the size of the summed terms (sum |x||W|): the float32 sums' own scale."""
    ref_w = w.dequantized_t_torch(torch.float32)[:w.k, :w.n].double()
    ref = x.double() @ ref_w
    return ((y.double() - ref).abs() / (x.double().abs() @ ref_w.abs()).clamp_min(1e-30)).max().item()


def _i16_excess(w: Int4Weights, x: torch.Tensor, y: torch.Tensor) -> float:
    """max |y - x W| over what 16-bit activations allow: each activation rounded to 2^-15 of its token's largest
    (i16_chunks: at most half a step of 2^-15 of a power of two above its chunk's largest), times sum |W|, plus the
    float32 sums' own 1e-6 of sum |x||W|; at most 1 where the kernel keeps its bound."""
    ref_w = w.dequantized_t_torch(torch.float32)[:w.k, :w.n].double()
    xd = x.double()
    room = 2.0 ** -15 * xd.abs().amax(dim=1, keepdim=True) * ref_w.abs().sum(0) + 1e-6 * (xd.abs() @ ref_w.abs())
    return ((y.double() - xd @ ref_w).abs() / room.clamp_min(1e-30)).max().item()


def _i16_extreme() -> float:
    """The 16-bit integer kernels' sums at their bound: every level 15, each token's activations of one sign at the
    top of the 16-bit range (32767 or -32768 in float32 "i16"; 32640 from bf16), 256 rows a chunk (per channel) and
    128 (groups of 128): the worst of _i16_excess (float32 in "i16") and of the bf16 output's relative error in units
    of 2^-8; at most 1 where no int32 sum overflows."""
    worst = 0.0
    for group in (None, 128):
        ng = 1536 // (group or 1536)
        w = Int4Weights.build(torch.full((64, 1536), 15), torch.full((64, ng), 1e-3), torch.zeros(64, ng), group)
        w.float32_decode = "i16"
        x = torch.full((2, 1536), 1 - 2.0 ** -15)   # 32767 exactly
        x[1] = -1 + 2.0 ** -16                          # -32767.5: -32768 (nearest even)
        worst = max(worst, _i16_excess(w, x, w.native_mm(x)))
        xb = torch.full((2, 1536), 1 - 2.0 ** -8).bfloat16()
        xb[1] = -xb[1]
        ref = xb.double() @ w.dequantized_t_torch(torch.float32)[:, :64].double()
        worst = max(worst, ((w.native_mm(xb).double() - ref).abs() / ref.abs()).max().item() * 2 ** 8)
    return worst


def _integer_blocks(w: Int4Weights) -> int:
    """How many of w's output features this build's 16-bit integer kernel computes (its whole blocks: 64 features
    with AVX512-VNNI, 32 with AVX2), 0 where it has none for w's packing or grouping."""
    products = native.library().lrq_int4_bf16_products().decode()
    block = {"int16 VNNI": 64, "int16 AVX2": 32}.get(products)
    k_pad, group = w.packed.shape[1] * 2, w.scale_group or w.group
    if block != w.block or group % 4 or k_pad % 4:
        return 0
    return w.packed.shape[0] // block * block


def _cpu_flags() -> set[str]:
    line = next(ln for ln in Path("/proc/cpuinfo").read_text().splitlines() if ln.startswith("flags"))
    return set(line.split(":", 1)[1].split())


def test_the_kernels_build_here_with_vector_code():
    """CI runs on x86-64 machines with a C compiler: the kernels must build there (a silent fall back to torch's
    kernels would hide a broken build)."""
    assert native.library() is not None, native.status()
    assert native.isa() in native.VECTOR_ISAS
    products = {"int16 VNNI" if {"avx512_vnni", "avx512vbmi", "avx512bw"} <= _cpu_flags() else
                "float32" if "avx512f" in _cpu_flags() else "int16 AVX2"}
    if os.environ.get("LRQ_NATIVE_MARCH", "native") != "native":   # built for another target than this CPU
        products = {"int16 VNNI", "int16 AVX2", "float32"}
    amx = {"; prefill on AMX tiles"} if {"amx_tile", "amx_int8", "amx_bf16"} <= _cpu_flags() else {""}
    if os.environ.get("LRQ_NATIVE_MARCH", "native") != "native":
        amx = {""}                                                    # the AMX code is built for AMX targets only
    # the int8 weight-only kernel's 16-bit products: with AVX512-VNNI and VBMI (block64_i16's build), else float32
    int8w = {"int16 VNNI" if "int16 VNNI" in products else "float32"}
    if os.environ.get("LRQ_NATIVE_MARCH", "native") != "native":
        int8w = {"int16 VNNI", "float32"}
    assert native.status() in {f"lrq native ({native.isa()}; 4-bit bf16 products: {p}; 8-bit weight-only: {q}{a})"
                               for p in products for q in int8w for a in amx}


@pytest.mark.parametrize("n,k,group", SHAPES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("m", [1, 3])
def test_gemv_equals_the_dequantized_product(n, k, group, dtype, m):
    w = _weights(n, k, group)
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(1)).to(dtype)
    y = w.native_mm(x)
    assert y.shape == (m, n) and y.dtype == dtype
    # float32: sums of exact products, rounded as float32 sums are; bf16: one rounding of the float32 result
    assert _relative_error(w, x, y) < (1e-6 if dtype == torch.float32 else 2 ** -8)


@pytest.mark.parametrize("n,k,group", SHAPES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_prefill_operand_is_torchs_dequantization_bit_for_bit(n, k, group, dtype):
    """A prefill call's transient weight (lrq_int4_unpack_t) equals torch's ops' q * s + zc rounded once, every bit,
    the remainder block and the padded rows included, on one thread and two."""
    w = _weights(n, k, group)
    ref = w.dequantized_t_torch(dtype)
    threads = torch.get_num_threads()
    try:
        for t in (1, 2):
            torch.set_num_threads(t)
            out = w.dequantized_t(dtype)
            assert out.dtype == dtype and out.shape == ref.shape and torch.equal(out, ref)
    finally:
        torch.set_num_threads(threads)


@pytest.mark.parametrize("n,k,group,ours,torchs", [(1536, 576, 128, 5, 9), (208, 264, 64, 5, 9),
                                                     (80, 96, None, 1, 3), (576, 1536, 128, 12, 12)])
def test_the_kernel_reads_one_scale_row_per_quantizer_group(n, k, group, ours, torchs):
    """lrq's kernel reads the quantizer's groups (the last one shorter where the group does not divide K: 576 at
    g128 is 128 x 4 + 64), not torch's kernel group repeating them (64 there): 4.5 bits a weight a token, not 5; the
    values per torch's group are ours repeated, and the product is the dequantized weight's."""
    w = _weights(n, k, group)
    n_pad = w.packed.shape[0]
    assert w.scale_zero.shape == (3 * ours * n_pad,) and w.scale_zero.dtype == torch.uint8   # fp16 s, uint8 z
    assert _weights(n, k, group, fp32_scales=True).scale_zero.shape == (2 * ours * n_pad,)
    assert w.scales.shape[0] == torchs
    assert w.scale_zero_rows().shape == (2, ours, n_pad)
    rows = w.kernel_group_scale_zero()
    assert rows.shape == (2, torchs, n_pad)
    per_feature = torch.arange(0, w.packed.shape[1] * 2, w.group) // (group or w.packed.shape[1] * 2)
    assert torch.equal(rows, w.scale_zero_rows()[:, per_feature])
    # torch's bf16 (scale, zero) rows are the same scales: both forms describe one weight
    torch.testing.assert_close(w.scales[..., 0].float(), rows[0], rtol=2 ** -8, atol=0)
    x = torch.randn(1, k, generator=torch.Generator().manual_seed(3))
    assert _relative_error(w, x, w.native_mm(x)) < 1e-6


@pytest.mark.parametrize("n,k,group", SHAPES)
def test_w4a8_prefill_levels_are_torchs_unpacking(n, k, group):
    """W4A8's prefill operand (lrq_int4_unpack_t's UNPACK_I8: the levels less 8, transposed, int8) equals torch's ops' reading
    of the same packing, the remainder block and padded rows included."""
    from lrq.cpu_kernels import _unpack_int4pack_t
    w = _weights(n, k, group)
    n_pad, k_pad = w.packed.shape[0], w.packed.shape[1] * 2
    out = torch.empty(k_pad, n_pad, dtype=torch.int8)
    assert native.library().lrq_int4_unpack_t(w._native_layer()[1], out.data_ptr(), native.UNPACK_I8, 2) == 0
    assert torch.equal(out, _unpack_int4pack_t(w.packed, torch.empty(k_pad, n_pad, dtype=torch.int8)).sub_(8))


def test_prefill_runs_the_native_dequantization(monkeypatch):
    """A 4-bit layer called with a prompt multiplies by lrq.native's dequantized operand, not torch's ops'."""
    w = _weights(576, 576, 128)
    calls = []
    monkeypatch.setattr(Int4Weights, "dequantized_t_torch", lambda self, dt=torch.float32: calls.append(dt))
    x = torch.randn(200, 576, generator=torch.Generator().manual_seed(2)).bfloat16()
    y = w.mm(x)
    assert not calls and y.shape == (200, 576) and torch.isfinite(y).all()
    ref = (x.float() @ w.dequantized_t(torch.float32)[:576, :576]).bfloat16()
    torch.testing.assert_close(y, ref, rtol=2e-2, atol=2e-2)


def _blocked(plain: torch.Tensor, nb: int, kb: int) -> torch.Tensor:
    """A plain [n, k] weight in oneDNN's blocked order [n / nb][k / kb][nb][kb], flattened (the tests' reference)."""
    n, k = plain.shape
    return plain.reshape(n // nb, nb, k // kb, kb).permute(0, 2, 1, 3).reshape(-1)


@pytest.mark.parametrize("n,k,group", [(1536, 576, 128), (576, 1536, None), (224, 576, 64), (96, 100, 32),
                                       (48, 100, 32)])
def test_prefill_operand_in_onednns_blocked_layout(n, k, group):
    """A bf16 prefill call writes its dequantized weight in oneDNN's blocked layout (OneDNNOperand): what lrq.native
    writes (UNPACK_BF16_BLOCKED, UNPACK_BF16_BLOCKED64) is the plain dequantized weight in [n / W][k / 2][W][2]
    order for W = 32 and 64, every bit (whole 64-feature blocks, a remainder block of 32, padded rows), on any CPU;
    where this oneDNN lays weights out so (the probe says which W), it is also oneDNN's own reorder of that weight,
    and the product is the plain operand's to the bf16 output's rounding; where not (another layout, n_pad not a
    multiple of W), the plain operand runs."""
    from lrq.cpu_kernels import OneDNNOperand
    w = _weights(n, k, group)
    n_pad, k_pad = w.packed.shape[0], w.packed.shape[1] * 2
    plain = w.dequantized_t(torch.bfloat16).t().contiguous()          # [n_pad, k_pad]
    for width, form in ((32, native.UNPACK_BF16_BLOCKED), (64, native.UNPACK_BF16_BLOCKED64)):
        out = torch.empty(n_pad * k_pad, dtype=torch.bfloat16)
        rc = native.library().lrq_int4_unpack_t(w._native_layer()[1], out.data_ptr(), form, 2)
        assert rc == (0 if n_pad % width == 0 else 1)
        if rc == 0:
            assert torch.equal(out.view(torch.int16), _blocked(plain, width, 2).view(torch.int16))
    x = torch.randn(40, k_pad, generator=torch.Generator().manual_seed(5)).bfloat16()
    x[:, k:] = 0                                   # the padded inputs, as mm pads them
    y = w._blocked_mm(x)
    if OneDNNOperand.layout_matches("bf16", n_pad, k_pad):
        mine = OneDNNOperand._raw(OneDNNOperand.scratch("bf16", n_pad, k_pad)[0]).view(torch.int16)
        assert torch.equal(mine, OneDNNOperand._raw(OneDNNOperand.reorder("bf16", plain)).view(torch.int16))
        assert y.shape == (40, n_pad) and _relative_error(w, x[:, :k].float(), y[:, :n].float()) < 2 ** -8
    else:
        assert y is None
    out = w.mm(x[:, :k])
    assert out.shape == (40, n) and _relative_error(w, x[:, :k].float(), out.float()) < 2 ** -8


@pytest.mark.parametrize("kind", ["bf16", "int8"])
def test_the_layout_probe_accepts_our_layout_and_only_it(monkeypatch, kind):
    """The probe against a simulated oneDNN (a reorder that lays weights out in a given order, its compensation the
    negated row sums): ours is accepted with each block width lrq.native writes (and says which), a 16-wide block,
    a transposed inner block or a wrong compensation refused. And on a CPU with AMX (where this torch's oneDNN was
    read to lay bf16 and int8 weights out as lrq.native writes them, 32 features a bf16 block, on an Intel Xeon) or
    with AVX512-BF16 and VNNI alone (64 a bf16 block, an AMD Zen 4) the real one is accepted: a probe refusing
    everything would keep the slower operands."""
    from lrq.cpu_kernels import BLOCK_WIDTHS, OneDNNOperand
    kb = 2 if kind == "bf16" else 4
    real = OneDNNOperand.block_width(kind, 256, 128)

    def simulated(order, sums=1):
        def make(_kind, w):
            n, k = w.shape
            body = order(w).contiguous().view(torch.uint8)
            tail = (-sums * w.sum(dim=1, dtype=torch.int32)).view(torch.uint8) if kind == "int8" else body[:0]
            return torch.cat([body, tail])
        return make

    def ours(nb):
        return lambda w: _blocked(w, nb, kb)

    def swapped(nb):
        return lambda w: w.reshape(-1, nb, w.shape[1] // kb, kb).permute(0, 2, 3, 1).reshape(-1)

    monkeypatch.setattr(OneDNNOperand, "_raw", staticmethod(lambda t, dtype=torch.bfloat16: t.view(dtype)))
    cases = ([(ours(nb), 1, nb) for nb in BLOCK_WIDTHS[kind]] + [(ours(16), 1, 0), (ours(128), 1, 0)]
             + [(swapped(nb), 1, 0) for nb in BLOCK_WIDTHS[kind]] + ([(ours(64), 2, 0)] if kind == "int8" else []))
    for order, sums, width in cases:
        monkeypatch.setattr(OneDNNOperand, "reorder", staticmethod(simulated(order, sums)))
        assert OneDNNOperand._probe(kind, 256, 128) == width
    from lrq.precision import cpu_bf16
    flags = _cpu_flags() if cpu_bf16()["native"] else set()   # an AVX-512 CPU held to AVX2: as a Zen 3, no claim
    if {"amx_bf16", "amx_int8"} <= flags:
        assert real == (32 if kind == "bf16" else 64)
    elif {"avx512_bf16", "avx512_vnni"} <= flags:   # an AMD Zen 4: int8 activations run oneDNN's reference there
        assert real == (64 if kind == "bf16" else 0)


def test_a_blocked_operand_that_runs_onednns_reference_implementation_is_refused(monkeypatch):
    """Where oneDNN's product on the blocked operand is its reference implementation (slower than the plain GEMM by
    thousands of times: int8 activations on an AMD Zen 4, which the probe test checks on the real one), block_width
    refuses the layout and a layer's call runs its plain operand. Simulated on any CPU: a oneDNN whose layout matches
    and whose product takes 5 ms for 2 rows of a 192 x 576 weight is refused, the same product at full speed taken."""
    import time
    from lrq.cpu_kernels import OneDNNOperand

    def product(x, packed, bias=None):
        if slow:
            time.sleep(0.005)
        return x @ packed.t()
    monkeypatch.setattr(OneDNNOperand, "_ops_exist", staticmethod(lambda kind: True))
    monkeypatch.setattr(OneDNNOperand, "_probe", classmethod(lambda cls, kind, n, k: 32))
    monkeypatch.setattr(OneDNNOperand, "reorder", staticmethod(lambda kind, w, batch=0: w))
    monkeypatch.setattr(OneDNNOperand, "linear", staticmethod(product))
    for slow, width in ((False, 32), (True, 0)):
        monkeypatch.setattr(OneDNNOperand, "_ok", {})
        assert OneDNNOperand.block_width("bf16", 192, 576) == width
    w = _weights(192, 576, 128)
    x = torch.randn(64, 576, generator=torch.Generator().manual_seed(3)).bfloat16()
    assert w._blocked_mm(x) is None
    assert _relative_error(w, x.float(), w.mm(x).float()) < 2 ** -8


def test_the_blocked_operand_is_rewritten_per_layer(monkeypatch):
    """Two layers of one shape share one operand: each call's product is its own layer's (nothing of the previous
    layer kept by oneDNN); while another thread holds the operands, and for a layout the probe does not recognise,
    the plain operand runs."""
    from lrq.cpu_kernels import OneDNNOperand
    a, b = _weights(576, 576, 128, seed=1), _weights(576, 576, 128, seed=2)
    x = torch.randn(64, 576, generator=torch.Generator().manual_seed(6)).bfloat16()
    ya, yb, ya2 = a.mm(x), b.mm(x), a.mm(x)
    assert torch.equal(ya, ya2) and not torch.equal(ya, yb)
    assert _relative_error(b, x.float(), yb.float()) < 2 ** -8
    # one buffer per shape for the process: a call while another thread holds it runs the plain operand
    with OneDNNOperand._lock:
        assert a._blocked_mm(x) is None and torch.equal(a.mm(x), x @ a.dequantized_t(torch.bfloat16))
    monkeypatch.setattr(OneDNNOperand, "_ok", {})
    monkeypatch.setattr(OneDNNOperand, "_probe", classmethod(lambda cls, kind, n, k: False))
    assert a._blocked_mm(x) is None
    assert _relative_error(a, x.float(), a.mm(x).float()) < 2 ** -8


@pytest.mark.parametrize("n,k", [(1536, 576), (192, 576), (576, 1536), (48, 100)])
def test_int8_prefill_operands_in_onednns_blocked_layout(n, k):
    """W8A8's and W4A8's prefill products through oneDNN's quantized inner product: what lrq.native writes
    (lrq_int8_blocked from W8A8's levels, UNPACK_I8_BLOCKED from W4A8's 4-bit packing) is the plain levels in
    [n / 64][k / 4][64][4] order followed by each feature's negated sum, on any CPU; where this oneDNN lays int8
    weights out so (the probe says), it is qlinear_prepack's own bytes; the products are the exact integer ones
    either way (torch._int_mm where the layout differs or the CPU's oneDNN int8 products are not exact)."""
    from lrq.cpu_kernels import Int4Int8Weights, OneDNNOperand
    g = torch.Generator().manual_seed(n + k)
    q8 = torch.randint(0, 256, (n, k), generator=g)
    w8 = Int8GemmWeights.build(q8, torch.rand(n, 1, generator=g) + 0.01,
                               torch.randint(0, 256, (n, 1), generator=g).float(), 8)
    q4 = torch.randint(0, 16, (n, k), generator=g)
    w4 = Int4Int8Weights.build(q4, torch.rand(n, 1, generator=g) + 0.01,
                               torch.randint(0, 16, (n, 1), generator=g).float())
    lib = native.library()

    def blocked_with_sums(plain: torch.Tensor) -> torch.Tensor:
        sums = (-plain.sum(dim=1, dtype=torch.int32)).view(torch.uint8)
        return torch.cat([_blocked(plain, 64, 4).view(torch.uint8), sums])

    w4i = w4.int4
    n_pad, k_pad = w4i.packed.shape[0], w4i.packed.shape[1] * 2
    plain4 = torch.zeros(n_pad, k_pad, dtype=torch.int8)
    plain4[:n, :k] = (w4i.levels().to(torch.int16) - 8).to(torch.int8)
    if n % 64 == 0 and k % 4 == 0:
        out = torch.empty(n * k + 4 * n, dtype=torch.uint8)
        assert lib.lrq_int8_blocked(w8.weight.data_ptr(), w8.wsum.data_ptr(), n, k, out.data_ptr(), 2) == 0
        assert torch.equal(out, blocked_with_sums(w8.weight))
    if n_pad % 64 == 0 and k_pad % 4 == 0:
        out = torch.empty(n_pad * k_pad + 4 * n_pad, dtype=torch.uint8)
        rc = lib.lrq_int4_unpack_t(w4i._native_layer()[1], out.data_ptr(), native.UNPACK_I8_BLOCKED, 2)
        if w4i.block == 64:
            assert rc == 0 and torch.equal(out, blocked_with_sums(plain4))
        else:   # torch's AVX2 packing (blocks of 32, a Zen 3): the form is refused, the int32 path runs
            assert rc == 1
    if OneDNNOperand.layout_matches("int8", n, k):
        assert torch.equal(blocked_with_sums(w8.weight), OneDNNOperand._raw(OneDNNOperand.reorder("int8", w8.weight),
                                                                            torch.uint8))
    xa = torch.randint(-128, 128, (70, k), dtype=torch.int8, generator=g)
    product = w8._product(xa)
    assert product.dtype == (torch.float32 if OneDNNOperand.layout_matches("int8", n, k) else torch.int32)
    assert torch.equal(product.float(), (xa.long() @ w8.weight.long().t()).float())
    # W4A8's prefill result equals the int32 path's, corrections and all
    xz, xs = torch.full((70, 1), 3.0), torch.rand(70, 1, generator=g) + 0.1
    ref = _int8_corrected_torch((xa.long() @ (q4 - 8).t()).int(), xa.sum(1, keepdim=True, dtype=torch.float32), xz,
                                xs, w4.col_term, w4.zero_term, w4.scale, w4.asymmetric)
    assert torch.equal(w4.mm(xa, xz, xs), ref)


def test_rows_apart_by_their_stride_and_nan_kept():
    w = _weights(208, 264, 64)
    big = torch.randn(3, 300)
    x = big[:, 10:10 + 264]                         # rows 300 apart, unit stride
    assert _relative_error(w, x, w.native_mm(x)) < 1e-6
    x = x.clone()
    x[1, 5] = float("nan")
    y = w.native_mm(x)
    assert torch.isnan(y[1]).all() and torch.isfinite(y[[0, 2]]).all()
    yb = w.native_mm(x.bfloat16())
    assert torch.isnan(yb[1].float()).all()


@pytest.mark.parametrize("group", [128, None])
def test_bf16_activations_far_apart_in_size(group):
    """bf16 activations enter the AVX512-VNNI kernel as 16-bit integers per chunk of rows, scaled by the chunk's
    largest: values 2^20 below an outlier in the same chunk are rounded there, not lost to the output's precision
    (the bound is the bf16 output's rounding), and an inf or NaN token runs the float32 path, non-finite as torch's."""
    w = _weights(576, 1536, group)
    g = torch.Generator().manual_seed(4)
    x = torch.randn(3, 1536, generator=g) * 1e-3
    x[:, ::97] = 1e3 * torch.randn(3, 16, generator=g)            # an outlier in every chunk of 256 and group of 128
    x = x.bfloat16()
    y = w.native_mm(x)
    assert _relative_error(w, x.float(), y.float()) < 2 ** -8
    # the small activations alone (outliers zeroed): still exact to the output's rounding
    small = torch.where(x.float().abs() > 1, 0.0, x.float()).bfloat16()
    assert _relative_error(w, small.float(), w.native_mm(small).float()) < 2 ** -8
    x[1, 700] = float("inf")
    y = w.native_mm(x)
    assert not torch.isfinite(y[1].float()).all() and torch.isfinite(y[[0, 2]].float()).all()


def test_16_bit_kernels_keep_their_sums_at_the_bound():
    """The integer decode kernel this machine builds (AVX512-VNNI, or AVX2 on a Zen 3) at the largest sums its int32
    lanes hold: levels all 15 and activations at the top of the 16-bit range, chunks of 256 and 128 rows (an overflow
    would be off by 2^32 units, far beyond the bound)."""
    assert _i16_extreme() <= 1


@pytest.mark.parametrize("n,k,group", [(1536, 576, 128), (576, 1536, None), (208, 264, 64), (96, 128, 32)])
def test_float32_i16_decode_rounds_only_the_activations(n, k, group):
    """float32_decode "i16": a float32 decode call through the 16-bit integer kernel where this build has one for the
    packing (AVX512-VNNI or AVX2; elsewhere the float32 kernel): each activation rounded to 2^-15 of the largest in
    its chunk, the products summed exactly (activations 1000x apart in size keep the bound); the remainder block and a
    token with a NaN or inf run the float32 kernel; "exact" gives back the float32 kernel's bits."""
    w = _weights(n, k, group)
    g = torch.Generator().manual_seed(5)
    x = torch.randn(3, k, generator=g)
    x[:, ::5] *= 1e3
    exact = w.native_mm(x)
    w.float32_decode = "i16"
    y = w.native_mm(x)
    assert y.dtype == torch.float32 and _i16_excess(w, x, y) <= 1
    full = _integer_blocks(w)
    assert torch.equal(y[:, full:], exact[:, full:])                  # the remainder: the float32 kernel
    assert full == 0 or not torch.equal(y[:, :full], exact[:, :full])  # the integer kernel ran where it is built
    bad = x.clone()
    bad[1, 3], bad[2, 7] = float("nan"), float("inf")
    yb = w.native_mm(bad)
    assert torch.equal(yb[0], y[0]) and torch.isnan(yb[1]).all() and not torch.isfinite(yb[2]).all()
    w.float32_decode = "exact"
    assert torch.equal(w.native_mm(x), exact)


def test_threads_give_the_same_bits():
    w, x = _weights(1536, 576, 128), torch.randn(2, 576)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = w.native_mm(x)
        torch.set_num_threads(2)
        two = w.native_mm(x)
    finally:
        torch.set_num_threads(before)
    assert torch.equal(one, two)   # each output block is one thread's, summed in the same order


def test_layers_run_it_where_it_pays_and_the_rest_as_before(monkeypatch):
    """A decode call (m <= NATIVE_MAX_M[dtype]) runs the native kernel, larger calls and float32_decode "bf16" take
    torch's paths; with the kernel turned off every call gives the same values through torch's."""
    w = _weights(208, 264, 64)
    ran = []
    monkeypatch.setattr(Int4Weights, "native_mm", lambda self, x, _f=Int4Weights.native_mm: ran.append(x.shape[0])
                        or _f(self, x))
    for dtype, top in NATIVE_MAX_M.items():
        for m in (1, top, top + 1, 64):
            ran.clear()
            x = torch.randn(m, 264).to(dtype)
            y = w.mm(x)
            assert ran == ([m] if m <= top else [])
            monkeypatch.setattr(native, "library", lambda: None)
            bound = 2 ** -7 if dtype == torch.bfloat16 else 1e-6   # torch's bf16 kernel rounds its own way
            assert _relative_error(w, x, y) < bound and _relative_error(w, x, w.mm(x)) < bound
            monkeypatch.undo()
            monkeypatch.setattr(Int4Weights, "native_mm", lambda self, x, _f=Int4Weights.native_mm:
                                ran.append(x.shape[0]) or _f(self, x))
    ran.clear()
    w.float32_decode = "bf16"
    w.mm(torch.randn(1, 264))
    assert ran == []


def _int8(n: int, k: int, symmetric: bool = False, seed: int = 0) -> Int8GemmWeights:
    g = torch.Generator().manual_seed(seed)
    zero = torch.full((n, 1), 128.0) if symmetric else torch.randint(0, 256, (n, 1), generator=g).float()
    return Int8GemmWeights.build(torch.randint(0, 256, (n, k), generator=g), torch.rand(n, 1, generator=g) * 0.01,
                                 zero, 8)


def _int8_reference(w: Int8GemmWeights, xa, x_zero, x_scale) -> torch.Tensor:
    levels = w.weight.double() + w.zero_term.double()[:, None]              # q - z
    return ((xa.double() - torch.as_tensor(x_zero).double()) @ levels.t()) * torch.as_tensor(x_scale).double() \
        * w.scale.double()


@pytest.mark.parametrize("n,k", [(1536, 576), (40, 100), (24, 70), (576, 1536), (30, 128)])   # 30: two rows after the fours
@pytest.mark.parametrize("symmetric", [False, True])
def test_int8_gemv_is_the_exact_integer_product(n, k, symmetric):
    """W8A8 decode: the int32 product is exact (extreme levels included: no saturating int16 step), its float32
    corrections are the torch path's (_int8_corrected_torch on torch._int_mm) to the bit, per tensor and per token."""
    w = _int8(n, k, symmetric)
    g = torch.Generator().manual_seed(3)
    for m, per_row, strided in ((1, False, False), (3, True, False), (2, True, True)):   # strided: rows k + 8 apart
        xa = torch.randint(-128, 128, (m, k + 8 if strided else k), dtype=torch.int8, generator=g)[:, :k]
        xa[0, :16] = -128
        xz = torch.randint(-20, 20, (m, 1), generator=g).float() if per_row else torch.tensor(-3.0)
        xs = torch.rand(m, 1, generator=g) * 0.1 if per_row else torch.tensor(0.05)
        y = w.native_mm(xa, xz, xs)
        acc = (xa.long() @ w.weight.long().t()).to(torch.int32)                 # exact, whatever _int_mm does here
        torch_path = _int8_corrected_torch(acc, xa.sum(dim=1, keepdim=True, dtype=torch.float32), xz, xs,
                                           w.col_term, w.zero_term, w.scale, w.asymmetric)
        ref = _int8_reference(w, xa, xz, xs)
        assert ((y.double() - ref).abs().max() / ref.abs().max()).item() < 1e-6
        assert ((y - torch_path).abs().max() / torch_path.abs().max()).item() < 1e-6


@pytest.mark.parametrize("n,k", [(37, 100), (64, 576), (5, 16), (200, 33)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("m", [1, 3])
def test_int8_weight_only_decode_is_the_dequantized_product(n, k, dtype, m):
    """An 8-bit weight-only layer per channel (w8a16; an int8 output head) at decode: lrq's kernel against the float64
    product of the dequantized weight, rows of x read at their stride, the output in x's dtype rounded once (bf16:
    within one bf16 step of the exact value, plus what 16-bit activations allow where the kernel takes them: each
    rounded to 2^-15 of its token's largest); ragged widths (k not a multiple of 16) read only their k columns. The
    activations span 2^-12 to 1 of their largest, so that the 16-bit form's rounding is exercised."""
    g = torch.Generator().manual_seed(n + k)
    q, s = torch.randint(0, 256, (n, k), generator=g), torch.rand(n, 1, generator=g) * 0.02 + 1e-4
    w = Int8Weights.build(q, s, torch.randint(0, 256, (n, 1), generator=g).float(), 8, None)
    assert w.native_for(m, dtype)
    spread = torch.exp2(-torch.randint(0, 13, (m, k + 7), generator=g).float())
    x = (torch.randn(m, k + 7, generator=g) * spread).to(dtype)[:, 3:k + 3]   # strided rows
    calls = []
    lib = native.library()

    class Spy:
        def __getattr__(self, name):
            calls.append(name)
            return getattr(lib, name)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(native, "library", lambda: Spy())
        y = w.mm(x)
    assert calls and set(calls) == {"lrq_int8w_gemv"} and y.dtype == dtype and y.shape == (m, n)
    ref_w = w.dequantized(torch.float32).double()
    exact = x.double() @ ref_w.t()
    bound = (x.double().abs() @ ref_w.abs().t()) * 1e-6
    if dtype == torch.bfloat16:
        i16 = 2.0 ** -15 * x.double().abs().amax(dim=1, keepdim=True) * ref_w.abs().sum(1)
        bound = bound + i16 + exact.abs() * 2.0 ** -8
    assert ((y.double() - exact).abs() <= bound).all()
    # the same values as the torch path (_weight_int8pack_mm) within its bf16 product rounding
    assert torch.allclose(y.float(), F.linear(x.float(), w.dequantized(torch.float32)), rtol=0.02, atol=1e-3)
    assert not w.native_for(NATIVE_INT8W_MAX_M + 1, dtype)   # above it: torch's kernel or the dequantized GEMM


@pytest.mark.parametrize("n,k", [(64, 576), (96, 100), (40, 33), (32, 34), (128, 64)])
@pytest.mark.parametrize("amx", [True, False])
def test_int8_weight_only_prefill_operands(n, k, amx, monkeypatch):
    """An 8-bit weight-only prefill call (bf16, 64 tokens): on AMX tiles where they run (lrq_amx_bf16_int8w_linear: n a
    multiple of 64, k of 32), else through oneDNN's blocked layout where it matches (lrq_int8w_unpack's form 2 or 3: n a
    multiple of 32, k even, as at SmolLM2's shapes; oneDNN pads some depths and its probe then refuses), else the plain
    bf16 operand (form 1); each the product of x and the bf16 values torch's ops make, within float32 sums' order. The
    float32 and bf16 operands are torch's ops' values bit for bit (ragged k included)."""
    import lrq.cpu_kernels as CK
    from lrq.cpu_kernels import OneDNNOperand
    monkeypatch.setattr(CK, "AMX_PREFILL", amx)
    g = torch.Generator().manual_seed(n * k)
    w = Int8Weights.build(torch.randint(0, 256, (n, k), generator=g), torch.rand(n, 1, generator=g) * 0.01,
                          torch.randint(0, 256, (n, 1), generator=g).float(), 8, None)
    for dtype in (torch.float32, torch.bfloat16):
        assert torch.equal(w.dequantized(dtype), w.dequantized_torch(dtype))
    x = torch.randn(64, k, generator=g).bfloat16()
    calls = []
    real = native.library()

    class Spy:
        def __getattr__(self, name):
            f = getattr(real, name)
            if name == "lrq_int8w_unpack":
                return lambda *a: calls.append(a[7]) or f(*a)
            if name == "lrq_amx_bf16_int8w_linear":
                return lambda *a: calls.append("amx") or f(*a)
            return f
    monkeypatch.setattr(native, "library", lambda: Spy())
    y = w.mm(x)
    tiles = CK.amx_ready() and n % 64 == 0 and k % 32 == 0
    width = OneDNNOperand.block_width("bf16", n, k)
    assert width or (n, k) != (64, 576) or not OneDNNOperand._ops_exist("bf16")
    assert calls == (["amx"] if tiles else [{32: 2, 64: 3}[width]] if width else [1])
    # forms 2 and 3 are the bf16 operand in oneDNN's blocks of 32 and 64 features, bit for bit, on any CPU
    plain = w.dequantized_torch(torch.bfloat16)
    for form, nb in ((2, 32), (3, 64)):
        out = torch.empty(n * k, dtype=torch.bfloat16)
        rc = real.lrq_int8w_unpack(*w._native_weight(), n, k, out.data_ptr(), form, 2)
        assert rc == (0 if n % nb == 0 and k % 2 == 0 else 1)
        if rc == 0:
            assert torch.equal(out.view(torch.int16), _blocked(plain, nb, 2).view(torch.int16))
    ref = x.double() @ w.dequantized_torch(torch.bfloat16).double().t()
    room = x.double().abs() @ w.dequantized_torch(torch.bfloat16).double().abs().t()
    assert y.dtype == torch.bfloat16 and ((y.double() - ref).abs() <= room * 2 ** -7 + 1e-6).all()


def test_w8a8_static_decode_quantizes_on_the_fake_quant_grid():
    """From float activations: the levels the kernel makes are the fake-quant path's (round half to even, the
    zero point, the clamp), bf16 inputs read as they are; NaN becomes a defined level, not undefined behaviour."""
    w = _int8(48, 576)
    scale, zero, hi = 0.02, -5.0, 127.0
    x = torch.randn(2, 576) * 2
    x[0, :4] = torch.tensor([0.01, 0.03, -0.01, 0.05])   # exact halves of the grid: half to even
    for xin in (x, x.bfloat16()):
        xf = xin.float()
        xa = torch.div(xf, scale).round_().add_(zero).clamp_(-128, hi).to(torch.int8)
        y = w.native_static_mm(xin, scale, zero, hi)
        ref = w.native_mm(xa, torch.tensor(zero), torch.tensor(scale))
        assert torch.equal(y, ref)
    x[1, 3] = float("nan")
    assert torch.isfinite(w.native_static_mm(x, scale, zero, hi)).all()


_PROBE = """
import json, torch
from lrq import native
from lrq.cpu_kernels import Int4Weights, _pack_block
import sys
sys.path.insert(0, "tests")
from tests.test_native import _i16_excess, _i16_extreme, _integer_blocks
g = torch.Generator().manual_seed(0)
errs, bf16_err, i16_excess, i16_ran = [], [], [], []
for n, k, group in [(1536, 576, 128), (48, 100, 32), (208, 264, 64)]:
    ng = -(-k // group)
    w = Int4Weights.build(torch.randint(0, 16, (n, k), generator=g), torch.rand(n, ng, generator=g) * 0.02 + 1e-3,
                          torch.randint(0, 16, (n, ng), generator=g).float(), group)
    x = torch.randn(2, k, generator=g)
    ref_w = w.dequantized_t_torch(torch.float32)[:k, :n].double()
    y = w.native_mm(x) if native.library() is not None else w.mm(x)
    errs.append(((y.double() - x.double() @ ref_w).abs() / (x.double().abs() @ ref_w.abs())).max().item())
    for dt in (torch.float32, torch.bfloat16):   # the prefill operand: torch's dequantization, bit for bit
        errs.append(0.0 if torch.equal(w.dequantized_t(dt), w.dequantized_t_torch(dt)) else 1.0)
    if native.library() is not None:   # bf16 activations (AVX2: the integer kernel) and float32 ones in "i16"
        xb = x.bfloat16()
        yb = w.native_mm(xb).double()
        bf16_err.append(((yb - xb.double() @ ref_w).abs() / (xb.double().abs() @ ref_w.abs())).max().item())
        w.float32_decode = "i16"
        yi = w.native_mm(x)
        i16_excess.append(_i16_excess(w, x, yi))
        full = _integer_blocks(w)
        i16_ran.append(full > 0 and not torch.equal(yi[:, :full], y[:, :full]))
        w.float32_decode = "exact"
i16_extreme = _i16_extreme() if native.library() is not None else None
from lrq.cpu_kernels import Int8GemmWeights
w8 = Int8GemmWeights.build(torch.randint(0, 256, (40, 100), generator=g), torch.rand(40, 1, generator=g),
                           torch.randint(0, 256, (40, 1), generator=g).float(), 8)
xa = torch.randint(-128, 128, (2, 100), dtype=torch.int8, generator=g)
xa[:, :20] = -128
if native.library() is not None:
    y = w8.native_mm(xa, torch.tensor(-7.0), torch.tensor(0.5))
    ref = ((xa.double() + 7) @ (w8.weight.double() + w8.zero_term.double()[:, None]).t()) * 0.5 * w8.scale.double()
    errs.append(((y.double() - ref).abs().max() / ref.abs().max()).item())
from lrq.cpu_kernels import Int8Weights   # the int8 weight-only kernel (an int8 head, w8a16), a ragged k
w8w = Int8Weights.build(torch.randint(0, 256, (37, 100), generator=g), torch.rand(37, 1, generator=g) * 0.01,
                        torch.randint(0, 256, (37, 1), generator=g).float(), 8, None)
if native.library() is not None:
    x = torch.randn(2, 100, generator=g)
    ref_w = w8w.dequantized(torch.float32).double()
    y = w8w.native_mm(x).double()
    errs.append(((y - x.double() @ ref_w.t()).abs() / (x.double().abs() @ ref_w.abs().t())).max().item())
if native.library() is not None:   # the one-token attention kernel (bf16 and float32 caches) against SDPA
    for dt in (torch.float32, torch.bfloat16):
        q = torch.randn(1, 1, 8, 64, generator=g).to(dt)
        kc, vc = torch.randn(1, 2, 40, 64, generator=g).to(dt), torch.randn(1, 2, 40, 64, generator=g).to(dt)
        o = torch.empty(1, 1, 8 * 64, dtype=dt)
        assert native.library().lrq_attend(q.data_ptr(), 64, kc.data_ptr(), vc.data_ptr(), kc.stride(1),
                                           o.data_ptr(), dt == torch.bfloat16, 33, 8, 2, 64, 0.125) == 0
        ref = torch.nn.functional.scaled_dot_product_attention(q.transpose(1, 2).float(), kc[:, :, :33].float(),
                                                               vc[:, :, :33].float(), scale=0.125, enable_gqa=True)
        ref = ref.transpose(1, 2).reshape(1, 1, -1)
        # relative errors 1e-5 (float32: exp, the sums) and 1e-2 (bf16 output) count as the int kernels' 1e-6
        errs.append(((o.float() - ref).abs().max() / ref.abs().max()).item() / (10 if dt == torch.float32 else 1e4))
if native.library() is not None:   # a fused decoder layer step (dense float32 and bf16) against the module path
    from lrq.runtime import LeanDecoder
    from tests.conftest import tiny_model
    for dt in (torch.float32, torch.bfloat16):
        model = tiny_model("llama", hidden=192, seed=3).to(dt)
        outs = []
        for fused in (True, False):
            lean = LeanDecoder(model, 16)
            lean.fused = fused
            lean.forward(torch.arange(6)[None])
            outs.append(torch.cat([lean.forward(torch.tensor([[7 + j]])).float() for j in range(3)], 1))
            assert not fused or all(f is not None for f in lean._fused)
        rel = ((outs[0] - outs[1]).abs().max() / outs[1].abs().max()).item()
        errs.append(rel / (10 if dt == torch.float32 else 1e4))
int8_exact = None
if native.library() is not None:   # the AVX2 integer prefill kernel (forced: treated as a CPU without VNNI)
    import lrq.cpu_kernels as K
    from lrq.cpu_kernels import _int8_corrected
    K.AMX_PREFILL, K.int_mm_ok, int8_exact = False, lambda: False, True
    for kind, (n, k, m) in (("w8a8", (128, 100, 37)), ("w4a8", (192, 576, 41)), ("w4a8", (64, 1536, 7))):
        top = 16 if kind == "w4a8" else 256
        q, zero = torch.randint(0, top, (n, k), generator=g), torch.randint(0, top, (n, 1), generator=g).float()
        scale = torch.rand(n, 1, generator=g) * 0.02 + 1e-3
        w = K.Int4Int8Weights.build(q, scale, zero) if kind == "w4a8" else K.Int8GemmWeights.build(q, scale, zero, 8)
        xa = torch.randint(-128, 128, (m, k), dtype=torch.int8, generator=g)
        xa[0], rowsum = 127, xa.sum(dim=1, keepdim=True, dtype=torch.float32)
        xz, xsc = torch.randint(-20, 20, (m, 1), generator=g).float(), torch.rand(m, 1, generator=g) * 0.05
        acc = (xa.long() @ (q.long() - top // 2).t()).int()
        for out in (torch.float32, torch.bfloat16):
            got = K.native_int8_linear(xa, xz, xsc, rowsum, n, w.col_term, w.zero_term, w.scale, w.asymmetric, out,
                                       **({"layer": w.int4._native_layer()[1]} if kind == "w4a8" else {"weight": w.weight}))
            int8_exact = int8_exact and got is not None and torch.equal(
                got, _int8_corrected(acc, rowsum, xz, xsc, w.col_term, w.zero_term, w.scale, w.asymmetric, out))
    import lrq.packed as P   # the activation levels, grid and row sums: torch's ops' bits (clamps, halves, a NaN)
    import sys
    sys.path.insert(0, "tests")                        # test_packed imports conftest as pytest runs it
    from tests.test_packed import _quant_linear
    base = torch.randn(9, 244, generator=g) * 3
    base[1] = base[1].abs() + 0.5
    base[2, 20:27] = torch.tensor([1e6, -1e6, 0.0, 0.5, -0.5, 1.5, 2.5])
    base[3, 30] = float("nan")
    for scheme in ("w8a8", "w4a8"):
        p = P.PackedLinear.from_quant_linear(_quant_linear(scheme, cin=204, cout=72))
        for dt in (torch.float32, torch.bfloat16):
            x = base.to(dt)[:, 20:224]   # 204: both kernels leave a tail to their plain-C loop
            mine, ref = p._native_int8_activations(x, any_build=True), p._int8_activations_torch(x)
            int8_exact = int8_exact and all(torch.equal(a.nan_to_num(), b.nan_to_num()) and
                                            torch.equal(a.isnan(), b.isnan()) for a, b in zip(mine, ref))
print(json.dumps({"status": native.status(), "isa": native.isa(), "block": _pack_block(), "err": max(errs),
                  "int8_exact": int8_exact, "bf16_err": max(bf16_err, default=None),
                  "i16_excess": max(i16_excess, default=None), "i16_ran": i16_ran, "i16_extreme": i16_extreme}))
"""


def _probe(tmp_path, **env) -> dict:
    run = subprocess.run([sys.executable, "-c", _PROBE], cwd=ROOT, capture_output=True, text=True, timeout=300,
                         env={**os.environ, "LRQ_BENCH_CACHE": str(tmp_path / "cache"), **env})
    assert run.returncode == 0, run.stderr[-2000:]
    return json.loads(run.stdout.strip().splitlines()[-1])


def test_avx2_layout_and_avx2_build(tmp_path):
    """torch packs in blocks of 32 features where its AVX2 kernels run (a Zen 3), and the C file's AVX2 branch is
    what such a CPU compiles: both checked here, each on its own and together, by building for haswell and running
    torch at its AVX2 capability; the AVX2 integer prefill kernel (W8A8, and W4A8 on both packings) gives the
    corrected exact product to the bit in each, the activation levels (lrq_int8_activations, vectorized for AVX2
    too) are torch's ops' bits, and the AVX2 16-bit decode kernel (bf16 activations, float32 ones in "i16") runs
    where the packing is AVX2's, within its bound."""
    if "avx2" not in Path("/proc/cpuinfo").read_text():
        pytest.fail("this test needs an x86-64 CPU with AVX2 (every machine CI runs on has it)")
    both = _probe(tmp_path, ATEN_CPU_CAPABILITY="avx2", LRQ_NATIVE_MARCH="haswell")
    assert both["isa"] == "avx2" and both["block"] == 32 and both["err"] < 1e-6 and both["int8_exact"] is True
    # the AVX2 16-bit kernel (bf16 activations, float32 ones in "i16") ran on the layers with whole blocks of 32
    assert "int16 AVX2" in both["status"] and both["i16_ran"] == [True, True, True]
    assert both["i16_excess"] <= 1 and both["bf16_err"] < 2 ** -8 and both["i16_extreme"] <= 1
    layout = _probe(tmp_path, ATEN_CPU_CAPABILITY="avx2")
    assert layout["block"] == 32 and layout["err"] < 1e-6 and layout["int8_exact"] is True
    assert layout["i16_excess"] <= 1 and layout["bf16_err"] < 2 ** -8 and layout["i16_extreme"] <= 1
    build = _probe(tmp_path, LRQ_NATIVE_MARCH="haswell")
    assert build["isa"] == "avx2" and build["err"] < 1e-6 and build["int8_exact"] is True
    assert build["bf16_err"] < 2 ** -8 and build["i16_excess"] <= 1 and build["i16_extreme"] <= 1
    if build["block"] == 64:   # torch's AVX-512 packing (blocks of 64 features): the AVX2 build's float32 kernel
        assert not any(build["i16_ran"])
    else:                      # a CPU whose torch runs at AVX2 anyway (a Zen 3): its packing, the integer kernel
        assert build["block"] == 32 and build["i16_ran"] == [True, True, True]


def test_the_c_file_builds_without_warnings_for_every_kind_of_cpu(tmp_path):
    """The C file's branches compile cleanly for each kind of x86-64 CPU it meets, whatever this one is: plain
    x86-64 (no AVX2: the portable loops), haswell (AVX2, a Zen 3), cooperlake (AVX-512 VNNI and BF16, as a Zen 4)
    and sapphirerapids (AMX). -Wall -Werror: an intrinsic used outside the branch that includes it (an implicit
    declaration, a link failure on that CPU only) fails here, not on the user's machine."""
    import subprocess
    cc = native._compiler()
    assert cc is not None, "a C compiler (cc/gcc) is needed"
    runs = {}
    for march in ("x86-64", "haswell", "cooperlake", "sapphirerapids"):
        flags = [f if not f.startswith("-march=") else f"-march={march}" for f in native._flags()]
        runs[march] = subprocess.Popen([cc, *flags, "-Wall", "-Werror", str(native.SOURCE), "-o",
                                        str(tmp_path / f"{march}.so"), "-lm"], stderr=subprocess.PIPE, text=True)
    for march, run in runs.items():
        err = run.communicate(timeout=300)[1]
        assert run.returncode == 0, f"-march={march}: {err[-600:]}"
        assert (tmp_path / f"{march}.so").stat().st_size > 0


def test_without_a_compiler_torch_kernels_run_and_say_why(tmp_path):
    bad = tmp_path / "cc"
    bad.write_text("#!/bin/sh\necho 'cc: simulated failure' >&2\nexit 1\n")
    bad.chmod(0o755)
    out = _probe(tmp_path, CC=str(bad))
    assert out["isa"] is None and "simulated failure" in out["status"] and out["status"].startswith("torch")
    assert out["err"] < 1e-6     # torch's (dequantized float32) path, exact
    assert not any((tmp_path / "cache").rglob("*.so")) and not any((tmp_path / "cache").rglob("*.tmp"))
    off = _probe(tmp_path, LRQ_NATIVE="0")
    assert off["status"] == "torch (lrq native: turned off (LRQ_NATIVE=0))"


@pytest.mark.parametrize("scheme", ["w8a8", "w4a8"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_prefill_activations_and_corrections_are_torchs_bit_for_bit(scheme, dtype):
    """A W8A8/W4A8 prefill call's activation levels, grid and row sums (lrq_int8_activations) and its corrected
    output (lrq_int8_correct, float32 and bf16) equal torch's ops' to the bit: exact halves of the grid, extremes that
    clamp, a NaN, rows of one sign, a strided input; one thread and two."""
    import lrq.packed as P
    from tests.test_packed import _quant_linear
    p = P.PackedLinear.from_quant_linear(_quant_linear(scheme, cin=200, cout=72))
    g = torch.Generator().manual_seed(7)
    base = torch.randn(70, 240, generator=g) * 3
    base[1] = base[1].abs() + 0.5                        # a row without negatives: the zero point at the edge
    base[2, 20:27] = torch.tensor([1e6, -1e6, 0.0, 0.5, -0.5, 1.5, 2.5])   # clamped; exact halves (static grid)
    base[3, 30] = float("nan")                            # a NaN: the per-token row's grid NaN, as torch's
    x = base.to(dtype)[:, 20:220]                        # rows of unit stride 240 apart
    threads = torch.get_num_threads()
    try:
        for t in (1, 2):
            torch.set_num_threads(t)
            mine, ref = p._native_int8_activations(x, any_build=True), p._int8_activations_torch(x)
            assert mine is not None
            assert (p._native_int8_activations(x) is None) != bool(native.library().lrq_int8_activations_vectorized())
            for a, b in zip(mine, ref):
                assert torch.equal(a, b) or (a.dtype.is_floating_point and torch.equal(a.isnan(), b.isnan())
                                             and torch.equal(a.nan_to_num(), b.nan_to_num()))
            if scheme == "w4a8":
                assert mine[2][3].isnan().all() and not mine[2][:3].isnan().any()
            w = p.cpu_weights or p.convert_for_cpu()
            acc = torch.randint(-2**20, 2**20, (70, 80), dtype=torch.int32, generator=g)[:, :72]   # strided rows
            want = _int8_corrected_torch(acc, ref[3], ref[1], ref[2], w.col_term, w.zero_term, w.scale, w.asymmetric)
            for out in (torch.float32, torch.bfloat16):
                got = _int8_corrected(acc, ref[3], ref[1], ref[2], w.col_term, w.zero_term, w.scale, w.asymmetric,
                                      out)
                assert got.dtype == out and torch.equal(got.isnan(), want.isnan())
                assert torch.equal(got.nan_to_num(), want.to(out).nan_to_num())
    finally:
        torch.set_num_threads(threads)


def test_integer_layers_without_an_exact_int_mm(monkeypatch):
    """Where torch._int_mm saturates (a CPU without VNNI/AMX), W8A8 and W4A8 still multiply integer levels: the
    decode step through lrq.native, prefill through float32 slices whose sums are exact integers; the outputs equal
    the same layers with an exact _int_mm, to the bit at prefill."""
    import lrq.cpu_kernels as K
    import lrq.packed as P
    from tests.test_packed import _quant_linear
    x = torch.randn(40, 576) * 3
    for scheme in ("w8a8", "w4a8"):
        q = _quant_linear(scheme, cin=576, cout=48)
        exact = P.PackedLinear.from_quant_linear(q)
        with torch.no_grad():
            ref_prefill, ref_decode = exact(x), exact(x[:1])
        monkeypatch.setattr(K, "_INT_MM", False)          # as the probe finds on a Zen 3
        p = P.PackedLinear.from_quant_linear(q)
        assert P.int_mm_ok() is False and p.integer_activations()
        monkeypatch.setattr(torch, "_int_mm", lambda *a: pytest.fail("the saturating _int_mm was called"))
        with torch.no_grad():
            assert torch.equal(p(x), ref_prefill)
            torch.testing.assert_close(p(x[:1]), ref_decode, rtol=1e-5, atol=1e-5)
        monkeypatch.undo()
    g = torch.Generator().manual_seed(5)
    a = torch.randint(-128, 128, (3, 2500), dtype=torch.int8, generator=g)
    b = torch.randint(-128, 128, (2500, 7), dtype=torch.int8, generator=g)
    a[:, :1200], b[:1200] = -128, -128                    # partial sums past 2^24 without the slicing
    monkeypatch.setattr(K, "_INT_MM", False)
    assert torch.equal(K._int_mm(a, b).long(), a.long() @ b.long())


def _int8_layer(kind: str, n: int, k: int, symmetric: bool, seed: int):
    from lrq.cpu_kernels import Int4Int8Weights
    g = torch.Generator().manual_seed(seed)
    top = 16 if kind == "w4a8" else 256
    q = torch.randint(0, top, (n, k), generator=g)
    q[0] = top - 1                                       # a feature at the grid's edge: the largest products
    zero = torch.full((n, 1), top // 2) if symmetric else torch.randint(0, top, (n, 1), generator=g)
    scale = torch.rand(n, 1, generator=g) * 0.02 + 1e-3
    if kind == "w4a8":
        return Int4Int8Weights.build(q, scale, zero.float())
    return Int8GemmWeights.build(q, scale, zero.float(), 8)


@pytest.mark.parametrize("kernel", ["amx", "avx2"])
@pytest.mark.parametrize("kind", ["w8a8", "w4a8"])
def test_native_int8_prefill_is_the_corrected_integer_product_bit_for_bit(kind, kernel, monkeypatch):
    """A W8A8/W4A8 prefill call runs lrq.native's own kernel (native_int8_linear) where one applies: AMX tiles on a
    CPU with AMX-INT8; AVX2 integer products (int16 for W8A8, unsigned-by-4-bit bytes for W4A8, neither saturating)
    where oneDNN's int8 GEMM is not exact (no VNNI: a Zen 3; forced here on any CPU with AVX2 by treating its
    torch._int_mm as inexact). Its output equals the path without it (oneDNN's GEMM, or float32 GEMMs over slices,
    then the separate corrections) to the bit in float32 and bf16: per-token and static grids, symmetric and
    asymmetric weights, extreme levels, rows that do not fill a block (37, 70), features that do not fill a panel of
    64 (W4A8: 200 of 256), depths 64 to 2048 (AMX at 2048: k in two chunks, the rows in two passes of 352 and 348 over
    the panels; AVX2: a depth of 100 too), strided rows, one and two threads; a call of a few tokens keeps the decode
    kernel."""
    import lrq.cpu_kernels as K
    if kernel == "amx" and not K.amx_ready():
        pytest.skip("this CPU has no AMX-INT8 (test_the_amx_kernel_is_built_for_amx_cpus_only checks the build)")
    flag = "AMX_PREFILL" if kernel == "amx" else "AVX2_INT8_PREFILL"
    if kernel == "avx2":
        monkeypatch.setattr(K, "AMX_PREFILL", False)
        monkeypatch.setattr(K, "int_mm_ok", lambda: False)
        assert K.int8_prefill_kernel() == "avx2"
    calls = []
    real = K.native_int8_linear
    monkeypatch.setattr(K, "native_int8_linear", lambda *a, **kw: calls.append(a[0].shape[0]) or real(*a, **kw))
    g = torch.Generator().manual_seed(1)
    threads = torch.get_num_threads()
    shapes = [(192, 576, 70), (64, 64, 37), (200 if kind == "w4a8" else 128, 1536, 33), (576, 128, 512),
              (64, 2048, 700) if kernel == "amx" else (64, 100 if kind == "w8a8" else 2048, 41)]
    try:
        for i, (n, k, m) in enumerate(shapes):
            w = _int8_layer(kind, n, k, symmetric=i == 1, seed=i)
            xs_full = torch.randint(-128, 128, (m, k + 64), dtype=torch.int8, generator=g)
            xa = xs_full[:, 32:32 + k]                    # rows k + 64 apart
            xa[:3] = 127
            xa[3] = -128
            rowsum = xa.sum(dim=1, keepdim=True, dtype=torch.float32)
            grids = [(torch.tensor(-3.0), torch.tensor(0.02)),
                     (torch.randint(-20, 20, (m, 1), generator=g).float(), torch.rand(m, 1, generator=g) * 0.05)]
            for (xz, xsc) in grids:
                for t in (1, 2):
                    torch.set_num_threads(t)
                    for out in (torch.float32, torch.bfloat16):
                        calls.clear()
                        got = w.mm(xa, xz, xsc, rowsum, out)
                        assert calls == [m]
                        monkeypatch.setattr(K, flag, False)
                        want = w.mm(xa, xz, xsc, rowsum, out)
                        monkeypatch.setattr(K, flag, True)
                        assert got.dtype == want.dtype == out and got.shape == (m, n)
                        assert torch.equal(got, want), (n, k, m, out, t)
            calls.clear()
            monkeypatch.setattr(K, "native_int8_linear", lambda *a, **kw: pytest.fail("a decode call ran the kernel"))
            small = w.mm(xa[:K.AMX_FROM_M - 1], grids[0][0], grids[0][1], rowsum[:K.AMX_FROM_M - 1]) \
                if kind == "w8a8" else None                # W4A8's decode calls run its 4-bit form, not mm
            assert small is None or small.shape == (K.AMX_FROM_M - 1, n)
            monkeypatch.setattr(K, "native_int8_linear", lambda *a, **kw: calls.append(a[0].shape[0]) or real(*a, **kw))
    finally:
        torch.set_num_threads(threads)


def test_amx_kernel_is_built_for_amx_cpus_only(tmp_path):
    """The AMX tile code is compiled where the target has AMX-INT8 (here: -march=sapphirerapids, whatever this CPU
    is) and nowhere else (an Ice Lake target: AVX-512 VNNI, no AMX): the assembly holds tdpbssd in the first and not in the second, and both
    builds keep lrq_amx_ready and lrq_amx_int8_linear (which refuse, returning 0 and 1, without AMX)."""
    import shutil
    cc = shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        pytest.fail("no C compiler: lrq.native cannot be built (the suite needs one)")
    for march, amx in (("sapphirerapids", True), ("icelake-server", False)):
        asm = tmp_path / f"{march}.s"
        run = subprocess.run([cc, "-O3", f"-march={march}", "-fopenmp", "-S", str(native.SOURCE), "-o", str(asm)],
                             capture_output=True, text=True)
        assert run.returncode == 0, run.stderr[-2000:]
        text = asm.read_text()
        assert ("tdpbssd" in text) is amx and ("ldtilecfg" in text) is amx
        assert "lrq_amx_ready:" in text and "lrq_amx_int8_linear:" in text


def test_amx_weight_only_prefill_is_the_bf16_product(monkeypatch):
    """On a CPU with AMX a bf16 prefill call of a 4-bit weight-only layer runs lrq.native's bf16 tile kernel
    (Int4Weights._amx_mm): each panel dequantized to the values of the bf16 operand oneDNN's path multiplies, summed in
    float32 and rounded once, so its error against the float64 product of those values is the bf16 output's rounding,
    as oneDNN's is; whole blocks and rows that do not fill one, per channel and g128, one and two threads, depth 1536
    in three chunks of k and its rows in two passes over the panels (512 rows: 256 each; 357: 192 and 165)."""
    import lrq.cpu_kernels as K
    if not K.amx_ready():
        pytest.skip("this CPU has no AMX (test_amx_kernel_is_built_for_amx_cpus_only checks the build)")
    ran = []
    real = K.Int4Weights._amx_mm
    monkeypatch.setattr(K.Int4Weights, "_amx_mm", lambda self, x: ran.append(x.shape[0]) or real(self, x))
    g = torch.Generator().manual_seed(3)
    threads = torch.get_num_threads()
    try:
        for (n, k, group), m in [((1536, 576, 128), 70), ((576, 1536, None), 512), ((192, 576, 64), 37),
                                 ((128, 1536, 128), 357)]:
            w = _weights(n, k, group)
            x = (torch.randn(m, k, generator=g) * 3).bfloat16()
            ref_w = w.dequantized_t(torch.bfloat16)[:k, :n].double()
            ref, size = x.double() @ ref_w, x.double().abs() @ ref_w.abs()
            for t in (1, 2):
                torch.set_num_threads(t)
                ran.clear()
                got = w.mm(x)
                assert ran == [m] and got.dtype == torch.bfloat16 and got.shape == (m, n)
                monkeypatch.setattr(K, "AMX_PREFILL", False)
                theirs = w.mm(x)
                monkeypatch.setattr(K, "AMX_PREFILL", True)
                err, their_err = (((y.double() - ref).abs() / size).max().item() for y in (got, theirs))
                assert err <= 2 ** -8 and err <= 1.01 * their_err + 1e-6, (n, k, m, err, their_err)
    finally:
        torch.set_num_threads(threads)


def _bf16_ulps(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """How many bf16 steps apart two bf16 tensors are (finite values of one sign; 0 where equal)."""
    ai, bi = a.view(torch.int16).int(), b.view(torch.int16).int()
    return (ai - bi).abs()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_rms_norm_rows_add_the_residual_and_norm_as_torch(dtype):
    """lrq_rms_norm_rows (the lean runtime's prefill rows): x += res in place with torch's rounding of x + res (to
    the bit), then rms_norm(x) * w as torch's fused rms_norm computes it up to the order of its float32 sums (bf16:
    every value within one bf16 step and nearly all equal; float32: within a few ulps); rows of 576 and of 100 (a
    partial vector), with and without the residual, one and two threads; y NULL adds only."""
    import torch.nn.functional as F
    lib = native.library()
    assert lib is not None, native.status()
    g = torch.Generator().manual_seed(5)
    threads = torch.get_num_threads()
    try:
        for rows, n in ((37, 576), (300, 100)):
            for with_res in (True, False):
                for t in (1, 2):
                    torch.set_num_threads(t)
                    x = (torch.randn(rows, n, generator=g) * 3).to(dtype)
                    res = (torch.randn(rows, n, generator=g) * 2).to(dtype)
                    w = (torch.rand(n, generator=g) + 0.5).to(dtype)
                    want_x = x + res if with_res else x.clone()
                    want = F.rms_norm(want_x, (n,), w, eps=1e-5)
                    y = torch.empty_like(x)
                    lib.lrq_rms_norm_rows(x.data_ptr(), res.data_ptr() if with_res else None, w.data_ptr(),
                                          y.data_ptr(), dtype == torch.bfloat16, rows, n, 1e-5, t)
                    assert torch.equal(x, want_x)
                    if dtype == torch.bfloat16:
                        assert _bf16_ulps(y, want).max() <= 1 and (y == want).float().mean() >= 0.99
                    else:
                        torch.testing.assert_close(y, want, rtol=2e-6, atol=1e-6)
        x, res = torch.ones(4, 64, dtype=dtype), torch.full((4, 64), 0.5, dtype=dtype)
        lib.lrq_rms_norm_rows(x.data_ptr(), res.data_ptr(), None, None, dtype == torch.bfloat16, 4, 64, 0.0, 1)
        assert torch.equal(x, torch.full((4, 64), 1.5, dtype=dtype))
    finally:
        torch.set_num_threads(threads)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_silu_mul_is_torchs_silu_times_up(dtype):
    """lrq_silu_mul (the MLP's act(gate) * up over a prefill's rows): torch's F.silu(g) * u with its two roundings,
    up to the exponential's last float32 bits (bf16: within one bf16 step, nearly all equal; float32: relative 1e-6 of
    the float64 value); torch's values where they are special (NaN, +-inf, underflow to -0, large); a count that is
    not a multiple of 16; one and two threads."""
    import torch.nn.functional as F
    lib = native.library()
    assert lib is not None, native.status()
    g = torch.Generator().manual_seed(6)
    threads = torch.get_num_threads()
    try:
        for t in (1, 2):
            torch.set_num_threads(t)
            gate = (torch.randn(300_007, generator=g) * 4).to(dtype)
            gate[:9] = torch.tensor([float("nan"), float("inf"), float("-inf"), -100.0, 100.0, -88.0, 0.0, -0.0, 30.0])
            up = (torch.randn(300_007, generator=g) * 2).to(dtype)
            up[:9] = 1.0
            y = torch.empty_like(gate)
            lib.lrq_silu_mul(gate.data_ptr(), up.data_ptr(), y.data_ptr(), dtype == torch.bfloat16, gate.numel(), t)
            want = F.silu(gate) * up
            nan = want[:9].isnan()                          # silu(nan), silu(-inf) = -inf / inf
            assert torch.equal(y[:9].isnan(), nan) and nan.sum() == 2
            got_special, want_special = y[:9][~nan], want[:9][~nan]
            assert torch.equal(got_special, want_special)
            assert torch.equal(got_special.signbit(), want_special.signbit())
            if dtype == torch.bfloat16:
                same_sign = y.signbit() == want.signbit()
                assert same_sign[9:].all() and _bf16_ulps(y[9:], want[9:]).max() <= 1
                assert (y[9:] == want[9:]).float().mean() >= 0.999
            else:
                exact = F.silu(gate[9:].double()) * up[9:].double()
                assert ((y[9:].double() - exact).abs() <= 1e-6 * exact.abs() + 1e-30).all()
    finally:
        torch.set_num_threads(threads)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("heads,kv_heads,hd", [(9, 3, 64), (8, 1, 128), (5, 5, 80), (12, 2, 64), (4, 2, 24)])
def test_one_token_attention_is_sdpa_for_grouped_heads(heads, kv_heads, hd, dtype):
    """lrq_attend (a decode step's attention: one query token against the cache) equals SDPA in float64 on the same
    inputs: float32 within 2e-6 of the output's size, bf16 within one bf16 step of it; every group size (the query
    heads of a key/value head four at a time: groups of 1, 3, 6 and 8), head sizes a multiple of 64, of 16 only
    (80) and of neither (24: the plain loop); lengths below, at and above the 16 positions scored together, and
    long (531, scores far apart); query rows further apart than hd; nothing written beyond the output's rows."""
    lib = native.library()
    assert lib is not None, native.status()
    g = torch.Generator().manual_seed(heads * 1000 + hd)
    max_len, q_stride = 600, hd + 8
    kc = torch.randn(kv_heads, max_len, hd, generator=g).to(dtype)
    vc = torch.randn(kv_heads, max_len, hd, generator=g).to(dtype)
    for length in (1, 15, 16, 17, 531):
        q = (torch.randn(heads, q_stride, generator=g) * (3 if length == 531 else 1)).to(dtype)
        out = torch.full((heads * hd + 16,), 7.0, dtype=dtype)
        assert lib.lrq_attend(q.data_ptr(), q_stride, kc.data_ptr(), vc.data_ptr(), kc.stride(0), out.data_ptr(),
                              dtype == torch.bfloat16, length, heads, kv_heads, hd, hd ** -0.5) == 0
        ref = torch.nn.functional.scaled_dot_product_attention(
            q[None, :, None, :hd].double(), kc[None, :, :length].double(), vc[None, :, :length].double(),
            scale=hd ** -0.5, enable_gqa=True).reshape(-1)
        got = out[:heads * hd]
        assert torch.equal(out[heads * hd:], torch.full((16,), 7.0, dtype=dtype))
        if dtype == torch.float32:
            assert (got.double() - ref).abs().max() <= 2e-6 * ref.abs().max()
        else:
            assert _bf16_ulps(got, ref.to(dtype)).max() <= 1


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("hd", [64, 128, 24])
def test_one_token_rope_and_cache_write(hd, dtype):
    """lrq_rope_cache (a decode step's RoPE and cache write; 16 lanes where hd / 2 is a multiple of 16, plain C for
    24): q roped in place and k roped into the key cache as x cos + roll(x, hd / 2) sin' in float32 (each product
    rounded, then their sum, rounded once to the dtype: every bit), v copied into the value cache, at `pos` only."""
    lib = native.library()
    assert lib is not None, native.status()
    g = torch.Generator().manual_seed(hd)
    heads, kv_heads, max_len, pos = 6, 2, 20, 13
    q, k, v = (torch.randn(n, hd, generator=g).to(dtype) for n in (heads, kv_heads, kv_heads))
    cos, sin = torch.randn(max_len, hd, generator=g).to(dtype), torch.randn(max_len, hd, generator=g).to(dtype)
    kc, vc = torch.zeros(kv_heads, max_len, hd, dtype=dtype), torch.zeros(kv_heads, max_len, hd, dtype=dtype)

    def roped(x):
        f = x.float()
        return (f * cos[pos].float() + f.roll(hd // 2, -1) * sin[pos].float()).to(dtype)

    want_q, want_k = roped(q), roped(k)
    assert lib.lrq_rope_cache(q.data_ptr(), k.data_ptr(), v.data_ptr(), cos[pos].data_ptr(), sin[pos].data_ptr(),
                              kc.data_ptr(), vc.data_ptr(), kc.stride(0), pos, heads, kv_heads, hd,
                              dtype == torch.bfloat16) == 0
    assert torch.equal(q, want_q) and torch.equal(kc[:, pos], want_k) and torch.equal(vc[:, pos], v)
    others = torch.ones(max_len, dtype=torch.bool)
    others[pos] = False
    assert not kc[:, others].any() and not vc[:, others].any()


@pytest.mark.parametrize("n_pad,block", [(192, 64), (208, 64), (48, 64), (96, 32), (112, 32)])
def test_the_scales_are_held_block_by_block(n_pad, block):
    """A 4-bit layer's s and zc are held as the kernels read them (cpu_gemv.c's block_scales): per block of output
    features (the last one what n_pad mod block leaves), its groups in order, each the block's s then its zc; read
    back as [2, groups, n_pad] they are the rows they were made from, value for value."""
    from lrq.cpu_kernels import blocked_scale_zero, scale_zero_rows
    g = torch.Generator().manual_seed(n_pad)
    s, zc = torch.rand(5, n_pad, generator=g), torch.rand(5, n_pad, generator=g)
    blocked = blocked_scale_zero(s, zc, block)
    assert blocked.shape == (2 * 5 * n_pad,)
    assert torch.equal(scale_zero_rows(blocked, 5, n_pad, block), torch.stack([s, zc]))
    # block b's group 2: its s then its zc, at b * block * 5 * 2 + 2 * 2 * width
    nb = n_pad // block
    for b in range(nb + (n_pad % block > 0)):
        width = block if b < nb else n_pad - nb * block
        at = b * block * 10 + 2 * 2 * width
        assert torch.equal(blocked[at:at + width], s[2, b * block:b * block + width])
        assert torch.equal(blocked[at + width:at + 2 * width], zc[2, b * block:b * block + width])


@pytest.mark.parametrize("n_pad,block", [(192, 64), (208, 64), (48, 64), (96, 32), (112, 32)])
def test_compact_scales_are_held_block_by_block(n_pad, block):
    """Where the scales are fp16 values and the zero points integers of 0..255 they are held in 3 bytes a feature and
    group (compact_scale_zero): per block its groups in order, each the block's scales as fp16 then its zero points
    as uint8; read back, zc = -z * s exactly (the float32 form's (8 - z) s - 8 s, value for value). Values that do
    not fit are refused (the caller keeps float32)."""
    from lrq.cpu_kernels import blocked_scale_zero, compact_scale_zero, scale_zero_rows
    g = torch.Generator().manual_seed(n_pad)
    s = (torch.rand(5, n_pad, generator=g) * 3).half().float()
    s[0, :3] = torch.tensor([2.0 ** -24, 65504.0, 0.0])   # fp16's smallest subnormal and largest, a padding zero
    z = torch.randint(0, 256, (5, n_pad), generator=g).float()
    z[1, :2] = torch.tensor([0.0, 255.0])
    held = compact_scale_zero(s, z, block)
    assert held.dtype == torch.uint8 and held.shape == (3 * 5 * n_pad,)
    rows = scale_zero_rows(held, 5, n_pad, block)
    assert torch.equal(rows, scale_zero_rows(blocked_scale_zero(s, (8 - z) * s - 8 * s, block), 5, n_pad, block))
    assert torch.equal(rows[0], s) and torch.equal(rows[1], -z * s)
    nb = n_pad // block
    for b in range(nb + (n_pad % block > 0)):   # block b's group 2 at b * block * 5 * 3 + 2 * 3 * width
        width = block if b < nb else n_pad - nb * block
        at, cols = b * block * 15 + 2 * 3 * width, slice(b * block, b * block + width)
        assert torch.equal(held[at:at + 2 * width].view(torch.float16).float(), s[2, cols])
        assert torch.equal(held[at + 2 * width:at + 3 * width].float(), z[2, cols])
    assert compact_scale_zero(s + 2.0 ** -20, z, block) is None           # not fp16 values
    assert compact_scale_zero(s, z + 0.5, block) is None                  # not integers
    assert compact_scale_zero(s, z + 1, block) is None                    # 256
    assert compact_scale_zero(s, z - 1, block) is None                    # -1


@pytest.mark.parametrize("n,k,group", SHAPES + [(200, 576, 128)])
def test_compact_and_float32_scales_compute_the_same(n, k, group):
    """A layer held with compact scales (fp16 s, uint8 z, decoded a block at a time by lrq.native) computes exactly
    what the same layer held with float32 (s, zc) computes: the decode kernel's outputs (bf16 and float32
    activations, one and three tokens, one and two threads) and every unpack form, bit for bit."""
    g = torch.Generator().manual_seed(n + k)
    ng = -(-k // (group or k))
    q = torch.randint(0, 16, (n, k), generator=g)
    s, z = (torch.rand(n, ng, generator=g) * 0.02 + 1e-3).half().float(), torch.randint(0, 16, (n, ng), generator=g)
    a, b = (Int4Weights.build(q, s, z.float(), group, compact=c) for c in (True, False))
    assert a.scale_zero.dtype == torch.uint8 and b.scale_zero.dtype == torch.float32
    assert a.nbytes() < b.nbytes()
    assert torch.equal(a.scale_zero_rows(), b.scale_zero_rows())
    lib, threads = native.library(), torch.get_num_threads()
    try:
        for t in (1, 2):
            torch.set_num_threads(t)
            for dtype in (torch.bfloat16, torch.float32):
                for m in (1, 3):
                    x = torch.randn(m, k, generator=g).to(dtype)
                    assert torch.equal(a.native_mm(x), b.native_mm(x)), (dtype, m, t)
            n_pad, k_pad = a.packed.shape[0], a.packed.shape[1] * 2
            for form in range(6):
                outs = [torch.zeros(4 * n_pad * k_pad + 4 * n_pad, dtype=torch.uint8) for _ in range(2)]
                rcs = [lib.lrq_int4_unpack_t(w._native_layer()[1], o.data_ptr(), form, t) for w, o in zip((a, b), outs)]
                assert rcs[0] == rcs[1] and torch.equal(outs[0], outs[1]), (form, t)
    finally:
        torch.set_num_threads(threads)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("n", [1, 15, 16, 49152, 1003])
def test_argmax_is_torchs(n, dtype):
    """lrq.native's argmax (a greedy step's token) is torch.argmax's: the first of equal largest values, the first
    NaN where there is one, -inf alone, lengths not a multiple of 16; greedy_tokens returns it as [1, 1]."""
    from lrq.runtime import greedy_tokens
    lib = native.library()
    g = torch.Generator().manual_seed(n)
    cases = [torch.randn(n, generator=g), torch.full((n,), float("-inf")), torch.randint(0, 3, (n,), generator=g).float()]
    x = torch.randn(n, generator=g)
    x[n // 2] = float("nan")
    cases.append(x)
    x = torch.randn(n, generator=g)
    x[n - 1], x[n // 3] = float("nan"), float("inf")
    cases.append(x)
    for x in cases:
        x = x.to(dtype)
        assert lib.lrq_argmax(x.data_ptr(), dtype == torch.bfloat16, n) == x.argmax().item()
        assert torch.equal(greedy_tokens(x.view(1, 1, n)), x.view(1, 1, n)[:, -1].argmax(-1, keepdim=True))
    wide = torch.randn(2, 3, n, generator=g).to(dtype)   # two rows: torch's argmax, the last position's
    assert torch.equal(greedy_tokens(wide), wide[:, -1].argmax(-1, keepdim=True))
