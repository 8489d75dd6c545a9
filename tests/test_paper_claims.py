"""bench/studies/paper_claims.py on stores written here: each verdict follows the intervals."""

import json
import math
import re

import pytest


def _claims_store(path, lrq_held, fr_held, lrq_ppl_shift):
    from bench.common.store import ResultStore, Row
    store = ResultStore(path)
    base = [2.0, 2.2, 2.1, 2.3, 2.05, 2.15]
    regime = {"method_resolved": {"iters": 20, "batch_size": 1, "heldout_samples": 8, "preset": "quick",
                                  "rank_rule": "fraction", "rank": 1024, "rank_fraction": 0.25},
              "calibration": {"n_samples": 32, "seq_len": 512}}
    rows = []
    for m, held, shift in (("lrq", lrq_held, lrq_ppl_shift), ("flexround", fr_held, 0.0), ("gptq", None, 0.05)):
        for ds in ("wikitext2", "c4"):
            w = [x + shift for x in base]
            rows.append(Row("smollm2-135m", m, "w4a16", ds, "ppl", math.exp(sum(w) / len(w)),
                            regime | {"eval": {"window_nll": w}}, seed=0))
        if held is not None:
            from bench.studies.paper_claims import param_counts
            from bench.run.shapes import SHAPES
            n = param_counts(SHAPES["smollm2-135m"], "fraction")[m]
            be = [{"calib_before": 10.0, "calib_after": 5.0 + 0.1 * i, "heldout_before": 11.0,
                   "heldout_after": held + 0.1 * i} for i in range(6)]
            rows.append(Row("smollm2-135m", m, "w4a16", "quant", "n_learnable", float(n),
                            regime | {"method_stats": {"block_errors": be}}, seed=0))
    for i, r in enumerate(rows):
        store.write_unit([r], key=f"k{i}")
    return store


def test_paper_claims_verdicts_follow_the_intervals(tmp_path):
    from bench.studies.paper_claims import main
    _claims_store(tmp_path / "good.sqlite", lrq_held=6.0, fr_held=6.6, lrq_ppl_shift=-0.05)
    assert main(["--results", str(tmp_path / "good.sqlite"), "--out", str(tmp_path / "good")]) == 0
    res = json.loads((tmp_path / "good" / "claims.json").read_text())
    by = {c["claim"]: c for c in res["claims"]}
    assert by["Learnable parameters"]["verdict"] == "holds in part"     # the official rule is full rank here
    assert "stored counts equal to the formula: 2 of 2 cells" in by["Learnable parameters"]["measurement"]
    assert by["Figure 2: generalization"]["verdict"] == "holds"
    assert "20 steps/block, batch 1, calibration 32 x 512" in by["Figure 2: generalization"]["regime"]
    w4 = by["Results at W4A16"]
    # lower perplexity than FlexRound and GPTQ on every window: separated; the rest are not in the store
    assert w4["verdict"] == "holds" and "vs omniquant: not in the store" in w4["measurement"]
    assert by["The rank"]["verdict"] == "not measurable here"
    page = (tmp_path / "good" / "claims.html").read_text()
    assert page.count("<tr>") == len(res["claims"]) + 1
    # readable at a glance: one number per row, a coloured short verdict, the measurements folded under it,
    # no path of the machine that made it
    assert [c["id"] for c in res["claims"]] == list(range(1, len(res["claims"]) + 1))
    assert {c["verdict_class"] for c in res["claims"]} <= {"holds", "holds in part", "not separated",
                                                            "does not hold", "not measurable here"}
    assert page.count("<details>") == len(res["claims"]) and 'style="background:#d7f0d2"' in page
    assert res["store"] == "good.sqlite" and str(tmp_path) not in page
    md = (tmp_path / "good" / "claims.md").read_text()
    assert md.count("\n## ") == len(res["claims"]) + 1 and str(tmp_path) not in md   # + the last section

    _claims_store(tmp_path / "bad.sqlite", lrq_held=6.6, fr_held=6.0, lrq_ppl_shift=0.02)
    assert main(["--results", str(tmp_path / "bad.sqlite"), "--out", str(tmp_path / "bad")]) == 0
    by = {c["claim"]: c for c in json.loads((tmp_path / "bad" / "claims.json").read_text())["claims"]}
    assert by["Figure 2: generalization"]["verdict"] == "does not hold"
    assert by["Results at W4A16"]["verdict"] == "does not hold"
    assert "separated worse than flexround on wikitext2" in by["Results at W4A16"]["why"]


def test_paper_claims_refuses_a_missing_store(tmp_path):
    from bench.studies.paper_claims import main
    from lrq.errors import UserError
    with pytest.raises(UserError, match="does not exist"):
        main(["--results", str(tmp_path / "none.sqlite"), "--out", str(tmp_path)])


def _figure2_dir(path, lrq_held, fr_held):
    """A finished Figure-2 study's output: one block, both methods, 4 held-out windows per point."""
    def curve(calib, held):
        return [{"step": st, "loss": 1.0, "calib": sum(calib) / 4, "heldout": sum(held) / 4,
                 "calib_windows": [x * (1 + st / 10) for x in calib], "heldout_windows": [x * (1 + st / 10) for x in held]}
                for st in (0, 10)]
    res = {"config": {"model": "smollm2-135m", "scheme": "w3a16", "methods": ["lrq", "flexround"], "blocks": [0],
                      "settings": {"iters": 10, "batch_size": 2, "heldout_samples": 4, "error_samples": 4},
                      "calibration": {"seq_len": 1024}, "train_windows": 8, "heldout_windows": 4, "every": 10,
                      "seed": 0, "device": "cpu"},
           "provenance": {"git": "0" * 40, "hardware": {"cpu": "x"}, "threads": 1},
           "results": {"0/lrq": {"block": 0, "method": "lrq", "n_learnable": 10, "curve": curve([5.1, 5.3, 5.0, 5.2], lrq_held)},
                       "0/flexround": {"block": 0, "method": "flexround",
                                       "curve": curve([5.0, 5.2, 4.9, 5.1], fr_held)}}}
    path.mkdir()
    (path / "figure2.json").write_text(json.dumps(res))
    return path


@pytest.mark.parametrize("lrq_held, verdict", [([6.0, 6.1, 5.9, 6.2], "holds"), ([6.9, 7.1, 6.8, 7.2], "does not hold"),
                                                ([6.0, 7.2, 6.1, 7.0], "not separated")])
def test_the_figure2_study_joins_the_page(tmp_path, lrq_held, verdict):
    from bench.studies.paper_claims import main
    from lrq.errors import UserError
    _claims_store(tmp_path / "s.sqlite", lrq_held=6.0, fr_held=6.6, lrq_ppl_shift=-0.05)
    f2 = _figure2_dir(tmp_path / "f2", lrq_held, [6.5, 6.6, 6.4, 6.7])
    assert main(["--results", str(tmp_path / "s.sqlite"), "--figure2", str(f2), "--out", str(tmp_path / "o")]) == 0
    by = {c["claim"]: c for c in json.loads((tmp_path / "o" / "claims.json").read_text())["claims"]}
    row = next(c for name, c in by.items() if name.startswith("Figure 2 in the paper's regime (LRQ rank rule"))
    assert row["verdict"] == verdict and "10 steps/block, batch 2, calibration 8 x 1024 (4 held out)" in row["regime"]
    assert "block 0 after 10 steps" in row["measurement"][0] and "4 windows each" in row["measurement"][0]
    page = (tmp_path / "o" / "claims.html").read_text()
    assert "paper's regime: block error during training" in page and page.count("<svg") == 1
    assert "<h3>Block 0, LRQ rank rule" in page and "(f2)</h3>" in page      # each figure titled apart
    # the page re-rendered from its JSON (the store gone): the same rows, verdicts and figure, numbered once
    assert main(["--from-json", str(tmp_path / "o" / "claims.json"), "--figure2", str(f2),
                 "--out", str(tmp_path / "re")]) == 0
    again = json.loads((tmp_path / "re" / "claims.json").read_text())
    first = json.loads((tmp_path / "o" / "claims.json").read_text())
    assert [(c["claim"], c["verdict"], c["measurement"]) for c in again["claims"]] == \
        [(c["claim"], c["verdict"], c["measurement"]) for c in first["claims"]]
    assert [c["id"] for c in again["claims"]] == list(range(1, len(first["claims"]) + 1))
    assert (tmp_path / "re" / "claims.html").read_text().count("<svg") == 1
    with pytest.raises(UserError, match="no figure2.json"):
        main(["--results", str(tmp_path / "s.sqlite"), "--figure2", str(tmp_path), "--out", str(tmp_path / "o2")])


def _rank_store(path, shifts: dict):
    """LRQ w4a16 cells that differ only in rank ({(rule, value): per-window NLL shift}); one ran compiled."""
    from bench.common.store import ResultStore, Row
    store = ResultStore(path)
    base = [2.0, 2.2, 2.1, 2.3, 2.05, 2.15]
    for i, ((rule, v), shift) in enumerate(shifts.items()):
        m = {"iters": 20, "batch_size": 1, "heldout_samples": 8, "preset": "quick", "rank_rule": rule, "rank": 1024,
             "rank_fraction": 0.25, "compile": i == 1} | ({"rank": v} if rule == "uniform" else {"rank_fraction": v})
        cfg = {"method_resolved": m, "calibration": {"n_samples": 32, "seq_len": 512}}
        rows = [Row("smollm2-135m", "lrq", "w4a16", "quant", "n_learnable", float(1000 * (i + 1)), cfg, seed=0)]
        for j, ds in enumerate(("wikitext2", "c4")):
            w = [x + shift + 0.001 * k * j for k, x in enumerate(base)]
            rows.append(Row("smollm2-135m", "lrq", "w4a16", ds, "ppl", math.exp(sum(w) / len(w)),
                            cfg | {"eval": {"window_nll": w}}, seed=0))
        store.write_unit(rows, key=f"r{i}")


def test_rank_claim_pairs_each_rank_with_the_highest(tmp_path):
    from bench.studies.paper_claims import main
    _claims_store(tmp_path / "main.sqlite", lrq_held=6.0, fr_held=6.6, lrq_ppl_shift=-0.05)
    # fewest to most learnables: r = 8 worse than the full rank on every window, fraction 0.25 the same
    _rank_store(tmp_path / "rank.sqlite", {("uniform", 8): 0.1, ("fraction", 0.25): 0.0, ("uniform", 576): 0.0})
    assert main(["--results", str(tmp_path / "main.sqlite"), "--rank-results", str(tmp_path / "rank.sqlite"),
                 "--out", str(tmp_path / "out")]) == 0
    res = json.loads((tmp_path / "out" / "claims.json").read_text())
    rank = {c["claim"]: c for c in res["claims"]}["The rank"]
    assert rank["verdict"] == "does not hold" and "r = 8 on wikitext2" in rank["why"]
    lines = rank["measurement"]
    # ordered by learnables, the reference (most learnables) last, unpaired; the compiled cell joined the others
    assert [ln.split(" (")[0] for ln in lines] == ["w4a16, r = 8", "w4a16, r = 0.25 min(Cout, Cin)", "w4a16, r = 576"]
    assert "/ r = 576: 1.105" in lines[0] and "/ r = 576" not in lines[2]
    assert "20 steps/block" in rank["regime"]
    assert "rank sweep" in (tmp_path / "out" / "claims.md").read_text()

    from bench.common.store import ResultStore
    from bench.studies.paper_claims import claim_rank
    _rank_store(tmp_path / "tie.sqlite", {("uniform", 8): 0.0, ("uniform", 576): 0.0})
    rank = claim_rank(ResultStore(tmp_path / "tie.sqlite").rows())
    assert rank["verdict"] == "not separated" and len(rank["measurement"]) == 2


def _long_folder(path, lrq_kld_shift, model="smollm2-135m"):
    """A long run's committed folder: LRQ, FlexRound and GPTQ at w3a16, per-window NLLs and KL means."""
    import hashlib
    from bench.run import ledger
    from bench.common.store import Row
    hexkey = lambda name: hashlib.sha256(name.encode()).hexdigest()  # noqa: E731   (unit keys are hexadecimal)
    base = [2.0, 2.2, 2.1, 2.3, 2.05, 2.15]
    kld = [0.40, 0.45, 0.42, 0.47, 0.41, 0.44]
    regime = {"method_resolved": {"iters": 1000, "batch_size": 2, "heldout_samples": 16, "preset": "long",
                                  "rank_rule": "llama2-7b-like"},
              "calibration": {"n_samples": 128, "seq_len": 1024}, "precision": {"used": "bf16"}}
    units = {}
    for m, shift in (("lrq", lrq_kld_shift), ("flexround", 0.0), ("gptq", 0.3)):
        for ds in ("wikitext2", "c4"):
            w = [x + shift for x in base]
            k = [x + shift for x in kld]
            for metric, value, extra in (("ppl", math.exp(sum(w) / len(w)), {"eval": {"window_nll": w}}),
                                         ("kld", sum(k) / len(k), {"kl": {"window_kld": k}})):
                key = hexkey(f"{m}-{ds}-{metric}")
                units[key] = [Row(model, m, "w3a16", ds, metric, value, regime | extra, seed=0,
                                  unit_key=key)]
    ledger.write(path, units)
    return path


@pytest.mark.parametrize("shift, verdict, why", [
    (0.05, "does not hold", "separated worse than flexround on wikitext2, flexround on c4, flexround on wikitext2 kld"),
    (-0.05, "holds", "not yet measured: awq"),
])
def test_the_long_runs_results_file_adds_a_row_per_scheme(tmp_path, shift, verdict, why):
    """`--long DIR` reads a committed results file: LRQ against FlexRound, GPTQ and AWQ, perplexity ratio
    and KLD difference paired over the windows, for both texts; the regime names the preset, rank rule and
    precision; the baselines not yet run are named, not counted."""
    from bench.studies.paper_claims import main
    _claims_store(tmp_path / "s.sqlite", lrq_held=6.0, fr_held=6.6, lrq_ppl_shift=-0.05)
    _long_folder(tmp_path / "long", shift)
    assert main(["--results", str(tmp_path / "s.sqlite"), "--long", str(tmp_path / "long"),
                 "--out", str(tmp_path / "out")]) == 0
    res = json.loads((tmp_path / "out" / "claims.json").read_text())
    by = {c["claim"]: c for c in res["claims"]}
    row = by["Results at W3A16, long preset"]
    assert row["verdict"] == verdict and why in row["why"]
    assert row["statement"] == "LRQ outperforms FlexRound, GPTQ and AWQ at W3A16"
    assert "long preset, LRQ rank rule llama2-7b-like, bf16" in row["regime"]
    vs_fr = next(line for line in row["measurement"] if line.startswith("vs flexround"))
    assert vs_fr.count("ppl ratio") == 2 and vs_fr.count("KLD difference") == 2
    assert f"wikitext2 KLD difference {shift:+.4f}" in vs_fr     # the windows differ by the shift exactly
    assert "vs awq: not in the long run's results yet" in row["measurement"]
    # the sweep's own rows are still there, and the long row stands apart from them
    assert by["Results at W4A16"]["verdict"] == "holds"
    # re-rendering the page from its JSON puts the long rows back in place of the old ones, once
    assert main(["--from-json", str(tmp_path / "out" / "claims.json"), "--long", str(tmp_path / "long"),
                 "--out", str(tmp_path / "again")]) == 0
    again = json.loads((tmp_path / "again" / "claims.json").read_text())
    assert [c["claim"] for c in again["claims"]] == [c["claim"] for c in res["claims"]]


def test_a_missing_long_folder_is_refused(tmp_path):
    from bench.studies.paper_claims import main
    from lrq.errors import UserError
    _claims_store(tmp_path / "s.sqlite", lrq_held=6.0, fr_held=6.6, lrq_ppl_shift=-0.05)
    with pytest.raises(UserError, match="no results file"):
        main(["--results", str(tmp_path / "s.sqlite"), "--long", str(tmp_path / "nowhere"), "--out", str(tmp_path)])


def _objection_run(root, name, method, held: dict, lr=None, product=None, scheme="w3a16", authors_lr=1e-3):
    """One Figure-2 study run of the objections: one method at one setting, 4 held-out windows per block."""
    settings = {"iters": 10, "batch_size": 2, "heldout_samples": 4, "error_samples": 4}
    settings |= ({"lr": lr} if lr is not None else {}) | ({"lowrank_product": product} if product else {})
    resolved = {"lr": lr or authors_lr} | ({"lowrank_product": product or "autocast"} if method == "lrq" else {})
    results = {f"{b}/{method}": {"block": b, "method": method, "resolved": resolved, "n_learnable": 10,
                                 "curve": [{"step": 10, "loss": 1.0, "calib": 1.0, "heldout": sum(w) / len(w),
                                            "calib_windows": [1.0] * len(w), "heldout_windows": w}]}
               for b, w in held.items()}
    res = {"config": {"model": "smollm2-135m", "scheme": scheme, "methods": [method], "blocks": sorted(held),
                      "settings": settings, "calibration": {"seq_len": 1024}, "train_windows": 8,
                      "heldout_windows": 4, "every": 10, "seed": 0, "device": "cpu",
                      "precision": "bf16 autocast over float32 weights in the training steps"},
           "provenance": {"git": "0" * 40, "hardware": {"cpu": "x"}, "threads": 1}, "results": results}
    (root / name).mkdir(parents=True)
    (root / name / "figure2.json").write_text(json.dumps(res))


def test_the_page_ends_with_what_would_change_the_verdict(tmp_path):
    """--objections: each method's held-out block error by learning rate, its best rate, the verdict at the best
    rates beside the authors' (here it changes: LRQ at 2x beats FlexRound at its best), the float32 product's
    effect; what was not run (W4A8 here) and what the suite cannot test are listed; the long run of a second model
    with no finished cell is a row saying so."""
    from bench.studies.paper_claims import main
    _claims_store(tmp_path / "s.sqlite", lrq_held=6.0, fr_held=6.6, lrq_ppl_shift=-0.05)
    obj = tmp_path / "objections"
    fr = {0: [5.0, 5.2, 5.1, 5.3], 15: [7.0, 7.3, 7.1, 7.2]}
    scale = lambda d, f, j=0.0: {b: [x * f + j * i for i, x in enumerate(w)] for b, w in d.items()}  # noqa: E731
    _objection_run(obj, "w3a16-flexround-lr1x", "flexround", fr)
    _objection_run(obj, "w3a16-flexround-lr0.5x", "flexround", scale(fr, 1.02), lr=5e-4)
    _objection_run(obj, "w3a16-lrq-lr1x", "lrq", scale(fr, 1.10, 0.01))         # FlexRound ahead at 1x
    _objection_run(obj, "w3a16-lrq-lr2x", "lrq", scale(fr, 0.90, 0.01), lr=2e-3)  # LRQ ahead at its best rate
    _objection_run(obj, "w3a16-lrq-lr1x-fp32product", "lrq", scale(fr, 1.10, 0.012), product="fp32")
    _objection_run(obj, "w4a8-flexround-lr1x", "flexround", fr, scheme="w4a8")         # W4A8: the authors' rates only
    _objection_run(obj, "w4a8-lrq-lr1x", "lrq", scale(fr, 1.10, 0.01), scheme="w4a8")
    from bench.run import ledger
    ledger.write(tmp_path / "gemma", {})                     # a long run that has not finished a cell
    assert main(["--results", str(tmp_path / "s.sqlite"), "--objections", str(obj), "--long", str(tmp_path / "gemma"),
                 "--out", str(tmp_path / "o")]) == 0
    md = (tmp_path / "o" / "claims.md").read_text()
    section = md[md.index("## What would change this verdict"):]
    assert md.rstrip().endswith(section.rstrip())          # the page's last section
    lr = next(ln for ln in section.splitlines() if ln.startswith("- Learning rate, W3A16"))
    assert "best rates so far LRQ 2x, FlexRound 1x" in lr and "rates run: LRQ 1x, 2x; FlexRound 0.5x, 1x" in lr
    assert re.search(r"block 0 0\.90\d \[0\.8\d\d, 0\.9\d\d\]", lr) and "LRQ separated ahead in 2, FlexRound in 0" in lr
    assert "So far the verdict changes: FlexRound ahead at the authors' rates, LRQ ahead at the best." in lr
    assert "Not yet run: lrq at 0.5x, 4x; flexround at 2x, 4x." in lr
    assert "| method | 0.5x | 1x | 2x |" in section and "| flexround | " in section
    prec = next(ln for ln in section.splitlines() if ln.startswith("- Precision, W3A16"))
    assert "float32 / in the autocast precision" in prec and "block 15 " in prec
    assert re.search(r"LRQ with the float32 product / FlexRound, both at the authors' rates: block 0 1\.1\d\d ", prec)
    assert prec.endswith("FlexRound in 2, not separated in 0 of 2 blocks; the verdict does not change")
    nt = section[section.index("**Not tested**"):]
    assert "learning rate at W4A8: only the authors' rates have run (LRQ / FlexRound held-out block error at 1x: " \
        "block 0 1.1" in nt and "the other rates (0.5x, 2x, 4x) go to objections/w4a8-<method>-lr<f>x/" in nt
    assert "- Learning rate, W4A8" not in section and "precision at W4A8" in nt and "C4 train" in nt
    assert "One model: row" in nt and "no cell of the long run in gemma has finished yet" in nt   # not yet tested
    html = (tmp_path / "o" / "claims.html").read_text()
    assert "<h2>What would change this verdict</h2>" in html and "<table>" in html.split("What would change")[1]
    # re-rendered from its JSON without the folder: the section is kept as it was
    assert main(["--from-json", str(tmp_path / "o" / "claims.json"), "--out", str(tmp_path / "re")]) == 0
    assert lr in (tmp_path / "re" / "claims.md").read_text()


def test_the_float32_product_can_change_the_verdict(tmp_path):
    """Where LRQ with its product in float32 overtakes FlexRound (both at the authors' rates), the precision line
    says the verdict changes."""
    from bench.studies.objections import answer
    fr = {0: [5.0, 5.2, 5.1, 5.3], 15: [7.0, 7.3, 7.1, 7.2]}
    scale = lambda d, f, j=0.0: {b: [x * f + j * i for i, x in enumerate(w)] for b, w in d.items()}  # noqa: E731
    _objection_run(tmp_path, "w4a8-flexround-lr1x", "flexround", fr, scheme="w4a8")
    _objection_run(tmp_path, "w4a8-lrq-lr1x", "lrq", scale(fr, 1.10, 0.01), scheme="w4a8")
    _objection_run(tmp_path, "w4a8-lrq-lr1x-fp32product", "lrq", scale(fr, 0.90, 0.01), product="fp32", scheme="w4a8")
    prec = next(t for t in answer(str(tmp_path))["tested"] if t.startswith("Precision, W4A8"))
    assert "LRQ separated ahead in 2, FlexRound in 0" in prec
    assert prec.endswith("the verdict changes: FlexRound ahead with the autocast product, LRQ ahead with float32")


def test_a_second_models_long_run_has_rows_of_its_own(tmp_path):
    """A long run of another model than the page's adds its rows, titled with the model, beside the page model's."""
    from bench.studies.paper_claims import main
    _claims_store(tmp_path / "s.sqlite", lrq_held=6.0, fr_held=6.6, lrq_ppl_shift=-0.05)
    _long_folder(tmp_path / "long", 0.05)
    _long_folder(tmp_path / "g", 0.05, model="gemma3-270m")
    assert main(["--results", str(tmp_path / "s.sqlite"), "--long", str(tmp_path / "long"), "--long",
                 str(tmp_path / "g"), "--out", str(tmp_path / "o")]) == 0
    by = {c["claim"]: c for c in json.loads((tmp_path / "o" / "claims.json").read_text())["claims"]}
    assert by["Results at W3A16, long preset"]["verdict"] == "does not hold"
    assert by["Results at W3A16, long preset, gemma3-270m"]["verdict"] == "does not hold"
    md = (tmp_path / "o" / "claims.md").read_text()
    assert "One model: row" in md and "Results at W3A16, long preset, gemma3-270m: does not hold" in md
