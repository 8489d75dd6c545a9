"""Quantizer primitives: pure functions on tensors, shared by every method, module and kernel.

Conventions (METHOD.md section 1 and 4):
- weights are quantized asymmetrically per output row, optionally in groups of `group_size` consecutive
  input columns; a ragged last group is narrower (576 = 4 x 128 + 64), never straddling two rows;
- stored integers are unsigned levels q in [0, 2^b - 1]; w_hat = (q - z) * s, z an integer per row/group.
  This is the same grid as METHOD.md's W_int = clamp(round(W/s), -z, 2^b-1-z), w_hat = W_int * s, with q = W_int + z;
- scales and zero points have shape [rows, n_groups] (n_groups = 1 for per-channel).
"""

from __future__ import annotations

import math

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


def per_token_fake_quant(x: torch.Tensor, bits: int = 8) -> torch.Tensor:
    """Dynamic asymmetric fake quantization with one scale/zero per token (last dimension).

    scale = max((max(t) - min(t)) / (2^b - 1), 1e-8), z = clamp(round(-min(t) / scale), 0, 2^b - 1),
    as in the authors' code, with the range widened to include 0 (min <= 0 <= max). That changes nothing
    for mixed-sign tokens (every real activation row) and keeps one-signed or constant tokens on the grid
    instead of clamping them.
    """
    qmax = 2**bits - 1
    xf = x.float()
    lo = xf.amin(dim=-1, keepdim=True).clamp(max=0)
    hi = xf.amax(dim=-1, keepdim=True).clamp(min=0)
    scale = ((hi - lo) / qmax).clamp(min=SCALE_EPS).detach()
    zero = torch.round(-lo / scale).clamp(0, qmax).detach()
    q = torch.clamp(round_ste(xf / scale) + zero, 0, qmax)
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


def _search_groups(w: torch.Tensor, group_size: int | None):
    """Rows/groups of `w` as [N, g] float32 (padding 0), the valid mask, and each group's lo <= 0 <= hi."""
    rows = w.shape[0]
    wg = _group_view(w.float(), group_size, math.nan)            # [rows, ng, g], NaN = padding
    ng, g = wg.shape[1], wg.shape[2]
    flat = wg.reshape(rows * ng, g)
    valid = ~torch.isnan(flat)
    flat = torch.nan_to_num(flat, nan=0.0)
    lo = torch.where(valid, flat, torch.full_like(flat, math.inf)).amin(-1).clamp(max=0)
    hi = torch.where(valid, flat, torch.full_like(flat, -math.inf)).amax(-1).clamp(min=0)
    return flat, valid, lo, hi, ng


def _search_error(x: torch.Tensor, valid: torch.Tensor, delta: torch.Tensor, zp: torch.Tensor, qmax: int,
                  norm: float) -> torch.Tensor:
    """The search's score sum |W - W_hat|^norm, float32, for x [R, 1, g] against candidates delta/zp [R, C, 1].

    Both searches score with exactly these float32 operations, so their scores agree to the last bit.
    """
    q = torch.clamp(torch.round(x / delta) + zp, 0, qmax)
    err = ((q - zp) * delta - x).abs().pow(norm)
    return torch.where(valid, err, 0).sum(-1)


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
    xs = torch.where(valid, x.float(), math.inf).sort(-1).values
    xz = torch.where(torch.arange(g)[None, :] < n[:, None], xs.double(), 0.0)
    zero_col = torch.zeros(R, 1, dtype=torch.float64)
    return xs, n, torch.cat([zero_col, xz.cumsum(-1)], 1), torch.cat([zero_col, (xz * xz).cumsum(-1)], 1)


def _score_bounds(groups: tuple, delta: torch.Tensor, qmax: int, norm: float, split: bool = True) -> torch.Tensor:
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
    even), which with float64 rounding is what the caller's margin absorbs.
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
        return nt.float() ** (1 - e) * (low + mid + up).clamp_(min=0).float() ** e
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


def search_qparams(w: torch.Tensor, bits: int, group_size: int | None = None, grid: int = 100,
                   norm: float = 2.4, chunk_elems: int = 2**22, margin: float = 1e-2,
                   stats: dict | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Clipping search for per-row (or per-group) scale and zero point (METHOD.md section 3).

    The same search as `search_qparams_exhaustive` (same candidates, same float32 scores, same tie rule,
    hence the same scales and zero points, which equal the authors'), without scoring every candidate.
    For norm >= 2 a candidate's score has lower bounds that cost far less than the score: from its squared
    (and absolute) errors, closed-form for all zero points of a width from one sort of the group
    (`_score_bounds`), and, cheaper still, from the group's extreme weights alone (`_extreme_bounds`).
    Pass 1 bounds every 5th width in closed form and scores its 8 most promising candidates exactly: e0,
    an upper bound on the group's best score. Pass 2 computes the closed-form bounds of the widths whose
    extremes bound does not already exceed e0 (groups needing as many widths are batched together) and
    scores every candidate whose bound, less a `margin` for rounding, does not exceed e0. No other candidate
    can reach e0, so none can win or tie. On the default model's weights about 20-30 of the 1,600 (4-bit)
    candidates per row or group are scored.
    Norms below 2 (no such bound) and non-finite weights use the exhaustive search. `stats`, when given,
    receives "candidates" (per group) and "scored" (a tensor: how many were scored in each group).
    """
    check_bits(bits)
    if norm < 2 or not torch.isfinite(w).all():
        if stats is not None:
            stats.update(candidates=grid * 2**bits, scored=None)
        return search_qparams_exhaustive(w, bits, group_size, grid, norm)
    rows = w.shape[0]
    qmax = 2**bits - 1
    Z = qmax + 1
    C = grid * Z                                          # candidates per group, index (i - 1) * Z + zp
    flat, valid, lo, hi, ng = _search_groups(w, group_size)
    N, g = flat.shape
    width = hi - lo
    # every candidate step, with exactly the exhaustive search's float32 operations
    delta = torch.stack([(width * i / grid / qmax).clamp(min=SCALE_EPS) for i in range(1, grid + 1)], dim=1)
    # the tails' own bounds cut the candidates scored by about half; worth their cost on long rows only
    split = g > 256
    first = min(8, C)
    step = max(1, min(chunk_elems // (grid * (2 * qmax + 2) * 8), chunk_elems // (first * g)))
    chunks = [slice(a, min(a + step, N)) for a in range(0, N, step)]
    # Pass 1: the closed-form bounds on every 5th width (the widest first); the `first` best of those
    # candidates are scored exactly: an upper bound e0 on every group's best score.
    coarse = torch.arange(grid - 1, -1, -5).flip(0)
    Gc = len(coarse)
    cand0 = torch.empty(N, first, dtype=torch.long)
    score0 = torch.empty(N, first)
    table0 = torch.empty(N, Gc, Z)
    srt = _sorted_groups(flat, valid)
    for sl in chunks:
        x, m, dl = flat[sl], valid[sl], delta[sl]
        b = _score_bounds(tuple(t[sl] for t in srt), dl[:, coarse], qmax, norm, split)        # [R, Gc, Z]
        table0[sl] = b
        top = b.reshape(len(x), -1).topk(first, dim=1, largest=False, sorted=False).indices
        cand = coarse[top // Z] * Z + top % Z
        cand0[sl] = cand
        score0[sl] = _search_error(x[:, None, :], m[:, None, :], dl.gather(1, cand // Z)[..., None],
                                   (cand % Z).float()[..., None], qmax, norm)
    e0 = score0.amin(1)
    # Which widths can still beat e0, by the cheap bound from the extreme weights; groups that need as many
    # widths go together, so pass 2 computes the closed-form bounds of few widths per group.
    ext = torch.empty(N, grid)
    for sl in chunks:
        ext[sl] = _extreme_bounds(flat[sl], valid[sl], delta[sl], qmax, norm)
    need = ext.double() * (1 - margin) <= e0[:, None].double()
    need[:, coarse] = False
    order = torch.sort(need.sum(1), stable=True).indices
    best = torch.empty(N, dtype=torch.long)
    scored = torch.empty(N, dtype=torch.long)
    # Pass 2: every candidate bounded (closed form where computed, else its width's extremes bound); those
    # whose bound does not exceed e0 are scored exactly.
    for a in range(0, N, step):
        idx = order[a:a + step]
        x, m, dl = flat[idx], valid[idx], delta[idx]
        R = len(idx)
        bound = ext[idx].double()[:, :, None].repeat(1, 1, Z)                                  # [R, G, Z]
        bound[:, coarse] = torch.maximum(bound[:, coarse], table0[idx].double())
        extra = need[idx].any(0).nonzero().squeeze(1)
        if extra.numel():
            bound[:, extra] = torch.maximum(bound[:, extra], _score_bounds(
                tuple(t[idx] for t in srt), dl[:, extra], qmax, norm, split).double())
        bound = bound.reshape(R, C) * (1 - margin)
        c0, s0 = cand0[idx], score0[idx]
        bound.scatter_(1, c0, math.inf)
        r2, c2 = (bound <= e0[idx, None].double()).nonzero(as_tuple=True)
        pr = [torch.arange(R)[:, None].expand(R, first).reshape(-1)]
        pc, ps = [c0.reshape(-1)], [s0.reshape(-1)]
        per = max(2, chunk_elems // g)
        for b in range(0, r2.numel(), per):
            rr, cc = r2[b:b + per], c2[b:b + per]
            if rr.numel() == 1:  # a single output would let torch split the sum across threads: keep >= 2
                rr, cc = rr.repeat(2), cc.repeat(2)
            sc = _search_error(x[rr][:, None, :], m[rr][:, None, :], dl[rr, cc // Z][:, None, None],
                               (cc % Z).float()[:, None, None], qmax, norm)[:, 0]
            pr.append(rr), pc.append(cc), ps.append(sc)
        pr, pc, ps = torch.cat(pr), torch.cat(pc), torch.cat(ps)
        # the lowest score wins, then the lowest candidate index (the exhaustive search's order)
        low = torch.full((R,), math.inf).scatter_reduce(0, pr, ps, "amin")
        win = torch.where(ps == low[pr], pc, C)
        best[idx] = torch.full((R,), C).scatter_reduce(0, pr, win, "amin")
        scored[idx] = first + torch.bincount(r2, minlength=R)
    if stats is not None:
        stats.update(candidates=C, scored=scored)
    scale = delta.gather(1, (best // Z)[:, None])[:, 0]
    return scale.reshape(rows, ng), (best % Z).float().reshape(rows, ng)
