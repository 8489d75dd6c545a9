"""Scheme application through RTN on tiny random Llama and Qwen2 models built in memory."""

import pytest
import torch
from torch import nn

from conftest import tiny_model
from lrq.arch import LINEAR_NAMES, decoder_blocks, block_linears
from lrq.errors import UserError
from lrq.methods import Calibration, get_method
from lrq.qlinear import QuantLinear
from lrq.quant import fake_quant, minmax_qparams
from lrq.schemes import DEFAULT_SCHEMES, SCHEMES, get_scheme


def _calib(vocab=128, n=4, seq=32):
    return Calibration(torch.randint(0, vocab, (n, seq), generator=torch.Generator().manual_seed(1)))


def _logits(model, ids):
    with torch.no_grad():
        return model(ids).logits


@pytest.mark.parametrize("scheme_name", list(SCHEMES))
def test_every_scheme_quantizes_all_seven_linears(arch, scheme_name):
    model = tiny_model(arch, hidden=192)  # 192 = 128 + 64: a ragged last group at g128
    ids = torch.randint(0, 128, (2, 24), generator=torch.Generator().manual_seed(0))
    ref = _logits(model, ids)
    originals = {(i, n): l.weight.detach().clone() for i, b in enumerate(decoder_blocks(model))
                 for n, l in block_linears(b).items()}
    scheme = get_scheme(scheme_name)
    get_method("rtn").quantize(model, scheme, {}, _calib())
    for i, block in enumerate(decoder_blocks(model)):
        lins = block_linears(block)
        assert set(lins) == set(LINEAR_NAMES)
        for name, m in lins.items():
            assert isinstance(m, QuantLinear) and m.bits == scheme.w_bits and m.group_size == scheme.group_size
            # the stored integers are RTN of the original weights on the min/max grid
            s, z = minmax_qparams(originals[(i, name)], scheme.w_bits, scheme.group_size)
            expect = fake_quant(originals[(i, name)], s, z, scheme.w_bits, scheme.group_size)
            assert torch.allclose(m.dequantized_weight(), expect)
            if scheme.static_activations:
                assert m.act_calibrated and m.act_scale > 0
            assert m.quantize_output == (scheme.kv_bits is not None and name in ("self_attn.k_proj", "self_attn.v_proj"))
    # embeddings, norms and the head stay in floating point
    assert not isinstance(model.lm_head, QuantLinear)
    out = _logits(model, ids)
    assert torch.isfinite(out).all()
    assert not torch.equal(out, ref)


def test_error_grows_as_bits_fall(arch):
    ids = torch.randint(0, 128, (2, 32), generator=torch.Generator().manual_seed(0))
    ref = _logits(tiny_model(arch), ids)
    errs = {}
    for name in ("w8a8", "w4a16", "w3a16"):
        model = tiny_model(arch)
        get_method("rtn").quantize(model, get_scheme(name), {}, _calib())
        errs[name] = (_logits(model, ids) - ref).pow(2).mean().item()
    assert 0 < errs["w8a8"] < errs["w4a16"] < errs["w3a16"]


def test_groupwise_beats_per_channel(arch):
    ids = torch.randint(0, 128, (2, 32), generator=torch.Generator().manual_seed(0))
    ref = _logits(tiny_model(arch, hidden=256), ids)
    errs = {}
    for name in ("w3a16", "w3a16-g128"):
        model = tiny_model(arch, hidden=256)
        get_method("rtn").quantize(model, get_scheme(name), {}, None)
        errs[name] = (_logits(model, ids) - ref).pow(2).mean().item()
    assert errs["w3a16-g128"] < errs["w3a16"]


def test_static_scheme_without_calibration_fails_loudly():
    model = tiny_model()
    get_method("rtn").quantize(model, get_scheme("w4a16"), {}, None)  # weight-only needs no data
    q = QuantLinear.from_linear(nn.Linear(8, 4), get_scheme("w8a8"), *minmax_qparams(torch.randn(4, 8), 8))
    with pytest.raises(RuntimeError, match="never calibrated"):
        q(torch.randn(2, 8))


def test_default_schemes_are_the_six():
    assert DEFAULT_SCHEMES == ("w8a8", "w4a8", "w4a16", "w3a16", "w4a16-g128", "w3a16-g128")
    with pytest.raises(UserError, match="unknown scheme 'w5a9'"):
        get_scheme("w5a9")


def test_unsupported_architecture_is_named():
    from transformers import GPT2Config, GPT2LMHeadModel
    model = GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=64))
    with pytest.raises(UserError, match="'gpt2' is not supported.*llama, mistral, qwen2"):
        get_method("rtn").quantize(model, get_scheme("w4a16"), {}, None)


def test_unknown_method_lists_registered():
    with pytest.raises(UserError, match="unknown method 'nope'.*rtn"):
        get_method("nope")


def test_set_overrides_parse_booleans_and_reject_bad_values():
    gptq = get_method("gptq")
    assert gptq.config("quick", {"act_order": "false"})["act_order"] is False
    assert gptq.config("quick", {"act_order": "True"})["act_order"] is True
    assert gptq.config("quick", {"damp": "0.05"})["damp"] == 0.05
    with pytest.raises(UserError, match="not a boolean"):
        gptq.config("quick", {"act_order": "maybe"})
    with pytest.raises(UserError, match="not a valid float"):
        gptq.config("quick", {"damp": "lots"})
