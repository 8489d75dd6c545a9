"""Checkpoints quantized elsewhere, scored as cells beside ours (issue O): our own export read back reproduces
its cell's numbers, compressed-tensors' own writer's symmetric checkpoint loads with the library's own
dequantization, and the GPTQ layout is read as AutoGPTQ documents it."""

from __future__ import annotations

import json

import pytest
import torch

from lrq.external import apply_checkpoint, describe, quantization_config
from bench.cli import main
from bench.common.store import ResultStore
from conftest import tiny_model

QUICK = ["--profile", "full", "--tasks", "none", "--datasets", "wikitext2", "--max-eval-tokens", "1024",
         "--eval-seq-len", "256", "--jobs", "1"]


@pytest.mark.heavy
def test_our_export_read_back_reproduces_its_cell(tiny_model_dir, data_dir, tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("LRQ_BENCH_CACHE", str(tmp_path / "cache"))
    results = tmp_path / "r.sqlite"
    common = [*QUICK, "--data-dir", str(data_dir), "--results", str(results)]
    assert main(["run", *common, "--model", str(tiny_model_dir), "--methods", "rtn", "--schemes", "w4a16"]) == 0
    assert main(["export", "--model", str(tiny_model_dir), "--method", "rtn", "--scheme", "w4a16",
                 "--out", str(tmp_path / "exp"), "--data-dir", str(data_dir)]) == 0
    assert quantization_config(tmp_path / "exp") and describe(tmp_path / "exp")["method"] == "external:lrq-bench-rtn-w4"
    capsys.readouterr()
    # the export names its reference model itself; scored in the same store, it becomes a cell beside ours
    assert main(["run", *common, "--model", str(tmp_path / "exp"), "--no-fp"]) == 0
    err = capsys.readouterr().err
    assert "scored as external:lrq-bench-rtn-w4 (w4a16)" in " ".join(err.split())
    rows = ResultStore(results).rows()
    ours = {r.metric: r.value for r in rows if r.method == "rtn" and r.dataset == "wikitext2"}
    theirs = {r.metric: r.value for r in rows if r.method == "external:lrq-bench-rtn-w4" and r.dataset == "wikitext2"}
    assert {r.model for r in rows} == {str(tiny_model_dir)}              # the same leaderboard section
    for metric in ("ppl", "kld", "kld_median", "kld_p99", "top1_agree"):
        assert theirs[metric] == ours[metric], metric                    # the same integers: the same numbers
    bits = {r.method: r.value for r in rows if r.metric == "bits_per_weight"}
    assert 4.0 < bits["external:lrq-bench-rtn-w4"] < 4.6
    # a checkpoint cell takes no method settings, and needs its reference model where it names none
    assert main(["run", *common, "--model", str(tmp_path / "exp"), "--methods", "gptq"]) == 2
    assert "does not apply" in capsys.readouterr().err


def test_a_symmetric_compressed_tensors_checkpoint_matches_the_librarys_own_dequantization(tmp_path):
    """A checkpoint written by compressed-tensors' own compressor (llm-compressor's W4A16 preset: symmetric,
    groups of 32 here) read by us gives the weights compressed-tensors itself decompresses."""
    ct = pytest.importorskip("compressed_tensors", reason="the export extra (compressed-tensors) is not installed")
    from compressed_tensors.compressors import ModelCompressor
    from compressed_tensors.quantization import QuantizationConfig, apply_quantization_config
    from transformers import AutoModelForCausalLM
    model = tiny_model("llama", hidden=64, layers=2)
    qcfg = {"config_groups": {"group_0": {"targets": ["Linear"], "weights": {
        "num_bits": 4, "type": "int", "symmetric": True, "strategy": "group", "group_size": 32}}},
        "ignore": ["lm_head"], "quantization_status": "frozen", "format": "pack-quantized"}
    apply_quantization_config(model, QuantizationConfig.model_validate(qcfg))
    with torch.no_grad():
        for name, m in model.named_modules():
            if hasattr(m, "weight_scale") and name.startswith("model.layers"):
                w = m.weight.float().reshape(m.weight.shape[0], -1, 32)
                scale = (w.abs().amax(-1) / 7).clamp(min=1e-8)
                m.weight_scale.copy_(scale.to(m.weight_scale.dtype))
                q = torch.round(w / scale.unsqueeze(-1)).clamp(-8, 7)
                m.weight.copy_((q * scale.unsqueeze(-1)).reshape_as(m.weight))
                if hasattr(m, "weight_zero_point"):
                    m.weight_zero_point.zero_()
    dense = {k: v.clone() for k, v in model.state_dict().items() if k.endswith(".weight")}
    mc = ModelCompressor.from_pretrained_model(model, quantization_format="pack-quantized")
    mc.compress_model(model)
    model.save_pretrained(tmp_path / "ct")
    mc.update_config(str(tmp_path / "ct"))
    info = describe(tmp_path / "ct")
    assert (info["bits"], info["group_size"], info["symmetric"], info["scheme"]) == (4, 32, True, "w4a16-g32")
    assert info["method"] == "external:llmc-rtn-w4g32-sym" or info["method"] == "external:compressed-tensors-w4g32-sym"
    fresh = tiny_model("llama", hidden=64, layers=2)
    stats = apply_checkpoint(fresh, tmp_path / "ct")
    for name, m in fresh.named_modules():
        if hasattr(m, "dequantized_weight"):
            torch.testing.assert_close(m.dequantized_weight().float(), dense[f"{name}.weight"].float(), rtol=0,
                                       atol=1e-6)
    assert stats["bits_per_weight"] == pytest.approx(4 + 16 / 32)     # levels + a 16-bit scale per 32, no zero
    ref = AutoModelForCausalLM.from_pretrained(tmp_path / "ct", dtype=torch.float32,
                                               quantization_config=__import__(
                                                   "transformers").CompressedTensorsConfig(dequantize=True)).eval()
    ids = torch.randint(0, 128, (1, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(fresh(ids).logits, ref(ids).logits, rtol=1e-5, atol=1e-5)
    assert ct.__version__


def _gptq_pack_rows(q: torch.Tensor, bits: int) -> torch.Tensor:
    """AutoGPTQ's packing written out plainly: q [rows, cols] -> int32 [rows * bits / 32, cols], each word
    holding 32 / bits consecutive rows, the first in the lowest bits."""
    per = 32 // bits
    rows, cols = q.shape
    out = torch.zeros(rows // per, cols, dtype=torch.int64)
    for r in range(rows):
        out[r // per] |= q[r].long() << (bits * (r % per))
    return (out - (out >= 2**31).long() * 2**32).to(torch.int32)


def _gptq_checkpoint(folder, model, **declared):
    """`model`'s block linears as AutoGPTQ stores them (random 4-bit levels, groups of 32, asymmetric), the other
    parameters as they are; returns the dequantized weights it holds."""
    from safetensors.torch import save_file
    cfg = model.config.to_dict() | {"quantization_config": {"quant_method": "gptq", "bits": 4, "group_size": 32,
                                                             "sym": False, "desc_act": False, **declared}}
    g = torch.Generator().manual_seed(1)
    tensors, expect = {}, {}
    for name, p in model.named_parameters():
        if name.startswith("model.layers") and p.dim() == 2:
            prefix = name[:-len(".weight")]
            out_f, in_f = p.shape
            q = torch.randint(0, 16, (out_f, in_f), generator=g)
            scale = torch.rand(out_f, in_f // 32, generator=g) * 0.01 + 0.001
            zero = torch.randint(1, 15, (out_f, in_f // 32), generator=g)
            expect[prefix] = (q - zero.repeat_interleave(32, 1)) * scale.repeat_interleave(32, 1)
            tensors[f"{prefix}.qweight"] = _gptq_pack_rows(q.t(), 4)                     # [in / 8, out]
            tensors[f"{prefix}.qzeros"] = _gptq_pack_rows(zero - 1, 4).t().contiguous()    # [G, out / 8], z - 1
            tensors[f"{prefix}.scales"] = scale.t().contiguous().half()                 # [G, out]
            tensors[f"{prefix}.g_idx"] = torch.arange(in_f, dtype=torch.int32) // 32
        else:
            tensors[name] = p.detach().clone()
    folder.mkdir()
    save_file(tensors, str(folder / "model.safetensors"))
    (folder / "config.json").write_text(json.dumps(cfg, default=str))
    return expect


def test_the_gptq_layout_is_read_as_autogptq_writes_it(tmp_path):
    expect = _gptq_checkpoint(tmp_path / "g", tiny_model("llama", hidden=64, layers=1))
    info = describe(tmp_path / "g")
    assert (info["format"], info["scheme"], info["method"]) == ("gptq", "w4a16-g32", "external:gptq-w4g32")
    fresh = tiny_model("llama", hidden=64, layers=1)
    apply_checkpoint(fresh, tmp_path / "g")
    for name, m in fresh.named_modules():
        if hasattr(m, "dequantized_weight"):
            # the scales went through fp16, as in the file
            torch.testing.assert_close(m.dequantized_weight().float(), expect[name].float(), rtol=2e-3, atol=1e-4)


def _retyped(folder, suffix, change):
    from safetensors.torch import load_file, save_file
    t = load_file(str(folder / "model.safetensors"))
    k = next(k for k in t if k.endswith(suffix))
    save_file(t | {k: change(t[k])}, str(folder / "model.safetensors"))


@pytest.mark.parametrize("declared,damage,match", [
    ({"dynamic": {"-:.*down_proj": {}}}, None, "quantization_config dynamic is"),
    ({"checkpoint_format": "marlin"}, None, "checkpoint_format is 'marlin'"),
    ({"lm_head": True}, None, "lm_head is True"),
    ({}, ("o_proj.scales", lambda s: -s), "zero or negative"),
    ({}, ("q_proj.qweight", lambda q: q.float()), "qweight is torch.float32"),
    ({}, ("q_proj.qzeros", lambda z: z.to(torch.int64)), "qzeros is torch.int64"),
    ({}, ("q_proj.scales", lambda s: s.to(torch.int32)), "scales is torch.int32"),
])
def test_a_gptq_checkpoint_declaring_what_the_suite_does_not_do_or_damaged_is_refused(declared, damage, match,
                                                                                     tmp_path):
    """Refused before any work, naming the field or tensor: GPTQModel's per-module `dynamic` overrides, a
    kernel-specific checkpoint_format, a quantized head; scales that are not positive, integers stored as floats
    (they were read as other numbers, or scored as another scheme)."""
    from lrq.errors import UserError
    _gptq_checkpoint(tmp_path / "g", tiny_model("llama", hidden=64, layers=1), **declared)
    if damage:
        _retyped(tmp_path / "g", *damage)
    with pytest.raises(UserError, match=match):
        apply_checkpoint(tiny_model("llama", hidden=64, layers=1), tmp_path / "g", check_only=True)
