"""Quantizer primitives: property tests on bounds, idempotence, scales, groups and zero points."""

import math

import pytest
import torch
from hypothesis import given, settings, strategies as st

from lrq.errors import UserError
from lrq.quant import (dequantize, expand_groups, fake_quant, minmax_qparams, n_groups, per_tensor_fake_quant,
                       per_token_fake_quant, qparams_from_range, quantize, round_ste, weight_bits_per_element)

SETTINGS = settings(max_examples=40, deadline=None)


def matrices(max_rows=8, max_cols=70):
    return st.tuples(st.integers(1, max_rows), st.integers(1, max_cols), st.integers(0, 2**31 - 1),
                     st.floats(1e-3, 1e3)).map(
        lambda a: torch.randn(a[0], a[1], generator=torch.Generator().manual_seed(a[2])) * a[3])


bits_st = st.integers(2, 8)


def group_st(cols):
    return st.one_of(st.none(), st.integers(1, cols))


@SETTINGS
@given(w=matrices(), bits=bits_st, data=st.data())
def test_levels_in_range_and_error_bounded(w, bits, data):
    g = data.draw(group_st(w.shape[1]))
    scale, zero = minmax_qparams(w, bits, g)
    assert scale.shape == zero.shape == (w.shape[0], n_groups(w.shape[1], g))
    assert torch.all(zero == zero.round()) and zero.min() >= 0 and zero.max() <= 2**bits - 1
    q = quantize(w, scale, zero, bits, g)
    assert q.dtype == torch.uint8 and int(q.max()) <= 2**bits - 1
    err = (dequantize(q, scale, zero, g) - w).abs()
    # min/max ranges cover every weight, so rounding is the only error: at most half a step
    # (the zero point's own rounding can shift the grid by up to another half step at the range ends).
    assert torch.all(err <= expand_groups(scale, g, w.shape[1]) * 1.0 + 1e-5 * w.abs().max())


@SETTINGS
@given(w=matrices(), bits=bits_st, data=st.data())
def test_fake_quant_is_idempotent(w, bits, data):
    g = data.draw(group_st(w.shape[1]))
    scale, zero = minmax_qparams(w, bits, g)
    once = fake_quant(w, scale, zero, bits, g)
    twice = fake_quant(once, scale, zero, bits, g)
    assert torch.allclose(once, twice, atol=1e-6 * (1 + w.abs().max().item()))


@SETTINGS
@given(w=matrices(), bits=bits_st)
def test_zero_is_exactly_representable(w, bits):
    scale, zero = minmax_qparams(w, bits)
    zeros = torch.zeros_like(w)
    assert torch.equal(fake_quant(zeros, scale, zero, bits), zeros)


@SETTINGS
@given(w=matrices(max_cols=300), data=st.data())
def test_groupwise_shapes_and_ragged_last_group(w, data):
    cols = w.shape[1]
    g = data.draw(st.integers(1, cols))
    scale, zero = minmax_qparams(w, 4, g)
    assert scale.shape[1] == math.ceil(cols / g)
    # each group's parameters depend only on that group's columns (no straddling)
    for j in range(scale.shape[1]):
        s_j, z_j = minmax_qparams(w[:, j * g:(j + 1) * g], 4, None)
        assert torch.allclose(scale[:, j:j + 1], s_j) and torch.equal(zero[:, j:j + 1], z_j)


def test_asymmetric_zero_point_tracks_range():
    w = torch.tensor([[0.0, 1.0, 2.0, 3.0], [-3.0, -2.0, -1.0, 0.0], [-1.0, 0.0, 1.0, 2.0]])
    scale, zero = minmax_qparams(w, 2)
    assert torch.allclose(scale.squeeze(1), torch.tensor([1.0, 1.0, 1.0]))
    assert zero.squeeze(1).tolist() == [0.0, 3.0, 1.0]
    assert torch.equal(fake_quant(w, scale, zero, 2), w)


@SETTINGS
@given(x=matrices(max_rows=16, max_cols=64), bits=st.sampled_from([4, 8]))
def test_per_token_scales_are_per_row(x, bits):
    y = per_token_fake_quant(x, bits)
    step = ((x.amax(-1).clamp(min=0) - x.amin(-1).clamp(max=0)) / (2**bits - 1)).clamp(min=1e-8)
    assert torch.all((y - x).abs() <= step[:, None] + 1e-5 * x.abs().max())
    # quantizing one token does not depend on the others
    assert torch.allclose(per_token_fake_quant(x[:1], bits), y[:1])
    assert torch.allclose(per_token_fake_quant(y, bits), y, atol=1e-4 * (1 + x.abs().max().item()))


def test_per_token_constant_row_is_stable():
    x = torch.full((2, 5), 3.25)
    assert torch.all(torch.isfinite(per_token_fake_quant(x)))


@SETTINGS
@given(x=matrices(max_rows=4, max_cols=64))
def test_per_tensor_static_clamps_outside_range(x):
    lo, hi = torch.tensor(-1.0), torch.tensor(1.0)
    scale, zero = qparams_from_range(lo, hi, 8)
    y = per_tensor_fake_quant(x, scale, zero, 8)
    assert y.min() >= -1.0 - 1e-6 and y.max() <= 1.0 + scale + 1e-6
    inside = (x > -1) & (x < 1)
    assert torch.all((y - x).abs()[inside] <= scale / 2 + 1e-6)


def test_round_ste_passes_gradient_through():
    x = torch.tensor([0.2, 1.7, -2.4], requires_grad=True)
    y = round_ste(x)
    assert y.tolist() == [0.0, 2.0, -2.0]
    y.sum().backward()
    assert x.grad.tolist() == [1.0, 1.0, 1.0]


@pytest.mark.parametrize("bits", [1, 9, 3.5])
def test_unsupported_bits_are_rejected(bits):
    with pytest.raises(UserError, match="bit width"):
        minmax_qparams(torch.randn(2, 8), bits)


def test_group_larger_than_row_is_rejected():
    with pytest.raises(UserError, match="group size 128 does not fit a layer with 64 input columns"):
        minmax_qparams(torch.randn(2, 64), 4, 128)


def test_bits_per_weight_counts_scales():
    assert weight_bits_per_element(4, 128, 576) == pytest.approx(4 + 5 * 20 / 576)
    assert weight_bits_per_element(8, None, 576) == pytest.approx(8 + 24 / 576)


def test_per_token_dequantized_is_the_fake_quant_bit_for_bit():
    """The inference shortcut gives per_token_fake_quant's values exactly, for ordinary rows, one-signed rows,
    constant and all-zero rows, values on .5 boundaries, in float32 and bf16."""
    from lrq.quant import per_token_dequantized
    g = torch.Generator().manual_seed(0)
    rows = [torch.randn(64, 576, generator=g) * 3, torch.rand(4, 576, generator=g) + 0.5,
            -torch.rand(4, 576, generator=g), torch.full((2, 576), 0.75), torch.zeros(2, 576),
            torch.arange(-255, 256, dtype=torch.float32)[None] / 2]
    from lrq import native
    assert native.library() is not None, native.status()   # the C replica (lrq.native) is what is checked first
    for use_native in (True, False):
        lib = native.library
        native.library = lib if use_native else (lambda: None)
        try:
            for bits in (8, 4):
                for x in rows:
                    for dt in (torch.float32, torch.bfloat16):
                        assert torch.equal(per_token_dequantized(x.to(dt), bits),
                                           per_token_fake_quant(x.to(dt), bits))
            nan_row = torch.randn(3, 576, generator=g)
            nan_row[1, 100] = float("nan")                # a NaN makes its whole row NaN, as torch's amin/amax do
            for dt in (torch.float32, torch.bfloat16):
                got, want = per_token_dequantized(nan_row.to(dt), 8), per_token_fake_quant(nan_row.to(dt), 8)
                assert got[1].isnan().all() and want[1].isnan().all() and torch.equal(got[[0, 2]], want[[0, 2]])
        finally:
            native.library = lib
