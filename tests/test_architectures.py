"""Every method on every decoder family the suite claims (issue U, item 7): tiny random Gemma 3 (a sliding and
a full-attention layer, q/k norms, pre/post feed-forward norms, (1 + weight) norms, GeGLU, head_dim apart from
hidden / heads, tied embeddings), Qwen2 (q/k/v biases) and Mistral (a sliding window shorter than the
sequence), through every method under the schemes it is meant for. Each result is finite and closer to the FP
model than a model of random weights would be, and each folding method records that its every fold was exact
(the folded FP model's output within rounding, checked before quantizing)."""

from __future__ import annotations

import copy

import pytest
import torch

from conftest import tiny_model

SEQ = 24          # longer than the sliding windows (8): the windowed layers differ from full attention
#: (method, schemes it is meant for, settings that keep the test short)
RUNS = [("rtn", ("w4a16-g64", "w4a8", "w8a8"), {}),
        ("gptq", ("w4a16-g64", "w3a16", "w4a8"), {}),
        ("awq", ("w4a16-g64", "w3a16"), {}),
        ("smoothquant", ("w8a8", "w4a8"), {}),
        ("lrq", ("w4a16-g64", "w4a8", "w8a8"), {"iters": 3, "heldout_samples": 1, "error_samples": 1}),
        ("flexround", ("w3a16", "w8a8"), {"iters": 3, "heldout_samples": 1, "error_samples": 1}),
        ("omniquant", ("w4a8", "w4a16-g64"), {"iters": 3, "heldout_samples": 1, "error_samples": 1})]
FOLDING = {"awq", "smoothquant", "omniquant"}     # and LRQ / FlexRound at w8a8 (their smoothing)


@pytest.mark.parametrize("arch", ["gemma3", "qwen2", "mistral"])
@pytest.mark.parametrize("method, schemes, extra", RUNS, ids=[r[0] for r in RUNS])
def test_every_method_on_every_family(arch, method, schemes, extra):
    import lrq
    from lrq.smooth import FOLD_TOLERANCE
    fp = tiny_model(arch, layers=2)
    g = torch.Generator().manual_seed(0)
    calib = torch.randint(0, 128, (6, SEQ), generator=g)
    probe = torch.randint(0, 128, (2, SEQ), generator=g)
    with torch.no_grad():
        ref = fp(probe).logits
        noise = tiny_model(arch, seed=1, layers=2)(probe).logits     # another random model: the scale of "wrong"
    for scheme in schemes:
        q = copy.deepcopy(fp)
        _, stats = lrq.quantize(q, method, scheme, calibration=calib, **extra)
        with torch.no_grad():
            out = q(probe).logits
        assert torch.isfinite(out).all(), (arch, method, scheme)
        err = float((out - ref).norm() / ref.norm())
        assert err < 0.5 * float((noise - ref).norm() / ref.norm()), (arch, method, scheme, err)
        folds = method in FOLDING and not (method == "omniquant" and scheme == "w4a16-g64") or (
            method in ("lrq", "flexround") and scheme == "w8a8")
        if folds:
            assert stats["fold_pairs_skipped"] == 0, (arch, method, scheme, stats)
            assert stats["fold_check_max_error"] < FOLD_TOLERANCE / 10, (arch, method, scheme, stats)


@pytest.mark.parametrize("arch", ["gemma3", "qwen2", "mistral"])
def test_smoothing_alone_keeps_the_fp_model(arch):
    """The fold with no quantization after it: SmoothQuant's scales at alpha 0.5 on every pair leave the FP
    model's logits as they were (before the fold followed Gemma's norms, this step alone took gemma3-270m's
    perplexity from 16.2 to 5.5e8)."""
    from lrq.smooth import PAIRS, smooth_model
    fp = tiny_model(arch, layers=2)
    m = copy.deepcopy(fp)
    calib = torch.randint(0, 128, (4, SEQ), generator=torch.Generator().manual_seed(0))
    stats = smooth_model(m, calib, alpha=0.5, pairs=list(PAIRS))
    assert stats["fold_pairs_skipped"] == 0 and stats["smoothed_pairs"] == 2 * len(PAIRS)
    assert stats["smooth_mean_abs_log10_scale"] > 0.05          # the scales are not all 1: something was folded
    with torch.no_grad():
        a, b = fp(calib).logits, m(calib).logits
    assert float((a - b).abs().max() / a.abs().max()) < 1e-4


@pytest.mark.parametrize("arch", ["llama", "qwen2", "gemma3"])
def test_each_input_groups_scope_holds_exactly_its_linears(arch):
    """`lrq.arch.group_scope` (where AWQ compares a group's output) is, in every family, the smallest module that
    holds all of the group's linears and none of another group's inputs."""
    from lrq.arch import INPUT_GROUPS, block_linears, decoder_blocks, group_scope
    block = decoder_blocks(tiny_model(arch))[0]
    lins = block_linears(block)
    for g, (_, members) in INPUT_GROUPS.items():
        scope = block.get_submodule(group_scope(g))
        held = {n for n, m in lins.items() if any(m is s for s in scope.modules())}
        assert set(members) <= held, (g, held)
        assert all(not group_scope(g).startswith(n) for n in lins if n not in members)
    assert {group_scope(g) for g in INPUT_GROUPS} == {"self_attn", "self_attn.o_proj", "mlp", "mlp.down_proj"}
