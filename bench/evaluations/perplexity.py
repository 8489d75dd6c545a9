"""Perplexity, GPTQ style: one token stream cut into non-overlapping windows, exp(mean window NLL)."""

from __future__ import annotations

import math
from itertools import chain

import torch
import torch.nn.functional as F
from torch import nn
from tqdm.auto import tqdm

from lrq import precision as P
from lrq import progress

#: The version of what this module computes (windows, NLL, the head's precision): bump it with any change that
#: changes a perplexity, and every perplexity unit is computed again (a key of its own; version 1 is left out of
#: the key, so the results stored before versions existed keep theirs). Rows record it (`eval_versions`).
VERSION = 1


def windows(ids: torch.Tensor, seq_len: int, include_partial: bool = False) -> list[torch.Tensor]:
    """Non-overlapping windows of `seq_len` tokens; the last partial one only when asked (and >= 2 tokens)."""
    if seq_len < 2:
        raise ValueError("seq_len must be at least 2")
    out = [ids[i:i + seq_len] for i in range(0, len(ids) - seq_len + 1, seq_len)]
    rest = len(ids) - len(out) * seq_len
    if include_partial and rest >= 2:
        out.append(ids[len(out) * seq_len:])
    return out


def final_hidden(model: nn.Module, window: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(the final hidden states [L-1, H] the output head reads for positions 1..L-1, their targets [L-1]): one
    forward pass of the model's body."""
    device = next(model.parameters()).device
    x = window.to(device).unsqueeze(0)
    hidden = model.model(input_ids=x, use_cache=False).last_hidden_state[0, :-1]
    return hidden, x[0, 1:]


def _logit_chunks(model: nn.Module, window: torch.Tensor, chunk: int = 128):
    """(float32 logits [c, vocab], targets [c]) of a window's positions 1..L-1, `chunk` positions at a time.

    The hidden states come from one forward pass; the vocabulary projection runs in chunks of positions,
    in float32 (also under bf16 autocast: lrq.precision.head_logits), so a 2048 x 49152 logit matrix is never
    held at once. 128 positions (25 MB of float32
    logits at a 49k vocabulary) keep the logits in the CPU's L3 cache across the cast and the log-softmax:
    0.5 s per 2048-token window instead of 0.75-0.9 s at 512 on the 2-core test machine
    (bench/studies/eval_speed.py); the sums differ by < 1e-7 relative."""
    from lrq.precision import head_logits
    hidden, targets = final_hidden(model, window)
    head = model.get_output_embeddings()
    for i in range(0, hidden.shape[0], chunk):   # the head in float32 whatever the body's precision
        yield head_logits(head, hidden[i:i + chunk]), targets[i:i + chunk]


@torch.no_grad()
def window_nll(model: nn.Module, window: torch.Tensor, chunk: int = 128) -> float:
    """Mean negative log-likelihood of tokens 2..L of a window given their prefixes."""
    total, n = 0.0, 0
    for logits, targets in _logit_chunks(model, window, chunk):
        total += F.cross_entropy(logits, targets, reduction="sum").item()
        n += targets.numel()
    return total / n


@torch.no_grad()
def window_scores(model: nn.Module, window: torch.Tensor, score, chunk: int = 128
                  ) -> tuple[float, torch.Tensor, torch.Tensor]:
    """The window's mean NLL and, from `score(lq, start)` (bench.evaluations.kl.Reference.scorer: the KL(P_fp || P_q) and
    top-1 agreement of the positions start.. given the quantized model's log-probabilities `lq` [c, vocab]),
    every position's KL and whether the top-1 tokens agree: one pass, one log-softmax per chunk."""
    total, n, kls, top1, ties = 0.0, 0, [], [], 0
    for logits, targets in _logit_chunks(model, window, chunk):
        lq = torch.log_softmax(logits, dim=-1)
        total -= lq.gather(1, targets.unsqueeze(1)).sum().item()
        kl, agree, tied = score(lq, n)
        kls.append(kl.cpu())
        top1.append(agree.cpu())
        ties += int(tied.sum())
        n += targets.numel()
    return total / n, torch.cat(kls), torch.cat(top1), ties


def perplexity(model: nn.Module, ids: torch.Tensor, seq_len: int = 2048, include_partial: bool = False,
               precision=None, desc: str = "perplexity", reference=None) -> dict:
    """exp(mean over windows of each window's mean NLL), at `precision` (lrq.precision: a `Precision`, 'bf16',
    'fp32' or 'auto'; None: the precision in force, which the harness sets to the cell's).

    `window_nll` holds every window's mean NLL (over `window_tokens` predicted tokens each), for paired
    comparisons of two models on the same windows; the results store keeps both with every perplexity.
    With `reference` (bench.evaluations.kl.Reference: what the FP model's logits on these windows are computed from) the same
    pass also measures the KL divergence from the FP model: `token_kl` and `token_top1` for every position,
    `window_kld` and `window_top1` per window."""
    wins = windows(ids, seq_len, include_partial)
    if not wins:
        raise ValueError(f"the text has {len(ids)} tokens, fewer than one {seq_len}-token window")
    if reference is not None and reference.n_windows != len(wins):
        raise ValueError(f"the KL reference holds {reference.n_windows} windows, the text {len(wins)}")
    device = next(model.parameters()).device
    nlls, kls, top1, ties = [], [], [], 0
    with P.use(precision), P.autocast(device):
        for k, w in enumerate(tqdm(wins, desc=desc, leave=False, unit="win")):
            progress.update(f"window {k + 1}/{len(wins)}", k / len(wins))
            if reference is None:
                nlls.append(window_nll(model, w))
                continue
            nll, kl, agree, tied = window_scores(model, w, reference.scorer(k))
            ties += tied
            nlls.append(nll)
            kls.append(kl)
            top1.append(agree)
    mean = sum(nlls) / len(nlls)
    out = {"ppl": math.exp(mean), "nll": mean, "windows": len(wins),
           "tokens": int(sum(len(w) for w in wins)), "window_nll": nlls,
           "window_tokens": [len(w) - 1 for w in wins]}   # the tokens each window's mean NLL is over
    if reference is not None:
        out |= {"token_kl": torch.cat(kls), "token_top1": torch.cat(top1), "top1_ties": ties,
                "window_kld": [float(v.mean()) for v in kls], "window_top1": [float(v.float().mean()) for v in top1]}
    return out


class NonFiniteResult(RuntimeError):
    """A measurement came out NaN or infinite: the unit fails (never stored) and the message says where the
    first non-finite value appeared."""


@torch.no_grad()
def locate_nonfinite(model: nn.Module, ids: torch.Tensor) -> str:
    """Where the first non-finite value appears: a floating-point parameter or buffer holding one, else the
    first module (in the order modules finish their forward, innermost first) whose output holds one on
    `ids` (a 1-D window), else none found (the overflow is in the loss itself)."""
    for name, t in chain(model.named_parameters(), model.named_buffers()):
        if t is not None and t.is_floating_point() and not torch.isfinite(t).all():
            bad = int((~torch.isfinite(t)).sum())
            return f"{name} holds {bad} non-finite value{'s' if bad > 1 else ''} (of {t.numel():,})"
    first: list[str] = []

    def hook(name):
        def fn(_m, _args, out):
            if first:
                return
            for o in (out if isinstance(out, (tuple, list)) else (out,)):
                if isinstance(o, torch.Tensor) and o.is_floating_point() and not torch.isfinite(o).all():
                    first.append(name)
                    return
        return fn
    handles = [m.register_forward_hook(hook(n or type(model).__name__)) for n, m in model.named_modules()]
    try:
        device = next(model.parameters()).device
        model(input_ids=ids[:256].to(device).unsqueeze(0), use_cache=False)
    finally:
        for h in handles:
            h.remove()
    return f"the output of {first[0]}" if first else "no module output (the loss itself overflowed)"


def check_finite_perplexity(model: nn.Module, ids: torch.Tensor, res: dict, dataset: str, seq_len: int,
                            include_partial: bool = False) -> None:
    """Raise NonFiniteResult, saying where, when a perplexity (or any window's NLL) is NaN or infinite."""
    bad = [i for i, v in enumerate(res["window_nll"]) if not math.isfinite(v)]
    if math.isfinite(res["ppl"]) and not bad:
        return
    first = bad[0] if bad else 0
    where = locate_nonfinite(model, windows(ids, seq_len, include_partial)[first])
    raise NonFiniteResult(
        f"{dataset} perplexity is not finite ({res['ppl']}): {len(bad)} of {res['windows']} windows have a "
        f"non-finite NLL (first: window {first}); the first non-finite value: {where}. Nothing was stored for "
        f"this unit; a rerun recomputes it.")
