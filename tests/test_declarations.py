"""What it takes to add a metric, a scheme or a method (issue R): one declaration each, made here at runtime and
found by the command line, the planner and the reports, none of which names it.

- a metric: one `Metric` in the catalogue (bench/evaluations/evals.py) plus the code that computes it; estimated with its
  interval, ranked, compared paired and formatted by the Markdown leaderboard, the HTML page and `compare`;
- a scheme: one `Scheme` (lrq.schemes.register_scheme);
- a method: one registered `Method` subclass with its typed config class (lrq.methods.register);
- a task: one `Task` in the catalogue (tests/test_kl.py::test_one_declaration_makes_a_task).
- an activation mode: one `ActivationMode` (lrq.schemes.register_activation_mode) and a scheme naming it; the
  linear modules (fake-quantized, learnable, packed), the export and the llm-compressor adapter dispatch on it.
"""

from __future__ import annotations

import json
import re

import pytest

from bench.evaluations import evals as E
from bench.common.store import Row

# a per-window metric of the perplexity texts, as a plug-in would declare it: the computing code would store each
# window's value under config["eval"]["window_brier"] (here the rows are written by hand)
BRIER = E.Metric("brier", "Brier score", "lower", "{:.4f}", interval="mean", samples=("eval", "window_brier"),
                 scope="text", evaluation="perplexity", summary=True)


@pytest.fixture
def brier(monkeypatch):
    monkeypatch.setattr(E, "METRICS", dict(E.METRICS))
    return E.declare_metric(BRIER)


def _rows(shift: float = 0.0) -> list[Row]:
    base = [0.40, 0.42, 0.38, 0.41, 0.39, 0.43]
    cells = {("fp", "fp"): 0.0, ("rtn", "w4a16"): 0.10 + shift, ("gptq", "w4a16"): 0.02}
    rows = []
    for (method, scheme), d in cells.items():
        w = [b + d + 0.002 * i for i, b in enumerate(base)]
        rows.append(Row("m", method, scheme, "wikitext2", "brier", sum(w) / len(w),
                        {"eval": {"window_brier": w, "seq_len": 2048, "max_tokens": 12288}}))
        rows.append(Row("m", method, scheme, "quant", "bits_per_weight", 16.0 if method == "fp" else 4.03, {}))
    return rows


def test_one_declaration_makes_a_metric(brier):
    from bench.reports import report as R
    from bench.reports.html_report import html_report
    stats = R.cell_stats(_rows())
    cs = stats[("rtn", "w4a16")][("wikitext2", "brier")]
    assert cs.kind == "mean" and cs.first().known and cs.first().lo < cs.value < cs.first().hi   # its interval
    assert R._style("brier") == "diff" and E.metric("brier").ranked
    md = R.markdown_report(_rows())
    head = next(line for line in md.splitlines() if "WikiText-2 Brier score" in line)   # a summary column
    assert head.startswith("| method")
    gptq = next(line for line in md.splitlines() if line.startswith("| gptq") and "w4a16" in line)
    assert re.search(r"\*\*0\.\d{4} \(0\.\d{4}-0\.\d{4}\)\*\*", gptq)    # formatted, with its interval, bold
    assert "WikiText-2 Brier score: best gptq w4a16, separated from the runner-up rtn w4a16" in md
    page = html_report(_rows())
    assert "Brier score" in page


def test_compare_shows_a_declared_metric_with_its_interval(brier, tmp_path, capsys):
    from bench.cli import main
    a, b = tmp_path / "a.json", tmp_path / "b.json"
    a.write_text(json.dumps([r.__dict__ for r in _rows()]))
    b.write_text(json.dumps([r.__dict__ for r in _rows(shift=0.05)]))
    tol = tmp_path / "tol.toml"      # which change fails the gate is the tolerance file's decision, not code's
    tol.write_text("[metrics.brier]\nabs = 0.01\n")
    code = main(["compare", str(a), str(b), "--tolerances", str(tol)])
    out = capsys.readouterr().out
    line = next(x for x in out.splitlines() if "brier" in x and "rtn" in x)
    assert code == 1 and "regressed" in line
    assert "+0.05000 [+0.05000, +0.05000]" in line     # the paired difference over the same windows
    assert "| yes |" in line                            # outside its interval


def test_an_estimator_must_exist():
    with pytest.raises(ValueError, match="unknown interval"):
        E.declare_metric(E.Metric("odd", "odd", interval="bootstrap"))


# ---- a scheme and a method: one declaration each, found by the command line, the planner and the reports -------

def _run(tiny_model_dir, data_dir, tmp_path, methods: str, schemes: str) -> tuple[int, str]:
    from bench.cli import main
    out = tmp_path / "rep"
    code = main(["run", "--profile", "full", "--tasks", "none", "--model", str(tiny_model_dir), "--methods", methods,
                 "--schemes", schemes, "--datasets", "wikitext2", "--data-dir", str(data_dir),
                 "--results", str(tmp_path / "r.sqlite"), "--max-eval-tokens", "512", "--eval-seq-len", "256",
                 "--calib-samples", "4", "--calib-seq-len", "64", "--jobs", "1", "--out", str(out)])
    return code, (out / "leaderboard.md").read_text() if code == 0 else ""


def test_one_declaration_makes_a_scheme(monkeypatch, tiny_model_dir, data_dir, tmp_path):
    """A new scheme is one `Scheme` (lrq.schemes.register_scheme): every method quantizes under it, the planner
    prices it and the leaderboard gives it a section with its description."""
    from lrq import schemes as SC
    SC.register_scheme(SC.Scheme("w5a16-g32", 5, 32, description="5-bit weights in groups of 32 columns"))
    try:
        code, md = _run(tiny_model_dir, data_dir, tmp_path, "rtn,gptq", "w5a16-g32")
    finally:
        del SC.SCHEMES["w5a16-g32"]
    assert code == 0
    assert "### Scheme w5a16-g32" in md and "5-bit weights in groups of 32 columns" in md
    summary = md.split("### Summary", 1)[1].split("###", 1)[0]
    assert "bits/weight" in summary.splitlines()[4]
    rows = [line for line in summary.splitlines() if line.startswith(("| rtn ", "| gptq "))]
    assert len(rows) == 2
    assert {line.split("|")[2].strip() for line in rows} == {"w5a16-g32"}
    bits = {float(line.split("|")[3]) for line in rows}
    assert all(5.0 < b < 6.2 for b in bits), bits     # 5 bits plus a scale and zero point per 32 weights


def test_one_declaration_makes_a_method(monkeypatch, tiny_model_dir, data_dir, tmp_path, capsys):
    """A new method is one registered `Method` subclass with its config class (lrq.methods.register): the command
    line accepts it, its settings are typed and checked, it has a store key of its own and a leaderboard row."""
    from dataclasses import dataclass

    from lrq import methods as M
    from lrq.config import MethodConfig, setting
    from lrq.quant import minmax_qparams
    from lrq.quantize_model import replace_linears
    monkeypatch.setattr(M, "METHODS", dict(M.load_methods()))

    @dataclass(frozen=True)
    class ShrunkConfig(MethodConfig):
        shrink: float = setting(0.9, lo=0.5, hi=1.0)     # the fraction of each row's range kept

    @M.register
    class ShrunkRTN(M.Method):
        name = "rtn-shrunk"
        summary = "round-to-nearest on a shrunk min/max range"
        settings = ShrunkConfig
        presets = {"quick": ShrunkConfig(), "paper": ShrunkConfig()}

        def _quantize(self, model, scheme, config, calib):
            def qparams(name, w):
                return minmax_qparams(w * config.shrink, scheme.w_bits, scheme.group_size)
            replace_linears(model, scheme, qparams)
            return {}

    code, md = _run(tiny_model_dir, data_dir, tmp_path, "rtn,rtn-shrunk", "w4a16")
    assert code == 0
    assert any(line.startswith("| rtn-shrunk ") for line in md.splitlines())
    from bench.cli import main
    capsys.readouterr()
    # its setting typed and checked: a value out of range is refused before any work, naming the setting
    assert main(["run", "--methods", "rtn-shrunk", "--schemes", "w4a16", "--set", "shrink=2", "--model",
                 str(tiny_model_dir), "--data-dir", str(data_dir), "--results", str(tmp_path / "x.sqlite")]) == 2
    assert "shrink takes a number in [0.5, 1]" in capsys.readouterr().err


def test_one_declaration_makes_an_activation_mode(tiny_model_dir, data_dir, tmp_path):
    """A new activation mode (here: dynamic, one range per tensor from its own values) is one `ActivationMode`;
    a scheme naming it quantizes with every method's linear modules, packs, exports as compressed-tensors
    arguments and runs end to end."""
    import torch

    import lrq
    from conftest import tiny_model
    from lrq import schemes as SC
    from lrq.export import _quant_args
    from lrq.packed import PackedLinear
    from lrq.quant import per_tensor_fake_quant, qparams_from_range

    def per_tensor_dynamic(x, bits):
        lo, hi = x.detach().float().amin().clamp(max=0), x.detach().float().amax().clamp(min=0)
        return per_tensor_fake_quant(x, *qparams_from_range(lo, hi, bits), bits)
    mode = SC.ActivationMode("per_tensor_dynamic", False, "tensor", per_tensor_dynamic, "dynamic, one per tensor")
    SC.register_activation_mode(mode)
    SC.register_scheme(SC.Scheme("w4a8-pt", 4, None, 8, "per_tensor_dynamic", description="4-bit weights, 8-bit "
                                 "per-tensor dynamic activations"))
    try:
        ids = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(0))
        outs, packed = {}, {}
        for scheme in ("w4a8", "w4a8-pt"):
            m = tiny_model("llama", layers=2)
            lrq.quantize(m, "rtn", scheme)
            with torch.no_grad():
                outs[scheme] = m(ids).logits
            lrq.pack(m)                       # the packed modules dispatch on the same mode
            with torch.no_grad():
                packed[scheme] = m(ids).logits
        gap = lambda a, b: float((a - b).abs().max())  # noqa: E731
        # the mode is applied: another output than per-token, and the packed model's is nearer its own
        assert gap(outs["w4a8"], outs["w4a8-pt"]) > 0.01
        assert gap(packed["w4a8-pt"], outs["w4a8-pt"]) < gap(packed["w4a8-pt"], outs["w4a8"])
        # a packed layer computes exactly: its dequantized weight on the mode's quantized input
        layer = next(mod for mod in m.modules() if isinstance(mod, PackedLinear))
        x = torch.randn(3, layer.in_features, generator=torch.Generator().manual_seed(1))
        with torch.no_grad():
            want = torch.nn.functional.linear(per_tensor_dynamic(x, 8), layer.dequantized_weight(x.dtype))
            assert torch.allclose(layer(x), want, atol=1e-5)
        m = tiny_model("llama", layers=2)    # a learnable method's modules too (LRQ, a few steps)
        lrq.quantize(m, "lrq", "w4a8-pt", calibration=torch.randint(0, 128, (4, 16)), iters=2, heldout_samples=0)
        args = _quant_args(SC.get_scheme("w4a8-pt"))["input_activations"]
        assert args["strategy"] == "tensor" and args["dynamic"] is True and args["observer"] is None
        assert SC.activation_mode_for("tensor", True) is mode
        code, md = _run(tiny_model_dir, data_dir, tmp_path, "rtn", "w4a8-pt")
        assert code == 0 and "### Scheme w4a8-pt" in md
    finally:
        del SC.SCHEMES["w4a8-pt"], SC.ACTIVATION_MODES["per_tensor_dynamic"]


def test_a_scheme_with_an_unknown_activation_mode_is_refused():
    from lrq import schemes as SC
    from lrq.errors import UserError
    with pytest.raises(UserError, match="unknown activation mode 'per_channel'"):
        SC.Scheme("w4a8-pc", 4, None, 8, "per_channel")
    with pytest.raises(UserError, match="go together"):
        SC.Scheme("w4a8-x", 4, None, 8)


def test_a_source_tree_without_an_install_finds_the_same_methods(monkeypatch):
    """The lent GPU machine runs the project from its source tree (PYTHONPATH=., nothing installed; found on
    the H200, 2026-12-04, where the planner's profile stopped at "no quantization methods are installed"):
    with no entry points, the methods come from pyproject.toml's declaration, the list an install registers."""
    import importlib.metadata

    import lrq.methods as M
    installed = {e.name: e.value for e in importlib.metadata.entry_points(group=M.ENTRY_POINTS)}
    assert installed and M._source_tree_entry_points() == installed
    imported = []
    monkeypatch.setattr(M, "_LOADED", False)
    monkeypatch.setattr(importlib.metadata, "entry_points", lambda **kw: [])
    monkeypatch.setattr(M.importlib, "import_module", imported.append)
    M.load_methods()
    assert sorted(imported) == sorted(v.split(":")[0] for v in installed.values())


def test_one_declaration_makes_a_row_of_the_cost_table(monkeypatch):
    """The quantization's cost table lists the catalogue's metrics of table "cost" (Metric.table), in its order:
    a cost a plug-in measures is one declaration, not an edit of the report's list."""
    from bench.reports import report as R
    monkeypatch.setattr(E, "METRICS", dict(E.METRICS))
    E.declare_metric(E.Metric("quant_energy_j", "quant energy (J)", "lower", "{:.0f}", "J", table="cost"))
    rows = _rows() + [Row("m", "gptq", "w4a16", "quant", "quant_time_s", 12.5, {}),
                      Row("m", "gptq", "w4a16", "quant", "quant_energy_j", 4321.0, {})]
    assert E.table_metrics("cost")[:2] == ["bits_per_weight", "quant_time_s"]
    assert E.table_metrics("cost")[-1] == "quant_energy_j"
    md = R.markdown_report(rows)
    head = next(line for line in md.splitlines() if "quant_time_s" in line and line.startswith("|"))
    assert head.index("quant_time_s") < head.index("quant_energy_j")
    assert any("4321" in line and line.startswith("| gptq") for line in md.splitlines())
