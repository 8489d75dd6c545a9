"""The compute precision of every forward the suite runs: bf16 (autocast) or fp32, chosen for the machine.

Weights stay float32; what changes is whether the matmuls of evaluation, calibration passes and the
block training that allows it run under bf16 autocast. bf16 is fast only where the CPU computes it
natively: on an Intel Xeon with AMX or an AMD Zen 4 (AVX512-BF16) a bf16 matmul is several times faster
than fp32; on a CPU without it (AMD Zen 3, AVX2 only) torch emulates bf16 and the same matmul is 5-10x
*slower* than fp32. So `auto` asks the machine:

- CUDA device: bf16;
- x86 CPU: bf16 when /proc/cpuinfo lists `avx512_bf16` or `amx_bf16` AND torch's ATen kernels run at
  AVX-512 (`torch.backends.cpu.get_cpu_capability()`; `ATEN_CPU_CAPABILITY=avx2` lowers it) AND oneDNN
  is not capped below a bf16 ISA (`ONEDNN_MAX_CPU_ISA`); else fp32;
- Arm CPU: bf16 when the `Features` line lists `bf16`; else fp32.

A run decides its precision once, as a `Precision` (what was asked, what is used, why `auto` chose it),
when a cell is settled; the cell carries that object to its worker, which runs everything inside
`use(cell.precision)`. `autocast(device, enabled)` is the one place that opens a bf16 autocast region: it
opens one when the precision in force is bf16 and none when it is fp32 or the caller's own setting says fp32
(`enabled=False`: a preset that fixes fp32, such as the paper preset's block training). Quantization,
evaluation (perplexity, KL divergence, tasks) and the planner's probes all call it; none builds its own.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os
import platform
from contextvars import ContextVar
from dataclasses import dataclass
from pathlib import Path

import torch

from lrq.errors import UserError

log = logging.getLogger(__name__)

PRECISIONS = ("auto", "bf16", "fp32")
# oneDNN ISA caps (ONEDNN_MAX_CPU_ISA / DNNL_MAX_CPU_ISA) under which bf16 is still computed natively
_BF16_ISAS = ("AVX512_CORE_BF16", "AVX512_CORE_FP16", "AVX512_CORE_AMX", "AVX512_CORE_AMX_FP16", "AVX10_1_512",
              "AVX10_1_512_AMX", "AVX10_1_512_AMX_FP16", "ALL", "DEFAULT")

_current: ContextVar[str | Precision | None] = ContextVar("lrq_precision", default=None)


def _cpu_flags() -> set[str]:
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return set()
    for line in text.splitlines():
        key = line.split(":", 1)[0].strip().lower()
        if key in ("flags", "features"):
            return set(line.split(":", 1)[1].split())
    return set()


@functools.lru_cache(maxsize=1)
def cpu_bf16() -> dict:
    """What this CPU and this torch say about bf16: {"native": bool, "why": str, ...the evidence}."""
    flags = _cpu_flags()
    capability = torch.backends.cpu.get_cpu_capability()
    isa_cap = os.environ.get("ONEDNN_MAX_CPU_ISA") or os.environ.get("DNNL_MAX_CPU_ISA")
    machine = platform.machine().lower()
    bf16_flags = sorted(f for f in flags if f in ("avx512_bf16", "amx_bf16", "bf16"))
    info = {"cpu_bf16_flags": bf16_flags, "torch_cpu_capability": capability, "onednn_max_cpu_isa": isa_cap}
    if machine in ("aarch64", "arm64"):
        native = "bf16" in flags
        why = "the CPU lists bf16" if native else "the CPU does not list bf16 (Arm)"
    elif not ({"avx512_bf16", "amx_bf16"} & flags):
        native, why = False, "the CPU has neither AVX512-BF16 nor AMX-BF16"
    elif not capability.upper().startswith("AVX512"):
        native, why = False, f"torch's CPU kernels run at {capability} (ATEN_CPU_CAPABILITY), below AVX-512"
    elif isa_cap and isa_cap.upper() not in _BF16_ISAS:
        native, why = False, f"oneDNN is capped at {isa_cap} (ONEDNN_MAX_CPU_ISA), below its bf16 ISAs"
    else:
        native = True
        why = "the CPU has " + " and ".join(f.upper().replace("_", "-") for f in bf16_flags
                                            if f in ("avx512_bf16", "amx_bf16"))
    return info | {"native": native, "why": why}


def resolve(precision: str | Precision | None = "auto", device: torch.device | str | None = None) -> str:
    """'bf16' or 'fp32': `precision` as asked, 'auto' (or None) decided for `device` (default: the CPU); a
    `Precision` already decided is what it says."""
    if isinstance(precision, Precision):
        return precision.used
    p = (precision or "auto").strip().lower()
    if p not in PRECISIONS:
        raise UserError(f"unknown precision {precision!r}: choose auto, bf16 or fp32 (--precision).")
    if p != "auto":
        return p
    kind = torch.device(device).type if device is not None else "cpu"
    if kind == "cuda":
        return "bf16"
    return "bf16" if cpu_bf16()["native"] else "fp32"


@dataclass(frozen=True)
class Precision:
    """A precision decided once: `used` ('bf16' or 'fp32') is what every forward computes at, `asked` what the
    user asked for ('auto', 'bf16', 'fp32'), `why` the reason, `native_bf16` whether this CPU computes bf16
    natively (None on a CUDA device). Built by `decide`; a settled cell carries one to its worker."""
    used: str
    asked: str = "auto"
    why: str = ""
    native_bf16: bool | None = None

    def __post_init__(self):
        if self.used not in ("bf16", "fp32"):
            raise ValueError(f"a decided precision is bf16 or fp32, not {self.used!r}")

    @classmethod
    def decide(cls, precision: str | Precision | None = "auto",
               device: torch.device | str | None = None) -> Precision:
        """`precision` ('auto', 'bf16', 'fp32'; None: 'auto') decided for `device` (default: the CPU)."""
        if isinstance(precision, Precision):
            return precision
        used = resolve(precision, device)
        asked = (precision or "auto").strip().lower()
        kind = torch.device(device).type if device is not None else "cpu"
        why = ("asked for explicitly" if asked != "auto" else
               "bf16 on a CUDA device" if kind == "cuda" else cpu_bf16()["why"])
        return cls(used, asked, why, None if kind == "cuda" else cpu_bf16()["native"])

    @property
    def bf16(self) -> bool:
        return self.used == "bf16"

    def info(self) -> dict:
        """What a result records about its precision: asked, used, why (and, on a CPU, native_bf16)."""
        return ({"asked": self.asked, "used": self.used, "why": self.why}
                | ({} if self.native_bf16 is None else {"native_bf16": self.native_bf16}))

    def autocast(self, device: torch.device | str, enabled: bool = True, cache_enabled: bool | None = None):
        """A bf16 autocast region on `device` when this precision is bf16 and `enabled` (see `autocast`)."""
        return autocast(device, enabled, cache_enabled, precision=self)

    def __str__(self) -> str:
        return self.used


def describe(precision: str | Precision | None = "auto", device: torch.device | str | None = None) -> dict:
    """What a result records about its precision: asked, used, and why `auto` chose it."""
    return Precision.decide(precision, device).info()


def current(device: torch.device | str | None = None) -> str:
    """The precision in force here: the innermost `use(...)`, else 'auto' decided for `device`."""
    return resolve(_current.get(), device)


@contextlib.contextmanager
def use(precision: str | Precision | None):
    """Run the code inside at `precision` (a `Precision`, or 'auto', 'bf16', 'fp32'; None leaves the enclosing
    one)."""
    if precision is None:
        yield
        return
    resolve(precision)   # an unknown name fails here, not deep inside a run
    token = _current.set(precision)
    try:
        yield
    finally:
        _current.reset(token)


def autocast(device: torch.device | str, enabled: bool = True, cache_enabled: bool | None = None,
             precision: str | Precision | None = None):
    """A bf16 autocast region on `device` when `enabled` and the precision (`precision`, else the one in force:
    `use`) is bf16; else nothing. The one place a bf16 autocast region is opened."""
    kind = torch.device(device).type
    used = current(kind) if precision is None else resolve(precision, kind)
    if not enabled or used != "bf16":
        return contextlib.nullcontext()
    kw = {} if cache_enabled is None else {"cache_enabled": cache_enabled}
    return torch.autocast(kind, dtype=torch.bfloat16, **kw)


def authors_fp16_model(model: torch.nn.Module, device: torch.device | str):
    """`train_precision=authors` for `model` computing on `device`: every parameter rounded now to the nearest
    fp16 value, in its own dtype (the authors load the model in fp16), a warning logged where the CPU emulates
    fp16 (`authors_fp16_cost`); returns the fp16 autocast region its block forwards run in (the training steps
    decide their own autocast). The engine's quantize and the Figure 2 study both start the pipeline here."""
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(p.half().to(p.dtype))
    if slow := authors_fp16_cost(device):
        log.warning(slow)
    return authors_fp16(device)


def authors_fp16_cost(device: torch.device | str) -> str | None:
    """Why `train_precision=authors` (fp16) will be slow on `device`, or None: a CPU without fp16 arithmetic
    (x86 without AVX512-FP16 or AMX-FP16, Arm without half-precision SIMD), where torch emulates fp16."""
    if torch.device(device).type != "cpu":
        return None
    flags = _cpu_flags()
    if {"avx512_fp16", "amx_fp16", "asimdhp", "fphp"} & flags:
        return None
    return ("train_precision=authors computes in fp16, and this CPU has no fp16 arithmetic (neither AVX512-FP16 nor "
            "AMX-FP16): torch emulates it, an order of magnitude slower than float32 (measured: FlexRound's w3a16 "
            "step on a SmolLM2-135M block, 8.7 s against 0.5 s, one thread of a Zen 4). The setting reproduces the "
            "authors' GPU pipeline; on a CPU, leave it at default unless the fp16 numerics are what you study.")


def authors_fp16(device: torch.device | str, enabled: bool = True):
    """An fp16 autocast region on `device` when `enabled`: the authors' fp16 pipeline (LRQ/FlexRound's
    `train_precision=authors`), a method's setting rather than the run's precision."""
    return torch.autocast(torch.device(device).type, dtype=torch.float16, enabled=enabled)


# Where logits are scored (perplexity, KL divergence, top-1 agreement, task accuracy) the output head runs in
# float32 whatever the precision of the model's body. Under bf16 autocast the head would compute in bf16 and
# only its output would be cast: on the default model, bf16 logits tie exactly for the top token at 310 of
# 8,188 positions (FP) and 466 (RTN w4a16), and tie-breaking by the lowest token id then decides top-1 agreement
# (0.5714 stored vs 0.5657 from float32 logits of the same hidden states).
HEAD_PRECISION = "fp32"


def float32_logits(hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """hidden @ weight^T (+ bias) in float32, outside any autocast: the vocabulary projection where logits are
    scored."""
    import torch.nn.functional as F
    with torch.autocast(hidden.device.type, enabled=False):
        return F.linear(hidden.float(), weight.float(), None if bias is None else bias.float())


def head_weight(head: torch.nn.Module) -> torch.Tensor:
    """The vocabulary projection's weight as its logits are scored: a Linear's own, or a head packed by
    lrq.packed.quantize_head dequantized in float32 (made on every call: a caller scoring many chunks makes it once)."""
    weight = getattr(head, "weight", None)
    return weight if isinstance(weight, torch.Tensor) else head.dequantized_weight(torch.float32)


def head_logits(head: torch.nn.Module, hidden: torch.Tensor) -> torch.Tensor:
    """float32 logits of `head` (head_weight's) on `hidden`, outside any autocast."""
    return float32_logits(hidden, head_weight(head), getattr(head, "bias", None))


@contextlib.contextmanager
def float32_head(model: torch.nn.Module):
    """The model's output head computes in float32 inside this block (lm-eval calls the model as a whole)."""
    head = model.get_output_embeddings()
    head.forward = lambda x: head_logits(head, x)   # an instance attribute over the class's forward
    try:
        yield
    finally:
        del head.forward
