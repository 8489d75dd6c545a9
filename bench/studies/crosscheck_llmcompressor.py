"""Cross-check our GPTQ, AWQ and SmoothQuant against llm-compressor's, on the same model and data.

    python -m bench.studies.crosscheck_llmcompressor setup-venv                 # once: .venv-llmc (about 2 minutes)
    OMP_NUM_THREADS=1 TQDM_DISABLE=1 python -m bench.studies.crosscheck_llmcompressor run \\
        --data-dir ../shared/data --calib-samples 64 --calib-seq-len 512 --max-eval-tokens 40960

llm-compressor (PyPI `llmcompressor`) pins transformers and compressed-tensors versions of its own, so it
lives in its own virtual environment (default `.venv-llmc` at the repository root, git-ignored):

    python3.11 -m venv .venv-llmc && .venv-llmc/bin/pip install torch==2.13.0 llmcompressor==0.14.0.1

How one comparison runs (the `run` command, in our environment):

1. our tokenizer draws the calibration windows (`bench.data.calibration_set`: C4 pool, seeded) and the
   evaluation token streams (WikiText-2 test, C4 validation, each cut at --max-eval-tokens); the windows
   are written to the work folder as `calib.safetensors` with their SHA-256;
2. the llm-compressor side: this same file runs under the llm-compressor venv's python (`worker`
   command). It loads the model folder in float32, builds a DataLoader over exactly those windows (batch
   1, in order), runs `oneshot` with the matching recipe and times it (RSS sampled for the peak). It
   then records, for each of the seven linears of every decoder block, the weight as compressed-tensors
   fake-quantizes it (`forward_quantize`), its scale and zero point, and for static activation schemes
   the input scale and zero point; also every other decoder parameter (norms that AWQ/SmoothQuant
   rescaled). The token windows that reached the embedding are hashed and must equal ours;
3. back in our environment these become our `QuantLinear` modules (the integers are recovered from the
   dequantized weights and checked to reproduce them exactly) in a fresh copy of the floating-point
   model, and our perplexity function scores them on the same token windows as our own method's result;
4. our method runs on a fresh model with the same windows, timed the same way (wall clock around the
   quantization call only, RSS sampled), then is scored.

Results are cached per step in the work folder (delete it or pass --force to recompute); the report
is a Markdown table plus a JSON file with versions of both stacks, settings, the calibration draw, the
git revision and the hardware. Every known difference between the two setups is listed with the
numbers (`MISMATCHES` below, per comparison).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import platform
import subprocess
import sys
import threading
import time
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

REPO_ROOT = Path(__file__).resolve().parents[2]
LLMC_VERSION = "0.14.0.1"
TORCH_PIN = "torch==2.13.0"
DEFAULT_LLMC_VENV = REPO_ROOT / ".venv-llmc"
VENV_COMMAND = (f"python3.11 -m venv .venv-llmc && .venv-llmc/bin/pip install {TORCH_PIN} "
                f"llmcompressor=={LLMC_VERSION}")
CALIB_FILE, CALIB_META = "calib.safetensors", "calib.json"
EXPORT_FILE, EXPORT_META = "llmc_export.safetensors", "llmc_result.json"
LINEAR_NAMES = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
                "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")
CHECK_TOKENS = 32
LLMC_PACKAGES = ("llmcompressor", "compressed-tensors", "torch", "transformers", "accelerate", "numpy")


class CrosscheckError(Exception):
    """A problem the user can fix (missing venv, bad option); printed without a traceback."""


# ---- the comparisons --------------------------------------------------------------------------------

@dataclass(frozen=True)
class Variant:
    name: str                      # CLI name
    method: str                    # our registered method
    scheme: str                    # our scheme (lrq/schemes.py)
    ours: dict[str, Any]           # overrides of our method's quick preset, chosen to match llm-compressor
    llmc: dict[str, Any]           # llm-compressor recipe as data: {"modifiers": [{"type", "kwargs"}]}
    mismatches: tuple[str, ...]    # every known difference between the two setups
    llmc_side: bool = True         # False: a reference row of ours only (RTN)


# Differences that hold for every comparison.
COMMON_MISMATCHES = (
    "precision: llm-compressor runs the model in float32 (its calibration forwards and searches); ours runs "
    "block forwards under bf16 autocast (our `bf16` setting, the quick preset), with GPTQ's algebra, Hessians "
    "and the AWQ 8-bit search in float32",
    "environment: llm-compressor's venv has transformers 5.17 (its pin, <=5.17.0), ours 5.24; same torch 2.13.0 "
    "CPU build, same thread count",
    "calibration batches: llm-compressor sees the windows one per batch (its default batch_size=1); ours in "
    "batches of 8 (sums over the same tokens)",
    "ragged groups: 576 input columns are not a multiple of 128; llm-compressor refuses strategy 'group' "
    "there, so its 'block' strategy with block_structure [1, 128] is used: per row, 128 columns, a last "
    "block of 64 zero-padded for min/max (the same grid as our groups: our min/max also include 0)",
)


def scheme_to_llmc_args(scheme) -> dict[str, Any]:
    """compressed-tensors QuantizationArgs (as plain dicts) for one of our schemes.

    Weights: asymmetric integers with min/max ranges (observer memoryless_minmax, their weight default),
    per output channel or in [1, group] blocks (see COMMON_MISMATCHES). Activations: per-tensor static
    with the running global min/max (static_minmax; their default `minmax` is a moving average), or
    per-token dynamic. Both grids are ours shifted by 2^(b-1) (signed storage): same levels.
    """
    if scheme.kv_bits is not None:
        raise CrosscheckError(f"scheme {scheme.name}: K/V output quantization has no llm-compressor counterpart here.")
    weights: dict[str, Any] = {"num_bits": scheme.w_bits, "type": "int", "symmetric": False,
                               "observer": "memoryless_minmax"}
    if scheme.group_size is None:
        weights["strategy"] = "channel"
    else:
        weights.update(strategy="block", block_structure=[1, scheme.group_size])
    acts = None
    if scheme.a_bits is not None:
        if scheme.a_mode == "per_tensor_static":
            acts = {"num_bits": scheme.a_bits, "type": "int", "symmetric": False, "strategy": "tensor",
                    "dynamic": False, "observer": "static_minmax"}
        elif scheme.a_mode == "per_token":
            acts = {"num_bits": scheme.a_bits, "type": "int", "symmetric": False, "strategy": "token",
                    "dynamic": True}
        else:
            raise CrosscheckError(f"scheme {scheme.name}: activation mode {scheme.a_mode!r} has no mapping.")
    return {"weights": weights, "input_activations": acts}


def variants(alpha: float = 0.8, n_samples: int = 64) -> dict[str, Variant]:
    """The comparisons, by CLI name. Our overrides copy llm-compressor's settings where we have them."""
    gptq_common = (
        "true-sequential: ours quantizes q/k/v, then o_proj on the quantized q/k/v's output, then gate/up, "
        "then down_proj (each Hessian from inputs through the already-quantized part of the block); "
        "llm-compressor collects all seven Hessians of a decoder layer in one pass on its unquantized "
        "weights. Both feed the next layer the quantized layer's output",
        "dead input columns (zero Hessian diagonal): llm-compressor zeroes their weights, ours keeps them "
        "(none occur on this calibration set: see method stats)",
        "dampening retries: ours raises the dampening x10 and retries when Cholesky fails, llm-compressor "
        "falls back to round-to-nearest for that layer (neither happened here: see method stats)",
    )
    return {
        "gptq": Variant(
            "gptq", "gptq", "w4a16-g128",
            {"damp": 0.01, "block_size": 128, "act_order": True},
            {"modifiers": [{"type": "GPTQModifier", "quant": True,
                            "kwargs": {"block_size": 128, "dampening_frac": 0.01, "actorder": "static"}}]},
            gptq_common + (
                "act-order: both order columns by decreasing Hessian diagonal and fit group scales/zeros up "
                "front on the original weights in natural column order (llm-compressor 'static' = 'weight', "
                "its default; ours act_order with static groups)",)),
        "gptq-noact": Variant(
            "gptq-noact", "gptq", "w4a16-g128",
            {"damp": 0.01, "block_size": 128, "act_order": False},
            {"modifiers": [{"type": "GPTQModifier", "quant": True,
                            "kwargs": {"block_size": 128, "dampening_frac": 0.01, "actorder": None}}]},
            gptq_common + (
                "group scales without act-order: llm-compressor 0.14 fits every group's scale/zero up front on "
                "the original weights; ours fits each group when GPTQ reaches its first column, on the weights "
                "as updated so far (the GPTQ paper's and reference code's default)",)),
        "awq": Variant(
            "awq", "awq", "w4a16-g128",
            {"n_grid": 20, "scale_vo": False, "clip": False, "n_samples": n_samples, "search_tokens": 0},
            {"modifiers": [{"type": "AWQModifier", "quant": False, "kwargs": {"duo_scaling": False, "n_grid": 20}},
                           {"type": "QuantizationModifier", "quant": True, "kwargs": {}}]},
            ("scale grid: llm-compressor tries ratio = i / (n_grid - 1), i = 0..19 (0 to 1 inclusive); ours "
             "i / n_grid (0 to 0.95; `grid=closed` is theirs, see bench/studies/awq_gap.py)",
             "scales: both s = mean|x|^ratio normalised by sqrt(max(s) min(s)) (duo scaling off on their "
             "side: with it on, its weight statistic cannot reshape 576 columns into blocks of 128); ours "
             "has no duo scaling",
             "v_proj -> o_proj: skipped on both sides (llm-compressor skips it when shapes differ, as under "
             "GQA; ours `scale_vo=false`); ours can scale it exactly under GQA (its default)",
             "weight clipping search: llm-compressor's AWQ has none; ours switched off (`clip=false`; its "
             "default is on)",
             "chain: llm-compressor feeds the next layer the scaled, still floating-point layer's output "
             "(quantization is disabled during its calibration passes); ours feeds the quantized block's output "
             "(`chain=float` is theirs, see bench/studies/awq_gap.py)",
             "loss: both mean squared error of the inspected module's output over every calibration token "
             f"(ours `search_tokens=0`, `n_samples={n_samples}`: every window; the quick preset uses 32 windows "
             "and 4096 tokens)",
             "llm-compressor on a CPU-only machine: its AWQ pins cached activations in page-locked memory, "
             "which needs an accelerator; the worker turns that pinning into a no-op (a transfer "
             "optimisation, no effect on the numbers)")),
        "smoothquant": Variant(
            "smoothquant", "smoothquant", "w8a8",
            {"alpha": alpha, "pairs": "qkv,gate_up"},
            {"modifiers": [{"type": "SmoothQuantModifier", "quant": False, "kwargs": {"smoothing_strength": alpha}},
                           {"type": "QuantizationModifier", "quant": True, "kwargs": {}}]},
            (f"alpha {alpha} on both sides; pairs input_layernorm -> q/k/v and post_attention_layernorm -> "
             "gate/up on both (their default mappings for Llama)",
             "activation statistic: llm-compressor uses the channel's range max(X_j) - min(X_j) and twice the "
             "weights' max|W_j|; ours max|X_j| and max|W_j| (the paper's). For channels symmetric about 0 "
             "this is a constant factor 2^(2 alpha - 1) on every scale, which per-channel weight and "
             "per-tensor activation quantization absorb; it differs for one-signed channels",
             "static activation ranges: both the global min/max over every calibration token (their "
             "observer set to static_minmax; its default `minmax` is a moving average with constant 0.01), "
             "both with floating-point activations upstream; ours observes after smoothing with 8-bit "
             "weights. MEASURED: llm-compressor's ranges for the smoothed linears (q/k/v, gate/up) equal "
             "the UNSMOOTHED model's ranges (median 2.1x, up to 18x wider than the smoothed inputs), so "
             "its observers saw activations from before the smoothing was folded in; o_proj/down_proj "
             "ranges agree. This, not the smoothing formula (<1 % when ours uses their scales), makes "
             "the perplexity gap",
             "weights: 8-bit per output channel, asymmetric, min/max on both sides")),
        "rtn": Variant("rtn", "rtn", "w4a16-g128", {}, {}, ("reference row: ours only, no llm-compressor run",),
                       llmc_side=False),
    }


DEFAULT_VARIANTS = ("rtn", "gptq", "awq", "smoothquant")


def llmc_recipe_spec(variant: Variant) -> dict[str, Any]:
    """The full recipe description the worker builds (pure data: recorded in the JSON report)."""
    from lrq.schemes import get_scheme
    args = scheme_to_llmc_args(get_scheme(variant.scheme))
    group = {"targets": ["Linear"], **{k: v for k, v in args.items() if v is not None}}
    return {"modifiers": variant.llmc["modifiers"], "config_groups": {"group_0": group}, "ignore": ["lm_head"]}


# ---- calibration export / import --------------------------------------------------------------------

def tokens_sha256(ids) -> str:
    """SHA-256 of int64 token windows [n, L] (row-major bytes): identifies a calibration set exactly."""
    import torch
    return hashlib.sha256(ids.to(torch.int64).contiguous().numpy().tobytes()).hexdigest()


def write_calibration(folder: Path, input_ids, description: dict[str, Any]) -> dict[str, Any]:
    """Write calibration windows and their description; returns the metadata written."""
    import torch
    from safetensors.torch import save_file
    folder.mkdir(parents=True, exist_ok=True)
    ids = input_ids.to(torch.int64).contiguous()
    if ids.dim() != 2 or ids.numel() == 0:
        raise CrosscheckError(f"calibration windows must be a non-empty [n, seq_len] tensor, got {tuple(ids.shape)}")
    save_file({"input_ids": ids}, str(folder / CALIB_FILE))
    meta = {"shape": list(ids.shape), "sha256": tokens_sha256(ids), "description": description}
    (folder / CALIB_META).write_text(json.dumps(meta, indent=2, default=str))
    return meta


def read_calibration(folder: Path):
    """Read windows written by write_calibration, checking shape and hash; returns (ids, metadata)."""
    from safetensors.torch import load_file
    path, meta_path = folder / CALIB_FILE, folder / CALIB_META
    if not path.is_file() or not meta_path.is_file():
        raise CrosscheckError(f"no calibration windows in {folder} ({CALIB_FILE} and {CALIB_META} expected)")
    meta = json.loads(meta_path.read_text())
    ids = load_file(str(path))["input_ids"]
    if list(ids.shape) != meta["shape"] or tokens_sha256(ids) != meta["sha256"]:
        raise CrosscheckError(f"{path} does not match {meta_path} (shape or SHA-256 differs): regenerate it")
    return ids, meta


# ---- measuring a step (usable in both venvs: psutil is in both) -------------------------------------

class Meter:
    """Wall time, CPU time (user + system, all threads) and peak resident set size of this process while
    the block runs (RSS sampled every 20 ms). On a shared machine CPU time is the steadier figure: wall
    time also counts the time other processes held the cores."""

    def __init__(self, interval: float = 0.02):
        import psutil
        self._proc, self._interval = psutil.Process(), interval
        self.wall_s, self.cpu_s, self.peak_rss_bytes, self.rss_before_bytes = 0.0, 0.0, 0, 0
        self._stop = threading.Event()

    def _sample(self):
        while not self._stop.wait(self._interval):
            self.peak_rss_bytes = max(self.peak_rss_bytes, self._proc.memory_info().rss)

    def __enter__(self):
        self.peak_rss_bytes = self.rss_before_bytes = self._proc.memory_info().rss
        self._cpu0 = self._proc.cpu_times()
        self.load_before = os.getloadavg()
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._t0 = time.perf_counter()
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self.wall_s = time.perf_counter() - self._t0
        cpu = self._proc.cpu_times()
        self.cpu_s = (cpu.user - self._cpu0.user) + (cpu.system - self._cpu0.system)
        self._stop.set()
        self._thread.join()
        self.peak_rss_bytes = max(self.peak_rss_bytes, self._proc.memory_info().rss)
        self.load_after = os.getloadavg()
        return False

    def to_dict(self) -> dict[str, Any]:
        return {"wall_s": self.wall_s, "cpu_s": self.cpu_s, "peak_rss_bytes": self.peak_rss_bytes,
                "rss_before_bytes": self.rss_before_bytes,
                "loadavg_1m_before": self.load_before[0], "loadavg_1m_after": self.load_after[0]}


def _package_versions(names) -> dict[str, str]:
    import importlib.metadata
    out = {"python": platform.python_version()}
    for n in names:
        try:
            out[n] = importlib.metadata.version(n)
        except importlib.metadata.PackageNotFoundError:
            pass
    return out


# ---- the llm-compressor side (runs in the llm-compressor venv) --------------------------------------

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


def llmc_worker(job_path: Path) -> int:
    """Run llm-compressor's oneshot on the job's model and calibration windows; write the export."""
    job = json.loads(Path(job_path).read_text())
    import torch
    threads = int(job["threads"])
    torch.set_num_threads(threads)
    from safetensors.torch import load_file, save_file
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from llmcompressor import oneshot

    ids = load_file(job["calib_path"])["input_ids"]
    if tokens_sha256(ids) != job["calib_sha256"]:
        raise SystemExit("calibration windows do not match their recorded SHA-256")
    model = AutoModelForCausalLM.from_pretrained(job["model_dir"], dtype=torch.float32).eval()
    # oneshot wants a processor whenever data is given, though the windows are already token ids
    tokenizer = AutoTokenizer.from_pretrained(job.get("tokenizer_dir") or job["model_dir"])
    unpinned = _disable_pinning_without_accelerator()
    recipe = _build_recipe(job["recipe"])

    seen: dict[str, int] = {}

    def record(_module, args, kwargs):  # the windows that actually reach the model
        x = args[0] if args else kwargs.get("input")
        for row in x.reshape(-1, x.shape[-1]):
            key = hashlib.sha256(row.to(torch.int64).contiguous().numpy().tobytes()).hexdigest()
            seen[key] = seen.get(key, 0) + 1

    hook = model.get_input_embeddings().register_forward_pre_hook(record, with_kwargs=True)
    batches = [{"input_ids": row.unsqueeze(0), "attention_mask": torch.ones_like(row).unsqueeze(0)} for row in ids]
    loader = torch.utils.data.DataLoader(batches, batch_size=None, shuffle=False)
    with Meter() as meter:
        oneshot(model=model, tokenizer=tokenizer, dataset=loader, recipe=recipe, num_calibration_samples=ids.shape[0],
                max_seq_length=ids.shape[1], shuffle_calibration_samples=False, pipeline=job.get("pipeline"))
    hook.remove()
    expected = {hashlib.sha256(r.contiguous().numpy().tobytes()).hexdigest() for r in ids.to(torch.int64)}

    from compressed_tensors.quantization import forward_quantize
    tensors: dict[str, torch.Tensor] = {}
    quant_args: dict[str, Any] = {}
    with torch.no_grad():
        layers = model.model.layers
        for i, layer in enumerate(layers):
            for lname in LINEAR_NAMES:
                mod = layer.get_submodule(lname)
                full = f"model.layers.{i}.{lname}"
                scheme = getattr(mod, "quantization_scheme", None)
                if scheme is None or scheme.weights is None:
                    raise SystemExit(f"{full} was not quantized by llm-compressor")
                w = mod.weight.detach().float()
                tensors[f"{full}.weight"] = forward_quantize(mod, mod.weight.detach(), "weight",
                                                             scheme.weights).float().contiguous()
                tensors[f"{full}.weight_float"] = w.contiguous()
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
        linear_params = {f"model.layers.{i}.{n}.{p}" for i in range(len(layers)) for n in LINEAR_NAMES
                         for p in ("weight", "bias")}
        for name, p in model.named_parameters():
            if name.startswith("model.layers.") and name not in linear_params and "." + name.rsplit(".", 1)[-1] in (".weight", ".bias"):
                if not any(q in name for q in ("_scale", "_zero_point", "_observer")):
                    tensors[f"param:{name}"] = p.detach().float().contiguous()
        # llm-compressor's own quantized forward (fake-quantized weights and activations, float32) on
        # the start of the first window: the reference that our loaded copy must reproduce
        check_ids = ids[:1, :CHECK_TOKENS].contiguous()
        tensors["check:input_ids"] = check_ids
        tensors["check:logits"] = model(input_ids=check_ids, use_cache=False).logits.float().contiguous()
    out = Path(job["out_dir"])
    out.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(out / EXPORT_FILE))
    one = next(iter(quant_args.values()))
    result = {
        "quant": meter.to_dict(), "threads": threads, "torch_threads": torch.get_num_threads(),
        "versions": _package_versions(LLMC_PACKAGES),
        "recipe": job["recipe"], "recipe_repr": [repr(m) for m in recipe],
        "quant_args_example": one,
        "distinct_args": len({json.dumps(v, sort_keys=True) for v in quant_args.values()}),
        "windows_seen": len(seen), "windows_expected": len(expected),
        "windows_match": set(seen) == expected,
        "forward_passes_per_window": sorted(set(seen.values())),
        "pinning_disabled": unpinned, "model_dtype": str(model.dtype),
    }
    (out / EXPORT_META).write_text(json.dumps(result, indent=2, default=str))
    print(json.dumps({"wall_s": meter.wall_s, "windows_match": result["windows_match"]}))
    return 0


# ---- back in our environment: load an export into our model -----------------------------------------

def apply_llmc_export(model, tensors: dict, scheme, atol: float = 1e-6) -> dict[str, Any]:
    """Replace every block linear of `model` (floating point) by a QuantLinear holding llm-compressor's
    result, and copy the other decoder parameters it exported (rescaled norms).

    compressed-tensors stores signed levels (zero point in [-2^(b-1), 2^(b-1) - 1]); ours are unsigned,
    so our zero = their zero + 2^(b-1) on the same grid. The integers are recovered from the dequantized
    weights and must reproduce them (max |error| <= atol * scale); returns statistics of the load.
    """
    import torch
    from lrq.arch import iter_linears, set_submodule, decoder_blocks
    from lrq.quant import dequantize, quantize
    from lrq.quantize_model import quant_linear_for

    if scheme.kv_bits is not None:
        raise CrosscheckError("K/V output quantization is not part of the cross-check")
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
                raise CrosscheckError(f"exported parameter {name} does not exist in the model")
            if params[name].shape != value.shape:
                raise CrosscheckError(f"exported parameter {name} has shape {tuple(value.shape)}, "
                                      f"the model's is {tuple(params[name].shape)}")
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
                raise CrosscheckError(f"the export has no {e.args[0]}: was it made for this model?") from None
            rows, cols = lin.weight.shape
            ng = 1 if scheme.group_size is None else -(-cols // scheme.group_size)
            if w.shape != (rows, cols) or scale.numel() != rows * ng or zp.numel() != rows * ng:
                raise CrosscheckError(f"{full}: exported shapes weight {tuple(w.shape)}, scale {tuple(scale.shape)} "
                                      f"do not fit [{rows}, {cols}] with {ng} group(s) per row")
            scale, zero = scale.reshape(rows, ng), (zp.reshape(rows, ng) + w_off)
            if zero.min() < 0 or zero.max() > 2 ** scheme.w_bits - 1:
                raise CrosscheckError(f"{full}: zero points outside the {scheme.w_bits}-bit range")
            q = quantize(w, scale, zero, scheme.w_bits, scheme.group_size)
            err = (dequantize(q, scale, zero, scheme.group_size) - w).abs()
            rel = float((err / expand(scale, scheme.group_size, cols)).max())
            max_err = max(max_err, rel)
            if rel > atol:
                raise CrosscheckError(f"{full}: exported weights are not on their own grid (max error {rel:.2e} "
                                      f"of a step): the export and the scheme disagree")
            lin_src = lin
            if f"{full}.bias" in tensors:
                lin_src.bias.data.copy_(tensors[f"{full}.bias"].to(lin_src.bias.dtype))
            qlin = quant_linear_for(lin_src, name, scheme, scale, zero, weight=w)
            if scheme.static_activations:
                a_off = 2 ** (scheme.a_bits - 1)
                try:
                    s_a = tensors[f"{full}.input_scale"].float().reshape(())
                    z_a = tensors[f"{full}.input_zero_point"].float().reshape(()) + a_off
                except KeyError as e:
                    raise CrosscheckError(f"the export has no {e.args[0]} for a static activation scheme") from None
                qlin.set_static_range(s_a.to(qlin.act_scale.device), z_a.to(qlin.act_zero.device))
            set_submodule(blocks[i], name, qlin)
            n += 1
    return {"linears": n, "max_grid_error_steps": max_err, "changed_params": len(changed),
            "changed_param_examples": changed[:4]}


def logits_agreement(model, tensors: dict) -> dict[str, float]:
    """Our loaded copy's logits vs llm-compressor's own quantized forward on the same tokens (float32,
    no autocast): max |difference| relative to the logits' max |value|, and top-1 agreement."""
    import torch
    if "check:logits" not in tensors:
        return {}
    ids, ref = tensors["check:input_ids"].long(), tensors["check:logits"].float()
    with torch.no_grad():
        got = model(input_ids=ids.to(next(model.parameters()).device), use_cache=False).logits.float().cpu()
    return {"max_abs_diff_rel": float((got - ref).abs().max() / ref.abs().max().clamp(min=1e-12)),
            "top1_agreement": float((got.argmax(-1) == ref.argmax(-1)).float().mean()),
            "tokens": int(ids.numel())}


CT_ROUNDING_LABEL = "[CT rounding]"


@contextmanager
def ct_activation_rounding():
    """Score static activation quantization with compressed-tensors' order of operations.

    Both stacks put activations on the same grid, but compressed-tensors rounds x / s + zp (zp its
    signed zero point) while ours rounds x / s and then adds the zero point. The two differ when adding
    zp moves x / s across a rounding boundary in float32, and at exact ties (x / s = k + 0.5) when the
    zero point is odd (both round half to even, before or after the shift): a few elements per tensor; under
    per-tensor static 8-bit ranges of thousands (massive activations) one such flip moves an input by
    a whole step. Inside this context our QuantLinear uses their order, which reproduces llm-compressor's
    own forward exactly (the logits check); the perplexity under both orders shows how much of a
    difference is float rounding rather than method.
    """
    import torch
    import lrq.qlinear as qlinear
    original = qlinear.per_tensor_fake_quant

    def fake_quant_ct(x, scale, zero, bits: int = 8):
        off = 2 ** (bits - 1)
        zp = zero - off
        q = torch.clamp(torch.round(x.float() / scale + zp), -off, off - 1)
        return ((q - zp) * scale).to(x.dtype)

    qlinear.per_tensor_fake_quant = fake_quant_ct
    try:
        yield
    finally:
        qlinear.per_tensor_fake_quant = original


def expand(t, group_size, cols):
    from lrq.quant import expand_groups
    return expand_groups(t, group_size, cols)


# ---- the orchestration (our venv) -------------------------------------------------------------------

def llmc_python(venv: Path) -> Path:
    """The llm-compressor venv's interpreter, or a clear error saying how to create it."""
    py = Path(venv) / "bin" / "python"
    if not py.exists():
        raise CrosscheckError(
            f"the llm-compressor virtual environment {venv} does not exist. Create it (about 2 minutes, "
            f"1.5 GB) from the repository root with:\n    {VENV_COMMAND}\nor run: python -m "
            f"bench.studies.crosscheck_llmcompressor setup-venv, or pass --llmc-venv PATH to an existing one.")
    probe = subprocess.run([str(py), "-c", "import llmcompressor, compressed_tensors; print(llmcompressor.__version__)"],
                           capture_output=True, text=True)
    if probe.returncode != 0:
        raise CrosscheckError(
            f"{py} cannot import llmcompressor ({probe.stderr.strip().splitlines()[-1] if probe.stderr.strip() else 'no output'}). "
            f"Install it there: {py.parent / 'pip'} install {TORCH_PIN} llmcompressor=={LLMC_VERSION}")
    return py


def model_folder(name: str) -> Path:
    """A local folder the llm-compressor side can load (the built-in model's safetensors cache)."""
    from bench.models import BUILTINS, cache_root, load_model
    if name in BUILTINS:
        folder = cache_root() / "models" / name
        if not (folder / "model.safetensors").exists():
            load_model(name)  # converts and caches it
        return folder
    p = Path(name).expanduser()
    if p.is_dir():
        return p.resolve()
    raise CrosscheckError(f"model {name!r}: the llm-compressor side needs a local Hugging Face model folder "
                          f"or a built-in name, not a hub id or a .gguf file.")


def cached_step(path: Path, key: dict, compute, force: bool = False, label: str = "") -> dict[str, Any]:
    """`compute()`'s result, from `path` when it holds one computed under the same key (written atomically)."""
    k = _key(key)
    if path.exists() and not force:
        saved = json.loads(path.read_text())
        if saved.get("key") == k:
            print(f"{label}: cached ({path})", flush=True)
            return saved["result"]
    print(f"{label}: running", flush=True)
    result = compute()
    from lrq.io import atomic_write_text as write_atomic  # our venv only (this file also runs in llm-compressor's)
    write_atomic(path, json.dumps({"key": k, "result": result}, indent=2, default=str))
    return result


def eval_streams(tokenizer, datasets: list[str], data_dir, seq_len: int, max_tokens: int | None = None):
    """Each dataset's evaluation tokens (cut at the protocol's cap and at `max_tokens`) and their
    description (token count, hash, windows, data fingerprint): ({name: ids}, {name: description})."""
    from bench import data as D
    ids = {}
    for ds in datasets:
        t = D.tokenize(tokenizer, D.eval_text(ds, data_dir).text)
        caps = [c for c in (D.eval_token_cap(ds), max_tokens) if c]
        ids[ds] = t[:min(caps)] if caps else t
    desc = {ds: {"tokens": int(len(t)), "sha256": hashlib.sha256(t.numpy().tobytes()).hexdigest()[:16],
                 "windows": len(t) // seq_len, "seq_len": seq_len, "data": D.data_fingerprint(ds, data_dir)}
            for ds, t in ids.items()}
    return ids, desc


def _key(obj: Any) -> str:
    return hashlib.sha256(json.dumps(obj, sort_keys=True, default=str).encode()).hexdigest()[:16]


@dataclass
class Side:
    side: str                                   # "ours" or "llm-compressor"
    variant: str
    method: str
    scheme: str
    quant: dict[str, Any]                       # wall_s, peak_rss_bytes, loadavg
    ppl: dict[str, float] = field(default_factory=dict)
    eval_tokens: dict[str, int] = field(default_factory=dict)
    config: dict[str, Any] = field(default_factory=dict)
    stats: dict[str, Any] = field(default_factory=dict)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m bench.studies.crosscheck_llmcompressor",
                                description="Cross-check our GPTQ/AWQ/SmoothQuant against llm-compressor.")
    sub = p.add_subparsers(dest="command", required=True)
    r = sub.add_parser("run", help="quantize with both stacks, evaluate with ours, write the report")
    r.add_argument("--model", default="smollm2-135m")
    r.add_argument("--variants", default=",".join(DEFAULT_VARIANTS),
                   help=f"comma-separated, from {', '.join(variants())}")
    r.add_argument("--data-dir", default=None)
    r.add_argument("--calib-samples", type=int, default=64)
    r.add_argument("--calib-seq-len", type=int, default=512)
    r.add_argument("--seed", type=int, default=0)
    r.add_argument("--datasets", default="wikitext2,c4")
    r.add_argument("--max-eval-tokens", type=int, default=40960)
    r.add_argument("--eval-seq-len", type=int, default=2048)
    r.add_argument("--alpha", type=float, default=0.8, help="SmoothQuant migration strength, both sides")
    r.add_argument("--threads", type=int, default=None, help="torch threads on both sides (default $OMP_NUM_THREADS or 1)")
    r.add_argument("--llmc-venv", type=Path, default=DEFAULT_LLMC_VENV)
    r.add_argument("--workdir", type=Path, default=None, help="default ~/.cache/lrq-bench/crosscheck-llmc")
    r.add_argument("--out", type=Path, default=None, help="report folder (default: the work folder)")
    r.add_argument("--no-fp", action="store_true", help="skip the floating-point reference row")
    r.add_argument("--force", action="store_true", help="recompute cached steps")
    r.add_argument("--timeout", type=int, default=3600, help="seconds for one llm-compressor run")
    w = sub.add_parser("worker", help="(internal) the llm-compressor side, run by the llm-compressor venv")
    w.add_argument("job", type=Path)
    s = sub.add_parser("setup-venv", help="create the llm-compressor virtual environment")
    s.add_argument("--llmc-venv", type=Path, default=DEFAULT_LLMC_VENV)
    s.add_argument("--python", default="python3.11")
    args = p.parse_args(argv)
    if args.command == "run":
        known = variants(args.alpha, args.calib_samples)
        args.variant_list = [v.strip() for v in args.variants.split(",") if v.strip()]
        bad = [v for v in args.variant_list if v not in known]
        if bad or not args.variant_list:
            p.error(f"unknown variant(s) {', '.join(bad) or '(none given)'}: choose from {', '.join(known)}")
        args.dataset_list = [d.strip() for d in args.datasets.split(",") if d.strip()]
        if any(d not in ("wikitext2", "c4") for d in args.dataset_list) or not args.dataset_list:
            p.error("--datasets: choose from wikitext2, c4")
        if args.calib_samples < 1 or args.calib_seq_len < 2:
            p.error("--calib-samples must be >= 1 and --calib-seq-len >= 2")
        if args.max_eval_tokens is not None and args.max_eval_tokens < args.eval_seq_len:
            p.error("--max-eval-tokens must be at least --eval-seq-len (one window)")
        if not 0.0 <= args.alpha <= 1.0:
            p.error("--alpha must be in [0, 1]")
        if args.threads is None:
            args.threads = int(os.environ.get("OMP_NUM_THREADS", "1") or 1)
        if args.threads < 1:
            p.error("--threads must be at least 1")
    return args


def run(args: argparse.Namespace) -> dict[str, Any]:
    import torch
    from bench import data as D
    from bench.models import cache_root, load_model
    from bench.perplexity import perplexity
    from bench.provenance import git_revision, hardware, versions
    from lrq.methods import get_method
    from lrq.schemes import get_scheme

    torch.set_num_threads(args.threads)
    workdir = args.workdir or (cache_root() / "crosscheck-llmc")
    workdir.mkdir(parents=True, exist_ok=True)
    out = args.out or workdir
    all_variants = variants(args.alpha, args.calib_samples)
    chosen = [all_variants[v] for v in args.variant_list]
    py = llmc_python(args.llmc_venv) if any(v.llmc_side for v in chosen) else None
    folder = model_folder(args.model)
    data_dir = D.resolve_data_dir(args.data_dir)
    D.check_available(sorted(set(args.dataset_list) | {"c4"}), data_dir)

    loaded = load_model(args.model)
    tok = loaded.tokenizer
    loaded.model = None  # every step loads a fresh copy: do not hold a second one through the measurements
    calib = D.calibration_set(tok, data_dir, "c4", args.calib_samples, args.calib_seq_len, args.seed, "random")
    calib_meta = write_calibration(workdir, calib.input_ids, calib.description)
    eval_ids, eval_desc = eval_streams(tok, args.dataset_list, data_dir, args.eval_seq_len, args.max_eval_tokens)
    base_key = {"model": loaded.fingerprint, "calib": calib_meta["sha256"], "eval": eval_desc,
                "threads": args.threads}

    def evaluate(model, label: str) -> tuple[dict[str, float], dict[str, int]]:
        ppl, toks = {}, {}
        for ds, ids in eval_ids.items():
            res = perplexity(model, ids, args.eval_seq_len, desc=f"{label} {ds}")
            ppl[ds], toks[ds] = res["ppl"], res["tokens"]
        return ppl, toks

    def cached(name: str, key: dict, compute) -> dict[str, Any]:
        return cached_step(workdir / "steps" / f"{name}.json", key, compute, args.force, f"[crosscheck] {name}")

    rows: list[dict[str, Any]] = []
    if not args.no_fp:
        def fp():
            ppl, toks = evaluate(load_model(args.model).model, "fp")
            return asdict(Side("fp", "fp", "fp", "fp", {}, ppl, toks))
        rows.append(cached("fp", base_key | {"step": "fp"}, fp))

    llmc_meta: dict[str, Any] = {}
    for v in chosen:
        scheme = get_scheme(v.scheme)
        method = get_method(v.method)
        cfg = method.config("quick", v.ours)
        if v.llmc_side:
            spec = llmc_recipe_spec(v)

            def theirs(v=v, spec=spec, scheme=scheme):
                vdir = workdir / f"llmc-{v.name}"
                job = {"model_dir": str(folder), "calib_path": str(workdir / CALIB_FILE),
                       "calib_sha256": calib_meta["sha256"], "recipe": spec, "threads": args.threads,
                       "out_dir": str(vdir), "pipeline": None}
                vdir.mkdir(parents=True, exist_ok=True)
                (vdir / "job.json").write_text(json.dumps(job, indent=2))
                env = dict(os.environ, OMP_NUM_THREADS=str(args.threads), MKL_NUM_THREADS=str(args.threads),
                           TQDM_DISABLE=os.environ.get("TQDM_DISABLE", "1"), HF_HUB_OFFLINE="1",
                           HF_DATASETS_OFFLINE="1", TRANSFORMERS_OFFLINE="1", PYTHONPATH="")
                log = vdir / "worker.log"
                with open(log, "w") as f:
                    proc = subprocess.run([str(py), str(Path(__file__).resolve()), "worker", str(vdir / "job.json")],
                                          stdout=f, stderr=subprocess.STDOUT, env=env, cwd=str(vdir),
                                          timeout=args.timeout)
                if proc.returncode != 0:
                    tail = log.read_text()[-3000:]
                    raise RuntimeError(f"llm-compressor run for {v.name} failed (exit {proc.returncode}); "
                                       f"log {log}:\n{tail}")
                meta = json.loads((vdir / EXPORT_META).read_text())
                if not meta["windows_match"]:
                    raise RuntimeError(f"llm-compressor saw other calibration windows than ours ({log})")
                from safetensors.torch import load_file
                model = load_model(args.model).model
                tensors = load_file(str(vdir / EXPORT_FILE))
                load_stats = apply_llmc_export(model, tensors, scheme)
                load_stats["logits_vs_llmc_forward"] = logits_agreement(model, tensors)
                ppl, toks = evaluate(model, f"llmc {v.name}")
                return asdict(Side("llm-compressor", v.name, v.method, v.scheme, meta["quant"], ppl, toks,
                                   {"recipe": spec, "recipe_repr": meta["recipe_repr"],
                                    "quant_args_example": meta["quant_args_example"]},
                                   {"load": load_stats, "windows_seen": meta["windows_seen"],
                                    "forward_passes_per_window": meta["forward_passes_per_window"],
                                    "pinning_disabled": meta["pinning_disabled"], "versions": meta["versions"],
                                    "model_dtype": meta["model_dtype"], "torch_threads": meta["torch_threads"]}))
            row = cached(f"llmc-{v.name}", base_key | {"step": "llmc", "spec": spec, "llmc": LLMC_VERSION}, theirs)
            llmc_meta = row["stats"].get("versions", llmc_meta)
            rows.append(row)

        def ours(v=v, scheme=scheme, method=method, cfg=cfg):
            model = load_model(args.model).model
            torch.manual_seed(args.seed)
            with Meter() as m:
                stats = method.quantize(model, scheme, cfg, calib) or {}
            ppl, toks = evaluate(model, f"ours {v.name}")
            return asdict(Side("ours", v.name, v.method, v.scheme, m.to_dict(), ppl, toks,
                               {"method_config": cfg, "overrides": v.ours, "scheme_def": scheme.to_dict()},
                               {k: s for k, s in stats.items() if isinstance(s, (int, float, str, bool))}))
        rows.append(cached(f"ours-{v.name}", base_key | {"step": "ours", "cfg": cfg, "scheme": v.scheme}, ours))

        if scheme.static_activations and v.llmc_side:
            # The same two quantized models, scored with compressed-tensors' order of operations in the
            # activation fake-quantization (see ct_activation_rounding): how much of the difference
            # between the sides is float rounding rather than method.
            def theirs_ct(v=v, scheme=scheme):
                from safetensors.torch import load_file
                model = load_model(args.model).model
                tensors = load_file(str(workdir / f"llmc-{v.name}" / EXPORT_FILE))
                apply_llmc_export(model, tensors, scheme)
                with ct_activation_rounding():
                    agree = logits_agreement(model, tensors)
                    ppl, toks = evaluate(model, f"llmc {v.name} ct-rounding")
                return asdict(Side(f"llm-compressor {CT_ROUNDING_LABEL}", v.name, v.method, v.scheme, {}, ppl, toks,
                                   stats={"logits_vs_llmc_forward": agree}))

            def ours_ct(v=v, scheme=scheme, method=method, cfg=cfg):
                model = load_model(args.model).model
                torch.manual_seed(args.seed)
                method.quantize(model, scheme, cfg, calib)
                with ct_activation_rounding():
                    ppl, toks = evaluate(model, f"ours {v.name} ct-rounding")
                return asdict(Side(f"ours {CT_ROUNDING_LABEL}", v.name, v.method, v.scheme, {}, ppl, toks))
            rows.append(cached(f"llmc-{v.name}-ct", base_key | {"step": "llmc-ct", "spec": llmc_recipe_spec(v),
                                                               "llmc": LLMC_VERSION}, theirs_ct))
            rows.append(cached(f"ours-{v.name}-ct", base_key | {"step": "ours-ct", "cfg": cfg, "scheme": v.scheme},
                               ours_ct))

    report = {
        "title": "Cross-check against llm-compressor",
        "model": {"name": args.model, "source": loaded.source, "fingerprint": loaded.fingerprint,
                  "folder": str(folder), "note": loaded.note},
        "calibration": calib_meta | {"description": calib.description},
        "evaluation": {"datasets": eval_desc, "autocast": "bf16", "function": "bench.perplexity.perplexity",
                       "max_eval_tokens": args.max_eval_tokens},
        "threads": args.threads,
        "ours": {"versions": versions(), "git_revision": git_revision()},
        "llm_compressor": {"versions": llmc_meta, "venv": str(args.llmc_venv), "pinned": LLMC_VERSION},
        "hardware": hardware() | {"loadavg_at_report": os.getloadavg()},
        "machine_note": "timings on a shared machine; see each step's 1-minute load average",
        "common_mismatches": list(COMMON_MISMATCHES),
        "variants": {v.name: {"method": v.method, "scheme": v.scheme, "ours_overrides": v.ours,
                              "llmc": llmc_recipe_spec(v) if v.llmc_side else None,
                              "mismatches": list(v.mismatches)} for v in chosen},
        "rows": rows,
    }
    out.mkdir(parents=True, exist_ok=True)
    (out / "crosscheck_llmcompressor.json").write_text(json.dumps(report, indent=2, default=str))
    md = markdown_report(report)
    (out / "crosscheck_llmcompressor.md").write_text(md)
    print(md)
    return report


def _fmt_mib(b) -> str:
    return f"{b / 2**20:,.0f}" if b else "-"


def markdown_report(report: dict[str, Any]) -> str:
    """The side-by-side table: per comparison, both perplexities and times, and the ratios ours/theirs."""
    rows = report["rows"]
    datasets = list(report["evaluation"]["datasets"])
    by = {(r["variant"], r["side"]): r for r in rows}
    head = ["comparison", "scheme", "side"] + [f"{d} ppl" for d in datasets] + [
        "quant wall (s)", "quant CPU (s)", "peak RSS (MiB)"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    verdicts = []
    for r in rows:
        cells = [r["variant"], r["scheme"], r["side"]] + [f"{r['ppl'].get(d, float('nan')):.2f}" for d in datasets]
        q = r.get("quant") or {}
        cells += [f"{q['wall_s']:.1f}" if q.get("wall_s") else "-", f"{q['cpu_s']:.1f}" if q.get("cpu_s") else "-",
                  _fmt_mib(q.get("peak_rss_bytes"))]
        lines.append("| " + " | ".join(cells) + " |")
        if r["side"] == "ours" and (r["variant"], "llm-compressor") in by:
            t = by[(r["variant"], "llm-compressor")]
            rel = {d: r["ppl"][d] / t["ppl"][d] - 1 for d in datasets}
            speed = r["quant"]["wall_s"] / t["quant"]["wall_s"]
            cpu = (r["quant"]["cpu_s"] / t["quant"]["cpu_s"]) if r["quant"].get("cpu_s") and t["quant"].get("cpu_s") else None
            ok_ppl = all(x <= 0.02 for x in rel.values())
            ok_time = speed <= 1.0 and (cpu is None or cpu <= 1.0)
            verdicts.append(f"- **{r['variant']}** ({r['scheme']}): ppl ours vs llm-compressor "
                            + ", ".join(f"{d} {x:+.1%}" for d, x in rel.items())
                            + f" ({'within' if ok_ppl else 'OUTSIDE'} the +2 % target); quantization time "
                            f"ours / theirs = {speed:.2f} wall" + (f", {cpu:.2f} CPU" if cpu is not None else "")
                            + f" ({'met' if ok_time else 'NOT met'})")
            o_ct, t_ct = by.get((r["variant"], f"ours {CT_ROUNDING_LABEL}")), by.get(
                (r["variant"], f"llm-compressor {CT_ROUNDING_LABEL}"))
            if o_ct and t_ct:
                verdicts.append(f"  - both scored with compressed-tensors' activation rounding order: ours vs "
                                "llm-compressor " + ", ".join(f"{d} {o_ct['ppl'][d] / t_ct['ppl'][d] - 1:+.1%}"
                                                              for d in datasets)
                                + "; llm-compressor's model, our order vs theirs: "
                                + ", ".join(f"{d} {r2:+.1%}" for d, r2 in
                                            ((d, t["ppl"][d] / t_ct["ppl"][d] - 1) for d in datasets)))
    ev = report["evaluation"]["datasets"]
    cal = report["calibration"]
    lv = report["llm_compressor"]["versions"]
    ov = report["ours"]["versions"]
    text = [f"## {report['title']}", "",
            f"Model {report['model']['name']} ({report['model']['source']}); calibration {cal['shape'][0]} x "
            f"{cal['shape'][1]} tokens from {cal['description'].get('source')} (seed {cal['description'].get('seed')}, "
            f"sha256 {cal['sha256'][:16]}), the same windows on both sides; evaluation with our perplexity "
            f"function (bf16 autocast) on "
            + ", ".join(f"{d} {e['tokens']} tokens ({e['windows']} x {e['seq_len']})" for d, e in ev.items())
            + f". {report['threads']} torch thread(s) on both sides, {report['hardware'].get('cpu')}; "
            f"{report['machine_note']}.", "",
            f"llm-compressor {lv.get('llmcompressor', '?')}, compressed-tensors {lv.get('compressed-tensors', '?')}, "
            f"transformers {lv.get('transformers', '?')}, torch {lv.get('torch', '?')}; ours: lrq-bench "
            f"{report['ours']['git_revision'][:12]}, transformers {ov.get('transformers', '?')}, torch {ov.get('torch', '?')}.",
            "", *lines, "", *verdicts]
    return "\n".join(text) + "\n"


def setup_venv(venv: Path, python: str) -> int:
    venv = Path(venv)
    cmds = [[python, "-m", "venv", str(venv)],
            [str(venv / "bin" / "pip"), "install", TORCH_PIN, f"llmcompressor=={LLMC_VERSION}"]]
    for c in cmds:
        print("+", " ".join(c), flush=True)
        if subprocess.run(c).returncode != 0:
            print(f"failed: {' '.join(c)}", file=sys.stderr)
            return 1
    return 0


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        if args.command == "worker":
            return llmc_worker(args.job)
        if args.command == "setup-venv":
            return setup_venv(args.llmc_venv, args.python)
        run(args)
        return 0
    except CrosscheckError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except Exception as e:  # lrq's UserError (bad data folder, model) reads the same way
        if type(e).__name__ == "UserError":
            print(f"error: {e}", file=sys.stderr)
            return 2
        raise


if __name__ == "__main__":
    sys.exit(main())
