"""What produced a number: package versions, git revision, hardware."""

from __future__ import annotations

import functools
import os
import platform
import subprocess
from pathlib import Path

import torch

from lrq.measure import package_versions   # noqa: F401  (re-exported: what the harness records)

PACKAGES = ("lrq-bench", "torch", "triton", "transformers", "lm_eval", "datasets", "gguf", "numpy")




@functools.lru_cache(maxsize=1)
def versions() -> dict[str, str]:
    return package_versions(PACKAGES)


CODE_PATHS = ("lrq", "baselines", "bench", "pyproject.toml")   # what computes a number (`git_revision`'s dirty flag)


def short_revision(rev: str) -> str:
    """A revision as the leaderboard prints it: 12 characters of the commit, and '+dirty' where it was dirty."""
    return rev[:12] + ("+dirty" if rev.endswith("+dirty") else "")


@functools.lru_cache(maxsize=1)
def git_revision() -> str:
    """HEAD of the checkout this package runs from, with '+dirty' when its code (the packages and pyproject.toml)
    has uncommitted changes: results written into the tree as a run goes (a `--sync` folder under reports/) are not
    the code that computed them, so they never mark it dirty."""
    return revision_of(Path(__file__).resolve().parents[2])


def revision_of(root: Path) -> str:
    """`git_revision` of the checkout at `root`."""
    try:
        rev = subprocess.run(["git", "-C", str(root), "rev-parse", "HEAD"], capture_output=True, text=True,
                             timeout=10).stdout.strip()
        if not rev:
            return "unknown"
        dirty = subprocess.run(["git", "-C", str(root), "status", "--porcelain", "--untracked-files=no", "--",
                                *CODE_PATHS],
                               capture_output=True, text=True, timeout=10).stdout.strip()
        return rev + ("+dirty" if dirty else "")
    except (OSError, subprocess.SubprocessError):
        return "unknown"


@functools.lru_cache(maxsize=1)
def _cpuinfo() -> dict[str, str]:
    out: dict[str, str] = {}
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if ":" in line:
                k, v = (x.strip() for x in line.split(":", 1))
                out.setdefault(k, v)
            elif not line.strip() and out:
                break   # the first processor is enough
    except OSError:
        pass
    return out


def cpu_kind(info: dict[str, str] | None = None) -> str:
    """What the CPU is, from its vendor, family, model and flags, where its model name does not say ("AMD
    EPYC" is a Zen 3 without native bf16 and a Zen 4 with it; "Intel(R) Xeon(R) Processor" with AMX or
    without): e.g. "Zen 4, AVX512-BF16", "Zen 3, AVX2", "Intel with AMX-BF16". Empty where unknown."""
    info = _cpuinfo() if info is None else info
    flags = set(info.get("flags", "").split())
    vendor = info.get("vendor_id", "")
    try:
        family, model = int(info.get("cpu family", "-1")), int(info.get("model", "-1"))
    except ValueError:
        family, model = -1, -1
    isa = ("AMX-BF16" if "amx_bf16" in flags else "AVX512-BF16" if "avx512_bf16" in flags else
           "AVX-512" if "avx512f" in flags else "AVX2" if "avx2" in flags else "")
    core = ""
    if vendor == "AuthenticAMD":
        core = {23: "Zen/Zen 2", 26: "Zen 5"}.get(family, "")
        if family == 25:   # Zen 3: models 0x00-0x0f, 0x20-0x5f; Zen 4: 0x10-0x1f, 0x60-0x7f, 0xa0-0xaf
            core = "Zen 4" if (0x10 <= model <= 0x1f or 0x60 <= model <= 0x7f or 0xa0 <= model <= 0xaf) else "Zen 3"
    elif vendor == "GenuineIntel":
        core = "Intel"
    return ", ".join(x for x in (core, isa) if x)


def cpu_label(hw: dict) -> str:
    """The CPU as reports name it: its model name and kind, e.g. "AMD EPYC (Zen 4, AVX512-BF16)"."""
    kind = hw.get("cpu_kind")
    return f"{hw.get('cpu')} ({kind})" if kind else str(hw.get("cpu"))


def hardware() -> dict[str, object]:
    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    from lrq.precision import cpu_bf16
    bf16 = cpu_bf16()
    # the model name alone does not tell CPUs apart ("AMD EPYC" is Zen 3 without native bf16 and Zen 4 with
    # it): what decides the numerics of bf16 runs and the speed of both precisions is recorded with it
    hw: dict[str, object] = {"cpu": cpu, "cpu_kind": cpu_kind(), "cpu_count": os.cpu_count(),
                             "torch_threads": torch.get_num_threads(),
                             "platform": platform.platform(), "native_bf16": bf16["native"],
                             "cpu_bf16_flags": bf16["cpu_bf16_flags"],
                             "torch_cpu_capability": bf16["torch_cpu_capability"]}
    from lrq.packed import int_mm_ok
    # how packed w8a8 layers multiply here: torch._int_mm only where it is exact (lrq.packed)
    hw["cpu_int8_gemm"] = "torch._int_mm" if int_mm_ok() else "dequantize (torch._int_mm missing or inexact)"
    if torch.cuda.is_available():
        hw["gpu"] = torch.cuda.get_device_name(0)
    return hw


def device_label() -> str:
    hw = hardware()
    return str(hw.get("gpu") or f"{cpu_label(hw)} x{hw['cpu_count']}")
