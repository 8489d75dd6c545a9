"""The one quantized linear module every method produces and every backend executes.

It stores what a deployment stores: unsigned integer weight levels, per-row (or per-group) scales and
integer zero points, and, by scheme, the activation quantizer (per-token dynamic or per-tensor static)
and an optional per-token quantizer on the output (K/V cache). The forward pass simulates the scheme
with fake quantization (dequantize once, cache the float weight); issue D's packed kernels replace the
forward without changing what is stored.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from lrq.quant import (dequantize, per_tensor_fake_quant, per_token_fake_quant, qparams_from_range, quantize,
                       weight_bits_per_element)
from lrq.schemes import Scheme


class QuantLinear(nn.Module):
    def __init__(self, in_features: int, out_features: int, bias: bool, scheme: Scheme, quantize_output: bool = False):
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.scheme = scheme
        self.bits, self.group_size = scheme.w_bits, scheme.group_size
        ng = 1 if scheme.group_size is None else -(-in_features // scheme.group_size)
        self.register_buffer("qweight", torch.zeros(out_features, in_features, dtype=torch.uint8))
        self.register_buffer("scale", torch.ones(out_features, ng))
        self.register_buffer("zero", torch.zeros(out_features, ng))
        self.register_buffer("bias", torch.zeros(out_features) if bias else None)
        # Static per-tensor activation range (w8a8); set by lrq.calibration.calibrate_static_activations.
        self.register_buffer("act_scale", torch.ones(()) if scheme.static_activations else None)
        self.register_buffer("act_zero", torch.zeros(()) if scheme.static_activations else None)
        self.act_calibrated = False
        self.act_quant_enabled = True
        self.quantize_output = quantize_output and scheme.kv_bits is not None
        self._observer: tuple[torch.Tensor, torch.Tensor] | None = None
        self._observing = False
        self._w_cache: torch.Tensor | None = None

    # ---- construction -------------------------------------------------------------------------
    @classmethod
    def from_linear(cls, linear: nn.Linear, scheme: Scheme, scale: torch.Tensor, zero: torch.Tensor,
                    weight: torch.Tensor | None = None, quantize_output: bool = False) -> "QuantLinear":
        """Quantize `weight` (default: the linear's own) on the grid given by scale/zero."""
        m = cls(linear.in_features, linear.out_features, linear.bias is not None, scheme, quantize_output)
        w = linear.weight.data if weight is None else weight
        m.set_weight(quantize(w, scale, zero, scheme.w_bits, scheme.group_size), scale, zero)
        if linear.bias is not None:
            m.bias.copy_(linear.bias.data.float())
        return m.to(linear.weight.device)

    def set_weight(self, q: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor) -> None:
        self.qweight.copy_(q)
        self.scale.copy_(scale.float())
        self.zero.copy_(zero.float())
        self._w_cache = None

    def dequantized_weight(self) -> torch.Tensor:
        if self._w_cache is None or self._w_cache.device != self.qweight.device:
            self._w_cache = dequantize(self.qweight, self.scale, self.zero, self.group_size)
        return self._w_cache

    def _apply(self, fn, *args, **kwargs):
        self._w_cache = None
        return super()._apply(fn, *args, **kwargs)

    # ---- activation calibration ---------------------------------------------------------------
    def start_observing(self) -> None:
        self._observing, self._observer = True, None

    def finish_observing(self) -> None:
        """Fix the static per-tensor range from the observed min/max (asymmetric, includes 0)."""
        if self._observer is None:
            raise RuntimeError("no activations were observed for a static activation quantizer")
        lo, hi = self._observer
        self.set_static_range(*qparams_from_range(lo.clamp(max=0), hi.clamp(min=0), self.scheme.a_bits))
        self._observing, self._observer = False, None

    def _observe(self, x: torch.Tensor) -> None:
        lo, hi = x.detach().float().amin(), x.detach().float().amax()
        if self._observer is not None:
            lo, hi = torch.minimum(lo, self._observer[0]), torch.maximum(hi, self._observer[1])
        self._observer = (lo, hi)

    # ---- forward ------------------------------------------------------------------------------
    def quantize_input(self, x: torch.Tensor) -> torch.Tensor:
        s = self.scheme
        if s.a_bits is None or not self.act_quant_enabled:
            return x
        if not s.activations.static:
            return s.activations.quantize(x, s.a_bits)
        if self._observing:
            self._observe(x)
            return x
        if not self.act_calibrated:
            raise RuntimeError(
                "static activation scales were never calibrated; run lrq.calibration.calibrate_static_activations")
        return per_tensor_fake_quant(x, self.act_scale, self.act_zero, s.a_bits)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.quantize_input(x)
        w = self.dequantized_weight()
        y = F.linear(x, w.to(x.dtype) if not torch.is_autocast_enabled(x.device.type) else w,
                     None if self.bias is None else self.bias.to(x.dtype))
        if self.quantize_output:
            y = per_token_fake_quant(y, self.scheme.kv_bits)
        return y

    def get_extra_state(self):
        return {"act_calibrated": self.act_calibrated}

    def set_extra_state(self, state):
        self.act_calibrated = bool(state.get("act_calibrated", False))

    def set_static_range(self, scale: torch.Tensor, zero: torch.Tensor) -> None:
        """Fix the per-tensor static activation range (computed elsewhere, e.g. on the FP model)."""
        self.act_scale.copy_(scale)
        self.act_zero.copy_(zero)
        self.act_calibrated = True

    # ---- accounting ---------------------------------------------------------------------------
    def bits_per_weight(self) -> float:
        return weight_bits_per_element(self.bits, self.group_size, self.in_features)

    def extra_repr(self) -> str:
        return (f"in={self.in_features}, out={self.out_features}, scheme={self.scheme.name}, "
                f"bits={self.bits}, group={self.group_size}")
