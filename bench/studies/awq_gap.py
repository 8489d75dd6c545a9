"""Where does our AWQ differ from llm-compressor's? An ablation on the cross-check's inputs.

    python -m bench.studies.awq_gap --data-dir ../shared/data                    # every variant, then the report
    python -m bench.studies.awq_gap --data-dir ../shared/data --variants fp32    # one variant

The cross-check (bench/studies/crosscheck_llmcompressor.py, `--variants awq`) compares the two AWQs on one
model and one set of calibration windows. Three known differences between the sides:

- precision: llm-compressor runs its calibration forwards and searches in float32, ours in bf16
  autocast (`bf16=false` switches ours to float32);
- the scale grid: theirs ratio = i / 19 (0 to 1), ours i / 20 (0 to 0.95) (`grid=closed` is theirs);
- the chain: theirs feeds the next layer the scaled, still floating-point layer, ours the quantized
  block (`chain=float` is theirs).

Every variant is a cell of the results store (ours: `awq` with the cross-check's overrides plus the
variant's; theirs: `llmc-awq`, the same cell as the cross-check's), on the same calibration windows,
scored on the full evaluation protocol (the whole WikiText-2 test set, 256 x 2048 tokens of C4); the
store keeps every window's NLL, so each comparison with llm-compressor is paired: the ratio of
perplexities is exp(mean over windows of the NLL difference), with a 95 % interval from the spread of
those differences, on the full texts and on the first 20 windows (the cross-check's slice).
"""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path
from typing import Any

from bench.common.provenance import short_revision
from bench.studies.crosscheck_llmcompressor import paired_ratio, variants as crosscheck_variants
from lrq.errors import UserError
from lrq.io import dumps_json

# Our overrides on top of the cross-check's AWQ row: each switches one difference to llm-compressor's.
VARIANTS: dict[str, dict[str, Any]] = {
    "crosscheck": {},
    "fp32": {"bf16": False},
    "closed-grid": {"grid": "closed"},
    "float-chain": {"chain": "float"},
    "all-three": {"bf16": False, "grid": "closed", "chain": "float"},
}
SLICE_TOKENS = 40960  # the cross-check's evaluation slice


def ppl_of(nlls: list[float]) -> float:
    return math.exp(sum(nlls) / len(nlls))


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m bench.studies.awq_gap", description=__doc__.split("\n")[0])
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--data-dir", default=None)
    p.add_argument("--variants", default=",".join(VARIANTS), help=f"from {', '.join(VARIANTS)}")
    p.add_argument("--datasets", default="wikitext2,c4")
    p.add_argument("--calib-samples", type=int, default=64)
    p.add_argument("--calib-seq-len", type=int, default=512)
    p.add_argument("--eval-seq-len", type=int, default=2048)
    p.add_argument("--llmc-venv", default=".venv-llmc")
    p.add_argument("--results", default=None, help="results store (default ~/.cache/lrq-bench/crosscheck.sqlite)")
    p.add_argument("--out", type=Path, default=None, help="report folder (default: beside the store)")
    p.add_argument("--with-fp", action="store_true", help="also score the floating-point model (a reference row)")
    a = p.parse_args(argv)
    a.variant_list = [v.strip() for v in a.variants.split(",") if v.strip()]
    bad = [v for v in a.variant_list if v not in VARIANTS]
    if bad:
        p.error(f"unknown variant(s) {', '.join(bad)}: choose from {', '.join(VARIANTS)}")
    a.dataset_list = [d.strip() for d in a.datasets.split(",") if d.strip()]
    return a


def cells(args: argparse.Namespace) -> list[tuple[str, Any]]:
    """(side, settled cell): llm-compressor's AWQ, each variant of ours, optionally FP."""
    from bench.run.cell import FP, CalibSettings, EvalSettings, Request, settle
    base = crosscheck_variants(n_samples=args.calib_samples)["awq"]
    common = dict(model=args.model, datasets=tuple(args.dataset_list), data_dir=args.data_dir,
                  calib=CalibSettings("c4", args.calib_samples, args.calib_seq_len, "random"),
                  eval=EvalSettings(args.eval_seq_len, False, None))
    out = [("llm-compressor", settle(Request(method=base.theirs, scheme=base.scheme,
                                             overrides=base.theirs_overrides | {"venv": args.llmc_venv}, **common)))]
    out += [(name, settle(Request(method=base.ours, scheme=base.scheme, overrides=base.ours_overrides | VARIANTS[name],
                                  **common))) for name in args.variant_list]
    if args.with_fp:
        out.append(("fp", settle(Request(method=FP, scheme=FP, **common))))
    return out


def report_rows(rows, sides, eval_seq_len: int) -> list[dict[str, Any]]:
    by_key = {r.unit_key: r for r in rows if r.metric == "ppl"}
    cpu = {r.unit_key: r.value for r in rows if r.metric == "quant_time_s"}
    nll = {}
    for side, cell in sides:
        nll[side] = {}
        for ds in cell.datasets:
            r = by_key.get(cell.keys[ds])
            w = None if r is None else r.config.get("eval", {}).get("window_nll")
            if w is None:
                raise UserError(f"{side}: no per-window NLLs stored for {ds} (a store made before they were kept?): "
                                f"rerun with a new --results file.")
            nll[side][ds] = w
    ref = nll["llm-compressor"]
    n_slice = SLICE_TOKENS // eval_seq_len
    out = []
    for side, cell in sides:
        row = {"side": side, "overrides": VARIANTS.get(side), "quant_time_s": cpu.get(cell.keys["quant"]),
               "ppl": {}, "ppl_slice": {}, "vs_llmc": {}, "vs_llmc_slice": {}}
        for ds, w in nll[side].items():
            row["ppl"][ds], row["ppl_slice"][ds] = ppl_of(w), ppl_of(w[:n_slice])
            if side != "llm-compressor":
                row["vs_llmc"][ds] = paired_ratio(w, ref[ds])
                row["vs_llmc_slice"][ds] = paired_ratio(w[:n_slice], ref[ds][:n_slice])
        out.append(row)
    return out


def markdown(report: dict[str, Any]) -> str:
    ds = report["datasets"]
    n = report["slice_windows"]
    head = (["model"] + [f"{d} ppl (full)" for d in ds] + [f"{d} vs llm-compressor (full, 95 % CI)" for d in ds]
            + [f"{d} vs llm-compressor (first {n} windows)" for d in ds] + ["quant (s)"])
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]

    def pct(r: dict) -> str:
        return f"{r['ratio'] - 1:+.2%} [{r['lo'] - 1:+.2%}, {r['hi'] - 1:+.2%}]"
    for r in report["rows"]:
        label = r["side"] if r["overrides"] is None else (
            f"ours {r['side']}" + (" (" + ", ".join(f"{k}={v}" for k, v in r["overrides"].items()) + ")"
                                   if r["overrides"] else ""))
        cells = ([label] + [f"{r['ppl'][d]:.3f}" for d in ds]
                 + [pct(r["vs_llmc"][d]) if d in r["vs_llmc"] else "-" for d in ds]
                 + [pct(r["vs_llmc_slice"][d]) if d in r["vs_llmc_slice"] else "-" for d in ds]
                 + [f"{r['quant_time_s']:.0f}" if r.get("quant_time_s") else "-"])
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join([
        f"## {report['title']}", "",
        f"Model {report['model']}, scheme {report['scheme']}; calibration {report['calibration']}; the cross-check's "
        f"overrides of our quick preset: {', '.join(f'{k}={v}' for k, v in report['base_overrides'].items())}. "
        f"Scored with our perplexity function (bf16 autocast) on the full protocol; the ratios are paired over "
        f"the same windows. Cells in {report['results']}; lrq-bench {short_revision(report['git_revision'])}.", "", *lines, ""])


def run(args: argparse.Namespace) -> dict[str, Any]:
    from bench.run.executor import LocalExecutor
    from bench.common.cache import cache_root
    from bench.common.provenance import git_revision, hardware, versions
    from bench.common.store import ResultStore
    from bench.run.sweep import run_cells
    from lrq.io import atomic_write_text
    sides = cells(args)
    store = ResultStore(args.results or cache_root() / "crosscheck.sqlite", check=True)
    outcomes = run_cells([c for _, c in sides], store, executor=LocalExecutor(1))
    failed = [f"{o.cell.label()}: {o.error}" for o in outcomes if o.status == "failed"]
    if failed:
        raise RuntimeError("; ".join(failed))
    base = crosscheck_variants(n_samples=args.calib_samples)["awq"]
    report = {"title": "AWQ w4a16-g128: our AWQ against llm-compressor's, difference by difference",
              "model": args.model, "scheme": base.scheme, "datasets": args.dataset_list,
              "calibration": f"{args.calib_samples} x {args.calib_seq_len} C4 tokens, seed 0",
              "slice_windows": SLICE_TOKENS // args.eval_seq_len, "base_overrides": base.ours_overrides,
              "rows": report_rows(store.rows(latest=True), sides, args.eval_seq_len), "results": str(store.path),
              "git_revision": git_revision(), "versions": versions(), "hardware": hardware()}
    out = args.out or store.path.parent / "crosscheck-llmcompressor"
    atomic_write_text(out / "awq_gap.json", dumps_json(report, indent=2, default=str))
    atomic_write_text(out / "awq_gap.md", markdown(report))
    print(markdown(report))
    return report


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        run(args)
        return 0
    except UserError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
