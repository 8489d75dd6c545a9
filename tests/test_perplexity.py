"""The perplexity harness against a hand-computed value on a tiny model."""

import math

import pytest
import torch

from bench.evaluations.perplexity import perplexity, windows
from conftest import tiny_model


def _hand_ppl(model, ids, seq_len, include_partial):
    """Token by token: each window's mean NLL of tokens 2..L, then exp of the mean over windows."""
    window_means = []
    starts = list(range(0, len(ids) - seq_len + 1, seq_len))
    spans = [(s, s + seq_len) for s in starts]
    if include_partial and len(ids) - len(starts) * seq_len >= 2:
        spans.append((len(starts) * seq_len, len(ids)))
    with torch.no_grad():
        for a, b in spans:
            w = ids[a:b]
            total = 0.0
            for t in range(1, len(w)):
                logits = model(w[:t].unsqueeze(0)).logits[0, -1].double()
                total -= torch.log_softmax(logits, -1)[w[t]].item()
            window_means.append(total / (len(w) - 1))
    return math.exp(sum(window_means) / len(window_means))


@pytest.mark.parametrize("include_partial", [False, True])
def test_perplexity_equals_hand_computation(include_partial):
    model = tiny_model("llama")
    ids = torch.randint(0, 128, (53,), generator=torch.Generator().manual_seed(3))
    res = perplexity(model, ids, seq_len=16, include_partial=include_partial, precision="fp32")
    assert res["windows"] == (4 if include_partial else 3)
    assert res["ppl"] == pytest.approx(_hand_ppl(model, ids, 16, include_partial), rel=1e-4)
    assert len(res["window_nll"]) == res["windows"]  # per window, for paired comparisons
    assert math.exp(sum(res["window_nll"]) / res["windows"]) == pytest.approx(res["ppl"], rel=1e-12)


def test_bf16_autocast_is_close_to_fp32():
    model = tiny_model("qwen2")
    ids = torch.randint(0, 128, (64,), generator=torch.Generator().manual_seed(4))
    a = perplexity(model, ids, 32, precision="fp32")["ppl"]
    b = perplexity(model, ids, 32, precision="bf16")["ppl"]
    assert b == pytest.approx(a, rel=0.05)


def test_windows_are_non_overlapping():
    ids = torch.arange(10)
    assert [w.tolist() for w in windows(ids, 4)] == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert [w.tolist() for w in windows(ids, 4, include_partial=True)][-1] == [8, 9]
    assert len(windows(torch.arange(9), 4, include_partial=True)) == 2  # a 1-token tail predicts nothing


def test_too_short_text_is_an_error():
    with pytest.raises(ValueError, match="fewer than one"):
        perplexity(tiny_model(), torch.arange(5), seq_len=16)
