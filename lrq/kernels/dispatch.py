"""Which weight-only kernel runs at a (scheme, M, N, K): ours (the decode GEMV, the GEMM), torch's int4 kernel.

Candidates (`candidates`):
- "gemv": lrq.kernels.gemv, M <= 16, groups a multiple of 32 columns (or per channel);
- "wq_gemm": lrq.kernels.wq_gemm, any shape (the fused GEMM; its own dequantize + vendor GEMM at large M);
- "torch_int4": torch's tinygemm (`torch._weight_int4pack_mm`), CUDA only, 4 bits, K a multiple of 128 and
  groups of 32/64/128/256 (per channel: the scale repeated over groups of 256 or 128, exact), N a multiple of 8.
  Its dequantization is (q - 8) * s + o with o = (8 - z) * s, ours (q - z) * s: the same numbers.
gemlite is not wired in (its packing API was not available to check here); `candidates` says so when it is
importable, in the record's `skipped`.

Choosing (`Dispatcher.choose`): with a measuring `timer` (on a GPU: triton.testing.do_bench's median), every
candidate is first checked against the float reference on the call's shape (a candidate that fails or
differs by more than 2 % of the output's range is dropped, with the reason recorded), then timed once; the
fastest is kept for that key and saved to the cache file (one JSON per device name) so a later process does not
measure again. Without a timer (CPU, interpreter, LRQ_DISPATCH_MEASURE=0) the static rule picks: the GEMV at
M <= 16 where it fits, else the GEMM. Every choice is kept in `Dispatcher.records` (kernel, how it was chosen,
times, drops) for the GPU session's JSON.

In the model (`PackedLinear._forward_gpu`): one process-wide Dispatcher (`default_dispatcher`; its table in
`default_cache_file()`, under lrq-bench's cache folder) picks per (device, scheme, M, N, K, dtype); a key is
decided once per process (`Dispatcher.chosen`) and recorded once. Inside a CUDA-graph capture nothing can be
measured (do_bench synchronizes) and no weights can be converted (the conversion would be recorded into the
graph, not run), so a key not decided before the capture takes the static rule among the kernels that are
ready (`ready`: their runner built already, or the GEMM, which reads the planar words as they are); that choice
is recorded with source "static-capture" and not saved. `LRQ_DISPATCH_KERNEL=<kernel>` pins a kernel wherever
it is a candidate (source "forced"; A/B runs).
"""

from __future__ import annotations

import json
import os
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from lrq.kernels import gemv as G
from lrq.kernels import wq_gemm as WQ
from lrq.io import cache_root
from lrq.kernels.common import capturing
from lrq.packing import unpack_planar

KERNELS = ("gemv", "wq_gemm", "torch_int4")


@dataclass
class Choice:
    scheme: str
    m: int
    n: int
    k: int
    kernel: str
    source: str                                  # "measured", "cached", "static", "static-capture" or "forced"
    times_ms: dict = field(default_factory=dict)
    dropped: dict = field(default_factory=dict)  # candidate -> why it was not considered
    skipped: dict = field(default_factory=dict)  # kernels not candidates at this shape -> why


def scheme_name(bits: int, group_size: int | None, k: int) -> str:
    g = WQ.kernel_group(group_size, k)
    return f"w{bits}a16" + (f"-g{g}" if g else "")


def _tinygemm_group(group: int, k: int) -> int | None:
    if k % 128:
        return None
    if group == 0:
        return next((g for g in (256, 128) if k % g == 0), None)
    return group if group in (32, 64, 128, 256) and k % group == 0 else None


def candidates(bits: int, group_size: int | None, m: int, n: int, k: int, device: torch.device) -> tuple[list, dict]:
    """(kernels that can run this shape, {kernel: why not} for the others)."""
    group = WQ.kernel_group(group_size, k)
    ok, why = [], {}
    if m > G.MAX_M:
        why["gemv"] = f"M = {m} > {G.MAX_M}"
    elif group % G.GROUP_MULTIPLE:
        why["gemv"] = f"group {group} not a multiple of {G.GROUP_MULTIPLE}"
    else:
        ok.append("gemv")
    ok.append("wq_gemm")
    if device.type != "cuda" or not hasattr(torch, "_weight_int4pack_mm"):
        why["torch_int4"] = "CUDA only"
    elif bits != 4:
        why["torch_int4"] = f"{bits} bits"
    elif _tinygemm_group(group, k) is None or n % 8:
        why["torch_int4"] = f"shape N={n} K={k} group {group} outside tinygemm's"
    else:
        ok.append("torch_int4")
    try:
        import gemlite  # noqa: F401
        why["gemlite"] = "importable but not wired in"
    except ImportError:
        why["gemlite"] = "not installed"
    return ok, why


def static_rule(ok: list) -> str:
    return "gemv" if "gemv" in ok else "wq_gemm"


class Runner:
    """One kernel's callable x -> y over one layer's weights, and the tensors it converted for itself (held beyond
    the layer's planar buffers: the GEMV layout, torch's int4 layout; none for the GEMM)."""

    def __init__(self, kernel: str, fn, held: tuple = ()):
        self.kernel, self.fn, self.held = kernel, fn, tuple(held)

    def __call__(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        return self.fn(x, bias)

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.held)

    def __repr__(self) -> str:
        return f"Runner({self.kernel}, {self.nbytes} bytes converted)"


def build_runner(kernel: str, packed: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, bits: int,
                 group_size: int | None, k: int) -> Runner:
    """A callable x -> y for one kernel, its weights converted once (here, not per call)."""
    if kernel == "gemv":
        w = G.repack_gemv(packed, scale, zero, bits, group_size, k)
        return Runner(kernel, lambda x, bias=None: G.gemv_matmul(x, w, bias), (w.words, w.scale, w.zero))
    if kernel == "wq_gemm":
        return Runner(kernel, lambda x, bias=None: WQ.wq_matmul(x, packed, scale, zero, bits, group_size, k, bias))
    if kernel == "torch_int4":
        group = WQ.kernel_group(group_size, k)
        tg = _tinygemm_group(group, k)
        q = unpack_planar(packed, bits, k).to(torch.int32)
        ours = torch.arange(k // tg, device=q.device) * tg // (group or k)
        s, z = scale.float()[:, ours], zero.float()[:, ours]
        sz = torch.stack([s.t(), ((8 - z) * s).t()], dim=-1).to(torch.bfloat16).contiguous()   # [groups, N, 2]
        u8 = ((q[:, ::2] << 4) | q[:, 1::2]).to(torch.uint8).contiguous()
        w4 = torch._convert_weight_to_int4pack(u8, 8)

        def run(x, bias=None):
            y = torch._weight_int4pack_mm(x.reshape(-1, k).to(torch.bfloat16), w4, tg, sz)
            if bias is not None:
                y = y + bias.to(y.dtype)
            return y.to(x.dtype).reshape(*x.shape[:-1], -1)
        return Runner(kernel, run, (w4, sz))
    raise ValueError(f"unknown kernel {kernel!r}: one of {KERNELS}")


def _default_timer():
    if os.environ.get("LRQ_DISPATCH_MEASURE", "1") == "0" or not torch.cuda.is_available():
        return None
    from triton.testing import do_bench
    return lambda fn: do_bench(fn, warmup=5, rep=25, return_mode="median")


class Dispatcher:
    def __init__(self, cache_file: str | Path | None = None, timer="default"):
        self.cache_file = Path(cache_file) if cache_file else None
        self.timer = _default_timer() if timer == "default" else timer
        self.table: dict[str, dict] = {}            # measured choices, as saved in the cache file
        self.chosen: dict[str, Choice] = {}         # every key decided in this process (not capture fallbacks)
        self.records: list[Choice] = []             # each (key, source) once, in order
        self.calls: dict[str, int] = {}             # key -> choose() calls (a model: one per layer of the shape)
        self._record_keys: list[str] = []
        if self.cache_file and self.cache_file.exists():
            self.table = json.loads(self.cache_file.read_text())

    @staticmethod
    def key(device: torch.device, scheme: str, m: int, n: int, k: int, dtype: torch.dtype) -> str:
        name = torch.cuda.get_device_name(device) if device.type == "cuda" else device.type
        return f"{name}|{scheme}|{m}|{n}|{k}|{str(dtype).removeprefix('torch.')}"

    def _record(self, key: str, c: Choice) -> Choice:
        self.calls[key] = self.calls.get(key, 0) + 1
        if not any(k == key and r.source == c.source for k, r in zip(self._record_keys, self.records)):
            self.records.append(c)
            self._record_keys.append(key)
        return c

    def choose(self, x: torch.Tensor, packed: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, bits: int,
               group_size: int | None, k: int, runners: dict | None = None) -> Choice:
        """The kernel for this call's key. `runners` (kernel -> Runner, a layer's own): measuring takes its runners
        from there and leaves the ones it builds there (built once, whichever wins); inside a CUDA-graph capture the
        kernels in it, and the GEMM, are the ready ones."""
        m, n = x.reshape(-1, k).shape[0], packed.shape[0]
        scheme = scheme_name(bits, group_size, k)
        key = self.key(x.device, scheme, m, n, k, x.dtype)
        ok, why = candidates(bits, group_size, m, n, k, x.device)
        ready = [name for name in ok if name == "wq_gemm" or name in (runners or {})]
        forced = os.environ.get("LRQ_DISPATCH_KERNEL")
        c = None
        if key in self.chosen:
            c = self.chosen[key]
        elif forced in ok:
            c = Choice(scheme, m, n, k, forced, "forced", skipped=why)
        elif key in self.table and self.table[key].get("kernel") in ok:
            c = Choice(**{**self.table[key], "source": "cached"})
        if (c is None or c.kernel not in ready) and capturing():
            # nothing may be timed or converted now: the static rule among what is ready, for this capture only
            return self._record(key, Choice(scheme, m, n, k, static_rule(ready), "static-capture", skipped=why))
        if c is None and self.timer is None:
            c = Choice(scheme, m, n, k, static_rule(ok), "static", skipped=why)
        elif c is None:
            c = self._measure(x, packed, scale, zero, bits, group_size, k, scheme, ok, why, runners)
            self.table[key] = asdict(c)
            if self.cache_file:
                self.cache_file.parent.mkdir(parents=True, exist_ok=True)
                self.cache_file.write_text(json.dumps(self.table, indent=1))
        self.chosen[key] = c
        return self._record(key, c)

    def _measure(self, x, packed, scale, zero, bits, group_size, k, scheme, ok, why, runners) -> Choice:
        m, n = x.reshape(-1, k).shape[0], packed.shape[0]
        ref = WQ.reference_wq_matmul(x, packed, scale, zero, bits, group_size, k).float()
        span = ref.abs().max().clamp(min=1e-6)
        times, dropped = {}, {}
        for name in ok:
            try:
                run = (runners or {}).get(name) or build_runner(name, packed, scale, zero, bits, group_size, k)
                if runners is not None:
                    runners[name] = run
                err = ((run(x).float() - ref).abs().max() / span).item()
                if not err < 0.02:
                    dropped[name] = f"differs from the reference by {err:.3g} of its range"
                    continue
                times[name] = float(self.timer(lambda: run(x)))
            except Exception as e:  # noqa: BLE001 - a candidate that cannot run here is dropped, said why
                dropped[name] = f"{type(e).__name__}: {str(e)[:200]}"
        if not times:
            raise RuntimeError(f"no kernel could run {scheme} at M={m} N={n} K={k}: {dropped}")
        return Choice(scheme, m, n, k, min(times, key=times.get), "measured", times, dropped, why)

    def report(self) -> list[dict]:
        """The records as JSON rows: the choice, its key (device, dtype) and how many calls took it (in a model:
        the layers of that shape)."""
        return [{**asdict(c), "key": key, "calls": self.calls.get(key, 0)}
                for key, c in zip(self._record_keys, self.records)]


def default_cache_file() -> Path | None:
    """$LRQ_DISPATCH_CACHE (a file; empty: none), else kernels/dispatch.json under lrq-bench's cache folder
    (lrq.io.cache_root)."""
    explicit = os.environ.get("LRQ_DISPATCH_CACHE")
    if explicit is not None:
        return Path(explicit).expanduser() if explicit else None
    return cache_root() / "kernels" / "dispatch.json"


_DEFAULT: Dispatcher | None = None


def default_dispatcher() -> Dispatcher:
    """The process-wide dispatcher the model's layers ask (made at first use)."""
    global _DEFAULT
    if _DEFAULT is None:
        _DEFAULT = Dispatcher(default_cache_file())
    return _DEFAULT


@contextmanager
def using(dispatcher: Dispatcher):
    """Make `dispatcher` the process-wide one inside the block (a benchmark's per-format records, tests)."""
    global _DEFAULT
    before, _DEFAULT = _DEFAULT, dispatcher
    try:
        yield dispatcher
    finally:
        _DEFAULT = before
