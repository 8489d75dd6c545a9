"""The Ray executor on a real local cluster (2 CPUs, separate worker processes, not local mode): the same
results as the local executor, the driver stores every unit, a failing cell is retried and then reported
while the others complete."""

from __future__ import annotations

import pytest

from bench.cli import main
from bench.run.executor import LocalExecutor, RayExecutor
from bench.run.cell import FP
from bench.run.sweep import run_cells
from bench.common.store import ResultStore
from test_executor import CELLS, _cells, _values

ray = pytest.importorskip("ray")   # a dev dependency: present wherever the suite is meant to run


@pytest.fixture(scope="module")
def cluster():
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, object_store_memory=100 * 2**20)
    yield
    ray.shutdown()


@pytest.mark.heavy
def test_ray_sweep_gives_exactly_the_local_results(cluster, tiny_model_dir, data_dir, tmp_path):
    over = {"iters": 3, "heldout_samples": 2}
    local, remote = ResultStore(tmp_path / "local.sqlite"), ResultStore(tmp_path / "ray.sqlite")
    out_l = run_cells(_cells(tiny_model_dir, data_dir, CELLS, overrides=over), local, executor=LocalExecutor(2, threads=1))
    ex = RayExecutor(retries=1)
    out_r = run_cells(_cells(tiny_model_dir, data_dir, CELLS, overrides=over), remote, executor=ex)
    assert [o.status for o in out_l] == [o.status for o in out_r] == ["done"] * len(CELLS)
    assert ex.jobs == 2                                   # two 1-CPU cells at a time on the 2-CPU cluster
    assert ex.max_running <= 2, ex.max_running            # and never more (a cell blocked in ray.get frees its CPU)
    vl, vr = _values(local), _values(remote)
    assert len(vl) >= 9 and vl == vr
    assert ray.is_initialized()                           # a cluster it did not start is left running


@pytest.mark.heavy
def test_a_failing_cell_is_retried_then_reported_while_the_others_complete(cluster, tiny_model_dir, data_dir,
                                                                          tmp_path, capsys):
    results = tmp_path / "r.sqlite"
    code = main(["run", "--profile", "full", "--tasks", "none", "--executor", "ray", "--retries", "1",
                 "--model", str(tiny_model_dir), "--methods", "rtn,lrq", "--schemes", "w4a16", "--datasets", "wikitext2",
                 "--data-dir", str(data_dir), "--results", str(results), "--max-eval-tokens", "512",
                 "--eval-seq-len", "256", "--calib-samples", "6", "--calib-seq-len", "32",
                 "--set", "iters=3", "--set", "heldout_samples=2", "--set", "lr=1e30"])
    err = capsys.readouterr().err
    assert code == 1, err
    assert "on Ray (a local cluster)" in err
    assert "FAILED" in err and "lrq w4a16" in err and "reconstruction loss became" in err and "after 2 attempts" in err
    stored = {(r.method, r.dataset) for r in ResultStore(results).rows() if r.metric == "ppl"}
    assert stored == {(FP, "wikitext2"), ("rtn", "wikitext2")}
