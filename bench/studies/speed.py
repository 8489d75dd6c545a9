"""Inference speed and memory of packed quantized layers and models vs bf16.

    python -m bench.studies.speed layers [--shapes smollm2|llama2-7b] [--ms 1,16,64,256,2048] [--out layers.json]
    python -m bench.studies.speed e2e    [--schemes w4a16,w8a8,...] [--prefill 512] [--decode 32] [--rounds 5]
                                         [--threads 1] [--anchors llama.cpp|none] [--out reports/speed-cpu]
                                         [--emulate-avx2]

`layers`: per-layer latency (median of torch.utils.benchmark's blocked autorange on the CPU, of
triton.testing.do_bench on a GPU) of every scheme's PackedLinear forward against the bf16 nn.Linear, and
the weight bytes of each. `e2e` on the CPU: the default model quantized with RTN (weights only matter here) and
packed, every format beside the dense model in one process, interleaved (bench.studies.speed_cpu: decode ms/token,
prefill tokens/s, resident weight memory, ratios against the faster dense model; llama.cpp running the same GGUF
joins the rounds where llama-cpp-python is installed, `pip install -e '.[anchors]'`: bench.studies.anchors); on a
GPU, or with `--shape`, a random-weight model of a named shape with a static KV cache and CUDA graphs
(bench.studies.speed_e2e). Both print a Markdown table and write JSON with the hardware and versions;
`--results` also stores the figures in the results store (dataset "speed_...") so the report shows them.
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


def _provenance() -> dict:
    from bench.common.provenance import git_revision, hardware, versions
    return {"hardware": hardware(), "versions": versions(), "git_rev": git_revision(),
            "threads": torch.get_num_threads()}


def _store(rows: list[dict], kind: str, results: str, model: str) -> None:
    from bench.common.provenance import git_revision, hardware, versions
    from bench.common.store import ResultStore, Row, unit_key
    store = ResultStore(results)
    metrics = {"layers": ("ms", "speedup_vs_bf16", "weight_bytes"),
               # weights as held (parameters, buffers and the kernels' own copies) and the allocator's peak (GPU)
               "e2e": ("prefill_tok_s", "decode_tok_s", "resident_weight_bytes", "peak_gpu_bytes"),
               "e2e-cpu": ("decode_ms", "decode_vs_dense", "prefill_tok_s", "prefill_vs_dense",
                           "weight_rss_bytes")}[kind]
    out = []
    for r in rows:
        cfg = {k: v for k, v in r.items() if k not in metrics} | {"kind": kind, "threads": torch.get_num_threads()}
        scheme = r.get("scheme") or r["candidate"]
        for metric in metrics:
            if r.get(metric) is None and metric == "peak_gpu_bytes":   # an e2e row made on the CPU (tests): no GPU peak
                continue
            name = metric if kind.startswith("e2e") else f"{r['shape']} M={r['M']} {metric}"
            out.append(Row(model=model, method="rtn" if r.get("kind", "packed") == "packed" and scheme != "bf16"
                           else "fp", scheme=scheme,
                           dataset=f"speed_{kind.replace('-', '_')}", metric=name, value=r[metric], config=cfg, seed=0,
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
    ap.add_argument("--threads", type=int, default=1, help="e2e on the CPU: torch threads (default 1)")
    ap.add_argument("--rounds", type=int, default=5, help="e2e on the CPU: interleaved rounds (medians over them)")
    ap.add_argument("--precision", default="auto", help="e2e on the CPU: what the packed models are held in")
    ap.add_argument("--anchors", default=None,
                    help="e2e on the CPU: llama.cpp (run the model's GGUF as Q4_1, Q8_0 and BF16 in the same rounds; "
                         "needs pip install -e '.[anchors]') or none; default: llama.cpp where it is installed "
                         "and the model comes from a GGUF")
    ap.add_argument("--runtime", default="auto", choices=["auto", "lean", "hf", "both"],
                    help="e2e on the CPU: lean (lrq.runtime), hf (the model's own forward), both, or auto (lean "
                         "where the model can)")
    ap.add_argument("--fp32-decode", default="exact",
                    help="e2e on the CPU, packed models held in float32: how their 4-bit layers run a decode step "
                         "(exact: float32 products, lrq.native's kernel where built; bf16: torch's bf16 int4 kernel, "
                         "activations and outputs rounded to bf16; i16: lrq.native's integer kernel, activations "
                         "rounded to 2^-15 of their largest, the output float32); several, comma-separated (e.g. "
                         "exact,i16): the first for the packed rows, each further one as copies of them on the same "
                         "models, interleaved")
    ap.add_argument("--bf16-table", action="store_true",
                    help="e2e on the CPU, packed models held in float32: also measure each with its output head (and "
                         "tied embedding) held in bf16, lossless for a bf16 checkpoint, else rounded as the dense bf16 model "
                         "rounds it (lrq.packed.quantize_head(model, 'bf16'); rows named '<scheme> +bf16 table')")
    ap.add_argument("--int8-head", nargs="?", const="profiled", default=None, choices=["profiled", "all"],
                    help="e2e on the CPU: also measure packed models with an int8 output head (lrq.packed."
                         "quantize_head): `profiled` (the flag alone; with --anchors) the profiled scheme's, which "
                         "is otherwise measured only when its profile shows the head costing as much as all "
                         "quantized linears; `all` every packed scheme's")
    ap.add_argument("--emulate-avx2", action="store_true",
                    help="e2e on the CPU: measure as a CPU without AVX-512 or native bf16 would (a Zen 3): the study "
                         "runs in a child process with torch's kernels, oneDNN and MKL held to AVX2 and lrq.native "
                         "built for haswell; the report names the instruction sets each ran at")
    args = ap.parse_args(argv)
    if args.emulate_avx2:
        return _emulated_avx2(list(sys.argv[1:] if argv is None else argv))
    schemes = [s for s in args.schemes.split(",") if s]
    if args.what == "e2e" and not (args.shape or args.device == "cuda"):
        return _e2e_cpu(args, [s for s in schemes if s != "bf16"])
    if args.what == "e2e" and (args.shape or args.device == "cuda"):
        from bench.studies import speed_e2e
        shape = args.shape or "llama-2-7b"
        rows = speed_e2e.run(shape, args.layers, schemes, args.device, args.prefill, args.decode,
                             graphs=not args.no_graphs)
        args.model = f"{shape} ({args.layers} layers, random weights)"
    elif args.what == "layers":
        rows = layer_latency(SHAPES[args.shapes], [int(m) for m in args.ms.split(",")], schemes, args.device)
    doc = {"what": args.what, "device": args.device, "model": args.model, **_provenance(), "rows": rows}
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(dumps_json(doc, indent=2, default=str))
    if args.results and not any("error" in r for r in rows):
        _store(rows, args.what, args.results, args.model)
    return 1 if any("error" in r for r in rows) else 0


def avx2_emulation() -> dict[str, str]:
    """The environment that holds this process's kernels to AVX2 on an x86 CPU that has more (AVX-512, AMX): torch's
    (ATEN_CPU_CAPABILITY), oneDNN's, MKL's (torch's float32 GEMMs: left uncapped, the dense float32 baseline ran with
    AVX-512 in the emulated studies before session 20) and lrq.native's build target. Set before torch is imported,
    hence a child process."""
    from bench.studies.precision import EMULATION
    return {**EMULATION, "LRQ_NATIVE_MARCH": "haswell"}


def _emulated_avx2(argv: list[str]) -> int:
    """`--emulate-avx2`: the same command in a child process under avx2_emulation(); its exit status."""
    import os
    import platform
    import subprocess
    from lrq.errors import UserError
    flags = Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").exists() else ""
    if platform.machine() not in ("x86_64", "AMD64") or " avx2" not in flags:
        raise UserError(f"--emulate-avx2 holds an x86 CPU's kernels to AVX2; this CPU ({platform.machine()}) "
                        f"has no AVX2 to hold them to: drop the flag")
    child = [a for a in argv if a != "--emulate-avx2"]
    return subprocess.run([sys.executable, "-m", "bench.studies.speed", *child],
                          env=os.environ | avx2_emulation()).returncode


def _e2e_cpu(args, schemes: list[str]) -> int:
    """`e2e` on the CPU: every candidate interleaved in one process (bench.studies.speed_cpu); `--out` is a folder
    (speed.json, speed.md and decode.svg) or a .json file."""
    from bench.studies import anchors, speed_cpu
    from lrq.io import atomic_write_text
    chosen = anchors.resolve(args.anchors, args.model)
    doc = speed_cpu.run(args.model, schemes or list(speed_cpu.DEFAULT_SCHEMES), args.precision, args.threads,
                        args.rounds, args.prefill, args.decode, args.data_dir, anchors=chosen,
                        int8_head=args.int8_head, runtime=args.runtime, float32_decode=args.fp32_decode,
                        bf16_table=args.bf16_table)
    print(speed_cpu.markdown(doc))
    ratio = speed_cpu.anchor_ratio(doc)
    if ratio:
        print(f"w4a16-g128 decode vs llama.cpp Q4_1: {ratio['ratio']:.2f}x (CPU time {ratio['cpu_ratio']:.2f}x); "
              f"target <= {ratio['target']}x: {'met' if ratio['met'] else 'NOT met'}", flush=True)
    if args.out:
        out = Path(args.out)
        files = ({out.name: dumps_json(doc, indent=2, default=str)} if out.suffix == ".json" else
                 {"speed.json": dumps_json(doc, indent=2, default=str), "speed.md": speed_cpu.markdown(doc),
                  "decode.svg": speed_cpu.svg(doc)})
        folder = out.parent if out.suffix == ".json" else out
        folder.mkdir(parents=True, exist_ok=True)
        for name, text in files.items():
            atomic_write_text(folder / name, text)
    if args.results:   # the leaderboard gets our formats; anchors and the int8-head copy stay in the study's files
        _store([r for r in doc["rows"] if r["kind"] != "anchor" and not r.get("mode_copy_of")
                and not r["candidate"].endswith((*speed_cpu.HEAD_SUFFIXES, speed_cpu.HF_SUFFIX))],
               "e2e-cpu", args.results, args.model)
    return 0


if __name__ == "__main__":
    sys.exit(main())
