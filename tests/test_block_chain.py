"""Every decoder block is replayed with its own layer's keyword arguments (issue U, item 2).

Block-wise methods (GPTQ, AWQ, LRQ, FlexRound, OmniQuant) train each block against the FP chain: the inputs of
block i are the outputs of the FP blocks before it, computed block by block outside the model's forward. A model
that mixes layer kinds (Gemma 3: sliding-window layers with rotary base 1e4 beside full-attention layers with
1e6; Qwen2 with sliding windows from `max_window_layers` on) gives each layer its own mask and rotary
embeddings, so replaying every block with layer 0's arguments drifts from the real model. Here the chain that
`lrq.blockwise.walk_blocks` hands each block equals the real model's hidden states, on tiny configs of each kind
with windows shorter than the sequence, and the same chain built from layer 0's arguments does not (so the
check can fail).
"""

from __future__ import annotations

import pytest
import torch

from conftest import tiny_model
from lrq.blockwise import capture_block_inputs, walk_blocks

SEQ = 32        # longer than every sliding window below (8), so the windowed and full masks differ


def _model(kind: str):
    """Three layers of the tiny config of `kind` (conftest.tiny_config: Gemma 3 sliding / full / sliding, with
    q/k norms, pre/post feed-forward norms and head_dim apart from hidden / heads; Qwen2 with sliding windows
    from layer 1 on; Mistral with a sliding window; Llama)."""
    return tiny_model(kind, layers=3)


def _chain(model, ids) -> list[torch.Tensor]:
    seen = []
    walk_blocks(model, ids, lambda ctx: seen.append(ctx.q_inputs.data.clone()), need_targets=False)
    return seen


@pytest.mark.parametrize("kind, layers_differ", [("gemma3", True), ("qwen2-sliding", True),
                                                 ("mistral", False), ("llama", False)])
def test_the_block_by_block_chain_is_the_models_own(kind, layers_differ):
    model = _model(kind)
    ids = torch.randint(0, 128, (2, SEQ), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        real = model(ids, output_hidden_states=True).hidden_states    # [i]: the input of block i
    chain = _chain(model, ids)
    assert len(chain) == model.config.num_hidden_layers
    for i, x in enumerate(chain):
        assert torch.allclose(x, real[i], atol=1e-5), f"{kind}: block {i}'s input is {float((x - real[i]).abs().max())} off"
    # the same chain replayed with layer 0's arguments for every block, as before the fix
    buf, per_layer = capture_block_inputs(model, ids)
    x, drift = buf.data[:].clone(), []
    from lrq.arch import decoder_blocks
    with torch.no_grad():
        for i, block in enumerate(decoder_blocks(model)):
            drift.append(float((x - real[i]).abs().max()))
            o = block(x, **per_layer[0])
            x = o[0] if isinstance(o, tuple) else o
    if layers_differ:
        assert max(drift) > 1e-3, f"{kind}: layer 0's arguments would have served every block"
    else:
        assert max(drift) < 1e-5


# ---- folds (issue U, item 3): only where exact, refused where a method would fold nothing ------------------

@pytest.mark.parametrize("kind", ["llama", "qwen2-sliding", "gemma3"])
def test_every_fold_is_exact_on_every_architecture(kind):
    """SmoothQuant, AWQ, OmniQuant's LET and the W8A8 smoothing of LRQ/FlexRound fold scales into the producing
    norm or linear. Gemma 3's norms compute (1 + weight) * normalised(x) and its MLP reads
    pre_feedforward_layernorm (post_attention_layernorm sits before the residual add): the fold measures the
    norm's offset and picks the norm the consumers read, so every pair folds exactly on all three (the folded FP
    block's output within rounding), checked on every block before a method folds, and every method runs."""
    import lrq
    from lrq.smooth import FOLD_TOLERANCE, PAIRS, check_model_folds
    ids = torch.randint(0, 128, (4, SEQ), generator=torch.Generator().manual_seed(0))
    ok, worst = check_model_folds(_model(kind), list(PAIRS), ids, "test")
    assert ok == list(PAIRS)
    assert worst < FOLD_TOLERANCE / 10
    _, stats = lrq.quantize(_model(kind), "smoothquant", "w8a8", calibration=ids)
    assert stats["fold_pairs_skipped"] == 0 and stats["fold_check_max_error"] < FOLD_TOLERANCE / 10
    probe = torch.randint(0, 128, (2, SEQ), generator=torch.Generator().manual_seed(5))
    rel = {}
    for method, scheme in (("rtn", "w4a16"), ("awq", "w4a16"), ("omniquant", "w4a8"), ("lrq", "w8a8")):
        extra = {"iters": 2, "heldout_samples": 0} if method in ("omniquant", "lrq") else {}
        fp, q = _model(kind), _model(kind)
        _, st = lrq.quantize(q, method, scheme, calibration=ids, **extra)
        if method != "rtn":      # each folding method records its check: every pair folded, within rounding
            assert st["fold_pairs_skipped"] == 0 and st["fold_check_max_error"] < FOLD_TOLERANCE / 10, (method, st)
        with torch.no_grad():
            ref, out = fp(probe).logits, q(probe).logits
        assert torch.isfinite(out).all(), method
        rel[method] = float((out - ref).norm() / ref.norm())
    # AWQ's search includes s = 1 (RTN) per pair: its output is about as close to FP as RTN's (before the fold
    # was fixed, folding into Gemma's norms gave AWQ 130,844 perplexity on gemma3-270m)
    assert rel["awq"] < 1.2 * rel["rtn"], rel


@pytest.mark.parametrize("offset", [0.0, 1.0])
def test_a_norm_fold_follows_the_norms_own_formula(offset):
    """Dividing a norm's outputs by s: weight <- (c + weight)/s - c, with c measured on the module (0 for
    Llama's RMSNorm, 1 for Gemma's)."""
    from transformers.models.gemma3.modeling_gemma3 import Gemma3RMSNorm
    from transformers.models.llama.modeling_llama import LlamaRMSNorm
    from lrq.smooth import divide_norm, norm_offset
    norm = (Gemma3RMSNorm if offset else LlamaRMSNorm)(16)
    with torch.no_grad():
        norm.weight.normal_(0.3, 0.2)
    assert norm_offset(norm) == offset
    x = torch.randn(3, 16)
    s = torch.rand(16) + 0.5
    ref = norm(x) / s
    divide_norm(norm, s)
    assert torch.allclose(norm(x), ref, atol=1e-6)


def test_a_fold_that_would_change_the_model_is_refused():
    """The numerical check catches a fold the formula gets wrong: with gate/up's producer pointed at the norm
    the MLP does not read (Gemma's post_attention_layernorm, as before the fix), the gate_up fold changes the FP
    block, a method that would fold only that pair refuses (nothing stored), and AWQ folds the others."""
    import lrq
    from lrq import smooth
    from lrq.arch import decoder_blocks
    from lrq.errors import UserError
    ids = torch.randint(0, 128, (4, SEQ), generator=torch.Generator().manual_seed(0))
    saved = smooth.ALT_PRODUCERS
    smooth.ALT_PRODUCERS = {}
    try:
        m = _model("gemma3")
        buf, per_layer = capture_block_inputs(m, ids[:1, :16])
        assert smooth.fold_error(decoder_blocks(m)[0], "gate_up", buf.data[:1], per_layer[0]) > 0.1
        assert smooth.fold_error(decoder_blocks(m)[0], "qkv", buf.data[:1], per_layer[0]) < 1e-5
        with pytest.raises(UserError, match="would change the floating-point model.*Nothing was stored"):
            lrq.quantize(_model("gemma3"), "smoothquant", "w8a8", calibration=ids, pairs="gate_up")
        _, stats = lrq.quantize(_model("gemma3"), "awq", "w4a16", calibration=ids)
        assert stats["fold_pairs_skipped"] == 1
    finally:
        smooth.ALT_PRODUCERS = saved
