"""Sweep planning: estimated time and memory of every cell, from a model's shape alone (no weights).

Cost model. Each method's work is written as FLOPs of a few kinds, from its algorithm and settings
(`cell_work`): block forward passes over the calibration set (the block-wise walk), reconstruction
training steps (LRQ, FlexRound, OmniQuant), GPTQ's Hessians and column updates, AWQ's scale and clipping
grids, whole-model forward passes (static activation ranges, SmoothQuant statistics, perplexity, tasks).
Each kind costs `per_call_s x calls + flops / flops_per_s` on this machine: both numbers are *measured*
(`measure_profile`) by running the real methods on random two-block Llama models of two widths and
solving for the per-block overhead and the rate. Estimates scale those measurements by each target
model's shapes. The profile is cached per machine (hardware + torch version) in the lrq-bench cache.

Memory model (`estimate_memory`): host = the resident memory of a worker process before it loads a model
(Python, torch, transformers and the methods imported: measured once per machine, `process_baseline_bytes`)
+ the weights as loaded (fp32) + the calibration activation streams that stay in RAM (three [n, seq, hidden] fp32 buffers within LRQ_RAM_BUDGET_GB, the rest on
disk) + one block's training state; device (CUDA) = one block at a time (offloaded walk) with its
learnables and Adam state plus one batch of activations, or the whole model when it is not offloaded.

Where things live: model shapes in `bench.run.shapes`, the machine profile in `bench.run.profile`, the probes
measured at a cell's own shape (long training, the calibration walk, evaluation windows) in `bench.run.probes`;
this module prices cells from them and keeps the memory model. The names a caller needs are importable from here.

What it does not model: process start-up and model loading, lm-eval's set-up, contention with other
processes. Expect the order of magnitude and the ranking of cells, not minutes.
"""

from __future__ import annotations

import functools
import json
import os
from dataclasses import asdict, dataclass, field
from typing import Any

import torch

from lrq.errors import UserError

from bench.run.probes import _probe_cache, measured_eval, measured_training, measured_walk
# the planner's API, said where it lives (bench.run.shapes, bench.run.profile) and importable from here
from bench.run.profile import busy_note, load_note, load_or_measure_profile, measure_profile, profile_path  # noqa: F401
from bench.run.shapes import KNOWN_BLOCKS, SHAPES, ModelShape, load_shape, shape_from_config  # noqa: F401


# ---- the work of one cell --------------------------------------------------------------------------------

@dataclass
class CellPlan:
    method: str
    scheme: str
    work: dict[str, tuple[float, float]]   # kind -> (calls, flops)
    seconds: float = 0.0
    host_bytes: int = 0
    device_bytes: int = 0
    stages: dict[str, float] | None = None   # seconds per stage as a run stores them ("quant", each text, "tasks")


def task_requests(task: str, task_limit: int | None) -> tuple[int, int]:
    """(model forwards, tokens per forward) of a task: the catalogue's (bench.evaluations.evals)."""
    from bench.evaluations.evals import task_requests as requests
    return requests(task, task_limit)


def stage_work(shape: ModelShape, method, scheme, cfg: dict, n: int, seq: int, eval_tokens: dict[str, int],
               eval_seq: int, tasks: list[str], task_limit: int | None, measure: bool = False
               ) -> dict[str, dict[str, tuple[float, float]]]:
    """(calls, flops) per kind of work, per stage of one cell as it runs: "quant" (the method's own work,
    `Method.work`; nothing for the FP reference), one stage per perplexity dataset, and "tasks". `measure`: the
    estimate is for this machine's CPU, where a compiled training step and a text window are measured at the
    cell's shape (`measured_training`, `measured_eval`)."""
    from lrq.methods import add_work
    stages: dict[str, dict[str, tuple[float, float]]] = {
        "quant": {} if method is None else dict(method.work(shape, scheme, cfg, n, seq))}
    L = shape.layers
    if method is not None and measure:
        measured_training(stages["quant"], shape, method, scheme, cfg, seq)
        measured_walk(stages["quant"], shape, method, scheme, cfg, n, seq)
    probe = measured_eval(shape, eval_seq) if measure and (eval_tokens or tasks) else None
    for ds, tokens in eval_tokens.items():
        windows = max(1, tokens // eval_seq)
        if probe:
            stages[ds] = {f"probe:{probe}:win_block": (float(windows * L), 0.0),
                          f"probe:{probe}:win_rest": (float(windows), 0.0)}
        else:
            stages[ds] = add_work({}, "fwd", windows * L, shape.model_fwd_flops(windows * eval_seq, eval_seq))
    if tasks:
        w: dict[str, tuple[float, float]] = {}
        for t in tasks:
            calls, toks = task_requests(t, task_limit)
            if probe:   # the measured window's cost per token (its float32 head and NLL dominate short requests)
                add_work(w, "fwd", calls * L, 0.0)                         # per-call overhead, from the profile
                add_work(w, f"probe:{probe}:win_block", calls * toks / eval_seq * L, 0.0)
                add_work(w, f"probe:{probe}:win_rest", calls * toks / eval_seq, 0.0)
            else:
                add_work(w, "fwd", calls * L, calls * shape.model_fwd_flops(toks, toks))
        stages["tasks"] = w
    return stages


def cell_work(shape: ModelShape, method, scheme, cfg: dict, n: int, seq: int, eval_tokens: dict[str, int],
              eval_seq: int, tasks: list[str], task_limit: int | None, measure: bool = False
              ) -> dict[str, tuple[float, float]]:
    """(calls, flops) per kind of work for one cell: every stage of `stage_work` together."""
    from lrq.methods import add_work
    w: dict[str, tuple[float, float]] = {}
    for stage in stage_work(shape, method, scheme, cfg, n, seq, eval_tokens, eval_seq, tasks, task_limit,
                            measure).values():
        for kind, (calls, flops) in stage.items():
            add_work(w, kind, calls, flops)
    return w


def estimate_memory(shape: ModelShape, method, n: int, seq: int, device: str = "cpu", offload: bool = True,
                    ram_budget: int | None = None, baseline: int | None = None) -> tuple[int, int]:
    """(host bytes, device bytes) at the peak of a cell; device bytes are 0 on a CPU-only run. `baseline`: the
    process's own resident memory before it loads the model (default: this machine's, measured)."""
    if ram_budget is None:
        ram_budget = int(os.environ.get("LRQ_RAM_BUDGET_GB", "6")) * 2**30
    m = method   # a Method (instance or class): what it declares about its memory
    weights = 4 * shape.params()
    block = 4 * (shape.block_params() + 2 * shape.hidden)
    stream = n * seq * shape.hidden * 4
    streams = 3 * stream if m.blockwise else 0
    acts_ram = streams if streams <= ram_budget else 0      # otherwise memory-mapped from disk
    # training state of one block: learnables + Adam's two moments + gradients (a full matrix per weight: 1.0)
    train = 4 * m.learnable_fraction * block
    gptq = (m() if isinstance(m, type) else m).extra_memory(shape, n * seq)
    batch_acts = 16 * seq * max(shape.hidden, shape.intermediate) * 4 * 8   # one batch of 8 windows through a block
    if baseline is None:
        baseline = process_baseline_bytes()
    host = baseline + weights + acts_ram + train + gptq + batch_acts
    if device == "cpu":
        return int(host), 0
    dev = (block if offload else weights) + train + gptq + batch_acts
    return int(host), int(dev)


#: the process baseline where it cannot be measured (a 2-core Zen 4, torch 2.13, transformers 5.24: 0.44 GiB)
BASELINE_FALLBACK = 512 * 2**20
BASELINE_FILE = "process-baseline.json"
#: the cache files that hold this machine's measurements (the planner's profiles and the process baseline): a
#: fresh cache given copies of them does not measure the machine again
MEASUREMENT_FILES = ("plan-profile-*.json", BASELINE_FILE)


@functools.cache
def process_baseline_bytes() -> int:
    """Resident memory of a fresh Python process that has imported what a cell runs (torch, transformers, the
    methods and the cell runner), before it loads a model: the floor under every cell's peak, about 0.45 GiB
    with torch 2.13 on x86, which the estimate left out (it was low by 1.8-2.6x on the default model's cells).
    Measured once per machine and package versions in a subprocess, and cached."""
    import platform
    import subprocess
    import sys
    from importlib.metadata import version

    from bench.common.cache import cache_root
    key = "-".join([platform.machine(), platform.python_version(), torch.__version__, version("transformers")])
    path = cache_root() / BASELINE_FILE
    try:
        known = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        known = {}
    if isinstance(known, dict) and isinstance(known.get(key), int):
        return known[key]
    # a model class, as a cell imports one to load its model: transformers' modelling code is half the figure
    code = ("import psutil, torch, transformers, lrq.methods, bench.run.cell\n"
            "from transformers import LlamaForCausalLM\n"
            "lrq.methods.load_methods()\n"
            "print(psutil.Process().memory_info().rss)")
    try:
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, check=True)
        rss = int(out.stdout.strip().splitlines()[-1])
    except (OSError, subprocess.SubprocessError, ValueError, IndexError):
        return BASELINE_FALLBACK
    from lrq.io import atomic_write_text
    try:
        atomic_write_text(path, json.dumps((known if isinstance(known, dict) else {}) | {key: rss}, indent=1))
    except OSError:
        pass   # a read-only cache: measured again next time
    return rss


def seconds(work: dict[str, tuple[float, float]], profile: dict) -> float:
    total = 0.0
    probes = None
    for kind, (calls, flops) in work.items():
        if kind.startswith("probe:"):
            if probes is None:
                probes = json.loads(_probe_cache().read_text())
            _, digest, part = kind.split(":")
            total += calls * probes[digest][f"{part}_s"]
            continue
        if kind not in profile["kinds"]:
            raise UserError(f"the machine profile has no timing for {kind!r} work (it predates that method): "
                            f"measure it again with `lrq-bench plan --remeasure`.")
        k = profile["kinds"][kind]
        total += k["per_call_s"] * calls + flops / k["flops_per_s"]
    return total


def schedule(durations: list[float], workers: int) -> float:
    """Wall time of independent cells on `workers` devices, longest first onto the least loaded."""
    loads = [0.0] * max(1, workers)
    for d in sorted(durations, reverse=True):
        i = loads.index(min(loads))
        loads[i] += d
    return max(loads)


def plan_cells(shape: ModelShape, methods: list[str], schemes: list[str], profile: dict, *, preset: str = "quick",
               overrides: dict | None = None, n: int = 128, seq: int = 512, eval_tokens: dict[str, int] | None = None,
               eval_seq: int = 2048, tasks: list[str] | None = None, task_limit: int | None = None,
               offload: bool = True, measure: bool = False) -> list[CellPlan]:
    """The planned cells. `measure`: `profile` is this machine's CPU profile, so compiled training steps may be
    measured here at each cell's shape (`measured_training`)."""
    from lrq.methods import get_method
    from lrq.schemes import get_scheme
    out = []
    eval_tokens = eval_tokens or {}
    for name in methods:   # the planned cells, settled once from their names
        method = get_method(name)
        if method.external:
            raise UserError(f"{name} runs another stack in its own environment: the planner has no cost model "
                            f"for it (time one cell instead).")
        cfg = method.config(preset, overrides or {})
        for s in schemes:
            scheme = get_scheme(s)
            work = cell_work(shape, method, scheme, cfg, n, seq, eval_tokens, eval_seq, tasks or [], task_limit,
                             measure and profile.get("device") == "cpu")
            host, dev = estimate_memory(shape, method, n, seq, profile["device"], offload)
            out.append(CellPlan(name, s, work, seconds(work, profile), host, dev))
    return out


def eval_tokens_for(datasets, max_tokens: int | None) -> dict[str, int]:
    """Tokens scored per dataset at `--max-eval-tokens` (None: the whole text, as the catalogue sizes it)."""
    from bench.evaluations.evals import PERPLEXITY
    full = {d: PERPLEXITY[d].full_tokens if d in PERPLEXITY else 300_000 for d in datasets}
    return {d: min(max_tokens or full[d], full[d]) for d in datasets}


@dataclass
class RunEstimate:
    """Seconds per stage of every cell a run will compute (`stages[i]`: cell index -> stage -> seconds), on
    the machine `profile` describes; cells with no cost model (external adapters) are in `unpriced`."""
    stages: dict[int, dict[str, float]]
    unpriced: list[int]
    profile: dict
    host_bytes: dict[int, int] = field(default_factory=dict)   # cell index -> estimated peak host memory
    done_blocks: dict[int, int] = field(default_factory=dict)  # cell index -> blocks already finished, not priced

    def seconds(self, i: int) -> float:
        return sum(self.stages.get(i, {}).values())

    @property
    def total(self) -> float:
        return sum(self.seconds(i) for i in self.stages)

    def wall(self, workers: int) -> float:
        return schedule([self.seconds(i) for i in self.stages], workers)


@dataclass(frozen=True)
class Priced:
    """What one cell of a run will compute, as the estimate prices it (`price`; a cell with any unit missing is
    quantized again, the model is not stored): built from a settled cell and its missing units by `estimate_run`, and from the command line by `plan_specs` (`lrq-bench plan`), so that
    `plan` and `run` price the same cells the same way."""
    label: str
    method: Any                       # the method class, None for the FP reference
    scheme: Any
    config: dict
    n: int
    seq: int
    ppl: tuple[str, ...]              # texts whose perplexity is computed
    kl: tuple[str, ...]               # texts whose KL divergence from FP is computed (same pass as ppl)
    max_tokens: int | None
    eval_seq: int
    tasks: tuple[str, ...] = ()
    task_limit: int | None = None
    measure: bool = False             # this machine's CPU profile: training steps and text passes measured at the
    #                                   cell's own shape (`measured_training`, `measured_eval`)
    cached_refs: tuple[str, ...] = ()  # texts whose FP KL reference is in the cache already: not computed again
    done_blocks: int = 0              # blocks an earlier run finished (a checkpoint): their work is not priced,
    replay: bool = False              # ... only the calibration streams recomputed through them, where `replay`


def price(shape: ModelShape, specs: dict[int, Priced], profile: dict) -> RunEstimate:
    """Seconds per stage of every cell: the method's work, every text's pass (perplexity and KL together: the
    FP logits recomputed from the stored hidden states by the output head, in float32), the tasks, and the FP
    reference pass over a text, once per run, in the stage of the first cell that needs it (bench.evaluations.kl)."""
    from lrq.methods import add_work
    stages: dict[int, dict[str, float]] = {}
    host_bytes: dict[int, int] = {}
    unpriced = []
    references: set[str] = set()
    for i, sp in specs.items():
        if sp.method is not None and sp.method.external:
            unpriced.append(i)
            continue
        datasets = sorted(set(sp.ppl) | set(sp.kl), key=lambda d: (d not in ("wikitext2", "c4"), d))
        tokens = eval_tokens_for(datasets, sp.max_tokens)
        work = stage_work(shape, sp.method, sp.scheme, sp.config, sp.n, sp.seq, tokens, sp.eval_seq,
                          list(sp.tasks), sp.task_limit, measure=sp.measure)
        if sp.done_blocks and sp.method is not None:
            work["quant"] = resumed_work(work["quant"], shape, sp.scheme, sp.n, sp.seq, sp.done_blocks, sp.replay)
        probe = measured_eval(shape, sp.eval_seq) if sp.measure and datasets else None
        for d in sp.kl:   # scoring KL: the FP logits from the float32 head, and the divergence itself
            windows = max(1, tokens[d] // sp.eval_seq)
            if probe:
                add_work(work[d], f"probe:{probe}:win_kl", windows, 0.0)
            else:
                add_work(work[d], "fwd", windows, 2.0 * shape.hidden * shape.vocab * windows * sp.eval_seq)
        new_refs = set(sp.kl) - references - set(sp.cached_refs)
        if new_refs:   # one FP pass over these texts, before the cell quantizes (none where it is cached)
            references |= new_refs
            ref_tokens = eval_tokens_for(sorted(new_refs), sp.max_tokens)
            ref_work = {} if probe else stage_work(shape, None, None, {}, 1, 1, ref_tokens, sp.eval_seq, [], None)
            for d in new_refs:
                if probe:
                    windows = max(1, ref_tokens[d] // sp.eval_seq)
                    add_work(work["quant"], f"probe:{probe}:win_block", windows * shape.layers, 0.0)
                    add_work(work["quant"], f"probe:{probe}:ref_rest", windows, 0.0)
                    continue
                for kind, (calls, flops) in ref_work[d].items():
                    add_work(work["quant"], kind, calls, flops)
        stages[i] = {name: seconds(w, profile) for name, w in work.items()}
        if sp.method is not None:
            host_bytes[i] = estimate_memory(shape, sp.method, sp.n, sp.seq, profile.get("device", "cpu"))[0]
    done = {i: sp.done_blocks for i, sp in specs.items() if sp.done_blocks and i in stages}
    return RunEstimate(stages, unpriced, profile, host_bytes, done)


def resumed_work(work: dict[str, tuple[float, float]], shape: ModelShape, scheme, n: int, seq: int, done: int,
                 replay: bool) -> dict[str, tuple[float, float]]:
    """The quantization's work where `done` of its blocks are finished already (a resumed block-wise cell): the
    per-block work of the blocks left (everything but W8A8's whole-model range pass, which runs after the walk),
    and, where `replay`, the calibration streams recomputed through the finished blocks (one forward of each
    over the n x seq tokens per stream; two streams where the method trains against FP targets)."""
    from lrq.methods import add_work, static_range_work
    left = max(0, shape.layers - done) / shape.layers
    whole = static_range_work(shape, scheme, n, seq)
    out: dict[str, tuple[float, float]] = {}
    for kind, (calls, flops) in work.items():
        wc, wf = whole.get(kind, (0.0, 0.0))
        add_work(out, kind, (calls - wc) * left + wc, (flops - wf) * left + wf)
    if replay:
        streams = 2 if any(k.startswith("train_") or k.endswith(":step") for k in work) else 1   # trains
        add_work(out, "fwd", done * streams, done * streams * shape.block_fwd_flops(n * seq, seq))
    return out


def estimate_run(shape: ModelShape, cells: dict[int, Any], todo: dict[int, set[str]], profile: dict,
                 carry: Any = None) -> RunEstimate:
    """The planner's estimate of a run about to start: for each settled cell (bench.run.cell.Cell) the stages its
    missing units need. A cell with any unit missing is quantized again (the model is not stored), so its
    "quant" stage always counts; a perplexity or task stage only when that unit is missing. Blocks an earlier
    run finished, in the cell's local checkpoint or in `carry`'s folder (bench.run.ledger.Carry, `run --sync`),
    are not priced again (bench.run.ledger.finished_blocks)."""
    from bench.run.ledger import finished_blocks
    specs = {}
    for i, cell in cells.items():
        units = todo.get(i) or set()
        if not units:
            continue
        done, replay = finished_blocks(cell, carry) if "quant" in units and not cell.is_fp else (0, False)
        specs[i] = Priced(
            f"{cell.method_name} {cell.scheme_name}", None if cell.is_fp else cell.method, cell.scheme,
            cell.config, cell.calib.n_samples, cell.calib.seq_len,
            tuple(d for d in cell.datasets if d in units), tuple(d for d in cell.datasets if f"{d}:kl" in units),
            cell.eval.max_tokens, cell.eval.seq_len, tuple(cell.tasks) if "tasks" in units else (), cell.task_limit,
            measure=profile.get("device") == "cpu", cached_refs=_cached_references(cell), done_blocks=done,
            replay=replay)
    return price(shape, specs, profile)


def _cached_references(cell) -> tuple[str, ...]:
    """The texts of `cell` whose FP KL reference (bench.evaluations.kl) is in the cache: loaded, not computed."""
    from bench.evaluations import kl
    from bench.run.cell import kl_reference_key
    return tuple(ds for ds in cell.datasets if kl.reference_path(kl_reference_key(cell, ds)).is_file())


def plan_specs(methods: list[str], schemes: list[str], calib: Any, *, preset: str, overrides: dict,
               datasets: list[str], max_tokens: int | None, eval_seq: int, tasks: list[str], task_limit: int | None,
               fp: bool = True, measure: bool = False) -> dict[int, Priced]:
    """The cells `lrq-bench run` would compute on an empty store with these options, in its order (FP first),
    as `price` takes them. `calib(method) -> (n, seq)`."""
    from lrq.methods import get_method
    from lrq.schemes import get_scheme
    out: list[Priced] = []
    if fp:
        out.append(Priced("fp fp", None, None, {}, 1, 1, tuple(datasets), (), max_tokens, eval_seq, tuple(tasks),
                          task_limit, measure=measure))
    for name in methods:
        method = get_method(name)
        if method.external:
            raise UserError(f"{name} runs another stack in its own environment: the planner has no cost model "
                            f"for it (time one cell instead).")
        cfg = method.config(preset, overrides or {})
        n, seq = calib(name)
        for s in schemes:
            out.append(Priced(f"{name} {s}", method, get_scheme(s), cfg, n, seq, tuple(datasets), tuple(datasets),
                              max_tokens, eval_seq, tuple(tasks), task_limit, measure=measure))
    return dict(enumerate(out))


def check_fits(shape: ModelShape, method, n: int, seq: int, device: str, host_available: int,
               device_available: int | None = None, offload: bool = True, jobs: int = 1) -> None:
    """Refuse, before any work, a cell whose estimated peak memory exceeds what is available: the host's
    memory shared by `jobs` cells at once (--jobs), the first way out named where fewer would fit."""
    host, dev = estimate_memory(shape, method, n, seq, device, offload)
    gib = 2**30
    problems, hints = [], []
    share = host_available // jobs
    if host > share:
        problems.append(f"about {host / gib:.1f} GiB of host memory, {share / gib:.1f} GiB available"
                        + (f" to each of the --jobs {jobs} cells run at once ({host_available / gib:.1f} GiB in "
                           f"all)" if jobs > 1 else ""))
        if jobs > 1 and host <= host_available:
            hints.append(f"fewer cells at once (--jobs {host_available // host} fits)")
    if device_available is not None and dev > device_available:
        problems.append(f"about {dev / gib:.1f} GiB of device memory, {device_available / gib:.1f} GiB available")
    if not problems:
        return
    fits = [k for k in (n // 2, n // 4, n // 8) if k >= 2 and estimate_memory(shape, method, k, seq, device, offload)[0]
            <= share]
    if fits:
        hints.append(f"fewer calibration samples (--calib-samples {fits[0]} fits)")
    hints.append("shorter calibration sequences (--calib-seq-len)")
    hints.append("calibration activations on disk (a smaller LRQ_RAM_BUDGET_GB)")
    if device != "cpu" and not offload:
        hints.append("block-by-block offloading")
    raise UserError(f"{shape.name} {method.name} with {n} x {seq} calibration tokens needs {' and '.join(problems)}. "
                    f"What would fit: {'; '.join(hints)}.")


def host_memory_available() -> int:
    """Bytes of host memory available now (LRQ_BENCH_HOST_MEMORY_GB declares a smaller limit)."""
    import psutil
    avail = psutil.virtual_memory().available
    limit = os.environ.get("LRQ_BENCH_HOST_MEMORY_GB")
    return min(avail, int(float(limit) * 2**30)) if limit else avail


def as_rows(plans: list[CellPlan]) -> list[dict]:
    return [{"method": p.method, "scheme": p.scheme, "hours": p.seconds / 3600, "seconds": p.seconds,
             "host_gib": p.host_bytes / 2**30, "device_gib": p.device_bytes / 2**30}
            | ({"stages": p.stages} if p.stages is not None else {}) for p in plans]


def describe(shape: ModelShape) -> dict:
    return asdict(shape) | {"params": shape.params()}


def fmt_duration(s: float) -> str:
    """'2 h 31 min', '12 min', '45 s'."""
    if s < 90:
        return f"{s:.0f} s"
    m = round(s / 60)
    return f"{m} min" if m < 60 else f"{m // 60} h {m % 60} min"


def fmt_hours(s: float) -> str:
    return f"{s / 3600:.2f} h" if s >= 360 else f"{s:.0f} s" if s < 600 else f"{s / 60:.0f} min"


__all__ = ["ModelShape", "SHAPES", "load_shape", "plan_cells", "estimate_memory", "check_fits", "measure_profile",
           "load_or_measure_profile", "schedule", "seconds"]
