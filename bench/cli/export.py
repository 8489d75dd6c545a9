"""`lrq-bench export`: a cell's quantized model written as a folder other tools load."""

from __future__ import annotations

import json
import os
import sys
from dataclasses import asdict
from pathlib import Path

from bench.cli.args import _calib_given, _check_writable, _checked_overrides, _methods, _schemes, _seeds
from lrq.errors import UserError
from lrq.io import default_mode, dumps_json


def cmd_export(args) -> int:
    from bench.run.cell import Request, quantize_cell, resolve_calib, settle
    from bench.evaluations.data import check_available, resolve_data_dir
    import lrq
    from bench.common.provenance import git_revision, versions

    (method,) = _methods(args.method)
    (scheme,) = _schemes(args.scheme)
    overrides = _checked_overrides(args.set, [method])
    (seed,) = _seeds(args)
    cell = settle(Request(model=args.model, method=method, scheme=scheme, datasets=(), preset=args.preset,
                          overrides=overrides, calib=resolve_calib(method, args.preset, _calib_given(args)),
                          seed=seed, data_dir=args.data_dir, precision=args.precision))
    target = _check_export_target(args.out, args.model, _export_request(cell), args.overwrite,   # before any work
                                  args.data_dir)
    if not args.allow_ragged:                          # a group size the loaders refuse: said before quantizing
        from bench.run.shapes import load_shape
        from lrq.export import group_fit_problem
        try:
            shape = load_shape(args.model)
        except UserError:
            shape = None                               # a .gguf file: lrq.save checks after quantizing
        problem = shape and group_fit_problem(cell.scheme, sorted({i for i, _ in shape.linears()}))
        if problem:
            raise UserError(f"--scheme {cell.scheme.name}: {problem} Nothing was quantized.")
    if cell.uses_calibration:
        check_available([cell.calib.dataset], resolve_data_dir(args.data_dir))
    model, tok, cfg, stats, qm = quantize_cell(cell)
    meta = cfg | {"versions": versions(), "git_rev": git_revision(), "quant_time_s": qm.wall_s,
                  "request": _export_request(cell)}
    # written into a new folder beside the target and moved into place whole: a failed export leaves nothing
    # (no empty or half-written --out), and an earlier export it replaces stays intact until the new one is done
    import shutil
    import tempfile
    staging = Path(tempfile.mkdtemp(dir=target.parent, prefix=f".{target.name}.partial-"))
    try:
        lrq.save(model, staging, tokenizer=tok, metadata=meta, allow_ragged=args.allow_ragged)
        (staging / EXPORT_MARKER).write_text("written by `lrq-bench export`: a later export may replace this folder\n")
        os.chmod(staging, default_mode(directory=True))   # the user's umask, not mkdtemp's private 0700
        _install_folder(staging, target)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    print(f"{args.method} {scheme} written to {target} ({sum(f.stat().st_size for f in target.iterdir()) / 2**20:.1f} "
          f"MiB; quantization {qm.wall_s:.1f} s)", file=sys.stderr)
    return 0


def _export_request(cell) -> dict:
    """What an export was asked for, as its metadata records it (`request`): the model, method, scheme, settings,
    seed, precision asked and calibration."""
    return json.loads(dumps_json({"model": cell.model, "model_id": cell.model_id, "method": cell.method_name,
                                  "scheme": cell.scheme_name, "preset": cell.preset, "seed": cell.seed,
                                  "method_config": dict(cell.config), "precision": cell.precision.used,
                                  "calibration": asdict(cell.calib) if cell.uses_calibration else None},
                                 sort_keys=True, default=str))


EXPORT_MARKER = ".lrq-bench-export"   # in every folder `export` writes: what --overwrite may replace


def _earlier_export(folder: Path) -> dict | None:
    """The request an lrq-bench export in `folder` was made for ({} for an export that predates the record;
    None: not a folder `export` wrote, by its marker)."""
    if not (folder / EXPORT_MARKER).is_file():
        return None
    try:
        from safetensors import safe_open
        with safe_open(str(folder / "model.safetensors"), framework="pt") as f:
            meta = json.loads((f.metadata() or {}).get("lrq_bench", "null"))
    except Exception:  # noqa: BLE001 - unreadable, absent, not ours: not an earlier export
        return None
    if not isinstance(meta, dict):
        return None
    return meta.get("request") if isinstance(meta.get("request"), dict) else {}


def _kept_folders(model: str, data_dir: str | None) -> dict[str, Path]:
    """The folders no export may replace or hold, by what they are: lrq-bench's cache, the folder the model is
    read from, the data folder and the repository lrq-bench runs from."""
    from bench.common.cache import cache_root
    from bench.common.models import source_folder
    from bench.evaluations.data import DATA_ENV
    code = Path(__file__).resolve().parent
    data = data_dir if data_dir is not None else os.environ.get(DATA_ENV)
    kept = {"lrq-bench's cache": cache_root(), f"the folder the model {model!r} is read from": source_folder(model),
            "the data folder": Path(data) if data else None,
            "lrq-bench's repository": next((p for p in code.parents if (p / ".git").exists()), None)}
    return {what: p.expanduser().resolve() for what, p in kept.items() if p is not None}


def _what_it_holds(target: Path, model: str, data_dir: str | None) -> str:
    """What a folder that an export may not replace holds, for the refusal."""
    for what, p in _kept_folders(model, data_dir).items():
        if p == target or target in p.parents:
            return f"{what} ({p})"
    for name, what in ((".git", "a git repository (.git)"), ("results.jsonl", "a run's sync folder (results.jsonl)")):
        if (target / name).exists():
            return what
    folders = sorted(p.name for p in target.iterdir() if p.is_dir() or p.is_symlink())
    if folders and (target / EXPORT_MARKER).is_file():
        return f"folders ({', '.join(folders[:5])}), which no export writes"
    if _earlier_export(target) is not None:
        return "an lrq-bench export of another request"
    if (target / "config.json").exists() or list(target.glob("*.safetensors")):
        return "a model"
    return f"folders ({', '.join(folders[:5])})" if folders else "other files"


def _check_export_target(out: str, model: str, request: dict | None = None, overwrite: bool = False,
                         data_dir: str | None = None) -> Path:
    """Where an export may go, decided before any work: never the folder the source model is read from, never
    inside lrq-bench's cache (the built-in model's converted copy is there: an export over it would be scored
    as the built-in by every later run). A folder that holds anything is replaced only where an earlier export
    wrote it (its marker file, plain files only): with the same request, or any request with `overwrite`; never
    a folder that holds the cache, a model, the data, a sync folder or a repository. Returns the target folder
    (not created: the export is moved there whole when it is done)."""
    from bench.common.cache import cache_root
    from bench.common.models import source_folder
    src = source_folder(model)
    target = Path(out).expanduser().resolve()
    if src is not None and target == src.resolve():
        raise UserError(f"--out {out!r} is the folder the model {model!r} is read from: the export would overwrite "
                        f"the source weights. Choose another folder (e.g. --out {target.name}-quantized). Nothing "
                        f"was quantized.")
    cache = cache_root().resolve()
    if target == cache or cache in target.parents:
        raise UserError(f"--out {out!r} is inside lrq-bench's cache ({cache}), which holds the built-in models and "
                        f"the results: an export there could replace a model every later run reads. Choose a folder "
                        f"outside it. Nothing was quantized.")
    if target.exists() and not target.is_dir():
        raise UserError(f"--out {out!r} is a file, not a folder: choose a folder for the export. Nothing was "
                        f"quantized.")
    if target.is_dir() and any(target.iterdir()):
        earlier = _earlier_export(target)
        plain = all(p.is_file() and not p.is_symlink() for p in target.iterdir())
        if earlier is None or not plain or not (overwrite or request is None or earlier == request):
            what = _what_it_holds(target, model, data_dir)
            hint = (" or pass --overwrite to replace the export" if what.startswith("an lrq-bench export") else
                    f": --overwrite replaces only a folder of plain files an earlier export wrote (its "
                    f"{EXPORT_MARKER} file says so), and never removes anything else")
            raise UserError(f"--out {out!r} already holds {what}: an export would replace it. Choose an empty or "
                            f"new folder{hint}. Nothing was quantized.")
    if target.parent != target:
        _check_writable(str(target.parent), "the export")
    return target


def _install_folder(staging: Path, target: Path) -> None:
    """Move a finished folder into place: the old one (if any) is set aside first and removed after."""
    import shutil
    import tempfile
    old = None
    if target.exists():
        old = Path(tempfile.mkdtemp(dir=target.parent, prefix=f".{target.name}.old-"))
        os.rmdir(old)
        os.replace(target, old)
    try:
        os.replace(staging, target)
    except BaseException:
        if old is not None:
            os.replace(old, target)
        raise
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)
