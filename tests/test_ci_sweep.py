"""CI reruns the small deterministic sweep on the real default model and compares it with the committed
reference results under the gate's tolerances (bench/studies/ci_sweep.py, reports/reference/ci_sweep*.json: one per
CPU model, since bf16 numerics differ between CPUs)."""

import json

from bench.studies import ci_sweep
from bench.provenance import hardware


def test_sweep_matches_the_committed_reference(tmp_path, data_dir, capsys):
    ref_path, matched = ci_sweep.reference_for()
    ref = json.loads(ref_path.read_text())
    methods = {(r["method"], r["scheme"]) for r in ref}
    assert {("fp", "fp"), ("rtn", "w3a16"), ("rtn", "w8a8"), ("gptq", "w4a16-g128"), ("lrq", "w3a16")} <= methods
    results = tmp_path / "ci.sqlite"
    code = ci_sweep.main(["--results", str(results), "--data-dir", str(data_dir)])
    out = capsys.readouterr().out
    assert f"reference: {ref_path.name}" in out
    assert code == 0 and "no regression" in out, out   # main ran the gate against the reference


def test_each_cpu_model_has_its_own_reference(tmp_path, monkeypatch):
    def write(name, cpu):
        (tmp_path / name).write_text(json.dumps([{"method": "fp", "hardware": {"cpu": cpu}}]))
    write("ci_sweep.json", "AMD EPYC")
    write("ci_sweep-intel-xeon.json", "Intel Xeon")
    monkeypatch.setattr(ci_sweep, "REFERENCE", tmp_path / "ci_sweep.json")
    assert ci_sweep.reference_for("Intel Xeon") == (tmp_path / "ci_sweep-intel-xeon.json", True)
    assert ci_sweep.reference_for("AMD EPYC") == (tmp_path / "ci_sweep.json", True)
    assert ci_sweep.reference_for("Some ARM") == (tmp_path / "ci_sweep.json", False)
    assert ci_sweep.reference_path_for_writing("Some ARM (R) v9") == tmp_path / "ci_sweep-some-arm-r-v9.json"
    assert ci_sweep.reference_path_for_writing("Intel Xeon") == tmp_path / "ci_sweep-intel-xeon.json"


def test_the_committed_references_name_their_cpu():
    for path in sorted(ci_sweep.REFERENCE.parent.glob("ci_sweep*.json")):
        assert ci_sweep._cpu_of(path), f"{path.name} mixes CPUs or names none"
    assert ci_sweep.reference_for(str(hardware()["cpu"]))[0].is_file()
