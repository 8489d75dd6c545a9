"""The s1 clipping search, three ways, side by side on one weight matrix of the default model.

    python -m bench.studies.s1_search                       # layer 0 down_proj (576 x 1536), 3 and 4 bits
    python -m bench.studies.s1_search --groups channel,128 --repeats 5 --threads 1

Times, in one run and interleaved (so all three share the machine's conditions):
- `naive`: a plain Python loop over the grid's widths and every zero point, one full fake-quantization
  pass of the matrix per (width, zero point) pair (grid x 2^b passes), the strictly-better rule in
  (width, zero point) order;
- `exhaustive`: `lrq.quant.search_qparams_exhaustive`, every candidate scored, vectorised over zero points
  (the implementation before the fast one);
- `fast`: `lrq.quant.search_qparams`, which scores only the candidates its lower bounds cannot rule out;
- `fast@REV` (with `--against REV`): `search_qparams` as it was at git revision REV (its `lrq/quant.py`
  loaded from git), to measure a change to the fast search before and after in one run.

All three must return bitwise-identical scales and zero points, or the study fails (exit 1). Medians of
`--repeats` runs; ratios are of medians from the same run. Writes `--out`/s1_search.json (after every
configuration) and s1_search.md, with the configuration, versions, hardware, git revision and the load
average around the run (other work on the machine slows all three alike, not always equally).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Callable

import torch

from lrq.errors import UserError
from lrq.io import atomic_write_text
from lrq.quant import SCALE_EPS, _search_groups, check_bits, search_qparams, search_qparams_exhaustive
from lrq.io import dumps_json


def naive_search(w: torch.Tensor, bits: int, group_size: int | None = None, grid: int = 100,
                 norm: float = 2.4) -> tuple[torch.Tensor, torch.Tensor]:
    """One fake-quantization pass of the whole matrix per (width, zero point): the obvious loop."""
    check_bits(bits)
    qmax = 2**bits - 1
    flat, valid, lo, hi, ng = _search_groups(w, group_size)
    width = hi - lo
    best_err = torch.full((flat.shape[0],), math.inf)
    best_scale = torch.ones(flat.shape[0])
    best_zero = torch.zeros(flat.shape[0])
    for i in range(1, grid + 1):
        delta = (width * i / grid / qmax).clamp(min=SCALE_EPS)[:, None]
        for zp in range(qmax + 1):
            q = torch.clamp(torch.round(flat / delta) + zp, 0, qmax)
            err = torch.where(valid, ((q - zp) * delta - flat).abs().pow(norm), 0).sum(-1)
            better = err < best_err
            best_err = torch.where(better, err, best_err)
            best_scale = torch.where(better, delta[:, 0], best_scale)
            best_zero = torch.where(better, float(zp), best_zero)
    return best_scale.reshape(w.shape[0], ng), best_zero.reshape(w.shape[0], ng)


IMPLS: dict[str, Callable] = {"naive": naive_search, "exhaustive": search_qparams_exhaustive, "fast": search_qparams}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m bench.studies.s1_search", description=__doc__.split("\n")[0])
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--weight", default="model.layers.0.mlp.down_proj",
                   help="the linear layer whose weight is searched (default: 576 x 1536)")
    p.add_argument("--bits", default="3,4")
    p.add_argument("--groups", default="channel,128", help="'channel' (per row) and/or group sizes")
    p.add_argument("--grid", type=int, default=100)
    p.add_argument("--norm", type=float, default=2.4)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--impls", default="naive,exhaustive,fast")
    p.add_argument("--against", default=None, metavar="REV",
                   help="also time `search_qparams` as it was at this git revision (e.g. a commit before a change)")
    p.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    p.add_argument("--out", default="reports/s1-search")
    p.add_argument("--smoke", action="store_true", help="a random 64 x 256 matrix, 1 repeat (the suite's check)")
    a = p.parse_args(argv)
    a.bits = [int(b) for b in a.bits.split(",") if b]
    a.groups = [None if g == "channel" else int(g) for g in a.groups.split(",") if g]
    a.impls = [i for i in a.impls.split(",") if i]
    bad = [i for i in a.impls if i not in IMPLS]
    if bad or "fast" not in a.impls:
        p.error(f"--impls: choose among {', '.join(IMPLS)}, 'fast' included (got {a.impls})")
    if a.repeats < 1:
        p.error("--repeats must be at least 1")
    return a


def search_at_revision(rev: str) -> tuple[str, Callable]:
    """`search_qparams` from `lrq/quant.py` at git revision `rev`, loaded as a module of its own."""
    import importlib.util
    import subprocess
    import tempfile

    root = Path(__file__).resolve().parents[2]
    try:
        full = subprocess.run(["git", "rev-parse", "--verify", f"{rev}^{{commit}}"], cwd=root, check=True,
                              capture_output=True, text=True).stdout.strip()
        src = subprocess.run(["git", "show", f"{full}:lrq/quant.py"], cwd=root, check=True,
                             capture_output=True, text=True).stdout
    except (subprocess.CalledProcessError, FileNotFoundError) as e:
        raise UserError(f"--against {rev}: no lrq/quant.py at that revision in {root} ({e}); name a commit of "
                        f"this repository, e.g. --against HEAD~1.") from None
    path = Path(tempfile.mkdtemp(prefix="s1-against-")) / f"quant_{full[:12]}.py"
    path.write_text(src)
    spec = importlib.util.spec_from_file_location(f"lrq_quant_{full[:12]}", path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod    # as an import does: a dataclass of the module looks the module up there
    spec.loader.exec_module(mod)
    return f"fast@{full[:7]}", mod.search_qparams


def load_weight(args) -> torch.Tensor:
    if args.smoke:
        g = torch.Generator().manual_seed(0)
        return torch.randn(64, 256, generator=g) * torch.rand(64, 1, generator=g)
    from bench.common.models import load_model
    model = load_model(args.model).model
    try:
        return model.get_submodule(args.weight).weight.detach().float().clone()
    except AttributeError:
        raise UserError(f"--weight {args.weight!r} is not a linear layer of {args.model}: name one such as "
                        f"model.layers.0.mlp.down_proj.") from None


def markdown(result: dict) -> str:
    c = result["config"]
    lines = [
        "# The s1 clipping search: naive loop, exhaustive, fast",
        "",
        f"Matrix `{c['weight']}` of {c['model']} ({c['shape'][0]} x {c['shape'][1]}), grid {c['grid']}, "
        f"norm {c['norm']}; median of {c['repeats']} interleaved runs each, {c['threads']} torch thread(s). "
        f"Command: `{c['command']}`.",
        f"{c['hardware']['cpu']} x{c['hardware']['cpu_count']}; torch {c['versions'].get('torch')}; git "
        f"{c['git']}; load average before / after: {c['load_before']} / {c['load_after']}.",
        "",
    ]
    names = list(c.get("impls", ["naive", "exhaustive", "fast"]))
    others = [k for k in names if k != "fast"]
    lines += ["| bits | groups | candidates per row/group | scored by `fast` (mean, max) | "
              + " | ".join(f"{k} s" for k in names) + " | " + " | ".join(f"{k} / fast" for k in others)
              + " | identical |",
              "|---" * (5 + len(names) + len(others)) + "|"]
    for r in result["rows"]:
        t = r["median_s"]
        lines.append(f"| {r['bits']} | {r['groups']} | {r['candidates']:,} | {r['scored_mean']:.1f}, {r['scored_max']} | "
                     + " | ".join(f"{t[k]:.3f}" for k in names) + " | "
                     + " | ".join(f"{t[k] / t['fast']:.1f}x" for k in others)
                     + f" | {'yes' if r['identical'] else 'NO'} |")
    bounded = [f"{r['bits']}-bit {r['groups']} {r['bounded_mean']:.1f}" for r in result["rows"]
               if r.get("bounded_mean") is not None]
    if bounded:
        lines += ["", f"Widths (of {c['grid']}) whose closed-form bounds `fast` computed, per row or group (mean): "
                  + "; ".join(bounded) + "."]
    lines += ["", "Every run's times (s): " + "; ".join(
        f"{r['bits']}-bit {r['groups']}: " + ", ".join(f"{k} {v}" for k, v in r["times_s"].items())
        for r in result["rows"]), ""]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    from bench.common.provenance import git_revision, hardware, versions
    impls = {name: IMPLS[name] for name in args.impls}
    if args.against:
        name, fn = search_at_revision(args.against)
        impls = {**{k: v for k, v in impls.items() if k != "fast"}, name: fn, "fast": impls["fast"]}
    w = load_weight(args)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    result = {"config": {"model": "random (smoke)" if args.smoke else args.model,
                         "weight": "random" if args.smoke else args.weight, "shape": list(w.shape),
                         "grid": args.grid, "norm": args.norm, "impls": list(impls),
                         "repeats": 1 if args.smoke else args.repeats,
                         "threads": torch.get_num_threads(), "command": " ".join(["python -m bench.studies.s1_search",
                                                                                  *(argv if argv is not None else sys.argv[1:])]),
                         "versions": versions(), "hardware": hardware(), "git": git_revision(),
                         "load_before": [round(x, 2) for x in os.getloadavg()]}, "rows": []}
    failed = False
    for bits in args.bits:
        for group in args.groups:
            times: dict[str, list[float]] = {k: [] for k in impls}
            outs: dict[str, tuple] = {}
            stats: dict = {}
            for _ in range(result["config"]["repeats"]):
                for name, fn in impls.items():
                    kw = {"stats": stats} if name == "fast" else {}
                    t0 = time.perf_counter()
                    outs[name] = fn(w, bits, group, args.grid, args.norm, **kw)
                    times[name].append(round(time.perf_counter() - t0, 4))
            ref = outs["fast"]
            identical = all(torch.equal(o[0], ref[0]) and torch.equal(o[1], ref[1]) for o in outs.values())
            failed |= not identical
            scored = stats["scored"].float() if stats.get("scored") is not None else None
            row = {"bits": bits, "groups": "per channel" if group is None else f"g{group}",
                   "candidates": stats["candidates"], "identical": identical, "times_s": times,
                   "median_s": {k: statistics.median(v) for k, v in times.items()},
                   "scored_mean": float(scored.mean()) if scored is not None else float(stats["candidates"]),
                   "scored_max": int(scored.max()) if scored is not None else stats["candidates"],
                   "bounded_mean": float(stats["bounded"].float().mean()) if stats.get("bounded") is not None
                   else None}
            result["rows"].append(row)
            print(json.dumps({k: row[k] for k in ("bits", "groups", "median_s", "scored_mean", "identical")}), flush=True)
            atomic_write_text(out / "s1_search.json", dumps_json(result, indent=1))
    result["config"]["load_after"] = [round(x, 2) for x in os.getloadavg()]
    atomic_write_text(out / "s1_search.json", dumps_json(result, indent=1))
    atomic_write_text(out / "s1_search.md", markdown(result))
    print(markdown(result))
    if failed:
        print("FAILED: the implementations disagree (see 'identical')", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    from bench.studies import run_main
    run_main(main, "python -m bench.studies.s1_search")
