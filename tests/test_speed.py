"""The speed benchmark's plumbing on tiny shapes (no timing is asserted: these machines are shared)."""

import json

import torch

from bench import speed
from bench.store import ResultStore


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
    from bench.report import markdown_report
    rows = speed.layer_latency({"tiny 48x64": (48, 64)}, [2], schemes=("w4a16",))
    speed._store(rows, "layers", str(tmp_path / "r.sqlite"), "tiny")
    e2e = [{"scheme": "bf16", "prefill_tokens": 8, "prefill_tok_s": 100.0, "decode_tokens": 4, "decode_tok_s": 5.0,
            "model_bytes": 2**20, "linear_bytes": None, "peak_rss_bytes": 2**28},
           {"scheme": "w4a16", "prefill_tokens": 8, "prefill_tok_s": 90.0, "decode_tokens": 4, "decode_tok_s": 4.0,
            "model_bytes": 2**19, "linear_bytes": 1000, "peak_rss_bytes": 2**27}]
    speed._store(e2e, "e2e", str(tmp_path / "r.sqlite"), "tiny")
    md = markdown_report(ResultStore(tmp_path / "r.sqlite").rows(latest=True))
    assert "### Inference speed (end to end)" in md and "| w4a16    | 90.0" in md
    assert "### Per-layer latency" in md and "tiny 48x64" in md
    assert "speed_layers perplexity" not in md
