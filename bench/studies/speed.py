"""Inference speed and memory of packed quantized layers and models vs bf16.

    python -m bench.studies.speed layers [--shapes smollm2|llama2-7b] [--ms 1,16,64,256,2048] [--out layers.json]
    python -m bench.studies.speed e2e    [--schemes w4a16,w8a8,...] [--prefill 512] [--decode 32] [--out e2e.json]

`layers`: per-layer latency (median of torch.utils.benchmark's blocked autorange on the CPU, of
triton.testing.do_bench on a GPU) of every scheme's PackedLinear forward against the bf16 nn.Linear, and
the weight bytes of each. `e2e`: the default model quantized with RTN (weights only matter here),
packed, then prefill tokens/s (one forward of `prefill` tokens) and decode tokens/s (greedy generation
of `decode` tokens with the KV cache) against bf16; weight bytes of the linears and of the whole model.
Both print a Markdown table and write JSON with the hardware and versions; `--results` also stores the
figures in the results store (dataset "speed") so the report shows them.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch
from torch import nn
from lrq.io import dumps_json

SHAPES = {  # (out_features, in_features) per linear kind
    "smollm2": {"qkv/o 576x576": (576, 576), "gate/up 1536x576": (1536, 576), "down 576x1536": (576, 1536)},
    "llama2-7b": {"4096x4096": (4096, 4096), "11008x4096": (11008, 4096), "4096x11008": (4096, 11008)},
}
LAYER_SCHEMES = ("w4a16", "w4a16-g128", "w3a16", "w3a16-g128", "w8a16", "w8a8", "w4a8")


def random_packed(n: int, k: int, scheme_name: str, device: str):
    """A PackedLinear with random levels, fp16 scales and zero points, built on `device` (speed does not depend
    on values; every bit pattern of the planar layout is valid levels, so the words themselves are random)."""
    from lrq.packed import PackedLinear
    from lrq.quant import n_groups
    from lrq.schemes import get_scheme
    s = get_scheme(scheme_name)
    if s.group_size is not None and k % s.group_size:
        s = type(s)(**{**s.__dict__, "group_size": 64, "name": s.name.replace("g128", "g64")})
    m = PackedLinear(k, n, False, s).to(device)
    g = torch.Generator(device=device).manual_seed(0)
    m.weight_packed.copy_(torch.randint(-2**31, 2**31, m.weight_packed.shape, generator=g, device=device,
                                        dtype=torch.int64).to(torch.int32))
    m.scale.copy_((torch.rand(n, n_groups(k, s.group_size), generator=g, device=device) * 0.01 + 1e-3).half())
    m.zero.fill_(2 ** (s.w_bits - 1))
    if s.static_activations:
        m.act_scale.fill_(0.05)
        m.act_zero.fill_(128)
    return m, s.name


def median_ms(fn, device: str) -> float:
    if device == "cuda":
        import triton.testing
        return float(triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median"))
    import torch.utils.benchmark as tb
    return tb.Timer(stmt="fn()", globals={"fn": fn}).blocked_autorange(min_run_time=0.5).median * 1e3


def weight_bytes(m: nn.Module) -> int:
    """Every parameter and buffer, plus the CPU kernel's form of the weights a PackedLinear holds instead of its
    planar words."""
    from lrq.packed import PackedLinear
    extra = sum(p.storage_bytes() - sum(b.numel() * b.element_size() for b in p.buffers())
                for p in m.modules() if isinstance(p, PackedLinear))
    return sum(t.numel() * t.element_size() for t in list(m.parameters()) + list(m.buffers())) + extra


@torch.no_grad()
def layer_latency(shapes: dict, ms: list[int], schemes=LAYER_SCHEMES, device: str = "cpu") -> list[dict]:
    rows = []
    for label, (n, k) in shapes.items():
        ref = nn.Linear(k, n, bias=False, dtype=torch.bfloat16, device=device)
        for m in ms:
            x = torch.randn(m, k, dtype=torch.bfloat16, device=device)
            bf16 = median_ms(lambda: ref(x), device)
            for name in schemes:
                layer, shown = random_packed(n, k, name, device)
                t = median_ms(lambda: layer(x), device)
                rows.append({"shape": label, "N": n, "K": k, "M": m, "scheme": shown, "ms": t, "bf16_ms": bf16,
                             "speedup_vs_bf16": bf16 / t, "weight_bytes": weight_bytes(layer),
                             "bf16_weight_bytes": weight_bytes(ref)})
                print(f"{label:>18} M={m:<5} {shown:<11} {t:9.3f} ms  bf16 {bf16:9.3f} ms  x{bf16 / t:5.2f}",
                      flush=True)
    return rows


def e2e_isolated(schemes: list[str], prefill: int, decode: int, data_dir: str | None, model_name: str,
                 with_bf16: bool = True) -> list[dict]:
    """e2e with every configuration in its own process, so each peak RSS is its own (RSS never shrinks)."""
    import subprocess
    import tempfile
    rows = []
    for name in (["bf16"] if with_bf16 else []) + schemes:
        with tempfile.TemporaryDirectory() as tmp:
            out = Path(tmp) / "one.json"
            cmd = [sys.executable, "-m", "bench.studies.speed", "e2e", "--one", name, "--prefill", str(prefill),
                   "--decode", str(decode), "--model", model_name, "--out", str(out)]
            if data_dir:
                cmd += ["--data-dir", data_dir]
            subprocess.run(cmd, check=True)
            rows += json.loads(out.read_text())["rows"]
    return rows


@torch.no_grad()
def e2e(schemes: list[str], prefill: int, decode: int, data_dir: str | None, model_name: str,
        with_bf16: bool = True) -> list[dict]:
    from bench.evaluations import data as D
    from bench.common.models import load_model
    from lrq.methods import get_method, load_methods
    from lrq.packed import pack_model
    from lrq.schemes import get_scheme
    load_methods()
    rows = []
    for name in (["bf16"] if with_bf16 else []) + schemes:
        loaded = load_model(model_name)
        model, tok = loaded.model.to(torch.bfloat16).eval(), loaded.tokenizer
        if name != "bf16":
            scheme, rtn = get_scheme(name), get_method("rtn")
            calib = None
            if rtn.needs_calibration(scheme):
                calib = D.calibration_set(tok, D.resolve_data_dir(data_dir), "c4", 16, 512)
            rtn.quantize(model, scheme, rtn.config("quick"), calib)
            sizes = pack_model(model)
        else:
            sizes = {"linear_bytes_bf16": 0, "linear_bytes_packed": 0}
        from bench.common.measure import measure
        ids = torch.randint(100, 1000, (1, prefill), generator=torch.Generator().manual_seed(0))
        model(ids[:, :16])  # warm-up
        with measure() as mp:
            model(ids)
        t_prefill = mp.wall_s
        with measure() as md:
            out = model.generate(ids[:, :16], max_new_tokens=decode, min_new_tokens=decode, do_sample=False,
                                 pad_token_id=tok.eos_token_id if tok is not None else 0)
        t_decode = md.wall_s
        new = out.shape[1] - 16
        rows.append({"scheme": name, "prefill_tokens": prefill, "prefill_tok_s": prefill / t_prefill,
                     "decode_tokens": new, "decode_tok_s": new / t_decode,
                     "model_bytes": weight_bytes(model), "linear_bytes": sizes["linear_bytes_packed"] or None,
                     "peak_rss_bytes": max(mp.peak_rss_bytes, md.peak_rss_bytes),
                     "peak_cuda_bytes": max(mp.peak_cuda_bytes or 0, md.peak_cuda_bytes or 0) or None})
        print(f"{name:<11} prefill {prefill / t_prefill:8.1f} tok/s  decode {new / t_decode:7.2f} tok/s  "
              f"model {weight_bytes(model) / 2**20:7.1f} MiB  peak RSS {rows[-1]['peak_rss_bytes'] / 2**20:7.0f} MiB",
              flush=True)
    return rows


def _provenance() -> dict:
    from bench.common.provenance import git_revision, hardware, versions
    return {"hardware": hardware(), "versions": versions(), "git_rev": git_revision(),
            "threads": torch.get_num_threads()}


def _store(rows: list[dict], kind: str, results: str, model: str) -> None:
    from bench.common.provenance import git_revision, hardware, versions
    from bench.common.store import ResultStore, Row, unit_key
    store = ResultStore(results)
    metrics = {"layers": ("ms", "speedup_vs_bf16", "weight_bytes"),
               "e2e": ("prefill_tok_s", "decode_tok_s", "model_bytes", "peak_rss_bytes")}[kind]
    out = []
    for r in rows:
        cfg = {k: v for k, v in r.items() if k not in metrics} | {"kind": kind, "threads": torch.get_num_threads()}
        for metric in metrics:
            name = metric if kind == "e2e" else f"{r['shape']} M={r['M']} {metric}"
            out.append(Row(model=model, method="rtn" if r["scheme"] != "bf16" else "fp", scheme=r["scheme"],
                           dataset=f"speed_{kind}", metric=name, value=r[metric], config=cfg, seed=0,
                           versions=versions(), git_rev=git_revision(), hardware=hardware()))
    store.write_unit(out, unit_key({"speed": kind, "rows": [r.metric + r.scheme for r in out],
                                    "t": time.time()}), "speed")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description="inference speed of packed quantized layers/models vs bf16")
    ap.add_argument("what", choices=["layers", "e2e"])
    ap.add_argument("--shapes", default="smollm2", choices=sorted(SHAPES))
    ap.add_argument("--ms", default="1,16,64,256,2048")
    ap.add_argument("--schemes", default=",".join(LAYER_SCHEMES))
    ap.add_argument("--prefill", type=int, default=512)
    ap.add_argument("--decode", type=int, default=32)
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--data-dir", default=None)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--out", default=None)
    ap.add_argument("--results", default=None, help="also store the figures in this results store")
    ap.add_argument("--shape", default=None,
                    help="e2e on a random-weight model of this shape (llama-2-7b, llama-2-13b, ...; the default "
                         "with --device cuda: llama-2-7b), static KV cache and CUDA graphs (bench.studies.speed_e2e)")
    ap.add_argument("--layers", type=int, default=8, help="decoder blocks of the --shape model")
    ap.add_argument("--no-graphs", action="store_true", help="--shape: time eager steps instead of CUDA graphs")
    ap.add_argument("--one", default=None, help=argparse.SUPPRESS)   # e2e worker: one configuration
    args = ap.parse_args(argv)
    schemes = [s for s in args.schemes.split(",") if s]
    if args.what == "e2e" and (args.shape or args.device == "cuda"):
        from bench.studies import speed_e2e
        shape = args.shape or "llama-2-7b"
        rows = speed_e2e.run(shape, args.layers, schemes, args.device, args.prefill, args.decode,
                             graphs=not args.no_graphs)
        args.model = f"{shape} ({args.layers} layers, random weights)"
    elif args.what == "layers":
        rows = layer_latency(SHAPES[args.shapes], [int(m) for m in args.ms.split(",")], schemes, args.device)
    elif args.one:
        rows = e2e([] if args.one == "bf16" else [args.one], args.prefill, args.decode, args.data_dir, args.model,
                   with_bf16=args.one == "bf16")
    else:
        rows = e2e_isolated(schemes, args.prefill, args.decode, args.data_dir, args.model)
    doc = {"what": args.what, "device": args.device, "model": args.model, **_provenance(), "rows": rows}
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(dumps_json(doc, indent=2, default=str))
    if args.results and not any("error" in r for r in rows):
        _store(rows, args.what, args.results, args.model)
    return 1 if any("error" in r for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
