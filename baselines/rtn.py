"""Round-to-nearest: each row's (or group's) min/max range, no data needed for the weights."""

from __future__ import annotations

from typing import Any

from torch import nn

from lrq.calibration import calibrate_static_activations
from lrq.config import MethodConfig
from lrq.methods import Calibration, Method, add_work, register
from lrq.quantize_model import replace_linears
from lrq.schemes import Scheme
from lrq.quant import minmax_qparams


@register
class RTN(Method):
    name = "rtn"
    summary = "round-to-nearest with min/max ranges per channel or group"

    def work(self, shape, scheme, cfg, n, seq):
        """A min/max pass and a rounding pass over every weight (about 10 operations per weight)."""
        return add_work(super().work(shape, scheme, cfg, n, seq), "rtn", shape.layers,
                        shape.layers * 10.0 * shape.block_params())

    def profile(self, run, shape, scheme, n, seq, steps=6):
        t, c = run()
        return {"rtn": (*self.work(shape, scheme, c, n, seq)["rtn"], t)}

    def _quantize(self, model: nn.Module, scheme: Scheme, config: MethodConfig,
                  calib: Calibration | None) -> dict[str, Any]:
        replace_linears(model, scheme, lambda name, w: minmax_qparams(w, scheme.w_bits, scheme.group_size))
        stats: dict[str, Any] = {}
        if scheme.static_activations:
            stats["static_activation_quantizers"] = calibrate_static_activations(model, calib.input_ids)
        return stats
