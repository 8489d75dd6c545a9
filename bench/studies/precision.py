"""Which compute precision is fast on this machine: fp32 against bf16 autocast, measured, and what `auto` picks.

    python -m bench.studies.precision [--out reports/precision] [--windows 2] [--reps 3]
    python -m bench.studies.precision --emulate-no-bf16 ...   # the same, as a CPU without native bf16

Times, in one process and alternating the two precisions so that load bursts hit both alike:
  1. one matmul 512 x 576 x 1536 (a SmolLM2 MLP projection of 512 tokens), float32 vs under bf16 autocast;
  2. evaluation as `lrq-bench run` does it: the default model's perplexity on 2048-token WikiText-2 windows
     (bench.evaluations.perplexity.perplexity), float32 weights with autocast off vs on; tokens per second.
and reports which precision `auto` (lrq.precision) chooses and how far its evaluation throughput is from
the faster of the two (target: within 1.15x).

`--emulate-no-bf16` reruns the study in a child process with `ATEN_CPU_CAPABILITY=avx2` (torch's CPU kernels
at AVX2), `ONEDNN_MAX_CPU_ISA=AVX2` (oneDNN without its AVX-512/AMX bf16 kernels) and
`MKL_ENABLE_INSTRUCTIONS=AVX2` (MKL's float32 GEMM at AVX2): an AMX machine behaving as an AVX2-only CPU
such as AMD Zen 3. The JSON records the variables, and the report compares the emulated bf16 penalty with
the one measured on a real Zen 3 (ENVIRONMENT.md: 10.5x on that matmul, 5.3x on a 4-layer forward).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

import torch

from bench.common.provenance import short_revision
from lrq import precision as P

EMULATION = {"ATEN_CPU_CAPABILITY": "avx2", "ONEDNN_MAX_CPU_ISA": "AVX2", "MKL_ENABLE_INSTRUCTIONS": "AVX2"}
TARGET = 1.15   # auto's evaluation throughput within this factor of the faster precision


def _median_time(fn, reps: int) -> float:
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def time_matmul(reps: int = 7) -> dict:
    a, b = torch.randn(512, 576), torch.randn(576, 1536)
    out = {"fp32_ms": [], "bf16_ms": []}
    for _ in range(2):   # warm-up of both paths
        a @ b
        with P.autocast("cpu", precision="bf16"):
            a @ b
    for _ in range(reps):   # alternate: a burst of load hits both
        out["fp32_ms"].append(1e3 * _median_time(lambda: a @ b, 1))
        with P.autocast("cpu", precision="bf16"):
            out["bf16_ms"].append(1e3 * _median_time(lambda: a @ b, 1))
    med = {k: statistics.median(v) for k, v in out.items()}
    return {"shape": "512 x 576 x 1536", "fp32_ms": med["fp32_ms"], "bf16_ms": med["bf16_ms"],
            "bf16_over_fp32": med["bf16_ms"] / med["fp32_ms"], "samples": out}


def time_eval(model, ids: torch.Tensor, windows: int, reps: int, seq_len: int = 2048) -> dict:
    from bench.evaluations.perplexity import perplexity
    ids = ids[: windows * seq_len]
    tokens = {}
    secs = {"fp32": [], "bf16": []}
    with torch.no_grad():
        perplexity(model, ids[:seq_len], seq_len, precision="fp32", desc="warm-up")
        perplexity(model, ids[:seq_len], seq_len, precision="bf16", desc="warm-up")
        for _ in range(reps):
            for prec in ("fp32", "bf16"):
                t = time.perf_counter()
                res = perplexity(model, ids, seq_len, precision=prec, desc=prec)
                secs[prec].append(time.perf_counter() - t)
                tokens[prec] = res["tokens"]
    out = {}
    for prec in secs:
        med = statistics.median(secs[prec])
        out[prec] = {"seconds": med, "tokens_per_s": tokens[prec] / med, "samples_s": secs[prec]}
    out["bf16_over_fp32_time"] = out["bf16"]["seconds"] / out["fp32"]["seconds"]
    return out


def measure(windows: int, reps: int, threads: int, data_dir: str | None, seq_len: int = 2048) -> dict:
    from bench.evaluations import data as D
    from bench.common.models import load_model
    from bench.common.provenance import git_revision, hardware, versions
    torch.set_num_threads(threads)
    loaded = load_model("smollm2-135m")
    text = D.eval_text("wikitext2", D.resolve_data_dir(data_dir))
    ids = D.tokenize(loaded.tokenizer, text.text)
    mm = time_matmul()
    ev = time_eval(loaded.model, ids, windows, reps, seq_len)
    auto = P.resolve("auto")
    fastest = min(("fp32", "bf16"), key=lambda p: ev[p]["seconds"])
    ratio = ev[auto]["seconds"] / ev[fastest]["seconds"]
    return {"cpu_bf16": P.cpu_bf16(), "auto": auto, "auto_why": P.describe("auto")["why"], "fastest": fastest,
            "auto_over_fastest": ratio, "within_target": ratio <= TARGET, "target": TARGET, "matmul": mm,
            "eval": ev, "windows": windows, "seq_len": seq_len, "reps": reps, "threads": threads,
            "emulation": {k: os.environ.get(k) for k in EMULATION if os.environ.get(k)},
            "hardware": hardware(), "versions": versions(), "git": git_revision(),
            "measured_at": time.strftime("%Y-%m-%dT%H:%M:%S%z")}


def markdown(results: list[dict]) -> str:
    lines = ["| machine | auto picks (why) | matmul fp32 / bf16 (ms) | bf16 / fp32 | eval fp32 / bf16 (tokens/s) | "
             "bf16 / fp32 time | auto / fastest |",
             "|---|---|---|---|---|---|---|"]
    for r in results:
        name = r["hardware"]["cpu"] + (" under the no-bf16 emulation (" + ", ".join(f"{k}={v}" for k, v in
                                                                                  r["emulation"].items()) + ")"
                                       if r["emulation"] else ", native")
        mm, ev = r["matmul"], r["eval"]
        lines.append(f"| {name} | {r['auto']} ({r['auto_why']}) | {mm['fp32_ms']:.1f} / {mm['bf16_ms']:.1f} | "
                     f"{mm['bf16_over_fp32']:.1f}x | {ev['fp32']['tokens_per_s']:.0f} / {ev['bf16']['tokens_per_s']:.0f} | "
                     f"{ev['bf16_over_fp32_time']:.2f}x | {r['auto_over_fastest']:.2f}x "
                     f"({'within' if r['within_target'] else 'NOT within'} {r['target']}x) |")
    r0 = results[0]
    lines += ["", f"{r0['threads']} thread(s), {r0['windows']} WikiText-2 windows of {r0['seq_len']} tokens per timed evaluation, "
              f"medians of {r0['reps']} alternating repetitions (matmul: of 7); git {short_revision(r0['git'])}, torch "
              f"{r0['versions'].get('torch')}."]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default="reports/precision", help="folder for precision.json / precision.md")
    ap.add_argument("--windows", type=int, default=2)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--seq-len", type=int, default=2048, help="evaluation window (the harness's default 2048)")
    ap.add_argument("--data-dir", default=None)
    ap.add_argument("--emulate-no-bf16", action="store_true", help="also measure as a CPU without native bf16")
    ap.add_argument("--json-only", action="store_true", help=argparse.SUPPRESS)   # the emulated child's mode
    args = ap.parse_args(argv)
    common = ["--windows", str(args.windows), "--reps", str(args.reps), "--threads", str(args.threads),
              "--seq-len", str(args.seq_len)] + (
        ["--data-dir", args.data_dir] if args.data_dir else [])
    if args.json_only:
        print(json.dumps(measure(args.windows, args.reps, args.threads, args.data_dir, args.seq_len)))
        return 0
    results = [measure(args.windows, args.reps, args.threads, args.data_dir, args.seq_len)]
    print(markdown(results), flush=True)
    if args.emulate_no_bf16:
        child = subprocess.run([sys.executable, "-m", "bench.studies.precision", "--json-only", *common],
                               env=os.environ | EMULATION, capture_output=True, text=True)
        if child.returncode:
            sys.stderr.write(child.stderr[-3000:])
            return child.returncode
        results.append(json.loads(child.stdout.strip().splitlines()[-1]))
    from bench.studies import write_study
    write_study(args.out, "precision", results, markdown(results))
    return 0 if all(r["within_target"] for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
