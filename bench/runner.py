"""The runner: each (model, method, scheme) cell is an independent job described by a CellSpec.

`execute_cell` is a pure function of its spec (it loads the model and data itself and returns rows),
so an executor can run cells anywhere; `run_cells` decides what is missing from the store, hands the cells to an executor (bench/executor.py:
in this process, or in worker processes) and writes each unit of results atomically as it arrives.
"""

from __future__ import annotations

import logging
import math
import random
import shutil
import uuid
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable

import numpy as np
import torch

from bench import data as D
from bench.measure import measure
from bench.models import cache_root, load_model, model_fingerprint
from bench.perplexity import NonFiniteResult, check_finite_perplexity, locate_nonfinite, perplexity
from bench.provenance import git_revision, hardware, versions
from bench.store import SCHEMA_VERSION, ResultStore, Row, unit_key
from lrq.errors import UserError
from lrq.methods import get_method
from lrq.quantize_model import model_bits_per_weight
from lrq.schemes import get_scheme

log = logging.getLogger("lrq_bench")

FP = "fp"  # the method and scheme name of the unquantized reference row


@dataclass(frozen=True)
class CalibSettings:
    dataset: str = "c4"
    n_samples: int = 128
    seq_len: int = 512
    sampling: str = "random"


@dataclass(frozen=True)
class EvalSettings:
    seq_len: int = 2048
    include_partial: bool = False
    max_tokens: int | None = None
    autocast: str = "bf16"


@dataclass
class CellSpec:
    model: str
    method: str
    scheme: str
    datasets: tuple[str, ...] = D.DATASETS
    preset: str = "quick"
    overrides: dict[str, Any] = field(default_factory=dict)
    calib: CalibSettings = field(default_factory=CalibSettings)
    eval: EvalSettings = field(default_factory=EvalSettings)
    seed: int = 0
    data_dir: str | None = None
    tasks: tuple[str, ...] = ()          # lm-eval tasks (bench/tasks.py), one "tasks" unit
    task_limit: int | None = None        # examples per task (None: all)
    device: str = "auto"                 # where to compute: auto (CUDA when present), cpu, cuda[:i]

    @property
    def is_fp(self) -> bool:
        return self.method == FP

    def label(self) -> str:
        return f"{self.model} {self.method} {self.scheme}"

    def method_config(self) -> dict[str, Any]:
        return {} if self.is_fp else get_method(self.method).config(self.preset, self.overrides)

    def uses_calibration(self) -> bool:
        return not self.is_fp and get_method(self.method).needs_calibration(get_scheme(self.scheme))

    def quant_identity(self, data_dir: Path | None) -> dict:
        ident = {"schema": SCHEMA_VERSION, "model": model_fingerprint(self.model), "method": self.method,
                 "scheme": self.scheme, "config": self.method_config(), "seed": self.seed}
        if self.uses_calibration():
            ident["calib"] = asdict(self.calib) | {"data": D.data_fingerprint(self.calib.dataset, data_dir)}
        return ident

    def eval_identity(self, dataset: str, data_dir: Path | None) -> dict:
        return self.quant_identity(data_dir) | {"dataset": dataset, "data": D.data_fingerprint(dataset, data_dir),
                                                "eval": asdict(self.eval)}

    def unit_keys(self) -> dict[str, str]:
        """Store keys of the units this cell produces: 'quant' plus one per dataset."""
        dd = D.resolve_data_dir(self.data_dir)
        keys = {"quant": unit_key(self.quant_identity(dd))}
        keys.update({ds: unit_key(self.eval_identity(ds, dd)) for ds in self.datasets})
        if self.tasks:
            from bench import tasks as T
            keys["tasks"] = unit_key(self.quant_identity(dd) | {
                "tasks": sorted(self.tasks), "limit": self.task_limit, "data": D.data_fingerprint("wikitext2", dd),
                "protocol": {"batch_size": T.BATCH_SIZE, "max_length": T.MAX_LENGTH, "add_bos": T.ADD_BOS}
                | ({"mmlu": f"{T.MMLU_SHOTS}-shot, shots dropped last first"} if "mmlu" in self.tasks else {})})
        return keys


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def _row(spec: CellSpec, dataset: str, metric: str, value, config: dict, wall_s=None, peak=None) -> Row:
    return Row(model=spec.model, method=spec.method, scheme=spec.scheme, dataset=dataset, metric=metric,
               value=None if value is None else float(value), config=config, seed=spec.seed,
               versions=versions(), git_rev=git_revision(), hardware=hardware(), wall_s=wall_s,
               peak_mem_bytes=peak)


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name.startswith("cuda") and not torch.cuda.is_available():
        raise UserError(f"--device {name}: no CUDA device is visible here (torch {torch.__version__}); use --device cpu.")
    try:
        return torch.device(name)
    except RuntimeError:
        raise UserError(f"unknown device {name!r}: use auto, cpu or cuda[:index].") from None


def place_model(model: torch.nn.Module, device: torch.device, headroom: float = 1.3) -> bool:
    """Move the whole model to `device` if it fits (with headroom for activations); True when it is there.
    A model that does not fit stays on the CPU: block-wise methods then visit the device one block at a time."""
    if device.type == "cpu":
        return True
    need = sum(p.numel() * p.element_size() for p in model.parameters()) * headroom
    free, _ = torch.cuda.mem_get_info(device)
    if need > free:
        log.warning("the model (%.1f GiB) does not fit the free memory of %s (%.1f GiB): it stays on the CPU and "
                    "block-wise methods move one block at a time to the device", need / 2**30, device, free / 2**30)
        return False
    model.to(device)
    return True


def quantize_cell(spec: CellSpec):
    """Load the cell's model and quantize it with the cell's method (resumable for block-wise methods).

    Returns (model, tokenizer, base_config, method_stats, measurement or None for FP)."""
    seed_everything(spec.seed)
    data_dir = D.resolve_data_dir(spec.data_dir)
    loaded = load_model(spec.model)
    model, tok = loaded.model, loaded.tokenizer
    base_cfg: dict[str, Any] = {
        "model": spec.model, "model_source": loaded.source, "model_note": loaded.note,
        "method": spec.method, "scheme": spec.scheme, "preset": spec.preset, "seed": spec.seed,
        "method_config": spec.method_config(),
        "scheme_def": None if spec.is_fp else get_scheme(spec.scheme).to_dict(),
    }
    if spec.is_fp:
        place_model(model, resolve_device(spec.device))
        return model, tok, base_cfg, {}, None
    method, scheme = get_method(spec.method), get_scheme(spec.scheme)
    device = resolve_device(spec.device)
    on_device = place_model(model, device)
    method.device = device
    base_cfg["device"] = {"compute": str(device), "whole_model_on_device": on_device}
    if hasattr(method, "checkpoint_dir"):  # block-wise methods checkpoint each block here
        method.checkpoint_dir = checkpoint_dir(spec)
    calib = None
    if method.needs_calibration(scheme):
        calib = D.calibration_set(tok, data_dir, spec.calib.dataset, spec.calib.n_samples, spec.calib.seq_len,
                                  spec.seed, spec.calib.sampling)
        base_cfg["calibration"] = calib.description
    with measure() as qm:
        stats = method.quantize(model, scheme, base_cfg["method_config"], calib) or {}
    base_cfg["method_stats"] = stats
    if not on_device and not place_model(model, device):
        log.warning("evaluating %s on the CPU: the quantized model does not fit %s", spec.label(), device)
    return model, tok, base_cfg, stats, qm


def execute_cell(spec: CellSpec, todo: set[str], emit: Callable[[str, list[Row]], None] | None = None
                 ) -> dict[str, list[Row]]:
    """Quantize and evaluate one cell; return rows per unit for the units named in `todo`.

    `emit(unit, rows)` is called as soon as each unit is complete (the runner stores it right away, so a
    crash in a later evaluation loses nothing already measured)."""
    data_dir = D.resolve_data_dir(spec.data_dir)
    model, tok, base_cfg, stats, qm = quantize_cell(spec)
    out: dict[str, list[Row]] = {}
    if "quant" in todo:
        cfg = dict(base_cfg)
        rows = [_row(spec, "quant", "bits_per_weight", 16.0 if spec.is_fp else model_bits_per_weight(model), cfg)]
        if qm is not None:
            rows += [_row(spec, "quant", "quant_time_s", qm.wall_s, cfg, qm.wall_s, qm.peak_rss_bytes),
                     _row(spec, "quant", "quant_peak_rss_bytes", qm.peak_rss_bytes, cfg, qm.wall_s, qm.peak_rss_bytes)]
            if qm.peak_cuda_bytes is not None:
                rows.append(_row(spec, "quant", "quant_peak_cuda_bytes", qm.peak_cuda_bytes, cfg, qm.wall_s))
            rows += [_row(spec, "quant", k, v, cfg) for k, v in stats.items()
                     if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)]
        out["quant"] = rows
        if emit is not None:
            emit("quant", rows)
    for ds in spec.datasets:
        if ds not in todo:
            continue
        text = D.eval_text(ds, data_dir)
        ids = D.tokenize(tok, text.text)
        caps = [c for c in (D.eval_token_cap(ds), spec.eval.max_tokens) if c]
        if caps:
            ids = ids[:min(caps)]
        with measure() as em:
            res = perplexity(model, ids, spec.eval.seq_len, spec.eval.include_partial,
                             autocast=spec.eval.autocast == "bf16", desc=f"{spec.method} {spec.scheme} {ds}")
        check_finite_perplexity(model, ids, res, ds, spec.eval.seq_len, spec.eval.include_partial)
        cfg = base_cfg | {"eval": asdict(spec.eval) | {"source": text.source, "windows": res["windows"],
                                                       "tokens": res["tokens"]}}
        out[ds] = [_row(spec, ds, "ppl", res["ppl"], cfg, em.wall_s, em.peak_rss_bytes),
                   _row(spec, ds, "eval_tokens_per_s", res["tokens"] / em.wall_s, cfg, em.wall_s, em.peak_rss_bytes)]
        if emit is not None:
            emit(ds, out[ds])
    if "tasks" in todo and spec.tasks:
        from bench import tasks as T
        if data_dir is None:
            raise UserError("task accuracy reads the data folder: pass --data-dir (or set LRQ_BENCH_DATA).")
        _check_finite_logits(model, tok)
        with measure() as tm:
            res = T.evaluate_tasks(model, tok, list(spec.tasks), data_dir, spec.task_limit)
        cfg = base_cfg | {"tasks": {"names": list(spec.tasks), "limit": spec.task_limit, "batch_size": T.BATCH_SIZE,
                                    "max_length": T.MAX_LENGTH, "add_bos_token": T.ADD_BOS,
                                    "main_metric": T.MAIN_METRIC}
                          | ({"mmlu_protocol": f"{T.MMLU_SHOTS}-shot from the dev split, shots dropped last first "
                                               f"while the prompt exceeds {T.MAX_LENGTH} tokens; limit = questions "
                                               f"per subject"} if "mmlu" in spec.tasks else {})}
        rows = []
        for task, metrics in res.items():
            for metric, value in metrics.items():
                if metric != "n" and value is not None:
                    rows.append(_row(spec, task, metric, value, cfg | {"n_examples": metrics.get("n")},
                                     tm.wall_s, tm.peak_rss_bytes))
        out["tasks"] = rows
        if emit is not None:
            emit("tasks", rows)
    return out


@torch.no_grad()
def _check_finite_logits(model: torch.nn.Module, tok) -> None:
    """Accuracy from non-finite logits is meaningless: one probe forward first, failing with a location."""
    ids = D.tokenize(tok, "The quick brown fox jumps over the lazy dog. " * 4)[:32]
    device = next(model.parameters()).device
    logits = model(input_ids=ids.to(device).unsqueeze(0), use_cache=False).logits
    if not torch.isfinite(logits).all():
        raise NonFiniteResult(f"the model's logits are not finite, so task accuracy would be meaningless; the "
                              f"first non-finite value: {locate_nonfinite(model, ids)}. Nothing was stored for "
                              f"the task unit.")


def checkpoint_dir(spec: CellSpec) -> Path:
    """Where a cell's resumable quantization state lives; keyed by everything that determines it."""
    return cache_root() / "checkpoints" / unit_key(spec.quant_identity(D.resolve_data_dir(spec.data_dir)))[:24]


def resolve_calib(method: str, preset: str, given: dict[str, Any]) -> CalibSettings:
    """Calibration settings: what the user gave, else the method's preset defaults, else the suite's."""
    base = {} if method == FP else dict(getattr(get_method(method), "calib_defaults", {}).get(preset, {}))
    base.update({k: v for k, v in given.items() if v is not None})
    return CalibSettings(**base)


@dataclass
class CellOutcome:
    spec: CellSpec
    status: str            # "reused", "done" or "failed"
    error: str = ""
    wall_s: float = 0.0


class _StoreSink:
    """Writes each unit to the store the moment it arrives, and collects the outcomes."""

    def __init__(self, store: ResultStore, run_id: str):
        self.store, self.run_id = store, run_id
        self.outcomes: dict[int, CellOutcome] = {}

    def unit(self, job, unit: str, rows: list[Row]) -> None:
        self.store.write_unit(rows, job.keys[unit], self.run_id)

    def done(self, job, wall_s: float) -> None:
        if not job.spec.is_fp:
            shutil.rmtree(checkpoint_dir(job.spec), ignore_errors=True)  # results are safe: drop the resume state
        self.outcomes[job.index] = CellOutcome(job.spec, "done", wall_s=wall_s)

    def failed(self, job, error: str) -> None:
        self.outcomes[job.index] = CellOutcome(job.spec, "failed", error)


def run_cells(specs: list[CellSpec], store: ResultStore, force: bool = False, executor=None) -> list[CellOutcome]:
    """Run every cell not already in the store (on `executor`, default: in this process, one by one);
    a failing cell is reported and the others go on. Returns one outcome per spec, in order."""
    from bench.executor import Job, LocalExecutor
    executor = executor or LocalExecutor(jobs=1)
    sink = _StoreSink(store, uuid.uuid4().hex[:12])
    jobs = []
    for i, spec in enumerate(specs):
        keys = spec.unit_keys()
        todo = frozenset(u for u, k in keys.items() if force or not store.has_unit(k))
        if todo:
            jobs.append(Job(i, spec, todo, keys))
        else:
            sink.outcomes[i] = CellOutcome(spec, "reused")
    executor.run(sorted(jobs, key=lambda j: -cost_rank(j.spec)), sink)
    return [sink.outcomes[i] for i in range(len(specs))]


def cost_rank(spec: CellSpec) -> int:
    """A coarse order of cell cost, so that parallel workers start the longest cells first (the sweep's
    wall time is then close to total work / workers instead of ending on one long straggler)."""
    if spec.is_fp:
        return 0
    method = get_method(spec.method)
    rank = getattr(method, "cost_rank", 1)
    return rank + (1 if spec.uses_calibration() else 0)
