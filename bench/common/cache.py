"""Where lrq-bench keeps what it can recompute: converted models, file hashes, checkpoints, profiles, logs."""

from __future__ import annotations

from lrq.io import cache_root  # noqa: F401 (the folder's rule, said in lrq: the kernels' dispatch table uses it too)
