"""Where does our AWQ differ from llm-compressor's? An ablation on the cross-check's own inputs.

    python -m bench.studies.awq_gap --data-dir ../shared/data                    # every variant, then the report
    python -m bench.studies.awq_gap --data-dir ../shared/data --variants fp32    # one variant (cached per step)

The cross-check (bench/studies/crosscheck_llmcompressor.py, `--variants awq`) compares the two AWQs on one
model, one set of calibration windows and the first 40,960 tokens of each evaluation set. Its AWQ row
left a C4 gap of +2.0 % with three known differences between the sides not separated:

- precision: llm-compressor runs its calibration forwards and searches in float32, ours in bf16
  autocast (`bf16=false` switches ours to float32);
- the scale grid: theirs ratio = i / 19 (0 to 1), ours i / 20 (0 to 0.95) (`grid=closed` is theirs);
- the chain: theirs feeds the next layer the scaled, still floating-point layer, ours the quantized
  block (`chain=float` is theirs).

This script reads the cross-check's work folder (its calibration windows, checked by hash, and
llm-compressor's exported AWQ model), runs our AWQ with the cross-check's settings and with each
difference switched to llm-compressor's choice, alone and all together, and scores every model on the
full evaluation protocol (the whole WikiText-2 test set, 256 x 2048 tokens of C4) as well as on the
cross-check's 20-window slice. Because every model is scored on the same windows, each comparison
with llm-compressor is paired: the ratio of perplexities is exp(mean over windows of the NLL
difference), and its 95 % interval comes from the spread of those per-window differences. A gap
whose interval holds 1.0 is not told apart from noise by this much text.

Steps are cached in the work folder (`steps/gap-*.json`, keyed by everything that determines them);
the report goes to --out as awq_gap.md and awq_gap.json.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import sys
from pathlib import Path
from typing import Any

from bench.studies.crosscheck_llmcompressor import (EXPORT_FILE, CrosscheckError, Meter, apply_llmc_export, cached_step,
                                            eval_streams, read_calibration, variants)

# Our overrides on top of the cross-check's AWQ row: each switches one difference to llm-compressor's.
VARIANTS: dict[str, dict[str, Any]] = {
    "crosscheck": {},
    "fp32": {"bf16": False},
    "closed-grid": {"grid": "closed"},
    "float-chain": {"chain": "float"},
    "all-three": {"bf16": False, "grid": "closed", "chain": "float"},
}
SLICE_TOKENS = 40960  # the cross-check's evaluation slice
Z95 = 1.959963984540054


def paired_ratio(ours: list[float], theirs: list[float]) -> dict[str, float]:
    """ppl(ours) / ppl(theirs) over the same windows, with a 95 % interval from the per-window NLL
    differences (normal approximation of their mean)."""
    if len(ours) != len(theirs) or not ours:
        raise ValueError(f"paired comparison needs the same non-empty windows ({len(ours)} vs {len(theirs)})")
    d = [a - b for a, b in zip(ours, theirs)]
    n = len(d)
    mean = sum(d) / n
    sd = math.sqrt(sum((x - mean) ** 2 for x in d) / (n - 1)) if n > 1 else float("nan")
    se = sd / math.sqrt(n)
    return {"ratio": math.exp(mean), "lo": math.exp(mean - Z95 * se), "hi": math.exp(mean + Z95 * se),
            "windows": n, "sd_window_diff": sd}


def ppl_of(nlls: list[float]) -> float:
    return math.exp(sum(nlls) / len(nlls))


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m bench.studies.awq_gap", description=__doc__.split("\n")[0])
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--data-dir", default=None)
    p.add_argument("--variants", default=",".join(VARIANTS), help=f"from {', '.join(VARIANTS)}")
    p.add_argument("--datasets", default="wikitext2,c4")
    p.add_argument("--eval-seq-len", type=int, default=2048)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--workdir", type=Path, default=None, help="the cross-check's (default ~/.cache/lrq-bench/crosscheck-llmc)")
    p.add_argument("--out", type=Path, default=None, help="report folder (default: the work folder)")
    p.add_argument("--with-fp", action="store_true", help="also score the floating-point model (a reference row)")
    p.add_argument("--force", action="store_true")
    a = p.parse_args(argv)
    a.variant_list = [v.strip() for v in a.variants.split(",") if v.strip()]
    bad = [v for v in a.variant_list if v not in VARIANTS]
    if bad:
        p.error(f"unknown variant(s) {', '.join(bad)}: choose from {', '.join(VARIANTS)}")
    a.dataset_list = [d.strip() for d in a.datasets.split(",") if d.strip()]
    return a


def run(args: argparse.Namespace) -> dict[str, Any]:
    import torch
    from bench import data as D
    from bench.models import cache_root, load_model
    from bench.perplexity import perplexity
    from bench.provenance import git_revision, hardware, versions
    from lrq.io import atomic_write_text as write_atomic
    from lrq.methods import Calibration, get_method
    from lrq.schemes import get_scheme

    torch.set_num_threads(args.threads)
    workdir = args.workdir or (cache_root() / "crosscheck-llmc")
    out = args.out or workdir
    ids, calib_meta = read_calibration(workdir)
    export = workdir / "llmc-awq" / EXPORT_FILE
    if not export.is_file():
        raise CrosscheckError(f"no llm-compressor AWQ export at {export}: run the cross-check first "
                              f"(python -m bench.studies.crosscheck_llmcompressor run --variants awq ...)")
    calib = Calibration(ids, calib_meta["description"])
    base = variants(n_samples=int(ids.shape[0]))["awq"]
    scheme, method = get_scheme(base.scheme), get_method(base.method)

    loaded = load_model(args.model)
    tok = loaded.tokenizer
    data_dir = D.resolve_data_dir(args.data_dir)
    D.check_available(args.dataset_list, data_dir)
    loaded.model = None  # every step loads a fresh copy
    eval_ids, eval_desc = eval_streams(tok, args.dataset_list, data_dir, args.eval_seq_len)
    base_key = {"model": loaded.fingerprint, "calib": calib_meta["sha256"], "eval": eval_desc,
                "threads": args.threads}

    def evaluate(model, label: str) -> dict[str, list[float]]:
        return {ds: perplexity(model, t, args.eval_seq_len, desc=f"{label} {ds}")["window_nll"]
                for ds, t in eval_ids.items()}

    def cached(name: str, key: dict, compute) -> dict[str, Any]:
        return cached_step(workdir / "steps" / f"gap-{name}.json", key, compute, args.force, f"[awq-gap] {name}")

    def theirs():
        from safetensors.torch import load_file
        model = load_model(args.model).model
        apply_llmc_export(model, load_file(str(export)), scheme)
        return {"window_nll": evaluate(model, "llmc awq")}

    sides: dict[str, dict[str, Any]] = {}
    for name in args.variant_list:
        overrides = base.ours | VARIANTS[name]
        cfg = method.config("quick", overrides)

        def ours(cfg=cfg, name=name):
            model = load_model(args.model).model
            torch.manual_seed(0)
            with Meter() as m:
                stats = method.quantize(model, scheme, cfg, calib) or {}
            return {"window_nll": evaluate(model, f"ours {name}"), "quant": m.to_dict(), "config": cfg,
                    "stats": {k: v for k, v in stats.items() if isinstance(v, (int, float, str, bool))}}
        sides[name] = cached(f"ours-{name}", base_key | {"step": "ours", "cfg": cfg, "scheme": base.scheme}, ours)
    export_sha = hashlib.sha256(export.read_bytes()).hexdigest()[:16]
    sides["llm-compressor"] = cached("llmc", base_key | {"step": "llmc", "export": export_sha}, theirs)
    if args.with_fp:
        sides["fp"] = cached("fp", base_key | {"step": "fp"},
                             lambda: {"window_nll": evaluate(load_model(args.model).model, "fp")})

    slice_windows = SLICE_TOKENS // args.eval_seq_len
    ref = sides["llm-compressor"]["window_nll"]
    rows = []
    for name, side in sides.items():
        row = {"side": name, "overrides": VARIANTS.get(name), "quant": side.get("quant"),
               "stats": side.get("stats"), "ppl": {}, "ppl_slice": {}, "vs_llmc": {}, "vs_llmc_slice": {}}
        for ds, nlls in side["window_nll"].items():
            row["ppl"][ds] = ppl_of(nlls)
            row["ppl_slice"][ds] = ppl_of(nlls[:slice_windows])
            if name != "llm-compressor":
                row["vs_llmc"][ds] = paired_ratio(nlls, ref[ds])
                row["vs_llmc_slice"][ds] = paired_ratio(nlls[:slice_windows], ref[ds][:slice_windows])
        rows.append(row)
    report = {"title": "AWQ w4a16-g128: our AWQ against llm-compressor's, difference by difference",
              "model": args.model, "scheme": base.scheme, "calibration": calib_meta, "evaluation": eval_desc,
              "slice_windows": slice_windows, "base_overrides": base.ours, "rows": rows,
              "git_revision": git_revision(), "versions": versions(), "hardware": hardware(),
              "threads": args.threads}
    write_atomic(out / "awq_gap.json", json.dumps(report, indent=2, default=str))
    write_atomic(out / "awq_gap.md", markdown(report))
    print(markdown(report))
    return report


def markdown(report: dict[str, Any]) -> str:
    ds = list(report["evaluation"])
    n = report["slice_windows"]
    head = (["model"] + [f"{d} ppl (full)" for d in ds] + [f"{d} vs llm-compressor (full, 95 % CI)" for d in ds]
            + [f"{d} vs llm-compressor (first {n} windows)" for d in ds] + ["quant CPU (s)"])
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]

    def pct(r: dict) -> str:
        return f"{r['ratio'] - 1:+.2%} [{r['lo'] - 1:+.2%}, {r['hi'] - 1:+.2%}]"
    for r in report["rows"]:
        label = r["side"] if r["overrides"] is None else (
            f"ours {r['side']}" + (" (" + ", ".join(f"{k}={v}" for k, v in r["overrides"].items()) + ")"
                                   if r["overrides"] else ""))
        q = r.get("quant") or {}
        cells = ([label] + [f"{r['ppl'][d]:.3f}" for d in ds]
                 + [pct(r["vs_llmc"][d]) if d in r["vs_llmc"] else "-" for d in ds]
                 + [pct(r["vs_llmc_slice"][d]) if d in r["vs_llmc_slice"] else "-" for d in ds]
                 + [f"{q['cpu_s']:.0f}" if q.get("cpu_s") else "-"])
        lines.append("| " + " | ".join(cells) + " |")
    ev = ", ".join(f"{d} {e['tokens']:,} tokens ({e['windows']} x {e['seq_len']})" for d, e in report["evaluation"].items())
    cal = report["calibration"]
    return "\n".join([
        f"## {report['title']}", "",
        f"Model {report['model']}, scheme {report['scheme']}; the cross-check's calibration windows "
        f"({cal['shape'][0]} x {cal['shape'][1]}, sha256 {cal['sha256'][:16]}); cross-check overrides of our quick "
        f"preset: {', '.join(f'{k}={v}' for k, v in report['base_overrides'].items())}. Scored with our "
        f"perplexity function (bf16 autocast) on {ev}; the ratios are paired over the same windows. "
        f"{report['threads']} torch thread(s); lrq-bench {report['git_revision'][:12]}.", "", *lines, ""])


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        run(args)
        return 0
    except CrosscheckError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
