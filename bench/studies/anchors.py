"""llama.cpp as the anchor of the CPU speed study (issue W, item 4): the same GGUF our built-in model is converted
from, run by llama.cpp (through llama-cpp-python, the optional extra `pip install -e '.[anchors]'`) in the same
interleaved rounds as our formats.

Anchors: the GGUF as shipped (SmolLM2-135M-Instruct Q4_1: its blocks Q4_1, its tied embedding/head Q8_0), and
Q8_0 and BF16 GGUFs made from it by llama.cpp's own `llama_model_quantize` (requantizing: each tensor dequantized
to float32, then stored in the new type; the weights are those of the Q4_1 file, not a higher-precision original).
The made files are cached under `<cache>/anchors/` beside a record of their SHA-256, the source's SHA-256 and the
llama-cpp-python version that made them; a file that no longer matches its record is made again.

Measured as our candidates are (bench.studies.speed_cpu): batch 1, `n_threads` = the study's --threads for
decode and prefill alike; decode: ms per greedy token after the same 16-token prompt (the prompt's evaluation not
timed; llama.cpp computes the last position's logits only, argmax over them in numpy); prefill: one evaluation of
the same `--prefill` tokens in a single batch (n_batch = n_ubatch >= prefill), the last position's logits only,
the KV cache cleared before each.
"""

from __future__ import annotations

import ctypes
import importlib.util
import json
import os
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from lrq.errors import UserError

ANCHORS = ("llama.cpp",)
LLAMA_CPP_TYPES = ("Q4_1", "Q8_0", "BF16")      # the GGUF as shipped, then the two made from it
INSTALL_HINT = "pip install -e '.[anchors]'"
_FTYPES = {"Q8_0": "LLAMA_FTYPE_MOSTLY_Q8_0", "BF16": "LLAMA_FTYPE_MOSTLY_BF16"}


def available() -> bool:
    """Whether llama-cpp-python is importable (without importing it: that loads the shared library)."""
    return importlib.util.find_spec("llama_cpp") is not None


def has_gguf(model_name: str) -> bool:
    """Whether the model comes from a GGUF llama.cpp can run (a built-in, or a .gguf file)."""
    from bench.common.models import BUILTINS
    return model_name in BUILTINS or (str(model_name).endswith(".gguf") and Path(model_name).is_file())


def resolve(requested: str | None, model_name: str | None = None) -> list[str]:
    """The anchors a run measures: `requested` is None (llama.cpp when it is installed and `model_name` comes from
    a GGUF, none otherwise), "none", or a comma-separated list of ANCHORS, each of which must be installed (else a
    UserError naming the extra)."""
    if requested is None:
        return ["llama.cpp"] if available() and (model_name is None or has_gguf(model_name)) else []
    names = [n.strip() for n in requested.split(",") if n.strip()]
    if names == ["none"]:
        return []
    unknown = [n for n in names if n not in ANCHORS]
    if unknown:
        raise UserError(f"unknown anchor(s) {', '.join(unknown)}: the anchors are {', '.join(ANCHORS)} (or none)")
    if "llama.cpp" in names and not available():
        raise UserError(f"--anchors llama.cpp needs llama-cpp-python, which is not installed: {INSTALL_HINT} "
                        f"(it compiles llama.cpp; CMAKE_ARGS=\"-DGGML_NATIVE=ON\" builds it for this CPU)")
    return names


def _llama_cpp():
    try:
        import llama_cpp
    except ImportError as e:   # installed but its shared library does not load
        raise UserError(f"llama-cpp-python does not import ({e}): reinstall it with {INSTALL_HINT}") from e
    return llama_cpp


def version() -> dict:
    """llama-cpp-python's version and the features its llama.cpp build reports (the vendored llama.cpp of an
    sdist build carries no commit)."""
    lc = _llama_cpp()
    info = lc.llama_print_system_info()
    return {"llama_cpp_python": lc.__version__,
            "system_info": (info.decode() if isinstance(info, bytes) else str(info)).strip()}


def source_gguf(model_name: str) -> Path:
    """The GGUF file the model comes from: a built-in's pinned GGUF (checked against its SHA-256) or a .gguf
    path; a model folder or hub id has none, so llama.cpp cannot run the same weights."""
    from bench.common import models
    if not has_gguf(model_name):
        raise UserError(f"the llama.cpp anchor runs the GGUF a model comes from; {model_name!r} is neither a "
                        f"built-in GGUF model ({', '.join(models.BUILTINS)}) nor a .gguf file (pass --anchors none)")
    if model_name in models.BUILTINS:
        spec = models.BUILTINS[model_name]
        path = models._find_builtin_gguf(spec)
        models._check_gguf(spec, path)
        return path
    return Path(model_name)


def tensor_types(path: Path) -> dict[str, object]:
    """How many tensors of each type the GGUF holds, and the type of its token embedding / output head."""
    import gguf
    reader = gguf.GGUFReader(str(path))
    counts: dict[str, int] = {}
    head = {}
    for t in reader.tensors:
        counts[t.tensor_type.name] = counts.get(t.tensor_type.name, 0) + 1
        if t.name in ("token_embd.weight", "output.weight"):
            head[t.name] = t.tensor_type.name
    return {"counts": dict(sorted(counts.items())), "head": head}


def _record_path(path: Path) -> Path:
    return path.with_name(path.name + ".json")


def _made_ok(path: Path, source_sha: str) -> dict | None:
    from bench.common.hashing import file_sha256
    try:
        rec = json.loads(_record_path(path).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    if not path.is_file() or rec.get("source_sha256") != source_sha or file_sha256(path) != rec.get("sha256"):
        return None
    return rec


def gguf_files(source: Path, cache: Path | None = None) -> dict[str, dict]:
    """{type: {path, sha256, bytes, made_from, tensor_types}} for Q4_1 (the source as is), Q8_0 and BF16 (made
    with llama.cpp's quantizer, allow_requantize, into `cache`/anchors, SHA-256 recorded beside each)."""
    from bench.common.cache import cache_root
    from bench.common.hashing import file_sha256
    source_sha = file_sha256(source)
    folder = (cache or cache_root()) / "anchors"
    out = {"Q4_1": {"path": str(source), "sha256": source_sha, "bytes": source.stat().st_size, "made_from": None}}
    stem = source.name[:-len(".gguf")].rsplit(".", 1)[0]
    for kind, ftype in _FTYPES.items():
        path = folder / f"{stem}.{kind}.gguf"
        rec = _made_ok(path, source_sha)
        if rec is None:
            lc = _llama_cpp()
            folder.mkdir(parents=True, exist_ok=True)
            with tempfile.TemporaryDirectory(dir=folder) as tmp:
                part = Path(tmp) / path.name
                params = lc.llama_model_quantize_default_params()
                params.ftype = getattr(lc, ftype)
                params.allow_requantize = True
                params.nthread = 1
                t0 = time.perf_counter()
                rc = lc.llama_model_quantize(str(source).encode(), str(part).encode(), ctypes.byref(params))
                if rc != 0 or not part.is_file():
                    raise RuntimeError(f"llama_model_quantize({source.name} -> {kind}) returned {rc}")
                rec = {"sha256": file_sha256(part), "source": source.name, "source_sha256": source_sha,
                       "ftype": ftype, "allow_requantize": True, "made_by": f"llama-cpp-python {lc.__version__}",
                       "seconds": round(time.perf_counter() - t0, 2)}
                os.replace(part, path)
            _record_path(path).write_text(json.dumps(rec, indent=2), encoding="utf-8")
        out[kind] = {"path": str(path), "sha256": rec["sha256"], "bytes": path.stat().st_size,
                     "made_from": f"{rec['source']} (sha256 {rec['source_sha256'][:12]}) by {rec['made_by']}"}
    for info in out.values():
        info["tensor_types"] = tensor_types(Path(info["path"]))
    return out


# llama.cpp's own build for a CPU without its AMX backend (which crashed on its first evaluation on a 2-core Intel
# Xeon with AMX, llama-cpp-python 0.3.36 built with GGML_NATIVE=ON: a known fault, ggml-org/llama.cpp#20824)
NO_AMX_CMAKE_ARGS = ("-DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON -DGGML_BMI2=ON "
                     "-DGGML_AVX_VNNI=ON -DGGML_AVX512=ON -DGGML_AVX512_VBMI=ON -DGGML_AVX512_VNNI=ON "
                     "-DGGML_AVX512_BF16=ON -DGGML_AMX_TILE=OFF -DGGML_AMX_INT8=OFF -DGGML_AMX_BF16=OFF")
_PROBE = """
import sys
from llama_cpp import Llama
for path in sys.argv[3:]:
    m = Llama(model_path=path, n_ctx=int(sys.argv[2]), n_batch=int(sys.argv[2]), n_ubatch=int(sys.argv[2]),
              n_threads=int(sys.argv[1]), n_threads_batch=int(sys.argv[1]), logits_all=False, verbose=False)
    m.eval(list(range(100, 164)))
    m.eval([42])
    print("ok", path, flush=True)
"""


def _probe_command(paths: list[str], threads: int, n_ctx: int) -> list[str]:
    import sys
    return [sys.executable, "-c", _PROBE, str(threads), str(n_ctx), *paths]


def probe(paths: list[str], threads: int, n_ctx: int, timeout: float = 600) -> None:
    """Load and evaluate each GGUF once in a child process before the study runs llama.cpp in its own: a fault in
    llama.cpp's native code would otherwise kill the study (and every measurement it holds) with a signal. A UserError
    says which file crashed it, and how to rebuild llama.cpp or run without the anchor."""
    import signal
    import subprocess
    try:
        run = subprocess.run(_probe_command(paths, threads, n_ctx), capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired as e:
        raise UserError(f"llama.cpp did not evaluate {len(paths)} GGUF(s) of 64 tokens within {timeout:.0f} s; pass "
                        f"--anchors none to measure without it") from e
    if run.returncode == 0:
        return
    done = {ln.split(" ", 2)[1] for ln in run.stdout.splitlines() if ln.startswith("ok ")}
    failed = next((p for p in paths if p not in done), paths[-1])
    how = f"exit status {run.returncode}"
    if run.returncode < 0:
        try:
            how = f"signal {signal.Signals(-run.returncode).name}"
        except ValueError:   # a signal number this platform does not name
            how = f"signal {-run.returncode}"
    info = version()
    hint = ""
    if "AMX_INT8 = 1" in info["system_info"]:
        hint = (" Its build runs llama.cpp's AMX backend on this CPU, a known fault (ggml-org/llama.cpp#20824): "
                f"rebuild it without AMX: CMAKE_ARGS=\"{NO_AMX_CMAKE_ARGS}\" pip install --force-reinstall --no-deps "
                f"--no-cache-dir llama-cpp-python=={info['llama_cpp_python']}.")
    tail = (run.stderr or "").strip().splitlines()[-3:]
    raise UserError(f"llama.cpp (llama-cpp-python {info['llama_cpp_python']}) crashed ({how}) evaluating "
                    f"{Path(failed).name} on this CPU, in a probe run before the study; nothing was measured.{hint} "
                    f"Or pass --anchors none to measure without it." + (f" Its last output: {' | '.join(tail)}"
                                                                        if tail else ""))


@dataclass
class LlamaCppRunner:
    """One GGUF loaded by llama.cpp, timed the way speed_cpu times our models."""
    path: str
    threads: int
    n_ctx: int

    def __post_init__(self):
        lc = _llama_cpp()
        self._lc = lc
        self.llm = lc.Llama(model_path=self.path, n_ctx=self.n_ctx, n_batch=self.n_ctx, n_ubatch=self.n_ctx,
                            n_threads=self.threads, n_threads_batch=self.threads, logits_all=False, verbose=False)
        self.n_vocab = self.llm.n_vocab()

    def _greedy(self) -> int:
        import numpy as np
        ptr = self._lc.llama_get_logits_ith(self.llm._ctx.ctx, -1)
        return int(np.ctypeslib.as_array(ptr, shape=(self.n_vocab,)).argmax())

    def decode(self, prompt: list[int], steps: int) -> tuple[float, float]:
        """(wall, CPU) ms per greedy token after `prompt` (its evaluation not timed)."""
        self.llm.reset()
        self.llm.eval(prompt)
        nxt = self._greedy()
        t0, c0 = time.perf_counter(), time.process_time()
        for _ in range(steps):
            self.llm.eval([nxt])
            nxt = self._greedy()
        return 1e3 * (time.perf_counter() - t0) / steps, 1e3 * (time.process_time() - c0) / steps

    def prefill(self, ids: list[int]) -> tuple[float, float]:
        """(tokens/s wall, CPU seconds) of one batch of `ids` from an empty cache, the last logits only."""
        self.llm.reset()
        t0, c0 = time.perf_counter(), time.process_time()
        self.llm.eval(ids)
        return len(ids) / (time.perf_counter() - t0), time.process_time() - c0

    def close(self) -> None:
        self.llm.close()
