"""The llm-compressor side of the `llmc-*` methods (baselines/llmc.py): runs in llm-compressor's own
virtual environment, never imported there by anything but this file.

    <.venv-llmc>/bin/python baselines/llmc_worker.py JOB.json

It loads the model folder in float32, builds a DataLoader over exactly the calibration windows it was
given (batch 1, in order; their SHA-256 must match the job's), runs `oneshot` with the recipe the job
describes and measures it (lrq.measure, which needs only psutil and torch). It then writes, for each
linear of every decoder block (the job names them, from lrq.arch), the weight as compressed-tensors fake-quantizes it
(`forward_quantize`), its scale and zero point, and for static activation schemes the input scale and
zero point; every other decoder parameter (norms that AWQ/SmoothQuant rescaled); llm-compressor's own
quantized forward on the first window's start (the reference our loaded copy must reproduce); and a
JSON record of the run (time, versions, the recipe, the windows that reached the embedding).

Nothing here imports baselines or the harness (bench), and of lrq only lrq.measure, which needs nothing but
psutil and torch (this environment pins its own transformers and compressed-tensors).
"""

from __future__ import annotations

import hashlib
import json
import sys
from pathlib import Path
from typing import Any

CHECK_TOKENS = 32
LLMC_PACKAGES = ("llmcompressor", "compressed-tensors", "torch", "transformers", "accelerate", "numpy")
EXPORT_FILE, EXPORT_META = "llmc_export.safetensors", "llmc_result.json"


def tokens_sha256(ids) -> str:
    """SHA-256 of int64 token windows [n, L] (row-major bytes): identifies a calibration set exactly."""
    import torch
    return hashlib.sha256(ids.to(torch.int64).contiguous().numpy().tobytes()).hexdigest()


def _disable_pinning_without_accelerator() -> bool:
    """llm-compressor's AWQ pins cached activations (page-locked memory), which fails without an
    accelerator. Pinning only speeds host-to-device copies, so on a CPU-only machine make it a no-op."""
    import torch
    if torch.accelerator.is_available():
        return False
    from llmcompressor.pipelines.cache import IntermediatesCache
    IntermediatesCache.pin_memory = lambda self, batch_index, input_names=None: None
    return True


def _build_recipe(spec: dict[str, Any]):
    from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme
    from llmcompressor.modifiers.gptq import GPTQModifier
    from llmcompressor.modifiers.quantization import QuantizationModifier
    from llmcompressor.modifiers.transform import AWQModifier
    from llmcompressor.modifiers.transform.smoothquant import SmoothQuantModifier
    kinds = {"GPTQModifier": GPTQModifier, "QuantizationModifier": QuantizationModifier,
             "AWQModifier": AWQModifier, "SmoothQuantModifier": SmoothQuantModifier}
    groups = {}
    for gname, g in spec["config_groups"].items():
        groups[gname] = QuantizationScheme(
            targets=g["targets"], weights=QuantizationArgs(**g["weights"]),
            input_activations=QuantizationArgs(**g["input_activations"]) if g.get("input_activations") else None)
    recipe = []
    for m in spec["modifiers"]:
        kwargs = dict(m["kwargs"])
        if m["quant"]:
            kwargs.update(config_groups=groups, ignore=spec["ignore"])
        recipe.append(kinds[m["type"]](**kwargs))
    return recipe


def _count_windows(model):
    """Count, by SHA-256, the token windows that actually reach the model (a pre-hook on its embedding); returns
    the counts (filled as the model runs) and the hook's handle."""
    import torch
    seen: dict[str, int] = {}

    def record(_module, args, kwargs):  # the windows that actually reach the model
        x = args[0] if args else kwargs.get("input")
        for row in x.reshape(-1, x.shape[-1]):
            key = hashlib.sha256(row.to(torch.int64).contiguous().numpy().tobytes()).hexdigest()
            seen[key] = seen.get(key, 0) + 1

    hook = model.get_input_embeddings().register_forward_pre_hook(record, with_kwargs=True)
    return seen, hook


def _export_linears(model, linear_names: list[str], tensors: dict, quant_args: dict[str, Any]) -> None:
    """Into `tensors`, each block linear's weight as compressed-tensors fake-quantizes it, its scale and zero
    point (and bias), and for a static activation scheme its input scale and zero point; into `quant_args`, its
    quantization arguments."""
    from compressed_tensors.quantization import forward_quantize
    for i, layer in enumerate(model.model.layers):
        for lname in linear_names:
            mod = layer.get_submodule(lname)
            full = f"model.layers.{i}.{lname}"
            scheme = getattr(mod, "quantization_scheme", None)
            if scheme is None or scheme.weights is None:
                raise SystemExit(f"{full} was not quantized by llm-compressor")
            tensors[f"{full}.weight"] = forward_quantize(mod, mod.weight.detach(), "weight",
                                                         scheme.weights).float().contiguous()
            tensors[f"{full}.weight_scale"] = mod.weight_scale.detach().float().contiguous()
            tensors[f"{full}.weight_zero_point"] = mod.weight_zero_point.detach().float().contiguous()
            if getattr(mod, "bias", None) is not None:
                tensors[f"{full}.bias"] = mod.bias.detach().float().contiguous()
            if scheme.input_activations is not None and not scheme.input_activations.dynamic:
                tensors[f"{full}.input_scale"] = mod.input_scale.detach().float().reshape(()).contiguous()
                tensors[f"{full}.input_zero_point"] = mod.input_zero_point.detach().float().reshape(()).contiguous()
            quant_args[full] = {"weights": scheme.weights.model_dump(mode="json"),
                                "input_activations": None if scheme.input_activations is None
                                else scheme.input_activations.model_dump(mode="json")}


def _export_other_block_params(model, linear_names: list[str], tensors: dict) -> None:
    """Into `tensors` as param:NAME, every other weight and bias of the decoder blocks (the norms AWQ and
    SmoothQuant rescaled), without the quantization's own scales, zero points and observers."""
    linear_params = {f"model.layers.{i}.{n}.{p}" for i in range(len(model.model.layers)) for n in linear_names
                     for p in ("weight", "bias")}
    for name, p in model.named_parameters():
        if name.startswith("model.layers.") and name not in linear_params \
                and "." + name.rsplit(".", 1)[-1] in (".weight", ".bias") \
                and not any(q in name for q in ("_scale", "_zero_point", "_observer")):
            tensors[f"param:{name}"] = p.detach().float().contiguous()


def run(job_path: Path) -> int:
    """Run llm-compressor's oneshot on the job's model and calibration windows; write the export."""
    job = json.loads(Path(job_path).read_text())
    import torch
    threads = int(job["threads"])
    linear_names = job["linear_names"]   # a block's linears, as lrq.arch names them (the parent says which)
    torch.set_num_threads(threads)
    from safetensors.torch import load_file, save_file
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from llmcompressor import oneshot

    from lrq.measure import measure, package_versions

    ids = load_file(job["calib_path"])["input_ids"]
    if tokens_sha256(ids) != job["calib_sha256"]:
        raise SystemExit("calibration windows do not match their recorded SHA-256")
    model = AutoModelForCausalLM.from_pretrained(job["model_dir"], dtype=torch.float32).eval()
    # oneshot wants a processor whenever data is given, though the windows are already token ids
    tokenizer = AutoTokenizer.from_pretrained(job["model_dir"])
    unpinned = _disable_pinning_without_accelerator()
    recipe = _build_recipe(job["recipe"])

    seen, hook = _count_windows(model)
    batches = [{"input_ids": row.unsqueeze(0), "attention_mask": torch.ones_like(row).unsqueeze(0)} for row in ids]
    loader = torch.utils.data.DataLoader(batches, batch_size=None, shuffle=False)
    with measure() as meter:
        oneshot(model=model, tokenizer=tokenizer, dataset=loader, recipe=recipe, num_calibration_samples=ids.shape[0],
                max_seq_length=ids.shape[1], shuffle_calibration_samples=False, pipeline=job.get("pipeline"))
    hook.remove()
    expected = {hashlib.sha256(r.contiguous().numpy().tobytes()).hexdigest() for r in ids.to(torch.int64)}

    tensors: dict[str, torch.Tensor] = {}
    quant_args: dict[str, Any] = {}
    with torch.no_grad():
        _export_linears(model, linear_names, tensors, quant_args)
        _export_other_block_params(model, linear_names, tensors)
        check_ids = ids[:1, :CHECK_TOKENS].contiguous()
        tensors["check:input_ids"] = check_ids
        tensors["check:logits"] = model(input_ids=check_ids, use_cache=False).logits.float().contiguous()
    out = Path(job["out_dir"])
    out.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(out / EXPORT_FILE))
    result = {
        "quant": {"wall_s": meter.wall_s, "cpu_s": meter.cpu_s, "peak_rss_bytes": meter.peak_rss_bytes},
        "threads": threads, "torch_threads": torch.get_num_threads(), "versions": package_versions(LLMC_PACKAGES),
        "recipe": job["recipe"], "recipe_repr": [repr(m) for m in recipe],
        "quant_args_example": next(iter(quant_args.values())),
        "distinct_args": len({json.dumps(v, sort_keys=True) for v in quant_args.values()}),
        "windows_seen": len(seen), "windows_expected": len(expected), "windows_match": set(seen) == expected,
        "forward_passes_per_window": sorted(set(seen.values())),
        "pinning_disabled": unpinned, "model_dtype": str(model.dtype),
    }
    (out / EXPORT_META).write_text(json.dumps(result, indent=2, default=str))
    print(json.dumps({"wall_s": meter.wall_s, "windows_match": result["windows_match"]}))
    return 0


if __name__ == "__main__":
    if len(sys.argv) != 2:
        print("usage: python baselines/llmc_worker.py JOB.json", file=sys.stderr)
        sys.exit(2)
    sys.exit(run(Path(sys.argv[1])))
