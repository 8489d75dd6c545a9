"""CI reruns the small deterministic sweep on the real default model and compares it with the committed
reference results under the gate's tolerances (bench/ci_sweep.py, reports/reference/ci_sweep.json)."""

import json

from bench import ci_sweep


def test_sweep_matches_the_committed_reference(tmp_path, data_dir, capsys):
    ref = json.loads(ci_sweep.REFERENCE.read_text())
    methods = {(r["method"], r["scheme"]) for r in ref}
    assert {("fp", "fp"), ("rtn", "w3a16"), ("rtn", "w8a8"), ("gptq", "w4a16-g128"), ("lrq", "w3a16")} <= methods
    results = tmp_path / "ci.sqlite"
    code = ci_sweep.main(["--results", str(results), "--data-dir", str(data_dir)])
    out = capsys.readouterr().out
    assert code == 0 and "no regression" in out, out   # main ran the gate against the reference
