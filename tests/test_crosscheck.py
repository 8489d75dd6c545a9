"""bench/studies/crosscheck_llmcompressor.py without llm-compressor installed: argument handling, the recipe as
data, the calibration export/import round trip, loading an llm-compressor-style export (signed zero
points, ragged last group, static activation ranges, rescaled norms) into our QuantLinear modules, the
report, and the orchestration end to end with the reference (ours-only) variant on a tiny model."""

import json
import math

import pytest
import torch

from bench.studies import crosscheck_llmcompressor as cc
from conftest import _train_tokenizer, tiny_model
from lrq.arch import iter_linears
from lrq.qlinear import QuantLinear
from lrq.quant import dequantize, minmax_qparams, quantize
from lrq.schemes import get_scheme


# ---- arguments and recipe ---------------------------------------------------------------------------

def test_run_arguments_defaults_and_threads(monkeypatch):
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    args = cc.parse_args(["run"])
    assert args.variant_list == list(cc.DEFAULT_VARIANTS)
    assert args.dataset_list == ["wikitext2", "c4"]
    assert (args.calib_samples, args.calib_seq_len, args.max_eval_tokens, args.threads) == (64, 512, 40960, 1)
    args = cc.parse_args(["run", "--variants", "gptq-noact, awq", "--threads", "2", "--datasets", "c4"])
    assert args.variant_list == ["gptq-noact", "awq"] and args.threads == 2 and args.dataset_list == ["c4"]


@pytest.mark.parametrize("argv, message", [
    (["run", "--variants", "gptq,bogus"], "unknown variant(s) bogus"),
    (["run", "--datasets", "ptb"], "--datasets"),
    (["run", "--max-eval-tokens", "100"], "--max-eval-tokens must be at least"),
    (["run", "--alpha", "1.5"], "--alpha"),
    (["run", "--calib-samples", "0"], "--calib-samples"),
])
def test_bad_arguments_exit_2(argv, message, capsys):
    with pytest.raises(SystemExit) as e:
        cc.parse_args(argv)
    assert e.value.code == 2
    assert message in capsys.readouterr().err


def test_scheme_mapping_matches_our_definitions():
    g = cc.scheme_to_llmc_args(get_scheme("w4a16-g128"))
    assert g["weights"] == {"num_bits": 4, "type": "int", "symmetric": False, "observer": "memoryless_minmax",
                            "strategy": "block", "block_structure": [1, 128]}
    assert g["input_activations"] is None
    a = cc.scheme_to_llmc_args(get_scheme("w8a8"))
    assert a["weights"]["strategy"] == "channel" and a["weights"]["num_bits"] == 8
    assert a["input_activations"] == {"num_bits": 8, "type": "int", "symmetric": False, "strategy": "tensor",
                                      "dynamic": False, "observer": "static_minmax"}
    assert cc.scheme_to_llmc_args(get_scheme("w4a8"))["input_activations"]["dynamic"] is True
    with pytest.raises(cc.CrosscheckError):
        cc.scheme_to_llmc_args(get_scheme("w4a8-kv8"))


def test_variants_pair_our_overrides_with_their_recipe():
    vs = cc.variants(alpha=0.7, n_samples=48)
    assert vs["gptq"].ours == {"damp": 0.01, "block_size": 128, "act_order": True}
    gptq = cc.llmc_recipe_spec(vs["gptq"])
    assert gptq["modifiers"][0]["kwargs"] == {"block_size": 128, "dampening_frac": 0.01, "actorder": "static"}
    assert gptq["config_groups"]["group_0"]["weights"]["block_structure"] == [1, 128]
    assert gptq["ignore"] == ["lm_head"]
    assert cc.llmc_recipe_spec(vs["gptq-noact"])["modifiers"][0]["kwargs"]["actorder"] is None
    assert vs["awq"].ours["n_samples"] == 48 and vs["awq"].ours["clip"] is False and vs["awq"].ours["scale_vo"] is False
    assert [m["type"] for m in vs["awq"].llmc["modifiers"]] == ["AWQModifier", "QuantizationModifier"]
    sq = cc.llmc_recipe_spec(vs["smoothquant"])
    assert sq["modifiers"][0]["kwargs"]["smoothing_strength"] == 0.7 and vs["smoothquant"].ours["alpha"] == 0.7
    assert sq["config_groups"]["group_0"]["input_activations"]["observer"] == "static_minmax"
    assert not vs["rtn"].llmc_side
    # every key we override exists in our method's settings (a typo would be silently ignored)
    from lrq.methods import get_method
    for v in vs.values():
        assert set(v.ours) <= set(get_method(v.method).config("quick")), v.name
        assert v.mismatches


# ---- calibration round trip -------------------------------------------------------------------------

def test_calibration_round_trip_and_tamper_check(tmp_path):
    ids = torch.randint(0, 1000, (3, 17), generator=torch.Generator().manual_seed(0))
    meta = cc.write_calibration(tmp_path, ids.to(torch.int32), {"dataset": "c4", "seed": 0})
    back, meta2 = cc.read_calibration(tmp_path)
    assert back.dtype == torch.int64 and torch.equal(back, ids)
    assert meta2 == json.loads(json.dumps(meta)) and meta["shape"] == [3, 17]
    assert meta["sha256"] == cc.tokens_sha256(ids) != cc.tokens_sha256(ids.flip(0))
    other = tmp_path / "other"
    cc.write_calibration(other, ids + 1, {})
    (tmp_path / cc.CALIB_FILE).write_bytes((other / cc.CALIB_FILE).read_bytes())
    with pytest.raises(cc.CrosscheckError, match="does not match"):
        cc.read_calibration(tmp_path)
    with pytest.raises(cc.CrosscheckError, match="no calibration windows"):
        cc.read_calibration(tmp_path / "missing")


def test_missing_llmc_venv_names_the_command(tmp_path):
    with pytest.raises(cc.CrosscheckError) as e:
        cc.llmc_python(tmp_path / "no-venv")
    assert cc.VENV_COMMAND in str(e.value) and "llmcompressor==" in cc.VENV_COMMAND


# ---- loading an export ------------------------------------------------------------------------------

def _fake_export(model, scheme, gen):
    """An export laid out as the worker writes it, made with our primitives in compressed-tensors'
    signed convention (zero point - 2^(b-1)), with one rescaled norm and static input ranges."""
    t = {}
    for i, name, lin in iter_linears(model):
        full = f"model.layers.{i}.{name}"
        w = lin.weight.detach().float()
        scale, zero = minmax_qparams(w, scheme.w_bits, scheme.group_size)
        t[f"{full}.weight"] = dequantize(quantize(w, scale, zero, scheme.w_bits, scheme.group_size), scale, zero,
                                         scheme.group_size)
        t[f"{full}.weight_scale"] = scale
        t[f"{full}.weight_zero_point"] = zero - 2 ** (scheme.w_bits - 1)
        if scheme.static_activations:
            t[f"{full}.input_scale"] = torch.tensor([0.01 + 0.01 * torch.rand((), generator=gen).item()])
            t[f"{full}.input_zero_point"] = torch.tensor([float(torch.randint(-5, 5, (), generator=gen))])
    norm = model.model.layers[0].input_layernorm.weight
    t["param:model.layers.0.input_layernorm.weight"] = norm.detach() * 1.5
    return t


@pytest.mark.parametrize("scheme_name", ["w4a16-g128", "w8a8"])
def test_export_loads_into_quantlinears_exactly(scheme_name):
    scheme = get_scheme(scheme_name)
    src = tiny_model("llama", hidden=192, layers=2)       # 192 = 128 + a ragged group of 64
    export = _fake_export(src, scheme, torch.Generator().manual_seed(1))
    model = tiny_model("llama", hidden=192, layers=2)
    stats = cc.apply_llmc_export(model, export, scheme)
    assert stats["linears"] == 14 and stats["max_grid_error_steps"] < 1e-5
    assert stats["changed_params"] == 1
    assert torch.equal(model.model.layers[0].input_layernorm.weight, export["param:model.layers.0.input_layernorm.weight"])
    for i, name, lin in iter_linears(model):
        full = f"model.layers.{i}.{name}"
        assert isinstance(lin, QuantLinear) and lin.scheme is scheme
        assert torch.allclose(lin.dequantized_weight(), export[f"{full}.weight"], atol=1e-6)
        assert torch.equal(lin.zero, export[f"{full}.weight_zero_point"] + 2 ** (scheme.w_bits - 1))
        if scheme.static_activations:
            assert lin.act_calibrated
            assert lin.act_zero.item() == export[f"{full}.input_zero_point"].item() + 128
            assert torch.allclose(lin.act_scale, export[f"{full}.input_scale"].reshape(()))
    # the reference forward the worker records: our loaded copy reproduces it
    ids = torch.randint(0, 128, (1, 16), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        ref = model(input_ids=ids, use_cache=False).logits
    agree = cc.logits_agreement(model, {"check:input_ids": ids, "check:logits": ref})
    assert agree["max_abs_diff_rel"] == 0.0 and agree["top1_agreement"] == 1.0
    if scheme.static_activations:  # activation quantization is live: it changes the output
        fp = tiny_model("llama", hidden=192, layers=2)
        with torch.no_grad():
            assert not torch.allclose(fp(input_ids=ids).logits, ref, atol=1e-3)


def test_export_errors_are_clear():
    scheme = get_scheme("w4a16-g128")
    src = tiny_model("llama", hidden=192, layers=1)
    export = _fake_export(src, scheme, torch.Generator().manual_seed(1))
    off_grid = dict(export)
    off_grid["model.layers.0.self_attn.q_proj.weight"] = src.model.layers[0].self_attn.q_proj.weight.detach().clone()
    with pytest.raises(cc.CrosscheckError, match="not on their own grid"):
        cc.apply_llmc_export(tiny_model("llama", hidden=192, layers=1), off_grid, scheme)
    missing = {k: v for k, v in export.items() if "down_proj.weight_scale" not in k}
    with pytest.raises(cc.CrosscheckError, match="has no"):
        cc.apply_llmc_export(tiny_model("llama", hidden=192, layers=1), missing, scheme)
    with pytest.raises(cc.CrosscheckError, match="do not fit"):   # a per-channel export read as g128
        cc.apply_llmc_export(tiny_model("llama", hidden=192, layers=1),
                             _fake_export(src, get_scheme("w4a16"), torch.Generator()), scheme)


def test_ct_activation_rounding_order_and_restore():
    """compressed-tensors rounds x / s + zp, ours round(x / s) + z: the same grid, but float32 addition
    can push x / s = 0.49999997 with zp = -101 onto -100.5 (rounded half to even: -100), where ours
    rounds 0.49999997 to 0 first. Inside the context our QuantLinear uses their order; outside, ours."""
    import lrq.qlinear as qlinear
    scheme = get_scheme("w8a8")
    lin = torch.nn.Linear(1, 1, bias=False)
    lin.weight.data.fill_(1.0)
    q = QuantLinear.from_linear(lin, scheme, *minmax_qparams(lin.weight.data, 8))
    q.set_static_range(torch.tensor(1.0), torch.tensor(27.0))            # signed zero point -101
    x = torch.tensor([[0.49999997]])
    assert q.quantize_input(x).item() == 0.0
    original = qlinear.per_tensor_fake_quant
    with cc.ct_activation_rounding():
        assert q.quantize_input(x).item() == 1.0
        assert q.quantize_input(torch.tensor([[2.5]])).item() == 3.0       # an exact tie, odd zero point
        grid = torch.linspace(-20, 20, 401)[:, None] + 0.013              # away from ties: identical
        assert torch.equal(q.quantize_input(grid), original(grid, q.act_scale, q.act_zero, 8))
    assert qlinear.per_tensor_fake_quant is original and q.quantize_input(x).item() == 0.0
    assert q.quantize_input(torch.tensor([[2.5]])).item() == 2.0                # half to even, then + z


# ---- the report and the orchestration ---------------------------------------------------------------

def test_markdown_report_compares_sides():
    def row(variant, side, wiki, c4, t):
        return {"variant": variant, "side": side, "scheme": "w4a16-g128", "ppl": {"wikitext2": wiki, "c4": c4},
                "quant": {"wall_s": t, "cpu_s": t / 2, "peak_rss_bytes": 2**30} if t else {}}
    report = {"title": "Cross-check", "model": {"name": "m", "source": "s"}, "threads": 1,
              "calibration": {"shape": [64, 512], "sha256": "ab" * 32, "description": {"source": "c4", "seed": 0}},
              "evaluation": {"datasets": {"wikitext2": {"tokens": 40960, "windows": 20, "seq_len": 2048},
                                          "c4": {"tokens": 40960, "windows": 20, "seq_len": 2048}}},
              "llm_compressor": {"versions": {"llmcompressor": "0.14.0.1"}},
              "ours": {"versions": {}, "git_revision": "0123456789abcdef"},
              "hardware": {"cpu": "cpu"}, "machine_note": "shared",
              "rows": [row("fp", "fp", 20.0, 30.0, None), row("gptq", "llm-compressor", 28.0, 40.0, 300.0),
                       row("gptq", "ours", 28.2, 41.0, 150.0)]}
    md = cc.markdown_report(report)
    assert "| gptq | w4a16-g128 | llm-compressor | 28.00 | 40.00 | 300.0 | 150.0 | 1,024 |" in md
    assert "| fp | w4a16-g128 | fp | 20.00 | 30.00 | - | - | - |" in md
    assert "wikitext2 +0.7%, c4 +2.5% (OUTSIDE the +2 % target)" in md
    assert "ours / theirs = 0.50 wall, 0.50 CPU (met)" in md


def test_run_end_to_end_with_the_reference_variant(tmp_path, data_dir, monkeypatch, capsys):
    """The orchestration with the ours-only RTN variant (no llm-compressor needed): calibration written,
    both datasets scored on the same capped windows, JSON + Markdown written, steps cached."""
    monkeypatch.setenv("LRQ_BENCH_CACHE", str(tmp_path / "cache"))
    from bench import data as D
    read = D.load_rows
    # the real files, fewer rows (tokenizing all of them twice with a tiny BPE is most of the time)
    monkeypatch.setattr(D, "load_rows", lambda ds, dd, part="validation": (
        lambda rows, src: (rows[:80] if ds == "c4" else rows[:3000], src))(*read(ds, dd, part)))
    monkeypatch.setattr(D, "C4_EVAL_DOCS", 20)
    tok = _train_tokenizer()
    folder = tmp_path / "tiny"
    tiny_model("llama", vocab_size=len(tok), hidden=192, layers=1).save_pretrained(folder)
    tok.save_pretrained(folder)
    argv = ["run", "--model", str(folder), "--variants", "rtn", "--data-dir", str(data_dir), "--calib-samples", "2",
            "--calib-seq-len", "64", "--max-eval-tokens", "256", "--eval-seq-len", "128",
            "--workdir", str(tmp_path / "work"), "--llmc-venv", str(tmp_path / "absent-venv")]
    assert cc.main(argv) == 0
    report = json.loads((tmp_path / "work" / "crosscheck_llmcompressor.json").read_text())
    assert [(r["variant"], r["side"]) for r in report["rows"]] == [("fp", "fp"), ("rtn", "ours")]
    assert report["calibration"]["shape"] == [2, 64]
    ids, meta = cc.read_calibration(tmp_path / "work")
    assert meta["sha256"] == report["calibration"]["sha256"] and ids.shape == (2, 64)
    for r in report["rows"]:
        assert r["eval_tokens"] == {"wikitext2": 256, "c4": 256} and all(v > 1 for v in r["ppl"].values())
    q = report["rows"][1]["quant"]
    assert q["wall_s"] > 0 and q["cpu_s"] >= 0 and q["peak_rss_bytes"] > 2**20 and report["ours"]["git_revision"]
    assert "| rtn | w4a16-g128 | ours |" in (tmp_path / "work" / "crosscheck_llmcompressor.md").read_text()
    capsys.readouterr()
    assert cc.main(argv) == 0                                            # second run: every step cached
    assert capsys.readouterr().out.count(": cached") == 2
    # a comparison that needs llm-compressor fails cleanly when its venv is missing
    assert cc.main(argv[:4] + ["gptq"] + argv[5:]) == 2
    assert cc.VENV_COMMAND in capsys.readouterr().err


# ---- the AWQ ablation (bench/studies/awq_gap.py) ----------------------------------------------------------------

def test_awq_gap_paired_ratio():
    from bench.studies.awq_gap import paired_ratio, ppl_of
    theirs = [3.0, 3.5, 2.8, 3.9, 3.2]
    same = paired_ratio(theirs, theirs)
    assert same["ratio"] == same["lo"] == same["hi"] == 1.0
    shifted = paired_ratio([x + 0.02 for x in theirs], theirs)  # every window 0.02 nats worse
    assert shifted["ratio"] == pytest.approx(math.exp(0.02)) == pytest.approx(ppl_of([x + 0.02 for x in theirs]) / ppl_of(theirs))
    assert shifted["lo"] == pytest.approx(shifted["ratio"]) == pytest.approx(shifted["hi"])  # no spread
    noisy = paired_ratio([x + d for x, d in zip(theirs, [0.05, -0.04, 0.03, -0.02, 0.0])], theirs)
    assert noisy["lo"] < 1 < noisy["hi"] and noisy["lo"] < noisy["ratio"] < noisy["hi"]
    with pytest.raises(ValueError, match="same non-empty windows"):
        paired_ratio(theirs[:3], theirs)


def test_awq_gap_variants_are_our_settings_and_need_the_export(tmp_path, capsys):
    from bench.studies import awq_gap
    from lrq.methods import get_method
    base = cc.variants()["awq"].ours
    for name, overrides in awq_gap.VARIANTS.items():
        cfg = get_method("awq").config("quick", base | overrides)
        assert all(cfg[k] == v for k, v in overrides.items())  # every override is a real setting
    assert awq_gap.VARIANTS["all-three"] == {**awq_gap.VARIANTS["fp32"], **awq_gap.VARIANTS["closed-grid"],
                                             **awq_gap.VARIANTS["float-chain"]}
    with pytest.raises(SystemExit):
        awq_gap.parse_args(["--variants", "fp32,nope"])
    assert "unknown variant(s) nope" in capsys.readouterr().err
    cc.write_calibration(tmp_path, torch.zeros(2, 8, dtype=torch.long), {})
    assert awq_gap.main(["--workdir", str(tmp_path), "--variants", "fp32"]) == 2
    assert "run the cross-check first" in capsys.readouterr().err


def test_awq_gap_markdown_marks_the_paired_ratios():
    from bench.studies.awq_gap import markdown, paired_ratio, ppl_of
    theirs = {"c4": [3.0, 3.1, 3.2, 3.3]}
    ours = {"c4": [3.05, 3.1, 3.25, 3.3]}
    rows = []
    for side, nll, ov in (("llm-compressor", theirs, None), ("fp32", ours, {"bf16": False})):
        rows.append({"side": side, "overrides": ov, "quant": {"cpu_s": 12.0} if ov else None,
                     "ppl": {"c4": ppl_of(nll["c4"])}, "ppl_slice": {},
                     "vs_llmc": {} if ov is None else {"c4": paired_ratio(nll["c4"], theirs["c4"])},
                     "vs_llmc_slice": {} if ov is None else {"c4": paired_ratio(nll["c4"][:2], theirs["c4"][:2])}})
    text = markdown({"title": "t", "model": "m", "scheme": "w4a16-g128", "slice_windows": 2,
                     "evaluation": {"c4": {"tokens": 8, "windows": 4, "seq_len": 2}}, "base_overrides": {"clip": False},
                     "calibration": {"shape": [2, 8], "sha256": "ab" * 20}, "threads": 1, "git_revision": "0" * 40,
                     "rows": rows})
    line = next(ln for ln in text.splitlines() if ln.startswith("| ours fp32 (bf16=False)"))
    r = paired_ratio(ours["c4"], theirs["c4"])
    assert f"{r['ratio'] - 1:+.2%} [{r['lo'] - 1:+.2%}, {r['hi'] - 1:+.2%}]" in line and line.endswith("| 12 |")
    assert "| llm-compressor | " in text and "first 2 windows" in text
