"""Dense bit packing and the packed CPU execution path."""

import pytest
import torch
from hypothesis import given, settings, strategies as st

from conftest import tiny_model
from lrq.arch import block_linears, decoder_blocks
from lrq.errors import UserError
from lrq.methods import get_method
from lrq.packed import PackedLinear, int_mm_ok, pack_model
from lrq.packing import pack_bits, packed_words, unpack_bits
from lrq.qlinear import QuantLinear
from lrq.quant import minmax_qparams, per_tensor_fake_quant
from lrq.schemes import SCHEMES, get_scheme


@settings(max_examples=60, deadline=None)
@given(bits=st.integers(2, 8), rows=st.integers(1, 5), n=st.integers(1, 100), seed=st.integers(0, 2**16))
def test_pack_unpack_round_trip(bits, rows, n, seed):
    q = torch.randint(0, 2**bits, (rows, n), generator=torch.Generator().manual_seed(seed), dtype=torch.int64)
    packed = pack_bits(q, bits)
    assert packed.dtype == torch.int32 and packed.shape == (rows, packed_words(n, bits))
    assert torch.equal(unpack_bits(packed, bits, n).long(), q)


def test_layout_is_a_dense_lsb_first_bit_stream():
    # 3-bit: element j occupies stream bits [3j, 3j + 3); element 10 straddles words 0 and 1
    q = torch.zeros(1, 32, dtype=torch.int64)
    q[0, 10] = 0b111
    p = pack_bits(q, 3)
    assert p.shape == (1, 3)
    assert p[0, 0].item() == -(1 << 31) + (1 << 30)   # bits 30 and 31 of word 0 (signed int32)
    assert p[0, 1].item() == 1                        # bit 32 of the stream = bit 0 of word 1
    q4 = torch.arange(8, dtype=torch.int64).view(1, 8)
    assert pack_bits(q4, 4)[0, 0].item() == 0x76543210


def test_packing_rejects_bad_input():
    with pytest.raises(UserError, match="2 to 8 bits"):
        pack_bits(torch.zeros(1, 4, dtype=torch.int64), 9)
    with pytest.raises(ValueError, match="outside"):
        pack_bits(torch.full((1, 4), 16), 4)
    with pytest.raises(ValueError, match="cannot hold"):
        unpack_bits(torch.zeros(1, 2, dtype=torch.int32), 4, 40)


def _quant_linear(scheme_name, cin=200, cout=24, seed=0):
    torch.manual_seed(seed)
    scheme = get_scheme(scheme_name)
    lin = torch.nn.Linear(cin, cout)
    scale, zero = minmax_qparams(lin.weight, scheme.w_bits, scheme.group_size)
    q = QuantLinear.from_linear(lin, scheme, scale.half().float(), zero)
    if scheme.static_activations:
        q.set_static_range(torch.tensor(0.02), torch.tensor(128.0))
    return q


@pytest.mark.parametrize("scheme_name", list(SCHEMES))
def test_packed_linear_matches_fake_quant(scheme_name):
    q = _quant_linear(scheme_name, cin=200 if "g128" not in scheme_name else 300)
    p = PackedLinear.from_quant_linear(q)
    assert torch.equal(p.levels(), q.qweight)
    x = torch.randn(3, 20, q.in_features)
    torch.testing.assert_close(p(x), q(x), rtol=1e-4, atol=1e-4)


def test_w8a8_integer_path_is_exact():
    """int8 x int8 -> int32 with the zero-point corrections equals the dequantized float product, on a CPU
    whose torch._int_mm is exact; where it is not (no VNNI: AVX2, Zen 3), the layer must not use it."""
    from lrq.cpu_kernels import Int8GemmWeights
    q = _quant_linear("w8a8", cin=576, cout=40)
    p = PackedLinear.from_quant_linear(q)
    x = torch.randn(33, 576) * 3      # large activations: the saturating case on AVX2
    xd = per_tensor_fake_quant(x.double(), p.act_scale.double(), p.act_zero.double())
    y_ref = (xd @ p.dequantized_weight(torch.float64).t() + p.bias.double()).float()
    torch.testing.assert_close(p(x), y_ref, rtol=1e-5, atol=1e-5)
    from lrq import native
    assert isinstance(p.cpu_weights, Int8GemmWeights) == (int_mm_ok() or native.library() is not None)
    if not int_mm_ok():   # the probe refused it: either no _int_mm at all, or one that is wrong on full-range int8
        a = torch.full((17, 576), 127, dtype=torch.int8)   # AVX2: (127 + 128) * 127 * 2 > int16's 32767
        try:
            got = torch._int_mm(a, a.t().contiguous())
        except Exception:  # noqa: BLE001 - not available on this build: nothing more to check
            return
        assert not torch.equal(got.long(), a.long() @ a.long().t()), "probe refused an exact torch._int_mm"


def test_w4a8_holds_half_a_byte_a_weight_and_its_integer_prefill_is_exact():
    """W4A8 with integer activations is held once as the int4 form (not as int8 levels): its prefill-sized calls
    run the transient int8 levels through torch._int_mm, exact against the float64 product on the same activation
    grid; decode runs the integer activation levels through the int4 kernel (bf16 rounding)."""
    import lrq.cpu_kernels as K
    from lrq.quant import per_token_fake_quant
    q = _quant_linear("w4a8", cin=576, cout=40)
    p = PackedLinear.from_quant_linear(q)
    from lrq import native
    if not (int_mm_ok() or native.library() is not None):   # no exact integer product: the float path runs
        assert not isinstance(p.cpu_weights, K.Int4Int8Weights)
        return
    assert isinstance(p.cpu_weights, K.Int4Int8Weights)
    assert p.storage_bytes() < 40 * 576     # half a byte a weight plus the kernel's scales: under int8's byte
    w64 = p.dequantized_weight(torch.float64).t()
    bias = 0 if p.bias is None else p.bias.double()
    for m in (K.DEQUANTIZE_FROM_M[torch.bfloat16], 70):
        x = (torch.randn(m, 576) * 3).bfloat16()
        ref = (per_token_fake_quant(x.double(), 8) @ w64 + bias)
        got = p(x)
        assert got.dtype == torch.bfloat16
        # bf16 rounding of the float32 result; a level on a .5 boundary may round apart from float64's grid
        torch.testing.assert_close(got.double(), ref.bfloat16().double(), rtol=8e-3, atol=1e-4 * ref.abs().max())
    x = torch.randn(1, 576).bfloat16()
    ref = per_token_fake_quant(x.double(), 8) @ w64 + bias
    torch.testing.assert_close(p(x).double(), ref, rtol=3e-2, atol=3e-2)


def test_a_float32_w4a8_prefill_multiplies_levels_where_onednn_int8_is_not_exact(monkeypatch):
    """On a CPU without VNNI (a Zen 3; forced here by treating torch._int_mm as inexact) a float32 W4A8 prefill call
    multiplies the activation levels by the 4-bit levels in lrq.native's AVX2 integer kernel (block 32 or 64 packing
    alike) instead of dequantizing both into a float32 GEMM: the same grid's product, exact before the float32
    corrections; LRQ_AVX2_INT8=0 keeps the float path, which agrees within float32 rounding; decode calls keep the
    4-bit form."""
    import lrq.cpu_kernels as K
    from lrq import native
    from lrq.quant import per_token_fake_quant
    if native.library() is None:
        pytest.skip("lrq.native is not built here (test_native checks that it builds on x86-64 CPUs)")
    monkeypatch.setattr(K, "AMX_PREFILL", False)
    monkeypatch.setattr(K, "int_mm_ok", lambda: False)
    calls = []
    real = K.native_int8_linear
    monkeypatch.setattr(K, "native_int8_linear", lambda *a, **kw: calls.append(a[0].shape[0]) or real(*a, **kw))
    p = PackedLinear.from_quant_linear(_quant_linear("w4a8", cin=576, cout=128))
    assert isinstance(p.cpu_weights, K.Int4Int8Weights)
    w64 = p.dequantized_weight(torch.float64).t()
    x = torch.randn(70, 576) * 3
    ref = per_token_fake_quant(x.double(), 8) @ w64 + p.bias.double()
    with torch.no_grad():
        got = p(x)
        assert calls == [70] and got.dtype == torch.float32
        torch.testing.assert_close(got.double(), ref, rtol=1e-5, atol=1e-5 * ref.abs().max().item())
        monkeypatch.setattr(K, "AVX2_INT8_PREFILL", False)
        calls.clear()
        floats = p(x)
        assert calls == [] and K.int8_prefill_kernel() is None
        torch.testing.assert_close(floats, got, rtol=1e-4, atol=1e-4 * ref.abs().max().item())
        monkeypatch.setattr(K, "AVX2_INT8_PREFILL", True)
        p(x[:1])
        assert calls == []


def test_a_new_static_range_reaches_the_integer_path():
    """The static activations' grid is kept between calls for speed, and remade when the range changes."""
    q = _quant_linear("w8a8", cin=576, cout=40)
    p = PackedLinear.from_quant_linear(q)
    x = torch.randn(2, 576)
    torch.testing.assert_close(p(x), q(x), rtol=1e-5, atol=1e-5)
    for m in (q, p):               # copied in place, as the calibration sets it
        m.act_scale.copy_(torch.tensor(0.05))
        m.act_zero.copy_(torch.tensor(100.0))
    torch.testing.assert_close(p(x), q(x), rtol=1e-5, atol=1e-5)
    p.act_zero.fill_(90.0)         # changed in place: the kept grid must notice
    q.act_zero.fill_(90.0)
    torch.testing.assert_close(p(x), q(x), rtol=1e-5, atol=1e-5)


def test_the_int_mm_probe_refuses_a_saturating_gemm(monkeypatch):
    """vpmaddubsw (AVX2) adds pairs of u8 x s8 products in int16 with saturation: the probe must see it."""
    import lrq.packed as P

    def saturating(a, b):   # oneDNN's AVX2 scheme: a + 128 as u8, pairs summed in int16, then int32
        u = (a.long() + 128)
        prod = u.unsqueeze(2) * b.long().unsqueeze(0)                     # [M, K, N]
        k = prod.shape[1] // 2 * 2
        pairs = (prod[:, 0:k:2] + prod[:, 1:k:2]).clamp(-32768, 32767).sum(1)
        comp = 128 * b.long().sum(0, keepdim=True)
        return (pairs - comp).int()

    assert P._int_mm_available() == P.int_mm_ok()
    monkeypatch.setattr(torch, "_int_mm", saturating)
    assert P._int_mm_available() is False
    monkeypatch.setattr(torch, "_int_mm", lambda a, b: (a.long() @ b.long()).int())   # an exact one passes
    assert P._int_mm_available() is True


def test_pack_model_keeps_logits_and_shrinks_weights(arch):
    model = tiny_model(arch, hidden=192)
    M = get_method("rtn")
    M.quantize(model, get_scheme("w4a16-g128"), M.config("quick"), None)
    ids = torch.randint(0, 128, (2, 16))
    for m in model.modules():   # packed scales are fp16, as deployed: compare on the same grid
        if isinstance(m, QuantLinear):
            m.set_weight(m.qweight, m.scale.half().float(), m.zero)
    with torch.no_grad():
        ref = model(ids).logits
    sizes = pack_model(model)
    assert all(isinstance(m, PackedLinear) for b in decoder_blocks(model) for m in block_linears(b).values())
    # 0.25 for the 4-bit words, plus the int4 kernel's scales (bf16 and float32, groups of 64 for the ragged 192)
    assert sizes["linear_bytes_packed"] < 0.4 * sizes["linear_bytes_bf16"]
    with torch.no_grad():
        torch.testing.assert_close(model(ids).logits, ref, rtol=1e-4, atol=1e-4)


CPU_FORMATS = ("w4a16", "w4a16-g128", "w3a16", "w3a16-g128", "w8a16", "w4a8", "w8a8")


@pytest.mark.parametrize("scheme_name", CPU_FORMATS)
@pytest.mark.parametrize("n,k", [(40, 200), (24, 576), (100, 300)])   # K, N off 32/64; 576 = 4 x 128 + 64
def test_cpu_kernels_match_fake_quant_on_odd_shapes(scheme_name, n, k):
    """Every format's CPU kernel against the fake-quant QuantLinear: decode (1 token) and prefill-sized
    inputs, 2-D and 3-D, float32 (the tolerance of the exact path) and bf16 (bf16 rounding)."""
    q = _quant_linear(scheme_name, cin=k, cout=n)
    p = PackedLinear.from_quant_linear(q)
    assert p.cpu_weights is not None and p.weight_packed is None and torch.equal(p.levels(), q.qweight)
    for shape in ((1, k), (2, 40, k), (70, k)):
        x = torch.randn(shape)
        torch.testing.assert_close(p(x), q(x), rtol=1e-4, atol=1e-4)
        y = p(x.bfloat16())
        assert y.dtype == torch.bfloat16
        torch.testing.assert_close(y.float(), q(x), rtol=3e-2, atol=3e-2)


@pytest.mark.parametrize("scheme_name", CPU_FORMATS)
def test_no_format_unpacks_or_dequantizes_per_call_at_decode(monkeypatch, scheme_name):
    """Packed once: a bf16 decode step after packing neither unpacks bits nor dequantizes a weight; a prefill-sized
    call of a 4-bit form reads its own packing into a transient dense weight (the faster path there), and nothing
    else unpacks (no planar words, no repacking)."""
    import lrq.cpu_kernels as K
    import lrq.packed as P
    import lrq.packing as B
    q = _quant_linear(scheme_name, cin=576, cout=48)
    p = PackedLinear.from_quant_linear(q)
    calls = []
    for mod, name in ((P, "unpack_planar"), (P, "dequantize"), (B, "_unpack"), (K, "_int4pack"),
                      (K, "_int4pack_source"), (K, "_unpack_int4pack_t"), (K.Int8Weights, "dequantized"),
                      (K.Int4Weights, "dequantized_t"), (K.Int4Weights, "_blocked_mm")):
        if hasattr(mod, name):
            monkeypatch.setattr(mod, name, lambda *a, _n=name, _f=getattr(mod, name), **kw: calls.append(_n) or _f(*a, **kw))
    held = p.storage_bytes()
    with torch.no_grad():
        p(torch.randn(1, 576).bfloat16())
        assert calls == []
        p(torch.randn(2, 70, 576).bfloat16())
    from lrq import native
    # the 4-bit form's transient operand: lrq.native writes it into oneDNN's blocked layout (OneDNNOperand) where
    # that layout is oneDNN's here, else reads the packing into a plain one in C, else torch's ops unpack it; W4A8's
    # prefill reads its levels into a transient int8 weight (in C where lrq.native is built)
    torch_unpacks = ["_unpack_int4pack_t"] if native.library() is None else []
    w = p.cpu_weights
    blocked = (isinstance(w, K.Int4Weights) and native.library() is not None
               and K.OneDNNOperand.layout_matches("bf16", w.packed.shape[0], w.packed.shape[1] * 2))
    transient = {K.Int4Weights: ["_blocked_mm"] + ([] if blocked else ["dequantized_t"] + torch_unpacks),
                 K.Int4Int8Weights: torch_unpacks, K.Int8Weights: ["dequantized"]}
    assert calls == transient.get(type(p.cpu_weights), [])
    assert p.storage_bytes() == held


@pytest.mark.parametrize("n,k,group", [(576, 1536, 128), (100, 300, None), (48, 576, 64), (24, 64, 32)])
def test_int4_prefill_path_reads_the_kernels_packing_exactly(n, k, group):
    """The 4-bit form's prefill path reads torch's int4 packing back (blocks of 64 features and a remainder block):
    the levels equal those packed, the dense weight equals (q - z) * s, and both paths of `mm` agree: float32 to
    float32 rounding, bf16 to bf16 rounding. Where the reading does not match the packing (another torch's layout),
    the int4 kernel runs at every size."""
    import lrq.cpu_kernels as K
    g = torch.Generator().manual_seed(n + k)
    ng = -(-k // (group or k))
    q = torch.randint(0, 16, (n, k), generator=g)
    s, z = torch.rand(n, ng, generator=g) * 0.01 + 1e-3, torch.randint(0, 16, (n, ng), generator=g).float()
    w = K.Int4Weights.build(q, s, z, group)
    assert w.decodable
    cols = torch.arange(k) // (group or k)
    ref = (q.float() - z[:, cols]) * s[:, cols]
    torch.testing.assert_close(w.dequantized_t()[:k, :n].t(), ref, rtol=1e-6, atol=1e-7)
    assert torch.equal(w.dequantized_t(torch.bfloat16), w.dequantized_t().bfloat16())   # chunked: rounded once
    small, large = torch.randn(1, k, generator=g), torch.randn(K.DEQUANTIZE_FROM_M[torch.bfloat16] + 3, k, generator=g)
    for x in (small, large):
        torch.testing.assert_close(w.mm(x), x @ ref.t(), rtol=1e-5, atol=1e-5)
        y = w.mm(x.bfloat16())
        assert y.dtype == torch.bfloat16
        torch.testing.assert_close(y.float(), x @ ref.t(), rtol=2e-2, atol=2e-2)
    kernel_only = K.Int4Weights(**{**w.__dict__, "decodable": False})
    torch.testing.assert_close(kernel_only.mm(large.bfloat16()).float(), w.mm(large.bfloat16()).float(),
                               rtol=2e-2, atol=2e-2)


def test_int4_layout_check_refuses_a_reading_that_differs(monkeypatch):
    import lrq.cpu_kernels as K
    monkeypatch.setattr(K, "_unpack_int4pack_t", lambda packed, out=None, _f=K._unpack_int4pack_t: _f(packed, out).zero_())
    w = K.Int4Weights.build(torch.randint(0, 16, (64, 128)), torch.rand(64, 1), torch.full((64, 1), 8.0), None)
    assert not w.decodable
    calls = []
    monkeypatch.setattr(torch, "_weight_int4pack_mm_for_cpu",
                        lambda *a, _f=torch._weight_int4pack_mm_for_cpu: calls.append(1) or _f(*a))
    w.mm(torch.randn(200, 128).bfloat16())
    assert calls == [1]


def test_memory_counts_what_is_held():
    """One copy of the weights on the CPU: the kernel's form replaces the planar words, and storage_bytes (what
    lrq.pack reports) is every tensor held; on SmolLM2's width the 4- and 3-bit forms stay near half a byte."""
    def tensors(obj):   # every tensor of a form, nested forms (Int4Int8Weights holds an Int4Weights) included
        if isinstance(obj, torch.Tensor):
            return [obj]
        if isinstance(obj, dict):
            obj = list(obj.values())
        elif hasattr(obj, "__dataclass_fields__"):
            obj = [getattr(obj, f) for f in obj.__dataclass_fields__]
        return [t for o in obj for t in tensors(o)] if isinstance(obj, (list, tuple)) else []

    for name in CPU_FORMATS:
        p = PackedLinear.from_quant_linear(_quant_linear(name, cin=576, cout=576))
        held = sum(t.numel() * t.element_size() for t in tensors(p.cpu_weights) + list(p.buffers()))
        assert p.weight_packed is None and p.storage_bytes() == held
        per_weight = p.storage_bytes() / 576**2
        assert per_weight < (0.75 if p.bits <= 4 else 1.05), (name, per_weight)


def test_the_cpu_form_survives_moves_and_state_dicts():
    """A dtype cast or device move goes through the planar words and back; the state dict holds the planar
    words (the portable form), and loads into a module that converts them again."""
    q = _quant_linear("w3a16-g128", cin=300, cout=40)
    p = PackedLinear.from_quant_linear(q)
    words = PackedLinear.from_quant_linear(q).planar_words()
    sd = p.state_dict()
    assert torch.equal(sd["weight_packed"], words)
    p.to(torch.float32)
    assert p.cpu_weights is not None and torch.equal(p.levels(), q.qweight)
    fresh = PackedLinear(300, 40, True, q.scheme)
    fresh.convert_for_cpu()
    fresh.load_state_dict(sd)
    x = torch.randn(5, 300)
    torch.testing.assert_close(fresh(x), p(x), rtol=0, atol=0)


def test_the_kernels_read_fp16_scales_whatever_precision_the_module_keeps():
    """A PackedLinear holds its scales at the precision it was given (fp16 when packed, float32 when a float32
    checkpoint is read back); the GPU kernels are compiled and checked for fp16 scale pointers only, so they get
    an fp16 copy, made once and remade when the scales change."""
    s = get_scheme("w4a16-g128")
    m16 = PackedLinear(256, 64, False, s)
    assert m16.scale.dtype == torch.float16 and m16.kernel_scale() is m16.scale
    m32 = PackedLinear(256, 64, True, s, scale_dtype=torch.float32, bias_dtype=torch.float32)
    assert m32.scale.dtype == torch.float32 and m32.bias.dtype == torch.float32
    m32.scale.copy_(torch.rand(64, 2) + 0.5)
    k = m32.kernel_scale()
    assert k.dtype == torch.float16 and torch.equal(k, m32.scale.half()) and m32.kernel_scale() is k
    m32.scale.mul_(2)                                   # changed in place: the copy follows
    assert torch.equal(m32.kernel_scale(), m32.scale.half())
    # on the CPU the module computes with its own float32 scales
    x = torch.randn(3, 256)
    w = m32.dequantized_weight(torch.float32)
    torch.testing.assert_close(m32(x), x @ w.t() + m32.bias, rtol=0, atol=1e-5)


def test_linears_reading_one_input_quantize_it_once(monkeypatch):
    """Dynamic per-token activations: q/k/v and gate/up read the same tensor, so a forward quantizes it once per
    group (4 quantizations a block, not 7), with outputs equal to quantizing per layer; a tensor changed in place
    since (its version counter moved) is quantized again."""
    import lrq.packed as P
    from lrq.schemes import get_scheme
    model = tiny_model("llama", hidden=192)
    rtn = get_method("rtn")
    rtn.quantize(model, get_scheme("w4a8"), rtn.config("quick"), None)
    pack_model(model)
    calls = []
    monkeypatch.setattr(P.PackedLinear, "_shared",
                        lambda self, x, form, compute, _f=P.PackedLinear._shared: calls.append(form) or
                        _f(self, x, form, compute))
    computed = []
    orig_float, orig_int8 = P.PackedLinear._float_activations, P.PackedLinear._int8_activations
    monkeypatch.setattr(P.PackedLinear, "_float_activations",
                        lambda self, *a: computed.append(1) or orig_float(self, *a))
    monkeypatch.setattr(P.PackedLinear, "_int8_activations", lambda self, x: computed.append(1) or orig_int8(self, x))
    for ids in (torch.randint(0, 128, (1, 1)), torch.randint(0, 128, (1, 70))):   # decode, prefill-sized
        calls.clear(), computed.clear()
        with torch.no_grad():
            shared = model(ids).logits
        # one quantization a group (q/k/v, o, gate/up, down), and one more where a layer of the group takes the other
        # form than the one before it (a float32 prefill on a CPU without VNNI: the int8 product where the layer's
        # shape suits lrq.native's AVX2 integer kernel, the dequantized activations elsewhere)
        groups = [calls[b * 7:b * 7 + 7][i:j] for b in range(2) for i, j in ((0, 3), (3, 4), (4, 6), (6, 7))]
        expected = sum(1 + sum(a != b for a, b in zip(grp, grp[1:])) for grp in groups)
        assert len(calls) == 7 * 2 and len(computed) == expected, (len(calls), len(computed), calls)
        monkeypatch.setattr(P, "_LAST_ACTIVATIONS", [None])
        with monkeypatch.context() as m:
            m.setattr(P.PackedLinear, "_shared", lambda self, x, form, compute: compute())
            with torch.no_grad():
                alone = model(ids).logits
        assert torch.equal(shared, alone)
    lin = decoder_blocks(model)[0].self_attn.q_proj
    x = torch.randn(1, 192)
    computed.clear()
    with torch.no_grad():
        a = lin(x)
        lin(x)
        x.mul_(2)           # changed in place: quantized again, and the output follows
        b = lin(x)
    assert len(computed) == 2 and not torch.equal(a, b)


def test_static_grids_share_the_levels_only_where_the_calibrated_range_is_the_same(monkeypatch):
    """W8A8: q/k/v calibrated on one input hold the same static range, so the levels (and their row sums) are
    computed once for them; a layer with another range computes its own; outputs equal the fake-quant layers."""
    import lrq.packed as P
    qs = [_quant_linear("w8a8", cin=576, cout=40) for _ in range(3)]
    for q in qs[1:]:
        q.act_scale.copy_(qs[0].act_scale)
        q.act_zero.copy_(qs[0].act_zero)
    ps = [PackedLinear.from_quant_linear(q) for q in qs]
    computed = []
    real = P.PackedLinear._int8_activations
    monkeypatch.setattr(P.PackedLinear, "_int8_activations", lambda self, x: computed.append(1) or real(self, x))
    x = torch.randn(2 * P.NATIVE_INT8_MAX_M, 576)     # above the native decode kernel's tokens: torch._int_mm
    with torch.no_grad():
        for p, q in zip(ps, qs):
            torch.testing.assert_close(p(x), q(x), rtol=1e-5, atol=5e-5)   # float32 sums of ~0.1 outputs
            # a decode step: lrq's own kernel quantizes on the same grid (nothing shared to compute)
            torch.testing.assert_close(p(x[:1]), q(x[:1]), rtol=1e-5, atol=1e-5)
            torch.testing.assert_close(p(x[:1].bfloat16()), q(x[:1].bfloat16()), rtol=1e-2, atol=1e-2)
        expected = 1 if isinstance(ps[0].cpu_weights, P.Int8GemmWeights) else 0
        assert len(computed) == expected
        ps[2].act_zero.fill_(ps[2].act_zero.item() + 3)
        qs[2].act_zero.fill_(qs[2].act_zero.item() + 3)
        torch.testing.assert_close(ps[2](x), qs[2](x), rtol=1e-5, atol=5e-5)
        assert len(computed) == 2 * expected


@pytest.mark.parametrize("scheme_name", ["w4a16-g128", "w3a16", "w4a8"])
def test_float32_decode_through_the_bf16_kernel_when_asked(monkeypatch, scheme_name):
    """A float32 model's 4-bit layers run a decode call exactly by default: lrq's own kernel (lrq.native) where it
    is built, else a transient dequantized weight (torch's float32 int4 kernel is scalar); set_float32_decode(model,
    "bf16") runs torch's vectorized bf16 kernel instead: nothing dequantized, the rounding of a bf16 layer, float32
    out; a rebuilt CPU form keeps the setting; a bad mode is refused."""
    import lrq.cpu_kernels as K
    from lrq import native
    from lrq.packed import set_float32_decode
    q = _quant_linear(scheme_name, cin=576, cout=48)
    model = torch.nn.Sequential(PackedLinear.from_quant_linear(q))
    x = torch.randn(1, 576)
    calls = []
    monkeypatch.setattr(K, "_unpack_int4pack_t", lambda *a, _f=K._unpack_int4pack_t: calls.append(1) or _f(*a))
    with torch.no_grad():
        exact = model(x)
        if isinstance(model[0].cpu_weights, K.Int4Weights):
            assert (calls == []) == (native.library() is not None)
        for off in (False, True):           # without the native kernel: the dequantized weight, the same values
            monkeypatch.setattr(native, "library", (lambda: None) if off else native.library)
            calls.clear()
            torch.testing.assert_close(model(x), exact, rtol=1e-5, atol=1e-6)
        assert calls or isinstance(model[0].cpu_weights, K.Int8GemmWeights)
        assert set_float32_decode(model, "bf16") == 1
        calls.clear()
        fast = model(x)
        assert calls == [] and fast.dtype == torch.float32
        torch.testing.assert_close(fast, q(x), rtol=3e-2, atol=3e-2)
        torch.testing.assert_close(exact, q(x), rtol=1e-4, atol=1e-4)
        model.to(torch.float32)                   # the CPU form is rebuilt: the setting stays
        calls.clear()
        model(x)
        assert calls == []
    with pytest.raises(UserError, match="float32 decode mode 'fast'"):
        set_float32_decode(model, "fast")


@pytest.mark.parametrize("call", ["one token", "amx prefill"])
def test_the_shortcuts_are_the_general_path_bit_for_bit(monkeypatch, call):
    """One token: a bf16 decode step of a 4-bit layer (weight-only, or W4A8 on its dequantized activations) skips
    _forward_cpu's Python; padded K and W8A8 take the general path. AMX prefill: a bf16 prefill call of a 4-bit
    weight-only layer goes straight to the AMX tile kernel where it runs (without AMX, or LRQ_AMX=0, every call takes
    the general path, as before); W4A8 and padded K take the general path. Both: the same kernel calls, the same output
    bits (a bias added as the general path adds it: every case has one); several tokens for the one-token shortcut,
    a short call for the prefill one, and float32 calls take the general path."""
    import lrq.packed as P
    from lrq.cpu_kernels import amx_ready
    assert _quant_linear("w3a16").bias is not None
    general_path = P.PackedLinear._forward_cpu
    one = call == "one token"
    cases = (("w4a16-g128", 576), ("w3a16", 192), ("w4a8", 576), ("w4a16", 200)) + ((("w8a8", 576),) if one else ())
    cout, shape = (40, (1, 1)) if one else (128, (2, 40))   # the AMX kernel takes whole panels of 64 features
    for scheme_name, k in cases:   # 200: K padded
        p = PackedLinear.from_quant_linear(_quant_linear(scheme_name, cin=k, cout=cout))
        general = []
        monkeypatch.setattr(P.PackedLinear, "_forward_cpu", lambda self, x: general.append(1) or general_path(self, x))
        x = torch.randn(*shape, k).bfloat16()
        takes = k != 200 and (scheme_name != "w8a8" if one else (amx_ready() and scheme_name != "w4a8"))
        with torch.no_grad():
            fast = p(x)
            assert general == ([] if takes else [1]), scheme_name
            monkeypatch.setattr(P, "_LAST_ACTIVATIONS", [None])      # the general path quantizes on its own
            assert fast.shape == (*shape, cout) and torch.equal(fast, general_path(p, x)), scheme_name
            general.clear()
            p(torch.randn(2 if one else 3, k).bfloat16()), p(torch.randn(1 if one else 64, k))
            assert general == [1, 1]
        monkeypatch.undo()


def test_the_int4_packing_is_read_under_torchs_avx2_kernels_too():
    """torch packs int4 weights in blocks of 64 output features where its AVX512 kernels run and of 32 with its AVX2
    ones (an AMD Zen 3): the prefill path must read both, or a Zen 3 falls back to the scalar float32 kernel at every
    size (5 tokens/s at prefill, measured with AVX2 kernels on a Zen 4). In a process held to AVX2 kernels
    (ATEN_CPU_CAPABILITY=avx2) the layout is found, the packing decodes and the dense weight is (q - z) * s."""
    import os
    import platform
    import subprocess
    import sys
    if platform.machine() not in ("x86_64", "AMD64"):
        pytest.skip("ATEN_CPU_CAPABILITY=avx2 is an x86 setting")
    code = (
        "import torch, lrq.cpu_kernels as K\n"
        "assert torch.backends.cpu.get_cpu_capability() == 'AVX2', torch.backends.cpu.get_cpu_capability()\n"
        "g = torch.Generator().manual_seed(0)\n"
        "for n, k, group in ((576, 1536, 128), (100, 300, None), (48, 576, 64)):\n"
        "    q = torch.randint(0, 16, (n, k), generator=g)\n"
        "    ng = -(-k // (group or k))\n"
        "    s, z = torch.rand(n, ng, generator=g) * 0.01 + 1e-3, torch.randint(0, 16, (n, ng), generator=g).float()\n"
        "    w = K.Int4Weights.build(q, s, z, group)\n"
        "    cols = torch.arange(k) // (group or k)\n"
        "    ref = (q.float() - z[:, cols]) * s[:, cols]\n"
        "    assert w.decodable and torch.equal(w.levels(), q.to(torch.uint8))\n"
        "    torch.testing.assert_close(w.dequantized_t()[:k, :n].t(), ref, rtol=1e-6, atol=1e-7)\n"
        "print(K._pack_block())\n")
    env = dict(os.environ, ATEN_CPU_CAPABILITY="avx2", PYTHONPATH=os.pathsep.join(sys.path))
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.split()[-1] == "32"


@pytest.mark.parametrize("arch,dtype", [("gemma3", torch.bfloat16), ("gemma3", torch.float32),
                                        ("llama", torch.bfloat16)])
def test_an_int8_head_is_the_dequantized_head_and_a_tied_table_is_held_once(arch, dtype):
    """quantize_head: the head computes with its 8-bit levels per output channel (the w8a16 grid, fp16 scales as
    packed), a tied embedding (gemma3's, scaled) reads the same levels and holds no table of its own, an untied one
    (llama's here) is left as it was; the lean runtime's decode gives the model's own logits; the export refuses."""
    from lrq.export import save_compressed
    from lrq.packed import PackedEmbedding, quantize_head
    from lrq.precision import head_logits
    from lrq.quant import dequantize, quantize
    from lrq.runtime import LeanDecoder
    model = tiny_model(arch, vocab_size=320, hidden=96).to(dtype)
    tied = model.get_input_embeddings().weight is model.lm_head.weight
    assert tied == (arch == "gemma3")
    w = model.lm_head.weight.detach().float().clone()
    scale, zero = minmax_qparams(w, 8)
    w_hat = dequantize(quantize(w, scale, zero, 8), scale.half().float(), zero)   # what the packed head holds
    emb_before = model.get_input_embeddings()
    params_before = sum(p.numel() for p in model.parameters())
    sizes = quantize_head(model)
    head, emb = model.lm_head, model.get_input_embeddings()
    assert isinstance(head, PackedLinear) and head.scheme.name == "w8a16" and sizes["embedding_shared"] == int(tied)
    assert torch.equal(head.dequantized_weight(), w_hat)
    assert sizes["head_bytes_packed"] < 0.3 * 320 * 96 * 4 + 320 * 40   # a byte a weight and a few per row
    if tied:
        assert isinstance(emb, PackedEmbedding)
        assert sum(p.numel() for p in model.parameters()) == params_before - 320 * 96   # the table is gone
        ids = torch.tensor([[0, 5, 319], [7, 7, 1]])
        scale_e = emb_before.embed_scale.to(dtype)
        torch.testing.assert_close(emb(ids), w_hat[ids].to(dtype) * scale_e, rtol=0, atol=0)
    else:
        assert emb is emb_before
    x = torch.randn(2, 5, 96).to(dtype)
    for rows in (x[:1, :1], x):   # one token (lrq's int8 kernel where built) and ten (torch's int8 kernel)
        exact = rows.float() @ w_hat.t()
        # bf16: the output's rounding, and torch's kernel rounds its product of the offset levels (q - 128) too
        room = rows.float().abs() @ (w_hat.abs() + 128 * scale.half().float()).t()
        bound = room * (2 ** -7 if dtype == torch.bfloat16 else 1e-5) + 1e-6
        assert ((head(rows).float() - exact).abs() <= bound).all()
    torch.testing.assert_close(head_logits(head, x), x.float() @ w_hat.t(), rtol=1e-5, atol=1e-5)
    if arch == "llama":   # the lean runtime (llama-shaped models) gives the model's own logits
        ids = torch.randint(0, 320, (1, 9))
        with torch.no_grad():
            ref = model(ids).logits[:, -1:].float()
            lean = LeanDecoder(model, max_len=16)
            got = lean.forward(ids).float()
            ref_step = model(torch.cat([ids, ids[:, :1]], 1)).logits[:, -1:].float()
            step = lean.forward(ids[:, :1]).float()   # a one-token step: the fused layers, then the int8 head
        # bf16: the two forwards round their hidden states at different points (and this CPU's bf16 GEMMs sum in
        # their own order: 0.0273 of a 2.8 logit on an AMD Zen 4), so within 2 % of the largest logit, as
        # test_runtime's bf16 comparisons; float32 value by value
        for a, b in ((got, ref), (step, ref_step)):
            if dtype == torch.bfloat16:
                assert (a - b).abs().max() <= 0.02 * b.abs().max() and torch.equal(a.argmax(-1), b.argmax(-1))
            else:
                torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)
    with pytest.raises(UserError, match="already packed"):
        quantize_head(model)
    with pytest.raises(UserError, match="export the model before quantizing its head"):
        save_compressed(model, "/nonexistent/never-written")
    with pytest.raises(UserError, match="choose one of int8"):
        quantize_head(tiny_model("llama"), "int4")


@pytest.mark.parametrize("arch", ["gemma3", "llama"])
def test_a_float32_models_bf16_table_is_held_in_bf16_without_changing_a_logit(arch):
    """quantize_head(model, "bf16"): a float32 model whose table came from a bf16 checkpoint holds it in bf16 (half
    the bytes; a tied embedding, gemma3's scaled one, reads the same table): several tokens give the float32 head's
    logits bit for bit (torch's GEMM on float32 slices), one token lrq.native's GEMV, whose sums on the widened table
    are its sums on the float32 one (the lean runtime's decode steps: the same bits); a table of float32 values is
    rounded as a bf16 model's, and how many values changed is said; refused on a bf16 model and twice; the export
    refuses as for any packed head."""
    from lrq import native
    from lrq.export import save_compressed
    from lrq.packed import TableEmbedding, TableHead, quantize_head
    from lrq.precision import head_logits
    from lrq.runtime import LeanDecoder
    model = tiny_model(arch, vocab_size=320, hidden=96).to(torch.bfloat16).float()   # a bf16 checkpoint, in float32
    tied = model.get_input_embeddings().weight is model.lm_head.weight
    w = model.lm_head.weight.detach().clone()
    emb_before = model.get_input_embeddings()
    ids = torch.randint(0, 320, (1, 9), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        ref, ref_emb = model(ids).logits, emb_before(ids)
        if arch == "llama":   # the lean runtime's decode steps (llama-shaped models)
            lean = LeanDecoder(model, max_len=16)
            lean.forward(ids)
            ref_steps = torch.cat([lean.forward(ids[:, j:j + 1]) for j in range(3)], 1)
    sizes = quantize_head(model, "bf16")
    head, emb = model.lm_head, model.get_input_embeddings()
    assert isinstance(head, TableHead) and head.weight.dtype == torch.bfloat16 and torch.equal(head.weight.float(), w)
    assert sizes["head_bytes_packed"] * 2 == sizes["head_bytes"] and sizes["embedding_shared"] == int(tied)
    assert isinstance(emb, TableEmbedding) == tied
    with torch.no_grad():
        assert torch.equal(emb(ids), ref_emb)
        assert torch.equal(model(ids).logits, ref)                 # nine tokens: torch's GEMM, the same bits
        x = torch.randn(1, 96)
        one = head(x)
        assert (one - x @ w.t()).abs().max() <= 1e-6 * (x.abs() @ w.abs().t()).max()
        torch.testing.assert_close(head_logits(head, x), x @ w.t(), rtol=0, atol=0)
        if native.library() is not None and arch == "llama":       # one token: the GEMV's sums, as on float32
            lean = LeanDecoder(model, max_len=16)
            lean.forward(ids)
            assert torch.equal(torch.cat([lean.forward(ids[:, j:j + 1]) for j in range(3)], 1), ref_steps)
    with pytest.raises(UserError, match="already packed"):
        quantize_head(model, "bf16")
    with pytest.raises(UserError, match="export the model before quantizing its head"):
        save_compressed(model, "/nonexistent/never-written")
    assert sizes["values_rounded"] == 0                                             # a bf16 checkpoint: lossless
    other = tiny_model(arch, vocab_size=320, hidden=96)                              # float32 values of its own
    w32 = other.lm_head.weight.detach().clone()
    rounded = quantize_head(other, "bf16")["values_rounded"]
    assert rounded == int((w32 != w32.bfloat16().float()).sum()) > 0
    assert torch.equal(other.lm_head.weight, w32.bfloat16())                         # rounded as a bf16 model's
    with pytest.raises(UserError, match="bfloat16 already"):
        quantize_head(tiny_model(arch, vocab_size=320, hidden=96).to(torch.bfloat16), "bf16")
