"""OmniQuant (Shao et al., ICLR 2024, arXiv 2308.13137) on the shared block-reconstruction engine.

Two kinds of learnables, trained block by block against the FP block's output (lrq.engine):

* LWC, learnable weight clipping: per output row (or group) two logits gamma, beta clip the range,
      hi = sigmoid(gamma) * max(W),  lo = sigmoid(beta) * min(W),
      s = (hi - lo) / (2^b - 1),  z = round(-lo / s),
      W_hat = (clamp(round_ste(W / s) + z, 0, 2^b - 1) - z) * s
  initialised at gamma = beta = 4 (sigmoid 0.982), as the authors do; z carries no gradient (round).
* LET, learnable equivalent transformation: per-channel scales s on the input of a group of linears,
  W' = W diag(s), x' = x / s, folded into the producer after training, so the deployed model is an
  ordinary quantized model. Pairs as the authors' Llama code: qkv (input_layernorm -> q, k, v),
  gate_up (post_attention_layernorm, Gemma's pre_feedforward_layernorm -> gate, up) and vo (v_proj rows -> o_proj columns, mapped across
  grouped-query heads). Initialised from SmoothQuant's s = max|X|^alpha / max|W|^(1-alpha) (alpha 0.5).

Deviations from the authors' code, each deliberate and recorded with the result:
* LET scales are learned in log space (the authors learn s directly): the same relative step size, and
  a scale can never cross zero and divide by it;
* no channel-wise shift: Llama/Qwen2 norms have no bias to absorb it (the authors switch it off for
  Llama as well), and no q/k scale (it only re-balances q_proj against k_proj under RoPE);
* lo <= 0 <= hi before clipping (our quantizer convention, lrq.quant.group_min_max), so z stays on the
  integer grid [0, 2^b - 1] that every kernel stores;
* Adam (the authors' AdamW runs with weight decay 0, which is Adam) at constant learning rates,
  loss summed over tokens (the authors' MSE averages; a constant factor that Adam is invariant to);
* W8A8 here is per-tensor *static* (the suite's scheme): training fake-quantizes activations with the
  current batch's range, then the final static ranges are observed on the block's calibration inputs
  after the LET is folded (the authors quantize activations per token, dynamically).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Literal

import torch
import torch.nn.functional as F
from torch import nn

from lrq.arch import block_linears, set_submodule
from lrq.blockwise import BlockContext
from lrq.config import setting
from lrq.engine import ReconConfig, ReconstructionMethod, recon_presets
from lrq.errors import UserError
from lrq.learnable import LearnableQuantLinear
from lrq.methods import register
from lrq.qlinear import QuantLinear
from lrq.quant import (group_min_max, per_tensor_fake_quant, per_token_fake_quant,
                       qparams_from_range, round_ste)
from lrq.schemes import Scheme
from lrq.smooth import PAIRS, divide_norm, exact_pairs, producer_name, fold_stats, consumer_weight_absmax, smoothing_scales, to_consumer_space, to_producer_space

LET_PAIRS: tuple[str, ...] = ("qkv", "gate_up", "vo")


class OmniQuantLinear(LearnableQuantLinear):
    """A linear under LWC (and, through callables, the block's LET scales on its inputs / output rows)."""

    def __init__(self, linear: nn.Linear, scheme: Scheme, scale: torch.Tensor, zero: torch.Tensor,
                 lwc_init: float = 4.0, in_scale: Callable[[], torch.Tensor] | None = None,
                 out_scale: Callable[[], torch.Tensor] | None = None, **kw):
        super().__init__(linear, scheme, scale, zero, **kw)
        del self.theta1   # LWC derives the scale from the clipped range instead
        shape = tuple(zero.shape)
        self.gamma = nn.Parameter(torch.full(shape, float(lwc_init), device=zero.device))   # upper-bound logit
        self.beta = nn.Parameter(torch.full(shape, float(lwc_init), device=zero.device))    # lower-bound logit
        self.in_scale, self.out_scale = in_scale, out_scale

    def learnables(self) -> list[nn.Parameter]:
        return [self.gamma, self.beta]   # the LET scales belong to the block (counted once, there)

    def effective(self) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The weight and bias after the equivalent transformation (what gets quantized)."""
        w, b = self.weight, self.bias
        if self.in_scale is not None:
            w = w * self.in_scale().view(1, -1)
        if self.out_scale is not None:
            s = self.out_scale()
            w = w / s.view(-1, 1)
            b = None if b is None else b / s
        return w, b

    def qparams(self, w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        lo, hi = group_min_max(w, self.group_size)
        return qparams_from_range(torch.sigmoid(self.beta) * lo, torch.sigmoid(self.gamma) * hi, self.bits)

    def _levels(self, w: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor) -> torch.Tensor:
        s, z = self._expand(scale), self._expand(zero)
        return torch.clamp(round_ste(w / s) + z, 0, 2**self.bits - 1)

    def w_hat(self) -> torch.Tensor:
        w, _ = self.effective()
        scale, zero = self.qparams(w)
        return (self._levels(w, scale, zero) - self._expand(zero)) * self._expand(scale)

    def quantize_input(self, x: torch.Tensor) -> torch.Tensor:
        s = self.scheme
        if self.act_quant and s.static_activations:
            # The LET moves the range every step: fake-quantize with the batch's own per-tensor range.
            lo, hi = x.detach().float().amin().clamp(max=0), x.detach().float().amax().clamp(min=0)
            return per_tensor_fake_quant(x, *qparams_from_range(lo, hi, s.a_bits), s.a_bits)
        return super().quantize_input(x)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        w, b = self.effective()
        scale, zero = self.qparams(w)
        w_hat = (self._levels(w, scale, zero) - self._expand(zero)) * self._expand(scale)
        y = F.linear(self.quantize_input(x), w_hat.to(x.dtype), None if b is None else b.to(x.dtype))
        if self.quantize_output and self.act_quant:
            y = per_token_fake_quant(y, self.scheme.kv_bits)
        return y

    @torch.no_grad()
    def freeze(self, half: bool = False) -> QuantLinear:
        """The frozen layer; `half` (train_precision=authors): the transformed weight, its range and scale on the
        fp16 grid first, as after `.half()` of the authors' model."""
        w, b = self.effective()
        if half:
            w = w.half().float()
        scale, zero = self.qparams(w)
        if half:
            scale = scale.half().float()
        q = QuantLinear(self.in_features, self.out_features, b is not None, self.scheme, self.quantize_output)
        q.set_weight(self._levels(w, scale, zero).round().to(torch.uint8), scale, zero)
        if b is not None:
            q.bias.copy_(b)
        if self.scheme.static_activations and self.act_range is not None:
            q.set_static_range(*self.act_range)
        return q.to(self.weight.device)


def omniquant_lwc_param_count(cout: int, n_groups: int = 1) -> int:
    return 2 * cout * n_groups


class ScaledNorm(nn.Module):
    """A norm followed by division by the LET scale (folded into the norm's weight after training)."""

    def __init__(self, norm: nn.Module, log_s: nn.Parameter):
        super().__init__()
        self.norm, self.log_s = norm, log_s

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.norm(x)
        return y * torch.exp(-self.log_s).to(y.dtype)


class LET(nn.Module):
    """One block's learnable equivalent transformation: log-scales per pair (producer -> consumers)."""

    def __init__(self, block: nn.Module, log_scales: dict[str, torch.Tensor]):
        super().__init__()
        self.log_s = nn.ParameterDict({p: nn.Parameter(t.detach().float().clone()) for p, t in log_scales.items()})
        self._block = [block]   # not a submodule

    def in_scale(self, name: str) -> Callable[[], torch.Tensor] | None:
        for pair in self.log_s:
            if name in PAIRS[pair][1]:
                return lambda pair=pair: to_consumer_space(self._block[0], pair, torch.exp(self.log_s[pair]))
        return None

    def out_scale(self, name: str) -> Callable[[], torch.Tensor] | None:
        for pair in self.log_s:
            if producer_name(self._block[0], pair) == name:
                return lambda pair=pair: torch.exp(self.log_s[pair])
        return None

    def install(self) -> None:
        """Put the norm producers' division in place (linear producers divide inside their module)."""
        block = self._block[0]
        for pair in self.log_s:
            name = producer_name(block, pair)
            if not isinstance(block.get_submodule(name), nn.Linear):
                set_submodule(block, name, ScaledNorm(block.get_submodule(name), self.log_s[pair]))

    @torch.no_grad()
    def fold(self) -> None:
        """Fold the trained scales into the norms and remove the wrappers."""
        block = self._block[0]
        for pair in self.log_s:
            name = producer_name(block, pair)
            m = block.get_submodule(name)
            if isinstance(m, ScaledNorm):
                divide_norm(m.norm, torch.exp(self.log_s[pair]))
                set_submodule(block, name, m.norm)


@torch.no_grad()
def observe_inputs(block: nn.Module, modules: dict[str, nn.Module], inputs: torch.Tensor, kwargs: dict,
                   batch: int = 8) -> dict[str, tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """Per module: (per-channel max |x|, tensor min, tensor max) of its input over the given block inputs.

    Activation quantizers are off while observing (as lrq.calibration does on the whole model)."""
    stats: dict[str, list[torch.Tensor]] = {}
    saved = {}
    for name, m in modules.items():
        if hasattr(m, "act_quant"):
            saved[name] = ("act_quant", m.act_quant)
            m.act_quant = False
        elif hasattr(m, "act_quant_enabled"):
            saved[name] = ("act_quant_enabled", m.act_quant_enabled)
            m.act_quant_enabled = False

    def hook(name):
        def fn(module, args):
            x = args[0].detach().float().reshape(-1, args[0].shape[-1])
            cur = [x.abs().amax(dim=0), x.amin(), x.amax()]
            prev = stats.get(name)
            stats[name] = cur if prev is None else [torch.maximum(prev[0], cur[0]), torch.minimum(prev[1], cur[1]),
                                                    torch.maximum(prev[2], cur[2])]
        return fn

    handles = [m.register_forward_pre_hook(hook(n)) for n, m in modules.items()]
    dev = next(block.parameters()).device
    try:
        for i in range(0, len(inputs), batch):
            block(inputs[i:i + batch].to(dev), **kwargs)
    finally:
        for h in handles:
            h.remove()
        for name, (attr, val) in saved.items():
            setattr(modules[name], attr, val)
    return {n: tuple(v) for n, v in stats.items()}


def _static_ranges(stats: dict, bits: int) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    return {n: qparams_from_range(lo.clamp(max=0), hi.clamp(min=0), bits) for n, (_, lo, hi) in stats.items()}


@dataclass(frozen=True, eq=False)
class OmniQuantConfig(ReconConfig):
    """OmniQuant's settings: the reconstruction settings, LWC's initial logit and LET (the authors' defaults)."""
    let: Literal["on", "off", "auto"] = "auto"           # auto: on where activations are quantized
    let_lr: float = setting(5e-3, lo=0, lo_open=True)
    let_alpha: float = setting(0.5, lo=0, hi=1)          # the LET's SmoothQuant-style initialisation
    lwc_init: float = 4.0                                # the clipping logits' start (sigmoid(4) = 0.982)
    smooth_alpha: float = setting(0.0, lo=0, hi=1)       # LET replaces the SmoothQuant pre-step
    lr_schedule: Literal["cosine", "constant"] = "constant"   # the authors: constant rates

    def validate(self, method: str) -> None:
        if self.smooth_alpha > 0 and self.let == "on":
            raise UserError("omniquant's LET replaces the SmoothQuant pre-step: use --set smooth_alpha=0 with "
                            "let=on (or let=off to smooth instead).")


@register
class OmniQuant(ReconstructionMethod):
    name = "omniquant"
    summary = "learnable weight clipping + learnable equivalent transformation, trained by block reconstruction"
    # The authors' defaults: AdamW (weight decay 0) at constant rates, LWC 1e-2, LET 5e-3, SmoothQuant-style
    # LET initialisation with alpha 0.5, 20 epochs over 128 x 2048-token samples at batch 1 (2560 steps),
    # mixed precision. LET only when activations are quantized (their weight-only scripts use LWC alone).
    settings = OmniQuantConfig
    presets = recon_presets(OmniQuantConfig, paper={"iters": 2560, "batch_size": 1, "autocast": True})
    # (LWC learning rate, s1 search): LWC sets its own range, so there is no s1 initialisation to search.
    paper_table = {"w3": (1e-2, False), "w4": (1e-2, False), "w4a8": (1e-2, False), "w8a8": (1e-2, False)}
    # quick: 100 steps instead of 2560; a sweep of held-out block error on the default model's first two
    # blocks (w3a16: lr 1e-2 -> 0.86/0.95 of the initial error, 5e-2 -> 0.43/0.67, 1e-1 -> 0.42/0.66).
    quick_lr = {"w3": 5e-2, "w4": 5e-2, "w4a8": 5e-2, "w8a8": 5e-2}
    # The authors calibrate on 128 x 2048 tokens of WikiText-2's train split; we hold no train split, and
    # calibrating on the evaluation text would flatter the perplexity, so the paper preset draws from C4.
    calib_defaults = {"paper": {"dataset": "c4", "n_samples": 128, "seq_len": 2048, "sampling": "random"}}
    upfront_static_ranges = False   # ranges are observed per block, after the LET is folded
    learnable_fraction = 0.05       # clipping logits per row/group and LET scales per channel

    def resolve(self, scheme: Scheme, config) -> OmniQuantConfig:
        cfg = self.typed(config)
        decided: dict[str, Any] = {}
        if cfg.let == "auto":
            decided["let"] = "on" if scheme.a_bits is not None else "off"
        if cfg.recon_act_quant == "auto":   # the authors train with the activation quantizers on
            decided["recon_act_quant"] = "on" if scheme.a_bits is not None else "off"
        if cfg.s1_init == "auto":
            decided["s1_init"] = "minmax"
        cfg = cfg.replace(**decided)
        cfg.validate(self.name)
        return super().resolve(scheme, cfg)

    def make_learnable(self, name, linear, scheme, scale, zero, config: OmniQuantConfig, generator, **kw):
        return OmniQuantLinear(linear, scheme, scale, zero, lwc_init=config.lwc_init, **kw)

    # ---- LET around the engine's per-block loop ---------------------------------------------------
    def prepare_block(self, ctx: BlockContext, cfg: OmniQuantConfig, n_train: int) -> LET | None:
        if cfg.let != "on":
            return None
        block = ctx.block
        # the LET folds into norms and linears: only where that is exact in this block, checked before training
        pairs, errors = exact_pairs(block, LET_PAIRS, ctx.q_inputs.data[:1], ctx.kwargs, "omniquant (LET)",
                                    ctx.index)
        ctx.stats.update(fold_stats(LET_PAIRS, pairs, errors))
        acts = observe_inputs(block, block_linears(block), ctx.q_inputs.data[:n_train], ctx.kwargs)
        log_scales = {}
        for pair in pairs:
            a = to_producer_space(block, pair, acts[PAIRS[pair][1][0]][0], "amax")
            s = smoothing_scales(a, consumer_weight_absmax(block, pair), cfg.let_alpha)
            log_scales[pair] = torch.log(s)
        let = LET(block, log_scales)
        let.install()
        return let

    def learnable_kwargs(self, state: LET | None, name: str) -> dict:
        if state is None:
            return {}
        return {"in_scale": state.in_scale(name), "out_scale": state.out_scale(name)}

    def init_learnables(self, ctx: BlockContext, learn: dict, state: Any, cfg: OmniQuantConfig, n_train: int) -> None:
        scheme = next(iter(learn.values())).scheme
        if scheme.static_activations:
            # static ranges for the 'before' measurement, seen through the initial LET
            stats = observe_inputs(ctx.block, learn, ctx.q_inputs.data[:n_train], ctx.kwargs)
            for name, rng in _static_ranges(stats, scheme.a_bits).items():
                learn[name].act_range = rng

    def param_groups(self, learn: dict, state: LET | None, cfg: OmniQuantConfig) -> list[dict]:
        groups = [{"params": [p for m in learn.values() for p in m.learnables()], "lr": cfg.lr}]
        if state is not None:
            groups.append({"params": list(state.parameters()), "lr": cfg.let_lr})
        return groups

    def finish_block(self, ctx: BlockContext, state: LET | None, cfg: OmniQuantConfig, n_train: int) -> None:
        if state is not None:
            state.fold()
        qlins = {n: m for n, m in block_linears(ctx.block).items() if isinstance(m, QuantLinear)}
        if qlins and next(iter(qlins.values())).scheme.static_activations:
            bits = next(iter(qlins.values())).scheme.a_bits
            stats = observe_inputs(ctx.block, qlins, ctx.q_inputs.data[:n_train], ctx.kwargs)
            for name, (scale, zero) in _static_ranges(stats, bits).items():
                qlins[name].set_static_range(scale, zero)
