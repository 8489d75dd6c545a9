"""The GPU check script runs end to end on the CPU under the Triton interpreter (tiny shapes), writes its
JSON stage by stage, and plans only compilations the offline AOT check covers."""

import json

import pytest

from bench.studies import gpu_check


def test_gpu_check_smoke(tmp_path):
    out = tmp_path / "g.json"
    assert gpu_check.main(["--smoke", "--out", str(out)]) == 0
    doc = json.loads(out.read_text())
    assert list(doc["stages"]) == ["correctness", "targets", "latency", "plan_profile", "offload"]
    assert doc["correctness"] and all(c["ok"] for c in doc["correctness"])
    assert {c["kernel"] for c in doc["correctness"]} == {"wq_gemm", "wq_dequant", "int8_gemm", "act_quant"}
    assert all(c["bit_exact"] for c in doc["correctness"] if c["kernel"] == "act_quant")
    assert {r["scheme"] for r in doc["latency"]} >= {"w4a16", "w8a8", "w4a8", "w3a16"}
    for r in doc["latency"]:
        assert r["bytes"] > 0 and 0 < r["bandwidth_fraction"] and r["speedup_vs_bf16"] > 0
    assert doc["targets"] == [], "CPU timings must not be judged against the GPU targets"
    assert doc["versions"]["torch"] and "never_below_1x" in doc
    # the offloaded block walk: on the CPU the "device" is the CPU itself, so the two runs must agree exactly
    for method in ("lrq", "gptq"):
        o = doc["offload"][method]
        assert o["ok"] and o["all_on_cpu_after"] and o["max_rel_logit_diff"] == 0.0
        assert o["int_weights_differing"] == 0.0 and o["err_gap"] == 0.0 and o["rel_logit_err_cpu"] > 0


def test_only_reruns_the_stages_named(tmp_path):
    """A cut GPU run is finished by rerunning only what it missed: the other stages leave no trace."""
    out = tmp_path / "g.json"
    assert gpu_check.main(["--smoke", "--only", "offload", "--out", str(out)]) == 0
    doc = json.loads(out.read_text())
    assert list(doc["stages"]) == ["offload"] and doc["only"] == ["offload"]
    assert "correctness" not in doc and "latency" not in doc and doc["offload"]["lrq"]["ok"]
    with pytest.raises(SystemExit):
        gpu_check.main(["--smoke", "--only", "correctness,latencies", "--out", str(out)])


def test_budget_cuts_the_table_but_keeps_the_json(tmp_path, monkeypatch):
    """A run past its budget stops the latency table and says so; what was measured is in the file."""
    out = tmp_path / "g.json"
    assert gpu_check.main(["--smoke", "--out", str(out), "--budget-s", "0"]) == 0
    doc = json.loads(out.read_text())
    assert doc["stages"]["latency"]["complete"] is False and doc["latency"] == []
    assert doc["correctness"] and doc["stages"]["correctness"]["ok"]


def test_targets_are_judged_on_the_worst_row():
    rows = [{"scheme": "w4a16", "shape": "4096x11008", "M": m, "speedup_vs_bf16": s}
            for m, s in ((1, 3.5), (4, 3.2), (16, 2.9), (64, 1.0))]
    (t,) = [t for t in gpu_check.judge_targets(rows) if t["scheme"] == "w4a16"]
    assert t["worst"] == 2.9 and t["worst_at"] == "4096x11008 M=16" and not t["met"]


def test_planned_compilations_are_covered_by_the_offline_check():
    """Every kernel compilation the GPU check will do is one whose configuration the AOT test compiles for
    sm_90/sm_80 (bias and alignment aside); a tuned bucket compiles two configurations, an untuned one."""
    from lrq.kernels import aot
    planned = gpu_check.planned_compilations()
    checked = {(v.kernel, v.config) for v in aot.variants()}
    assert planned and all((v.kernel, v.config) in checked for v in planned)
    assert {v.kernel for v in planned} == {"wq_gemm", "wq_dequant", "int8_gemm", "act_quant"}
    assert len(gpu_check.planned_compilations(tune=False)) < len(planned)
    assert any(not v.aligned for v in planned), "the odd-shape correctness cases compile unaligned variants"
    with pytest.raises(SystemExit):
        gpu_check.main(["--no-such-flag"])
