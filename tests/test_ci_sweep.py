"""CI reruns the small deterministic sweep on the real default model and compares it with the committed
reference results under the gate's tolerances (bench/studies/ci_sweep.py, reports/reference/ci_sweep*.json: one per
CPU model and precision, since bf16 numerics differ between CPUs and a CPU without native bf16 runs fp32)."""

import json

import pytest

from bench.studies import ci_sweep


@pytest.mark.heavy
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


def test_each_cpu_capability_and_precision_has_its_own_reference(tmp_path, monkeypatch):
    def write(name, cpu, native, cap, precision):
        (tmp_path / name).write_text(json.dumps([{"method": "fp", "config": {"precision": {"used": precision}},
                                                  "hardware": {"cpu": cpu, "native_bf16": native,
                                                               "torch_cpu_capability": cap}}]))
    write("ci_sweep.json", "AMD EPYC", True, "AVX512", "bf16")                 # Zen 4
    write("ci_sweep-intel-xeon.json", "Intel Xeon", True, "AVX512", "bf16")
    write("ci_sweep-fp32-avx2.json", "Intel Xeon", False, "AVX2", "fp32")      # the no-bf16 emulation
    monkeypatch.setattr(ci_sweep, "REFERENCE", tmp_path / "ci_sweep.json")
    me = lambda cpu, native, cap, prec: dict(cpu=cpu, native_bf16=native, torch_cpu_capability=cap, precision=prec)  # noqa: E731
    assert ci_sweep.reference_for(me("Intel Xeon", True, "AVX512", "bf16")) == (tmp_path / "ci_sweep-intel-xeon.json", True)
    assert ci_sweep.reference_for(me("AMD EPYC", True, "AVX512", "bf16")) == (tmp_path / "ci_sweep.json", True)
    assert ci_sweep.reference_for(me("Intel Xeon", False, "AVX2", "fp32")) == (tmp_path / "ci_sweep-fp32-avx2.json", True)
    # "AMD EPYC" names Zen 3 too: it runs fp32 at AVX2 and gets the fp32 AVX2 reference, said to be another CPU's
    assert ci_sweep.reference_for(me("AMD EPYC", False, "AVX2", "fp32")) == (tmp_path / "ci_sweep-fp32-avx2.json", False)
    # a Zen 3 forced to bf16 has no reference of its own: the same CPU name's bf16 one, not a match
    assert ci_sweep.reference_for(me("AMD EPYC", False, "AVX2", "bf16")) == (tmp_path / "ci_sweep.json", False)
    assert ci_sweep.reference_path_for_writing(me("Some ARM (R) v9", True, "SVE256", "bf16")) \
        == tmp_path / "ci_sweep-some-arm-r-v9-sve256-bf16.json"
    assert ci_sweep.reference_path_for_writing(me("AMD EPYC", True, "AVX512", "bf16")) == tmp_path / "ci_sweep.json"


def test_another_cpus_reference_gates_calibration_dependent_cells_loosely(tmp_path, capsys):
    from bench.common.store import ResultStore, Row

    def rows(fp, w8a8, kld=0.5, top1=0.58):
        cal = {"calibration": {"n_samples": 16}}
        return [Row("smollm2-135m", "fp", "fp", "wikitext2", "ppl", fp, config={}),
                Row("smollm2-135m", "rtn", "w8a8", "wikitext2", "ppl", w8a8, config=cal),
                Row("smollm2-135m", "rtn", "w8a8", "wikitext2", "kld", kld, config=cal),
                Row("smollm2-135m", "rtn", "w8a8", "wikitext2", "top1_agree", top1, config=cal)]
    ref = tmp_path / "ref.json"
    ref.write_text(json.dumps([r.__dict__ for r in rows(24.0, 40.0)]))

    def gate(*values, **kl):
        store = ResultStore(tmp_path / f"{values}-{sorted(kl.items())}.sqlite")
        store.write_unit(rows(*values, **kl), "k")
        return ci_sweep.cross_cpu_gate(ref, str(store.path))
    assert gate(24.0, 44.0) == 0          # another CPU's rounding: 10 % on a calibration-dependent cell passes
    assert gate(24.0, 44.0, kld=0.52, top1=0.57) == 0   # and 4 % of KLD, 1 point of top-1 (fp32, AVX2 vs AVX-512)
    assert gate(24.0, 60.0) == 1          # 50 %: a broken method still fails
    assert gate(24.0, 40.0, kld=0.8) == 1   # on KLD as well
    assert gate(24.0, 40.0, top1=0.50) == 1   # and on top-1 agreement (8 points)
    assert gate(24.5, 40.0) == 1          # calibration-free cells stay strict (2 % > 0.5 %)
    assert "calibration-dependent cells, perplexity and KLD within 25%, top-1 within 3 points" in capsys.readouterr().out


def test_the_committed_references_name_their_machine():
    seen = set()
    for path in sorted(ci_sweep.REFERENCE.parent.glob("ci_sweep*.json")):
        ident = ci_sweep.identity_of(path)
        assert ident and None not in ident.values(), f"{path.name} mixes machines or names none"
        seen.add((ident["precision"], ident["torch_cpu_capability"]))
    assert {("bf16", "AVX512"), ("fp32", "AVX2")} <= seen   # bf16 CPUs, and the CPUs without native bf16
    assert ci_sweep.reference_for()[0].is_file()


def test_write_reference_then_gate_round_trips(tmp_path, monkeypatch, capsys):
    """--write-reference stores the gate-relevant rows of this machine's sweep (here: rows written by a stub
    sweep), and the gate then passes against that file and fails on a worse result."""
    from bench.common.store import ResultStore, Row

    def fake_sweep(results, data_dir, precision="auto", ppl=30.0):
        rows = [Row(model="smollm2-135m", method="rtn", scheme="w4a16-g128", dataset="wikitext2", metric="ppl",
                    value=ppl, config={"precision": {"used": "fp32"}}),
                Row(model="smollm2-135m", method="rtn", scheme="w4a16-g128", dataset="wikitext2", metric="latency_ms",
                    value=1.0, config={"precision": {"used": "fp32"}})]
        ResultStore(results).write_unit(rows, key=f"k{ppl}")
        return 0

    monkeypatch.setattr(ci_sweep, "run_sweep", fake_sweep)
    ref = tmp_path / "ref.json"
    assert ci_sweep.main(["--results", str(tmp_path / "a.sqlite"), "--write-reference", "--reference", str(ref)]) == 0
    stored = json.loads(ref.read_text())
    assert [(r["metric"], r["value"]) for r in stored] == [("ppl", 30.0)]     # untracked metrics left out
    capsys.readouterr()
    assert ci_sweep.main(["--results", str(tmp_path / "b.sqlite"), "--reference", str(ref)]) == 0
    assert "no regression" in capsys.readouterr().out
    monkeypatch.setattr(ci_sweep, "run_sweep", lambda r, d, p="auto": fake_sweep(r, d, p, ppl=36.0))
    assert ci_sweep.main(["--results", str(tmp_path / "c.sqlite"), "--reference", str(ref)]) == 1
    assert "**REGRESSION**" in capsys.readouterr().out
