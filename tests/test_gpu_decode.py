"""Issue X's GPU driver (bench/studies/gpu_decode.py) on the CPU under the interpreter, tiny shapes: the files it
writes, targets.json's exact shape, resuming a cut run, argument checks, and the target judging on GPU-like rows."""

import json

import pytest

from bench.studies import gpu_decode as GD


def test_smoke_writes_json_markdown_and_targets(tmp_path):
    assert GD.main(["--smoke", "--out-dir", str(tmp_path), "--only", "correctness,copy_bw,decode"]) == 0
    doc = json.loads((tmp_path / "decode.json").read_text())
    assert list(doc["stages"]) == ["correctness", "copy_bw", "decode"] and all(
        v["complete"] for v in doc["stages"].values())
    assert doc["correctness"] and all(r["ok"] for r in doc["correctness"])
    assert {r["scheme"] for r in doc["correctness"]} == set(GD.SCHEMES)
    assert all(r["chosen"] == "gemv" and r["chosen_by"] == "static" for r in doc["decode"])
    assert doc["machine"]["git_rev"] and doc["machine"]["torch"]
    # one dispatch record per distinct key (the smoke plan's last row repeats a shape of its table)
    keys = [(r["scheme"], r["m"], r["n"], r["k"]) for r in doc["decode"]]
    assert [(c["scheme"], c["m"], c["n"], c["k"]) for c in doc["dispatch"]] == list(dict.fromkeys(keys))
    assert len(keys) == len(set(keys)) + 1
    t = json.loads((tmp_path / "targets.json").read_text())
    assert list(t) == ["targets"] and [e["name"] for e in t["targets"]] == list(GD.GOALS)
    assert all(list(e) == ["name", "measured", "goal", "met"] for e in t["targets"])
    assert all(e["measured"] is None and e["met"] is False for e in t["targets"]), "CPU timings judge nothing"
    assert "| target | measured | goal | met |" in (tmp_path / "decode.md").read_text()


def test_resume_keeps_finished_stages_and_rows(tmp_path):
    cut = {"stages": {"correctness": {"complete": True, "s": 1.0}, "decode": {"complete": False, "s": 9.0}},
           "correctness": [{"scheme": "marker", "ok": True}],
           "decode": [{"scheme": "w4a16", "m": 1, "n": 48, "k": 160, "bf16_ms": 123.0, "chosen": "gemv",
                       "chosen_by": "static", "chosen_ms": 1.0}]}
    (tmp_path / "decode.json").write_text(json.dumps(cut))
    assert GD.main(["--smoke", "--resume", "--out-dir", str(tmp_path), "--only", "correctness,decode"]) == 0
    doc = json.loads((tmp_path / "decode.json").read_text())
    assert doc["correctness"] == [{"scheme": "marker", "ok": True}]          # not rerun
    kept = [r for r in doc["decode"] if r["bf16_ms"] == 123.0]
    assert len(kept) == 1 and doc["stages"]["decode"]["complete"]
    assert len(doc["decode"]) == len(GD.SCHEMES) * 2 + 1                    # the others measured now


def test_arguments_are_checked(tmp_path):
    with pytest.raises(SystemExit):
        GD.main(["--smoke", "--out-dir", str(tmp_path), "--only", "decode,latency"])
    with pytest.raises(SystemExit):
        GD.main(["--out-dir", str(tmp_path)])                               # no GPU and no --smoke
    with pytest.raises(SystemExit):
        GD.main(["--smoke", "--out-dir", str(tmp_path), "--budget-s", "0"])
    GD.main(["--smoke", "--out-dir", str(tmp_path), "--budget-s", "0.001", "--only", "decode"])
    assert json.loads((tmp_path / "decode.json").read_text())["stages"]["decode"]["complete"] is False


def test_targets_are_judged_from_gpu_rows():
    dec = [{"scheme": s, "m": m, "n": n, "k": k, "chosen_ms": 1.0, "bandwidth_fraction": 0.8,
            "speedup_vs_bf16": 3.5 if m > 1 else 2.0} for s in ("w4a16", "w4a16-g128") for m in (1, 16)
           for n, k in GD.DECODE_SHAPES]
    dec.append({"scheme": "w4a16-g128", "m": 1, "n": 4096, "k": 4096, "chosen_ms": 1.0, "gemv_ms": 0.01,
                "wq_gemm_ms": 0.05, "torch_int4_ms": 0.011})
    i8 = [{"m": 1, "bf16_ms": 1, "int8_ms": 0.5, "w8a16_gemv_ms": 0.4}, {"m": 512, "bf16_ms": 2.0, "int8_ms": 1.0}]
    e2e = {"bf16": {"prefill_speedup_vs_bf16": 1.0}, "w4a16": {"decode_speedup_vs_bf16": 2.6,
                                                              "prefill_speedup_vs_bf16": 0.9},
           "w8a8": {"decode_speedup_vs_bf16": 1.6, "prefill_speedup_vs_bf16": 1.2}}
    t = {e["name"]: e for e in GD.judge_targets({"on_gpu": True, "decode": dec, "int8": i8, "e2e": e2e})}
    got = {n: (round(e["measured"], 3), e["met"]) for n, e in t.items()}
    assert list(got.values()) == [(0.8, True), (2.0, False), (1.1, True), (2.0, True), (0.8, False), (2.6, True),
                                  (1.6, True), (0.9, False)]


def test_e2e_stage_carries_the_dispatchers_choices_into_json_and_markdown(tmp_path):
    """The end-to-end JSON's per-format `dispatch` records (kernel per layer shape) and the kernels' weight copies
    reach decode.json's e2e stage and a table in decode.md."""
    choice = {"scheme": "w4a16", "m": 1, "n": 4096, "k": 11008, "kernel": "gemv", "source": "measured",
              "times_ms": {"gemv": 0.011, "wq_gemm": 0.02}, "dropped": {}, "skipped": {}, "key": "H200|w4a16|1",
              "calls": 8}
    e2e = {"rows": [{"scheme": "bf16", "dispatch": [], "kernel_copy_bytes": 0},
                    {"scheme": "w4a16", "decode_speedup_vs_bf16": 2.0, "weight_bytes": 100, "kernel_copy_bytes": 90,
                     "dispatch": [choice]}]}
    (tmp_path / "e2e.json").write_text(json.dumps(e2e))
    assert GD.main(["--smoke", "--out-dir", str(tmp_path), "--only", "e2e", "--e2e", str(tmp_path / "e2e.json")]) == 0
    doc = json.loads((tmp_path / "decode.json").read_text())
    assert doc["e2e"]["w4a16"]["dispatch"] == [choice] and doc["e2e"]["w4a16"]["kernel_copy_bytes"] == 90
    md = (tmp_path / "decode.md").read_text()
    assert "| w4a16 | 1 | 4096x11008 | gemv | measured | 8 | gemv 0.0110, wq_gemm 0.0200 |" in md


def test_the_config_stage_checks_times_and_ranks_each_gemv_tile(tmp_path):
    """Stage "configs" (CPU smoke: the first two candidates per M, float32 timings that judge nothing): a row per
    (scheme, M, shape, configuration), each checked against the float reference before it is timed, the default
    marked, exactly one fastest per shape; a resumed run measures nothing twice."""
    assert GD.main(["--smoke", "--out-dir", str(tmp_path), "--only", "configs"]) == 0
    doc = json.loads((tmp_path / "decode.json").read_text())
    rows = doc["configs"]
    assert doc["stages"]["configs"]["complete"] and len(rows) == 2 * 2 * 2   # 2 schemes x M = 1, 16 x 2 candidates
    assert all("error" not in r and r["rel_err"] < 1e-5 and r["ms"] > 0 for r in rows)
    shapes = {(r["scheme"], r["m"], r["n"], r["k"]) for r in rows}
    assert all(sum(r["best"] for r in rows if (r["scheme"], r["m"], r["n"], r["k"]) == s) == 1 for s in shapes)
    assert {r["config"] for r in rows if r["default"]} == {"m1 n128 w1 s2", "m16 n128 w2 s3"}
    assert "GEMV tile configurations" in (tmp_path / "decode.md").read_text()
    assert GD.main(["--smoke", "--resume", "--out-dir", str(tmp_path), "--only", "configs"]) == 0
    again = json.loads((tmp_path / "decode.json").read_text())["configs"]
    assert [(r["config"], r["ms"]) for r in again] == [(r["config"], r["ms"]) for r in rows]
