"""`lrq-bench run` and `lrq-bench plan`: settle the cells, price them, run them."""

from __future__ import annotations

import sys
import time
from pathlib import Path

from bench.cli.args import (_apply_profile, _calib_given, _check_lists, _check_writable, _checked_overrides, _datasets,
                       _default_results, _methods, _schemes, _seeds, _task_names, _warn_unreadable)
from lrq.errors import UserError
from lrq.io import dumps_json, plain_text


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
