"""Save a quantized model in the compressed-tensors "pack-quantized" layout and load it back.

Any method's output exports the same way (LRQ and FlexRound fold their learned scaling into ordinary
integers + per-channel/group scale + zero point, so their files are indistinguishable from RTN's).

Per quantized linear `<prefix>` (compressed-tensors names and conventions):
  <prefix>.weight_packed      int32 [out, ceil(in * b / 32)]  dense LSB-first bit stream of q (lrq.packing;
                              a PackedLinear's in-memory planar layout is converted on the way out and in);
                              compressed-tensors' signed value q - 2^(b-1) plus its 2^(b-1) offset is q
  <prefix>.weight_scale       float32 [out, n_groups] (fp16 when exported from an already packed model)
  <prefix>.weight_zero_point  int32 [ceil(out * b / 32), n_groups]  signed zero point z - 2^(b-1), packed along dim 0
  <prefix>.weight_shape       int64 [2]
  <prefix>.input_scale / .input_zero_point   the static per-tensor activation range (w8a8)
and config.json carries `quantization_config` (quant_method compressed-tensors, format pack-quantized,
one config group targeting Linear, lm_head ignored). A ragged last group (in_features not a multiple of
the group size, e.g. 576 = 4 x 128 + 64) is stored as ceil(in / g) groups; loaders that assume
divisibility must be told, so the exporter records `lrq_bench.ragged_groups` in the config.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from torch import nn

from lrq.arch import KV_LINEARS, decoder_blocks, iter_linears, set_submodule
from lrq.errors import UserError
from lrq.io import atomic_write, atomic_write_text
from lrq.packed import PackedLinear, pack_model
from lrq.packing import pack_bits, stream_to_planar, unpack_bits
from lrq.qlinear import QuantLinear
from lrq.schemes import SCHEMES, Scheme, activation_mode_for
from lrq.io import dumps_json

FORMAT = "pack-quantized"


def _quant_args(scheme: Scheme) -> dict:
    weights = {"num_bits": scheme.w_bits, "type": "int", "symmetric": False, "dynamic": False,
               "strategy": "channel" if scheme.group_size is None else "group",
               "group_size": scheme.group_size, "actorder": None, "observer": "minmax"}
    acts = None
    if scheme.a_bits is not None:
        acts = scheme.activations.compressed_tensors(scheme.a_bits)
    # the format is also given per group: loaders otherwise infer one from the activation settings
    return {"targets": ["Linear"], "weights": weights, "input_activations": acts, "output_activations": None,
            "format": FORMAT}


def quantization_config(scheme: Scheme, ragged: bool) -> dict:
    """compressed-tensors' config. `dequantize: true` asks transformers to expand the packed integers into dense
    weights as it loads: compressed-tensors 0.18-0.20 build the model on the meta device with an unpacked zero
    point and then refuse the packed one this format (and compressed-tensors' own writer) stores, so without it
    `AutoModelForCausalLM.from_pretrained` fails on every asymmetric pack-quantized checkpoint; with it the
    logits equal ours exactly (tests/test_export.py). The file itself stays the standard packed layout."""
    return {"quant_method": "compressed-tensors", "format": FORMAT, "quantization_status": "compressed",
            "config_groups": {"group_0": _quant_args(scheme)}, "ignore": ["lm_head"], "dequantize": True,
            "lrq_bench": {"scheme": scheme.to_dict(), "ragged_groups": ragged}}


def group_fit_problem(scheme: Scheme, in_widths) -> str | None:
    """Why compressed-tensors loaders would refuse `scheme` on layers of these input widths (a group size that
    does not divide one of them), with the schemes that would fit, or None."""
    if scheme.group_size is None:
        return None
    bad = sorted({w for w in in_widths if w % scheme.group_size})
    if not bad:
        return None
    fits = [s.name for s in SCHEMES.values() if s.w_bits == scheme.w_bits and s.a_bits == scheme.a_bits
            and s.group_size and all(w % s.group_size == 0 for w in in_widths) and s.kv_bits is None]
    return (f"group size {scheme.group_size} does not divide the input width of every layer ({', '.join(map(str, bad))}): "
            f"compressed-tensors loaders (transformers, vLLM) reject such a checkpoint. Use "
            + (f"--scheme {fits[0]} ({fits[0].split('-g')[1]} divides every width)" if fits else "a per-channel scheme")
            + ", or --allow-ragged for a folder only lrq-bench's own loader (lrq.load) reads.")


def _scheme_of(model: nn.Module) -> Scheme:
    schemes = {m.scheme for m in model.modules() if isinstance(m, (QuantLinear, PackedLinear))}
    if not schemes:
        raise UserError("the model has no quantized linears: quantize it (lrq-bench run / a method) before export.")
    if len(schemes) > 1:
        raise UserError(f"the model mixes schemes ({', '.join(sorted(s.name for s in schemes))}); export needs one.")
    scheme = schemes.pop()
    if scheme.kv_bits is not None:
        raise UserError(f"scheme {scheme.name}: per-token K/V quantization has no compressed-tensors equivalent "
                        f"(its kv_cache_scheme is static per-tensor); export the scheme without -kv8.")
    return scheme


@torch.no_grad()
def save_compressed(model: nn.Module, out_dir: str | os.PathLike, tokenizer=None, metadata: dict | None = None,
                    allow_ragged: bool = False) -> Path:
    """Write model.safetensors + config.json (+ the tokenizer) to out_dir, atomically per file.

    compressed-tensors (and so vLLM and transformers) refuse a group size that does not divide every
    layer's input width; such a model is written only with allow_ragged=True (lrq-bench reads it back)."""
    if getattr(model, "_lrq_head", None):
        raise UserError(f"this model's output head was packed in memory ({model._lrq_head}, lrq.packed.quantize_head): "
                        "the checkpoint leaves lm_head unquantized, so export the model before quantizing its head "
                        "and quantize the head again after loading it")
    scheme = _scheme_of(model)
    problem = None if allow_ragged else group_fit_problem(scheme, [m.in_features for _, _, m in iter_linears(model)])
    if problem:
        raise UserError(problem.replace("--allow-ragged", "allow_ragged=True"))
    # the scales as the quantized model holds them (float32 from every method): a checkpoint read back, by
    # transformers or as a cell of its own, then computes exactly what the model in memory computed; the packed
    # model keeps its fp16 copy (lrq.packed), which is what it had already
    scales = {f"model.layers.{i}.{name}": m.scale.detach().float().clone()
              for i, name, m in iter_linears(model) if isinstance(m, QuantLinear)}
    if any(isinstance(m, QuantLinear) for m in model.modules()):
        pack_model(model)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tensors: dict[str, torch.Tensor] = {}
    quantized_prefixes = set()
    ragged = False
    for i, name, m in iter_linears(model):
        prefix = f"model.layers.{i}.{name}"
        quantized_prefixes.add(prefix)
        ragged |= scheme.group_size is not None and m.in_features % scheme.group_size != 0
        tensors[f"{prefix}.weight_packed"] = pack_bits(m.levels(), scheme.w_bits).contiguous()
        tensors[f"{prefix}.weight_scale"] = scales.get(prefix, m.scale).contiguous()
        zp = m.zero.to(torch.int64)   # = (z - offset) + offset: pack the signed zero point with its offset
        tensors[f"{prefix}.weight_zero_point"] = pack_bits(zp.t().contiguous(), scheme.w_bits).t().contiguous()
        tensors[f"{prefix}.weight_shape"] = torch.tensor([m.out_features, m.in_features], dtype=torch.int64)
        if m.bias is not None:
            tensors[f"{prefix}.bias"] = m.bias.contiguous()
        if scheme.static_activations:
            tensors[f"{prefix}.input_scale"] = m.act_scale.reshape(1).float().contiguous()
            tensors[f"{prefix}.input_zero_point"] = (m.act_zero.reshape(1) - 128).to(torch.int8).contiguous()
    tied = bool(getattr(model.config, "tie_word_embeddings", False))
    for key, t in model.state_dict().items():
        if any(key.startswith(p + ".") for p in quantized_prefixes) or (tied and key == "lm_head.weight"):
            continue
        tensors[key] = t.detach().contiguous().clone()
    meta = {"format": "pt", "lrq_bench": dumps_json(metadata or {}, default=str)}
    atomic_write(out / "model.safetensors", lambda p: save_file(tensors, str(p), metadata=meta))
    cfg = model.config.to_dict()
    cfg["quantization_config"] = quantization_config(scheme, ragged)
    atomic_write_text(out / "config.json", dumps_json(cfg, indent=2, default=str))
    if tokenizer is not None:
        tokenizer.save_pretrained(str(out))
    generation = getattr(model, "generation_config", None)
    if generation is not None:   # the source's decoding defaults (eos ids, sampling) travel with the export
        generation.save_pretrained(str(out))
    return out



def scheme_from_config(qc: dict) -> Scheme:
    """The suite's Scheme for a compressed-tensors quantization_config written by save_compressed."""
    if qc.get("quant_method") != "compressed-tensors" or qc.get("format") != FORMAT:
        raise UserError(f"not a compressed-tensors {FORMAT} checkpoint (quant_method={qc.get('quant_method')!r}, "
                        f"format={qc.get('format')!r}).")
    own = qc.get("lrq_bench", {}).get("scheme")
    if own:
        return Scheme(**own)
    (group,) = qc["config_groups"].values()
    w, a = group["weights"], group.get("input_activations")
    if w.get("symmetric"):
        raise UserError("symmetric compressed-tensors weights are not supported by the loader (lrq-bench stores "
                        "asymmetric integers with zero points).")
    for s in SCHEMES.values():
        if (s.w_bits, s.group_size) == (w["num_bits"], w.get("group_size") if w["strategy"] == "group" else None) \
                and (s.a_bits is None) == (a is None) and s.kv_bits is None \
                and (a is None or s.activations == activation_mode_for(a.get("strategy"), bool(a.get("dynamic")))):
            return s
    raise UserError(f"no lrq-bench scheme matches this quantization config: {json.dumps(group)}")


@torch.no_grad()
def load_compressed(path: str | os.PathLike, dtype: torch.dtype | None = None) -> nn.Module:
    """Rebuild the model from save_compressed's folder with PackedLinear modules, scales and biases at the precision
    the file holds: the logits of the model that was exported (on the CPU; the GPU kernels read fp16 scales)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    folder = Path(path)
    if not (folder / "config.json").is_file() or not (folder / "model.safetensors").is_file():
        raise UserError(f"{folder} is not an exported model folder (config.json and model.safetensors expected).")
    cfg_dict = json.loads((folder / "config.json").read_text())
    scheme = scheme_from_config(cfg_dict.get("quantization_config") or {})
    config = AutoConfig.from_pretrained(str(folder))
    if hasattr(config, "quantization_config"):
        delattr(config, "quantization_config")
    tensors = load_file(str(folder / "model.safetensors"))
    emb_dtype = tensors["model.embed_tokens.weight"].dtype
    model = AutoModelForCausalLM.from_config(config, dtype=dtype or emb_dtype)
    blocks = decoder_blocks(model)
    quantized: set[str] = set()
    for i, name, lin in list(iter_linears(model)):
        prefix = f"model.layers.{i}.{name}"
        out_f, in_f = (int(v) for v in tensors.pop(f"{prefix}.weight_shape"))
        scale = tensors.pop(f"{prefix}.weight_scale")
        bias = tensors.pop(f"{prefix}.bias", None)
        # the scales and bias at the precision they were saved in (float32 from a quantized model, fp16 from an
        # already packed one): the loaded model then computes what the exported one did, as transformers' load does
        m = PackedLinear(in_f, out_f, bias is not None, scheme, quantize_output=name in KV_LINEARS,
                         scale_dtype=scale.dtype, bias_dtype=bias.dtype if bias is not None else torch.float16)
        m.weight_packed.copy_(stream_to_planar(tensors.pop(f"{prefix}.weight_packed"), scheme.w_bits, in_f))
        m.scale.copy_(scale)
        zp = tensors.pop(f"{prefix}.weight_zero_point")
        m.zero.copy_(unpack_bits(zp.t().contiguous(), scheme.w_bits, out_f).t())
        if m.bias is not None:
            m.bias.copy_(bias)
        if scheme.static_activations:
            m.act_scale.copy_(tensors.pop(f"{prefix}.input_scale").reshape(()))
            m.act_zero.copy_(tensors.pop(f"{prefix}.input_zero_point").reshape(()).float() + 128)
        m.convert_for_cpu()
        set_submodule(blocks[i], name, m)
        quantized.add(prefix)
    missing, unexpected = model.load_state_dict(tensors, strict=False)
    missing = [k for k in missing if not any(k.startswith(p + ".") for p in quantized)
               and not (k == "lm_head.weight" and getattr(config, "tie_word_embeddings", False))]
    if missing or unexpected:
        raise UserError(f"{folder}: the checkpoint does not match the model: missing {missing[:5]}, "
                        f"unexpected {list(unexpected)[:5]}.")
    if getattr(config, "tie_word_embeddings", False):
        model.tie_weights()
    return model.eval()
