"""PackedLinear's weight-only GPU forward routed through the dispatcher (lrq.kernels.dispatch), on the CPU under
Triton's interpreter (conftest sets TRITON_INTERPRET=1: the kernels take CPU tensors, and `_forward_gpu` is called
directly, since `forward` on a CPU tensor takes the CPU kernels): outputs against the float reference, the static
rule's choice per M, runners built once and rebuilt when a buffer changes, measured choices reusing and dropping
the runners they built, and what a CUDA-graph capture may do (nothing measured, nothing converted)."""

import copy
import pickle

import pytest
import torch

import lrq.kernels.dispatch as D
import lrq.kernels.gemv as G
from lrq.packed import PackedLinear
from lrq.schemes import get_scheme

from test_kernels import TOL, _layer, _rel   # the kernels' layer maker, tolerances and error measure

N, K = 64, 256


def _packed(scheme_name: str, seed: int = 0, bias: bool = True) -> PackedLinear:
    """A PackedLinear built by hand (as a load onto a GPU leaves it: planar words, fp16 scales, no CPU form)."""
    s = get_scheme(scheme_name)
    packed, scale, zero, _ = _layer(N, K, s.w_bits, s.group_size, seed)
    m = PackedLinear(K, N, bias, s)
    m.weight_packed.copy_(packed)
    m.scale.copy_(scale)
    m.zero.copy_(zero)
    if bias:
        m.bias.copy_(torch.randn(N, generator=torch.Generator().manual_seed(seed + 1)).half())
    return m


def _reference(m: PackedLinear, x: torch.Tensor) -> torch.Tensor:
    return D.WQ.reference_wq_matmul(x, m.weight_packed, m.scale, m.zero, m.bits, m.group_size, K, m.bias)


def _counting(monkeypatch):
    """Count build_runner calls per kernel and GEMV repacks (the conversion a runner must do only once)."""
    calls = {"build": [], "repack": 0}
    real_build, real_repack = D.build_runner, G.repack_gemv

    def build(kernel, *a, **kw):
        calls["build"].append(kernel)
        return real_build(kernel, *a, **kw)

    def repack(*a, **kw):
        calls["repack"] += 1
        return real_repack(*a, **kw)
    monkeypatch.setattr(D, "build_runner", build)
    monkeypatch.setattr(G, "repack_gemv", repack)
    return calls


@pytest.mark.parametrize("scheme,dtype", [("w4a16-g128", torch.bfloat16), ("w4a16", torch.float16),
                                          ("w3a16", torch.float32), ("w8a16", torch.bfloat16)])
def test_weight_only_forward_goes_through_the_dispatcher(scheme, dtype, monkeypatch):
    """M = 1 takes the GEMV and M = 64 the GEMM under the static rule (no GPU to measure on), both kernels really
    run (their torch references are made to fail meanwhile) and equal the float reference; the layer then holds
    both runners, and the GEMV's second copy of the weights is counted."""
    m = _packed(scheme, seed=3)
    g = torch.Generator().manual_seed(5)
    xs = [torch.randn(*rows, K, generator=g).to(dtype) for rows in ((1,), (64,), (2, 3))]
    with D.using(D.Dispatcher(timer=None)) as d, monkeypatch.context() as mp:
        for mod, name in ((D.WQ, "reference_wq_matmul"), (G, "reference_gemv")):
            mp.setattr(mod, name, lambda *a, **k: pytest.fail("fell back to a torch reference"))
        ys = [m._forward_gpu(x) for x in xs]                            # the last: leading dims, M = 6
        again = m._forward_gpu(xs[2])
    for x, y in zip(xs, ys):
        assert y.dtype == dtype and y.shape == (*x.shape[:-1], N)
        assert _rel(y, _reference(m, x)) < TOL[dtype], (scheme, x.shape)
    assert torch.equal(again, ys[2])
    got = [(c.m, c.kernel, c.source) for c in d.records]
    assert got == [(1, "gemv", "static"), (64, "wq_gemm", "static"), (6, "gemv", "static")]
    assert [r["calls"] for r in d.report()] == [1, 1, 1], "the layer asks once per (M, dtype), then keeps its choice"
    assert set(m.runners) == {"gemv", "wq_gemm"} and m.runners["wq_gemm"].nbytes == 0
    w = G.repack_gemv(m.weight_packed, m.scale, m.zero, m.bits, m.group_size, K)
    copy = sum(t.numel() * t.element_size() for t in (w.words, w.scale, w.zero))
    assert m.runner_bytes() == copy > 0.9 * m.weight_packed.numel() * 4
    assert m.storage_bytes() == sum(b.numel() * b.element_size() for b in m.buffers()) + copy


def test_runners_are_built_once_and_rebuilt_when_a_buffer_changes(monkeypatch):
    calls = _counting(monkeypatch)
    m = _packed("w4a16-g128", seed=1)
    x1 = torch.randn(1, K)
    with D.using(D.Dispatcher(timer=None)):
        y = m._forward_gpu(x1)
        for _ in range(2):
            assert torch.equal(m._forward_gpu(x1), y)
        m._forward_gpu(torch.randn(4, K))                 # another M: another choice, the same GEMV runner
        assert calls == {"build": ["gemv"], "repack": 1}
        runner = m.runners["gemv"]

        m.weight_packed[:, 0] ^= 0x0F                     # in place: the version moves, the runners are remade
        y2 = m._forward_gpu(x1)
        assert calls["repack"] == 2 and m.runners["gemv"] is not runner
        assert not torch.equal(y2, y) and _rel(y2, _reference(m, x1)) < TOL[torch.float32]

        sd = {k: v.clone() for k, v in m.state_dict().items()}
        sd["scale"] = sd["scale"] * 2                     # a load copies into the buffers: remade again
        m.load_state_dict(sd)
        y3 = m._forward_gpu(x1)
        assert calls["repack"] == 3 and _rel(y3, _reference(m, x1)) < TOL[torch.float32]

        m.zero = m.zero.clone()                           # a buffer replaced by another tensor: remade
        m._forward_gpu(x1)
        assert calls["repack"] == 4
        clone = copy.deepcopy(m)                          # copies and pickles leave them behind
        assert m.runners and clone.runners == {} and pickle.loads(pickle.dumps(m)).runners == {}
        assert torch.equal(clone._forward_gpu(x1), y3)
        m.to(torch.float32)                               # a move or cast (_apply) drops them
        assert m.runners == {} and m.runner_bytes() == 0


def test_a_measured_choice_reuses_the_runners_it_built_and_drops_the_losers(monkeypatch):
    """With a (scripted) timer the dispatcher builds every candidate on the layer's own runners and measures it;
    the winner is kept (not rebuilt), the loser's weight copy is dropped, and the choice is the table's."""
    calls = _counting(monkeypatch)
    m = _packed("w4a16", seed=2)
    times = iter([2.0, 1.0])                              # gemv, then wq_gemm: the GEMM wins at M = 1
    d = D.Dispatcher(timer=lambda fn: (fn(), next(times))[1])
    with D.using(d):
        x = torch.randn(1, K)
        y = m._forward_gpu(x)
        m._forward_gpu(x)
    assert calls["build"] == ["gemv", "wq_gemm"] and calls["repack"] == 1
    assert set(m.runners) == {"wq_gemm"} and m.runner_bytes() == 0, "the GEMV's copy was dropped"
    (c,) = d.records
    assert (c.kernel, c.source, c.times_ms) == ("wq_gemm", "measured", {"gemv": 2.0, "wq_gemm": 1.0})
    assert _rel(y, _reference(m, x)) < TOL[torch.float32]
    # a second layer of the same shape takes the decided choice: nothing measured, only its own runner built
    m2 = _packed("w4a16", seed=4)
    with D.using(d):
        m2._forward_gpu(x)
    assert calls["build"] == ["gemv", "wq_gemm", "wq_gemm"] and d.report()[0]["calls"] == 2


def test_inside_a_capture_nothing_is_measured_or_converted(monkeypatch):
    """A CUDA-graph capture (simulated: dispatch.capturing() true) may only use what the warm-up decided and built:
    an undecided key takes the static rule among the ready kernels (the GEMM, which converts nothing, or a runner
    this layer built) and is recorded as static-capture; a decided key uses its runner as it is."""
    calls = _counting(monkeypatch)
    never = D.Dispatcher(timer=lambda fn: pytest.fail("measured inside a capture"))
    cold = _packed("w8a16", seed=6)
    x = torch.randn(1, K)
    monkeypatch.setattr(D, "capturing", lambda: True)
    with D.using(never):
        y = cold._forward_gpu(x)                          # no warm-up: the GEMV is not ready, the GEMM runs
    assert calls == {"build": ["wq_gemm"], "repack": 0} and set(cold.runners) == {"wq_gemm"}
    assert [(c.kernel, c.source) for c in never.records] == [("wq_gemm", "static-capture")]
    assert never.chosen == {} and never.table == {}, "a capture's fallback is not kept for the key"
    assert _rel(y, _reference(cold, x)) < TOL[torch.float32]

    monkeypatch.setattr(D, "capturing", lambda: False)
    warm = _packed("w8a16", seed=7)
    d = D.Dispatcher(timer=None)
    with D.using(d):
        warm._forward_gpu(x)                              # the warm-up: M = 1 decided (GEMV), its runner built
        monkeypatch.setattr(D, "capturing", lambda: True)
        before = list(calls["build"])
        warm._forward_gpu(x)                              # captured: the runner as built
        y3 = warm._forward_gpu(torch.randn(3, K))         # an M the warm-up missed: the GEMV is ready, so it runs
    assert calls["build"] == before and calls["repack"] == 1
    assert [(c.m, c.kernel, c.source) for c in d.records] == [(1, "gemv", "static"), (3, "gemv", "static-capture")]
    assert y3.shape == (3, N)

    # a choice from the cache file, for a layer that has not built its runner, is not converted inside a capture
    key = D.Dispatcher.key(torch.device("cpu"), "w8a16", 1, N, K, torch.float32)
    d2 = D.Dispatcher(timer=lambda fn: pytest.fail("measured"))
    d2.table[key] = {"scheme": "w8a16", "m": 1, "n": N, "k": K, "kernel": "gemv", "source": "measured"}
    with D.using(d2):
        _packed("w8a16", seed=9)._forward_gpu(x)
        monkeypatch.setattr(D, "capturing", lambda: False)
        _packed("w8a16", seed=9)._forward_gpu(x)
    assert [(c.kernel, c.source) for c in d2.records] == [("wq_gemm", "static-capture"), ("gemv", "cached")]
    assert calls["repack"] == 2


def test_the_dispatch_cache_file_is_under_lrq_bench_cache(monkeypatch, tmp_path):
    from bench.common.cache import cache_root
    monkeypatch.delenv("LRQ_DISPATCH_CACHE", raising=False)
    for root in (str(tmp_path / "c"), None):
        if root:
            monkeypatch.setenv("LRQ_BENCH_CACHE", root)
        else:
            monkeypatch.delenv("LRQ_BENCH_CACHE", raising=False)
        assert D.default_cache_file() == cache_root() / "kernels" / "dispatch.json"
    monkeypatch.setenv("LRQ_DISPATCH_CACHE", str(tmp_path / "t.json"))
    assert D.default_cache_file() == tmp_path / "t.json"
    monkeypatch.setenv("LRQ_DISPATCH_CACHE", "")
    assert D.default_cache_file() is None
    monkeypatch.setattr(D, "_DEFAULT", None)
    assert D.default_dispatcher() is D.default_dispatcher() and D.default_dispatcher().cache_file is None


def test_a_cached_kernel_that_is_no_longer_a_candidate_is_decided_again():
    """A table written where torch's int4 kernel existed, read where it is not a candidate (here: the CPU)."""
    key = D.Dispatcher.key(torch.device("cpu"), "w4a16", 1, N, K, torch.float32)
    d = D.Dispatcher(timer=None)
    d.table[key] = {"scheme": "w4a16", "m": 1, "n": N, "k": K, "kernel": "torch_int4", "source": "measured"}
    with D.using(d):
        _packed("w4a16")._forward_gpu(torch.randn(1, K))
    assert [(c.kernel, c.source) for c in d.records] == [("gemv", "static")]


def test_a_pinned_kernel_is_used_where_it_is_a_candidate(monkeypatch):
    monkeypatch.setenv("LRQ_DISPATCH_KERNEL", "wq_gemm")
    m = _packed("w4a16-g128", seed=8)
    with D.using(D.Dispatcher(timer=lambda fn: pytest.fail("measured a pinned kernel"))) as d:
        m._forward_gpu(torch.randn(1, K))
    assert [(c.kernel, c.source) for c in d.records] == [("wq_gemm", "forced")] and set(m.runners) == {"wq_gemm"}
