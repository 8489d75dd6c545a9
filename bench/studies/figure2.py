"""The LRQ paper's Figure 2 in its regime: calibration vs held-out block error while training, LRQ and FlexRound.

    python -m bench.studies.figure2                                  # blocks 0, 15, 29; 5,000 steps; batch 2
    python -m bench.studies.figure2 --blocks 0 --iters 1000 --every 100 --threads 2
    python -m bench.studies.figure2 --device cuda --blocks all       # every block, on a GPU

Each chosen block is trained exactly as the engine trains it (`ReconstructionMethod._reconstruct_block`,
the paper preset: Adam, cosine decay, fp32, the authors' learning rates and s1 initialisation per scheme)
on the full-precision chain's inputs to that block (so blocks are independent and any subset can be
measured), with calibration windows of C4 taken in order as in the authors' code, and `--heldout` more
windows that are never trained on. Every `--every` steps the block's output error (the training loss's
quantity, on the first `--error-samples` training windows and on the held-out windows) is logged.

The default model's C4 pool holds 418 windows of 1,024 tokens beside the evaluation documents: the
default is 384 training + 32 held-out windows (the paper: 512 training windows). Results are written
after every (block, method) to `--out`/figure2.json, with the configuration, and a rerun with the same
configuration resumes where it stopped: at the next (block, method), and within the one that was training at
its last `--every` step (its state is saved in `--state-dir`, the cache by default, and removed when done); figure2.md and figure2.html hold the table and the curves.
Every point keeps each window's own error: the table gives 95 % intervals across windows, and LRQ /
FlexRound is the geometric mean of the per-window ratios on the same held-out windows, with its interval.

The methods may run in separate processes (one thread each, side by side on a 2-core machine), each with
its own `--out`; `--merge DIR DIR ...` then joins their results into `--out` (the configurations must be
the same but for the methods) and writes the page.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import hashlib
import json
import time
from pathlib import Path
from types import SimpleNamespace

import torch

from bench.common.provenance import short_revision
from lrq.errors import UserError
from lrq.io import atomic_write_text
from lrq.io import dumps_json


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m bench.studies.figure2", description=__doc__.split("\n")[0])
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--data-dir", default=None)
    p.add_argument("--methods", default="lrq,flexround")
    p.add_argument("--scheme", default="w3a16")
    p.add_argument("--blocks", default="first,middle,last", help="comma-separated indices, first/middle/last, or all")
    p.add_argument("--iters", type=int, default=5000)
    p.add_argument("--batch-size", type=int, default=2)
    p.add_argument("--calib-samples", type=int, default=384)
    p.add_argument("--heldout", type=int, default=32)
    p.add_argument("--error-samples", type=int, default=32, help="windows the errors are measured on (each side)")
    p.add_argument("--seq-len", type=int, default=1024)
    p.add_argument("--every", type=int, default=250)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="more method settings")
    p.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    p.add_argument("--device", default="cpu")
    p.add_argument("--precision", default="fp32", choices=("fp32", "bf16"),
                   help="the training steps' compute precision: fp32 (the paper's W3A16 regime) or bf16 (autocast "
                        "over float32 weights, as the long preset trains on a CPU with native bf16)")
    p.add_argument("--calib-file", default=None, help="calibration windows already tokenized (a safetensors file "
                   "with input_ids [n, seq]; bench/studies/gpu_stage.py pack writes one) instead of the data folder")
    p.add_argument("--budget-s", type=float, default=0, help="start no (block, method) that would end after this "
                   "many seconds (judged by the last one's time); 0: no limit")
    p.add_argument("--state-dir", default=None, help="where the (block, method) in training is saved every --every "
                   "steps, to resume there after an interruption (default: the cache, figure2-state/)")
    p.add_argument("--out", default="reports/figure2")
    p.add_argument("--merge", nargs="+", default=None, metavar="DIR",
                   help="join the results of runs made apart (e.g. one per method) into --out, and render")
    a = p.parse_args(argv)
    if a.iters < 1 or a.every < 1 or a.heldout < 2 or a.error_samples < 2 or a.calib_samples < a.batch_size:
        p.error("--iters and --every must be >= 1, --heldout and --error-samples >= 2, --calib-samples >= --batch-size")
    return a


def _blocks(spec: str, n: int) -> list[int]:
    named = {"first": 0, "middle": n // 2, "last": n - 1}
    if spec == "all":
        return list(range(n))
    out = []
    for t in spec.split(","):
        t = t.strip()
        i = named.get(t, None)
        if i is None:
            try:
                i = int(t)
            except ValueError:
                raise UserError(f"--blocks {spec!r}: give block indices, first, middle, last or all.") from None
        if not 0 <= i < n:
            raise UserError(f"--blocks {spec!r}: the model has blocks 0..{n - 1}.")
        if i not in out:
            out.append(i)
    return out


BASE_SETTINGS = ("iters", "batch_size", "heldout_samples", "error_samples")   # every run sets these


def _settings(args, methods: list[str]) -> dict:
    from bench.cli.args import _checked_overrides  # the CLI's own KEY=VALUE parsing and key check
    extra = _checked_overrides(args.set, methods)
    return dict(zip(BASE_SETTINGS, (args.iters, args.batch_size, args.heldout, args.error_samples))) | extra


def _calibration_file(path: str, n: int, seq: int):
    """Calibration windows tokenized elsewhere: the first n rows of input_ids [rows, seq] in `path`."""
    from safetensors import safe_open

    from lrq.methods import Calibration
    with safe_open(path, framework="pt") as f:
        ids = f.get_tensor("input_ids").long()
        desc = json.loads((f.metadata() or {}).get("description", "{}"))
    if ids.shape[0] < n or ids.shape[1] != seq:
        raise UserError(f"--calib-file {path}: {tuple(ids.shape)} windows, {n} x {seq} needed.")
    return Calibration(ids[:n], desc | {"file": Path(path).name, "n_samples": n, "seq_len": seq})


def run(args) -> dict:
    from bench.evaluations.data import calibration_set, resolve_data_dir
    from bench.common.cache import cache_root
    from bench.common.models import load_model
    from bench.common.provenance import git_revision, hardware, versions
    from lrq.arch import decoder_blocks
    from lrq.blockwise import capture_block_inputs
    from lrq.methods import get_method
    from lrq import precision
    from lrq.schemes import get_scheme

    if args.threads:
        torch.set_num_threads(args.threads)
    dev = torch.device(args.device)
    scheme = get_scheme(args.scheme)
    if scheme.static_activations:
        raise UserError(f"--scheme {args.scheme}: static activation ranges need the whole model's calibration pass, "
                        f"which this per-block study does not make; use a weight-only or per-token scheme "
                        f"(w3a16, w4a16, w4a8, or their -g128 forms).")
    methods = [m.strip() for m in args.methods.split(",") if m.strip()]
    objs = {m: get_method(m, device=dev) for m in methods}
    for m, o in objs.items():
        if not hasattr(o, "curve_every"):
            raise UserError(f"--methods: {m} is not trained block by block; choose among lrq, flexround, omniquant.")
    settings = _settings(args, methods)
    if args.precision == "bf16":   # the paper preset trains in float32 (autocast off): bf16 asks for it on
        settings.setdefault("autocast", "true")
    # train_precision=authors as the engine's quantize runs it: the model on the fp16 grid, and the chain's
    # inputs, the full-precision targets and the curve's errors under fp16 autocast (the training steps decide
    # their own autocast). --set gives every method of a run the same value, so one chain serves them all.
    authors = any(o.resolve(scheme, o.config("paper", settings)).train_precision == "authors" for o in objs.values())
    loaded = load_model(args.model)
    model = loaded.model.to(dev)
    fp16 = precision.authors_fp16_model(model, dev) if authors else contextlib.nullcontext()
    blocks = decoder_blocks(model)
    chosen = _blocks(args.blocks, len(blocks))
    n_total = args.calib_samples + args.heldout
    if args.calib_file:
        calib = _calibration_file(args.calib_file, n_total, args.seq_len)
    else:
        calib = calibration_set(loaded.tokenizer, resolve_data_dir(args.data_dir), "c4", n_total, args.seq_len,
                                seed=args.seed, sampling="sequential")
    config = {"model": args.model, "scheme": args.scheme, "methods": methods, "blocks": chosen,
              "settings": settings, "calibration": calib.description, "train_windows": args.calib_samples,
              "heldout_windows": args.heldout, "every": args.every, "seed": args.seed, "device": str(dev)}
    if authors:   # absent otherwise, so that results stored before it existed still match their configuration
        config["chain"] = "fp16 model, inputs and targets under fp16 autocast"
    if args.precision != "fp32":   # absent at fp32 (every study before the option): their configurations still match
        config["precision"] = f"{args.precision} autocast over float32 weights in the training steps"
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / "figure2.json"
    res = json.loads(path.read_text()) if path.exists() else {}
    # results are kept per (block, method): a run over other blocks of the same configuration adds to them
    strip = lambda c: {k: v for k, v in _comparable(c).items() if k != "blocks"}  # noqa: E731
    if strip(res.get("config")) != strip(config):
        res = {"config": config, "results": {}}
    res["config"]["blocks"] = sorted(set(res["config"].get("blocks", [])) | set(chosen))
    for r in res["results"].values():   # results kept from an earlier run keep that run's machine and revision
        if not r.get("provenance") and res.get("provenance"):
            r["provenance"] = res["provenance"]
    res["provenance"] = {"versions": versions(), "hardware": hardware(), "git": git_revision(),
                         "threads": torch.get_num_threads()}
    todo = [(b, m) for b in chosen for m in methods if f"{b}/{m}" not in res["results"]]
    if not todo:
        return res
    state_dir = Path(args.state_dir) if args.state_dir else cache_root() / "figure2-state"
    state_dir.mkdir(parents=True, exist_ok=True)
    started, last = time.monotonic(), 0.0

    def out_of_time() -> bool:
        return bool(args.budget_s) and time.monotonic() - started + last > args.budget_s

    # the full-precision chain's inputs to every chosen block, and that block's full-precision outputs
    with fp16, torch.no_grad():
        buf, kw = capture_block_inputs(model, calib.input_ids.to(dev))
        x = buf.data[:].clone()
        for i in range(max(chosen) + 1):
            y = torch.empty_like(x)
            for a in range(0, len(x), 8):
                o = blocks[i](x[a:a + 8], **kw[i])
                y[a:a + 8] = o[0] if isinstance(o, tuple) else o
            if i in chosen and any(b == i for b, _ in todo):
                for b, m in [t for t in todo if t[0] == i]:
                    if out_of_time():
                        print(f"budget of {args.budget_s:.0f} s reached before block {b} {m}: stopping; a rerun "
                              f"continues here", flush=True)
                        return res
                    method = objs[m]
                    method.curve_every = args.every
                    cfg = method.resolve(scheme, method.config("paper", settings))
                    key = hashlib.sha256(dumps_json([strip(res["config"]), b, m, dict(cfg)],
                                                    sort_keys=True, default=str).encode()).hexdigest()[:24]
                    method.train_state_path = state_dir / f"{key}.pt"
                    method.train_state_key = key
                    ctx = SimpleNamespace(index=i, n_blocks=len(blocks), block=copy.deepcopy(blocks[i]),
                                          q_inputs=SimpleNamespace(data=x), fp_targets=SimpleNamespace(data=y),
                                          kwargs=kw[i], stats={})
                    t0 = time.perf_counter()
                    with torch.enable_grad():
                        out = method._reconstruct_block(ctx, scheme, cfg, {}, args.calib_samples, args.seed)
                    # the wall time of the training's earlier processes, if it resumed, is counted too
                    earlier = out["resumed"][-1]["train_s_before"] if out.get("resumed") else 0.0
                    res["results"][f"{b}/{m}"] = {"block": b, "method": m, "resolved": dict(cfg),
                                                  "n_learnable": out["n_learnable"], "curve": out["curve"],
                                                  "wall_s": earlier + time.perf_counter() - t0,
                                                  "provenance": res["provenance"]}
                    if out.get("resumed"):
                        res["results"][f"{b}/{m}"]["resumed_at_steps"] = [r["step"] for r in out["resumed"]]
                    atomic_write_text(path, dumps_json(res, indent=1, default=str))
                    method.train_state_path.unlink(missing_ok=True)
                    last = time.perf_counter() - t0
                    print(f"block {b} {m}: {len(out['curve'])} points, {last:.0f} s", flush=True)
            x = y
    return res


def _comparable(config: dict | None) -> dict:
    """A study's configuration as compared for resuming and merging: the calibration windows by their tokens'
    hash where it is recorded, not by the path they were read from (`../shared/data` on one machine,
    `/work/shared/data` on another: the same windows)."""
    c = dict(config or {})
    calib = c.get("calibration")
    if isinstance(calib, dict) and calib.get("tokens_sha256"):
        c["calibration"] = {k: v for k, v in calib.items() if k != "source"}
    return c


def merge(dirs: list[str], out: Path) -> dict:
    """Join figure2.json files whose configurations agree but for the methods and blocks (runs made apart) and
    for settings only one run's methods have (e.g. LRQ's rank_rule beside a FlexRound run); each result keeps
    its own resolved settings. `DIR:METHOD[,METHOD]` takes only those methods' results from DIR (FlexRound's
    block 0 from a study whose LRQ ran under another rank rule, say). A (block, method) given twice is refused."""
    parts = []
    for d in dirs:
        folder, _, only = d.partition(":") if not Path(d).exists() else (d, "", "")
        path = Path(folder) / "figure2.json"
        if not path.exists():
            raise UserError(f"--merge: {path} does not exist; give the --out folders of finished runs.")
        r = json.loads(path.read_text())
        if only:
            keep = [m.strip() for m in only.split(",") if m.strip()]
            absent = [m for m in keep if m not in r["config"]["methods"]]
            if absent:
                raise UserError(f"--merge: {folder} has no {', '.join(absent)} results (its methods: "
                                f"{', '.join(r['config']['methods'])}).")
            r["config"] = dict(r["config"], methods=keep)
            r["results"] = {k: v for k, v in r["results"].items() if v["method"] in keep}
        r["config"]["blocks"] = sorted({v["block"] for v in r["results"].values()})   # the blocks measured
        parts.append(r)
    from lrq.methods import get_method

    def keys_of(config) -> set:      # the settings any of a run's methods has
        return set().union(*(get_method(m).config("paper") for m in config["methods"]))

    strip = lambda c: {k: v for k, v in _comparable(c).items() if k not in ("methods", "settings", "blocks")}  # noqa: E731
    base = strip(parts[0]["config"])
    settings: dict = {}
    for d, r in zip(dirs, parts):
        if strip(r["config"]) != base:
            diff = sorted(k for k in set(base) | set(strip(r["config"])) if base.get(k) != strip(r["config"]).get(k))
            raise UserError(f"--merge: {d} was run with a different configuration ({', '.join(diff)}); only the "
                            f"methods and blocks may differ between the runs joined.")
        # a setting may differ only where it belongs to one run's methods alone (rank_rule is LRQ's)
        for d0, r0 in zip(dirs, parts):
            shared = keys_of(r["config"]) & keys_of(r0["config"])
            a, b = r["config"]["settings"], r0["config"]["settings"]
            diff = sorted(k for k in shared & (set(a) | set(b)) if a.get(k) != b.get(k))
            if diff:
                raise UserError(f"--merge: {d} and {d0} were run with a different configuration (settings "
                                f"{', '.join(diff)}, which both runs' methods have); only the methods, and settings "
                                f"that belong to one run's methods alone, may differ between the runs joined.")
        settings.update(r["config"]["settings"])
    seen: dict[str, str] = {}
    for d, r in zip(dirs, parts):
        for k in r["results"]:
            if k in seen:
                raise UserError(f"--merge: the result {k} appears in more than one run ({seen[k]} and {d}); "
                                f"join runs of distinct (block, method) results, or take one method of a run "
                                f"with DIR:METHOD.")
            seen[k] = d
    methods = list(dict.fromkeys(m for r in parts for m in r["config"]["methods"]))
    blocks = sorted({b for r in parts for b in r["config"]["blocks"]})
    res = {"config": base | {"methods": methods, "settings": settings, "blocks": blocks}, "results": {},
           "merged_from": [str(d) for d in dirs], "provenance_of_parts": [r.get("provenance") for r in parts],
           "provenance": parts[0]["provenance"]}
    for r in parts:   # each result keeps the machine and revision it was measured on
        res["results"].update({k: {"provenance": r.get("provenance")} | v for k, v in r["results"].items()})
    out.mkdir(parents=True, exist_ok=True)
    atomic_write_text(out / "figure2.json", dumps_json(res, indent=1, default=str))
    return res


def summary(res: dict) -> list[dict]:
    """Per block: each method's final calibration and held-out errors (with 95 % intervals across windows
    where the windows were kept), and LRQ / FlexRound at the end: the ratio of the means, and the geometric
    mean of the per-window ratios on the same windows with its interval."""
    from bench.evaluations import stats as S
    rows = []
    by_block: dict = {}
    for r in res["results"].values():
        by_block.setdefault(r["block"], {})[r["method"]] = r
    for b in sorted(by_block):
        ms = by_block[b]
        row = {"block": b}
        for m, r in ms.items():
            last = r["curve"][-1]
            row[m] = {"calib": last["calib"], "heldout": last["heldout"],
                      "calib_min": min(p["calib"] for p in r["curve"]),
                      "heldout_min": min(p["heldout"] for p in r["curve"]), "steps": last["step"],
                      "calib_ci": S.mean_interval(last.get("calib_windows", [])),
                      "heldout_ci": S.mean_interval(last.get("heldout_windows", []))}
        if "lrq" in ms and "flexround" in ms:
            row["lrq_over_flexround"] = {k: row["lrq"][k] / row["flexround"][k] for k in ("calib", "heldout")}
            for k in ("calib", "heldout"):
                a = ms["lrq"]["curve"][-1].get(f"{k}_windows", [])
                b = ms["flexround"]["curve"][-1].get(f"{k}_windows", [])
                ok = len(a) == len(b) and all(x > 0 and y > 0 for x, y in zip(a, b))
                row["lrq_over_flexround"][f"{k}_paired"] = S.ratio_interval(a, b) if ok else None
        rows.append(row)
    return rows


def _where(res: dict, result: dict) -> str:
    """A result's wall time and the machine it was measured on (its own provenance, else its run's)."""
    from bench.common.provenance import cpu_label
    prov = result.get("provenance") or res["provenance"]
    wall = result.get("wall_s")
    resumed = result.get("resumed_at_steps")
    return (f"{wall:,.0f} s, " if wall else "") + f"{cpu_label(prov['hardware'])}, {prov['threads']} thread(s), " \
        f"{short_revision(prov['git'])}" + (f", resumed at step {', '.join(map(str, resumed))}" if resumed else "")


def markdown(res: dict) -> str:
    from bench.evaluations import stats as S
    c = res["config"]
    s = c["settings"]
    rows = summary(res)
    extra = {k: v for k, v in s.items() if k not in BASE_SETTINGS}
    lines = ["# Figure 2: calibration vs held-out block error during training", "",
             f"{c['model']}, {c['scheme']}, blocks {', '.join(map(str, c['blocks']))} (each on the full-precision "
             f"chain's inputs); {s['iters']} steps at batch {s['batch_size']}; {c['train_windows']} x "
             f"{c['calibration']['seq_len']} C4 training windows in order, {c['heldout_windows']} held-out windows "
             f"never trained on; errors on {s['error_samples']} windows each side every {c['every']} steps. "
             f"Code {', '.join(dict.fromkeys(short_revision(p['git']) for p in res.get('provenance_of_parts') or [res['provenance']]))}"
             f"; each row's machine and wall time in its last column.", "",
             *([f"Settings beyond the paper preset: {', '.join(f'{k}={v}' for k, v in sorted(extra.items()))} "
                "(each applies to the methods that have it).", ""] if extra else []),
             "Errors at the end with their 95 % intervals across windows (t, over the windows measured).", "",
             "| block | method | steps | calibration error (end) | held-out error (end) | held-out (lowest) | "
             "wall time, where |",
             "|---|---|---|---|---|---|---|"]
    ci = lambda v, k: (f"{v[k]:.4g} [{v[k + '_ci'][1]:.4g}, {v[k + '_ci'][2]:.4g}]" if v.get(k + "_ci")
                       else f"{v[k]:.4g}")
    for r in rows:
        for m in c["methods"]:
            if m in r:
                v, where = r[m], _where(res, res["results"][f"{r['block']}/{m}"])
                lines.append(f"| {r['block']} | {m} | {v['steps']} | {ci(v, 'calib')} | {ci(v, 'heldout')} | "
                             f"{v['heldout_min']:.4g} | {where} |")
    ratios = [r["lrq_over_flexround"] for r in rows if "lrq_over_flexround" in r]
    if ratios:
        lines.append("")
        for k, name in (("calib", "calibration"), ("heldout", "held-out")):
            per = ", ".join(f"{x[k]:.3f}" for x in ratios)
            ci = S.ratio_interval([x[k] for x in ratios], [1.0] * len(ratios))
            lines.append(f"- LRQ / FlexRound {name} error at the end, per block: {per}"
                         + (f"; geometric mean {ci[0]:.3f} [{ci[1]:.3f}, {ci[2]:.3f}] (95 %, over blocks)" if ci else ""))
            paired = [(r["block"], r["lrq_over_flexround"].get(f"{k}_paired")) for r in rows
                      if "lrq_over_flexround" in r]
            paired = [(b, p) for b, p in paired if p]
            if paired:
                lines.append(f"- LRQ / FlexRound {name} error at the end, window by window on the same windows "
                             f"(geometric mean of the per-window ratios, 95 % interval across windows): "
                             + "; ".join(f"block {b} {p[0]:.3f} [{p[1]:.3f}, {p[2]:.3f}]" for b, p in paired))
    return "\n".join(lines) + "\n"


def charts(res: dict) -> list[dict]:
    """One SVG per block: calibration and held-out error of every method over the training steps."""
    from bench.reports.html_report import lines_svg
    charts = []
    by_block: dict = {}
    for r in res["results"].values():
        by_block.setdefault(r["block"], {})[r["method"]] = r
    for b in sorted(by_block):
        series = {}
        for m, r in by_block[b].items():
            series[f"{m} calibration"] = [p["calib"] for p in r["curve"]]
            series[f"{m} held-out"] = [p["heldout"] for p in r["curve"]]
        last = max(p["step"] for r in by_block[b].values() for p in r["curve"])
        charts.append({"block": b, "svg": lines_svg(series, f"training step (0 to {last}, every "
                                                            f"{res['config']['every']})", "block output error")})
    return charts


def html(res: dict) -> str:
    from jinja2 import Environment, select_autoescape

    env = Environment(autoescape=select_autoescape(default=True, default_for_string=True))
    tpl = env.from_string("""<!doctype html><html><head><meta charset="utf-8"><title>Figure 2</title></head>
<body style="font-family:sans-serif;max-width:1100px;margin:2em auto"><h1>Figure 2: calibration vs held-out block
error</h1><pre>{{ md }}</pre>{% for c in charts %}<h2>Block {{ c.block }}</h2>{{ c.svg | safe }}{% endfor %}
</body></html>""")
    return tpl.render(md=markdown(res), charts=charts(res))


def main(argv=None) -> int:
    args = parse_args(argv)
    out = Path(args.out)
    if args.merge:
        res = merge(args.merge, out)
    else:
        from lrq import precision
        with precision.use(precision.Precision.decide(args.precision, args.device)):
            res = run(args)
    atomic_write_text(out / "figure2.md", markdown(res))
    atomic_write_text(out / "figure2.html", html(res))
    print(markdown(res))
    return 0


if __name__ == "__main__":
    from bench.studies import run_main
    run_main(main, "python -m bench.studies.figure2")
