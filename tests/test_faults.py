"""Never lost, never wedged, never executed (issue N): stores, checkpoints, workers and the gate under faults
and hostile files. One test per row of the issue's table: each reproduces the input and asserts the exit
code, the message and the state of the store or checkpoint folder afterwards. Faults that need a real file
system (a read-only mount, a full disk) mount a small tmpfs; where this machine cannot mount one the test is
skipped, saying why."""

from __future__ import annotations

import json
import os
import pickle
import shutil
import signal
import sqlite3
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from bench.cli import main
from bench.common.store import ResultStore, Row
from conftest import ROOT, cache_with_measurements, tiny_model

QUICK = ["--profile", "full", "--tasks", "none", "--datasets", "wikitext2", "--max-eval-tokens", "512",
         "--eval-seq-len", "256", "--calib-samples", "4", "--calib-seq-len", "64"]


def _run(args, capsys):
    code = main(args)
    out, err = capsys.readouterr()
    return code, out, " ".join(err.split())


def _rows(path: Path):
    return [(r.unit_key, r.method, r.scheme, r.dataset, r.metric, r.value)
            for r in ResultStore(path, readonly=True).rows()]


class Mount:
    """A small tmpfs mounted for one test (root and a kernel that allows it), unmounted after."""

    def __init__(self, where: Path, size: str = "64m"):
        self.path = where
        where.mkdir(parents=True, exist_ok=True)
        res = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(where)],
                             capture_output=True, text=True)
        if res.returncode:
            pytest.skip(f"cannot mount a tmpfs here ({res.stderr.strip() or 'mount failed'}): the fault needs a real "
                        f"read-only or full file system")

    def readonly(self) -> None:
        subprocess.run(["mount", "-o", "remount,ro", str(self.path)], check=True)

    def fill(self) -> None:
        """Fill the file system to the last byte."""
        for name, chunk in (("filler", 1 << 16), ("filler2", 1)):   # then the last partial block
            fd = os.open(self.path / name, os.O_WRONLY | os.O_CREAT)
            try:
                while True:
                    os.write(fd, b"\0" * chunk)
            except OSError:
                pass
            finally:
                os.close(fd)

    def close(self) -> None:
        subprocess.run(["umount", "-l", str(self.path)], capture_output=True)


@pytest.fixture
def tmpfs(tmp_path):
    mounts = []

    def make(name="fs", size="64m"):
        m = Mount(tmp_path / name, size)
        mounts.append(m)
        return m
    yield make
    for m in mounts:
        m.close()


def _small_store(path: Path) -> Path:
    store = ResultStore(path)
    for i in range(5):
        store.write_unit([Row("m", "rtn", "w4a16", "wikitext2", "ppl", 10.0 + i)], f"k{i}")
    conn = sqlite3.connect(path)
    conn.execute("PRAGMA wal_checkpoint(TRUNCATE)")
    conn.close()
    return path


# ---- 1 and 5: checkpoint files are data, never code; a damaged one is discarded, not fatal -------------------

class _Bomb:
    """Unpickling this writes a marker file: what a planted checkpoint would do under torch.load(weights_only=False)."""

    def __init__(self, marker: str):
        self.marker = marker

    def __reduce__(self):
        return (Path.write_text, (Path(self.marker), "executed"))


def _calib(n=6):
    from lrq.methods import Calibration
    return Calibration(torch.randint(0, 128, (n, 24), generator=torch.Generator().manual_seed(1)), {"seed": 0})


def _lrq_interrupted(ckpt: Path, monkeypatch) -> None:
    """LRQ on a 3-block tiny model killed while training block 2: blocks 0 and 1 are checkpointed."""
    from lrq.engine import ReconstructionMethod
    from lrq.methods import get_method
    from lrq.schemes import get_scheme
    real = ReconstructionMethod._reconstruct_block

    def crashing(self, ctx, *a, **k):
        if ctx.index == 2:
            raise KeyboardInterrupt
        return real(self, ctx, *a, **k)
    monkeypatch.setattr(ReconstructionMethod, "_reconstruct_block", crashing)
    m = get_method("lrq", checkpoint_dir=ckpt)
    with pytest.raises(KeyboardInterrupt):
        m.quantize(tiny_model("llama", layers=3), get_scheme("w3a16"), m.config("quick", {"iters": 4, "heldout_samples": 2}), _calib())
    monkeypatch.setattr(ReconstructionMethod, "_reconstruct_block", real)


def _lrq_finish(ckpt: Path):
    from lrq.methods import get_method
    from lrq.schemes import get_scheme
    m = get_method("lrq", checkpoint_dir=ckpt)
    model = tiny_model("llama", layers=3)
    stats = m.quantize(model, get_scheme("w3a16"), m.config("quick", {"iters": 4, "heldout_samples": 2}), _calib())
    return model, stats


@pytest.fixture(scope="module")
def uninterrupted():
    from lrq.methods import get_method
    from lrq.schemes import get_scheme
    m = get_method("lrq")
    model = tiny_model("llama", layers=3)
    m.quantize(model, get_scheme("w3a16"), m.config("quick", {"iters": 4, "heldout_samples": 2}), _calib())
    return {k: v.clone() for k, v in model.state_dict().items() if torch.is_tensor(v)}


def _same(model, ref) -> bool:
    return all(torch.equal(v, ref[k]) for k, v in model.state_dict().items() if torch.is_tensor(v))


def test_planted_checkpoint_files_are_never_executed(tmp_path, monkeypatch, uninterrupted):
    ckpt = tmp_path / "ckpt"
    _lrq_interrupted(ckpt, monkeypatch)
    marker = tmp_path / "EXECUTED"
    # the old pickle names beside the real files, and a pickle disguised as the block file itself
    for name in ("state.pt", "streams.pt", "block0000.pt", "block0001.safetensors"):
        (ckpt / name).write_bytes(pickle.dumps(_Bomb(str(marker))))
    model, stats = _lrq_finish(ckpt)
    assert not marker.exists()                    # nothing in the folder ran
    assert _same(model, uninterrupted)            # the damaged block was recomputed: the same result
    assert stats["resumed_blocks"] == 0           # the damage meant starting afresh, said in the log


@pytest.mark.parametrize("damage", ["empty block", "truncated block", "truncated streams", "garbage state"])
def test_a_damaged_checkpoint_is_reported_once_and_recomputed(damage, tmp_path, monkeypatch, uninterrupted, caplog):
    ckpt = tmp_path / "ckpt"
    _lrq_interrupted(ckpt, monkeypatch)
    target = {"empty block": "block0000.safetensors", "truncated block": "block0001.safetensors",
              "truncated streams": "streams-0002-q.npy", "garbage state": "state.json"}[damage]
    data = (ckpt / target).read_bytes()
    (ckpt / target).write_bytes(b"" if damage == "empty block" else
                                data[: len(data) // 2] if "truncated" in damage else b"\x00\xffnot json")
    with caplog.at_level("WARNING", logger="lrq_bench"):
        model, stats = _lrq_finish(ckpt)
    assert _same(model, uninterrupted)
    # damaged streams cost a replay of the finished blocks, a damaged block or state the blocks themselves
    assert stats["resumed_blocks"] == (2 if damage == "truncated streams" else 0)
    said = [r.message for r in caplog.records if "is damaged" in r.message]
    assert len(said) == 1 and "computed again" in said[0]
    assert not (ckpt / target).exists() or (ckpt / target).read_bytes() != b""   # discarded, then rewritten
    caplog.clear()
    with caplog.at_level("WARNING", logger="lrq_bench"):   # the next run meets nothing damaged
        _lrq_finish(ckpt)
    assert not [r for r in caplog.records if "is damaged" in r.message]


@pytest.mark.parametrize("planted", ["streams of the next block count", "legacy streams"])
def test_streams_that_do_not_match_the_state_are_never_fed_to_a_block(planted, tmp_path, monkeypatch, uninterrupted):
    """A crash after the streams of a block were written but before the state counted it left, in the legacy
    format (one streams file for every count), streams that already went through block 2 beside a state that
    says 2 blocks are done. Streams are now named by the count they follow, and legacy ones are recomputed."""
    import numpy as np
    ckpt = tmp_path / "ckpt"
    _lrq_interrupted(ckpt, monkeypatch)
    assert json.loads((ckpt / "state.json").read_text())["done"] == 2
    q = np.load(ckpt / "streams-0002-q.npy")
    wrong = {"q": np.full_like(q, 3.0), "fp": np.full_like(q, -3.0)}
    if planted == "legacy streams":
        from safetensors.numpy import save_file
        for f in ckpt.glob("streams-*.npy"):
            f.unlink()
        save_file(wrong, str(ckpt / "streams.safetensors"))
    else:
        for k, v in wrong.items():
            np.save(ckpt / f"streams-0003-{k}.npy", v)
    model, stats = _lrq_finish(ckpt)
    assert _same(model, uninterrupted)
    assert stats["resumed_blocks"] == 2


# ---- 2: the driver's workers end with it --------------------------------------------------------------------

def _slow_run(model_dir, data_dir, results, cache):
    env = dict(os.environ, LRQ_BENCH_CACHE=str(cache), PYTHONUNBUFFERED="1")
    cmd = [sys.executable, "-m", "bench.cli", "run", *QUICK, "--model", str(model_dir), "--methods", "lrq",
           "--schemes", "w4a16,w3a16", "--no-fp", "--data-dir", str(data_dir), "--results", str(results), "--jobs",
           "2", "--set", "iters=600", "--set", "heldout_samples=1"]
    return subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _workers(pid: int) -> list[int]:
    import psutil
    try:
        return [c.pid for c in psutil.Process(pid).children(recursive=True)
                if "multiprocessing" in " ".join(c.cmdline()) and "resource_tracker" not in " ".join(c.cmdline())]
    except psutil.NoSuchProcess:
        return []


def _wait_for(cond, timeout=240.0, step=0.5):
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if cond():
            return True
        time.sleep(step)
    return False


def _gone(pids, timeout=20.0) -> bool:
    import psutil
    return _wait_for(lambda: not [p for p in pids if psutil.pid_exists(p) and
                                  psutil.Process(p).status() != psutil.STATUS_ZOMBIE], timeout)


@pytest.mark.heavy
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGKILL])
def test_workers_end_with_the_driver_and_a_rerun_resumes(sig, tiny_model_dir, data_dir, tmp_path):
    results, cache = tmp_path / "r.sqlite", cache_with_measurements(tmp_path / "cache")
    proc = _slow_run(tiny_model_dir, data_dir, results, cache)
    try:
        assert _wait_for(lambda: len(_workers(proc.pid)) == 2 and
                         any((cache / "checkpoints").glob("*/state.json"))), "the workers never trained a block"
        workers = _workers(proc.pid)
        proc.send_signal(sig)
        out, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert _gone(workers), "workers outlived their driver"
    if sig == signal.SIGTERM:
        assert proc.returncode == 143
        assert "terminated (SIGTERM)" in err and "a rerun of the same command resumes" in " ".join(err.split())
    else:
        assert proc.returncode == -signal.SIGKILL
    assert ResultStore(results).rows() == [] or all(r.dataset == "quant" for r in ResultStore(results).rows())
    # finished blocks are kept for the rerun (the mid-block kill below shows the rerun resuming from them)
    states = [json.loads(p.read_text()) for p in (cache / "checkpoints").glob("*/state.json")]
    assert states and all(st["done"] >= 1 for st in states)


# ---- a worker killed mid-block: reported, the other cell completes, the rerun resumes at the next block -------

@pytest.mark.heavy
def test_a_worker_killed_mid_block_resumes_at_its_next_block(tiny_model_dir, data_dir, tmp_path):
    import psutil
    results, cache = tmp_path / "r.sqlite", cache_with_measurements(tmp_path / "cache")
    env = dict(os.environ, LRQ_BENCH_CACHE=str(cache), PYTHONUNBUFFERED="1")
    base = [sys.executable, "-m", "bench.cli", "run", *QUICK, "--model", str(tiny_model_dir), "--methods", "lrq",
            "--schemes", "w4a16,w3a16", "--no-fp", "--data-dir", str(data_dir), "--results", str(results),
            "--jobs", "2", "--set", "heldout_samples=1"]
    proc = subprocess.Popen(base + ["--set", "iters=500"], cwd=ROOT, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    try:   # both cells have finished a block and are training the next
        assert _wait_for(lambda: len(list((cache / "checkpoints").glob("*/state.json"))) == 2
                         and len(_workers(proc.pid)) == 2)
        victim = _workers(proc.pid)[0]
        os.kill(victim, signal.SIGKILL)
        out, err = proc.communicate(timeout=900)
    finally:
        if proc.poll() is None:
            proc.kill()
    err = " ".join(err.split())
    assert proc.returncode == 1 and "the worker process died (killed by signal 9)" in err
    assert "1 run" in err and "1 failed" in err
    assert not psutil.pid_exists(victim) or psutil.Process(victim).status() == psutil.STATUS_ZOMBIE
    rerun = subprocess.run(base + ["--set", "iters=500"], cwd=ROOT, env=env, capture_output=True, text=True,
                           timeout=900)
    assert rerun.returncode == 0, rerun.stderr[-2000:]
    rows = [r for r in ResultStore(results).rows() if r.metric == "resumed_blocks"]
    assert len(rows) == 2 and max(r.value for r in rows) >= 1     # the killed cell resumed, not restarted


# ---- 3 and 4: a read-only store is read; a full disk is said as such ------------------------------------------

@pytest.mark.parametrize("how", ["read-only mount", "immutable file"])
def test_a_read_only_store_is_read_and_run_says_it_is_read_only(how, tmpfs, tmp_path, capsys):
    if how == "read-only mount":
        fs = tmpfs()
        store = _small_store(fs.path / "r.sqlite")
        before = _rows(store)
        fs.readonly()
    else:
        (tmp_path / "imm").mkdir()
        store = _small_store(tmp_path / "imm" / "r.sqlite")
        before = _rows(store)
        if subprocess.run(["chattr", "+i", str(store)], capture_output=True).returncode:
            pytest.skip("chattr +i is not supported on this file system")
    try:
        code, out, err = _run(["results", "--results", str(store)], capsys)
        assert code == 0 and out.startswith("model") and out.count(" ppl ") == 5 and "damaged" not in err
        code, out, err = _run(["report", "--results", str(store), "--out", str(tmp_path / "rep")], capsys)
        assert code == 0 and (tmp_path / "rep" / "leaderboard.md").is_file()
        code, out, err = _run(["compare", str(store), str(store)], capsys)
        assert code == 0 and "no regression" in out
        code, out, err = _run(["run", "--results", str(store), "--methods", "rtn"], capsys)
        assert code == 2 and "is read-only" in err and "damaged" not in err
    finally:
        if how == "immutable file":
            subprocess.run(["chattr", "-i", str(store)])
    assert _rows(store) == before


def test_a_full_disk_is_disk_full_and_the_store_stays_intact(tmpfs):
    from lrq.errors import UserError
    fs = tmpfs(size="1m")
    store = _small_store(fs.path / "r.sqlite")
    before = _rows(store)
    fs.fill()
    with pytest.raises(UserError) as e:
        ResultStore(store).write_unit([Row("m", "rtn", "w3a16", "wikitext2", "ppl", 99.0,
                                           config={"pad": "x" * 200_000})], "new")
    msg = str(e.value)
    assert msg.startswith("disk full") and str(store) in msg and "damaged" not in msg and ".recover" not in msg
    (fs.path / "filler").unlink()
    assert _rows(store) == before
    conn = sqlite3.connect(store)
    assert conn.execute("PRAGMA integrity_check").fetchone()[0] == "ok"
    conn.close()


def test_a_full_disk_while_checkpointing_is_disk_full(tmpfs, tmp_path):
    from lrq.errors import UserError
    from lrq.methods import get_method
    from lrq.schemes import get_scheme
    fs = tmpfs(size="1m")
    (fs.path / "ckpt").mkdir()
    fs.fill()
    m = get_method("lrq", checkpoint_dir=fs.path / "ckpt")
    with pytest.raises(UserError) as e:
        m.quantize(tiny_model("llama", layers=2), get_scheme("w4a16"), m.config("quick", {"iters": 2, "heldout_samples": 2}), _calib())
    assert str(e.value).startswith("disk full: cannot write") and str(fs.path / "ckpt") in str(e.value)


# ---- 6: data too small for its windows is refused before any work --------------------------------------------

def _data_copy(data_dir: Path, tmp_path: Path, wikitext: str | None) -> Path:
    """A data folder like the shared one (no checksum file), with the WikiText-2 test text replaced."""
    d = tmp_path / "data"
    (d / "wikitext2").mkdir(parents=True)
    (d / "c4").symlink_to(data_dir / "c4")
    (d / "wikitext2" / "wiki.test.raw").write_text(wikitext, encoding="utf-8")
    return d


@pytest.mark.parametrize("text, args, message", [
    (" \n" * 500, [], "holds no text"),
    ("A short text of a dozen tokens or so .\n", [], "fewer than one window of --eval-seq-len 256"),
    (None, ["--max-eval-tokens", "3"], "--max-eval-tokens 3 is less than one window of --eval-seq-len 256"),
    (None, ["--max-eval-tokens", "1000", "--eval-seq-len", "2048", "--methods", "lrq", "--set", "iters=2",
             "--set", "heldout_samples=1"],
     "--max-eval-tokens 1000 is less than one window of --eval-seq-len 2048"),
    (None, ["--calib-samples", "100000", "--calib-seq-len", "64", "--methods", "lrq", "--set", "iters=2",
             "--set", "heldout_samples=1"],
     "the calibration pool"),
])
def test_data_too_small_is_refused_before_any_work(text, args, message, tiny_model_dir, data_dir, tmp_path, capsys,
                                                   monkeypatch):
    monkeypatch.setenv("LRQ_BENCH_CACHE", str(tmp_path / "cache"))
    folder = data_dir if text is None else _data_copy(data_dir, tmp_path, text)
    results = tmp_path / "r.sqlite"
    base = ["run", *QUICK, "--model", str(tiny_model_dir), "--methods", "rtn", "--schemes", "w4a16",
            "--data-dir", str(folder), "--results", str(results)]
    code, out, err = _run(base + args, capsys)
    assert code == 2 and message in err, err
    assert ResultStore(results).rows() == []
    assert not (tmp_path / "cache" / "checkpoints").exists()


# ---- 7: an export never overwrites its source -------------------------------------------------------------------

def test_export_refuses_the_source_folder_and_an_unwritable_out(tiny_model_dir, data_dir, tmp_path, capsys):
    src = tmp_path / "model"
    shutil.copytree(tiny_model_dir, src)
    before = {p.name: p.read_bytes() for p in src.iterdir()}
    code, out, err = _run(["export", "--model", str(src), "--method", "rtn", "--scheme", "w4a16", "--out", str(src),
                           "--data-dir", str(data_dir)], capsys)
    assert code == 2 and "would overwrite the source weights" in err and "Nothing was quantized" in err
    assert {p.name: p.read_bytes() for p in src.iterdir()} == before
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    t = time.perf_counter()
    code, out, err = _run(["export", "--model", str(src), "--method", "gptq", "--scheme", "w4a16", "--out",
                           str(blocker / "out"), "--data-dir", str(data_dir)], capsys)
    assert code == 2 and "is not a writable folder" in err and time.perf_counter() - t < 30


# ---- 8-11: the gate's inputs ---------------------------------------------------------------------------------------

def _export(path: Path, value: float, metric: str = "ppl") -> Path:
    path.write_text(json.dumps([Row("m", "rtn", "w4a16", "wikitext2", metric, value).__dict__]))
    return path


def test_compare_treats_nan_as_a_regression_and_a_nan_baseline_as_bad_input(tmp_path, capsys):
    base, nan = _export(tmp_path / "b.json", 20.0), _export(tmp_path / "n.json", float("nan"))
    inf = _export(tmp_path / "i.json", float("inf"))
    for cur in (nan, inf):
        code, out, err = _run(["compare", str(base), str(cur)], capsys)
        assert code == 1 and "**REGRESSION**" in out and "regressed" in out
    code, out, err = _run(["compare", str(nan), str(base)], capsys)
    assert code == 2 and "must be finite" in err


@pytest.mark.parametrize("toml, message", [
    ('[metrics.ppl]\ndirection = "lower"\nrel = "abc"\n', "[metrics.ppl].rel = 'abc'"),
    ("[metrics]\nppl = 5\n", "[metrics.ppl] must be a table"),
    ("metrics = 3\n", "`metrics` must be a table"),
    (None, "is a folder"),
    (b"\xff\xfe[metrics.ppl]\n", "is not UTF-8 text"),
    ('[metrics.ppl]\nrel = -1\n', "[metrics.ppl].rel = -1"),
    ('[metrics.ppl]\nrelative = 0.1\n', "unknown key(s) relative"),
])
def test_a_bad_tolerance_file_is_bad_input_naming_the_key(toml, message, tmp_path, capsys):
    base = _export(tmp_path / "b.json", 20.0)
    tol = tmp_path / "tol.toml"
    if toml is None:
        tol.mkdir()
    elif isinstance(toml, bytes):
        tol.write_bytes(toml)
    else:
        tol.write_text(toml)
    code, out, err = _run(["compare", str(base), str(base), "--tolerances", str(tol)], capsys)
    assert code == 2 and message in err and "Traceback" not in err


def test_a_misspelled_metric_or_a_gate_checking_nothing_is_bad_input(tmp_path, capsys):
    base, worse = _export(tmp_path / "b.json", 20.0), _export(tmp_path / "w.json", 30.0)
    typo = tmp_path / "typo.toml"
    typo.write_text('[metrics.pll]\ndirection = "lower"\nrel = 0.01\n')
    code, out, err = _run(["compare", str(base), str(worse), "--tolerances", str(typo)], capsys)
    assert code == 2 and "[metrics.pll] names no metric" in err and "did you mean 'ppl'" in err
    other = tmp_path / "other.toml"
    other.write_text('[metrics.acc]\ndirection = "higher"\nabs = 0.01\n')
    code, out, err = _run(["compare", str(base), str(worse), "--tolerances", str(other)], capsys)
    assert code == 2 and "covers none of the 1 metrics" in err
    code, out, err = _run(["compare", str(base), str(worse)], capsys)    # the default file gates ppl
    assert code == 1


def test_an_installed_wheel_carries_the_default_tolerances(tmp_path):
    """`pip install .` (not editable): `compare` without --tolerances finds reports/tolerances.toml."""
    import sysconfig
    wheels = tmp_path / "wheels"
    build = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q",
                            "-w", str(wheels), str(ROOT)], capture_output=True, text=True, timeout=600)
    assert build.returncode == 0, build.stderr[-2000:]
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=120)
    py = venv / "bin" / "python"
    inst = subprocess.run([sys.executable, "-m", "pip", "--python", str(py), "install", "--no-deps", "-q",
                           str(next(wheels.glob("lrq_bench-*.whl")))], capture_output=True, text=True, timeout=600)
    assert inst.returncode == 0, inst.stderr[-2000:]
    # the installed package's dependencies from this environment (a .pth does not activate its editable install)
    site = subprocess.run([str(py), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                          capture_output=True, text=True, check=True).stdout.strip()
    Path(site, "deps.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    base, worse = _export(tmp_path / "b.json", 20.0), _export(tmp_path / "w.json", 30.0)
    work = tmp_path / "elsewhere"
    work.mkdir()
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}   # nothing but the installed wheel
    where = subprocess.run([str(py), "-c", "import bench, reports; print(bench.__file__, reports.__file__)"],
                           cwd=work, capture_output=True, text=True, env=env)
    assert str(venv) in where.stdout and str(ROOT) not in where.stdout, where
    res = subprocess.run([str(venv / "bin" / "lrq-bench"), "compare", str(base), str(worse)], cwd=work,
                         capture_output=True, text=True, timeout=300, env=env)
    assert res.returncode == 1 and "**REGRESSION**" in res.stdout, res.stderr[-2000:]


# ---- 12-13: model folders and settings are checked before any work -------------------------------------------

@pytest.mark.parametrize("config, message", [(None, "it has no config.json"),
                                             ("{not json", "its config.json cannot be read"),
                                             ('["a list"]', "is not a model configuration")])
def test_a_broken_model_folder_is_bad_input(config, message, tiny_model_dir, tmp_path, capsys):
    d = tmp_path / "model"
    shutil.copytree(tiny_model_dir, d)
    if config is None:
        (d / "config.json").unlink()
    else:
        (d / "config.json").write_text(config)
    code, out, err = _run(["run", "--model", str(d), "--methods", "rtn", "--results", str(tmp_path / "r.sqlite")],
                          capsys)
    assert code == 2 and message in err and "Traceback" not in err


@pytest.mark.parametrize("setting, message", [
    ("lr=abc", "lr takes a number > 0 or auto"), ("heldout_samples=-1", "heldout_samples takes an integer >= 0"),
    ("preset=bogus", "preset is not a --set value: choose it with --preset"), ("rank=0", "rank takes an integer >= 1"),
    ("rank_fraction=1.5", "rank_fraction takes a number in (0, 1]"), ("s1_init=guess", "s1_init takes one of"),
    ("heldout_samples=4", "heldout_samples (4) must be smaller than the calibration set (4 windows)"),
])
def test_every_setting_is_validated_before_any_work(setting, message, tiny_model_dir, data_dir, tmp_path, capsys):
    results = tmp_path / "r.sqlite"
    code, out, err = _run(["run", *QUICK, "--model", str(tiny_model_dir), "--methods", "lrq", "--schemes", "w4a16",
                           "--data-dir", str(data_dir), "--results", str(results), "--set", setting], capsys)
    assert code == 2 and message in err, err
    assert ResultStore(results).rows() == []


# ---- 14, 16: what the suite writes is never markup and never NaN ----------------------------------------------

def test_stored_strings_are_text_in_the_markdown_leaderboard(tiny_model_dir, data_dir, tmp_path, capsys):
    evil = tmp_path / "<script>alert(1)<"
    shutil.copytree(tiny_model_dir, evil)
    results = tmp_path / "r.sqlite"
    assert main(["run", *QUICK, "--model", str(evil), "--methods", "rtn", "--schemes", "w4a16", "--no-fp",
                 "--data-dir", str(data_dir), "--results", str(results), "--out", str(tmp_path / "rep")]) == 0
    capsys.readouterr()
    md = (tmp_path / "rep" / "leaderboard.md").read_text()
    assert "<script>" not in md and "&lt;script&gt;alert(1)&lt;" in md
    assert "<script>alert(1)" not in (tmp_path / "rep" / "leaderboard.html").read_text()


def test_no_nan_in_any_json_the_suite_writes(tiny_model_dir, data_dir, tmp_path, capsys):
    results = tmp_path / "r.sqlite"
    # no held-out samples (the paper preset's default): the held-out block errors are NaN
    assert main(["run", *QUICK, "--model", str(tiny_model_dir), "--methods", "lrq", "--schemes", "w4a16", "--no-fp",
                 "--data-dir", str(data_dir), "--results", str(results), "--set", "iters=2",
                 "--set", "heldout_samples=0"]) == 0
    capsys.readouterr()
    assert main(["results", "--results", str(results), "--json"]) == 0
    out = capsys.readouterr().out

    def refuse(word):
        raise ValueError(f"bare {word} in JSON")
    rows = json.loads(out, parse_constant=refuse)          # strict JSON: no NaN, Infinity
    stats = next(r for r in rows if r["metric"] == "n_learnable")["config"]["method_stats"]
    assert stats["block_errors"][0]["heldout_after"] is None and stats["mean_block_heldout_after"] is None
    conn = sqlite3.connect(results)                       # SQLite's own JSON functions read every stored config
    assert conn.execute("SELECT count(json_extract(config, '$.method')) FROM results").fetchone()[0] == len(rows)
    conn.close()


# ---- 17: a model rewritten in place is a new model -----------------------------------------------------------------

def test_a_file_rewritten_in_place_with_its_mtime_restored_is_hashed_again(tmp_path, monkeypatch):
    from bench.common import hashing
    monkeypatch.setenv("LRQ_BENCH_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(hashing, "_MEMO", {})
    f = tmp_path / "model.safetensors"
    f.write_bytes(os.urandom(1 << 16))
    st = f.stat()
    first = hashing.file_sha256(f)
    time.sleep(0.01)
    with open(f, "r+b") as fh:                            # same size, same inode, new bytes
        fh.write(os.urandom(1 << 16))
    os.utime(f, ns=(st.st_atime_ns, st.st_mtime_ns))      # mtime set back, as `touch -d` would
    assert f.stat().st_size == st.st_size and f.stat().st_mtime_ns == st.st_mtime_ns and f.stat().st_ino == st.st_ino
    monkeypatch.setattr(hashing, "_MEMO", {})
    assert hashing.file_sha256(f) != first


# ---- 18: two runs sharing a store compute each cell once --------------------------------------------------------

def test_two_runs_on_one_store_compute_each_cell_once(tiny_model_dir, data_dir, tmp_path):
    results = tmp_path / "r.sqlite"
    # one thread each: two runs of two threads on two cores spin against each other (docs/running.md: OMP_NUM_THREADS=1)
    env = dict(os.environ, LRQ_BENCH_CACHE=str(cache_with_measurements(tmp_path / "cache")), OMP_NUM_THREADS="1")
    cmd = [sys.executable, "-m", "bench.cli", "run", *QUICK, "--model", str(tiny_model_dir), "--methods", "rtn",
           "--schemes", "w4a16,w3a16", "--data-dir", str(data_dir), "--results", str(results), "--jobs", "1",
           "--max-eval-tokens", "32768"]   # 128 windows: cells long enough for the two runs to overlap
    procs = [subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for _ in range(2)]
    outs = [p.communicate(timeout=900) for p in procs]
    assert [p.returncode for p in procs] == [0, 0], [o[1][-1500:] for o in outs]
    conn = sqlite3.connect(results)
    per_unit = conn.execute("SELECT unit_key, count(DISTINCT run_id) FROM results GROUP BY unit_key").fetchall()
    conn.close()
    # FP, rtn w4a16, rtn w3a16 (two units each) and the two quantized cells' KLD units: each once
    assert len(per_unit) == 3 * 2 + 2 and all(n == 1 for _, n in per_unit)
    ran = [int(o[1].split(" cells: ")[1].split(" run")[0]) for o in outs]
    assert sum(ran) == 3                                   # the other run reused what one computed
