"""Weights a CPU decode step streams, gathered into one region of transparent huge pages (2 MB).

A one-token step reads every weight once from memory, layer by layer: about 420 arrays of 60 KB-1.7 MB for a 4-bit
SmolLM2-135M and its 57 MB output head. With 4 KB pages every 4 KB of them needs its own page-table walk (on a
virtual machine a two-level one), and the arrays lie wherever the allocator put them. Copied into one region backed
by huge pages, in the order a step reads them, the same kernels stream them faster: on a 2-core Intel Xeon VM (one
thread, interleaved) a dense bf16 decode step 29.9 -> 21.0 ms and a w4a16-g128 one 12.9 -> 10.9 ms. torch's own
allocator does this only for single allocations of 2 MB and more, and only with THP_MEM_ALLOC_ENABLE=1.

Linux only, and only where the kernel offers transparent huge pages (`/sys/kernel/mm/transparent_hugepage/enabled`
is `always` or `madvise`); elsewhere `gather` returns None and the weights stay as they are. The values are copied,
never changed; the region lives as long as a tensor that views it.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import mmap
import sys
from pathlib import Path

import torch

HUGE = 2 << 20            # the huge page size of x86-64 Linux
ALIGN = 64                # each tensor starts on a cache line
MADV_HUGEPAGE = 14
THP_SETTING = Path("/sys/kernel/mm/transparent_hugepage/enabled")


def available() -> bool:
    """Whether this process can ask for transparent huge pages (Linux, THP `always` or `madvise`)."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        setting = THP_SETTING.read_text()
    except OSError:
        return False
    return "[always]" in setting or "[madvise]" in setting


@functools.lru_cache(maxsize=None)
def _libc() -> ctypes.CDLL:
    """The C library, loaded once (its madvise and, with glibc, malloc_trim)."""
    libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
    libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    libc.madvise.restype = ctypes.c_int
    return libc


def arena(nbytes: int) -> torch.Tensor | None:
    """A uint8 tensor of at least `nbytes` bytes, 2 MB-aligned, in an anonymous private mapping marked for huge
    pages (not yet touched: its pages are made when first written); None where huge pages cannot be asked for."""
    if nbytes <= 0 or not available():
        return None
    size = -(-nbytes // HUGE) * HUGE
    try:
        region = mmap.mmap(-1, size + HUGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        address = ctypes.addressof((ctypes.c_char * len(region)).from_buffer(region))
        start = (-address) % HUGE
        if _libc().madvise(address + start, size, MADV_HUGEPAGE) != 0:
            return None
    except (OSError, ValueError, AttributeError):
        return None
    # the tensor holds the mapping's buffer, so the mapping lives as long as any view of it
    return torch.frombuffer(region, dtype=torch.uint8)[start:start + size]


def gather(tensors: list[torch.Tensor]) -> list[torch.Tensor] | None:
    """Copies of `tensors` (CPU, contiguous; their dtypes and shapes) placed one after the other, each on a cache line,
    in one huge-page arena; None where there is no such arena (then nothing was copied)."""
    offsets, total = [], 0
    for t in tensors:
        if t.device.type != "cpu" or not t.is_contiguous():
            raise ValueError("gather takes contiguous CPU tensors")
        offsets.append(total)
        total += -(-t.numel() * t.element_size() // ALIGN) * ALIGN
    region = arena(total)
    if region is None:
        return None
    out = []
    for t, o in zip(tensors, offsets):
        copy = region[o:o + t.numel() * t.element_size()].view(t.dtype).view(t.shape)
        copy.copy_(t)
        out.append(copy)
    return out


def release_freed() -> None:
    """Hands the pages of memory freed since (the weights `gather` replaced) back to the system where the C library
    is glibc (malloc_trim): its allocator keeps freed blocks of the heap otherwise, and the process would go on
    holding both copies. A no-op elsewhere."""
    try:
        trim = _libc().malloc_trim
    except (OSError, AttributeError):
        return
    trim.argtypes = [ctypes.c_size_t]
    trim(0)
