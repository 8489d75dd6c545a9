"""The small deterministic sweep CI reruns and compares against the committed reference.

    python -m bench.studies.ci_sweep --data-dir ../shared/data --results /tmp/ci.sqlite            # run + compare
    python -m bench.studies.ci_sweep --data-dir ../shared/data --results R --write-reference       # refresh reference

The default model, a handful of methods and schemes (RTN weight-only and W8A8, GPTQ g128, LRQ with a
few steps), calibration 16 x 256 C4 tokens, WikiText-2's first 8192 tokens (4 windows). Every number is
deterministic on a given CPU and torch build; the gate's tolerances (reports/tolerances.toml) absorb
the rest. Refresh the reference deliberately, with a commit that says why the numbers moved.

The numbers depend on the CPU and the precision: bf16 autocast matmuls round differently on AMD EPYC Zen 4
(AVX512-BF16) and on Intel Xeon with AMX, and the calibration-dependent cells (static W8A8 ranges, GPTQ,
LRQ) carry that through to 2-6 % in perplexity, beyond the gate's tolerance; and a CPU without native bf16
(AMD Zen 3, AVX2 only) runs the sweep in float32 (`--precision auto`, lrq.precision), where it is 5-10x
faster. So a reference is identified by (CPU model, native bf16, precision), read from its rows
(`reports/reference/ci_sweep*.json`): the gate uses the bf16 reference measured on this CPU model with the same
native-bf16 support ("AMD EPYC" names both Zen 3 and Zen 4), and, at fp32, the fp32 reference: float32
results do not depend on the CPU's vector ISA beyond the tolerance (bench/studies/README: the fp32 sweep
natively on AVX-512 and under the AVX2 emulation agree). With no matching reference it uses one of the
same precision and says that differences in calibration-dependent cells may be this CPU's numerics.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import asdict
from pathlib import Path
from lrq.io import dumps_json

REFERENCE = Path(__file__).resolve().parents[2] / "reports" / "reference" / "ci_sweep.json"


def identity_of(path: Path) -> dict | None:
    """(cpu, native_bf16, precision) of a reference file, from its rows; None when its rows disagree."""
    from bench.store import config_precision
    rows = json.loads(path.read_text())
    ids = {(r.get("hardware", {}).get("cpu"), r.get("hardware", {}).get("native_bf16"),
            config_precision(r.get("config"))) for r in rows}
    if len(ids) != 1:
        return None
    cpu, native, prec = ids.pop()
    return {"cpu": cpu, "native_bf16": native, "precision": prec} if cpu else None


def this_machine(precision: str | None = None) -> dict:
    """What this machine's sweep is identified by: its CPU model, native bf16 and the precision auto picks."""
    from bench.provenance import hardware
    from lrq import precision as P
    hw = hardware()
    return {"cpu": str(hw["cpu"]), "native_bf16": bool(hw.get("native_bf16")),
            "precision": P.resolve(precision or "auto")}


def _matches(ref: dict, me: dict) -> bool:
    if ref["precision"] != me["precision"]:
        return False
    if me["precision"] == "fp32":   # float32 sweeps agree across CPUs within the tolerance
        return True
    return ref["cpu"] == me["cpu"] and ref["native_bf16"] in (me["native_bf16"], None)


def reference_for(me: dict | None = None) -> tuple[Path, bool]:
    """The committed reference for this machine (and True), else one of the same precision (and False),
    else the default one (and False)."""
    me = me or this_machine()
    files = sorted(REFERENCE.parent.glob("ci_sweep*.json"))
    ids = {p: identity_of(p) for p in files}
    for path, ref in ids.items():
        if ref and _matches(ref, me):
            return path, True
    same = [p for p, ref in ids.items() if ref and ref["precision"] == me["precision"]]
    same.sort(key=lambda p: (ids[p]["cpu"] != me["cpu"], p != REFERENCE))   # this CPU's name first, then the default
    return (same[0] if same else REFERENCE), False


def reference_path_for_writing(me: dict) -> Path:
    """Where --write-reference puts this machine's reference: the file that already holds it, else a new one
    named after the CPU and precision (fp32: one for every CPU)."""
    path, found = reference_for(me)
    if found:
        return path
    if me["precision"] == "fp32":
        return REFERENCE.with_name("ci_sweep-fp32.json")
    slug = "".join(c if c.isalnum() else "-" for c in me["cpu"].lower()).strip("-")
    while "--" in slug:
        slug = slug.replace("--", "-")
    return REFERENCE.with_name(f"ci_sweep-{slug}-{me['precision']}.json")


def describe(me: dict) -> str:
    return f"{me['cpu']}, {'native' if me['native_bf16'] else 'no native'} bf16, precision {me['precision']}"


COMMON = ["--profile", "full", "--tasks", "none", "--jobs", "1", "--model", "smollm2-135m", "--datasets", "wikitext2", "--max-eval-tokens", "8192",
          "--calib-samples", "16", "--calib-seq-len", "256"]
SWEEP = [
    ["--methods", "rtn", "--schemes", "w3a16,w4a16-g128,w8a8"],
    ["--methods", "gptq", "--schemes", "w4a16-g128", "--no-fp"],
    ["--methods", "lrq", "--schemes", "w3a16", "--no-fp", "--set", "iters=5", "--set", "heldout_samples=4"],
]
STABLE_DATASETS = ("wikitext2", "quant")
STABLE_METRICS = ("ppl", "bits_per_weight", "n_learnable")


def run_sweep(results: str, data_dir: str | None, precision: str = "auto") -> int:
    """The sweep at `precision` (default auto: what this machine computes fastest; the reference is chosen to
    match)."""
    from bench.cli import main
    extra = ["--results", results, "--precision", precision] + (["--data-dir", data_dir] if data_dir else [])
    codes = [main(["run", *COMMON, *args, *extra]) for args in SWEEP]
    return max(codes)


def export(results: str, out: str | Path) -> None:
    """The sweep's gate-relevant rows as JSON (what the reference holds)."""
    from bench.store import ResultStore
    rows = [r for r in ResultStore(results).rows(latest=True)
            if r.dataset in STABLE_DATASETS and r.metric in STABLE_METRICS]
    Path(out).write_text(dumps_json([asdict(r) for r in rows], indent=1, sort_keys=True, default=str) + "\n")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description="CI regression sweep")
    ap.add_argument("--results", required=True)
    ap.add_argument("--data-dir", default=None)
    ap.add_argument("--write-reference", action="store_true",
                    help="write this machine's reference (reports/reference/ci_sweep*.json) instead of comparing")
    ap.add_argument("--reference", default=None, help="compare with this file (default: the one for this machine)")
    ap.add_argument("--precision", default="auto", choices=["auto", "bf16", "fp32"],
                    help="run the sweep at this precision (default auto, as CI does)")
    args = ap.parse_args(argv)
    me = this_machine(args.precision)
    print(f"machine: {describe(me)}", flush=True)
    code = run_sweep(args.results, args.data_dir, args.precision)
    if code:
        print(f"the sweep itself failed (exit {code})", file=sys.stderr)
        return code
    if args.write_reference:
        out = Path(args.reference) if args.reference else reference_path_for_writing(me)
        export(args.results, out)
        print(f"reference for {describe(me)} written to {out}")
        return 0
    ref, matched = (Path(args.reference), True) if args.reference else reference_for(me)
    print(f"reference: {ref.name}" + (f" (measured on a machine like this one: {describe(me)})"
                                      if matched and not args.reference else "" if args.reference else
                                      f" (none measured on a machine like this one, {describe(me)}: differences in "
                                      f"calibration-dependent cells may be this CPU's numerics; write one with "
                                      f"--write-reference)"))
    from bench.compare import gate
    code, md = gate(str(ref), args.results)
    print(md)
    return code


if __name__ == "__main__":
    sys.exit(main())
