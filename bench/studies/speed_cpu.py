"""End-to-end CPU speed of every packed format beside the dense model, measured honestly on a shared machine.

    python -m bench.studies.speed e2e [--schemes w4a16-g128,w4a8,w8a8,w3a16] [--threads 1] [--rounds 5]
                                      [--precision auto] [--out reports/speed-cpu]

Every candidate lives in one process and is measured in the same rounds, in a rotating order (round r starts at
candidate r), so that whatever else the machine does falls on all of them alike; each figure is the median over
rounds, with the spread (min-max) beside it, and CPU time beside wall time (a wall time far above the CPU time
says the process waited for the cores). Candidates:

- the dense model held in bf16 and in float32 (eager): the ratios are taken against the faster of the two per
  measure (bf16 on a CPU with native bf16, float32 where torch emulates bf16), never against a slow baseline;
  and the same dense models through the other paths torch offers (`[no oneDNN]`, `[torch linears]`,
  `[oneDNN prepacked]`: the body's linears in oneDNN's own layout), the fastest dense per measure the reference;
- each scheme's RTN-quantized, packed model (`lrq.packed.pack_model`), its other parts held in the precision
  `--precision auto` picks on this CPU.

Measures: decode, ms per generated token after a 16-token prompt (the prompt excluded; greedy, KV cache, only the
last position's logits computed); prefill, tokens/s of one forward of `--prefill` tokens computing the last
position's logits only; weight memory, the resident memory the model added to the process when it was built
(measured with the allocator's free memory returned to the system, not summed from buffers).

Anchors (bench.studies.anchors): where llama-cpp-python is installed (or `--anchors llama.cpp` asks for it), the
GGUF the model comes from, run by llama.cpp as Q4_1 (as shipped), Q8_0 and BF16, joins the same rounds; their
weight memory is the resident memory the loaded GGUF added (its weights mapped and touched, plus llama.cpp's KV
cache and compute buffers), with the file's size beside it. With anchors, the w4a16-g128 model's decode is also
profiled (`profile_decode`: where its time goes; the first packed scheme where w4a16-g128 is not measured); when
its bf16 output head costs at least as much as all its quantized linears together, or --int8-head asks, a copy with
an int8 head (lrq.packed.quantize_head: 8-bit levels per output channel, the tied embedding reading the same levels;
the Q4_1 GGUF holds its tied table as Q8_0) is measured as an extra candidate; the defaults do not change.
"""

from __future__ import annotations

import ctypes
import gc
import statistics
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import nn

from bench.common.provenance import short_revision
from lrq.cpu_kernels import OneDNNOperand, onednn
from lrq.errors import UserError

DEFAULT_SCHEMES = ("w4a16-g128", "w4a16", "w4a8", "w8a8", "w3a16")


HEAD_INT8 = " +int8 head"        # the suffix of a packed candidate whose output head lrq.packed.quantize_head packed
HEAD_BF16 = " +bf16 table"       # ... whose float32 table quantize_head holds in bf16 (lossless: --bf16-table)
HEAD_SUFFIXES = {HEAD_INT8: "int8", HEAD_BF16: "bf16"}


def _scheme_and_head(name: str) -> tuple[str, str | None]:
    """A packed candidate's scheme and its quantize_head format (None: the model's own head)."""
    for suffix, fmt in HEAD_SUFFIXES.items():
        if name.endswith(suffix):
            return name.removesuffix(suffix), fmt
    return name, None


PROFILE_GROUPS = ("quantized linears", "output head", "attention/SDPA, RoPE, norms and other ops",
                  "framework/Python overhead", "fused decoder layers (lrq.native)")


@dataclass
class Candidate:
    name: str
    model: nn.Module | None        # None for an anchor (its runner times it)
    kind: str                      # "dense", "packed" or "anchor"
    dtype: str                     # what its activations and unquantized parts compute in
    weight_rss_bytes: int
    runner: object = None          # an anchor's runner (decode/prefill like this module's functions)
    lean: object = None            # the LeanDecoder (lrq.runtime) it runs through, or None: its own forward
    info: dict = field(default_factory=dict)
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


def build(model_name: str, schemes, dtype: torch.dtype, data_dir: str | None, dense: bool = True) -> list[Candidate]:
    """The dense model in bf16 and float32, and each scheme's packed model held in `dtype`, each with the resident
    memory its building left in the process. A scheme named `<scheme> +int8 head` is that scheme's packed model
    with its output head (and tied embedding) packed by lrq.packed.quantize_head. `dense=False`: the schemes only
    (after a first build)."""
    from bench.common.models import load_model
    from bench.evaluations import data as D
    from lrq.methods import get_method, load_methods
    from lrq.packed import pack_model, quantize_head
    from lrq.schemes import get_scheme
    load_methods()
    # one throwaway build first: what the first load and calibration leave for good (imported code, cached texts,
    # the tokenizer) must not be counted as the first candidate's weights
    loaded = load_model(model_name) if dense else None
    if dense and any(get_method("rtn").needs_calibration(get_scheme(_scheme_and_head(s)[0])) for s in schemes):
        D.calibration_set(loaded.tokenizer, D.resolve_data_dir(data_dir), "c4", 16, 512)
    del loaded
    out = []
    for name in (("dense bf16", "dense fp32") if dense else ()) + tuple(schemes):
        before = _rss()
        loaded = load_model(model_name)
        model, tok = loaded.model.eval(), loaded.tokenizer
        calib, held_head = None, None
        if name.startswith("dense"):
            held = torch.bfloat16 if name.endswith("bf16") else torch.float32
            model.to(held)
        else:
            held = dtype
            model.to(held)
            (scheme_name, head_format), rtn = _scheme_and_head(name), get_method("rtn")
            scheme = get_scheme(scheme_name)
            calib = (D.calibration_set(tok, D.resolve_data_dir(data_dir), "c4", 16, 512)
                     if rtn.needs_calibration(scheme) else None)
            rtn.quantize(model, scheme, rtn.config("quick"), calib)
            pack_model(model)
            if head_format:
                held_head = quantize_head(model, head_format)
        del loaded, calib
        _own_memory(model)
        _warm(model)   # what a format converts or caches at its first forward is part of what it holds
        out.append(Candidate(name, model, "dense" if name.startswith("dense") else "packed",
                             str(held).replace("torch.", ""), _rss() - before))
        if held_head and "values_rounded" in held_head:
            out[-1].info["head_values_rounded"] = held_head["values_rounded"]
    return out


@torch.no_grad()
def _own_memory(model: nn.Module) -> None:
    """Every parameter and buffer copied into memory of its own. A model held in the checkpoint's own dtype keeps
    tensors that view the memory-mapped file (safetensors), and one of them alive (the embedding of a packed model)
    keeps every page of the file read so far resident: a float32 packed model measured 480 MiB more than it holds
    (the linears' float weights, read once by the quantizer). A copy is what a deployment holds."""
    for t in list(model.parameters()) + list(model.buffers()):
        t.data = t.data.clone()


def _warm(model: nn.Module) -> None:
    ids = torch.arange(16).unsqueeze(0) % model.config.vocab_size
    decode(model, ids, 2)
    prefill(model, torch.arange(64).unsqueeze(0) % model.config.vocab_size)


def _stepper(target):
    """(first, next): the logits of the last position after a prompt (from an empty cache) and after one more
    token, through the model's own forward (a fresh cache) or a `LeanDecoder` (its cache reset)."""
    from lrq.runtime import LeanDecoder
    if isinstance(target, LeanDecoder):
        def first(prompt):
            target.reset()
            return target.forward(prompt)
        return first, target.forward
    state = {}

    def step(ids, **kw):
        out = target(ids, use_cache=True, logits_to_keep=1, **kw)
        state["cache"] = out.cache
        return out.logits
    return step, lambda ids: step(ids, cache=state["cache"])


@torch.no_grad()
def decode(target, prompt: torch.Tensor, steps: int) -> tuple[float, float]:
    """(wall, CPU) ms per greedy token after `prompt` (the prompt's own forward not timed); `target` is a model
    (its own forward) or a LeanDecoder; each token chosen by lrq.runtime.greedy_tokens (lrq.native's argmax where it
    runs, the same for every candidate)."""
    from lrq.runtime import greedy_tokens
    first, step = _stepper(target)
    nxt = greedy_tokens(first(prompt))
    t0, c0 = time.perf_counter(), time.process_time()
    for _ in range(steps):
        nxt = greedy_tokens(step(nxt))
    return 1e3 * (time.perf_counter() - t0) / steps, 1e3 * (time.process_time() - c0) / steps


@torch.no_grad()
def prefill(target, ids: torch.Tensor) -> tuple[float, float]:
    """(tokens/s wall, CPU seconds) of one forward of `ids`, the last position's logits only."""
    t0, c0 = time.perf_counter(), time.process_time()
    if isinstance(target, nn.Module):
        target(ids, use_cache=False, logits_to_keep=1)
    else:
        _stepper(target)[0](ids)
    return ids.shape[1] / (time.perf_counter() - t0), time.process_time() - c0


NO_ONEDNN = " [no oneDNN]"   # the dense bf16 model with torch.backends.mkldnn off: torch's own bf16 kernels


READ_PROBE_BYTES = 256 << 20   # the plain read timed once a round: larger than any CPU's last-level cache here


def read_gbs(probe: torch.Tensor) -> float:
    """GB/s of one plain pass over `probe` (int64, torch's vectorized sum: a core's streaming read, within a few % of
    a hand-written AVX-512 loop on a Zen 4). A decode step mostly streams weights, so its ms/token move with this."""
    t0 = time.perf_counter()
    probe.sum()
    return probe.numel() * probe.element_size() / (time.perf_counter() - t0) / 1e9


def measure(cands: list[Candidate], rounds: int, prefill_len: int, decode_steps: int) -> list[float]:
    """`rounds` rounds over every candidate in a rotating order; each round one decode and one prefill each, and one
    plain read of READ_PROBE_BYTES (read_gbs) after it. Returns the rounds' read GB/s."""
    gen = torch.Generator().manual_seed(0)
    vocab = cands[0].model.config.vocab_size
    ids = torch.randint(min(100, vocab // 2), min(1000, vocab), (1, prefill_len), generator=gen)
    n = len(cands)
    listed = ids[0].tolist()
    from lrq.packed import set_float32_decode
    probe, reads = torch.ones(READ_PROBE_BYTES // 8, dtype=torch.int64), []
    for r in range(rounds):
        for c in cands[r % n:] + cands[:r % n]:
            if c.kind == "packed" and "float32_decode" in c.info:   # a model measured in several modes: its own
                set_float32_decode(c.model, c.info["float32_decode"])
            with onednn(c.info.get("onednn", True)):
                if c.runner is not None:   # an anchor: the same tokens, timed the same way by its runner
                    wall, cpu = c.runner.decode(listed[:16], decode_steps)
                else:
                    wall, cpu = decode(c.lean or c.model, ids[:, :16], decode_steps)
                c.decode_ms.append(wall)
                c.decode_cpu_ms.append(cpu)
                tok_s, cpu_s = c.runner.prefill(listed) if c.runner is not None else prefill(c.lean or c.model, ids)
            c.prefill_tok_s.append(tok_s)
            c.prefill_cpu_s.append(cpu_s)
        reads.append(read_gbs(probe))
        print(f"round {r + 1}/{rounds}: " + ", ".join(f"{c.name} {c.decode_ms[-1]:.1f} ms" for c in cands) +
              f"; a plain read {reads[-1]:.1f} GB/s", flush=True)
    return reads


def paired_ratios(ref: list[float], ours: list[float]) -> list[float]:
    """Round by round, ref / ours (the candidate's speed-up where both are times, its ratio where both are rates):
    each round's candidate against the reference measured in the same round, seconds apart, so that the memory's
    speed moving between rounds (11-25 GB/s on a shared Zen 4) moves both."""
    if len(ref) != len(ours):
        raise ValueError(f"{len(ours)} rounds against the reference's {len(ref)}: ratios pair rounds")
    return [a / b for a, b in zip(ref, ours)]


def rows(cands: list[Candidate]) -> list[dict]:
    """One row per candidate: medians, spreads and the ratios against the faster dense model per measure (the median of
    the rounds' own ratios, paired_ratios, and their range)."""
    med = statistics.median
    dense = [c for c in cands if c.kind == "dense"]
    best_decode = min(dense, key=lambda c: med(c.decode_ms))
    best_prefill = max(dense, key=lambda c: med(c.prefill_tok_s))
    best_memory = next(c for c in dense if c.dtype == "bfloat16")
    out = []
    for c in cands:
        decode = paired_ratios(best_decode.decode_ms, c.decode_ms)
        prefill = paired_ratios(c.prefill_tok_s, best_prefill.prefill_tok_s)
        out.append({"candidate": c.name, "kind": c.kind, "dtype": c.dtype,
                    "decode_ms": med(c.decode_ms), "decode_ms_range": [min(c.decode_ms), max(c.decode_ms)],
                    "decode_ms_rounds": list(c.decode_ms), "prefill_tok_s_rounds": list(c.prefill_tok_s),
                    "decode_cpu_ms": med(c.decode_cpu_ms),
                    "prefill_tok_s": med(c.prefill_tok_s), "prefill_tok_s_range": [min(c.prefill_tok_s),
                                                                                   max(c.prefill_tok_s)],
                    "prefill_cpu_s": med(c.prefill_cpu_s), "weight_rss_bytes": c.weight_rss_bytes,
                    "decode_vs_dense": med(decode), "decode_vs_dense_range": [min(decode), max(decode)],
                    "prefill_vs_dense": med(prefill), "prefill_vs_dense_range": [min(prefill), max(prefill)],
                    "memory_vs_dense_bf16": c.weight_rss_bytes / max(best_memory.weight_rss_bytes, 1),
                    "dense_reference": {"decode": best_decode.name, "prefill": best_prefill.name}, **c.info})
    return out


@torch.no_grad()
def profile_decode(target, prompt: torch.Tensor, steps: int = 8) -> dict:
    """Where `steps` greedy decode steps after `prompt` spend their time, under torch.profiler: the quantized
    linears (PackedLinear modules) and the output head are each the wall time of their module's calls (a labelled
    range: aten ops and lrq.native's C kernels alike, which are no aten ops); every other top-level aten op (one
    inside no aten op and no labelled module) goes to attention/SDPA, RoPE, norms and other ops, and so do the lean
    runtime's lrq.native norm and attention calls (labelled by it); a decoder layer the lean runtime runs as one
    lrq.native call (its linears, norms and attention together) is a group of its own, and its C head call counts as
    the output head; the wall time left is framework/Python overhead. ms per token, and shares; the profiler adds
    its own cost to every op (most of it lands in the overhead), so the same steps are also timed without it first
    (`unprofiled_ms_per_token`). `target`: a model (its own forward) or a LeanDecoder."""
    from lrq.runtime import greedy_tokens
    from torch.autograd.profiler import record_function
    from torch.profiler import ProfilerActivity, profile
    from lrq.packed import PackedLinear
    model = target if isinstance(target, nn.Module) else target.model
    stack, handles = [], []

    def label(module: nn.Module, group: str) -> None:
        def enter(_m, _args):
            rf = record_function(f"lrq.group::{group}")
            rf.__enter__()
            stack.append(rf)

        def leave(_m, _args, _out):
            stack.pop().__exit__(None, None, None)
        handles.extend([module.register_forward_pre_hook(enter), module.register_forward_hook(leave)])

    head = model.get_output_embeddings()
    for m in model.modules():
        if isinstance(m, PackedLinear) and m is not head:   # a head quantize_head packed is still the head
            label(m, PROFILE_GROUPS[0])
    label(head, PROFILE_GROUPS[1])
    try:
        plain_ms, _ = decode(target, prompt, steps)
        first, step = _stepper(target)
        nxt = greedy_tokens(first(prompt))
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            t0 = time.perf_counter()
            for _ in range(steps):
                nxt = greedy_tokens(step(nxt))
            wall_us = 1e6 * (time.perf_counter() - t0)
    finally:
        for h in handles:
            h.remove()
    us = dict.fromkeys(PROFILE_GROUPS[:3] + PROFILE_GROUPS[4:], 0.0)
    for e in prof.events():
        labelled = e.name.startswith(("lrq.group::", "lrq.native::"))
        if not (labelled or e.name.startswith("aten::")):
            continue
        p = e.cpu_parent
        while p is not None and not p.name.startswith(("aten::", "lrq.group::", "lrq.native::")):
            p = p.cpu_parent
        if p is not None:   # inside a labelled range or another aten op: counted there
            continue
        group = (e.name.split("::", 1)[1] if e.name.startswith("lrq.group::") else
                 PROFILE_GROUPS[4] if e.name == "lrq.native::decoder_layer" else
                 PROFILE_GROUPS[1] if e.name == "lrq.native::head" else PROFILE_GROUPS[2])
        us[group] += e.time_range.elapsed_us()
    us[PROFILE_GROUPS[3]] = max(wall_us - sum(us.values()), 0.0)
    return {"steps": steps, "wall_ms_per_token": wall_us / 1e3 / steps, "unprofiled_ms_per_token": plain_ms,
            "groups": [{"group": g, "ms_per_token": us[g] / 1e3 / steps, "share": us[g] / wall_us}
                       for g in PROFILE_GROUPS]}


def head_dominates(profile: dict) -> bool:
    """The output head costs at least as much as all the quantized linears together (where the lean runtime fuses
    whole decoder layers, as all those layers together: an upper bound of their linears)."""
    ms = {g["group"]: g["ms_per_token"] for g in profile["groups"]}
    return ms[PROFILE_GROUPS[1]] >= ms[PROFILE_GROUPS[0]] + ms.get(PROFILE_GROUPS[4], 0.0)


def probe_anchors(model_name: str, anchors: list[str], threads: int, n_ctx: int) -> None:
    """Each llama.cpp GGUF evaluated once in a child process (bench.studies.anchors.probe): a llama.cpp that
    crashes on this CPU is an error before the study builds anything, not a signal that ends it later."""
    if "llama.cpp" in anchors:
        from bench.studies import anchors as A
        A.probe([f["path"] for f in A.gguf_files(A.source_gguf(model_name)).values()], threads, n_ctx)


def build_anchors(model_name: str, anchors: list[str], threads: int, n_ctx: int) -> tuple[list[Candidate], dict]:
    """llama.cpp's candidates (Q4_1, Q8_0, BF16 of the model's GGUF), each warmed, with the resident memory it
    added; and what the report names about them (version, files and their SHA-256)."""
    if "llama.cpp" not in anchors:
        return [], {}
    from bench.studies import anchors as A
    files = A.gguf_files(A.source_gguf(model_name))
    cands = []
    for kind in A.LLAMA_CPP_TYPES:
        f = files[kind]
        before = _rss()
        runner = A.LlamaCppRunner(f["path"], threads, n_ctx)
        runner.decode(list(range(16)), 2)
        runner.prefill(list(range(64)))
        cands.append(Candidate(f"llama.cpp {kind}", None, "anchor", kind, _rss() - before, runner=runner,
                               info={"gguf": Path(f["path"]).name, "gguf_sha256": f["sha256"],
                                     "gguf_bytes": f["bytes"]}))
    return cands, {"llama.cpp": {**A.version(), "n_threads": threads, "n_batch": n_ctx, "flash_attn": False,
                                 "files": {k: {**v, "path": Path(v["path"]).name} for k, v in files.items()}}}


RUNTIMES = ("auto", "lean", "hf", "both")


def _set_float32_decode(cands: list[Candidate], mode: str) -> None:
    """--fp32-decode: how the packed models' 4-bit layers run a float32 decode step (lrq.packed.set_float32_decode),
    recorded in each packed row."""
    from lrq.packed import set_float32_decode
    for c in cands:
        if c.kind == "packed":
            set_float32_decode(c.model, mode)
            c.info["float32_decode"] = mode


def _float32_decode_modes(spec: str) -> list[str]:
    """--fp32-decode's comma-separated modes (the first the packed rows', each further one a copy of every packed row
    in that mode), checked against lrq.cpu_kernels.FLOAT32_DECODE."""
    from lrq.cpu_kernels import FLOAT32_DECODE
    modes = [m.strip() for m in spec.split(",") if m.strip()]
    bad = [m for m in modes if m not in FLOAT32_DECODE]
    if not modes or bad or len(set(modes)) < len(modes):
        raise UserError(f"--fp32-decode {spec!r}: give one or more of {', '.join(FLOAT32_DECODE)}, comma-separated, "
                        f"each once (e.g. exact,i16)")
    return modes


def _mode_copies(cands: list[Candidate], modes: list[str]) -> list[Candidate]:
    """For each further float32 decode mode, a copy of every packed candidate on the same model (named
    `<name> [<mode>]`; measure switches the model's mode before each one's calls, so they interleave with the
    others; their rows are not stored to a results store)."""
    return [Candidate(f"{c.name} [{mode}]", c.model, c.kind, c.dtype, c.weight_rss_bytes, lean=c.lean,
                      info={**c.info, "float32_decode": mode, "mode_copy_of": c.name})
            for mode in modes for c in cands if c.kind == "packed"]


PROFILE_STEPS = 8           # decode steps profile_decode times (with anchors)
HF_SUFFIX = " [hf eager]"   # a candidate run through the model's own forward where --runtime both asks for both


def _without_onednn(cands: list[Candidate]) -> list[Candidate]:
    """The dense bf16 model again, run with oneDNN off (torch.backends.mkldnn.enabled = False for its calls): on a
    Zen 4 torch's own bf16 matrix-vector product decodes SmolLM2-135M 1.7x faster than oneDNN's (27 against 47 ms a
    token) while its prefill is 7x slower, so the dense reference per measure is the better of the two (issue W:
    the dense baseline is fair too). Same weights, same memory; its rows say onednn false."""
    out = []
    for c in cands:
        if c.kind == "dense" and c.dtype == "bfloat16" and not c.name.endswith(HF_SUFFIX):
            lean = c.lean if c.lean is None else type(c.lean)(c.model, c.lean.max_len)
            out.append(Candidate(c.name + NO_ONEDNN, c.model, "dense", c.dtype, c.weight_rss_bytes, lean=lean,
                                 info={**c.info, "onednn": False}))
    return out


TORCH_LINEARS = " [torch linears]"   # the dense model's lean decode with its modules (torch's GEMV), not fused


def _torch_linears(cands: list[Candidate]) -> list[Candidate]:
    """The dense models again (bf16 and float32) through the lean runtime with its decoder layers not fused
    (LeanDecoder.fused = False): one-token steps call the model's modules, i.e. torch's own matrix-vector kernels,
    beside lrq.native's norms and attention. The fused path runs the dense weights through lrq's own bf16/float32
    GEMV in one C call a layer; both are measured and the dense reference per measure is the faster (issue W: the
    dense baseline is fair too). Same weights, same memory; its rows say fused false."""
    out = []
    for c in cands:
        if c.kind == "dense" and c.lean is not None and not c.name.endswith((HF_SUFFIX, NO_ONEDNN)):
            lean = type(c.lean)(c.model, c.lean.max_len)
            lean.fused = False
            decode(lean, torch.arange(16).unsqueeze(0) % c.model.config.vocab_size, 2)
            out.append(Candidate(c.name + TORCH_LINEARS, c.model, "dense", c.dtype, c.weight_rss_bytes, lean=lean,
                                 info={**c.info, "fused": False}))
    return out


PREPACKED = " [oneDNN prepacked]"   # the dense model's body linears held in oneDNN's own layout


class PrepackedLinear(nn.Module):
    """A dense nn.Linear whose weight oneDNN holds in its own blocked layout, made once
    (`torch.ops.mkldnn._reorder_linear_weight`, for `batch` rows; the plain weight dropped: one copy), run by
    `torch.ops.mkldnn._linear_pointwise` on plain tensors (what torch.compile's frozen CPU graphs call): the
    prepacked oneDNN linear the issue names as a dense baseline. F.linear's values up to its own summation order (a
    check when built)."""

    def __init__(self, lin: nn.Linear, batch: int):
        super().__init__()
        self.in_features, self.out_features = lin.in_features, lin.out_features
        self.register_buffer("packed", OneDNNOperand.reorder("bf16", lin.weight.detach(), batch))
        self.register_buffer("bias", None if lin.bias is None else lin.bias.detach())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with onednn(True):
            y = OneDNNOperand.linear(x.reshape(-1, self.in_features), self.packed, self.bias)
        return y.reshape(*x.shape[:-1], self.out_features)


def _prepacked(cands: list[Candidate], batch: int) -> tuple[list[Candidate], list[str]]:
    """The dense models again (bf16 and float32) with their decoder blocks' linears prepacked for oneDNN
    (PrepackedLinear, prepacked for `batch` rows: the prefill's), through the lean runtime (its one-token steps call
    these modules: a layer of them is not fused). Issue W item 2: the dense baseline through the best path torch
    offers; the study takes the faster dense per measure. A copy of the model is made, its plain linears dropped as
    they are replaced (the measured memory is the copy's). Where this torch has no such op, or its outputs differ
    from F.linear's, the candidate is left out and the reason returned."""
    import copy
    from lrq.arch import decoder_blocks, iter_linears, set_submodule
    out, skipped = [], []
    for c in cands:
        if c.kind != "dense" or c.lean is None or c.name.endswith((HF_SUFFIX, NO_ONEDNN, TORCH_LINEARS)):
            continue
        before = _rss()
        try:
            model = copy.deepcopy(c.model)
            blocks = decoder_blocks(model)
            probe = next(iter_linears(model))[2]
            x = torch.randn(3, probe.in_features, generator=torch.Generator().manual_seed(0)).to(probe.weight.dtype)
            got, ref = PrepackedLinear(probe, 3)(x).float(), nn.functional.linear(x, probe.weight, probe.bias).float()
            err = ((got - ref).abs().max() / ref.abs().max().clamp_min(1e-30)).item()
            if not err <= (1e-2 if probe.weight.dtype == torch.bfloat16 else 1e-5):   # its own summation order
                raise RuntimeError(f"its output differs from F.linear's (relative {err:.1e})")
            for i, name, lin in list(iter_linears(model)):
                set_submodule(blocks[i], name, PrepackedLinear(lin, batch))
        except (RuntimeError, AttributeError) as e:   # no mkldnn ops in this build, or a dtype it does not take
            skipped.append(f"{c.name}{PREPACKED}: {e}")
            continue
        gc.collect()
        lean = type(c.lean)(model, c.lean.max_len)
        decode(lean, torch.arange(16).unsqueeze(0) % model.config.vocab_size, 2)
        out.append(Candidate(c.name + PREPACKED, model, "dense", c.dtype, _rss() - before, lean=lean,
                             info={**c.info, "linears": "oneDNN prepacked"}))
    return out, skipped


def attach_runtime(cands: list[Candidate], runtime: str, max_len: int) -> list[Candidate]:
    """Each model candidate set to run through `runtime`: `lean` (lrq.runtime.LeanDecoder, an error where the
    model cannot), `hf` (the model's own forward), `auto` (lean where the model can, else its own forward, the
    reason recorded), `both` (lean, plus a copy of the candidate on the same weights through its own forward,
    named with HF_SUFFIX; its rows are not stored to a results store). Every row names its runtime."""
    from lrq.runtime import LeanDecoder, lean_support
    if runtime not in RUNTIMES:
        raise UserError(f"--runtime {runtime!r}: choose one of {', '.join(RUNTIMES)}")
    out = []
    for c in cands:
        if c.model is None:
            out.append(c)
            continue
        why = None if runtime == "hf" else lean_support(c.model, max_len)
        if runtime == "lean" and why:
            raise UserError(f"--runtime lean: {c.name} cannot run through the lean runtime ({why}); use "
                            f"--runtime auto or hf")
        if runtime == "hf" or why:
            c.info.update(runtime="hf eager", **({"lean_refused": why} if why else {}))
            out.append(c)
            continue
        c.lean = LeanDecoder(c.model, max_len)
        c.info["runtime"] = "lean"
        out.append(c)
        if runtime == "both":
            out.append(Candidate(c.name + HF_SUFFIX, c.model, c.kind, c.dtype, c.weight_rss_bytes,
                                 info={**c.info, "runtime": "hf eager"}))
    for c in out:
        if c.lean is not None:   # warmed as build warmed the model's own forward
            decode(c.lean, torch.arange(16).unsqueeze(0) % c.model.config.vocab_size, 2)
    return out


def run(model_name: str, schemes, precision: str, threads: int, rounds: int, prefill_len: int, decode_steps: int,
        data_dir: str | None, anchors: list[str] | None = None, int8_head: bool | str = False,
        runtime: str = "auto", float32_decode: str = "exact", bf16_table: bool = False) -> dict:
    """The study. `int8_head`: True (or "profiled") measures the profiled scheme's int8-head copy as well (with
    anchors: the profile is theirs), "all" every packed scheme's; `bf16_table` (float32 models): every packed scheme
    again with its table held in bf16 (lossless)."""
    from bench.common.provenance import cpu_label, git_revision, hardware, versions
    from lrq.precision import Precision
    torch.set_num_threads(threads)
    decided = Precision.decide(precision, "cpu")
    dtype = torch.bfloat16 if decided.used == "bf16" else torch.float32
    modes = _float32_decode_modes(float32_decode)
    if len(modes) > 1 and dtype != torch.float32:
        raise UserError(f"--fp32-decode {float32_decode}: several modes compare float32 decode steps, but the packed "
                        f"models are held in {decided.used} here; add --precision fp32 or give one mode")
    if bf16_table and dtype != torch.float32:
        raise UserError(f"--bf16-table holds a float32 model's table in bf16, but the packed models are held in "
                        f"{decided.used} here (their table is bf16 already); add --precision fp32 or drop it")
    n_ctx = max(prefill_len, 16 + decode_steps + 8)
    probe_anchors(model_name, anchors or [], threads, n_ctx)   # before anything is built: a crash costs a minute
    cands = build(model_name, schemes, dtype, data_dir)
    _set_float32_decode(cands, modes[0])
    max_len = max(prefill_len, 16 + max(decode_steps, PROFILE_STEPS)) + 1
    cands = attach_runtime(cands, runtime, max_len)
    profiled, extra, anchor_cands, head_copies = None, {}, [], []
    if anchors:
        packed = [c for c in cands if c.kind == "packed"]   # w4a16-g128, the anchor's comparison, else the first
        target = next((c for c in packed if c.name == "w4a16-g128"), packed[0] if packed else None)
        if target is not None:
            ids = torch.arange(100, 116).unsqueeze(0) % target.model.config.vocab_size
            profiled = {"candidate": target.name, **profile_decode(target.lean or target.model, ids,
                                                                   PROFILE_STEPS)}
            profiled["head_dominates"] = head_dominates(profiled)
            print(f"profile of {target.name} decode: " + ", ".join(
                f"{g['group']} {g['ms_per_token']:.1f} ms" for g in profiled["groups"]), flush=True)
            if (profiled["head_dominates"] or int8_head) and int8_head != "all":
                head_copies = [target.name]
        anchor_cands, extra = build_anchors(model_name, anchors, threads, n_ctx)
    if int8_head == "all":
        head_copies = [c.name for c in cands if c.kind == "packed"]
    # the bf16-table copies of every packed scheme (float32 models only), then the int8-head ones
    head_copies = [n + HEAD_BF16 for n in schemes if bf16_table] + [n + HEAD_INT8 for n in head_copies]
    if head_copies:   # the int8-head (and bf16-table) copies (lrq.packed.quantize_head), built after the profile
        heads = build(model_name, head_copies, dtype, data_dir, dense=False)
        _set_float32_decode(heads, modes[0])
        cands += attach_runtime(heads, "hf" if runtime == "hf" else "auto", max_len)
    cands += _mode_copies(cands, modes[1:])
    prepacked, prepack_skipped = _prepacked(cands, prefill_len)
    cands += _without_onednn(cands) + _torch_linears(cands) + prepacked + anchor_cands
    try:
        reads = measure(cands, rounds, prefill_len, decode_steps)
    finally:
        for c in cands:
            if c.runner is not None:
                c.runner.close()
    hw = hardware()
    doc = {"what": "e2e-cpu", "model": model_name, "threads": threads, "rounds": rounds, "prefill": prefill_len,
           "decode_steps": decode_steps, "runtime": runtime, "float32_decode": float32_decode,
           "kernels_isa": _kernels_isa(),
           "precision": decided.info(), "machine": cpu_label(hw),
           "hardware": hw, "versions": versions(), "git_rev": git_revision(), "rows": rows(cands),
           "anchors": extra, "prepacked_skipped": prepack_skipped,
           "memory_read_gbs": {"median": statistics.median(reads), "min": min(reads), "max": max(reads),
                               "rounds": reads, "bytes": READ_PROBE_BYTES}}
    if profiled:
        doc["profile"] = profiled
    return doc


ANCHOR_TARGET = 1.5   # issue W: our w4a16-g128 decode within 1.5x of llama.cpp Q4_1's


def anchor_ratio(doc: dict) -> dict | None:
    """Our w4a16-g128 decode ms/token over llama.cpp Q4_1's (wall and CPU), against the target: the median of the
    rounds' own ratios with their range where the rows keep their rounds (paired_ratios), else of the medians."""
    by = {r["candidate"]: r for r in doc["rows"]}
    ours, ref = by.get("w4a16-g128"), by.get("llama.cpp Q4_1")
    if not (ours and ref):
        return None
    out = {"ratio": ours["decode_ms"] / ref["decode_ms"]}
    if ours.get("decode_ms_rounds") and ref.get("decode_ms_rounds"):
        pairs = paired_ratios(ours["decode_ms_rounds"], ref["decode_ms_rounds"])
        out = {"ratio": statistics.median(pairs), "range": [min(pairs), max(pairs)]}
    return {**out, "cpu_ratio": ours["decode_cpu_ms"] / ref["decode_cpu_ms"], "target": ANCHOR_TARGET,
            "met": out["ratio"] <= ANCHOR_TARGET}


def markdown(doc: dict) -> str:
    from tabulate import tabulate
    body = [[r["candidate"], r["dtype"], r.get("runtime", "llama.cpp" if r["kind"] == "anchor" else "hf eager"),
             f"{r['decode_ms']:.1f} ({r['decode_ms_range'][0]:.1f}-"
             f"{r['decode_ms_range'][1]:.1f})", f"{r['decode_cpu_ms']:.1f}",
             f"{r['prefill_tok_s']:.0f} ({r['prefill_tok_s_range'][0]:.0f}-{r['prefill_tok_s_range'][1]:.0f})",
             f"{r['weight_rss_bytes'] / 2**20:.0f}", _ratio_text(r, "decode_vs_dense"),
             _ratio_text(r, "prefill_vs_dense"), f"{r['memory_vs_dense_bf16']:.2f}x"] for r in doc["rows"]]
    ref = doc["rows"][0]["dense_reference"]
    lines = "\n".join([
        f"# CPU speed, {doc['model']}, batch 1, {doc['threads']} thread(s)", "",
        f"Machine: {doc['machine']} (flags {', '.join(doc['hardware'].get('cpu_bf16_flags') or []) or 'no bf16'}); "
        f"torch {doc['versions'].get('torch')}; revision {short_revision(doc['git_rev'])}; packed models held in "
        f"{doc['precision']['used']} ({doc['precision']['why']})"
        f"{_fp32_decode_sentence(doc)}; kernels' instruction set: {_isa_text(doc)}.", "",
        f"Every candidate in one process, {doc['rounds']} rounds in a rotating order; medians over rounds (min-max). "
        f"Decode: ms per greedy token after a 16-token prompt ({doc['decode_steps']} tokens a round, the prompt not "
        f"timed, the last position's logits only). Prefill: tokens/s of one {doc['prefill']}-token forward, the "
        f"last position's logits only. Weight memory: the resident memory each model added when it was built. "
        f"Ratios against the faster dense model per measure (decode: {ref['decode']}; prefill: {ref['prefill']})"
        f"{_paired_sentence(doc)}; "
        f"memory against dense bf16.{_bf16_table_sentence(doc)}{_read_sentence(doc)}", "",
        _runtime_sentence(doc), "",
        tabulate(body, headers=["candidate", "held in", "runtime", "decode ms/token", "decode CPU ms", "prefill tok/s",
                                "weight MiB", "decode vs dense", "prefill vs dense", "memory vs bf16"],
                 tablefmt="github", disable_numparse=True), ""])
    extra = _anchor_markdown(doc)
    return lines + ("\n" + extra if extra else "")


def _ratio_text(row: dict, key: str) -> str:
    """A ratio with the range of the rounds' own ratios (older reports: the ratio of medians alone)."""
    span = row.get(f"{key}_range")
    if not span or span[0] == span[1]:   # the reference itself: 1.00x every round
        return f"{row[key]:.2f}x"
    return f"{row[key]:.2f}x ({span[0]:.2f}-{span[1]:.2f})"


def _paired_sentence(doc: dict) -> str:
    if not any("decode_vs_dense_range" in r for r in doc["rows"]):
        return ""
    return (", each the median of the rounds' own ratios (a round's candidate against the reference measured in that "
            "round: the memory's speed moves between rounds), their range in brackets")


def _read_sentence(doc: dict) -> str:
    """The memory's speed during the rounds, and what it means for the decode ratios (older reports: none)."""
    read = doc.get("memory_read_gbs")
    if not read:
        return ""
    who = "One core's" if doc.get("threads", 1) == 1 else f"{doc['threads']} threads'"
    return (f" {who} plain read of {read['bytes'] >> 20} MiB once a round: {read['median']:.1f} GB/s "
            f"({read['min']:.1f}-{read['max']:.1f}). A decode step reads every weight once, so where it streams them "
            f"its time follows that speed, and a format's decode ratio is bounded by about the inverse of its memory "
            f"ratio (the bytes read a token; less where the step's other work, the same for every format, weighs).")


def _bf16_table_sentence(doc: dict) -> str:
    rounded = {r.get("head_values_rounded") for r in doc["rows"] if r["candidate"].endswith(HEAD_BF16)}
    if not rounded:
        return ""
    how = ("lossless: every value a bf16 value" if rounded == {0} else
           "this model's table has float32 values, rounded to bf16 as the dense bf16 model rounds them")
    return (f" `<scheme>{HEAD_BF16}`: the same packed model with its float32 output head and tied embedding held in "
            f"bf16 (lrq.packed.quantize_head(model, \"bf16\"); {how}), the rest held and computed in float32.")


def _kernels_isa() -> dict:
    """The instruction set torch's kernels, oneDNN and MKL were allowed to use (ATEN_CPU_CAPABILITY,
    ONEDNN_MAX_CPU_ISA and MKL_ENABLE_INSTRUCTIONS limit them below the CPU's own: how a CPU without native bf16 is
    emulated on one that has it; MKL runs torch's float32 GEMMs, so an emulation that leaves it uncapped times the
    dense float32 prefill with the real CPU's AVX-512)."""
    import os
    import lrq.cpu_kernels as cpu_kernels
    import lrq.native as native
    return {"aten": torch.backends.cpu.get_cpu_capability(),
            "aten_cpu_capability": os.environ.get("ATEN_CPU_CAPABILITY") or "all",
            "onednn_max_cpu_isa": os.environ.get("ONEDNN_MAX_CPU_ISA") or os.environ.get("DNNL_MAX_CPU_ISA") or "all",
            "mkl_enable_instructions": (os.environ.get("MKL_ENABLE_INSTRUCTIONS") or "all"
                                        if torch.backends.mkl.is_available() else "no MKL"),
            "decode_kernel": native.status(),
            "int8_prefill_kernel": {"amx": "lrq native, AMX tiles", "avx2": "lrq native, AVX2 integer products"}.get(
                cpu_kernels.int8_prefill_kernel(), "oneDNN" if cpu_kernels.int_mm_ok() else "float32 GEMMs over slices")}


def _isa_text(doc: dict) -> str:
    isa = doc.get("kernels_isa") or {}
    text = f"aten {isa.get('aten', '?')}, oneDNN {isa.get('onednn_max_cpu_isa', '?')}"
    mkl = isa.get("mkl_enable_instructions")
    if mkl:
        text += f", MKL {mkl}"
        if mkl == "all" and isa.get("aten_cpu_capability", "all") != "all":   # aten held by ATEN_CPU_CAPABILITY
            text += (" (not capped: torch's float32 GEMMs ran with the CPU's full instruction set while its other "
                     "kernels were held below it; set MKL_ENABLE_INSTRUCTIONS too)")
    text += f"; 4-bit decode kernel: {isa['decode_kernel']}" if isa.get("decode_kernel") else ""
    return text + (f"; W8A8/W4A8 prefill: {isa['int8_prefill_kernel']}" if isa.get("int8_prefill_kernel") else "")


def _fp32_decode_sentence(doc: dict) -> str:
    if doc.get("precision", {}).get("used") != "fp32":
        return ""
    mode, *more = doc.get("float32_decode", "exact").split(",")
    native = str((doc.get("kernels_isa") or {}).get("decode_kernel", "")).startswith("lrq native")
    exact = ("exact (lrq's own float32 kernel on the packed levels)" if native else
             "exact (a transient float32 weight per call)")
    text = {"exact": exact, "bf16": "through the bf16 int4 kernel (activations and outputs rounded to bf16)",
            "i16": ("16-bit integer activations (i16: each rounded to 2^-15 of its chunk's largest, lrq.native's "
                    "integer kernel where built for the packing; the products summed exactly, the output float32)")}
    return "; float32 decode steps of the 4-bit layers: " + text.get(mode, mode) + "".join(
        f"; rows marked [{m}]: the same models, interleaved, {text.get(m, m)}" for m in more)


def _runtime_sentence(doc: dict) -> str:
    """What the runtime column means, and why a model did not run through the lean runtime where it did not."""
    refused = sorted({r["lean_refused"] for r in doc["rows"] if r.get("lean_refused")})
    return ("Runtime: `lean` is lrq.runtime.LeanDecoder (the model's own weights, a preallocated key/value cache, "
            "fused norms, no per-call masks; a one-token step runs each decoder layer as one lrq.native call where "
            "all its parts can be (all of them fused: the whole stack one call): the same logits up to float "
            "rounding); `hf eager` the model's own transformers forward (a dynamic cache); `[no oneDNN]`: the dense "
            "bf16 model with torch.backends.mkldnn off for its calls (torch's own bf16 kernels); `[torch linears]`: "
            "the dense model through the lean runtime without fused layers (its decode steps call its modules: "
            "torch's matrix-vector kernels); `[oneDNN prepacked]`: "
            "the dense model with its decoder blocks' linears held in oneDNN's own layout, made once "
            "(torch.ops.mkldnn._linear_pointwise, as torch.compile's frozen CPU graphs run them)"
            + (f"; not lean because {'; '.join(refused)}" if refused else "")
            + (f"; not measured: {'; '.join(doc['prepacked_skipped'])}" if doc.get("prepacked_skipped") else "")
            + ".")


def _anchor_markdown(doc: dict) -> str:
    from tabulate import tabulate
    out = []
    lc = (doc.get("anchors") or {}).get("llama.cpp")
    if lc:
        files = ", ".join(f"{k}: {v['path']} (SHA-256 {v['sha256']}, {v['bytes'] / 2**20:.0f} MiB; token_embd "
                          f"{v['tensor_types']['head'].get('token_embd.weight', '?')})" for k, v in lc["files"].items())
        out += [f"llama.cpp: llama-cpp-python {lc['llama_cpp_python']} (its vendored llama.cpp, built from the "
                f"sdist), n_threads = n_threads_batch = {lc['n_threads']}, n_batch = n_ubatch = {lc['n_batch']}, "
                f"flash attention off, batch 1; its weight memory is the resident memory the loaded GGUF added "
                f"(weights, KV cache and compute buffers). Files: {files}. Q8_0 and BF16 were made from the Q4_1 "
                f"file by llama_model_quantize (allow_requantize). Build: {lc['system_info']}", ""]
    ratio = anchor_ratio(doc)
    if ratio:
        r, span = ratio["ratio"], ratio.get("range")
        said = f"{r:.2f}x slower" if r > 1 else f"{1 / r:.2f}x faster (ms/token {r:.2f}x llama.cpp's)"
        if span:
            said += f", the rounds' own {span[0]:.2f}-{span[1]:.2f}x"
        out += [f"**w4a16-g128 decode vs llama.cpp Q4_1: {said}** (wall; CPU time "
                f"{ratio['cpu_ratio']:.2f}x); target within {ratio['target']}x: "
                f"{'met' if ratio['met'] else 'not met'}.", ""]
    prof = doc.get("profile")
    if prof:
        body = [[g["group"], f"{g['ms_per_token']:.2f}", f"{100 * g['share']:.0f} %"] for g in prof["groups"]]
        out += [f"Where {prof['candidate']}'s decode time goes (torch.profiler, {prof['steps']} steps after a "
                f"16-token prompt, {prof['wall_ms_per_token']:.1f} ms/token under the profiler, "
                f"{prof.get('unprofiled_ms_per_token', float('nan')):.1f} without it; top-level aten ops by the "
                f"module they run in, overhead = wall time inside no aten op, the profiler's own per-op cost "
                f"mostly included):", "",
                tabulate(body, headers=["group", "ms/token", "share"], tablefmt="github", disable_numparse=True),
                "", _head_sentence(prof, doc), ""]
    return "\n".join(out)


def _head_sentence(prof: dict, doc: dict) -> str:
    by = {r["candidate"]: r for r in doc["rows"]}
    fused = {g["group"]: g["ms_per_token"] for g in prof["groups"]}.get(PROFILE_GROUPS[4], 0.0)
    text = (f"The head {'dominates' if prof['head_dominates'] else 'does not dominate'} (it costs "
            f"{'at least' if prof['head_dominates'] else 'less than'} all the quantized linears together"
            f"{', counted as the fused decoder layers that hold them' if fused > 0 else ''})")
    head_row, ours = by.get(prof["candidate"] + HEAD_INT8), by.get(prof["candidate"])
    if head_row and ours:
        text += (f"; `{head_row['candidate']}` above is the same model with an int8 per-channel head "
                 f"(lrq.packed.quantize_head, the tied embedding reading its levels; llama.cpp's Q4_1 file holds "
                 f"its tied table as Q8_0, groups of 32; what it costs in accuracy: bench.studies.head_int8)"
                 f"{'' if prof['head_dominates'] else ', measured because --int8-head asked for it'}: decode "
                 f"{head_row['decode_ms']:.1f} ms/token against {ours['decode_ms']:.1f} with the bf16 head")
    return text + "."


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
        colour = {"dense": "#888", "anchor": "#d8843b"}.get(r["kind"], "#3b7dd8")
        parts += [f'<text x="8" y="{y + 15}">{html.escape(r["candidate"])}</text>',
                  f'<rect x="{left}" y="{y + 3}" width="{w:.1f}" height="{bar - 6}" fill="{colour}"/>',
                  f'<text x="{left + w + 4:.1f}" y="{y + 15}">{r["decode_ms"]:.1f}</text>']
    return "\n".join(parts + ["</svg>"]) + "\n"
