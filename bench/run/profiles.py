"""Run profiles: named bundles of `lrq-bench run` defaults, each sized for a purpose.

Every explicit option overrides its profile's value, and every setting ends up in each stored row's
configuration (calibration size, evaluation slice, task limit, method settings), so numbers from
different profiles are never mixed up: they are different cells of the store.

- `sweep` (the default): every registered method under the six standard schemes on the default model,
  perplexity on the first 16,384 tokens of WikiText-2 and of C4 (8 windows of 2048 each, so a
  perplexity's 95 % interval rests on 7 degrees of freedom), the paper's seven zero-shot tasks on
  10 examples each (shown with their intervals, never ranked at that size), calibration 32 x 512 C4 tokens (8 held out), the quick preset with 20 training steps
  per block for the block-wise methods (LRQ, FlexRound, OmniQuant; their block errors on 8 windows), two
  worker processes on a CPU. Sized to finish within 2 hours on 2 CPU cores: it is the whole picture at a glance, the question a new user
  asks first ("which methods are worth a closer look at my bit width?").
- `first-look`: RTN only, same evaluation slice: a smoke test of the installation, model and data
  within 10 minutes.
- `full`: publication settings: whole evaluation texts (WikiText-2 test, C4 256 x 2048), 128 x 512
  calibration, the quick preset as defined by each method (100 steps per block), all tasks (seven
  zero-shot, LAMBADA, MMLU 5-shot) without a limit, one process. Many hours on a CPU; meant for a GPU.

Why the sweep differs from `full` (measured on the default model, one thread per process, 3 processes on
2 cores): a training step of one block costs about 0.43 s, so the quick preset's 100 steps x 30 blocks
are about 22 minutes per LRQ-family cell (18 such cells); the calibration chain and block errors on 32
windows add about 4 minutes; 8,192 tokens of perplexity take 24 s (so 16,384 take about 48 s) and the
seven zero-shot tasks on 10 examples each 56 s. A full WikiText-2 + C4 evaluation is about 15 minutes per cell for 43 cells. The
sweep keeps every method and scheme and cuts the sample sizes instead; its figures carry those sizes.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any

from lrq.errors import UserError


@dataclass(frozen=True)
class Profile:
    name: str
    methods: str | None = None            # None: every registered method
    schemes: str | None = None            # None: the six standard schemes
    datasets: str = "wikitext2,c4"
    max_eval_tokens: int | None = None    # None: the whole evaluation text
    calib_samples: int | None = None      # None: the method's preset default (128; paper preset 512)
    tasks: str = ""
    task_limit: int | None = None
    jobs: str = "auto"                    # "auto": 2 workers on a CPU machine with >= 2 cores, else 1
    method_settings: dict[str, Any] = field(default_factory=dict)  # --set defaults (a method ignores keys it lacks)

    def for_preset(self, preset: str) -> "Profile":
        """The profile as it applies under `preset`. A profile sizes the quick preset (its calibration windows
        and training steps); a preset chosen explicitly (long, paper) keeps its own, or `--preset long` would
        silently train 20 steps on 32 windows under the default sweep profile. Its evaluation settings
        (texts, slice, tasks) and workers apply under every preset."""
        if preset == "quick":
            return self
        return replace(self, calib_samples=None, method_settings={})


PROFILES: dict[str, Profile] = {
    "sweep": Profile("sweep", max_eval_tokens=16384, calib_samples=32, tasks="zeroshot", task_limit=10,
                     method_settings={"iters": 20, "heldout_samples": 8, "error_samples": 8}),
    "first-look": Profile("first-look", methods="rtn", max_eval_tokens=16384, calib_samples=32, tasks="zeroshot",
                          task_limit=10),
    "full": Profile("full", tasks="all", jobs="1"),
}
DEFAULT_PROFILE = "sweep"


def get_profile(name: str) -> Profile:
    if name not in PROFILES:
        raise UserError(f"unknown profile {name!r}: choose from {', '.join(PROFILES)}.")
    return PROFILES[name]


def resolve_jobs(value: str | int) -> int:
    """'auto': one process per CUDA device's worth of work (1) on a GPU machine; two single-threaded
    workers on a CPU machine with at least two cores (a 135M model does not keep two cores busy from one
    process); an integer is taken as given."""
    if str(value) != "auto":
        try:
            n = int(value)
        except ValueError:
            raise UserError(f"--jobs must be a positive integer or 'auto', got {value!r}.") from None
        if n < 1:
            raise UserError(f"--jobs must be a positive integer or 'auto', got {value!r}.")
        return n
    import torch

    from bench.run.executor import available_cpus
    if torch.cuda.is_available():
        return 1
    return 2 if available_cpus() >= 2 else 1
