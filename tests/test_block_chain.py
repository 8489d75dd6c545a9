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
