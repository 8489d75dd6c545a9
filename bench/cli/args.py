"""The command line's options: the parser of every command and the checks and conversions the commands share."""

from __future__ import annotations

import argparse
import sys
import textwrap
from pathlib import Path

from lrq.errors import UserError


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
