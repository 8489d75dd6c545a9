"""The local executor: cells in worker processes give exactly the in-process results, the driver stores
every unit, and a failing or dying worker is reported while the other cells complete."""

from __future__ import annotations

import multiprocessing as mp
import os
import re
import signal
from pathlib import Path

import pytest

from bench.cli import main
from bench.run.executor import LocalExecutor
from bench.run.cell import FP, CalibSettings, EvalSettings, Request, execute, settle
from bench.run.sweep import run_cells
from bench.common.store import ResultStore
from lrq.errors import UserError


def _cells(model_dir, data_dir, methods_schemes, **kw):
    common = dict(model=str(model_dir), datasets=("wikitext2",), eval=EvalSettings(256, False, kw.pop("tokens", 1024)),
                  calib=CalibSettings(n_samples=6, seq_len=32), data_dir=str(data_dir))
    return [settle(Request(method=m, scheme=s, **common, **kw)) for m, s in methods_schemes]


def _values(store: ResultStore) -> dict:
    return {(r.method, r.scheme, r.dataset, r.metric): r.value for r in store.rows()
            if r.metric in ("ppl", "bits_per_weight", "n_learnable", "mean_block_calib_after")}


CELLS = [(FP, FP), ("rtn", "w4a16"), ("rtn", "w8a8"), ("lrq", "w3a16")]


@pytest.mark.heavy
def test_two_workers_give_exactly_the_in_process_results(tiny_model_dir, data_dir, tmp_path):
    over = {"iters": 3, "heldout_samples": 2}
    one, two = ResultStore(tmp_path / "one.sqlite"), ResultStore(tmp_path / "two.sqlite")
    out1 = run_cells(_cells(tiny_model_dir, data_dir, CELLS, overrides=over), one, executor=LocalExecutor(1))
    out2 = run_cells(_cells(tiny_model_dir, data_dir, CELLS, overrides=over), two, executor=LocalExecutor(2, threads=1))
    assert [o.status for o in out1] == [o.status for o in out2] == ["done"] * len(CELLS)
    v1, v2 = _values(one), _values(two)
    assert len(v1) >= 9 and v1 == v2   # bit-identical numbers, every unit stored by the driver
    # a second run finds every unit in the store and starts no worker
    again = run_cells(_cells(tiny_model_dir, data_dir, CELLS, overrides=over), two, executor=LocalExecutor(2))
    assert [o.status for o in again] == ["reused"] * len(CELLS)


@pytest.mark.heavy
def test_a_failing_cell_is_reported_and_the_others_complete(tiny_model_dir, data_dir, tmp_path, capsys):
    results = tmp_path / "r.sqlite"
    # a learning rate of 1e30 makes LRQ's loss infinite after one step: a run-time failure of that cell only
    code = main(["run", "--profile", "full", "--tasks", "none", "--jobs", "2", "--model", str(tiny_model_dir),
                 "--methods", "rtn,lrq", "--schemes", "w4a16", "--datasets", "wikitext2", "--data-dir", str(data_dir),
                 "--results", str(results), "--max-eval-tokens", "512", "--eval-seq-len", "256", "--calib-samples", "6",
                 "--calib-seq-len", "32", "--set", "iters=3", "--set", "heldout_samples=2", "--set", "lr=1e30"])
    err = capsys.readouterr().err
    assert code == 1, err
    assert "FAILED" in err and "lrq w4a16" in err and "reconstruction loss became" in err
    assert "2 at a time" in err and "1 failed" in err
    # the workers' own output went to one file per cell, named in the failure report
    logged = re.search(r"worker output: (\S+\.log)", err)
    assert logged and Path(logged.group(1)).is_file() and "lrq-w4a16" in logged.group(1)
    stored = {(r.method, r.dataset) for r in ResultStore(results).rows() if r.metric == "ppl"}
    assert stored == {(FP, "wikitext2"), ("rtn", "wikitext2")}


class _KillOnFirstUnit:
    """A sink that SIGKILLs the worker of the cell with `scheme` as soon as that cell's first unit arrives."""

    def __init__(self, scheme: str):
        self.scheme, self.units, self.outcomes = scheme, [], {}

    def unit(self, job, unit, rows):
        self.units.append((job.cell.scheme_name, unit))
        if job.cell.scheme_name == self.scheme and unit == "quant":
            for p in mp.active_children():
                if p.name.endswith(job.cell.label()):
                    os.kill(p.pid, signal.SIGKILL)

    def done(self, job, wall_s):
        self.outcomes[job.cell.scheme_name] = "done"

    def failed(self, job, error):
        self.outcomes[job.cell.scheme_name] = error


@pytest.mark.heavy
def test_a_worker_that_dies_is_reported_and_the_other_cell_completes(tiny_model_dir, data_dir):
    from bench.run.executor import Job
    # the whole WikiText-2 test text: the evaluation lasts long enough for the kill to land first
    cells = _cells(tiny_model_dir, data_dir, [("rtn", "w4a16"), ("rtn", "w3a16")], tokens=None)
    jobs = [Job(i, s, frozenset({"quant", "wikitext2"})) for i, s in enumerate(cells)]
    sink = _KillOnFirstUnit("w3a16")
    LocalExecutor(2, threads=1).run(jobs, sink, execute)
    assert "the worker process died (killed by signal 9)" in sink.outcomes["w3a16"]
    assert sink.outcomes["w4a16"] == "done"
    assert ("w3a16", "quant") in sink.units and ("w3a16", "wikitext2") not in sink.units
    assert ("w4a16", "wikitext2") in sink.units
    assert not mp.active_children()


def test_bad_input_inside_a_worker_stops_the_run_with_its_message(tiny_model_dir, data_dir, tmp_path):
    # run_cells directly, without the CLI's checks before any work: the calibration pool is too small for
    # 100,000 windows, which only the worker finds out
    common = dict(model=str(tiny_model_dir), datasets=("wikitext2",), eval=EvalSettings(256, False, 1024),
                  calib=CalibSettings(n_samples=100_000, seq_len=32), data_dir=str(data_dir))
    cells = [settle(Request(method=m, scheme="w8a8", **common)) for m in ("rtn", "smoothquant")]
    with pytest.raises(UserError, match=r"asked for 100000"):
        run_cells(cells, ResultStore(tmp_path / "r.sqlite"), executor=LocalExecutor(2, threads=1))
    assert not mp.active_children()


def test_jobs_and_profiles_are_validated(capsys):
    for args, msg in ((["--jobs", "0"], "--jobs must be a positive integer"),
                      (["--jobs", "many"], "--jobs must be a positive integer"),
                      (["--profile", "huge"], "unknown profile 'huge'")):
        assert main(["run", *args]) == 2
        assert msg in capsys.readouterr().err.replace("\n", " ")


@pytest.mark.heavy
def test_first_look_profile_runs_every_scheme_with_tasks_in_workers(tiny_model_dir, data_dir, tmp_path, capsys):
    results = tmp_path / "r.sqlite"
    code = main(["run", "--profile", "first-look", "--model", str(tiny_model_dir), "--data-dir", str(data_dir),
                 "--results", str(results), "--eval-seq-len", "256", "--task-limit", "2", "--jobs", "2",
                 "--schemes", "w8a8,w4a8,w4a16", "--out", str(tmp_path / "rep")])  # g128 does not fit 64 columns
    err = capsys.readouterr().err
    assert code == 0, err
    assert "profile first-look, 4 cells (4 to compute, 0 already stored), 2 at a time" in err
    # the planner's estimate is printed before any cell runs, and the bar shows stages inside cells
    assert err.index("lrq-bench: estimate on this machine") < err.index("cells 1/4")
    assert "CPU-process-hours of work, about" in err
    # (which cell's window or task shows depends on how fast the machine is: updates are sent twice a second)
    assert re.search(r"(rtn [\w-]+|fp fp): ((wikitext2|c4) window \d+/\d+|tasks \d+/~\d+ forwards)", err), err[-2000:]
    assert "ETA after the first unit" in err             # no ETA before a first unit has finished
    rows = ResultStore(results).rows()
    cells = {(r.method, r.scheme) for r in rows}
    assert cells == {(FP, FP)} | {("rtn", s) for s in ("w8a8", "w4a8", "w4a16")}
    ppl = [r for r in rows if r.metric == "ppl"]
    assert len(ppl) == 8 and all(r.config["eval"]["max_tokens"] == 16384 for r in ppl)
    avg = [r for r in rows if r.dataset == "zeroshot_avg"]
    assert len(avg) == 4 and all(r.config["tasks"]["limit"] == 2 for r in avg)
    w8a8 = next(r for r in rows if r.scheme == "w8a8" and r.metric == "ppl")
    assert w8a8.config["calibration"]["n_samples"] == 32   # the profile's calibration size
    assert (tmp_path / "rep" / "leaderboard.md").is_file() and (tmp_path / "rep" / "leaderboard.html").is_file()
    # every stage's price, as announced, is stored with the stage's result, beside the time it took
    from bench.reports.report import planned_vs_measured
    planned = [r for r in rows if r.metric == "planned_time_s"]
    assert {(r.method, r.scheme, r.config["planned"]["stage"]) for r in planned} == {
        (m, s, st) for m, s in cells for st in ("quant", "wikitext2", "c4", "tasks")}
    assert all(r.config["planned"]["workers"] == 2 and r.config["planned"]["machine"] for r in planned)
    assert all(r.value > 0 for r in planned if r.method != FP or r.config["planned"]["stage"] != "quant")
    pv = planned_vs_measured(rows)
    assert len(pv) == len(planned) == 16
    for p in pv:
        if p["method"] == FP and p["stage"] == "quant":
            assert p["measured_s"] is None          # the FP reference quantizes nothing: no time to compare
        else:
            assert p["measured_s"] > 0 and p["ratio"] == pytest.approx(p["measured_s"] / p["planned_s"])
    # the quantization's memory estimate too, beside the peak measured in the worker: the estimate counts the
    # worker's own interpreter and libraries, without which it was 50-100x low on a model this small
    quant = [p for p in pv if p["stage"] == "quant" and p["method"] != FP]
    assert len(quant) == 3
    for p in quant:
        assert 0.5 <= p["measured_host_bytes"] / p["planned_host_bytes"] <= 3, p
    md = (tmp_path / "rep" / "leaderboard.md").read_text()
    assert "### Planned and measured time" in md and "stages within 25 % of their estimate" in md
    assert "host memory: planned / measured" in md and re.search(r"\| \d+\.\d\d / \d+\.\d\d GiB \(\d", md)
    assert "| tasks " not in md.split("### Planned and measured time")[0]   # a price alone is not a text


@pytest.mark.skipif(__import__("torch").cuda.is_available(), reason="checks the message on a machine without CUDA")
def test_asking_for_cuda_without_a_gpu_is_bad_input(capsys):
    assert main(["run", "--device", "cuda"]) == 2
    assert "no CUDA device is visible here" in capsys.readouterr().err.replace("\n", " ")
