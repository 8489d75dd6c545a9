"""What it takes to add a metric: one declaration in the catalogue (bench/evals.py), plus the code that computes
it (issue R, item 3). Added here at runtime, the new metric is estimated with its interval, ranked, compared
paired and formatted by the Markdown leaderboard, the HTML page and `lrq-bench compare`, none of which names it.
"""

from __future__ import annotations

import json
import re

import pytest

from bench import evals as E
from bench.store import Row

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
    from bench import report as R
    from bench.html_report import html_report
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
