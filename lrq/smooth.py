"""Per-input-channel smoothing scales folded into the preceding op (SmoothQuant, arXiv 2211.10438).

A group of linears reads one input x = P(h), where the producer P is a norm or another linear. For any
positive vector s,
    W x = (W diag(s)) (diag(s)^-1 x),
and the diag(s)^-1 is folded into P (a norm's weight, or P's output rows and bias), so the floating-point
model computes the same function while activation outliers move into the weights. SmoothQuant picks
    s_j = max|X_j|^alpha / max|W_j|^(1 - alpha)
from calibration activation maxima; AWQ (baselines/awq.py) searches its own s and folds it the same way.

Pairs (producer -> consumers) within a Llama/Qwen2 decoder block:
    qkv      input_layernorm          -> q_proj, k_proj, v_proj
    gate_up  post_attention_layernorm -> gate_proj, up_proj
    vo       v_proj (output rows)     -> o_proj
    up_down  up_proj (output rows)    -> down_proj
SmoothQuant's own default is the two norm pairs. Other decoders differ in two ways, both handled here:
- the norm gate/up read: Gemma 2/3 put post_attention_layernorm on the attention output before the residual
  add, and the MLP reads pre_feedforward_layernorm (`producer_name` picks the norm the block has);
- the norm's formula: y = (offset + weight) * normalised(x), offset 0 for Llama, 1 for Gemma. It is measured
  on the module itself (`norm_offset`), and dividing its outputs by s sets weight <- (offset + weight)/s - offset.
Every fold is checked numerically on the real block before a method folds (`exact_pairs`). With grouped-query attention, o_proj input channel
(h, d) of query head h reads v_proj output channel (h // rep, d), rep = query heads per KV head; a scale
for the vo pair therefore lives on v_proj's outputs and is repeated across the rep query heads for o_proj.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import torch
from torch import nn

from lrq.arch import ALT_PRODUCERS, INPUT_GROUPS, block_linears, decoder_blocks
from lrq.calibration import run_calibration
from lrq.errors import UserError

# the input groups of the block layout (lrq/arch.py), in the canonical order of the `pairs` setting
PAIRS: dict[str, tuple[str, tuple[str, ...]]] = {
    name: INPUT_GROUPS[name] for name in ("qkv", "gate_up", "vo", "up_down")}
DEFAULT_PAIRS: tuple[str, ...] = ("qkv", "gate_up")
SCALE_RANGE = (1e-5, 1e5)


def parse_pairs(pairs: str | Iterable[str]) -> tuple[str, ...]:
    """'qkv,gate_up' or an iterable of pair names -> a checked tuple in canonical order."""
    names = [p.strip() for p in (pairs.split(",") if isinstance(pairs, str) else pairs) if p.strip()]
    unknown = [p for p in names if p not in PAIRS]
    if unknown:
        raise UserError(f"unknown smoothing pair(s) {', '.join(unknown)}: choose from {', '.join(PAIRS)} "
                        f"(e.g. --set pairs=qkv,gate_up).")
    return tuple(p for p in PAIRS if p in names)


def producer_name(block: nn.Module, pair: str) -> str:
    """The producer of `pair` in this block: Gemma 2/3's MLP reads pre_feedforward_layernorm, Llama's
    post_attention_layernorm."""
    for name in ALT_PRODUCERS.get(pair, ()):
        try:
            block.get_submodule(name)
            return name
        except AttributeError:
            continue
    return PAIRS[pair][0]


def producer(block: nn.Module, pair: str) -> nn.Module:
    return block.get_submodule(producer_name(block, pair))


@torch.no_grad()
def norm_offset(norm: nn.Module) -> float:
    """c in y = (c + weight) * normalised(x) (+ bias), measured on the module: 0 for Llama's RMSNorm and
    LayerNorm, 1 for Gemma's. The norm's output with its weight set to zeros and to ones (bias zeroed), on a
    fixed random input: y0 = c n, y1 = (c + 1) n. A norm whose output is not of that form (not affine in its
    weight) is a UserError naming it; the weight and bias are restored whatever happens."""
    w = norm.weight
    bias = getattr(norm, "bias", None)
    saved = w.detach().clone(), (bias.detach().clone() if bias is not None else None)
    x = torch.randn(1, 4, w.shape[0], generator=torch.Generator().manual_seed(0)).to(w.device, w.dtype)
    try:
        if bias is not None:
            bias.zero_()
        w.zero_()
        y0 = norm(x).float()
        w.fill_(1.0)
        y1 = norm(x).float()
    finally:
        w.copy_(saved[0])
        if bias is not None:
            bias.copy_(saved[1])
    n = y1 - y0
    c = float((y0 * n).sum() / (n * n).sum().clamp(min=1e-30))
    if (y0 - c * n).abs().max() > 1e-3 * n.abs().max().clamp(min=1e-30):
        raise UserError(f"{type(norm).__name__}: its output is not (c + weight) * normalised(x), so scales cannot be "
                        f"folded into it; quantize with a method that folds nothing (rtn, gptq, lrq and flexround at "
                        f"weight-only schemes).")
    return round(c, 6)


@torch.no_grad()
def divide_norm(norm: nn.Module, s: torch.Tensor) -> None:
    """Divide a norm's outputs by s in its parameters: weight <- (c + weight)/s - c, bias <- bias/s."""
    c = norm_offset(norm)
    w = norm.weight
    w.copy_(((w.float() + c) / s.float().to(w.device) - c).to(w.dtype))
    if getattr(norm, "bias", None) is not None:
        norm.bias.div_(s.to(norm.bias.device, norm.bias.dtype))


def consumers(block: nn.Module, pair: str) -> list[nn.Module]:
    return [block.get_submodule(n) for n in PAIRS[pair][1]]


def _kv_repeat(block: nn.Module) -> tuple[int, int, int]:
    """(KV heads, query heads per KV head, head dim) of the block's attention."""
    v_name, (o_name,) = PAIRS["vo"]
    v, o = block.get_submodule(v_name), block.get_submodule(o_name)
    head_dim = getattr(block.self_attn, "head_dim", None) or block.self_attn.config.head_dim
    n_kv = v.out_features // head_dim
    rep = o.in_features // v.out_features
    if n_kv * head_dim != v.out_features or rep * v.out_features != o.in_features:
        raise UserError(f"cannot map o_proj inputs ({o.in_features}) onto v_proj outputs ({v.out_features}) "
                        f"with head_dim {head_dim}: smooth without the 'vo' pair.")
    return n_kv, rep, head_dim


def to_producer_space(block: nn.Module, pair: str, t: torch.Tensor, reduce: str = "amax") -> torch.Tensor:
    """A per-consumer-input-channel vector reduced onto the producer's output channels (differs only for vo)."""
    if pair != "vo":
        return t
    n_kv, rep, hd = _kv_repeat(block)
    t = t.reshape(n_kv, rep, hd)
    return (t.amax(dim=1) if reduce == "amax" else t.mean(dim=1)).reshape(-1)


def to_consumer_space(block: nn.Module, pair: str, s: torch.Tensor) -> torch.Tensor:
    """A per-producer-output-channel scale repeated onto the consumers' input channels (differs only for vo)."""
    if pair != "vo":
        return s
    n_kv, rep, hd = _kv_repeat(block)
    return s.reshape(n_kv, 1, hd).expand(n_kv, rep, hd).reshape(-1)


def consumer_weight_absmax(block: nn.Module, pair: str) -> torch.Tensor:
    """max |W_j| over every consumer row, per producer channel j."""
    w = torch.cat([m.weight.detach().float() for m in consumers(block, pair)], dim=0)
    return to_producer_space(block, pair, w.abs().amax(dim=0), "amax")


@torch.no_grad()
def fold_scales(block: nn.Module, pair: str, s: torch.Tensor) -> None:
    """Divide the producer's outputs by s and multiply the consumers' input columns by s (FP output unchanged)."""
    prod = producer(block, pair)
    s = s.detach().float().to(prod.weight.device)
    if isinstance(prod, nn.Linear):
        prod.weight.div_(s.view(-1, 1).to(prod.weight.dtype))
        if prod.bias is not None:
            prod.bias.div_(s.to(prod.bias.dtype))
    else:  # a norm: y = (c + weight) * normalised(x) (+ bias)
        divide_norm(prod, s)
    s_in = to_consumer_space(block, pair, s)
    for m in consumers(block, pair):
        m.weight.mul_(s_in.view(1, -1).to(m.weight.dtype))


#: the most a folded scale may change a floating-point block's output (max |difference| / max |output|, float32):
#: an exact fold changes it by rounding only (about 1e-7); a fold into a norm whose formula was misread or into a
#: producer its consumers do not read changes it by far more
FOLD_TOLERANCE = 1e-4


def _float_block(block: nn.Module) -> nn.Module:
    """The block itself when it computes in float32, else a float32 copy (the fold check's arithmetic)."""
    import copy
    return block if all(p.dtype == torch.float32 for p in block.parameters()) else copy.deepcopy(block).float()


def _output(block: nn.Module, x: torch.Tensor, kwargs: dict) -> torch.Tensor:
    dev = next(block.parameters()).device
    with torch.autocast(dev.type, enabled=False):
        o = block(x.to(dev).float(), **kwargs)
    return o[0] if isinstance(o, tuple) else o


@torch.no_grad()
def fold_error(block: nn.Module, pair: str, x: torch.Tensor, kwargs: dict,
               ref: torch.Tensor | None = None) -> float:
    """How much folding a random positive scale (0.5-2) for `pair` changes the floating-point block's output on
    the hidden states `x` (relative to the output's largest value), in float32: the numerical check that the
    fold is exact in this block, whatever its architecture. `ref`: the block's own output on `x` in float32,
    when the caller has it already. The block itself is left as it was."""
    import copy
    base = _float_block(block)
    if ref is None:
        ref = _output(base, x, kwargs)
    n = producer(block, pair).weight.shape[0]
    s = torch.empty(n).uniform_(0.5, 2.0, generator=torch.Generator().manual_seed(0))
    probe = copy.deepcopy(base)
    fold_scales(probe, pair, s)
    got = _output(probe, x, kwargs)
    return float((got - ref).abs().max() / ref.abs().max().clamp(min=1e-12))


def exact_pairs(block: nn.Module, pairs: Sequence[str], x: torch.Tensor, kwargs: dict, method: str,
                index: int | None = None) -> tuple[list[str], dict[str, float]]:
    """The pairs whose fold is exact in this block (fold_error within FOLD_TOLERANCE), and every pair's error.
    A method folds only those; the others are left unscaled (a warning names them). None exact is a UserError:
    the method would do nothing of its own, and a fold that changed the floating-point model would make every
    number after it wrong (never stored)."""
    base = _float_block(block)
    ref = _output(base, x, kwargs)          # the block's own output, once for every pair
    errors = {p: fold_error(base, p, x, kwargs, ref) for p in pairs}
    ok = [p for p in pairs if errors[p] <= FOLD_TOLERANCE]
    bad = {p: e for p, e in errors.items() if p not in ok}
    where = f"block {index}" if index is not None else "a block"
    text = "; ".join(f"pair {p} (scales divided out of {producer_name(block, p)}, into {', '.join(PAIRS[p][1])}): the FP "
                     f"output changes by {e:.3g} of its largest value" for p, e in bad.items())
    if bad and not ok:
        raise UserError(f"{method}: folding its scales would change the floating-point model in {where} ({text}; "
                        f"an exact fold changes it by less than {FOLD_TOLERANCE:g}). This architecture's norms or "
                        f"layer order do not match the fold's assumption (y = (c + weight) * normalised(x), read "
                        f"directly by the consumers). Quantize it with a method that folds nothing (rtn, gptq, lrq and "
                        f"flexround at weight-only schemes), or name pairs that fold exactly (--set pairs=...). "
                        f"Nothing was stored.")
    if bad:
        import logging
        logging.getLogger("lrq").warning("%s: %s: not folded, the fold is not exact here (%s); folded: %s",
                                         method, where, text, ", ".join(ok))
    return ok, errors


def fold_stats(asked: Sequence[str], ok: Sequence[str], errors: dict[str, float]) -> dict[str, float]:
    """What a folding method records about the check: the largest error among the pairs it folded, and how many
    of the pairs it was asked for it left unfolded."""
    return {"fold_check_max_error": max((errors[p] for p in ok), default=0.0),
            "fold_pairs_skipped": float(len(asked) - len(ok))}


def merge_fold_stats(per_block: Sequence[dict]) -> dict[str, float]:
    """A model's fold figures from its blocks' (`fold_stats`): the largest error folded anywhere, the most pairs
    skipped in a block; empty when no block recorded any."""
    got = [b for b in per_block if "fold_check_max_error" in b]
    if not got:
        return {}
    return {"fold_check_max_error": max(b["fold_check_max_error"] for b in got),
            "fold_pairs_skipped": max(b["fold_pairs_skipped"] for b in got)}


@torch.no_grad()
def check_model_folds(model: nn.Module, pairs: Sequence[str], input_ids: torch.Tensor, method: str,
                      tokens: int = 16) -> tuple[list[str], float]:
    """`exact_pairs` on every block of the model, with each block's own arguments and its real inputs on the
    first `tokens` tokens of the first calibration window: the pairs exact in every block, and the largest
    error among them."""
    from lrq.blockwise import capture_block_inputs, run_block
    buf, per_layer = capture_block_inputs(model, input_ids[:1, :tokens])
    x = buf.data[:].clone()
    ok, worst = list(pairs), {}
    for i, block in enumerate(decoder_blocks(model)):
        ok_i, err = exact_pairs(block, ok, x, per_layer[i], method, i)
        ok = [p for p in ok if p in ok_i]
        worst = {p: max(worst.get(p, 0.0), err[p]) for p in ok}
        x = run_block(block, x, per_layer[i])
    return ok, fold_stats(pairs, ok, worst)["fold_check_max_error"]


def smoothing_scales(act_absmax: torch.Tensor, weight_absmax: torch.Tensor, alpha: float) -> torch.Tensor:
    """s_j = max|X_j|^alpha / max|W_j|^(1-alpha); 1 where a channel never fires or has no weight."""
    a, w = act_absmax.float(), weight_absmax.float().to(act_absmax.device)
    s = a.clamp(min=SCALE_RANGE[0]).pow(alpha) / w.clamp(min=SCALE_RANGE[0]).pow(1 - alpha)
    s = torch.where((a > 0) & (w > 0), s, torch.ones_like(s))
    return s.clamp(*SCALE_RANGE)


@torch.no_grad()
def activation_absmax(model: nn.Module, input_ids: torch.Tensor, batch_size: int = 8) -> list[dict[str, torch.Tensor]]:
    """Per block, per linear: max |x_j| over every calibration token of the linear's input channel j.

    One forward pass of the whole model with hooks on the block linears (at the run's precision, as calibration
    and evaluation run), in the model's current state.
    """
    stats: list[dict[str, torch.Tensor]] = [{} for _ in decoder_blocks(model)]
    handles = []

    def hook(i: int, name: str):
        def fn(module, args):
            x = args[0].detach().reshape(-1, args[0].shape[-1]).abs().amax(dim=0).float().cpu()
            prev = stats[i].get(name)
            stats[i][name] = x if prev is None else torch.maximum(prev, x)
        return fn

    for i, block in enumerate(decoder_blocks(model)):
        for name, lin in block_linears(block).items():
            handles.append(lin.register_forward_pre_hook(hook(i, name)))
    try:
        run_calibration(model, input_ids, desc="activation maxima", batch_size=batch_size)
    finally:
        for h in handles:
            h.remove()
    return stats


@torch.no_grad()
def apply_smoothing(model: nn.Module, absmax: Sequence[dict[str, torch.Tensor]], alpha: float,
                    pairs: Sequence[str] = DEFAULT_PAIRS) -> dict[str, float]:
    """Fold SmoothQuant scales into every block for the given pairs; returns summary statistics."""
    pairs = parse_pairs(pairs)
    if not 0.0 <= alpha <= 1.0:
        raise UserError(f"smoothing strength alpha={alpha} is outside [0, 1] (SmoothQuant uses 0.5; LRQ's W8A8 0.8).")
    log_s = []
    for block, acts in zip(decoder_blocks(model), absmax):
        for pair in pairs:
            first_consumer = PAIRS[pair][1][0]
            a = to_producer_space(block, pair, acts[first_consumer], "amax")
            s = smoothing_scales(a, consumer_weight_absmax(block, pair), alpha)
            fold_scales(block, pair, s)
            log_s.append(s.log10().abs().mean().item())
    return {"smoothed_pairs": len(log_s),
            "smooth_mean_abs_log10_scale": sum(log_s) / len(log_s) if log_s else 0.0}


def smooth_model(model: nn.Module, input_ids: torch.Tensor, alpha: float,
                 pairs: str | Sequence[str] = DEFAULT_PAIRS) -> dict[str, float]:
    """SmoothQuant as a pre-step on a floating-point model: calibration maxima, then fold the scales.

    Leaves nn.Linear modules in place (the FP function is unchanged); any method quantizes afterwards.
    """
    asked = parse_pairs(pairs)
    pairs, worst = check_model_folds(model, asked, input_ids, "smoothing")   # exact folds only, checked first
    return (apply_smoothing(model, activation_absmax(model, input_ids), alpha, pairs)
            | fold_stats(asked, pairs, {p: worst for p in pairs}))
