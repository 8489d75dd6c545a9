"""`lrq-bench`: run a sweep, write the leaderboard, dump stored results.

Exit codes: 0 success, 2 bad input (one paragraph on stderr, no traceback), 1 failure at run time.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import textwrap
import time
from dataclasses import asdict
from pathlib import Path

from lrq.errors import UserError
from lrq.io import default_mode, dumps_json, plain_text



class _Parser(argparse.ArgumentParser):
    def error(self, message):  # bad options are bad input: exit 2 with one paragraph
        raise UserError(f"{message}. See `{self.prog} --help`.")


def _csv(s: str) -> list[str]:
    return [x.strip() for x in s.split(",") if x.strip()]


def _unique(items) -> list:
    """In order, each once (`--methods rtn,RTN` is one method; `--schemes w4a16,W4A16` one scheme)."""
    return list(dict.fromkeys(items))


def _catalogue():
    from bench.evaluations import evals
    return evals


_LISTS = {"methods": "method", "schemes": "scheme",
          "datasets": f"perplexity dataset ({', '.join(_catalogue().PERPLEXITY)}; or 'none')"}


def _check_lists(args) -> None:
    """A list option given but empty (`--schemes ''`, `--methods ,`) is bad input, not 'the default'."""
    for name, what in _LISTS.items():
        raw = getattr(args, name, None)
        if raw is not None and not _csv(raw):
            raise UserError(f"--{name} is empty ({raw!r}): name at least one {what}, or leave the option out for "
                            f"the profile's default.")


def _methods(spec: str | None) -> list[str]:
    from lrq.methods import load_methods, method_class
    names = _csv(spec) if spec else sorted(n for n, c in load_methods().items() if not c.external)
    return _unique(method_class(m).name for m in names if m.strip().lower() != "fp")


def _schemes(spec: str | None) -> list[str]:
    from lrq.schemes import DEFAULT_SCHEMES, get_scheme
    return _unique(get_scheme(s).name for s in (_csv(spec) if spec else DEFAULT_SCHEMES))


def _datasets(spec: str) -> list[str]:
    from bench.evaluations.evals import PERPLEXITY
    names = [] if spec.strip().lower() == "none" else _unique(d.lower() for d in _csv(spec))
    for d in names:
        if d not in PERPLEXITY:
            raise UserError(f"unknown dataset {d!r}: choose from {', '.join(PERPLEXITY)} (or 'none').")
    return names


def _checked_overrides(pairs: list[str], methods: list[str]) -> dict[str, str]:
    """--set KEY=VALUE pairs, every KEY a setting of at least one of `methods` (lrq.methods.check_settings)."""
    from lrq.methods import check_settings
    given = _overrides(pairs)
    check_settings(given, methods)
    return given


def _check_writable(folder: str, what: str = "the leaderboard", option: str = "--out", how: str = "") -> None:
    """--out (or `option`) must be a folder we can write, checked before any cell runs (not after hours of
    work); `how`: what to do instead (default: choose another place)."""
    import tempfile
    path = Path(folder).expanduser()
    try:
        path.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=path, prefix=".lrq-bench-write-check-"):
            pass
    except OSError as e:
        raise UserError(f"{option} {folder!r} is not a writable folder ({e.strerror or e}): "
                        f"{how or 'choose another place for ' + what}. Nothing was run.") from None


PRECISION_HELP = ("compute precision of every forward (evaluation, calibration passes, block training where the "
                  "preset does not fix fp32): auto (bf16 where the CPU computes it natively, AMX or AVX512-BF16, and "
                  "on a GPU; fp32 elsewhere), bf16 or fp32. A bf16 and an fp32 result are different cells")


def _default_results() -> Path:
    from bench.common.cache import cache_root
    return cache_root() / "results.sqlite"


def _run_epilog() -> str:
    """What `run --help` lists: the registered methods, schemes, profiles and built-in models (read from their
    registries, so the help never goes stale)."""
    from bench.common.models import BUILTINS
    from bench.run.profiles import PROFILES
    from lrq.methods import load_methods
    from lrq.schemes import DEFAULT_SCHEMES, SCHEMES
    methods = load_methods()
    lines = ["methods: " + ", ".join(sorted(n for n, c in methods.items() if not c.external))
             + " (adapters run in their own environment, named explicitly: "
             + ", ".join(sorted(n for n, c in methods.items() if c.external)) + ")",
             "schemes: " + ", ".join(SCHEMES) + f" (default: {', '.join(DEFAULT_SCHEMES)})",
             "profiles: " + "; ".join(f"{p.name}: {p.methods or 'every method'}, calibration "
                                      f"{p.calib_samples or 'the preset default'} windows, tasks "
                                      f"{p.tasks or 'none'}" for p in PROFILES.values()),
             "built-in models: " + ", ".join(f"{n} ({b.note})" for n, b in BUILTINS.items())]
    return "\n".join(textwrap.fill(line, width=100, subsequent_indent="  ") for line in lines)


def build_parser(with_lists: bool = False) -> argparse.ArgumentParser:
    """The command line; `with_lists`: the help lists registered methods, schemes, profiles and models (it
    imports the methods, so only when help is asked for)."""
    p = _Parser(prog="lrq-bench", description="Post-training quantization benchmark: LRQ, FlexRound and baselines.")
    sub = p.add_subparsers(dest="command", required=True, parser_class=_Parser)
    _add_run_parser(sub, with_lists)
    _add_plan_parser(sub)
    _add_export_parser(sub)
    _add_compare_parser(sub)
    _add_report_parser(sub)
    _add_results_parser(sub)
    return p


def _add_run_parser(sub, with_lists: bool) -> None:
    """The `run` subcommand's options."""
    r = sub.add_parser("run", help="quantize and evaluate every (method, scheme) cell",
                       epilog=_run_epilog() if with_lists else None, formatter_class=argparse.RawDescriptionHelpFormatter)
    r.add_argument("--profile", default=None, help="bundle of defaults below: sweep (the default: every method x "
                   "scheme, evaluation slices, tasks on 10 examples; within 2 hours on 2 CPU cores), first-look "
                   "(RTN only, within 10 minutes) or full (whole texts, all tasks); see bench/run/profiles.py")
    r.add_argument("--model", default="smollm2-135m", help="built-in name, hub id, local folder or .gguf file; a "
                   "folder holding a checkpoint quantized elsewhere (compressed-tensors or GPTQ format) is scored as "
                   "one cell beside its reference model")
    r.add_argument("--reference-model", default=None, help="the FP model a quantized --model checkpoint was made "
                   "from (default: the one its own metadata names)")
    r.add_argument("--methods", default=None, help="comma-separated methods (default: every registered method)")
    r.add_argument("--schemes", default=None, help="comma-separated schemes (default: the six standard schemes)")
    r.add_argument("--datasets", default=None, help=f"perplexity texts, each also compared with the FP model "
                   f"(KL divergence, top-1 agreement): {','.join(_catalogue().PERPLEXITY)} or 'none'")
    r.add_argument("--data-dir", default=None, help="data folder (default: $LRQ_BENCH_DATA, else the hub)")
    r.add_argument("--results", default=None, help="SQLite results store (default: ~/.cache/lrq-bench/results.sqlite)")
    r.add_argument("--preset", default="quick", choices=["quick", "long", "paper"],
                   help="method settings preset: quick (CPU-sized, the default), long (1,000 steps per block at "
                        "batch 2 x 1,024 on 128 calibration windows: about 2 hours per LRQ/FlexRound cell on 2 CPU "
                        "cores), paper (the authors' settings)")
    r.add_argument("--max-eval-tokens", type=int, default=None,
                   help="evaluate only the first N tokens of each text (0: the whole text)")
    r.add_argument("--eval-seq-len", type=int, default=2048, help="perplexity window length")
    r.add_argument("--include-partial", action="store_true", help="also score the last partial window")
    r.add_argument("--calib-dataset", default=None, choices=["c4", "wikitext2"], help="default c4")
    r.add_argument("--calib-samples", type=int, default=None,
                   help="calibration windows (default: the profile's, 32 for sweep and first-look; with --profile "
                        "full the method's preset: 128, the paper preset of lrq/flexround 512)")
    r.add_argument("--calib-seq-len", type=int, default=None, help="default 512 (paper preset: 1024)")
    r.add_argument("--calib-sampling", default=None, choices=["random", "sequential"], help="default random")
    r.add_argument("--tasks", default=None, help=f"lm-eval accuracy tasks: comma-separated names from "
                   f"{','.join(_catalogue().ALL_TASKS)}, or 'zeroshot' (the paper's seven), 'all' or 'none'")
    r.add_argument("--task-limit", type=int, default=None, help="examples per task (0: all)")
    r.add_argument("--jobs", default=None, help="local executor: cells run at once in worker processes on this "
                   "machine, or 'auto' (2 on a CPU machine with >= 2 cores, 1 with a GPU)")
    r.add_argument("--device", default="auto", help="where to compute: auto (CUDA when present), cpu or cuda[:i]; "
                   "a model larger than the device stays on the CPU and block-wise methods move one block at a time")
    r.add_argument("--precision", default="auto", choices=["auto", "bf16", "fp32"], help=PRECISION_HELP)
    r.add_argument("--executor", default="local", choices=["local", "ray"],
                   help="where cells run: this machine (local) or a Ray cluster (ray)")
    r.add_argument("--ray-address", default=None, help="Ray cluster address (default: start a local cluster)")
    r.add_argument("--retries", type=int, default=2, help="ray: attempts after the first for a failing cell")
    r.add_argument("--cpus-per-cell", type=int, default=1, help="ray, CPU clusters: CPUs each cell asks for")
    r.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="override a method setting (repeatable), e.g. --set lr=5e-4")
    r.add_argument("--seed", type=int, default=0)
    r.add_argument("--seeds", default=None, help="comma-separated seeds (e.g. 0,1,2): every cell that depends on "
                   "calibration data runs once per seed (independent calibration draws and initialisations); cells "
                   "that do not (FP, RTN weight-only) run once, with the first")
    r.add_argument("--force", action="store_true", help="recompute cells already in the store")
    r.add_argument("--no-fp", action="store_true", help="skip the floating-point reference row")
    r.add_argument("--out", default=None, help="also write the leaderboard to this folder")
    r.add_argument("--sync", default=None, metavar="DIR",
                   help="continue a run across machines: read DIR/results.jsonl first (its units are not computed "
                        "again), and keep it and the running cells' finished blocks (DIR/checkpoints/) up to date "
                        "as the run goes; commit DIR, and the same command on another machine continues")


def _add_plan_parser(sub) -> None:
    """The `plan` subcommand's options."""
    pl = sub.add_parser("plan", help="estimated time and memory of every cell from a model's shape (no weights)")
    pl.add_argument("--model", default="smollm2-135m",
                    help="built-in shape (llama-2-7b, llama-2-13b, llama-2-70b, smollm2-135m), config.json, folder or hub id")
    pl.add_argument("--profile", default=None, help="run profile whose defaults to plan (as for `run`)")
    pl.add_argument("--methods", default=None)
    pl.add_argument("--schemes", default=None)
    pl.add_argument("--preset", default="quick", choices=["quick", "long", "paper"])
    pl.add_argument("--datasets", default=None)
    pl.add_argument("--max-eval-tokens", type=int, default=None, help="0: the whole text")
    pl.add_argument("--eval-seq-len", type=int, default=2048)
    pl.add_argument("--calib-samples", type=int, default=None)
    pl.add_argument("--calib-seq-len", type=int, default=None)
    pl.add_argument("--tasks", default=None)
    pl.add_argument("--task-limit", type=int, default=None)
    pl.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
    pl.add_argument("--precision", default="auto", choices=["auto", "bf16", "fp32"], help=PRECISION_HELP)
    pl.add_argument("--gpus", type=int, default=None,
                    help="devices working in parallel (default: the run's --jobs for the profile on this machine)")
    pl.add_argument("--machine-profile", default=None, help="a profile JSON measured on another machine "
                    "(`lrq-bench plan --save-profile FILE` there); default: measured here once and cached")
    pl.add_argument("--save-profile", default=None, help="also write this machine's profile to FILE")
    pl.add_argument("--remeasure", action="store_true", help="measure this machine's profile again")
    pl.add_argument("--json", action="store_true", help="print the plan as JSON")


def _add_export_parser(sub) -> None:
    """The `export` subcommand's options."""
    ex = sub.add_parser("export", help="quantize with one method and scheme, save in the compressed-tensors "
                                       "pack-quantized layout")
    ex.add_argument("--model", default="smollm2-135m")
    ex.add_argument("--method", required=True)
    ex.add_argument("--scheme", required=True)
    ex.add_argument("--out", required=True, help="folder to write (model.safetensors, config.json, tokenizer)")
    ex.add_argument("--data-dir", default=None)
    ex.add_argument("--preset", default="quick", choices=["quick", "long", "paper"])
    ex.add_argument("--calib-dataset", default=None, choices=["c4", "wikitext2"])
    ex.add_argument("--calib-samples", type=int, default=None)
    ex.add_argument("--calib-seq-len", type=int, default=None)
    ex.add_argument("--calib-sampling", default=None, choices=["random", "sequential"])
    ex.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
    ex.add_argument("--seed", type=int, default=0)
    ex.add_argument("--precision", default="auto", choices=["auto", "bf16", "fp32"], help=PRECISION_HELP)
    ex.add_argument("--overwrite", action="store_true",
                    help="replace an earlier export of another request in --out (without it, only one of the same "
                         "request); a folder no export wrote is never replaced")
    ex.add_argument("--allow-ragged", action="store_true",
                    help="write a group size that does not divide every layer (only lrq-bench reads it back)")


def _add_compare_parser(sub) -> None:
    """The `compare` subcommand's options."""
    cmp_ = sub.add_parser("compare", help="regression gate: compare CURRENT results with BASELINE under tolerances")
    cmp_.add_argument("baseline", help="results store (.sqlite) or JSON export")
    cmp_.add_argument("current", help="results store (.sqlite) or JSON export")
    cmp_.add_argument("--tolerances", default=None, help="TOML file (default reports/tolerances.toml)")
    cmp_.add_argument("--allow-missing", action="store_true", help="a baseline cell absent now is not a failure")
    cmp_.add_argument("--all", action="store_true", help="list every compared value, not only changes")
    cmp_.add_argument("--allow-settings-change", action="store_true",
                      help="compare results whose identities differ (other settings, model, data or evaluation) on "
                           "purpose; without it such a comparison is refused (exit 2) naming what differs")


def _add_report_parser(sub) -> None:
    """The `report` subcommand's options."""
    rep = sub.add_parser("report", help="write the Markdown leaderboard from the results store")
    rep.add_argument("--results", default=None)
    rep.add_argument("--out", default="lrq-bench-report", help="folder for leaderboard.md and leaderboard.html "
                     "(default: ./lrq-bench-report)")


def _add_results_parser(sub) -> None:
    """The `results` subcommand's options."""
    res = sub.add_parser("results", help="print stored results")
    res.add_argument("--results", default=None)
    res.add_argument("--format", default="table", choices=["table", "csv", "json"],
                     help="table (default, with a header), csv, or json (every row with its full configuration)")
    res.add_argument("--save", default=None, metavar="DIR",
                     help="instead of printing, add the store's units to the results file DIR/results.jsonl (what "
                          "`run --sync DIR` reads on another machine)")
    res.add_argument("--model", dest="only_model", default=None, help="with --save: only this model's units")
    res.add_argument("--methods", dest="only_methods", default=None,
                     help="with --save: only these methods' units (comma-separated)")
    res.add_argument("--json", action="store_true", help="the same as --format json")


def _apply_profile(args):
    """Fill every option left unset (None) with the chosen run profile's value; returns the profile."""
    from bench.run.profiles import DEFAULT_PROFILE, get_profile
    prof = get_profile(args.profile or DEFAULT_PROFILE).for_preset(getattr(args, "preset", "quick"))
    for name in ("methods", "schemes", "datasets", "max_eval_tokens", "calib_samples", "tasks", "task_limit", "jobs"):
        if getattr(args, name, None) is None and hasattr(args, name):
            setattr(args, name, getattr(prof, name))
    return prof


def _task_names(spec: str) -> list[str]:
    from bench.evaluations.evals import ALL_TASKS, ZERO_SHOT
    return {"": [], "none": [], "zeroshot": list(ZERO_SHOT), "all": list(ALL_TASKS)}.get(spec, _csv(spec))


def _overrides(pairs: list[str]) -> dict[str, str]:
    out = {}
    for kv in pairs:
        if "=" not in kv:
            raise UserError(f"--set expects KEY=VALUE, got {kv!r}.")
        k, v = (part.strip() for part in kv.split("=", 1))
        if k in out:   # which one wins would be an accident of order
            raise UserError(f"--set {k} is given twice ({k}={out[k]} and {k}={v}): give each setting once.")
        out[k] = v
    return out


MAX_SEED = 2**32 - 1   # numpy's seeds are 32-bit: a larger one fails in every cell, after the model is loaded


def _seeds(args) -> list[int]:
    """--seeds 0,1,2 (each once, in order), else [--seed]; every one in 0..MAX_SEED (exit 2 before any work)."""
    if getattr(args, "seeds", None) is None:
        option, seeds = "--seed", [args.seed]
    else:
        option = "--seeds"
        try:
            seeds = _unique(int(s) for s in _csv(args.seeds))
        except ValueError:
            raise UserError(f"--seeds takes comma-separated integers (e.g. 0,1,2), not {args.seeds!r}.") from None
        if not seeds:
            raise UserError(f"--seeds needs at least one integer, got {args.seeds!r}.")
    bad = [s for s in seeds if not 0 <= s <= MAX_SEED]
    if bad:
        raise UserError(f"{option} {bad[0]} is outside 0..{MAX_SEED} (the seeds numpy and torch take): choose a "
                        f"seed in that range. Nothing was run.")
    return seeds


def _calib_given(args) -> dict:
    """The calibration settings the user gave (None: the method's preset default)."""
    return {"dataset": getattr(args, "calib_dataset", None), "n_samples": args.calib_samples,
            "seq_len": args.calib_seq_len, "sampling": getattr(args, "calib_sampling", None)}


def cmd_run(args) -> int:
    from bench.run.cell import check_sizes, resolve_device
    from bench.evaluations.data import check_available, resolve_data_dir
    from bench.run.executor import LocalExecutor
    from bench.run.profiles import resolve_jobs
    from bench.common.store import ResultStore
    from bench.run.sweep import missing_units, run_cells
    _check_lists(args)
    external = _external_checkpoint(args)   # --model a checkpoint quantized elsewhere: it is the one cell
    prof = _apply_profile(args)
    args.max_eval_tokens = args.max_eval_tokens or None    # 0: the whole text
    args.task_limit = args.task_limit if args.task_limit != 0 else None
    if args.executor == "ray":
        from bench.run.executor import RayExecutor
        executor = RayExecutor(args.ray_address, retries=args.retries, cpus_per_cell=args.cpus_per_cell)
    else:
        executor = LocalExecutor(resolve_jobs(args.jobs))
    if external:
        methods, schemes, user_overrides = ["external"], [external["scheme"]], external["overrides"]
    else:
        methods, schemes = _methods(args.methods), _schemes(args.schemes)
        user_overrides = _checked_overrides(args.set, methods)
    datasets = _datasets(args.datasets)
    tasks = _check_run_args(args)
    compute = resolve_device(args.device)
    store = ResultStore(args.results or _default_results(), check=True)   # a damaged store: exit 2 now
    carry = _open_sync(args.sync, store, args.data_dir)
    from bench.common.models import load_model
    from transformers.utils import logging as hf_logging
    hf_logging.disable_progress_bar()   # the terminal shows one bar, the run's (worker output goes to their logs)
    loaded = load_model(args.model)  # bad model names fail before any work; also warms the cache
    if external:   # the checkpoint read whole against its reference before any work (exit 2 naming file and field)
        from lrq.external import check_against_reference
        check_against_reference(external["overrides"]["checkpoint"], loaded.model, args.model,
                                itself=_same_weights(args.model, external["overrides"]["checkpoint"]))

    # explicit --set wins over the profile; a checkpoint read as it is takes none of the methods' settings
    overrides = user_overrides if external else dict(prof.method_settings) | user_overrides
    cells = _settle_cells(args, methods, schemes, datasets, tasks, overrides)
    needed = set(datasets) | {c.calib.dataset for c in cells if c.uses_calibration}
    check_available(sorted(needed), resolve_data_dir(args.data_dir))  # fail before any model work
    if tasks:
        from bench.evaluations.tasks import check_task_data
        check_task_data(tasks, resolve_data_dir(args.data_dir))
    check_sizes(cells, loaded.tokenizer)   # every text big enough for its windows: before any model work
    if args.executor == "local":  # every cell must fit this machine (with --jobs of them at once)
        _check_cells_fit(args.model, cells, loaded, compute, executor.jobs)
    t0 = time.perf_counter()
    where = (f"on Ray ({executor.address or 'a local cluster'})" if args.executor == "ray" else
             f"{executor.jobs} at a time" + (f" ({executor.threads} thread{'s' if executor.threads > 1 else ''} each)"
                                             if executor.jobs > 1 else ""))
    todo = missing_units(cells, store, args.force)
    n_todo = sum(bool(t) for t in todo.values())
    prec = cells[0].precision
    print(f"lrq-bench run: profile {prof.name}, {len(cells)} cells ({n_todo} to compute, {len(cells) - n_todo} "
          f"already stored), {where}; precision {prec.used} ({prec.why})", file=sys.stderr, flush=True)
    estimate = _announce_estimate(args, cells, todo, executor, loaded, carry) if n_todo else None
    outcomes = run_cells(cells, store, force=args.force, executor=executor, estimate=estimate, carry=carry)
    return _finish_run(args, cells, store, outcomes, time.perf_counter() - t0)


def _check_run_args(args) -> list[str]:
    """`run`'s options checked before any work (exit 2 naming the option); returns the task names."""
    from bench.evaluations.data import resolve_data_dir
    from bench.evaluations.evals import ALL_TASKS
    if args.out:
        from bench.common.models import source_folder
        src, out = source_folder(args.model), Path(args.out).expanduser().resolve()
        if src is not None and (out == src.resolve() or src.resolve() in out.parents):
            raise UserError(f"--out {args.out!r} is inside the folder the model is read from ({src}): the "
                            f"leaderboard does not belong to the model. Choose a folder outside it. Nothing was run.")
        _check_writable(args.out)
    for name, v in (("--max-eval-tokens", args.max_eval_tokens), ("--eval-seq-len", args.eval_seq_len),
                    ("--calib-samples", args.calib_samples), ("--calib-seq-len", args.calib_seq_len)):
        if v is not None and v < 2:
            raise UserError(f"{name} must be at least 2, got {v}.")
    resolve_data_dir(args.data_dir)  # fail early on a missing folder
    _seeds(args)
    tasks = _task_names(args.tasks)
    bad = [t for t in tasks if t not in ALL_TASKS]
    if bad:
        raise UserError(f"unknown task(s) {', '.join(bad)}: choose from {', '.join(ALL_TASKS)}, zeroshot or all.")
    if tasks and resolve_data_dir(args.data_dir) is None:
        raise UserError("--tasks reads the evaluation data folder: pass --data-dir (or set LRQ_BENCH_DATA).")
    if args.task_limit is not None and args.task_limit < 1:
        raise UserError(f"--task-limit must be 0 (all) or at least 1, got {args.task_limit}.")
    return tasks


def _open_sync(folder: str | None, store, data_dir: str | None = None):
    """`--sync DIR`: the results file's units imported into the store (exit 2 on a damaged file, before any
    work), and the carry that keeps DIR up to date as the run goes; None without --sync."""
    if not folder:
        return None
    from bench.run.ledger import Carry
    carry = Carry(folder, store)
    _check_writable(str(carry.folder), "the results file", "--sync")
    added, present = carry.import_results(data_dir)
    if added or present:
        _say(f"{carry.file}: {added} unit(s) added to {store.path}, {present} already there; cells they "
             f"complete are not computed again")
    return carry


def _settle_cells(args, methods, schemes, datasets, tasks, overrides) -> list:
    """Every (method, scheme) cell of the run settled, FP first, once per seed where calibration matters."""
    from bench.run.cell import FP, EvalSettings, Request, resolve_calib, settle
    seeds = _seeds(args)
    common = dict(model=args.model, datasets=tuple(datasets), preset=args.preset, overrides=overrides,
                  eval=EvalSettings(args.eval_seq_len, args.include_partial, args.max_eval_tokens),
                  data_dir=args.data_dir, tasks=tuple(tasks), task_limit=args.task_limit, device=args.device,
                  precision=args.precision)
    given = _calib_given(args)
    pairs = ([] if args.no_fp else [(FP, FP)]) + [(m, s) for m in methods for s in schemes]
    cells = []
    for m, s in pairs:
        for i, seed in enumerate(seeds):
            cell = settle(Request(method=m, scheme=s, calib=resolve_calib(m, args.preset, given), seed=seed, **common),
                          bind_device=args.executor == "local")
            if i and not cell.uses_calibration:
                break   # nothing in this cell depends on the seed: one run says it all
            cells.append(cell)
    return cells


def _check_cells_fit(model: str, cells, loaded, compute, jobs: int) -> None:
    """Every cell fits this machine's memory with `jobs` of them at once (exit 2 before any work)."""
    from bench.run import plan as P
    shape = P.shape_from_config(model, loaded.model.config)
    dev = compute.type
    dev_avail = None
    if dev == "cuda":
        import torch
        dev_avail = torch.cuda.mem_get_info(compute)[1]
    host_avail = P.host_memory_available()
    for c in cells:
        if not c.is_fp:
            P.check_fits(shape, c.method, c.calib.n_samples, c.calib.seq_len, dev, host_avail, dev_avail, jobs=jobs)


def _finish_run(args, cells, store, outcomes, wall: float) -> int:
    """The run's summary on the terminal, the leaderboard files (--out), the cell counts; exit 1 if one failed."""
    from bench.reports.html_report import write_report
    from bench.common.store import newest
    run_keys = {k for c in cells for k in c.keys.values()}   # the leaderboard of this run's own settings only
    rows = newest([r for r in store.rows() if r.unit_key in run_keys])
    _warn_unreadable(store)
    from bench.reports.report import terminal_summary
    print(terminal_summary(rows))
    if args.out:
        md = write_report(store, Path(args.out))
        print(f"leaderboard written to {md} and {md.with_name('leaderboard.html')}", file=sys.stderr)
    counts = {s: sum(o.status == s for o in outcomes) for s in ("done", "reused", "failed")}
    print(f"{len(outcomes)} cells: {counts['done']} run, {counts['reused']} reused from {store.path}, "
          f"{counts['failed']} failed; wall time {wall:.1f} s", file=sys.stderr)
    for o in outcomes:
        if o.status == "failed":
            print(f"FAILED {o.cell.label()}: {o.error}", file=sys.stderr)
    return 1 if counts["failed"] else 0


def cmd_plan(args) -> int:
    from tabulate import tabulate

    from bench.run import plan as P
    from bench.run.cell import resolve_calib
    from bench.run.profiles import resolve_jobs
    from bench.common.provenance import cpu_label

    _check_lists(args)
    prof = _apply_profile(args)
    shape = P.load_shape(args.model)
    methods = _methods(args.methods)
    schemes = _schemes(args.schemes)
    user_overrides = _checked_overrides(args.set, methods)
    tasks = _task_names(args.tasks)
    limit = args.task_limit or None
    device = "cuda" if torch_cuda() else "cpu"
    workers = args.gpus or (resolve_jobs(prof.jobs) if device == "cpu" else 1)
    if not args.machine_profile:   # this machine is measured (or its measurement read) in the cache
        from bench.common.cache import cache_root
        _check_writable(str(cache_root()), option="the cache folder", how=(
            "the planner keeps this machine's measurements there. Set LRQ_BENCH_CACHE to a writable folder, or "
            "pass --machine-profile FILE (a profile measured elsewhere: `lrq-bench plan --save-profile FILE`)"))
    if device == "cpu" and not args.machine_profile:
        import torch

        from bench.run.executor import LocalExecutor
        torch.set_num_threads(LocalExecutor(workers).threads)   # measure as each worker will run
    machine = P.load_or_measure_profile(device, args.machine_profile, args.remeasure, args.precision, say=_say)
    if args.save_profile:
        Path(args.save_profile).write_text(dumps_json(machine, indent=1))
    overrides = dict(prof.method_settings) | user_overrides
    given = _calib_given(args)

    def calib(m):
        c = resolve_calib(m, args.preset, given)
        return c.n_samples, c.seq_len
    specs = P.plan_specs(methods, schemes, calib, preset=args.preset, overrides=overrides,
                         datasets=_datasets(args.datasets), max_tokens=args.max_eval_tokens or None,
                         eval_seq=args.eval_seq_len, tasks=tasks, task_limit=limit,
                         measure=not args.machine_profile and device == "cpu")
    est = P.price(shape, specs, machine)   # the estimate `run` prints for the same options on an empty store
    cells = []
    for i, sp in specs.items():
        if sp.method is None:
            continue
        host, dev = P.estimate_memory(shape, sp.method, sp.n, sp.seq, machine["device"])
        cells.append(P.CellPlan(sp.method.name, sp.scheme.name, {}, est.seconds(i), host, dev, est.stages.get(i)))
    fp_s = est.seconds(0)
    total, wall = est.total, est.wall(workers)
    load = P.load_note(workers) if device == "cpu" else None
    unit = "GPU" if machine["device"] == "cuda" else "CPU-process"
    if args.json:
        print(dumps_json({"shape": P.describe(shape), "machine": {k: machine[k] for k in ("device", "hardware", "threads")},
                          "cells": P.as_rows(cells), "fp_seconds": fp_s, "total_hours": total / 3600,
                          "workers": workers, "wall_hours": wall / 3600}, indent=1))
        return 0
    rows = [[c.method, c.scheme, P.fmt_hours(c.seconds), f"{c.host_bytes / 2**30:.1f}",
             f"{c.device_bytes / 2**30:.1f}" if c.device_bytes else "-"] for c in cells]
    print(f"Plan: {shape.name} ({shape.params() / 1e9:.2f} B parameters, {shape.layers} blocks), profile {prof.name}, "
          f"preset {args.preset}; machine profile: {machine['device']}, {machine['threads']} thread(s), "
          f"{machine['hardware'].get('gpu') or cpu_label(machine['hardware'])}, precision "
          f"{machine.get('precision', 'bf16 (measured before the precision was recorded)')}\n")
    print(tabulate(rows, headers=["method", "scheme", "est. time", "host GiB", "device GiB"], tablefmt="github"))
    print(f"\nFP reference evaluation: {P.fmt_hours(fp_s)}. Total: {total / 3600:.2f} {unit}-hours; "
          f"wall time on {workers} {'device' if unit == 'GPU' else 'worker'}{'s' if workers > 1 else ''}: "
          f"{P.fmt_hours(wall)} (longest cells first).")
    if shape.rough:
        print(f"Rough: {shape.rough}.")
    if load:
        print(f"Note: {load}.")
    return 0


def _same_weights(reference: str, folder: str) -> bool:
    """Whether the model `reference` names is the checkpoint in `folder` itself: its folder, or the same content
    (bench.common.models' identity of weights)."""
    from bench.common.models import model_fingerprint, source_folder
    folder_path = Path(folder).expanduser().resolve()
    src = source_folder(reference)
    return (src is not None and src.resolve() == folder_path) or \
        model_fingerprint(reference) == model_fingerprint(str(folder_path))


def _external_checkpoint(args) -> dict | None:
    """`--model` names a checkpoint quantized elsewhere (lrq.external, read by the `external` method): the run
    scores it as one cell beside its reference FP model, which becomes the run's model. None for an ordinary model."""
    from lrq.external import describe, quantization_config
    if not quantization_config(args.model):
        if args.reference_model:
            raise UserError(f"--reference-model applies to a quantized checkpoint, and {args.model!r} is not one.")
        return None
    for opt, v in (("--methods", args.methods), ("--schemes", args.schemes), ("--set", args.set)):
        if v:
            raise UserError(f"{opt} does not apply to {args.model!r}: it is a checkpoint quantized elsewhere, scored "
                            f"as it is (one cell). Leave {opt} out.")
    info = describe(args.model)
    reference = args.reference_model or info["reference"]
    if not reference:
        raise UserError(f"{args.model!r} is a {info['format']} checkpoint ({info['method']}) that does not name the "
                        f"floating-point model it was quantized from: pass it with --reference-model (a built-in "
                        f"name, folder or hub id), so the checkpoint is scored on that model's windows and compared "
                        f"with its cells.")
    from bench.common.models import model_fingerprint
    folder = str(Path(args.model).expanduser().resolve())
    info["overrides"] = {"checkpoint": folder, "fingerprint": model_fingerprint(folder)}
    _say(f"{args.model}: a {info['format']} checkpoint ({info['bits']}-bit, "
         f"{'group ' + str(info['group_size']) if info['group_size'] else 'per channel'}, "
         f"{'symmetric' if info['symmetric'] else 'asymmetric'}) scored as {info['method']} ({info['scheme']}) "
         f"against {reference}")
    args.model = reference
    return info


def _announce_estimate(args, cells, todo, executor, loaded, carry=None):
    """Print the planner's estimate of what the run is about to compute, on this machine at the run's precision
    (asking nothing: a user who sees '34 h' can stop at once). Blocks of a resumed cell that an earlier run
    finished (here, or carried in `carry`'s folder) are not priced again. Returns the estimate (the progress bar
    weighs stages by it), or None where there is none (a Ray cluster; a planner failure, said in one line)."""
    from bench.run import plan as P
    if args.executor == "ray":
        _say("no time estimate for a Ray cluster (its nodes' speed is not known here).")
        return None
    import torch
    device = cells[0].compute_device().type
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(executor.threads if device == "cpu" else threads)   # as each worker will run
        machine = P.load_or_measure_profile(device, precision=cells[0].precision.used, say=_say)
        shape = P.shape_from_config(args.model, loaded.model.config)
        est = P.estimate_run(shape, dict(enumerate(cells)), todo, machine, carry)
    except UserError:
        raise
    except Exception as e:  # noqa: BLE001 - an estimate is a courtesy: never the reason a run does not start
        _say(f"no time estimate ({type(e).__name__}: {e}).")
        return None
    finally:
        torch.set_num_threads(threads)
    if not est.stages:
        return est
    unit = "GPU" if device == "cuda" else "CPU-process"
    workers = executor.jobs
    longest = max(est.stages, key=est.seconds)
    unpriced = f"; {len(est.unpriced)} cell(s) without a cost model not counted" if est.unpriced else ""
    if est.done_blocks:
        unpriced += "; resumed, so not priced again: " + ", ".join(
            f"{cells[i].method_name} {cells[i].scheme_name}'s first {n} blocks" for i, n in est.done_blocks.items())
    from bench.common.provenance import cpu_label
    _say(f"estimate on this machine ({machine['hardware'].get('gpu') or cpu_label(machine['hardware'])}, "
         f"{cells[0].precision.used}): {len(est.stages)} cells, {est.total / 3600:.2f} {unit}-hours of work, about "
         f"{P.fmt_duration(est.wall(workers))} wall on {workers} worker{'s' if workers > 1 else ''} (longest cell: "
         f"{cells[longest].method_name} {cells[longest].scheme_name}, {P.fmt_duration(est.seconds(longest))}"
         f"{unpriced}). `lrq-bench plan` itemizes it; Ctrl-C stops at once, and a rerun keeps what was stored.")
    if shape.rough:
        _say(f"the estimate is rough: {shape.rough}.")
    load = P.load_note(workers, executor.threads) if device == "cpu" else None
    if load:
        _say(load + ".")
    return est


def _say(line: str) -> None:
    print(f"lrq-bench: {plain_text(line)}", file=sys.stderr, flush=True)


def torch_cuda() -> bool:
    import torch
    return torch.cuda.is_available()


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
        from bench.run.plan import load_shape
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


def cmd_compare(args) -> int:
    from bench.reports.compare import gate
    code, md = gate(args.baseline, args.current, args.tolerances, args.allow_missing, args.all,
                    args.allow_settings_change)
    print(md)
    return code


def _existing_store(results: str | None):
    from bench.common.store import ResultStore
    path = Path(results or _default_results())
    if not path.exists():
        raise UserError(f"results store {str(path)!r} does not exist: run `lrq-bench run` first or pass --results.")
    return ResultStore(path, check=True, readonly=True)   # read-only commands never write the store


def _warn_unreadable(store) -> None:
    if store.unreadable:
        print(f"lrq-bench: warning: {store.unreadable} stored row(s) of {store.path} could not be decoded and are "
              f"left out.", file=sys.stderr)


def cmd_report(args) -> int:
    from bench.reports.html_report import write_report
    store = _existing_store(args.results)
    out = write_report(store, Path(args.out))
    _warn_unreadable(store)
    print(out)
    print(out.with_name("leaderboard.html"))
    return 0


RESULT_COLUMNS = ("model", "method", "scheme", "precision", "dataset", "metric", "value", "seed", "git_rev", "created_at")


def _result_cell(row, column: str):
    """A row's field as `results` shows it in a table: stored strings as plain text, the revision short."""
    value = getattr(row, column)
    if not isinstance(value, str):
        return value
    return plain_text(value)[:12] if column == "git_rev" else plain_text(value)


def cmd_results(args) -> int:
    store = _existing_store(args.results)
    rows = store.rows(as_stored=args.save or args.json or args.format == "json")   # files carry what was stored
    _warn_unreadable(store)
    if args.save:
        from bench.run import ledger
        methods = set(_csv(args.only_methods)) if args.only_methods else None
        keys = {r.unit_key for r in rows if (args.only_model is None or r.model == args.only_model)
                and (methods is None or r.method in methods)}
        path, n = ledger.save(store, args.save, keys)
        print(f"{path}: {n} unit(s) ({len(keys)} from {store.path})")
        return 0
    fmt = "json" if args.json else args.format
    if fmt == "json":
        sys.stdout.write(dumps_json([asdict(r) | {"precision": r.precision} for r in rows], indent=1, default=str))
        print()
        return 0
    table = [[_result_cell(r, c) for c in RESULT_COLUMNS] for r in rows]
    if fmt == "csv":
        import csv
        w = csv.writer(sys.stdout)
        w.writerow(RESULT_COLUMNS)
        w.writerows(table)
    else:
        from tabulate import tabulate
        print(tabulate(table, headers=RESULT_COLUMNS, tablefmt="simple", disable_numparse=True))
    return 0


class Terminated(BaseException):
    """SIGTERM reached the driver: unwinds like Ctrl-C (workers are terminated on the way out), never taken
    for a failing cell (it is not an Exception)."""


def _on_sigterm(signum, frame):
    raise Terminated()


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=os.environ.get("LRQ_BENCH_LOG", "WARNING"), format="%(levelname)s %(message)s")
    import signal
    import threading
    old_term = None
    if threading.current_thread() is threading.main_thread():
        old_term = signal.signal(signal.SIGTERM, _on_sigterm)
    try:
        argv = sys.argv[1:] if argv is None else argv
        args = build_parser(with_lists=any(a in ("-h", "--help") for a in argv)).parse_args(argv)
        return {"run": cmd_run, "plan": cmd_plan, "export": cmd_export, "compare": cmd_compare, "report": cmd_report,
                "results": cmd_results}[args.command](args)
    except UserError as e:
        print(textwrap.fill(f"lrq-bench: error: {plain_text(e)}", width=100, break_long_words=False, break_on_hyphens=False),
              file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("lrq-bench: interrupted; completed cells are stored and will be reused.", file=sys.stderr)
        return 130
    except Terminated:
        print("lrq-bench: terminated (SIGTERM): the running cells were stopped with their workers; every unit "
              "measured so far is stored, and a rerun of the same command resumes (block-wise methods at their "
              "next block).", file=sys.stderr)
        return 143
    except BrokenPipeError:   # `lrq-bench results --json | head`: the reader left; nothing to say
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        return 0
    finally:
        if old_term is not None:
            signal.signal(signal.SIGTERM, old_term)


if __name__ == "__main__":
    sys.exit(main())
