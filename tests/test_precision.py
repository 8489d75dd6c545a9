"""The compute precision (lrq.precision): `auto` decided from the CPU's flags and torch's capability, every
forward of a run at the cell's precision, the precision in every stored row and store key (bf16 keys as
before), the leaderboard saying which precision each number has, the planner's estimate and the terminal
bar's progress inside cells."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from bench.run import plan as P
from bench.run import profile
from bench.run.cell import EvalSettings, Request, settle
from bench.cli import main
from bench.common.store import ResultStore
from lrq import precision, progress
from lrq.errors import UserError


@pytest.fixture
def cpu(monkeypatch):
    """Pretend to be another CPU: flags, torch's capability, oneDNN's ISA cap."""
    def make(flags=(), capability="AVX512", isa=None, machine="x86_64"):
        precision.cpu_bf16.cache_clear()
        monkeypatch.setattr(precision, "_cpu_flags", lambda: set(flags))
        monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: capability)
        monkeypatch.setattr(precision.platform, "machine", lambda: machine)
        monkeypatch.delenv("DNNL_MAX_CPU_ISA", raising=False)
        if isa:
            monkeypatch.setenv("ONEDNN_MAX_CPU_ISA", isa)
        else:
            monkeypatch.delenv("ONEDNN_MAX_CPU_ISA", raising=False)
    yield make
    precision.cpu_bf16.cache_clear()


def test_auto_asks_the_cpu(cpu):
    cpu({"avx2", "avx512f", "avx512_bf16", "amx_bf16"})        # Intel Xeon with AMX
    assert precision.resolve("auto") == "bf16" and "AMX-BF16" in precision.describe()["why"]
    cpu({"avx2", "avx512f", "avx512_bf16"})                    # AMD Zen 4
    assert precision.resolve("auto") == "bf16"
    cpu({"avx2", "fma", "f16c"}, capability="AVX2")            # AMD Zen 3
    assert precision.resolve("auto") == "fp32"
    assert "neither AVX512-BF16 nor AMX-BF16" in precision.describe()["why"]
    # the emulation of a CPU without native bf16 on an AMX machine is seen through
    cpu({"avx512_bf16", "amx_bf16"}, capability="AVX2")
    assert precision.resolve("auto") == "fp32" and "ATEN_CPU_CAPABILITY" in precision.describe()["why"]
    cpu({"avx512_bf16", "amx_bf16"}, isa="AVX2")
    assert precision.resolve("auto") == "fp32" and "ONEDNN_MAX_CPU_ISA" in precision.describe()["why"]
    cpu({"avx512_bf16", "amx_bf16"}, isa="AVX512_CORE_AMX")
    assert precision.resolve("auto") == "bf16"
    cpu({"fp", "asimd", "bf16"}, capability="DEFAULT", machine="aarch64")   # Arm with BF16
    assert precision.resolve("auto") == "bf16"
    cpu({"fp", "asimd"}, capability="DEFAULT", machine="aarch64")
    assert precision.resolve("auto") == "fp32"
    assert precision.resolve("auto", "cuda") == "bf16"
    # an explicit choice is taken as given, an unknown one is bad input
    assert precision.resolve("BF16") == "bf16" and precision.resolve("fp32") == "fp32"
    with pytest.raises(UserError, match="choose auto, bf16 or fp32"):
        precision.resolve("fp16")


def test_autocast_only_where_the_precision_and_the_caller_allow():
    def dtype_of_a_matmul():
        return (torch.randn(4, 8) @ torch.randn(8, 4)).dtype
    with precision.use("bf16"):
        with precision.autocast("cpu"):
            assert dtype_of_a_matmul() == torch.bfloat16
        with precision.autocast("cpu", enabled=False):   # e.g. the paper preset's fp32 training
            assert dtype_of_a_matmul() == torch.float32
        with precision.use("fp32"), precision.autocast("cpu"):
            assert dtype_of_a_matmul() == torch.float32
    with pytest.raises(UserError):
        with precision.use("half"):
            pass


def test_one_precision_object_decided_once_and_carried_by_the_cell(cpu, data_dir):
    """A settled cell carries a `Precision` (what was asked, what is used, why); the worker receives the same
    object (pickled), the row records its `info()`, and an explicit precision given to an evaluation wins over
    the one in force, so nothing downstream decides it again."""
    import pickle
    cpu({"avx2", "fma", "f16c"}, capability="AVX2")            # AMD Zen 3: auto means fp32
    cell = _cell("auto", data_dir=str(data_dir))
    assert isinstance(cell.precision, precision.Precision)
    assert cell.precision == precision.Precision("fp32", "auto", "the CPU has neither AVX512-BF16 nor AMX-BF16",
                                                 False)
    assert cell.precision.info() == precision.describe("auto") and cell.eval.autocast == "fp32"
    assert pickle.loads(pickle.dumps(cell)).precision == cell.precision
    with pytest.raises(ValueError, match="bf16 or fp32"):
        precision.Precision("auto")                          # a decided precision names what is used
    # the precision in force never overrides the one a caller passes, and the object opens its own region
    from bench.evaluations.perplexity import perplexity
    model = _tiny_llama()
    ids = torch.randint(0, model.config.vocab_size, (64,), generator=torch.Generator().manual_seed(0))
    fp32 = perplexity(model, ids, 32, precision=precision.Precision("fp32"))["nll"]
    with precision.use("bf16"):
        assert perplexity(model, ids, 32, precision="fp32")["nll"] == fp32
        assert perplexity(model, ids, 32)["nll"] != fp32            # None: the precision in force (bf16)
        with precision.Precision("fp32").autocast("cpu"):
            assert (torch.randn(4, 8) @ torch.randn(8, 4)).dtype == torch.float32
    with precision.Precision.decide("bf16").autocast("cpu"):
        assert (torch.randn(4, 8) @ torch.randn(8, 4)).dtype == torch.bfloat16


def _tiny_llama():
    from transformers import LlamaConfig, LlamaForCausalLM
    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                        num_attention_heads=4, num_key_value_heads=2)).eval()


def test_every_autocast_region_is_opened_by_lrq_precision():
    """The one autocast helper: no module of the suite (methods, evaluation, planner, studies) opens a torch
    autocast region of its own; closing one (`enabled=False`, a float32 section) is allowed."""
    import re
    from pathlib import Path
    root = Path(__file__).resolve().parents[1]
    opened = []
    for path in sorted(p for d in ("lrq", "bench", "baselines") for p in (root / d).rglob("*.py")):
        if path == root / "lrq" / "precision.py":
            continue
        for n, line in enumerate(path.read_text().splitlines(), 1):
            for call in re.findall(r"torch\.(?:cpu\.|cuda\.|amp\.)?autocast\([^)]*\)?", line):
                if "enabled=False" not in call:
                    opened.append(f"{path.relative_to(root)}:{n}: {call}")
    assert not opened, "autocast regions opened outside lrq.precision.autocast / authors_fp16:\n" + "\n".join(opened)


def _cell(prec, tmp_data=None, **kw):
    return settle(Request(model="smollm2-135m", method=kw.pop("method", "rtn"), scheme=kw.pop("scheme", "w3a16"),
                          datasets=("wikitext2",), eval=EvalSettings(2048, False, 8192), precision=prec, **kw))


def test_bf16_store_keys_are_those_of_earlier_releases_and_fp32_are_new(data_dir):
    """A bf16 cell's quantization is keyed as before the precision became a choice, and the committed CI
    reference (its perplexity units written again on 2026-12-02, when the output head became float32 and the
    evaluation keys name it) is found under the keys settled today; an fp32 cell is a different cell."""
    ref = json.loads((Path(__file__).resolve().parents[1] / "reports/reference/ci_sweep.json").read_text())
    key = {(r["method"], r["scheme"], r["dataset"]): r["unit_key"] for r in ref
           if r["dataset"] == "quant" or r["metric"] == "ppl"}   # (the KL unit of a text has a key of its own)
    for method, scheme in (("fp", "fp"), ("rtn", "w3a16")):
        bf16, fp32 = _cell("bf16", method=method, scheme=scheme, data_dir=str(data_dir)), \
            _cell("fp32", method=method, scheme=scheme, data_dir=str(data_dir))
        assert bf16.keys["quant"] == key[(method, scheme, "quant")]
        assert bf16.keys["wikitext2"] == key[(method, scheme, "wikitext2")]
        assert bf16.precision.used == "bf16" and fp32.precision.used == "fp32" and fp32.eval.autocast == "fp32"
        assert not set(bf16.keys.values()) & set(fp32.keys.values())


@pytest.mark.heavy
def test_a_run_records_its_precision_and_the_leaderboard_says_it(tiny_model_dir, data_dir, tmp_path, capsys):
    results = tmp_path / "r.sqlite"
    base = ["run", "--profile", "full", "--tasks", "none", "--model", str(tiny_model_dir), "--methods", "rtn",
            "--schemes", "w8a8", "--datasets", "wikitext2", "--data-dir", str(data_dir), "--results", str(results),
            "--max-eval-tokens", "512", "--eval-seq-len", "256", "--calib-samples", "4", "--calib-seq-len", "64",
            "--jobs", "1"]
    assert main(base + ["--precision", "fp32"]) == 0
    err = capsys.readouterr().err
    assert "precision fp32 (asked for explicitly)" in err and "lrq-bench: estimate on this machine" in err
    assert main(base + ["--precision", "bf16", "--out", str(tmp_path / "rep")]) == 0
    capsys.readouterr()
    rows = ResultStore(results).rows(latest=True)
    by = {(r.method, r.dataset, r.metric, r.precision): r for r in rows}
    # both precisions are kept side by side (neither replaces the other), each row saying which it is
    for prec in ("fp32", "bf16"):
        ppl = by[("rtn", "wikitext2", "ppl", prec)]
        assert ppl.config["precision"]["used"] == prec and ppl.config["eval"]["autocast"] == prec
        assert "native_bf16" in ppl.hardware
    assert by[("rtn", "wikitext2", "ppl", "fp32")].value != by[("rtn", "wikitext2", "ppl", "bf16")].value
    md = (tmp_path / "rep" / "leaderboard.md").read_text()
    assert f"## Model: {tiny_model_dir}, precision fp32" in md and f"## Model: {tiny_model_dir}, precision bf16" in md
    assert "Precision of every number in this section: fp32, float32 throughout (asked for explicitly)" in md
    html = (tmp_path / "rep" / "leaderboard.html").read_text()
    assert "precision fp32</h2>" in html and "precision bf16</h2>" in html


@pytest.mark.parametrize("prec, expected", [("fp32", torch.float32), ("bf16", torch.bfloat16)])
def test_every_forward_of_a_quantization_runs_at_the_precision(prec, expected):
    """Calibration passes (W8A8 static ranges), the block walk and LRQ's training steps all see the dtype of
    the precision; the paper preset's fp32 training stays fp32 under bf16."""
    import lrq
    from conftest import tiny_model
    seen: dict[str, set] = {"train": set(), "calib": set()}
    model = tiny_model("llama", layers=1)
    # the MLP module stays in place while its linears are swapped for quantizers: its output shows the dtype
    # of every forward; training steps are the ones run with gradients
    model.model.layers[0].mlp.register_forward_hook(
        lambda m, a, out: seen["train" if torch.is_grad_enabled() else "calib"].add(out.dtype))
    ids = torch.randint(0, 128, (4, 32), generator=torch.Generator().manual_seed(0))
    lrq.quantize(model, "lrq", "w8a8", calibration=ids, iters=2, heldout_samples=1, error_samples=1, precision=prec)
    assert expected in seen["calib"] and seen["train"] == {expected}, seen


def test_stages_and_steps_are_reported_inside_a_cell(tiny_model_dir, data_dir, tmp_path, monkeypatch):
    from bench.run.cell import execute
    monkeypatch.setenv("LRQ_BENCH_CACHE", str(tmp_path / "cache"))   # no checkpoint of an earlier run to resume
    events = []
    cell = settle(Request(model=str(tiny_model_dir), method="lrq", scheme="w4a16", datasets=("wikitext2",),
                          overrides={"iters": 3, "heldout_samples": 1, "error_samples": 1},
                          calib=__import__("bench.run.cell", fromlist=["CalibSettings"]).CalibSettings("c4", 4, 64),
                          eval=EvalSettings(256, False, 1024), data_dir=str(data_dir)))
    old = progress.INTERVAL
    progress.INTERVAL = 0.0      # every report, for the test
    try:
        with progress.reporting(lambda st, d, f: events.append((st, d, f))):
            execute(cell, set(cell.keys))
    finally:
        progress.INTERVAL = old
    stages = [e[0] for e in events if e[2] == 0.0 and e[1] == ""]
    assert stages == ["quant", "wikitext2"]
    assert ("quant", "block 2/2 step 3/3", 1.0) in events
    assert any(st == "wikitext2" and d == "window 4/4" for st, d, _ in events)
    fractions = [f for st, _, f in events if st == "quant" and f is not None]
    assert fractions == sorted(fractions)         # never backwards within a stage


def test_the_board_moves_with_stages_weighted_by_the_estimate():
    from types import SimpleNamespace

    from bench.run.executor import Job, ProgressBoard
    cell = lambda m: SimpleNamespace(method_name=m, scheme_name="w4a16")  # noqa: E731
    jobs = [Job(0, cell("lrq"), frozenset({"quant", "wikitext2"})), Job(1, cell("rtn"), frozenset({"quant"}))]
    board = ProgressBoard(jobs, {0: {"quant": 90.0, "wikitext2": 10.0}, 1: {"quant": 100.0}})
    try:
        board.start(0)
        board.update(0, "quant", "block 15/30", 0.5)
        assert board.bar.n == pytest.approx(45.0) and "lrq w4a16: quant block 15/30" in board.postfix()
        board.update(0, "quant", "block 14/30", 0.4)       # a late or smaller report never moves it back
        assert board.bar.n == pytest.approx(45.0)
        assert not board.eta and "ETA after the first unit" in str(board.bar)   # no ETA before a unit is done
        board.update(0, "quant", "done", 1.0)
        assert board.eta and "ETA after" not in str(board.bar) and "<" in str(board.bar)
        board.update(0, "wikitext2", "window 1/2", 0.5)
        assert board.bar.n == pytest.approx(95.0)
        board.finish(0)
        board.finish(1, failed=True)
        assert board.bar.n == pytest.approx(200.0) and "failed: 1" in board.postfix()
        assert board._desc() == "cells 2/2"
    finally:
        board.close()


def test_profiles_are_per_precision_and_say_when_the_machine_was_busy(monkeypatch, tmp_path):
    monkeypatch.setenv("LRQ_BENCH_CACHE", str(tmp_path))
    assert P.profile_path("cpu", "fp32") != P.profile_path("cpu", "bf16")
    said = []
    fake = {"kinds": {}, "device": "cpu", "precision": "fp32",
            "load": {"busy": True, "others_cpu_share": 0.6, "cpus": 2, "loadavg_before": 2.5, "seconds": 12.0}}
    monkeypatch.setattr(profile, "measure_profile", lambda device, precision: fake)
    P.load_or_measure_profile("cpu", precision="fp32", say=said.append)
    assert said[0].startswith("measuring this machine") and "fp32" in said[0]
    assert any("other processes used 60 % of the 2 CPUs" in s and "--remeasure" in s for s in said)
    said.clear()
    P.load_or_measure_profile("cpu", precision="fp32", say=said.append)   # cached: no measuring, the note again
    assert not any(s.startswith("measuring") for s in said) and any("60 %" in s for s in said)


def test_estimate_counts_only_what_is_missing(tiny_model_dir, data_dir, tmp_path, monkeypatch):
    monkeypatch.setenv("LRQ_BENCH_CACHE", str(tmp_path))   # no KL reference cached (a cached one is not priced)
    shape = P.shape_from_config("tiny", json.loads((tiny_model_dir / "config.json").read_text()))
    prof = {"kinds": {k: {"per_call_s": 0.0, "flops_per_s": 1e9} for k in
                      ("fwd", "walk", "train_lrq", "train_flexround", "train_omniquant", "gptq", "awq")}}
    cell = settle(Request(model=str(tiny_model_dir), method="lrq", scheme="w4a16", datasets=("wikitext2", "c4"),
                          overrides={"iters": 10}, eval=EvalSettings(256, False, 1024), data_dir=str(data_dir)))
    no_kl = {u for u in cell.keys if not u.endswith(":kl")}
    full = P.estimate_run(shape, {0: cell}, {0: set(cell.keys)}, prof)
    full_no_kl = P.estimate_run(shape, {0: cell}, {0: no_kl}, prof)
    part = P.estimate_run(shape, {0: cell}, {0: {"c4"}}, prof)
    none = P.estimate_run(shape, {0: cell}, {0: set()}, prof)
    assert set(full.stages[0]) == {"quant", "wikitext2", "c4"} and set(part.stages[0]) == {"quant", "c4"}
    assert part.stages[0]["quant"] == full_no_kl.stages[0]["quant"] > 0   # quantized again for any missing unit
    assert full.stages[0]["quant"] > full_no_kl.stages[0]["quant"]        # + the FP pass of the KL reference
    assert none.stages == {} and full.wall(2) == full.total


def test_a_stage_stopped_midway_is_never_reported_done():
    """A SIGTERM in the 7th block of AWQ's long cell (2026-12-04) left the bar at 99 % reading "quant done"."""
    from lrq import progress
    seen = []
    with progress.reporting(lambda *a: seen.append(a)):
        with progress.stage("wikitext2"):
            pass
        with pytest.raises(KeyboardInterrupt):
            with progress.stage("quant"):
                raise KeyboardInterrupt
    assert ("wikitext2", "done", 1.0) in seen and not any(s == "quant" and d == "done" for s, d, _ in seen)
