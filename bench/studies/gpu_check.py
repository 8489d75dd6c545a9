"""The whole GPU check in one bounded run, writing its JSON after every stage.

    python -m bench.studies.gpu_check --out reports/gpu/gpu_check.json     # on a GPU machine (<= 5 min, cold cache)
    python -m bench.studies.gpu_check --estimate                            # no GPU needed: compilations x compile time
    TRITON_INTERPRET=1 python -m bench.studies.gpu_check --smoke            # the same code path on the CPU, tiny shapes

Stages, in order (a run cut short still leaves every finished stage in the JSON):
1. correctness: every kernel on the GPU against its torch reference (bits 2-8, groups, odd shapes,
   split K, the large-M dequantize path, bit-exact activation quantization);
2. targets: the rows the targets are judged on (issue D, H200: W4A16 >= 3.1x bf16 at M = 1..16 on
   4096x11008; W8A8 >= 1.6x at M >= 1024; W4A8 >= 3x at M = 1 and >= 1.6x at M = 4096; never below 1.0x);
3. latency: every Llama-2-7B layer shape x M x format against torch's bf16 GEMM, with torch's own int4
   kernel (tinygemm, g128) and gemlite (w4 g128 and per channel, when importable) beside ours, and the
   achieved bandwidth of each row against the card's 4.3 TB/s (bytes = packed weights, scales, zero
   points, activations in and out); at M >= 256 the weight-only formats are timed both ways (dequantize
   + cuBLAS, and the fused kernel);
4. the sweep planner's GPU profile (plan-profile-gpu.json beside --out);
5. the offloaded block walk (one block at a time on the GPU) against the all-CPU run.

Bounded: at most two tile configurations per M bucket are compiled and timed (LRQ_KERNEL_TUNE=0: one),
timings are medians of triton.testing.do_bench with the L2 flushed, and `--budget-s` (default 290)
stops the latency table early, then skips what no longer fits, saying so in the JSON.
On a bare GPU machine run from the source tree: PYTHONPATH=. (wheels for what is missing, such as
gemlite, under wheels/: pip install --no-index --no-deps wheels/*.whl).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import torch
from lrq.io import dumps_json

SHAPES_7B = {"4096x4096": (4096, 4096), "11008x4096": (11008, 4096), "4096x11008": (4096, 11008)}
MS = (1, 4, 16, 64, 256, 1024, 2048, 4096)
SCHEMES = ("w4a16", "w4a16-g128", "w3a16", "w8a8", "w4a8")
BANDWIDTH = 4.3e12   # bytes/s: the H200's device-memory bandwidth (measured copy, GPU.md)
TARGETS = [  # (scheme, shape or None for all, M range, minimum speedup over bf16)
    ("w4a16-g128", "4096x11008", (1, 16), 3.1),
    ("w4a16", "4096x11008", (1, 16), 3.1),
    ("w8a8", None, (1024, 1 << 30), 1.6),
    ("w4a8", None, (1, 1), 3.0),
    ("w4a8", None, (4096, 4096), 1.6),
]
TARGET_MS = sorted({1, 4, 16, 1024, 2048, 4096})


def _save(doc: dict, out: Path) -> None:
    from lrq.io import atomic_write_text
    atomic_write_text(out, dumps_json(doc, indent=1, default=str))


def _layer(n: int, k: int, bits: int, group: int | None, seed: int):
    from lrq.packing import pack_planar
    from lrq.quant import n_groups
    g = torch.Generator().manual_seed(seed)
    q = torch.randint(0, 2**bits, (n, k), generator=g)
    ng = n_groups(k, group)
    scale = (torch.rand(n, ng, generator=g) * 0.01 + 1e-3).half()
    zero = torch.randint(0, 2**bits, (n, ng), generator=g).to(torch.uint8)
    return pack_planar(q, bits), scale, zero


def _rel(y: torch.Tensor, ref: torch.Tensor) -> float:
    """Largest deviation from the reference, relative to the reference's largest entry (either on any device)."""
    ref = ref.float().cpu()
    return ((y.float().cpu() - ref).abs().max() / ref.abs().max().clamp(min=1e-6)).item()


def correctness_cases(smoke: bool) -> list[tuple]:
    """(bits, M, K, group, N): odd shapes, every plane combination, decode / small / large M."""
    from lrq.kernels.wq_gemm import LARGE_M
    cases = [(3, 40, 96, 32, 64), (4, 17, 200, None, 70), (4, 1, 256, 128, 64), (2, 5, 160, None, 33),
             (8, 33, 96, None, 64), (5, 3, 130, 64, 48)]
    if not smoke:
        cases += [(4, 1, 4096, 128, 512), (4, 16, 11008, 128, 512), (3, 7, 4096, None, 512),
                  (6, 64, 1000, 128, 300), (7, 2, 344, None, 344), (4, 300, 4096, None, 512),
                  (3, LARGE_M + 7, 576, 128, 1536)]
    return cases


def correctness(device: str, smoke: bool) -> list[dict]:
    from lrq.kernels.int8_gemm import (int8_matmul, quantize_activations, quantize_activations_gpu,
                                       reference_int8_matmul)
    from lrq.kernels.wq_gemm import LARGE_M, dequantize_packed, reference_wq_matmul, wq_matmul
    out = []
    dt = torch.float16 if device == "cpu" else torch.bfloat16   # the interpreter's bf16 dot is wrong
    tol = 2e-3 if dt == torch.float16 else 1e-2
    for bits, m, k, group, n in correctness_cases(smoke):
        packed, scale, zero = _layer(n, k, bits, group, seed=bits * 1000 + m)
        x = torch.randn(m, k, generator=torch.Generator().manual_seed(m)).to(dt)
        t = [v.to(device) for v in (x, packed, scale, zero)]
        ref = reference_wq_matmul(x, packed, scale, zero, bits, group, k)
        paths = [("auto", {})] + ([("fused", {"large_m": "fused"})] if m >= LARGE_M else [])
        for label, kw in paths:
            err = _rel(wq_matmul(*t, bits, group, k, **kw), ref)
            out.append({"kernel": "wq_gemm", "path": label, "bits": bits, "M": m, "K": k, "N": n, "group": group,
                        "rel_err": err, "ok": err < tol})
        w = dequantize_packed(t[1], t[2], t[3], bits, group, k, dt).float().cpu()
        from lrq.packing import unpack_planar
        from lrq.quant import dequantize
        wref = dequantize(unpack_planar(packed, bits, k), scale.float(), zero.float(), group).to(dt).float()
        err = ((w - wref).abs().max() / wref.abs().max()).item()
        out.append({"kernel": "wq_dequant", "bits": bits, "K": k, "N": n, "group": group, "rel_err": err,
                    "ok": err <= 2**-7})
        if group is None and bits in (3, 4, 8):
            for static in (None, (torch.tensor(0.02), torch.tensor(128.0))):
                st = None if static is None else tuple(v.to(device) for v in static)
                y = int8_matmul(t[0], t[1], t[2], t[3], bits, k, None, st)
                err = _rel(y, reference_int8_matmul(x, packed, scale, zero, bits, k, None, static))
                out.append({"kernel": "int8_gemm", "bits": bits, "M": m, "K": k, "N": n,
                            "activations": "static" if static else "per_token", "rel_err": err, "ok": err < tol})
                xa, sx, zx = quantize_activations(x, static)
                xa2, sx2, zx2, xs = quantize_activations_gpu(t[0], st)
                same = (torch.equal(xa, xa2.cpu()) and torch.equal(sx, sx2.cpu()) and torch.equal(zx, zx2.cpu())
                        and torch.equal(xs.cpu(), xa.sum(1, dtype=torch.int32)))
                out.append({"kernel": "act_quant", "M": m, "K": k, "static": static is not None,
                            "bit_exact": same, "ok": same})
    return out


def _weight_bytes(layer) -> int:
    return sum(b.numel() * b.element_size() for b in layer.buffers())


def _peers(n: int, k: int, m: int, device: str, timer) -> dict:
    """torch's int4 weight-only GEMM (tinygemm, g128, bf16 scale+zero) and gemlite's, where available."""
    out: dict = {}
    x = torch.randn(m, k, dtype=torch.bfloat16, device=device)
    try:
        w = torch.randint(0, 16, (n, k), dtype=torch.int32, device=device)
        packed = torch.ops.aten._convert_weight_to_int4pack((w[:, ::2] << 4 | w[:, 1::2]).to(torch.uint8), 8)
        sz = torch.rand(k // 128, n, 2, dtype=torch.bfloat16, device=device)
        out["torch_int4_g128_ms"] = timer(lambda: torch._weight_int4pack_mm(x, packed, 128, sz))
    except Exception as e:  # noqa: BLE001 - recorded, not fatal
        out["torch_int4_error"] = f"{type(e).__name__}: {str(e)[:200]}"
    for label, group in (("gemlite_w4_g128_ms", 128), ("gemlite_w4_ms", k)):
        layer = _gemlite(n, k, group, device)
        if isinstance(layer, str):
            out["gemlite_error"] = layer
            break
        try:
            out[label] = timer(lambda: layer(x))
        except Exception as e:  # noqa: BLE001
            out["gemlite_error"] = f"{type(e).__name__}: {str(e)[:200]}"
            break
    return out


_GEMLITE: dict = {}


def _gemlite(n: int, k: int, group: int, device: str):
    """A gemlite A16W4 layer (asymmetric, float zero points: the same (q - z) * s as ours), or why not."""
    key = (n, k, group)
    if key in _GEMLITE:
        return _GEMLITE[key]
    try:
        import gemlite
        from gemlite.helper import A16Wn
        if not _GEMLITE:
            name = torch.cuda.get_device_name().lower()
            if "h100" not in name and ("h200" in name or "h20" in name):   # same SM count and cache: H100's configs
                gemlite.load_config(str(Path(gemlite.__file__).parent / "configs" / "h100.json"))
        g = torch.Generator(device="cpu").manual_seed(0)
        q = torch.randint(0, 16, (n, k), generator=g, dtype=torch.uint8)
        s = (torch.rand(n, k // group, generator=g) * 0.01 + 1e-3).to(torch.bfloat16)
        z = torch.full((n, k // group), 8.0, dtype=torch.bfloat16)
        layer = A16Wn(device=device, dtype=torch.bfloat16).from_weights(q.to(device), s.to(device), z.to(device),
                                                                         W_nbits=4, group_size=group)
        _GEMLITE[key] = layer
    except Exception as e:  # noqa: BLE001 - gemlite is optional; why it is absent is recorded
        _GEMLITE[key] = f"{type(e).__name__}: {str(e)[:200]}"
    return _GEMLITE[key]


def latency_rows(shapes: dict, ms, schemes, device: str, timer, deadline: float, peers: bool,
                 measured: list[dict] = ()) -> tuple[list, bool]:
    """One row per (shape, M, format); rows already `measured` are reused (only the peers are added);
    stops (returning False) when the deadline passes."""
    from bench.studies.speed import random_packed
    from lrq.kernels.wq_gemm import LARGE_M, wq_matmul
    rows = []
    with torch.no_grad():
        for label, (n, k) in shapes.items():
            ref = torch.nn.Linear(k, n, bias=False, dtype=torch.bfloat16, device=device)
            layers = {s: random_packed(n, k, s, device) for s in schemes}
            for m in ms:
                if time.time() > deadline:
                    return rows, False
                x = torch.randn(m, k, dtype=torch.bfloat16, device=device)
                done = {r["scheme"]: r for r in measured if r["shape"] == label and r["M"] == m}
                bf16 = next(iter(done.values()))["bf16_ms"] if done else timer(lambda: ref(x))
                extra = _peers(n, k, m, device, timer) if peers else {}
                act_bytes = 2 * m * (k + n)
                for scheme in schemes:
                    layer, shown = layers[scheme]
                    if shown in done:
                        rows.append({**done[shown], **extra})
                        continue
                    t = timer(lambda: layer(x))
                    nbytes = _weight_bytes(layer) + act_bytes
                    row = {"shape": label, "N": n, "K": k, "M": m, "scheme": shown, "ms": t, "bf16_ms": bf16,
                           "speedup_vs_bf16": bf16 / t, "bytes": nbytes, "bandwidth_GBps": nbytes / t / 1e6,
                           "bandwidth_fraction": nbytes / (t / 1e3) / BANDWIDTH,
                           "bf16_bandwidth_fraction": (2 * n * k + act_bytes) / (bf16 / 1e3) / BANDWIDTH, **extra}
                    if m >= LARGE_M and layer.scheme.a_bits is None:
                        row["fused_ms"] = timer(lambda: wq_matmul(
                            x, layer.weight_packed, layer.scale, layer.zero, layer.bits, layer.group_size, k,
                            large_m="fused"))
                    rows.append(row)
                    print(f"{label} M={m} {shown}: {t:.4f} ms, bf16 {bf16:.4f} ms (x{bf16 / t:.2f}), "
                          f"{row['bandwidth_fraction']:.0%} of peak bandwidth"
                          + "".join(f", {k2} {v:.4f}" for k2, v in extra.items() if k2.endswith("_ms") and v)
                          + (f", fused {row['fused_ms']:.4f} ms" if "fused_ms" in row else ""), flush=True)
    return rows, True


def judge_targets(rows: list[dict]) -> list[dict]:
    out = []
    for scheme, shape, (lo, hi), need in TARGETS:
        sel = [r for r in rows if r["scheme"] == scheme and lo <= r["M"] <= hi and (shape is None or r["shape"] == shape)]
        if sel:
            worst = min(sel, key=lambda r: r["speedup_vs_bf16"])
            out.append({"scheme": scheme, "shape": shape, "M": [lo, hi], "need": need,
                        "worst": worst["speedup_vs_bf16"], "worst_at": f"{worst['shape']} M={worst['M']}",
                        "met": worst["speedup_vs_bf16"] >= need})
    return out


def planned_compilations(smoke: bool = False, sms: int = 132, tune: bool = True) -> list:
    """The kernel compilations a (non-smoke) check does on a GPU with `sms` SMs, from the dispatchers' own
    decisions: distinct (kernel, configuration, constexprs, alignment) over every call it makes."""
    from lrq.kernels import aot
    from lrq.kernels import int8_gemm as I8
    from lrq.kernels import wq_gemm as WQ
    from lrq.schemes import get_scheme
    seen = {}

    def add(items, aligned):
        for kernel, cfg, ce in items:
            v = aot.variant_of(kernel, cfg, ce, aligned)
            seen[v] = True

    def call(m, n, k, scheme, **kw):
        s = get_scheme(scheme)
        aligned = n % 16 == 0 and k % 16 == 0
        if s.a_bits == 8 and s.group_size is None:
            add(I8.compilations(m, n, k, s.w_bits, torch.bfloat16, s.static_activations, sms=sms, tune=tune), aligned)
        else:
            add(WQ.compilations(m, n, k, s.w_bits, s.group_size, torch.bfloat16, sms=sms, tune=tune, **kw), aligned)
    for bits, m, k, group, n in correctness_cases(smoke):
        aligned = n % 16 == 0 and k % 16 == 0 and (k * bits) % 512 == 0
        add(WQ.compilations(m, n, k, bits, group, torch.bfloat16, sms=sms, tune=tune), aligned)
        if m >= WQ.LARGE_M:
            add(WQ.compilations(m, n, k, bits, group, torch.bfloat16, sms=sms, tune=tune, large_m="fused"), aligned)
        if group is None and bits in (3, 4, 8):
            for static in (False, True):
                add(I8.compilations(m, n, k, bits, torch.bfloat16, static, sms=sms, tune=tune), aligned)
    for label, (n, k) in SHAPES_7B.items():
        for m in MS:
            for scheme in SCHEMES:
                call(m, n, k, scheme)
                if m >= WQ.LARGE_M and get_scheme(scheme).a_bits is None:
                    call(m, n, k, scheme, large_m="fused")
    return list(seen)


def estimate(json_out: str | None) -> int:
    """Compile, for sm_90 on this machine, every kernel variant the GPU check will compile; report how many
    there are and the measured time (the GPU machine's own CPU compiles them; its speed differs)."""
    from lrq.kernels import aot
    vs = planned_compilations()
    t = time.time()
    rows = aot.run((90,), jobs=min(2, os.cpu_count() or 1), only=vs)
    times = sorted(r["compile_s"] for r in rows)
    doc = {"compilations": len(vs), "by_kernel": {k: sum(v.kernel == k for v in vs) for k in sorted({v.kernel for v in vs})},
           "compile_s_total": round(sum(times), 1), "compile_s_median": times[len(times) // 2],
           "compile_s_max": times[-1], "wall_s_here_2_jobs": round(time.time() - t, 1),
           "estimate_s_one_process": round(len(vs) * times[len(times) // 2], 1),
           "failed": [aot.violations(r) for r in rows if aot.violations(r)]}
    print(json.dumps(doc, indent=1))
    if json_out:
        Path(json_out).write_text(dumps_json(doc, indent=1))
    return 1 if doc["failed"] else 0


def offload_check(device: str) -> dict:
    """Block-wise quantization with the model kept on the CPU and one block at a time on `device` (the
    offloaded walk) against the same run entirely on the CPU: every block back on the CPU afterwards,
    device memory bounded by about one block, and the same quantization up to float differences.

    "The same" is judged by quality, not bit for bit: another device's float rounding moves the weights
    that sit within an ulp of a rounding boundary to the neighbouring level (a whole step), and GPTQ's error
    feedback carries each such flip along its row, so the logits of two correct runs differ by several per
    cent of their largest value (0.06 and 0.11 on the H200, 2026-12-04). What must agree is the error
    against the FP model: the two runs' relative logit errors within 10 % of each other. On one device the
    runs are identical (0.0)."""
    import copy

    from transformers import LlamaConfig, LlamaForCausalLM

    from lrq.methods import Calibration, get_method
    from lrq.qlinear import QuantLinear
    from lrq.schemes import get_scheme
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=512, hidden_size=256, intermediate_size=688, num_hidden_layers=4,
                      num_attention_heads=4, num_key_value_heads=4, tie_word_embeddings=False)
    model = LlamaForCausalLM(cfg).eval()
    ids = torch.randint(0, 512, (8, 64), generator=torch.Generator().manual_seed(0))
    calib = Calibration(ids, {"dataset": "random", "n_samples": 8, "seq_len": 64, "seed": 0})
    out = {}
    with torch.no_grad():
        fp = model(ids[:2]).logits
    for method in ("lrq", "gptq"):
        c = get_method(method).config("quick", {"iters": 5, "heldout_samples": 2, "autocast": False})
        ref, off = copy.deepcopy(model), copy.deepcopy(model)
        get_method(method).quantize(ref, get_scheme("w4a16"), c, calib)
        if device == "cuda":
            torch.cuda.reset_peak_memory_stats()
        get_method(method, device=device).quantize(off, get_scheme("w4a16"), c, calib)   # the offloaded walk
        peak = torch.cuda.max_memory_allocated() if device == "cuda" else None
        with torch.no_grad():
            a, b = ref(ids[:2]).logits, off(ids[:2]).logits
        block_bytes = sum(p.numel() * p.element_size() for p in model.model.layers[0].parameters())
        err_ref, err_off = (float((x - fp).norm() / fp.norm()) for x in (a, b))
        q_ref, q_off = ([m.qweight for m in x.modules() if isinstance(m, QuantLinear)] for x in (ref, off))
        differ = sum(int((x != y).sum()) for x, y in zip(q_ref, q_off))
        r = out[method] = {
            "max_rel_logit_diff": float((a - b).abs().max() / a.abs().max()),
            "rel_logit_err_cpu": err_ref, "rel_logit_err_offloaded": err_off,
            "err_gap": abs(err_off - err_ref) / max(err_ref, 1e-12),
            "int_weights_differing": differ / max(1, sum(x.numel() for x in q_ref)),
            "all_on_cpu_after": all(p.device.type == "cpu" for p in off.parameters())
            and all(t.device.type == "cpu" for t in off.buffers()),
            "peak_device_bytes": peak, "block_bytes": block_bytes,
            "model_bytes": sum(p.numel() * p.element_size() for p in model.parameters())}
        r["ok"] = r["all_on_cpu_after"] and len(q_ref) == len(q_off) > 0 and r["err_gap"] <= 0.10
    return out


def _cpu_once(fn) -> float:
    t = time.perf_counter()
    fn()
    return (time.perf_counter() - t) * 1e3


STAGES = ("correctness", "targets", "latency", "plan_profile", "offload")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default="gpu_check.json")
    ap.add_argument("--smoke", action="store_true", help="tiny shapes (runs under TRITON_INTERPRET=1 on a CPU)")
    ap.add_argument("--estimate", action="store_true",
                    help="no GPU needed: count the compilations the check does and time them for sm_90 here")
    ap.add_argument("--budget-s", type=float, default=290.0, help="wall-time budget of the whole check")
    ap.add_argument("--no-peers", action="store_true", help="skip torch's int4 kernel and gemlite")
    ap.add_argument("--only", default=",".join(STAGES), metavar="STAGE[,STAGE]",
                    help=f"run only these stages, of {', '.join(STAGES)} (a rerun of the ones a cut run missed)")
    args = ap.parse_args(argv)
    only = [s.strip() for s in args.only.split(",") if s.strip()]
    if unknown := sorted(set(only) - set(STAGES)):
        ap.error(f"unknown stage(s) {', '.join(unknown)}: choose from {', '.join(STAGES)}")
    if args.estimate:
        return estimate(None if args.out == "gpu_check.json" else args.out)
    from bench.common.provenance import git_revision, hardware, versions
    from bench.studies.speed import median_ms
    t0 = time.time()
    deadline = t0 + args.budget_s
    device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
        print("no GPU: run with TRITON_INTERPRET=1 --smoke to exercise the script on the CPU", file=sys.stderr)
        return 2
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    vers = versions()
    try:
        import importlib.metadata
        vers["gemlite"] = importlib.metadata.version("gemlite")
    except Exception:  # noqa: BLE001 - optional
        pass
    doc = {"device": torch.cuda.get_device_name() if device == "cuda" else "cpu (interpreter)",
           "hardware": hardware(), "versions": vers, "git_rev": git_revision(), "smoke": args.smoke,
           "budget_s": args.budget_s, "kernel_tune": os.environ.get("LRQ_KERNEL_TUNE", "1") != "0",
           "bandwidth_peak_Bps": BANDWIDTH, "stages": {}}

    def stage(name: str, t_start: float, **fields) -> None:
        doc["stages"][name] = {"wall_s": round(time.time() - t_start, 1), **fields}
        doc["wall_s"] = round(time.time() - t0, 1)
        _save(doc, out)
        print(f"[{doc['wall_s']:.0f} s] {name} done", flush=True)

    doc["only"] = only
    # 1. correctness
    t = time.time()
    if "correctness" in only:
        doc["correctness"] = correctness(device, args.smoke)
        n_ok = sum(c["ok"] for c in doc["correctness"])
        print(f"correctness: {n_ok}/{len(doc['correctness'])} ok", flush=True)
        stage("correctness", t, ok=n_ok == len(doc["correctness"]))

    timer = (lambda fn: median_ms(fn, "cuda")) if device == "cuda" else _cpu_once
    shapes = {"64x96": (64, 96)} if args.smoke else SHAPES_7B
    # 2. the target rows first, so a cut run still judges them
    t = time.time()
    doc["target_rows"] = []
    if "targets" in only:
        rows, complete = latency_rows(shapes, (1, 16) if args.smoke else TARGET_MS, SCHEMES, device, timer,
                                      deadline, peers=False)
        doc["target_rows"] = rows
        doc["targets"] = judge_targets(rows) if device == "cuda" else []   # CPU smoke timings judge nothing
        stage("targets", t, complete=complete)

    # 3. the full table with the peers, until the budget leaves room for the last two stages
    t = time.time()
    if "latency" in only:
        reserve = 0 if args.smoke else 60
        rows, complete = latency_rows(shapes, (1, 16) if args.smoke else MS, SCHEMES, device, timer,
                                      deadline - reserve, peers=device == "cuda" and not args.no_peers,
                                      measured=doc["target_rows"])
        doc["latency"] = rows
        doc["never_below_1x"] = all(r["speedup_vs_bf16"] >= 1.0 for r in rows) if rows else None
        from lrq.kernels import int8_gemm, wq_gemm
        doc["tuned_configs"] = {str(k): str(v) for tuner in (wq_gemm._TUNER, int8_gemm._TUNER)
                                for k, v in tuner.best.items()}
        stage("latency", t, complete=complete, rows=len(rows))

    # 4. the planner's GPU profile
    t = time.time()
    if "plan_profile" not in only:
        pass
    elif args.smoke:
        stage("plan_profile", t, skipped="smoke")
    elif time.time() > deadline - 40:
        stage("plan_profile", t, skipped="budget")
    else:
        from bench.run.profile import measure_profile
        prof = measure_profile(device)
        out.with_name("plan-profile-gpu.json").write_text(dumps_json(prof, indent=1, default=str))
        stage("plan_profile", t, file=str(out.with_name("plan-profile-gpu.json")))

    # 5. the offloaded block walk
    t = time.time()
    if "offload" not in only:
        pass
    elif time.time() > deadline - 15 and not args.smoke:
        stage("offload", t, skipped="budget")
    else:
        doc["offload"] = offload_check(device)
        print(f"offloaded block walk: {json.dumps(doc['offload'])}", flush=True)
        stage("offload", t)
    print(f"wrote {out} in {doc['wall_s']:.0f} s")
    ok = all(c["ok"] for c in doc.get("correctness", [])) and all(v["ok"] for v in doc.get("offload", {}).values())
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
