"""Issue X's GPU measurements in one bounded, resumable run; JSON after every stage, then Markdown and targets.json.

    python -m bench.studies.gpu_decode --out-dir reports/gpu/<date> --budget-s 300 [--e2e FILE] [--resume]
    TRITON_INTERPRET=1 python -m bench.studies.gpu_decode --smoke --out-dir /tmp/x   # same code path, CPU, tiny

Stages (in order; each records `complete`, a cut run is finished by --resume, which keeps every finished stage
and every measured row of a cut table): correctness (the decode GEMV against the float reference on the
device, bits 3/4/8, g128, odd shapes, M = 1/3/16), copy_bw (device-to-device copy bandwidth), decode (M = 1, 2,
4, 8, 16 at 4096x11008 and 11008x4096 for w4a16, w4a16-g128, w3a16, w8a16: bf16, the GEMV, the GEMM, torch's
int4 kernel where it applies, and the dispatcher's measured choice; 4096x4096 g128 at M = 1 beside torch int4),
int8 (w8a8 prefill at M = 512/2048/4096 on 4096x11008: our int8 GEMM and torch._int_mm with the activation
quantization in torch, beside bf16; w8a8 decode at M = 1 beside the w8a16 GEMV), e2e (read from the
end-to-end benchmark's JSON, --e2e: speedups, memory with the kernels' weight copies, and the kernel the
dispatcher chose per layer shape, also as a table in decode.md). Budget: every timed row checks the deadline
(--budget-s) first; what does not fit is left out and the stage marked incomplete.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

from bench.studies.gpu_check import _rel

STAGES = ("correctness", "copy_bw", "decode", "int8", "configs", "e2e")
DECODE_SHAPES = ((4096, 11008), (11008, 4096))       # (N, K): out x in features
DECODE_MS = (1, 2, 4, 8, 16)
SCHEMES = {"w4a16": (4, None), "w4a16-g128": (4, 128), "w3a16": (3, None), "w8a16": (8, None)}
INT8_MS = (512, 2048, 4096)
# the GEMV's tile configurations timed side by side (stage "configs"): (block_m, block_n, warps, stages); the
# defaults (lrq.kernels.gemv.GEMV_CONFIGS) were chosen offline, by machine-code counts, without a GPU
CONFIG_CANDIDATES = {1: ((1, 128, 1, 2), (1, 128, 1, 1), (1, 128, 1, 3), (1, 256, 2, 2)),
                     16: ((16, 128, 2, 3), (16, 128, 4, 3), (16, 64, 2, 3), (16, 128, 2, 2), (16, 256, 4, 3))}
SMOKE_SHAPES = ((48, 160),)
GOALS = {   # target name -> goal (measured >= goal is met)
    "decode bandwidth at M=1, 4-bit, fraction of copy bandwidth": 0.70,
    "4-bit decode speedup vs bf16 at M=1..16 (worst)": 3.0,
    "speedup vs torch int4 at M=1, 4096x4096 g128": 1.0,
    "int8 prefill speedup vs bf16 at M>=512 (worst)": 1.5,
    "int8 decode speed vs w8a16 at M=1": 1.0,
    "e2e decode speedup vs bf16, w4a16": 2.5,
    "e2e decode speedup vs bf16, w8a8": 1.5,
    "e2e prefill speed vs bf16 (worst quantized format)": 1.0,
}


def _layer(n, k, bits, group, seed=0, device="cpu"):
    from lrq.packing import pack_planar
    from lrq.quant import n_groups
    g = torch.Generator().manual_seed(seed)
    q = torch.randint(0, 2**bits, (n, k), generator=g)
    ng = n_groups(k, group)
    s = (torch.rand(n, ng, generator=g) * 0.02 + 0.001).half()
    z = torch.randint(0, 2**bits, (n, ng), generator=g).to(torch.uint8)
    return pack_planar(q, bits).to(device), s.to(device), z.to(device)


def make_timer(device: str):
    if device == "cuda":
        from triton.testing import do_bench
        return lambda fn: float(do_bench(fn, warmup=10, rep=50, return_mode="median"))

    def cpu(fn):
        ts = []
        for _ in range(3):
            t = time.perf_counter()
            fn()
            ts.append((time.perf_counter() - t) * 1e3)
        return statistics.median(ts)
    return cpu


def machine(device: str) -> dict:
    def sh(*cmd):
        try:
            return subprocess.run(cmd, capture_output=True, text=True, timeout=20).stdout.strip()
        except Exception:  # noqa: BLE001 - a missing tool is recorded as empty
            return ""
    import triton
    return {"device": torch.cuda.get_device_name() if device == "cuda" else platform.processor() or "cpu",
            "gpu": sh("nvidia-smi", "--query-gpu=name,driver_version,memory.total", "--format=csv,noheader"),
            "python": platform.python_version(), "torch": torch.__version__, "triton": triton.__version__,
            "git_rev": sh("git", "rev-parse", "HEAD"), "date": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime())}


def _tol(dtype: torch.dtype) -> float:
    return 1e-2 if dtype in (torch.bfloat16, torch.float16) else 1e-5


def stage_correctness(device, smoke, deadline):
    from lrq.kernels import gemv as G
    from lrq.kernels.wq_gemm import reference_wq_matmul
    rows = []
    shapes = ((37, 300),) if smoke else ((37, 300), (4096, 4096 + 96), (4096, 4096))   # odd, masked, even
    act = torch.bfloat16 if device == "cuda" else torch.float32
    for n, k in shapes:
        for name, (bits, group) in SCHEMES.items():
            # bf16 everywhere; fp16 too where its own paths run (the fp16 pair PTX of the 16-token kernel, 8 bits
            # included, and the M = 1 kernel's fp16 loads)
            for m, dtype in [(m, act) for m in (1, 3, 16)] + [(m, torch.float16) for m in (1, 16)
                                                               if device == "cuda" and group is None]:
                if time.time() > deadline:
                    return rows, False
                packed, s, z = _layer(n, k, bits, group, m, device)
                w = G.repack_gemv(packed, s, z, bits, group, k)
                x = torch.randn(m, k, device=device, dtype=dtype)
                b = torch.randn(n, device=device)
                y = G.gemv_matmul(x, w, b)
                ref = reference_wq_matmul(x.float(), packed, s, z, bits, group, k, b)
                rel = _rel(y, ref)
                rows.append({"scheme": name, "m": m, "n": n, "k": k, "dtype": str(dtype).replace("torch.", ""),
                             "rel_err": rel, "ok": rel < _tol(dtype)})
    return rows, True


def stage_copy_bw(device, smoke, timer):
    n = (1 << 20) if smoke else (1 << 30)
    a = torch.empty(n, dtype=torch.uint8, device=device)
    b = torch.empty_like(a)
    ms = timer(lambda: b.copy_(a))
    return {"bytes": n, "ms": ms, "bytes_per_s": 2 * n / (ms / 1e3)}   # read + write


def _row_key(r):
    return f"{r['scheme']}|{r['m']}|{r['n']}|{r['k']}"


def stage_decode(device, smoke, timer, deadline, done, copy_bps, dispatcher):
    """done: rows of a cut run (kept, not measured again)."""
    from lrq.kernels import dispatch as D
    from lrq.quant import n_groups
    rows = list(done)
    have = {_row_key(r) for r in rows}
    dt = torch.bfloat16 if device == "cuda" else torch.float32
    plan = []
    for n, k in (SMOKE_SHAPES if smoke else DECODE_SHAPES):
        for scheme in SCHEMES:
            for m in (DECODE_MS[:2] if smoke else DECODE_MS):
                plan.append((scheme, m, n, k))
    plan.append(("w4a16-g128", 1) + ((SMOKE_SHAPES[0]) if smoke else (4096, 4096)))
    for scheme, m, n, k in plan:
        key = f"{scheme}|{m}|{n}|{k}"
        if key in have:
            continue
        if time.time() > deadline:
            return rows, False
        bits, group = SCHEMES[scheme]
        packed, s, z = _layer(n, k, bits, group, 0, device)
        x = torch.randn(m, k, device=device, dtype=dt)
        wd = torch.randn(n, k, device=device, dtype=dt)
        row = {"scheme": scheme, "m": m, "n": n, "k": k, "bf16_ms": timer(lambda: x @ wd.t())}
        ok, _ = D.candidates(bits, group, m, n, k, x.device)
        for name in ok:
            try:
                run = D.build_runner(name, packed, s, z, bits, group, k)
                row[f"{name}_ms"] = timer(lambda: run(x))
            except Exception as e:  # noqa: BLE001 - recorded, the row goes on
                row[f"{name}_error"] = f"{type(e).__name__}: {str(e)[:200]}"
        c = dispatcher.choose(x, packed, s, z, bits, group, k)
        row["chosen"], row["chosen_by"] = c.kernel, c.source
        row["chosen_ms"] = row.get(f"{c.kernel}_ms")
        from lrq.kernels.gemv import WB, elems_per_word
        e = elems_per_word(bits)
        wbytes = -(-k // (e * WB)) * WB * 4 * n + n_groups(k, group) * n * 3
        row["bytes"] = wbytes + (m * k + m * n) * x.element_size()
        if row["chosen_ms"]:
            row["bandwidth_fraction"] = row["bytes"] / (row["chosen_ms"] / 1e3) / copy_bps
            row["speedup_vs_bf16"] = row["bf16_ms"] / row["chosen_ms"]
        rows.append(row)
    return rows, True


def _int_mm_path(x, wq_t, sw):
    """torch's int8 path with the activation quantization in torch: per-token symmetric int8, _int_mm, rescale."""
    sx = x.float().abs().amax(dim=1, keepdim=True).clamp(min=1e-8) / 127
    xq = (x.float() / sx).round().clamp(-128, 127).to(torch.int8)
    return (torch._int_mm(xq, wq_t).float() * sx * sw).to(x.dtype)


def stage_int8(device, smoke, timer, deadline, done):
    from lrq.kernels import gemv as G
    from lrq.kernels.int8_gemm import int8_matmul
    rows = list(done)
    have = {(r["m"], r["n"], r["k"]) for r in rows}
    n, k = (64, 256) if smoke else (4096, 11008)
    dt = torch.bfloat16 if device == "cuda" else torch.float32
    packed, s, z = _layer(n, k, 8, None, 0, device)
    wq_t = torch.randint(-128, 128, (k, n), dtype=torch.int8, device=device)
    sw = torch.rand(1, n, device=device) * 0.01
    wd = torch.randn(n, k, device=device, dtype=dt)
    gw = G.repack_gemv(packed, s, z, 8, None, k)
    for m in ((1, 32) if smoke else (1,) + INT8_MS):
        if (m, n, k) in have:
            continue
        if time.time() > deadline:
            return rows, False
        x = torch.randn(m, k, device=device, dtype=dt)
        row = {"m": m, "n": n, "k": k, "bf16_ms": timer(lambda: x @ wd.t()),
               "ours_ms": timer(lambda: int8_matmul(x, packed, s, z, 8, k))}
        try:
            row["torch_int_mm_ms"] = timer(lambda: _int_mm_path(x, wq_t, sw))
        except Exception as e:  # noqa: BLE001 - e.g. shapes _int_mm refuses
            row["torch_int_mm_error"] = f"{type(e).__name__}: {str(e)[:200]}"
        if m <= G.MAX_M:
            row["w8a16_gemv_ms"] = timer(lambda: G.gemv_matmul(x, gw))
        best = min(v for key, v in row.items() if key in ("ours_ms", "torch_int_mm_ms"))
        row["int8_kept"] = "ours" if best == row["ours_ms"] else "torch_int_mm"
        row["int8_ms"] = best
        rows.append(row)
    return rows, True


def stage_configs(device, smoke, timer, deadline, done):
    """The GEMV's tile configurations side by side at the decode shapes (4 bits, per channel and g128; M = 1 and
    16): each checked against the float reference, then timed; a row per configuration, `best` per shape. The
    defaults were picked offline by machine-code counts: this is where a GPU says whether they were right."""
    from lrq.kernels import gemv as G
    from lrq.kernels.wq_gemm import reference_wq_matmul
    rows = list(done)
    have = {(r["scheme"], r["m"], r["n"], r["k"], r["config"]) for r in rows}
    dt = torch.bfloat16 if device == "cuda" else torch.float32
    for n, k in (SMOKE_SHAPES if smoke else DECODE_SHAPES):
        for scheme in ("w4a16", "w4a16-g128"):
            bits, group = SCHEMES[scheme]
            packed, s, z = _layer(n, k, bits, group, 0, device)
            w = G.repack_gemv(packed, s, z, bits, group, k)
            for m, cands in CONFIG_CANDIDATES.items():
                x = torch.randn(m, k, device=device, dtype=dt)
                ref = reference_wq_matmul(x.float(), packed, s, z, bits, group, k)
                for cand in (cands[:2] if smoke else cands):
                    c = G.GemvConfig(*cand)
                    if (scheme, m, n, k, str(c)) in have:
                        continue
                    if time.time() > deadline:
                        return rows, False
                    row = {"scheme": scheme, "m": m, "n": n, "k": k, "config": str(c),
                           "default": c == G.GEMV_CONFIGS[m]}
                    try:
                        row["rel_err"] = _rel(G.gemv_matmul(x, w, config=c), ref)
                        if row["rel_err"] < _tol(dt):
                            row["ms"] = timer(lambda: G.gemv_matmul(x, w, config=c))
                    except Exception as e:  # noqa: BLE001 - a configuration that fails is a row, not a crash
                        row["error"] = f"{type(e).__name__}: {str(e)[:200]}"
                    rows.append(row)
    for r in rows:
        same = [o["ms"] for o in rows if (o["scheme"], o["m"], o["n"], o["k"]) == (r["scheme"], r["m"], r["n"], r["k"])
                and "ms" in o]
        r["best"] = "ms" in r and r["ms"] == min(same)
    return rows, True


def stage_e2e(path):
    if not path or not Path(path).exists():
        return None, False
    rows = json.loads(Path(path).read_text())["rows"]
    return {r["scheme"]: {k: r.get(k) for k in ("decode_speedup_vs_bf16", "prefill_speedup_vs_bf16",
                                                 "decode_ms_per_token", "prefill_tok_s", "weight_bytes",
                                                 "kernel_copy_bytes", "peak_gpu_bytes", "dispatch")}
            for r in rows}, True


def judge_targets(doc: dict) -> list[dict]:
    """One entry per target of issue X; measured None where the run has no number for it (then not met), and
    always off a GPU (CPU smoke timings judge nothing)."""
    if not doc.get("on_gpu"):
        return [{"name": name, "measured": None, "goal": goal, "met": False} for name, goal in GOALS.items()]
    dec = [r for r in doc.get("decode", []) if r.get("chosen_ms")]
    big = [r for r in dec if (r["n"], r["k"]) in DECODE_SHAPES]
    four = [r for r in big if r["scheme"].startswith("w4")]

    def worst(vals):
        vals = [v for v in vals if v is not None]
        return min(vals) if vals else None
    t4 = [r for r in dec if (r["n"], r["k"]) == (4096, 4096) and r["m"] == 1 and r["scheme"] == "w4a16-g128"]
    best_ours = [min(r[f"{n}_ms"] for n in ("gemv", "wq_gemm") if f"{n}_ms" in r) for r in t4 if "torch_int4_ms" in r]
    i8 = doc.get("int8", [])
    e2e = doc.get("e2e") or {}
    measured = {
        "decode bandwidth at M=1, 4-bit, fraction of copy bandwidth":
            worst(r.get("bandwidth_fraction") for r in four if r["m"] == 1),
        "4-bit decode speedup vs bf16 at M=1..16 (worst)": worst(r.get("speedup_vs_bf16") for r in four),
        "speedup vs torch int4 at M=1, 4096x4096 g128":
            t4[0]["torch_int4_ms"] / best_ours[0] if best_ours else None,
        "int8 prefill speedup vs bf16 at M>=512 (worst)":
            worst(r["bf16_ms"] / r["int8_ms"] for r in i8 if r["m"] >= 512),
        "int8 decode speed vs w8a16 at M=1":
            worst(r["w8a16_gemv_ms"] / r["int8_ms"] for r in i8 if r["m"] == 1 and "w8a16_gemv_ms" in r),
        "e2e decode speedup vs bf16, w4a16": (e2e.get("w4a16") or {}).get("decode_speedup_vs_bf16"),
        "e2e decode speedup vs bf16, w8a8": (e2e.get("w8a8") or {}).get("decode_speedup_vs_bf16"),
        "e2e prefill speed vs bf16 (worst quantized format)":
            worst(v.get("prefill_speedup_vs_bf16") for s, v in e2e.items() if s != "bf16"),
    }
    return [{"name": name, "measured": measured[name], "goal": goal,
             "met": measured[name] is not None and measured[name] >= goal} for name, goal in GOALS.items()]


def markdown(doc: dict) -> str:
    m = doc["machine"]
    lines = [f"# Issue X GPU run, {m['date']}", "", f"{m['device']} ({m['gpu']}); python {m['python']}, torch "
             f"{m['torch']}, triton {m['triton']}; revision {m['git_rev']}.", "",
             f"Stages: {json.dumps(doc['stages'])}", ""]
    if doc.get("copy_bw"):
        lines += [f"Copy bandwidth: {doc['copy_bw']['bytes_per_s'] / 1e9:.0f} GB/s", ""]
    lines += ["| scheme | M | N x K | bf16 ms | gemv ms | wq_gemm ms | torch int4 ms | chosen (how) | vs bf16 | "
              "bandwidth |", "|---|---|---|---|---|---|---|---|---|---|"]
    f = lambda v, p=4: "-" if v is None else f"{v:.{p}f}"  # noqa: E731
    for r in doc.get("decode", []):
        lines.append(f"| {r['scheme']} | {r['m']} | {r['n']}x{r['k']} | {f(r['bf16_ms'])} | {f(r.get('gemv_ms'))} | "
                     f"{f(r.get('wq_gemm_ms'))} | {f(r.get('torch_int4_ms'))} | {r['chosen']} ({r['chosen_by']}) | "
                     f"{f(r.get('speedup_vs_bf16'), 2)}x | {f(r.get('bandwidth_fraction'), 2)} |")
    lines += ["", "| int8 M | N x K | bf16 ms | ours ms | torch _int_mm ms | w8a16 gemv ms | kept |",
              "|---|---|---|---|---|---|---|"]
    for r in doc.get("int8", []):
        lines.append(f"| {r['m']} | {r['n']}x{r['k']} | {f(r['bf16_ms'])} | {f(r['ours_ms'])} | "
                     f"{f(r.get('torch_int_mm_ms'))} | {f(r.get('w8a16_gemv_ms'))} | {r['int8_kept']} |")
    if doc.get("configs"):
        lines += ["", "GEMV tile configurations (4 bits; * the default, the fastest in bold):", "",
                  "| scheme | M | N x K | config | ms | rel err |", "|---|---|---|---|---|---|"]
        for r in doc["configs"]:
            name = f"{r['config']}{' *' if r['default'] else ''}"
            lines.append(f"| {r['scheme']} | {r['m']} | {r['n']}x{r['k']} | {f'**{name}**' if r['best'] else name} | "
                         f"{f(r.get('ms'))} | {r.get('error') or f(r.get('rel_err'), 6)} |")
    e2e_choices = [(scheme, d) for scheme, v in (doc.get("e2e") or {}).items() for d in (v.get("dispatch") or [])]
    if e2e_choices:
        lines += ["", "End to end, the dispatcher's choice per layer shape (layers: how many took it):", "",
                  "| scheme | M | N x K | kernel | how | layers | times ms |", "|---|---|---|---|---|---|---|"]
        for scheme, d in e2e_choices:
            times = ", ".join(f"{k} {v:.4f}" for k, v in (d.get("times_ms") or {}).items()) or "-"
            lines.append(f"| {scheme} | {d['m']} | {d['n']}x{d['k']} | {d['kernel']} | {d['source']} | "
                         f"{d.get('calls', '-')} | {times} |")
    lines += ["", "| target | measured | goal | met |", "|---|---|---|---|"]
    for t in doc.get("targets", []):
        lines.append(f"| {t['name']} | {f(t['measured'], 3)} | {t['goal']} | {'yes' if t['met'] else 'no'} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description="issue X's GPU measurements (bounded, resumable)")
    ap.add_argument("--out-dir", required=True)
    ap.add_argument("--budget-s", type=float, default=300.0)
    ap.add_argument("--smoke", action="store_true", help="tiny shapes on the CPU (TRITON_INTERPRET=1)")
    ap.add_argument("--resume", action="store_true", help="keep what a cut run's decode.json finished")
    ap.add_argument("--e2e", default=None, help="the end-to-end benchmark's JSON (bench.studies.speed e2e)")
    ap.add_argument("--only", default=",".join(STAGES))
    args = ap.parse_args(argv)
    if args.budget_s <= 0:
        ap.error("--budget-s must be positive")
    only = [s for s in args.only.split(",") if s]
    bad = [s for s in only if s not in STAGES]
    if bad:
        ap.error(f"unknown stage(s) {bad}: choose from {', '.join(STAGES)}")
    device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cpu" and not args.smoke:
        ap.error("no GPU here: use --smoke (with TRITON_INTERPRET=1) on a CPU")
    out = Path(args.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    path = out / "decode.json"
    doc = json.loads(path.read_text()) if args.resume and path.exists() else {}
    doc["machine"] = machine(device)
    doc["on_gpu"] = device == "cuda"
    doc.setdefault("stages", {})
    doc["budget_s"] = args.budget_s
    deadline = time.time() + args.budget_s
    timer = make_timer(device)
    from lrq.kernels.dispatch import Dispatcher
    dispatcher = Dispatcher(out / "dispatch_table.json", timer=timer if device == "cuda" else None)

    def save():
        doc["targets"] = judge_targets(doc)
        doc["dispatch"] = [vars(c) for c in dispatcher.records]
        path.write_text(json.dumps(doc, indent=1, default=str))
        (out / "decode.md").write_text(markdown(doc))
        (out / "targets.json").write_text(json.dumps({"targets": doc["targets"]}, indent=1))

    def done(name):
        return doc["stages"].get(name, {}).get("complete", False)

    for name in STAGES:
        if name not in only or done(name):
            continue
        t = time.time()
        if name == "correctness":
            doc[name], complete = stage_correctness(device, args.smoke, deadline)
        elif name == "copy_bw":
            doc[name], complete = stage_copy_bw(device, args.smoke, timer), True
        elif name == "decode":
            bps = ((doc.get("copy_bw") or {}).get("bytes_per_s")
                   or stage_copy_bw(device, args.smoke, timer)["bytes_per_s"])
            doc[name], complete = stage_decode(device, args.smoke, timer, deadline, doc.get(name, []), bps, dispatcher)
        elif name == "int8":
            doc[name], complete = stage_int8(device, args.smoke, timer, deadline, doc.get(name, []))
        elif name == "configs":
            doc[name], complete = stage_configs(device, args.smoke, timer, deadline, doc.get(name, []))
        else:
            doc[name], complete = stage_e2e(args.e2e)
        doc["stages"][name] = {"complete": complete, "s": round(time.time() - t, 1)}
        save()
    save()
    bad = [r for r in doc.get("correctness", []) if not r["ok"]]
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
