"""The small deterministic sweep CI reruns and compares against the committed reference.

    python -m bench.ci_sweep --data-dir ../shared/data --results /tmp/ci.sqlite            # run + compare
    python -m bench.ci_sweep --data-dir ../shared/data --results R --write-reference       # refresh reference

The default model, a handful of methods and schemes (RTN weight-only and W8A8, GPTQ g128, LRQ with a
few steps), calibration 16 x 256 C4 tokens, WikiText-2's first 8192 tokens (4 windows). Every number is
deterministic on a given CPU and torch build; the gate's tolerances (reports/tolerances.toml) absorb
the rest. Refresh the reference deliberately, with a commit that says why the numbers moved.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import asdict
from pathlib import Path

REFERENCE = Path(__file__).resolve().parent.parent / "reports" / "reference" / "ci_sweep.json"
COMMON = ["--profile", "full", "--tasks", "none", "--jobs", "1", "--model", "smollm2-135m", "--datasets", "wikitext2", "--max-eval-tokens", "8192",
          "--calib-samples", "16", "--calib-seq-len", "256"]
SWEEP = [
    ["--methods", "rtn", "--schemes", "w3a16,w4a16-g128,w8a8"],
    ["--methods", "gptq", "--schemes", "w4a16-g128", "--no-fp"],
    ["--methods", "lrq", "--schemes", "w3a16", "--no-fp", "--set", "iters=5", "--set", "heldout_samples=4"],
]
STABLE_DATASETS = ("wikitext2", "quant")
STABLE_METRICS = ("ppl", "bits_per_weight", "n_learnable")


def run_sweep(results: str, data_dir: str | None) -> int:
    from bench.cli import main
    extra = ["--results", results] + (["--data-dir", data_dir] if data_dir else [])
    codes = [main(["run", *COMMON, *args, *extra]) for args in SWEEP]
    return max(codes)


def export(results: str, out: str | Path) -> None:
    """The sweep's gate-relevant rows as JSON (what the reference holds)."""
    from bench.store import ResultStore
    rows = [r for r in ResultStore(results).rows(latest=True)
            if r.dataset in STABLE_DATASETS and r.metric in STABLE_METRICS]
    Path(out).write_text(json.dumps([asdict(r) for r in rows], indent=1, sort_keys=True, default=str) + "\n")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description="CI regression sweep")
    ap.add_argument("--results", required=True)
    ap.add_argument("--data-dir", default=None)
    ap.add_argument("--write-reference", action="store_true", help=f"overwrite {REFERENCE}")
    ap.add_argument("--reference", default=str(REFERENCE))
    args = ap.parse_args(argv)
    code = run_sweep(args.results, args.data_dir)
    if code:
        print(f"the sweep itself failed (exit {code})", file=sys.stderr)
        return code
    if args.write_reference:
        export(args.results, args.reference)
        print(f"reference written to {args.reference}")
        return 0
    from bench.compare import gate
    code, md = gate(args.reference, args.results)
    print(md)
    return code


if __name__ == "__main__":
    sys.exit(main())
