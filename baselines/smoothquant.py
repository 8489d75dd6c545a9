"""SmoothQuant (Xiao et al., ICML 2023, arXiv 2211.10438): migrate activation outliers into the weights.

1. Per-input-channel maxima max|X_j| of every block linear's input from one calibration pass.
2. s_j = max|X_j|^alpha / max|W_j|^(1-alpha), folded into the preceding norm (lrq.smooth): the
   floating-point model is unchanged, activations become flatter and weights a little harder.
3. Round-to-nearest weights on the scheme's grid (the shared min/max primitives), then, for static
   schemes, per-tensor activation ranges calibrated on the smoothed model.

alpha: the paper's default is 0.5 (kept here); the LRQ paper uses SmoothQuant with alpha = 0.8 as its
W8A8 baseline (`--set alpha=0.8`). pairs: SmoothQuant smooths the two norm -> linear pairs; v->o and
up->down (see lrq.smooth) can be added with `--set pairs=qkv,gate_up,vo,up_down`.

Other methods use the smoothing alone as a pre-step: `lrq.smooth.smooth_model(model, input_ids, alpha)`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from torch import nn

from baselines.rtn import RTN
from lrq.config import MethodConfig, setting
from lrq.methods import Calibration, Method, register
from lrq.schemes import Scheme
from lrq.smooth import DEFAULT_PAIRS, parse_pairs, smooth_model

@dataclass(frozen=True, eq=False)
class SmoothQuantConfig(MethodConfig):
    """SmoothQuant's settings: the migration strength and the norm -> linear pairs smoothed."""
    alpha: float = setting(0.5, lo=0, hi=1)
    pairs: str = ",".join(DEFAULT_PAIRS)

    def validate(self, method: str) -> None:
        parse_pairs(self.pairs)    # an unknown pair name is bad input now, not in the worker


@register
class SmoothQuant(Method):
    name = "smoothquant"
    summary = "SmoothQuant: calibrated per-channel smoothing folded into the norms, then round-to-nearest"
    settings = SmoothQuantConfig
    presets = {"quick": SmoothQuantConfig(), "paper": SmoothQuantConfig()}

    def needs_calibration(self, scheme: Scheme) -> bool:
        return True

    def work(self, shape, scheme, cfg, n, seq):
        """The activation statistics' whole-model forwards (and W8A8's ranges after smoothing)."""
        passes = 2 if scheme is not None and scheme.static_activations else 1
        return {"fwd": (n * shape.layers * passes, shape.model_fwd_flops(n * seq, seq) * passes)}

    def _quantize(self, model: nn.Module, scheme: Scheme, config: SmoothQuantConfig,
                  calib: Calibration | None) -> dict[str, Any]:
        stats = smooth_model(model, calib.input_ids, config.alpha, config.pairs)
        stats.update(RTN().quantize(model, scheme, RTN.presets["quick"], calib))
        return stats
