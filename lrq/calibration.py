"""Calibration passes shared by methods: static per-tensor activation ranges."""

from __future__ import annotations

import torch
from torch import nn
from tqdm.auto import tqdm

from lrq import precision, progress
from lrq.qlinear import QuantLinear


def decoder_body(model: nn.Module) -> nn.Module:
    """The model without its output head (transformers' `get_decoder()`: embeddings, blocks, final norm), or the
    model itself where it has none. The calibration passes observe the blocks' linears only (the head is never
    quantized), and the logits of a batch of windows over a 262,144-token vocabulary (Gemma 3) take gigabytes."""
    get = getattr(model, "get_decoder", None)
    body = get() if callable(get) else None
    return body if isinstance(body, nn.Module) and body is not model else model


@torch.no_grad()
def run_calibration(model: nn.Module, input_ids: torch.Tensor, desc: str = "calibration", batch_size: int = 1) -> None:
    """Forward every calibration window through the model's decoder (`decoder_body`: no logits), at the run's
    precision (lrq.precision), as evaluation runs."""
    device = next(model.parameters()).device
    body = decoder_body(model)
    with precision.autocast(device):
        for i in tqdm(range(0, len(input_ids), batch_size), desc=desc, leave=False):
            progress.update(f"{desc} {i + 1}/{len(input_ids)}")
            body(input_ids[i:i + batch_size].to(device), use_cache=False)


def calibrate_static_activations(model: nn.Module, input_ids: torch.Tensor) -> int:
    """Set every static activation quantizer's range from the min/max it sees on the calibration set.

    All quantizers observe in one pass with activation quantization off, so each range is that of the
    layer's input under floating-point activations (weights as they are now). Returns the count set.
    """
    layers = [m for m in model.modules() if isinstance(m, QuantLinear) and m.scheme.static_activations]
    if not layers:
        return 0
    for m in layers:
        m.start_observing()
    try:
        run_calibration(model, input_ids, desc="static activation ranges")
    finally:
        for m in layers:
            if m._observer is not None:
                m.finish_observing()
            m._observing = False
    missing = [m for m in layers if not m.act_calibrated]
    if missing:
        raise RuntimeError(f"{len(missing)} static activation quantizers saw no input during calibration")
    return len(layers)


@torch.no_grad()
def observe_input_ranges(model: nn.Module, input_ids: torch.Tensor) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """Per-tensor (min, max) of every block linear's input over the calibration set, on the model as it
    is (e.g. the floating-point, smoothed model before reconstruction). Keys: 'model.layers.i.<name>'."""
    from lrq.arch import iter_linears
    ranges: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
    handles = []

    def hook(name):
        def fn(_mod, args):
            x = args[0].detach().float()
            lo, hi = x.amin(), x.amax()
            if name in ranges:
                lo, hi = torch.minimum(lo, ranges[name][0]), torch.maximum(hi, ranges[name][1])
            ranges[name] = (lo, hi)
        return fn

    for i, name, mod in iter_linears(model):
        handles.append(mod.register_forward_pre_hook(hook(f"model.layers.{i}.{name}")))
    try:
        run_calibration(model, input_ids, desc="activation ranges")
    finally:
        for h in handles:
            h.remove()
    return ranges
