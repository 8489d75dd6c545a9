"""AWQ (Lin et al., MLSys 2024, arXiv 2306.00978): activation-aware weight scaling, then clipping.

Salient weight channels are those fed by large activations. Scaling input channel j of a weight by
s_j > 1 (and the input by 1/s_j, folded into the preceding op) shrinks that channel's relative rounding
error. Per decoder block, for every group of linears that share an input:
    qkv      input_layernorm          -> q/k/v,    objective: self_attn output
    vo       v_proj rows              -> o_proj,   objective: o_proj output
    gate_up  post_attention_layernorm -> gate/up,  objective: mlp output (Gemma: pre_feedforward_layernorm)
    up_down  up_proj rows             -> down_proj, objective: down_proj output
search s = mean|x|^ratio over a grid of `n_grid` ratios in [0, 1), normalised by sqrt(max(s) min(s)),
quantize W diag(s) round-to-nearest on the scheme's grid, and keep the ratio whose inspected output is
closest (MSE) to the floating-point output. Ratio 0 is s = 1, plain RTN, so the chosen scale is never
worse than no scaling on this objective. Scales are searched on the unscaled block, then all folded
(lrq.smooth.fold_scales). Then, per linear except q/k (their outputs pass through softmax, as in the
paper's code), the clipping search: shrink each row's (or group's) max |w| by 0..max_shrink in steps of
1/clip_grid, clamp, quantize, and keep the shrink with the smallest error of that row's (group's) partial
output on `clip_tokens` calibration tokens. Finally every linear becomes a round-to-nearest QuantLinear.

Choices and deviations, with reasons:
- scales from the input only (s = x_mean^ratio, the paper's formulation and its reference code);
  AutoAWQ's "duo scaling" (also dividing by a weight statistic) is not used; llm-compressor's AWQ with
  duo scaling off is the LANDSCAPE.md reference (28.12 at W4 g128).
- v -> o with grouped-query attention: the reference code only scales v -> o when v_proj and o_proj have
  the same shape. Here it is done exactly for GQA too: one scale per v_proj output channel, repeated
  across the query heads that read it (config `scale_vo`).
- block inputs come from the already-quantized earlier blocks (lrq.blockwise.walk_blocks), as for GPTQ
  (`chain="quantized"`); the reference code and llm-compressor feed the scaled (and clipped), still
  floating-point blocks forward, and quantize every linear at the end (`chain="float"`).
- the scale grid is ratio = i / n_grid, i = 0..n_grid-1 (`grid="open"`, 0 to 0.95, the reference
  code's); llm-compressor's is i / (n_grid - 1), 0 to 1 inclusive (`grid="closed"`).
- `n_samples` calibration sequences are used (the paper: 128 x 512 tokens; static activation ranges
  always use the full calibration set). The scale search runs every inspected module 20 times over
  them, which on 2 CPU cores is most of the cost; the quick preset walks 32 sequences and measures the
  token-wise objectives (o_proj, mlp, down_proj outputs) on `search_tokens` = 4096 evenly spaced tokens
  (mean|x| still comes from every token; the attention objective needs whole sequences and uses all
  32). The paper preset uses everything.
- block forwards run under bf16 autocast (`bf16`) where the run's precision is bf16 (lrq.precision; float32
  on a CPU without native bf16), as evaluation does; so does the scale search when
  weights have 4 bits or fewer (bf16 rounding is then far below the quantization error it is compared
  against); 8-bit searches, where the two are of the same size, run in fp32.
- the clipping error is computed with batched matrix products instead of the reference's broadcast
  product; ragged last groups are zero-padded (adds nothing to a partial output).
Activation quantizers stay off while weights are chosen; static ranges are calibrated afterwards.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

import torch
from torch import nn

from lrq import precision
from lrq.arch import INPUT_GROUPS, QK_LINEARS, block_linears, decoder_blocks, group_scope, set_submodule
from lrq.blockwise import BlockContext, method_checkpoint, run_block, walk_blocks, walk_time_stats
from lrq.calibration import calibrate_static_activations
from lrq.errors import UserError
from lrq.config import MethodConfig, setting
from lrq.methods import Calibration, Method, add_work, register
from lrq.qlinear import QuantLinear
from lrq.quant import expand_groups, fake_quant, group_min_max, minmax_qparams, n_groups
from lrq.quantize_model import quant_linear_for, quantized_block_restorer
from lrq.schemes import Scheme
from lrq.smooth import PAIRS, exact_pairs, fold_stats, merge_fold_stats, consumers, fold_scales, to_consumer_space, to_producer_space

# pair -> module whose output measures the scale's effect (its input is the pair's shared input)
INSPECT = {g: group_scope(g) for g in INPUT_GROUPS}   # qkv: self_attn, vo: o_proj, gate_up: mlp, up_down: down_proj
NO_CLIP = QK_LINEARS
@dataclass(frozen=True, eq=False)
class AWQConfig(MethodConfig):
    """AWQ's settings (the reference implementation's defaults; quick: fewer windows and search tokens)."""
    n_grid: int = setting(20, lo=1)                # scale exponents tried per pair
    grid: Literal["open", "closed"] = "open"       # open: alpha in [0, 1) as the reference; closed: [0, 1]
    scale_vo: bool = True                          # also scale v_proj -> o_proj
    clip: bool = True                              # the weight-clipping search after scaling
    clip_grid: int = setting(20, lo=1)
    max_shrink: float = setting(0.5, lo=0, hi=1)
    clip_tokens: int = setting(512, lo=1)
    n_samples: int = setting(128, lo=1)            # calibration windows used
    search_tokens: int = setting(0, lo=0)          # tokens the scale search scores (0: all)
    bf16: bool = True
    batch_size: int = setting(8, lo=1)
    chain: Literal["quantized", "float"] = "quantized"   # the next block's inputs: quantized or FP blocks


def rtn(w: torch.Tensor, scheme: Scheme) -> torch.Tensor:
    """Round-to-nearest on the scheme's min/max grid (what the final QuantLinear stores)."""
    return fake_quant(w, *minmax_qparams(w, scheme.w_bits, scheme.group_size), scheme.w_bits, scheme.group_size)


class Captured:
    """A module's input over a run (concatenated on the batch axis) and how it was called, to re-run it."""

    def __init__(self):
        self.chunks: list[torch.Tensor] = []
        self.rest: tuple = ()
        self.kwargs: dict | None = None
        self.by_name = False

    def hook(self, module, args, kwargs):
        self.by_name = not args
        x = kwargs["hidden_states"] if self.by_name else args[0]
        self.chunks.append(x.detach().float().cpu())
        if self.kwargs is None:
            self.rest = args[1:]
            self.kwargs = {k: v for k, v in kwargs.items() if k != "hidden_states"}

    @property
    def x(self) -> torch.Tensor:
        if len(self.chunks) > 1:
            self.chunks = [torch.cat(self.chunks)]
        return self.chunks[0]

    def call(self, module: nn.Module, x: torch.Tensor) -> torch.Tensor:
        out = module(hidden_states=x, **self.kwargs) if self.by_name else module(x, *self.rest, **self.kwargs)
        return out[0] if isinstance(out, tuple) else out


@torch.no_grad()
def capture(block: nn.Module, inputs: torch.Tensor, kwargs: dict, names: list[str], batch_size: int,
            bf16: bool = False) -> dict[str, Captured]:
    """Inputs (and call arguments) of the named sub-modules while `block` runs on `inputs`."""
    torch.clear_autocast_cache()  # weights may have changed since an enclosing autocast region cached them
    caps = {n: Captured() for n in names}
    handles = [block.get_submodule(n).register_forward_pre_hook(caps[n].hook, with_kwargs=True) for n in names]
    try:
        run_block(block, inputs, kwargs, batch_size=batch_size, autocast=bf16)
    finally:
        for h in handles:
            h.remove()
    return caps


@torch.no_grad()
def run_module(cap: Captured, module: nn.Module, x: torch.Tensor, batch_size: int, bf16: bool) -> torch.Tensor:
    """`module` on x in batches. Autocast's weight cache is off: the searches change weights between calls
    (a cached bf16 copy would hide the candidate weights until the outermost autocast region ends)."""
    device = next(module.parameters()).device
    with precision.autocast(device, enabled=bf16, cache_enabled=False):
        return torch.cat([cap.call(module, x[i:i + batch_size].to(device)).float().cpu()
                          for i in range(0, x.shape[0], batch_size)])


def token_sample(x: torch.Tensor, n: int) -> torch.Tensor:
    """Up to n evenly spaced token rows of x [..., cols]."""
    x = x.reshape(-1, x.shape[-1])
    return x[::max(1, x.shape[0] // n)][:n]


@dataclass
class ScaleSearch:
    scale: torch.Tensor       # best s on the producer's output channels
    ratio: float
    losses: list[float]       # output MSE per grid ratio; losses[0] is s = 1 (plain RTN)


def grid_ratios(n_grid: int, grid: str = "open") -> list[float]:
    """The ratios tried: i / n_grid ("open": 0 .. (n-1)/n) or i / (n_grid - 1) ("closed": 0 .. 1)."""
    if n_grid < 1 or (grid == "closed" and n_grid < 2):
        raise UserError(f"awq: n_grid={n_grid} is too small for a {grid} grid: use at least 2.")
    return [i / (n_grid - 1 if grid == "closed" else n_grid) for i in range(n_grid)]


@torch.no_grad()
def search_scale(block: nn.Module, pair: str, cap: Captured, scheme: Scheme, n_grid: int = 20,
                 batch_size: int = 8, bf16: bool = False, search_tokens: int = 0,
                 grid: str = "open") -> ScaleSearch:
    """AWQ's grid search of s = mean|x|^ratio for one pair; the block is left as it was.

    mean|x| comes from every captured token; with `search_tokens` > 0, the loss of a token-wise
    objective (every pair but qkv, whose objective is attention) is measured on that many evenly
    spaced tokens.
    """
    module = block.get_submodule(INSPECT[pair])
    x = cap.x
    x_mean = to_producer_space(block, pair, x.reshape(-1, x.shape[-1]).abs().mean(dim=0), "mean")
    if search_tokens and pair != "qkv":
        x = token_sample(x, search_tokens)[None]
    fp_out = run_module(cap, module, x, batch_size, bf16)
    linears = consumers(block, pair)
    originals = [m.weight.data.clone() for m in linears]
    best, losses = None, []
    try:
        for ratio in grid_ratios(n_grid, grid):
            s = x_mean.pow(ratio).clamp(min=1e-4)
            s = s / (s.max() * s.min()).sqrt()
            s_in = to_consumer_space(block, pair, s).view(1, -1)
            for m, w in zip(linears, originals):
                m.weight.data = (rtn(w.float() * s_in.to(w.device), scheme) / s_in.to(w.device)).to(w.dtype)
            loss = (run_module(cap, module, x, batch_size, bf16) - fp_out).pow(2).mean().item()
            losses.append(loss)
            if best is None or loss < best.losses[0]:
                best = ScaleSearch(s, ratio, [loss])
    finally:
        for m, w in zip(linears, originals):
            m.weight.data = w
    return ScaleSearch(best.scale, best.ratio, losses)


@torch.no_grad()
def search_clip(w: torch.Tensor, x: torch.Tensor, scheme: Scheme, clip_grid: int = 20,
                max_shrink: float = 0.5) -> torch.Tensor:
    """Per row (and group) max |w| to clamp to, minimising the error of the row's partial outputs on x.

    w [rows, cols], x [tokens, cols]; returns [rows, n_groups]. Shrink 0 (no clipping) is in the grid.
    """
    rows, cols = w.shape
    gs = scheme.group_size or cols
    ng = n_groups(cols, scheme.group_size)
    pad = ng * gs - cols

    def partial_out(m: torch.Tensor) -> torch.Tensor:  # [ng, tokens, rows]: each group's share of x m^T
        mg = nn.functional.pad(m, (0, pad)).reshape(rows, ng, gs).permute(1, 2, 0)
        return torch.bmm(xg, mg)

    w = w.float()
    xg = nn.functional.pad(x.float(), (0, pad)).reshape(-1, ng, gs).transpose(0, 1)
    ref = partial_out(w)
    absmax = nn.functional.pad(w.abs(), (0, pad)).reshape(rows, ng, gs).amax(dim=-1)
    best_max, best_err = absmax.clone(), torch.full_like(absmax, float("inf"))
    for i in range(int(max_shrink * clip_grid)):
        max_val = absmax * (1 - i / clip_grid)
        m = expand_groups(max_val, scheme.group_size, cols)
        err = (partial_out(rtn(torch.maximum(torch.minimum(w, m), -m), scheme)) - ref).pow(2).mean(dim=1).T
        better = err < best_err
        best_err = torch.where(better, err, best_err)
        best_max = torch.where(better, max_val, best_max)
    return best_max


def clip_weight(w: torch.Tensor, max_val: torch.Tensor, group_size: int | None) -> torch.Tensor:
    m = expand_groups(max_val, group_size, w.shape[1]).to(w.dtype)
    return torch.maximum(torch.minimum(w, m), -m)


@torch.no_grad()
def awq_block(block: nn.Module, inputs: torch.Tensor, kwargs: dict, scheme: Scheme, config: dict[str, Any],
              stats: dict) -> None:
    """Search and fold the scales, then search and apply the clipping, all in floating point.

    Forwards run under bf16 autocast when config.bf16; the scale search too if weights have <= 4 bits.
    """
    pairs = [p for p in PAIRS if p != "vo" or config.scale_vo]
    bs, bf16 = config.batch_size, config.bf16
    # only folds exact in this block (its architecture), checked on its first input window before any search
    asked = pairs
    pairs, errors = exact_pairs(block, asked, inputs[:1], kwargs, "awq")
    stats.update(fold_stats(asked, pairs, errors))
    caps = capture(block, inputs, kwargs, [INSPECT[p] for p in pairs], bs, bf16)
    found = {p: search_scale(block, p, caps[INSPECT[p]], scheme, config.n_grid, bs,
                             bf16 and scheme.w_bits <= 4, config.search_tokens, config.grid)
             for p in pairs}
    for p, res in found.items():
        fold_scales(block, p, res.scale)
        caps[INSPECT[p]].x.div_(to_consumer_space(block, p, res.scale))
    stats["ratios"] = [res.ratio for res in found.values()]
    stats["loss_vs_rtn"] = [min(res.losses) / max(res.losses[0], 1e-30) for res in found.values()]
    if not config.clip:
        return
    shrink = []
    for p in ("qkv", "vo", "gate_up", "up_down"):
        x = caps.get(INSPECT[p])
        names = PAIRS[p][1]
        if x is None:  # vo not scaled: o_proj's input was not captured above
            x = capture(block, inputs, kwargs, [names[0]], bs, bf16)[names[0]]
        x = token_sample(x.x, config.clip_tokens).to(block.get_submodule(names[0]).weight.device)
        for name in names:
            if name in NO_CLIP:
                continue
            lin = block.get_submodule(name)
            w = lin.weight.data
            max_val = search_clip(w, x, scheme, config.clip_grid, config.max_shrink)
            lo, hi = group_min_max(w, scheme.group_size)
            absmax = torch.maximum(-lo, hi)
            shrink.append((1 - max_val / absmax.clamp(min=1e-12)).mean().item())
            lin.weight.data = clip_weight(w, max_val, scheme.group_size)
    stats["clip_shrink"] = sum(shrink) / len(shrink)


@register
class AWQ(Method):
    name = "awq"
    summary = "AWQ: activation-aware per-channel scale search folded into the preceding op, then clipping, RTN"
    settings = AWQConfig
    presets = {"quick": AWQConfig(n_samples=32, search_tokens=4096), "paper": AWQConfig()}
    cost_rank = 5
    blockwise = True
    probe_walk = True     # activation scales and the scale search walked per block: priced at the model's widths
    checkpoints = True    # resumes at its next block (a long cell is hours on a CPU)

    def needs_calibration(self, scheme: Scheme) -> bool:
        return True

    def work(self, shape, scheme, cfg, n, seq):
        """Per block: two forwards of the search samples, n_grid candidate forwards, the clipping grid."""
        L = shape.layers
        ns = min(cfg.n_samples, n)
        st = min(cfg.search_tokens or ns * seq, ns * seq)
        clip = sum(cfg.clip_grid * 2.0 * b * a * cfg.clip_tokens for a, b in shape.linears())
        return add_work(super().work(shape, scheme, cfg, n, seq), "awq", L,
                        L * (2 * shape.block_fwd_flops(ns * seq, seq)
                             + cfg.n_grid * shape.block_fwd_flops(st, seq) + clip))

    def profile(self, run, shape, scheme, n, seq, steps=6):
        t, c = run()
        return {"awq": (*self.work(shape, scheme, c, n, seq)["awq"], t)}

    def extra_memory(self, shape, tokens: int = 0) -> int:
        """At a block's peak, float32 over every calibration token: the captured inputs of the four searched
        modules (attention, o_proj, MLP, down_proj), the widest once more (joined from its batches, then |x| for
        the mean), and three module outputs (the FP output, a candidate's batches and their join). On the
        default model at the long preset (131,072 tokens) that is 3.2 GiB: its AWQ cells peaked at 5.9-6.0 GiB
        resident, priced 2.5 GiB without it."""
        ins = [shape.hidden, shape.heads * shape.head_dim, shape.hidden, shape.intermediate]
        return 4 * tokens * (sum(ins) + max(ins) + 3 * shape.hidden)

    def _quantize(self, model: nn.Module, scheme: Scheme, config: AWQConfig,
                  calib: Calibration | None) -> dict[str, Any]:
        device_type = self.compute_device(model).type
        float_chain = config.chain == "float"

        def to_quant_linears(block: nn.Module) -> None:
            for name, lin in block_linears(block).items():
                qlin = quant_linear_for(lin, name, scheme, *minmax_qparams(lin.weight.data, scheme.w_bits,
                                                                           scheme.group_size))
                qlin.act_quant_enabled = False  # weights are chosen for floating-point activations
                set_submodule(block, name, qlin)

        def process(ctx: BlockContext) -> None:
            with torch.autocast(device_type, enabled=False):  # searches in fp32 unless they ask for bf16
                awq_block(ctx.block, ctx.q_inputs.data, ctx.kwargs, scheme, config, ctx.stats)
            torch.clear_autocast_cache()  # drop bf16 copies of the weights about to be replaced
            if not float_chain:  # else the scaled floating-point block feeds the next; quantized at the end
                to_quant_linears(ctx.block)

        ids = calib.input_ids[:config.n_samples]
        # The chain advances under the same autocast as the block forwards (and as evaluation).
        with precision.autocast(device_type, enabled=config.bf16):
            # a checkpointed block is the scaled FP block (float chain) or its quantized form, as `process` left it
            restore = ((lambda i, block, state: block.load_state_dict(state)) if float_chain
                       else quantized_block_restorer(scheme, act_quant_enabled=False))
            per_block = walk_blocks(model, ids, process, need_targets=False, batch_size=config.batch_size,
                                    desc=f"awq {scheme.name}", device=self.device,
                                    checkpoint=method_checkpoint(self, scheme, config, calib), restore=restore)
        if float_chain:
            for block in decoder_blocks(model):
                to_quant_linears(block)
        for m in decoder_blocks(model).modules():
            if isinstance(m, QuantLinear):
                m.act_quant_enabled = True
        ratios = [r for s in per_block for r in s["ratios"]]
        gains = [g for s in per_block for g in s["loss_vs_rtn"]]
        stats: dict[str, Any] = {"awq_mean_ratio": sum(ratios) / len(ratios),
                                 "awq_mean_loss_vs_rtn": sum(gains) / len(gains),
                                 "awq_samples": int(ids.shape[0])}
        stats |= merge_fold_stats(per_block) | walk_time_stats(per_block)
        if config.clip:
            stats["awq_mean_clip_shrink"] = sum(s["clip_shrink"] for s in per_block) / len(per_block)
        if scheme.static_activations:
            stats["static_activation_quantizers"] = calibrate_static_activations(model, calib.input_ids)
        return stats
