"""Which pairs of cells each metric can tell apart: paired perplexity against paired KL divergence and top-1
agreement, from a results store.

    python -m bench.studies.separation --results STORE [--same-scheme] [--out reports/kl]

For every pair of quantized cells of one model scored on the same windows of a text (same seed, same
evaluation settings and precision), the paired comparison of each metric (bench.evaluations.stats: perplexity as the
ratio exp(mean of per-window NLL differences), KLD and top-1 agreement as the mean per-window difference,
each with its t interval over windows) and whether its 95 % interval excludes no difference. Reports, per
text and metric, the pairs separated and the median relative half-width: for perplexity the half-width of the
ratio's interval (sqrt(hi / lo) - 1), for KLD the half-width over the pair's mean KLD, for top-1 agreement
the half-width in points and over the pair's mean disagreement (1 - agreement). `--same-scheme` keeps only
pairs at one scheme (what a leaderboard column compares).
"""

from __future__ import annotations

import argparse
import itertools
import statistics
import sys
import time


def cells(results: str, methods: set[str] | None = None) -> dict:
    """{(model, seed, precision, text): {(method, scheme): {"nll": [...], "kld": [...], "top1": [...]}}}."""
    from bench.common.store import ResultStore
    out: dict = {}
    for r in ResultStore(results, readonly=True).rows(latest=True):
        if r.method == "fp" or r.metric not in ("ppl", "kld", "top1_agree") or (methods and r.method not in methods):
            continue
        per = ((r.config.get("eval") or {}).get("window_nll") if r.metric == "ppl" else
               (r.config.get("kl") or {}).get("window_kld" if r.metric == "kld" else "window_top1"))
        if not per:
            continue
        group = out.setdefault((r.model, r.seed, r.precision, r.dataset), {})
        name = {"ppl": "nll", "kld": "kld", "top1_agree": "top1"}[r.metric]
        group.setdefault((r.method, r.scheme), {})[name] = list(per)
    return out


def study(results: str, same_scheme: bool, methods: set[str] | None = None) -> dict:
    from bench.evaluations import stats
    texts = {}
    for (model, seed, prec, text), group in sorted(cells(results, methods).items(), key=lambda kv: str(kv[0])):
        res = {m: {"pairs": 0, "separated": 0, "half_widths": []} for m in ("ppl", "kld", "top1")}
        for (a, va), (b, vb) in itertools.combinations(sorted(group.items()), 2):
            if same_scheme and a[1] != b[1]:
                continue
            if not all(k in va and k in vb for k in ("nll", "kld", "top1")):
                continue
            comps = {"ppl": stats.paired_ppl(va["nll"], vb["nll"]), "kld": stats.paired_mean(va["kld"], vb["kld"]),
                     "top1": stats.paired_mean(va["top1"], vb["top1"])}
            if any(c is None or c.lo is None for c in comps.values()):
                continue
            scale = {"ppl": None, "kld": (statistics.fmean(va["kld"]) + statistics.fmean(vb["kld"])) / 2,
                     "top1": 1 - (statistics.fmean(va["top1"]) + statistics.fmean(vb["top1"])) / 2}
            for m, c in comps.items():
                res[m]["pairs"] += 1
                res[m]["separated"] += bool(c.separated)
                hw = (c.hi / c.lo) ** 0.5 - 1 if m == "ppl" else (c.hi - c.lo) / 2 / max(scale[m], 1e-12)
                res[m]["half_widths"].append(hw)
        for m in res:
            hws = res[m].pop("half_widths")
            res[m]["median_rel_half_width"] = statistics.median(hws) if hws else None
        texts[f"{model} {text} ({prec}, seed {seed})"] = {"cells": len(group), "windows": len(next(iter(
            group.values())).get("nll", [])), **res}
    return texts


def render(doc: dict) -> str:
    lines = ["# What separates cells: paired perplexity, KL divergence and top-1 agreement", "",
             f"Store `{doc['store_name']}`, {'same-scheme pairs' if doc['same_scheme'] else 'all pairs'} of "
             f"quantized cells{' of ' + doc['methods'] if doc.get('methods') else ''}; 95 % paired t intervals over windows (bench.evaluations.stats); measured {doc['measured_at']}.",
             "", "| text | cells | windows | metric | pairs | separated | median relative half-width |",
             "|---|---|---|---|---|---|---|"]
    names = {"ppl": "perplexity (ratio)", "kld": "KLD (difference / mean KLD)",
             "top1": "top-1 agreement (difference / mean disagreement)"}
    for text, r in doc["texts"].items():
        for m in ("ppl", "kld", "top1"):
            hw = r[m]["median_rel_half_width"]
            lines.append(f"| {text} | {r['cells']} | {r['windows']} | {names[m]} | {r[m]['pairs']} | "
                         f"{r[m]['separated']} | {'-' if hw is None else f'{hw:.1%}'} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    from pathlib import Path

    from bench.studies import write_study
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--results", required=True, help="the results store (SQLite)")
    ap.add_argument("--same-scheme", action="store_true", help="only pairs of cells at the same scheme")
    ap.add_argument("--methods", default=None, help="only these methods (comma-separated; default: every one)")
    ap.add_argument("--out", default="reports/kl")
    ap.add_argument("--name", default="separation")
    args = ap.parse_args(argv)
    doc = {"store_name": Path(args.results).name, "same_scheme": args.same_scheme,
           "measured_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "methods": args.methods,
           "texts": study(args.results, args.same_scheme, set(args.methods.split(",")) if args.methods else None)}
    if not doc["texts"]:
        print(f"{args.results}: no pairs of quantized cells with per-window perplexity and KL data", file=sys.stderr)
        return 1
    write_study(args.out, args.name, doc, render(doc))
    return 0


if __name__ == "__main__":
    from bench.studies import run_main
    run_main(main, "separation")
