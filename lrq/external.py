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

The method is `external` (baselines/external.py, the plug-in that reads through this module); its cells are
named from the checkpoint (`external:<producer>-w4g128`) and keyed by the checkpoint's content fingerprint. One
of our own exports read back this way reproduces its cell's numbers exactly (tests/test_external.py).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from torch import nn

from lrq.errors import UserError
from lrq.io import plain_text
from lrq.schemes import SCHEMES, Scheme, activation_mode_for


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


def _int_field(d: dict, key: str, where: str, lo: int, hi: int, default=None, allow_none: bool = False):
    """An integer setting of the quantization_config, checked: anything else is bad input naming the field."""
    v = d.get(key, default)
    if v is None and allow_none:
        return None
    if isinstance(v, bool) or not isinstance(v, int) or not lo <= v <= hi:
        raise UserError(f"{where}: quantization_config {key} is {v!r}; an integer from {lo} to {hi} is expected. "
                        f"The checkpoint's config.json is damaged or of a format lrq-bench does not read.")
    return v


LM_HEAD_ONLY = ([], ["lm_head"], ["re:.*lm_head"], ["re:.*lm_head$"])   # what the suite leaves unquantized too
DECLARES_NOTHING = (None, False, "", {}, [])


def _refuse_unsupported(where: str, declared: dict[str, Any]) -> None:
    """Quantization the checkpoint declares that the suite does not implement (field -> the value it declares,
    one of DECLARES_NOTHING where it declares none): refused naming the field, never scored as the scheme its
    other settings map to."""
    for field, value in declared.items():
        if value not in DECLARES_NOTHING:
            raise UserError(f"{where}: quantization_config {field} is {value!r}: lrq-bench does not implement this "
                            f"quantization, and scored without it the checkpoint would be measured as another model. "
                            f"Not supported: quantize the model without it to score it here.")


def _declared_compressed_tensors(qc: dict, group: dict, w: dict, a: dict | None) -> dict[str, Any]:
    """What a compressed-tensors config declares beyond integer weights (and integer input activations)."""
    sparsity = qc.get("sparsity_config")
    fmt = {qc.get("format"), group.get("format")} - {None, "pack-quantized", "int-quantized"}
    return {"format": sorted(fmt)[0] if fmt else None, "kv_cache_scheme": qc.get("kv_cache_scheme"),
            "sparsity_config": None if isinstance(sparsity, dict) and sparsity.get("format") == "dense" else sparsity,
            "transform_config": qc.get("transform_config"),
            "ignore": None if qc.get("ignore") in LM_HEAD_ONLY else qc.get("ignore"),
            "output_activations": group.get("output_activations"), "weights dynamic": w.get("dynamic"),
            "input_activations type": None if not isinstance(a, dict) or a.get("type", "int") == "int" else a["type"],
            "input_activations dynamic": None if not isinstance(a, dict) or a.get("dynamic") in (None, False, True)
            else a["dynamic"]}


def _weights_args(qc: dict, where: str = "config.json") -> tuple[dict, dict | None]:
    if qc["quant_method"] == "gptq":
        fmt = qc.get("checkpoint_format", "gptq")
        _refuse_unsupported(where, {"dynamic": qc.get("dynamic"), "lm_head": qc.get("lm_head"),
                                    "is_marlin_format": qc.get("is_marlin_format"),
                                    "checkpoint_format": None if fmt in ("gptq", "gptq_v2") else fmt})
        bits = _int_field(qc, "bits", where, 1, 8)
        gs = _int_field(qc, "group_size", where, -1, 1 << 20, default=-1)
        sym = qc.get("sym", True)
        if not isinstance(sym, bool):
            raise UserError(f"{where}: quantization_config sym is {sym!r}; true or false is expected.")
        return {"num_bits": bits, "group_size": None if gs <= 0 else gs, "symmetric": sym,
                "strategy": "group" if gs > 0 else "channel"}, None
    groups = qc.get("config_groups")
    if not isinstance(groups, dict) or not all(isinstance(g, dict) for g in groups.values()):
        raise UserError(f"{where}: quantization_config config_groups is {type(groups).__name__}; an object of "
                        f"groups is expected.")
    groups = list(groups.values())
    if len(groups) != 1:
        raise UserError(f"the checkpoint has {len(groups)} quantization config groups: one (every Linear alike) "
                        f"is supported.")
    w, a = groups[0].get("weights"), groups[0].get("input_activations")
    if not isinstance(w, dict):
        raise UserError(f"{where}: config_groups weights is {w!r}; the weights' quantization arguments (num_bits, "
                        f"strategy, group_size, symmetric) are expected.")
    if w.get("type", "int") != "int":
        raise UserError(f"the checkpoint's weights are {w.get('type')}, not integers: not supported.")
    _int_field(w, "num_bits", where, 1, 8)
    strategy = w.get("strategy", "channel")
    if strategy not in ("channel", "group", "tensor", "block"):
        raise UserError(f"{where}: weights strategy is {strategy!r}; channel, group, block or tensor is expected.")
    if strategy == "group":
        _int_field(w, "group_size", where, 1, 1 << 20)
    if not isinstance(w.get("symmetric", True), bool):
        raise UserError(f"{where}: weights symmetric is {w.get('symmetric')!r}; true or false is expected.")
    if a is not None and not isinstance(a, dict):
        raise UserError(f"{where}: config_groups input_activations is {a!r}; an object or null is expected.")
    _refuse_unsupported(where, _declared_compressed_tensors(qc, groups[0], w, a))
    if a is not None:
        _int_field(a, "num_bits", where, 1, 16)
    return w, a


def describe(folder: str | Path) -> dict:
    """What the checkpoint is: format, producer, bits, group size, symmetry, activations, the scheme it maps
    to, the cell's method name and the FP model its metadata names."""
    folder = Path(folder)
    qc = quantization_config(folder)
    if qc is None:
        raise UserError(f"{folder} is not a quantized checkpoint (no compressed-tensors or GPTQ quantization_config "
                        f"in its config.json).")
    w, a = _weights_args(qc, str(folder / "config.json"))
    bits = int(w["num_bits"])
    group = w.get("group_size") if w.get("strategy") == "group" else None
    if w.get("strategy") == "block":
        group = (w.get("block_structure") or [None, None])[1]
    a_mode = None if not a else activation_mode_for(a.get("strategy"), bool(a.get("dynamic"))).name
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
    if meta.get("method"):   # a stored string: it names the cell everywhere the method is shown
        return f"lrq-bench-{plain_text(meta['method'])}"
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


INDEX = "model.safetensors.index.json"


def _index(folder: Path) -> dict[str, str] | None:
    """The checkpoint's safetensors index (tensor name -> file), or None where it has none."""
    path = folder / INDEX
    if not path.exists():
        return None
    try:
        weight_map = json.loads(path.read_text(encoding="utf-8")).get("weight_map")
    except (OSError, UnicodeDecodeError, ValueError, AttributeError) as e:
        raise UserError(f"{path}: cannot be read as a safetensors index ({type(e).__name__}): the checkpoint is "
                        f"damaged; copy it again.") from None
    if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
        raise UserError(f"{path}: its weight_map is not an object of tensor names to file names: the checkpoint is "
                        f"damaged; copy it again.")
    return weight_map


def _read_weights_file(f: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file
    try:
        if not f.is_file() or f.resolve().is_char_device():
            raise OSError("not a regular file")
        return load_file(str(f))
    except Exception as e:  # noqa: BLE001 - an unreadable weights file is the user's to fix
        raise UserError(f"{f}: cannot be read as safetensors ({type(e).__name__}: {str(e)[:160]}).") from None


def _tensors(folder: Path) -> dict[str, torch.Tensor]:
    """Every tensor of every .safetensors file of the folder (hidden ones too: the model's fingerprint covers the
    same files). A file that is not a regular safetensors file (a symlink loop, a device, truncated, garbage) or a
    tensor stored twice is bad input naming the file; so is, where the folder has a safetensors index, a shard it
    names that is missing, a weights file it does not name, or a tensor it places in a file that does not hold it."""
    files = sorted(folder.glob("*.safetensors"))
    index = _index(folder)
    if index is not None:
        missing = sorted(set(index.values()) - {f.name for f in files})
        unnamed = [f.name for f in files if f.name not in set(index.values())]
        if missing or unnamed:
            raise UserError(f"{folder}: its index ({INDEX}) names weights files " + (
                f"that are missing ({', '.join(missing[:4])}): copy the checkpoint whole." if missing else
                f"and not {', '.join(unnamed[:4])}: which tensors are the model's is not clear. Remove the extra "
                f"file."))
    if not files:
        raise UserError(f"{folder} holds no .safetensors weights.")
    out: dict[str, torch.Tensor] = {}
    held_by: dict[str, str] = {}
    for f in files:
        part = _read_weights_file(f)
        twice = set(part) & set(out)
        if twice:
            raise UserError(f"{f}: tensors also stored in another file of the folder ({', '.join(sorted(twice)[:3])}): "
                            f"which one is the model's is not clear. Remove the extra file.")
        out.update(part)
        held_by.update(dict.fromkeys(part, f.name))
    misplaced = [k for k, name in (index or {}).items() if held_by.get(k) != name]
    if misplaced:
        k = misplaced[0]
        raise UserError(f"{folder}: its index ({INDEX}) places {k} in {index[k]}, and " + (
            f"it is in {held_by[k]}" if k in held_by else "no file holds it") + f" ({len(misplaced)} such tensor(s)): "
            f"the checkpoint is incomplete or damaged; copy it whole.")
    return out


def _unpack_stream(packed: torch.Tensor, bits: int, n: int) -> torch.Tensor:
    """compressed-tensors' dense LSB-first bit stream along the last dimension: [rows, words] -> [rows, n]."""
    from lrq.packing import unpack_bits
    return unpack_bits(packed.contiguous(), bits, n)


INTS = (torch.int8, torch.int16, torch.int32, torch.int64)
FLOATS = (torch.float16, torch.bfloat16, torch.float32)


def _checked(t: dict, prefix: str, name: str, dtypes: tuple, shape: tuple[int, ...] | None = None) -> torch.Tensor:
    """The tensor `<prefix>.<name>`, of one of `dtypes` (the types its format stores it in: integers read as
    floats, or floats as integers, would be other numbers) and of `shape` where given."""
    v = t[f"{prefix}.{name}"]
    if v.dtype not in dtypes:
        raise UserError(f"{prefix}: {name} is {v.dtype}; {' or '.join(map(str, dtypes))} is expected: the checkpoint "
                        f"stores it in a type its format does not use (damaged, or of a layout lrq-bench does not "
                        f"read).")
    if shape is not None and tuple(v.shape) != shape:
        raise UserError(f"{prefix}: {name} has shape {tuple(v.shape)}; {shape} is expected: the checkpoint does not "
                        f"match its config, or is of another model than the reference (name the right one with "
                        f"--reference-model).")
    return v


def _levels_compressed_tensors(t: dict, prefix: str, bits: int, shape: tuple[int, int]) -> torch.Tensor:
    """The unsigned levels [out, in] of pack-quantized (int32 words) or int-quantized (int8) weights, after the
    shape the checkpoint declares (weight_shape) is checked against the layer's."""
    from lrq.packing import packed_words
    out_f, in_f = shape
    if f"{prefix}.weight_shape" in t:
        declared = tuple(int(v) for v in _checked(t, prefix, "weight_shape", INTS, (2,)))
        if declared != shape:
            raise UserError(f"{prefix}: its weight_shape says {declared}, and the reference model's layer is "
                            f"{out_f} x {in_f}: the checkpoint is of another model (name the right one with "
                            f"--reference-model) or damaged.")
    if f"{prefix}.weight_packed" in t:                                          # stored unsigned (signed + 2^(b-1))
        return _unpack_stream(_checked(t, prefix, "weight_packed", (torch.int32,), (out_f, packed_words(in_f, bits))),
                              bits, in_f)
    if f"{prefix}.weight" in t and not t[f"{prefix}.weight"].is_floating_point():
        return _checked(t, prefix, "weight", (torch.int8,), shape).to(torch.int64) + (1 << (bits - 1))
    raise UserError(f"{prefix}: neither weight_packed nor integer weight in the checkpoint.")


def read_compressed_tensors(t: dict, prefix: str, bits: int, group: int | None, symmetric: bool,
                            shape: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(unsigned levels [out, in], scale [out, G], unsigned zero [out, G]) of one linear."""
    out_f, in_f = shape
    off = 1 << (bits - 1)
    q = _levels_compressed_tensors(t, prefix, bits, shape)
    g_idx = t.get(f"{prefix}.weight_g_idx")
    if g_idx is not None and not torch.equal(g_idx.long(), torch.arange(in_f) // (group or in_f)):
        raise UserError(f"{prefix}: the checkpoint quantizes with activation order (weight_g_idx: its groups are "
                        f"permuted column sets, not contiguous ranges), which lrq-bench's quantized linear does not "
                        f"hold. Not supported: export the model without act-order (llm-compressor: "
                        f"actorder=None) to score it here.")
    if f"{prefix}.weight_scale" not in t:
        raise UserError(f"{prefix}: the checkpoint has no weight_scale for it.")
    n_groups = 1 if not group else -(-in_f // group)
    scale = t[f"{prefix}.weight_scale"]
    if tuple(scale.shape) != (out_f, n_groups):
        raise UserError(f"{prefix}: weight_scale has shape {tuple(scale.shape)}; the config "
                        f"({'group ' + str(group) if group else 'per channel'}) of a {out_f} x {in_f} weight needs "
                        f"({out_f}, {n_groups}).")
    scale = _checked(t, prefix, "weight_scale", FLOATS).float()
    has_zp = f"{prefix}.weight_zero_point" in t
    if symmetric and has_zp or not symmetric and not has_zp:
        raise UserError(f"{prefix}: the config says {'symmetric' if symmetric else 'asymmetric'} weights and the "
                        f"checkpoint {'has' if has_zp else 'has no'} weight_zero_point: its tensors do not match "
                        f"its config.")
    if symmetric:
        zero = torch.full_like(scale, float(off))
    else:
        zp = _checked(t, prefix, "weight_zero_point", INTS)
        if zp.dtype == torch.int32 and zp.shape[0] != out_f:                   # packed along the output rows
            zero = _unpack_stream(zp.t(), bits, out_f).t().float()
        else:
            zero = zp.float() + off
        if tuple(zero.shape) != (out_f, n_groups):
            raise UserError(f"{prefix}: weight_zero_point has shape {tuple(zp.shape)}; ({out_f}, {n_groups}) is "
                            f"expected.")
    top = (1 << bits) - 1
    if int(q.min()) < 0 or int(q.max()) > top or float(zero.min()) < 0 or float(zero.max()) > top:
        raise UserError(f"{prefix}: integers outside the {bits}-bit range the config declares (levels "
                        f"{int(q.min()) - off}..{int(q.max()) - off}, zero points {float(zero.min()) - off:g}.."
                        f"{float(zero.max()) - off:g}, signed); they are never clamped into it.")
    _check_scale(prefix, "weight_scale", scale)
    return q.to(torch.uint8), scale, zero


def _check_finite(prefix: str, name: str, t: torch.Tensor) -> None:
    if not torch.isfinite(t).all():
        raise UserError(f"{prefix}: {name} holds NaN or infinite values: the checkpoint is damaged (nothing was "
                        f"evaluated or stored).")


def _check_scale(prefix: str, name: str, t: torch.Tensor) -> None:
    """A scale is finite and positive: a zero or negative one (which some loaders would take as it is, flipping or
    zeroing a row) means a damaged checkpoint."""
    _check_finite(prefix, name, t)
    bad = t <= 0
    if bad.any():
        raise UserError(f"{prefix}: {name} holds zero or negative values ({int(bad.sum())} of {t.numel()}, the "
                        f"smallest {float(t.min()):g}): quantization scales are positive, so the checkpoint is "
                        f"damaged (nothing was evaluated or stored).")


def read_gptq(t: dict, prefix: str, bits: int, group: int | None, symmetric: bool, shape: tuple[int, int],
              zero_offset: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """AutoGPTQ / GPTQModel layout: qweight int32 [in * b / 32, out] (packed along the input, LSB first),
    qzeros int32 [G, out * b / 32], scales [G, out], g_idx [in] (act-order refused: its groups are not
    contiguous). `zero_offset`: 1 for the original format, whose stored zeros are z - 1."""
    from lrq.packing import packed_words, unpack_bits
    out_f, in_f = shape
    gs = group or in_f
    n_groups = -(-in_f // gs)
    missing = [k for k in ("qweight", "qzeros", "scales") if f"{prefix}.{k}" not in t]
    if missing:
        raise UserError(f"{prefix}: the GPTQ checkpoint has no {', '.join(missing)} for it.")
    g_idx = _checked(t, prefix, "g_idx", INTS) if f"{prefix}.g_idx" in t else None
    if g_idx is not None and not torch.equal(g_idx.long(), torch.arange(in_f) // gs):
        raise UserError(f"{prefix}: the checkpoint uses act-order (desc_act): its groups are not contiguous "
                        f"column ranges, which the suite's quantized linear cannot hold.")
    qweight = _checked(t, prefix, "qweight", (torch.int32,), (packed_words(in_f, bits), out_f))
    q = unpack_bits(qweight.t().contiguous(), bits, in_f)                                       # [out, in]
    scale = _checked(t, prefix, "scales", FLOATS, (n_groups, out_f)).float().t().contiguous()    # [out, G]
    qzeros = _checked(t, prefix, "qzeros", (torch.int32,), (n_groups, packed_words(out_f, bits)))
    zero = unpack_bits(qzeros.contiguous(), bits, out_f).t().float() + zero_offset
    if symmetric:
        zero = torch.full_like(scale, float(1 << (bits - 1)))
    _check_scale(prefix, "scales", scale)
    return q.to(torch.uint8), scale, zero


def _check_complete(model: nn.Module, t: dict, folder: Path) -> None:
    """Every tensor of the model outside its block linears (embeddings, norms, the head unless tied) is in the
    checkpoint: one it lacks (a shard not copied) is never taken from the reference model, which would score a
    model nobody quantized."""
    from lrq.arch import iter_linears
    prefixes = tuple(f"model.layers.{i}.{name}." for i, name, _ in iter_linears(model))
    tied = bool(getattr(model.config, "tie_word_embeddings", False))
    missing = [k for k in model.state_dict() if k not in t and not k.startswith(prefixes)
               and not (tied and k == "lm_head.weight")]
    if missing:
        raise UserError(f"{folder}: the checkpoint lacks {', '.join(missing[:4])}"
                        + (f" and {len(missing) - 4} more tensor(s)" if len(missing) > 4 else "")
                        + ", which the model has: a weights file was not copied, or it is of another model. Copy the "
                          "checkpoint whole (lrq-bench never fills a tensor in from the reference model).")


def _read_linear(t: dict, qc: dict, info: dict, scheme: Scheme, prefix: str,
                 shape: tuple[int, int]) -> tuple[tuple[torch.Tensor, torch.Tensor, torch.Tensor], list[str]]:
    """One block linear's (levels, scale, zero), checked with its bias and activation range; and the names of the
    checkpoint's tensors it reads."""
    bits, group, sym = info["bits"], info["group_size"], info["symmetric"]
    if info["quant_method"] == "gptq":
        fmt = str(qc.get("checkpoint_format", "gptq"))
        read = read_gptq(t, prefix, bits, group, sym, shape, 0 if fmt == "gptq_v2" else 1)
        names = ("qweight", "qzeros", "scales", "g_idx", "bias")
    else:
        read = read_compressed_tensors(t, prefix, bits, group, sym, shape)
        names = ("weight_packed", "weight", "weight_scale", "weight_zero_point", "weight_shape", "weight_g_idx",
                 "bias", "input_scale", "input_zero_point")
    if f"{prefix}.bias" in t:
        _check_finite(prefix, "bias", _checked(t, prefix, "bias", FLOATS, (shape[0],)).float())
    if scheme.static_activations:
        if f"{prefix}.input_scale" not in t:
            raise UserError(f"{prefix}: the config declares static activations and the checkpoint has no "
                            f"input_scale for it.")
        _check_scale(prefix, "input_scale", _checked(t, prefix, "input_scale", FLOATS).float())
        if f"{prefix}.input_zero_point" in t:
            _checked(t, prefix, "input_zero_point", INTS)
    return read, [f"{prefix}.{k}" for k in names if f"{prefix}.{k}" in t]


@torch.no_grad()
def apply_checkpoint(model: nn.Module, folder: str | Path, check_only: bool = False,
                     tensors: dict[str, torch.Tensor] | None = None) -> dict[str, Any]:
    """Replace `model`'s block linears by QuantLinears holding the checkpoint's integers and copy every other
    parameter it stores. Returns statistics, among them the bits per weight the checkpoint really stores.
    `check_only`: read and check everything (shapes and dtypes against the config and the model, integer ranges,
    positive finite scales, tensors the model lacks or the checkpoint lacks) and change nothing: what the driver
    runs before any work. `tensors`: the folder's tensors where the caller has read them already (`_tensors`)."""
    from lrq.arch import KV_LINEARS, decoder_blocks, iter_linears, set_submodule
    from lrq.qlinear import QuantLinear
    folder = Path(folder)
    info = describe(folder)
    qc = quantization_config(folder)
    scheme = SCHEMES[info["scheme"]]
    t = _tensors(folder) if tensors is None else tensors
    _check_complete(model, t, folder)
    blocks = decoder_blocks(model)
    stored_bits = n_weights = 0
    used = set()
    for i, name, lin in list(iter_linears(model)):
        prefix = f"model.layers.{i}.{name}"
        try:   # a refusal names the checkpoint as well as the tensor
            (q, scale, zero), keys = _read_linear(t, qc, info, scheme, prefix, (lin.out_features, lin.in_features))
        except UserError as e:
            raise UserError(f"{folder}: {e}") from None
        used.update(keys)
        if check_only:
            continue
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
        # what the checkpoint stores per weight: the levels, a 16-bit scale and (asymmetric) a zero point per group
        ng = scale.shape[1]
        stored_bits += (info["bits"] * lin.in_features * lin.out_features
                        + ng * lin.out_features * (16 + (0 if info["symmetric"] else info["bits"])))
        n_weights += lin.in_features * lin.out_features
    replaced = _copy_other_tensors(model, {k: v for k, v in t.items() if k not in used}, folder, check_only)
    if check_only:
        return {"external": info}
    return {"bits_per_weight": stored_bits / n_weights, "external": info, "replaced_params": replaced}


def _copy_other_tensors(model: nn.Module, rest: dict[str, torch.Tensor], folder: Path, check_only: bool) -> int:
    """The checkpoint's tensors outside the block linears copied into the model (checked only, with
    `check_only`): each must be one of the model's, of its shape and finite. Returns how many differ from the
    reference model's."""
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
        if v.is_floating_point():
            _check_finite(k, "the stored tensor", v.float())
        replaced += not torch.equal(params[k].detach().to(v.dtype), v)
        if not check_only:
            params[k].copy_(v.to(params[k].dtype))
    return replaced


def check_against_reference(folder: str | Path, model: nn.Module, reference: str, itself: bool) -> None:
    """Before any work: the checkpoint is not its own reference (`itself`: the caller found the reference's
    weights to be the checkpoint's, by its folder or its content fingerprint), it reads whole against the
    reference model (every check of `apply_checkpoint`), and the reference is the model it was quantized from,
    as far as the tensors they share say (the token embeddings, which no method of either side changes)."""
    folder = Path(folder).expanduser().resolve()
    if itself:
        raise UserError(f"the reference model {reference!r} is the checkpoint {folder} itself: scored against itself "
                        f"it would show KLD 0 and top-1 agreement 1. Pass the floating-point model it was quantized "
                        f"from with --reference-model.")
    vocab = getattr(model.config, "vocab_size", None)
    cfg = json.loads((folder / "config.json").read_text(encoding="utf-8"))
    if vocab is not None and cfg.get("vocab_size") not in (None, vocab):
        raise UserError(f"{folder}: its vocabulary has {cfg.get('vocab_size')} tokens and the reference model "
                        f"{reference!r} has {vocab}: it is not the model this checkpoint was quantized from. Pass the "
                        f"right one with --reference-model.")
    t = _tensors(folder)   # read once, for every check below
    apply_checkpoint(model, folder, check_only=True, tensors=t)
    emb = t.get("model.embed_tokens.weight")
    if emb is not None:
        mine = model.get_input_embeddings().weight.detach()
        diff = (mine.to(emb.dtype).float() - emb.float()).norm() / emb.float().norm().clamp(min=1e-12)
        if float(diff) > 1e-3:
            raise UserError(f"{folder}: its token embeddings differ from those of the reference model {reference!r} "
                            f"(relative difference {float(diff):.3g}): it is not the model this checkpoint was "
                            f"quantized from, and its KLD against it would mean nothing. Pass the right one with "
                            f"--reference-model.")
