"""Triton kernels under the interpreter (tests/conftest.py sets TRITON_INTERPRET=1) against their
plain-torch references, on small random shapes including odd sizes and ragged groups."""

import pytest
import torch
from hypothesis import given, settings, strategies as st

from lrq.kernels.wq_gemm import reference_wq_matmul, wq_matmul
from lrq.packing import pack_bits
from lrq.quant import n_groups


def _layer(n, k, bits, group, seed):
    g = torch.Generator().manual_seed(seed)
    q = torch.randint(0, 2**bits, (n, k), generator=g)
    ng = n_groups(k, group)
    scale = (torch.rand(n, ng, generator=g) * 0.1 + 0.01).half()
    zero = torch.randint(0, 2**bits, (n, ng), generator=g).to(torch.uint8)
    return pack_bits(q, bits), scale, zero, q


@settings(max_examples=12, deadline=None)
@given(bits=st.sampled_from([3, 4, 8, 2, 5]), m=st.integers(1, 20), n=st.integers(1, 70), k=st.integers(1, 150),
       group=st.sampled_from([None, 32, 64]), bias=st.booleans(), seed=st.integers(0, 1000))
def test_wq_gemm_equals_reference(bits, m, n, k, group, bias, seed):
    if group is not None and group > k:
        group = None
    packed, scale, zero, q = _layer(n, k, bits, group, seed)
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(seed + 1))
    b = torch.randn(n) if bias else None
    y = wq_matmul(x, packed, scale, zero, bits, group, k, b)
    ref = reference_wq_matmul(x, packed, scale, zero, bits, group, k, b)
    torch.testing.assert_close(y, ref, rtol=1e-4, atol=1e-4)


def test_reference_is_the_dequantized_product():
    packed, scale, zero, q = _layer(24, 100, 3, 32, 0)
    x = torch.randn(5, 100)
    zf = zero.float().repeat_interleave(32, dim=1)[:, :100]
    sf = scale.float().repeat_interleave(32, dim=1)[:, :100]
    torch.testing.assert_close(reference_wq_matmul(x, packed, scale, zero, 3, 32, 100), x @ ((q - zf) * sf).t())


def test_wq_gemm_checks_the_width():
    packed, scale, zero, _ = _layer(8, 64, 4, None, 0)
    with pytest.raises(ValueError, match="does not match"):
        wq_matmul(torch.randn(2, 63), packed, scale, zero, 4, None, 64)


def test_the_kernel_itself_runs_under_the_interpreter(monkeypatch):
    import lrq.kernels.wq_gemm as K
    assert K.INTERPRET and K.triton is not None
    packed, scale, zero, _ = _layer(40, 96, 3, 32, 3)
    x = torch.randn(3, 96)
    ref = K.reference_wq_matmul(x, packed, scale, zero, 3, 32, 96)
    monkeypatch.setattr(K, "reference_wq_matmul", lambda *a, **k: pytest.fail("fell back to the torch reference"))
    torch.testing.assert_close(K.wq_matmul(x, packed, scale, zero, 3, 32, 96), ref, rtol=1e-4, atol=1e-4)


@settings(max_examples=10, deadline=None)
@given(bits=st.sampled_from([8, 4, 3]), m=st.integers(1, 20), n=st.integers(1, 50), k=st.integers(1, 90),
       static=st.booleans(), bias=st.booleans(), seed=st.integers(0, 1000))
def test_int8_gemm_equals_reference(bits, m, n, k, static, bias, seed):
    from lrq.kernels.int8_gemm import int8_matmul, reference_int8_matmul
    packed, scale, zero, _ = _layer(n, k, bits, None, seed)
    g = torch.Generator().manual_seed(seed + 7)
    x = torch.randn(m, k, generator=g)
    rng = (torch.tensor(0.02), torch.tensor(120.0)) if static else None
    b = torch.randn(n, generator=g) if bias else None
    y = int8_matmul(x, packed, scale, zero, bits, k, b, rng)
    ref = reference_int8_matmul(x, packed, scale, zero, bits, k, b, rng)
    torch.testing.assert_close(y, ref, rtol=1e-4, atol=1e-4)


def test_int8_reference_is_the_fake_quantized_product():
    """The reference equals QuantLinear's fake-quant forward for w8a8 (static) and w4a8 (per token)."""
    from lrq.kernels.int8_gemm import reference_int8_matmul
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
        y = reference_int8_matmul(x, pack_bits(q.qweight, s.w_bits), q.scale.half(), q.zero.to(torch.uint8),
                                  s.w_bits, 48, q.bias, static)
        torch.testing.assert_close(y, q(x), rtol=1e-4, atol=1e-4)
