"""LRQ and FlexRound on the shared block-reconstruction engine."""

import pytest
import torch
from torch import nn

from conftest import tiny_model
from lrq.arch import block_linears, decoder_blocks
from lrq.blockwise import BlockCheckpoint
from lrq.errors import UserError
from lrq.flexround import FlexRoundLinear, flexround_param_count
from lrq.lrq import LRQLinear, choose_rank, lrq_param_count, official_rank
from lrq.methods import Calibration, get_method
from lrq.qlinear import QuantLinear
from lrq.quant import dequantize, minmax_qparams, quantize, search_qparams
from lrq.schemes import get_scheme


def _linear(cout=24, cin=40, seed=0):
    torch.manual_seed(seed)
    lin = nn.Linear(cin, cout)
    lin.weight.data.normal_(0, 0.1)
    return lin


def _learnable(kind, lin, scheme, rank=4):
    s, z = minmax_qparams(lin.weight, scheme.w_bits, scheme.group_size)
    if kind == "lrq":
        return LRQLinear(lin, scheme, s, z, rank=rank, generator=torch.Generator().manual_seed(0)), s, z
    return FlexRoundLinear(lin, scheme, s, z), s, z


@pytest.mark.parametrize("kind", ["lrq", "flexround"])
@pytest.mark.parametrize("scheme_name", ["w3a16", "w4a16-g128", "w8a8", "w4a8"])
def test_initialisation_equals_rtn_exactly(kind, scheme_name):
    scheme = get_scheme(scheme_name)
    lin = _linear(cout=24, cin=200)  # 200 = 128 + 72: ragged group at g128
    m, s, z = _learnable(kind, lin, scheme)
    s1 = torch.exp(torch.log(s))  # the same s1 the learnable holds
    rtn = dequantize(quantize(lin.weight.data, s1, z, scheme.w_bits, scheme.group_size), s1, z, scheme.group_size)
    assert torch.equal(m.w_hat(), rtn)
    frozen = m.freeze()
    assert isinstance(frozen, QuantLinear)
    assert torch.equal(frozen.dequantized_weight(), rtn)
    if scheme.weight_only:
        x = torch.randn(3, 200)
        assert torch.allclose(frozen(x), m(x), atol=1e-5)


@pytest.mark.parametrize("kind", ["lrq", "flexround", "omniquant"])
def test_learnables_are_made_on_the_weights_device(kind):
    """A block reconstructed on a GPU trains its learnables there. Found on the H200 (2026-12-04): LRQ's
    L, U, r2, c2 were made on the CPU beside a CUDA weight, and the first step failed. The meta device
    stands in for any device other than the CPU; LRQ's U is still drawn by the (CPU) seeded generator."""
    from baselines.omniquant import OmniQuantLinear
    scheme = get_scheme("w4a16-g128")
    lin = _linear(cout=24, cin=200)
    s, z = minmax_qparams(lin.weight, scheme.w_bits, scheme.group_size)
    lin, s, z = lin.to("meta"), s.to("meta"), z.to("meta")
    if kind == "lrq":
        m = LRQLinear(lin, scheme, s, z, rank=4, generator=torch.Generator().manual_seed(0))
    else:
        m = (FlexRoundLinear if kind == "flexround" else OmniQuantLinear)(lin, scheme, s, z)
    assert m.learnables() and {p.device.type for p in m.parameters()} == {"meta"}


def test_parameter_count_formulas():
    lin = _linear(cout=24, cin=40)
    lrq, _, _ = _learnable("lrq", lin, get_scheme("w4a16"), rank=5)
    fr, _, _ = _learnable("flexround", lin, get_scheme("w4a16"))
    assert lrq.n_learnable() == lrq_param_count(24, 40, 5) == 5 * (24 + 40) + 2 * 24 + 40
    assert fr.n_learnable() == flexround_param_count(24, 40) == 24 * 40 + 2 * 24
    g, _, _ = _learnable("flexround", _linear(cout=8, cin=300), get_scheme("w4a16-g128"))
    assert g.n_learnable() == flexround_param_count(8, 300, n_groups=3)


def test_rank_rules():
    assert official_rank(4096, 4096) == 1024
    assert official_rank(11008, 4096) is None and official_rank(4096, 11008) is None
    assert official_rank(8192, 8192) is None
    assert official_rank(8192, 28672) == 2048
    assert official_rank(576, 576) == 576  # capped at min(Cout, Cin)
    assert choose_rank(576, 192, "fraction", 0, 0.25) == 48
    assert choose_rank(576, 192, "uniform", 64, 0) == 64
    with pytest.raises(UserError, match="rank rule"):
        choose_rank(8, 8, "bogus", 1, 0.1)


@pytest.mark.parametrize("kind, names", [("lrq", {"theta1", "L", "U", "r2", "c2"}),
                                         ("flexround", {"theta1", "theta2", "theta3"})])
def test_gradients_reach_every_learnable(kind, names):
    lin = _linear()
    m, _, _ = _learnable(kind, lin, get_scheme("w3a16"))
    assert {n for n, _ in m.named_parameters()} == names
    x, target = torch.randn(16, 40), torch.randn(16, 24)
    opt = torch.optim.Adam(m.parameters(), lr=1e-2)
    for _ in range(2):  # after one step L != 0, so U receives gradient too
        opt.zero_grad()
        loss = (m(x) - target).pow(2).sum()
        loss.backward()
        opt.step()
    for n, p in m.named_parameters():
        assert p.grad is not None and p.grad.abs().sum() > 0, n


def test_fused_quantizer_gradient_matches_autograd_chain():
    from lrq.quant import round_ste
    lin = _linear()
    m, _, _ = _learnable("lrq", lin, get_scheme("w4a16"))
    with torch.no_grad():
        m.L.normal_(0, 0.2)
        m.c2.normal_(0, 0.1)
    g = torch.randn(24, 40)

    def chain():
        z = m._expand(m.zero)
        d = m._expand(m.theta1) + m.extra_log_divisor()
        w_int = torch.clamp(round_ste(m.weight / torch.exp(d)), -z, 2**m.bits - 1 - z)
        return w_int * torch.exp(m._expand(m.theta1))

    grads = []
    for fn in (chain, m.w_hat):
        m.zero_grad()
        (fn() * g).sum().backward()
        grads.append({n: p.grad.clone() for n, p in m.named_parameters()})
    for n in grads[0]:
        assert torch.allclose(grads[0][n], grads[1][n], rtol=1e-5, atol=1e-6), n


@pytest.mark.parametrize("bits, group", [(2, None), (3, None), (4, 8)])
def test_grid_search_equals_brute_force(bits, group):
    torch.manual_seed(bits)
    w = torch.randn(5, 20) * torch.tensor([0.1, 1.0, 3.0, 0.5, 0.02])[:, None]
    w[1, 3] = 6.0  # an outlier worth clipping
    scale, zero = search_qparams(w, bits, group, grid=25)
    qmax = 2**bits - 1
    g = group or 20
    for r in range(5):
        for j in range(scale.shape[1]):
            row = w[r, j * g:(j + 1) * g]
            lo, hi = min(row.min().item(), 0.0), max(row.max().item(), 0.0)
            best = (float("inf"), None, None)
            for i in range(1, 26):
                delta = max((hi - lo) * i / 25 / qmax, 1e-8)
                for zp in range(qmax + 1):
                    q = torch.clamp(torch.round(row / delta) + zp, 0, qmax)
                    err = ((q - zp) * delta - row).abs().pow(2.4).sum().item()
                    if best[1] is None or err < best[0] - 1e-9 * max(1.0, best[0]):
                        best = (err, delta, zp)
            assert scale[r, j].item() == pytest.approx(best[1], rel=1e-5)
            assert zero[r, j].item() == best[2]


def _calib(n=10, seq=24, vocab=128):
    return Calibration(torch.randint(0, vocab, (n, seq), generator=torch.Generator().manual_seed(5)), {"seed": 0})


@pytest.mark.parametrize("method", ["lrq", "flexround"])
def test_reconstruction_loss_falls(method, arch):
    model = tiny_model(arch, hidden=64)
    M = get_method(method)
    stats = M.quantize(model, get_scheme("w3a16"), M.config("quick", {"iters": 40, "lr": 5e-3, "heldout_samples": 3}),
                       _calib())
    for b in stats["block_errors"]:
        assert b["calib_after"] < b["calib_before"]
    assert stats["n_learnable"] > 0 and stats["train_samples"] == 7
    assert all(isinstance(m, QuantLinear) for b in decoder_blocks(model) for m in block_linears(b).values())


@pytest.mark.parametrize("scheme_name", ["w8a8", "w4a8-kv8", "w4a16-g128"])
def test_every_scheme_runs(scheme_name, arch):
    model = tiny_model(arch, hidden=192)
    ids = torch.randint(0, 128, (2, 16))
    for method in ("lrq", "flexround"):
        M = get_method(method)
        M.quantize(model if method == "lrq" else tiny_model(arch, hidden=192), get_scheme(scheme_name),
                   M.config("quick", {"iters": 3, "heldout_samples": 2}), _calib(6))
    with torch.no_grad():
        assert torch.isfinite(model(ids).logits).all()
    qs = [m for m in model.modules() if isinstance(m, QuantLinear)]
    assert len(qs) == 14
    if scheme_name == "w8a8":
        assert all(m.act_calibrated for m in qs)


def _state(model):
    return {k: v.clone() if torch.is_tensor(v) else v for k, v in model.state_dict().items()}


def test_resume_after_interruption_gives_identical_weights(tmp_path, monkeypatch):
    from lrq.engine import ReconstructionMethod
    cfg = {"iters": 8, "lr": 5e-3, "heldout_samples": 2}
    M = get_method("lrq")
    full = tiny_model("llama", layers=3)
    M.quantize(full, get_scheme("w3a16"), M.config("quick", cfg), _calib(6))

    real = ReconstructionMethod._reconstruct_block
    calls = {"n": 0}

    def crashing(self, ctx, *a, **k):
        if ctx.index == 2:
            raise KeyboardInterrupt  # killed while training block 2
        calls["n"] += 1
        return real(self, ctx, *a, **k)

    monkeypatch.setattr(ReconstructionMethod, "_reconstruct_block", crashing)
    M2 = get_method("lrq", checkpoint_dir=tmp_path / "ckpt")
    with pytest.raises(KeyboardInterrupt):
        M2.quantize(tiny_model("llama", layers=3), get_scheme("w3a16"), M2.config("quick", cfg), _calib(6))
    assert calls["n"] == 2
    monkeypatch.setattr(ReconstructionMethod, "_reconstruct_block", real)

    resumed = tiny_model("llama", layers=3)
    counted = {"n": 0}

    def counting(self, ctx, *a, **k):
        counted["n"] += 1
        return real(self, ctx, *a, **k)

    monkeypatch.setattr(ReconstructionMethod, "_reconstruct_block", counting)
    stats = M2.quantize(resumed, get_scheme("w3a16"), M2.config("quick", cfg), _calib(6))
    assert counted["n"] == 1  # only the unfinished block was trained again
    assert len(stats["block_errors"]) == 3
    # the record says so, and the block time covers the blocks finished before the kill
    assert stats["resumed_blocks"] == 2 and stats["blocks_time_s"] > 0
    a, b = _state(full), _state(resumed)
    assert a.keys() == b.keys()
    for k in a:
        assert (torch.equal(a[k], b[k]) if torch.is_tensor(a[k]) else a[k] == b[k]), k


def test_checkpoint_of_another_configuration_is_ignored(tmp_path):
    ck = BlockCheckpoint(tmp_path, "identity-a")
    block = nn.Linear(2, 2)
    ck.save(0, block, torch.zeros(1), None, [{}])
    assert ck.completed() == 1
    assert BlockCheckpoint(tmp_path, "identity-b").completed() == 0


def test_nan_guard_on_poisoned_input():
    model = tiny_model("llama")
    with torch.no_grad():
        model.model.embed_tokens.weight[7] = float("nan")
    ids = torch.full((4, 16), 7)
    M = get_method("lrq")
    with pytest.raises(UserError, match="contain NaN"):
        M.quantize(model, get_scheme("w4a16"), M.config("quick", {"iters": 2, "heldout_samples": 1}),
                   Calibration(ids, {"seed": 0}))


def test_nan_guard_on_diverging_training(monkeypatch):
    import lrq.engine as engine
    monkeypatch.setattr(engine, "block_loss", lambda p, t: (p - t).pow(2).sum() * float("nan"))
    M = get_method("flexround")
    with pytest.raises(engine.ReconstructionError, match="loss became nan at step 0"):
        M.quantize(tiny_model("llama"), get_scheme("w4a16"), M.config("quick", {"iters": 2, "heldout_samples": 1}),
                   _calib(4))


@pytest.mark.heavy
def test_lrq_and_flexround_through_the_cli(tiny_model_dir, data_dir, tmp_path, capsys, monkeypatch):
    import json
    monkeypatch.setenv("LRQ_BENCH_CACHE", str(tmp_path / "cache"))
    from bench.cli import main
    results = tmp_path / "r.sqlite"
    code = main(["run", "--profile", "full", "--tasks", "none", "--model", str(tiny_model_dir), "--methods", "lrq,flexround", "--schemes", "w4a16",
                 "--datasets", "wikitext2", "--data-dir", str(data_dir), "--results", str(results),
                 "--max-eval-tokens", "512", "--eval-seq-len", "256", "--calib-samples", "6", "--calib-seq-len", "32",
                 "--set", "iters=4", "--set", "heldout_samples=2", "--out", str(tmp_path / "rep")])
    out, err = capsys.readouterr()
    assert code == 0, err
    out = (tmp_path / "rep" / "leaderboard.md").read_text()
    assert "### Block reconstruction" in out and "lrq / flexround learnable parameters" in out
    main(["results", "--results", str(results), "--json"])
    rows = json.loads(capsys.readouterr()[0])
    n = {r["method"]: r["value"] for r in rows if r["metric"] == "n_learnable"}
    assert 0 < n["lrq"] < n["flexround"]
    cfg = next(r["config"] for r in rows if r["method"] == "lrq" and r["metric"] == "ppl")
    assert cfg["method_config"]["iters"] == 4 and cfg["method_stats"]["resolved_config"]["lr"] == 1e-2
    assert len(cfg["method_stats"]["block_errors"]) == 2
    # the checkpoint of a finished cell is removed once its results are stored
    ckpts = tmp_path / "cache" / "checkpoints"
    assert ckpts.is_dir() and not any(ckpts.iterdir())


@pytest.mark.parametrize("method,scheme_name,amp", [("lrq", "w4a16", True), ("lrq", "w3a16", False),
                                                    ("flexround", "w3a16", True), ("omniquant", "w4a16", False)])
def test_train_precision_authors_runs_the_authors_fp16_pipeline(method, scheme_name, amp):
    """train_precision=authors: the model on the fp16 grid first, fp16 autocast + GradScaler exactly where
    the authors' Llama-2-7B script uses them, and integers and scales frozen on the fp16 grid."""
    model = tiny_model("llama", hidden=64)
    M = get_method(method)
    stats = M.quantize(model, get_scheme(scheme_name),
                       M.config("quick", {"iters": 3, "heldout_samples": 2, "train_precision": "authors"}), _calib(6))
    want = "steps under fp16 autocast with a GradScaler" if amp else "fp32 steps"
    assert stats["train_precision"].startswith("authors: fp16 model and freeze") and want in stats["train_precision"]
    qs = [m for m in model.modules() if isinstance(m, QuantLinear)]
    assert len(qs) == 14
    for q in qs:   # scales exactly representable in fp16
        assert torch.equal(q.scale, q.scale.half().float())
    norm = model.model.norm.weight
    assert torch.equal(norm, norm.half().float())   # the unquantized weights were put on the fp16 grid
    with torch.no_grad():
        assert torch.isfinite(model(torch.randint(0, 128, (2, 16))).logits).all()
    default = M.config("quick", {"iters": 3, "heldout_samples": 2})
    assert M.keyed_settings(M.resolve(get_scheme(scheme_name), default)) != \
        M.keyed_settings(M.resolve(get_scheme(scheme_name), dict(default, train_precision="authors")))


def test_train_precision_authors_warns_where_the_cpu_emulates_fp16(monkeypatch, caplog):
    """fp16 on a CPU without fp16 arithmetic is emulated (17x slower training steps on a Zen 4): the run says so
    where it starts; a CPU with AVX512-FP16, and a GPU, get no warning."""
    from lrq import precision
    assert precision.authors_fp16_cost("cuda") is None
    M = get_method("lrq")
    for flags, warned in (({"avx2", "avx512f", "avx512_bf16"}, True), ({"avx512f", "avx512_fp16", "amx_fp16"}, False)):
        monkeypatch.setattr(precision, "_cpu_flags", lambda: flags)
        assert ("no fp16 arithmetic" in (precision.authors_fp16_cost("cpu") or "")) == warned
        caplog.clear()
        with caplog.at_level("WARNING", logger="lrq.engine"):
            M.quantize(tiny_model("llama", hidden=64), get_scheme("w3a16"),
                       M.config("quick", {"iters": 1, "heldout_samples": 2, "train_precision": "authors"}), _calib(6))
        assert ("no fp16 arithmetic" in caplog.text) == warned, flags


def test_the_long_preset_resolves_to_its_sizes_for_every_method():
    """--preset long: 1,000 steps at batch 2 with 16 held-out windows, the authors' settings otherwise; LRQ at
    the llama2-7b-like rank; one calibration (128 x 1,024 C4 tokens in order) for LRQ, FlexRound, GPTQ and AWQ;
    a method without a long preset takes its paper settings."""
    from bench.run.cell import resolve_calib
    from lrq.methods import method_class
    for name in ("lrq", "flexround"):
        cfg = method_class(name)().config("long")
        paper = method_class(name)().config("paper")
        assert (cfg["iters"], cfg["batch_size"], cfg["heldout_samples"], cfg["preset"]) == (1000, 2, 16, "long")
        assert cfg["lr"] == paper["lr"] and cfg["s1_init"] == paper["s1_init"]
    assert method_class("lrq")().config("long")["rank_rule"] == "llama2-7b-like"
    assert method_class("lrq")().config("paper")["rank_rule"] != "llama2-7b-like"
    for name in ("lrq", "flexround", "gptq", "awq"):
        c = resolve_calib(name, "long", {})
        assert (c.dataset, c.n_samples, c.seq_len, c.sampling) == ("c4", 128, 1024, "sequential"), name
    assert method_class("gptq")().config("long") == method_class("gptq")().config("paper")


def test_a_block_that_training_made_worse_is_warned_of_and_reported(caplog):
    """FlexRound at the quick preset's learning rate ended 4 of Gemma 3's 18 blocks above their RTN start
    (2026-12-04): such a cell is not the method at its best, and the run log and the leaderboard say so."""
    from types import SimpleNamespace

    from bench.reports.report import _blocks_worse_lines
    M = get_method("flexround")
    with caplog.at_level("WARNING", logger="lrq.precision"):
        stats = M.quantize(tiny_model("llama"), get_scheme("w4a16"),
                           M.config("quick", {"iters": 3, "heldout_samples": 1, "lr": 5.0}), _calib(4))
    be = stats["block_errors"]
    worse = [i for i, b in enumerate(be) if b["calib_after"] > b["calib_before"]]
    assert worse, "a learning rate of 5 in log space must wreck some block"
    assert sum("higher calibration error than its RTN start" in r.message for r in caplog.records) == len(worse)
    rows = [SimpleNamespace(method="flexround", scheme="w4a16", config={"method_stats": stats}),
            SimpleNamespace(method="flexround", scheme="w4a16", config={"method_stats": stats}),   # one line per cell
            SimpleNamespace(method="lrq", scheme="w4a16", config={"method_stats": {"block_errors": [
                {"calib_before": 2.0, "calib_after": 1.0}]}})]
    lines = _blocks_worse_lines(rows)
    assert lines[0] == "Blocks that training made worse:" and len([x for x in lines if x.startswith("- ")]) == 1
    assert f"in {len(worse)} of {len(be)} blocks" in lines[2] and lines[2].startswith("- flexround w4a16")
    assert _blocks_worse_lines(rows[2:]) == []


def test_the_low_rank_product_can_be_formed_in_float32_under_autocast():
    """Issue Z: under bf16 autocast LRQ's L @ U was formed in bf16 (relative error ~4e-3) while FlexRound's full
    scale matrix entered in float32. `lowrank_product=fp32` forms it in float32 there; the default is unchanged
    (its store keys and checkpoint identities too)."""
    import torch.nn as nn
    from lrq.lrq import LRQLinear
    from lrq.methods import get_method
    from lrq.schemes import get_scheme
    torch.manual_seed(0)
    lin = nn.Linear(96, 64, bias=False)
    scheme = get_scheme("w3a16")
    scale, zero = torch.full((64, 1), 0.05), torch.full((64, 1), 4.0)
    layers = {fp32: LRQLinear(lin, scheme, scale, zero, rank=16, product_fp32=fp32) for fp32 in (False, True)}
    for m in layers.values():
        m.L.data.copy_(torch.randn(64, 16, generator=torch.Generator().manual_seed(1)) * 0.1)
        m.U.data.copy_(layers[False].U.data)
    exact = (layers[True].L.double() @ layers[True].U.double()).float()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got = {k: (m.extra_log_divisor() - m.r2 - m.c2).float() for k, m in layers.items()}
    err = {k: ((v - exact).abs().max() / exact.abs().max()).item() for k, v in got.items()}
    assert err[True] < 1e-6 < 1e-3 < err[False], err
    cfg = get_method("lrq").config("long", {"lowrank_product": "fp32"})
    assert get_method("lrq").keyed_settings(cfg)["lowrank_product"] == "fp32"
    assert "lowrank_product" not in get_method("lrq").keyed_settings(get_method("lrq").config("long"))
