"""Model shapes for the planner (bench.run.plan): a decoder's widths, heads, vocabulary and attention kinds, from its
config alone (no weights), and the shapes written here (Llama-2's published configurations, the built-in models')."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from lrq.arch import SUPPORTED_MODEL_TYPES
from lrq.errors import UserError


#: model types whose decoder block the planner's cost model describes as it is (the others are priced as the
#: same widths in that form, and their estimate is labelled rough)
KNOWN_BLOCKS = SUPPORTED_MODEL_TYPES + ("gemma3",)   # the models lrq.arch supports; gemma3: the multimodal config


@dataclass(frozen=True)
class ModelShape:
    """A decoder's shape, from its config alone: widths, heads and head_dim (which Gemma sets apart from
    hidden / heads), vocabulary, whether the output head is the embedding (tied: one matrix), the MLP kind
    (gated: gate, up, down; plain: up, down) and the attention kind of each layer (a sliding window attends to
    at most `sliding_window` tokens)."""
    name: str
    hidden: int
    intermediate: int
    layers: int
    heads: int
    kv_heads: int
    vocab: int
    head_dim_: int | None = None          # None: hidden // heads
    tied: bool = False
    mlp: str = "gated"
    sliding_window: int | None = None
    sliding_layers: int = 0               # how many of the layers attend through the window
    model_type: str | None = None
    rough: str = ""                       # why the estimate is rough ("" when the block is one the model knows)

    @property
    def head_dim(self) -> int:
        return self.head_dim_ or self.hidden // self.heads

    def linears(self) -> list[tuple[int, int]]:
        """(in, out) of the block's linears: q, k, v, o, then gate, up, down (gated) or up, down (plain)."""
        h, i = self.hidden, self.intermediate
        q, kv = self.heads * self.head_dim, self.kv_heads * self.head_dim
        mlp = [(h, i), (h, i), (i, h)] if self.mlp == "gated" else [(h, i), (i, h)]
        return [(h, q), (h, kv), (h, kv), (q, h), *mlp]

    def block_params(self) -> int:
        return sum(a * b for a, b in self.linears())

    def params(self) -> int:
        return self.layers * (self.block_params() + 2 * self.hidden) + (1 if self.tied else 2) * self.vocab * self.hidden

    def _attention_flops(self, tokens: float, seq: int, window: int | None) -> float:
        """QK^T and AV of one layer on `tokens` tokens in causal windows of `seq`: 4 x heads x head_dim x the mean
        number of keys a query sees (seq / 2 in full causal attention, about the window when it is shorter)."""
        if window and window < seq:
            keys = window - window * (window - 1) / (2.0 * seq)
        else:
            keys = (seq + 1) / 2.0
        return 4.0 * self.heads * self.head_dim * keys * tokens

    def block_fwd_flops(self, tokens: float, seq: int) -> float:
        """Matmuls of the model's mean block on `tokens` tokens in windows of `seq` (its sliding-window layers
        attend to fewer keys than its full-attention ones)."""
        full = self.layers - self.sliding_layers
        attn = (full * self._attention_flops(tokens, seq, None)
                + self.sliding_layers * self._attention_flops(tokens, seq, self.sliding_window)) / self.layers
        return 2.0 * self.block_params() * tokens + attn

    def model_fwd_flops(self, tokens: float, seq: int) -> float:
        return self.layers * self.block_fwd_flops(tokens, seq) + 2.0 * self.hidden * self.vocab * tokens

    def probe_shape(self) -> list[int]:
        """The widths a measured probe is keyed by (head_dim only where it is not hidden / heads, so keys made
        before it was recorded still hold)."""
        base = [self.hidden, self.intermediate, self.heads, self.kv_heads]
        return base + ([self.head_dim] if self.head_dim_ and self.head_dim_ != self.hidden // self.heads else [])


# Shapes written here (a config is a handful of numbers): Llama-2's published configurations; the built-in models'.
SHAPES: dict[str, ModelShape] = {
    "llama-2-7b": ModelShape("llama-2-7b", 4096, 11008, 32, 32, 32, 32000, model_type="llama"),
    "llama-2-13b": ModelShape("llama-2-13b", 5120, 13824, 40, 40, 40, 32000, model_type="llama"),
    "llama-2-70b": ModelShape("llama-2-70b", 8192, 28672, 80, 64, 8, 32000, model_type="llama"),
    "smollm2-135m": ModelShape("smollm2-135m", 576, 1536, 30, 9, 3, 49152, 64, tied=True, model_type="llama"),
    # 15 of its 18 layers attend through a 512-token window (5 sliding, then 1 full, three times)
    "gemma3-270m": ModelShape("gemma3-270m", 640, 2048, 18, 4, 1, 262144, 256, tied=True, sliding_window=512,
                              sliding_layers=15, model_type="gemma3_text"),
}

#: where other families keep the numbers the planner needs (first present wins)
_ALIASES = {"hidden": ("hidden_size", "n_embd", "d_model", "dim"),
            "layers": ("num_hidden_layers", "n_layer", "num_layers", "n_layers"),
            "heads": ("num_attention_heads", "n_head", "num_heads", "n_heads"),
            "intermediate": ("intermediate_size", "n_inner", "ffn_dim", "ffn_hidden_size", "hidden_dim"),
            "vocab": ("vocab_size", "n_vocab", "padded_vocab_size")}
#: activations of gated MLPs (SwiGLU, GeGLU) in families the planner does not know; GPT-2's gelu_new is a plain MLP's
_GATED_ACTS = ("silu", "swish", "gelu_pytorch_tanh", "geglu", "swiglu")


def shape_from_config(name: str, cfg: Any) -> ModelShape:
    """The shape of any decoder from its config: layers, widths, heads, head_dim, vocabulary, tied head, MLP kind
    and attention kind of each layer. A model type whose block the cost model does not know (`KNOWN_BLOCKS`) is
    priced from the same numbers as a Llama-style block and labelled rough; only a config without the widths
    at all (not a decoder's) is refused."""
    if not isinstance(cfg, dict):
        cfg = cfg.to_dict() if hasattr(cfg, "to_dict") else vars(cfg)
    text = cfg.get("text_config")
    if isinstance(text, dict) and not any(k in cfg for k in _ALIASES["hidden"]):
        cfg = text | {"model_type": text.get("model_type") or cfg.get("model_type"),
                      "tie_word_embeddings": cfg.get("tie_word_embeddings", text.get("tie_word_embeddings"))}

    def num(field: str) -> int | None:
        for k in _ALIASES[field]:
            v = cfg.get(k)
            if isinstance(v, int) and not isinstance(v, bool) and v > 0:
                return v
        return None
    model_type = cfg.get("model_type")
    hidden, layers, heads, vocab = num("hidden"), num("layers"), num("heads"), num("vocab")
    missing = [f for f, v in (("hidden_size", hidden), ("num_hidden_layers", layers), ("num_attention_heads", heads),
                              ("vocab_size", vocab)) if v is None]
    if missing:
        raise UserError(f"{name}: its configuration (model type {model_type!r}) has no usable {', '.join(missing)}, "
                        f"so it is not a decoder the planner can price: give a causal LM's config.json, folder or "
                        f"hub id, or one of {', '.join(SHAPES)}.")
    rough = []
    intermediate = num("intermediate")
    if intermediate is None:
        intermediate = 4 * hidden
        rough.append("no intermediate_size in the config: 4 x hidden assumed")
    kv = cfg.get("num_key_value_heads") or cfg.get("num_kv_heads") or heads
    head_dim = cfg.get("head_dim") if isinstance(cfg.get("head_dim"), int) and cfg.get("head_dim") > 0 else None
    act = str(cfg.get("hidden_act") or cfg.get("hidden_activation") or cfg.get("activation_function") or "silu")
    mlp = "gated" if model_type in KNOWN_BLOCKS or act in _GATED_ACTS else "plain"
    window = cfg.get("sliding_window") if isinstance(cfg.get("sliding_window"), int) else None
    types = cfg.get("layer_types")
    if isinstance(types, list) and len(types) == layers:
        sliding = sum(t == "sliding_attention" for t in types)
    elif window and (cfg.get("use_sliding_window", model_type == "mistral")):
        sliding = max(0, layers - int(cfg.get("max_window_layers") or 0)) if model_type in ("qwen2", "qwen3") else layers
    else:
        sliding = 0
    if model_type not in KNOWN_BLOCKS:
        rough.insert(0, f"model type {model_type!r} is not one whose block the planner knows "
                        f"({', '.join(KNOWN_BLOCKS)}): priced as a {mlp} Llama-style block of the same widths")
    return ModelShape(name, hidden, intermediate, layers, heads, int(kv), vocab, head_dim,
                      tied=bool(cfg.get("tie_word_embeddings", False)), mlp=mlp,
                      sliding_window=window if sliding else None, sliding_layers=sliding if window else 0,
                      model_type=model_type, rough="; ".join(rough))


def load_shape(spec: str) -> ModelShape:
    """A built-in shape name, a config.json file, a model folder, or a hub id (config only, no weights)."""
    if spec in SHAPES:
        return SHAPES[spec]
    path = Path(spec).expanduser()
    if path.is_dir():
        path = path / "config.json"
    if path.is_file():
        try:
            cfg = json.loads(path.read_text())
        except (OSError, UnicodeDecodeError, ValueError) as e:
            raise UserError(f"cannot read the model configuration {path} ({type(e).__name__}: {e}).") from None
        if not isinstance(cfg, dict):
            raise UserError(f"{path} is not a model configuration (a JSON object expected).")
        return shape_from_config(spec, cfg)
    try:
        from transformers import AutoConfig
        cfg = AutoConfig.from_pretrained(spec)
    except Exception as e:  # noqa: BLE001 (any failure to find a config is the same bad input)
        raise UserError(f"cannot read a model configuration for {spec!r} ({type(e).__name__}): give one of "
                        f"{', '.join(SHAPES)}, a config.json, a model folder or a reachable hub id.") from None
    return shape_from_config(spec, cfg)
