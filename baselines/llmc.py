"""llm-compressor's GPTQ, AWQ and SmoothQuant as methods of this suite (adapters): `llmc-gptq`,
`llmc-awq`, `llmc-smoothquant`. Their cells are ordinary cells: settled, stored, reported and gated like
every other, so a cross-check is two cells with the same calibration windows.

llm-compressor (PyPI `llmcompressor`) pins transformers and compressed-tensors versions of its own, so it
runs in its own virtual environment (setting `venv`, default `.venv-llmc` at the repository root):

    python3.11 -m venv .venv-llmc && .venv-llmc/bin/pip install torch==2.13.0 llmcompressor==0.14.0.1

`quantize` writes the floating-point model (with the tokenizer that made the calibration windows) and
the windows to a temporary folder, runs baselines/llmc_worker.py under that environment's python
(`oneshot` with the recipe below, batch 1, windows in order, hash-checked where they reach the
embedding), and loads the export back into this model: every block linear becomes a QuantLinear holding
llm-compressor's integers (recovered from its dequantized weights, which they must reproduce exactly),
scales, zero points (its signed convention + 2^(b-1)) and static input ranges, and the decoder
parameters it rescaled (norms) are copied. The stats record llm-compressor's own `oneshot` time, CPU
time and peak memory, its package versions and recipe, and how closely our copy reproduces its own
quantized forward (logits on the first window's start).

Scheme mapping (compressed-tensors QuantizationArgs): asymmetric integer weights with min/max ranges
(observer memoryless_minmax, their weight default), per output channel or in [1, group] blocks (their
'group' strategy refuses 576 columns with groups of 128; 'block' with block_structure [1, g] gives the
same grid as our ragged groups); activations per-tensor static with the global min/max (static_minmax)
or per-token dynamic. K/V output quantization has no counterpart.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

import torch
from torch import nn

from lrq.arch import LINEAR_NAMES
from lrq.config import MethodConfig, setting
from lrq.errors import UserError
from lrq.methods import Calibration, Method, register
from lrq.schemes import Scheme

REPO_ROOT = Path(__file__).resolve().parent.parent
LLMC_VERSION = "0.14.0.1"
TORCH_PIN = "torch==2.13.0"
VENV_COMMAND = (f"python3.11 -m venv .venv-llmc && .venv-llmc/bin/pip install {TORCH_PIN} "
                f"llmcompressor=={LLMC_VERSION}")
WORKER = Path(__file__).resolve().parent / "llmc_worker.py"


def scheme_to_llmc_args(scheme: Scheme) -> dict[str, Any]:
    """compressed-tensors QuantizationArgs (as plain dicts) for one of our schemes (see the module docstring).
    Both grids are ours shifted by 2^(b-1) (signed storage): the same levels."""
    if scheme.kv_bits is not None:
        raise UserError(f"scheme {scheme.name}: K/V output quantization has no llm-compressor counterpart.")
    weights: dict[str, Any] = {"num_bits": scheme.w_bits, "type": "int", "symmetric": False,
                               "observer": "memoryless_minmax"}
    if scheme.group_size is None:
        weights["strategy"] = "channel"
    else:
        weights.update(strategy="block", block_structure=[1, scheme.group_size])
    acts = None
    if scheme.a_bits is not None:
        acts = scheme.activations.llm_compressor(scheme.a_bits)
    return {"weights": weights, "input_activations": acts}


def llmc_python(venv: str | os.PathLike) -> Path:
    """The llm-compressor environment's interpreter, or a clear error saying how to create it."""
    venv = Path(venv)
    if not venv.is_absolute():
        venv = REPO_ROOT / venv
    py = venv / "bin" / "python"
    if not py.exists():
        raise UserError(
            f"the llm-compressor virtual environment {venv} does not exist. Create it (about 2 minutes, 1.5 GB) "
            f"from the repository root with: {VENV_COMMAND} (or python -m bench.studies.crosscheck_llmcompressor "
            f"setup-venv), or pass --set venv=PATH to an existing one.")
    probe = subprocess.run([str(py), "-c", "import llmcompressor, compressed_tensors"], capture_output=True, text=True)
    if probe.returncode != 0:
        last = probe.stderr.strip().splitlines()[-1] if probe.stderr.strip() else "no output"
        raise UserError(f"{py} cannot import llmcompressor ({last}). Install it there: "
                        f"{py.parent / 'pip'} install {TORCH_PIN} llmcompressor=={LLMC_VERSION}")
    return py


def apply_llmc_export(model: nn.Module, tensors: dict, scheme: Scheme, atol: float = 1e-6) -> dict[str, Any]:
    """Replace every block linear of `model` (floating point) by a QuantLinear holding llm-compressor's
    result, and copy the other decoder parameters it exported (rescaled norms).

    compressed-tensors stores signed levels (zero point in [-2^(b-1), 2^(b-1) - 1]); ours are unsigned,
    so our zero = their zero + 2^(b-1) on the same grid. The integers are recovered from the dequantized
    weights and must reproduce them (max |error| <= atol * scale); returns statistics of the load.
    """
    from lrq.arch import decoder_blocks, iter_linears, set_submodule
    from lrq.quant import dequantize, expand_groups, quantize
    from lrq.quantize_model import quant_linear_for

    if scheme.kv_bits is not None:
        raise UserError("K/V output quantization has no llm-compressor counterpart")
    blocks = decoder_blocks(model)
    w_off = 2 ** (scheme.w_bits - 1)
    max_err = 0.0
    changed = []
    with torch.no_grad():
        params = dict(model.named_parameters())
        for key, value in tensors.items():
            if not key.startswith("param:"):
                continue
            name = key[len("param:"):]
            if name not in params:
                raise UserError(f"the llm-compressor export has a parameter {name} the model does not have")
            if params[name].shape != value.shape:
                raise UserError(f"exported parameter {name} has shape {tuple(value.shape)}, the model's is "
                                f"{tuple(params[name].shape)}")
            if not torch.equal(params[name].detach().float(), value.float()):
                changed.append(name)
            params[name].copy_(value.to(params[name].dtype))
        n = 0
        for i, name, lin in iter_linears(model):
            full = f"model.layers.{i}.{name}"
            try:
                w = tensors[f"{full}.weight"].float()
                scale = tensors[f"{full}.weight_scale"].float()
                zp = tensors[f"{full}.weight_zero_point"].float()
            except KeyError as e:
                raise UserError(f"the llm-compressor export has no {e.args[0]}: was it made for this model?") from None
            rows, cols = lin.weight.shape
            ng = 1 if scheme.group_size is None else -(-cols // scheme.group_size)
            if w.shape != (rows, cols) or scale.numel() != rows * ng or zp.numel() != rows * ng:
                raise UserError(f"{full}: exported shapes weight {tuple(w.shape)}, scale {tuple(scale.shape)} do "
                                f"not fit [{rows}, {cols}] with {ng} group(s) per row")
            scale, zero = scale.reshape(rows, ng), (zp.reshape(rows, ng) + w_off)
            if zero.min() < 0 or zero.max() > 2 ** scheme.w_bits - 1:
                raise UserError(f"{full}: exported zero points outside the {scheme.w_bits}-bit range")
            q = quantize(w, scale, zero, scheme.w_bits, scheme.group_size)
            err = (dequantize(q, scale, zero, scheme.group_size) - w).abs()
            rel = float((err / expand_groups(scale, scheme.group_size, cols)).max())
            max_err = max(max_err, rel)
            if rel > atol:
                raise UserError(f"{full}: exported weights are not on their own grid (max error {rel:.2e} of a "
                                f"step): the export and the scheme disagree")
            if f"{full}.bias" in tensors:
                lin.bias.data.copy_(tensors[f"{full}.bias"].to(lin.bias.dtype))
            qlin = quant_linear_for(lin, name, scheme, scale, zero, weight=w)
            if scheme.static_activations:
                a_off = 2 ** (scheme.a_bits - 1)
                try:
                    s_a = tensors[f"{full}.input_scale"].float().reshape(())
                    z_a = tensors[f"{full}.input_zero_point"].float().reshape(()) + a_off
                except KeyError as e:
                    raise UserError(f"the llm-compressor export has no {e.args[0]} for a static activation "
                                    f"scheme") from None
                qlin.set_static_range(s_a.to(qlin.act_scale.device), z_a.to(qlin.act_zero.device))
            set_submodule(blocks[i], name, qlin)
            n += 1
    return {"linears": n, "max_grid_error_steps": max_err, "changed_params": len(changed),
            "changed_param_examples": changed[:4]}


def logits_agreement(model: nn.Module, tensors: dict) -> dict[str, float]:
    """Our loaded copy's logits vs llm-compressor's own quantized forward on the same tokens (float32,
    no autocast): max |difference| relative to the logits' max |value|, and top-1 agreement."""
    if "check:logits" not in tensors:
        return {}
    ids, ref = tensors["check:input_ids"].long(), tensors["check:logits"].float()
    with torch.no_grad():
        got = model(input_ids=ids.to(next(model.parameters()).device), use_cache=False).logits.float().cpu()
    return {"max_abs_diff_rel": float((got - ref).abs().max() / ref.abs().max().clamp(min=1e-12)),
            "top1_agreement": float((got.argmax(-1) == ref.argmax(-1)).float().mean()),
            "tokens": int(ids.numel())}


@dataclass(frozen=True, eq=False)
class LLMCConfig(MethodConfig):
    """Where llm-compressor's environment is and how long and wide its run may be."""
    venv: str = ".venv-llmc"
    timeout_s: int = setting(3600, lo=1)
    threads: int = setting(0, lo=0)                # 0: as many as this process uses


@dataclass(frozen=True, eq=False)
class LLMCGPTQConfig(LLMCConfig):
    block_size: int = setting(128, lo=1)
    dampening_frac: float = setting(0.01, lo=0, hi=1)
    actorder: str = "static"                       # llm-compressor's word; none/off: no activation order


@dataclass(frozen=True, eq=False)
class LLMCAWQConfig(LLMCConfig):
    duo_scaling: bool = False
    n_grid: int = setting(20, lo=1)


@dataclass(frozen=True, eq=False)
class LLMCSmoothQuantConfig(LLMCConfig):
    smoothing_strength: float = setting(0.8, lo=0, hi=1)


class LLMCompressorMethod(Method):
    """An llm-compressor recipe run in its own environment; subclasses give the modifiers."""

    external = True
    cost_rank = 5

    def needs_calibration(self, scheme: Scheme) -> bool:
        return True

    def modifiers(self, config: dict[str, Any]) -> list[dict[str, Any]]:
        raise NotImplementedError

    def recipe(self, scheme: Scheme, config: dict[str, Any]) -> dict[str, Any]:
        """The full recipe the worker builds (pure data: recorded with the results)."""
        args = scheme_to_llmc_args(scheme)
        group = {"targets": ["Linear"], **{k: v for k, v in args.items() if v is not None}}
        return {"modifiers": self.modifiers(config), "config_groups": {"group_0": group}, "ignore": ["lm_head"]}

    def _quantize(self, model: nn.Module, scheme: Scheme, config: LLMCConfig,
                  calib: Calibration | None) -> dict[str, Any]:
        from safetensors.torch import load_file, save_file

        from baselines.llmc_worker import EXPORT_FILE, EXPORT_META, tokens_sha256
        if calib is None:
            raise UserError(f"{self.name} needs calibration windows.")
        if calib.tokenizer is None:
            raise UserError(f"{self.name}: llm-compressor's oneshot needs the tokenizer that made the calibration "
                            f"windows (lrq.methods.Calibration.tokenizer).")
        py = llmc_python(config.venv)
        recipe = self.recipe(scheme, config)
        threads = config.threads or torch.get_num_threads()
        ids = calib.input_ids.to(torch.int64).contiguous()
        with tempfile.TemporaryDirectory(prefix="lrq-llmc-") as tmp:
            work = Path(tmp)
            model.save_pretrained(work / "model", safe_serialization=True)
            calib.tokenizer.save_pretrained(str(work / "model"))
            save_file({"input_ids": ids}, str(work / "calib.safetensors"))
            job = {"model_dir": str(work / "model"), "calib_path": str(work / "calib.safetensors"),
                   "calib_sha256": tokens_sha256(ids), "recipe": recipe, "threads": threads,
                   "out_dir": str(work / "out"), "pipeline": None, "linear_names": list(LINEAR_NAMES)}
            (work / "job.json").write_text(json.dumps(job, indent=2))
            env = dict(os.environ, OMP_NUM_THREADS=str(threads), MKL_NUM_THREADS=str(threads),
                       TQDM_DISABLE=os.environ.get("TQDM_DISABLE", "1"), HF_HUB_OFFLINE="1",
                       HF_DATASETS_OFFLINE="1", TRANSFORMERS_OFFLINE="1", PYTHONPATH=str(REPO_ROOT))
            log = work / "worker.log"
            with open(log, "w") as f:
                proc = subprocess.run([str(py), str(WORKER), str(work / "job.json")], stdout=f,
                                      stderr=subprocess.STDOUT, env=env, cwd=str(work),
                                      timeout=config.timeout_s)
            if proc.returncode != 0:
                raise RuntimeError(f"llm-compressor ({self.name}) failed with exit {proc.returncode}:\n"
                                   f"{log.read_text()[-3000:]}")
            meta = json.loads((work / "out" / EXPORT_META).read_text())
            if not meta["windows_match"]:
                raise RuntimeError(f"llm-compressor ({self.name}) saw other calibration windows than ours")
            tensors = load_file(str(work / "out" / EXPORT_FILE))
        load_stats = apply_llmc_export(model, tensors, scheme)
        agree = logits_agreement(model, tensors)
        return {"llmc_oneshot_s": meta["quant"]["wall_s"], "llmc_oneshot_cpu_s": meta["quant"]["cpu_s"],
                "llmc_peak_rss_bytes": meta["quant"]["peak_rss_bytes"],
                "llmc_logits_max_rel_diff": agree.get("max_abs_diff_rel"),
                "llmc_logits_top1_agreement": agree.get("top1_agreement"),
                "max_grid_error_steps": load_stats["max_grid_error_steps"],
                "rescaled_params": load_stats["changed_params"],
                "llmc": {"versions": meta["versions"], "recipe": recipe, "recipe_repr": meta["recipe_repr"],
                         "quant_args_example": meta["quant_args_example"], "windows_seen": meta["windows_seen"],
                         "forward_passes_per_window": meta["forward_passes_per_window"],
                         "pinning_disabled": meta["pinning_disabled"], "torch_threads": meta["torch_threads"],
                         "load": load_stats, "logits_vs_llmc_forward": agree}}


@register
class LLMCGPTQ(LLMCompressorMethod):
    name = "llmc-gptq"
    summary = "llm-compressor's GPTQModifier (its own environment), loaded back as our QuantLinears"
    settings = LLMCGPTQConfig
    presets = {"quick": LLMCGPTQConfig(), "paper": LLMCGPTQConfig()}

    def modifiers(self, config):
        actorder = None if config.actorder.lower() in ("none", "off", "") else config.actorder
        return [{"type": "GPTQModifier", "quant": True,
                 "kwargs": {"block_size": config.block_size, "dampening_frac": config.dampening_frac,
                            "actorder": actorder}}]


@register
class LLMCAWQ(LLMCompressorMethod):
    name = "llmc-awq"
    summary = "llm-compressor's AWQModifier + QuantizationModifier (its own environment)"
    settings = LLMCAWQConfig
    presets = {"quick": LLMCAWQConfig(), "paper": LLMCAWQConfig()}

    def modifiers(self, config):
        return [{"type": "AWQModifier", "quant": False,
                 "kwargs": {"duo_scaling": config.duo_scaling, "n_grid": config.n_grid}},
                {"type": "QuantizationModifier", "quant": True, "kwargs": {}}]


@register
class LLMCSmoothQuant(LLMCompressorMethod):
    name = "llmc-smoothquant"
    summary = "llm-compressor's SmoothQuantModifier + QuantizationModifier (its own environment)"
    settings = LLMCSmoothQuantConfig
    presets = {"quick": LLMCSmoothQuantConfig(), "paper": LLMCSmoothQuantConfig()}

    def modifiers(self, config):
        return [{"type": "SmoothQuantModifier", "quant": False,
                 "kwargs": {"smoothing_strength": config.smoothing_strength}},
                {"type": "QuantizationModifier", "quant": True, "kwargs": {}}]


def setup_venv(venv: str | os.PathLike = REPO_ROOT / ".venv-llmc", python: str = "python3.11") -> int:
    venv = Path(venv)
    for c in ([python, "-m", "venv", str(venv)], [str(venv / "bin" / "pip"), "install", TORCH_PIN,
                                                   f"llmcompressor=={LLMC_VERSION}"]):
        print("+", " ".join(c), flush=True)
        if subprocess.run(c).returncode != 0:
            print(f"failed: {' '.join(c)}", file=sys.stderr)
            return 1
    return 0
