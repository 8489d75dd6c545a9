"""The GPU check script runs end to end on the CPU under the Triton interpreter (tiny shapes)."""

import json

from bench import gpu_check


def test_gpu_check_smoke(tmp_path):
    out = tmp_path / "g.json"
    assert gpu_check.main(["--smoke", "--out", str(out)]) == 0
    doc = json.loads(out.read_text())
    assert doc["correctness"] and all(c["ok"] for c in doc["correctness"])
    assert {c["kernel"] for c in doc["correctness"]} == {"wq_gemm", "int8_gemm"}
    assert {r["scheme"] for r in doc["latency"]} >= {"w4a16", "w8a8", "w4a8"}
    assert doc["versions"]["torch"] and "never_below_1x" in doc
    # the offloaded block walk: on the CPU the "device" is the CPU itself, so the two runs must agree exactly
    for method in ("lrq", "gptq"):
        o = doc["offload"][method]
        assert o["ok"] and o["all_on_cpu_after"] and o["max_rel_logit_diff"] == 0.0
