"""End-to-end inference speed that measures the kernels, not Python: a random-weight model of a named
shape, a static KV cache and CUDA graphs (the way gpt-fast removes launch overhead).

    python -m bench.studies.speed e2e --device cuda --shape llama-2-7b --layers 8 [--schemes ...] [--out FILE]

Per format (bf16, then each scheme): the model is built with random weights of the shape (seeded, the
same for every format), its seven linears per block are RTN-quantized and packed (w8a8's static input
ranges from one forward of the FP model on random tokens), then
* prefill: one forward of `prefill` tokens into the static cache, captured as a CUDA graph and replayed
  (median over replays) -> tokens/s;
* decode: one greedy step (forward of one token at the next cache position, argmax, position + 1)
  captured as a CUDA graph; replayed `decode` times from the prefilled cache -> ms/token (median of
  blocks of replays, CUDA events);
* weight memory (parameters + buffers), the weight copies the GPU kernels converted for themselves during the
  warm-up (`kernel_copy_bytes`: the decode GEMV reads its own layout, a second copy beside the planar words the
  GEMM and the state dict keep; lrq.packed), their sum (`resident_weight_bytes`), what torch's allocator holds
  after the warm-up and its peak over the whole run (both include those copies: they are allocator tensors);
* which kernel the dispatcher chose per layer shape and M (`dispatch`: lrq.kernels.dispatch's records of a
  dispatcher made for this format, measured on the GPU during the eager warm-up, before any capture);
* the bandwidth floor of a decode step: (weight bytes + the KV cache read at that context) / 4.3 TB/s,
  and how far the measured step is above it.
When capture fails (an operation the graph cannot hold) the row says why and times eager steps
instead, marked `cuda_graphs: false`. On a CPU the same code runs eagerly (for tests).
"""

from __future__ import annotations

import time
import warnings

import torch
from torch import nn

BANDWIDTH = 4.3e12


def random_model(shape: str, layers: int, device: str, seed: int = 0) -> nn.Module:
    """A Llama of a named shape (bench.run.plan.SHAPES) with `layers` decoder blocks and random weights."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from bench.run.shapes import load_shape
    s = load_shape(shape)
    cfg = LlamaConfig(vocab_size=s.vocab, hidden_size=s.hidden, intermediate_size=s.intermediate,
                      num_hidden_layers=layers, num_attention_heads=s.heads, num_key_value_heads=s.kv_heads,
                      max_position_embeddings=4096, tie_word_embeddings=False)
    torch.manual_seed(seed)
    with torch.device(device):
        model = LlamaForCausalLM(cfg).to(torch.bfloat16).eval()
    return model


@torch.no_grad()
def static_ranges(model: nn.Module, ids: torch.Tensor) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """Per-tensor (scale, zero) of every block linear's input over one forward (min/max, 8 bits)."""
    from lrq.arch import iter_linears
    from lrq.quant import qparams_from_range
    lo: dict[str, torch.Tensor] = {}
    hi: dict[str, torch.Tensor] = {}
    hooks = []
    for i, name, lin in iter_linears(model):
        key = f"{i}.{name}"

        def hook(_m, args, key=key):
            x = args[0].float()
            lo[key] = torch.minimum(lo.get(key, x.min()), x.min())
            hi[key] = torch.maximum(hi.get(key, x.max()), x.max())
        hooks.append(lin.register_forward_pre_hook(hook))
    try:
        model(ids)
    finally:
        for h in hooks:
            h.remove()
    return {k: qparams_from_range(lo[k].clamp(max=0), hi[k].clamp(min=0), 8) for k in lo}


@torch.no_grad()
def quantize_packed(model: nn.Module, scheme_name: str, ids: torch.Tensor) -> None:
    """RTN (min/max per row or group) of every block linear, packed in place (PackedLinear)."""
    from lrq.arch import decoder_blocks, iter_linears, set_submodule
    from lrq.packed import PackedLinear
    from lrq.qlinear import QuantLinear
    from lrq.quant import minmax_qparams
    from lrq.schemes import get_scheme
    scheme = get_scheme(scheme_name)
    ranges = static_ranges(model, ids) if scheme.static_activations else {}
    blocks = decoder_blocks(model)
    for i, name, lin in list(iter_linears(model)):
        scale, zero = minmax_qparams(lin.weight, scheme.w_bits, scheme.group_size)
        q = QuantLinear.from_linear(lin, scheme, scale.half().float(), zero)
        if scheme.static_activations:
            q.set_static_range(*ranges[f"{i}.{name}"])
        set_submodule(blocks[i], name, PackedLinear.from_quant_linear(q))
        del q, lin


def model_bytes(model: nn.Module) -> int:
    return sum(t.numel() * t.element_size() for t in list(model.parameters()) + list(model.buffers()))


def _kv_bytes(model: nn.Module, ctx: int) -> int:
    c = model.config
    head_dim = c.hidden_size // c.num_attention_heads
    return 2 * c.num_hidden_layers * c.num_key_value_heads * head_dim * ctx * 2


class _Runner:
    """The model with a static cache: prefill and greedy decode steps, as CUDA graphs where possible."""

    def __init__(self, model: nn.Module, prefill: int, decode: int, graphs: bool):
        from transformers import StaticCache
        self.model = model
        self.device = next(model.parameters()).device
        self.cache = StaticCache(config=model.config, max_cache_len=prefill + decode + 8)
        g = torch.Generator().manual_seed(1)
        self.ids = torch.randint(100, model.config.vocab_size, (1, prefill), generator=g).to(self.device)
        self.prefill_pos = torch.arange(prefill, device=self.device)
        self.tok = torch.zeros(1, 1, dtype=torch.long, device=self.device)
        self.pos = torch.tensor([prefill], device=self.device)
        self.prefill_len = prefill
        self.graphs = graphs and self.device.type == "cuda"
        self.graph_error = None
        self._prefill_graph = self._step_graph = None

    def _set_length(self, n: int):
        """Where the static cache writes next: transformers >= 5.2x keeps its own per-layer counter (and
        ignores cache_position when writing), older releases write at cache_position."""
        for layer in getattr(self.cache, "layers", []):
            length = getattr(layer, "cumulative_length", None)
            if isinstance(length, torch.Tensor):
                length.fill_(n)
            elif isinstance(length, int):
                layer.cumulative_length = n

    @torch.no_grad()
    def _prefill(self):
        logits = self.model(input_ids=self.ids, past_key_values=self.cache, cache_position=self.prefill_pos,
                            use_cache=True).logits
        self.tok.copy_(logits[:, -1:].argmax(-1))

    @torch.no_grad()
    def _step(self):
        logits = self.model(input_ids=self.tok, past_key_values=self.cache, cache_position=self.pos,
                            use_cache=True).logits
        self.tok.copy_(logits[:, -1:].argmax(-1))
        self.pos.add_(1)

    def reset(self):
        """Back to the end of the prompt: the next decode step writes position `prefill`."""
        self.pos.fill_(self.prefill_len)
        self._set_length(self.prefill_len)

    def capture(self):
        """Warm up eagerly (kernels compiled and tuned, the cache allocated, and the weight-only kernel of every
        layer chosen and its weights converted, at exactly the shapes captured below: the prefill's M and M = 1;
        nothing can be measured or converted inside a capture), then capture both steps."""
        warnings.filterwarnings("ignore", message=".*past_key_values.*deprecated")
        self.prefill()
        self._step()
        self.reset()
        if not self.graphs:
            return
        try:
            s = torch.cuda.Stream()
            s.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(s):
                for _ in range(2):
                    self.prefill()
                    self._step()
                    self.reset()
            torch.cuda.current_stream().wait_stream(s)
            self._prefill_graph = torch.cuda.CUDAGraph()
            self._set_length(0)
            with torch.cuda.graph(self._prefill_graph):
                self._prefill()
            self.reset()
            self._step_graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(self._step_graph):
                self._step()
            self.reset()
        except Exception as e:  # noqa: BLE001 - recorded; eager timing follows
            self.graphs = False
            self.graph_error = f"{type(e).__name__}: {str(e)[:300]}"
            self._prefill_graph = self._step_graph = None

    def prefill(self):
        self._set_length(0)
        self._prefill_graph.replay() if self._prefill_graph is not None else self._prefill()

    def step(self):
        self._step_graph.replay() if self._step_graph is not None else self._step()


def _timed_ms(fn, device: torch.device, reps: int) -> list[float]:
    out = []
    for _ in range(reps):
        if device.type == "cuda":
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            fn()
            b.record()
            b.synchronize()
            out.append(a.elapsed_time(b))
        else:
            t = time.perf_counter()
            fn()
            out.append((time.perf_counter() - t) * 1e3)
    return out


def _median(v: list[float]) -> float:
    v = sorted(v)
    return v[len(v) // 2]


def kernel_copy_bytes(model: nn.Module) -> int:
    """Bytes of the weight copies the packed layers' GPU kernels converted for themselves (lrq.packed.runner_bytes)."""
    from lrq.packed import PackedLinear
    return sum(m.runner_bytes() for m in model.modules() if isinstance(m, PackedLinear))


def measure_format(shape: str, layers: int, scheme: str, device: str, prefill: int, decode: int,
                   graphs: bool = True, reps: int = 5) -> dict:
    """One format's row; its weight-only layers ask a dispatcher made for this format (its records are the row's
    `dispatch`; measured choices are shared through the dispatcher's cache file)."""
    from lrq.kernels import dispatch as D
    dispatcher = D.Dispatcher(D.default_cache_file())
    with D.using(dispatcher):
        row = _measure_format(shape, layers, scheme, device, prefill, decode, graphs, reps)
    row["dispatch"] = dispatcher.report()
    return row


def _measure_format(shape: str, layers: int, scheme: str, device: str, prefill: int, decode: int,
                    graphs: bool, reps: int) -> dict:
    dev = torch.device(device)
    if dev.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    model = random_model(shape, layers, device)
    if scheme != "bf16":
        calib = torch.randint(100, model.config.vocab_size, (1, 256), generator=torch.Generator().manual_seed(2))
        quantize_packed(model, scheme, calib.to(dev))
    if dev.type == "cuda":
        torch.cuda.empty_cache()
    weights = model_bytes(model)
    r = _Runner(model, prefill, decode, graphs)
    t = time.perf_counter()
    r.capture()
    warm_s = time.perf_counter() - t
    copies = kernel_copy_bytes(model)
    allocated = torch.cuda.memory_allocated() if dev.type == "cuda" else None
    prefill_ms = _median(_timed_ms(r.prefill, dev, reps))
    # decode: from the prefilled cache, `decode` greedy steps, timed in blocks
    r.reset()
    r.prefill()
    block = max(1, decode // reps)
    steps = _timed_ms(lambda: [r.step() for _ in range(block)], dev, reps)
    decode_ms = _median(steps) / block
    ctx = prefill + decode // 2
    floor_ms = (weights + _kv_bytes(model, ctx)) / BANDWIDTH * 1e3
    row = {"shape": shape, "layers": layers, "scheme": scheme, "device": torch.cuda.get_device_name()
           if dev.type == "cuda" else "cpu", "cuda_graphs": r.graphs, "graph_error": r.graph_error,
           "prefill_tokens": prefill, "prefill_ms": prefill_ms, "prefill_tok_s": prefill / prefill_ms * 1e3,
           "decode_steps": block * reps, "decode_ms_per_token": decode_ms, "decode_tok_s": 1e3 / decode_ms,
           "weight_bytes": weights, "kernel_copy_bytes": copies, "resident_weight_bytes": weights + copies,
           "allocated_after_warmup_bytes": allocated,
           "decode_floor_ms": floor_ms, "decode_vs_floor": decode_ms / floor_ms,
           "warmup_s": warm_s,
           "peak_gpu_bytes": torch.cuda.max_memory_allocated() if dev.type == "cuda" else None}
    del r, model
    return row


def dispatch_line(records: list[dict]) -> str:
    """`NxK M=m kernel (source, layers)` per record, for the log."""
    return ", ".join(f"{r['n']}x{r['k']} M={r['m']} {r['kernel']} ({r['source']}, {r['calls']})" for r in records)


def run(shape: str, layers: int, schemes: list[str], device: str, prefill: int, decode: int,
        graphs: bool = True) -> list[dict]:
    rows = []
    for name in ["bf16"] + [s for s in schemes if s != "bf16"]:
        try:
            row = measure_format(shape, layers, name, device, prefill, decode, graphs)
        except Exception as e:  # noqa: BLE001 - one format failing must not hide the others; it is a row
            row = {"shape": shape, "layers": layers, "scheme": name, "error": f"{type(e).__name__}: {str(e)[:300]}"}
        rows.append(row)
        if "error" in row:
            print(f"{name:<11} FAILED: {row['error']}", flush=True)
            continue
        base = rows[0] if "error" not in rows[0] else None
        rel = (f"  x{base['decode_ms_per_token'] / row['decode_ms_per_token']:.2f} decode, "
               f"x{row['prefill_tok_s'] / base['prefill_tok_s']:.2f} prefill vs bf16") if base else ""
        print(f"{name:<11} prefill {row['prefill_tok_s']:10.0f} tok/s  decode {row['decode_ms_per_token']:8.3f} ms/tok "
              f"(floor {row['decode_floor_ms']:.3f})  weights {row['weight_bytes'] / 2**20:8.0f} MiB "
              f"+ kernel copies {row['kernel_copy_bytes'] / 2**20:6.0f} MiB  "
              f"peak {(row['peak_gpu_bytes'] or 0) / 2**20:8.0f} MiB{rel}"
              + ("" if row["cuda_graphs"] or device != "cuda" else f"  [eager: {row['graph_error']}]"), flush=True)
        if row.get("dispatch"):
            print("            dispatch: " + dispatch_line(row["dispatch"]), flush=True)
    base = rows[0] if "error" not in rows[0] else None
    for row in rows:
        if base and "error" not in row:
            row["decode_speedup_vs_bf16"] = base["decode_ms_per_token"] / row["decode_ms_per_token"]
            row["prefill_speedup_vs_bf16"] = row["prefill_tok_s"] / base["prefill_tok_s"]
    return rows
