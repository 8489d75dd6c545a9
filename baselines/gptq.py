"""GPTQ (Frantar et al., ICLR 2023, arXiv 2210.17323): column-by-column quantization with second-order
error compensation.

For a linear with weight W [rows, cols] and calibration inputs X [tokens, cols], GPTQ minimises
||X W^T - X Q^T||^2 one column at a time: after rounding column j, the rounding error is spread over
the not-yet-quantized columns through the inverse Hessian of H = 2 X^T X / tokens:
    e = (w_j - q_j) / [H^-1]_jj,      W[:, j:] -= e [H^-1]_{j, j:}
using the upper Cholesky factor of H^-1 (numerically stable form of the OBQ updates) and "lazy batch"
updates: columns are processed in blocks of `block_size`, the trailing matrix is updated once per block.

Details as in the paper and its reference code:
- dampening: H += damp * mean(diag H) * I (damp = 1 %); a Hessian that is still not positive definite
  (Cholesky fails) gets ten times the dampening, retried; retries are counted in the stats (and a
  Hessian that never factorises falls back to round-to-nearest for that layer group, also counted);
- dead inputs (H_jj = 0, a channel that is zero on every calibration token) get H_jj = 1;
- act_order: columns in order of decreasing H_jj (on this model it matters: LANDSCAPE.md). With groups it
  uses "static groups": group scales/zero points computed up front from the original weights in natural
  column order, so the stored format stays plain group-wise (no column permutation at inference);
- without act_order, group-wise qparams are fitted when the first column of a group is reached, on the
  weights as updated so far (the paper's default). A ragged last group (576 = 4 x 128 + 64) is a group;
- asymmetric min/max qparams from lrq.quant, per output channel or per group.
- true-sequential: within a block, q/k/v are quantized first, then o_proj sees the outputs of the
  quantized q/k/v, gate/up see the quantized attention, down_proj sees the quantized gate/up. Blocks see
  the output of the already-quantized earlier blocks (lrq.blockwise.walk_blocks).

Deviation: the reference code also zeroes dead input columns' weights; here they are kept (they are
rounded without spreading error), since a channel silent on the calibration set may fire at test time.
Rows sharing one Hessian (q/k/v; gate/up) are processed as one stacked matrix: GPTQ treats rows
independently, so this is the same result with fewer, larger operations.

Speed (2 CPU cores): block forwards (Hessian inputs, the quantized chain) run under bf16 autocast
(`bf16`) where the run's precision is bf16 (lrq.precision; in float32 on a CPU without native bf16), as
evaluation does and as the reference code runs its fp16 model; X^T X is accumulated and
GPTQ's algebra done in fp32. Each Hessian pass stops at the group's first linear, so only the part of
the block before it is computed.

Activation quantizers stay off while weights are chosen (GPTQ is a weight method); for static schemes
per-tensor ranges are calibrated afterwards on the quantized model.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from lrq import precision
from lrq.arch import INPUT_GROUPS, decoder_blocks, set_submodule
from lrq.blockwise import BlockContext, method_checkpoint, run_block, walk_blocks, walk_time_stats
from lrq.calibration import calibrate_static_activations
from lrq.config import MethodConfig, setting
from lrq.methods import Calibration, Method, add_work, register
from lrq.qlinear import QuantLinear
from lrq.quant import fake_quant, minmax_qparams, n_groups, single_cpu_thread
from lrq.quantize_model import quant_linear_for, quantized_block_restorer
from lrq.schemes import Scheme

# Linears sharing one input, in the order a block computes them (true-sequential GPTQ).
SEQUENTIAL_GROUPS: tuple[tuple[str, ...], ...] = tuple(group for _, group in INPUT_GROUPS.values())
MAX_DAMP_RETRIES = 8
@dataclass(frozen=True, eq=False)
class GPTQConfig(MethodConfig):
    """GPTQ's settings (the reference implementation's defaults)."""
    damp: float = setting(0.01, lo=0, hi=1)        # dampening, a fraction of the mean Hessian diagonal
    block_size: int = setting(128, lo=1)           # columns updated together (lazy batch updates)
    act_order: bool = True                         # columns in decreasing Hessian-diagonal order
    bf16: bool = True                              # the calibration chain under bf16 autocast
    batch_size: int = setting(8, lo=1)             # calibration windows per forward


@dataclass
class GPTQResult:
    weight: torch.Tensor      # dequantized GPTQ weights [rows, cols], natural column order, on the grid below
    scale: torch.Tensor       # [rows, n_groups]
    zero: torch.Tensor        # [rows, n_groups]
    retries: int              # dampening increases needed before the Cholesky factorisation succeeded
    fallback: bool            # True when no dampening worked and the weights were rounded to nearest
    dead: int                 # input channels that were zero on every calibration token


def inverse_hessian_factor(h: torch.Tensor, damp: float, max_retries: int = MAX_DAMP_RETRIES
                           ) -> tuple[torch.Tensor | None, int]:
    """Upper Cholesky factor of (H + lambda I)^-1, lambda = damp * mean(diag H), raised x10 until it factorises."""
    mean_diag = h.diagonal().abs().mean().clamp(min=1e-12)
    eye = torch.eye(h.shape[0], dtype=h.dtype, device=h.device)
    for retry in range(max_retries + 1):
        lower, info = torch.linalg.cholesky_ex(h + (damp * 10**retry) * mean_diag * eye)
        if info == 0:
            upper, info = torch.linalg.cholesky_ex(torch.cholesky_inverse(lower), upper=True)
            if info == 0 and torch.isfinite(upper).all():
                return upper, retry
    return None, max_retries + 1


@torch.no_grad()
def gptq_quantize(w: torch.Tensor, h: torch.Tensor, bits: int, group_size: int | None = None, *,
                  damp: float = 0.01, block_size: int = 128, act_order: bool = True) -> GPTQResult:
    """Quantize the rows of `w` [rows, cols] against the Hessian `h` [cols, cols] of their shared input."""
    # the column loop is thousands of small operations: on a CPU, thread synchronisation costs more than it
    # saves (100x slower on 2 busy cores), so it runs on one thread
    with single_cpu_thread(w.device):
        return _gptq(w, h, bits, group_size, damp, block_size, act_order)


def _gptq(w: torch.Tensor, h: torch.Tensor, bits: int, group_size: int | None, damp: float, block_size: int,
          act_order: bool) -> GPTQResult:
    w = w.detach().float().clone()
    h = h.detach().float().clone()
    rows, cols = w.shape
    ng = n_groups(cols, group_size)
    dead = h.diagonal() == 0
    h.diagonal()[dead] = 1.0

    static = group_size is None or act_order
    if static:  # per-channel, or static groups: qparams from the original weights in natural order
        scale, zero = minmax_qparams(w, bits, group_size)
    else:
        scale, zero = w.new_zeros(rows, ng), w.new_zeros(rows, ng)

    perm = torch.argsort(h.diagonal(), descending=True, stable=True) if act_order else None
    if perm is not None:
        w, h = w[:, perm], h[perm][:, perm]
    group_of = ((perm if perm is not None else torch.arange(cols, device=w.device)) // (group_size or cols)).tolist()

    hinv, retries = inverse_hessian_factor(h, damp)
    fallback = hinv is None
    if fallback:  # with an identity factor no error is spread: plain round-to-nearest
        hinv = torch.eye(cols, device=w.device)

    q = torch.empty_like(w)
    for i1 in range(0, cols, block_size):
        i2 = min(i1 + block_size, cols)
        w1 = w[:, i1:i2].clone()
        err = w.new_empty(rows, i2 - i1)
        h1 = hinv[i1:i2, i1:i2]
        for i in range(i2 - i1):
            c = i1 + i
            g = group_of[c]
            if not static and c % group_size == 0:  # fit this group on the weights updated so far
                cur = torch.cat([w1[:, i:], w[:, i2:]], dim=1)[:, :group_size]
                scale[:, g:g + 1], zero[:, g:g + 1] = minmax_qparams(cur, bits)
            col = w1[:, i:i + 1]
            qc = fake_quant(col, scale[:, g:g + 1], zero[:, g:g + 1], bits)
            q[:, c:c + 1] = qc
            e = (col - qc) / h1[i, i]
            w1[:, i:].sub_(e * h1[i:i + 1, i:])
            err[:, i:i + 1] = e
        w[:, i2:].sub_(err @ hinv[i1:i2, i2:])

    if perm is not None:
        q = q[:, torch.argsort(perm)]
    return GPTQResult(q, scale, zero, retries, fallback, int(dead.sum()))


class _StopForward(Exception):
    pass


@torch.no_grad()
def input_hessian(block: nn.Module, linear: nn.Module, inputs: torch.Tensor, kwargs: dict,
                  batch_size: int, bf16: bool = False) -> torch.Tensor:
    """H = 2 X^T X / tokens of `linear`'s input while `block` runs on `inputs`; each batch stops at `linear`.

    The block may run under bf16 autocast; X^T X is accumulated in fp32.
    """
    cols = linear.in_features
    h = torch.zeros(cols, cols, device=linear.weight.device)
    count = 0

    def hook(module, args):
        nonlocal count
        x = args[0].detach().reshape(-1, cols).float()
        with torch.autocast(x.device.type, enabled=False):
            h.addmm_(x.T, x)
        count += x.shape[0]
        raise _StopForward

    handle = linear.register_forward_pre_hook(hook)
    try:
        for i in range(0, inputs.shape[0], batch_size):
            try:
                run_block(block, inputs[i:i + batch_size], kwargs, batch_size=batch_size, autocast=bf16)
            except _StopForward:
                pass
    finally:
        handle.remove()
    return h.mul_(2.0 / max(count, 1))


def relative_output_error(w: torch.Tensor, q: torch.Tensor, h: torch.Tensor) -> float:
    """||X (W - Q)^T||^2 / ||X W^T||^2 on the calibration inputs, from the Hessian."""
    d = w.float() - q
    num = ((d @ h) * d).sum()
    den = ((w.float() @ h) * w.float()).sum().clamp(min=1e-30)
    return float(num / den)


@register
class GPTQ(Method):
    name = "gptq"
    summary = "GPTQ: column-wise rounding with inverse-Hessian error feedback, true-sequential, act-order"
    settings = GPTQConfig
    presets = {"quick": GPTQConfig(), "paper": GPTQConfig()}
    cost_rank = 5
    blockwise = True
    probe_walk = True     # Hessians / activation scales walked per block: priced at the model's widths
    checkpoints = True    # resumes at its next block (a long cell is hours on a CPU)

    def needs_calibration(self, scheme: Scheme) -> bool:
        return True

    def work(self, shape, scheme, cfg, n, seq):
        """Per block: the Hessians' forwards and X^T X, the column updates, the quantized chain."""
        L, T = shape.layers, n * seq
        upd = sum(a * a * b for a, b in shape.linears())
        hess = sum(2.0 * T * a * a for a, _ in shape.linears())
        return add_work(super().work(shape, scheme, cfg, n, seq), "gptq", L,
                        L * (4 * shape.block_fwd_flops(T, seq) + hess + upd))

    def profile(self, run, shape, scheme, n, seq, steps=6):
        t, c = run()
        return {"gptq": (*self.work(shape, scheme, c, n, seq)["gptq"], t)}

    def extra_memory(self, shape, tokens: int = 0) -> int:
        """The largest Hessian, its inverse and Cholesky factor in float32."""
        return 4 * max(a * a for a, _ in shape.linears()) * 3

    def _quantize(self, model: nn.Module, scheme: Scheme, config: GPTQConfig,
                  calib: Calibration | None) -> dict[str, Any]:
        batch_size, bf16 = config.batch_size, config.bf16
        device_type = self.compute_device(model).type

        def process(ctx: BlockContext) -> None:
            block, inputs = ctx.block, ctx.q_inputs.data
            retries = fallbacks = dead = 0
            errors = []
            for names in SEQUENTIAL_GROUPS:
                linears = [block.get_submodule(n) for n in names]
                h = input_hessian(block, linears[0], inputs, ctx.kwargs, batch_size, bf16)
                w = torch.cat([lin.weight.detach().float() for lin in linears], dim=0)
                with torch.autocast(device_type, enabled=False):  # GPTQ's algebra in fp32
                    res = gptq_quantize(w, h, scheme.w_bits, scheme.group_size, damp=config.damp,
                                        block_size=config.block_size, act_order=config.act_order)
                    errors.append(relative_output_error(w, res.weight, h))
                retries, fallbacks, dead = retries + res.retries, fallbacks + res.fallback, dead + res.dead
                row = 0
                for name, lin in zip(names, linears):
                    part = slice(row, row + lin.out_features)
                    row += lin.out_features
                    qlin = quant_linear_for(lin, name, scheme, res.scale[part], res.zero[part], weight=res.weight[part])
                    qlin.act_quant_enabled = False  # weights are chosen for floating-point activations
                    set_submodule(block, name, qlin)
            ctx.stats.update(retries=retries, fallbacks=fallbacks, dead=dead, error=sum(errors) / len(errors))
            torch.clear_autocast_cache()  # bf16 copies of the weights just replaced

        # The quantized chain advances under the same autocast as the Hessian forwards (and as evaluation).
        with precision.autocast(device_type, enabled=bf16):
            per_block = walk_blocks(model, calib.input_ids, process, need_targets=False, batch_size=batch_size,
                                    desc=f"gptq {scheme.name}", device=self.device,
                                    checkpoint=method_checkpoint(self, scheme, config, calib),
                                    restore=quantized_block_restorer(scheme, act_quant_enabled=False))
        for m in decoder_blocks(model).modules():
            if isinstance(m, QuantLinear):
                m.act_quant_enabled = True
        stats: dict[str, Any] = {
            "gptq_damp_retries": sum(s["retries"] for s in per_block),
            "gptq_rtn_fallbacks": sum(s["fallbacks"] for s in per_block),
            "gptq_dead_inputs": sum(s["dead"] for s in per_block),
            "gptq_mean_rel_output_error": sum(s["error"] for s in per_block) / len(per_block),
        } | walk_time_stats(per_block)
        if scheme.static_activations:
            stats["static_activation_quantizers"] = calibrate_static_activations(model, calib.input_ids)
        return stats
