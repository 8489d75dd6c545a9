"""llama.cpp as the anchor of the CPU speed study (issue W item 4): the plumbing without llama-cpp-python, and,
marked `anchors` (left out of the default suite and of CI, which installs only .[dev]; `-m anchors` runs it, and it
fails rather than skips where llama-cpp-python is missing), llama.cpp itself on the built-in GGUF."""

import json

import time

import pytest
import torch

from bench.studies import anchors, speed, speed_cpu
from lrq.errors import UserError
from tests.conftest import onednn_bf16_prepack


def test_anchor_choice_and_the_error_when_asked_but_missing(monkeypatch, tmp_path):
    monkeypatch.setattr(anchors, "available", lambda: False)
    assert anchors.resolve(None) == [] and anchors.resolve("none") == []
    with pytest.raises(UserError, match=r"needs llama-cpp-python.*pip install -e '\.\[anchors\]'"):
        anchors.resolve("llama.cpp")
    with pytest.raises(UserError, match="unknown anchor.*llamafile.*the anchors are llama.cpp"):
        anchors.resolve("llamafile")
    # the study refuses before it builds anything (no model is loaded: the model name does not even exist)
    with pytest.raises(UserError, match=r"pip install -e '\.\[anchors\]'"):
        speed.main(["e2e", "--device", "cpu", "--model", str(tmp_path / "nothing"), "--anchors", "llama.cpp"])
    monkeypatch.setattr(anchors, "available", lambda: True)
    assert anchors.resolve(None) == ["llama.cpp"] and anchors.resolve("llama.cpp") == ["llama.cpp"]
    assert anchors.resolve(None, "smollm2-135m") == ["llama.cpp"]
    assert anchors.resolve(None, str(tmp_path)) == []   # installed, but a model folder has no GGUF to run
    assert anchors.resolve("none") == []


def test_a_crashing_llama_cpp_is_found_by_a_probe_and_named(monkeypatch, tmp_path):
    """llama.cpp faulting in native code (its AMX backend did, on an Intel Xeon with AMX) would kill the study with
    every measurement in it: a child process evaluates each GGUF first, and a crash becomes an error naming the file,
    the signal, the rebuild without AMX (where the build runs it) and --anchors none."""
    import sys
    files = [str(tmp_path / "m.Q4_1.gguf"), str(tmp_path / "m.Q8_0.gguf")]
    crash_on_second = ("import os, signal, sys; print('ok', sys.argv[1], flush=True); "
                       "os.kill(os.getpid(), signal.SIGSEGV)")
    monkeypatch.setattr(anchors, "_probe_command", lambda paths, t, n: [sys.executable, "-c", crash_on_second, *paths])
    monkeypatch.setattr(anchors, "version", lambda: {"llama_cpp_python": "0.3.36",
                                                     "system_info": "CPU : AVX512 = 1 | AMX_INT8 = 1 |"})
    with pytest.raises(UserError) as e:
        anchors.probe(files, 1, 128)
    msg = str(e.value)
    assert "signal SIGSEGV" in msg and "m.Q8_0.gguf" in msg and "--anchors none" in msg
    assert "-DGGML_AMX_INT8=OFF" in msg and "llama-cpp-python==0.3.36" in msg and "20824" in msg
    monkeypatch.setattr(anchors, "version", lambda: {"llama_cpp_python": "0.3.36", "system_info": "CPU : AVX2 = 1 |"})
    monkeypatch.setattr(anchors, "_probe_command", lambda paths, t, n: [sys.executable, "-c", "raise SystemExit(3)"])
    with pytest.raises(UserError, match=r"crashed \(exit status 3\) evaluating m\.Q4_1\.gguf") as e:
        anchors.probe(files, 1, 128)
    assert "AMX" not in str(e.value)
    monkeypatch.setattr(anchors, "_probe_command", lambda paths, t, n: [sys.executable, "-c", "print('ok x')"])
    assert anchors.probe(files, 1, 128) is None


def test_anchor_needs_the_gguf_the_model_comes_from(tmp_path):
    with pytest.raises(UserError, match="neither a built-in GGUF model.*--anchors none"):
        anchors.source_gguf(str(tmp_path))


def _doc(profile_head_ms: float) -> dict:
    row = {"dtype": "bfloat16", "decode_ms_range": [1, 2], "prefill_tok_s": 100.0, "prefill_tok_s_range": [90, 110],
           "weight_rss_bytes": 2**20, "decode_vs_dense": 1.0, "prefill_vs_dense": 1.0, "memory_vs_dense_bf16": 1.0,
           "dense_reference": {"decode": "dense bf16", "prefill": "dense bf16"}}
    rows = [{**row, "candidate": "dense bf16", "kind": "dense", "decode_ms": 90.0, "decode_cpu_ms": 80.0},
            {**row, "candidate": "w4a16-g128", "kind": "packed", "decode_ms": 45.0, "decode_cpu_ms": 40.0},
            {**row, "candidate": "llama.cpp Q4_1", "kind": "anchor", "decode_ms": 20.0, "decode_cpu_ms": 20.0,
             "gguf": "m.Q4_1.gguf", "gguf_sha256": "ab" * 32, "gguf_bytes": 2**20}]
    files = {"Q4_1": {"path": "m.Q4_1.gguf", "sha256": "ab" * 32, "bytes": 2**20,
                      "tensor_types": {"counts": {"Q4_1": 3}, "head": {"token_embd.weight": "Q8_0"}}}}
    groups = [{"group": g, "ms_per_token": ms, "share": ms / 50} for g, ms in
              zip(speed_cpu.PROFILE_GROUPS, (20.0, profile_head_ms, 10.0, 50 - 30 - profile_head_ms))]
    return {"model": "m", "threads": 1, "machine": "a CPU", "hardware": {}, "versions": {"torch": "2"},
            "git_rev": "0" * 40, "precision": {"used": "bf16", "why": "x"}, "rounds": 3, "decode_steps": 2,
            "prefill": 16, "rows": rows,
            "anchors": {"llama.cpp": {"llama_cpp_python": "0.3.36", "system_info": "AVX512 = 1", "n_threads": 1,
                                      "n_batch": 16, "files": files}},
            "profile": {"candidate": "w4a16-g128", "steps": 8, "wall_ms_per_token": 50.0, "groups": groups,
                        "head_dominates": speed_cpu.head_dominates({"groups": groups})}}


def test_markdown_names_llama_cpp_its_gguf_the_ratio_and_the_profile():
    doc = _doc(profile_head_ms=15.0)
    ratio = speed_cpu.anchor_ratio(doc)
    assert ratio == {"ratio": 2.25, "cpu_ratio": 2.0, "target": 1.5, "met": False}   # rows without their rounds
    paired = _doc(profile_head_ms=15.0)   # with them: the median of the rounds' own ratios, and their range
    by = {r["candidate"]: r for r in paired["rows"]}
    by["w4a16-g128"]["decode_ms_rounds"] = [45.0, 60.0, 30.0]
    by["llama.cpp Q4_1"]["decode_ms_rounds"] = [20.0, 20.0, 30.0]
    got = speed_cpu.anchor_ratio(paired)
    assert got["ratio"] == 2.25 and got["range"] == [1.0, 3.0] and not got["met"]
    assert "2.25x slower, the rounds' own 1.00-3.00x" in speed_cpu.markdown(paired)
    md = speed_cpu.markdown(doc)
    assert "|\n\nllama.cpp: llama-cpp-python 0.3.36" in md and "ab" * 32 in md and "token_embd Q8_0" in md
    assert "w4a16-g128 decode vs llama.cpp Q4_1: 2.25x slower" in md and "not met" in md
    assert "| output head " in md and "| framework/Python overhead " in md and "does not dominate" in md
    assert "does not dominate" not in speed_cpu.markdown(_doc(profile_head_ms=25.0))
    fast = _doc(profile_head_ms=15.0)
    next(r for r in fast["rows"] if r["candidate"] == "w4a16-g128")["decode_ms"] = 10.0
    ref = next(r for r in fast["rows"] if r["candidate"] == "llama.cpp Q4_1")["decode_ms"]
    md = speed_cpu.markdown(fast)   # ours faster: said so, not as "0.5x slower"
    assert f"Q4_1: {ref / 10:.2f}x faster (ms/token {10 / ref:.2f}x llama.cpp's)" in md and ": met" in md
    assert speed_cpu.svg(doc).count("#d8843b") == 1   # the anchor drawn in its own colour
    assert "revision 000000000000;" in md
    dirty = dict(doc, git_rev="1" * 40 + "+dirty")   # code changed while it ran: the page says so, as the JSON does
    assert "revision 111111111111+dirty;" in speed_cpu.markdown(dirty)


@torch.no_grad()
def test_profile_groups_a_packed_models_decode_and_the_int8_head():
    from tests.conftest import tiny_model
    from lrq.methods import get_method, load_methods
    from lrq.packed import pack_model
    from lrq.schemes import get_scheme
    load_methods()
    model = tiny_model("llama", vocab_size=256, hidden=128, layers=2).to(torch.bfloat16)
    rtn = get_method("rtn")
    rtn.quantize(model, get_scheme("w4a16"), rtn.config("quick"), None)
    pack_model(model)
    prof = speed_cpu.profile_decode(model, torch.arange(16).unsqueeze(0), steps=3)
    ms = {g["group"]: g["ms_per_token"] for g in prof["groups"]}
    fused = speed_cpu.PROFILE_GROUPS[4]   # the model's own forward: no lean runtime, no fused layers
    assert list(ms) == list(speed_cpu.PROFILE_GROUPS) and ms.pop(fused) == 0 and all(v > 0 for v in ms.values())
    assert sum(ms.values()) == pytest.approx(prof["wall_ms_per_token"], rel=1e-6)
    assert not any(m._forward_hooks or m._forward_pre_hooks for m in model.modules())   # hooks removed
    # the study's int8-head copy: lrq.packed.quantize_head (tested in test_packed), profiled as the output head
    from lrq.packed import PackedLinear, quantize_head
    x = torch.randn(2, 3, 128, dtype=torch.bfloat16)
    ref = model.lm_head(x).float()
    quantize_head(model)
    got = model.lm_head(x).float()
    assert isinstance(model.lm_head, PackedLinear) and got.shape == ref.shape and (got - ref).norm() / ref.norm() < 0.02
    prof = speed_cpu.profile_decode(model, torch.arange(16).unsqueeze(0), steps=3)
    assert {g["group"]: g["ms_per_token"] for g in prof["groups"]}["output head"] > 0


@pytest.mark.anchors
def test_llama_cpp_runs_the_builtin_gguf_and_its_made_copies(tmp_path):
    import llama_cpp  # noqa: F401 - must be installed for this marker: an ImportError fails the test
    from bench.common.hashing import file_sha256
    src = anchors.source_gguf("smollm2-135m")
    files = anchors.gguf_files(src, cache=tmp_path)
    assert files["Q4_1"]["path"] == str(src) and files["Q4_1"]["tensor_types"]["head"] == {
        "token_embd.weight": "Q8_0"}
    assert "Q4_1" not in files["Q8_0"]["tensor_types"]["counts"]
    assert "BF16" in files["BF16"]["tensor_types"]["counts"]
    for kind in ("Q8_0", "BF16"):
        path = tmp_path / "anchors" / f"SmolLM2-135M-Instruct.{kind}.gguf"
        rec = json.loads(path.with_name(path.name + ".json").read_text())
        assert rec["sha256"] == file_sha256(path) == files[kind]["sha256"]
    before = {k: tmp_path.joinpath("anchors", f"SmolLM2-135M-Instruct.{k}.gguf").stat().st_mtime_ns
              for k in ("Q8_0", "BF16")}
    assert anchors.gguf_files(src, cache=tmp_path)["BF16"]["sha256"] == files["BF16"]["sha256"]   # reused
    assert before == {k: tmp_path.joinpath("anchors", f"SmolLM2-135M-Instruct.{k}.gguf").stat().st_mtime_ns
                      for k in ("Q8_0", "BF16")}
    for kind in anchors.LLAMA_CPP_TYPES:
        runner = anchors.LlamaCppRunner(files[kind]["path"], threads=1, n_ctx=32)
        try:
            wall, cpu = runner.decode(list(range(100, 116)), 2)
            tok_s, cpu_s = runner.prefill(list(range(100, 116)))
        finally:
            runner.close()
        assert wall > 0 and cpu > 0 and tok_s > 0 and cpu_s > 0
    assert anchors.version()["llama_cpp_python"] == llama_cpp.__version__


class _FakeRunner:
    """Stands in for llama.cpp: records the tokens it is given, answers fixed times."""

    def __init__(self):
        self.calls, self.closed = [], False

    def decode(self, prompt, steps):
        self.calls.append(("decode", list(prompt), steps))
        return 2.0, 1.5

    def prefill(self, ids):
        self.calls.append(("prefill", list(ids)))
        return 1000.0, 0.01

    def close(self):
        self.closed = True


def test_anchors_join_the_same_rotating_rounds(tiny_model_dir, data_dir, tmp_path, monkeypatch):
    """An anchor is measured in every round, in the rotation, on the same tokens as our models; the profile of
    first packed scheme (w4a16-g128 where measured) is taken; --int8-head adds its int8-head copy; the JSON and
    Markdown carry the anchor's figures; the results store does not get the anchor's rows."""
    runner = _FakeRunner()
    order = []
    real = speed_cpu.decode
    monkeypatch.setattr(speed_cpu, "decode", lambda model, prompt, steps: (order.append(id(model)),
                                                                          real(model, prompt, steps))[1])
    monkeypatch.setattr(anchors, "available", lambda: True)

    def fake_build_anchors(model_name, chosen, threads, n_ctx):
        assert chosen == ["llama.cpp"] and threads == 1 and n_ctx >= 16
        info = {"gguf": "m.Q4_1.gguf", "gguf_sha256": "cd" * 32, "gguf_bytes": 1}
        return [speed_cpu.Candidate("llama.cpp Q4_1", None, "anchor", "Q4_1", 1, runner=runner, info=info)], {}

    monkeypatch.setattr(speed_cpu, "build_anchors", fake_build_anchors)
    probed = []
    monkeypatch.setattr(speed_cpu, "probe_anchors", lambda *a: probed.append((a[1], order[:])))
    out, store = tmp_path / "a", tmp_path / "r.sqlite"
    assert speed.main(["e2e", "--device", "cpu", "--model", str(tiny_model_dir), "--data-dir", str(data_dir),
                       "--schemes", "w4a16", "--rounds", "2", "--prefill", "16", "--decode", "2",
                       "--anchors", "llama.cpp", "--int8-head", "--out", str(out), "--results", str(store)]) == 0
    doc = json.loads((out / "speed.json").read_text())
    names = [r["candidate"] for r in doc["rows"]]
    assert names[:3] == ["dense bf16", "dense fp32", "w4a16"] and names[-1] == "llama.cpp Q4_1"
    assert len([c for c in runner.calls if c[0] == "decode"]) == 2 and runner.closed
    decodes = [c for c in runner.calls if c[0] == "decode"]
    assert all(len(c[1]) == 16 and c[2] == 2 for c in decodes)
    assert [c[1] for c in runner.calls if c[0] == "prefill"][0][:16] == decodes[0][1]   # the same tokens
    # the anchor is first in round 1's rotation slot n-1 and moves up by one in round 2: our models' order shows it
    n = len(names)
    timed = order[-2 * (n - 1):]
    assert timed[n - 1:] == timed[1:n - 1] + timed[:1]
    anchor = doc["rows"][-1]
    assert anchor["kind"] == "anchor" and anchor["decode_ms"] == 2.0 and anchor["gguf_sha256"] == "cd" * 32
    assert doc["profile"]["candidate"] == "w4a16"
    assert probed == [(["llama.cpp"], [])]   # probed once, before any of our models ran
    assert names[3] == "w4a16 +int8 head"   # asked for with --int8-head, whatever the profile says
    assert doc["profile"]["unprofiled_ms_per_token"] > 0
    md = (out / "speed.md").read_text()
    assert "| output head " in md and "llama.cpp Q4_1" in md and "`w4a16 +int8 head` above" in md
    from bench.common.store import ResultStore
    stored = {r.scheme for r in ResultStore(store).rows()}
    assert stored == {"dense bf16", "dense bf16 [no oneDNN]", "dense fp32", "w4a16", "dense bf16 [torch linears]",
                      "dense fp32 [torch linears]", "dense fp32 [oneDNN prepacked]"} | (
                          {"dense bf16 [oneDNN prepacked]"} if onednn_bf16_prepack() else set())
    # no anchor, no int8-head copy


def test_int8_head_all_copies_every_packed_scheme_without_anchors(tiny_model_dir, data_dir, tmp_path):
    """--int8-head all: every packed scheme gets its int8-head copy (lrq.packed.quantize_head) in the same rounds,
    with no anchors and no profile; the copies stay out of the results store."""
    out, store = tmp_path / "h", tmp_path / "r.sqlite"
    assert speed.main(["e2e", "--device", "cpu", "--model", str(tiny_model_dir), "--data-dir", str(data_dir),
                       "--schemes", "w4a16,w8a8", "--rounds", "1", "--prefill", "16", "--decode", "2",
                       "--int8-head", "all", "--out", str(out), "--results", str(store)]) == 0
    doc = json.loads((out / "speed.json").read_text())
    rows = {r["candidate"]: r for r in doc["rows"]}
    assert {"w4a16 +int8 head", "w8a8 +int8 head"} <= set(rows) and "profile" not in doc
    assert all(rows[n + " +int8 head"]["decode_ms"] > 0 for n in ("w4a16", "w8a8"))
    from bench.common.store import ResultStore
    assert not any(r.scheme.endswith("+int8 head") for r in ResultStore(store).rows())


@pytest.mark.parametrize("fused", [False, True])
def test_profile_counts_native_kernels_where_they_run(fused):
    """lrq.native's C calls are no aten ops: the quantized linears' time is their modules' wall time, and the lean
    runtime's norm/attention calls are labelled, so neither lands in the Python overhead; a decoder layer fused
    into one C call is a group of its own."""
    from lrq import native
    from lrq.runtime import LeanDecoder
    from tests.conftest import tiny_model
    from lrq.methods import get_method, load_methods
    from lrq.packed import pack_model
    from lrq.schemes import get_scheme
    assert native.library() is not None, native.status()
    load_methods()
    model = tiny_model("llama", vocab_size=256, hidden=256, layers=2).to(torch.bfloat16)
    rtn = get_method("rtn")
    rtn.quantize(model, get_scheme("w4a16"), rtn.config("quick"), None)
    pack_model(model)
    lean = LeanDecoder(model, 40)
    lean.fused = fused
    lib, spent = lean._lib, []

    class Timed:   # the library, its fused layer calls timed while the profiler records
        def __getattr__(self, name):
            return getattr(lib, name)

        def lrq_decoder_layer_step(self, *args):
            return self._timed(lib.lrq_decoder_layer_step, args)

        def lrq_decoder_layers_step(self, *args):   # the whole stack in one call (every layer fused)
            return self._timed(lib.lrq_decoder_layers_step, args)

        @staticmethod
        def _timed(fn, args):
            t = time.perf_counter()
            rc = fn(*args)
            if torch.autograd._profiler_enabled():
                spent.append(time.perf_counter() - t)
            return rc

    lean._lib = Timed()
    prof = speed_cpu.profile_decode(lean, torch.arange(16).unsqueeze(0), steps=4)
    ms = {g["group"]: g["ms_per_token"] for g in prof["groups"]}
    assert sum(ms.values()) == pytest.approx(prof["wall_ms_per_token"], rel=1e-6)
    if fused:   # both layers in C: nothing of them runs as modules or separate calls
        # every C layer call's time is in its group (not the overhead), whatever share of the step it is
        assert len(spent) == 4   # one call a step for both layers
        assert ms["fused decoder layers (lrq.native)"] >= 0.9 * 1e3 * sum(spent) / 4 > 0
        assert ms["quantized linears"] == 0 and ms["output head"] > 0   # the head's C call counted as the head
        return
    assert not spent
    assert ms["fused decoder layers (lrq.native)"] == 0
    # 14 packed linears per step through C: far more than nothing (they were ~0 when only aten ops counted)
    assert ms["quantized linears"] > 0.1 * prof["wall_ms_per_token"]
    assert ms["attention/SDPA, RoPE, norms and other ops"] > 0
