"""lrq: post-training quantization of LLMs (LRQ, FlexRound and the baselines), as a library.

    import lrq
    model, stats = lrq.quantize(model, "lrq", "w4a8", calibration=ids, iters=200)   # fake-quantized in place
    lrq.pack(model)                                  # real low-bit storage (lrq.packed.PackedLinear)
    lrq.save(model, "out/", tokenizer)               # compressed-tensors pack-quantized folder
    model = lrq.load("out/")                         # back, with identical logits
    model = lrq.load("out/", head="int8")            # ... with an int8 output head (faster CPU decode; see docs)

`lrq-bench` (the benchmark harness in `bench/`) quantizes every cell through `lrq.quantize` too.
Methods: lrq, flexround, rtn, smoothquant, gptq, awq, omniquant (`lrq.list_methods()`); schemes: w8a8,
w4a8, w4a16, w3a16, w4a16-g128, w3a16-g128, w4a8-kv8 (`lrq.list_schemes()`). Llama/Mistral/Qwen2-style decoders.
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path
from typing import Any

__version__ = "0.1.0"
__all__ = ["quantize", "pack", "save", "load", "list_methods", "list_schemes"]


def list_methods() -> list[str]:
    """The registered method names."""
    from lrq.methods import load_methods
    return sorted(load_methods())


def list_schemes() -> list[str]:
    from lrq.schemes import SCHEMES
    return list(SCHEMES)


def _calibration(calibration):
    """A Calibration from token ids [n_samples, seq_len] (a tensor, or a list of equal-length id lists)."""
    import torch

    from lrq.errors import UserError
    from lrq.methods import Calibration
    if calibration is None or isinstance(calibration, Calibration):
        return calibration
    ids = calibration if isinstance(calibration, torch.Tensor) else torch.tensor(calibration)
    if ids.dim() != 2 or ids.dtype not in (torch.int32, torch.int64) or ids.shape[0] < 1 or ids.shape[1] < 2:
        raise UserError(f"calibration must be token ids of shape [n_samples, seq_len] (integers, seq_len >= 2), "
                        f"got {ids.dtype} {tuple(ids.shape)}.")
    ids = ids.long()
    digest = hashlib.sha256(ids.numpy().tobytes()).hexdigest()[:16]
    return Calibration(ids, {"dataset": "user", "n_samples": ids.shape[0], "seq_len": ids.shape[1],
                             "tokens_sha256": digest})


def quantize(model, method, scheme, calibration=None, *, preset: str = "quick", device=None,
             checkpoint_dir: str | os.PathLike | None = None, precision: str = "auto", config=None, **settings: Any):
    """Quantize `model`'s decoder linears in place with `method` under `scheme`; returns (model, stats).

    method: a registered name ("lrq", "gptq", ...) or a configured lrq.methods.Method instance.
    scheme: a name ("w4a8", "w3a16-g128", ...) or an lrq.schemes.Scheme.
    calibration: token ids [n_samples, seq_len] (required by every method that uses data, and by any
    scheme with static activation ranges), or an lrq.methods.Calibration.
    preset: "quick" (CPU-sized) or "paper" (the authors' settings); settings: any of the method's
    settings (`lrq.methods.get_method(name).defaults`), e.g. iters=200, lr=1e-3; an unknown one is an
    error with the valid names. device: where block-wise methods compute (default: where the model is;
    a CUDA device with the model on the CPU offloads one block at a time). checkpoint_dir: per-block
    checkpoints of the training methods (a rerun with the same arguments resumes at the next block).
    precision: "auto" (bf16 where the device computes it natively, else fp32), "bf16", "fp32", or an
    lrq.precision.Precision already decided (what a settled cell carries): the compute
    precision of the method's forwards (calibration passes, block forwards, training where the preset does
    not fix fp32); see lrq.precision.
    config: the method's settings already parsed (an lrq.config.MethodConfig of the method, e.g.
    `get_method("lrq").config("quick", {"iters": 200})`), instead of preset + settings.
    stats: what the method measured (learnable parameters, block errors, ...).
    """
    from lrq import precision as P
    from lrq.errors import UserError
    from lrq.methods import Method, check_settings, get_method
    from lrq.schemes import Scheme, get_scheme
    m = method if isinstance(method, Method) else get_method(method, device=device,
                                                              checkpoint_dir=None if checkpoint_dir is None
                                                              else str(checkpoint_dir))
    s = scheme if isinstance(scheme, Scheme) else get_scheme(scheme)
    if config is not None:
        if settings:
            raise UserError(f"give the settings either parsed (config=) or as keywords ({', '.join(settings)}), "
                            f"not both.")
        if not isinstance(config, m.settings):
            raise UserError(f"config= must be {m.name}'s settings ({m.settings.__name__}), got "
                            f"{type(config).__name__}: build it with lrq.methods.get_method({m.name!r}).config(...).")
        cfg = config
    else:
        check_settings(settings, [m.name])
        cfg = m.config(preset, settings)
    calib = _calibration(calibration)
    if calib is None and (m.needs_calibration(s) or (s.static_activations and not m.provides_activation_ranges)):
        raise UserError(f"{m.name} under {s.name} needs calibration data: pass calibration=<token ids "
                        f"[n_samples, seq_len]> (e.g. 128 x 512 tokens of C4).")
    with P.use(precision):
        stats = m.quantize(model, s, cfg, calib) or {}
    return model, stats


def pack(model) -> dict[str, int]:
    """Swap every quantized linear for its packed form (int32 words, fp16 scales, uint8 zero points);
    returns the weight bytes before (bf16) and after."""
    from lrq.packed import pack_model
    return pack_model(model)


def save(model, folder: str | os.PathLike, tokenizer=None, metadata: dict | None = None,
         allow_ragged: bool = False) -> Path:
    """Write the quantized model as a compressed-tensors pack-quantized folder (packs it first)."""
    from lrq.export import save_compressed
    return save_compressed(model, folder, tokenizer=tokenizer, metadata=metadata, allow_ragged=allow_ragged)


def load(folder: str | os.PathLike, dtype=None, head: str | None = None):
    """The model `save` wrote, with packed linears (identical logits). `head="int8"`: its output head (and a tied
    embedding with it) held as 8-bit levels per output channel, a deployment choice on the CPU that changes the logits
    (lrq.packed.quantize_head; what it costs: bench.studies.head_int8); `head="bf16"` (a float32 model): its table
    held in bf16 (half the bytes; lossless for a bf16 checkpoint, else rounded as a bf16 model's)."""
    from lrq.export import load_compressed
    model = load_compressed(folder, dtype)
    if head is not None:
        from lrq.packed import quantize_head
        quantize_head(model, head)
    return model
