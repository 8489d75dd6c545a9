"""llm-compressor as adapter methods (baselines/llmc.py) and the cross-check study built on them
(bench/studies/crosscheck_llmcompressor.py), without llm-compressor installed: the scheme mapping, the
recipes, loading an llm-compressor-style export (signed zero points, ragged last group, static activation
ranges, rescaled norms) into our QuantLinear modules, the adapters' place in the harness (never in the
default sweep, not priced, a clear error without their environment), the paired report, and the study end
to end with its reference (ours-only) variant on a tiny model. The adapters against the real
llm-compressor were run here (see docs/crosscheck-llmcompressor.md)."""

import json
import math

import pytest
import torch

from baselines import llmc
from bench.studies import crosscheck_llmcompressor as cc
from conftest import _train_tokenizer, tiny_model
from lrq.arch import iter_linears
from lrq.errors import UserError
from lrq.qlinear import QuantLinear
from lrq.quant import dequantize, minmax_qparams, quantize
from lrq.schemes import get_scheme


# ---- arguments, mapping, recipes ---------------------------------------------------------------------

def test_run_arguments_defaults():
    args = cc.parse_args(["run"])
    assert args.variant_list == list(cc.DEFAULT_VARIANTS)
    assert args.dataset_list == ["wikitext2", "c4"]
    assert (args.calib_samples, args.calib_seq_len, args.max_eval_tokens) == (64, 512, 40960)
    args = cc.parse_args(["run", "--variants", "gptq-noact, awq", "--datasets", "c4"])
    assert args.variant_list == ["gptq-noact", "awq"] and args.dataset_list == ["c4"]


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
    g = llmc.scheme_to_llmc_args(get_scheme("w4a16-g128"))
    assert g["weights"] == {"num_bits": 4, "type": "int", "symmetric": False, "observer": "memoryless_minmax",
                            "strategy": "block", "block_structure": [1, 128]}
    assert g["input_activations"] is None
    a = llmc.scheme_to_llmc_args(get_scheme("w8a8"))
    assert a["weights"]["strategy"] == "channel" and a["weights"]["num_bits"] == 8
    assert a["input_activations"] == {"num_bits": 8, "type": "int", "symmetric": False, "strategy": "tensor",
                                      "dynamic": False, "observer": "static_minmax"}
    assert llmc.scheme_to_llmc_args(get_scheme("w4a8"))["input_activations"]["dynamic"] is True
    with pytest.raises(UserError):
        llmc.scheme_to_llmc_args(get_scheme("w4a8-kv8"))


def test_variants_pair_our_settings_with_the_adapters():
    from lrq.methods import get_method
    vs = cc.variants(alpha=0.7, n_samples=48)
    gptq = get_method("llmc-gptq")
    spec = gptq.recipe(get_scheme("w4a16-g128"), gptq.config("quick", vs["gptq"].theirs_overrides))
    assert spec["modifiers"][0]["kwargs"] == {"block_size": 128, "dampening_frac": 0.01, "actorder": "static"}
    assert spec["config_groups"]["group_0"]["weights"]["block_structure"] == [1, 128] and spec["ignore"] == ["lm_head"]
    noact = gptq.recipe(get_scheme("w4a16-g128"), gptq.config("quick", vs["gptq-noact"].theirs_overrides))
    assert noact["modifiers"][0]["kwargs"]["actorder"] is None
    awq = get_method("llmc-awq")
    assert [m["type"] for m in awq.recipe(get_scheme("w4a16-g128"), awq.config("quick"))["modifiers"]] == \
           ["AWQModifier", "QuantizationModifier"]
    sq = get_method("llmc-smoothquant")
    sq_spec = sq.recipe(get_scheme("w8a8"), sq.config("quick", vs["smoothquant"].theirs_overrides))
    assert sq_spec["modifiers"][0]["kwargs"]["smoothing_strength"] == 0.7 and vs["smoothquant"].ours_overrides["alpha"] == 0.7
    assert sq_spec["config_groups"]["group_0"]["input_activations"]["observer"] == "static_minmax"
    assert vs["awq"].ours_overrides["n_samples"] == 48 and vs["rtn"].theirs is None
    for v in vs.values():   # every override is a real setting of its method (a typo would be refused)
        assert set(v.ours_overrides) <= set(get_method(v.ours).config("quick")), v.name
        if v.theirs:
            assert set(v.theirs_overrides) <= set(get_method(v.theirs).config("quick")), v.name
        assert v.mismatches


def test_adapters_are_external_methods():
    """Never in the default sweep, refused by the planner, a clear error without their environment."""
    import lrq
    from bench.cli.args import _methods
    from bench.run.plan import SHAPES, plan_cells
    from lrq.methods import Calibration, get_method
    assert {"llmc-gptq", "llmc-awq", "llmc-smoothquant"} <= set(lrq.list_methods())
    assert not any(m.startswith("llmc-") for m in _methods(None)) and _methods("llmc-gptq") == ["llmc-gptq"]
    with pytest.raises(UserError, match="no cost model"):
        plan_cells(SHAPES["smollm2-135m"], ["llmc-gptq"], ["w4a16"], {"kinds": {}, "device": "cpu"})
    m = get_method("llmc-gptq")
    calib = Calibration(torch.zeros(2, 8, dtype=torch.long), {}, _train_tokenizer())
    with pytest.raises(UserError, match="does not exist. Create it"):
        m.quantize(tiny_model("llama"), get_scheme("w4a16"), m.config("quick", {"venv": "/no/such/venv"}), calib)
    with pytest.raises(UserError, match="needs the tokenizer"):
        m.quantize(tiny_model("llama"), get_scheme("w4a16"), m.config("quick"), Calibration(calib.input_ids, {}))
    assert llmc.VENV_COMMAND.endswith(f"llmcompressor=={llmc.LLMC_VERSION}")


def test_the_worker_is_told_the_blocks_linears(tmp_path):
    """The llm-compressor worker names no projection itself: the job it is given lists a block's linears as
    lrq.arch says them (one place for the shape of a block, issue Y)."""
    import json
    import stat
    from pathlib import Path

    from baselines import llmc_worker
    from lrq.arch import LINEAR_NAMES
    from lrq.methods import Calibration, get_method
    assert not any(n.rsplit(".", 1)[-1] in Path(llmc_worker.__file__).read_text() for n in LINEAR_NAMES)
    seen = tmp_path / "job_seen.json"
    py = tmp_path / "venv" / "bin" / "python"
    py.parent.mkdir(parents=True)   # a stand-in interpreter: passes the import probe, keeps the job, then fails
    py.write_text(f'#!/bin/sh\n[ "$1" = "-c" ] && exit 0\ncp "$2" {seen}\nexit 3\n')
    py.chmod(py.stat().st_mode | stat.S_IEXEC)
    m = get_method("llmc-gptq")
    calib = Calibration(torch.zeros(2, 8, dtype=torch.long), {}, _train_tokenizer())
    with pytest.raises(RuntimeError, match="failed with exit 3"):
        m.quantize(tiny_model("llama"), get_scheme("w4a16"), m.config("quick", {"venv": str(tmp_path / "venv")}), calib)
    assert json.loads(seen.read_text())["linear_names"] == list(LINEAR_NAMES)


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
    stats = llmc.apply_llmc_export(model, export, scheme)
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
    agree = llmc.logits_agreement(model, {"check:input_ids": ids, "check:logits": ref})
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
    with pytest.raises(UserError, match="not on their own grid"):
        llmc.apply_llmc_export(tiny_model("llama", hidden=192, layers=1), off_grid, scheme)
    missing = {k: v for k, v in export.items() if "down_proj.weight_scale" not in k}
    with pytest.raises(UserError, match="has no"):
        llmc.apply_llmc_export(tiny_model("llama", hidden=192, layers=1), missing, scheme)
    with pytest.raises(UserError, match="do not fit"):   # a per-channel export read as g128
        llmc.apply_llmc_export(tiny_model("llama", hidden=192, layers=1),
                             _fake_export(src, get_scheme("w4a16"), torch.Generator()), scheme)


# ---- the report and the study ---------------------------------------------------------------------

def test_paired_ratio():
    theirs = [3.0, 3.5, 2.8, 3.9, 3.2]
    same = cc.paired_ratio(theirs, theirs)
    assert same["ratio"] == same["lo"] == same["hi"] == 1.0
    shifted = cc.paired_ratio([x + 0.02 for x in theirs], theirs)  # every window 0.02 nats worse
    assert shifted["ratio"] == pytest.approx(math.exp(0.02)) and shifted["lo"] == pytest.approx(shifted["hi"])
    noisy = cc.paired_ratio([x + d for x, d in zip(theirs, [0.05, -0.04, 0.03, -0.02, 0.0])], theirs)
    assert noisy["lo"] < 1 < noisy["hi"] and noisy["lo"] < noisy["ratio"] < noisy["hi"]
    with pytest.raises(ValueError, match="same non-empty windows"):
        cc.paired_ratio(theirs[:3], theirs)


@pytest.mark.heavy
def test_study_end_to_end_with_the_reference_variant(tmp_path, data_dir, capsys):
    """The study's cells are ordinary cells: stored, reused on a rerun; an adapter without its
    environment is bad input (exit 2)."""
    tok = _train_tokenizer()
    folder = tmp_path / "tiny"
    tiny_model("llama", vocab_size=len(tok), hidden=192, layers=1).save_pretrained(folder)   # 192 = 128 + 64: g128
    tok.save_pretrained(folder)
    results = tmp_path / "r.sqlite"
    argv = ["run", "--model", str(folder), "--variants", "rtn", "--data-dir", str(data_dir), "--calib-samples", "2",
            "--calib-seq-len", "64", "--max-eval-tokens", "512", "--eval-seq-len", "256", "--results", str(results),
            "--out", str(tmp_path / "rep"), "--llmc-venv", str(tmp_path / "absent-venv")]
    assert cc.main(argv) == 0
    report = json.loads((tmp_path / "rep" / "crosscheck_llmcompressor.json").read_text())
    assert [(r["variant"], r["side"]) for r in report["rows"]] == [("fp", "fp"), ("rtn", "ours")]
    for r in report["rows"]:
        assert set(r["ppl"]) == {"wikitext2", "c4"} and all(v > 1 for v in r["ppl"].values())
        assert all(len(w) == 2 for w in r["window_nll"].values())     # 512 tokens in 256-token windows
    from bench.common.store import ResultStore
    stored = {(r.method, r.dataset) for r in ResultStore(results).rows() if r.metric == "ppl"}
    assert stored == {("fp", "wikitext2"), ("fp", "c4"), ("rtn", "wikitext2"), ("rtn", "c4")}
    assert "| rtn | w4a16-g128 | ours |" in (tmp_path / "rep" / "crosscheck_llmcompressor.md").read_text()
    before = len(ResultStore(results).rows())
    assert cc.main(argv) == 0 and len(ResultStore(results).rows()) == before      # reused: nothing recomputed
    assert cc.main(argv[:4] + ["gptq"] + argv[5:]) == 2                            # llmc-gptq without its venv
    assert "does not exist. Create it" in capsys.readouterr().err


def test_report_pairs_each_side_over_the_same_windows():
    rows = [{"variant": "gptq", "side": "llm-compressor", "scheme": "w4a16-g128", "ppl": {"c4": 40.0},
             "window_nll": {"c4": [3.6, 3.7]}, "quant": {"quant_time_s": 300.0, "quant_peak_rss_bytes": 2**30},
             "stats": {"llmc_oneshot_s": 280.0}, "llmc": {"versions": {"llmcompressor": "0.14.0.1"}}},
            {"variant": "gptq", "side": "ours", "scheme": "w4a16-g128", "ppl": {"c4": 41.0},
             "window_nll": {"c4": [3.62, 3.73]}, "quant": {"quant_time_s": 150.0}, "stats": {},
             "vs_llmc": {"c4": cc.paired_ratio([3.62, 3.73], [3.6, 3.7])}}]
    md = cc.markdown({"title": "t", "model": "m", "datasets": ["c4"], "calibration": "c", "eval": "e", "results": "r",
                      "git_revision": "0" * 12, "common_mismatches": ["x"], "variants": {"gptq": {"mismatches": ["y"]}},
                      "rows": rows})
    assert "| gptq | w4a16-g128 | llm-compressor | 40.00 | - | 300.0 | 280.0 | 1,024 |" in md
    assert "| gptq | w4a16-g128 | ours | 41.00 | +2.53% [" in md and "llm-compressor 0.14.0.1" in md


def test_awq_gap_variants_are_our_settings():
    from bench.studies import awq_gap
    from lrq.methods import get_method
    base = cc.variants()["awq"].ours_overrides
    for name, overrides in awq_gap.VARIANTS.items():
        cfg = get_method("awq").config("quick", base | overrides)
        assert all(cfg[k] == v for k, v in overrides.items())
    assert awq_gap.VARIANTS["all-three"] == {**awq_gap.VARIANTS["fp32"], **awq_gap.VARIANTS["closed-grid"],
                                             **awq_gap.VARIANTS["float-chain"]}
    with pytest.raises(SystemExit):
        awq_gap.parse_args(["--variants", "fp32,nope"])
