"""Where lrq-bench keeps what it can recompute: converted models, file hashes, checkpoints, profiles, logs."""

from __future__ import annotations

import os
from pathlib import Path


def cache_root() -> Path:
    """$LRQ_BENCH_CACHE (a leading ~ is the home folder, as in a shell), else ~/.cache/lrq-bench."""
    root = os.environ.get("LRQ_BENCH_CACHE")
    return Path(root).expanduser() if root else Path.home() / ".cache" / "lrq-bench"
