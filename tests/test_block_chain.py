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

from lrq.blockwise import capture_block_inputs, walk_blocks

SEQ = 32        # longer than every sliding window below (8), so the windowed and full masks differ


def _model(kind: str):
    from transformers import (Gemma3ForCausalLM, Gemma3TextConfig, LlamaConfig, LlamaForCausalLM, MistralConfig,
                              MistralForCausalLM, Qwen2Config, Qwen2ForCausalLM)
    common = dict(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=3, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=256)
    torch.manual_seed(0)
    if kind == "gemma3":      # q/k norms, pre/post feed-forward norms, head_dim != hidden / heads, two rotary bases
        cfg = Gemma3TextConfig(**common, head_dim=32, sliding_window=8,
                               layer_types=["sliding_attention", "full_attention", "sliding_attention"])
        model = Gemma3ForCausalLM(cfg)
    elif kind == "qwen2-sliding":   # full attention in layer 0, sliding windows from layer 1 on
        model = Qwen2ForCausalLM(Qwen2Config(**common, use_sliding_window=True, sliding_window=8, max_window_layers=1))
    elif kind == "mistral-sliding":
        model = MistralForCausalLM(MistralConfig(**common, sliding_window=8))
    else:
        model = LlamaForCausalLM(LlamaConfig(**common))
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 2:
                p.normal_(0, 0.08)
    return model.eval()


def _chain(model, ids) -> list[torch.Tensor]:
    seen = []
    walk_blocks(model, ids, lambda ctx: seen.append(ctx.q_inputs.data.clone()), need_targets=False)
    return seen


@pytest.mark.parametrize("kind, layers_differ", [("gemma3", True), ("qwen2-sliding", True),
                                                 ("mistral-sliding", False), ("llama", False)])
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
def test_every_fold_is_checked_exact_before_a_method_folds(kind):
    """SmoothQuant, AWQ, OmniQuant's LET and the W8A8 smoothing of LRQ/FlexRound fold scales into the producing
    norm or linear. On Llama and Qwen2 blocks every pair folds exactly (the folded FP block's output within
    rounding). On Gemma 3 the norms compute (1 + weight) * normalised(x): the norm pairs (qkv, gate_up) do not
    fold, the linear pairs (vo, up_down) do. A method folds only the exact pairs (AWQ, OmniQuant's LET keep vo /
    up_down, the stats count the pairs skipped), and one left with none (SmoothQuant and the W8A8 smoothing use
    the norm pairs only) refuses before any quantization instead of storing a broken model's numbers."""
    import lrq
    from lrq.arch import decoder_blocks
    from lrq.errors import UserError
    from lrq.smooth import FOLD_TOLERANCE, PAIRS, check_model_folds, fold_error
    ids = torch.randint(0, 128, (4, SEQ), generator=torch.Generator().manual_seed(0))
    ok, worst = check_model_folds(_model(kind), list(PAIRS), ids, "test")
    assert worst < FOLD_TOLERANCE / 10
    if kind != "gemma3":
        assert ok == list(PAIRS)
        _, stats = lrq.quantize(_model(kind), "smoothquant", "w8a8", calibration=ids)
        assert stats["fold_pairs_skipped"] == 0
        for method, scheme in (("awq", "w4a16"), ("omniquant", "w4a8"), ("lrq", "w8a8")):
            extra = {"iters": 2, "heldout_samples": 0} if method != "awq" else {}
            lrq.quantize(_model(kind), method, scheme, calibration=ids, **extra)
        return
    assert ok == ["vo", "up_down"]
    m = _model(kind)
    buf, per_layer = capture_block_inputs(m, ids[:1, :16])
    assert fold_error(decoder_blocks(m)[0], "qkv", buf.data[:1], per_layer[0]) > 0.1   # far from exact
    for method, scheme, extra in (("smoothquant", "w8a8", {}), ("lrq", "w8a8", {"iters": 2, "heldout_samples": 0})):
        with pytest.raises(UserError, match="would change the floating-point model.*Nothing was stored"):
            lrq.quantize(_model(kind), method, scheme, calibration=ids, **extra)
    # AWQ and OmniQuant fold their linear pairs only: the FP function is kept, and AWQ's output is as close to
    # FP as RTN's (before the check, folding into Gemma's norms gave AWQ 130,844 perplexity on gemma3-270m)
    probe = torch.randint(0, 128, (2, SEQ), generator=torch.Generator().manual_seed(5))
    rel = {}
    for method in ("rtn", "awq"):
        fp, q = _model(kind), _model(kind)
        lrq.quantize(q, method, "w4a16", calibration=ids)
        with torch.no_grad():
            ref, out = fp(probe).logits, q(probe).logits
        rel[method] = float((out - ref).norm() / ref.norm())
    assert rel["awq"] < 1.2 * rel["rtn"], rel
    lrq.quantize(_model(kind), "omniquant", "w4a8", calibration=ids, iters=2, heldout_samples=0)
