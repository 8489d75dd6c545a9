"""A checkpoint quantized elsewhere, scored as a cell of its own: `lrq-bench run --model <folder>`.

A folder whose config.json carries a `quantization_config` of compressed-tensors (llm-compressor, vLLM's
format; `pack-quantized` or `int-quantized` integer weights, symmetric or asymmetric, per channel or in
groups) or of GPTQ (AutoGPTQ / GPTQModel: `qweight`, `qzeros`, `scales`, without act-order) is read here:
its integers, scales and zero points become the block linears (lrq.qlinear.QuantLinear: the same module
every method of the suite produces, so its forward, packing, export and bits per weight are the suite's),
the other parameters it stores (embeddings, norms it may have rescaled, the head) replace the reference
model's. The cell runs on the reference FP model it names (`--reference-model`, else the one its own
metadata names) so it is scored on the same windows, KL reference and task examples as every cell of that
model, and compares paired with them.

The method is `external`; its cells are named from the checkpoint (`external:<producer>-w4g128`) and keyed
by the checkpoint's content fingerprint. One of our own exports read back this way reproduces its cell's
numbers exactly (tests/test_external.py).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from torch import nn

from lrq.errors import UserError
from lrq.methods import Calibration, Method, register
from lrq.schemes import SCHEMES, Scheme


def quantization_config(folder: str | Path) -> dict | None:
    """The checkpoint's quantization_config, or None when `folder` is not a quantized model folder."""
    cfg = Path(folder) / "config.json"
    if not Path(folder).is_dir() or not cfg.is_file():
        return None
    try:
        qc = json.loads(cfg.read_text(encoding="utf-8")).get("quantization_config")
    except (OSError, UnicodeDecodeError, ValueError, AttributeError):
        return None
    return qc if isinstance(qc, dict) and qc.get("quant_method") in ("compressed-tensors", "gptq") else None


def _weights_args(qc: dict) -> tuple[dict, dict | None]:
    if qc["quant_method"] == "gptq":
        return {"num_bits": int(qc["bits"]), "group_size": None if int(qc.get("group_size", -1)) <= 0
                else int(qc["group_size"]), "symmetric": bool(qc.get("sym", True)),
                "strategy": "group" if int(qc.get("group_size", -1)) > 0 else "channel"}, None
    groups = list((qc.get("config_groups") or {}).values())
    if len(groups) != 1:
        raise UserError(f"the checkpoint has {len(groups)} quantization config groups: one (every Linear alike) "
                        f"is supported.")
    w, a = groups[0].get("weights") or {}, groups[0].get("input_activations")
    if w.get("type", "int") != "int":
        raise UserError(f"the checkpoint's weights are {w.get('type')}, not integers: not supported.")
    return w, a


def describe(folder: str | Path) -> dict:
    """What the checkpoint is: format, producer, bits, group size, symmetry, activations, the scheme it maps
    to, the cell's method name and the FP model its metadata names."""
    folder = Path(folder)
    qc = quantization_config(folder)
    if qc is None:
        raise UserError(f"{folder} is not a quantized checkpoint (no compressed-tensors or GPTQ quantization_config "
                        f"in its config.json).")
    w, a = _weights_args(qc)
    bits = int(w["num_bits"])
    group = w.get("group_size") if w.get("strategy") == "group" else None
    if w.get("strategy") == "block":
        group = (w.get("block_structure") or [None, None])[1]
    a_mode = None if not a else ("per_tensor_static" if a.get("strategy") == "tensor" and not a.get("dynamic")
                                 else "per_token")
    scheme = _scheme_for(bits, group, None if not a else int(a["num_bits"]), a_mode)
    fmt = "gptq" if qc["quant_method"] == "gptq" else qc.get("format") or groups_format(qc)
    producer = _producer(folder, qc)
    label = f"{producer}-w{bits}" + (f"g{group}" if group else "") + ("-sym" if w.get("symmetric") else "")
    meta = _lrq_metadata(folder)
    return {"format": fmt, "producer": producer, "bits": bits, "group_size": group,
            "symmetric": bool(w.get("symmetric")), "activations": a_mode, "scheme": scheme.name,
            "method": f"external:{label}", "reference": meta.get("model"), "quant_method": qc["quant_method"]}


def groups_format(qc: dict) -> str:
    return next(iter(qc.get("config_groups", {}).values()), {}).get("format") or "pack-quantized"


def _scheme_for(bits: int, group: int | None, a_bits: int | None, a_mode: str | None) -> Scheme:
    """The suite's scheme of these settings; one not registered (a group size of 32, say) is registered now,
    named like the others (w4a16-g32), so that the checkpoint's cell can be settled and reported."""
    from lrq.schemes import register_scheme
    for s in SCHEMES.values():
        if (s.w_bits, s.group_size, s.a_bits, s.a_mode, s.kv_bits) == (bits, group, a_bits, a_mode, None):
            return s
    if a_bits is not None:
        raise UserError(f"no scheme of the suite matches the checkpoint's activations ({a_bits}-bit {a_mode}): known "
                        f"schemes are {', '.join(SCHEMES)}.")
    name = f"w{bits}a16" + (f"-g{group}" if group else "")
    return register_scheme(Scheme(name, bits, group, description=f"{bits}-bit weights"
                                  + (f" in groups of {group} columns" if group else " per channel")
                                  + ", fp activations (read from a checkpoint)"))


def _producer(folder: Path, qc: dict) -> str:
    """Who made the checkpoint: lrq-bench's own metadata, llm-compressor's recipe modifiers, else the format."""
    meta = _lrq_metadata(folder)
    if meta.get("method"):
        return f"lrq-bench-{meta['method']}"
    recipe = folder / "recipe.yaml"
    if recipe.is_file():
        text = recipe.read_text(errors="replace")
        for mod, name in (("GPTQModifier", "gptq"), ("AWQModifier", "awq"), ("SmoothQuantModifier", "smoothquant"),
                          ("QuantizationModifier", "rtn")):
            if mod in text:
                return f"llmc-{name}"
    return "gptq" if qc["quant_method"] == "gptq" else "compressed-tensors"


def _lrq_metadata(folder: Path) -> dict:
    """The metadata lrq-bench's own exports carry in model.safetensors (method, model, scheme, ...)."""
    from safetensors import safe_open
    path = folder / "model.safetensors"
    if not path.is_file():
        return {}
    try:
        with safe_open(str(path), framework="pt") as f:
            return json.loads((f.metadata() or {}).get("lrq_bench", "{}"))
    except Exception:  # noqa: BLE001 - another tool's file: no metadata of ours
        return {}


def _tensors(folder: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise UserError(f"{folder} holds no .safetensors weights.")
    out: dict[str, torch.Tensor] = {}
    for f in files:
        out.update(load_file(str(f)))
    return out


def _unpack_stream(packed: torch.Tensor, bits: int, n: int) -> torch.Tensor:
    """compressed-tensors' dense LSB-first bit stream along the last dimension: [rows, words] -> [rows, n]."""
    from lrq.packing import unpack_bits
    return unpack_bits(packed.to(torch.int32).contiguous(), bits, n)


def read_compressed_tensors(t: dict, prefix: str, bits: int, group: int | None, symmetric: bool,
                            shape: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(unsigned levels [out, in], scale [out, G], unsigned zero [out, G]) of one linear."""
    out_f, in_f = shape
    off = 1 << (bits - 1)
    if f"{prefix}.weight_packed" in t:
        q = _unpack_stream(t[f"{prefix}.weight_packed"], bits, in_f)          # stored unsigned (signed + 2^(b-1))
    elif f"{prefix}.weight" in t and not t[f"{prefix}.weight"].is_floating_point():
        q = t[f"{prefix}.weight"].to(torch.int64) + off                        # int-quantized: signed int8
    else:
        raise UserError(f"{prefix}: neither weight_packed nor integer weight in the checkpoint.")
    scale = t[f"{prefix}.weight_scale"].float().reshape(out_f, -1)
    if symmetric or f"{prefix}.weight_zero_point" not in t:
        zero = torch.full_like(scale, float(off))
    else:
        zp = t[f"{prefix}.weight_zero_point"]
        if zp.dtype == torch.int32 and zp.shape[0] != out_f:                   # packed along the output rows
            zero = _unpack_stream(zp.t().contiguous(), bits, out_f).t().float()
        else:
            zero = zp.float().reshape(out_f, -1) + off
    return q.clamp(0, (1 << bits) - 1).to(torch.uint8), scale, zero


def read_gptq(t: dict, prefix: str, bits: int, group: int | None, symmetric: bool, shape: tuple[int, int],
              zero_offset: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """AutoGPTQ / GPTQModel layout: qweight int32 [in * b / 32, out] (packed along the input, LSB first),
    qzeros int32 [G, out * b / 32], scales [G, out], g_idx [in] (act-order refused: its groups are not
    contiguous). `zero_offset`: 1 for the original format, whose stored zeros are z - 1."""
    from lrq.packing import unpack_bits
    out_f, in_f = shape
    g_idx = t.get(f"{prefix}.g_idx")
    gs = group or in_f
    if g_idx is not None and not torch.equal(g_idx.long(), torch.arange(in_f) // gs):
        raise UserError(f"{prefix}: the checkpoint uses act-order (desc_act): its groups are not contiguous "
                        f"column ranges, which the suite's quantized linear cannot hold.")
    q = unpack_bits(t[f"{prefix}.qweight"].t().contiguous(), bits, in_f)          # [out, in]
    scale = t[f"{prefix}.scales"].float().t().contiguous()                       # [out, G]
    zero = unpack_bits(t[f"{prefix}.qzeros"].contiguous(), bits, out_f).t().float() + zero_offset
    if symmetric:
        zero = torch.full_like(scale, float(1 << (bits - 1)))
    return q.to(torch.uint8), scale, zero


@torch.no_grad()
def apply_checkpoint(model: nn.Module, folder: str | Path) -> dict[str, Any]:
    """Replace `model`'s block linears by QuantLinears holding the checkpoint's integers and copy every other
    parameter it stores. Returns statistics, among them the bits per weight the checkpoint really stores."""
    from lrq.arch import KV_LINEARS, decoder_blocks, iter_linears, set_submodule
    from lrq.qlinear import QuantLinear
    folder = Path(folder)
    info = describe(folder)
    qc = quantization_config(folder)
    scheme = SCHEMES[info["scheme"]]
    bits, group, sym = info["bits"], info["group_size"], info["symmetric"]
    t = _tensors(folder)
    blocks = decoder_blocks(model)
    stored_bits = n_weights = 0
    used = set()
    for i, name, lin in list(iter_linears(model)):
        prefix = f"model.layers.{i}.{name}"
        shape = (lin.out_features, lin.in_features)
        if info["quant_method"] == "gptq":
            fmt = str(qc.get("checkpoint_format", "gptq"))
            q, scale, zero = read_gptq(t, prefix, bits, group, sym, shape, 0 if fmt == "gptq_v2" else 1)
            keys = [f"{prefix}.{k}" for k in ("qweight", "qzeros", "scales", "g_idx", "bias")]
        else:
            q, scale, zero = read_compressed_tensors(t, prefix, bits, group, sym, shape)
            keys = [f"{prefix}.{k}" for k in ("weight_packed", "weight", "weight_scale", "weight_zero_point",
                                              "weight_shape", "bias", "input_scale", "input_zero_point")]
        m = QuantLinear(lin.in_features, lin.out_features, f"{prefix}.bias" in t, scheme,
                        quantize_output=name in KV_LINEARS)
        m.set_weight(q, scale, zero)
        if m.bias is not None:
            m.bias.copy_(t[f"{prefix}.bias"].float())
        if scheme.static_activations:
            s_a = t[f"{prefix}.input_scale"].float().reshape(())
            z_a = t.get(f"{prefix}.input_zero_point", torch.zeros(())).float().reshape(())
            m.set_static_range(s_a, z_a + (1 << (scheme.a_bits - 1)))
        set_submodule(blocks[i], name, m.to(lin.weight.device))
        used.update(k for k in keys if k in t)
        # what the checkpoint stores per weight: the levels, a 16-bit scale and (asymmetric) a zero point per group
        ng = scale.shape[1]
        stored_bits += bits * lin.in_features * lin.out_features + ng * lin.out_features * (16 + (0 if sym else bits))
        n_weights += lin.in_features * lin.out_features
    rest = {k: v for k, v in t.items() if k not in used}
    params = dict(model.named_parameters()) | dict(model.named_buffers())
    unknown = [k for k in rest if k not in params]
    if unknown:
        raise UserError(f"{folder}: tensors the reference model does not have ({', '.join(unknown[:4])}): is it "
                        f"the model this checkpoint was quantized from? Name it with --reference-model.")
    replaced = 0
    for k, v in rest.items():
        if params[k].shape != v.shape:
            raise UserError(f"{folder}: {k} has shape {tuple(v.shape)}, the reference model's is "
                            f"{tuple(params[k].shape)}: name the right model with --reference-model.")
        replaced += not torch.equal(params[k].detach().to(v.dtype), v)
        params[k].copy_(v.to(params[k].dtype))
    return {"bits_per_weight": stored_bits / n_weights, "external": info, "replaced_params": replaced}


@register
class External(Method):
    """Load a checkpoint quantized elsewhere into the reference model (module docstring)."""

    name = "external"
    summary = "a checkpoint quantized by another tool (compressed-tensors or GPTQ format), read as it is"
    external = True
    defaults = {"quick": {"checkpoint": "", "fingerprint": ""}, "paper": {"checkpoint": "", "fingerprint": ""}}

    def display_name(self, config: dict[str, Any]) -> str:
        return describe(config["checkpoint"])["method"] if config.get("checkpoint") else self.name

    def needs_calibration(self, scheme: Scheme) -> bool:
        return False

    def quantize(self, model: nn.Module, scheme: Scheme, config: dict[str, Any],
                 calib: Calibration | None) -> dict[str, Any]:
        if not config.get("checkpoint"):
            raise UserError("the external method reads a checkpoint: run `lrq-bench run --model <its folder>`.")
        return apply_checkpoint(model, config["checkpoint"])
