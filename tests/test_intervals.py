"""How sure the leaderboard is (bench.evaluations.stats, the reports, the gate): intervals, paired comparisons, seeds,
and bold only on separated values."""

import json
import math

import pytest
import torch

from bench.evaluations import stats as S
from bench.cli import main
from bench.reports.report import cell_stats, markdown_report
from bench.common.store import ResultStore, Row


# ---- the statistics ----------------------------------------------------------------------------------------

def test_ppl_interval_is_exp_of_the_mean_nll_interval():
    w = [3.0, 3.2, 2.9, 3.1]
    e = S.ppl_estimate(w)
    m = sum(w) / 4
    sd = math.sqrt(sum((x - m) ** 2 for x in w) / 3)
    assert e.value == pytest.approx(math.exp(m))
    assert e.lo == pytest.approx(math.exp(m - 3.182446305 * sd / 2)) and e.hi == pytest.approx(math.exp(m + 3.182446305 * sd / 2))
    assert not S.ppl_estimate(None, 12.0).known and S.ppl_estimate(None, 12.0).value == 12.0


def test_wilson_interval():
    lo, hi = S.wilson(5, 10)
    assert lo == pytest.approx(0.2366, abs=1e-4) and hi == pytest.approx(0.7634, abs=1e-4)   # textbook values
    assert S.wilson(0, 10)[0] == 0.0 and S.wilson(10, 10)[1] == pytest.approx(1.0)
    e = S.acc_estimate([1, 0, 1, 1, 0, 1, 0, 1, 1, 0])
    assert e.value == 0.6 and e.n == 10 and e.lo < 0.6 < e.hi


def test_paired_comparisons():
    base = [3.0, 3.5, 2.8, 3.9, 3.2]
    same = S.paired_ppl(base, base)
    assert same.effect == 1.0 and not same.separated
    worse = S.paired_ppl([x + 0.02 + 0.001 * i for i, x in enumerate(base)], base)
    assert worse.separated and worse.lo > 1.0
    assert S.paired_ppl(base[:3], base) is None                     # different windows: no paired comparison
    a, b = [1, 1, 1, 0, 1, 1, 1, 1], [0, 0, 1, 0, 0, 0, 1, 0]
    d = S.paired_acc(a, b)
    assert d.effect == pytest.approx(0.625) and d.separated
    assert not S.paired_acc([1, 0, 1, 0], [0, 1, 0, 1]).separated


def test_seeds_compare_by_welch():
    a = S.CellStat("ppl", {0: S.Estimate(30.0), 1: S.Estimate(30.5), 2: S.Estimate(29.8)})
    b = S.CellStat("ppl", {0: S.Estimate(30.2), 1: S.Estimate(29.9), 2: S.Estimate(30.4)})
    c = S.compare(a, b)
    assert c.how == "seeds (Welch)" and not c.separated
    far = S.CellStat("ppl", {0: S.Estimate(40.0), 1: S.Estimate(40.3), 2: S.Estimate(39.9)})
    assert S.compare(far, a).separated


# ---- the bold rule on real (tiny) cells --------------------------------------------------------------------

def _cell(method, scheme, windows, seed=0):
    ppl = math.exp(sum(windows) / len(windows))
    return Row("m", method, scheme, "wikitext2", "ppl", ppl, {"eval": {"window_nll": windows}}, seed=seed)


def test_identical_methods_with_different_seeds_are_never_bold_against_each_other():
    """Two cells of the same method that differ only by seed (their seeds' values swapped between them) are
    not separated, however tight each seed's own interval, and are marked tied."""
    s0 = [3.00, 3.10, 3.20, 3.30]
    s1 = [x + 0.05 for x in s0]           # another seed: consistently a bit worse on every window
    s2 = [x + 0.02 for x in s0]
    rows = [_cell("lrq-a", "w4a16", w, seed=i) for i, w in enumerate((s0, s1, s2))]
    rows += [_cell("lrq-b", "w4a16", w, seed=i) for i, w in enumerate((s1, s2, s0))]
    stats = cell_stats(rows)
    r = S.rank({k: v[("wikitext2", "ppl")] for k, v in stats.items()}, True)
    assert r.status == "tied" and set(r.marks.values()) == {"tie"}
    md = markdown_report(rows)
    assert "**" not in md.split("### Scheme")[0] and "~" in md and "no separated best" in md
    assert "+-" in md and "(3 seeds)" in md


@pytest.mark.slow
def test_a_clearly_worse_cell_is_separated(data_dir):
    """On the default model, RTN w4a16-g128 against RTN with 3x widened ranges (a 3x coarser grid), both
    scored on the same 8 WikiText-2 windows: the plain RTN is bold, the widened one is not tied with it."""
    from bench.evaluations import data as D
    from bench.common.models import load_model
    from bench.evaluations.perplexity import perplexity
    from lrq.methods import get_method
    from lrq.qlinear import QuantLinear
    from lrq.quant import minmax_qparams, quantize
    from lrq.schemes import get_scheme
    rows = []
    for name, widen in (("rtn", 1.0), ("rtn-widened", 3.0)):
        loaded = load_model("smollm2-135m")
        model, tok = loaded.model, loaded.tokenizer
        ids = D.tokenize(tok, D.eval_text("wikitext2", data_dir).text)[: 8 * 256]
        get_method("rtn").quantize(model, get_scheme("w4a16-g128"), {}, None)
        if widen != 1.0:
            with torch.no_grad():
                for m in model.modules():
                    if isinstance(m, QuantLinear):
                        w = m.dequantized_weight()
                        scale, zero = minmax_qparams(w * widen, 4, 128)   # the range 3x wider: a coarser grid
                        m.set_weight(quantize(w, scale, zero, 4, 128), scale, zero)
        res = perplexity(model, ids, 256)
        rows.append(Row("m", name, "w4a16-g128", "wikitext2", "ppl", res["ppl"],
                        {"eval": {"window_nll": res["window_nll"]}}))
    stats = cell_stats(rows)
    r = S.rank({k: v[("wikitext2", "ppl")] for k, v in stats.items()}, True)
    assert rows[1].value > rows[0].value
    assert r.status == "separated" and r.best == ("rtn", "w4a16-g128") and r.comparison.separated
    assert "**" in markdown_report(rows)


def test_old_rows_without_windows_are_shown_with_unknown_intervals():
    rows = [Row("m", "rtn", "w4a16", "wikitext2", "ppl", 30.0), Row("m", "gptq", "w4a16", "wikitext2", "ppl", 29.0)]
    md = markdown_report(rows)
    assert "30.00 (?)" in md and "interval unknown" in md and "**" not in md


def test_rankings_across_seeds_say_which_orders_hold_on_every_seed():
    """a beats b on every seed; b and c swap places between seeds; RTN (one seed) counts on every seed."""
    from bench.reports.report import seed_rankings
    base = [3.0, 3.1, 3.2, 3.3]
    shift = lambda d: [x + d for x in base]
    rows = [_cell("a", "w3a16", shift(d), seed=i) for i, d in enumerate((0.00, 0.01, 0.02))]
    rows += [_cell("b", "w3a16", shift(d), seed=i) for i, d in enumerate((0.10, 0.30, 0.12))]
    rows += [_cell("c", "w3a16", shift(d), seed=i) for i, d in enumerate((0.20, 0.15, 0.22))]
    rows += [_cell("rtn", "w3a16", shift(0.5))]
    once = _cell("d", "w3a16", shift(-1.0))            # calibration-dependent, one seed only: left out
    once.config["calibration"] = {"n_samples": 32, "seed": 0}
    rows.append(once)
    (r,) = seed_rankings(cell_stats(rows), {("rtn", "w3a16")})
    assert r["order"] == ["a", "b", "c", "rtn"] and r["cells"]["rtn"][2] == 1 and r["single_seed"] == ["d"]
    held = {(st["ahead"], st["behind"]): st["holds"] for st in r["steps"]}
    assert held == {("a", "b"): True, ("b", "c"): False, ("c", "rtn"): True}
    ppl = lambda d: math.exp(3.15 + d)
    ab = [ppl(db) - ppl(da) for da, db in ((0.00, 0.10), (0.01, 0.30), (0.02, 0.12))]
    assert r["steps"][0]["gaps"] == pytest.approx(ab) and r["steps"][0]["seeds"] == [0, 1, 2]
    md = markdown_report(rows)
    section = md.split("### Rankings across seeds")[1].split("###")[0]
    mean = sum(ab) / 3
    sd = (sum((g - mean) ** 2 for g in ab) / 2) ** 0.5
    assert f"a > b: {mean:.2f} +-{sd:.2f} (all 3 seeds)" in section
    assert "b > c: " in section and "(not all 3 seeds)" in section and f"rtn {ppl(0.5):.2f} (1 seed)" in section
    row = next(l for l in section.splitlines() if l.startswith("| w3a16"))
    assert row.rstrip(" |").endswith("| d")
    # one seed everywhere: no section
    assert "Rankings across seeds" not in markdown_report([_cell("a", "w3a16", base), _cell("b", "w3a16", shift(1))])


# ---- accuracy, seeds and the gate through the CLI --------------------------------------------------------

@pytest.mark.heavy
def test_seeds_repeat_only_calibration_dependent_cells(tiny_model_dir, data_dir, tmp_path, capsys):
    results = tmp_path / "r.sqlite"
    code = main(["run", "--profile", "full", "--tasks", "none", "--jobs", "1", "--model", str(tiny_model_dir),
                 "--methods", "rtn,lrq", "--schemes", "w4a16,w8a8", "--datasets", "wikitext2", "--data-dir",
                 str(data_dir), "--results", str(results), "--max-eval-tokens", "512", "--eval-seq-len", "256",
                 "--calib-samples", "6", "--calib-seq-len", "32", "--set", "iters=2", "--set", "heldout_samples=2",
                 "--seeds", "0,1", "--out", str(tmp_path / "rep")])
    out, err = capsys.readouterr()
    assert "(2 seeds)" in out                      # the terminal summary shows seeds as seeds
    out = (tmp_path / "rep" / "leaderboard.md").read_text()
    # FP and RTN w4a16 (no calibration) once; RTN w8a8, LRQ w4a16 and LRQ w8a8 per seed
    assert code == 0 and "8 cells: 8 run" in err, err
    seeds = {(r.method, r.scheme): set() for r in ResultStore(results).rows()}
    for r in ResultStore(results).rows():
        seeds[(r.method, r.scheme)].add(r.seed)
    assert seeds == {("fp", "fp"): {0}, ("rtn", "w4a16"): {0}, ("rtn", "w8a8"): {0, 1}, ("lrq", "w4a16"): {0, 1},
                     ("lrq", "w8a8"): {0, 1}}
    assert "(2 seeds)" in out and "### Seeds" in out
    assert main(["run", "--seeds", "a,b"]) == 2 and "--seeds takes comma-separated integers" in capsys.readouterr().err


def test_task_rows_keep_every_example_and_show_intervals(tiny_model_dir, data_dir, tmp_path, capsys):
    results = tmp_path / "r.sqlite"
    code = main(["run", "--profile", "full", "--tasks", "piqa,boolq", "--task-limit", "6", "--jobs", "1",
                 "--model", str(tiny_model_dir), "--methods", "rtn", "--schemes", "w4a16", "--datasets", "none",
                 "--data-dir", str(data_dir), "--results", str(results), "--out", str(tmp_path / "rep")])
    out, err = capsys.readouterr()
    assert code == 0, err
    out = (tmp_path / "rep" / "leaderboard.md").read_text()
    acc = [r for r in ResultStore(results).rows() if r.metric in ("acc", "acc_norm")]
    for r in acc:
        per = r.config["per_example"]
        assert len(per) == 6 and set(per) <= {0.0, 1.0} and sum(per) / 6 == pytest.approx(r.value)
        assert r.config["doc_ids"] == list(range(6))
    assert "### Task accuracy" in out and "(" in out.split("### Task accuracy")[1]


def test_the_gate_shows_intervals_and_whether_a_change_is_outside_them(tmp_path, capsys):
    base = [3.0, 3.1, 3.2, 3.3]
    worse = [x + 0.05 for x in base]
    a, b = tmp_path / "a.json", tmp_path / "b.json"
    a.write_text(json.dumps([_cell("rtn", "w4a16", base).__dict__]))
    b.write_text(json.dumps([_cell("rtn", "w4a16", worse).__dict__]))
    code = main(["compare", str(a), str(b)])
    out = capsys.readouterr().out
    assert code == 1 and "regressed" in out and "| yes |" in out and "1.0513x [" in out
    # 2.8 % worse on average (beyond the 0.5 % tolerance: a regression), but not on every window: the change
    # is inside its paired interval, and the gate says so
    noisy = [x + d for x, d in zip(base, (0.08, -0.02, 0.06, -0.01))]
    b.write_text(json.dumps([_cell("rtn", "w4a16", noisy).__dict__]))
    code = main(["compare", str(a), str(b)])
    out = capsys.readouterr().out
    assert code == 1 and "regressed" in out and "| no |" in out


def test_plain_columns_of_a_multi_seed_cell_show_every_seed():
    """Quantization time and memory have no interval, but a cell run with several seeds shows their mean +-
    sd over seeds (and how many), never whichever seed's row came last; a value equal on every seed (bits
    per weight) shows once."""
    rows = []
    for seed, (t, mem) in enumerate(((100.0, 2**30), (130.0, 2**30 + 2**27), (160.0, 2**30))):
        rows += [_cell("gptq", "w4a16", [3.0 + 0.01 * seed] * 4, seed=seed),
                 Row("m", "gptq", "w4a16", "quant", "quant_time_s", t, {}, seed=seed),
                 Row("m", "gptq", "w4a16", "quant", "quant_peak_rss_bytes", float(mem), {}, seed=seed),
                 Row("m", "gptq", "w4a16", "quant", "bits_per_weight", 4.029, {}, seed=seed)]
    md = markdown_report(rows)
    line = next(l for l in md.split("### Quantization cost")[1].splitlines() if l.startswith("| gptq"))
    assert "130.0 +-30.0 (3 seeds)" in line and "1067 MiB +-74 MiB (3 seeds)" in line and "| 4.029 " in line
    summary = next(l for l in md.split("### Summary")[1].splitlines() if l.startswith("| gptq"))
    assert "130.0 +-30.0 (3 seeds)" in summary and "160.0" not in summary


def test_intervals_stay_within_their_metrics_bounds(tmp_path, capsys):
    """A t interval over windows near a bound reaches past it (top-1 agreement [96.9, 101.6] %, KLD
    [-0.016, 0.031]): the leaderboard, the page and the gate show it cut at the bound, and say so."""
    from bench.reports.html_report import html_report
    top1, kld = [1.0, 1.0, 0.97, 1.0], [0.0, 0.0, 0.03, 0.0]
    kl = {"kl": {"window_top1": top1, "window_kld": kld}}
    rows = [Row("m", "rtn", "w4a16", "wikitext2", "top1_agree", sum(top1) / 4, kl),
            Row("m", "rtn", "w4a16", "wikitext2", "kld", sum(kld) / 4, kl),
            Row("m", "rtn", "w4a16", "quant", "bits_per_weight", 4.0, {})]
    st = cell_stats(rows)[("rtn", "w4a16")]
    assert st[("wikitext2", "top1_agree")].first().hi == 1.0 and st[("wikitext2", "top1_agree")].first().lo < 0.99
    assert st[("wikitext2", "kld")].first().lo == 0.0 and st[("wikitext2", "kld")].first().hi > 0.03
    md, page = markdown_report(rows), html_report(rows)
    assert "96.86-100.00)" in md and "0.0000-0.0314)" in md and "101." not in md and "(-0.0" not in md
    for text, at_least in ((md, ">="), (page, "&gt;=")):   # the page escapes >
        assert "An interval is cut at its metric's bounds" in text and f"KLD {at_least} 0" in text
        assert "top-1 agreement, accuracy" in text and "0-100 %" in text
    a = tmp_path / "a.json"
    a.write_text(json.dumps([r.__dict__ for r in rows]))
    assert main(["compare", str(a), str(a), "--all"]) == 0
    assert "0.9925 (96.9-100.0)" in capsys.readouterr().out
