"""CI reruns the small deterministic sweep on the real default model and compares it with the committed
reference results under the gate's tolerances (bench/studies/ci_sweep.py, reports/reference/ci_sweep*.json: one per
CPU model and precision, since bf16 numerics differ between CPUs and a CPU without native bf16 runs fp32)."""

import json

from bench.studies import ci_sweep


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


def test_each_cpu_and_precision_has_its_own_reference(tmp_path, monkeypatch):
    def write(name, cpu, native, precision):
        (tmp_path / name).write_text(json.dumps([{"method": "fp", "hardware": {"cpu": cpu, "native_bf16": native},
                                                  "config": {"precision": {"used": precision}}}]))
    write("ci_sweep.json", "AMD EPYC", True, "bf16")                 # Zen 4
    write("ci_sweep-intel-xeon.json", "Intel Xeon", True, "bf16")
    write("ci_sweep-fp32.json", "AMD EPYC", False, "fp32")           # measured on a CPU without native bf16
    monkeypatch.setattr(ci_sweep, "REFERENCE", tmp_path / "ci_sweep.json")
    zen4 = {"cpu": "AMD EPYC", "native_bf16": True, "precision": "bf16"}
    zen3 = {"cpu": "AMD EPYC", "native_bf16": False, "precision": "fp32"}
    assert ci_sweep.reference_for({"cpu": "Intel Xeon", "native_bf16": True, "precision": "bf16"}) == \
        (tmp_path / "ci_sweep-intel-xeon.json", True)
    assert ci_sweep.reference_for(zen4) == (tmp_path / "ci_sweep.json", True)
    # "AMD EPYC" names Zen 3 too: there the sweep runs in fp32 and meets the fp32 reference, whatever the CPU
    assert ci_sweep.reference_for(zen3) == (tmp_path / "ci_sweep-fp32.json", True)
    assert ci_sweep.reference_for({"cpu": "Intel Xeon", "native_bf16": True, "precision": "fp32"}) == \
        (tmp_path / "ci_sweep-fp32.json", True)
    # a Zen 3 forced to bf16 has no reference of its own: one of the same precision, said to be another CPU's
    assert ci_sweep.reference_for(zen3 | {"precision": "bf16"}) == (tmp_path / "ci_sweep.json", False)
    assert ci_sweep.reference_for({"cpu": "Some ARM", "native_bf16": True, "precision": "bf16"})[1] is False
    assert ci_sweep.reference_path_for_writing({"cpu": "Some ARM (R) v9", "native_bf16": True, "precision": "bf16"}) \
        == tmp_path / "ci_sweep-some-arm-r-v9-bf16.json"
    assert ci_sweep.reference_path_for_writing(zen4) == tmp_path / "ci_sweep.json"


def test_the_committed_references_name_their_cpu_and_precision():
    seen = set()
    for path in sorted(ci_sweep.REFERENCE.parent.glob("ci_sweep*.json")):
        ident = ci_sweep.identity_of(path)
        assert ident and ident["native_bf16"] is not None, f"{path.name} mixes machines or names none"
        seen.add(ident["precision"])
    assert seen == {"bf16", "fp32"}   # an fp32 reference serves every CPU without native bf16
    assert ci_sweep.reference_for()[0].is_file()
