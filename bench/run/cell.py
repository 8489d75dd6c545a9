"""One cell: a request settled into an immutable record, and running it.

A `Request` is what a user asks for (model, method, scheme, preset, --set overrides, calibration and
evaluation settings, tasks, seed, device). `settle(request)` resolves it once, in the driver, into a
frozen `Cell`: the method instance (configured with its device and checkpoint folder), the scheme, the
declared settings and the resolved ones (every `auto` decided for the scheme), the calibration settings
(the method's preset defaults filled in), the fingerprints of the model and of every data file, the
task protocol, the store key of every unit and the checkpoint folder. Nothing downstream looks a name up
again or sets an attribute on a method: the executors ship the Cell, `execute` runs it, the store keys
and the rows' configurations come from it.

The store keys are unchanged from earlier releases (the identity hashes the *declared* settings: the
resolved ones are a deterministic function of them, the scheme and the model), so a results store made
before still resumes. A method's execution settings (`Method.execution_settings`, e.g. torch.compile of
the block step) are recorded in the rows but not hashed: they change how a cell runs, not what it computes.
"""

from __future__ import annotations

import logging
import math
import random
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any, Callable

import numpy as np
import torch

import lrq
from lrq import precision, progress
from lrq.precision import Precision
from bench.evaluations import data as D
from bench.evaluations.evals import PERPLEXITY
from lrq.measure import measure
from bench.common.cache import cache_root
from bench.common.models import load_model, model_fingerprint
from bench.evaluations.perplexity import VERSION as PPL_VERSION
from bench.evaluations.perplexity import NonFiniteResult, check_finite_perplexity, locate_nonfinite, perplexity
from bench.common.provenance import git_revision, hardware, versions
from bench.common.store import SCHEMA_VERSION, Row, unit_key
from lrq.errors import UserError
from lrq.methods import Method, method_class, method_of_row
from lrq.quantize_model import model_bits_per_weight
from lrq.schemes import Scheme, get_scheme

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
    """How perplexity is measured. `autocast` records the evaluation's compute precision in the unit keys,
    "bf16" (bf16 autocast over float32 weights) or "fp32" (the name is kept so that the store keys of bf16
    results made before the precision became a choice are unchanged): `settle` fills it in from the cell's
    `Precision`, which is what the evaluation computes at; nothing reads this field to decide it."""
    seq_len: int = 2048
    include_partial: bool = False
    max_tokens: int | None = None
    autocast: str = "bf16"
    head: str = "fp32"        # the output head's precision where logits are scored (lrq.precision.HEAD_PRECISION)
    bos: bool = False         # every window starts with the model's BOS (the model's protocol: `settle` decides)

    def key(self) -> dict:
        """The settings as unit keys hold them: `bos` only where it is set, so the keys of models without BOS
        (every result stored before the protocol was recorded) are unchanged."""
        d = asdict(self)
        if not d["bos"]:
            del d["bos"]
        return d


@dataclass(frozen=True)
class Request:
    """What to run, as asked: names and options. `calib` None: the method's preset defaults."""
    model: str
    method: str
    scheme: str
    datasets: tuple[str, ...] = tuple(PERPLEXITY)
    preset: str = "quick"
    overrides: dict[str, Any] = field(default_factory=dict)
    calib: CalibSettings | None = None
    eval: EvalSettings = field(default_factory=EvalSettings)
    seed: int = 0
    data_dir: str | None = None
    tasks: tuple[str, ...] = ()          # lm-eval tasks (bench/evaluations/tasks.py), one "tasks" unit
    task_limit: int | None = None        # examples per task (None: all)
    device: str = "auto"                 # where to compute: auto (CUDA when present), cpu, cuda[:i]
    precision: str = "auto"              # compute precision of every forward: auto, bf16, fp32 (lrq.precision)


@dataclass(frozen=True)
class Cell:
    """A settled request (see the module docstring). Immutable: built once by `settle`."""
    model: str
    model_id: str                        # the model's content identity (bench.common.models.model_fingerprint)
    method_name: str
    method: Method | None                # the configured instance; None for the FP reference
    scheme_name: str
    scheme: Scheme | None                # None for the FP reference
    preset: str
    config: Mapping[str, Any]            # declared settings (the preset + overrides, parsed: lrq.config): the key's
    resolved: Mapping[str, Any]          # the same with every 'auto' decided for the scheme
    calib: CalibSettings
    uses_calibration: bool
    datasets: tuple[str, ...]
    eval: EvalSettings
    tasks: tuple[str, ...]
    task_limit: int | None
    seed: int
    data_dir: str | None                 # the resolved data folder (None: the hub)
    device: str                          # the compute device ("auto" only where a remote worker decides)
    data: dict[str, str]                 # dataset -> fingerprint of its text
    calib_data: str | None               # fingerprint of the calibration text
    identity: dict[str, Any]             # what the quantization unit's key hashes
    keys: dict[str, str]                 # unit -> store key
    checkpoint_dir: str | None           # where a resumable method keeps its per-block state
    precision: Precision                 # what this cell computes at, decided once (lrq.precision)
    identities: dict[str, dict] = field(default_factory=dict)   # unit -> the identity its key hashes

    @property
    def is_fp(self) -> bool:
        return self.method is None

    def label(self) -> str:
        return f"{self.model} {self.method_name} {self.scheme_name}"

    def compute_device(self) -> torch.device:
        return resolve_device(self.device)

    def bound_method(self) -> Method:
        """The cell's method, bound to the device this process computes on when the cell left it open."""
        if self.device != "auto":
            return self.method
        return type(self.method)(device=self.compute_device(), checkpoint_dir=self.checkpoint_dir)


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name.startswith("cuda") and not torch.cuda.is_available():
        raise UserError(f"--device {name}: no CUDA device is visible here (torch {torch.__version__}); use --device cpu.")
    try:
        return torch.device(name)
    except RuntimeError:
        raise UserError(f"unknown device {name!r}: use auto, cpu or cuda[:index].") from None


def resolve_calib(method: str, preset: str, given: dict[str, Any]) -> CalibSettings:
    """Calibration settings: what the user gave, else the method's preset defaults, else the suite's."""
    from lrq.methods import PRESET_CALIB
    base = {} if method == FP else dict(method_class(method).calib_defaults.get(preset, PRESET_CALIB.get(preset, {})))
    base.update({k: v for k, v in given.items() if v is not None})
    return CalibSettings(**base)


def eval_versions() -> dict[str, int]:
    """The version of each evaluation's code (perplexity, KL divergence, tasks), as every row records it."""
    from bench.evaluations import tasks as T
    from bench.evaluations.kl import SCHEMA
    return {"perplexity": PPL_VERSION, "kl": SCHEMA, "tasks": T.VERSION}


def _task_protocol(tasks: tuple[str, ...], bos: bool = False) -> dict:
    from bench.evaluations import tasks as T
    from lrq.precision import HEAD_PRECISION
    return ({"batch_size": T.BATCH_SIZE, "max_length": T.MAX_LENGTH, "add_bos": T.ADD_BOS or bos, "head": HEAD_PRECISION}
            | ({"mmlu": f"{T.MMLU_SHOTS}-shot, shots dropped last first"} if "mmlu" in tasks else {})
            | ({"version": T.VERSION} if T.VERSION != 1 else {}))


def settle(req: Request, bind_device: bool = True) -> Cell:
    """Resolve a request once: names to objects, defaults to values, data to fingerprints, units to keys.
    `bind_device=False` leaves "auto" to the worker that runs the cell (a remote executor's node)."""
    is_fp = req.method.strip().lower() == FP
    cls = None if is_fp else method_class(req.method)
    method_name = FP if is_fp else cls.name
    scheme = None if is_fp else get_scheme(req.scheme)
    scheme_name = FP if is_fp else scheme.name
    probe = None if is_fp else cls()
    config = {} if is_fp else probe.config(req.preset, req.overrides)
    if not is_fp:
        method_name = probe.display_name(config)   # a checkpoint read as it is: named after the checkpoint
    resolved = {} if is_fp else probe.resolve(scheme, config)
    calib = req.calib or resolve_calib(method_name, req.preset, {})
    uses_calibration = not is_fp and probe.needs_calibration(scheme)
    if uses_calibration:
        probe.check_calibration(resolved, calib.n_samples, calib.seq_len)
    data_dir = D.resolve_data_dir(req.data_dir)
    device = str(resolve_device(req.device)) if (bind_device or req.device != "auto") else "auto"
    # 'auto' is decided for the device the cell computes on (an unbound remote device: as this machine would)
    prec_device = None if device == "auto" else device
    decided = Precision.decide(req.precision, prec_device)
    prec = decided.used
    from bench.common.models import model_bos
    ev = replace(req.eval, autocast=prec, bos=model_bos(req.model))
    # execution settings (torch.compile, ...) change how the cell runs, not what it computes: not in the key
    ident: dict[str, Any] = {"schema": SCHEMA_VERSION, "model": model_fingerprint(req.model), "method": method_name,
                             "scheme": scheme_name, "config": {} if is_fp else cls.keyed_settings(config),
                             "seed": req.seed}
    if not is_fp and cls.version != 1:   # version 1: what every result stored before versions existed computed
        ident["method_version"] = cls.version
    if prec != "bf16":   # bf16 was the only precision before it became a choice: those keys stay as they were
        ident["precision"] = prec
    calib_data = None
    if uses_calibration:
        calib_data = D.data_fingerprint(calib.dataset, data_dir)
        ident["calib"] = asdict(calib) | {"data": calib_data} | ({"bos": True} if ev.bos else {})
    data = {ds: D.data_fingerprint(ds, data_dir) for ds in req.datasets}
    identities = unit_identities(ident, req.datasets, data, ev, is_fp)
    if req.tasks:
        identities["tasks"] = tasks_identity(ident, req.tasks, req.task_limit, data_dir, ev.bos, prec)
    keys = {u: unit_key(i) for u, i in identities.items()}
    ckpt = None if is_fp or not cls.checkpoints else str(cache_root() / "checkpoints" / keys["quant"][:24])
    method = None if is_fp else cls(device=None if device == "auto" else device, checkpoint_dir=ckpt)
    return Cell(model=req.model, model_id=ident["model"], method_name=method_name, method=method,
                scheme_name=scheme_name, scheme=scheme, preset=req.preset, config=config, resolved=resolved,
                calib=calib, uses_calibration=uses_calibration, datasets=tuple(req.datasets), eval=ev,
                tasks=tuple(req.tasks), task_limit=req.task_limit, seed=req.seed,
                data_dir=None if data_dir is None else str(data_dir), device=device, data=data,
                calib_data=calib_data, identity=ident, keys=keys, checkpoint_dir=ckpt, precision=decided,
                identities=identities)


def unit_identities(ident: dict, datasets, data: dict[str, str], ev: EvalSettings, is_fp: bool) -> dict[str, dict]:
    """Unit -> the identity its store key hashes: the cell's (`ident`) for its quantization, with the text, its
    fingerprint and the evaluation settings for a text's perplexity and (quantized cells) its KL divergence."""
    out = {"quant": ident}
    out.update({ds: ident | {"dataset": ds, "data": data[ds], "eval": ev.key()}
                | ({"eval_version": PPL_VERSION} if PPL_VERSION != 1 else {}) for ds in datasets})
    if not is_fp:   # the KL divergence from the FP model on the same windows, a unit of its own
        from bench.evaluations.kl import APPROXIMATION, SCHEMA
        out.update({kl_unit(ds): ident | {"dataset": ds, "data": data[ds], "eval": ev.key(),
                                          "kl": {"schema": SCHEMA, "approximation": APPROXIMATION}}
                    for ds in datasets})
    return out


def tasks_identity(ident: dict, tasks, limit: int | None, data_dir: Path | None, bos: bool, prec: str,
                   legacy: bool = False) -> dict:
    """The tasks unit's identity: the cell's, the tasks and their protocol, and the fingerprint of every file
    the tasks read (`bench.evaluations.tasks.task_data_fingerprint`: an answer key changed in a task file is
    another result). `legacy`: the identity results stored before 2026-12-05 were keyed by, which hashed
    WikiText-2's file in place of the task files (read only to check such a result's key on import)."""
    # before the precision became a choice, task accuracy ran in float32 whatever the cell's precision: the
    # protocol now names it, so those earlier results (a float32 score of a bf16 cell) are not reused
    out = ident | {"tasks": sorted(tasks), "limit": limit,
                   "protocol": _task_protocol(tuple(tasks), bos) | {"precision": prec}}
    if legacy:
        return out | {"data": D.data_fingerprint("wikitext2", data_dir)}
    from bench.evaluations.tasks import task_data_fingerprint
    return out | {"task_data": task_data_fingerprint(sorted(tasks), data_dir)}


def _enough_tokens(tokenizer, text: str, need: int) -> int:
    """Tokens in `text`, counted only as far as deciding whether it holds `need` of them takes (a prefix of
    16 characters per token needed; the whole text when the prefix falls short)."""
    prefix = text[: 16 * (need + 1)]
    n = len(D.tokenize(tokenizer, prefix))
    if n < need + 1 and len(prefix) < len(text):
        n = len(D.tokenize(tokenizer, text))
    return n


def check_sizes(cells: list[Cell], tokenizer) -> None:
    """Every evaluation text holds at least one window, every calibration pool the windows its cells draw:
    checked once in the driver before any work, so a text too small is exit 2 naming the minimum, not a
    failure of every cell after hours of quantization."""
    texts: dict = {}
    counted: dict = {}   # (dataset, data folder, tokens needed) -> tokens counted
    pools: dict = {}     # (calibration dataset, data folder, tokens needed) -> (tokens counted, source)
    for c in cells:
        data_dir = None if c.data_dir is None else Path(c.data_dir)
        for ds in c.datasets:
            need = 2 if c.eval.include_partial else c.eval.seq_len
            window = ("at least 2 tokens (--include-partial scores a partial window)" if c.eval.include_partial
                      else f"one window of --eval-seq-len {c.eval.seq_len} tokens")
            if c.eval.max_tokens is not None and c.eval.max_tokens < need:
                raise UserError(f"--max-eval-tokens {c.eval.max_tokens} is less than {window}: give at least "
                                f"--max-eval-tokens {need} (0: the whole text), or a shorter --eval-seq-len. Nothing "
                                f"was run.")
            if (ds, c.data_dir) not in texts:
                texts[(ds, c.data_dir)] = D.eval_text(ds, data_dir)
            text = texts[(ds, c.data_dir)]
            if (ds, c.data_dir, need) not in counted:
                counted[(ds, c.data_dir, need)] = _enough_tokens(tokenizer, text.text, need)
            n = counted[(ds, c.data_dir, need)]
            if n < need:
                raise UserError(f"the {ds} evaluation text ({text.source}) holds {n} tokens with this model's "
                                f"tokenizer, fewer than {window}: restore the data file (see the data folder's "
                                f"SOURCES.md), or evaluate with --eval-seq-len {max(2, n)} at most. Nothing was run.")
        if c.uses_calibration:
            key = (c.calib.dataset, c.data_dir, c.calib.n_samples * c.calib.seq_len)
            if key not in pools:
                pool = D.calibration_pool(c.calib.dataset, data_dir)
                pools[key] = (_enough_tokens(tokenizer, pool.text, key[2]), pool.source)
            n, source = pools[key]
            if n < key[2]:
                raise UserError(f"the calibration pool ({source}) holds {n} tokens with this model's tokenizer, "
                                f"fewer than the {c.calib.n_samples} x {c.calib.seq_len} = {key[2]} that "
                                f"{c.method_name} {c.scheme_name} draws: use fewer samples (--calib-samples "
                                f"{max(1, n // c.calib.seq_len)} fits at this length) or shorter windows "
                                f"(--calib-seq-len). Nothing was run.")


def without_units(cell: Cell, keep: set[str]) -> Cell:
    """The cell restricted to some units (its keys for the others dropped)."""
    return replace(cell, keys={u: k for u, k in cell.keys.items() if u in keep})


# ---- running one cell ---------------------------------------------------------------------------------

def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def _row(cell: Cell, dataset: str, metric: str, value, config: dict, wall_s=None, peak=None) -> Row:
    return Row(model=cell.model, method=cell.method_name, scheme=cell.scheme_name, dataset=dataset, metric=metric,
               value=None if value is None else float(value), config=config, seed=cell.seed,
               versions=versions(), git_rev=git_revision(), hardware=hardware(), wall_s=wall_s,
               peak_mem_bytes=peak)


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


def quantize_cell(cell: Cell, before_quantize: Callable | None = None):
    """Load the cell's model and quantize it with the cell's method (resumable for block-wise methods);
    `before_quantize(model, tokenizer)` sees the unquantized model on its device first (the KL reference).

    Returns (model, tokenizer, base_config, method_stats, measurement or None for FP)."""
    seed_everything(cell.seed)
    loaded = load_model(cell.model)
    model, tok = loaded.model, loaded.tokenizer
    base_cfg: dict[str, Any] = {
        "model": cell.model, "model_source": loaded.source, "model_note": loaded.note,
        "method": cell.method_name, "scheme": cell.scheme_name, "preset": cell.preset, "seed": cell.seed,
        "method_config": dict(cell.config), "method_resolved": dict(cell.resolved),
        "method_version": None if cell.is_fp else type(cell.method).version,
        "eval_versions": eval_versions(),
        "scheme_def": None if cell.is_fp else cell.scheme.to_dict(),
        "precision": cell.precision.info(),
    }
    device = cell.compute_device()
    if cell.is_fp:
        place_model(model, device)
        return model, tok, base_cfg, {}, None
    method = cell.bound_method()
    on_device = place_model(model, device)
    base_cfg["device"] = {"compute": str(device), "whole_model_on_device": on_device}
    if before_quantize is not None:
        before_quantize(model, tok)
    calib = None
    if cell.uses_calibration:
        data_dir = None if cell.data_dir is None else Path(cell.data_dir)
        calib = D.calibration_set(tok, data_dir, cell.calib.dataset, cell.calib.n_samples, cell.calib.seq_len,
                                  cell.seed, cell.calib.sampling, bos=cell.eval.bos)
        base_cfg["calibration"] = calib.description
    from lrq import blockwise
    with blockwise.made_by(git_revision()), measure() as qm:   # each finished block records what made it
        # the settings parsed once when the cell was settled, typed: never parsed again here
        _, stats = lrq.quantize(model, method, cell.scheme, calib, config=cell.config, precision=cell.precision)
    base_cfg["method_stats"] = stats
    if not on_device and not place_model(model, device):
        log.warning("evaluating %s on the CPU: the quantized model does not fit %s", cell.label(), device)
    return model, tok, base_cfg, stats, qm


def execute(cell: Cell, todo: set[str], emit: Callable[[str, list[Row]], None] | None = None) -> dict[str, list[Row]]:
    """Quantize and evaluate one cell; return rows per unit for the units named in `todo`.

    `emit(unit, rows)` is called as soon as each unit is complete (the sweep stores it right away, so a
    crash in a later evaluation loses nothing already measured). Every forward runs at the cell's precision."""
    with precision.use(cell.precision):
        return _execute(cell, todo, emit)


def kl_unit(dataset: str) -> str:
    """The unit of a text's KL comparison with the FP model (its own unit: perplexities stored before it
    existed stay valid)."""
    return f"{dataset}:kl"


def _eval_ids(cell: Cell, ds: str, tok, cache: dict) -> tuple[torch.Tensor, D.Text]:
    """The token ids a cell scores on `ds` (the dataset's protocol cap and --max-eval-tokens applied)."""
    if ds not in cache:
        text = D.eval_text(ds, None if cell.data_dir is None else Path(cell.data_dir))
        ids = D.tokenize(tok, text.text)
        if cell.eval.bos:   # the model's protocol: every window starts with BOS (the caps count BOS positions)
            ids = D.with_bos(ids, cell.eval.seq_len, tok.bos_token_id)
        caps = [c for c in (D.eval_token_cap(ds), cell.eval.max_tokens) if c]
        cache[ds] = (ids[:min(caps)] if caps else ids), text
    return cache[ds]


def kl_reference_key(cell: Cell, ds: str) -> str:
    """The key of the FP model's KL reference of `cell`'s text `ds` (bench.evaluations.kl), shared by every cell
    of the same model, text, evaluation settings and precision."""
    from bench.evaluations import kl
    return kl.reference_key(cell.model_id, ds, cell.data[ds], cell.eval.key(), cell.precision.used)


def _kl_references(cell: Cell, datasets: list[str], model, tok, texts: dict) -> dict:
    """The FP model's KL reference of every text in `datasets` (its final hidden states and output head),
    loaded or computed now from the unquantized `model` (bench.evaluations.kl)."""
    from bench.evaluations import kl
    from bench.evaluations.perplexity import windows
    refs = {}
    for ds in datasets:
        ids, _ = _eval_ids(cell, ds, tok, texts)
        key = kl_reference_key(cell, ds)
        refs[ds] = kl.ensure_reference(model, windows(ids, cell.eval.seq_len, cell.eval.include_partial), key,
                                       precision=cell.precision)
    return refs


def _execute(cell: Cell, todo: set[str], emit: Callable[[str, list[Row]], None] | None) -> dict[str, list[Row]]:
    data_dir = None if cell.data_dir is None else Path(cell.data_dir)
    texts: dict = {}
    refs: dict = {}
    kl_todo = [ds for ds in cell.datasets if kl_unit(ds) in todo]

    def references(model, tok):
        refs.update(_kl_references(cell, kl_todo, model, tok, texts))
    with progress.stage("quant"):
        model, tok, base_cfg, stats, qm = quantize_cell(cell, references if kl_todo else None)
    if refs:   # one copy of the FP head in the process: the model's own where it is unchanged (checked)
        from bench.evaluations import kl
        kl.attach_head(refs.values(), model)
    out: dict[str, list[Row]] = {}

    def finished(unit: str, rows: list[Row]) -> None:
        """A unit's rows, each carrying the identity its store key hashes, kept and emitted."""
        ident = cell.identities.get(unit)
        out[unit] = [replace(r, config=r.config | {"identity": ident}) for r in rows] if ident else rows
        if emit is not None:
            emit(unit, out[unit])
    if "quant" in todo:
        cfg = dict(base_cfg)
        # bits per weight: what the stats say the method stores (a checkpoint read as it is), else the modules'
        bpw = 16.0 if cell.is_fp else stats.get("bits_per_weight", model_bits_per_weight(model))
        rows = [_row(cell, "quant", "bits_per_weight", bpw, cfg)]
        if qm is not None:
            rows += [_row(cell, "quant", "quant_time_s", qm.wall_s, cfg, qm.wall_s, qm.peak_rss_bytes),
                     _row(cell, "quant", "quant_peak_rss_bytes", qm.peak_rss_bytes, cfg, qm.wall_s, qm.peak_rss_bytes)]
            if qm.peak_cuda_bytes is not None:
                rows.append(_row(cell, "quant", "quant_peak_cuda_bytes", qm.peak_cuda_bytes, cfg, qm.wall_s))
            rows += [_row(cell, "quant", k, v, cfg) for k, v in stats.items() if k != "bits_per_weight"
                     and isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)]
        finished("quant", rows)
    for ds in cell.datasets:
        if ds not in todo and kl_unit(ds) not in todo:
            continue
        ids, text = _eval_ids(cell, ds, tok, texts)
        with measure() as em, progress.stage(ds):   # one pass: perplexity, and the KL divergence from FP
            res = perplexity(model, ids, cell.eval.seq_len, cell.eval.include_partial,
                             precision=cell.precision, desc=f"{cell.method_name} {cell.scheme_name} {ds}",
                             reference=refs.get(ds))
        check_finite_perplexity(model, ids, res, ds, cell.eval.seq_len, cell.eval.include_partial)
        ev = asdict(cell.eval) | {"source": text.source, "windows": res["windows"], "tokens": res["tokens"],
                                  "window_tokens": res["window_tokens"]}
        if ds in todo:
            cfg = base_cfg | {"eval": ev | {"window_nll": res["window_nll"]}}
            finished(ds, [_row(cell, ds, "ppl", res["ppl"], cfg, em.wall_s, em.peak_rss_bytes),
                          _row(cell, ds, "eval_tokens_per_s", res["tokens"] / em.wall_s, cfg, em.wall_s,
                               em.peak_rss_bytes)])
        if ds in refs:
            finished(kl_unit(ds), _kl_rows(cell, ds, res, refs[ds], base_cfg | {"eval": ev}, em))
    if "tasks" in todo and cell.tasks:
        from bench.evaluations import tasks as T
        if data_dir is None:
            raise UserError("task accuracy reads the data folder: pass --data-dir (or set LRQ_BENCH_DATA).")
        _check_finite_logits(model, tok)
        add_bos = T.ADD_BOS or cell.eval.bos     # the model's protocol (as `_task_protocol` keys it)
        with measure() as tm, progress.stage("tasks"):
            res = T.evaluate_tasks(model, tok, list(cell.tasks), data_dir, cell.task_limit, precision=cell.precision,
                                   add_bos=add_bos)
        cfg = base_cfg | {"tasks": {"names": list(cell.tasks), "limit": cell.task_limit, "batch_size": T.BATCH_SIZE,
                                    "precision": cell.precision.used,
                                    "max_length": T.MAX_LENGTH, "add_bos_token": add_bos,
                                    "main_metric": T.MAIN_METRIC}
                          | ({"mmlu_protocol": f"{T.MMLU_SHOTS}-shot from the dev split, shots dropped last first "
                                               f"while the prompt exceeds {T.MAX_LENGTH} tokens; limit = questions "
                                               f"per subject"} if "mmlu" in cell.tasks else {})}
        rows = []
        for task, metrics in res.items():
            per = metrics.get("per_example") or {}
            for metric, value in metrics.items():
                if metric not in ("n", "per_example", "doc_ids") and value is not None:
                    extra = {"n_examples": metrics.get("n")}
                    if metric in per:   # every example's 0/1 score, for intervals and paired comparisons
                        extra |= {"per_example": per[metric], "doc_ids": metrics.get("doc_ids")}
                    rows.append(_row(cell, task, metric, value, cfg | extra, tm.wall_s, tm.peak_rss_bytes))
        finished("tasks", rows)
    return out


def _kl_rows(cell: Cell, ds: str, res: dict, ref, cfg: dict, em) -> list[Row]:
    """The KL unit of a text: mean, median and 99th-percentile KL and top-1 agreement, each window's mean
    KL and agreement kept for intervals and paired comparisons."""
    from bench.evaluations import kl
    values = kl.summary(res["token_kl"], res["token_top1"], res.get("top1_ties"))
    bad = [k for k, v in values.items() if not math.isfinite(v)]
    if bad:
        raise NonFiniteResult(f"{ds} KL divergence from the FP model is not finite ({', '.join(bad)}). Nothing was "
                              f"stored for this unit; a rerun recomputes it.")
    cfg = cfg | {"kl": {"schema": kl.SCHEMA, "approximation": kl.APPROXIMATION, "reference": ref.key[:16],
                        "window_kld": res["window_kld"], "window_top1": res["window_top1"],
                        "positions": int(res["token_kl"].numel())}}
    return [_row(cell, ds, k, v, cfg, em.wall_s, em.peak_rss_bytes) for k, v in values.items()]


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


# ---- a stored unit's key, recomputed from its configuration ---------------------------------------------------

_DERIVED: dict[str, dict[str, set[str]]] = {}


def derived_keys(cfg: dict, dataset: str, data_dir: str | Path | None) -> dict[str, set[str]]:
    """Unit -> the store keys it can have, for the cell a stored row's configuration describes, settled anew on
    this machine's model and data (`data_dir`); the tasks unit also under the key results stored before
    2026-12-05 had (`tasks_identity(legacy=True)`). A unit whose key is not its unit's was not made by that
    configuration on this model and data (bench.run.verify). Empty when the configuration cannot be settled here
    (a model or checkpoint this machine does not have)."""
    from bench.common.identity import canonical
    memo = canonical([cfg.get(k) for k in ("model", "method", "scheme", "preset", "method_config", "calibration",
                                            "eval", "tasks", "seed", "precision")] + [dataset, str(data_dir)])
    if memo not in _DERIVED:
        _DERIVED[memo] = _derive(cfg, dataset, data_dir)
    return _DERIVED[memo]


def _derive(cfg: dict, dataset: str, data_dir) -> dict[str, set[str]]:
    from bench.evaluations.evals import TASK_ROWS
    calib = cfg.get("calibration") if isinstance(cfg.get("calibration"), dict) else None
    ev = cfg.get("eval") if isinstance(cfg.get("eval"), dict) else {}
    tasks = cfg.get("tasks") if isinstance(cfg.get("tasks"), dict) else {}
    method = str(cfg.get("method", ""))
    try:
        req = Request(model=str(cfg["model"]), method=method_of_row(method),
                      scheme=str(cfg["scheme"]), datasets=(dataset,) if dataset in PERPLEXITY or ev else (),
                      preset=str(cfg.get("preset", "quick")), overrides=dict(cfg.get("method_config") or {}),
                      calib=CalibSettings(**{k: calib[k] for k in ("dataset", "n_samples", "seq_len", "sampling")
                                             if k in calib}) if calib else None,
                      eval=EvalSettings(ev.get("seq_len", 2048), bool(ev.get("include_partial", False)),
                                        ev.get("max_tokens")),
                      seed=int(cfg.get("seed") or 0), data_dir=None if data_dir is None else str(data_dir),
                      tasks=tuple(tasks.get("names") or ()) if dataset in TASK_ROWS else (),
                      task_limit=tasks.get("limit"), device="cpu",
                      precision=str((cfg.get("precision") or {}).get("used") or "bf16"))
        cell = settle(req)
    except (UserError, KeyError, TypeError, ValueError):
        return {}
    keys = {u: {k} for u, k in cell.keys.items()}
    if req.tasks:
        keys["tasks"].add(unit_key(tasks_identity(cell.identity, req.tasks, req.task_limit,
                                                  D.resolve_data_dir(req.data_dir), cell.eval.bos,
                                                  cell.precision.used, legacy=True)))
    return keys
