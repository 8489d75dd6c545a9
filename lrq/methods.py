"""The method interface and registry.

A method turns a floating-point model into one whose seven linears per block are QuantLinear modules
for a given scheme. It is described entirely by (scheme, config, calibration data): no state is kept
between calls, so every (model, method, scheme) cell is an independent job.

Methods register themselves with `@register`; `load_methods()` imports every module of the `baselines`
package and the LRQ/FlexRound modules, so a new method is a new file, not a change to the harness.
"""

from __future__ import annotations

import importlib
import pkgutil
from dataclasses import dataclass, field
from typing import Any, ClassVar

import torch
from torch import nn

from lrq.errors import UserError
from lrq.schemes import Scheme


@dataclass
class Calibration:
    """Calibration token windows [n_samples, seq_len] and how they were drawn (recorded with results)."""
    input_ids: torch.Tensor
    description: dict[str, Any] = field(default_factory=dict)


class Method:
    """Base class. Subclasses set `name`, `defaults` (per preset) and implement `quantize`."""

    name: ClassVar[str]
    summary: ClassVar[str] = ""
    # Settings by preset; every key can be overridden from the CLI (--set key=value) and is recorded.
    defaults: ClassVar[dict[str, dict[str, Any]]] = {"quick": {}, "paper": {}}
    # Coarse relative cost of one cell (1: no search, 5: a per-layer search, 10: block-wise training); parallel
    # executors start costly cells first.
    cost_rank: ClassVar[int] = 1
    # Where block-wise methods compute (set by the runner). When the model stays on the CPU and this is a
    # CUDA device, the walk moves one block at a time to it and back (offloading): device memory is then
    # bounded by one block plus a batch of activations. None: wherever the model is.
    device: torch.device | None = None

    def compute_device(self, model: nn.Module) -> torch.device:
        return self.device if self.device is not None else next(model.parameters()).device

    def config(self, preset: str, overrides: dict[str, Any] | None = None) -> dict[str, Any]:
        if preset not in self.defaults:
            raise UserError(f"unknown preset {preset!r} for method {self.name}: choose from {', '.join(self.defaults)}.")
        cfg = dict(self.defaults[preset])
        for k, v in (overrides or {}).items():
            if k not in cfg:
                continue  # an override meant for another method
            cfg[k] = _coerce(self.name, k, cfg[k], v)
        return cfg

    def needs_calibration(self, scheme: Scheme) -> bool:
        """Whether the result depends on calibration data (it then becomes part of the cell's identity)."""
        return scheme.static_activations

    def quantize(self, model: nn.Module, scheme: Scheme, config: dict[str, Any],
                 calib: Calibration | None) -> dict[str, Any]:
        """Quantize `model` in place; return statistics worth storing (e.g. learnable-parameter counts)."""
        raise NotImplementedError


def _coerce(method: str, key: str, default: Any, value: Any) -> Any:
    """Convert a --set value to the type of the setting's default (booleans need explicit words)."""
    if default is None or isinstance(value, type(default)):
        return value
    if isinstance(default, bool):
        word = str(value).strip().lower()
        if word in ("true", "1", "yes", "on"):
            return True
        if word in ("false", "0", "no", "off"):
            return False
        raise UserError(f"{method}: --set {key}={value!r} is not a boolean: use true or false.")
    try:
        return type(default)(value)
    except (TypeError, ValueError):
        raise UserError(f"{method}: --set {key}={value!r} is not a valid {type(default).__name__}.") from None


METHODS: dict[str, type[Method]] = {}
_LOADED = False


def register(cls: type[Method]) -> type[Method]:
    if cls.name in METHODS and METHODS[cls.name] is not cls:
        raise RuntimeError(f"two methods registered under the name {cls.name!r}")
    METHODS[cls.name] = cls
    return cls


def load_methods() -> dict[str, type[Method]]:
    global _LOADED
    if not _LOADED:
        import baselines
        for info in pkgutil.iter_modules(baselines.__path__):
            importlib.import_module(f"baselines.{info.name}")
        for mod in ("lrq.lrq", "lrq.flexround"):
            try:
                importlib.import_module(mod)
            except ModuleNotFoundError as e:
                if e.name != mod:
                    raise
        _LOADED = True
    return METHODS


def get_method(name: str) -> Method:
    methods = load_methods()
    try:
        return methods[name.strip().lower()]()
    except KeyError:
        raise UserError(f"unknown method {name!r}: choose from {', '.join(sorted(methods))}.") from None
