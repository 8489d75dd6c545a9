"""One identity, end to end (issue V): a number is shown, compared and reused only under the full identity that
produced it (bench.common.identity). Each test failed on the code before."""

from __future__ import annotations

import math
import shutil

import pytest

from bench.common.identity import of_row
from bench.common.store import ResultStore, Row, unit_key
from bench.reports.report import markdown_report
from lrq.errors import UserError


def _cell(store, method="smoothquant", settings=None, model_fp="folder:sha256:aaaaaaaaaaaaaaaa", quant_time=1.0,
          ppl=None, model="m", source=None, identity=True):
    """A cell as `run` stores it: a quantization unit and, with `ppl`, a WikiText-2 unit, each carrying its
    identity (or, with identity=False, a row stored before identities were recorded: its model source only)."""
    settings = {"alpha": 0.5} if settings is None else settings
    base = {"model": model, "method": method, "scheme": "w8a8", "seed": 0, "method_config": settings,
            "model_source": source or f"folder:/models/{model}", "precision": {"used": "bf16"}}
    ident = {"schema": 1, "model": model_fp, "method": method, "scheme": "w8a8", "config": settings, "seed": 0}
    units = {"quant": ({**base, "identity": ident} if identity else base,
                       [("quant", "bits_per_weight", 8.0), ("quant", "quant_time_s", quant_time),
                        ("quant", "quant_peak_rss_bytes", 1e9)], ident)}
    if ppl is not None:
        ev = {"seq_len": 256, "max_tokens": 512, "include_partial": False, "window_nll": [math.log(ppl)] * 2,
              "window_tokens": [255, 255]}
        pid = ident | {"dataset": "wikitext2", "data": "sha256:1", "eval": {"seq_len": 256}}
        units["wikitext2"] = ({**base, "eval": ev, "identity": pid} if identity else {**base, "eval": ev},
                              [("wikitext2", "ppl", ppl), ("wikitext2", "eval_tokens_per_s", 9.0)], pid)
    for cfg, rows, ident_ in units.values():
        store.write_unit([Row(model, method, "w8a8" if method != "fp" else "fp", d, m, v, config=cfg, seed=0)
                          for d, m, v in rows], unit_key(ident_ | {"source": source or ""}))


def _table_rows(md: str, method: str) -> list[str]:
    return [line for line in md.splitlines() if line.startswith(f"| {method}")]


def test_two_settings_of_one_cell_name_are_two_rows_each_saying_what_differs(tmp_path):
    """SmoothQuant w8a8 at alpha 0.3 (evaluated), then at alpha 0.9 with --datasets none, into one store: before,
    one row showed alpha 0.9's quantization time beside alpha 0.3's perplexity, no setting named."""
    store = ResultStore(tmp_path / "r.sqlite")
    _cell(store, settings={"alpha": 0.3}, quant_time=11.0, ppl=20.0)
    _cell(store, settings={"alpha": 0.9}, quant_time=99.0)
    rows = store.rows(latest=True)
    assert {r.method for r in rows} == {"smoothquant (alpha=0.3)", "smoothquant (alpha=0.9)"}
    by = {(r.method, r.metric): r.value for r in rows}
    assert by[("smoothquant (alpha=0.3)", "quant_time_s")] == 11.0 and by[("smoothquant (alpha=0.3)", "ppl")] == 20.0
    assert by[("smoothquant (alpha=0.9)", "quant_time_s")] == 99.0 and ("smoothquant (alpha=0.9)", "ppl") not in by
    md = markdown_report(rows)
    assert "smoothquant (alpha=0.3)" in md and "smoothquant (alpha=0.9)" in md


def test_a_store_of_one_identity_per_name_is_named_as_before(tmp_path):
    store = ResultStore(tmp_path / "r.sqlite")
    _cell(store, settings={"alpha": 0.3}, ppl=20.0)
    assert {r.method for r in store.rows()} == {"smoothquant"}


def test_an_fp_row_pairs_only_with_cells_of_its_own_weights(tmp_path):
    """A model folder whose weights were replaced, rerun with --no-fp: the old FP perplexity stood beside the new
    quantized one, and 'ppl vs FP' paired windows of two different models."""
    store = ResultStore(tmp_path / "r.sqlite")
    _cell(store, method="fp", settings={}, model_fp="folder:sha256:00000000aaaaaaaa", ppl=10.0)
    _cell(store, settings={"alpha": 0.5}, model_fp="folder:sha256:1e1e1e1e1e1e1e1e", ppl=30.0)
    rows = store.rows(latest=True)
    assert {(r.model, r.method) for r in rows} == {("m@00000000", "fp"), ("m@1e1e1e1e", "smoothquant")}
    md = markdown_report(rows)
    sections = md.split("## Model: ")[1:]
    assert len(sections) == 2
    new = next(s for s in sections if s.startswith("m@1e1e1e1e"))
    lines = new.splitlines()
    assert not [x for x in lines if x.startswith("| fp ")]                    # no FP row of other weights here
    header = next(i for i, x in enumerate(lines) if "ppl vs FP" in x)
    assert lines[header + 2].replace(" ", "").startswith("|smoothquant|w8a8|-|")   # nothing paired with it


def test_report_of_a_synced_store_keeps_a_foreign_unit_apart(tmp_path):
    """A unit of another model source but the same name, method and scheme, newer, won in `report` before."""
    store = ResultStore(tmp_path / "r.sqlite")
    _cell(store, settings={"alpha": 0.5}, ppl=20.0, identity=False, source="folder:/home/a/m")
    _cell(store, settings={"alpha": 0.5}, ppl=90.0, identity=False, source="folder:/home/b/m")
    rows = store.rows(latest=True)
    ppl = sorted((r.model, r.value) for r in rows if r.metric == "ppl")
    assert len(ppl) == 2 and {v for _, v in ppl} == {20.0, 90.0} and ppl[0][0] != ppl[1][0]


def test_a_legacy_row_and_a_new_row_of_a_builtin_are_one_identity():
    from bench.common.models import model_fingerprint
    fp = model_fingerprint("smollm2-135m")
    legacy = Row("smollm2-135m", "rtn", "w4a16", "quant", "bits_per_weight", 4.0,
                 config={"model_source": f"pypi:{fp}", "method_config": {}}, seed=0)
    new = Row("smollm2-135m", "rtn", "w4a16", "quant", "bits_per_weight", 4.0,
              config={"model_source": f"pypi:{fp}", "method_config": {}, "identity": {"model": fp}}, seed=0)
    assert of_row(legacy).differences(of_row(new)) == []


def test_compare_refuses_results_of_other_settings_and_names_them(tmp_path):
    from bench.reports.compare import gate
    base, cur = ResultStore(tmp_path / "base.sqlite"), ResultStore(tmp_path / "cur.sqlite")
    _cell(base, settings={"alpha": 0.3}, ppl=20.0)
    _cell(cur, settings={"alpha": 0.9}, ppl=25.0)
    with pytest.raises(UserError, match=r"differ in settings.*alpha=0.3 -> alpha=0.9.*--allow-settings-change"):
        gate(base.path, cur.path)
    code, md = gate(base.path, cur.path, allow_settings_change=True)
    assert code == 1 and "on purpose (--allow-settings-change)" in md   # compared, and said so
    same = ResultStore(tmp_path / "same.sqlite")
    _cell(same, settings={"alpha": 0.3}, ppl=20.0)
    assert gate(base.path, same.path)[0] == 0


def test_compare_command_line_exits_2_on_other_settings(tmp_path, capsys):
    from bench.cli import main
    base, cur = ResultStore(tmp_path / "base.sqlite"), ResultStore(tmp_path / "cur.sqlite")
    _cell(base, settings={"alpha": 0.3}, ppl=20.0)
    _cell(cur, settings={"alpha": 0.9}, ppl=20.0)
    assert main(["compare", str(base.path), str(cur.path)]) == 2
    assert "alpha" in capsys.readouterr().err
    assert main(["compare", str(base.path), str(cur.path), "--allow-settings-change"]) == 0


def test_pytorch_bin_weights_are_part_of_the_model_identity(tiny_model_dir, tmp_path):
    """A folder read through its pytorch_model.bin: replacing the .bin reused the old cells ("0 to compute")."""
    import torch
    from bench.common.models import model_fingerprint
    folder = tmp_path / "bin-model"
    shutil.copytree(tiny_model_dir, folder)
    state = {}
    for f in folder.glob("*.safetensors"):
        from safetensors.torch import load_file
        state |= load_file(f)
        f.unlink()
    torch.save(state, folder / "pytorch_model.bin")
    before = model_fingerprint(str(folder))
    torch.save({k: v + 1 for k, v in state.items()}, folder / "pytorch_model.bin")
    assert model_fingerprint(str(folder)) != before
    (folder / "notes.bin").write_bytes(b"not weights")      # a file the loader never reads changes nothing
    assert model_fingerprint(str(folder)) == model_fingerprint(str(folder))


def test_a_changed_task_file_is_another_tasks_result(data_dir, tmp_path):
    """Answer keys changed in a task file (SHA256SUMS updated with them) reused the old accuracy: the tasks unit
    was keyed by WikiText-2's file alone."""
    import hashlib
    from bench.run.cell import Request, settle
    copy = tmp_path / "data"
    shutil.copytree(data_dir, copy)
    req = lambda d: Request("smollm2-135m", "rtn", "w4a16", datasets=("wikitext2",), tasks=("piqa",),  # noqa: E731
                            task_limit=10, data_dir=str(d), device="cpu")
    before = settle(req(copy)).keys
    labels = copy / "piqa" / "valid-labels.lst"
    text = labels.read_text().splitlines()
    labels.write_text("\n".join(["1" if x == "0" else "0" for x in text[:5]] + text[5:]) + "\n")
    sums = copy / "SHA256SUMS"
    digest = hashlib.sha256(labels.read_bytes()).hexdigest()
    sums.write_text("\n".join(f"{digest}  piqa/valid-labels.lst" if line.endswith(" piqa/valid-labels.lst") else line
                              for line in sums.read_text().splitlines()) + "\n")
    after = settle(req(copy)).keys
    assert after["tasks"] != before["tasks"]
    assert after["wikitext2"] == before["wikitext2"] and after["quant"] == before["quant"]


@pytest.mark.heavy
def test_every_unit_stores_the_identity_its_key_hashes(tiny_model_dir, data_dir, tmp_path, monkeypatch):
    from bench.cli import main
    monkeypatch.setenv("LRQ_BENCH_CACHE", str(tmp_path / "cache"))
    store = tmp_path / "r.sqlite"
    assert main(["run", "--model", str(tiny_model_dir), "--methods", "rtn", "--schemes", "w4a16", "--tasks", "none",
                 "--datasets", "wikitext2", "--max-eval-tokens", "512", "--eval-seq-len", "256", "--jobs", "1",
                 "--data-dir", str(data_dir), "--results", str(store)]) == 0
    rows = ResultStore(store).rows(as_stored=True)
    assert rows and all(unit_key(r.config["identity"]) == r.unit_key for r in rows)
    assert {r.config["identity"]["model"] for r in rows} == {f"folder:sha256:{of_row(rows[0])['model'][14:]}"}


def test_the_leaderboard_names_every_revision_a_cells_blocks_came_from(tmp_path):
    """Issue Z: a cell resumed across revisions showed only the last run's revision, and '+dirty' was cut off."""
    from lrq.blockwise import walk_time_stats
    made = walk_time_stats([{"block_s": 1.0, "made_by": "a" * 40}, {"block_s": 1.0, "restored": True,
                                                                     "made_by": "a" * 40},
                            {"block_s": 2.0, "made_by": "b" * 40 + "+dirty"}, {"block_s": 2.0}])["block_revisions"]
    assert made == {"a" * 40: [1, 2], "b" * 40 + "+dirty": [3], "unrecorded": [4]}
    store = ResultStore(tmp_path / "r.sqlite")
    cfg = {"method_config": {}, "method_stats": {"block_revisions": made}}
    store.write_unit([Row("m", "lrq", "w3a16", "quant", "bits_per_weight", 3.0, config=cfg, seed=0,
                          git_rev="c" * 40 + "+dirty")], "k")
    md = markdown_report(store.rows(latest=True))
    assert "- lrq w3a16: aaaaaaaaaaaa (blocks 1-2); bbbbbbbbbbbb+dirty (blocks 3); unrecorded (blocks 4)" in md
    assert "Git revisions: cccccccccccc+dirty." in md


def test_results_written_into_the_tree_do_not_make_the_code_dirty(tmp_path):
    import subprocess
    from bench.common import provenance
    repo = tmp_path / "repo"
    (repo / "bench").mkdir(parents=True)
    (repo / "reports").mkdir()
    (repo / "bench" / "x.py").write_text("a = 1\n")
    (repo / "reports" / "results.jsonl").write_text("{}\n")
    git = lambda *a: subprocess.run(["git", "-C", str(repo), *a], check=True, capture_output=True)  # noqa: E731
    git("init", "-q")
    git("-c", "user.email=t@t", "-c", "user.name=t", "add", ".")
    git("-c", "user.email=t@t", "-c", "user.name=t", "commit", "-qm", "x")
    (repo / "reports" / "results.jsonl").write_text("{}\n{}\n")   # a sync folder grows
    assert not provenance.revision_of(repo).endswith("+dirty")
    (repo / "bench" / "x.py").write_text("a = 2\n")                # the code changes
    assert provenance.revision_of(repo).endswith("+dirty")


def test_a_walk_records_the_revision_of_each_block_only_while_asked():
    import torch
    from conftest import tiny_model
    from lrq import blockwise
    from lrq.methods import Calibration, get_method
    from lrq.schemes import get_scheme
    m = get_method("gptq")
    calib = Calibration(torch.randint(0, 128, (4, 16), generator=torch.Generator().manual_seed(0)), {"seed": 0})
    with blockwise.made_by("f" * 40):
        stats = m.quantize(tiny_model("llama", layers=2), get_scheme("w4a16"), m.config("quick"), calib)
    assert stats["block_revisions"] == {"f" * 40: [1, 2]}
    assert blockwise.MADE_BY is None    # nothing leaks into the process's later walks
    stats = m.quantize(tiny_model("llama", layers=2), get_scheme("w4a16"), m.config("quick"), calib)
    assert "block_revisions" not in stats and all(isinstance(v, (int, float)) for v in stats.values())


def test_an_evaluation_field_a_row_never_recorded_separates_nothing():
    """The committed CI references were stored before the head's precision was recorded in the evaluation settings:
    the gate compared them as other evaluations (CI red)."""
    old = Row("m", "rtn", "w4a16", "wikitext2", "ppl", 9.0, config={"eval": {"seq_len": 2048, "max_tokens": 8192}})
    new = Row("m", "rtn", "w4a16", "wikitext2", "ppl", 9.0,
              config={"eval": {"seq_len": 2048, "max_tokens": 8192, "head": "fp32", "bos": False}})
    other = Row("m", "rtn", "w4a16", "wikitext2", "ppl", 9.0, config={"eval": {"seq_len": 1024, "max_tokens": 8192}})
    assert of_row(old).differences(of_row(new)) == []
    assert of_row(old).differences(of_row(other)) == ["evaluation"]
