"""The small deterministic sweep CI reruns and compares against the committed reference.

    python -m bench.studies.ci_sweep --data-dir ../shared/data --results /tmp/ci.sqlite            # run + compare
    python -m bench.studies.ci_sweep --data-dir ../shared/data --results R --write-reference       # refresh reference

The default model, a handful of methods and schemes (RTN weight-only and W8A8, GPTQ g128, LRQ with a
few steps), calibration 16 x 256 C4 tokens, WikiText-2's first 8192 tokens (4 windows). Every number is
deterministic on a given CPU and torch build; the gate's tolerances (reports/tolerances.toml) absorb
the rest. Refresh the reference deliberately, with a commit that says why the numbers moved.

The numbers depend on the CPU: bf16 autocast matmuls round differently on AMD EPYC (AVX-512) and on
Intel Xeon with AMX, and the calibration-dependent cells (static W8A8 ranges, GPTQ, LRQ) carry that
through to 2-6 % in perplexity, beyond the gate's tolerance. So there is one reference per CPU model
(`reports/reference/ci_sweep*.json`, each row recording the CPU it ran on); the gate uses the one measured
on this CPU, and says so. On a CPU with no reference it uses the default one and says that differences
in calibration-dependent cells may be the CPU's.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import asdict
from pathlib import Path

REFERENCE = Path(__file__).resolve().parents[2] / "reports" / "reference" / "ci_sweep.json"


def _cpu_of(path: Path) -> str | None:
    rows = json.loads(path.read_text())
    cpus = {r.get("hardware", {}).get("cpu") for r in rows}
    return cpus.pop() if len(cpus) == 1 else None


def reference_for(cpu: str | None = None) -> tuple[Path, bool]:
    """The committed reference measured on this CPU model (and True), else the default one (and False)."""
    from bench.provenance import hardware
    cpu = cpu or str(hardware()["cpu"])
    for path in sorted(REFERENCE.parent.glob("ci_sweep*.json")):
        if _cpu_of(path) == cpu:
            return path, True
    return REFERENCE, False


def reference_path_for_writing(cpu: str) -> Path:
    """Where --write-reference puts this CPU's reference: the file that already holds it, else a new one."""
    path, found = reference_for(cpu)
    if found:
        return path
    slug = "".join(c if c.isalnum() else "-" for c in cpu.lower()).strip("-")
    while "--" in slug:
        slug = slug.replace("--", "-")
    return REFERENCE.with_name(f"ci_sweep-{slug}.json")
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
    ap.add_argument("--write-reference", action="store_true",
                    help="write this CPU's reference (reports/reference/ci_sweep*.json) instead of comparing")
    ap.add_argument("--reference", default=None, help="compare with this file (default: the one for this CPU)")
    args = ap.parse_args(argv)
    from bench.provenance import hardware
    cpu = str(hardware()["cpu"])
    code = run_sweep(args.results, args.data_dir)
    if code:
        print(f"the sweep itself failed (exit {code})", file=sys.stderr)
        return code
    if args.write_reference:
        out = Path(args.reference) if args.reference else reference_path_for_writing(cpu)
        export(args.results, out)
        print(f"reference for {cpu} written to {out}")
        return 0
    ref, matched = (Path(args.reference), True) if args.reference else reference_for(cpu)
    print(f"reference: {ref.name}" + (f" (measured on this CPU, {cpu})" if matched and not args.reference else
                                      "" if args.reference else
                                      f" (no reference measured on {cpu}: differences in calibration-dependent "
                                      f"cells may be this CPU's numerics; write one with --write-reference)"))
    from bench.compare import gate
    code, md = gate(str(ref), args.results)
    print(md)
    return code


if __name__ == "__main__":
    sys.exit(main())
