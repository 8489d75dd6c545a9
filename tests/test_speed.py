"""The speed benchmark's plumbing on tiny shapes (no timing is asserted: these machines are shared)."""

import json

import pytest

import torch

from bench.studies import speed
from bench.common.store import ResultStore
from lrq.errors import UserError
from tests.conftest import onednn_bf16_prepack


def test_layer_latency_rows_and_store(tmp_path):
    rows = speed.layer_latency({"tiny 48x64": (48, 64)}, [3], schemes=("w4a16", "w8a8", "w4a16-g128"))
    assert [r["scheme"] for r in rows] == ["w4a16", "w8a8", "w4a16-g64"]   # g128 does not divide 64: g64
    for r in rows:
        assert r["ms"] > 0 and r["bf16_ms"] > 0 and r["speedup_vs_bf16"] > 0
        assert r["weight_bytes"] < r["bf16_weight_bytes"]   # packed weights really are smaller
    speed._store(rows, "layers", str(tmp_path / "r.sqlite"), "tiny")
    stored = ResultStore(tmp_path / "r.sqlite").rows()
    assert len(stored) == 3 * len(rows) and all(r.dataset == "speed_layers" for r in stored)


def test_packed_random_layer_runs_every_scheme():
    for name in speed.LAYER_SCHEMES:
        layer, shown = speed.random_packed(32, 256, name, "cpu")
        y = layer(torch.randn(2, 256, dtype=torch.bfloat16))
        assert y.shape == (2, 32) and torch.isfinite(y).all()


def test_cli_writes_json(tmp_path, monkeypatch):
    monkeypatch.setitem(speed.SHAPES, "tiny", {"t": (16, 64)})
    out = tmp_path / "l.json"
    assert speed.main(["layers", "--shapes", "tiny", "--ms", "2", "--schemes", "w3a16", "--out", str(out)]) == 0
    doc = json.loads(out.read_text())
    assert doc["rows"][0]["scheme"] == "w3a16" and doc["hardware"] and doc["versions"]["torch"]


def test_report_shows_speed_sections(tmp_path):
    from bench.reports.report import markdown_report
    rows = speed.layer_latency({"tiny 48x64": (48, 64)}, [2], schemes=("w4a16",))
    speed._store(rows, "layers", str(tmp_path / "r.sqlite"), "tiny")
    md = markdown_report(ResultStore(tmp_path / "r.sqlite").rows(latest=True))
    assert "### Per-layer latency" in md and "tiny 48x64" in md
    assert "speed_layers perplexity" not in md


def test_e2e_static_cache_runner_on_a_named_shape(tmp_path):
    """The GPU e2e benchmark's code path (random model of a named shape, RTN packed, static KV cache,
    greedy steps) runs eagerly on the CPU: every format gets a row, bf16 first, weights shrink."""
    out, store = tmp_path / "e2e.json", tmp_path / "r.sqlite"
    rc = speed.main(["e2e", "--device", "cpu", "--shape", "smollm2-135m", "--layers", "1", "--prefill", "8",
                     "--decode", "5", "--schemes", "w4a16,w8a8,w4a8", "--out", str(out), "--results", str(store)])
    doc = json.loads(out.read_text())
    assert rc == 0 and [r["scheme"] for r in doc["rows"]] == ["bf16", "w4a16", "w8a8", "w4a8"]
    bf16 = doc["rows"][0]
    for r in doc["rows"]:
        assert "error" not in r and r["decode_ms_per_token"] > 0 and r["prefill_tok_s"] > 0
        assert r["cuda_graphs"] is False and r["decode_steps"] == 5
        assert r["decode_speedup_vs_bf16"] > 0 and r["decode_floor_ms"] > 0
    assert all(r["weight_bytes"] < bf16["weight_bytes"] for r in doc["rows"][1:])
    assert doc["model"].startswith("smollm2-135m (1 layers")
    # the leaderboard shows the rows as measured: tokens/s and the weights held (kernel copies included)
    from bench.reports.report import markdown_report
    md = markdown_report(ResultStore(store).rows(latest=True))
    assert "### Inference speed (end to end)" in md
    w4 = doc["rows"][1]
    assert f"| w4a16    | {w4['prefill_tok_s']:.1f}" in md and f"{w4['resident_weight_bytes'] / 2**20:.1f} MiB" in md


def test_e2e_row_records_the_dispatchers_choices_and_the_kernel_copies(monkeypatch):
    """The GPU e2e path's dispatch plumbing, run on the CPU: the packed layers take their GPU forward (Triton's
    interpreter) on a tiny Llama, so the row lists the kernel the dispatcher chose per layer shape at the shapes the
    warm-up runs (the prefill's M and M = 1, the ones a GPU run then captures), how many layers took it, and the
    GEMV's second copy of the weights beside the stored bytes."""
    from conftest import tiny_config
    from transformers import LlamaForCausalLM

    from bench.studies import speed_e2e
    from lrq.packed import PackedLinear

    def tiny(shape, layers, device, seed=0):
        torch.manual_seed(seed)
        return LlamaForCausalLM(tiny_config(layers=layers)).to(torch.bfloat16).eval()
    monkeypatch.setattr(speed_e2e, "random_model", tiny)
    monkeypatch.setattr(PackedLinear, "convert_for_cpu", lambda self, levels=None: None)   # keep the planar words
    monkeypatch.setattr(PackedLinear, "forward", lambda self, x: self._forward_gpu(x))
    monkeypatch.setenv("LRQ_DISPATCH_CACHE", "")
    row = speed_e2e.measure_format("tiny", 2, "w4a16", "cpu", prefill=20, decode=2, graphs=False, reps=1)
    got = {(d["n"], d["k"], d["m"]): (d["kernel"], d["source"], d["calls"]) for d in row["dispatch"]}
    # per block: q, o 64x64; k, v 32x64; gate, up 160x64; down 64x160 -> two layers each
    shapes = {(64, 64): 4, (32, 64): 4, (160, 64): 4, (64, 160): 2}
    assert got == {**{(n, k, 20): ("wq_gemm", "static", c) for (n, k), c in shapes.items()},
                   **{(n, k, 1): ("gemv", "static", c) for (n, k), c in shapes.items()}}
    # the GEMV copy per layer: K padded to blocks of 8 x 16 = 128 columns, 4 bytes per 8 levels, fp16 scale + uint8 zero
    copy = sum(c * (-(-k // 128) * 16 * 4 * n + 3 * n) for (n, k), c in shapes.items())
    assert row["kernel_copy_bytes"] == copy
    assert row["resident_weight_bytes"] == row["weight_bytes"] + row["kernel_copy_bytes"]
    assert "gemv (static, 4)" in speed_e2e.dispatch_line(row["dispatch"])


def test_e2e_runner_keeps_decode_positions():
    """Repeated prefills and decode blocks never run past the static cache (positions are reset)."""
    from bench.studies import speed_e2e
    model = speed_e2e.random_model("smollm2-135m", 1, "cpu")
    r = speed_e2e._Runner(model, 8, 4, graphs=False)
    r.capture()
    for _ in range(3):
        r.prefill()
    r.reset()
    for _ in range(4):
        r.step()
    assert int(r.pos) == 12


def test_cpu_e2e_measures_every_candidate_interleaved_in_one_process(tiny_model_dir, data_dir, tmp_path, monkeypatch):
    """Issue W: the CPU e2e study timed one sample per format in separate processes minutes apart, so on a loaded
    machine its ratios disagreed with an interleaved measurement. Now one process, rotating rounds, medians,
    CPU time beside wall time, ratios against the faster dense model, resident weight memory, a folder with a
    chart, and the leaderboard's section from the stored rows."""
    from bench.studies import speed_cpu
    order = []
    real = speed_cpu.decode

    def spy(model, prompt, steps):
        order.append(id(model))
        return real(model, prompt, steps)

    monkeypatch.setattr(speed_cpu, "decode", spy)
    out, store = tmp_path / "speed-cpu", tmp_path / "r.sqlite"
    assert speed.main(["e2e", "--device", "cpu", "--model", str(tiny_model_dir), "--data-dir", str(data_dir),
                       "--schemes", "w4a16,w8a8", "--rounds", "3", "--prefill", "16", "--decode", "2",
                       "--out", str(out), "--results", str(store)]) == 0
    doc = json.loads((out / "speed.json").read_text())
    rows = {r["candidate"]: r for r in doc["rows"]}
    bf16_prepack = onednn_bf16_prepack()   # not on a CPU without bf16 paths in oneDNN (a Zen 3): left out, and why
    dense = ("dense bf16", "dense bf16 [no oneDNN]", "dense fp32", "dense bf16 [torch linears]",
             "dense fp32 [torch linears]", "dense fp32 [oneDNN prepacked]") + (
                 ("dense bf16 [oneDNN prepacked]",) if bf16_prepack else ())
    assert set(rows) == {*dense, "w4a16", "w8a8"}
    skipped = doc["prepacked_skipped"]
    assert skipped == [] if bf16_prepack else (len(skipped) == 1 and skipped[0].startswith(
        "dense bf16 [oneDNN prepacked]: ") and "not measured: dense bf16 [oneDNN prepacked]: " in
        (out / "speed.md").read_text())
    assert rows["dense bf16 [no oneDNN]"]["onednn"] is False and "onednn" not in rows["dense bf16"]
    assert rows["dense bf16 [torch linears]"]["fused"] is False and "fused" not in rows["dense bf16"]
    assert rows["dense fp32 [oneDNN prepacked]"]["linears"] == "oneDNN prepacked"
    n = len(rows)                             # 9 candidates (8 without the bf16 prepacked one)
    timed = order[-3 * n:]                    # 3 rounds x n candidates, after the warm-ups
    rounds = [timed[i:i + n] for i in (0, n, 2 * n)]
    assert len(set(timed)) == n and all(len(set(r)) == n for r in rounds)
    assert rounds[1] == rounds[0][1:] + rounds[0][:1] and rounds[2] == rounds[0][2:] + rounds[0][:2]   # rotating
    for r in rows.values():
        assert r["decode_ms"] > 0 and r["decode_cpu_ms"] > 0 and r["prefill_tok_s"] > 0
        assert r["decode_ms_range"][0] <= r["decode_ms"] <= r["decode_ms_range"][1]
    ref = rows["w4a16"]["dense_reference"]["decode"]
    assert rows[ref]["decode_vs_dense"] == 1.0 and ref in dense
    for r in rows.values():   # each ratio the median of the rounds' own, within their range
        lo, hi = r["decode_vs_dense_range"]
        assert lo <= r["decode_vs_dense"] <= hi and r["prefill_vs_dense_range"][0] <= r["prefill_vs_dense"]
    assert all(rows[ref]["decode_ms"] <= rows[d]["decode_ms"] for d in dense)
    assert "Machine:" in (out / "speed.md").read_text() and (out / "decode.svg").read_text().startswith("<svg")
    # the memory's speed in the same rounds: one plain read a round, its median and spread in the report
    read = doc["memory_read_gbs"]
    assert len(read["rounds"]) == 3 and all(g > 0 for g in read["rounds"]) and read["bytes"] == 256 << 20
    assert read["min"] <= read["median"] <= read["max"]
    assert f"{read['median']:.1f} GB/s ({read['min']:.1f}-{read['max']:.1f})" in (out / "speed.md").read_text()
    from bench.common.store import ResultStore
    from bench.reports.report import markdown_report
    md = markdown_report(ResultStore(store).rows(latest=True))
    assert "### Inference speed on the CPU (end to end, interleaved)" in md and "| w8a8 " in md
    assert "| runtime " in md and "| lean " in md       # how each row ran is shown beside it


def test_the_leaderboard_says_how_a_float32_model_decoded():
    """A CPU speed row of a float32 packed model says when its 4-bit decode steps were not exact float32 (the bf16
    kernel, or the 16-bit integer activations of --fp32-decode i16): a figure carries what produced it."""
    from bench.reports.report import _cpu_runtime
    assert _cpu_runtime({"runtime": "lean"}) == _cpu_runtime({"runtime": "lean", "float32_decode": "exact"}) == "lean"
    assert _cpu_runtime({"runtime": "lean", "float32_decode": "bf16"}) == "lean (4-bit float32 decode via bf16)"
    assert _cpu_runtime({"runtime": "lean", "float32_decode": "i16"}) == (
        "lean (4-bit float32 decode: 16-bit integer activations)")
    assert _cpu_runtime({}) == "hf eager"   # rows from before the runtime was recorded


def test_ratios_pair_each_round_with_the_reference_measured_in_it():
    """A candidate's ratio against the dense model is the median of the rounds' own ratios, with their range: memory
    that slows for a round slows both there, so the pairs hold where a ratio of medians does not (here 2.0x every
    round but the last, 1.5x, against 1.5x from the medians); the reference shows 1.00x without a range, and rounds
    that do not pair are refused."""
    from bench.studies import speed_cpu
    dense = speed_cpu.Candidate("dense bf16", None, "dense", "bfloat16", 100, decode_ms=[10.0, 20.0, 12.0],
                                decode_cpu_ms=[1.0] * 3, prefill_tok_s=[100.0, 50.0, 90.0], prefill_cpu_s=[1.0] * 3)
    ours = speed_cpu.Candidate("w4a16", None, "packed", "bfloat16", 40, decode_ms=[5.0, 10.0, 8.0],
                               decode_cpu_ms=[1.0] * 3, prefill_tok_s=[95.0, 40.0, 90.0], prefill_cpu_s=[1.0] * 3)
    rows = {r["candidate"]: r for r in speed_cpu.rows([dense, ours])}
    assert rows["w4a16"]["decode_vs_dense"] == 2.0 and rows["w4a16"]["decode_vs_dense_range"] == [1.5, 2.0]
    assert rows["w4a16"]["decode_ms_rounds"] == [5.0, 10.0, 8.0]   # every round kept, in the order measured
    assert rows["w4a16"]["prefill_tok_s_rounds"] == [95.0, 40.0, 90.0]
    assert rows["w4a16"]["prefill_vs_dense"] == 0.95 and rows["w4a16"]["prefill_vs_dense_range"] == [0.8, 1.0]
    assert rows["dense bf16"]["decode_vs_dense"] == 1.0 and rows["dense bf16"]["decode_vs_dense_range"] == [1.0, 1.0]
    assert speed_cpu._ratio_text(rows["w4a16"], "decode_vs_dense") == "2.00x (1.50-2.00)"
    assert speed_cpu._ratio_text(rows["dense bf16"], "decode_vs_dense") == "1.00x"
    with pytest.raises(ValueError, match="pair rounds"):
        speed_cpu.paired_ratios([1.0, 2.0], [1.0])


def test_cpu_e2e_runtime_both_times_each_model_through_the_lean_runtime_and_its_own_forward(tiny_model_dir, data_dir,
                                                                                           tmp_path):
    """--runtime both: every model twice on the same weights (lrq.runtime.LeanDecoder, and the transformers
    forward under a suffixed name); each row names its runtime, the ratios take the faster dense of either, and
    only the lean rows reach the results store."""
    from bench.common.store import ResultStore
    from bench.studies import speed_cpu
    out, store = tmp_path / "speed.json", tmp_path / "r.sqlite"
    assert speed.main(["e2e", "--device", "cpu", "--model", str(tiny_model_dir), "--data-dir", str(data_dir),
                       "--schemes", "w4a16", "--rounds", "2", "--prefill", "24", "--decode", "3",
                       "--runtime", "both", "--fp32-decode", "bf16", "--out", str(out), "--results", str(store)]) == 0
    doc = json.loads(out.read_text())
    rows = {r["candidate"]: r for r in doc["rows"]}
    hf = speed_cpu.HF_SUFFIX
    assert set(rows) == {n + s for n in ("dense bf16", "dense fp32", "w4a16") for s in ("", hf)} | {
        "dense bf16 [no oneDNN]", "dense bf16 [torch linears]", "dense fp32 [torch linears]",
        "dense fp32 [oneDNN prepacked]"} | ({"dense bf16 [oneDNN prepacked]"} if onednn_bf16_prepack() else set())
    assert all(r["runtime"] == ("hf eager" if n.endswith(hf) else "lean") for n, r in rows.items())
    import torch
    assert torch.backends.mkldnn.enabled            # restored after the no-oneDNN candidate's calls
    assert rows["w4a16"]["weight_rss_bytes"] == rows["w4a16" + hf]["weight_rss_bytes"]   # one model
    assert doc["float32_decode"] == rows["w4a16"]["float32_decode"] == "bf16"            # recorded per row
    best = min((r for r in rows.values() if r["kind"] == "dense"), key=lambda r: r["decode_ms"])
    assert rows["w4a16"]["dense_reference"]["decode"] == best["candidate"]
    stored = [r for r in ResultStore(store).rows(latest=True)]
    assert stored and not any(hf in str(r) for r in stored)
    with pytest.raises(UserError, match="--runtime lean: .*gemma3_text"):
        from tests.conftest import tiny_model
        speed_cpu.attach_runtime([speed_cpu.Candidate("g", tiny_model("gemma3"), "dense", "float32", 0)], "lean", 8)


def test_cpu_e2e_compares_float32_decode_modes_on_the_same_models_interleaved(tiny_model_dir, data_dir, tmp_path,
                                                                           monkeypatch):
    """--fp32-decode exact,i16: each packed row again in the second mode on the same model (no second copy of its
    weights), the model switched to each row's own mode before its calls in every round; only the first mode's rows
    reach the results store; a mode that does not exist, or several modes where the packed models are not held in
    float32, are refused before anything is built. --bf16-table: the float32 packed rows again with their table in
    bf16, refused where the models are bf16."""
    from bench.studies import speed_cpu
    from lrq.cpu_kernels import int4_form
    from lrq.errors import UserError
    from lrq.packed import PackedLinear
    seen = []
    real = speed_cpu.decode

    def spy(target, prompt, steps):
        model = getattr(target, "model", target)
        forms = [int4_form(m.cpu_weights) for m in model.modules() if isinstance(m, PackedLinear)]
        forms = [f for f in forms if f is not None]
        if forms:
            seen.append((id(model), forms[0].float32_decode, bool(forms[0]._native_layer()[0].x16)))
        return real(target, prompt, steps)

    monkeypatch.setattr(speed_cpu, "decode", spy)
    out, store = tmp_path / "speed-cpu", tmp_path / "r.sqlite"
    assert speed.main(["e2e", "--device", "cpu", "--model", str(tiny_model_dir), "--data-dir", str(data_dir),
                       "--schemes", "w4a16", "--rounds", "2", "--prefill", "16", "--decode", "2",
                       "--precision", "fp32", "--fp32-decode", "exact,i16", "--out", str(out),
                       "--results", str(store)]) == 0
    rows = {r["candidate"]: r for r in json.loads((out / "speed.json").read_text())["rows"]}
    assert rows["w4a16"]["float32_decode"] == "exact" and rows["w4a16 [i16]"]["float32_decode"] == "i16"
    assert rows["w4a16 [i16]"]["mode_copy_of"] == "w4a16"
    assert rows["w4a16 [i16]"]["weight_rss_bytes"] == rows["w4a16"]["weight_rss_bytes"]   # one model
    timed = seen[-4:]                                   # 2 rounds x the two packed rows, after the warm-ups
    assert len({m for m, _, _ in timed}) == 1 and sorted(timed, key=str) == sorted(
        [(timed[0][0], "exact", False), (timed[0][0], "i16", True)] * 2, key=str)
    assert "rows marked [i16]" in (out / "speed.md").read_text()
    from bench.common.store import ResultStore
    assert not any("[i16]" in str(r) for r in ResultStore(store).rows(latest=True))
    # --bf16-table: each packed scheme again with its float32 table held in bf16 (lossless: a bf16 checkpoint), not
    # stored either
    import shutil
    from transformers import AutoModelForCausalLM
    bf16_dir = tmp_path / "bf16-checkpoint"
    shutil.copytree(tiny_model_dir, bf16_dir)
    AutoModelForCausalLM.from_pretrained(tiny_model_dir).to(torch.bfloat16).save_pretrained(bf16_dir)
    assert speed.main(["e2e", "--device", "cpu", "--model", str(bf16_dir), "--data-dir", str(data_dir),
                       "--schemes", "w4a16", "--rounds", "1", "--prefill", "16", "--decode", "2",
                       "--precision", "fp32", "--bf16-table", "--out", str(out), "--results", str(store)]) == 0
    rows = {r["candidate"]: r for r in json.loads((out / "speed.json").read_text())["rows"]}
    assert {"w4a16", "w4a16 +bf16 table"} <= set(rows) and rows["w4a16 +bf16 table"]["kind"] == "packed"
    assert "+bf16 table`: the same packed model" in (out / "speed.md").read_text()
    assert not any("bf16 table" in str(r) for r in ResultStore(store).rows(latest=True))
    with pytest.raises(UserError, match="--bf16-table"):
        speed_cpu.run(str(tiny_model_dir), ["w4a16"], "bf16", 1, 1, 16, 2, str(data_dir), bf16_table=True)
    with pytest.raises(UserError, match="exact,fast"):
        speed.main(["e2e", "--device", "cpu", "--model", str(tiny_model_dir), "--fp32-decode", "exact,fast"])
    with pytest.raises(UserError, match="held in bf16"):
        speed_cpu.run(str(tiny_model_dir), ["w4a16"], "bf16", 1, 1, 16, 2, str(data_dir), float32_decode="exact,i16")


def test_prepacked_dense_baseline_equals_the_dense_model_or_says_why_not(tiny_model_dir, data_dir, monkeypatch):
    """The dense model with oneDNN-prepacked linears (issue W: the best path torch offers) gives the dense model's
    logits; where this torch cannot prepack, the candidate is left out with the reason, not measured wrongly."""
    from bench.studies import speed_cpu
    bf16 = [c for c in speed_cpu.attach_runtime(speed_cpu.build(str(tiny_model_dir), [], torch.bfloat16,
                                                                str(data_dir)), "auto", 64) if c.dtype == "bfloat16"]
    made, skipped = speed_cpu._prepacked(bf16, 16)
    if onednn_bf16_prepack():
        assert skipped == [] and [c.name for c in made] == ["dense bf16 [oneDNN prepacked]"]
        ids = torch.arange(3, 19).unsqueeze(0)
        with torch.no_grad():
            ref, got = bf16[0].model(ids).logits.float(), made[0].model(ids).logits.float()
        assert ((got - ref).abs().max() / ref.abs().max()).item() < 2e-2   # bf16 sums in oneDNN's own order
        assert sum(isinstance(m, speed_cpu.PrepackedLinear) for m in made[0].model.modules()) == 7 * len(
            made[0].model.model.layers)
    else:   # a CPU without oneDNN's bf16 paths (a Zen 3): left out, torch's reason kept
        assert made == [] and len(skipped) == 1 and skipped[0].startswith("dense bf16 [oneDNN prepacked]: ")
        assert len(skipped[0]) > len("dense bf16 [oneDNN prepacked]: ")

    fp32 = [c for c in speed_cpu.attach_runtime(speed_cpu.build(str(tiny_model_dir), [], torch.float32,
                                                                str(data_dir)), "auto", 64) if c.dtype == "float32"]
    made32, skipped = speed_cpu._prepacked(fp32, 16)
    assert skipped == [] and [c.name for c in made32] == ["dense fp32 [oneDNN prepacked]"]

    def no_op(self, lin, batch):
        raise RuntimeError("no mkldnn ops in this build")
    monkeypatch.setattr(speed_cpu.PrepackedLinear, "__init__", no_op)
    made, skipped = speed_cpu._prepacked(bf16, 16)
    assert made == [] and skipped == ["dense bf16 [oneDNN prepacked]: no mkldnn ops in this build"]


def test_the_study_says_which_instruction_sets_its_kernels_and_mkl_were_held_to(monkeypatch):
    """An AVX2-only CPU emulated on an AVX-512 one must hold MKL down too: torch's float32 GEMMs run in MKL, and an
    uncapped MKL timed the dense float32 prefill with AVX-512 while every other kernel ran at AVX2 (session 20 found
    this in the emulated studies). The record names MKL's cap, and the text says when it was left uncapped while
    torch's kernels were held (ATEN_CPU_CAPABILITY), not on a CPU whose own instruction set is AVX2."""
    from bench.studies import speed_cpu
    monkeypatch.setenv("MKL_ENABLE_INSTRUCTIONS", "AVX2")
    isa = speed_cpu._kernels_isa()
    assert isa["mkl_enable_instructions"] == ("AVX2" if torch.backends.mkl.is_available() else "no MKL")
    monkeypatch.setenv("ATEN_CPU_CAPABILITY", "avx2")
    assert speed_cpu._kernels_isa()["aten_cpu_capability"] == "avx2"
    capped = {"kernels_isa": {"aten": "AVX2", "aten_cpu_capability": "avx2", "onednn_max_cpu_isa": "AVX2",
                              "mkl_enable_instructions": "AVX2"}}
    assert speed_cpu._isa_text(capped) == "aten AVX2, oneDNN AVX2, MKL AVX2"
    partial = {"kernels_isa": {**capped["kernels_isa"], "mkl_enable_instructions": "all"}}
    assert "MKL all (not capped" in speed_cpu._isa_text(partial) and "MKL_ENABLE_INSTRUCTIONS" in speed_cpu._isa_text(partial)
    native = {"kernels_isa": {**partial["kernels_isa"], "aten": "AVX512", "aten_cpu_capability": "all"}}
    assert speed_cpu._isa_text(native) == "aten AVX512, oneDNN AVX2, MKL all"
    zen3 = {"kernels_isa": {"aten": "AVX2", "aten_cpu_capability": "all", "onednn_max_cpu_isa": "all",
                            "mkl_enable_instructions": "all"}}   # an AVX2-only CPU as it is: nothing was held
    assert speed_cpu._isa_text(zen3) == "aten AVX2, oneDNN all, MKL all"


def test_emulate_avx2_reruns_the_study_with_every_kernel_held_to_avx2(monkeypatch):
    """`--emulate-avx2` measures as a CPU without AVX-512 or bf16 would: the same command in a child process whose
    torch kernels, oneDNN, MKL and lrq.native build are all held to AVX2 (the flag itself not passed on), its exit
    status returned; a CPU without AVX2 gets a clear error."""
    import platform
    import subprocess
    calls = []
    monkeypatch.setattr(subprocess, "run", lambda cmd, env=None, **kw: calls.append((cmd, env)) or
                        subprocess.CompletedProcess(cmd, 3))
    argv = ["e2e", "--device", "cpu", "--schemes", "w4a8", "--emulate-avx2", "--rounds", "2"]
    if platform.machine() not in ("x86_64", "AMD64"):
        with pytest.raises(UserError, match="no AVX2"):
            speed.main(argv)
        return
    assert speed.main(argv) == 3
    (cmd, env), = calls
    assert cmd[1:] == ["-m", "bench.studies.speed", "e2e", "--device", "cpu", "--schemes", "w4a8", "--rounds", "2"]
    assert {k: env[k] for k in ("ATEN_CPU_CAPABILITY", "ONEDNN_MAX_CPU_ISA", "MKL_ENABLE_INSTRUCTIONS",
                                "LRQ_NATIVE_MARCH")} == {"ATEN_CPU_CAPABILITY": "avx2", "ONEDNN_MAX_CPU_ISA": "AVX2",
                                                         "MKL_ENABLE_INSTRUCTIONS": "AVX2", "LRQ_NATIVE_MARCH": "haswell"}
    monkeypatch.setattr(platform, "machine", lambda: "aarch64")
    with pytest.raises(UserError, match="no AVX2 to hold them to"):
        speed.main(argv)
