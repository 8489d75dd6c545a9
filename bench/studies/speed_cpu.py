"""End-to-end CPU speed of every packed format beside the dense model, measured honestly on a shared machine.

    python -m bench.studies.speed e2e [--schemes w4a16-g128,w4a8,w8a8,w3a16] [--threads 1] [--rounds 5]
                                      [--precision auto] [--out reports/speed-cpu]

Every candidate lives in one process and is measured in the same rounds, in a rotating order (round r starts at
candidate r), so that whatever else the machine does falls on all of them alike; each figure is the median over
rounds, with the spread (min-max) beside it, and CPU time beside wall time (a wall time far above the CPU time
says the process waited for the cores). Candidates:

- the dense model held in bf16 and in float32 (eager): the ratios are taken against the faster of the two per
  measure (bf16 on a CPU with native bf16, float32 where torch emulates bf16), never against a slow baseline;
- each scheme's RTN-quantized, packed model (`lrq.packed.pack_model`), its other parts held in the precision
  `--precision auto` picks on this CPU.

Measures: decode, ms per generated token after a 16-token prompt (the prompt excluded; greedy, KV cache, only the
last position's logits computed); prefill, tokens/s of one forward of `--prefill` tokens computing the last
position's logits only; weight memory, the resident memory the model added to the process when it was built
(measured with the allocator's free memory returned to the system, not summed from buffers).
"""

from __future__ import annotations

import ctypes
import gc
import statistics
import time
from dataclasses import dataclass, field

import torch
from torch import nn

DEFAULT_SCHEMES = ("w4a16-g128", "w4a16", "w4a8", "w8a8", "w3a16")


@dataclass
class Candidate:
    name: str
    model: nn.Module
    kind: str                      # "dense" or "packed"
    dtype: str                     # what its activations and unquantized parts compute in
    weight_rss_bytes: int
    decode_ms: list[float] = field(default_factory=list)
    decode_cpu_ms: list[float] = field(default_factory=list)
    prefill_tok_s: list[float] = field(default_factory=list)
    prefill_cpu_s: list[float] = field(default_factory=list)


def _rss() -> int:
    """The process's resident memory now, after returning the allocator's free memory to the system."""
    import psutil
    gc.collect()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):   # not glibc: what the allocator keeps stays counted
        pass
    return psutil.Process().memory_info().rss


def build(model_name: str, schemes, dtype: torch.dtype, data_dir: str | None) -> list[Candidate]:
    """The dense model in bf16 and float32, and each scheme's packed model held in `dtype`, each with the resident
    memory its building left in the process."""
    from bench.common.models import load_model
    from bench.evaluations import data as D
    from lrq.methods import get_method, load_methods
    from lrq.packed import pack_model
    from lrq.schemes import get_scheme
    load_methods()
    # one throwaway build first: what the first load and calibration leave for good (imported code, cached texts,
    # the tokenizer) must not be counted as the first candidate's weights
    loaded = load_model(model_name)
    if any(get_method("rtn").needs_calibration(get_scheme(s)) for s in schemes):
        D.calibration_set(loaded.tokenizer, D.resolve_data_dir(data_dir), "c4", 16, 512)
    del loaded
    out = []
    for name in ("dense bf16", "dense fp32", *schemes):
        before = _rss()
        loaded = load_model(model_name)
        model, tok = loaded.model.eval(), loaded.tokenizer
        calib = None
        if name.startswith("dense"):
            held = torch.bfloat16 if name.endswith("bf16") else torch.float32
            model.to(held)
        else:
            held = dtype
            model.to(held)
            scheme, rtn = get_scheme(name), get_method("rtn")
            calib = (D.calibration_set(tok, D.resolve_data_dir(data_dir), "c4", 16, 512)
                     if rtn.needs_calibration(scheme) else None)
            rtn.quantize(model, scheme, rtn.config("quick"), calib)
            pack_model(model)
        del loaded, calib
        _warm(model)   # what a format converts or caches at its first forward is part of what it holds
        out.append(Candidate(name, model, "dense" if name.startswith("dense") else "packed",
                             str(held).replace("torch.", ""), _rss() - before))
    return out


def _warm(model: nn.Module) -> None:
    ids = torch.arange(16).unsqueeze(0) % model.config.vocab_size
    decode(model, ids, 2)
    prefill(model, torch.arange(64).unsqueeze(0) % model.config.vocab_size)


@torch.no_grad()
def decode(model: nn.Module, prompt: torch.Tensor, steps: int) -> tuple[float, float]:
    """(wall, CPU) ms per greedy token after `prompt` (the prompt's own forward not timed)."""
    out = model(prompt, use_cache=True, logits_to_keep=1)
    cache, nxt = out.cache, out.logits[:, -1:].argmax(-1)
    t0, c0 = time.perf_counter(), time.process_time()
    for _ in range(steps):
        out = model(nxt, cache=cache, use_cache=True, logits_to_keep=1)
        cache, nxt = out.cache, out.logits[:, -1:].argmax(-1)
    return 1e3 * (time.perf_counter() - t0) / steps, 1e3 * (time.process_time() - c0) / steps


@torch.no_grad()
def prefill(model: nn.Module, ids: torch.Tensor) -> tuple[float, float]:
    """(tokens/s wall, CPU seconds) of one forward of `ids`, the last position's logits only."""
    t0, c0 = time.perf_counter(), time.process_time()
    model(ids, use_cache=False, logits_to_keep=1)
    return ids.shape[1] / (time.perf_counter() - t0), time.process_time() - c0


def measure(cands: list[Candidate], rounds: int, prefill_len: int, decode_steps: int) -> None:
    """`rounds` rounds over every candidate in a rotating order; each round one decode and one prefill each."""
    gen = torch.Generator().manual_seed(0)
    vocab = cands[0].model.config.vocab_size
    ids = torch.randint(min(100, vocab // 2), min(1000, vocab), (1, prefill_len), generator=gen)
    n = len(cands)
    for r in range(rounds):
        for c in cands[r % n:] + cands[:r % n]:
            wall, cpu = decode(c.model, ids[:, :16], decode_steps)
            c.decode_ms.append(wall)
            c.decode_cpu_ms.append(cpu)
            tok_s, cpu_s = prefill(c.model, ids)
            c.prefill_tok_s.append(tok_s)
            c.prefill_cpu_s.append(cpu_s)
        print(f"round {r + 1}/{rounds}: " + ", ".join(f"{c.name} {c.decode_ms[-1]:.1f} ms" for c in cands), flush=True)


def rows(cands: list[Candidate]) -> list[dict]:
    """One row per candidate: medians, spreads and the ratios against the faster dense model per measure."""
    med = statistics.median
    dense = [c for c in cands if c.kind == "dense"]
    best_decode = min(dense, key=lambda c: med(c.decode_ms))
    best_prefill = max(dense, key=lambda c: med(c.prefill_tok_s))
    best_memory = next(c for c in dense if c.dtype == "bfloat16")
    out = []
    for c in cands:
        out.append({"candidate": c.name, "kind": c.kind, "dtype": c.dtype,
                    "decode_ms": med(c.decode_ms), "decode_ms_range": [min(c.decode_ms), max(c.decode_ms)],
                    "decode_cpu_ms": med(c.decode_cpu_ms),
                    "prefill_tok_s": med(c.prefill_tok_s), "prefill_tok_s_range": [min(c.prefill_tok_s),
                                                                                   max(c.prefill_tok_s)],
                    "prefill_cpu_s": med(c.prefill_cpu_s), "weight_rss_bytes": c.weight_rss_bytes,
                    "decode_vs_dense": med(best_decode.decode_ms) / med(c.decode_ms),
                    "prefill_vs_dense": med(c.prefill_tok_s) / med(best_prefill.prefill_tok_s),
                    "memory_vs_dense_bf16": c.weight_rss_bytes / max(best_memory.weight_rss_bytes, 1),
                    "dense_reference": {"decode": best_decode.name, "prefill": best_prefill.name}})
    return out


def run(model_name: str, schemes, precision: str, threads: int, rounds: int, prefill_len: int, decode_steps: int,
        data_dir: str | None) -> dict:
    from bench.common.provenance import cpu_label, git_revision, hardware, versions
    from lrq.precision import Precision
    torch.set_num_threads(threads)
    decided = Precision.decide(precision, "cpu")
    dtype = torch.bfloat16 if decided.used == "bf16" else torch.float32
    cands = build(model_name, schemes, dtype, data_dir)
    measure(cands, rounds, prefill_len, decode_steps)
    hw = hardware()
    return {"what": "e2e-cpu", "model": model_name, "threads": threads, "rounds": rounds, "prefill": prefill_len,
            "decode_steps": decode_steps, "precision": decided.info(), "machine": cpu_label(hw),
            "hardware": hw, "versions": versions(), "git_rev": git_revision(), "rows": rows(cands)}


def markdown(doc: dict) -> str:
    from tabulate import tabulate
    body = [[r["candidate"], r["dtype"], f"{r['decode_ms']:.1f} ({r['decode_ms_range'][0]:.1f}-"
             f"{r['decode_ms_range'][1]:.1f})", f"{r['decode_cpu_ms']:.1f}",
             f"{r['prefill_tok_s']:.0f} ({r['prefill_tok_s_range'][0]:.0f}-{r['prefill_tok_s_range'][1]:.0f})",
             f"{r['weight_rss_bytes'] / 2**20:.0f}", f"{r['decode_vs_dense']:.2f}x", f"{r['prefill_vs_dense']:.2f}x",
             f"{r['memory_vs_dense_bf16']:.2f}x"] for r in doc["rows"]]
    ref = doc["rows"][0]["dense_reference"]
    return "\n".join([
        f"# CPU speed, {doc['model']}, batch 1, {doc['threads']} thread(s)", "",
        f"Machine: {doc['machine']} (flags {', '.join(doc['hardware'].get('cpu_bf16_flags') or []) or 'no bf16'}); "
        f"torch {doc['versions'].get('torch')}; revision {doc['git_rev'][:12]}; packed models held in "
        f"{doc['precision']['used']} ({doc['precision']['why']}).", "",
        f"Every candidate in one process, {doc['rounds']} rounds in a rotating order; medians over rounds (min-max). "
        f"Decode: ms per greedy token after a 16-token prompt ({doc['decode_steps']} tokens a round, the prompt not "
        f"timed, the last position's logits only). Prefill: tokens/s of one {doc['prefill']}-token forward, the "
        f"last position's logits only. Weight memory: the resident memory each model added when it was built. "
        f"Ratios against the faster dense model per measure (decode: {ref['decode']}; prefill: {ref['prefill']}); "
        f"memory against dense bf16.", "",
        tabulate(body, headers=["candidate", "held in", "decode ms/token", "decode CPU ms", "prefill tok/s",
                                "weight MiB", "decode vs dense", "prefill vs dense", "memory vs bf16"],
                 tablefmt="github", disable_numparse=True), ""])


def svg(doc: dict, width: int = 560, bar: int = 22) -> str:
    """A horizontal bar chart of decode ms/token by candidate (lower is faster), the machine in its title."""
    import html
    rows_ = doc["rows"]
    top = max(r["decode_ms"] for r in rows_) or 1.0
    left, height = 150, 40 + bar * len(rows_)
    parts = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" font-family="sans-serif" '
             f'font-size="12"><text x="8" y="18">decode ms/token, {html.escape(doc["model"])}, '
             f'{html.escape(doc["machine"])}, {doc["threads"]} thread(s)</text>']
    for i, r in enumerate(rows_):
        y = 30 + i * bar
        w = (width - left - 70) * r["decode_ms"] / top
        colour = "#888" if r["kind"] == "dense" else "#3b7dd8"
        parts += [f'<text x="8" y="{y + 15}">{html.escape(r["candidate"])}</text>',
                  f'<rect x="{left}" y="{y + 3}" width="{w:.1f}" height="{bar - 6}" fill="{colour}"/>',
                  f'<text x="{left + w + 4:.1f}" y="{y + 15}">{r["decode_ms"]:.1f}</text>']
    return "\n".join(parts + ["</svg>"]) + "\n"
