"""Where lrq-bench keeps what it can recompute: converted models, file hashes, checkpoints, profiles, logs."""

from __future__ import annotations

import os
from pathlib import Path


def cache_root() -> Path:
    """$LRQ_BENCH_CACHE, else ~/.cache/lrq-bench."""
    root = os.environ.get("LRQ_BENCH_CACHE")
    return Path(root) if root else Path.home() / ".cache" / "lrq-bench"
