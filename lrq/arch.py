"""Find decoder blocks and their seven linear layers in Llama/Mistral/Qwen2-style causal LMs.

Methods never walk the model themselves; they get blocks and linears from here.
"""

from __future__ import annotations

from collections.abc import Iterator

from torch import nn

from lrq.errors import UserError

# The block layout, declared once. Input groups: linears sharing one input, in the order a block computes
# them; each with the module whose output is that input (a norm, or the projection feeding it), which is where
# a per-channel scale of the group's inputs can be folded. Methods, the planner and the workers read these.
INPUT_GROUPS: dict[str, tuple[str, tuple[str, ...]]] = {
    "qkv": ("input_layernorm", ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj")),
    "vo": ("self_attn.v_proj", ("self_attn.o_proj",)),
    "gate_up": ("post_attention_layernorm", ("mlp.gate_proj", "mlp.up_proj")),
    "up_down": ("mlp.up_proj", ("mlp.down_proj",)),
}
# Where a family puts another module in front of a group's linears (the first of these the block has wins over the
# group's producer above): Gemma 2/3's MLP reads pre_feedforward_layernorm (its post_attention_layernorm sits on the
# attention output before the residual add).
ALT_PRODUCERS: dict[str, tuple[str, ...]] = {"gate_up": ("pre_feedforward_layernorm",)}
# Every decoder block of a supported model has exactly these linears (attribute paths within the block).
LINEAR_NAMES: tuple[str, ...] = tuple(name for _, group in INPUT_GROUPS.values() for name in group)
KV_LINEARS = ("self_attn.k_proj", "self_attn.v_proj")
QK_LINEARS = ("self_attn.q_proj", "self_attn.k_proj")   # their outputs meet in the attention scores (after RoPE)
ATTENTION_LINEARS: tuple[str, ...] = tuple(n for n in LINEAR_NAMES if n.startswith("self_attn."))


def group_scope(group: str) -> str:
    """The smallest module holding every linear of an input group (`INPUT_GROUPS`): the group's own linear where it
    has one (vo: o_proj), else their common parent (qkv: self_attn, gate_up: mlp). Its output is where a change
    of the group's weights shows first."""
    parts = [name.split(".") for name in INPUT_GROUPS[group][1]]
    common = [p[0] for p in zip(*parts) if len(set(p)) == 1]
    return ".".join(common)


SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3", "gemma2", "gemma3_text")


def _get(module: nn.Module, path: str) -> nn.Module | None:
    for part in path.split("."):
        module = getattr(module, part, None)
        if module is None:
            return None
    return module


def decoder_blocks(model: nn.Module) -> nn.ModuleList:
    """The ModuleList of decoder blocks, checked to hold the seven expected linears."""
    model_type = getattr(getattr(model, "config", None), "model_type", type(model).__name__)
    layers = _get(model, "model.layers")
    ok = isinstance(layers, nn.ModuleList) and len(layers) > 0 and all(
        isinstance(_get(layers[0], n), nn.Module) for n in LINEAR_NAMES)
    if not ok:
        raise UserError(
            f"model type {model_type!r} is not supported: lrq-bench quantizes Llama/Mistral/Qwen2-style "
            f"decoders (model.model.layers[i] with self_attn.q/k/v/o_proj and mlp.gate/up/down_proj); "
            f"supported model types: {', '.join(SUPPORTED_MODEL_TYPES)}."
        )
    return layers


def block_linears(block: nn.Module) -> dict[str, nn.Module]:
    return {name: _get(block, name) for name in LINEAR_NAMES}


def set_submodule(root: nn.Module, path: str, new: nn.Module) -> None:
    parent_path, _, attr = path.rpartition(".")
    parent = _get(root, parent_path) if parent_path else root
    setattr(parent, attr, new)


def iter_linears(model: nn.Module) -> Iterator[tuple[int, str, nn.Module]]:
    """(block index, name within block, module) for every quantizable linear, in execution order."""
    for i, block in enumerate(decoder_blocks(model)):
        for name, mod in block_linears(block).items():
            yield i, name, mod
