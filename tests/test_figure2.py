"""bench/studies/figure2.py on a tiny model, and the engine's error curve leaving training unchanged."""

import json

import pytest
import torch

from bench.studies.figure2 import main, markdown, summary


@pytest.fixture(autouse=True)
def _keep_threads():
    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)


ARGS = ["--seq-len", "32", "--calib-samples", "8", "--heldout", "4", "--error-samples", "4", "--iters", "6",
        "--every", "2", "--blocks", "first,last", "--threads", "1", "--scheme", "w4a16", "--set", "lr=0.01"]


def test_figure2_curves_and_resume(tiny_model_dir, data_dir, tmp_path):
    out = tmp_path / "fig2"
    args = ["--model", str(tiny_model_dir), "--data-dir", str(data_dir), "--out", str(out)] + ARGS
    assert main(args) == 0
    res = json.loads((out / "figure2.json").read_text())
    assert sorted(res["results"]) == ["0/flexround", "0/lrq", "1/flexround", "1/lrq"]
    for r in res["results"].values():
        assert [p["step"] for p in r["curve"]] == [0, 2, 4, 6]
        assert all(p["calib"] > 0 and p["heldout"] > 0 for p in r["curve"])
        assert r["resolved"]["iters"] == 6 and r["resolved"]["preset"] == "paper" and r["resolved"]["lr"] == 0.01
    assert res["config"]["calibration"]["sampling"] == "sequential" and res["config"]["heldout_windows"] == 4
    rows = summary(res)
    assert [r["block"] for r in rows] == [0, 1] and "lrq_over_flexround" in rows[0]
    md = (out / "figure2.md").read_text()
    assert "| 0 | lrq | 6 |" in md and "LRQ / FlexRound held-out error at the end, per block" in md
    # every point keeps each window's error: intervals across windows, and the paired per-window ratio
    for r in res["results"].values():
        for p in r["curve"]:
            assert len(p["heldout_windows"]) == 4 and len(p["calib_windows"]) == 4
            assert p["heldout"] == pytest.approx(sum(p["heldout_windows"]) / 4, rel=1e-12)
    lo, hi = rows[0]["lrq"]["heldout_ci"][1:]
    assert lo < rows[0]["lrq"]["heldout"] < hi
    g, glo, ghi = rows[0]["lrq_over_flexround"]["heldout_paired"]
    a = res["results"]["0/lrq"]["curve"][-1]["heldout_windows"]
    b = res["results"]["0/flexround"]["curve"][-1]["heldout_windows"]
    assert glo < g < ghi and min(x / y for x, y in zip(a, b)) <= g <= max(x / y for x, y in zip(a, b))
    assert "window by window on the same windows" in md and f"block 0 {g:.3f} [{glo:.3f}, {ghi:.3f}]" in md
    page = (out / "figure2.html").read_text()
    assert page.count("<svg") == 2 and "lrq held-out" in page
    # a rerun with the same configuration trains nothing again; a changed one starts over
    before = (out / "figure2.json").read_text()
    assert main(args) == 0
    assert json.loads((out / "figure2.json").read_text())["results"] == json.loads(before)["results"]
    assert main(args[:-2] + ["--set", "lr=0.02", "--blocks", "first"]) == 0
    res2 = json.loads((out / "figure2.json").read_text())
    assert sorted(res2["results"]) == ["0/flexround", "0/lrq"] and res2["config"]["settings"]["lr"] == "0.02"
    assert markdown(res2).count("| 0 |") == 2


def test_methods_run_apart_then_merged(tiny_model_dir, data_dir, tmp_path):
    """One process per method (each its own --out), then --merge: the same table as one run of both."""
    from lrq.errors import UserError
    one_block = ARGS.copy()
    one_block[one_block.index("--blocks") + 1] = "first"
    base = ["--model", str(tiny_model_dir), "--data-dir", str(data_dir)] + one_block
    assert main(base + ["--methods", "lrq", "--out", str(tmp_path / "a")]) == 0
    assert main(base + ["--methods", "flexround", "--out", str(tmp_path / "b")]) == 0
    assert main(["--merge", str(tmp_path / "a"), str(tmp_path / "b"), "--out", str(tmp_path / "m")]) == 0
    res = json.loads((tmp_path / "m" / "figure2.json").read_text())
    assert sorted(res["results"]) == ["0/flexround", "0/lrq"] and res["config"]["methods"] == ["lrq", "flexround"]
    assert "lrq_over_flexround" in summary(res)[0] and (tmp_path / "m" / "figure2.html").exists()
    assert main(base + ["--out", str(tmp_path / "both")]) == 0      # the same training, whichever process ran it
    one = json.loads((tmp_path / "both" / "figure2.json").read_text())
    for k in ("0/lrq", "0/flexround"):
        assert res["results"][k]["curve"] == one["results"][k]["curve"]
    assert main(base + ["--methods", "lrq", "--iters", "4", "--out", str(tmp_path / "c")]) == 0
    with pytest.raises(UserError, match="different configuration"):
        main(["--merge", str(tmp_path / "a"), str(tmp_path / "c"), "--out", str(tmp_path / "m2")])
    # a setting of LRQ's alone may differ from the FlexRound run's (which has no rank rule); a shared one not
    assert main(base + ["--methods", "lrq", "--set", "rank_rule=uniform", "--set", "rank=4",
                        "--out", str(tmp_path / "r4")]) == 0
    assert main(["--merge", str(tmp_path / "r4"), str(tmp_path / "b"), "--out", str(tmp_path / "m5")]) == 0
    res5 = json.loads((tmp_path / "m5" / "figure2.json").read_text())
    assert res5["config"]["settings"]["rank_rule"] == "uniform" and res5["results"]["0/lrq"]["resolved"]["rank"] == 4
    other_lr = [a if a != "lr=0.01" else "lr=0.02" for a in base]   # a setting is given once (issue V)
    assert main(other_lr + ["--methods", "flexround", "--out", str(tmp_path / "lr")]) == 0
    with pytest.raises(UserError, match="settings lr"):
        main(["--merge", str(tmp_path / "a"), str(tmp_path / "lr"), "--out", str(tmp_path / "m6")])
    with pytest.raises(UserError, match="more than one run"):
        main(["--merge", str(tmp_path / "a"), str(tmp_path / "a"), "--out", str(tmp_path / "m3")])
    with pytest.raises(UserError, match="does not exist"):
        main(["--merge", str(tmp_path / "nothing"), "--out", str(tmp_path / "m4")])
    # one method of a run (DIR:METHOD), runs over other blocks: the blocks join, each result keeps its machine
    last = base[:]
    last[last.index("--blocks") + 1] = "last"
    assert main(last + ["--methods", "flexround", "--out", str(tmp_path / "bl")]) == 0
    assert main(["--merge", str(tmp_path / "r4"), f"{tmp_path / 'both'}:flexround", str(tmp_path / "bl"),
                 "--out", str(tmp_path / "m7")]) == 0
    res7 = json.loads((tmp_path / "m7" / "figure2.json").read_text())
    assert sorted(res7["results"]) == ["0/flexround", "0/lrq", "1/flexround"] and res7["config"]["blocks"] == [0, 1]
    assert res7["results"]["0/lrq"]["resolved"]["rank_rule"] == "uniform"       # r4's LRQ, not both's
    assert res7["results"]["0/flexround"]["curve"] == one["results"]["0/flexround"]["curve"]
    assert all(r["provenance"]["hardware"]["cpu"] for r in res7["results"].values())
    md = (tmp_path / "m7" / "figure2.md").read_text()
    assert md.count(" thread(s), ") == 3        # each row names its wall time and machine
    with pytest.raises(UserError, match="0/lrq appears in more than one run"):
        main(["--merge", str(tmp_path / "a"), str(tmp_path / "both"), "--out", str(tmp_path / "m8")])
    with pytest.raises(UserError, match="has no omniquant results"):
        main(["--merge", f"{tmp_path / 'both'}:omniquant", "--out", str(tmp_path / "m9")])


def test_figure2_rejects_bad_blocks_and_static_schemes(tiny_model_dir, data_dir, tmp_path):
    from lrq.errors import UserError
    base = ["--model", str(tiny_model_dir), "--data-dir", str(data_dir), "--out", str(tmp_path)] + ARGS
    with pytest.raises(UserError, match="blocks 0..1"):
        main(base + ["--blocks", "7"])
    with pytest.raises(UserError, match="static activation ranges"):
        main(base + ["--scheme", "w8a8"])


def test_the_curve_does_not_change_training(tiny_model_dir, data_dir):
    """The same block trained with and without the curve ends with bitwise the same quantized weights."""
    import copy
    from types import SimpleNamespace

    from bench.evaluations.data import calibration_set
    from bench.common.models import load_model
    from lrq.arch import block_linears, decoder_blocks
    from lrq.blockwise import capture_block_inputs
    from lrq.methods import get_method
    from lrq.schemes import get_scheme

    loaded = load_model(str(tiny_model_dir))
    calib = calibration_set(loaded.tokenizer, data_dir, "c4", 6, 32, sampling="sequential")
    buf, per_layer = capture_block_inputs(loaded.model, calib.input_ids)
    kw = per_layer[0]
    x = buf.data[:].clone()
    block = decoder_blocks(loaded.model)[0]
    with torch.no_grad():
        y = block(x, **kw)[0] if isinstance(block(x, **kw), tuple) else block(x, **kw)
    scheme = get_scheme("w4a16")
    weights = []
    for every, iters in ((0, "5"), (2, "5"), (0, "0")):
        m = get_method("lrq")
        m.curve_every = every
        cfg = m.resolve(scheme, m.config("paper", {"iters": iters, "batch_size": "2", "error_samples": "2",
                                                   "lr": "0.01"}))
        ctx = SimpleNamespace(index=0, n_blocks=2, block=copy.deepcopy(block), q_inputs=SimpleNamespace(data=x),
                              fp_targets=SimpleNamespace(data=y), kwargs=kw, stats={})
        out = m._reconstruct_block(ctx, scheme, cfg, {}, 4, 0)
        assert ("curve" in out) == bool(every) and (len(out.get("curve", [])) == 4 if every else True)
        weights.append({n: (q.qweight.clone(), q.scale.clone()) for n, q in block_linears(ctx.block).items()})
    assert all(torch.equal(weights[0][n][k], weights[1][n][k]) for n in weights[0] for k in (0, 1))
    # and training did move the weights (0 steps: round to nearest)
    assert not all(torch.equal(weights[0][n][0], weights[2][n][0]) for n in weights[0])


@pytest.mark.parametrize("method,extra", [("lrq", {}), ("flexround", {"train_precision": "authors"})])
def test_training_resumes_mid_block_exactly(tiny_model_dir, data_dir, tmp_path, monkeypatch, method, extra):
    """A block's training stopped between two curve points and continued by another process (a new method
    object, the saved state file) ends bitwise where the uninterrupted training ends: weights, scales and
    curve (Adam, the cosine schedule, the GradScaler, the batch order and the generator all resume)."""
    import copy
    from types import SimpleNamespace

    from bench.evaluations.data import calibration_set
    from bench.common.models import load_model
    from lrq.arch import block_linears, decoder_blocks
    from lrq.blockwise import capture_block_inputs
    from lrq.engine import ReconstructionMethod
    from lrq.methods import get_method
    from lrq.schemes import get_scheme

    loaded = load_model(str(tiny_model_dir))
    calib = calibration_set(loaded.tokenizer, data_dir, "c4", 8, 32, sampling="sequential")
    buf, per_layer = capture_block_inputs(loaded.model, calib.input_ids)
    kw, x = per_layer[1], buf.data[:].clone()
    block = decoder_blocks(loaded.model)[1]
    with torch.no_grad():
        y = block(x, **kw)
        y = y[0] if isinstance(y, tuple) else y
    scheme = get_scheme("w4a16")
    state = tmp_path / "state.pt"

    def train(key="run", stop_after=None):
        m = get_method(method)
        m.curve_every, m.train_state_path, m.train_state_key = 2, state, key
        cfg = m.resolve(scheme, m.config("paper", {"iters": "7", "batch_size": "2", "error_samples": "2",
                                                   "lr": "0.01", "compile": "off", **extra}))
        ctx = SimpleNamespace(index=1, n_blocks=2, block=copy.deepcopy(block), q_inputs=SimpleNamespace(data=x),
                              fp_targets=SimpleNamespace(data=y), kwargs=kw, stats={})
        out = m._reconstruct_block(ctx, scheme, cfg, {}, 6, 0)
        return out, {n: (q.qweight.clone(), q.scale.clone()) for n, q in block_linears(ctx.block).items()}

    whole, w_whole = train(key="whole")
    state.unlink()                                     # the uninterrupted run leaves its last save (step 6)
    saves = []
    real_save = ReconstructionMethod._save_train_state

    def save_then_stop(self, st):
        real_save(self, st)
        saves.append(st["step"])
        if st["step"] == 4:
            raise KeyboardInterrupt                    # the process is stopped after the save at step 4
    monkeypatch.setattr(ReconstructionMethod, "_save_train_state", save_then_stop)
    with pytest.raises(KeyboardInterrupt):
        train()
    monkeypatch.setattr(ReconstructionMethod, "_save_train_state", real_save)
    assert saves == [2, 4] and state.exists()
    resumed, w_resumed = train()
    assert [r["step"] for r in resumed["resumed"]] == [4] and "resumed" not in whole
    assert [p["step"] for p in resumed["curve"]] == [0, 2, 4, 6, 7]
    same = lambda a, b: json.dumps(a) == json.dumps(b)     # noqa: E731  (step 0's loss is NaN: != itself)
    assert same(resumed["curve"], whole["curve"]) and resumed["final_loss"] == whole["final_loss"]
    for n in w_whole:
        assert torch.equal(w_whole[n][0], w_resumed[n][0]) and torch.equal(w_whole[n][1], w_resumed[n][1])
    assert resumed["train_s"] >= resumed["resumed"][0]["train_s_before"] > 0
    # a state saved under another key (another configuration) is never resumed from: trained from step 0
    assert state.exists()
    other, w_other = train(key="another")
    assert "resumed" not in other and same(other["curve"], whole["curve"])


def test_figure2_resumes_the_block_in_training(tiny_model_dir, data_dir, tmp_path, monkeypatch):
    """The study stopped mid-(block, method) resumes there on a rerun, says so, and removes its state file."""
    from lrq.engine import ReconstructionMethod
    one = ARGS.copy()
    one[one.index("--blocks") + 1] = "first"
    base = ["--model", str(tiny_model_dir), "--data-dir", str(data_dir), "--methods", "lrq",
            "--state-dir", str(tmp_path / "state")] + one
    assert main(base + ["--out", str(tmp_path / "whole")]) == 0
    assert list((tmp_path / "state").iterdir()) == []
    real_save = ReconstructionMethod._save_train_state

    def save_then_stop(self, st):
        real_save(self, st)
        if st["step"] == 4:
            raise KeyboardInterrupt
    monkeypatch.setattr(ReconstructionMethod, "_save_train_state", save_then_stop)
    with pytest.raises(KeyboardInterrupt):
        main(base + ["--out", str(tmp_path / "cut")])
    assert len(list((tmp_path / "state").iterdir())) == 1
    monkeypatch.setattr(ReconstructionMethod, "_save_train_state", real_save)
    assert main(base + ["--out", str(tmp_path / "cut")]) == 0
    whole = json.loads((tmp_path / "whole" / "figure2.json").read_text())["results"]["0/lrq"]
    cut = json.loads((tmp_path / "cut" / "figure2.json").read_text())["results"]["0/lrq"]
    assert cut["curve"] == whole["curve"] and cut["resumed_at_steps"] == [4] and "resumed_at_steps" not in whole
    assert list((tmp_path / "state").iterdir()) == []
    assert "resumed at step 4" in (tmp_path / "cut" / "figure2.md").read_text()


def test_results_of_an_earlier_run_keep_their_machine(tiny_model_dir, data_dir, tmp_path):
    """A run that adds a block to a folder written by an earlier run (whose results named their machine only at
    the run's level) leaves the earlier results' machine and revision as they were."""
    out = tmp_path / "f"
    base = ["--model", str(tiny_model_dir), "--data-dir", str(data_dir), "--methods", "lrq", "--out", str(out),
            "--state-dir", str(tmp_path / "state")] + ARGS
    first = base.copy()
    first[first.index("--blocks") + 1] = "first"
    assert main(first) == 0
    res = json.loads((out / "figure2.json").read_text())
    res["provenance"]["git"] = "an-earlier-revision"
    del res["results"]["0/lrq"]["provenance"]        # as files written before results kept their own
    (out / "figure2.json").write_text(json.dumps(res))
    assert main(base) == 0                             # adds the last block
    res = json.loads((out / "figure2.json").read_text())
    assert res["results"]["0/lrq"]["provenance"]["git"] == "an-earlier-revision"
    assert res["results"]["1/lrq"]["provenance"]["git"] != "an-earlier-revision"
    assert "an-earlier-revision"[:12] in (out / "figure2.md").read_text()


def test_train_precision_authors_gives_the_study_the_engines_fp16_chain(tiny_model_dir, data_dir, tmp_path):
    """--set train_precision=authors: the study's block sees what the engine's quantize gives it under that
    setting (the model on the fp16 grid, inputs and targets under fp16 autocast), not the float32 chain. LRQ at
    w3a16 trains in fp32 either way, so before this only the label said "authors"."""
    from bench.common.models import load_model
    from bench.evaluations.data import calibration_set
    from lrq.methods import get_method
    from lrq.schemes import get_scheme

    one = ARGS.copy()
    one[one.index("--blocks") + 1] = "first"
    one[one.index("--scheme") + 1] = "w3a16"
    base = ["--model", str(tiny_model_dir), "--data-dir", str(data_dir), "--methods", "lrq",
            "--state-dir", str(tmp_path / "state")] + one
    curves, chains = {}, {}
    for p in ("default", "authors"):
        assert main(base + ["--set", f"train_precision={p}", "--out", str(tmp_path / p)]) == 0
        res = json.loads((tmp_path / p / "figure2.json").read_text())
        assert res["results"]["0/lrq"]["resolved"]["train_precision"] == p
        curves[p] = res["results"]["0/lrq"]["curve"]
        chains[p] = res["config"].get("chain")
    assert curves["authors"][0]["calib"] != curves["default"][0]["calib"]
    # the engine under the same setting, windows and sizes: its block 0 starts from the same errors
    loaded = load_model(str(tiny_model_dir))
    calib = calibration_set(loaded.tokenizer, data_dir, "c4", 12, 32, seed=0, sampling="sequential")
    M = get_method("lrq")
    stats = M.quantize(loaded.model, get_scheme("w3a16"),
                       M.config("paper", {"iters": "6", "batch_size": "2", "heldout_samples": "4",
                                          "error_samples": "4", "lr": "0.01", "train_precision": "authors"}), calib)
    first = stats["block_errors"][0]
    assert first["calib_before"] == pytest.approx(curves["authors"][0]["calib"], rel=1e-6)
    assert first["heldout_before"] == pytest.approx(curves["authors"][0]["heldout"], rel=1e-6)
    assert first["calib_before"] != pytest.approx(curves["default"][0]["calib"], rel=1e-6)
    # the configuration says so, and an earlier "authors" result made on the float32 chain does not match it
    assert chains == {"default": None, "authors": "fp16 model, inputs and targets under fp16 autocast"}


def test_the_study_trains_at_the_precision_asked_and_records_it(tiny_model_dir, data_dir, tmp_path, monkeypatch):
    """Issue Z: the study trained in float32 whatever the question; `--precision bf16` trains under bf16 autocast
    as the long preset does (recorded in its configuration: another study than the float32 one), and LRQ's
    `lowrank_product=fp32` then changes the curve."""
    from lrq import precision
    seen = []
    real = precision.autocast

    def spy(device, enabled=True, *a, **k):
        seen.append((precision.current(), enabled))
        return real(device, enabled, *a, **k)

    monkeypatch.setattr(precision, "autocast", spy)
    args = ["--model", str(tiny_model_dir), "--data-dir", str(data_dir), "--methods", "lrq"] + ARGS
    args[args.index("first,last")] = "first"
    runs = {}
    for name, extra in (("fp32", []), ("bf16", ["--precision", "bf16"]),
                        ("bf16-fp32-product", ["--precision", "bf16", "--set", "lowrank_product=fp32"])):
        seen.clear()
        assert main(args + extra + ["--out", str(tmp_path / name)]) == 0
        runs[name] = json.loads((tmp_path / name / "figure2.json").read_text())
        assert (("bf16", True) in seen) if name != "fp32" else all(p == "fp32" for p, _ in seen), (name, set(seen))
    assert "precision" not in runs["fp32"]["config"] and "bf16" in runs["bf16"]["config"]["precision"]
    curve = lambda r: [p["heldout"] for p in r["results"]["0/lrq"]["curve"]]  # noqa: E731
    assert curve(runs["bf16"]) != curve(runs["fp32"])
    assert curve(runs["bf16-fp32-product"]) != curve(runs["bf16"])
