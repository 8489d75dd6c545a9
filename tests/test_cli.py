"""The CLI contract: bad input exits 2 with one paragraph; a run on a tiny model folder end to end,
reuse on the second run, `results --json` and `report`."""

import json
import os
import subprocess
import sys

import pytest

from bench.cli import main
from bench.evaluations.data import load_rows
from bench.common.store import ResultStore
from lrq.errors import UserError


def _run(args, capsys):
    code = main(args)
    out, err = capsys.readouterr()
    return code, out, err


@pytest.mark.parametrize("args, message", [
    (["run", "--schemes", "w5a9"], "unknown scheme 'w5a9'"),
    (["run", "--methods", "nope"], "unknown method 'nope'"),
    (["run", "--data-dir", "/definitely/not/here"], "data folder '/definitely/not/here'"),
    (["run", "--model", "does/not-exist"], "cannot load model 'does/not-exist'"),
    (["run", "--model", "missing.gguf"], "GGUF file 'missing.gguf' does not exist"),
    (["run", "--max-eval-tokens", "1"], "--max-eval-tokens must be at least 2"),
    (["run", "--bogus"], "unrecognized arguments"),
    (["report", "--results", "/nonexistent/r.sqlite"], "does not exist"),
])
def test_bad_input_exits_2_with_a_message(args, message, capsys):
    code, out, err = _run(args, capsys)
    assert code == 2
    assert message in err.replace("\n", " ")
    assert "Traceback" not in err


def test_console_script_exit_code_and_no_traceback(tmp_path):
    env = dict(os.environ, HF_HUB_OFFLINE="1")
    proc = subprocess.run([sys.executable, "-m", "bench.cli", "run", "--model", "does/not-exist", "--results",
                           str(tmp_path / "r.sqlite")], capture_output=True, text=True, env=env, timeout=300)
    assert proc.returncode == 2
    assert "cannot load model 'does/not-exist'" in proc.stderr.replace("\n", " ")
    assert "Traceback" not in proc.stderr


def test_missing_data_names_both_routes(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    with pytest.raises(UserError) as e:
        load_rows("wikitext2", tmp_path)
    msg = str(e.value)
    assert "wikitext2/wiki.test.raw" in msg and "--data-dir" in msg and "datasets.load_dataset" in msg
    with pytest.raises(UserError, match="no data folder given"):
        load_rows("c4", None)


@pytest.mark.heavy
def test_run_end_to_end_reuse_results_and_report(tiny_model_dir, data_dir, tmp_path, capsys):
    results = tmp_path / "r.sqlite"
    args = ["run", "--profile", "full", "--tasks", "none", "--model", str(tiny_model_dir), "--methods", "rtn", "--schemes", "w4a16,w8a8",
            "--datasets", "wikitext2,c4", "--data-dir", str(data_dir), "--results", str(results),
            "--max-eval-tokens", "1024", "--eval-seq-len", "256", "--calib-samples", "4", "--calib-seq-len", "64"]
    code, out, err = _run(args, capsys)
    assert code == 0, err
    assert "3 cells: 3 run, 0 reused" in err
    assert out.splitlines()[2].split()[0] == "fp" and max(len(l) for l in out.splitlines()) <= 120  # the summary
    assert _run(["report", "--results", str(results), "--out", str(tmp_path / "rep0")], capsys)[0] == 0
    md = (tmp_path / "rep0" / "leaderboard.md").read_text()
    lines = [l for l in md.splitlines() if l.startswith("| fp") or l.startswith("| rtn")]
    assert lines[0].startswith("| fp")  # FP row first in each table

    code, out, err = _run(["results", "--results", str(results), "--json"], capsys)
    rows = json.loads(out)
    ppl = {(r["method"], r["scheme"], r["dataset"]): r["value"] for r in rows if r["metric"] == "ppl"}
    assert set(ppl) == {(m, s, d) for m, s in [("fp", "fp"), ("rtn", "w4a16"), ("rtn", "w8a8")]
                        for d in ("wikitext2", "c4")}
    assert all(v > 1 for v in ppl.values())
    assert ppl[("rtn", "w4a16", "wikitext2")] != ppl[("fp", "fp", "wikitext2")]
    one = next(r for r in rows if r["method"] == "rtn" and r["scheme"] == "w8a8" and r["metric"] == "ppl")
    assert one["config"]["calibration"]["n_samples"] == 4 and one["config"]["eval"]["seq_len"] == 256
    assert one["versions"]["torch"] and one["hardware"]["cpu_count"] and one["git_rev"]
    assert one["wall_s"] > 0 and one["peak_mem_bytes"] > 0 and one["seed"] == 0
    n_rows = len(rows)

    code, out, err = _run(args, capsys)
    assert code == 0 and "3 cells: 0 run, 3 reused" in err
    code, out, err = _run(["results", "--results", str(results), "--json"], capsys)
    assert len(json.loads(out)) == n_rows  # nothing recomputed or duplicated

    code, out, err = _run(["report", "--results", str(results), "--out", str(tmp_path / "rep")], capsys)
    assert code == 0
    md = (tmp_path / "rep" / "leaderboard.md").read_text()
    assert "### Paired comparisons with FP and RTN" in md and "wikitext2 ppl vs FP" in md and "c4 ppl vs RTN" in md
    assert "| rtn      | w8a8" in md
    # the leaderboard: a summary and one table per scheme, each with the FP row first
    assert md.index("### Summary") < md.index("### Scheme w8a8") < md.index("### Scheme w4a16\n")
    w8a8 = md[md.index("### Scheme w8a8"):md.index("### Scheme w4a16\n")]
    table = [ln for ln in w8a8.splitlines() if ln.startswith("| ") and "---" not in ln]
    assert table[0].startswith("| method") and table[1].startswith("| fp ") and len(table) == 3, w8a8
    assert "WikiText-2 ppl" in table[0] and "C4 ppl" in table[0]
    assert "**" not in w8a8   # one quantized row: nothing to rank
    summary = md[md.index("### Summary"):md.index("### Scheme w8a8")]
    latest = {r.scheme: r.value for r in ResultStore(results).rows(latest=True)
              if r.method == "rtn" and r.dataset == "wikitext2" and r.metric == "ppl"}
    best, worse = sorted(latest.values())
    # bold only when the paired comparison with the runner-up separates them; else both marked tied
    from bench.evaluations import stats as S
    from bench.reports.report import cell_stats
    ranked = S.rank({k: v[("wikitext2", "ppl")] for k, v in cell_stats(ResultStore(results).rows(latest=True)).items()
                     if k[0] != "fp"}, True)
    rows = [[c.strip() for c in ln.strip("|").split("|")] for ln in summary.splitlines()
            if ln.startswith("| ") and "---" not in ln]
    col = rows[0].index("WikiText-2 ppl")
    ppl_cells = [r[col] for r in rows[1:] if r[0] == "rtn"]
    assert len(ppl_cells) == 2
    if ranked.status == "separated":
        assert any(c.startswith(f"**{best:.2f} (") for c in ppl_cells) and not any(c.startswith(f"**{worse:.2f}") for c in ppl_cells)
    else:
        assert ranked.status == "tied" and not any("**" in c for c in ppl_cells)
        assert all(c.endswith("~") for c in ppl_cells), ppl_cells
        assert "- WikiText-2 ppl: no separated best" in summary

    # a changed setting is a different cell: only the calibrated one reruns, and the leaderboard keeps both cells,
    # each named by what differs (before, the newer calibration's numbers replaced the older's under one name)
    code, out, err = _run(args[:-1] + ["32"], capsys)
    assert code == 0 and "3 cells: 1 run, 2 reused" in err
    assert _run(["report", "--results", str(results), "--out", str(tmp_path / "rep2")], capsys)[0] == 0
    md = (tmp_path / "rep2" / "leaderboard.md").read_text()
    w8a8 = md[md.index("### Scheme w8a8"):md.index("### Scheme w4a16\n")]
    named = sorted({ln.split("|")[1].strip() for ln in w8a8.splitlines() if ln.startswith("| rtn")})
    assert len(named) == 2 and all(n.startswith("rtn (calibration ") for n in named), named


def test_a_crash_in_a_later_evaluation_keeps_what_was_measured(tiny_model_dir, data_dir, tmp_path, capsys,
                                                                  monkeypatch):
    """Units are stored as they finish: a C4 evaluation that crashes loses neither the quantization unit
    nor the WikiText-2 result, and the rerun computes only what is missing."""
    import bench.run.cell as runner
    results = tmp_path / "r.sqlite"
    args = ["run", "--profile", "full", "--tasks", "none", "--jobs", "1", "--model", str(tiny_model_dir), "--methods", "rtn", "--schemes", "w4a16", "--no-fp",
            "--datasets", "wikitext2,c4", "--data-dir", str(data_dir), "--results", str(results),
            "--max-eval-tokens", "512", "--eval-seq-len", "256"]
    real = runner.perplexity

    def flaky(model, ids, *a, desc="", **kw):
        if desc.endswith("c4"):
            raise RuntimeError("simulated crash in hour three")
        return real(model, ids, *a, desc=desc, **kw)

    monkeypatch.setattr(runner, "perplexity", flaky)
    code, out, err = _run(args, capsys)
    assert code == 1 and "simulated crash" in err
    code, out, err = _run(["results", "--results", str(results), "--json"], capsys)
    kept = {(r["dataset"], r["metric"]) for r in json.loads(out)}
    assert ("quant", "bits_per_weight") in kept and ("wikitext2", "ppl") in kept
    assert not any(d == "c4" for d, _ in kept)

    monkeypatch.setattr(runner, "perplexity", real)
    code, out, err = _run(args, capsys)
    assert code == 0, err
    code, out, err = _run(["results", "--results", str(results), "--json"], capsys)
    rows = json.loads(out)
    assert sum(r["dataset"] == "wikitext2" and r["metric"] == "ppl" for r in rows) == 1   # not recomputed
    assert any(r["dataset"] == "c4" and r["metric"] == "ppl" for r in rows)


def test_export_command_round_trips(tiny_model_dir, data_dir, tmp_path, capsys):
    import torch
    from lrq.export import load_compressed
    out = tmp_path / "exp"
    code, _, err = _run(["export", "--model", str(tiny_model_dir), "--method", "rtn", "--scheme", "w4a16",
                         "--out", str(out), "--data-dir", str(data_dir)], capsys)
    assert code == 0, err
    assert "written to" in err and (out / "model.safetensors").is_file() and (out / "tokenizer.json").is_file()
    model = load_compressed(out)
    with torch.no_grad():
        assert torch.isfinite(model(torch.randint(0, 100, (1, 8))).logits).all()
    code, _, err = _run(["export", "--model", str(tiny_model_dir), "--method", "rtn", "--scheme", "w4a16-g128",
                         "--out", str(tmp_path / "x"), "--data-dir", str(data_dir)], capsys)
    assert code == 2 and "group size 128" in err   # bad input: a clear message, exit 2


def test_task_accuracy_through_lm_eval(tiny_model_dir, data_dir, tmp_path, capsys):
    """lm-eval scores the quantized model object on the offline task files; rows, average and report."""
    results = tmp_path / "r.sqlite"
    args = ["run", "--profile", "full", "--model", str(tiny_model_dir), "--methods", "rtn", "--schemes", "w4a16", "--datasets", "wikitext2",
            "--data-dir", str(data_dir), "--results", str(results), "--max-eval-tokens", "512", "--eval-seq-len", "256",
            "--tasks", "zeroshot", "--task-limit", "3"]
    code, out, err = _run(args + ["--out", str(tmp_path / "rep")], capsys)
    assert code == 0, err
    out = (tmp_path / "rep" / "leaderboard.md").read_text()
    assert "### Task accuracy (lm-eval)" in out and "zero-shot avg" in out and "first 3 examples" in out
    code, out, _ = _run(["results", "--results", str(results), "--json"], capsys)
    rows = json.loads(out)
    acc = {(r["method"], r["dataset"], r["metric"]): r for r in rows}
    for task in ("piqa", "arc_easy", "arc_challenge", "hellaswag", "winogrande", "boolq", "openbookqa"):
        r = acc[("rtn", task, "acc")]
        assert 0 <= r["value"] <= 1 and r["config"]["n_examples"] == 3
        assert r["config"]["tasks"]["add_bos_token"] is False and r["config"]["tasks"]["batch_size"] == 1
    assert ("fp", "zeroshot_avg", "acc") in acc
    code, _, err = _run(args[:-4] + ["--tasks", "nope"], capsys)
    assert code == 2 and "unknown task" in err


def test_the_rough_edges_a_new_user_met(tiny_model_dir, data_dir, tmp_path, capsys):
    """results has a header and formats; report prints both paths; run --help lists what can be chosen;
    a cell left without evaluation by an interrupted run is not a row of dashes; one window is not 'stored
    before per-window data were kept'."""
    import csv
    import io
    results = tmp_path / "r.sqlite"
    assert main(["run", "--profile", "full", "--tasks", "none", "--model", str(tiny_model_dir), "--methods", "rtn",
                 "--schemes", "w4a16,w3a16", "--datasets", "wikitext2", "--data-dir", str(data_dir), "--results",
                 str(results), "--max-eval-tokens", "256", "--eval-seq-len", "256", "--jobs", "1"]) == 0
    capsys.readouterr()
    code, out, _ = _run(["results", "--results", str(results)], capsys)
    assert code == 0 and out.splitlines()[0].split()[:6] == ["model", "method", "scheme", "precision", "dataset", "metric"]
    code, out, _ = _run(["results", "--results", str(results), "--format", "csv"], capsys)
    rows = list(csv.DictReader(io.StringIO(out)))
    assert code == 0 and {r["metric"] for r in rows} >= {"ppl", "kld", "bits_per_weight"}
    # an interrupted run: the quant unit of a cell stored, none of its evaluation
    from bench.common.store import ResultStore, Row
    prec = ResultStore(results).rows()[0].config["precision"]   # the run's own (bf16 or fp32, by the CPU)
    ResultStore(results).write_unit([Row(str(tiny_model_dir), "gptq", "w4a16", "quant", "bits_per_weight", 4.2,
                                         {"precision": prec})], "x")
    code, out, _ = _run(["report", "--results", str(results), "--out", str(tmp_path / "rep")], capsys)
    assert code == 0 and out.split() == [str(tmp_path / "rep" / "leaderboard.md"), str(tmp_path / "rep" / "leaderboard.html")]
    md = (tmp_path / "rep" / "leaderboard.md").read_text()
    summary = md.split("### Summary")[1].split("###")[0]
    assert "| gptq " not in summary and "Not shown: gptq w4a16" in summary
    assert "- wikitext2: 1 window of 256 tokens" in md
    assert "measured on 1 window or example only" in md and "stored before per-window" not in md
    with pytest.raises(SystemExit):
        main(["run", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    for word in ("methods: awq, flexround, gptq, lrq", "w4a16-g64", "profiles: sweep", "first-look",
                 "built-in models: smollm2-135m", "32 for sweep and first-look", "--precision"):
        assert word in text, word
