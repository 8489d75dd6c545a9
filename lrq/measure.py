"""Wall time, CPU time and peak memory of a step: resident set size sampled in a thread, CUDA peak from torch.

The one memory meter of the project (results, studies, and the llm-compressor worker, which imports it
in its own environment: it needs only psutil and torch, and lrq/__init__ imports nothing at import time);
`package_versions` says what a measured run ran with. On a shared machine CPU time (user + system,
all threads) is the steadier figure: wall time also counts the time other processes held the cores."""

from __future__ import annotations

import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass

import psutil
import torch


@dataclass
class Measurement:
    wall_s: float = 0.0
    peak_rss_bytes: int = 0
    peak_cuda_bytes: int | None = None
    cpu_s: float = 0.0
    rss_before_bytes: int = 0


@contextmanager
def measure(interval: float = 0.02):
    proc = psutil.Process()
    m = Measurement(peak_rss_bytes=proc.memory_info().rss)
    m.rss_before_bytes = m.peak_rss_bytes
    cpu0 = proc.cpu_times()
    stop = threading.Event()

    def sample():
        while not stop.wait(interval):
            m.peak_rss_bytes = max(m.peak_rss_bytes, proc.memory_info().rss)

    thread = threading.Thread(target=sample, daemon=True)
    cuda = torch.cuda.is_available()
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    t0 = time.perf_counter()
    thread.start()
    try:
        yield m
    finally:
        m.wall_s = time.perf_counter() - t0
        cpu = proc.cpu_times()
        m.cpu_s = (cpu.user - cpu0.user) + (cpu.system - cpu0.system)
        stop.set()
        thread.join()
        m.peak_rss_bytes = max(m.peak_rss_bytes, proc.memory_info().rss)
        if cuda:
            m.peak_cuda_bytes = torch.cuda.max_memory_allocated()


def package_versions(names) -> dict[str, str]:
    """Python's and each installed package's version (absent packages left out)."""
    import importlib.metadata
    import platform
    out = {"python": platform.python_version()}
    for p in names:
        try:
            out[p] = importlib.metadata.version(p)
        except importlib.metadata.PackageNotFoundError:
            pass
    return out
