"""Swap a model's linears for QuantLinear modules: the one place where the model is rewritten."""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn
from tqdm.auto import tqdm

from lrq.arch import KV_LINEARS, block_linears, decoder_blocks, iter_linears, set_submodule
from lrq.qlinear import QuantLinear
from lrq.schemes import Scheme

QParamsFn = Callable[[str, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]


def quant_linear_for(linear: nn.Linear, name: str, scheme: Scheme, scale: torch.Tensor, zero: torch.Tensor,
                     weight: torch.Tensor | None = None) -> QuantLinear:
    return QuantLinear.from_linear(linear, scheme, scale, zero, weight=weight,
                                   quantize_output=name in KV_LINEARS)


def quantized_block_restorer(scheme: Scheme, act_quant_enabled: bool = True):
    """`restore(index, block, state)` for lrq.blockwise.walk_blocks: turn a block's linears into QuantLinears of
    `scheme` and load a checkpointed block state into it (the quantized block the method had made;
    `act_quant_enabled` as the method's walk left it, so recomputed streams are the walk's own)."""
    def restore(i: int, block: nn.Module, state: dict) -> None:
        for name, lin in block_linears(block).items():
            q = QuantLinear(lin.in_features, lin.out_features, lin.bias is not None, scheme,
                            quantize_output=name in KV_LINEARS)
            q.act_quant_enabled = act_quant_enabled
            set_submodule(block, name, q)
        block.load_state_dict(state)
    return restore


@torch.no_grad()
def replace_linears(model: nn.Module, scheme: Scheme, qparams: QParamsFn) -> None:
    """Replace every block linear by a QuantLinear on the grid `qparams(full_name, weight)` returns."""
    blocks = decoder_blocks(model)
    todo = list(iter_linears(model))
    for i, name, lin in tqdm(todo, desc=f"quantize {scheme.name}", leave=False):
        if isinstance(lin, QuantLinear):
            continue
        scale, zero = qparams(f"model.layers.{i}.{name}", lin.weight.data)
        set_submodule(blocks[i], name, quant_linear_for(lin, name, scheme, scale, zero))


def model_bits_per_weight(model: nn.Module) -> float:
    """Average storage bits per quantized weight (with scales and zero points)."""
    total_bits = total = 0.0
    for m in model.modules():
        if isinstance(m, QuantLinear):
            n = m.in_features * m.out_features
            total += n
            total_bits += n * m.bits_per_weight()
    return total_bits / total if total else 16.0
