"""Every kernel configuration compiled ahead of time for real GPUs, on a machine that has none.

    python -m lrq.kernels.aot [--targets 90,80] [--jobs 2] [--json FILE] [--extra KERNEL:BMxBNxBKwWsS ...]

For each kernel, each of its tile configurations (all M buckets) and representative constexprs (bits
3/4/8, per channel and group 128, bf16 and fp16 activations, split-K atomics where a bucket uses them),
Triton compiles the kernel for sm_90 (H100/H200) and sm_80 (A100) with `triton.compile(...,
target=GPUTarget("cuda", cc, 32))`; ptxas (shipped in the triton wheel) then reports registers, stack
frame and spills with -v. A row fails when its shared memory exceeds the target's per-block limit
(sm_90: 232,448 B; sm_80: 166,912 B), when it spills registers, or when a GEMM does not use the tensor
cores (wgmma on sm_90, mma.sync on sm_80). Exit status 1 when any row fails. The decode GEMV's rows also carry
their main loop's cost from the disassembled SASS (nvdisasm): instructions per weight and thread, and the
barriers, shuffles and int-to-float conversions in it (`gemv_loop`). The compile is the one a
GPU does on first use of the shape class LLM layers have (every size and stride a multiple of 16, so
Triton's divisibility specialisation applies); `--unaligned` adds the odd-shape specialisation.

Compilation runs in worker processes without TRITON_INTERPRET (the test suite sets it for the
interpreter tests), so the kernels there are real JIT functions.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

LIMITS = {90: 232_448, 80: 166_912}
ARCH = {90: "sm_90a", 80: "sm_80"}
TENSOR_CORE_OPS = {90: ("wgmma.mma_async",), 80: ("mma.sync",)}
DTYPES = ("bf16", "fp16")
BITS = (3, 4, 8)
GROUPS = (0, 128)
SMALL_GROUPS = (32, 64)


@dataclass(frozen=True)
class Variant:
    kernel: str
    config: tuple        # (block_m, block_n, block_k, num_warps, num_stages)
    constexprs: tuple    # sorted (name, value) pairs
    aligned: bool = True

    @property
    def label(self) -> str:
        c = dict(self.constexprs)
        parts = [f"{k}={v}" for k, v in c.items() if k not in ("BLOCK_M", "BLOCK_N", "BLOCK_K", "UPCAST", "PREC")]
        return " ".join(parts) + ("" if self.aligned else " unaligned")

    def config_str(self) -> str:
        bm, bn, bk, w, s = self.config
        return f"{bm}x{bn}x{bk} w{w} s{s}"


def _planes(bits: int) -> dict:
    from lrq.packing import plane_bits
    p = plane_bits(bits) + (0, 0)
    return {"P0": p[0], "P1": p[1], "P2": p[2]}


def _cfg(c) -> tuple:
    return (c.block_m, c.block_n, c.block_k, c.num_warps, c.num_stages)


def variant_of(kernel: str, config, constexprs: dict, aligned: bool = True) -> Variant:
    """The Variant of a (kernel, TileConfig, constexprs) as the dispatchers' `compilations` describe it."""
    return Variant(kernel, _cfg(config), tuple(sorted(constexprs.items())), aligned)


def _gemv_variants(gemv_full: bool) -> list[Variant]:
    """The decode GEMV (lrq.kernels.gemv): both configurations, bits 3/4/8, per channel and group 128, both
    activation dtypes, split K (atomics) and not; the M = 1 kernel with and without masks (EVEN: N a multiple of
    its tile and K of the K block, as LLM shapes are at 4 and 8 bits; 3 bits' 160-column block rarely divides K);
    the 16-token kernel with its 16-bit pair path wherever the dtype and width take it."""
    import torch

    from lrq.kernels.gemv import GEMV_CONFIGS, WB, fast_pairs
    out = []
    for gc in GEMV_CONFIGS.values():
        for bits in BITS:
            for group in GROUPS:
                for dt in DTYPES:
                    for atomic in (False, True):
                        if not gemv_full and (dt, atomic) != ("bf16", True) and (dt, atomic, bits, group) != \
                                ("fp16", False, 4, 0):
                            continue
                        cfg = (gc.block_m, gc.block_n, 0, gc.num_warps, gc.num_stages)
                        ce = {"BITS": bits, "GROUP": group, "HAS_BIAS": True, "ATOMIC": atomic, "BLOCK_N": gc.block_n,
                              "WBC": WB, "DT": dt}
                        if gc.block_m > 1:
                            fast = fast_pairs(bits, {"bf16": torch.bfloat16, "fp16": torch.float16}[dt])
                            out.append(Variant("gemv", cfg, tuple(sorted({**ce, "UPCAST": False, "PREC": "tf32",
                                                                          "FAST": fast, "ASM": fast,
                                                                          "BLOCK_M": gc.block_m}.items()))))
                            continue
                        for even in ((True, False) if bits == 3 or gemv_full else (True,)):
                            out.append(Variant("gemv", cfg, tuple(sorted({**ce, "EVEN": even,
                                                                          "STAGES": gc.num_stages}.items()))))
    return out


def variants(extra: list[tuple[str, tuple]] = (), unaligned: bool = False, gemv_full: bool = False) -> list[Variant]:
    """Every (kernel, configuration, constexprs) the checks compile. The decode GEMV: each configuration at
    bits 3/4/8, per channel and group 128, bf16, split K (atomics), plus fp16 without split at 4 bits;
    `gemv_full` adds every dtype x epilogue combination (52 variants instead of 14; ~3 min on 2 loaded cores)."""
    from lrq.kernels.common import TileConfig
    from lrq.kernels.int8_gemm import ACT_QUANT_CONFIG, INT8_BUCKETS
    from lrq.kernels.wq_gemm import DEQUANT_CONFIG, WQ_BUCKETS, fit_group
    out: list[Variant] = []

    def gemm(kernel, buckets, extra_cfgs):
        per = [(_cfg(c), i == 0) for i, cs in enumerate(buckets.configs) for c in cs]
        per += [(cfg, True) for k, cfg in extra_cfgs if k == kernel]
        for cfg, decode in per:
            for bits in BITS:
                for i, dt in enumerate(DTYPES):
                    for atomic in ((False, True) if decode else (False,)):
                        ce = {**_planes(bits), "HAS_BIAS": True, "ATOMIC": atomic,
                              "BLOCK_M": cfg[0], "BLOCK_N": cfg[1], "BLOCK_K": cfg[2], "DT": dt}
                        if kernel == "wq_gemm":
                            # per channel and group 128, each with both activation dtypes
                            for group in GROUPS:
                                out.append(Variant(kernel, cfg, tuple(sorted({**ce, "GROUP": group,
                                                                               "UPCAST": False,
                                                                               "PREC": "tf32"}.items()))))
                        elif i == 0:   # the int8 GEMM never sees the activations' dtype
                            out.append(Variant(kernel, cfg, tuple(sorted({**ce, "DT": "int8"}.items()))))

    gemm("wq_gemm", WQ_BUCKETS, extra)
    gemm("int8_gemm", INT8_BUCKETS, extra)
    # groups smaller than a K tile (32, 64) shrink the tile (wq_gemm.fit_group): those tiles too, at 4 bits, bf16
    for i, cs in enumerate(WQ_BUCKETS.configs):
        for c in cs:
            for group in SMALL_GROUPS:
                f = fit_group(c, group)
                if f != c:
                    for atomic in ((False, True) if i == 0 else (False,)):
                        out.append(Variant("wq_gemm", _cfg(f), tuple(sorted(
                            {**_planes(4), "HAS_BIAS": True, "ATOMIC": atomic, "GROUP": group, "UPCAST": False,
                             "PREC": "tf32", "DT": "bf16", **f.kwargs()}.items()))))
    for bits in BITS:
        for group in GROUPS + SMALL_GROUPS:
            for dt in DTYPES:
                d = fit_group(DEQUANT_CONFIG, group)
                out.append(Variant("wq_dequant", _cfg(d), tuple(sorted(
                    {**_planes(bits), "GROUP": group, "BLOCK_N": d.block_n, "BLOCK_K": d.block_k, "DT": dt}.items()))))
    del TileConfig
    for static in (False, True):
        for dt in DTYPES:
            out.append(Variant("act_quant", _cfg(ACT_QUANT_CONFIG), tuple(sorted(
                {"STATIC": static, "INTERPRET": False, "BLOCK_K": ACT_QUANT_CONFIG.block_k, "DT": dt}.items()))))
    out += _gemv_variants(gemv_full)
    if unaligned:   # the odd-shape specialisation of every configuration, at 4 bits, per channel, bf16
        # (not the M = 1 GEMV's: odd sizes go to the 16-token one, lrq.kernels.gemv._config)
        out += [Variant(v.kernel, v.config, v.constexprs, aligned=False) for v in list(out)
                if "EVEN" not in dict(v.constexprs)
                and dict(v.constexprs).get("P0", dict(v.constexprs).get("BITS")) in (4, None)
                and dict(v.constexprs).get("GROUP", 0) == 0
                and dict(v.constexprs).get("DT") in ("bf16", "int8") and not dict(v.constexprs).get("STATIC")]
    return out


# ---- compiling (worker side: no interpreter) -------------------------------------------------------

_INTS_D = {  # integer arguments that are multiples of 16 for LLM shapes (Triton's divisibility specialisation)
    "wq_gemm": ("N", "K", "off1", "off2", "stride_xm", "stride_wn", "stride_ym", "k_split"),
    "int8_gemm": ("N", "K", "off1", "off2", "stride_xm", "stride_wn", "stride_ym", "k_split"),
    "wq_dequant": ("N", "K", "off1", "off2", "stride_wn", "stride_on"),
    "act_quant": ("K", "stride_xm", "stride_am"),
    "gemv": ("N", "K", "stride_xm", "stride_ym"),
}


def _signature(kernel: str, ce: dict) -> dict:
    dt = ce.get("DT")
    act = {"bf16": "*bf16", "fp16": "*fp16", "int8": "*bf16"}[dt]
    if kernel == "wq_gemm":
        ptrs = {"x_ptr": act, "w_ptr": "*i32", "s_ptr": "*fp16", "z_ptr": "*u8", "b_ptr": "*fp16",
                "y_ptr": "*fp32" if ce["ATOMIC"] else act}
        ints = ("M", "N", "K", "off1", "off2", "stride_xm", "stride_wn", "stride_sn", "stride_ym", "k_split")
    elif kernel == "int8_gemm":
        ptrs = {"xa_ptr": "*i8", "sx_ptr": "*fp32", "zx_ptr": "*fp32", "xsum_ptr": "*i32", "w_ptr": "*i32",
                "sw_ptr": "*fp16", "wz_ptr": "*u8", "wsum_ptr": "*i32", "b_ptr": "*fp16",
                "y_ptr": "*fp32" if ce["ATOMIC"] else act}
        ints = ("M", "N", "K", "off1", "off2", "stride_xm", "stride_wn", "stride_sn", "stride_ym", "k_split")
    elif kernel == "gemv":
        ptrs = {"x_ptr": act, "w_ptr": "*i32", "s_ptr": "*fp16", "z_ptr": "*u8", "b_ptr": "*fp16",
                "y_ptr": "*fp32" if ce["ATOMIC"] else act}
        if "EVEN" in ce:   # the M = 1 kernel: y in the activations' dtype, a float32 workspace and counters
            return {**ptrs, "y_ptr": act, "ws_ptr": "*fp32", "cnt_ptr": "*i32",
                    **{i: "i32" for i in ("N", "K", "kb_per_split", "magic")}}
        ints = ("M", "N", "K", "stride_xm", "stride_ym", "kb_per_split")
    elif kernel == "wq_dequant":
        ptrs = {"w_ptr": "*i32", "s_ptr": "*fp16", "z_ptr": "*u8", "o_ptr": act}
        ints = ("N", "K", "off1", "off2", "stride_wn", "stride_sn", "stride_on")
    else:
        ptrs = {"x_ptr": act, "xa_ptr": "*i8", "sx_ptr": "*fp32", "zx_ptr": "*fp32", "xsum_ptr": "*i32",
                "ss_ptr": "*fp32", "sz_ptr": "*fp32"}
        ints = ("K", "stride_xm", "stride_am")
    return {**ptrs, **{i: "i32" for i in ints}}


def _kernel_fn(kernel: str, ce: dict | None = None):
    from lrq.kernels import gemv, int8_gemm, wq_gemm
    if kernel == "gemv" and "EVEN" in (ce or {}):
        return gemv._gemv1_kernel
    return {"gemv": gemv._gemv_kernel, "wq_gemm": wq_gemm._wq_gemm_kernel, "wq_dequant": wq_gemm._wq_dequant_kernel,
            "act_quant": int8_gemm._act_quant_kernel, "int8_gemm": int8_gemm._int8_gemm_kernel}[kernel]


def _nvidia_tool(name: str) -> Path:
    """A CUDA tool the triton wheel ships (ptxas, nvdisasm)."""
    import triton
    return Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / name


def _ptxas(ptx: str, cc: int) -> dict:
    exe = _nvidia_tool("ptxas")
    with tempfile.TemporaryDirectory() as d:
        src = Path(d) / "k.ptx"
        src.write_text(ptx)
        r = subprocess.run([str(exe), f"-arch={ARCH[cc]}", "-v", str(src), "-o", str(Path(d) / "k.cubin")],
                           capture_output=True, text=True)
    if r.returncode != 0:
        raise RuntimeError(f"ptxas failed: {r.stderr.strip()[:500]}")
    text = r.stderr + r.stdout

    def num(pattern):
        m = re.search(pattern, text)
        return int(m.group(1)) if m else 0
    return {"registers": num(r"Used (\d+) registers"), "stack_bytes": num(r"(\d+) bytes stack frame"),
            "spill_stores": num(r"(\d+) bytes spill stores"), "spill_loads": num(r"(\d+) bytes spill loads")}


def _nvdisasm(cubin: bytes) -> str:
    """The SASS of a cubin (nvdisasm from the triton wheel)."""
    exe = _nvidia_tool("nvdisasm")
    with tempfile.TemporaryDirectory() as d:
        src = Path(d) / "k.cubin"
        src.write_bytes(cubin)
        r = subprocess.run([str(exe), "-c", str(src)], capture_output=True, text=True)
    if r.returncode != 0:
        raise RuntimeError(f"nvdisasm failed: {r.stderr.strip()[:500]}")
    return r.stdout


def sass_loop(sass: str) -> dict[str, int]:
    """Opcode counts of the kernel's main loop: the longest span from a label to a branch back to it."""
    lines = sass.splitlines()
    labels = {m.group(1): i for i, line in enumerate(lines) if (m := re.match(r"^(\.L_x_\d+):", line))}
    best = None
    for i, line in enumerate(lines):
        m = re.search(r"BRA\s+`\((\.L_x_\d+)\)", line)
        if m and labels.get(m.group(1), i) < i and (best is None or i - labels[m.group(1)] > best[1] - best[0]):
            best = (labels[m.group(1)], i)
    ops: dict[str, int] = {}
    for line in lines[best[0]:best[1] + 1] if best else []:
        m = re.search(r"/\*[0-9a-f]{4,}\*/\s+(?:@!?U?P[T0-9]+\s+)?([A-Z][A-Z0-9_]*)", line)
        if m:
            ops[m.group(1)] = ops.get(m.group(1), 0) + 1
    return ops


def gemv_loop(ops: dict[str, int], ce: dict, num_warps: int) -> dict:
    """What one iteration of a GEMV's loop (one K block of E * WB columns by BLOCK_N rows) costs a thread:
    instructions per weight (the issue bound: an SM issues 4 warp-instructions a clock), and the ones that
    should not be there (barriers, shuffles, int-to-float conversions)."""
    from lrq.kernels.gemv import elems_per_word
    weights = elems_per_word(ce["BITS"]) * ce["WBC"] * ce["BLOCK_N"] / (32 * num_warps)
    total = sum(ops.values())
    return {"instructions": total, "weights": weights, "per_weight": round(total / weights, 2),
            "barriers": ops.get("BAR", 0), "shuffles": ops.get("SHFL", 0),
            "int_to_float": sum(n for op, n in ops.items() if op.startswith("I2F")),
            "top": dict(sorted(ops.items(), key=lambda kv: -kv[1])[:6])}


def compile_variant(v: Variant, cc: int) -> dict:
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    ce = dict(v.constexprs)
    fn = _kernel_fn(v.kernel, ce)
    sig = _signature(v.kernel, ce)
    constexprs = {k: val for k, val in ce.items() if k != "DT"}
    names = list(sig)
    attrs = {}
    for i, name in enumerate(fn.arg_names):
        if name not in sig:
            continue
        if sig[name].startswith("*") or (v.aligned and name in _INTS_D[v.kernel]):
            attrs[(i,)] = [["tt.divisibility", 16]]
    for name in fn.arg_names:
        if name not in sig and name not in constexprs:
            raise KeyError(f"{v.kernel}: no signature or constexpr for argument {name!r}")
    full_sig = {name: (sig[name] if name in sig else "constexpr") for name in fn.arg_names}
    assert set(names) <= set(full_sig)
    bm, bn, bk, warps, stages = v.config
    t = time.perf_counter()
    row = {"kernel": v.kernel, "config": v.config_str(), "variant": v.label, "target": f"sm_{cc}", "cc": cc,
           "aligned": v.aligned}
    try:
        c = triton.compile(ASTSource(fn=fn, signature=full_sig, constexprs=constexprs, attrs=attrs),
                           target=GPUTarget("cuda", cc, 32), options={"num_warps": warps, "num_stages": stages})
    except Exception as e:  # noqa: BLE001 - an out-of-resource or lowering failure is a row, not a crash
        row.update(error=f"{type(e).__name__}: {str(e)[:300]}", compile_s=round(time.perf_counter() - t, 2))
        return row
    row["compile_s"] = round(time.perf_counter() - t, 2)
    ptx = c.asm["ptx"]
    row["shared_bytes"] = int(c.metadata.shared)
    row["shared_limit"] = LIMITS[cc]
    row.update(_ptxas(ptx, cc))
    if v.kernel == "gemv":   # the decode kernels' cost per weight, from their machine code
        row["loop"] = gemv_loop(sass_loop(_nvdisasm(c.asm["cubin"])), ce, warps)
    # the GEMV's 16-token tiles are below wgmma's 64-row minimum: on sm_90 too they use mma.sync (tensor cores)
    ops = TENSOR_CORE_OPS[cc] + (("mma.sync",) if v.kernel == "gemv" else ())
    row["tensor_cores"] = any(op in ptx for op in ops)
    # the GEMV's 16-token configuration multiplies with tl.dot; its M = 1 one is elementwise by design
    row["needs_tensor_cores"] = v.kernel in ("wq_gemm", "int8_gemm") or (v.kernel == "gemv" and bm > 1)
    return row


def violations(row: dict) -> list[str]:
    if "error" in row:
        return [f"does not compile: {row['error']}"]
    out = []
    if row["shared_bytes"] > row["shared_limit"]:
        out.append(f"shared memory {row['shared_bytes']:,} B over the {row['target']} limit {row['shared_limit']:,} B")
    if row["spill_stores"] or row["spill_loads"]:
        out.append(f"spills registers ({row['spill_stores']} B stored, {row['spill_loads']} B loaded)")
    if row["needs_tensor_cores"] and not row["tensor_cores"]:
        out.append("the GEMM does not use the tensor cores")
    return out


def _worker(payload: str) -> list[dict]:
    jobs = json.loads(payload)
    rows = []
    for v, cc in jobs:
        v = Variant(v["kernel"], tuple(v["config"]), tuple((k, val) for k, val in v["constexprs"]), v["aligned"])
        rows.append(compile_variant(v, cc))
    return rows


def run(targets=(90, 80), jobs: int = 2, extra: list[tuple[str, tuple]] = (), unaligned: bool = False,
        only: list[Variant] | None = None, cold: bool = True, gemv_full: bool = False) -> list[dict]:
    """Compile every variant for every target in `jobs` worker processes; rows in variant order. `cold`:
    an empty Triton cache, so every compile time is a first use's (what a GPU's cold start pays)."""
    todo = [(asdict(v), cc) for v in (only if only is not None else variants(extra, unaligned, gemv_full))
            for cc in targets]
    jobs = max(1, min(jobs, len(todo)))
    chunks = [todo[i::jobs] for i in range(jobs)]
    env = {k: val for k, val in os.environ.items() if k != "TRITON_INTERPRET"}
    root = str(Path(__file__).resolve().parents[2])
    env["PYTHONPATH"] = root + os.pathsep + env.get("PYTHONPATH", "")
    cache = tempfile.TemporaryDirectory(prefix="lrq-aot-triton-") if cold else None
    if cache is not None:
        env["TRITON_CACHE_DIR"] = cache.name
    procs = []
    for chunk in chunks:
        f = tempfile.NamedTemporaryFile("w", suffix=".json", delete=False)
        json.dump(chunk, f)
        f.close()
        out = f.name + ".out"
        procs.append((subprocess.Popen([sys.executable, "-m", "lrq.kernels.aot", "--worker", f.name, out], env=env,
                                       cwd=root), f.name, out))
    rows_by_job: list[list[dict]] = []
    for p, inp, out in procs:
        rc = p.wait()
        Path(inp).unlink(missing_ok=True)
        if rc != 0:
            raise RuntimeError(f"an ahead-of-time compile worker exited with {rc}")
        rows_by_job.append(json.loads(Path(out).read_text()))
        Path(out).unlink(missing_ok=True)
    if cache is not None:
        cache.cleanup()
    rows = [None] * len(todo)
    for j, chunk_rows in enumerate(rows_by_job):
        for i, r in enumerate(chunk_rows):
            rows[j + i * jobs] = r
    return rows


def format_table(rows: list[dict]) -> str:
    head = ("| kernel | config | constexprs | target | shared B (limit) | regs | spills st/ld B | stack B | "
            "tensor cores | loop instr/weight (bar, shfl, i2f) | compile s | ok |")
    lines = [head, "|" + "---|" * 12]
    for r in rows:
        bad = violations(r)
        if "error" in r:
            lines.append(f"| {r['kernel']} | {r['config']} | {r['variant']} | {r['target']} | - | - | - | - | - | - | "
                         f"{r['compile_s']} | FAIL: {bad[0][:80]} |")
            continue
        tc = "n/a" if not r["needs_tensor_cores"] else ("yes" if r["tensor_cores"] else "NO")
        lp = r.get("loop")
        loop = f"{lp['per_weight']} ({lp['barriers']}, {lp['shuffles']}, {lp['int_to_float']})" if lp else "-"
        lines.append(f"| {r['kernel']} | {r['config']} | {r['variant']} | {r['target']} | "
                     f"{r['shared_bytes']:,} ({r['shared_limit']:,}) | {r['registers']} | "
                     f"{r['spill_stores']}/{r['spill_loads']} | {r['stack_bytes']} | {tc} | {loop} | "
                     f"{r['compile_s']} | "
                     f"{'ok' if not bad else 'FAIL: ' + '; '.join(bad)} |")
    return "\n".join(lines)


def summary(rows: list[dict]) -> dict:
    ok = [r for r in rows if "error" not in r]
    times = sorted(r["compile_s"] for r in rows)
    return {"rows": len(rows), "failed": sum(bool(violations(r)) for r in rows),
            "max_shared": {t: max((r["shared_bytes"] for r in ok if r["target"] == t), default=0)
                           for t in sorted({r["target"] for r in ok})},
            "max_registers": max((r["registers"] for r in ok), default=0),
            "compile_s_total": round(sum(times), 1),
            "compile_s_median": times[len(times) // 2] if times else None, "compile_s_max": max(times, default=None)}


def _parse_extra(spec: str) -> tuple[str, tuple]:
    m = re.fullmatch(r"(\w+):(\d+)x(\d+)x(\d+)w(\d+)s(\d+)", spec)
    if not m:
        raise argparse.ArgumentTypeError(f"--extra takes KERNEL:BMxBNxBKwWARPSsSTAGES (e.g. wq_gemm:128x256x128w8s4), "
                                         f"not {spec!r}")
    return m.group(1), tuple(int(g) for g in m.groups()[1:])


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--worker"]:
        Path(argv[2]).write_text(json.dumps(_worker(Path(argv[1]).read_text())))
        return 0
    ap = argparse.ArgumentParser(description="compile every kernel configuration for sm_90 and sm_80, offline")
    ap.add_argument("--targets", default="90,80")
    ap.add_argument("--jobs", type=int, default=min(2, os.cpu_count() or 1))
    ap.add_argument("--json", default=None, help="also write the rows and the summary here")
    ap.add_argument("--extra", action="append", type=_parse_extra, default=[],
                    help="an additional configuration to check (e.g. a deliberately oversized one)")
    ap.add_argument("--only-extra", action="store_true", help="check only the --extra configurations")
    ap.add_argument("--unaligned", action="store_true", help="also the odd-shape specialisation")
    ap.add_argument("--gemv-full", action="store_true", help="every dtype/epilogue variant of the decode GEMV")
    ap.add_argument("--warm-cache", action="store_true", help="use Triton's own cache (compile times then mean little)")
    args = ap.parse_args(argv)
    targets = tuple(int(t) for t in args.targets.split(","))
    bad_targets = [t for t in targets if t not in LIMITS]
    if bad_targets:
        print(f"unknown target(s) {bad_targets}: use {sorted(LIMITS)}", file=sys.stderr)
        return 2
    only = None
    if args.only_extra:
        extra_kernels = {k for k, _ in args.extra}
        only = [v for v in variants(args.extra) if v.kernel in extra_kernels
                and v.config in {c for _, c in args.extra}]
    t = time.time()
    rows = run(targets, args.jobs, args.extra, args.unaligned, only, cold=not args.warm_cache,
               gemv_full=args.gemv_full)
    print(format_table(rows))
    s = summary(rows)
    s["wall_s"] = round(time.time() - t, 1)
    print(json.dumps(s))
    if args.json:
        Path(args.json).write_text(json.dumps({"summary": s, "rows": rows}, indent=1))
    return 1 if s["failed"] else 0


if __name__ == "__main__":
    sys.exit(main())
