"""Wall time and peak memory of a step: resident set size sampled in a thread, CUDA peak from torch."""

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


@contextmanager
def measure(interval: float = 0.02):
    proc = psutil.Process()
    m = Measurement(peak_rss_bytes=proc.memory_info().rss)
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
        stop.set()
        thread.join()
        m.peak_rss_bytes = max(m.peak_rss_bytes, proc.memory_info().rss)
        if cuda:
            m.peak_cuda_bytes = torch.cuda.max_memory_allocated()
