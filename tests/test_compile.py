"""torch.compile of the block-reconstruction step (`compile` setting, lrq.engine.compiled_step): how it is
decided, what happens without a compiler, that it stays out of the store key, and that the compiled step
trains to the eager step's result."""

from __future__ import annotations

import contextlib

import pytest
import torch
from torch import nn

from conftest import tiny_model
from lrq.engine import COMPILE_MIN_ITERS, compile_unavailable, compiled_step
from lrq.errors import UserError
from lrq.methods import Calibration, get_method
from lrq.qlinear import QuantLinear
from lrq.schemes import get_scheme


def test_compile_setting_resolves():
    scheme = get_scheme("w4a16")
    for name in ("lrq", "flexround", "omniquant"):
        M = get_method(name)
        assert M.resolve(scheme, M.config("quick", {}))["compile"] is False   # 100 steps: not worth compiling
        assert M.resolve(scheme, M.config("paper", {}))["compile"] is (compile_unavailable() is None)
        assert M.resolve(scheme, M.config("quick", {"iters": COMPILE_MIN_ITERS}))["compile"] is (
            compile_unavailable() is None)
        assert M.resolve(scheme, M.config("quick", {"compile": "on"}))["compile"] is True
        assert M.resolve(scheme, M.config("paper", {"compile": "off"}))["compile"] is False
    with pytest.raises(UserError, match="compile takes on, off or auto"):
        M.resolve(scheme, M.config("quick", {"compile": "sometimes"}))


def test_without_a_compiler_auto_runs_eagerly_and_on_is_refused(monkeypatch):
    monkeypatch.setenv("PATH", "/nonexistent")
    monkeypatch.delenv("CXX", raising=False)
    assert "C++ compiler" in compile_unavailable("cpu")
    M = get_method("lrq")
    assert M.resolve(get_scheme("w4a16"), M.config("paper", {}))["compile"] is False
    lin = nn.Linear(4, 4)
    assert compiled_step(lin, False, torch.device("cpu")) is lin
    with pytest.raises(UserError, match="no C.. compiler on PATH.*--set compile=off"):
        compiled_step(lin, True, torch.device("cpu"))


def test_compile_is_recorded_but_not_part_of_the_store_key(tiny_model_dir, data_dir):
    from bench.run.cell import CalibSettings, Request, settle

    def cell(**over):
        return settle(Request(model=str(tiny_model_dir), method="lrq", scheme="w4a16", datasets=("wikitext2",),
                              calib=CalibSettings(n_samples=6, seq_len=32), data_dir=str(data_dir),
                              overrides={"heldout_samples": 2} | over))

    on, off, other = cell(compile="on"), cell(compile="off"), cell(iters=7)
    assert on.keys == off.keys == cell().keys          # resumes and reuses results made either way
    assert on.resolved["compile"] is True and off.resolved["compile"] is False
    assert other.keys["quant"] != off.keys["quant"]    # a setting that changes the math does change the key


def _calib(n=6, seq=24):
    return Calibration(torch.randint(0, 128, (n, seq), generator=torch.Generator().manual_seed(5)), {"seed": 0})


@pytest.mark.skipif(compile_unavailable() is not None, reason="no C++ compiler for torch.compile")
def test_compiled_training_matches_eager_training():
    """Same model, data and seed, fp32 (the paper preset's setting): the compiled step computes the same
    math, so up to floating-point reassociation the trained integers, scales and errors are the eager ones."""
    cfg = {"iters": 6, "lr": 5e-3, "heldout_samples": 2, "autocast": False, "rank_fraction": 0.5}
    M = get_method("lrq")
    models, stats = {}, {}
    for mode in ("off", "on"):
        models[mode] = tiny_model("llama", hidden=64)
        stats[mode] = M.quantize(models[mode], get_scheme("w3a16"), M.config("quick", cfg | {"compile": mode}),
                                 _calib())
    assert stats["off"]["compiled_blocks"] == 0 and stats["on"]["resolved_config"]["compile"] is True
    from torch._inductor.cpu_vec_isa import pick_vec_isa
    if stats["on"]["compile_refused"]:
        # refused only where inductor generates AVX2 code (a Zen 3, the AVX2 emulation: NaN in torch 2.13);
        # then every block trained eagerly, and the result is exactly the eager one
        assert pick_vec_isa().bit_width() < 512, stats["on"]["compile_refused"]
        assert stats["on"]["compiled_blocks"] == 0 and "compiled training step is wrong" in stats["on"]["compile_refused"]
    else:
        assert stats["on"]["compiled_blocks"] == 2
    qs = {mode: [m for m in models[mode].modules() if isinstance(m, QuantLinear)] for mode in models}
    assert len(qs["on"]) == len(qs["off"]) == 14
    n_same = n_all = 0
    for a, b in zip(qs["off"], qs["on"]):
        n_same += int((a.qweight == b.qweight).sum())
        n_all += a.qweight.numel()
        torch.testing.assert_close(b.scale, a.scale, rtol=1e-4, atol=0)
    assert n_same / n_all > 0.999, f"{n_all - n_same} of {n_all} integers differ"
    for k in ("mean_block_calib_after", "mean_block_heldout_after"):
        assert stats["on"][k] == pytest.approx(stats["off"][k], rel=1e-3)
    # and training did move the learnables (the comparison is not between two untouched RTN models)
    assert stats["off"]["mean_block_calib_after"] < stats["off"]["mean_block_calib_before"]


def test_a_wrong_compiled_step_is_refused_and_training_continues_eagerly(monkeypatch):
    """A compiled step that disagrees with the eager one (as torch.compile's AVX2 code did: NaN) never
    trains: the check on the first batch refuses it, this and every later block train eagerly, the stats
    say why, and the result is bit for bit the compile=off one."""
    import lrq.engine as E

    class Wrong(torch.nn.Module):          # a "compiled" block: the right math, then a corruption
        def __init__(self, block, how):
            super().__init__()
            self.block, self.how = block, how

        def forward(self, *a, **k):
            y = self.block(*a, **k)
            y0 = y[0] if isinstance(y, tuple) else y
            return y0 * float("nan") if self.how == "nan" else y0 * 1.5

    cfg = {"iters": 3, "lr": 5e-3, "heldout_samples": 2, "autocast": False, "rank_fraction": 0.5}
    M = get_method("lrq")
    off = tiny_model("llama", hidden=64)
    s_off = M.quantize(off, get_scheme("w3a16"), M.config("quick", cfg | {"compile": "off"}), _calib())
    for how in ("nan", "scaled"):
        built = []
        monkeypatch.setattr(E, "compiled_step", lambda b, on, dev: built.append(on) or (Wrong(b, how) if on else b))
        m = tiny_model("llama", hidden=64)
        st = M.quantize(m, get_scheme("w3a16"), M.config("quick", cfg | {"compile": "on"}), _calib())
        assert built == [True, False]                      # block 1 was not compiled again
        assert st["compiled_blocks"] == 0 and st["compile_refused"].startswith("block 0: the compiled training")
        assert ("loss is nan" if how == "nan" else "differs from the eager step") in st["compile_refused"]
        for a, b in zip([x for x in off.modules() if isinstance(x, QuantLinear)],
                        [x for x in m.modules() if isinstance(x, QuantLinear)]):
            assert torch.equal(a.qweight, b.qweight) and torch.equal(a.scale, b.scale)
        assert st["mean_block_calib_after"] == s_off["mean_block_calib_after"]
    # an honest compiled step passes the check
    block = tiny_model("llama", hidden=64)
    from lrq.arch import decoder_blocks
    blk = decoder_blocks(block)[0]
    x = torch.randn(2, 8, 64)
    ids = torch.arange(8).unsqueeze(0)
    rot = block.model.rotary_emb(x, ids)
    params = [p for p in blk.parameters() if p.dim() == 2][:2]
    for p in params:
        p.requires_grad_(True)
    kw = {"position_embeddings": rot, "position_ids": ids}
    assert E.check_compiled_step(blk, blk, params, x, torch.randn(2, 8, 64), kw, contextlib.nullcontext()) is None
    assert all(p.grad is None for p in params)
    assert "loss is nan" in E.check_compiled_step(Wrong(blk, "nan"), blk, params, x, torch.randn(2, 8, 64), kw,
                                                 contextlib.nullcontext())
