"""The Python API (lrq.quantize / pack / save / load): what a user scripting LRQ calls, and what the
harness itself calls for every cell."""

import pytest
import torch

import lrq
from conftest import tiny_model
from lrq.errors import UserError


def _ids(n=6, seq=32, vocab=128, seed=0):
    return torch.randint(0, vocab, (n, seq), generator=torch.Generator().manual_seed(seed))


def test_quantize_pack_save_load_round_trip(tmp_path):
    model = tiny_model("llama")
    x = _ids(2, 16)
    with torch.no_grad():
        fp = model(x).logits
    out, stats = lrq.quantize(model, "lrq", "w4a8", calibration=_ids(), iters=3, heldout_samples=2)
    assert out is model and stats["n_learnable"] > 0 and len(stats["block_errors"]) == 2
    with torch.no_grad():
        q = model(x).logits
    assert not torch.equal(q, fp) and (q - fp).abs().max() < fp.abs().max()
    sizes = lrq.pack(model)
    assert sizes["linear_bytes_packed"] < sizes["linear_bytes_bf16"]
    with torch.no_grad():
        packed = model(x).logits
    # the same integers; only the scales are rounded to fp16 for storage
    assert (packed - q).abs().max() < 0.25 * (q - fp).abs().max()
    lrq.save(model, tmp_path / "m", allow_ragged=True)
    back = lrq.load(tmp_path / "m")
    with torch.no_grad():
        torch.testing.assert_close(back(x).logits, model(x).logits)
    # loaded with an int8 output head: close to the model's logits, not equal (a deployment choice that changes them)
    small = lrq.load(tmp_path / "m", head="int8")
    assert type(small.lm_head).__name__ == "PackedLinear" and small.lm_head.bits == 8
    with torch.no_grad():
        ref, got = model(x).logits, small(x).logits
    assert not torch.equal(got, ref) and (got - ref).norm() < 0.02 * ref.norm()


def test_the_api_and_a_configured_method_give_the_same_weights():
    from lrq.methods import get_method
    a, b = tiny_model("llama"), tiny_model("llama")
    lrq.quantize(a, "gptq", "w3a16", calibration=_ids())
    lrq.quantize(b, get_method("gptq"), "w3a16", calibration=_ids().tolist())
    sa, sb = a.state_dict(), b.state_dict()
    assert sa.keys() == sb.keys()
    assert all(torch.equal(sa[k], sb[k]) if torch.is_tensor(sa[k]) else sa[k] == sb[k] for k in sa)


@pytest.mark.parametrize("call, message", [
    (lambda m: lrq.quantize(m, "lrq", "w4a16", calibration=_ids(), iter=10), "did you mean 'iters'"),
    (lambda m: lrq.quantize(m, "gptq", "w4a16"), "gptq under w4a16 needs calibration data"),
    (lambda m: lrq.quantize(m, "rtn", "w8a8"), "rtn under w8a8 needs calibration data"),
    (lambda m: lrq.quantize(m, "nope", "w4a16"), "unknown method 'nope'"),
    (lambda m: lrq.quantize(m, "rtn", "w9a9"), "unknown scheme"),
    (lambda m: lrq.quantize(m, "gptq", "w4a16", calibration=torch.zeros(4)), "shape [n_samples, seq_len]"),
])
def test_bad_calls_are_clear(call, message):
    with pytest.raises(UserError, match=message.replace("[", r"\[").replace("]", r"\]")):
        call(tiny_model("llama"))


def test_listing():
    assert {"lrq", "flexround", "gptq", "awq", "rtn", "smoothquant", "omniquant"} <= set(lrq.list_methods())
    assert "w4a8" in lrq.list_schemes()


@pytest.mark.heavy
@pytest.mark.slow
def test_the_readme_example_runs_as_written(tmp_path, data_dir):
    """The documented Python API block (docs/api.md), extracted and run in a fresh folder (the real default model)."""
    import os
    import re
    import subprocess
    import sys

    from conftest import ROOT
    readme = (ROOT / "docs" / "api.md").read_text()
    block = re.search(r"<!-- api-example -->\s*```python\n(.*?)```", readme, re.S).group(1)
    (tmp_path / "example.py").write_text(block)
    env = dict(os.environ, LRQ_BENCH_DATA=str(data_dir), PYTHONPATH=str(ROOT), TQDM_DISABLE="1")
    proc = subprocess.run([sys.executable, "example.py"], cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = proc.stdout.splitlines()
    assert lines[0].startswith("learnable parameters: ") and int(lines[0].split(": ")[1]) > 0
    assert "'linear_bytes_packed'" in lines[1]
    assert lines[2] == "same logits after reload: True"
    assert (tmp_path / "smollm2-lrq-w4a8" / "model.safetensors").is_file()
