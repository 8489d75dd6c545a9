"""Triton kernels under the interpreter (tests/conftest.py sets TRITON_INTERPRET=1) against their
plain-torch references: every kernel, every tile configuration of every M bucket, bits 2-8, per channel
and groups (tile-aligned and smaller than a tile, ragged last group), odd shapes, split K, bf16 / fp16 /
fp32 activations. (bf16 products are computed in float32 inside the kernel under the interpreter only:
its tl.dot is wrong for bf16; loads, conversions and stores stay bf16.)"""

import pytest
import torch
from hypothesis import example, given, settings, strategies as st

import lrq.kernels.int8_gemm as I8
import lrq.kernels.wq_gemm as WQ
from lrq.kernels.common import Buckets, TileConfig, split_k
from lrq.packing import pack_bits, pack_planar, plane_bits, unpack_planar
from lrq.quant import dequantize, n_groups

TOL = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1e-2}


def _layer(n, k, bits, group, seed):
    g = torch.Generator().manual_seed(seed)
    q = torch.randint(0, 2**bits, (n, k), generator=g)
    ng = n_groups(k, group)
    scale = (torch.rand(n, ng, generator=g) * 0.1 + 0.01).half()
    zero = torch.randint(0, 2**bits, (n, ng), generator=g).to(torch.uint8)
    return pack_planar(q, bits), scale, zero, q


def _rel(y, ref):
    return ((y.float() - ref.float()).abs().max() / ref.float().abs().max().clamp(min=1e-6)).item()


def test_the_kernels_run_under_the_interpreter_here():
    assert WQ.INTERPRET and WQ.triton is not None, "these tests need triton and TRITON_INTERPRET=1 (conftest sets it)"


@settings(max_examples=25, deadline=None)
@example(bits=2, m=1, n=1, k=279, group=48, bias=False, seed=12, dtype=torch.float16, split=None)  # near-cancelling
@given(bits=st.integers(2, 8), m=st.integers(1, 20), n=st.integers(1, 70), k=st.integers(1, 300),
       group=st.sampled_from([None, 32, 48, 64, 96, 128]), bias=st.booleans(), seed=st.integers(0, 1000),
       dtype=st.sampled_from([torch.float32, torch.float16, torch.bfloat16]), split=st.sampled_from([None, 1, 3]))
def test_wq_gemm_equals_reference(bits, m, n, k, group, bias, seed, dtype, split):
    if group is not None and group > k:
        group = None
    packed, scale, zero, q = _layer(n, k, bits, group, seed)
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(seed + 1)).to(dtype)
    b = torch.randn(n) if bias else None
    y = WQ.wq_matmul(x, packed, scale, zero, bits, group, k, b, split=split)
    ref = WQ.reference_wq_matmul(x, packed, scale, zero, bits, group, k, b)
    assert y.dtype == dtype and y.shape == (m, n)
    # relative to the size of the terms summed (sum |x| |w| + |b|), the scale of a dot product's rounding error:
    # relative to |ref| alone a near-cancelling output (n = 1, a small sum of large terms) fails on rounding
    w = dequantize(q, scale.float(), zero.float(), group)
    terms = x.float().abs() @ w.abs().t() + (0 if b is None else b.abs())
    assert ((y.float() - ref.float()).abs().max() / terms.max().clamp(min=1e-6)).item() < TOL[dtype]


@pytest.mark.parametrize("bucket", [0, 1, 2])
@pytest.mark.parametrize("kernel", ["wq", "int8"])
def test_every_tile_configuration_is_correct(bucket, kernel):
    """Each configuration the GPU may pick (all buckets), on a shape with ragged tiles in N, M and K."""
    buckets = WQ.WQ_BUCKETS if kernel == "wq" else I8.INT8_BUCKETS
    for c in buckets.configs[bucket]:
        for bits, group, dtype in [(3, None, torch.float16), (4, 128, torch.bfloat16), (8, None, torch.float32)]:
            if kernel == "int8":
                group = None
            n, k, m = c.block_n + 5, 300, min(c.block_m + 3, 40)
            packed, scale, zero, _ = _layer(n, k, bits, group, 7)
            x = torch.randn(m, k).to(dtype)
            b = torch.randn(n)
            if kernel == "wq":
                y = WQ.wq_matmul(x, packed, scale, zero, bits, group, k, b, config=c, split=2 if bucket == 0 else 1)
                ref = WQ.reference_wq_matmul(x, packed, scale, zero, bits, group, k, b)
            else:
                y = I8.int8_matmul(x, packed, scale, zero, bits, k, b, config=c, split=2 if bucket == 0 else 1)
                ref = I8.reference_int8_matmul(x, packed, scale, zero, bits, k, b)
            assert _rel(y, ref) < TOL[dtype], (str(c), bits, group, dtype)


def test_bucket_selection_and_split_k():
    assert [WQ.WQ_BUCKETS.bucket(m) for m in (1, 16, 17, 64, 65, 4096)] == [0, 0, 1, 1, 2, 2]
    assert isinstance(WQ.WQ_BUCKETS, Buckets) and all(len(cs) <= 2 for cs in WQ.WQ_BUCKETS.configs)
    for c in WQ.WQ_BUCKETS.all() + I8.INT8_BUCKETS.all():
        assert c.block_k % 32 == 0, "a 1-bit plane needs whole words per K tile"
    assert split_k(10, 4096, 128, 0) == 1                   # no GPU: never split
    assert split_k(64, 11008, 128, 132) == 4                # 4096x11008 at decode on an H200: 64 tiles -> 256 programs
    assert split_k(172, 4096, 128, 132) == 1                # 11008 rows already give 172 tiles
    assert split_k(1, 256, 128, 132) == 1                   # too little K to share


def test_small_groups_shrink_the_k_tile():
    """Groups of 32/64 under a 128-wide tile: the tile shrinks so scales load once per row and tile; a group
    that is not a multiple of 32 keeps the tile (per-element scales)."""
    c = TileConfig(16, 64, 128, 4, 4)
    assert WQ.fit_group(c, 0) == c and WQ.fit_group(c, 128) == c and WQ.fit_group(c, 256) == c
    assert WQ.fit_group(c, 64).block_k == 64 and WQ.fit_group(c, 32).block_k == 32
    assert WQ.fit_group(c, 96).block_k == 32
    assert WQ.fit_group(c, 48) == c
    (call,) = [ce for _, _, ce in WQ.compilations(1, 4096, 4096, 4, 32, torch.bfloat16, tune=False)]
    assert call["BLOCK_K"] == 32


def test_compilations_follow_the_dispatch():
    """What the GPU check counts as compilations is what the dispatchers launch: the decode bucket splits K
    (float32 atomics) only where the tiles are too few, large M goes to the dequantize kernel."""
    dec = WQ.compilations(1, 4096, 11008, 4, 128, torch.bfloat16)
    assert [k for k, _, _ in dec] == ["wq_gemm", "wq_gemm"] and all(ce["ATOMIC"] for _, _, ce in dec)
    assert [c for _, c, _ in dec] == list(WQ.WQ_BUCKETS.configs[0])
    wide = WQ.compilations(1, 11008, 4096, 4, None, torch.bfloat16)   # 172 tiles of 64 rows: no split; 86 of 128: 2
    assert [ce["ATOMIC"] for _, _, ce in wide] == [False, True]
    (big,) = WQ.compilations(4096, 4096, 4096, 3, None, torch.bfloat16)
    assert big[0] == "wq_dequant" and big[2]["P1"] == 1
    assert len(WQ.compilations(4096, 4096, 4096, 3, None, torch.bfloat16, large_m="fused")) == 2
    assert len(WQ.compilations(1, 4096, 4096, 4, None, torch.bfloat16, tune=False)) == 1
    i8 = I8.compilations(1, 4096, 4096, 8, torch.bfloat16, static=True)
    assert i8[0][0] == "act_quant" and i8[0][2]["STATIC"] and [k for k, _, _ in i8[1:]] == ["int8_gemm"] * 2


@pytest.mark.parametrize("bits", range(2, 9))
@pytest.mark.parametrize("group", [None, 32, 48, 128])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_dequantize_kernel_writes_the_weight(bits, group, dtype):
    n, k = 37, 300
    packed, scale, zero, q = _layer(n, k, bits, group, bits)
    w = WQ.dequantize_packed(packed, scale, zero, bits, group, k, dtype)
    ref = dequantize(q, scale.float(), zero.float(), group).to(dtype)
    assert w.dtype == dtype
    if dtype == torch.bfloat16:   # the interpreter's float32 -> bf16 conversion truncates (a GPU rounds): 1 ulp
        torch.testing.assert_close(w, ref, rtol=2**-7, atol=0)
    else:
        assert torch.equal(w, ref)


def test_large_m_never_uses_the_float32_reference(monkeypatch):
    """From LARGE_M rows the default path is dequantize kernel + torch matmul; "fused" keeps the kernel."""
    packed, scale, zero, _ = _layer(24, 96, 3, 32, 3)
    x = torch.randn(WQ.LARGE_M, 96, dtype=torch.float16)
    ref = WQ.reference_wq_matmul(x, packed, scale, zero, 3, 32, 96)
    calls = []
    real = WQ.dequantize_packed
    monkeypatch.setattr(WQ, "dequantize_packed", lambda *a, **k: calls.append(1) or real(*a, **k))
    monkeypatch.setattr(WQ, "reference_wq_matmul", lambda *a, **k: pytest.fail("fell back to the float32 reference"))
    assert _rel(WQ.wq_matmul(x, packed, scale, zero, 3, 32, 96), ref) < 2e-3 and calls == [1]
    assert _rel(WQ.wq_matmul(x, packed, scale, zero, 3, 32, 96, large_m="fused"), ref) < 2e-3 and calls == [1]
    with pytest.raises(ValueError, match="large_m"):
        WQ.wq_matmul(x, packed, scale, zero, 3, 32, 96, large_m="fastest")


def test_reference_is_the_dequantized_product():
    packed, scale, zero, q = _layer(24, 100, 3, 32, 0)
    x = torch.randn(5, 100)
    zf = zero.float().repeat_interleave(32, dim=1)[:, :100]
    sf = scale.float().repeat_interleave(32, dim=1)[:, :100]
    torch.testing.assert_close(WQ.reference_wq_matmul(x, packed, scale, zero, 3, 32, 100), x @ ((q - zf) * sf).t())


def test_wq_gemm_checks_its_inputs():
    packed, scale, zero, _ = _layer(8, 64, 4, None, 0)
    with pytest.raises(ValueError, match="does not match"):
        WQ.wq_matmul(torch.randn(2, 63), packed, scale, zero, 4, None, 64)
    with pytest.raises(ValueError, match="planar layout"):   # 5 words cannot hold 64 3-bit columns (6 needed)
        WQ.wq_matmul(torch.randn(2, 64), torch.zeros(8, 5, dtype=torch.int32), scale, zero, 3, None, 64)
    assert WQ.wq_matmul(torch.randn(0, 64), packed, scale, zero, 4, None, 64).shape == (0, 8)


def test_the_fused_kernel_itself_runs(monkeypatch):
    packed, scale, zero, _ = _layer(40, 96, 3, 32, 3)
    x = torch.randn(3, 96)
    ref = WQ.reference_wq_matmul(x, packed, scale, zero, 3, 32, 96)
    monkeypatch.setattr(WQ, "reference_wq_matmul", lambda *a, **k: pytest.fail("fell back to the torch reference"))
    torch.testing.assert_close(WQ.wq_matmul(x, packed, scale, zero, 3, 32, 96), ref, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("static", [False, True])
def test_activation_quantization_kernel_is_bit_exact(dtype, static):
    """Levels, scales and zero points equal torch's to the last bit (IEEE division, round half to even),
    on rows with ties, constant rows, one-signed rows and K past one chunk."""
    g = torch.Generator().manual_seed(1)
    x = (torch.randn(9, 2100, generator=g) * 4).to(dtype)
    x[1] = 0.0
    x[2] = x[2].abs()
    x[3] = -x[3].abs()
    x[4, :8] = torch.tensor([0.5, 1.5, 2.5, -0.5, -1.5, 3.0, -3.0, 0.0], dtype=dtype)
    rng = (torch.tensor(0.037), torch.tensor(121.0)) if static else None
    xa, sx, zx = I8.quantize_activations(x, rng)
    xa2, sx2, zx2, xsum = I8.quantize_activations_gpu(x, rng)
    assert torch.equal(xa, xa2) and torch.equal(sx, sx2) and torch.equal(zx, zx2)
    assert torch.equal(xsum, xa.sum(dim=1, dtype=torch.int32))


@settings(max_examples=15, deadline=None)
@given(bits=st.sampled_from([8, 4, 3, 2, 7]), m=st.integers(1, 20), n=st.integers(1, 50), k=st.integers(1, 200),
       static=st.booleans(), bias=st.booleans(), seed=st.integers(0, 1000), split=st.sampled_from([None, 2]),
       dtype=st.sampled_from([torch.float32, torch.float16, torch.bfloat16]))
def test_int8_gemm_equals_reference(bits, m, n, k, static, bias, seed, split, dtype):
    packed, scale, zero, _ = _layer(n, k, bits, None, seed)
    g = torch.Generator().manual_seed(seed + 7)
    x = torch.randn(m, k, generator=g).to(dtype)
    rng = (torch.tensor(0.02), torch.tensor(120.0)) if static else None
    b = torch.randn(n, generator=g) if bias else None
    y = I8.int8_matmul(x, packed, scale, zero, bits, k, b, rng, split=split)
    ref = I8.reference_int8_matmul(x, packed, scale, zero, bits, k, b, rng)
    assert y.dtype == dtype and _rel(y, ref) < TOL[dtype]


def test_int8_reference_is_the_fake_quantized_product():
    """The reference equals QuantLinear's fake-quant forward for w8a8 (static) and w4a8 (per token)."""
    from lrq.qlinear import QuantLinear
    from lrq.quant import minmax_qparams
    from lrq.schemes import get_scheme
    torch.manual_seed(0)
    for name in ("w8a8", "w4a8"):
        s = get_scheme(name)
        lin = torch.nn.Linear(48, 20)
        sc, z = minmax_qparams(lin.weight, s.w_bits)
        q = QuantLinear.from_linear(lin, s, sc.half().float(), z)
        static = None
        if s.static_activations:
            q.set_static_range(torch.tensor(0.03), torch.tensor(100.0))
            static = (q.act_scale, q.act_zero)
        x = torch.randn(7, 48)
        y = I8.reference_int8_matmul(x, pack_planar(q.qweight, s.w_bits), q.scale.half(), q.zero.to(torch.uint8),
                                     s.w_bits, 48, q.bias, static)
        torch.testing.assert_close(y, q(x), rtol=1e-4, atol=1e-4)


@settings(max_examples=40, deadline=None)
@given(bits=st.integers(2, 8), rows=st.integers(1, 4), n=st.integers(1, 150), seed=st.integers(0, 2**16))
def test_planar_layout_round_trip(bits, rows, n, seed):
    from lrq.packing import planar_to_stream, planar_words, stream_to_planar
    q = torch.randint(0, 2**bits, (rows, n), generator=torch.Generator().manual_seed(seed))
    p = pack_planar(q, bits)
    assert p.shape == (rows, planar_words(n, bits)) and torch.equal(unpack_planar(p, bits, n).long(), q)
    assert torch.equal(planar_to_stream(p, bits, n), pack_bits(q, bits))
    assert torch.equal(stream_to_planar(pack_bits(q, bits), bits, n), p)
    if bits in (2, 4, 8):
        assert torch.equal(p, pack_bits(q, bits)), "2/4/8 bits: the planar layout is compressed-tensors' stream"
    assert sum(plane_bits(bits)) == bits


def test_planar_layout_of_3_bits():
    """3 bits = a 2-bit plane of the low bits (16 per word) then a 1-bit plane of the high bit (32 per word)."""
    q = torch.zeros(1, 32, dtype=torch.int64)
    q[0, 0] = 0b111
    q[0, 31] = 0b100
    p = pack_planar(q, 3)
    assert p.shape == (1, 3)                      # 2 words of 2-bit plane + 1 word of 1-bit plane
    assert p[0, 0].item() == 0b11 and p[0, 1].item() == 0
    assert p[0, 2].item() == 1 - (1 << 31)         # bits 0 and 31 of the high plane (signed int32)


def test_tile_config_repr():
    assert str(TileConfig(16, 64, 128, 4, 4)) == "16x64x128 w4 s4"
