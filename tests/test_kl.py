"""KL divergence from the FP model and flips (issue L): the stored reference gives the exact KL,
the reference computed once and reused, KL as its own unit beside perplexities stored before it, the
leaderboard led by KLD and top-1 agreement, flips per task, the gate on KLD, and the catalogue every consumer
reads."""

from __future__ import annotations

import json
import math

import pytest

import torch

from bench.evaluations import evals as E
from bench.evaluations import kl
from bench.cli import main
from bench.common.store import ResultStore

QUICK = ["--profile", "full", "--tasks", "none", "--datasets", "wikitext2", "--max-eval-tokens", "1024",
         "--eval-seq-len", "256", "--jobs", "1"]


def _dists(n=64, vocab=300, seed=0, spread=0.3):
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(n, vocab, generator=g) * 3
    lp = torch.log_softmax(logits, -1)
    lq = torch.log_softmax(logits + spread * torch.randn(n, vocab, generator=g), -1)
    return lp, lq


def test_the_stored_reference_gives_the_exact_kl(tiny_model_dir, tmp_path, monkeypatch):
    """The KL from the stored reference (FP final hidden states + head, recomputed) equals the KL computed from
    both models side by side, in bf16 and fp32, through a save/load round trip; it is 0 against itself."""
    import copy

    import lrq
    from bench.common.models import load_model
    from bench.evaluations.perplexity import _logit_chunks, perplexity, windows
    fp = load_model(str(tiny_model_dir)).model
    q = copy.deepcopy(fp)
    lrq.quantize(q, "rtn", "w3a16")
    ids = torch.randint(0, fp.config.vocab_size, (512,), generator=torch.Generator().manual_seed(0))
    wins = windows(ids, 128)
    for bf16 in (False, True):
        ctx = torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16)
        with ctx, torch.no_grad():
            exact = torch.cat([kl.kl_exact(torch.log_softmax(a, -1), torch.log_softmax(b, -1))[0]
                               for w in wins for (a, _), (b, _) in zip(_logit_chunks(fp, w), _logit_chunks(q, w))])
        ref = kl.compute_reference(fp, wins, "bf16" if bf16 else "fp32", key=f"k{bf16}")
        path = tmp_path / f"ref{bf16}.safetensors"
        monkeypatch.setenv("LRQ_BENCH_CACHE", str(tmp_path / "kl-cache"))
        kl.save_reference(ref, path)
        back = kl.load_reference(path, f"k{bf16}")
        assert back is not None and kl.load_reference(path, "another key") is None
        assert back.hidden.dtype == torch.float32   # what the float32 head reads, under every precision
        res = perplexity(q, ids, 128, precision="bf16" if bf16 else "fp32", reference=back)
        assert exact.mean() > 0.01
        assert torch.allclose(res["token_kl"], exact, rtol=1e-5, atol=1e-6), float((res["token_kl"] - exact).abs().max())
        self_kl = perplexity(fp, ids, 128, precision="bf16" if bf16 else "fp32", reference=back)
        assert float(self_kl["token_kl"].abs().max()) < 1e-5 and bool(self_kl["token_top1"].all())
        # one copy of the head for every reference of the model in this process
        assert kl.load_reference(path, f"k{bf16}").weight is back.weight
        # a damaged head file makes the reference absent in a new process (recomputed), never wrong
        hpath = next((tmp_path / "kl-cache" / "kl-reference").glob("head-*.safetensors"))
        good = hpath.read_bytes()
        hpath.write_bytes(good[:100])
        monkeypatch.setattr(kl, "_HEADS", {})
        assert kl.load_reference(path, f"k{bf16}") is None
        hpath.write_bytes(good)


def test_the_head_computes_in_float32_under_bf16_autocast_and_ties_are_counted(tiny_model_dir):
    """Under bf16 autocast the body runs in bf16 and the head in float32: the scored logits equal the float32
    projection of the body's output exactly (a bf16 head ties the top token where float32 does not)."""
    import torch.nn.functional as F

    from bench.common.models import load_model
    from bench.evaluations.perplexity import _logit_chunks, final_hidden
    fp = load_model(str(tiny_model_dir)).model
    w = torch.randint(0, fp.config.vocab_size, (128,), generator=torch.Generator().manual_seed(1))
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        got = torch.cat([c for c, _ in _logit_chunks(fp, w, chunk=32)])
        h, _ = final_hidden(fp, w)
        bf16_head = fp.get_output_embeddings()(h)
    assert got.dtype == torch.float32 and bf16_head.dtype == torch.bfloat16
    assert torch.equal(got, F.linear(h.float(), fp.get_output_embeddings().weight.float()))
    assert not torch.equal(got, bf16_head.float())
    lp = torch.log_softmax(torch.tensor([[2.0, 1.0, 0.0], [1.0, 1.0, 0.0], [0.0, 3.0, 1.0]]), -1)
    lq = torch.log_softmax(torch.tensor([[2.0, 2.0, 0.0], [1.0, 0.5, 0.0], [0.0, 3.0, 1.0]]), -1)
    _, agree, tied = kl.kl_exact(lp, lq)
    assert tied.tolist() == [True, True, False] and agree.tolist() == [True, True, True]
    assert kl.summary(torch.zeros(3), agree, int(tied.sum()))["top1_ties"] == 2


@pytest.mark.heavy
def test_kl_is_a_unit_of_its_own_computed_with_the_perplexity(tiny_model_dir, data_dir, tmp_path, capsys,
                                                              monkeypatch):
    monkeypatch.setenv("LRQ_BENCH_CACHE", str(tmp_path / "cache"))
    calls = []
    real = kl.compute_reference
    monkeypatch.setattr(kl, "compute_reference", lambda *a, **k: calls.append(1) or real(*a, **k))
    results = tmp_path / "r.sqlite"
    base = ["run", *QUICK, "--model", str(tiny_model_dir), "--methods", "rtn", "--data-dir", str(data_dir),
            "--results", str(results)]
    assert main(base + ["--schemes", "w4a16,w3a16"]) == 0
    assert len(calls) == 1            # one FP reference for both cells (the FP cell needs none)
    rows = ResultStore(results).rows()
    kld = {r.scheme: r for r in rows if r.metric == "kld"}
    assert set(kld) == {"w4a16", "w3a16"} and kld["w3a16"].value > kld["w4a16"].value > 0
    c = kld["w4a16"].config["kl"]
    assert c["schema"] == kl.SCHEMA and len(c["window_kld"]) == 4 and c["positions"] == 4 * 255
    assert math.isclose(sum(c["window_kld"]) / 4, kld["w4a16"].value, rel_tol=1e-6)
    top1 = next(r for r in rows if r.metric == "top1_agree" and r.scheme == "w4a16")
    assert 0 < top1.value <= 1
    # a store of perplexities made before KL existed: only the KL units are computed, the rest reused
    conn = __import__("sqlite3").connect(results)
    conn.execute("DELETE FROM results WHERE metric IN ('kld', 'kld_median', 'kld_p99', 'top1_agree', 'top1_ties')")
    conn.commit()
    conn.close()
    ppl_before = {(r.scheme, r.unit_key) for r in ResultStore(results).rows() if r.metric == "ppl"}
    assert main(base + ["--schemes", "w4a16,w3a16"]) == 0
    capsys.readouterr()
    after = ResultStore(results).rows()
    assert {(r.scheme, r.unit_key) for r in after if r.metric == "ppl"} == ppl_before   # not recomputed
    assert {r.scheme for r in after if r.metric == "kld"} == {"w4a16", "w3a16"}
    assert len(calls) == 1            # the cached reference was reused
    # the separation study pairs the two cells on every text, each metric paired over the same windows
    from bench.evaluations import stats
    from bench.studies import separation
    assert separation.main(["--results", str(results), "--out", str(tmp_path / "sep")]) == 0
    capsys.readouterr()
    doc = json.loads((tmp_path / "sep" / "separation.json").read_text())
    assert len(doc["texts"]) == len({r.dataset for r in after if r.metric == "kld"})
    for text, res in doc["texts"].items():
        assert res["cells"] == 2 and res["windows"] == 4 and all(res[m]["pairs"] == 1 for m in ("ppl", "kld", "top1"))
    ds = next(r.dataset for r in after if r.metric == "kld")
    k = {r.scheme: r.config["kl"]["window_kld"] for r in after if r.metric == "kld" and r.dataset == ds}
    c = stats.paired_mean(k["w3a16"], k["w4a16"])
    res = next(v for t, v in doc["texts"].items() if f" {ds} " in t)
    assert res["kld"]["separated"] == int(c.separated)
    assert math.isclose(res["kld"]["median_rel_half_width"],
                        (c.hi - c.lo) / 2 / ((sum(k["w3a16"]) + sum(k["w4a16"])) / 8), rel_tol=1e-9)


@pytest.mark.heavy
def test_the_leaderboard_is_led_by_kld_and_shows_flips(tiny_model_dir, data_dir, tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("LRQ_BENCH_CACHE", str(tmp_path / "cache"))
    results = tmp_path / "r.sqlite"
    assert main(["run", *QUICK, "--model", str(tiny_model_dir), "--methods", "rtn", "--schemes", "w3a16,w4a16",
                 "--data-dir", str(data_dir), "--results", str(results), "--tasks", "zeroshot", "--task-limit", "6",
                 "--out", str(tmp_path / "rep")]) == 0
    capsys.readouterr()
    md = (tmp_path / "rep" / "leaderboard.md").read_text()
    header = next(line for line in md.splitlines() if line.startswith("| method") and "bits/weight" in line)
    cols = [c.strip() for c in header.strip("|").split("|")]
    assert cols[2:5] == ["bits/weight", "WikiText-2 KLD", "WikiText-2 top-1 agreement %"]
    assert cols.index("WikiText-2 ppl") < cols.index("flips vs FP %") < cols.index("zero-shot avg %")
    assert "### KL divergence from the FP model" in md and "### Flips against the FP model" in md
    flips = md.split("### Flips against the FP model")[1].split("###")[0]
    assert flips.count("| rtn ") == 2 and "zero-shot flips %" in flips
    html = (tmp_path / "rep" / "leaderboard.html").read_text()
    assert "KL divergence from the FP model" in html and 'class="ref"' in html


def test_flips_count_answers_that_changed():
    from bench.evaluations import stats as S
    fp = [1, 1, 0, 0, 1]
    q = [1, 0, 1, 0, 0]
    r2w, w2r = S.flips(fp, q)
    assert r2w == [0, 1, 0, 0, 1] and w2r == [0, 0, 1, 0, 0]


def test_the_gate_tracks_kld_in_its_direction(tmp_path, capsys):
    from bench.common.store import Row

    def export(path, kld):
        path.write_text(json.dumps([Row("m", "rtn", "w4a16", "wikitext2", "kld", kld,
                                        config={"kl": {"window_kld": [kld * f for f in (0.9, 1.0, 1.1, 1.0)]}}).__dict__]))
        return path
    base = export(tmp_path / "b.json", 0.1000)
    assert main(["compare", str(base), str(export(tmp_path / "ok.json", 0.1005))]) == 0
    assert main(["compare", str(base), str(export(tmp_path / "w.json", 0.1030))]) == 1   # 3 % worse: flagged
    out = capsys.readouterr().out
    assert "kld" in out and "regressed" in out
    assert main(["compare", str(base), str(export(tmp_path / "better.json", 0.09))]) == 0
    bad = tmp_path / "t.toml"
    bad.write_text('[metrics.kld]\ndirection = "higher"\nrel = 0.01\n')
    assert main(["compare", str(base), str(base), "--tolerances", str(bad)]) == 2
    assert "kld is lower is better" in " ".join(capsys.readouterr().err.split())


def test_one_declaration_makes_a_task(monkeypatch):
    """A new lm-eval task is one Task in the catalogue: the command line, the planner and the report know it."""
    from bench.run import plan as P
    from bench.cli.args import _task_names
    new = E.Task("sciq", "SciQ", "sciq/test.jsonl", {"output_type": "multiple_choice"}, "acc", 4, 80, 1000)
    monkeypatch.setattr(E, "TASKS", dict(E.TASKS, sciq=new))
    monkeypatch.setattr(E, "ALL_TASKS", tuple(E.TASKS))
    assert "sciq" in _task_names("all")
    assert P.task_requests("sciq", 10) == (40, 80)
    from bench.evaluations.tasks import task_specs
    assert task_specs(__import__("pathlib").Path("/d"))["sciq"]["dataset_kwargs"]["data_files"]["test"] == "/d/sciq/test.jsonl"


def test_every_catalogue_metric_formats_and_has_a_direction():
    for m in E.METRICS.values():
        assert m.gate_direction in ("lower", "higher", "both")
        assert m.format(0.5) and m.format(None) == "-"
    cols = E.summary_columns({("quant", "bits_per_weight"), ("wikitext2", "kld"), ("wikitext2", "top1_agree"),
                              ("wikitext2", "ppl"), ("c4", "ppl"), ("c4", "kld")})
    assert [c.metric for c in cols][:5] == ["bits_per_weight", "kld", "top1_agree", "kld", "ppl"]


def test_kld_chart_points_are_identifiable_and_schemes_order_by_bits():
    import re

    from bench.reports.html_report import log_ticks, scheme_chart, scheme_order
    pts = [("rtn", "w3a16", 0.5, 0.4, 0.6), ("gptq", "w3a16", 0.3, 0.25, 0.35), ("rtn", "w3a16-g128", 0.2, 0.15, 0.25),
           ("rtn", "w4a16", 0.1, 0.08, 0.12), ("awq", "w4a16", 0.09, 0.07, 0.11), ("rtn", "w4a8", 0.12, 0.1, 0.14),
           ("awq", "w4a8", 0.11, 0.09, 0.13), ("rtn", "w8a8", 0.01, 0.005, 0.015)]
    schemes = [("w3a16", 3.028), ("w3a16-g128", 3.161), ("w4a8", 4.029), ("w4a16", 4.029), ("w8a8", 8.035)]
    svg = scheme_chart(pts, schemes, "KLD", logy=False, ref=(0.0, "FP"))
    # every scheme labelled on its own slot, even two at the same bits per weight (w4a8 and w4a16: 4.029)
    labels = re.findall(r'<text class="xtick" x="([\d.]+)"[^>]*>([^<]+)<', svg)
    assert [t for _, t in labels] == [s for s, _ in schemes]
    assert len({x for x, _ in labels}) == len(schemes)
    circles = re.findall(r'<circle class="pt" cx="([\d.]+)" cy="([\d.]+)" r="4" fill="([^"]+)" data-method="([^"]+)" '
                         r'data-scheme="([^"]+)"><title>([^<]+)</title>', svg)
    assert len(circles) == len(pts) and len({(c[0], c[1]) for c in circles}) == len(pts)   # none hides another
    fills = {m: f for _, _, f, m, _, _ in circles}
    assert len(set(fills.values())) == 3                                            # one colour per method
    for _, _, _, m, s, title in circles:
        assert title.startswith(f"{m} {s}, ") and "bits/weight" in title and "95 %" in title   # tooltip names both
    assert 'class="ref"' in svg
    yt = [float(t) for t in re.findall(r'<text class="ytick"[^>]*>([^<]+)<', svg)]
    assert yt and all(abs(v * 10 - round(v * 10)) < 1e-9 for v in yt)             # round ticks
    assert log_ticks(13.5, 1020) == [20, 50, 100, 200, 500, 1000]
    assert log_ticks(13.5, 20) == [14, 16, 18, 20]
    assert scheme_order(["w8a8", "w4a16", "w3a16-g128", "w4a8", "w3a16", "w4a16-g128"]) == \
        ["w3a16", "w3a16-g128", "w4a8", "w4a16", "w4a16-g128", "w8a8"]


def test_one_copy_of_the_head_the_model_own_and_a_changed_head_is_never_scored(tiny_model_dir, tmp_path, monkeypatch):
    """The reference is made from the model's own head tensor (no clone); before scoring, attach_head points every
    reference at the quantized model's head where it is the FP head bit for bit (the copy read from the file is
    dropped), and a head changed in memory after the reference was made is read again from its checked file, or
    refused when that file is gone: the KL is never computed from a wrong FP distribution."""
    import copy

    import lrq
    from bench.common.models import load_model
    from bench.evaluations.perplexity import perplexity, windows
    monkeypatch.setenv("LRQ_BENCH_CACHE", str(tmp_path / "kl-cache"))
    monkeypatch.setattr(kl, "_HEADS", {})
    fp = load_model(str(tiny_model_dir)).model
    ids = torch.randint(0, fp.config.vocab_size, (512,), generator=torch.Generator().manual_seed(0))
    wins = windows(ids, 128)
    ref = kl.compute_reference(fp, wins, "fp32", key="k")
    assert ref.weight is fp.get_output_embeddings().weight.detach() or \
        ref.weight.data_ptr() == fp.get_output_embeddings().weight.data_ptr()       # no copy made
    path = tmp_path / "ref.safetensors"
    kl.save_reference(ref, path)
    q = copy.deepcopy(fp)
    lrq.quantize(q, "rtn", "w3a16")
    exact = perplexity(q, ids, 128, precision="fp32", reference=ref)["token_kl"]
    # another process: the reference's head read from its file, then the quantized model's own head attached
    monkeypatch.setattr(kl, "_HEADS", {})
    back = kl.load_reference(path, "k")
    q_head = q.get_output_embeddings().weight
    assert back.weight.data_ptr() != q_head.data_ptr()
    kl.attach_head([back], q)
    assert back.weight.data_ptr() == q_head.data_ptr() and kl._HEADS[back.head_key][0] is back.weight
    assert torch.equal(perplexity(q, ids, 128, precision="fp32", reference=back)["token_kl"], exact)
    # the model's head changed in memory after the reference shared it: read again from the file, exact KL
    original = q_head.detach().clone()
    with torch.no_grad():
        q_head.mul_(1.5)
    kl.attach_head([back], q)
    assert back.weight.data_ptr() != q_head.data_ptr()
    assert torch.equal(back.weight, original)
    with torch.no_grad():
        q_head.copy_(original)
    assert torch.equal(perplexity(q, ids, 128, precision="fp32", reference=back)["token_kl"], exact)
    # ... and refused where the file is gone
    kl.attach_head([back], q)
    assert back.weight.data_ptr() == q_head.data_ptr()
    with torch.no_grad():
        q_head.mul_(1.5)
    for f in (tmp_path / "kl-cache" / "kl-reference").glob("head-*.safetensors"):
        f.unlink()
    import pytest
    with pytest.raises(RuntimeError, match="changed in memory"):
        kl.attach_head([back], q)
