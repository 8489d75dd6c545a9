"""Long runs carried between machines (bench/run/ledger.py): the results file, checkpoints without their streams,
and `run --sync DIR` continuing on a machine whose cache is gone."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from bench.run import ledger
from bench.cli import main
from bench.common.store import ResultStore, Row
from conftest import ROOT, cache_with_measurements, tiny_model
from lrq.errors import UserError

QUICK = ["--profile", "full", "--tasks", "none", "--datasets", "wikitext2", "--max-eval-tokens", "512",
         "--eval-seq-len", "256", "--calib-samples", "4", "--calib-seq-len", "64"]


def _calib(n=6):
    from lrq.methods import Calibration
    return Calibration(torch.randint(0, 128, (n, 24), generator=torch.Generator().manual_seed(1)), {"seed": 0})


def _tensors(model):
    return {k: v.clone() for k, v in model.state_dict().items() if torch.is_tensor(v)}


# ---- a checkpoint without its streams resumes to exactly the uninterrupted result ---------------------------

@pytest.mark.parametrize("method,scheme", [("lrq", "w3a16"), ("flexround", "w4a8"), ("omniquant", "w4a8"),
                                           ("gptq", "w3a16"), ("gptq", "w8a8"), ("awq", "w4a8"), ("awq", "w3a16-float")])
def test_a_checkpoint_without_streams_resumes_to_the_uninterrupted_result(method, scheme, tmp_path, monkeypatch):
    """LRQ, FlexRound, OmniQuant and (since 2026-12-04) GPTQ and AWQ, whose long cells are hours on a CPU: killed
    after block 1, their carried blocks resume to the uninterrupted result bit for bit (AWQ with both chains)."""
    from lrq import blockwise
    from lrq.methods import get_method
    from lrq.schemes import get_scheme
    cfg = {"iters": 4, "heldout_samples": 2} if method in ("lrq", "flexround", "omniquant") else {}
    if scheme.endswith("-float"):
        scheme, cfg = scheme[:-len("-float")], {"chain": "float"}
    m = get_method(method)
    full = tiny_model("llama", layers=3)
    m.quantize(full, get_scheme(scheme), m.config("quick", cfg), _calib())
    reference = _tensors(full)

    saved: list[dict] = []
    real_save = blockwise.BlockCheckpoint.save

    def save_then_crash(self, index, block, q_next, fp_next, stats):
        real_save(self, index, block, q_next, fp_next, stats)
        saved.append({"q": q_next.clone(), "fp": None if fp_next is None else fp_next.clone()})
        if index == 1:
            raise KeyboardInterrupt   # killed right after block 1 was checkpointed

    monkeypatch.setattr(blockwise.BlockCheckpoint, "save", save_then_crash)
    ckpt = tmp_path / "ckpt"
    m2 = get_method(method, checkpoint_dir=ckpt)
    assert m2.checkpoints
    with pytest.raises(KeyboardInterrupt):
        m2.quantize(tiny_model("llama", layers=3), get_scheme(scheme), m2.config("quick", cfg), _calib())
    monkeypatch.setattr(blockwise.BlockCheckpoint, "save", real_save)
    streams = list(ckpt.glob("streams-*.npy"))
    assert streams
    for f in streams:
        f.unlink()                                # what a carried checkpoint lacks

    replayed = {}
    real_replay = blockwise.replay_streams

    def spy(layers, states, restore, q_in, fp_in, fp_out, *a):
        out = real_replay(layers, states, restore, q_in, fp_in, fp_out, *a)
        replayed["q"] = q_in.data.clone()
        replayed["fp"] = None if out[0] is None else out[0].data.clone()
        return out

    monkeypatch.setattr(blockwise, "replay_streams", spy)
    resumed = tiny_model("llama", layers=3)
    restored = []
    real_completed = blockwise.BlockCheckpoint.completed
    monkeypatch.setattr(blockwise.BlockCheckpoint, "completed",
                        lambda self: restored.append(real_completed(self)) or restored[-1])
    stats = m2.quantize(resumed, get_scheme(scheme), m2.config("quick", cfg), _calib())
    assert replayed, "the walk did not recompute the missing streams"
    assert restored == [2] and stats["resumed_blocks"] == 2   # every checkpointing method says so
    assert stats["blocks_time_s"] > 0                          # and sums the carried blocks' times too
    # the recomputed streams are the ones the interrupted walk saved, bit for bit
    assert torch.equal(replayed["q"], saved[1]["q"])
    assert (replayed["fp"] is None) == (saved[1]["fp"] is None)
    if replayed["fp"] is not None:
        assert torch.equal(replayed["fp"], saved[1]["fp"])
    after = _tensors(resumed)
    assert after.keys() == reference.keys()
    assert all(torch.equal(after[k], reference[k]) for k in reference), "resumed result differs"


# ---- the results file ---------------------------------------------------------------------------------------

def _unit(store, key, value=1.5, method="rtn", metric="ppl"):
    rows = [Row("m", method, "w4a16", "wikitext2", metric, value, config={"calib": {"n": 4}}, seed=0,
                versions={"torch": "x"}, git_rev="abc", hardware={"cpu": "AMD EPYC", "cpu_bf16_flags": "avx512_bf16"},
                wall_s=2.0),
            Row("m", method, "w4a16", "wikitext2", "ppl_ci_high", value + 1, config={"calib": {"n": 4}}, seed=0,
                versions={"torch": "x"}, git_rev="abc", hardware={"cpu": "AMD EPYC"}, wall_s=2.0)]
    store.write_unit(rows, key)


def test_results_file_round_trip_keeps_every_field(tmp_path):
    a = ResultStore(tmp_path / "a.sqlite")
    _unit(a, "a" * 64)
    _unit(a, "b" * 64, value=3.0, method="gptq")
    path, n = ledger.save(a, tmp_path / "carry")
    assert n == 2 and path.name == "results.jsonl"
    lines = path.read_text().splitlines()
    assert json.loads(lines[0]) == {"format": ledger.FORMAT, "version": ledger.VERSION, "units": 2, "rows": 4}
    b = ResultStore(tmp_path / "b.sqlite")
    assert ledger.load_into(b, tmp_path / "carry") == (2, 0)
    assert ledger.load_into(b, tmp_path / "carry") == (0, 2)      # nothing twice
    order = lambda rows: sorted((dict(r.__dict__) for r in rows), key=lambda d: (d["unit_key"], d["metric"]))  # noqa: E731
    assert order(a.rows()) == order(b.rows())   # every field, run ids and times too
    # saving again adds nothing and keeps the file byte for byte (no noise in a commit's diff)
    before = path.read_bytes()
    ledger.save(b, tmp_path / "carry")
    assert path.read_bytes() == before


def test_a_unit_recomputed_with_force_travels_as_its_newest_measurement(tmp_path):
    a = ResultStore(tmp_path / "a.sqlite")
    _unit(a, "c" * 64, value=1.0)
    time.sleep(1.1)
    _unit(a, "c" * 64, value=2.0)   # the same unit stored again by a --force run
    ledger.save(a, tmp_path / "carry")
    units = ledger.read(tmp_path / "carry")
    assert [r.value for r in units["c" * 64] if r.metric == "ppl"] == [2.0]


@pytest.mark.parametrize("damage,match", [
    (lambda ls: ls[:-1], "header says 2 units"),
    (lambda ls: ls[:1] + [ls[1][:40]] + ls[2:], "not JSON"),
    (lambda ls: ls[:1] + [ls[1].replace('"value":1.5', '"value":NaN')] + ls[2:], "not a finite number"),
    (lambda ls: ls[:1] + [ls[1].replace('"value":1.5', '"value":"1.5"')] + ls[2:], "not a finite number"),
    (lambda ls: ['{"format": "something else"}'] + ls[1:], "not an lrq-bench results file"),
    (lambda ls: ls[:1] + [ls[1].replace('"unit":"', '"unit":"zz')] + ls[2:], "not a unit key"),
    (lambda ls: ls[:1] + [ls[1], ls[1]], "appears twice"),
    (lambda ls: [], "is empty"),
])
def test_a_damaged_results_file_is_refused_before_anything_is_imported(damage, match, tmp_path):
    a = ResultStore(tmp_path / "a.sqlite")
    _unit(a, "a" * 64)
    _unit(a, "b" * 64, method="gptq")
    path, _ = ledger.save(a, tmp_path / "carry")
    lines = path.read_text().splitlines()
    path.write_text("\n".join(damage(lines)) + ("\n" if damage(lines) else ""))
    b = ResultStore(tmp_path / "b.sqlite")
    with pytest.raises(UserError, match=match):
        ledger.load_into(b, path)
    assert b.rows() == []


def test_results_save_from_the_command_line(tmp_path, capsys):
    a = ResultStore(tmp_path / "a.sqlite")
    _unit(a, "a" * 64)
    _unit(a, "b" * 64, method="gptq")
    assert main(["results", "--results", str(a.path), "--save", str(tmp_path / "carry"), "--methods", "gptq"]) == 0
    assert "1 unit(s)" in capsys.readouterr().out
    assert [r[0].method for r in ledger.read(tmp_path / "carry").values()] == ["gptq"]


# ---- run --sync: a machine whose cache is gone continues from the committed folder ---------------------------

def _env(cache: Path) -> dict:
    return dict(os.environ, LRQ_BENCH_CACHE=str(cache), PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1")


def test_run_sync_continues_a_cell_on_a_fresh_machine(tiny_model_dir, data_dir, tmp_path):
    carry = tmp_path / "committed"
    base = [sys.executable, "-m", "bench.cli", "run", *QUICK, "--model", str(tiny_model_dir), "--methods", "lrq",
            "--schemes", "w3a16", "--data-dir", str(data_dir), "--jobs", "1", "--sync", str(carry),
            "--set", "heldout_samples=1", "--set", "iters=300"]
    machine_a = cache_with_measurements(tmp_path / "cache-a")
    proc = subprocess.Popen(base + ["--results", str(tmp_path / "a.sqlite")], cwd=ROOT, env=_env(machine_a),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    state = None
    try:   # machine A finishes block 0 of 2, carries it, and is taken away while training block 1
        end = time.monotonic() + 600
        while time.monotonic() < end and proc.poll() is None:
            found = list((carry / "checkpoints").glob("*/state.json"))
            if found and json.loads(found[0].read_text()).get("done") == 1:
                state = found[0]
                break
            time.sleep(0.5)
        assert state is not None, "no block was carried"
        proc.kill()
        proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert not any(r[0].method == "lrq" for r in ledger.read(carry).values())   # nothing of the cell stored
    assert list(state.parent.glob("block0000.safetensors.xz"))
    assert not list(state.parent.glob("streams*"))                   # the streams never travel

    # machine B: a new cache, a new store, the committed folder
    machine_b = cache_with_measurements(tmp_path / "cache-b")
    done = subprocess.run(base + ["--results", str(tmp_path / "b.sqlite")], cwd=ROOT, env=_env(machine_b),
                          capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-2000:]
    rows = ResultStore(tmp_path / "b.sqlite").rows()
    assert [r.value for r in rows if r.metric == "resumed_blocks"] == [1.0]   # resumed at block 1, not restarted
    # priced as resumed: the estimate left out the carried block, said so, and stored it with the stage's price
    assert "lrq w3a16's first 1 blocks" in " ".join(done.stderr.split()), done.stderr[-2000:]
    planned = [r for r in rows if r.metric == "planned_time_s" and r.dataset == "quant" and r.method == "lrq"]
    assert [r.config["planned"].get("done_blocks") for r in planned] == [1]
    assert not (carry / "checkpoints" / state.parent.name).exists()       # dropped once the cell is done
    units = ledger.read(carry)
    assert {r[0].method for r in units.values()} == {"fp", "lrq"}
    # a third machine computes nothing
    again = subprocess.run(base + ["--results", str(tmp_path / "c.sqlite")], cwd=ROOT,
                           env=_env(cache_with_measurements(tmp_path / "cache-c")), capture_output=True, text=True, timeout=600)
    assert again.returncode == 0 and "0 to compute" in " ".join(again.stderr.split()), again.stderr[-2000:]


# ---- the long preset is the long preset under the default profile ---------------------------------------------

class _Captured(Exception):
    pass


@pytest.mark.parametrize("preset,iters,n,seq", [("long", 1000, 128, 1024), ("quick", 20, 32, 512)])
def test_a_preset_keeps_its_steps_and_calibration_under_the_default_profile(preset, iters, n, seq, tiny_model_dir,
                                                                            data_dir, tmp_path, monkeypatch):
    """The sweep profile sizes the quick preset (20 steps, 32 windows); `--preset long` used to get them too,
    silently, and a '1,000-step' cell trained 20 steps per block."""
    import bench.run.sweep

    def capture(cells, *a, **k):
        raise _Captured(cells)

    monkeypatch.setattr(bench.run.sweep, "run_cells", capture)
    monkeypatch.setattr("bench.cli._announce_estimate", lambda *a, **k: None)
    with pytest.raises(_Captured) as got:
        main(["run", "--preset", preset, "--model", str(tiny_model_dir), "--methods", "lrq", "--schemes", "w3a16",
              "--no-fp", "--tasks", "none", "--datasets", "wikitext2", "--max-eval-tokens", "512",
              "--eval-seq-len", "256", "--data-dir", str(data_dir), "--results", str(tmp_path / "r.sqlite")])
    (cell,) = got.value.args[0]
    assert cell.resolved["iters"] == iters
    assert (cell.calib.n_samples, cell.calib.seq_len) == (n, seq)
