"""lrq-bench's own CPU kernels (lrq/csrc/cpu_gemv.c), compiled on the machine that runs them: the decode steps'
matrix-vector products (4-bit, W8A8, dense bf16/float32), the 4-bit form's prefill operand, the lean runtime's norms,
RoPE and attention, and a whole decoder layer's one-token step in one call (lrq.runtime.LeanDecoder's fused path).

At a decode step (a few tokens) a 4-bit layer is a matrix-vector product over half a byte a weight; torch's int4
CPU kernel takes bf16 inputs only in vector code (float32: a scalar path, 10-100x slower), so a model held in
float32 (what `--precision auto` picks on a CPU without native bf16) had to dequantize a transient weight per call.
This kernel reads the same bytes torch's int4 packing holds (no second copy), in float32 or bf16 alike, with AVX-512
or AVX2 vector code (by what the CPU has), the output blocks split over torch's thread count.

The C file is compiled once per CPU and source with the system's C compiler (`cc -O3 -march=native -fopenmp`,
about a second) into the cache (`lrq.io.cache_root()/native/`, written atomically: processes compiling at once
each rename a whole file), then loaded with ctypes. Where there is no compiler, the compile fails or the CPU has
neither AVX-512 nor AVX2, `library()` is None and the layers keep torch's kernels (`status()` says why).
`LRQ_NATIVE=0` turns the kernels off (an A/B measurement, a suspected fault); `LRQ_NATIVE_MARCH` compiles for another
-march than native.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import platform
import shutil
import subprocess
from pathlib import Path

from lrq.io import atomic_write, cache_root

SOURCE = Path(__file__).with_name("csrc") / "cpu_gemv.c"
# LRQ_NATIVE_MARCH builds for another target than this CPU (a test of the AVX2 branch on an AVX-512 machine: haswell)
def _flags() -> tuple[str, ...]:
    return ("-O3", f"-march={os.environ.get('LRQ_NATIVE_MARCH', 'native')}", "-fopenmp", "-ffp-contract=off",
            "-shared", "-fPIC")

VECTOR_ISAS = ("avx512-bf16", "avx512", "avx2")   # the builds of the C file worth running (its portable C is slower than torch's)
_REASON: list[str] = []


def _cpu_key() -> str:
    """What -march=native depends on: the CPU's model and flags (one cache shared by machines of different CPUs
    keeps one library per CPU)."""
    try:
        info = Path("/proc/cpuinfo").read_text()
    except OSError:
        return platform.processor() or platform.machine()
    lines = [ln for ln in info.splitlines() if ln.startswith(("model name", "flags", "cpu family", "model\t"))]
    return "\n".join(sorted(set(lines)))


def _compiler() -> str | None:
    cc = os.environ.get("CC") or "cc"
    return shutil.which(cc) or shutil.which("gcc")


def _compile(cc: str, out: Path) -> None:
    run = subprocess.run([cc, *_flags(), str(SOURCE), "-o", str(out), "-lm"], capture_output=True, text=True,
                         timeout=300)
    if run.returncode:
        raise RuntimeError(f"{cc} failed: {(run.stderr or run.stdout).strip()[-400:]}")


def _declare(lib: ctypes.CDLL) -> None:
    """Each kernel's argument and result types (ctypes converts and checks Python's arguments by them)."""
    p, i, lg = ctypes.c_void_p, ctypes.c_int, ctypes.c_long
    lib.lrq_argmax.argtypes = [p, i, lg]
    lib.lrq_argmax.restype = lg
    lib.lrq_int4_gemv.argtypes = [p, p, i, lg, p, i, i]
    lib.lrq_int4_gemv.restype = i
    lib.lrq_int4_unpack_t.argtypes = [p, p, i, i]
    lib.lrq_int4_unpack_t.restype = i
    lib.lrq_int8_gemv.argtypes = [p, p, p, lg, p, i, p, i, p, p, i, p, p, i, i, i, i]
    lib.lrq_int8_gemv.restype = i
    f = ctypes.c_float
    lib.lrq_w8a8_gemv.argtypes = [p, p, p, i, lg, f, f, f, p, p, i, p, p, i, i, i, i]
    lib.lrq_w8a8_gemv.restype = i
    lib.lrq_rms_norm_rows.argtypes = [p, p, p, p, i, i, i, f, i]
    lib.lrq_rms_norm_rows.restype = None
    lib.lrq_rope_cache_rows.argtypes = [p, p, p, p, p, p, p, lg, i, i, i, i, i, i, i]
    lib.lrq_rope_cache_rows.restype = i
    lib.lrq_silu_mul.argtypes = [p, p, p, i, lg, i]
    lib.lrq_silu_mul.restype = None
    lib.lrq_attend.argtypes = [p, lg, p, p, lg, p, i, i, i, i, i, f]
    lib.lrq_attend.restype = i
    lib.lrq_rope_cache.argtypes = [p, p, p, p, p, p, p, lg, i, i, i, i, i]
    lib.lrq_rope_cache.restype = i
    lib.lrq_per_token_dequant.argtypes = [p, p, i, i, i, i, f]
    lib.lrq_per_token_dequant.restype = None
    lib.lrq_int8_activations.argtypes = [p, i, lg, i, i, i, i, f, f, f, p, p, p, p, i]
    lib.lrq_int8_activations.restype = None
    lib.lrq_int8_activations_vectorized.argtypes = []
    lib.lrq_int8_activations_vectorized.restype = i
    lib.lrq_int8_correct.argtypes = [p, lg, i, i, p, p, i, p, i, p, p, i, p, p, i, i, i]
    lib.lrq_int8_correct.restype = None
    lib.lrq_int8_blocked.argtypes = [p, p, i, i, p, i]
    lib.lrq_int8_blocked.restype = i
    lib.lrq_amx_ready.argtypes = []
    lib.lrq_amx_ready.restype = i
    lib.lrq_amx_bf16_linear.argtypes = [p, p, lg, i, i, p, i]
    lib.lrq_amx_bf16_linear.restype = i
    lib.lrq_amx_int8_linear.argtypes = [p, lg, i, i, p, p, i, p, p, i, p, i, p, p, i, p, p, i, i]
    lib.lrq_amx_int8_linear.restype = i
    lib.lrq_avx2_int8_linear.argtypes = lib.lrq_amx_int8_linear.argtypes
    lib.lrq_avx2_int8_linear.restype = i
    lib.lrq_dense_gemv.argtypes = [p, p, p, i, i, i, i]
    lib.lrq_dense_gemv.restype = i
    lib.lrq_int8w_gemv.argtypes = [p, lg, p, p, p, i, lg, p, i, i, i, i]
    lib.lrq_int8w_gemv.restype = i
    lib.lrq_int8w_unpack.argtypes = [p, lg, p, p, i, i, p, i, i]
    lib.lrq_int8w_unpack.restype = i
    lib.lrq_amx_bf16_int8w_linear.argtypes = [p, lg, p, p, p, lg, i, i, i, p, i]
    lib.lrq_amx_bf16_int8w_linear.restype = i
    lib.lrq_decoder_layer_step.argtypes = [p, p, i, i]
    lib.lrq_decoder_layer_step.restype = i
    lib.lrq_decoder_layers_step.argtypes = [p, i, p, i, i]
    lib.lrq_decoder_layers_step.restype = i


@functools.lru_cache(maxsize=None)
def library() -> ctypes.CDLL | None:
    """The compiled kernels, or None (then `status()` says why)."""
    if os.environ.get("LRQ_NATIVE", "1") == "0":
        _REASON.append("turned off (LRQ_NATIVE=0)")
        return None
    if platform.machine().lower() not in ("x86_64", "amd64"):
        _REASON.append(f"no vector code for {platform.machine()} (x86-64 only)")
        return None
    cc = _compiler()
    if cc is None:
        _REASON.append("no C compiler (cc or gcc) on PATH; install one (e.g. apt install gcc) for the fast CPU decode")
        return None
    try:
        version = subprocess.run([cc, "--version"], capture_output=True, text=True, timeout=60).stdout
        key = hashlib.sha256("\0".join([SOURCE.read_text(), version, " ".join(_flags()), _cpu_key()]).encode())
        path = cache_root() / "native" / f"cpu_gemv-{key.hexdigest()[:16]}.so"
        if not path.exists():
            atomic_write(path, lambda tmp: _compile(cc, tmp), fsync=False)
        import torch  # noqa: F401 - torch's own libgomp loaded first: the kernel's OpenMP calls share its runtime
        lib = ctypes.CDLL(str(path))
    except Exception as e:  # noqa: BLE001 - any failure: torch's kernels instead, and the reason kept
        _REASON.append(f"compiling or loading {SOURCE.name} failed ({e}); torch's kernels run instead")
        return None
    lib.lrq_isa.restype = ctypes.c_char_p
    lib.lrq_int4_bf16_products.restype = ctypes.c_char_p
    lib.lrq_int8w_bf16_products.restype = ctypes.c_char_p
    isa = lib.lrq_isa().decode()
    if isa not in VECTOR_ISAS:
        _REASON.append(f"this CPU has neither AVX-512 nor AVX2 (the build targets {isa}); torch's kernels run instead")
        return None
    _declare(lib)
    return lib


class Int4Layer(ctypes.Structure):
    """The constant arguments of lrq_int4_gemv for one layer (cpu_gemv.c's int4_layer)."""
    _fields_ = [("packed", ctypes.c_void_p), ("sz", ctypes.c_void_p),
                ("n", ctypes.c_int32), ("n_pad", ctypes.c_int32), ("k", ctypes.c_int32), ("k_pad", ctypes.c_int32),
                ("group", ctypes.c_int32), ("block", ctypes.c_int32), ("x16", ctypes.c_int32),
                ("compact", ctypes.c_int32)]


class Linear(ctypes.Structure):
    """One linear of a fused decoder layer (cpu_gemv.c's lrq_linear): kind 1 a 4-bit layer (`q4`: the address of its
    Int4Layer), kind 2 a dense weight [n, k] in the model's dtype (`w`), kind 3 W8A8 on a static grid (`w` its int8
    levels, then lrq_w8a8_gemv's other arguments), kind 4 8-bit weight-only per channel (`w` its int8 levels, rows k
    rounded up to 16 apart, `scale` and `zero_term` [n] float32: lrq_int8w_gemv's); `act_bits` the per-token fake
    quantization of its input (W4A8), 0 for none; `bias` [n] in the model's dtype or None."""
    _fields_ = [("kind", ctypes.c_int32), ("act_bits", ctypes.c_int32), ("n", ctypes.c_int32), ("k", ctypes.c_int32),
                ("q4", ctypes.c_void_p), ("w", ctypes.c_void_p), ("bias", ctypes.c_void_p),
                ("wsum", ctypes.c_void_p), ("col_term", ctypes.c_void_p), ("zero_term", ctypes.c_void_p),
                ("scale", ctypes.c_void_p), ("asymmetric", ctypes.c_int32), ("a_scale", ctypes.c_float),
                ("a_zero", ctypes.c_float), ("a_hi", ctypes.c_float)]


class DecoderLayer(ctypes.Structure):
    """A Llama-family decoder layer's constant arguments for lrq_decoder_layer_step (cpu_gemv.c's
    lrq_decoder_layer): its seven linears, norms, epsilons, attention scale, this layer's key/value caches and the
    rotary tables (lrq.runtime.LeanDecoder builds it)."""
    _fields_ = ([(name, Linear) for name in ("q", "k", "v", "o", "gate", "up", "down")]
                + [(name, ctypes.c_void_p) for name in ("in_norm", "post_norm", "q_norm", "k_norm")]
                + [(name, ctypes.c_float) for name in ("eps", "q_eps", "k_eps", "scale", "act_eps")]
                + [("kc", ctypes.c_void_p), ("vc", ctypes.c_void_p), ("kv_stride", ctypes.c_long),
                   ("cos", ctypes.c_void_p), ("sin", ctypes.c_void_p)]
                + [(name, ctypes.c_int32) for name in ("hidden", "heads", "kv_heads", "hd", "inter", "bf16",
                                                        "max_len")])


# lrq_int4_unpack_t's forms (cpu_gemv.c)
UNPACK_F32, UNPACK_BF16, UNPACK_I8, UNPACK_BF16_BLOCKED, UNPACK_I8_BLOCKED, UNPACK_BF16_BLOCKED64 = 0, 1, 2, 3, 4, 5


def checked(rc: int, what: str) -> None:
    """Raise for a kernel's non-zero return code (1: arguments it does not take, 2: out of memory)."""
    if rc:
        raise RuntimeError(f"lrq native {what} refused its arguments (code {rc}): a bug, please report; "
                           f"LRQ_NATIVE=0 runs torch's kernels instead")


def isa() -> str | None:
    """The instruction set the kernels were built for ("avx512", "avx2"), or None where they do not run."""
    lib = library()
    return lib.lrq_isa().decode() if lib is not None else None


def status() -> str:
    """One line for reports: which decode kernels run, or why torch's do."""
    lib = library()
    if lib is not None:
        amx = "; prefill on AMX tiles" if lib.lrq_amx_ready() else ""
        return (f"lrq native ({isa()}; 4-bit bf16 products: {lib.lrq_int4_bf16_products().decode()}; 8-bit "
                f"weight-only: {lib.lrq_int8w_bf16_products().decode()}{amx})")
    return "torch (lrq native: " + ("; ".join(dict.fromkeys(_REASON)) or "unavailable") + ")"
