"""Nothing wrong comes back with exit 0. One test per bad input a demanding user tried (issue K): each
reproduces the input, asserts the exit code and the message, and that no stored result changed."""

import json
import os
import shutil
import sqlite3
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from bench.cli import main
from bench.common.store import ResultStore
from conftest import ROOT, tiny_model

QUICK = ["--profile", "full", "--tasks", "none", "--jobs", "1", "--datasets", "wikitext2", "--max-eval-tokens", "512",
         "--eval-seq-len", "256", "--calib-samples", "4", "--calib-seq-len", "64"]


def _run(args, capsys):
    code = main(args)
    out, err = capsys.readouterr()
    return code, out, " ".join(err.split())


def _snapshot(path: Path):
    """Every stored row (everything but the creation time), to prove a bad input changed nothing."""
    if not path.exists():
        return None
    return [(r.unit_key, r.method, r.scheme, r.dataset, r.metric, r.value) for r in ResultStore(path).rows()]


@pytest.fixture
def model_copy(tiny_model_dir, tmp_path):
    d = tmp_path / "model"
    shutil.copytree(tiny_model_dir, d)
    return d


# ---- 1. a model folder is identified by its contents -------------------------------------------------------

def test_overwritten_weights_are_a_new_model(model_copy, data_dir, tmp_path, capsys):
    results = tmp_path / "r.sqlite"
    args = ["run", *QUICK, "--model", str(model_copy), "--methods", "rtn", "--schemes", "w4a16", "--no-fp",
            "--data-dir", str(data_dir), "--results", str(results)]
    code, _, err = _run(args, capsys)
    assert code == 0 and "1 run, 0 reused" in err
    before = {r.value for r in ResultStore(results).rows() if r.metric == "ppl"}
    # other weights of the same shapes saved over the first (a fine-tune over its base)
    vocab = json.loads((model_copy / "config.json").read_text())["vocab_size"]
    tiny_model("llama", seed=7, vocab_size=vocab, hidden=64, layers=2).save_pretrained(model_copy)
    code, _, err = _run(args, capsys)
    assert code == 0 and "1 run, 0 reused" in err, err      # not "0 run, 1 reused" with the old number
    after = {r.model: r.value for r in ResultStore(results).rows(latest=True) if r.metric == "ppl"}
    # two weights under one folder name: two models on the leaderboard (`name@<fingerprint>`), never one row
    assert len(after) == 2 and all("@" in m for m in after) and set(after.values()) - before
    code, _, err = _run(args, capsys)                      # unchanged now: reused
    assert code == 0 and "0 run, 1 reused" in err


def test_unchanged_files_are_hashed_once(tmp_path, monkeypatch):
    from bench.common import hashing
    monkeypatch.setenv("LRQ_BENCH_CACHE", str(tmp_path / "cache"))
    f = tmp_path / "w.bin"
    f.write_bytes(os.urandom(1 << 20))
    calls = []
    real = hashing.hashlib.sha256
    monkeypatch.setattr(hashing.hashlib, "sha256", lambda *a: calls.append(1) or real(*a))
    monkeypatch.setattr(hashing, "_MEMO", {})
    first = hashing.file_sha256(f)
    monkeypatch.setattr(hashing, "_MEMO", {})            # a new process: only the on-disk cache is left
    assert hashing.file_sha256(f) == first and len(calls) == 1
    f.write_bytes(os.urandom(1 << 20))                    # same name and size, new contents
    assert hashing.file_sha256(f) != first and len(calls) == 2


# ---- 2. a non-finite result is a failure, never stored --------------------------------------------------------

def test_nan_perplexity_fails_the_cell_and_is_not_cached(model_copy, data_dir, tmp_path, capsys):
    from transformers import AutoModelForCausalLM
    m = AutoModelForCausalLM.from_pretrained(model_copy)
    with torch.no_grad():
        m.model.layers[1].mlp.down_proj.weight[3, 5] = float("nan")
    m.save_pretrained(model_copy)
    results = tmp_path / "r.sqlite"
    args = ["run", *QUICK, "--model", str(model_copy), "--methods", "rtn", "--schemes", "w4a16", "--no-fp",
            "--data-dir", str(data_dir), "--results", str(results)]
    for _ in range(2):                                     # the second run computes it again: nothing was cached
        code, _, err = _run(args, capsys)
        assert code == 1 and "0 run, 0 reused" in err and "1 failed" in err, err
        assert "NonFiniteResult: wikitext2 perplexity is not finite (nan)" in err
        assert "model.layers.1.mlp.down_proj" in err and "Nothing was stored" in err
        assert not [r for r in ResultStore(results).rows() if r.dataset == "wikitext2"]


def test_the_store_refuses_non_finite_values(tmp_path):
    from bench.common.store import Row
    store = ResultStore(tmp_path / "r.sqlite")
    for bad in (float("nan"), float("inf")):
        with pytest.raises(ValueError, match="non-finite"):
            store.write_unit([Row("m", "rtn", "w4a16", "wikitext2", "ppl", bad)], "k")
    assert store.rows() == []


# ---- 3. every option is checked ---------------------------------------------------------------------------------

@pytest.mark.parametrize("args, message", [
    (["--methods", "lrq", "--set", "iter=5000"], "has a setting 'iter'; did you mean 'iters'?"),
    (["--methods", "rtn,gptq", "--set", "lr=1e-3"], "none of the selected methods (rtn, gptq) has a setting 'lr'"),
    (["--schemes", ""], "--schemes is empty"),
    (["--methods", ""], "--methods is empty"),
    (["--methods", " , "], "--methods is empty"),
    (["--datasets", ""], "--datasets is empty"),
])
def test_options_are_never_ignored(args, message, tmp_path, capsys):
    results = tmp_path / "r.sqlite"
    code, _, err = _run(["run", "--results", str(results), *args], capsys)
    assert code == 2 and message in err and "Traceback" not in err
    assert _snapshot(results) in (None, [])


def test_method_names_are_case_normalized_and_cells_deduplicated(tiny_model_dir, data_dir, tmp_path, capsys):
    results = tmp_path / "r.sqlite"
    code, _, err = _run(["run", *QUICK, "--model", str(tiny_model_dir), "--methods", "rtn,RTN, Rtn",
                         "--schemes", "w4a16,W4A16", "--no-fp", "--data-dir", str(data_dir), "--results",
                         str(results)], capsys)
    assert code == 0 and "1 cells: 1 run" in err, err
    assert {r.method for r in ResultStore(results).rows()} == {"rtn"}


def test_a_valid_key_of_one_selected_method_is_accepted():
    from bench.cli.args import _checked_overrides
    assert _checked_overrides(["iters=5"], ["rtn", "lrq"]) == {"iters": "5"}


# ---- 4. data files are checked --------------------------------------------------------------------------------

def _data_copy(data_dir: Path, dest: Path, with_sums: bool) -> Path:
    for rel in ("wikitext2/wiki.test.raw", "c4/c4_en_validation_sample2000.jsonl.gz"):
        (dest / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(data_dir / rel, dest / rel)
    if with_sums:
        shutil.copyfile(data_dir / "SHA256SUMS", dest / "SHA256SUMS")
    return dest


@pytest.mark.parametrize("prefix", ["", "./"])   # `sha256sum ./*/*` writes ./wikitext2/wiki.test.raw
def test_a_truncated_text_file_is_caught_by_its_checksum(prefix, tiny_model_dir, data_dir, tmp_path, capsys):
    d = _data_copy(data_dir, tmp_path / "data", with_sums=True)
    sums = d / "SHA256SUMS"
    sums.write_text("".join(f"{h}  {prefix}{name}" for h, name in
                            (line.split(None, 1) for line in sums.read_text().splitlines(keepends=True))))
    f = d / "wikitext2" / "wiki.test.raw"
    f.write_bytes(f.read_bytes()[: f.stat().st_size // 2])
    results = tmp_path / "r.sqlite"
    code, _, err = _run(["run", *QUICK, "--model", str(tiny_model_dir), "--methods", "rtn", "--schemes", "w4a16",
                         "--data-dir", str(d), "--results", str(results)], capsys)
    assert code == 2 and f"data file {f} does not match {d / 'SHA256SUMS'}" in err and "Traceback" not in err
    assert _snapshot(results) == []


def test_a_truncated_gzip_without_checksums_is_a_clear_error(tiny_model_dir, data_dir, tmp_path, capsys):
    d = _data_copy(data_dir, tmp_path / "data", with_sums=False)
    f = d / "c4" / "c4_en_validation_sample2000.jsonl.gz"
    f.write_bytes(f.read_bytes()[:200_000])
    results = tmp_path / "r.sqlite"
    code, _, err = _run(["run", *QUICK, "--model", str(tiny_model_dir), "--methods", "rtn", "--schemes", "w8a8",
                         "--data-dir", str(d), "--results", str(results)], capsys)
    assert code == 2 and f"cannot read data file {f}: EOFError" in err and "Traceback" not in err
    assert _snapshot(results) == []


@pytest.mark.parametrize("damage", ["missing", "a folder"])
def test_a_missing_data_file_is_never_replaced_by_the_hubs_text(damage, data_dir, tmp_path, monkeypatch):
    """The hub's C4 is other documents than the data folder's sample: reading it in place of a missing file
    would store another text's numbers under the run's settings."""
    from bench.evaluations import data as D
    from lrq.errors import UserError
    d = _data_copy(data_dir, tmp_path / "data", with_sums=True)
    f = d / "c4" / "c4_en_validation_sample2000.jsonl.gz"
    f.unlink()
    if damage == "a folder":
        f.mkdir()
    monkeypatch.setattr(D, "_hub", lambda *a: pytest.fail("the hub was asked for another text"))
    with pytest.raises(UserError, match=f"file {f} not found in the data folder {d}") as e:
        D.load_rows("c4", d)
    assert "leave the data folder out" in str(e.value)


def test_a_damaged_task_file_is_caught_before_any_model_work(tiny_model_dir, data_dir, tmp_path, capsys):
    d = _data_copy(data_dir, tmp_path / "data", with_sums=True)
    (d / "piqa").mkdir()
    (d / "piqa" / "valid.jsonl").write_text('{"goal": "x", "sol1": "a", "sol2": "b"}\n')
    shutil.copy(data_dir / "piqa" / "valid-labels.lst", d / "piqa")
    code, _, err = _run(["run", *QUICK[:-2], "--calib-seq-len", "64", "--tasks", "piqa", "--model",
                         str(tiny_model_dir), "--methods", "rtn", "--schemes", "w4a16", "--data-dir", str(d),
                         "--results", str(tmp_path / "r.sqlite")], capsys)
    assert code == 2 and "piqa/valid.jsonl does not match" in err


def test_a_damaged_piqa_label_file_is_caught_before_any_model_work(tiny_model_dir, data_dir, tmp_path, capsys):
    """PIQA's answers live in a file of their own, read by the task's documents: it was neither checked against
    SHA256SUMS nor part of the tasks' key, so changed answers passed and reused the old accuracy."""
    d = _data_copy(data_dir, tmp_path / "data", with_sums=True)
    (d / "piqa").mkdir()
    shutil.copy(data_dir / "piqa" / "valid.jsonl", d / "piqa")
    (d / "piqa" / "valid-labels.lst").write_text("1\n" * 1838)
    code, _, err = _run(["run", *QUICK[:-2], "--calib-seq-len", "64", "--tasks", "piqa", "--model",
                         str(tiny_model_dir), "--methods", "rtn", "--schemes", "w4a16", "--data-dir", str(d),
                         "--results", str(tmp_path / "r.sqlite")], capsys)
    assert code == 2 and "piqa/valid-labels.lst does not match" in err


# ---- 5. the gate and the side commands ------------------------------------------------------------------------

@pytest.fixture(scope="module")
def stored(tmp_path_factory):
    """A small store with real rows (no model work: written directly)."""
    from bench.common.store import Row
    path = tmp_path_factory.mktemp("store") / "r.sqlite"
    store = ResultStore(path)
    for i in range(40):
        store.write_unit([Row("m", "rtn", "w4a16", "wikitext2", "ppl", 10.0 + i, config={"pad": "x" * 300})], f"k{i}")
    conn = sqlite3.connect(path)
    conn.execute("PRAGMA wal_checkpoint(TRUNCATE)")
    conn.close()
    return path


@pytest.mark.parametrize("content, message", [
    (b"[" * 100_000 + b"]" * 100_000, "nested deeper than Python's parser goes"),
    (b'[{"model": "m", "method": "rtn", "scheme": "s", "dataset": "wikitext2", "metric": "ppl", "value": -7.5}]',
     "value -7.5 is outside what perplexity can take (>= 1)"),
    (b'[{"model": "m", "method": "rtn", "scheme": "s", "dataset": "wikitext2", "metric": "top1_agree", '
     b'"value": 1.5}]', "value 1.5 is outside what top-1 agreement can take (0-100 %)"),
    # exp(mean NLL) of these windows is 20.1 [19.6, 20.6]: 7.0 is not theirs
    (b'[{"model": "m", "method": "rtn", "scheme": "s", "dataset": "wikitext2", "metric": "ppl", "value": 7.0, '
     b'"config": {"eval": {"window_nll": [3.0, 3.0, 3.02, 2.98]}}}]',
     "its value 7.00 lies outside what its 4 stored windows or examples give (20.09, 95 % interval"),
])
def test_compare_exits_2_on_a_row_that_cannot_be_a_measurement(content, message, tmp_path, capsys):
    bad = tmp_path / "bad.json"
    bad.write_bytes(content)
    code, out, err = _run(["compare", str(bad), str(bad)], capsys)
    assert code == 2 and message in err and "Traceback" not in err, err


def test_compare_exits_2_on_a_null_baseline(tmp_path, capsys):
    """A baseline of null passed any current value (or none) as 'ok': a gate against nothing."""
    row = {"model": "m", "method": "rtn", "scheme": "w4a16", "dataset": "wikitext2", "metric": "ppl"}
    base, cur = tmp_path / "base.json", tmp_path / "cur.json"
    base.write_text(json.dumps([row | {"value": None}]))
    for value in (None, 25.0):
        cur.write_text(json.dumps([row | {"value": value}]))
        code, out, err = _run(["compare", str(base), str(cur)], capsys)
        assert code == 2 and "the baseline value of m rtn w4a16" in err and "is null" in err, (out, err)


@pytest.mark.parametrize("content, message", [
    (b"\x00garbage\xff" * 100, "is damaged"),
    (b"{not json", "is not readable JSON"),
    (b'{"rows": []}', "is not a results export"),
    (b'[{"model": "m", "metric": "ppl"}]', "row 0 is not a result row (missing method, scheme, dataset, value)"),
    (b'[{"model": "m", "method": "rtn", "scheme": "s", "dataset": "d", "metric": "ppl", "value": "7"}]',
     "value '7' is not a number"),
])
def test_compare_exits_2_on_an_unreadable_baseline(content, message, stored, tmp_path, capsys):
    bad = tmp_path / ("base.json" if content[:1] in (b"{", b"[") else "base.sqlite")
    bad.write_bytes(content)
    code, out, err = _run(["compare", str(bad), str(stored)], capsys)
    assert code == 2 and message in err and "Traceback" not in err
    code, out, err = _run(["compare", str(stored), str(bad)], capsys)
    assert code == 2 and message in err


def test_plan_refuses_a_config_that_is_not_a_decoder(tmp_path, capsys):
    """An architecture the planner has not seen gets a rough estimate (tests/test_plan.py); a config without a
    decoder's widths at all is refused with what it lacks."""
    (tmp_path / "vit").mkdir()
    (tmp_path / "vit" / "config.json").write_text(json.dumps({"model_type": "vit", "image_size": 224}))
    code, _, err = _run(["plan", "--model", str(tmp_path / "vit")], capsys)
    assert code == 2 and "not a decoder the planner can price" in err and "hidden_size" in err
    assert "Traceback" not in err


def test_unwritable_out_fails_before_any_cell_runs(tiny_model_dir, data_dir, tmp_path, capsys):
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    results = tmp_path / "r.sqlite"
    code, _, err = _run(["run", *QUICK, "--model", str(tiny_model_dir), "--methods", "rtn", "--schemes", "w4a16",
                         "--data-dir", str(data_dir), "--results", str(results), "--out", str(blocker / "report")],
                        capsys)
    assert code == 2 and "is not a writable folder" in err and "Nothing was run" in err
    assert _snapshot(results) in (None, [])


def _damage(src: Path, dest: Path) -> Path:
    shutil.copyfile(src, dest)
    with open(dest, "r+b") as f:   # the b-tree page after the schema's: a damaged page, as a bad disk leaves
        f.seek(4096 * 2)
        f.write(b"\xff" * 64)
    return dest


@pytest.mark.parametrize("command", ["run", "results", "report", "compare"])
def test_a_damaged_store_is_bad_input(command, stored, tmp_path, capsys):
    bad = _damage(stored, tmp_path / "bad.sqlite")
    before = bad.read_bytes()
    args = {"run": ["run", "--results", str(bad), "--methods", "rtn"], "results": ["results", "--results", str(bad)],
            "report": ["report", "--results", str(bad), "--out", str(tmp_path / "rep")],
            "compare": ["compare", str(stored), str(bad)]}[command]
    code, out, err = _run(args, capsys)
    assert code == 2 and "is damaged" in err and ".recover" in err and "Traceback" not in err
    assert bad.read_bytes() == before


def test_undecodable_rows_are_reported(stored, tmp_path, capsys):
    p = tmp_path / "r.sqlite"
    shutil.copyfile(stored, p)
    conn = sqlite3.connect(p)
    conn.execute("UPDATE results SET config = '{cut' WHERE id = 40")   # the newest row: the one the gate reads
    conn.commit()
    conn.close()
    code, out, err = _run(["results", "--results", str(p), "--json"], capsys)
    assert code == 0 and len(json.loads(out)) == 39 and "1 stored row(s)" in err and "left out" in err
    code, out, err = _run(["compare", str(stored), str(p)], capsys)
    assert code == 2 and "cannot be decoded" in err


def test_results_into_a_closed_pipe_is_quiet(tmp_path):
    from bench.common.store import Row
    path = tmp_path / "big.sqlite"   # far more than a pipe's buffer, so the writer meets the closed pipe
    ResultStore(path).write_unit([Row("m", "rtn", "w4a16", "wikitext2", f"metric{i}", float(i),
                                      config={"pad": "x" * 500}) for i in range(2000)], "k")
    proc = subprocess.run(f"{sys.executable} -m bench.cli results --json --results {path} | head -c 10",
                          shell=True, capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert len(proc.stdout) == 10 and proc.stderr == "", proc.stderr


# ---- 6. fast paths take only the shapes they can -----------------------------------------------------------

@pytest.mark.parametrize("scheme_name", ["w4a16", "w4a16-g128", "w3a16", "w3a16-g128", "w8a8", "w4a8"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_every_packed_format_on_awkward_shapes(scheme_name, dtype):
    """N and K not multiples of 16 or of the group size, at decode (M = 1) and prefill (M = 40) sizes: every
    path a PackedLinear takes on the CPU (torch's int4 kernel, int_mm, dequantize + BLAS) gives the fake-quant
    result or falls back."""
    from lrq.packed import PackedLinear
    from lrq.qlinear import QuantLinear
    from lrq.quant import minmax_qparams
    from lrq.schemes import get_scheme
    torch.manual_seed(0)
    s = get_scheme(scheme_name)
    for n, k in ((344, 200), (40, 136), (16, 160)):
        lin = torch.nn.Linear(k, n)
        scale, zero = minmax_qparams(lin.weight, s.w_bits, s.group_size)
        q = QuantLinear.from_linear(lin, s, scale.half().float(), zero)
        if s.static_activations:
            q.set_static_range(torch.tensor(0.02), torch.tensor(128.0))
        p = PackedLinear.from_quant_linear(q)
        for m in (1, 40):
            x = torch.randn(m, k).to(dtype)
            y, ref = p(x), q(x.float())
            assert y.shape == (m, n) and torch.isfinite(y).all()
            torch.testing.assert_close(y.float(), ref, rtol=3e-2 if dtype == torch.bfloat16 else 1e-4,
                                       atol=3e-2 if dtype == torch.bfloat16 else 1e-4)


def test_generate_with_an_intermediate_size_not_a_multiple_of_16():
    """The issue's crash: a random Llama with intermediate size 344, 4-bit packed, bf16 generate on the CPU."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from lrq.methods import get_method
    from lrq.packed import pack_model
    from lrq.schemes import get_scheme
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=344, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False)
    model = LlamaForCausalLM(cfg).eval()
    rtn = get_method("rtn")
    rtn.quantize(model, get_scheme("w4a16"), rtn.config("quick"), None)
    pack_model(model)
    model = model.to(torch.bfloat16)
    out = model.generate(torch.tensor([[1, 2, 3]]), max_new_tokens=4, do_sample=False, pad_token_id=0)
    assert out.shape == (1, 7)


# ---- 7. pytest, python -m pytest and tox collect the same suite --------------------------------------------

def test_bare_pytest_collects_the_suite():
    env = {k: v for k, v in os.environ.items() if k != "PYTEST_ADDOPTS"}
    # the bare `pytest` of the environment running this test (its bin/ beside the interpreter; PATH's when there is
    # none there): a venv used without activating it must not pick another installation's pytest
    beside = Path(sys.executable).with_name("pytest")
    bare = str(beside) if beside.exists() else shutil.which("pytest") or "pytest"
    runs = [subprocess.run(cmd + ["--collect-only", "-q", "-p", "no:cacheprovider"], cwd=ROOT, capture_output=True,
                           text=True, env=env, timeout=600) for cmd in ([bare], [sys.executable, "-m", "pytest"])]
    counts = []
    for r in runs:
        assert r.returncode == 0 and "error" not in r.stdout.lower().split("collected")[-1], r.stdout[-2000:]
        counts.append([l for l in r.stdout.splitlines() if "collected" in l][-1].split(" in ")[0])
    assert counts[0] == counts[1] and int(counts[0].split()[0].split("/")[0]) > 400   # "883/908" with heavy left out


def test_a_full_disk_is_said_as_such(tmp_path):
    from bench.common.store import _reraise
    from lrq.errors import UserError
    with pytest.raises(UserError, match="disk full: cannot write to the results store .* Free some space"):
        _reraise(tmp_path / "r.sqlite", sqlite3.OperationalError("database or disk is full"))
    with pytest.raises(sqlite3.IntegrityError):   # a constraint is a bug, not the user's disk
        _reraise(tmp_path / "r.sqlite", sqlite3.IntegrityError("NOT NULL constraint failed"))


def test_written_files_are_readable_like_plain_ones(tmp_path):
    """Reports and stores are written atomically through a private temporary file; the result must not keep
    its 0600 mode (a shared results folder would be unreadable to the rest of the team)."""
    import os
    import stat

    from lrq.io import _UMASK, atomic_write_text
    new = atomic_write_text(tmp_path / "report.md", "a")
    assert stat.S_IMODE(new.stat().st_mode) == 0o666 & ~_UMASK
    kept = tmp_path / "kept.md"
    kept.write_text("old")
    os.chmod(kept, 0o640)
    atomic_write_text(kept, "new")
    assert stat.S_IMODE(kept.stat().st_mode) == 0o640 and kept.read_text() == "new"


# ---- 8. the rest of the round (issue item 5) ----------------------------------------------------------------

def test_a_setting_given_twice_is_refused(tiny_model_dir, data_dir, tmp_path, capsys):
    results = tmp_path / "r.sqlite"
    code, _, err = _run(["run", *QUICK, "--model", str(tiny_model_dir), "--data-dir", str(data_dir), "--no-fp",
                         "--results", str(results), "--methods", "smoothquant", "--schemes", "w8a8",
                         "--set", "alpha=0.5", "--set", "alpha=0.8"], capsys)
    assert code == 2 and "--set alpha is given twice (alpha=0.5 and alpha=0.8)" in err and "Traceback" not in err
    assert _snapshot(results) in (None, [])


def test_minus_zero_is_one_cell_with_zero(tiny_model_dir, data_dir):
    from bench.run.cell import Request, settle

    def keys(method, overrides):
        return settle(Request(model=str(tiny_model_dir), method=method, scheme="w8a8", overrides=overrides,
                              data_dir=str(data_dir))).keys
    assert keys("smoothquant", {"alpha": "-0"}) == keys("smoothquant", {"alpha": "0"}) == \
        keys("smoothquant", {"alpha": -0.0})
    assert keys("smoothquant", {"alpha": "0"}) != keys("smoothquant", {})


def test_integer_settings_are_never_read_through_a_float():
    from lrq.methods import get_method
    big = 2**53 + 1                                   # the first integer a float cannot hold
    for given in (str(big), big):
        rank = get_method("lrq").config("quick", {"rank": given})["rank"]
        assert rank == big and isinstance(rank, int)
    assert get_method("lrq").config("quick", {"rank": "1e3"})["rank"] == 1000


@pytest.mark.parametrize("seeds", [["--seed", "-1"], ["--seed", str(2**32)], ["--seeds", f"0,{2**32}"]])
def test_seeds_numpy_cannot_take_are_refused_before_work(seeds, tiny_model_dir, data_dir, tmp_path, capsys,
                                                          monkeypatch):
    import bench.common.models as models
    monkeypatch.setattr(models, "load_model", lambda *a, **k: pytest.fail("the model was loaded"))
    results = tmp_path / "r.sqlite"
    code, _, err = _run(["run", *QUICK, "--model", str(tiny_model_dir), "--data-dir", str(data_dir), "--no-fp",
                         "--results", str(results), "--methods", "smoothquant", "--schemes", "w8a8", *seeds], capsys)
    assert code == 2 and f"{seeds[0]} {seeds[1].split(',')[-1]} is outside 0..4294967295" in err, err
    assert _snapshot(results) in (None, [])
    code, _, err = _run(["export", "--model", str(tiny_model_dir), "--method", "smoothquant", "--scheme", "w8a8",
                         "--out", str(tmp_path / "out"), "--seed", str(2**32)], capsys)
    assert code == 2 and "--seed 4294967296 is outside" in err and not (tmp_path / "out").exists()


def test_a_tilde_in_the_cache_variable_is_the_home_folder(tmp_path, monkeypatch):
    from bench.common.cache import cache_root
    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.setenv("LRQ_BENCH_CACHE", "~/lrq-cache")
    assert cache_root() == tmp_path / "lrq-cache"      # not a folder named '~' in the working directory


def test_plan_with_a_cache_it_cannot_write_is_bad_input(tmp_path, capsys, monkeypatch):
    blocker = tmp_path / "a-file"      # a cache folder under a file: unwritable even to root, unlike chmod
    blocker.write_text("")
    monkeypatch.setenv("LRQ_BENCH_CACHE", str(blocker / "cache"))
    code, _, err = _run(["plan", "--model", "smollm2-135m", "--methods", "rtn", "--schemes", "w4a16"], capsys)
    assert code == 2 and "Traceback" not in err, err
    assert f"the cache folder '{blocker / 'cache'}' is not a writable folder" in err
    assert "LRQ_BENCH_CACHE" in err and "--machine-profile" in err


def test_too_many_jobs_for_the_memory_name_jobs(tiny_model_dir, data_dir, tmp_path, capsys, monkeypatch):
    """--jobs 999 splits the host's memory 999 ways: the refusal says so and how many would fit, instead of
    'needs 0.5 GiB, 0.0 GiB available' with advice about calibration sizes."""
    monkeypatch.setenv("LRQ_BENCH_HOST_MEMORY_GB", "8")
    results = tmp_path / "r.sqlite"
    code, _, err = _run(["run", *QUICK, "--jobs", "999",      # the last --jobs is the one argparse keeps
                         "--model", str(tiny_model_dir), "--data-dir", str(data_dir), "--no-fp", "--results",
                         str(results), "--methods", "rtn", "--schemes", "w4a16"], capsys)
    assert code == 2 and "available to each of the --jobs 999 cells run at once (8.0 GiB in all)" in err, err
    assert "What would fit: fewer cells at once (--jobs " in err and "Traceback" not in err
    assert _snapshot(results) in (None, [])
