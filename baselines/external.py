"""The `external` method: a checkpoint quantized elsewhere, scored as a cell of its own (`lrq-bench run --model
<folder>`). The checkpoint is read by lrq.external (with the suite's other readers of weights); this module is
the plug-in that registers the method (pyproject.toml's `lrq_bench.methods` entry point `external`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from torch import nn

from lrq.config import MethodConfig
from lrq.errors import UserError
from lrq.external import apply_checkpoint, describe
from lrq.methods import Calibration, Method, register
from lrq.schemes import Scheme


@dataclass(frozen=True, eq=False)
class ExternalConfig(MethodConfig):
    """The checkpoint read (its folder) and its content fingerprint (the cell's identity)."""
    checkpoint: str = ""
    fingerprint: str = ""


@register
class External(Method):
    """Load a checkpoint quantized elsewhere into the reference model (module docstring)."""

    name = "external"
    summary = "a checkpoint quantized by another tool (compressed-tensors or GPTQ format), read as it is"
    external = True
    provides_activation_ranges = True   # a static-activation checkpoint stores its input_scale: scored from it
    settings = ExternalConfig
    presets = {"quick": ExternalConfig(), "paper": ExternalConfig()}

    def display_name(self, config: dict[str, Any]) -> str:
        return describe(config["checkpoint"])["method"] if config.get("checkpoint") else self.name

    def needs_calibration(self, scheme: Scheme) -> bool:
        return False

    def _quantize(self, model: nn.Module, scheme: Scheme, config: ExternalConfig,
                  calib: Calibration | None) -> dict[str, Any]:
        if not config.get("checkpoint"):
            raise UserError("the external method reads a checkpoint: run `lrq-bench run --model <its folder>`.")
        return apply_checkpoint(model, config["checkpoint"])
