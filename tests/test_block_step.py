"""bench/studies/block_step.py on a tiny model: both methods step, the table and the JSON say what ran."""

import json

import pytest
import torch

from bench.studies.block_step import main


@pytest.fixture(autouse=True)
def _keep_threads():
    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)


def test_block_step_study_on_a_tiny_model(tiny_model_dir, tmp_path):
    assert main(["--model", str(tiny_model_dir), "--block", "1", "--seq", "16", "--steps", "2", "--warmup", "1",
                 "--out", str(tmp_path), "--profile", "5"]) == 0
    res = json.loads((tmp_path / "block_step-b1x16-bf16-t1.json").read_text())
    for m in ("flexround", "lrq"):
        assert len(res["times_s"][m]["step"]) == 2 and res["median_s"][m]["step"] > 0
        assert res["median_s"][m]["step"] >= res["median_s"][m]["forward"]
        assert "aten::" in res["profile"][m]
    assert res["learnables"]["lrq"] < res["learnables"]["plain"] < res["learnables"]["flexround"]
    assert res["config"]["block"] == 1 and res["config"]["threads"] == 1
    md = (tmp_path / "block_step-b1x16-bf16-t1.md").read_text()
    assert "| plain | eager |" in md and "| lrq | eager |" in md and "LRQ / FlexRound step time:" in md


@pytest.mark.heavy
def test_block_step_study_times_the_compiled_step_beside_the_eager_one(tiny_model_dir, tmp_path):
    from lrq.engine import compile_unavailable
    if compile_unavailable() is not None:
        pytest.skip(compile_unavailable())
    assert main(["--model", str(tiny_model_dir), "--seq", "16", "--steps", "2", "--warmup", "0", "--fp32",
                 "--compile", "--out", str(tmp_path)]) == 0
    res = json.loads((tmp_path / "block_step-b1x16-fp32-t1-compile.json").read_text())
    variants = ("plain", "flexround", "lrq", "plain+compile", "flexround+compile", "lrq+compile")
    assert set(res["median_s"]) == set(variants) and res["config"]["compile"] is True
    for v in variants:
        assert len(res["times_s"][v]["step"]) == 2 and res["median_s"][v]["step"] > 0
    assert res["learnables"]["lrq+compile"] == res["learnables"]["lrq"]
    assert set(res["compile_s"]) == {"plain+compile", "flexround+compile", "lrq+compile"}
    assert min(res["compile_s"].values()) > 0
    for m in ("plain", "flexround", "lrq"):
        assert res["eager_over_compiled"][m] == pytest.approx(res["median_s"][m]["step"]
                                                              / res["median_s"][m + "+compile"]["step"])
    md = (tmp_path / "block_step-b1x16-fp32-t1-compile.md").read_text()
    assert "| lrq | torch.compile |" in md and "| flexround | eager |" in md and "Eager / compiled step time" in md


def test_block_step_rejects_a_missing_block(tiny_model_dir, tmp_path):
    from lrq.errors import UserError
    with pytest.raises(UserError, match="blocks 0..1"):
        main(["--model", str(tiny_model_dir), "--block", "5", "--out", str(tmp_path)])
