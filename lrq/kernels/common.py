"""What the GPU kernels share: the Triton import guard, the planar-weight unpacking, tile configurations
bucketed by M, and a bounded autotuner.

Configurations. Each kernel declares a few tile configurations per range of M (decode, small, large). On
a GPU the first call for a new (bucket, N, K, constexprs) times each of that bucket's configurations
(at most two: a cold Triton cache compiles each once, 0.3-1.5 s) and keeps the fastest;
`LRQ_KERNEL_TUNE=0` skips the timing and takes the bucket's first configuration, and so does a first call
inside a CUDA-graph capture (nothing can be timed there; not kept, so a later eager call still tunes). Under
the interpreter (TRITON_INTERPRET=1, the CPU) the bucket's first configuration is used, or the one a test passes.
Every configuration is compiled ahead of time for sm_90 and sm_80 by `lrq.kernels.aot` in the test
suite (shared memory, registers, spills), so a configuration that cannot run on those GPUs never ships.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field

import torch

try:
    import triton
    import triton.language as tl
except ImportError:   # CPU wheels without triton: every entry point falls back to its torch reference
    triton = None
    tl = None

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"


@dataclass(frozen=True)
class TileConfig:
    block_m: int
    block_n: int
    block_k: int
    num_warps: int
    num_stages: int

    def kwargs(self) -> dict:
        return {"BLOCK_M": self.block_m, "BLOCK_N": self.block_n, "BLOCK_K": self.block_k}

    def options(self) -> dict:
        return {"num_warps": self.num_warps, "num_stages": self.num_stages}

    def __str__(self) -> str:
        return f"{self.block_m}x{self.block_n}x{self.block_k} w{self.num_warps} s{self.num_stages}"


@dataclass(frozen=True)
class Buckets:
    """Tile configurations per range of M: bucket i holds M <= bounds[i] (the last: any M)."""
    bounds: tuple[int, ...]
    configs: tuple[tuple[TileConfig, ...], ...]
    names: tuple[str, ...] = field(default=())

    def bucket(self, m: int) -> int:
        return next((i for i, b in enumerate(self.bounds) if m <= b), len(self.bounds))

    def all(self) -> list[TileConfig]:
        return [c for cs in self.configs for c in cs]

    def candidates(self, bucket: int, tune: bool | None = None) -> tuple[TileConfig, ...]:
        """The configurations a call in this bucket may compile: all of them when tuning, else the first."""
        cs = self.configs[bucket]
        return cs if (tune if tune is not None else tune_enabled() and not INTERPRET) else cs[:1]

    def split(self, c: TileConfig, m: int, n: int, k: int, sms: int, split: int | None = None) -> tuple[int, int]:
        """(K columns per program, programs per output tile) for configuration c; split K only at decode."""
        if split is None:
            split = split_k(cdiv(n, c.block_n) * cdiv(m, c.block_m), k, c.block_k, sms) if self.bucket(m) == 0 else 1
        k_split = cdiv(cdiv(k, split), c.block_k) * c.block_k
        return k_split, cdiv(k, k_split)


def capturing() -> bool:
    """Whether the current CUDA stream is capturing a graph (nothing may be timed or synchronized then)."""
    return torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()


def tune_enabled() -> bool:
    return os.environ.get("LRQ_KERNEL_TUNE", "1") != "0"


_SMS: dict[int, int] = {}


def sm_count(device: torch.device) -> int:
    idx = device.index if device.index is not None else torch.cuda.current_device()
    if idx not in _SMS:
        _SMS[idx] = torch.cuda.get_device_properties(idx).multi_processor_count
    return _SMS[idx]


def device_sms(device: torch.device) -> int:
    """Streaming multiprocessors of a CUDA device; 0 elsewhere (no split K)."""
    return sm_count(device) if device.type == "cuda" else 0


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def split_k(tiles: int, k: int, block_k: int, sms: int) -> int:
    """How many programs share one output tile's K range (decode sizes): enough programs for two per SM,
    each still with at least four K steps; a power of two. 1 without SMs (CPU, interpreter)."""
    if sms <= 0:
        return 1
    want = max(1, (2 * sms) // max(tiles, 1))
    most = max(1, k // (4 * block_k))
    s = 1
    while s * 2 <= min(want, most):
        s *= 2
    return s


def split_output(buckets: "Buckets", c: TileConfig, m: int, n: int, k: int, device: torch.device,
                 dtype: torch.dtype, split: int | None = None):
    """A launch's K split, output buffer and grid: split K adds float32 partial sums into a zeroed buffer
    (atomics), else the kernel writes the activations' dtype directly. Returns (k_split, atomic, y, grid)."""
    k_split, sk = buckets.split(c, m, n, k, device_sms(device), split)
    atomic = sk > 1
    y = (torch.zeros if atomic else torch.empty)(m, n, device=device, dtype=torch.float32 if atomic else dtype)
    return k_split, atomic, y, (cdiv(n, c.block_n), cdiv(m, c.block_m), sk)


class Tuner:
    """Picks one configuration per key by timing the candidates once (bounded: a bucket has at most a few).
    `launch(config)` must run the whole operation (buffers, kernel, epilogue) so the timing is its cost."""

    def __init__(self):
        self.best: dict[tuple, TileConfig] = {}
        self.timings: dict[tuple, dict[str, float]] = {}

    def pick(self, key: tuple, candidates: tuple[TileConfig, ...], launch) -> TileConfig:
        if key in self.best:
            return self.best[key]
        if capturing():          # a shape first seen inside a CUDA-graph capture: untimed, not kept
            return candidates[0]
        if len(candidates) == 1:
            self.best[key] = candidates[0]
            return candidates[0]
        from triton.testing import do_bench
        times = {}
        for c in candidates:
            try:
                times[c] = do_bench(lambda: launch(c), warmup=5, rep=20, return_mode="median")
            except Exception as e:  # noqa: BLE001 - a config that cannot launch here is skipped, said once
                print(f"lrq.kernels: {c} skipped for {key}: {type(e).__name__}: {str(e)[:200]}", flush=True)
        if not times:
            raise RuntimeError(f"no tile configuration of {candidates} could run for {key}")
        self.best[key] = min(times, key=times.get)
        self.timings[key] = {str(c): t for c, t in times.items()}
        return self.best[key]


def dtype_name(dtype: torch.dtype) -> str:
    return {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32"}[dtype]


def check_activation(x: torch.Tensor, in_features: int) -> torch.Tensor:
    """x [..., K] -> a row-major [M, K] view (copied only when its rows are not contiguous)."""
    if x.shape[-1] != in_features:
        raise ValueError(f"activation width {x.shape[-1]} does not match the layer's {in_features} input features")
    x2 = x.reshape(-1, in_features)
    return x2 if x2.stride(-1) == 1 else x2.contiguous()


if triton is not None:
    @triton.jit
    def _plane(w_ptr, rn, n_ok, stride_wn, K, k0, PB: tl.constexpr, BLOCK_K: tl.constexpr):
        """One bit plane's levels for K columns [k0, k0 + BLOCK_K) of rows rn: each packed word of the
        [BLOCK_N, BLOCK_K * PB / 32] tile is loaded once, replicated in registers (interleave) and shifted."""
        E: tl.constexpr = 32 // PB
        wk = k0 // E + tl.arange(0, BLOCK_K // E)
        w = tl.load(w_ptr + rn[:, None] * stride_wn + wk[None, :],
                    mask=n_ok[:, None] & (wk[None, :] < tl.cdiv(K * PB, 32)), other=0)
        for i in tl.static_range(5):
            if (1 << i) < E:
                w = tl.interleave(w, w)
        shift = (tl.arange(0, BLOCK_K) % E) * PB
        return (w >> shift[None, :]) & ((1 << PB) - 1)

    @triton.jit
    def load_levels(w_ptr, rn, n_ok, stride_wn, K, k0, off1, off2,
                    P0: tl.constexpr, P1: tl.constexpr, P2: tl.constexpr, BLOCK_K: tl.constexpr):
        """[BLOCK_N, BLOCK_K] int32 levels of the planar layout (lrq.packing.pack_planar)."""
        q = _plane(w_ptr, rn, n_ok, stride_wn, K, k0, P0, BLOCK_K)
        if P1 > 0:
            q |= _plane(w_ptr + off1, rn, n_ok, stride_wn, K, k0, P1, BLOCK_K) << P0
        if P2 > 0:
            q |= _plane(w_ptr + off2, rn, n_ok, stride_wn, K, k0, P2, BLOCK_K) << (P0 + P1)
        return q

    @triton.jit
    def load_qparams(s_ptr, z_ptr, rn, n_ok, rk, K, k0, stride_sn, GROUP: tl.constexpr, BLOCK_K: tl.constexpr):
        """Scale and zero point of a [BLOCK_N, BLOCK_K] tile as float32: one load per row when the tile lies
        in one group (GROUP a multiple of BLOCK_K), else per element (group sizes below the tile)."""
        if GROUP % BLOCK_K == 0:
            g = k0 // GROUP
            s = tl.load(s_ptr + rn * stride_sn + g, mask=n_ok, other=0.0).to(tl.float32)[:, None]
            z = tl.load(z_ptr + rn * stride_sn + g, mask=n_ok, other=0).to(tl.float32)[:, None]
        else:
            off = rn[:, None] * stride_sn + (rk // GROUP)[None, :]
            ok = n_ok[:, None] & (rk[None, :] < K)
            s = tl.load(s_ptr + off, mask=ok, other=0.0).to(tl.float32)
            z = tl.load(z_ptr + off, mask=ok, other=0).to(tl.float32)
        return s, z
