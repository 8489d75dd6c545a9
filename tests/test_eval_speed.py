"""bench.studies.eval_speed on a tiny saved Llama: both harnesses score tokens and give finite perplexities."""

import json
import math

import torch

from bench.evaluations.data import tokenize
from bench.studies.eval_speed import _detail, _fmt_table, measure


def test_both_sides_score_tokens(tiny_model_dir, data_dir, tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    # A few short pages in the layout of wikitext_document_level.test.jsonl (field `page`).
    real = (data_dir / "wikitext2" / "wikitext_document_level.test.jsonl").read_text(encoding="utf-8").splitlines()
    pages = [json.loads(line)["page"][:300] for line in real[:3]]
    docs = tmp_path / "docs.jsonl"
    docs.write_text("".join(json.dumps({"page": p}) + "\n" for p in pages), encoding="utf-8")
    ids = tokenize(tok, "\n\n".join(pages))

    out = measure(model, tok, ids, docs, max_tokens=64, seq_len=32, log=lambda m: None)

    rows = out["rows"]
    assert [r.harness for r in rows] == ["ours", "lm-eval", "ours"]
    assert rows[0].dtype == rows[1].dtype == "bf16 weights"
    for r in rows:
        assert r.tokens > 0 and r.forward_tokens > 0 and r.windows > 0
        assert math.isfinite(r.ppl) and r.ppl > 1
        assert r.wall_s > 0 and 0 <= r.body_s <= r.wall_s
    assert rows[0].tokens == 2 * 31
    assert out["limit_docs"] >= 1
    assert all(math.isfinite(v) for v in rows[1].extra["metrics"].values())
    assert next(model.parameters()).dtype == torch.float32  # the bf16 runs used a copy
    table = _fmt_table(rows, out["reference"])
    assert table.count("\n") == 4 and "| lm-eval | bf16 weights |" in table
    assert "token perplexity" in _detail(rows, 32)
