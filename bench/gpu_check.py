"""The whole GPU check in one go: kernel correctness against the torch references, then per-layer
latency of the fused kernels vs torch bf16 matmul and vs torch's built-in int4 weight-only kernel
(torch._weight_int4pack_mm, g128) on Llama-2-7B shapes, written as one JSON.

    python -m bench.gpu_check --out gpu_check.json            # on a GPU machine
    TRITON_INTERPRET=1 python -m bench.gpu_check --smoke      # the same code path on the CPU, tiny shapes

Targets (issue D, H200): W4A16 >= 3.1x over bf16 at M = 1..16 on 4096x11008; W8A8 >= 1.6x at M >= 1024;
W4A8 >= 3x at M = 1 and >= 1.6x at M = 4096; never below 1.0x. The JSON says which were met.
It also measures the sweep planner's machine profile on the GPU (plan-profile-gpu.json beside --out), so
that `lrq-bench plan --machine-profile plan-profile-gpu.json` gives GPU-hours on any machine.
On a bare GPU machine, install first from carried wheels: pip install --no-index --find-links wheels/ -e .
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import torch

SHAPES_7B = {"4096x4096": (4096, 4096), "11008x4096": (11008, 4096), "4096x11008": (4096, 11008)}
MS = (1, 4, 16, 64, 256, 1024, 2048, 4096)
TARGETS = [  # (scheme, shape, M range, minimum speedup)
    ("w4a16-g128", "4096x11008", (1, 16), 3.1),
    ("w4a16", "4096x11008", (1, 16), 3.1),
    ("w8a8", None, (1024, 1 << 30), 1.6),
    ("w4a8", None, (1, 1), 3.0),
    ("w4a8", None, (4096, 4096), 1.6),
]


def correctness(device: str, smoke: bool) -> list[dict]:
    from lrq.kernels.int8_gemm import int8_matmul, reference_int8_matmul
    from lrq.kernels.wq_gemm import reference_wq_matmul, wq_matmul
    from lrq.packing import pack_bits
    from lrq.quant import n_groups
    out = []
    g = torch.Generator().manual_seed(0)
    cases = [(3, 40, 96, 32), (4, 17, 200, None), (4, 1, 256, 128), (3, 5, 160, None), (8, 33, 96, None)]
    if not smoke:
        cases += [(4, 1, 4096, 128), (4, 16, 11008, 128), (3, 7, 4096, None), (4, 300, 4096, None),
                  (8, 1024, 4096, None)]
    for bits, m, k, group in cases:
        n = 64 if smoke else 512
        q = torch.randint(0, 2**bits, (n, k), generator=g)
        ng = n_groups(k, group)
        scale = (torch.rand(n, ng, generator=g) * 0.01 + 1e-3).half()
        zero = torch.randint(0, 2**bits, (n, ng), generator=g).to(torch.uint8)
        x = torch.randn(m, k, generator=g)
        packed = pack_bits(q, bits)
        t = [v.to(device) for v in (x, packed, scale, zero)]
        y = wq_matmul(t[0], t[1], t[2], t[3], bits, group, k).cpu()
        ref = reference_wq_matmul(x, packed, scale, zero, bits, group, k)
        err = ((y - ref).abs().max() / ref.abs().max().clamp(min=1e-6)).item()
        out.append({"kernel": "wq_gemm", "bits": bits, "M": m, "K": k, "N": n, "group": group, "rel_err": err,
                    "ok": err < 1e-3})
        if group is None:
            for static in (None, (torch.tensor(0.02), torch.tensor(128.0))):
                st = None if static is None else tuple(v.to(device) for v in static)
                y = int8_matmul(t[0], t[1], t[2], t[3], bits, k, None, st).cpu()
                ref = reference_int8_matmul(x, packed, scale, zero, bits, k, None, static)
                err = ((y - ref).abs().max() / ref.abs().max().clamp(min=1e-6)).item()
                out.append({"kernel": "int8_gemm", "bits": bits, "M": m, "K": k, "N": n,
                            "activations": "static" if static else "per_token", "rel_err": err, "ok": err < 1e-3})
    return out


def offload_check(device: str) -> dict:
    """Block-wise quantization with the model kept on the CPU and one block at a time on `device` (the
    offloaded walk) against the same run entirely on the CPU: same weights up to float differences,
    every block back on the CPU afterwards, device memory bounded by about one block."""
    import copy

    from transformers import LlamaConfig, LlamaForCausalLM

    from lrq.methods import Calibration, get_method
    from lrq.schemes import get_scheme
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=512, hidden_size=256, intermediate_size=688, num_hidden_layers=4,
                      num_attention_heads=4, num_key_value_heads=4, tie_word_embeddings=False)
    model = LlamaForCausalLM(cfg).eval()
    ids = torch.randint(0, 512, (8, 64), generator=torch.Generator().manual_seed(0))
    calib = Calibration(ids, {"dataset": "random", "n_samples": 8, "seq_len": 64, "seed": 0})
    out = {}
    for method in ("lrq", "gptq"):
        m = get_method(method)
        if hasattr(m, "checkpoint_dir"):
            m.checkpoint_dir = None
        c = m.config("quick", {"iters": 5, "heldout_samples": 2, "autocast": False})
        ref, off = copy.deepcopy(model), copy.deepcopy(model)
        m.device = None
        m.quantize(ref, get_scheme("w4a16"), c, calib)
        if device == "cuda":
            torch.cuda.reset_peak_memory_stats()
        m.device = torch.device(device)
        m.quantize(off, get_scheme("w4a16"), c, calib)
        m.device = None
        peak = torch.cuda.max_memory_allocated() if device == "cuda" else None
        with torch.no_grad():
            a, b = ref(ids[:2]).logits, off(ids[:2]).logits
        block_bytes = sum(p.numel() * p.element_size() for p in model.model.layers[0].parameters())
        out[method] = {"max_rel_logit_diff": float((a - b).abs().max() / a.abs().max()),
                       "all_on_cpu_after": all(p.device.type == "cpu" for p in off.parameters()),
                       "peak_device_bytes": peak, "block_bytes": block_bytes,
                       "model_bytes": sum(p.numel() * p.element_size() for p in model.parameters())}
        out[method]["ok"] = out[method]["all_on_cpu_after"] and out[method]["max_rel_logit_diff"] < 0.05
    return out


def torch_int4_ms(n: int, k: int, m: int, device: str, timer) -> float | None:
    """torch's own int4 weight-only GEMM (tinygemm) at group 128, the built-in baseline."""
    try:
        w = torch.randint(0, 16, (n, k), dtype=torch.int32, device=device)
        packed = torch.ops.aten._convert_weight_to_int4pack((w[:, ::2] << 4 | w[:, 1::2]).to(torch.uint8), 8)
        sz = torch.rand(k // 128, n, 2, dtype=torch.bfloat16, device=device)
        x = torch.randn(m, k, dtype=torch.bfloat16, device=device)
        return timer(lambda: torch._weight_int4pack_mm(x, packed, 128, sz))
    except Exception as e:  # noqa: BLE001 - recorded, not fatal
        return None if not os.environ.get("LRQ_DEBUG") else print(f"torch int4 failed: {e}")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default="gpu_check.json")
    ap.add_argument("--smoke", action="store_true", help="tiny shapes (runs under TRITON_INTERPRET=1 on a CPU)")
    args = ap.parse_args(argv)
    from bench.provenance import git_revision, hardware, versions
    from bench.speed import median_ms, random_packed
    device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
        print("no GPU: run with TRITON_INTERPRET=1 --smoke to exercise the script on the CPU", file=sys.stderr)
        return 2
    t0 = time.time()
    doc = {"device": torch.cuda.get_device_name() if device == "cuda" else "cpu (interpreter)",
           "hardware": hardware(), "versions": versions(), "git_rev": git_revision(), "smoke": args.smoke}
    doc["correctness"] = correctness(device, args.smoke)
    print(f"correctness: {sum(c['ok'] for c in doc['correctness'])}/{len(doc['correctness'])} ok", flush=True)
    doc["offload"] = offload_check(device)
    print(f"offloaded block walk: {json.dumps(doc['offload'])}", flush=True)
    if not args.smoke:
        # the sweep planner's per-block costs on this GPU: `lrq-bench plan --machine-profile FILE` anywhere
        from bench.plan import measure_profile
        prof = measure_profile(device)
        Path(args.out).with_name("plan-profile-gpu.json").write_text(json.dumps(prof, indent=1, default=str))
        print(f"plan profile: {json.dumps({k: round(v['flops_per_s'] / 1e12, 2) for k, v in prof['kinds'].items()})} "
              f"TFLOP/s", flush=True)
    shapes = {"64x96": (64, 96)} if args.smoke else SHAPES_7B
    ms = (1, 16) if args.smoke else MS
    timer = (lambda fn: median_ms(fn, "cuda")) if device == "cuda" else (lambda fn: _cpu_once(fn))
    rows = []
    with torch.no_grad():
        for label, (n, k) in shapes.items():
            ref = torch.nn.Linear(k, n, bias=False, dtype=torch.bfloat16, device=device)
            for m in ms:
                x = torch.randn(m, k, dtype=torch.bfloat16, device=device)
                bf16 = timer(lambda: ref(x))
                int4 = torch_int4_ms(n, k, m, device, timer) if device == "cuda" else None
                for scheme in ("w4a16", "w4a16-g128", "w3a16", "w8a8", "w4a8"):
                    layer, shown = random_packed(n, k, scheme, device)
                    t = timer(lambda: layer(x))
                    rows.append({"shape": label, "M": m, "scheme": shown, "ms": t, "bf16_ms": bf16,
                                 "speedup_vs_bf16": bf16 / t, "torch_int4_g128_ms": int4})
                    print(f"{label} M={m} {shown}: {t:.4f} ms, bf16 {bf16:.4f} ms (x{bf16 / t:.2f})"
                          + (f", torch int4 {int4:.4f} ms" if int4 else ""), flush=True)
    doc["latency"] = rows
    doc["targets"] = []
    for scheme, shape, (lo, hi), need in TARGETS:
        sel = [r for r in rows if r["scheme"] == scheme and lo <= r["M"] <= hi and (shape is None or r["shape"] == shape)]
        if sel:
            worst = min(r["speedup_vs_bf16"] for r in sel)
            doc["targets"].append({"scheme": scheme, "shape": shape, "M": [lo, hi], "need": need, "worst": worst,
                                   "met": worst >= need})
    doc["never_below_1x"] = all(r["speedup_vs_bf16"] >= 1.0 for r in rows)
    doc["wall_s"] = time.time() - t0
    Path(args.out).write_text(json.dumps(doc, indent=2, default=str))
    print(f"wrote {args.out} in {doc['wall_s']:.0f} s")
    ok = all(c["ok"] for c in doc["correctness"]) and all(v["ok"] for v in doc["offload"].values())
    return 0 if ok else 1


def _cpu_once(fn) -> float:
    t = time.perf_counter()
    fn()
    return (time.perf_counter() - t) * 1e3


if __name__ == "__main__":
    sys.exit(main())
