"""The planner: shapes from configs alone, a measured machine profile, estimates within a factor of 2 of
measured cell costs on a model of a width the profile never saw, and the memory pre-flight that refuses a
cell which cannot fit, saying what would."""

from __future__ import annotations

import json
import copy
import time

import pytest
import torch

from bench.run import plan as P
from bench.run import probes as PR
from bench.cli import main
from bench.common.store import ResultStore
from lrq.errors import UserError
from lrq.methods import Calibration, get_method
from lrq.schemes import get_scheme
from conftest import tiny_model


def test_llama_shapes_have_their_published_parameter_counts():
    assert P.SHAPES["llama-2-7b"].params() == pytest.approx(6.74e9, rel=0.01)
    assert P.SHAPES["llama-2-13b"].params() == pytest.approx(13.0e9, rel=0.01)
    assert P.SHAPES["llama-2-70b"].params() == pytest.approx(69.0e9, rel=0.01)
    assert P.SHAPES["smollm2-135m"].params() == pytest.approx(134.5e6, rel=0.01)  # tied head: one matrix


GEMMA3_270M = {"model_type": "gemma3_text", "hidden_size": 640, "intermediate_size": 2048, "num_hidden_layers": 18,
               "num_attention_heads": 4, "num_key_value_heads": 1, "head_dim": 256, "vocab_size": 262144,
               "tie_word_embeddings": True, "sliding_window": 512, "hidden_activation": "gelu_pytorch_tanh",
               "layer_types": (["sliding_attention"] * 5 + ["full_attention"]) * 3}


def test_any_decoder_is_priced_from_its_config():
    """Gemma 3 270M's config (as transformers converts its GGUF): head_dim 256 (not 640 / 4), the tied head
    counted once, 15 of 18 layers attending through a 512-token window; its parameter count is the converted
    model's (268,098,176 with the norms: 18 x 4 norms + q/k norms, which the planner leaves out)."""
    s = P.shape_from_config("gemma3-270m", GEMMA3_270M)
    assert s == P.SHAPES["gemma3-270m"]     # the built-in's shape is its config's
    assert (s.head_dim, s.tied, s.sliding_layers, s.sliding_window, s.rough) == (256, True, 15, 512, "")
    assert s.linears()[0] == (640, 1024) and s.linears()[3] == (1024, 640)
    assert s.params() == pytest.approx(268.1e6, rel=0.001)
    # a sliding window makes long windows cheaper per block than full attention, never dearer
    full = P.shape_from_config("full", GEMMA3_270M | {"layer_types": ["full_attention"] * 18})
    assert s.block_fwd_flops(2048, 2048) < full.block_fwd_flops(2048, 2048)
    assert s.block_fwd_flops(256, 256) == full.block_fwd_flops(256, 256)   # windows shorter than the window
    # nested as in a multimodal config
    assert P.shape_from_config("nested", {"model_type": "gemma3", "text_config": GEMMA3_270M}).head_dim == 256


def test_an_unseen_architecture_gets_a_rough_estimate_not_a_refusal(tmp_path):
    gpt2 = {"model_type": "gpt2", "n_embd": 768, "n_layer": 12, "n_head": 12, "vocab_size": 50257,
            "activation_function": "gelu_new", "tie_word_embeddings": True}
    s = P.shape_from_config("gpt2", gpt2)
    assert (s.hidden, s.layers, s.heads, s.intermediate, s.mlp) == (768, 12, 12, 3072, "plain")   # fc, proj
    assert "not one whose block the planner knows" in s.rough and "4 x hidden assumed" in s.rough
    (tmp_path / "config.json").write_text(json.dumps(gpt2))
    assert main(["plan", "--model", str(tmp_path), "--methods", "rtn", "--schemes", "w4a16"]) == 0
    with pytest.raises(UserError, match="not a decoder the planner can price"):
        P.shape_from_config("vision", {"model_type": "vit", "image_size": 224})


def test_shape_from_a_config_folder(tiny_model_dir):
    s = P.load_shape(str(tiny_model_dir))
    assert (s.hidden, s.layers, s.kv_heads) == (64, 2, 2)
    with pytest.raises(UserError, match="cannot read a model configuration"):
        P.load_shape("/no/such/config")


@pytest.fixture(scope="module")
def profile():
    """This machine's profile, timed in this process's CPU seconds (time.process_time) instead of wall seconds:
    what the cost model is checked against below is timed the same way, so other processes on a shared machine
    (a long run, a second test session) slow neither side. On an idle machine the two clocks agree for a one-thread process."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(time, "perf_counter", time.process_time)
        return P.measure_profile("cpu")


@pytest.mark.parametrize("method, over", [("lrq", {"iters": 20, "heldout_samples": 2}), ("gptq", {}), ("awq", {})])
def test_estimate_within_a_factor_of_two_of_the_measured_cost(profile, method, over):
    model = tiny_model("llama", hidden=192, layers=3, vocab_size=256)    # a width the profile never measured
    shape = P.shape_from_config("tiny-192", model.config)
    n, seq = 8, 96
    ids = torch.randint(0, 256, (n, seq), generator=torch.Generator().manual_seed(0))
    calib = Calibration(ids, {"dataset": "random", "n_samples": n, "seq_len": seq, "seed": 0})
    m = get_method(method)
    cfg = m.config("quick", over)
    est = P.plan_cells(shape, [method], ["w4a16"], profile, overrides=over, n=n, seq=seq)[0].seconds
    times = []
    for _ in range(2):   # the faster of two runs, in CPU seconds as the profile was measured
        q = copy.deepcopy(model)
        t = time.process_time()
        m.quantize(q, get_scheme("w4a16"), cfg, calib)
        times.append(time.process_time() - t)
    measured = min(times)
    assert 0.5 <= est / measured <= 2.0, (method, est, measured)


def test_plan_command_for_llama_shapes(profile, tmp_path, capsys, monkeypatch):
    import json
    f = tmp_path / "machine.json"
    f.write_text(json.dumps(profile))
    assert main(["plan", "--model", "llama-2-70b", "--profile", "full", "--methods", "lrq,rtn", "--schemes",
                 "w4a16,w8a8", "--machine-profile", str(f), "--gpus", "8"]) == 0
    out = capsys.readouterr().out
    assert "llama-2-70b (68.98 B parameters, 80 blocks)" in out
    assert out.count("| lrq ") == 2 and out.count("| rtn ") == 2
    # a CPU machine's profile gives CPU hours, never labelled as GPU hours
    assert "wall time on 8 workers" in out and "CPU-process-hours" in out and "GPU" not in out
    assert main(["plan", "--model", "llama-2-7b", "--methods", "gptq", "--schemes", "w3a16", "--machine-profile",
                 str(f), "--json"]) == 0
    plan = json.loads(capsys.readouterr().out)
    assert plan["shape"]["layers"] == 32 and len(plan["cells"]) == 1 and plan["cells"][0]["hours"] > 0


def test_memory_preflight_refuses_and_says_what_would_fit():
    shape = P.SHAPES["llama-2-70b"]
    with pytest.raises(UserError) as e:
        P.check_fits(shape, get_method("lrq"), 512, 1024, "cpu", host_available=64 * 2**30)
    msg = str(e.value)
    assert "needs about" in msg and "GiB of host memory" in msg and "What would fit" in msg
    P.check_fits(P.SHAPES["smollm2-135m"], get_method("lrq"), 128, 512, "cpu", host_available=64 * 2**30)   # fits: no error
    with pytest.raises(UserError, match="device memory"):
        P.check_fits(shape, get_method("lrq"), 128, 2048, "cuda", host_available=2**50, device_available=2**30)


def test_the_process_baseline_is_measured_once_in_a_fresh_interpreter_and_counted(tmp_path, monkeypatch):
    """The memory estimate starts from what a worker holds before it loads a model (its interpreter and
    libraries: about 0.45 GiB with torch 2.13), measured in a subprocess once per machine and versions."""
    import subprocess
    monkeypatch.setenv("LRQ_BENCH_CACHE", str(tmp_path))
    P.process_baseline_bytes.cache_clear()
    try:
        base = P.process_baseline_bytes()
        assert 150 * 2**20 < base < 4 * 2**30             # torch alone is more than 150 MiB resident
        stored = json.loads((tmp_path / "process-baseline.json").read_text())
        assert list(stored.values()) == [base] and torch.__version__ in next(iter(stored))
        P.process_baseline_bytes.cache_clear()

        def no_subprocess(*a, **k):
            raise AssertionError("measured again")
        monkeypatch.setattr(subprocess, "run", no_subprocess)
        assert P.process_baseline_bytes() == base          # read from the cache, not measured again
        shape = P.SHAPES["smollm2-135m"]
        with_base = P.estimate_memory(shape, get_method("rtn"), 128, 512)[0]
        assert with_base - P.estimate_memory(shape, get_method("rtn"), 128, 512, baseline=0)[0] == base
    finally:
        P.process_baseline_bytes.cache_clear()


def test_awq_memory_is_priced_for_its_captured_activations():
    """AWQ keeps every calibration token's inputs to the searched modules in float32: the long preset's AWQ
    cells on the default model peaked at 5.87 GiB (w4a8) and 6.00 GiB (w3a16) resident on a 2-core Zen 4
    (reports/long-smollm2-135m, 2026-12-04), priced 2.54 GiB before. The estimate now lands within 25 %, and
    grows with the calibration tokens as the captures do."""
    shape = P.SHAPES["smollm2-135m"]
    awq = get_method("awq")
    base = int(0.44 * 2**30)                  # the process baseline measured on that machine
    long = P.estimate_memory(shape, awq, 128, 1024, baseline=base)[0] / 2**30
    assert 0.8 * 6.00 <= long <= 1.25 * 5.87
    tokens = lambda n: P.estimate_memory(shape, awq, n, 1024, baseline=base)[0]  # noqa: E731
    assert tokens(128) - tokens(64) > 1.5 * 2**30    # half the windows: half the captures (about 1.6 GiB)
    assert awq.extra_memory(shape, 0) == 0 and get_method("gptq").extra_memory(shape, 10**6) == \
        get_method("gptq").extra_memory(shape)      # GPTQ's Hessians do not grow with the tokens


def test_run_refuses_a_cell_that_cannot_fit_before_any_work(tiny_model_dir, data_dir, tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("LRQ_BENCH_HOST_MEMORY_GB", "0.001")
    code = main(["run", "--profile", "full", "--tasks", "none", "--model", str(tiny_model_dir), "--methods", "lrq",
                 "--schemes", "w4a16", "--datasets", "wikitext2", "--data-dir", str(data_dir),
                 "--results", str(tmp_path / "r.sqlite"), "--calib-samples", "6", "--calib-seq-len", "32",
                 "--set", "heldout_samples=2"])
    err = capsys.readouterr().err.replace("\n", " ")
    assert code == 2 and "needs about" in err and "host memory" in err
    assert not ResultStore(tmp_path / "r.sqlite").rows()


def test_long_training_is_priced_from_a_step_measured_at_the_cells_shape(tmp_path, monkeypatch):
    """A cell with MEASURE_TRAINING_FROM_STEPS training steps or more is priced from its own step, measured on one
    random block of the model's widths at the cell's batch and window (cached): the FLOP-scaled eager profile
    priced the long preset's compiled steps 3x too slow."""
    from bench.run import plan as P
    from lrq.methods import get_method
    from lrq.schemes import get_scheme
    monkeypatch.setenv("LRQ_BENCH_CACHE", str(tmp_path))
    shape = P.ModelShape("tiny", 64, 160, 2, 4, 2, 128)
    m, scheme = get_method("lrq"), get_scheme("w3a16")
    cfg = m.config("quick", {"iters": 3000, "compile": "on", "batch_size": 2})
    work = dict(m.work(shape, scheme, cfg, 8, 32))
    calls = []
    real = PR._measure_training
    monkeypatch.setattr(PR, "_measure_training", lambda *a: calls.append(1) or real(*a))
    P.measured_training(work, shape, m, scheme, cfg, 32)
    assert "train_lrq" not in work and len(calls) == 1
    (step_kind,) = [k for k in work if k.endswith(":step")]
    assert work[step_kind][0] == 2 * 3000
    probe = json.loads((tmp_path / "plan-training-steps.json").read_text())[step_kind.split(":")[1]]
    assert probe["step_s"] > 0 and probe["key"]["seq"] == 32 and probe["key"]["settings"]["batch_size"] == 2
    expect = 6000 * probe["step_s"] + 2 * probe["block_s"]
    assert abs(P.seconds({k: v for k, v in work.items() if k.startswith("probe:")}, {"kinds": {}}) - expect) < 1e-9
    # cached: the same cell is not measured again; a quick (eager) cell is never measured
    again = dict(m.work(shape, scheme, cfg, 8, 32))
    P.measured_training(again, shape, m, scheme, cfg, 32)
    quick = dict(m.work(shape, scheme, m.config("quick", {}), 8, 32))
    P.measured_training(quick, shape, m, scheme, m.config("quick", {}), 32)
    assert len(calls) == 1 and "train_lrq" in quick


@pytest.mark.parametrize("method", ["gptq", "awq"])
def test_long_gptq_and_awq_are_priced_at_the_models_widths(tmp_path, monkeypatch, method):
    """A GPTQ or AWQ cell with MEASURE_WALK_FROM_TOKENS calibration tokens or more is priced by its own work formula
    at the rate measured on one random block of the model's widths (cached), not at the narrow profile's rate;
    cells with less calibration keep the profile's price, and the probe never touches the cell's checkpoints."""
    from bench.run import plan as P
    from lrq.methods import get_method
    from lrq.schemes import get_scheme
    monkeypatch.setenv("LRQ_BENCH_CACHE", str(tmp_path))
    monkeypatch.setattr(PR, "MEASURE_WALK_FROM_TOKENS", 256)
    shape = P.ModelShape("tiny", 64, 160, 3, 4, 2, 128)
    m, scheme = get_method(method, checkpoint_dir=str(tmp_path / "ck")), get_scheme("w4a16")
    cfg = m.config("quick", {})
    flops = sum(f for _, f in m.work(shape, scheme, cfg, 16, 32).values())
    work = dict(m.work(shape, scheme, cfg, 16, 32))
    calls = []
    real = PR._measure_walk
    monkeypatch.setattr(PR, "_measure_walk", lambda *a: calls.append(1) or real(*a))
    P.measured_walk(work, shape, m, scheme, cfg, 16, 32)
    assert len(calls) == 1 and method not in work and len(work) == 2
    (flop_kind,) = [k for k in work if k.endswith(":flop")]
    assert work[flop_kind][0] == flops and work[flop_kind.replace(":flop", ":block")][0] == 3
    probe = json.loads((tmp_path / "plan-training-steps.json").read_text())[flop_kind.split(":")[1]]
    assert probe["flop_s"] > 0 and probe["block_s"] >= 0 and len(probe["points"]) == 3
    assert probe["key"]["method"] == method and probe["key"]["seq"] == 32
    expect = flops * probe["flop_s"] + 3 * probe["block_s"]
    assert P.seconds(work, {"kinds": {}}) == pytest.approx(expect, rel=1e-12)
    # the line through the two measured sizes (2 and 8 windows of one block; never a negative time)
    (f1, t1), (f2, t2) = probe["points"][1:]
    assert f2 > f1 and probe["flop_s"] == pytest.approx(max((t2 - t1) / (f2 - f1), 1e-15), rel=1e-9)
    assert probe["block_s"] == pytest.approx(max(t1 - f1 * probe["flop_s"], 0.0), rel=1e-9, abs=1e-12)
    # cached; a cell with less calibration than the threshold keeps the FLOP-scaled price
    again = dict(m.work(shape, scheme, cfg, 16, 32))
    P.measured_walk(again, shape, m, scheme, cfg, 16, 32)
    small = dict(m.work(shape, scheme, cfg, 4, 32))
    P.measured_walk(small, shape, m, scheme, cfg, 4, 32)
    assert len(calls) == 1 and again == work and method in small
    assert not (tmp_path / "ck").exists() or not any((tmp_path / "ck").iterdir())
    # the planner asks the method (Method.probe_walk), it names none: one that does not say so keeps its
    # FLOP-scaled price
    monkeypatch.setattr(type(m), "probe_walk", False)
    plain = dict(m.work(shape, scheme, cfg, 16, 32))
    P.measured_walk(plain, shape, m, scheme, cfg, 16, 32)
    assert method in plain and len(calls) == 1


def test_plan_and_run_price_the_same_cells_the_same_way(tiny_model_dir, data_dir, tmp_path, capsys, monkeypatch):
    """`plan` and the estimate `run` prints come from one function (`P.price`): for the same options on an empty
    store and cache they agree to the second, and both count the KL pass (the FP reference over each text once,
    and the float32 head for the FP logits in every quantized cell's pass); `run` leaves out the FP reference
    pass of a text whose reference is cached already."""
    from bench.evaluations import kl
    from bench.run.cell import EvalSettings, Request, resolve_calib, settle
    monkeypatch.setenv("LRQ_BENCH_CACHE", str(tmp_path / "cache"))
    kinds = {k: {"per_call_s": 1e-3, "flops_per_s": 1e9} for k in
             ("fwd", "walk", "rtn", "train_lrq", "train_flexround", "train_omniquant", "gptq", "awq")}
    prof = {"kinds": kinds, "device": "cuda", "hardware": {"gpu": "test"}, "threads": 1, "precision": "bf16"}
    f = tmp_path / "machine.json"
    f.write_text(json.dumps(prof))
    opts = ["--model", str(tiny_model_dir), "--profile", "full", "--methods", "rtn,gptq", "--schemes", "w4a16,w3a16",
            "--datasets", "wikitext2,c4", "--max-eval-tokens", "1024", "--eval-seq-len", "256", "--tasks", "piqa",
            "--task-limit", "8", "--calib-samples", "6", "--calib-seq-len", "32"]
    assert main(["plan", *opts, "--machine-profile", str(f), "--json"]) == 0
    plan = json.loads(capsys.readouterr().out)
    given = {"n_samples": 6, "seq_len": 32}
    cells = [settle(Request(model=str(tiny_model_dir), method=m, scheme=s, datasets=("wikitext2", "c4"),
                            preset="quick", calib=resolve_calib(m, "quick", given), eval=EvalSettings(256, False, 1024),
                            data_dir=str(data_dir), tasks=("piqa",), task_limit=8))
             for m, s in [("fp", "fp")] + [(m, s) for m in ("rtn", "gptq") for s in ("w4a16", "w3a16")]]
    est = P.estimate_run(plan_shape := P.load_shape(str(tiny_model_dir)), dict(enumerate(cells)),
                         {i: set(c.keys) for i, c in enumerate(cells)}, prof)
    assert plan["fp_seconds"] == pytest.approx(est.seconds(0), rel=1e-9)
    assert [c["seconds"] for c in plan["cells"]] == pytest.approx([est.seconds(i) for i in range(1, 5)], rel=1e-9)
    # and per stage, as a run stores each stage's price with its result (planned_time_s)
    for i, c in enumerate(plan["cells"], 1):
        assert set(c["stages"]) == {"quant", "wikitext2", "c4", "tasks"}
        assert c["stages"] == pytest.approx(est.stages[i], rel=1e-9)
    assert plan["total_hours"] * 3600 == pytest.approx(est.total, rel=1e-9)
    # the KL pass is priced: without the KL units the same cells cost less, and the FP reference is paid once
    no_kl = P.estimate_run(plan_shape, dict(enumerate(cells)),
                           {i: {u for u in c.keys if not u.endswith(":kl")} for i, c in enumerate(cells)}, prof)
    assert est.total > no_kl.total and est.seconds(1) - no_kl.seconds(1) > est.seconds(2) - no_kl.seconds(2) > 0
    # a cached reference is loaded, not computed: the first quantized cell's quantization stage no longer pays it
    c = cells[1]
    path = kl.reference_path(kl.reference_key(c.model_id, "c4", c.data["c4"], c.eval.key(), c.precision.used))
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(b"")
    cached = P.estimate_run(plan_shape, dict(enumerate(cells)), {i: set(c.keys) for i, c in enumerate(cells)}, prof)
    assert cached.stages[1]["quant"] < est.stages[1]["quant"] and cached.stages[1]["c4"] == est.stages[1]["c4"]
    assert cached.stages[2] == est.stages[2]


def test_a_loaded_machine_is_said_to_make_the_estimate_too_short():
    assert P.load_note(2, 1, busy=0.1, cpus=2) is None
    note = P.load_note(2, 1, busy=2.0, cpus=2)
    assert "too short" in note and "too long" not in note and "2.0x as long" in note


def test_text_passes_are_priced_from_a_window_measured_at_the_models_shape(tmp_path, monkeypatch):
    """On this machine's CPU profile a text pass, its KL scoring, the FP reference and the tasks are priced from
    one window measured through the harness's own perplexity pass at the model's shape (`measured_eval`, cached
    once), not from FLOPs at the profile's small widths: the float32 head and the KL over a 49k vocabulary
    dominate a SmolLM2 window and were priced at a tenth of their cost."""
    monkeypatch.setenv("LRQ_BENCH_CACHE", str(tmp_path))
    shape = P.ModelShape("probe-test", 128, 384, 2, 2, 2, 30_000)       # 8 M parameters
    monkeypatch.setattr(PR, "MEASURE_EVAL_MIN_PARAMS", 1)
    said = []
    monkeypatch.setattr(PR, "_say_stderr", said.append)
    digest = P.measured_eval(shape, 128)
    assert digest and len(said) == 1 and P.measured_eval(shape, 128) == digest and len(said) == 1   # cached
    probe = json.loads(PR._probe_cache().read_text())[digest]
    assert probe["win_rest_s"] > 0 and probe["win_kl_s"] > 0 and probe["key"]["shape"][-1] == 30_000
    prof = {"kinds": {"fwd": {"per_call_s": 0.0, "flops_per_s": 1e12}}, "device": "cpu"}
    specs = P.plan_specs(["rtn"], ["w4a16"], lambda m: (4, 32), preset="quick", overrides={}, datasets=["wikitext2"],
                         max_tokens=512, eval_seq=128, tasks=[], task_limit=None, fp=False, measure=True)
    prof["kinds"]["rtn"] = {"per_call_s": 0.0, "flops_per_s": 1e12}
    est = P.price(shape, specs, prof)
    windows = 512 // 128
    want = windows * (2 * probe["win_block_s"] + probe["win_rest_s"] + probe["win_kl_s"])
    assert est.stages[0]["wikitext2"] == pytest.approx(want)
    assert est.stages[0]["quant"] >= windows * (2 * probe["win_block_s"] + probe["ref_rest_s"])   # + the reference
    monkeypatch.setattr(PR, "MEASURE_EVAL_MIN_PARAMS", 10**12)                  # a tiny model: FLOP-priced
    assert P.measured_eval(shape, 128) is None


def test_the_training_probe_never_writes_into_a_cells_checkpoints(tmp_path, monkeypatch):
    """The probe that prices a long cell's step trains a random block: with the cell's method instance it wrote
    a block 0 of that random model into the cell's (committed) checkpoint folder (seen on 2026-12-02)."""
    from bench.run import plan as P
    from lrq.methods import get_method
    from lrq.schemes import get_scheme
    monkeypatch.setattr(PR, "_PROBE_STEPS", (1, 2))
    m = get_method("lrq", checkpoint_dir=str(tmp_path / "ck"))
    shape = P.ModelShape("tiny", 64, 128, 2, 4, 2, 256)
    out = PR._measure_training(shape, m, get_scheme("w3a16"), m.config("quick", {"heldout_samples": 1}), 32, False)
    # the step is the median of the probe's own timed steps (lrq.engine's step_s_median), within its training loop
    assert 0 < out["step_s"] <= out["train_s"] <= out["probe_s"][-1]
    assert not (tmp_path / "ck").exists() or not any((tmp_path / "ck").iterdir())
    assert m.checkpoint_dir == str(tmp_path / "ck")     # the cell's own instance is untouched


def test_a_resumed_cell_is_priced_for_the_blocks_it_has_left(tmp_path, monkeypatch):
    """Blocks an earlier run finished are not priced again: half the blocks done, half the per-block work, plus
    the calibration streams recomputed through the finished blocks where they are not kept locally (two streams
    for a method that trains against FP targets, one for GPTQ). `finished_blocks` reads what the next run will
    find: the local checkpoint (with or without its streams) or a carried folder holding more blocks."""
    import dataclasses
    from types import SimpleNamespace
    from bench.run import ledger
    from lrq.blockwise import BlockCheckpoint
    kinds = {k: {"per_call_s": 1e-3, "flops_per_s": 1e9} for k in ("fwd", "walk", "rtn", "train_lrq", "gptq")}
    prof = {"kinds": kinds, "device": "cuda", "hardware": {"gpu": "test"}, "threads": 1}
    shape = P.ModelShape("resume-test", 128, 384, 4, 4, 4, 1000)
    specs = P.plan_specs(["lrq", "gptq"], ["w3a16"], lambda m: (8, 64), preset="quick", overrides={},
                         datasets=[], max_tokens=None, eval_seq=64, tasks=[], task_limit=None, fp=False)
    full = P.price(shape, specs, prof)
    half = P.price(shape, {i: dataclasses.replace(sp, done_blocks=2) for i, sp in specs.items()}, prof)
    for i in specs:
        assert half.stages[i]["quant"] == pytest.approx(full.stages[i]["quant"] / 2)
    assert half.done_blocks == {i: 2 for i in specs} and full.done_blocks == {}
    replayed = P.price(shape, {i: dataclasses.replace(sp, done_blocks=2, replay=True) for i, sp in specs.items()}, prof)
    extra = {specs[i].method.name: replayed.stages[i]["quant"] - half.stages[i]["quant"] for i in specs}
    one_stream = 2 * 1e-3 + 2 * shape.block_fwd_flops(8 * 64, 64) / 1e9
    assert extra["gptq"] == pytest.approx(one_stream) and extra["lrq"] == pytest.approx(2 * one_stream)
    everything = P.price(shape, {i: dataclasses.replace(sp, done_blocks=4) for i, sp in specs.items()}, prof)
    assert all(everything.stages[i]["quant"] == pytest.approx(0.0, abs=1e-9) for i in specs)   # only the walk left

    # what the next run will find
    local, folder = tmp_path / "cache" / "abc123", tmp_path / "carried"
    cell = SimpleNamespace(checkpoint_dir=str(local))
    carry = ledger.Carry(folder, ResultStore(tmp_path / "r.sqlite"))
    assert ledger.finished_blocks(cell, carry) == (0, False)
    assert ledger.finished_blocks(SimpleNamespace(checkpoint_dir=None), carry) == (0, False)
    local.mkdir(parents=True)
    (local / BlockCheckpoint.STATE).write_text(json.dumps({"done": 2, "identity": "x"}))
    assert ledger.finished_blocks(cell, carry) == (2, True)                 # no streams kept: recomputed
    (local / BlockCheckpoint._streams_name(2, "q")).write_bytes(b"")
    assert ledger.finished_blocks(cell, carry) == (2, False)
    (folder / ledger.CHECKPOINTS / "abc123").mkdir(parents=True)
    (folder / ledger.CHECKPOINTS / "abc123" / BlockCheckpoint.STATE).write_text(json.dumps({"done": 3}))
    assert ledger.finished_blocks(cell, carry) == (3, True)                 # the carried folder is further
    assert ledger.finished_blocks(cell) == (2, False)                       # without --sync: the local one
