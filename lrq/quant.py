"""Quantizer primitives: pure functions on tensors, shared by every method, module and kernel.

Conventions (METHOD.md section 1 and 4):
- weights are quantized asymmetrically per output row, optionally in groups of `group_size` consecutive
  input columns; a ragged last group is narrower (576 = 4 x 128 + 64), never straddling two rows;
- stored integers are unsigned levels q in [0, 2^b - 1]; w_hat = (q - z) * s, z an integer per row/group.
  This is the same grid as METHOD.md's W_int = clamp(round(W/s), -z, 2^b-1-z), w_hat = W_int * s, with q = W_int + z;
- scales and zero points have shape [rows, n_groups] (n_groups = 1 for per-channel).
"""

from __future__ import annotations

import contextlib
import functools
import math
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np
import torch

from lrq.errors import UserError

SCALE_EPS = 1e-8


def check_bits(bits: int) -> None:
    if not isinstance(bits, int) or not 2 <= bits <= 8:
        raise UserError(f"bit width {bits!r} is not supported: use an integer from 2 to 8.")


def n_groups(in_features: int, group_size: int | None) -> int:
    """Number of column groups per row; a ragged last group counts as one."""
    if group_size is None:
        return 1
    if group_size <= 0 or group_size > in_features:
        raise UserError(
            f"group size {group_size} does not fit a layer with {in_features} input columns: "
            f"use a group size from 1 to {in_features}, or per-channel quantization (no group size)."
        )
    return math.ceil(in_features / group_size)


def expand_groups(t: torch.Tensor, group_size: int | None, in_features: int) -> torch.Tensor:
    """Broadcast per-group parameters [rows, n_groups] to per-weight [rows, in_features]."""
    if group_size is None or t.shape[-1] == 1:
        return t.expand(*t.shape[:-1], in_features) if t.shape[-1] == 1 else t
    return t.repeat_interleave(group_size, dim=-1)[..., :in_features]


def _group_view(w: torch.Tensor, group_size: int | None, pad_value: float) -> torch.Tensor:
    """View a [rows, cols] matrix as [rows, n_groups, group_size], padding the ragged last group."""
    rows, cols = w.shape
    g = cols if group_size is None else group_size
    ng = n_groups(cols, group_size)
    pad = ng * g - cols
    if pad:
        w = torch.nn.functional.pad(w, (0, pad), value=pad_value)
    return w.reshape(rows, ng, g)


def group_min_max(w: torch.Tensor, group_size: int | None) -> tuple[torch.Tensor, torch.Tensor]:
    """Row/group minimum (clamped to <= 0) and maximum (clamped to >= 0), each [rows, n_groups]."""
    w = w.float()
    lo = _group_view(w, group_size, math.inf).amin(dim=-1).clamp(max=0)
    hi = _group_view(w, group_size, -math.inf).amax(dim=-1).clamp(min=0)
    return lo, hi


def qparams_from_range(lo: torch.Tensor, hi: torch.Tensor, bits: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Asymmetric scale and integer zero point covering [lo, hi] (lo <= 0 <= hi)."""
    qmax = 2**bits - 1
    scale = ((hi - lo) / qmax).clamp(min=SCALE_EPS)
    zero = torch.round(-lo / scale).clamp(0, qmax)
    return scale, zero


def minmax_qparams(w: torch.Tensor, bits: int, group_size: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Round-to-nearest quantization parameters from each row's (or group's) min/max."""
    check_bits(bits)
    lo, hi = group_min_max(w, group_size)
    return qparams_from_range(lo, hi, bits)


def quantize(w: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, bits: int,
             group_size: int | None = None) -> torch.Tensor:
    """Integer levels q = clamp(round(w / s) + z, 0, 2^b - 1) as uint8."""
    cols = w.shape[-1]
    s = expand_groups(scale, group_size, cols)
    z = expand_groups(zero, group_size, cols)
    q = torch.clamp(torch.round(w.float() / s) + z, 0, 2**bits - 1)
    return q.to(torch.uint8)


def dequantize(q: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor,
               group_size: int | None = None, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """w_hat = (q - z) * s, computed in `dtype` (float32 by default)."""
    cols = q.shape[-1]
    return ((q.to(dtype) - expand_groups(zero.to(dtype), group_size, cols))
            * expand_groups(scale.to(dtype), group_size, cols))


def fake_quant(w: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, bits: int,
               group_size: int | None = None) -> torch.Tensor:
    return dequantize(quantize(w, scale, zero, bits, group_size), scale, zero, group_size).to(w.dtype)


def round_ste(x: torch.Tensor) -> torch.Tensor:
    """Round forward, identity backward (straight-through estimator)."""
    return (torch.round(x) - x).detach() + x


def per_token_qparams(x: torch.Tensor, bits: int = 8) -> tuple[torch.Tensor, torch.Tensor]:
    """The per-token grid of `per_token_fake_quant`: scale and integer zero point per row [..., 1] (float32)."""
    # qparams_from_range's arithmetic, step for step, in place on fresh [..., 1] tensors: at one token (a decode
    # step) each layer's cost is the count of its operations, not their size
    # two reductions, not torch.aminmax: its CPU reduction along the last dim is about 20x slower from a few rows up
    # (torch 2.13: 1.7 against 0.07 ms for 512 x 1536 float32 on a Zen 5; as fast at one row)
    xf = x.detach().float()
    lo, hi = xf.amin(dim=-1, keepdim=True), xf.amax(dim=-1, keepdim=True)
    qmax = 2**bits - 1
    scale = hi.clamp_(min=0).sub_(lo.clamp_(max=0)).div_(qmax).clamp_(min=SCALE_EPS)
    return scale, lo.div_(scale).neg_().round_().clamp_(0, qmax)


def per_token_dequantized(x: torch.Tensor, bits: int = 8) -> torch.Tensor:
    """per_token_fake_quant's values, bit for bit (a test checks), without the straight-through estimator's
    operations: for inference (no gradient), where a decode step's cost is its count of operations."""
    if x.device.type == "cpu" and x.dtype in (torch.bfloat16, torch.float32) and x.is_contiguous() and x.numel():
        import lrq.native as native
        lib = native.library()
        if lib is not None:   # the same operations in one C call (lrq/csrc/cpu_gemv.c: lrq_per_token_dequant)
            y = torch.empty_like(x)
            lib.lrq_per_token_dequant(x.data_ptr(), y.data_ptr(), x.dtype == torch.bfloat16, x.numel() // x.shape[-1],
                                      x.shape[-1], bits, SCALE_EPS)
            return y
    xf = x.detach().float()
    scale, zero = per_token_qparams(xf, bits)
    return torch.div(xf, scale).round_().add_(zero).clamp_(0, 2**bits - 1).sub_(zero).mul_(scale).to(x.dtype)


def per_token_fake_quant(x: torch.Tensor, bits: int = 8) -> torch.Tensor:
    """Dynamic asymmetric fake quantization with one scale/zero per token (last dimension).

    scale = max((max(t) - min(t)) / (2^b - 1), 1e-8), z = clamp(round(-min(t) / scale), 0, 2^b - 1),
    as in the authors' code, with the range widened to include 0 (min <= 0 <= max). That changes nothing
    for mixed-sign tokens (every real activation row) and keeps one-signed or constant tokens on the grid
    instead of clamping them.
    """
    qmax = 2**bits - 1
    scale, zero = per_token_qparams(x, bits)
    q = torch.clamp(round_ste(x.float() / scale) + zero, 0, qmax)
    return ((q - zero) * scale).to(x.dtype)


def per_tensor_fake_quant(x: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, bits: int = 8) -> torch.Tensor:
    """Static asymmetric fake quantization with one (calibrated) scale and zero point for the whole tensor."""
    qmax = 2**bits - 1
    q = torch.clamp(round_ste(x.float() / scale) + zero, 0, qmax)
    return ((q - zero) * scale).to(x.dtype)


def weight_bits_per_element(bits: int, group_size: int | None, in_features: int,
                            scale_bits: int = 16, zero_bits: int | None = None) -> float:
    """Storage bits per weight including per-row/group fp16 scales and `bits`-wide zero points."""
    zero_bits = bits if zero_bits is None else zero_bits
    return bits + n_groups(in_features, group_size) * (scale_bits + zero_bits) / in_features


# Scores are sums of float32 |e|^p. torch computes pow over whole vectors with one routine and the
# remainder of a buffer that is not a whole number of vectors with another, which can differ in the last
# bit; so the searches lay every group out in a multiple of SEARCH_ALIGN columns (padding masked out) and
# score on one thread, where every element goes through the vector routine whatever the layout, the block
# sizes or the machine's thread count, and both searches agree to the last bit.
SEARCH_ALIGN = 32


def _search_groups(w: torch.Tensor, group_size: int | None):
    """Rows/groups of `w` as [N, g] float32 (padding 0, g a multiple of SEARCH_ALIGN), the valid mask, and
    each group's lo <= 0 <= hi."""
    rows = w.shape[0]
    wg = _group_view(w.float(), group_size, math.nan)            # [rows, ng, g], NaN = padding
    ng, g = wg.shape[1], wg.shape[2]
    flat = wg.reshape(rows * ng, g)
    if g % SEARCH_ALIGN:
        flat = torch.nn.functional.pad(flat, (0, SEARCH_ALIGN - g % SEARCH_ALIGN), value=math.nan)
    valid = ~torch.isnan(flat)
    flat = torch.nan_to_num(flat, nan=0.0)
    lo = torch.where(valid, flat, torch.full_like(flat, math.inf)).amin(-1).clamp(max=0)
    hi = torch.where(valid, flat, torch.full_like(flat, -math.inf)).amax(-1).clamp(min=0)
    return flat, valid, lo, hi, ng


def _search_error(x: torch.Tensor, valid: torch.Tensor, delta: torch.Tensor, zp: torch.Tensor, qmax: int,
                  norm: float) -> torch.Tensor:
    """The search's score sum |W - W_hat|^norm, float32, for x [R, 1, g] against candidates delta/zp [R, C, 1].

    Both searches score with exactly these float32 operations (on one thread, g a multiple of
    SEARCH_ALIGN), so their scores agree to the last bit.
    """
    q = torch.clamp(torch.round(x / delta) + zp, 0, qmax)
    err = ((q - zp) * delta - x).abs().pow(norm)
    return torch.where(valid, err, 0).sum(-1)


def _score_candidates(flat: torch.Tensor, valid: torch.Tensor | None, rows: torch.Tensor, delta: torch.Tensor,
                      zp: torch.Tensor, qmax: int, norm: float, block_elems: int = 2**16) -> torch.Tensor:
    """The exact scores [K] of K candidates: group rows[k] of `flat` [N, g] at step delta[k], zero point zp[k].

    The same float32 operations as `_search_error`, element by element and summed in the same order, hence
    the same scores to the last bit, but in place and in blocks of about `block_elems` elements that stay in
    the cache (about 4x faster than one pass over all candidates). `valid` None: no padding.
    """
    K, g = rows.numel(), flat.shape[1]
    out = torch.empty(K)
    per = max(1, block_elems // g)
    for a in range(0, K, per):
        r, d, z = rows[a:a + per], delta[a:a + per, None], zp[a:a + per, None]
        x = flat[r]
        q = x / d
        q.round_().add_(z).clamp_(0, qmax).sub_(z).mul_(d).sub_(x).abs_().pow_(norm)
        if valid is not None:
            q.masked_fill_(~valid[r], 0)
        out[a:a + per] = q.sum(-1)
    return out


@contextlib.contextmanager
def single_cpu_thread(device: torch.device | str = "cpu"):
    """torch on one CPU thread for the duration (nothing changes for another device); the caller's thread
    count is restored. For work that must not depend on the thread count (the searches, see SEARCH_ALIGN)
    or that is many small operations, where thread synchronisation costs more than it saves (GPTQ)."""
    before = torch.get_num_threads()
    if torch.device(device).type != "cpu" or before == 1:
        yield
        return
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def _on_cpu(search):
    """Run a search on the CPU, one thread, whatever device `w` is on; the results go back to that device."""
    @functools.wraps(search)
    def run(w: torch.Tensor, *args, **kwargs) -> tuple[torch.Tensor, torch.Tensor]:
        with single_cpu_thread():
            scale, zero = search(w.detach().float().cpu(), *args, **kwargs)
        return scale.to(w.device), zero.to(w.device)
    return run


@_on_cpu
def search_qparams_exhaustive(w: torch.Tensor, bits: int, group_size: int | None = None, grid: int = 100,
                              norm: float = 2.4, chunk_elems: int = 2**24) -> tuple[torch.Tensor, torch.Tensor]:
    """The clipping search by scoring every candidate (the definition; `search_qparams` is the fast equivalent).

    For i = 1..grid the candidate width is (max - min) * i / grid with step delta = width / (2^b - 1);
    for every zero point zp in 0..2^b - 1 the range is [-zp * delta, width - zp * delta]. The score is
    sum |W - W_hat|^norm over the row (or group); the best (delta, zp) per row/group wins, the first in
    (i, zp) order on ties. Vectorised over rows, zero points and columns; rows in chunks to bound memory.
    """
    check_bits(bits)
    rows = w.shape[0]
    qmax = 2**bits - 1
    flat, valid, lo, hi, ng = _search_groups(w, group_size)
    g = flat.shape[1]
    zps = torch.arange(qmax + 1, dtype=torch.float32)[None, :, None]   # [1, Z, 1]
    best_err = torch.full((flat.shape[0],), math.inf)
    best_scale = torch.ones(flat.shape[0])
    best_zero = torch.zeros(flat.shape[0])
    step = max(1, chunk_elems // max(1, (qmax + 1) * g))
    for a in range(0, flat.shape[0], step):
        x = flat[a:a + step].unsqueeze(1)                        # [R, 1, g]
        m = valid[a:a + step].unsqueeze(1)                       # [R, 1, g]
        width = (hi[a:a + step] - lo[a:a + step])                # [R]
        for i in range(1, grid + 1):
            delta = (width * i / grid / qmax).clamp(min=SCALE_EPS)[:, None, None]    # [R, 1, 1]
            err = _search_error(x, m, delta, zps, qmax, norm)                        # [R, Z]
            e, z = err.min(dim=1)
            better = e < best_err[a:a + step]
            best_err[a:a + step] = torch.where(better, e, best_err[a:a + step])
            best_scale[a:a + step] = torch.where(better, delta[:, 0, 0], best_scale[a:a + step])
            best_zero[a:a + step] = torch.where(better, z.float(), best_zero[a:a + step])
    return best_scale.reshape(rows, ng), best_zero.reshape(rows, ng)


def _sorted_groups(x: torch.Tensor, valid: torch.Tensor):
    """Each group sorted (float32, padding last as inf), its size and prefix sums of x and x^2 (float64)."""
    R, g = x.shape
    n = valid.sum(-1)
    # numpy's sort (vectorised where the CPU allows) is about 15x torch's on rows; the values are the same
    xs = torch.from_numpy(np.sort(torch.where(valid, x.float(), math.inf).numpy(), axis=-1))
    xz = xs.double()
    if not bool(valid.all()):
        xz.masked_fill_(torch.arange(g)[None, :] >= n[:, None], 0.0)
    p1 = torch.zeros(R, g + 1, dtype=torch.float64)
    p2 = torch.zeros(R, g + 1, dtype=torch.float64)
    torch.cumsum(xz, -1, out=p1[:, 1:])
    torch.cumsum(xz.mul_(xz), -1, out=p2[:, 1:])
    return xs, n, p1, p2


def _score_bounds(groups: tuple, delta: torch.Tensor, qmax: int, norm: float, split: bool = True,
                  squares: bool = False) -> torch.Tensor:
    """A lower bound [R, G, Z] on every candidate's score sum |e|^p (p = norm >= 2), for the groups given
    sorted (`_sorted_groups`) and the steps delta [R, G].

    For any set of k errors, sum |e|^p >= k^(1 - p/2) (sum e^2)^(p/2) (power means). With `split` (long
    rows, where the bound's cost is small beside the scoring it saves) the weights clamped to the lowest
    level, the unclamped ones and those clamped to the highest level are bounded apart and summed, since
    the clamped tails carry the large errors, and by a tighter bound (below). The squared errors are
    closed-form: with step d the weights that round to level m lie in [(m - 1/2) d, (m + 1/2) d), a
    contiguous run found by binary search, so from prefix counts and sums of x and x^2 at the 2 qmax + 2
    level boundaries a run's squared error is sum x^2 - 2 m d sum x + m^2 d^2 count. Zero point zp keeps
    the levels -zp..qmax - zp: every weight below the boundary of level -zp takes level -zp, every one
    from the boundary below level qmax - zp takes that level, and the levels in between add up by
    cumulative sums over the levels. Rounding ties are taken upwards here (the scores round half to
    even), which with float64 rounding is what the caller's margin absorbs. With `squares` (and not
    `split`) the sums of squared errors themselves are returned, float64.
    """
    xs, n, p1, p2 = groups
    R = xs.shape[0]
    G = delta.shape[1]
    d = delta.double()                                                      # [R, G]
    m = torch.arange(-qmax - 1, qmax + 1, dtype=torch.float64)              # boundary b_m = (m + 1/2) d
    lv = torch.arange(-qmax, qmax + 1, dtype=torch.float64)
    dd = d[:, :, None]
    bnd = (m + 0.5) * dd                                                    # [R, G, K = 2 qmax + 2]
    K = bnd.shape[-1]
    # The runs are found in float32, the weights' own precision (sums and errors are float64); with `split`
    # the level values m d too, in the same binary search.
    queries = torch.cat([bnd, lv * dd], -1) if split else bnd
    found = torch.searchsorted(xs, queries.reshape(R, -1).float()).clamp_(max=n[:, None]).reshape(R, G, -1)
    ci = found[..., :K].reshape(R, G * K)                                   # count of x < b_m
    c1 = p1.gather(1, ci).reshape(R, G, K)
    c2 = p2.gather(1, ci).reshape(R, G, K)
    c0 = ci.reshape(R, G, K).double()
    # level m = -qmax..qmax holds the run between b_{m-1} and b_m: its sum of m x and of m^2, cumulated
    zeros = torch.zeros(R, G, 1, dtype=torch.float64)
    s1 = torch.cat([zeros, (lv * (c1[..., 1:] - c1[..., :-1])).cumsum(-1)], -1)      # [R, G, K]
    s0 = torch.cat([zeros, (lv * lv * (c0[..., 1:] - c0[..., :-1])).cumsum(-1)], -1)
    zp = torch.arange(qmax + 1)
    lo_i = qmax + 1 - zp                      # index of b_{-zp}: below it, level -zp
    hi_i = 2 * qmax - zp                      # index of b_{qmax - zp - 1}: from it on, level qmax - zp
    lo_l, hi_l = -zp.double(), (qmax - zp).double()
    nt = n[:, None, None].double()
    low0, low1, low2 = c0[..., lo_i], c1[..., lo_i], c2[..., lo_i]                     # [R, G, Z]
    up0 = nt - c0[..., hi_i]
    up1 = p1.gather(1, n[:, None])[:, :, None] - c1[..., hi_i]
    up2 = p2.gather(1, n[:, None])[:, :, None] - c2[..., hi_i]
    low = low2 - 2 * lo_l * dd * low1 + lo_l * lo_l * dd * dd * low0
    up = up2 - 2 * hi_l * dd * up1 + hi_l * hi_l * dd * dd * up0
    # levels -zp + 1 .. qmax - zp - 1: runs lo_i + 1 .. hi_i, i.e. cumulated entries hi_i minus lo_i
    mid = (c2[..., hi_i] - low2) - 2 * dd * (s1[..., hi_i] - s1[..., lo_i]) + dd * dd * (s0[..., hi_i] - s0[..., lo_i])
    e = norm / 2
    if not split:
        sq = (low + mid + up).clamp_(min=0)
        return sq if squares else nt.float() ** (1 - e) * sq.float() ** e
    # Long rows: each part bounded apart, by its sum of |e| as well: for r < s < t the moments obey
    # M_s^(t - r) <= M_r^(t - s) M_t^(s - r) (Lyapunov); r = 1, s = 2, t = p gives
    # sum |e|^p >= (sum e^2)^(p - 1) / (sum |e|)^(p - 2), never below the power-mean bound and much closer
    # for the near-uniform rounding errors (about 4 % under the score instead of 10 %). The sums of |e| need
    # each run split at its level's value m d, which a second binary search gives.
    pts = lv * dd                                                            # [R, G, 2 qmax + 1]: m d
    pi = found[..., K:]
    q1 = p1.gather(1, pi.reshape(R, -1)).reshape(pi.shape)
    q0 = pi.double()
    run_abs = pts * (q0 - c0[..., :-1]) - (q1 - c1[..., :-1]) + (c1[..., 1:] - q1) - pts * (c0[..., 1:] - q0)
    cum_abs = torch.cat([zeros, run_abs.cumsum(-1)], -1)
    jz, ju = lo_i - 1, hi_i                   # the levels -zp and qmax - zp among -qmax..qmax
    L, U = pts[..., jz], pts[..., ju]
    t1 = p1.gather(1, n[:, None])[:, :, None]
    low_abs = L * q0[..., jz] - q1[..., jz] + (low1 - q1[..., jz]) - L * (low0 - q0[..., jz])
    up_abs = U * (q0[..., ju] - c0[..., hi_i]) - (q1[..., ju] - c1[..., hi_i]) + (t1 - q1[..., ju]) \
        - U * (nt - q0[..., ju])
    mid_abs = cum_abs[..., hi_i] - cum_abs[..., lo_i]
    bound = torch.zeros(low.shape)
    for sq, ab in ((low, low_abs), (mid, mid_abs), (up, up_abs)):
        sq, ab = sq.clamp_(min=0), ab.clamp_(min=0)
        bound += torch.where(ab > 0, sq ** (norm - 1) / ab.clamp(min=1e-300) ** (norm - 2), 0.0).float()
    return bound


def _extreme_bounds(x: torch.Tensor, valid: torch.Tensor, delta: torch.Tensor, qmax: int, norm: float
                    ) -> torch.Tensor:
    """A cheap lower bound [R, G] on the score of every zero point at each width, from the lowest and the
    highest weight of the group alone.

    With zero point zp every weight below -zp d takes level -zp and every weight above (qmax - zp) d takes
    level qmax - zp (by rounding or by clamping: the same level), so the error of the lowest weight is at
    least its distance below -zp d and that of the highest its distance above (qmax - zp) d; the other
    weights add >= 0. The larger of the two, to the power p, minimised over zp, bounds the width's best
    score. Weak where the range covers the weights, strong for the narrow widths that clip far."""
    lowest = torch.where(valid, x, math.inf).amin(-1)[:, None, None]
    highest = torch.where(valid, x, -math.inf).amax(-1)[:, None, None]
    zp = torch.arange(qmax + 1, dtype=torch.float32)
    d = delta[:, :, None]
    below = (-zp * d).sub_(lowest).clamp_(min=0)                                 # [R, G, Z]
    above = (highest - (qmax - zp) * d).clamp_(min=0)
    return torch.maximum(below, above).amin(-1).pow_(norm)


def _row_lists(mask: torch.Tensor) -> torch.Tensor | None:
    """Each row's True columns of `mask` [R, G], as indices [R, Gm] (Gm = the most in any row), short rows
    padded with their first index (computing a bound twice is harmless); None when no row has any."""
    cnt = mask.sum(1)
    gm = int(cnt.max()) if cnt.numel() else 0
    if gm == 0:
        return None
    idx = torch.sort(mask.to(torch.int8), dim=1, descending=True, stable=True).indices[:, :gm]
    return torch.where(torch.arange(gm)[None, :] >= cnt[:, None], idx[:, :1], idx)


@_on_cpu
def search_qparams(w: torch.Tensor, bits: int, group_size: int | None = None, grid: int = 100,
                   norm: float = 2.4, chunk_elems: int = 2**20, margin: float = 3e-3,
                   stats: dict | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Clipping search for per-row (or per-group) scale and zero point (METHOD.md section 3).

    The same search as `search_qparams_exhaustive` (same candidates, same float32 scores, same tie rule,
    hence the same scales and zero points, which equal the authors'), without scoring every candidate.
    For norm >= 2 a candidate's score has lower bounds that cost far less than the score: closed-form from
    its squared (and absolute) errors for all zero points of a width from one sort of the group
    (`_score_bounds`), and, cheaper still, from the group's extreme weights alone (`_extreme_bounds`).
    Pass 1 computes the squared errors of every 5th width and scores the 4 most promising candidates
    exactly: e0, an upper bound on the group's best score. A candidate can only reach e0 if its squared
    error is at most T^2 = e0^(2/p) n^(1 - 2/p) (power means), and the squared error moves slowly with the
    step: with the same levels k, | ||k d - x|| - ||k d' - x|| | <= |d - d'| ||k||, and ||k|| <= (||x|| + T) / d
    for any candidate within T. So the coarse widths rule out most of the others with no further work.
    Pass 2 computes, per group, the closed-form bounds of only the widths still in play (the tighter ones
    on long rows, with the coarse widths still alive) and scores every candidate whose bound, less a `margin` for
    rounding, does not exceed e0. No other candidate can reach e0, so none can win or tie. On the default
    model's weights about 20-30 of the 1,600 (4-bit) candidates per row or group are scored.
    The margin covers rounding: a score is a float32 sum of float32 |e|^p (relative error about 1e-6 for
    thousands of terms), the bounds are float64 sums whose only float32 step is locating each weight's
    level (a weight within float32 rounding of a level boundary may be counted at the neighbour level,
    which changes its error by a few float32 ulps of the step); 3e-3 is over a hundred times either, and
    at 1e-2 the search scored 8 % more candidates for the same result (`reports/s1-search/`).
    Norms below 2 (no such bound) and non-finite weights use the exhaustive search. `stats`, when given,
    receives "candidates" (per group), "scored" (a tensor: how many were scored in each group) and
    "bounded" (a tensor: how many widths got closed-form bounds in each group, of `grid`).
    """
    check_bits(bits)
    if norm < 2 or not torch.isfinite(w).all():
        if stats is not None:
            stats.update(candidates=grid * 2**bits, scored=None, bounded=None)
        return search_qparams_exhaustive.__wrapped__(w, bits, group_size, grid, norm)
    rows = w.shape[0]
    s = _Search.of(w, bits, group_size, grid, norm, chunk_elems, margin)
    first = _search_pass1(s)
    best, scored, bounded = _search_pass2(s, first, *_in_play(s, first))
    if stats is not None:
        stats.update(candidates=s.C, scored=scored, bounded=bounded)
    scale = s.delta.gather(1, (best // s.Z)[:, None])[:, 0]
    return scale.reshape(rows, s.ng), (best % s.Z).float().reshape(rows, s.ng)


@dataclass(frozen=True, eq=False)
class _Search:
    """What the passes of `search_qparams` share: the groups, every candidate's step, the groups sorted, the
    coarse widths and the row chunks. Candidate (i, zp) of a group has index (i - 1) * Z + zp, of C."""
    flat: torch.Tensor                  # [N, g] the groups (`_search_groups`)
    valid: torch.Tensor                 # [N, g]
    pad: torch.Tensor | None            # `valid`, or None where no group is padded (`_score_candidates`)
    delta: torch.Tensor                 # [N, grid] every width's step
    srt: tuple                          # the groups sorted (`_sorted_groups`)
    n: torch.Tensor                     # [N] float64 group sizes
    ng: int                             # groups per row
    qmax: int
    grid: int
    norm: float
    margin: float
    split: bool                         # the tighter, split bounds (`_score_bounds`)
    first: int                          # candidates pass 1 scores exactly per group
    coarse: torch.Tensor                # every 5th width, the widest first included
    chunks: list[slice]                 # rows per chunk of pass 1 and the pruning
    step: int                           # rows per chunk of pass 2

    @property
    def Z(self) -> int:                 # the zero points per width
        return self.qmax + 1

    @property
    def C(self) -> int:                 # the candidates per group
        return self.grid * self.Z

    @classmethod
    def of(cls, w: torch.Tensor, bits: int, group_size: int | None, grid: int, norm: float, chunk_elems: int,
           margin: float) -> _Search:
        qmax = 2**bits - 1
        flat, valid, lo, hi, ng = _search_groups(w, group_size)
        N, g = flat.shape
        width = hi - lo
        # every candidate step, with exactly the exhaustive search's float32 operations
        delta = torch.stack([(width * i / grid / qmax).clamp(min=SCALE_EPS) for i in range(1, grid + 1)], dim=1)
        coarse = torch.arange(grid - 1, -1, -5).flip(0)
        # rows per chunk: pass 1 bounds the coarse widths of each; pass 2 a few dozen widths per row at most
        step1 = max(1, chunk_elems // (max(len(coarse), 8) * (2 * qmax + 2) * 8))
        step = max(1, chunk_elems // (32 * (2 * qmax + 2) * 8))
        chunks = [slice(a, min(a + step1, N)) for a in range(0, N, step1)]
        pad = None if bool(valid.all()) else valid
        srt = _sorted_groups(flat, valid)
        # the tails' own bounds cut the candidates scored by about half; worth their cost on long rows only
        return cls(flat, valid, pad, delta, srt, srt[1].double(), ng, qmax, grid, norm, margin, split=g > 256,
                   first=min(4, grid * (qmax + 1)), coarse=coarse, chunks=chunks, step=step)


class _Pass1(NamedTuple):
    """Pass 1 of `search_qparams`, per group: the candidates scored and their scores, the coarse widths'
    squared errors and power-mean bounds for every zero point, and e0, the best score found (float64)."""
    cand: torch.Tensor                  # [N, first]
    score: torch.Tensor                 # [N, first]
    sq: torch.Tensor                    # [N, Gc, Z] float64
    table: torch.Tensor                 # [N, Gc, Z]
    e0: torch.Tensor                    # [N]


def _search_pass1(s: _Search) -> _Pass1:
    """Squared errors of every 5th width (the widest first) for every zero point, their power-mean bounds,
    and the `first` most promising candidates scored exactly: e0."""
    N, Z, first, p = len(s.flat), s.Z, s.first, s.norm
    cand0 = torch.empty(N, first, dtype=torch.long)
    score0 = torch.empty(N, first)
    sq0 = torch.empty(N, len(s.coarse), Z, dtype=torch.float64)
    table0 = torch.empty(N, len(s.coarse), Z)
    for sl in s.chunks:
        dl = s.delta[sl]
        sq = _score_bounds(tuple(t[sl] for t in s.srt), dl[:, s.coarse], s.qmax, s.norm, False, squares=True)
        sq0[sl] = sq
        b = s.n[sl, None, None].float() ** (1 - p / 2) * sq.float() ** (p / 2)                # [R, Gc, Z]
        table0[sl] = b
        R = len(b)
        top = b.reshape(R, -1).topk(first, dim=1, largest=False, sorted=False).indices
        cand = s.coarse[top // Z] * Z + top % Z
        cand0[sl] = cand
        rows0 = torch.arange(sl.start, sl.stop).repeat_interleave(first)
        score0[sl] = _score_candidates(s.flat, s.pad, rows0, dl.gather(1, cand // Z).reshape(-1),
                                       (cand % Z).float().reshape(-1), s.qmax, s.norm).reshape(R, first)
    return _Pass1(cand0, score0, sq0, table0, score0.amin(1).double())


def _in_play(s: _Search, one: _Pass1) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Which candidates [N, grid, Z] are still in play after pass 1: not ruled out by the extreme weights
    (`_extreme_bounds`, also returned, [N, grid]) nor, via the nearest coarse width on either side, by the
    squared errors' slow change with the step (`search_qparams`); and which non-coarse widths [N, grid] pass 2
    must bound. (A pruning test only, in float32: its rounding is far inside the margin.)"""
    N, Z, grid, qmax, margin, p, n, e0 = len(s.flat), s.Z, s.grid, s.qmax, s.margin, s.norm, s.n, one.e0
    Gc = len(s.coarse)
    T = ((e0 * (1 + margin)) ** (2 / p) * n ** (1 - 2 / p)).sqrt().float()[:, None, None]     # T, [N, 1, 1]
    xnorm = s.srt[3].gather(1, s.srt[1][:, None]).sqrt().float()[:, :, None]                # ||x||, [N, 1, 1]
    zp = torch.arange(Z, dtype=torch.float32)
    kmax = torch.maximum(zp, qmax - zp) * n.sqrt().float()[:, None]                         # ||k|| <= this
    reach0 = one.sq.sqrt().float().mul_(1 - margin)                                         # [N, Gc, Z]
    j = torch.arange(grid)
    left = ((j - 4).clamp(min=0) // 5).clamp(max=Gc - 1)        # the coarse width at or below j (or the first)
    right = (j // 5).clamp(max=Gc - 1)                            # at or above j
    live = torch.empty(N, grid, Z, dtype=torch.bool)
    ext = torch.empty(N, grid)
    for sl in s.chunks:
        ext[sl] = _extreme_bounds(s.flat[sl], s.valid[sl], s.delta[sl], qmax, s.norm)
        d = s.delta[sl][:, :, None]                                                          # [R, G, 1]
        knorm = torch.minimum((xnorm[sl] + T[sl]) / d, kmax[sl][:, None, :])               # [R, G, Z]
        keep = (ext[sl].double() * (1 - margin) <= e0[sl, None])[:, :, None].expand(-1, -1, Z).clone()
        for side in (left, right):
            dc = s.delta[sl][:, s.coarse[side], None]
            keep &= reach0[sl][:, side] <= (dc - d).abs_() * knorm + T[sl]
        live[sl] = keep
    live[:, s.coarse] = True          # the coarse widths have their bounds already; pass 2 takes them as they are
    need = live.any(-1)
    need[:, s.coarse] = False
    return live, ext, need


def _search_pass2(s: _Search, one: _Pass1, live: torch.Tensor, ext: torch.Tensor, need: torch.Tensor
                  ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Every candidate in play bounded in closed form (with `split`, the tighter bounds, also on the coarse
    widths still alive), each group its own widths; those whose bound does not exceed e0 are scored exactly.
    Per group: the best candidate, how many were scored, and how many widths got closed-form bounds."""
    N, Z, C, first, margin, coarse, e0 = len(s.flat), s.Z, s.C, s.first, s.margin, s.coarse, one.e0
    order = torch.sort(need.sum(1), stable=True).indices
    best = torch.empty(N, dtype=torch.long)
    scored = torch.empty(N, dtype=torch.long)
    bounded = torch.full((N,), len(coarse), dtype=torch.long)
    for a in range(0, N, s.step):
        idx = order[a:a + s.step]
        dl = s.delta[idx]
        R = len(idx)
        grp = tuple(t[idx] for t in s.srt)
        bound = torch.where(live[idx], ext[idx].double()[:, :, None], math.inf)               # [R, G, Z]
        bound[:, coarse] = torch.maximum(bound[:, coarse], one.table[idx].double())
        todo = need[idx]
        if s.split:   # straight to the tighter bounds, on the widths in play and the coarse ones still alive
            todo = todo | (bound * (1 - margin) <= e0[idx, None, None]).any(-1)
        cols = _row_lists(todo)
        if cols is not None:
            vals = _score_bounds(grp, dl.gather(1, cols), s.qmax, s.norm, s.split).double()
            bound.scatter_reduce_(1, cols[:, :, None].expand(-1, -1, Z), vals, "amax")
        bounded[idx] += todo.sum(1)
        bound = bound.reshape(R, C) * (1 - margin)
        c0, s0 = one.cand[idx], one.score[idx]
        bound.scatter_(1, c0, math.inf)
        r2, c2 = (bound <= e0[idx, None]).nonzero(as_tuple=True)
        sc = _score_candidates(s.flat, s.pad, idx[r2], dl[r2, c2 // Z], (c2 % Z).float(), s.qmax, s.norm)
        pr = torch.cat([torch.arange(R)[:, None].expand(R, first).reshape(-1), r2])
        pc, ps = torch.cat([c0.reshape(-1), c2]), torch.cat([s0.reshape(-1), sc])
        # the lowest score wins, then the lowest candidate index (the exhaustive search's order)
        low = torch.full((R,), math.inf).scatter_reduce(0, pr, ps, "amin")
        win = torch.where(ps == low[pr], pc, C)
        best[idx] = torch.full((R,), C).scatter_reduce(0, pr, win, "amin")
        scored[idx] = first + torch.bincount(r2, minlength=R)
    return best, scored, bounded
