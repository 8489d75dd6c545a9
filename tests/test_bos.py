"""The evaluation protocol per model: whether windows start with BOS (issue U, item 5).

Gemma's tokenizer starts every text with <bos>, and the model depends on it (gemma3-270m's first WikiText-2
window: perplexity 16.19 without BOS, 11.87 with). SmolLM2's does not. lrq-bench reads the protocol from the
model's own tokenizer (`bench.common.models.default_bos`; a built-in declares it): where it adds BOS,
every perplexity window, KL reference window, calibration window and task request starts with it; where it
does not, the token stream is cut as before and every unit key is the one stored before the protocol
existed."""

from __future__ import annotations

import shutil

import pytest

import torch

from bench.evaluations import data as D


def _bos_tokenizer_dir(src, dst):
    """A copy of the tiny model whose tokenizer prepends its BOS, as Gemma's does (a post-processor)."""
    from tokenizers import processors
    from transformers import AutoTokenizer
    shutil.copytree(src, dst)
    tok = AutoTokenizer.from_pretrained(str(dst))
    bos = tok.bos_token
    tok._tokenizer.post_processor = processors.TemplateProcessing(
        single=f"{bos} $A", pair=f"{bos} $A {bos} $B", special_tokens=[(bos, tok.bos_token_id)])
    tok.save_pretrained(str(dst))
    return dst


def test_windows_start_with_bos_and_lose_no_token():
    ids = torch.arange(10, 30)
    s = D.with_bos(ids, 8, 1)
    wins = [s[i:i + 8] for i in range(0, len(s) - 7, 8)]
    assert all(int(w[0]) == 1 for w in wins)
    # the text's tokens in order, 7 per window, none dropped, none repeated
    assert torch.equal(torch.cat([w[1:] for w in wins]), ids[:7 * len(wins)])
    assert torch.equal(D.with_bos(ids, 8, None), ids)


def test_the_protocol_is_read_from_the_tokenizer(tiny_model_dir, tmp_path):
    from transformers import AutoTokenizer
    from bench.common.models import BUILTINS, default_bos, model_bos
    plain = AutoTokenizer.from_pretrained(str(tiny_model_dir))
    bos_dir = _bos_tokenizer_dir(tiny_model_dir, tmp_path / "bos")
    with_bos = AutoTokenizer.from_pretrained(str(bos_dir))
    assert default_bos(plain) is None and default_bos(with_bos) == with_bos.bos_token_id
    assert model_bos(str(tiny_model_dir)) is False and model_bos(str(bos_dir)) is True
    assert BUILTINS["smollm2-135m"].bos is False
    calib = D.calibration_set(with_bos, D.resolve_data_dir(None), "c4", 4, 64, bos=True)
    assert (calib.input_ids[:, 0] == with_bos.bos_token_id).all() and calib.description["bos"] is True
    assert "bos" not in D.calibration_set(plain, D.resolve_data_dir(None), "c4", 4, 64).description


@pytest.mark.heavy
def test_a_bos_model_is_scored_with_bos_and_says_so(tiny_model_dir, data_dir, tmp_path, monkeypatch):
    from bench.cli import main
    from bench.common.store import ResultStore
    from bench.run.cell import EvalSettings, Request, settle
    monkeypatch.setenv("LRQ_BENCH_CACHE", str(tmp_path / "cache"))
    bos_dir = _bos_tokenizer_dir(tiny_model_dir, tmp_path / "bos")
    common = dict(method="gptq", scheme="w4a16", datasets=("wikitext2",), tasks=(), precision="fp32",
                  device="cpu", data_dir=str(data_dir))
    plain, bos = settle(Request(model=str(tiny_model_dir), **common)), settle(Request(model=str(bos_dir), **common))
    assert plain.eval.bos is False and "bos" not in plain.eval.key() and bos.eval.key()["bos"] is True
    assert bos.identity["calib"]["bos"] is True and "bos" not in plain.identity["calib"]
    # a model without BOS keeps the keys it had before the protocol was recorded
    assert EvalSettings().key() == {"seq_len": 2048, "include_partial": False, "max_tokens": None,
                                    "autocast": "bf16", "head": "fp32"}
    ppl = {}
    for name, folder in (("plain", tiny_model_dir), ("bos", bos_dir)):
        store = tmp_path / f"{name}.sqlite"
        assert main(["run", "--model", str(folder), "--methods", "rtn", "--schemes", "w4a16", "--tasks", "none",
                     "--datasets", "wikitext2", "--max-eval-tokens", "512", "--eval-seq-len", "128",
                     "--data-dir", str(data_dir), "--results", str(store), "--precision", "fp32",
                     "--out", str(tmp_path / f"report-{name}")]) == 0
        rows = [r for r in ResultStore(store).rows() if r.metric == "ppl" and r.method == "fp"]
        assert rows[0].config["eval"]["bos"] is (name == "bos")
        ppl[name] = rows[0].value
        board = (tmp_path / f"report-{name}" / "leaderboard.md").read_text()
        assert ("each starting with the model's BOS token" in board) is (name == "bos")
        assert ("cut from the text's token stream, no BOS" in board) is (name == "plain")
    assert ppl["plain"] != ppl["bos"]     # the same weights scored on other windows
