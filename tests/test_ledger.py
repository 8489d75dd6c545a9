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

def _identity(method="rtn", tag="a"):
    return {"schema": 1, "model": "folder:sha256:0123456789abcdef", "method": method, "scheme": "w4a16", "config": {},
            "seed": 0, "dataset": "wikitext2", "data": "sha256:" + tag * 8, "eval": {"seq_len": 256}}


def _unit(store, tag="a", value=1.5, method="rtn", identity=None, run_id=None):
    """A unit as `run` stores it: its rows carry the identity its key hashes. Returns the key."""
    from bench.common.store import unit_key
    ident = identity or _identity(method, tag)
    key = unit_key(ident)
    cfg = {"model": "m", "calib": {"n": 4}, "method_config": {}, "identity": ident}
    rows = [Row("m", method, "w4a16", "wikitext2", "ppl", value, config=cfg, seed=0,
                versions={"torch": "x"}, git_rev="abc", hardware={"cpu": "AMD EPYC", "cpu_bf16_flags": "avx512_bf16"},
                wall_s=2.0),
            Row("m", method, "w4a16", "wikitext2", "eval_tokens_per_s", value + 1, config=cfg, seed=0,
                versions={"torch": "x"}, git_rev="abc", hardware={"cpu": "AMD EPYC"}, wall_s=2.0)]
    store.write_unit(rows, key, run_id)
    return key


def test_results_file_round_trip_keeps_every_field(tmp_path):
    a = ResultStore(tmp_path / "a.sqlite")
    _unit(a, "a")
    _unit(a, "b", value=3.0, method="gptq")
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
    key = _unit(a, "c", value=1.0)
    time.sleep(1.1)
    _unit(a, "c", value=2.0)   # the same unit stored again by a --force run
    ledger.save(a, tmp_path / "carry")
    units = ledger.read(tmp_path / "carry")
    assert [r.value for r in units[key] if r.metric == "ppl"] == [2.0]


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
    _unit(a, "a")
    _unit(a, "b", method="gptq")
    path, _ = ledger.save(a, tmp_path / "carry")
    lines = path.read_text().splitlines()
    path.write_text("\n".join(damage(lines)) + ("\n" if damage(lines) else ""))
    b = ResultStore(tmp_path / "b.sqlite")
    with pytest.raises(UserError, match=match):
        ledger.load_into(b, path)
    assert b.rows() == []


def test_results_save_from_the_command_line(tmp_path, capsys):
    a = ResultStore(tmp_path / "a.sqlite")
    _unit(a, "a")
    _unit(a, "b", method="gptq")
    assert main(["results", "--results", str(a.path), "--save", str(tmp_path / "carry"), "--methods", "gptq"]) == 0
    assert "1 unit(s)" in capsys.readouterr().out
    assert [r[0].method for r in ledger.read(tmp_path / "carry").values()] == ["gptq"]


# ---- run --sync: a machine whose cache is gone continues from the committed folder ---------------------------

def _env(cache: Path) -> dict:
    return dict(os.environ, LRQ_BENCH_CACHE=str(cache), PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1")


@pytest.mark.heavy
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
    monkeypatch.setattr("bench.cli.run._announce_estimate", lambda *a, **k: None)
    with pytest.raises(_Captured) as got:
        main(["run", "--preset", preset, "--model", str(tiny_model_dir), "--methods", "lrq", "--schemes", "w3a16",
              "--no-fp", "--tasks", "none", "--datasets", "wikitext2", "--max-eval-tokens", "512",
              "--eval-seq-len", "256", "--data-dir", str(data_dir), "--results", str(tmp_path / "r.sqlite")])
    (cell,) = got.value.args[0]
    assert cell.resolved["iters"] == iters
    assert (cell.calib.n_samples, cell.calib.seq_len) == (n, seq)


# ---- a results file is checked like input from a stranger before anything is imported (issue V) ---------------

def _with_windows(tmp_path):
    """A store holding one perplexity unit and one KL unit whose values are their windows' functions."""
    import math
    from bench.common.store import unit_key
    a = ResultStore(tmp_path / "a.sqlite")
    nll, kld, top1, toks = [2.0, 2.2, 2.4], [0.1, 0.2, 0.3], [0.8, 0.7, 0.9], [255, 255, 255]
    for unit, metrics in (("ppl", {"ppl": math.exp(2.2), "eval_tokens_per_s": 100.0}),
                          ("kl", {"kld": 0.2, "kld_median": 0.15, "kld_p99": 0.9, "top1_agree": 0.8})):
        ident = _identity("rtn", "d") | ({"kl": {"schema": 1}} if unit == "kl" else {})
        cfg = {"model": "m", "method_config": {}, "identity": ident,
               "eval": {"window_nll": nll, "window_tokens": toks, "seq_len": 256}}
        if unit == "kl":
            cfg["kl"] = {"window_kld": kld, "window_top1": top1}
        a.write_unit([Row("m", "rtn", "w4a16", "wikitext2", k, v, config=cfg, seed=0) for k, v in metrics.items()],
                     unit_key(ident))
    path, _ = ledger.save(a, tmp_path / "carry")
    return path


def _tamper_line(path, which, edit):
    """Edit the header (0) or the unit holding the metric `which` ("ppl" or "kld")."""
    lines = path.read_text().splitlines()
    i = which if which == 0 else next(n for n, line in enumerate(lines[1:], 1)
                                      if which in {r["metric"] for r in json.loads(line)["rows"]})
    obj = json.loads(lines[i])
    edit(obj)
    lines[i] = json.dumps(obj)
    path.write_text("\n".join(lines) + "\n")


def _set_row(metric, value):
    def edit(obj):
        for r in obj["rows"]:
            if r["metric"] == metric:
                r["value"] = value
    return edit


def _shared(path_in_config, value):
    def edit(obj):
        d = obj["shared"]["config"]
        for k in path_in_config[:-1]:
            d = d[k]
        d[path_in_config[-1]] = value
    return edit


def _drop_row(metric):
    def edit(obj):
        obj["rows"] = [r for r in obj["rows"] if r["metric"] != metric]
    return edit


@pytest.mark.parametrize("line,edit,fix_header,match", [
    ("ppl", _shared(["identity", "seed"], 7), False, "does not hash to its key"),              # identity altered
    ("ppl", lambda o: o.update(shared=o["shared"] | {"method": "gptq"}), False, "disagree"),      # rows renamed
    ("ppl", _set_row("ppl", 7.0), False, "windows"),                                               # ppl not exp(mean NLL)
    ("kld", _set_row("kld", 0.5), False, "windows"),                                               # KLD not their mean
    ("kld", _set_row("top1_agree", 0.2), False, "windows"),
    ("ppl", _shared(["eval", "window_nll"], [2.0, None, 2.4]), False, "null among its numbers"),  # a NaN written as null
    ("ppl", _set_row("ppl", -3.0), False, "outside the range"),                                     # negative perplexity
    ("kld", _drop_row("kld_p99"), True, "lacks wikitext2 kld_p99"),                                # a metric missing
    (0, lambda o: o.update(rows=o["rows"] + 1), False, "header says"),                         # row count
])
def test_an_altered_unit_is_refused_and_nothing_is_imported(line, edit, fix_header, match, tmp_path):
    path = _with_windows(tmp_path)
    b = ResultStore(tmp_path / "b.sqlite")
    assert ledger.load_into(b, path) == (2, 0)                  # the file as written imports
    b.path.unlink()
    _tamper_line(path, line, edit)
    if fix_header:
        _tamper_line(path, 0, lambda o: o.update(rows=o["rows"] - 1))
    c = ResultStore(tmp_path / "c.sqlite")
    with pytest.raises(UserError, match=match):
        ledger.load_into(c, path)
    assert c.rows() == []                                        # nothing imported, not even the sound unit


def test_a_legacy_unit_whose_key_does_not_follow_from_its_configuration_is_refused(tiny_model_dir, data_dir,
                                                                                    tmp_path):
    """A unit stored before identities were recorded is checked by settling its configuration anew on this
    machine's model and data: the key of another text (or a forged one) is refused."""
    from bench.run.cell import Request, settle
    cell = settle(Request(str(tiny_model_dir), "rtn", "w4a16", datasets=("wikitext2",), data_dir=str(data_dir)))
    cfg = {"model": str(tiny_model_dir), "method": "rtn", "scheme": "w4a16", "preset": "quick",
           "method_config": dict(cell.config), "seed": 0, "precision": {"used": cell.precision.used},
           "eval": {"seq_len": 2048, "include_partial": False, "max_tokens": None, "window_nll": [2.0]}}
    rows = lambda: [Row(str(tiny_model_dir), "rtn", "w4a16", "wikitext2", "ppl", 7.38905609893065, config=cfg,  # noqa: E731
                        seed=0), Row(str(tiny_model_dir), "rtn", "w4a16", "wikitext2", "eval_tokens_per_s", 9.0,
                                     config=cfg, seed=0)]
    good = ResultStore(tmp_path / "good.sqlite")
    good.write_unit(rows(), cell.keys["wikitext2"])
    ledger.save(good, tmp_path / "good")
    assert ledger.load_into(ResultStore(tmp_path / "g2.sqlite"), tmp_path / "good", data_dir) == (1, 0)
    bad = ResultStore(tmp_path / "bad.sqlite")
    bad.write_unit(rows(), cell.keys["quant"])   # a perplexity unit under the quantization's key
    ledger.save(bad, tmp_path / "bad")
    b2 = ResultStore(tmp_path / "b2.sqlite")
    with pytest.raises(UserError, match="does not follow from its configuration"):
        ledger.load_into(b2, tmp_path / "bad", data_dir)
    assert b2.rows() == []


def test_two_versions_of_one_unit_are_an_error_naming_both(tmp_path):
    a = ResultStore(tmp_path / "a.sqlite")
    _unit(a, "v", value=1.5, run_id="run-from-a")
    path, _ = ledger.save(a, tmp_path / "carry")
    b = ResultStore(tmp_path / "b.sqlite")
    _unit(b, "v", value=2.5, run_id="run-from-b")   # the same unit measured here by another run
    _unit(a, "w")
    ledger.save(a, tmp_path / "carry")
    with pytest.raises(UserError, match="another version.*run-from-a.*run-from-b"):
        ledger.load_into(b, path)
    assert {r.run_id for r in b.rows()} == {"run-from-b"}          # nothing imported, not even the other unit
    assert ledger.load_into(a, path) == (0, 2)                      # its own file reimports as the same version


def _saver(folder, cache, tag, n):
    os.environ["LRQ_BENCH_CACHE"] = str(cache)   # each writer its own cache: the lock must not live there
    store = ResultStore(Path(cache) / "s.sqlite")
    for i in range(n):
        _unit(store, f"{tag}{i:02d}")
        ledger.save(store, folder)


def test_writers_with_different_caches_lose_no_unit(tmp_path):
    import multiprocessing as mp
    for rep in range(2):
        folder = tmp_path / f"carry{rep}"
        ctx = mp.get_context("fork")
        procs = [ctx.Process(target=_saver, args=(folder, tmp_path / f"cache{rep}{w}", "xy"[w], 25)) for w in (0, 1)]
        for p in procs:
            p.start()
        for p in procs:
            p.join(120)
        assert all(p.exitcode == 0 for p in procs)
        assert len(ledger.read(folder)) == 50
        assert (folder / ledger.LOCK).exists()                   # the lock lives beside the file it guards


# ---- carried blocks: checked before anything local is replaced, and named by what made them ---------------------

def _carry_cell(tmp_path, name="abc123", key="q" * 64):
    from types import SimpleNamespace
    local = tmp_path / "cache" / name
    return SimpleNamespace(checkpoint_dir=str(local), keys={"quant": key}, preset="long",
                           precision=SimpleNamespace(used="bf16"), label=lambda: "m lrq w3a16")


def _local_blocks(cell, n, tag=b"x"):
    from lrq.blockwise import BlockCheckpoint
    local = Path(cell.checkpoint_dir)
    local.mkdir(parents=True, exist_ok=True)
    for i in range(n):
        (local / BlockCheckpoint._block_name(i)).write_bytes(tag * (100 + i))
    (local / BlockCheckpoint.STATE).write_text(json.dumps({"identity": "walk", "done": n, "streams": [], "stats": []}))


def test_carried_blocks_record_the_revision_and_cell_that_made_them(tmp_path):
    from bench.common.provenance import git_revision
    cell = _carry_cell(tmp_path)
    _local_blocks(cell, 2)
    carry = ledger.Carry(tmp_path / "sync", ResultStore(tmp_path / "s.sqlite"))
    assert carry.mirror(cell) == 2
    label = json.loads((tmp_path / "sync" / "checkpoints" / "abc123" / "state.json").read_text())["label"]
    assert label["identity"] == cell.keys["quant"]
    assert set(label["revisions"].values()) == {git_revision()} and len(label["revisions"]) == 2


@pytest.mark.parametrize("damage", ["block", "identity"])
def test_a_bad_carry_never_replaces_the_local_progress(damage, tmp_path):
    """A damaged carried block (or a carry of another cell) is refused before the machine's own checkpoint is
    touched: before, the local blocks were deleted first and the walk restarted from block 0."""
    from lrq.blockwise import BlockCheckpoint
    cell = _carry_cell(tmp_path)
    _local_blocks(cell, 3)
    carry = ledger.Carry(tmp_path / "sync", ResultStore(tmp_path / "s.sqlite"))
    carry.mirror(cell)
    _local_blocks(cell, 1, tag=b"y")                # this machine: one block of its own; the carry holds three
    before = {p.name: p.read_bytes() for p in Path(cell.checkpoint_dir).iterdir()}
    carried = tmp_path / "sync" / "checkpoints" / "abc123"
    if damage == "block":
        (carried / (BlockCheckpoint._block_name(2) + ".xz")).write_bytes(b"\xfd7zXZ garbage")
        match = "incomplete"
    else:
        state = json.loads((carried / "state.json").read_text())
        state["label"]["identity"] = "z" * 64
        (carried / "state.json").write_text(json.dumps(state))
        match = "made by another cell"
    fresh = ledger.Carry(tmp_path / "sync", ResultStore(tmp_path / "s.sqlite"))
    with pytest.raises(UserError, match=match):
        fresh.restore(cell)
    assert {p.name: p.read_bytes() for p in Path(cell.checkpoint_dir).iterdir()} == before


def test_a_good_carry_replaces_a_shorter_local_checkpoint(tmp_path):
    cell = _carry_cell(tmp_path)
    _local_blocks(cell, 3)
    ledger.Carry(tmp_path / "sync", ResultStore(tmp_path / "s.sqlite")).mirror(cell)
    _local_blocks(cell, 1, tag=b"y")
    assert ledger.Carry(tmp_path / "sync", ResultStore(tmp_path / "s.sqlite")).restore(cell) == 3
    local = Path(cell.checkpoint_dir)
    assert json.loads((local / "state.json").read_text())["done"] == 3
    assert (local / "block0000.safetensors").read_bytes() == b"x" * 100
    assert not local.with_name(local.name + ".restoring").exists()


def test_a_block_larger_than_a_repository_file_is_carried_in_parts(tmp_path, monkeypatch):
    """A compressed block above CARRY_FILE_BYTES goes as numbered parts, each under the limit, restored whole (the
    repository keeps files under 2 MB); carried again smaller, it is one file and the parts are gone."""
    import os
    cell = _carry_cell(tmp_path)
    local = Path(cell.checkpoint_dir)
    local.mkdir(parents=True)
    big = os.urandom(5000)                                  # incompressible: ~5 kB of xz
    (local / "block0000.safetensors").write_bytes(big)
    (local / "state.json").write_text(json.dumps({"identity": "walk", "done": 1, "streams": [], "stats": []}))
    monkeypatch.setattr(ledger, "CARRY_FILE_BYTES", 2000)
    carry = ledger.Carry(tmp_path / "sync", ResultStore(tmp_path / "s.sqlite"))
    assert carry.mirror(cell) == 1
    carried = tmp_path / "sync" / "checkpoints" / "abc123"
    parts = sorted(p.name for p in carried.glob("block0000.safetensors.xz*"))
    assert parts == [f"block0000.safetensors.xz.{j:03d}" for j in range(len(parts))] and len(parts) == 3
    assert all((carried / p).stat().st_size <= 2000 for p in parts)
    _local_blocks(cell, 0)                                  # a fresh machine: nothing local
    (local / "block0000.safetensors").unlink()
    assert ledger.Carry(tmp_path / "sync", ResultStore(tmp_path / "s.sqlite")).restore(cell) == 1
    assert (local / "block0000.safetensors").read_bytes() == big
    (carried / parts[1]).unlink()                           # a part missing: refused as incomplete
    _local_blocks(cell, 0)
    with pytest.raises(UserError, match="incomplete"):
        ledger.Carry(tmp_path / "sync", ResultStore(tmp_path / "s.sqlite")).restore(cell)
    monkeypatch.setattr(ledger, "CARRY_FILE_BYTES", 1 << 20)
    _local_blocks(cell, 2)                                  # further on, block 0 made again: one file now
    assert ledger.Carry(tmp_path / "sync", ResultStore(tmp_path / "s.sqlite")).mirror(cell) == 2
    assert sorted(p.name for p in carried.glob("block0000.safetensors.xz*")) == ["block0000.safetensors.xz"]
