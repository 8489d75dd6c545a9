"""Quantization schemes as data, named once (METHOD.md section 4).

A scheme says what is quantized and how; methods decide how the weight integers are chosen.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from lrq.errors import UserError


@dataclass(frozen=True)
class Scheme:
    name: str
    w_bits: int
    group_size: int | None = None          # None = per output channel
    a_bits: int | None = None              # None = activations stay in floating point
    a_mode: str | None = None              # "per_token" (dynamic) or "per_tensor_static"
    kv_bits: int | None = None             # k_proj / v_proj outputs, per token (before RoPE)
    description: str = ""

    @property
    def weight_only(self) -> bool:
        return self.a_bits is None

    @property
    def static_activations(self) -> bool:
        return self.a_mode == "per_tensor_static"

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
