"""Linear layers under block reconstruction: frozen FP weight, fixed integer zero point, learnable
log-space scales (METHOD.md section 1). FlexRound and LRQ differ only in the per-weight divisor D.

    W_int = clamp(round_ste(W / exp(D)), -z, 2^b - 1 - z),   W_hat = W_int * exp(theta1)

After training, `freeze()` returns a plain QuantLinear holding q = W_int + z, scale exp(theta1) and z:
the deployed format is ordinary asymmetric integers, so the learned scaling costs nothing at inference.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from lrq.qlinear import QuantLinear
from lrq.quant import expand_groups, per_tensor_fake_quant, per_token_fake_quant, round_ste
from lrq.schemes import Scheme


class _RoundScaled(torch.autograd.Function):
    """W_hat = clamp(round(W * exp(-D)), -z, qmax - z) * exp(theta1) with the straight-through estimator,
    fused: one forward pass and one backward pass over the weight instead of a dozen autograd nodes
    (the element-wise chain dominates a reconstruction step on the CPU otherwise).

    Gradients: with v = W exp(-D) and m = 1 inside the clamp range (STE through round and clamp),
      dL/dD      = -g * exp(theta1) * m * v
      dL/dlog_s1 = g * W_int * exp(theta1)     (the direct path; theta1's path through D adds dL/dD)
    """

    @staticmethod
    def forward(ctx, weight, d, log_s1, lo, hi):
        v = weight * torch.exp(-d)
        r = torch.round(v)
        w_int = torch.minimum(torch.maximum(r, lo), hi)
        s1 = torch.exp(log_s1)
        ctx.save_for_backward(v, w_int, s1, r, lo, hi)
        return w_int * s1

    @staticmethod
    def backward(ctx, g):
        v, w_int, s1, r, lo, hi = ctx.saved_tensors
        gs = g * s1
        inside = (r >= lo) & (r <= hi)
        grad_d = torch.where(inside, -gs * v, 0.0)
        grad_log_s1 = gs * w_int
        return None, grad_d, grad_log_s1, None, None


class LearnableQuantLinear(nn.Module):
    def __init__(self, linear: nn.Linear, scheme: Scheme, scale: torch.Tensor, zero: torch.Tensor,
                 quantize_output: bool = False, act_range: tuple[torch.Tensor, torch.Tensor] | None = None,
                 act_quant: bool = False):
        super().__init__()
        self.scheme, self.bits, self.group_size = scheme, scheme.w_bits, scheme.group_size
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.register_buffer("weight", linear.weight.detach().float().clone())
        self.register_buffer("bias", None if linear.bias is None else linear.bias.detach().float().clone())
        self.register_buffer("zero", zero.detach().float().clone())
        self.theta1 = nn.Parameter(torch.log(scale.detach().float()).clone())     # [Cout, n_groups]
        self.quantize_output = quantize_output and scheme.kv_bits is not None
        # Static activation range (w8a8), fixed before reconstruction; used when act_quant is on.
        self.act_range = act_range
        self.act_quant = act_quant

    # subclasses: the learnable part of log(divisor) beyond theta1, broadcastable to [Cout, Cin]
    def extra_log_divisor(self) -> torch.Tensor | float:
        raise NotImplementedError

    def _expand(self, t: torch.Tensor) -> torch.Tensor:
        return expand_groups(t, self.group_size, self.in_features)

    def w_int(self) -> torch.Tensor:
        qmax = 2**self.bits - 1
        z = self._expand(self.zero)
        d = self._expand(self.theta1) + self.extra_log_divisor()
        return torch.clamp(round_ste(self.weight / torch.exp(d)), -z, qmax - z)

    def w_hat(self) -> torch.Tensor:
        z = self._expand(self.zero)
        t1 = self._expand(self.theta1)
        return _RoundScaled.apply(self.weight, t1 + self.extra_log_divisor(), t1, -z, 2**self.bits - 1 - z)

    def quantize_input(self, x: torch.Tensor) -> torch.Tensor:
        s = self.scheme
        if not self.act_quant or s.a_bits is None:
            return x
        if not s.activations.static:
            return s.activations.quantize(x, s.a_bits)
        return per_tensor_fake_quant(x, self.act_range[0], self.act_range[1], s.a_bits)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = F.linear(self.quantize_input(x), self.w_hat().to(x.dtype),
                     None if self.bias is None else self.bias.to(x.dtype))
        if self.quantize_output and self.act_quant:
            y = per_token_fake_quant(y, self.scheme.kv_bits)
        return y

    def learnables(self) -> list[nn.Parameter]:
        return list(self.parameters())  # the FP weight, bias and zero point are buffers

    def n_learnable(self) -> int:
        return sum(p.numel() for p in self.learnables())

    @torch.no_grad()
    def freeze(self, half: bool = False) -> QuantLinear:
        """Integers + per-channel (or per-group) scale and zero point; the learnables are dropped. `half`: the
        integers and scales computed in fp16, as the authors' code does after `.half()` of the model."""
        q = QuantLinear(self.in_features, self.out_features, self.bias is not None, self.scheme,
                        self.quantize_output)
        if half:
            z = self._expand(self.zero).half()
            d = (self._expand(self.theta1) + self.extra_log_divisor()).half()
            w_int = torch.clamp(torch.round(self.weight.half() / torch.exp(d)), -z, 2**self.bits - 1 - z).float()
            scale = torch.exp(self.theta1.half()).float()
        else:
            scale = torch.exp(self.theta1)
            w_int = self.w_int()
        q.set_weight((w_int + self._expand(self.zero)).round().to(torch.uint8), scale, self.zero)
        if self.bias is not None:
            q.bias.copy_(self.bias)
        if self.scheme.static_activations and self.act_range is not None:
            q.set_static_range(*self.act_range)
        return q.to(self.weight.device)
