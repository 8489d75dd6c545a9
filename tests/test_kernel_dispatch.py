"""The weight-only dispatcher (lrq.kernels.dispatch) on the CPU: the static rule, measured choices (a scripted
timer; the candidates really run, under the interpreter, and are checked against the reference), drops of a
wrong candidate, the cache file, and the records the GPU session writes."""

import json

import pytest
import torch

import lrq.kernels.dispatch as D
from lrq.packing import pack_planar
from lrq.quant import n_groups


def _layer(n, k, bits, group, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randint(0, 2**bits, (n, k), generator=g)
    ng = n_groups(k, group)
    return (pack_planar(q, bits), (torch.rand(n, ng, generator=g) * 0.1 + 0.01).half(),
            torch.randint(0, 2**bits, (n, ng), generator=g).to(torch.uint8))


def test_static_rule_and_candidates():
    cpu = torch.device("cpu")
    ok, why = D.candidates(4, 128, 1, 4096, 4096, cpu)
    assert ok == ["gemv", "wq_gemm"] and why["torch_int4"] == "CUDA only" and "gemlite" in why
    assert D.static_rule(ok) == "gemv"
    ok, why = D.candidates(4, 128, 17, 4096, 4096, cpu)
    assert ok == ["wq_gemm"] and why["gemv"] == "M = 17 > 16" and D.static_rule(ok) == "wq_gemm"
    for group in (24, 16):   # the GEMV's pairs of 16-word fields cover 32 columns: a group must hold whole pairs
        ok, why = D.candidates(4, group, 1, 64, 96, cpu)
        assert "gemv" not in ok and "wq_gemm" in ok and "multiple of 32" in why["gemv"]
    assert D.scheme_name(4, 128, 4096) == "w4a16-g128" and D.scheme_name(3, None, 4096) == "w3a16"
    d = D.Dispatcher(timer=None)
    packed, scale, zero = _layer(24, 256, 4, None)
    c = d.choose(torch.randn(3, 256), packed, scale, zero, 4, None, 256)
    assert (c.kernel, c.source, c.m, c.n, c.k) == ("gemv", "static", 3, 24, 256) and d.records == [c]


def test_measured_choice_is_the_fastest_correct_one_and_is_cached(tmp_path, monkeypatch):
    packed, scale, zero = _layer(24, 256, 4, 128)
    x = torch.randn(2, 256)
    script = iter([3.0, 1.0])                       # candidates in order: gemv, wq_gemm
    d = D.Dispatcher(tmp_path / "table.json", timer=lambda fn: (fn(), next(script))[1])
    c = d.choose(x, packed, scale, zero, 4, 128, 256)
    assert (c.kernel, c.source) == ("wq_gemm", "measured") and c.times_ms == {"gemv": 3.0, "wq_gemm": 1.0}
    saved = json.loads((tmp_path / "table.json").read_text())
    assert [v["kernel"] for v in saved.values()] == ["wq_gemm"]
    again = D.Dispatcher(tmp_path / "table.json", timer=lambda fn: pytest.fail("measured a cached shape"))
    c2 = again.choose(x, packed, scale, zero, 4, 128, 256)
    assert (c2.kernel, c2.source, c2.times_ms) == ("wq_gemm", "cached", c.times_ms)
    # a candidate whose output is wrong is dropped, whatever its speed
    real = D.build_runner
    monkeypatch.setattr(D, "build_runner", lambda name, *a: (lambda x, bias=None: real(name, *a)(x) * 2)
                        if name == "gemv" else real(name, *a))
    d3 = D.Dispatcher(timer=lambda fn: 1.0 if fn() is not None else 0)
    c3 = d3.choose(torch.randn(1, 256), packed, scale, zero, 4, 128, 256)
    assert c3.kernel == "wq_gemm" and "differs from the reference" in c3.dropped["gemv"]


def test_runners_agree_with_the_reference():
    packed, scale, zero = _layer(40, 300, 3, None, 1)
    x = torch.randn(4, 300)
    ref = D.WQ.reference_wq_matmul(x, packed, scale, zero, 3, None, 300)
    for name in ("gemv", "wq_gemm"):
        torch.testing.assert_close(D.build_runner(name, packed, scale, zero, 3, None, 300)(x), ref,
                                   rtol=1e-4, atol=1e-4)
    with pytest.raises(ValueError, match="unknown kernel"):
        D.build_runner("marlin", packed, scale, zero, 3, None, 300)
