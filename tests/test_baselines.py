"""SmoothQuant, GPTQ and AWQ on tiny random Llama/Qwen2 models (GQA: 4 query heads, 2 KV heads) and on
single random linear layers."""

import pytest
import torch

import baselines.awq as awq_mod
from baselines.awq import INSPECT, awq_block, capture, clip_weight, grid_ratios, rtn, search_clip, search_scale
from baselines.gptq import gptq_quantize
from conftest import tiny_model
from lrq.arch import block_linears, decoder_blocks
from lrq.blockwise import capture_block_inputs, walk_blocks
from lrq.errors import UserError
from lrq.methods import Calibration, get_method
from lrq.qlinear import QuantLinear
from lrq.quant import dequantize, fake_quant, group_min_max, minmax_qparams, quantize
from lrq.schemes import SCHEMES, get_scheme
from lrq.smooth import PAIRS, activation_absmax, fold_scales, parse_pairs, smooth_model


def _ids(n=4, seq=32, seed=1, vocab=128):
    return torch.randint(0, vocab, (n, seq), generator=torch.Generator().manual_seed(seed))


def _logits(model, ids):
    with torch.no_grad():
        return model(ids).logits


def _weights(model):
    return {n: p.detach().clone() for n, p in model.named_parameters()}


# ---- smoothing folds ---------------------------------------------------------------------------------

def test_random_scales_fold_exactly_for_every_pair(arch):
    model = tiny_model(arch)
    ids = _ids()
    ref = _logits(model, ids)
    g = torch.Generator().manual_seed(3)
    for block in decoder_blocks(model):
        for pair in PAIRS:
            n = block.get_submodule(PAIRS[pair][0]).weight.shape[0]
            fold_scales(block, pair, torch.exp(torch.randn(n, generator=g)))
    assert torch.allclose(_logits(model, ids), ref, atol=1e-4, rtol=1e-4)


def test_smoothquant_folding_keeps_fp_logits(arch):
    model = tiny_model(arch)
    ids = _ids()
    ref, before = _logits(model, ids), _weights(model)
    stats = smooth_model(model, ids, alpha=0.8, pairs="qkv,gate_up,vo,up_down")
    assert stats["smoothed_pairs"] == 4 * len(decoder_blocks(model)) and stats["smooth_mean_abs_log10_scale"] > 0.05
    after = _weights(model)
    assert not torch.equal(after["model.layers.0.input_layernorm.weight"], before["model.layers.0.input_layernorm.weight"])
    assert not torch.equal(after["model.layers.1.self_attn.o_proj.weight"], before["model.layers.1.self_attn.o_proj.weight"])
    assert torch.allclose(_logits(model, ids), ref, atol=1e-4, rtol=1e-4)


def test_smoothing_flattens_activation_maxima():
    model = tiny_model("llama")
    with torch.no_grad():  # an outlier channel, as in real LLMs
        model.model.layers[0].input_layernorm.weight[5] = 30.0
    ids = _ids()
    spread = lambda m: (lambda a: (a.max() / a.median()).item())(activation_absmax(m, ids)[0]["self_attn.q_proj"])
    before = spread(model)
    smooth_model(model, ids, alpha=0.5)
    assert spread(model) < before / 2


def test_calibration_passes_never_compute_logits(monkeypatch):
    """The activation maxima and static ranges read the blocks' linears only: the output head (262,144 x 640 on
    Gemma 3, gigabytes of logits per batch) is never run, and the maxima are those of the full model's pass."""
    model = tiny_model("llama")
    ids = _ids()
    seen = {}
    hooks = [lin.register_forward_pre_hook(lambda mod, args, name=name: seen.setdefault(name, args[0].clone()))
             for name, lin in block_linears(decoder_blocks(model)[1]).items()]
    from lrq import precision
    with torch.no_grad(), precision.autocast(torch.device("cpu")):    # as the calibration passes run
        model(ids, use_cache=False)
    for h in hooks:
        h.remove()
    full = {name: x.reshape(-1, x.shape[-1]).abs().amax(0) for name, x in seen.items()}

    def no_head(*a, **k):
        raise AssertionError("the output head ran during a calibration pass")
    monkeypatch.setattr(model.lm_head, "forward", no_head)
    maxima = activation_absmax(model, ids, batch_size=len(ids))[1]
    assert set(maxima) == set(full) and all(torch.allclose(maxima[n], full[n].float()) for n in full)


def test_smoothing_pairs_are_checked():
    assert parse_pairs("gate_up, qkv") == ("qkv", "gate_up")
    with pytest.raises(UserError, match="unknown smoothing pair"):
        parse_pairs("qkv,ov")


def test_awq_folding_keeps_fp_logits(arch):
    model = tiny_model(arch)
    ids = _ids()
    ref, before = _logits(model, ids), _weights(model)
    cfg = get_method("awq").config("quick") | {"clip": False}
    walk_blocks(model, ids, lambda ctx: awq_block(ctx.block, ctx.q_inputs.data, ctx.kwargs, get_scheme("w3a16"),
                                                  cfg, ctx.stats), need_targets=False)
    assert all(not isinstance(m, QuantLinear) for m in model.modules())  # scales folded, nothing quantized
    changed = [n for n, w in _weights(model).items() if not torch.equal(w, before[n])]
    assert any("o_proj" in n for n in changed) and any("layernorm" in n for n in changed)
    assert torch.allclose(_logits(model, ids), ref, atol=1e-4, rtol=1e-4)


# ---- AWQ searches ------------------------------------------------------------------------------------

@pytest.mark.parametrize("scheme_name", ["w3a16", "w4a16-g128"])
@pytest.mark.parametrize("pair", list(PAIRS))
def test_awq_scale_is_never_worse_than_no_scaling(arch, pair, scheme_name):
    scheme = get_scheme(scheme_name)
    model = tiny_model(arch, hidden=192)
    inputs, per_layer = capture_block_inputs(model, _ids())
    kwargs = per_layer[0]
    block = decoder_blocks(model)[0]
    before = _weights(block)
    cap = capture(block, inputs.data, kwargs, [INSPECT[pair]], 8)[INSPECT[pair]]
    res = search_scale(block, pair, cap, scheme, n_grid=20)
    after = _weights(block)  # the search leaves the block as it was
    assert after.keys() == before.keys() and all(torch.equal(w, before[n]) for n, w in after.items())
    sub = search_scale(block, pair, cap, scheme, n_grid=20, search_tokens=40)  # loss on 40 tokens
    assert min(sub.losses) <= sub.losses[0] and (pair == "qkv") == (sub.losses == res.losses)
    # the objective at s = 1, computed independently: plain RTN of every consumer
    module = block.get_submodule(INSPECT[pair])
    with torch.no_grad():
        ref = cap.call(module, cap.x)
        for name in PAIRS[pair][1]:
            lin = block.get_submodule(name)
            lin.weight.data = rtn(lin.weight.data, scheme)
        identity_loss = (cap.call(module, cap.x) - ref).pow(2).mean().item()
    assert res.losses[0] == pytest.approx(identity_loss, rel=1e-5)
    assert len(res.losses) == 20 and res.ratio == res.losses.index(min(res.losses)) / 20
    assert min(res.losses) <= res.losses[0]


def test_awq_grids():
    assert grid_ratios(20) == [i / 20 for i in range(20)] and max(grid_ratios(20)) == 0.95  # the reference code's
    closed = grid_ratios(20, "closed")  # llm-compressor's: 0 to 1 inclusive
    assert len(closed) == 20 and closed[0] == 0 and closed[-1] == 1 and closed[1] == pytest.approx(1 / 19)
    with pytest.raises(UserError, match="n_grid=1"):
        grid_ratios(1, "closed")
    scheme = get_scheme("w3a16")
    model = tiny_model("llama", hidden=192)
    inputs, per_layer = capture_block_inputs(model, _ids())
    kwargs = per_layer[0]
    block = decoder_blocks(model)[0]
    cap = capture(block, inputs.data, kwargs, [INSPECT["gate_up"]], 8)[INSPECT["gate_up"]]
    res = search_scale(block, "gate_up", cap, scheme, n_grid=5, grid="closed")
    assert len(res.losses) == 5 and res.ratio in (0, 0.25, 0.5, 0.75, 1.0)
    assert res.ratio == res.losses.index(min(res.losses)) / 4


def _block_inputs_seen(monkeypatch, model, ids, cfg):
    """Run AWQ on `model`, returning the input stream each block's search saw."""
    seen = []

    def spy(block, inputs, *args):
        seen.append(inputs.clone())
        return awq_block(block, inputs, *args)
    monkeypatch.setattr(awq_mod, "awq_block", spy)
    get_method("awq").quantize(model, get_scheme("w3a16"), cfg, Calibration(ids))
    return seen


def test_awq_float_chain_feeds_the_floating_point_blocks(monkeypatch):
    ids = _ids(n=4, seq=32)
    fp = tiny_model("llama")
    with torch.no_grad():
        hidden = fp(ids, output_hidden_states=True).hidden_states
    fp_inputs = [h for h in hidden[:len(decoder_blocks(fp))]]
    cfg = get_method("awq").config("quick") | {"clip": False, "bf16": False, "n_samples": 4}
    float_seen = _block_inputs_seen(monkeypatch, tiny_model("llama"), ids, cfg | {"chain": "float"})
    quant_seen = _block_inputs_seen(monkeypatch, tiny_model("llama"), ids, cfg)
    assert len(float_seen) == len(quant_seen) == len(fp_inputs) >= 2
    for i, (f, q, ref) in enumerate(zip(float_seen, quant_seen, fp_inputs)):
        # scales folded without quantization leave the function unchanged: the float chain is the FP model's
        assert torch.allclose(f, ref, atol=1e-4, rtol=1e-4)
        if i > 0:  # the quantized chain differs from the first quantized block on
            assert (q - ref).abs().max() > 1e-3
    model = tiny_model("llama")
    get_method("awq").quantize(model, get_scheme("w3a16"), cfg | {"chain": "float"}, Calibration(ids))
    assert sum(isinstance(m, QuantLinear) for m in model.modules()) == 7 * len(decoder_blocks(model))


def test_awq_bad_choice_is_a_clear_error():
    with pytest.raises(UserError, match="chain='fast' is not valid: chain takes one of quantized, float"):
        get_method("awq").quantize(tiny_model("llama"), get_scheme("w3a16"),
                                   get_method("awq").config("quick", {"chain": "fast"}), Calibration(_ids()))


@pytest.mark.parametrize("group_size", [None, 128])
def test_awq_clip_is_never_worse_than_no_clipping(group_size):
    scheme = get_scheme("w3a16" if group_size is None else "w3a16-g128")
    g = torch.Generator().manual_seed(0)
    w = torch.randn(48, 192, generator=g) * torch.linspace(0.2, 3, 192)
    w[:, 7] *= 8  # an outlier column
    x = torch.randn(256, 192, generator=g)
    max_val = search_clip(w, x, scheme)
    lo, hi = group_min_max(w, group_size)
    assert (max_val <= torch.maximum(-lo, hi) + 1e-6).all()
    clipped = (x @ rtn(clip_weight(w, max_val, group_size), scheme).T - x @ w.T).pow(2).mean()
    plain = (x @ rtn(w, scheme).T - x @ w.T).pow(2).mean()
    assert clipped < plain  # per row/group never worse; with an outlier, strictly better overall


# ---- GPTQ --------------------------------------------------------------------------------------------

def _correlated_inputs(tokens=2048, cols=192, seed=0):
    g = torch.Generator().manual_seed(seed)
    mix = torch.randn(cols, cols, generator=g) / cols**0.5 + torch.eye(cols)
    x = torch.randn(tokens, cols, generator=g) @ mix
    return x * torch.exp(torch.randn(cols, generator=g))  # channels of very different scale


@pytest.mark.parametrize("act_order", [True, False])
@pytest.mark.parametrize("group_size", [None, 128])
def test_gptq_beats_rtn_on_correlated_inputs(group_size, act_order):
    bits = 4
    x = _correlated_inputs(cols=192)  # 192 = 128 + 64: a ragged last group at g128
    w = torch.randn(96, 192, generator=torch.Generator().manual_seed(1))
    h = 2 * x.T @ x / x.shape[0]
    res = gptq_quantize(w, h, bits, group_size, act_order=act_order)
    rtn_w = fake_quant(w, *minmax_qparams(w, bits, group_size), bits, group_size)
    err = lambda q: (x @ w.T - x @ q.T).norm().item()
    # channels of very different scale: ordering by H_jj is where most of the gain comes from
    assert err(res.weight) < (0.7 if act_order else 0.9) * err(rtn_w)
    assert res.retries == 0 and not res.fallback
    # the GPTQ weights lie exactly on the stored grid: QuantLinear reproduces GPTQ's integers
    q = quantize(res.weight, res.scale, res.zero, bits, group_size)
    assert torch.equal(dequantize(q, res.scale, res.zero, group_size), res.weight)
    if act_order or group_size is None:  # static qparams: min/max of the original weights, natural order
        s, z = minmax_qparams(w, bits, group_size)
        assert torch.equal(res.scale, s) and torch.equal(res.zero, z)


def test_gptq_quantlinear_stores_gptq_integers():
    x = _correlated_inputs(cols=192)
    lin = torch.nn.Linear(192, 64)
    scheme = get_scheme("w4a16-g128")
    res = gptq_quantize(lin.weight.data, 2 * x.T @ x / len(x), 4, 128)
    m = QuantLinear.from_linear(lin, scheme, res.scale, res.zero, weight=res.weight)
    assert torch.equal(m.dequantized_weight(), res.weight)


def test_gptq_survives_dead_and_rank_deficient_inputs():
    x = _correlated_inputs(tokens=40, cols=192)  # 40 tokens: rank 40 << 192
    x[:, 10:20] = 0  # dead channels
    w = torch.randn(32, 192, generator=torch.Generator().manual_seed(2))
    for group_size in (None, 128):
        res = gptq_quantize(w, 2 * x.T @ x / len(x), 3, group_size)
        assert torch.isfinite(res.weight).all() and res.dead == 10 and not res.fallback


def test_gptq_zero_hessian_is_round_to_nearest():
    w = torch.randn(16, 64, generator=torch.Generator().manual_seed(3))
    res = gptq_quantize(w, torch.zeros(64, 64), 4, None)
    assert res.dead == 64 and torch.equal(res.weight, fake_quant(w, *minmax_qparams(w, 4), 4))


def test_gptq_raises_damping_until_the_hessian_factorises():
    h = torch.eye(64)
    h[0, 1] = h[1, 0] = 2.0  # indefinite: eigenvalue -1
    w = torch.randn(8, 64, generator=torch.Generator().manual_seed(4))
    res = gptq_quantize(w, h, 4, None)
    assert res.retries >= 2 and not res.fallback and torch.isfinite(res.weight).all()
    res = gptq_quantize(w, torch.full((64, 64), float("nan")), 4, None)  # never factorises: RTN
    assert res.fallback and torch.isfinite(res.weight).all()


def test_gptq_is_true_sequential(monkeypatch):
    """Each group's Hessian is collected after the block's earlier groups became QuantLinear."""
    import baselines.gptq as gptq
    seen = []
    real = gptq.input_hessian

    def spy(block, linear, *args, **kwargs):
        kinds = {n: isinstance(m, QuantLinear) for n, m in block_linears(block).items()}
        seen.append((next(n for n, m in block_linears(block).items() if m is linear), kinds))
        return real(block, linear, *args, **kwargs)

    monkeypatch.setattr(gptq, "input_hessian", spy)
    model = tiny_model("llama")
    get_method("gptq").quantize(model, get_scheme("w4a16"), get_method("gptq").config("quick"), Calibration(_ids()))
    assert [n for n, _ in seen] == [g[0] for g in gptq.SEQUENTIAL_GROUPS] * len(decoder_blocks(model))
    done: set[str] = set()
    for name, kinds in seen[:len(gptq.SEQUENTIAL_GROUPS)]:
        assert {n for n, q in kinds.items() if q} == done
        done |= set(next(g for g in gptq.SEQUENTIAL_GROUPS if g[0] == name))


# ---- every method, every scheme ---------------------------------------------------------------------

@pytest.mark.parametrize("scheme_name", list(SCHEMES))
@pytest.mark.parametrize("method", ["smoothquant", "gptq", "awq"])
def test_every_baseline_runs_under_every_scheme(arch, method, scheme_name):
    model = tiny_model(arch, hidden=192)  # g128: a ragged last group of 64
    ids = _ids(n=2, seq=24, seed=0)
    scheme = get_scheme(scheme_name)
    m = get_method(method)
    assert m.needs_calibration(scheme)
    stats = m.quantize(model, scheme, m.config("quick"), Calibration(_ids()))
    assert all(isinstance(v, (int, float)) for v in stats.values())
    for block in decoder_blocks(model):
        for name, lin in block_linears(block).items():
            assert isinstance(lin, QuantLinear) and lin.bits == scheme.w_bits and lin.group_size == scheme.group_size
            assert lin.act_quant_enabled and (lin.act_calibrated or not scheme.static_activations)
    out = _logits(model, ids)
    assert torch.isfinite(out).all()
    if method == "awq":  # the searches saw the candidate weights (a stale bf16 weight cache would give loss 0)
        assert 0 < stats["awq_mean_loss_vs_rtn"] <= 1


def test_presets_and_overrides():
    for name in ("smoothquant", "gptq", "awq"):
        m = get_method(name)
        assert set(m.presets) == {"quick", "paper"}
    assert get_method("smoothquant").config("quick", {"alpha": "0.8"})["alpha"] == 0.8
    assert get_method("gptq").config("paper") == {"damp": 0.01, "block_size": 128, "act_order": True, "bf16": True,
                                                  "batch_size": 8}
    assert get_method("awq").config("paper")["n_samples"] == 128
