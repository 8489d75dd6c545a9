"""KL divergence of a quantized model's next-token distribution from the FP model's, on the perplexity windows.

For every predicted position t of the perplexity windows, KL(P_fp,t || P_q,t) over the whole vocabulary is
what llama.cpp's `perplexity --kl-divergence` reports. Storing the FP model's log-probabilities is 1.6 GB per
16,384 tokens of a 49,152-token vocabulary in fp16, and a top-k summary (the k most likely tokens' log-probs
plus the tail's mass) is not good enough on a small model: measured against the exact KL on real cells of the
default model it is 14-19 % low at k = 64 and still 7-10 % low at k = 256 (its flat tails carry the
divergence; bench/studies/kl_approx.py, reports/kl/). So the reference keeps what the FP logits are computed
from: the FP model's final hidden state at every position (after the last norm: hidden size H values per
position, in float32, what the output head reads: the head computes in float32 under every precision,
lrq.precision.head_logits) and, once per model, its output head (the vocabulary projection, float32). At
scoring time the FP logits are recomputed chunk by chunk with the same operation, the same inputs and the
same precision as the FP pass that stored them, so the FP log-probabilities, hence the KL, are exact
(bench/studies/kl_approx.py measures it), at one head projection and one log-softmax per chunk beside the
quantized model's own: 38 MB per 16,384 tokens and 113 MB per model for the head, instead of 1.6 GB per text.
A process holds one copy of a model's head for all its texts' references (`_HEADS`), and no copy of its own
where the model's head is that head bit for bit: the reference is computed from the model's own head tensor
(no clone) and, before scoring, `attach_head` points every reference at the quantized model's head (no method
changes the head) once its SHA-256 still matches the reference's, so a cell holds one copy of a 262,144 x 640
head (Gemma 3: 671 MB in float32) where it held two (three before one copy served every text).

Top-1 agreement: the quantized model's most likely token is the FP model's.

The reference is computed once per (model, text, evaluation settings, precision) from the unquantized model,
by the first cell that needs it (before it quantizes: the model is loaded anyway), under a file lock so
parallel workers compute it once, and kept in the lrq-bench cache.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import nn

from lrq.precision import float32_logits

APPROXIMATION = "none: FP logits recomputed from the FP final hidden states and output head (exact)"
SCHEMA = 3   # 3: the output head in float32 under every precision (2: in bf16 under bf16 autocast)


def kl_exact(lp: torch.Tensor, lq: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per position: KL(P_fp || P_q) over the whole vocabulary from both models' log-probabilities [n, vocab]
    (float32), whether their most likely tokens agree, and whether either model's most likely token is an exact
    tie (then argmax's lowest-id rule, not the model, decides the agreement; counted and reported)."""
    kl = (lp.exp() * (lp - lq)).sum(1).clamp(min=0.0)
    p2, q2 = lp.topk(2, dim=1).values, lq.topk(2, dim=1).values
    tied = (p2[:, 0] == p2[:, 1]) | (q2[:, 0] == q2[:, 1])
    return kl, lp.argmax(1) == lq.argmax(1), tied


@dataclass
class Reference:
    """What the FP model's logits on a text's windows are computed from: `hidden` [positions, H] (window w's
    positions at offsets[w]:offsets[w + 1]) and the output head `weight` [vocab, H] (+ `bias`)."""
    hidden: torch.Tensor
    weight: torch.Tensor
    bias: torch.Tensor | None
    offsets: list[int]
    key: str
    head_key: str = ""    # SHA-256 of the head (bench.evaluations.kl._head_key), set once it is stored or loaded
    _heads: dict = field(default_factory=dict, repr=False, compare=False)

    @property
    def n_windows(self) -> int:
        return len(self.offsets) - 1

    def _head(self, device: torch.device) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The head in float32 on `device` (moved once, not at every chunk)."""
        if self.weight.device == torch.device(device) and self.weight.dtype == torch.float32:
            return self.weight, self.bias     # the head itself (attach_head may re-point it): no copy
        key = str(device)
        if key not in self._heads:
            self._heads[key] = (self.weight.to(device, torch.float32),
                                None if self.bias is None else self.bias.to(device, torch.float32))
        return self._heads[key]

    def scorer(self, w: int):
        """score(lq, start): KL and top-1 agreement of window w's positions start.. (bench.evaluations.perplexity calls it
        chunk by chunk, under the evaluation's autocast, with the quantized model's log-probabilities `lq`
        [c, vocab]): the FP logits recomputed from the stored hidden states, as the FP pass computed them."""
        a = self.offsets[w]

        def score(lq: torch.Tensor, start: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
            c = lq.shape[0]
            weight, bias = self._head(lq.device)
            h = self.hidden[a + start:a + start + c].to(lq.device)
            # the head in float32, as the FP pass ran it
            return kl_exact(torch.log_softmax(float32_logits(h, weight, bias), dim=-1), lq)
        return score


def reference_key(model_id: str, dataset: str, data: str, eval_settings: dict, precision: str) -> str:
    """What a reference depends on: the model's weights, the text, the windows, the precision."""
    blob = json.dumps({"model": model_id, "dataset": dataset, "data": data, "eval": eval_settings,
                       "precision": precision, "schema": SCHEMA}, sort_keys=True, default=str)
    return hashlib.sha256(blob.encode()).hexdigest()


def reference_path(key: str) -> Path:
    from bench.common.cache import cache_root
    return cache_root() / "kl-reference" / f"{key[:32]}.safetensors"


def head_path(head_key: str) -> Path:
    from bench.common.cache import cache_root
    return cache_root() / "kl-reference" / f"head-{head_key[:32]}.safetensors"


def _tensor_sha256(t: torch.Tensor) -> str:
    """SHA-256 of a tensor's bytes, any dtype (bf16 included)."""
    return hashlib.sha256(t.detach().contiguous().cpu().reshape(-1).view(torch.uint8).numpy().tobytes()).hexdigest()


STALE_TMP_S = 15 * 60   # a temporary of the reference folder older than this is a crashed writer's leftover


def clean_stale_temporaries(folder: Path, older_than_s: float = STALE_TMP_S) -> int:
    """Remove what writers killed mid-write left in the reference folder (atomic_write's `.<name>.*.tmp`,
    anything `.tmp*`): a kill -9 while the 113 MB head was written left it there forever. Only files older than
    any write takes (minutes), so a temporary another process is writing now is never touched."""
    import time
    removed = 0
    if not folder.is_dir():
        return 0
    now = time.time()
    for p in folder.iterdir():
        n = p.name
        if p.is_file() and n.startswith(".") and (n.endswith(".tmp") or n.startswith(".tmp")):
            try:
                if now - p.stat().st_mtime > older_than_s:
                    p.unlink()
                    removed += 1
            except OSError:
                pass
    return removed


def _head_key(weight: torch.Tensor, bias: torch.Tensor | None) -> str:
    h = hashlib.sha256(weight.detach().float().contiguous().cpu().numpy().tobytes())
    if bias is not None:
        h.update(bias.detach().float().contiguous().cpu().numpy().tobytes())
    return h.hexdigest()


@torch.no_grad()
def compute_reference(model: nn.Module, wins: list[torch.Tensor], precision=None, key: str = "") -> Reference:
    """The FP model's final hidden states at every predicted position of `wins` (what its output head reads,
    computed exactly as bench.evaluations.perplexity computes them, at `precision`: lrq.precision, None for the one in
    force) and its output head."""
    from bench.evaluations.perplexity import final_hidden
    from lrq import precision as P
    from lrq import progress
    device = next(model.parameters()).device
    store_dtype = torch.float32   # the head reads the body's output in float32 (schema 3; bf16 before)
    hidden, offsets = [], [0]
    with P.use(precision), P.autocast(device):
        for n, w in enumerate(wins):
            progress.update(f"FP reference window {n + 1}/{len(wins)}")
            h, _ = final_hidden(model, w)
            hidden.append(h.to(store_dtype).cpu())   # what the float32 head reads (lrq.precision.head_logits)
            offsets.append(offsets[-1] + len(w) - 1)
    head = model.get_output_embeddings()
    # the model's own head tensor where it is float32 on the CPU (no second copy: `attach_head` checks it is
    # unchanged before anything is scored with it), else a float32 CPU copy
    bias = None if getattr(head, "bias", None) is None else head.bias.detach().float().cpu()
    return Reference(torch.cat(hidden), head.weight.detach().float().cpu(), bias, offsets, key)


def save_reference(ref: Reference, path: Path) -> None:
    from safetensors.torch import save_file

    from lrq.io import atomic_write
    hkey = _head_key(ref.weight, ref.bias)
    hpath = head_path(hkey)
    if not _head_file_holds(hpath, hkey):   # on disk, whatever this process holds: the next process reads it
        tensors = {"weight": ref.weight.contiguous()} | ({} if ref.bias is None else {"bias": ref.bias.contiguous()})
        atomic_write(hpath, lambda p: save_file(tensors, str(p), metadata={"key": hkey}))
    held = _HEADS.setdefault(hkey, (ref.weight, ref.bias))   # the other texts' references share this copy
    ref.weight, ref.bias = held
    ref.head_key = hkey
    meta = {"offsets": json.dumps(ref.offsets), "key": ref.key, "head": hkey, "schema": str(SCHEMA),
            "hidden_sha256": _tensor_sha256(ref.hidden)}
    atomic_write(path, lambda p: save_file({"hidden": ref.hidden.contiguous()}, str(p), metadata=meta))


#: the heads this process holds, by key: every text's reference of one model shares one copy (Gemma 3's
#: 262,144 x 640 head is 671 MB in float32; a copy per text and per load held three)
_HEADS: dict[str, tuple[torch.Tensor, torch.Tensor | None]] = {}


def _head_file_holds(path: Path, hkey: str) -> bool:
    """Whether the head file at `path` is there and names key `hkey` (its contents are checked when loaded)."""
    from safetensors import safe_open
    try:
        with safe_open(str(path), framework="pt") as f:
            return (f.metadata() or {}).get("key") == hkey
    except Exception:  # noqa: BLE001 - absent or unreadable: written again
        return False


def _load_head(path: Path, hkey: str) -> tuple[torch.Tensor, torch.Tensor | None] | None:
    """The head of key `hkey`: the copy this process holds already (checked when it was loaded or computed),
    else read from its file and checked against its key; None when absent, of another key, unreadable or
    altered (then computed again)."""
    from safetensors import safe_open
    if hkey in _HEADS:
        return _HEADS[hkey]
    if not path.is_file():
        return None
    try:
        with safe_open(str(path), framework="pt") as f:
            if (f.metadata() or {}).get("key") != hkey:
                return None
            weight = f.get_tensor("weight")
            bias = f.get_tensor("bias") if "bias" in f.keys() else None
    except Exception:  # noqa: BLE001 - a damaged cache file is recomputed
        return None
    if _head_key(weight, bias) != hkey:
        return None
    _HEADS[hkey] = (weight, bias)
    return weight, bias


def load_reference(path: Path, key: str) -> Reference | None:
    """The stored reference, or None when absent, of another key, unreadable, or altered: its hidden states must
    match the SHA-256 their metadata records, as the head must match its key (then computed again; an altered
    reference would otherwise change every KLD stored for that model from then on, with exit 0)."""
    from safetensors import safe_open
    if not path.is_file():
        return None
    try:
        with safe_open(str(path), framework="pt") as f:
            meta = f.metadata() or {}
            if meta.get("key") != key or meta.get("schema") != str(SCHEMA):
                return None
            hidden, offsets, hkey = f.get_tensor("hidden"), json.loads(meta["offsets"]), meta["head"]
            digest = meta.get("hidden_sha256")
    except Exception:  # noqa: BLE001 - a damaged cache file is recomputed
        return None
    if not digest or _tensor_sha256(hidden) != digest:
        import logging
        logging.getLogger("lrq_bench").warning("the KL reference %s %s: it is computed again", path,
                                               "predates its integrity check" if not digest else
                                               "does not match its recorded SHA-256 (altered or damaged)")
        return None
    head = _load_head(head_path(hkey), hkey)
    if head is None or len(offsets) < 2 or offsets[-1] != hidden.shape[0]:
        return None
    return Reference(hidden, head[0], head[1], offsets, key, head_key=hkey)


def attach_head(refs, model: nn.Module) -> None:
    """Before scoring: every reference of `refs` reads the FP head it was computed with, checked, and the process
    keeps one copy of it. Where the model's own output head (the quantized model's: no method changes it) equals
    the reference's bit for bit, the references read the model's tensor and the process drops its other copy; the
    head scored with must match the SHA-256 the reference recorded (a head changed in memory since the reference
    was made, by anything, is read again from its checked file), so a stored KL is never computed from a wrong
    FP distribution."""
    head = model.get_output_embeddings()
    w = head.weight.detach()
    b = None if getattr(head, "bias", None) is None else head.bias.detach()
    checked: dict[int, bool] = {}

    def intact(weight, bias, hkey) -> bool:
        if id(weight) not in checked:
            checked[id(weight)] = _head_key(weight, bias) == hkey
        return checked[id(weight)]
    for ref in refs:
        if not ref.head_key:
            continue
        usable = w.dtype == torch.float32 and w.device.type == "cpu" and w.shape == ref.weight.shape \
            and (b is None) == (ref.bias is None) and (b is None or b.dtype == torch.float32)
        if usable and ref.weight is not w and torch.equal(ref.weight, w) and (b is None or torch.equal(ref.bias, b)) \
                and intact(ref.weight, ref.bias, ref.head_key):
            ref.weight, ref.bias = w, b
            _HEADS[ref.head_key] = (w, b)    # the copy read from the file is freed with its last reference
            checked[id(w)] = True
        if not intact(ref.weight, ref.bias, ref.head_key):
            _HEADS.pop(ref.head_key, None)
            again = _load_head(head_path(ref.head_key), ref.head_key)
            if again is None:
                raise RuntimeError(f"the FP output head of KL reference {ref.key[:16]} changed in memory after the "
                                   f"reference was made and its file {head_path(ref.head_key)} is gone or altered: "
                                   f"no KL is scored (rerun: the reference is computed again)")
            ref.weight, ref.bias = again


def ensure_reference(model: nn.Module, wins: list[torch.Tensor], key: str, precision=None) -> Reference:
    """The reference for `key`: loaded from the cache, else computed from `model` (the unquantized model) and
    stored. A file lock makes parallel workers compute it once."""
    from lrq.io import file_lock
    path = reference_path(key)
    clean_stale_temporaries(path.parent)
    ref = load_reference(path, key)
    if ref is not None:
        return ref
    with file_lock(path):
        ref = load_reference(path, key)   # another worker may have finished it meanwhile
        if ref is None:
            ref = compute_reference(model, wins, precision, key)
            save_reference(ref, path)
    return ref


def summary(token_kl: torch.Tensor, token_top1: torch.Tensor, top1_ties: int | None = None) -> dict[str, float]:
    """The stored KL metrics of one text: mean, median and 99th percentile KL over positions, top-1 agreement
    and (where counted) the positions where either model's top token was an exact tie."""
    from bench.evaluations.evals import KL_METRICS, METRICS
    kl = token_kl.double()
    out = {m: float(METRICS[m].from_positions(kl, token_top1)) for m in KL_METRICS}
    return out | ({} if top1_ties is None else {"top1_ties": float(top1_ties)})
