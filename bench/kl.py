"""KL divergence of a quantized model's next-token distribution from the FP model's, on the perplexity windows.

For every predicted position t of the perplexity windows, KL(P_fp,t || P_q,t) over the whole vocabulary is
what llama.cpp's `perplexity --kl-divergence` reports. Storing the FP model's full log-probabilities is 1.6 GB
per 16,384 tokens of a 49,152-token vocabulary in fp16, so the reference keeps, per position, the FP model's
top-k tokens and their log-probabilities (float32), and the rest of the vocabulary as one tail of mass
p_tail = 1 - sum(top-k p). The quantized model's log-probabilities are computed in full in the same pass as its
perplexity (bench.perplexity.window_scores), so

    KL ~= sum_{v in top-k} p_v (log p_v - log q_v) + p_tail (log p_tail - log q_tail),   q_tail = 1 - sum(top-k q)

which is KL between the two distributions with the tail merged into one outcome: never above the exact value
(the log-sum inequality), and below it only by the divergence inside the tail, which the FP model gives at most
p_tail of its mass. With k = TOP_K the error measured against the exact KL on real cells is below 1 % of the
KL (bench/studies/kl_approx.py, reports/kl/). Top-1 agreement: the quantized model's most likely token is the
FP model's (the reference's first entry).

The reference is computed once per (model, text, evaluation settings, precision, k) from the unquantized
model, by the first cell that needs it (before it quantizes: the model is loaded anyway), under a file lock so
parallel workers compute it once, and kept in the lrq-bench cache (about 9 MB per 16,384 tokens at k = 64).
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

TOP_K = 64
APPROXIMATION = "top-k FP log-probabilities + tail mass"


def kl_top_k(lq: torch.Tensor, ref_idx: torch.Tensor, ref_lp: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per position: KL(P_fp || P_q) from the FP model's top-k (`ref_idx`, `ref_lp` [n, k], sorted, log-probs)
    and the quantized model's full log-probabilities `lq` [n, vocab]; and whether the top-1 tokens agree."""
    lq_top = lq.gather(1, ref_idx.long())
    p = ref_lp.exp()
    kl = (p * (ref_lp - lq_top)).sum(1)
    p_tail = (1.0 - p.sum(1)).clamp(min=0.0)
    q_tail = (1.0 - lq_top.exp().sum(1)).clamp(min=1e-30)
    tail = torch.where(p_tail > 0, p_tail * (torch.log(p_tail.clamp(min=1e-30)) - torch.log(q_tail)),
                       torch.zeros_like(p_tail))
    return (kl + tail).clamp(min=0.0), lq.argmax(1) == ref_idx[:, 0].long()


@dataclass
class Reference:
    """The FP model's top-k log-probabilities on a text's windows: `idx`, `lp` [positions, k] in window order,
    window w's positions at offsets[w]:offsets[w + 1]."""
    idx: torch.Tensor
    lp: torch.Tensor
    offsets: list[int]
    key: str

    @property
    def n_windows(self) -> int:
        return len(self.offsets) - 1

    def window(self, w: int) -> tuple[torch.Tensor, torch.Tensor]:
        a, b = self.offsets[w], self.offsets[w + 1]
        return self.idx[a:b], self.lp[a:b]

    def scorer(self, w: int):
        """score(lq, start): KL and top-1 agreement of window w's positions start.. (bench.perplexity calls it
        chunk by chunk with the quantized model's log-probabilities `lq` [c, vocab])."""
        idx, lp = self.window(w)

        def score(lq: torch.Tensor, start: int) -> tuple[torch.Tensor, torch.Tensor]:
            c = lq.shape[0]
            return kl_top_k(lq, idx[start:start + c].to(lq.device), lp[start:start + c].to(lq.device))
        return score


def reference_key(model_id: str, dataset: str, data: str, eval_settings: dict, precision: str, k: int = TOP_K) -> str:
    """What a reference depends on: the model's weights, the text, the windows, the precision, k."""
    blob = json.dumps({"model": model_id, "dataset": dataset, "data": data, "eval": eval_settings,
                       "precision": precision, "k": k, "schema": 1}, sort_keys=True, default=str)
    return hashlib.sha256(blob.encode()).hexdigest()


def reference_path(key: str) -> Path:
    from bench.cache import cache_root
    return cache_root() / "kl-reference" / f"{key[:32]}.safetensors"


@torch.no_grad()
def compute_reference(model: nn.Module, wins: list[torch.Tensor], k: int, autocast: bool, key: str = "") -> Reference:
    """The FP model's top-k log-probabilities (float32) at every predicted position of `wins`."""
    from contextlib import nullcontext

    from bench.perplexity import _logit_chunks
    from lrq import progress
    device = next(model.parameters()).device
    ctx = torch.autocast(device.type, dtype=torch.bfloat16) if autocast else nullcontext()
    idx, lp, offsets = [], [], [0]
    with ctx:
        for n, w in enumerate(wins):
            progress.update(f"FP reference window {n + 1}/{len(wins)}")
            for logits, _ in _logit_chunks(model, w):
                top = torch.log_softmax(logits, dim=-1).topk(k, dim=-1)
                idx.append(top.indices.to(torch.int32).cpu())
                lp.append(top.values.cpu())
            offsets.append(offsets[-1] + len(w) - 1)
    return Reference(torch.cat(idx), torch.cat(lp), offsets, key)


def save_reference(ref: Reference, path: Path) -> None:
    from safetensors.torch import save_file

    from lrq.io import atomic_write
    meta = {"offsets": json.dumps(ref.offsets), "key": ref.key, "approximation": APPROXIMATION}
    atomic_write(path, lambda p: save_file({"idx": ref.idx.contiguous(), "lp": ref.lp.contiguous()}, str(p),
                                           metadata=meta))


def load_reference(path: Path, key: str) -> Reference | None:
    """The stored reference, or None when absent, of another key, or unreadable (then computed again)."""
    from safetensors import safe_open
    if not path.is_file():
        return None
    try:
        with safe_open(str(path), framework="pt") as f:
            meta = f.metadata() or {}
            if meta.get("key") != key:
                return None
            return Reference(f.get_tensor("idx"), f.get_tensor("lp"), json.loads(meta["offsets"]), key)
    except Exception:  # noqa: BLE001 - a damaged cache file is recomputed
        return None


def ensure_reference(model: nn.Module, wins: list[torch.Tensor], key: str, autocast: bool, k: int = TOP_K) -> Reference:
    """The reference for `key`: loaded from the cache, else computed from `model` (the unquantized model) and
    stored. A file lock makes parallel workers compute it once."""
    from lrq.io import file_lock
    path = reference_path(key)
    ref = load_reference(path, key)
    if ref is not None:
        return ref
    with file_lock(path):
        ref = load_reference(path, key)   # another worker may have finished it meanwhile
        if ref is None:
            ref = compute_reference(model, wins, k, autocast, key)
            save_reference(ref, path)
    return ref


def summary(token_kl: torch.Tensor, token_top1: torch.Tensor) -> dict[str, float]:
    """The stored KL metrics of one text: mean, median and 99th percentile KL over positions, top-1 agreement."""
    kl = token_kl.double()
    return {"kld": float(kl.mean()), "kld_median": float(kl.median()),
            "kld_p99": float(torch.quantile(kl, 0.99)), "top1_agree": float(token_top1.float().mean())}
