"""OmniQuant (LWC + LET) on the shared reconstruction engine, on tiny random Llama/Qwen2 models (GQA)."""

import pytest
import torch

from baselines.omniquant import LET, LET_PAIRS, OmniQuantLinear
from conftest import tiny_model
from lrq.arch import block_linears, decoder_blocks
from lrq.errors import UserError
from lrq.methods import Calibration, get_method
from lrq.qlinear import QuantLinear
from lrq.quant import fake_quant, minmax_qparams
from lrq.schemes import SCHEMES, get_scheme


def _calib(n=10, seq=24, vocab=128, seed=5):
    return Calibration(torch.randint(0, vocab, (n, seq), generator=torch.Generator().manual_seed(seed)), {"seed": 0})


def _logits(model, ids):
    with torch.no_grad():
        return model(ids).logits


def _random_let(block, seed=0):
    g = torch.Generator().manual_seed(seed)
    sizes = {"qkv": block.self_attn.q_proj.in_features, "gate_up": block.mlp.gate_proj.in_features,
             "vo": block.self_attn.v_proj.out_features}
    return LET(block, {p: 0.5 * torch.randn(sizes[p], generator=g) for p in LET_PAIRS})


@pytest.mark.parametrize("bits", [3, 4, 8])
@pytest.mark.parametrize("group_size", [None, 32, 48])
def test_lwc_at_full_range_is_round_to_nearest(bits, group_size):
    """With sigmoid(gamma) = sigmoid(beta) = 1 the clipped range is min/max: exactly RTN."""
    torch.manual_seed(0)
    lin = torch.nn.Linear(80, 12)
    scheme = get_scheme("w4a16") if bits == 4 else get_scheme("w3a16") if bits == 3 else get_scheme("w8a8")
    scheme = type(scheme)(**{**scheme.__dict__, "w_bits": bits, "group_size": group_size})
    scale, zero = minmax_qparams(lin.weight, bits, group_size)
    m = OmniQuantLinear(lin, scheme, scale, zero, lwc_init=60.0)   # sigmoid(60) == 1.0 in float32
    expected = fake_quant(lin.weight.detach(), scale, zero, bits, group_size)
    torch.testing.assert_close(m.w_hat(), expected, rtol=0, atol=1e-6)
    frozen = m.freeze()
    torch.testing.assert_close(frozen.dequantized_weight(), expected, rtol=0, atol=1e-6)
    assert m.n_learnable() == 2 * scale.numel()


def test_lwc_gradients_reach_both_bounds():
    torch.manual_seed(1)
    lin = torch.nn.Linear(64, 16)
    scale, zero = minmax_qparams(lin.weight, 3)
    m = OmniQuantLinear(lin, get_scheme("w3a16"), scale, zero)
    x = torch.randn(4, 64)
    ((m(x) - lin(x)) ** 2).sum().backward()
    assert m.gamma.grad is not None and m.gamma.grad.abs().sum() > 0
    assert m.beta.grad is not None and m.beta.grad.abs().sum() > 0


def test_lwc_clipping_shrinks_the_range():
    lin = torch.nn.Linear(64, 8)
    scale, zero = minmax_qparams(lin.weight, 4)
    m = OmniQuantLinear(lin, get_scheme("w4a16"), scale, zero, lwc_init=0.0)   # sigmoid(0) = 0.5
    s, _ = m.qparams(m.weight)
    torch.testing.assert_close(s, scale * 0.5, rtol=1e-5, atol=1e-8)


def test_let_at_initialisation_leaves_logits_unchanged(arch):
    """Random LET scales on every pair (norms, v->o across GQA heads) applied to FP weights: same function,
    before and after the norms' scales are folded."""
    model = tiny_model(arch)
    ids = torch.randint(0, 128, (2, 16))
    ref = _logits(model, ids)
    lets = []
    for i, block in enumerate(decoder_blocks(model)):
        let = _random_let(block, seed=i)
        let.install()
        lets.append(let)
        with torch.no_grad():
            for name, lin in block_linears(block).items():
                ins, outs = let.in_scale(name), let.out_scale(name)
                if ins is not None:
                    lin.weight.mul_(ins().view(1, -1))
                if outs is not None:
                    lin.weight.div_(outs().view(-1, 1))
                    if lin.bias is not None:
                        lin.bias.div_(outs())
    assert type(decoder_blocks(model)[0].input_layernorm).__name__ == "ScaledNorm"
    torch.testing.assert_close(_logits(model, ids), ref, rtol=1e-4, atol=1e-4)
    for let in lets:
        let.fold()
    assert all(type(b.post_attention_layernorm).__name__ != "ScaledNorm" for b in decoder_blocks(model))
    torch.testing.assert_close(_logits(model, ids), ref, rtol=1e-4, atol=1e-4)


def test_omniquant_linear_with_let_matches_transformed_weight():
    torch.manual_seed(2)
    lin = torch.nn.Linear(32, 16)
    s_in, s_out = torch.rand(32) + 0.5, torch.rand(16) + 0.5
    scale, zero = minmax_qparams(lin.weight, 8)
    m = OmniQuantLinear(lin, get_scheme("w4a16"), scale, zero, lwc_init=60.0,
                        in_scale=lambda: s_in, out_scale=lambda: s_out)
    w, b = m.effective()
    torch.testing.assert_close(w, lin.weight.detach() * s_in / s_out.view(-1, 1))
    torch.testing.assert_close(b, lin.bias.detach() / s_out)
    ref_scale, ref_zero = minmax_qparams(w, 4)
    torch.testing.assert_close(m.freeze().dequantized_weight(), fake_quant(w, ref_scale, ref_zero, 4), atol=1e-6,
                               rtol=0)


def test_reconstruction_loss_falls_and_counts(arch):
    model = tiny_model(arch, hidden=64)
    M = get_method("omniquant")
    stats = M.quantize(model, get_scheme("w4a8"), M.config("quick", {"iters": 40, "heldout_samples": 3}), _calib())
    for b in stats["block_errors"]:
        assert b["calib_after"] < b["calib_before"]
    block = decoder_blocks(model)[0]
    lin = block_linears(block)
    lwc = sum(2 * m.out_features for m in lin.values())
    let = lin["self_attn.q_proj"].in_features + lin["mlp.gate_proj"].in_features + lin["self_attn.v_proj"].out_features
    assert stats["n_learnable"] == len(decoder_blocks(model)) * (lwc + let)
    assert stats["resolved_config"]["let"] == "on" and stats["resolved_config"]["recon_act_quant"] == "on"
    assert all(isinstance(m, QuantLinear) for b in decoder_blocks(model) for m in block_linears(b).values())
    # the LET was folded away: the norms are plain norms again
    assert all(type(b.input_layernorm).__name__ != "ScaledNorm" for b in decoder_blocks(model))


def test_weight_only_uses_lwc_alone():
    M = get_method("omniquant")
    cfg = M.resolve(get_scheme("w3a16"), M.config("quick"))
    assert cfg["let"] == "off" and cfg["recon_act_quant"] == "off" and cfg["lr_schedule"] == "constant"
    with pytest.raises(UserError, match="smooth_alpha"):
        M.resolve(get_scheme("w8a8"), M.config("quick", {"smooth_alpha": 0.8}))
    with pytest.raises(UserError, match="let takes one of on, off, auto"):
        M.resolve(get_scheme("w8a8"), M.config("quick", {"let": "maybe"}))
    assert M.config("paper")["iters"] == 2560 and M.calib_defaults["paper"]["n_samples"] == 128


def test_trained_let_is_folded_exactly():
    """After training, the deployed block (folded norms + QuantLinears) computes what the trained learnable
    block computed: the LET costs nothing at inference."""
    model = tiny_model("qwen2", hidden=64)
    M = get_method("omniquant")
    cfg = M.config("quick", {"let": "on", "iters": 15, "heldout_samples": 2})
    calib = _calib(6)
    captured = {}

    def finish(ctx, state, cfg_, n_train):
        with torch.no_grad():
            before = ctx.block(ctx.q_inputs.data[:2], **ctx.kwargs)
            before = before[0] if isinstance(before, tuple) else before
        type(M).finish_block(M, ctx, state, cfg_, n_train)
        with torch.no_grad():
            after = ctx.block(ctx.q_inputs.data[:2], **ctx.kwargs)
            after = after[0] if isinstance(after, tuple) else after
        captured.setdefault("pairs", []).append((before, after))
        assert state is not None and any(p.abs().sum() > 0 for p in state.parameters())

    M.finish_block = finish
    try:
        M.quantize(model, get_scheme("w4a16"), cfg, calib)
    finally:
        del M.finish_block
    assert len(captured["pairs"]) == len(decoder_blocks(model))
    for before, after in captured["pairs"]:
        torch.testing.assert_close(after, before, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("scheme_name", list(SCHEMES))
def test_omniquant_runs_under_every_scheme(arch, scheme_name):
    model = tiny_model(arch, hidden=192)   # g128: a ragged last group of 64
    scheme = get_scheme(scheme_name)
    M = get_method("omniquant")
    stats = M.quantize(model, scheme, M.config("quick", {"iters": 3, "heldout_samples": 2}), _calib(6))
    qs = [m for b in decoder_blocks(model) for m in block_linears(b).values()]
    assert all(isinstance(m, QuantLinear) and m.bits == scheme.w_bits and m.group_size == scheme.group_size
               for m in qs)
    if scheme.static_activations:
        assert all(m.act_calibrated for m in qs)
    assert torch.isfinite(_logits(model, torch.randint(0, 128, (2, 16)))).all()
    assert stats["n_learnable"] > 0
