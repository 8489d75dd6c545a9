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
    assert res["learnables"]["lrq"] < res["learnables"]["flexround"]
    assert res["config"]["block"] == 1 and res["config"]["threads"] == 1
    md = (tmp_path / "block_step-b1x16-bf16-t1.md").read_text()
    assert "| lrq |" in md and "LRQ / FlexRound step time:" in md


def test_block_step_rejects_a_missing_block(tiny_model_dir, tmp_path):
    from lrq.errors import UserError
    with pytest.raises(UserError, match="blocks 0..1"):
        main(["--model", str(tiny_model_dir), "--block", "5", "--out", str(tmp_path)])
