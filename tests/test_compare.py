"""The regression gate: tolerance logic, the CLI, and a deliberately degraded method failing it."""

import json

import pytest

from bench.cli import main
from bench.reports.compare import compare, gate, load_tolerances
from bench.common.store import Row

TOL = {"ppl": {"direction": "lower", "rel": 0.01}, "acc": {"direction": "higher", "abs": 0.01},
       "bits_per_weight": {"direction": "both", "abs": 1e-9}}


def _k(metric, method="rtn", scheme="w4a16", dataset="wikitext2", precision="bf16"):
    return ("m", method, scheme, precision, dataset, metric, 0)


@pytest.mark.parametrize("base,cur,metric,status", [
    (20.0, 20.1, "ppl", "ok"), (20.0, 20.3, "ppl", "regressed"), (20.0, 19.0, "ppl", "improved"),
    (0.50, 0.495, "acc", "ok"), (0.50, 0.48, "acc", "regressed"), (0.50, 0.53, "acc", "improved"),
    (4.0, 4.0, "bits_per_weight", "ok"), (4.0, 3.9, "bits_per_weight", "regressed"),
    (1.0, 5.0, "quant_time_s", "untracked"),
])
def test_tolerance_logic(base, cur, metric, status):
    (d,) = compare({_k(metric): base}, {_k(metric): cur}, TOL)
    assert d.status == status


def test_missing_and_new_cells():
    diffs = {d.key: d.status for d in compare({_k("ppl", "gptq"): 20.0}, {_k("ppl", "awq"): 19.0}, TOL)}
    assert diffs == {_k("ppl", "gptq"): "missing", _k("ppl", "awq"): "new"}
    diffs = compare({_k("ppl", "gptq"): 20.0}, {}, TOL, allow_missing=True)
    assert diffs[0].status == "ok"


def _write(path, values):
    rows = [Row(model="m", method=k[1], scheme=k[2], dataset=k[4], metric=k[5], value=v,
                config={"precision": {"used": k[3]}}) for k, v in values.items()]
    path.write_text(json.dumps([r.__dict__ for r in rows]))
    return path


def test_cli_compare_exit_codes(tmp_path, capsys):
    base = _write(tmp_path / "b.json", {_k("ppl"): 20.0, _k("bits_per_weight", dataset="quant"): 4.03})
    same = _write(tmp_path / "s.json", {_k("ppl"): 20.05, _k("bits_per_weight", dataset="quant"): 4.03})
    worse = _write(tmp_path / "w.json", {_k("ppl"): 21.0, _k("bits_per_weight", dataset="quant"): 4.03})
    assert main(["compare", str(base), str(same)]) == 0
    assert "no regression" in capsys.readouterr().out
    assert main(["compare", str(base), str(worse)]) == 1
    out = capsys.readouterr().out
    assert "**REGRESSION**" in out and "| rtn | w4a16 | bf16 | wikitext2 | ppl | 0 | 20 (?) | 21 (?) |" in out
    assert main(["compare", str(base), str(tmp_path / "nope.json")]) == 2
    bad = tmp_path / "t.toml"
    bad.write_text("[metrics.ppl]\ndirection = 'sideways'\n")
    assert main(["compare", str(base), str(same), "--tolerances", str(bad)]) == 2


def test_committed_tolerances_parse():
    tol = load_tolerances(None)
    assert tol["ppl"]["direction"] == "lower" and "bits_per_weight" in tol


def test_a_degraded_method_fails_the_gate(tiny_model_dir, data_dir, tmp_path, capsys, monkeypatch):
    """Run RTN, then run it again with a deliberately broken quantizer (ranges widened 1.8x): the
    perplexity worsens and the gate exits 1; the honest rerun passes."""
    args = ["run", "--profile", "full", "--tasks", "none", "--model", str(tiny_model_dir), "--methods", "rtn", "--schemes", "w3a16", "--no-fp",
            "--datasets", "wikitext2", "--data-dir", str(data_dir), "--max-eval-tokens", "1024",
            "--eval-seq-len", "256"]
    assert main(args + ["--results", str(tmp_path / "base.sqlite")]) == 0
    assert main(args + ["--results", str(tmp_path / "again.sqlite")]) == 0
    capsys.readouterr()
    code, md = gate(tmp_path / "base.sqlite", tmp_path / "again.sqlite")
    assert code == 0, md

    import baselines.rtn as rtn
    real = rtn.minmax_qparams

    def broken(w, bits, group_size=None):
        scale, zero = real(w, bits, group_size)
        return scale * 1.8, zero
    monkeypatch.setattr(rtn, "minmax_qparams", broken)
    assert main(args + ["--results", str(tmp_path / "broken.sqlite")]) == 0
    code, md = gate(tmp_path / "base.sqlite", tmp_path / "broken.sqlite")
    assert code == 1 and "regressed" in md
