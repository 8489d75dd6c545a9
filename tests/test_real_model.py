"""Integration on the real default model (SmolLM2-135M from its GGUF): RTN on a WikiText-2 slice.

The first run converts the GGUF once (about 20 s) and caches safetensors; later runs load in < 1 s.
"""

import math

import pytest

from bench.run.cell import FP, CalibSettings, EvalSettings, Request, execute, settle

pytestmark = pytest.mark.slow

SLICE = EvalSettings(seq_len=2048, max_tokens=4 * 2048)


def _ppl(method, scheme, data_dir):
    cell = settle(Request(model="smollm2-135m", method=method, scheme=scheme, datasets=("wikitext2",),
                          calib=CalibSettings(n_samples=16, seq_len=512), eval=SLICE, data_dir=str(data_dir)))
    units = execute(cell, {"quant", "wikitext2"})
    row = next(r for r in units["wikitext2"] if r.metric == "ppl")
    assert row.config["eval"]["windows"] == 4 and row.config["eval"]["tokens"] == 4 * 2048
    return row.value, units


@pytest.fixture(autouse=True)
def _threads():
    import os
    import torch
    before = torch.get_num_threads()
    torch.set_num_threads(max(1, min(4, os.cpu_count() or 1)))
    yield
    torch.set_num_threads(before)


@pytest.mark.heavy
def test_rtn_on_the_default_model(data_dir):
    fp, _ = _ppl(FP, FP, data_dir)
    assert math.isfinite(fp) and 12 < fp < 40, fp  # about 22 on the whole test set
    g128, units = _ppl("rtn", "w4a16-g128", data_dir)
    bpw = next(r.value for r in units["quant"] if r.metric == "bits_per_weight")
    assert 4.1 < bpw < 4.3
    w8a8, units = _ppl("rtn", "w8a8", data_dir)
    assert units["quant"][0].config["calibration"]["n_samples"] == 16
    for q in (g128, w8a8):
        assert fp < q < 3 * fp, (fp, q)  # worse than FP, not collapsed
