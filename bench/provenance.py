"""What produced a number: package versions, git revision, hardware."""

from __future__ import annotations

import functools
import importlib.metadata
import os
import platform
import subprocess
from pathlib import Path

import torch

PACKAGES = ("lrq-bench", "torch", "triton", "transformers", "lm_eval", "datasets", "gguf", "numpy")


def package_versions(names) -> dict[str, str]:
    """Python's and each installed package's version (absent packages left out)."""
    out = {"python": platform.python_version()}
    for p in names:
        try:
            out[p] = importlib.metadata.version(p)
        except importlib.metadata.PackageNotFoundError:
            pass
    return out


@functools.lru_cache(maxsize=1)
def versions() -> dict[str, str]:
    return package_versions(PACKAGES)


@functools.lru_cache(maxsize=1)
def git_revision() -> str:
    """HEAD of the checkout this package runs from, with '+dirty' when it has uncommitted changes."""
    root = Path(__file__).resolve().parent.parent
    try:
        rev = subprocess.run(["git", "-C", str(root), "rev-parse", "HEAD"], capture_output=True, text=True,
                             timeout=10).stdout.strip()
        if not rev:
            return "unknown"
        dirty = subprocess.run(["git", "-C", str(root), "status", "--porcelain", "--untracked-files=no"],
                               capture_output=True, text=True, timeout=10).stdout.strip()
        return rev + ("+dirty" if dirty else "")
    except (OSError, subprocess.SubprocessError):
        return "unknown"


@functools.lru_cache(maxsize=1)
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
    hw: dict[str, object] = {"cpu": cpu, "cpu_count": os.cpu_count(), "torch_threads": torch.get_num_threads(),
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
    return str(hw.get("gpu") or f"{hw['cpu']} x{hw['cpu_count']}")
