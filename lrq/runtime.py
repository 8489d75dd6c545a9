"""A lean forward for generation with Llama-family causal LMs (llama, mistral, qwen2, qwen3), dense or packed.

The Hugging Face forward is general: masks built per call, a cache object updated through Python, each norm six
operations, module hooks. At batch 1 on a CPU a decode step of SmolLM2-135M is mostly such small operations, so
they hide what a weight format buys. `LeanDecoder` runs the same computation with the model's own modules (its
linears, dense or `PackedLinear`, its activation, its rotary embedding) and fewer operations around them:

- a key/value cache allocated once for `max_len` positions, written in place (no per-step concatenation);
- the rotary tables computed once by the model's own rotary module for every position (scaled variants included),
  applied as x * cos + roll(x) * sin' (three operations; sin' carries rotate_half's sign);
- RMSNorm as one fused `F.rms_norm` with its weight (float32 inside, one rounding: at least as close to the float
  result as the Hugging Face norm's two);
- `scaled_dot_product_attention` with grouped heads (no repeated keys), causal from the cache's start, a mask
  only where a chunk of several tokens follows cached ones;
- several tokens (a prefill): each residual add with the norm after it, the MLP's SiLU with its product, and RoPE
  with the cache write (batch 1) as one lrq.native pass over the rows each (`rows_native`; torch's CPU rms_norm on
  bf16 is about twenty operations);
- the head on the positions asked for only;
- a decode step (one token) with oneDNN off (`onednn_decode`): torch's own bf16 matrix-vector kernels are faster;
- at the first forward, the weights a step streams (each layer's linears in the order a step reads them, the head)
  moved into one region of transparent huge pages (`huge_pages`, lrq.hugepages: the same values, one copy held; a
  dense bf16 SmolLM2-135M decode step 30 -> 21 ms on a 2-core Intel Xeon VM, a w4a16-g128 one 12.9 -> 10.9).

What it refuses (a clear error; use the model's own forward): other families (Gemma's norms and soft-capping),
a sliding window the cache would reach, rotary embeddings that change with the length (`dynamic`, `longrope`),
batches with padding (every row has the same length here). Its outputs equal the model's forward up to the
rounding of reordered float operations: `tests/test_runtime.py` checks logits and greedy tokens against it.
"""

from __future__ import annotations

import ctypes

import torch
import torch.nn.functional as F
from torch import nn

import lrq.native as native
from lrq.cpu_kernels import onednn
from lrq.errors import UserError

LEAN_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3")
_LENGTH_DEPENDENT_ROPE = ("dynamic", "longrope")


def lean_support(model: nn.Module, max_len: int) -> str | None:
    """Why `model` cannot run through LeanDecoder with `max_len` positions, or None when it can."""
    cfg = getattr(model, "config", None)
    kind = getattr(cfg, "model_type", type(model).__name__)
    if kind not in LEAN_MODEL_TYPES:
        return f"model type {kind!r} is not one of {', '.join(LEAN_MODEL_TYPES)}"
    rope = getattr(cfg, "rope_parameters", None) or getattr(cfg, "rope_scaling", None) or {}
    if rope.get("rope_type", rope.get("type", "default")) in _LENGTH_DEPENDENT_ROPE:
        return f"its rotary embedding ({rope.get('rope_type', rope.get('type'))}) changes with the length"
    window = getattr(cfg, "sliding_window", None)
    uses_window = window is not None and (kind == "mistral" or getattr(cfg, "use_sliding_window", False))
    if uses_window and window < max_len:
        return f"its sliding window ({window}) is shorter than the {max_len} positions asked for"
    if not hasattr(getattr(model, "model", None), "rotary_emb"):
        return "it has no model.rotary_emb module to compute the rotary tables with"
    return None


def _native(name: str, fn, *args):
    """An lrq.native call, labelled `lrq.native::<name>` while torch.profiler records (it is no aten op, so a profile
    would otherwise count it as Python overhead; bench.studies.speed_cpu.profile_decode reads the label)."""
    if torch.autograd._profiler_enabled():
        with torch.autograd.profiler.record_function(f"lrq.native::{name}"):
            return fn(*args)
    return fn(*args)


def greedy_tokens(logits: torch.Tensor) -> torch.Tensor:
    """The greedy next token after each row's last position: logits [b, t, vocab] -> [b, 1], torch.argmax's choice
    (the first of equal largest, the first NaN). One row on the CPU in bf16 or float32 through lrq.native's argmax
    (torch's takes about 200 us over SmolLM2's 49,152 bf16 logits on a Zen 4, 4 % of a 4-bit model's step), else
    torch's."""
    last = logits[:, -1]
    lib = native.library()
    if (lib is not None and last.shape[0] == 1 and last.device.type == "cpu" and last.is_contiguous()
            and last.dtype in (torch.bfloat16, torch.float32)):
        index = lib.lrq_argmax(last.data_ptr(), last.dtype == torch.bfloat16, last.shape[-1])
        return torch.tensor([[index]], dtype=torch.long)
    return last.argmax(-1, keepdim=True)


def _rms(norm: nn.Module, x: torch.Tensor, lib=None) -> torch.Tensor:
    """The Llama/Qwen RMSNorm as one fused operation (torch computes it in float32 and rounds once; the Hugging Face
    norm rounds the normalized values to the model's dtype before scaling them by the weight, four operations).
    With `lib` (lrq.native, one-token steps) its C kernel: the same float32 computation in one call, where torch's
    CPU rms_norm on bf16 makes about twenty operations (80 us for 576 values on a Zen 4: 5 ms a token); the kernel the
    fused layer step runs (lrq_rms_norm_rows, one thread)."""
    w = norm.weight
    if lib is not None and x.is_contiguous() and w.dtype == x.dtype and w.is_contiguous():
        y = torch.empty_like(x)
        _native("rms_norm", lib.lrq_rms_norm_rows, x.data_ptr(), None, w.data_ptr(), y.data_ptr(),
                x.dtype == torch.bfloat16, x.numel() // x.shape[-1], x.shape[-1], norm.variance_epsilon, 1)
        return y
    return F.rms_norm(x, (x.shape[-1],), w, eps=norm.variance_epsilon)


def _rows_ok(lib, *ts: torch.Tensor) -> bool:
    """Whether lrq.native's row kernels take these tensors: lib built, one dtype (bf16 or float32), contiguous, CPU."""
    d = ts[0].dtype
    return lib is not None and d in (torch.bfloat16, torch.float32) and all(
        t.dtype == d and t.is_contiguous() and t.device.type == "cpu" for t in ts)


def _add_norm(x: torch.Tensor, resid: torch.Tensor | None, norm: nn.Module | None, lib) -> torch.Tensor | None:
    """x += resid in place (when given; rounded to x's dtype as x + resid is), then norm(x) (None: the add only):
    one lrq.native pass over the rows (lrq_rms_norm_rows) where it takes them, else torch's operations."""
    w = None if norm is None else norm.weight
    if resid is not None and resid.shape != x.shape:   # a broadcast: torch's add
        x.add_(resid)
        resid = None
    if _rows_ok(lib, x, *(t for t in (resid, w) if t is not None)):
        y = None if norm is None else torch.empty_like(x)
        _native("rms_norm_rows", lib.lrq_rms_norm_rows, x.data_ptr(), None if resid is None else resid.data_ptr(),
                None if w is None else w.data_ptr(), None if y is None else y.data_ptr(), x.dtype == torch.bfloat16,
                x.numel() // x.shape[-1], x.shape[-1], 0.0 if norm is None else norm.variance_epsilon,
                torch.get_num_threads())
        return y
    if resid is not None:
        x.add_(resid)
    return None if norm is None else _rms(norm, x)


def _silu_mul(g: torch.Tensor, u: torch.Tensor, lib) -> torch.Tensor:
    """silu(g) * u, each rounded to the dtype as the module's two operations are: one lrq.native pass (lrq_silu_mul)
    where it takes them, else torch's."""
    if g.shape == u.shape and _rows_ok(lib, g, u):
        y = torch.empty_like(g)
        _native("silu_mul", lib.lrq_silu_mul, g.data_ptr(), u.data_ptr(), y.data_ptr(), g.dtype == torch.bfloat16,
                g.numel(), torch.get_num_threads())
        return y
    return F.silu(g) * u


def _step_linears(layer: nn.Module) -> tuple:
    """A decoder layer's seven linears in the order a one-token step runs them."""
    a, mlp = layer.self_attn, layer.mlp
    return a.q_proj, a.k_proj, a.v_proj, a.o_proj, mlp.gate_proj, mlp.up_proj, mlp.down_proj


def _form_slots(w) -> list:
    """(object, attribute) of each tensor a packed layer's CPU form streams at decode (LeanDecoder._huge_page_weights):
    the 4-bit form's packing and scales, the int8 weight-only form's levels (its one chunk), scales and zero terms, or
    W8A8's levels and per-row terms."""
    from lrq.cpu_kernels import Int8Weights, int4_form
    int4 = int4_form(w)
    if int4 is not None:
        return [(int4, "packed"), (int4, "scale_zero")]
    if isinstance(w, Int8Weights) and w.per_channel:
        return [(w, "chunks"), (w, "scales"), (w, "zero_term")]
    return [(w, a) for a in ("weight", "wsum", "col_term", "zero_term", "scale")
            if isinstance(getattr(w, a, None), torch.Tensor)]


def _fused_linear(mod: nn.Module, dtype: torch.dtype) -> tuple | None:
    """(lrq.native.Linear, what it points into) for one linear of a fused decoder layer, or None where the layer
    cannot be fused. What its own forward runs at one token, as one part of the layer's C call: a dense nn.Linear held
    in the model's dtype (lrq's bf16/float32 GEMV); a PackedLinear on lrq.native's 4-bit kernel (weight-only, or
    W4A8 on its per-token dequantized activations), its W8A8 kernel on a static grid or its int8 weight-only kernel
    (w8a16 per channel)."""
    from lrq.cpu_kernels import Int8Weights, int4_form
    from lrq.packed import PackedLinear
    if isinstance(mod, PackedLinear):
        if mod.quantize_output:
            return None
        w = mod.cpu_weights or mod.convert_for_cpu()
        int4, s = int4_form(w), mod.scheme
        bias = None if mod.bias is None else mod.bias.detach().to(dtype).contiguous()   # the forward's own cast
        bias_ptr = None if bias is None else bias.data_ptr()
        if mod._native_static(w, 1):   # the module's own one-token W8A8 kernel
            n, k = w.weight.shape
            return (native.Linear(3, 0, n, k, None, w.weight.data_ptr(), bias_ptr, w.wsum.data_ptr(),
                                  w.col_term.data_ptr(), w.zero_term.data_ptr(), w.scale.data_ptr(), w.asymmetric,
                                  *mod.native_static_grid()), (w, bias))
        if isinstance(w, Int8Weights):   # the module's own one-token int8 weight-only kernel
            if s.a_bits is not None or not w.native_for(1, dtype):
                return None
            (levels,), k = w.chunks, w.widths[0]
            if levels.stride(0) != (k + 15) // 16 * 16 or not levels.is_contiguous():
                return None
            return (native.Linear(4, 0, levels.shape[0], k, None, levels.data_ptr(), bias_ptr, None, None,
                                  w.zero_term.data_ptr(), w.scales.data_ptr()), (levels, w.scales, w.zero_term, bias))
        if int4 is None or int4.k != int4.packed.shape[1] * 2 or not int4.native_for(1, dtype):
            return None
        if int4 is w and s.a_bits is None:
            act = 0
        elif int4 is not w and not w.integer_call(1, dtype) and mod.per_token_dequantized_activations():
            act = s.a_bits
        else:
            return None
        layer = int4._native_layer()
        return native.Linear(1, act, int4.n, int4.k, layer[1], None, bias_ptr), (layer, bias)
    if type(mod) is nn.Linear and mod.weight.dtype == dtype and mod.weight.is_contiguous():
        bias = mod.bias
        if bias is not None and (bias.dtype != dtype or not bias.is_contiguous()):
            return None
        n, k = mod.weight.shape
        return (native.Linear(2, 0, n, k, None, mod.weight.data_ptr(), None if bias is None else bias.data_ptr()),
                (mod.weight.detach(), None if bias is None else bias.detach()))   # their storage, not the module's
    return None


class LeanDecoder:
    """Batch-`batch` generation state for `model` (not copied; its weights are used as they are held)."""

    def __init__(self, model: nn.Module, max_len: int, batch: int = 1):
        why = lean_support(model, max_len)
        if why:
            raise UserError(f"the lean runtime cannot run this model: {why}. Use the model's own forward "
                            f"(speed study: --runtime hf).")
        self.model, self.max_len, self.batch = model, max_len, batch
        inner, cfg = model.model, model.config
        self.layers = list(inner.layers)
        attn = self.layers[0].self_attn
        self.head_dim = attn.head_dim
        self.qk_norm = hasattr(attn, "q_norm")
        # the embedding's table (a PackedEmbedding, lrq.packed.quantize_head's, reads the head's levels: its dtype)
        emb = getattr(inner.embed_tokens, "weight", None)
        emb = emb if emb is not None else torch.empty(0, dtype=inner.embed_tokens.dtype)
        dtype = emb.dtype if emb.is_floating_point() else torch.float32
        shape = (len(self.layers), batch, cfg.num_key_value_heads, max_len, self.head_dim)
        # the key and value caches, as per-layer views made once (the views keep the two allocations alive)
        self.k_layers = torch.zeros(shape, dtype=dtype, device=emb.device).unbind(0)
        self.v_layers = torch.zeros(shape, dtype=dtype, device=emb.device).unbind(0)
        with torch.no_grad():
            pos = torch.arange(max_len, device=emb.device)[None]
            cos, sin = inner.rotary_emb(torch.zeros(1, dtype=dtype, device=emb.device), pos)
        half = self.head_dim // 2
        sin = sin[0].clone()
        sin[:, :half] = -sin[:, :half]            # roll(x, half) * sin' == rotate_half(x) * sin
        self.cos, self.sin = cos[0], sin
        self.length = 0
        # one-token steps with oneDNN off: its bf16 matrix-vector product reads the weights at about half the speed
        # of torch's own kernel (Zen 4, one thread: dense SmolLM2-135M 49 against 29 ms a token; the bf16 output
        # head of a packed model alike); True keeps oneDNN on for them
        self.onednn_decode = False
        # lrq.native's norm and attention kernels for one-token steps (bf16 or float32 caches), where they are built;
        # None: torch's operations (set it to None to compare)
        on_cpu = emb.device.type == "cpu"   # the C kernels read host memory: a model on a GPU keeps torch's operations
        self._lib = native.library() if dtype in (torch.bfloat16, torch.float32) and on_cpu else None
        # one-token steps of each decoder layer as one lrq.native call (lrq_decoder_layer_step) where every part of
        # it can be (see _fused_layer; every layer fused: the whole stack one call, lrq_decoder_layers_step); False:
        # the module path above (to compare)
        self.fused = True
        self._fused: list | None = None
        self._fused_stack = None   # the fused layers' struct addresses as one ctypes array (_fused_layers)
        # several tokens (a prefill) with lrq.native's row kernels for the norms, residual adds and SiLU products
        # (_layers_rows); False: torch's operations (to compare)
        self.rows_native = True
        # at the first forward, the weights a step streams moved into one region of huge pages (lrq.hugepages: the
        # same values, fewer page-table walks); False leaves them where they are (to compare)
        self.huge_pages = on_cpu
        self._huge_done = False

    def reset(self) -> None:
        """An empty cache; the fused layers' arguments are made again at the next step: weights replaced since
        (a new tensor, a new static grid) are read from then on; weights changed in place are read at every step."""
        self.length = 0
        self._fused = self._fused_stack = None

    def _fused_layer(self, i: int, layer: nn.Module) -> tuple | None:
        """(address of its lrq.native.DecoderLayer, what it points into) for a one-token step of layer i in one C
        call, or None (then its modules run): SiLU MLP, norms and linears lrq.native takes (_fused_linear), the
        model's dtype bf16 or float32."""
        cfg, a = self.model.config, layer.self_attn
        kc, vc = self.k_layers[i], self.v_layers[i]
        dtype = kc.dtype
        if getattr(cfg, "hidden_act", None) not in ("silu", "swish") or self._lib is None:
            return None
        parts = [_fused_linear(m, dtype) for m in _step_linears(layer)]
        norms = [layer.input_layernorm, layer.post_attention_layernorm] + (
            [a.q_norm, a.k_norm] if self.qk_norm else [])
        if any(p is None for p in parts) or any(n.weight.dtype != dtype or not n.weight.is_contiguous() for n in norms) \
                or layer.input_layernorm.variance_epsilon != layer.post_attention_layernorm.variance_epsilon:
            return None
        ptr = [n.weight.data_ptr() for n in norms] + [None, None]
        eps = [n.variance_epsilon for n in norms] + [0.0, 0.0]
        from lrq.quant import SCALE_EPS
        st = native.DecoderLayer(*[p[0] for p in parts], ptr[0], ptr[1], ptr[2], ptr[3], eps[0], eps[2], eps[3],
                                 a.scaling, SCALE_EPS, kc.data_ptr(), vc.data_ptr(), kc.stride(1),
                                 self.cos.data_ptr(), self.sin.data_ptr(), cfg.hidden_size,
                                 cfg.num_attention_heads, cfg.num_key_value_heads, self.head_dim,
                                 parts[4][0].n, dtype == torch.bfloat16, self.max_len)
        # what the struct points into is kept alive by reference to the storage (detached tensors), so a module whose
        # weight is replaced (e.g. `param.data = ...`) leaves this step reading the old, still valid values until the
        # next reset() makes the arguments again
        return ctypes.addressof(st), (st, parts, [n.weight.detach() for n in norms])

    def _huge_page_weights(self) -> int:
        """Moves the weights a step streams (each layer's linears in the order a step reads them, then the output head;
        the CPU forms packed models run) into one region of huge pages, once (lrq.hugepages.gather: copies, values
        unchanged; a tied embedding moves with the head). Returns how many tensors moved (0 where the kernel offers
        no huge pages). Modules keep their identity; a tensor held elsewhere keeps the old storage."""
        from lrq import hugepages
        from lrq.packed import PackedLinear, TableHead
        if getattr(self.model, "_lrq_huge_pages", False):   # moved by an earlier decoder of this model: once
            return 0
        slots = []   # (object, attribute): the copy replaces getattr(object, attribute); a Parameter's .data
        for layer in self.layers:
            for mod in _step_linears(layer):
                if isinstance(mod, PackedLinear) and not mod.quantize_output:
                    slots += _form_slots(mod.cpu_weights or mod.convert_for_cpu())
                elif type(mod) is nn.Linear:
                    slots.append((mod.weight, "data"))
        head = self.model.lm_head
        if type(head) is nn.Linear:
            slots.append((head.weight, "data"))
        elif isinstance(head, PackedLinear) and head.cpu_weights is not None:   # an int8 head (quantize_head)
            slots += _form_slots(head.cpu_weights)
        elif isinstance(head, TableHead):   # a float32 model's table held in bf16 (quantize_head's "bf16")
            slots.append((head, "weight"))
        held = [(o, n, o.data if n == "data" else getattr(o, n)) for o, n in slots]
        held = [(o, n, t[0] if n == "chunks" else t) for o, n, t in held]
        held = [(o, n, t) for o, n, t in held if t.device.type == "cpu" and t.is_contiguous()]
        copies = hugepages.gather([t for _, _, t in held])
        if copies is None:
            return 0
        for (obj, name, _), copy in zip(held, copies):
            if name == "data":
                obj.data = copy
            elif name == "chunks":
                obj.chunks = (copy,)
            else:
                setattr(obj, name, copy)
                if hasattr(obj, "native_args"):
                    obj.native_args = None   # its kernel arguments point into the old storage: made again when asked
        self.model._lrq_huge_pages = True
        del held, slots
        hugepages.release_freed()   # the old copies' pages back to the system, not kept by the C allocator
        return len(copies)

    def _fused_layers(self) -> list:
        if self._fused is None:
            self._fused = [self._fused_layer(i, layer) for i, layer in enumerate(self.layers)]
            # every layer fused: their structs' addresses in one array, the whole stack one call a step
            self._fused_stack = ((ctypes.c_void_p * len(self._fused))(*[f[0] for f in self._fused])
                                 if self._fused and all(f is not None for f in self._fused) else None)
        return self._fused

    def _layers(self, x: torch.Tensor, start: int, mask, lib, fused: list) -> torch.Tensor:
        """The decoder layers through their modules and torch's operations, a layer with fused arguments (a one-token
        step) as one lrq.native call."""
        if fused is self._fused and self._fused_stack is not None:   # every layer fused: one call for the stack
            rc = _native("decoder_layer", lib.lrq_decoder_layers_step, self._fused_stack, len(fused), x.data_ptr(),
                         start, torch.get_num_threads())
            native.checked(rc, "decoder layers")
            return x
        for i, layer in enumerate(self.layers):
            if fused[i] is not None:   # x is this step's own tensor: the layer's output is written into it
                rc = _native("decoder_layer", lib.lrq_decoder_layer_step, fused[i][0], x.data_ptr(), start,
                             torch.get_num_threads())
                native.checked(rc, "decoder layer")
                continue
            x = x + self._attention(i, layer, _rms(layer.input_layernorm, x, lib), start, mask, lib)
            mlp = layer.mlp
            h = _rms(layer.post_attention_layernorm, x, lib)
            g, u = mlp.gate_proj(h), mlp.up_proj(h)
            silu = lib is not None and getattr(self.model.config, "hidden_act", None) in ("silu", "swish")
            x = x + mlp.down_proj(_silu_mul(g, u, lib) if silu else mlp.act_fn(g) * u)
        return x

    def _layers_rows(self, x: torch.Tensor, start: int, mask, lib) -> torch.Tensor:
        """The decoder layers over several tokens with each residual add, the norm after it and the MLP's SiLU product
        as lrq.native row kernels (lrq_rms_norm_rows, lrq_silu_mul: one pass each where torch makes about twenty
        operations of an rms_norm on bf16) wherever the tensors allow, else torch's operations; the linears and the
        attention are the modules' and torch's as on the other path. x is the embedding's own output: the residual
        stream is added into it in place (the same rounding as x + r)."""
        x = x.contiguous()
        silu = getattr(self.model.config, "hidden_act", None) in ("silu", "swish")
        resid = None
        for i, layer in enumerate(self.layers):
            h = _add_norm(x, resid, layer.input_layernorm, lib)
            resid = self._attention(i, layer, h, start, mask, None, lib)
            h = _add_norm(x, resid, layer.post_attention_layernorm, lib)
            mlp = layer.mlp
            g, u = mlp.gate_proj(h), mlp.up_proj(h)
            resid = mlp.down_proj(_silu_mul(g, u, lib) if silu else mlp.act_fn(g) * u)
        _add_norm(x, resid, None, lib)
        return x

    def _rope(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        return torch.addcmul(x * cos, x.roll(self.head_dim // 2, -1), sin)

    def _attention(self, i: int, layer: nn.Module, h: torch.Tensor, start: int, mask, lib,
                   rows=None) -> torch.Tensor:
        """One layer's attention; `lib`: lrq.native for a one-token step of batch 1, else None (torch's operations);
        `rows`: lrq.native for several tokens (the q/k norms, RoPE and the cache write as row kernels; batch 1)."""
        a, (b, t, _) = layer.self_attn, h.shape
        end, hd = start + t, self.head_dim
        q = a.q_proj(h).view(b, t, -1, hd)
        k = a.k_proj(h).view(b, t, -1, hd)
        v = a.v_proj(h).view(b, t, -1, hd)
        if self.qk_norm and rows is not None:
            q, k = _add_norm(q, None, a.q_norm, rows), _add_norm(k, None, a.k_norm, rows)
        elif self.qk_norm:
            q, k = _rms(a.q_norm, q, lib), _rms(a.k_norm, k, lib)
        kc, vc = self.k_layers[i], self.v_layers[i]
        if rows is not None and b == 1 and _rows_ok(rows, q, k, v, self.cos, self.sin) and kc.dtype == q.dtype:
            # several tokens: RoPE (q in place: the projection's own output) and the cache write in one call, the
            # values a one-token step's lrq_rope_cache makes; the attention is torch's
            native.checked(_native("rope_cache_rows", rows.lrq_rope_cache_rows, q.data_ptr(), k.data_ptr(),
                                   v.data_ptr(), self.cos.data_ptr(), self.sin.data_ptr(), kc.data_ptr(),
                                   vc.data_ptr(), kc.stride(1), start, t, q.shape[2], kc.shape[1], hd,
                                   q.dtype == torch.bfloat16, torch.get_num_threads()), "rope/cache rows")
            o = F.scaled_dot_product_attention(q.transpose(1, 2), kc[:, :, :end], vc[:, :, :end], attn_mask=mask,
                                               is_causal=mask is None and start == 0 and t > 1,
                                               scale=a.scaling, enable_gqa=True)
            return a.o_proj(o.transpose(1, 2).reshape(b, t, -1))
        if lib is not None and all(x.is_contiguous() and x.dtype == kc.dtype for x in (q, k, v)):
            # one token: RoPE, the cache write and the attention as two lrq.native calls (q is roped in place: the
            # projection's own fresh output, nothing else holds it)
            rc = _native("rope_cache", lib.lrq_rope_cache, q.data_ptr(), k.data_ptr(), v.data_ptr(),
                         self.cos[start].data_ptr(), self.sin[start].data_ptr(), kc.data_ptr(), vc.data_ptr(),
                         kc.stride(1), start, q.shape[2], kc.shape[1], hd, q.dtype == torch.bfloat16)
            o = torch.empty(b, t, q.shape[2] * hd, dtype=q.dtype)
            rc = rc or _native("attend", lib.lrq_attend, q.data_ptr(), hd, kc.data_ptr(), vc.data_ptr(),
                               kc.stride(1), o.data_ptr(), q.dtype == torch.bfloat16, end, q.shape[2], kc.shape[1],
                               hd, a.scaling)
            native.checked(rc, "rope/attention")
            return a.o_proj(o)
        v = v.transpose(1, 2)
        cos, sin = self.cos[start:end, None], self.sin[start:end, None]    # [t, 1, hd] against [b, t, heads, hd]
        kc[:, :, start:end] = self._rope(k, cos, sin).transpose(1, 2)
        vc[:, :, start:end] = v
        q = self._rope(q, cos, sin).transpose(1, 2)
        o = F.scaled_dot_product_attention(q, kc[:, :, :end], vc[:, :, :end], attn_mask=mask,
                                           is_causal=mask is None and start == 0 and t > 1,
                                           scale=a.scaling, enable_gqa=True)
        return a.o_proj(o.transpose(1, 2).reshape(b, t, -1))

    @torch.no_grad()
    def forward(self, ids: torch.Tensor, keep: int = 1) -> torch.Tensor:
        """Append `ids` [batch, t] to the sequence; the logits of its last `keep` positions [batch, keep, vocab]."""
        b, t = ids.shape
        start = self.length
        if b != self.batch:
            raise UserError(f"this LeanDecoder holds a cache for batch {self.batch}, got {b} rows")
        if start + t > self.max_len:
            raise UserError(f"{start + t} positions exceed the lean cache's {self.max_len}: make the LeanDecoder "
                            f"with a larger max_len")
        mask = None
        if t > 1 and start > 0:   # a chunk after cached tokens: row j sees keys up to start + j
            mask = torch.ones(t, start + t, dtype=torch.bool, device=ids.device).tril(start)
        if self.huge_pages and not self._huge_done:   # before any struct points into the weights
            self._huge_done = True
            self._fused = self._fused_stack = None
            self._huge_page_weights()
        with onednn(False if t == 1 and not self.onednn_decode else torch.backends.mkldnn.enabled):
            inner = self.model.model
            lib = self._lib if t == 1 and b == 1 else None
            x = inner.embed_tokens(ids)
            # the fused layers' arguments are made at the first step after a reset, prefill included (so a timed
            # decode loop does not pay for them)
            made = self._fused_layers() if self.fused and self._lib is not None and b == 1 else None
            fused = made if lib is not None and made is not None else [None] * len(self.layers)
            if any(fused):
                x = x.contiguous() if x.is_contiguous() else x.clone(memory_format=torch.contiguous_format)
            rows = self._lib if lib is None and self.rows_native else None
            if rows is not None:   # several tokens: the norms, residual adds and SiLU products as lrq.native rows
                x = self._layers_rows(x, start, mask, rows)
            else:
                x = self._layers(x, start, mask, lib, fused)
            self.length = start + t
            h, head = _rms(inner.norm, x[:, -keep:], lib), self.model.lm_head
            if (any(fused) and type(head) is nn.Linear and head.bias is None and head.weight.dtype == h.dtype
                    and head.weight.is_contiguous() and h.is_contiguous()):
                # the head through lrq's GEMV too (dense and packed models alike: every format keeps it dense;
                # one lrq.packed.quantize_head packed runs its own forward, lrq's int8 kernel)
                y = torch.empty(*h.shape[:-1], head.out_features, dtype=h.dtype)
                native.checked(_native("head", lib.lrq_dense_gemv, head.weight.data_ptr(), h.data_ptr(),
                                       y.data_ptr(), h.dtype == torch.bfloat16, head.out_features,
                                       head.in_features, torch.get_num_threads()), "output head")
                return y
            return head(h)

    @torch.no_grad()
    def greedy(self, prompt: torch.Tensor, steps: int) -> torch.Tensor:
        """From an empty cache: the `steps` greedy tokens after `prompt` [batch, t] ([batch, steps])."""
        self.reset()
        nxt = greedy_tokens(self.forward(prompt))
        out = [nxt]
        for _ in range(steps - 1):
            nxt = greedy_tokens(self.forward(nxt))
            out.append(nxt)
        return torch.cat(out, dim=1)
