"""Quantization schemes as data, named once (METHOD.md section 4).

A scheme says what is quantized and how; methods decide how the weight integers are chosen.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import asdict, dataclass, field

from lrq.errors import UserError
from lrq.quant import per_token_fake_quant, per_token_qparams


@dataclass(frozen=True)
class ActivationMode:
    """How a scheme quantizes the input activations of its linear layers, declared once: every linear module
    (lrq.qlinear, lrq.learnable, lrq.packed), the export (compressed-tensors) and the llm-compressor adapter
    dispatch on it.

    `static`: one range per tensor, calibrated once on calibration data (lrq.calibration) and stored with the
    layer; else `quantize(x, bits)` fake-quantizes each input from its own values. `strategy` is the name
    compressed-tensors and llm-compressor give the granularity ("tensor", "token")."""
    name: str
    static: bool
    strategy: str
    dynamic_quant: Callable | None = field(default=None, compare=False, repr=False)   # (x, bits) -> x, dynamic
    description: str = ""
    # (x, bits) -> scale, zero point per row of a dynamic mode's grid: kernels then multiply the integer levels
    integer_qparams: Callable | None = field(default=None, compare=False, repr=False)

    def quantize(self, x, bits: int):
        """A dynamic mode's fake quantization of `x` at `bits` (a static one's needs its calibrated range)."""
        if self.static:
            raise TypeError(f"activation mode {self.name} is static: its range is calibrated, not computed per input")
        return self.dynamic_quant(x, bits)

    def compressed_tensors(self, bits: int) -> dict:
        """The compressed-tensors `input_activations` arguments of this mode."""
        return {"num_bits": bits, "type": "int", "symmetric": False, "strategy": self.strategy,
                "dynamic": not self.static, "observer": "minmax" if self.static else None}

    def llm_compressor(self, bits: int) -> dict:
        """llm-compressor's `input_activations` arguments of this mode (its static observer is static_minmax)."""
        args = {"num_bits": bits, "type": "int", "symmetric": False, "strategy": self.strategy,
                "dynamic": not self.static}
        return args | ({"observer": "static_minmax"} if self.static else {})


ACTIVATION_MODES: dict[str, ActivationMode] = {m.name: m for m in (
    ActivationMode("per_token", False, "token", per_token_fake_quant, "dynamic, one range per token",
                   per_token_qparams),
    ActivationMode("per_tensor_static", True, "tensor", None, "static, one calibrated range per tensor"),
)}


def register_activation_mode(mode: ActivationMode) -> ActivationMode:
    """Add an activation mode (a plug-in's, or a test's); a scheme may then name it."""
    known = ACTIVATION_MODES.get(mode.name)
    if known is not None and known != mode:
        raise UserError(f"activation mode name {mode.name!r} is taken by another mode.")
    if not mode.static and mode.dynamic_quant is None:
        raise UserError(f"activation mode {mode.name!r}: a dynamic mode needs its dynamic_quant(x, bits).")
    ACTIVATION_MODES[mode.name] = mode
    return mode


def activation_mode_for(strategy: str | None, dynamic: bool) -> ActivationMode:
    """The mode of a checkpoint's compressed-tensors activation arguments (strategy, dynamic)."""
    for m in ACTIVATION_MODES.values():
        if m.strategy == strategy and m.static == (not dynamic):
            return m
    raise UserError(f"activations quantized with strategy {strategy!r} ({'dynamic' if dynamic else 'static'}) "
                    f"match none of the suite's activation modes ({', '.join(ACTIVATION_MODES)}).")


@dataclass(frozen=True)
class Scheme:
    name: str
    w_bits: int
    group_size: int | None = None          # None = per output channel
    a_bits: int | None = None              # None = activations stay in floating point
    a_mode: str | None = None              # the activation mode's name (ACTIVATION_MODES): per_token, ...
    kv_bits: int | None = None             # k_proj / v_proj outputs, per token (before RoPE)
    description: str = ""

    def __post_init__(self):
        if (self.a_bits is None) != (self.a_mode is None):
            raise UserError(f"scheme {self.name}: activation bits and an activation mode go together "
                            f"(a_bits={self.a_bits}, a_mode={self.a_mode!r}).")
        if self.a_mode is not None and self.a_mode not in ACTIVATION_MODES:
            raise UserError(f"scheme {self.name}: unknown activation mode {self.a_mode!r}: choose from "
                            f"{', '.join(ACTIVATION_MODES)} (or register one: lrq.schemes.register_activation_mode).")

    @property
    def weight_only(self) -> bool:
        return self.a_bits is None

    @property
    def activations(self) -> ActivationMode | None:
        """The activation mode (None: activations stay in floating point)."""
        return None if self.a_mode is None else ACTIVATION_MODES[self.a_mode]

    @property
    def static_activations(self) -> bool:
        return self.a_mode is not None and ACTIVATION_MODES[self.a_mode].static

    def to_dict(self) -> dict:
        return asdict(self)


_ALL = [
    Scheme("w8a8", 8, None, 8, "per_tensor_static",
           description="8-bit per-channel weights, 8-bit per-tensor static activations"),
    Scheme("w4a8", 4, None, 8, "per_token",
           description="4-bit per-channel weights, 8-bit per-token dynamic activations"),
    Scheme("w4a16", 4, None, description="4-bit per-channel weights, fp activations"),
    Scheme("w3a16", 3, None, description="3-bit per-channel weights, fp activations"),
    Scheme("w4a16-g128", 4, 128, description="4-bit weights in groups of 128 columns, fp activations"),
    Scheme("w3a16-g128", 3, 128, description="3-bit weights in groups of 128 columns, fp activations"),
    # groups that divide the default model's widths (576, 1536): exports compressed-tensors loaders accept
    Scheme("w4a16-g64", 4, 64, description="4-bit weights in groups of 64 columns, fp activations"),
    Scheme("w3a16-g64", 3, 64, description="3-bit weights in groups of 64 columns, fp activations"),
    Scheme("w8a16", 8, None, description="8-bit per-channel weights, fp activations"),
    # llm-compressor's W8A8 preset: per-token dynamic activations (ours, w8a8, is per-tensor static)
    Scheme("w8a8-dyn", 8, None, 8, "per_token", description="8-bit per-channel weights, 8-bit per-token dynamic "
           "activations"),
    Scheme("w4a8-kv8", 4, None, 8, "per_token", kv_bits=8,
           description="w4a8 plus 8-bit per-token K/V (k_proj, v_proj outputs)"),
]

SCHEMES: dict[str, Scheme] = {s.name: s for s in _ALL}
# The schemes a plain `lrq-bench run` sweeps; w4a8-kv8 is opt-in.
DEFAULT_SCHEMES: tuple[str, ...] = ("w8a8", "w4a8", "w4a16", "w3a16", "w4a16-g128", "w3a16-g128")


def register_scheme(scheme: Scheme) -> Scheme:
    """Add a scheme to the registry (a checkpoint quantized elsewhere may use one the suite does not list)."""
    known = SCHEMES.get(scheme.name)
    if known is not None and known != scheme:
        raise UserError(f"scheme name {scheme.name!r} is taken by another scheme.")
    SCHEMES[scheme.name] = scheme
    return scheme


def get_scheme(name: str) -> Scheme:
    try:
        return SCHEMES[name.strip().lower()]
    except KeyError:
        raise UserError(
            f"unknown scheme {name!r}: choose from {', '.join(SCHEMES)} "
            f"(e.g. --schemes w4a16-g128,w8a8)."
        ) from None
