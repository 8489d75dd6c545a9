"""The GPU session's paper-regime stage, dry-run on the CPU (issue P): the parcels join back into the checked
file, the stage trains every block of a tiny model with both methods within its budget, writes its results as
it goes, stops at the budget, and a later run continues without redoing finished blocks."""

from __future__ import annotations

import json

import pytest
import torch

from bench.studies import gpu_stage


def _calib_file(path, n=12, seq=32):
    from safetensors.torch import save_file
    ids = torch.randint(0, 300, (n, seq), generator=torch.Generator().manual_seed(0)).to(torch.int32)
    save_file({"input_ids": ids}, str(path), metadata={"description": json.dumps({"dataset": "random"})})
    return path


def test_the_parcels_join_into_the_checked_file(tmp_path):
    carry = tmp_path / "gpu_carry"
    data = bytes(range(256)) * 1000
    (carry / "part-a").mkdir(parents=True)
    (carry / "part-b").mkdir()
    (carry / "part-a" / "m.gguf.0").write_bytes(data[:1000])
    with pytest.raises(SystemExit, match="parcel file"):
        (carry / "part-b" / "manifest.json").write_text(json.dumps({"gguf": "m.gguf", "sha256": "0" * 64}))
        gpu_stage.assemble(carry)
    (carry / "part-b" / "m.gguf.1").write_bytes(data[1000:])
    import hashlib
    (carry / "part-b" / "manifest.json").write_text(json.dumps({"gguf": "m.gguf",
                                                                "sha256": hashlib.sha256(data).hexdigest()}))
    gguf, calib = gpu_stage.assemble(carry)
    assert gguf.read_bytes() == data and calib == carry / "part-b" / "calibration.safetensors"


def test_the_stage_trains_every_block_within_its_budget_and_continues(tiny_model_dir, tmp_path):
    calib = _calib_file(tmp_path / "calib.safetensors")
    extra = ["--calib-samples", "8", "--heldout", "4", "--error-samples", "2", "--seq-len", "32", "--batch-size", "2"]
    out = tmp_path / "figure2-gpu"
    # a budget already spent: nothing starts, and the study says where a rerun continues
    res = gpu_stage.stage(str(tiny_model_dir), str(calib), out, 1e-6, "cpu", iters=4, every=2, extra=extra)
    assert res["done"] == []
    res = gpu_stage.stage(str(tiny_model_dir), str(calib), out, 600, "cpu", iters=4, every=2, extra=extra)
    assert res["done"] == ["0/flexround", "0/lrq", "1/flexround", "1/lrq"]      # both blocks, both methods
    doc = json.loads((out / "figure2.json").read_text())
    assert doc["config"]["blocks"] == [0, 1] and doc["config"]["calibration"]["file"] == "calib.safetensors"
    assert all(len(r["curve"]) == 3 for r in doc["results"].values())          # steps 0, 2, 4
    before = (out / "figure2.json").read_text()
    res = gpu_stage.stage(str(tiny_model_dir), str(calib), out, 600, "cpu", iters=4, every=2, extra=extra)
    assert len(res["done"]) == 4
    again = json.loads((out / "figure2.json").read_text())
    assert again["results"] == json.loads(before)["results"]                    # nothing trained twice
