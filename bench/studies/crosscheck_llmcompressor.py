"""Cross-check our GPTQ, AWQ and SmoothQuant against llm-compressor's: ordinary cells, side by side.

    python -m bench.studies.crosscheck_llmcompressor setup-venv            # once: .venv-llmc (about 2 minutes)
    OMP_NUM_THREADS=1 TQDM_DISABLE=1 python -m bench.studies.crosscheck_llmcompressor run \\
        --data-dir ../shared/data --calib-samples 64 --calib-seq-len 512 --max-eval-tokens 40960

Each comparison is two cells of the results store with the same model, scheme, calibration windows (the
same seeded draw of C4) and evaluation windows: ours (`gptq`, `awq`, `smoothquant` with the overrides that
match llm-compressor's settings where we have them) and llm-compressor's through its adapter method
(`llmc-gptq`, `llmc-awq`, `llmc-smoothquant`: baselines/llmc.py runs it in its own environment and loads
its export back). The cells run through the harness (bench.run.sweep: stored as they finish, reused on a
rerun), so they are reported and gated like any other; this study only chooses the pairs and writes
the side-by-side report (`--out`: Markdown and JSON) with every known difference between the two setups
and, because both perplexities come from the same windows, the paired ratio ours / theirs with its 95 %
interval from the per-window NLL differences.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from baselines.llmc import setup_venv
from bench.common.provenance import short_revision
from lrq.errors import UserError
from lrq.io import dumps_json

Z95 = 1.959963984540054


@dataclass(frozen=True)
class Variant:
    name: str                      # CLI name
    scheme: str                    # our scheme (lrq/schemes.py)
    ours: str                      # our method
    ours_overrides: dict[str, Any]  # chosen to match llm-compressor's settings
    theirs: str | None             # the adapter method (None: a reference row of ours only)
    theirs_overrides: dict[str, Any]
    mismatches: tuple[str, ...]    # every known difference between the two setups


# Differences that hold for every comparison.
COMMON_MISMATCHES = (
    "precision: llm-compressor runs the model in float32 (its calibration forwards and searches); ours runs "
    "block forwards under bf16 autocast (our `bf16` setting, the quick preset), with GPTQ's algebra, Hessians "
    "and the AWQ 8-bit search in float32",
    "environment: llm-compressor's venv has transformers 5.17 (its pin, <=5.17.0), ours 5.24; same torch 2.13.0 "
    "CPU build, same thread count",
    "calibration batches: llm-compressor sees the windows one per batch (its default batch_size=1); ours in "
    "batches of 8 (sums over the same tokens)",
    "ragged groups: 576 input columns are not a multiple of 128; llm-compressor refuses strategy 'group' "
    "there, so its 'block' strategy with block_structure [1, 128] is used: per row, 128 columns, a last "
    "block of 64 zero-padded for min/max (the same grid as our groups: our min/max also include 0)",
    "quantization time: ours is the method's call; llm-compressor's cell also saves the model for its "
    "environment and loads the export back (its own oneshot time is the stat llmc_oneshot_s)",
)


def variants(alpha: float = 0.8, n_samples: int = 64) -> dict[str, Variant]:
    """The comparisons, by CLI name."""
    gptq_common = (
        "true-sequential: ours quantizes q/k/v, then o_proj on the quantized q/k/v's output, then gate/up, "
        "then down_proj (each Hessian from inputs through the already-quantized part of the block); "
        "llm-compressor collects all seven Hessians of a decoder layer in one pass on its unquantized "
        "weights. Both feed the next layer the quantized layer's output",
        "dead input columns (zero Hessian diagonal): llm-compressor zeroes their weights, ours keeps them",
        "dampening retries: ours raises the dampening x10 and retries when Cholesky fails, llm-compressor "
        "falls back to round-to-nearest for that layer",
    )
    return {
        "gptq": Variant(
            "gptq", "w4a16-g128", "gptq", {"damp": 0.01, "block_size": 128, "act_order": True},
            "llmc-gptq", {"block_size": 128, "dampening_frac": 0.01, "actorder": "static"},
            gptq_common + (
                "act-order: both order columns by decreasing Hessian diagonal and fit group scales/zeros up "
                "front on the original weights in natural column order (llm-compressor 'static', its default; "
                "ours act_order with static groups)",)),
        "gptq-noact": Variant(
            "gptq-noact", "w4a16-g128", "gptq", {"damp": 0.01, "block_size": 128, "act_order": False},
            "llmc-gptq", {"block_size": 128, "dampening_frac": 0.01, "actorder": "none"},
            gptq_common + (
                "group scales without act-order: llm-compressor 0.14 fits every group's scale/zero up front on "
                "the original weights; ours fits each group when GPTQ reaches its first column, on the weights "
                "as updated so far (the GPTQ paper's and reference code's default)",)),
        "awq": Variant(
            "awq", "w4a16-g128", "awq",
            {"n_grid": 20, "scale_vo": False, "clip": False, "n_samples": n_samples, "search_tokens": 0},
            "llmc-awq", {"duo_scaling": False, "n_grid": 20},
            ("scale grid: llm-compressor tries ratio = i / (n_grid - 1), i = 0..19 (0 to 1 inclusive); ours "
             "i / n_grid (0 to 0.95; `grid=closed` is theirs, see bench/studies/awq_gap.py)",
             "scales: both s = mean|x|^ratio normalised by sqrt(max(s) min(s)) (duo scaling off on their side: "
             "with it on, its weight statistic cannot reshape 576 columns into blocks of 128)",
             "v_proj -> o_proj: skipped on both sides (llm-compressor skips it when shapes differ, as under GQA; "
             "ours `scale_vo=false`); ours can scale it exactly under GQA (its default)",
             "weight clipping search: llm-compressor's AWQ has none; ours switched off (`clip=false`)",
             "chain: llm-compressor feeds the next layer the scaled, still floating-point layer's output; ours "
             "the quantized block's output (`chain=float` is theirs, see bench/studies/awq_gap.py)",
             f"loss: both mean squared error of the inspected module's output over every calibration token "
             f"(ours `search_tokens=0`, `n_samples={n_samples}`)",
             "llm-compressor on a CPU-only machine: its AWQ pins cached activations in page-locked memory, which "
             "needs an accelerator; the worker makes that pinning a no-op (no effect on the numbers)")),
        "smoothquant": Variant(
            "smoothquant", "w8a8", "smoothquant", {"alpha": alpha, "pairs": "qkv,gate_up"},
            "llmc-smoothquant", {"smoothing_strength": alpha},
            (f"alpha {alpha} on both sides; pairs input_layernorm -> q/k/v and post_attention_layernorm -> "
             "gate/up on both (their default mappings for Llama)",
             "activation statistic: llm-compressor uses the channel's range max - min and twice the weights' "
             "max|W|; ours max|X| and max|W| (the paper's): a constant factor for channels symmetric about 0",
             "static activation ranges: both the global min/max over every calibration token (their observer "
             "static_minmax). MEASURED (stop 10): llm-compressor's ranges for the smoothed linears (q/k/v, "
             "gate/up) equal the UNSMOOTHED model's ranges, so its observers saw activations from before the "
             "smoothing was folded in; this, not the smoothing formula, makes the perplexity gap",
             "rounding order: compressed-tensors rounds x / s + zp, ours round(x / s) + z: the same grid, a few "
             "elements per tensor differ (0.3-0.5 % in perplexity, measured in stop 10)",
             "weights: 8-bit per output channel, asymmetric, min/max on both sides")),
        "rtn": Variant("rtn", "w4a16-g128", "rtn", {}, None, {}, ("reference row: ours only",)),
    }


DEFAULT_VARIANTS = ("rtn", "gptq", "awq", "smoothquant")


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


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m bench.studies.crosscheck_llmcompressor",
                                description="Cross-check our GPTQ/AWQ/SmoothQuant against llm-compressor.")
    sub = p.add_subparsers(dest="command", required=True)
    r = sub.add_parser("run", help="run both sides as cells of the results store, write the report")
    r.add_argument("--model", default="smollm2-135m")
    r.add_argument("--variants", default=",".join(DEFAULT_VARIANTS), help=f"comma-separated, from {', '.join(variants())}")
    r.add_argument("--data-dir", default=None)
    r.add_argument("--calib-samples", type=int, default=64)
    r.add_argument("--calib-seq-len", type=int, default=512)
    r.add_argument("--seed", type=int, default=0)
    r.add_argument("--datasets", default="wikitext2,c4")
    r.add_argument("--max-eval-tokens", type=int, default=40960, help="0: the whole texts")
    r.add_argument("--eval-seq-len", type=int, default=2048)
    r.add_argument("--alpha", type=float, default=0.8, help="SmoothQuant migration strength, both sides")
    r.add_argument("--llmc-venv", default=".venv-llmc")
    r.add_argument("--results", default=None, help="results store (default ~/.cache/lrq-bench/crosscheck.sqlite)")
    r.add_argument("--out", type=Path, default=None, help="report folder (default: beside the store)")
    r.add_argument("--no-fp", action="store_true", help="skip the floating-point reference row")
    r.add_argument("--force", action="store_true", help="recompute cells already in the store")
    s = sub.add_parser("setup-venv", help="create the llm-compressor virtual environment")
    s.add_argument("--llmc-venv", default=".venv-llmc")
    s.add_argument("--python", default="python3.11")
    args = p.parse_args(argv)
    if args.command == "run":
        known = variants(args.alpha, args.calib_samples)
        args.variant_list = [v.strip() for v in args.variants.split(",") if v.strip()]
        bad = [v for v in args.variant_list if v not in known]
        if bad or not args.variant_list:
            p.error(f"unknown variant(s) {', '.join(bad) or '(none given)'}: choose from {', '.join(known)}")
        args.dataset_list = [d.strip() for d in args.datasets.split(",") if d.strip()]
        if any(d not in ("wikitext2", "c4") for d in args.dataset_list) or not args.dataset_list:
            p.error("--datasets: choose from wikitext2, c4")
        if args.calib_samples < 1 or args.calib_seq_len < 2:
            p.error("--calib-samples must be >= 1 and --calib-seq-len >= 2")
        if args.max_eval_tokens and args.max_eval_tokens < args.eval_seq_len:
            p.error("--max-eval-tokens must be at least --eval-seq-len (one window)")
        if not 0.0 <= args.alpha <= 1.0:
            p.error("--alpha must be in [0, 1]")
    return args


def cells(args: argparse.Namespace) -> list[tuple[str, str, Any]]:
    """(variant, side, settled cell) for every comparison asked, the FP reference first."""
    from bench.run.cell import FP, CalibSettings, EvalSettings, Request, settle
    calib = CalibSettings("c4", args.calib_samples, args.calib_seq_len, "random")
    common = dict(model=args.model, datasets=tuple(args.dataset_list), calib=calib, seed=args.seed,
                  eval=EvalSettings(args.eval_seq_len, False, args.max_eval_tokens or None), data_dir=args.data_dir)
    out = [] if args.no_fp else [("fp", "fp", settle(Request(method=FP, scheme=FP, **common)))]
    for name in args.variant_list:
        v = variants(args.alpha, args.calib_samples)[name]
        if v.theirs:
            out.append((name, "llm-compressor", settle(Request(method=v.theirs, scheme=v.scheme,
                                                               overrides=v.theirs_overrides | {"venv": args.llmc_venv},
                                                               **common))))
        out.append((name, "ours", settle(Request(method=v.ours, scheme=v.scheme, overrides=v.ours_overrides,
                                                 **common))))
    return out


def collect(rows, pairs) -> list[dict[str, Any]]:
    """One entry per (variant, side): the stored perplexities (with their windows), quantization cost and
    stats of its cell; the comparisons pair each 'ours' with its 'llm-compressor' over the same windows."""
    by_key: dict[str, list] = {}
    for r in rows:
        by_key.setdefault(r.unit_key, []).append(r)
    out = []
    for variant, side, cell in pairs:
        entry: dict[str, Any] = {"variant": variant, "side": side, "method": cell.method_name,
                                 "scheme": cell.scheme_name, "config": dict(cell.config), "ppl": {}, "window_nll": {},
                                 "quant": {}, "stats": {}}
        for ds in cell.datasets:
            for r in by_key.get(cell.keys[ds], []):
                if r.metric == "ppl":
                    entry["ppl"][ds] = r.value
                    entry["window_nll"][ds] = r.config.get("eval", {}).get("window_nll")
        for r in by_key.get(cell.keys["quant"], []):
            if r.metric in ("quant_time_s", "quant_peak_rss_bytes"):
                entry["quant"][r.metric] = r.value
            elif r.metric != "bits_per_weight":
                entry["stats"][r.metric] = r.value
            entry["calibration"] = r.config.get("calibration")
            entry["llmc"] = (r.config.get("method_stats") or {}).get("llmc")
        out.append(entry)
    for e in out:
        if e["side"] != "ours":
            continue
        theirs = next((t for t in out if t["variant"] == e["variant"] and t["side"] == "llm-compressor"), None)
        if theirs is None:
            continue
        e["vs_llmc"] = {}
        for ds in e["ppl"]:
            a, b = e["window_nll"].get(ds), theirs["window_nll"].get(ds)
            e["vs_llmc"][ds] = paired_ratio(a, b) if a and b else {"ratio": e["ppl"][ds] / theirs["ppl"][ds]}
    return out


def markdown(report: dict[str, Any]) -> str:
    ds = report["datasets"]
    head = (["comparison", "scheme", "side"] + [f"{d} ppl" for d in ds] + [f"{d} ours / theirs (95 % CI)" for d in ds]
            + ["quant wall (s)", "llm-compressor oneshot (s)", "peak RSS (MiB)"])
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]

    def pct(r: dict | None) -> str:
        if not r:
            return "-"
        if "lo" not in r:
            return f"{r['ratio'] - 1:+.2%} (no windows stored)"
        return f"{r['ratio'] - 1:+.2%} [{r['lo'] - 1:+.2%}, {r['hi'] - 1:+.2%}]"
    for e in report["rows"]:
        q = e.get("quant") or {}
        cells = ([e["variant"], e["scheme"], e["side"]] + [f"{e['ppl'][d]:.2f}" if d in e["ppl"] else "-" for d in ds]
                 + [pct((e.get("vs_llmc") or {}).get(d)) for d in ds]
                 + [f"{q['quant_time_s']:.1f}" if q.get("quant_time_s") else "-",
                    f"{e['stats']['llmc_oneshot_s']:.1f}" if e["stats"].get("llmc_oneshot_s") else "-",
                    f"{q['quant_peak_rss_bytes'] / 2**20:,.0f}" if q.get("quant_peak_rss_bytes") else "-"])
        lines.append("| " + " | ".join(cells) + " |")
    llmc_versions = next((e["llmc"]["versions"] for e in report["rows"] if e.get("llmc")), {})
    notes = [f"- **{name}**: " + "; ".join(v["mismatches"]) for name, v in report["variants"].items()]
    return "\n".join([
        f"## {report['title']}", "",
        f"Model {report['model']}; calibration {report['calibration']}; evaluation with our perplexity function "
        f"(bf16 autocast) on {', '.join(ds)} ({report['eval']}); the same windows on both sides, so every ratio "
        f"is paired over them. Cells in {report['results']}; lrq-bench {short_revision(report['git_revision'])}; "
        f"llm-compressor {llmc_versions.get('llmcompressor', '-')}, compressed-tensors "
        f"{llmc_versions.get('compressed-tensors', '-')}, transformers {llmc_versions.get('transformers', '-')} there.",
        "", *lines, "", "Known differences, common to every comparison: " + "; ".join(report["common_mismatches"]) + ".",
        "", *notes, ""])


def run(args: argparse.Namespace) -> dict[str, Any]:
    from dataclasses import asdict

    from bench.run.executor import LocalExecutor
    from bench.common.cache import cache_root
    from bench.common.provenance import git_revision, hardware, versions
    from bench.common.store import ResultStore
    from bench.run.sweep import run_cells
    from lrq.io import atomic_write_text
    pairs = cells(args)
    store = ResultStore(args.results or cache_root() / "crosscheck.sqlite", check=True)
    outcomes = run_cells([c for _, _, c in pairs], store, force=args.force, executor=LocalExecutor(1))
    failed = [f"{o.cell.label()}: {o.error}" for o in outcomes if o.status == "failed"]
    report = {"title": "Cross-check against llm-compressor", "model": args.model, "datasets": args.dataset_list,
              "calibration": f"{args.calib_samples} x {args.calib_seq_len} C4 tokens, seed {args.seed}",
              "eval": f"{args.max_eval_tokens or 'all'} tokens in {args.eval_seq_len}-token windows",
              "results": str(store.path), "git_revision": git_revision(), "versions": versions(),
              "hardware": hardware(), "common_mismatches": list(COMMON_MISMATCHES),
              "variants": {n: asdict(v) for n, v in variants(args.alpha, args.calib_samples).items()
                           if n in args.variant_list},
              "rows": collect(store.rows(latest=True), pairs), "failed": failed}
    out = args.out or store.path.parent / "crosscheck-llmcompressor"
    atomic_write_text(out / "crosscheck_llmcompressor.json", dumps_json(report, indent=2, default=str))
    atomic_write_text(out / "crosscheck_llmcompressor.md", markdown(report))
    print(markdown(report))
    for f in failed:
        print(f"FAILED {f}", file=sys.stderr)
    return report


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        if args.command == "setup-venv":
            return setup_venv(args.llmc_venv, args.python)
        report = run(args)
        return 1 if report["failed"] else 0
    except UserError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    os.environ.setdefault("TQDM_DISABLE", "1")
    sys.exit(main())
