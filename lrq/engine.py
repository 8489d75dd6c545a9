"""The block-reconstruction engine shared by LRQ, FlexRound and OmniQuant: method-independent.

For every decoder block (lrq.blockwise supplies the FP targets and the quantized chain's inputs):
  1. swap the block's linears for learnable quantizers (a method's `make_learnable`), s1/z initialised
     by min/max or the L2.4 clipping search;
  2. measure the block's output error on the training samples and on held-out samples;
  3. train every learnable with Adam (one learning rate, cosine decay to 0, shuffled batches) on
     loss = (pred - target)^2 summed over tokens, averaged over batch and hidden (METHOD.md 2);
  4. freeze: fold into integers + per-channel/group scale and zero point (QuantLinear);
  5. measure the error again (the paper's Figure 2: calibration vs held-out), checkpoint the block.

Methods with block-level learnables (OmniQuant's equivalent transformation) use the hooks
prepare_block / learnable_kwargs / init_learnables / param_groups / finish_block; the optimizer may be
given per-group learning rates and a constant schedule (`lr_schedule`).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import math
import os
import shutil
import statistics
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, ClassVar, Literal

import torch
from torch import nn
from tqdm.auto import tqdm

from lrq import precision, progress
from lrq.arch import KV_LINEARS, block_linears, set_submodule
from lrq.blockwise import BlockCheckpoint, BlockContext, walk_blocks, walk_time_stats
from lrq.calibration import observe_input_ranges
from lrq.errors import UserError
from lrq.io import atomic_write
from lrq.learnable import LearnableQuantLinear
from lrq.config import MethodConfig, setting
from lrq.methods import Calibration, Method, add_work, static_range_work
from lrq.quant import minmax_qparams, qparams_from_range, search_qparams
from lrq.quantize_model import quantized_block_restorer
from lrq.schemes import Scheme

log = logging.getLogger(__name__)

# `compile=auto` compiles the block step from this many steps per block on: compiling costs 10-40 s per
# process on the CPU (less from torch's on-disk cache), paid back after a few hundred steps of the paper's
# 5,000 (bench/studies/block_step.py --compile measures both).
COMPILE_MIN_ITERS = 1000


class ReconstructionError(RuntimeError):
    pass


def compile_unavailable(device: torch.device | str = "cpu") -> str | None:
    """Why torch.compile cannot compile a block step for `device` on this machine, or None when it can."""
    kind = torch.device(device).type
    if kind == "cpu":
        cxx = os.environ.get("CXX") or shutil.which("g++") or shutil.which("c++") or shutil.which("clang++")
        return None if cxx else "no C++ compiler on PATH (torch.compile's CPU backend needs g++ or clang++)"
    if kind == "cuda":
        import importlib.util
        return None if importlib.util.find_spec("triton") else "Triton is not installed (torch.compile's CUDA backend needs it)"
    return f"torch.compile is not set up for {kind} devices here"


def compiled_step(block: nn.Module, compile_on: bool, device: torch.device) -> nn.Module:
    """The module the training steps call: `block` itself, or torch.compile of it (same parameters, same
    math up to floating-point reassociation; the backward graph is compiled too). The error measurements
    keep calling `block` (eager, no gradient)."""
    if not compile_on:
        return block
    why = compile_unavailable(device)
    if why:
        raise UserError(f"compile is on but {why}: install one, or run eagerly with --set compile=off.")
    return torch.compile(block, dynamic=False)


def check_compiled_step(fwd: nn.Module, block: nn.Module, params: list[nn.Parameter], x: torch.Tensor,
                        target: torch.Tensor, kwargs: dict, autocast) -> str | None:
    """One training step's loss and gradients through the compiled `fwd` and through the eager `block`, on
    the same batch; the reason to distrust the compiled one, or None. torch.compile's CPU code is generated
    per vector ISA, and its AVX2 code (an AMD Zen 3; any CPU below AVX-512) returned NaN for a block whose
    eager and AVX-512 compiled steps are fine (torch 2.13, seen under the AVX2 emulation): a wrong compiled
    step must never train a model. Costs one eager step per block; leaves no gradient behind."""
    def step(f) -> tuple[float, list[torch.Tensor]]:
        for p in params:
            p.grad = None
        with torch.enable_grad(), autocast:
            y = f(x, **kwargs)
            loss = block_loss(y[0] if isinstance(y, tuple) else y, target)
        loss.backward()
        grads = [torch.zeros_like(p) if p.grad is None else p.grad.detach().float().clone() for p in params]
        return loss.item(), grads

    try:
        (lc, gc), (le, ge) = step(fwd), step(block)
    finally:
        for p in params:
            p.grad = None
    if not math.isfinite(le):
        return None                 # the eager step itself diverges: the training loop reports that
    if not math.isfinite(lc):
        return f"its loss is {lc} where the eager step's is {le:.6g}"
    if abs(lc - le) > 0.02 * abs(le) + 1e-6:
        return f"its loss {lc:.6g} differs from the eager step's {le:.6g} by more than 2 %"
    num = math.sqrt(sum(float((a - b).pow(2).sum()) for a, b in zip(gc, ge)))
    den = math.sqrt(sum(float(b.pow(2).sum()) for b in ge))
    if not math.isfinite(num) or num > 0.1 * den + 1e-12:
        return f"its gradients differ from the eager step's by {num / max(den, 1e-30):.3g} (relative norm)"
    return None


def block_loss(pred: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """(pred - target)^2 summed over tokens, averaged over batch and hidden (the authors' loss)."""
    return (pred.float() - target.float()).pow(2).sum(dim=1).mean()


def _block_batches(block: nn.Module, inputs: torch.Tensor, targets: torch.Tensor, kwargs: dict, batch: int):
    """The block's outputs on `inputs` in batches, each with its targets, on the block's device."""
    dev = next(block.parameters()).device
    for i in range(0, len(inputs), batch):
        y = block(inputs[i:i + batch].to(dev), **kwargs)
        yield (y[0] if isinstance(y, tuple) else y), targets[i:i + batch].to(dev)


@torch.no_grad()
def window_errors(block: nn.Module, inputs: torch.Tensor, targets: torch.Tensor, kwargs: dict,
                  batch: int = 8) -> list[float]:
    """`block_loss` of each window alone (its squared error summed over tokens, averaged over hidden)."""
    out: list[float] = []
    for y, t in _block_batches(block, inputs, targets, kwargs, batch):
        out += (y.float() - t.float()).pow(2).sum(dim=1).mean(-1).tolist()
    return out


def _curve_point(step: int, loss: float, block: nn.Module, calib: tuple, heldout: tuple, kwargs: dict) -> dict:
    """One point of a block's training curve: the mean error over the calibration windows measured and over
    the held-out ones, and every window's own error (for intervals across windows)."""
    c, h = window_errors(block, *calib, kwargs), window_errors(block, *heldout, kwargs)
    mean = lambda v: sum(v) / len(v) if v else math.nan
    return {"step": step, "loss": loss, "calib": mean(c), "heldout": mean(h), "calib_windows": c, "heldout_windows": h}


@torch.no_grad()
def block_error(block: nn.Module, inputs: torch.Tensor, targets: torch.Tensor, kwargs: dict, batch: int = 8) -> float:
    if len(inputs) == 0:
        return float("nan")
    total = 0.0
    for y, t in _block_batches(block, inputs, targets, kwargs, batch):
        total += block_loss(y, t).item() * len(y)
    return total / len(inputs)


def made_worse(err: Mapping) -> bool:
    """A block whose training ended with a higher calibration error than its RTN start (one entry of the
    stats' `block_errors`): its steps or learning rate do not suit the model."""
    return err["calib_after"] > err["calib_before"]


FAMILY_FALLBACK = {"w8": "w8a8"}


def _scheme_key(scheme: Scheme) -> str:
    if scheme.a_bits is not None:
        return "w4a8" if scheme.w_bits <= 4 else "w8a8"
    return f"w{scheme.w_bits}"


@dataclass(frozen=True, eq=False)
class ReconConfig(MethodConfig):
    """The settings every block-reconstruction method shares (lrq.config: typed, parsed once)."""
    preset: str = setting("quick", fixed=True)
    # Adam's learning rate; auto: the authors' rate for the scheme family (paper, long), the CPU rate (quick)
    lr: float | Literal["auto"] = setting("auto", lo=0, lo_open=True)
    # s1 initialisation: min/max, or the authors' L2.4 clipping search; auto: the authors' per-scheme choice
    s1_init: Literal["minmax", "search", "auto"] = "auto"
    search_grid: int = setting(100, lo=1)
    search_norm: float = setting(2.4, lo=0, lo_open=True)
    # the activation quantizers during reconstruction; auto: on for W8A8 static, off for W4A8 per-token
    recon_act_quant: Literal["on", "off", "auto"] = "auto"
    smooth_alpha: float = setting(0.8, lo=0, hi=1)     # SmoothQuant migration before W8A8 reconstruction (0: none)
    error_samples: int = setting(16, lo=1)               # windows of each block error (Figure 2)
    # torch.compile of the training step: how the step runs, not what it computes; auto: from COMPILE_MIN_ITERS
    compile: bool | Literal["auto"] = setting("auto", execution=True)
    # authors: the authors' fp16 model, fp16 freeze and (where their script has it) fp16 autocast + GradScaler
    train_precision: Literal["default", "authors"] = setting("default", neutral="default")
    iters: int = setting(100, lo=0)                      # training steps per block
    batch_size: int = setting(1, lo=1)
    heldout_samples: int = setting(16, lo=0)             # calibration windows held out of training (Figure 2)
    autocast: bool = True                                # bf16 autocast of the steps where the run computes bf16
    # the learning-rate schedule over a block's steps (the authors' LRQ/FlexRound: cosine to 0)
    lr_schedule: Literal["cosine", "constant"] = setting("cosine", neutral="cosine")


def recon_presets(cls: type[ReconConfig] = ReconConfig, quick: Mapping | None = None, paper: Mapping | None = None,
                  long: Mapping | None = None) -> dict[str, ReconConfig]:
    """The quick, long and paper presets of a reconstruction method's config class, each with its extras.

    quick: sized for one cell of the 135M default model in about 15 minutes on 2 CPU cores. long: the closest to
    the paper a CPU affords end to end (a step at batch 2 x 1,024 takes about 0.2 s compiled in bf16 on one AMX
    core, reports/block-step/, so 1,000 steps x 30 blocks of the default model are about 1 h 45 min per cell
    there; bf16 where the CPU has it, compiled, the authors' learning rates and s1 search, 16 held-out windows
    for Figure 2). paper: the authors' settings."""
    base = {"quick": {"preset": "quick", "iters": 100, "batch_size": 1, "heldout_samples": 16, "autocast": True},
            "paper": {"preset": "paper", "iters": 5000, "batch_size": 2, "heldout_samples": 0, "autocast": False},
            "long": {"preset": "long", "iters": 1000, "batch_size": 2, "heldout_samples": 16, "autocast": True}}
    quick, paper, long = dict(quick or {}), dict(paper or {}), dict(long or {})
    return {"quick": cls(**(base["quick"] | quick)), "long": cls(**(base["paper"] | paper | base["long"] | long)),
            "paper": cls(**(base["paper"] | paper))}


class ReconstructionMethod(Method):
    """A method whose learnables are trained block by block; subclasses supply `make_learnable`."""

    _compile_refused: str | None = None   # set by a compiled step that failed its check (this quantize call)

    # The authors' Llama-2-7B settings per scheme family (METHOD.md): (lr, s1 search); subclasses override.
    paper_table: ClassVar[dict[str, tuple[float, bool]]] = {}
    # CPU quick preset learning rates per scheme family (few steps need a larger rate; 8-bit grids are
    # 16x finer than 4-bit ones, so the same step in log-scale moves 16x more levels).
    quick_lr: ClassVar[dict[str, float]] = {}
    cost_rank: ClassVar[int] = 10
    settings: ClassVar[type[MethodConfig]] = ReconConfig
    presets: ClassVar[dict[str, MethodConfig]] = recon_presets()
    # train_precision=authors: the scheme families whose Llama-2-7B script trains under fp16 autocast with a
    # GradScaler (FlexRound: all of them; LRQ: W4A16 and W4A8); subclasses override
    authors_amp: ClassVar[tuple[str, ...]] = ()
    # Not a setting: when > 0, every `curve_every` steps the block's output error on the calibration and the
    # held-out error windows is measured (frozen, no gradient, no random numbers: training is unchanged) and
    # kept as the block's "curve" (bench/studies/figure2.py sets it on its method object).
    curve_every: int = 0
    # Not a setting: a file where the training of the block in progress is saved at every curve point (its
    # learnables, Adam's, the schedule's and the GradScaler's state, the batch order, the random generator, the
    # curve and step times so far), and from which the same block resumes exactly where an earlier process
    # stopped; `train_state_key` names the run the file must belong to (another key: trained from the start).
    # bench/studies/figure2.py sets both: one of its (block, method)s is an hour of a CPU core.
    train_state_path: str | os.PathLike | None = None
    train_state_key: str = ""
    checkpoints: ClassVar[bool] = True
    blockwise: ClassVar[bool] = True

    calib_defaults: ClassVar[dict[str, dict[str, Any]]] = {
        "paper": {"dataset": "c4", "n_samples": 512, "seq_len": 1024, "sampling": "sequential"},
        "long": {"dataset": "c4", "n_samples": 128, "seq_len": 1024, "sampling": "sequential"}}

    def needs_calibration(self, scheme: Scheme) -> bool:
        return True

    def check_calibration(self, config: ReconConfig, n_samples: int, seq_len: int) -> None:
        n_held = config.heldout_samples
        if n_held >= n_samples:
            raise UserError(f"{self.name}: heldout_samples ({n_held}) must be smaller than the calibration set "
                            f"({n_samples} windows): lower --set heldout_samples or raise --calib-samples.")

    # ---- cost (bench.run.plan) ------------------------------------------------------------------------
    def work(self, shape, scheme: Scheme | None, cfg: ReconConfig, n: int, seq: int) -> dict[str, tuple[float, float]]:
        """The block walk (both calibration chains and the block errors) and `iters` training steps per block
        (forward + backward ~ 3 forwards of a batch); W8A8's static ranges (twice with a SmoothQuant step)."""
        es, iters, bs = min(cfg.error_samples, n), cfg.iters, cfg.batch_size
        L, T = shape.layers, n * seq
        w: dict[str, tuple[float, float]] = {}
        add_work(w, "walk", L, L * shape.block_fwd_flops(2 * T + 4 * es * seq, seq))
        add_work(w, f"train_{self.name}", L * iters, L * iters * 3 * shape.block_fwd_flops(bs * seq, seq))
        for kind, v in static_range_work(shape, scheme, n, seq, 2 if cfg.smooth_alpha else 1).items():
            add_work(w, kind, *v)
        return w

    def profile(self, run, shape, scheme: Scheme, n: int, seq: int, steps: int = 6) -> dict:
        """The walk alone (0 steps), then `steps` training steps: their difference is the training."""
        light = {"heldout_samples": 2, "error_samples": 4}
        t0, c0 = run(iters=0, **light)
        t1, c1 = run(iters=steps, **light)
        kind = f"train_{self.name}"
        return {"walk": (*self.work(shape, scheme, c0, n, seq)["walk"], t0),
                kind: (*self.work(shape, scheme, c1, n, seq)[kind], max(t1 - t0, 1e-6))}

    training_probe_settings: ClassVar[tuple[str, ...]] = (
        "batch_size", "compile", "autocast", "train_precision", "rank_rule", "rank", "rank_fraction", "s1_init",
        "search_grid", "recon_act_quant", "let")

    def training(self, cfg: ReconConfig) -> tuple[int, int]:
        return int(cfg.iters), int(cfg.batch_size)

    def training_probe_config(self, cfg: ReconConfig, steps: int, compiled: bool) -> ReconConfig:
        return cfg | {"iters": steps, "heldout_samples": 1, "error_samples": 1, "compile": "on" if compiled else "off"}

    # ---- settings ---------------------------------------------------------------------------------
    def resolve(self, scheme: Scheme, config: Mapping) -> ReconConfig:
        cfg = self.typed(config)
        family = _scheme_key(scheme)
        # 8-bit weight-only (w8a16) has no row of the authors' own: it takes the W8A8 row, whose 8-bit weight
        # grid it shares (the learning rate scales with the grid's step, not with the activations)
        family = family if family in self.paper_table or family not in FAMILY_FALLBACK else FAMILY_FALLBACK[family]
        lr, search = self.paper_table.get(family, (None, False))
        decided: dict[str, Any] = {}
        if cfg.lr == "auto":
            lr = self.quick_lr.get(family) if cfg.preset == "quick" else lr
            if lr is None:
                raise UserError(f"{self.name} has no learning rate for {scheme.name} (weights at {scheme.w_bits} "
                                f"bits): give one with --set lr=...")
            decided["lr"] = float(lr)
        if cfg.s1_init == "auto":
            # On the CPU quick preset the exhaustive L2.4 search (100 widths x 2^b zero points) costs more
            # than the training; the paper preset follows the authors' per-scheme choice.
            decided["s1_init"] = "search" if (search and cfg.iters >= 1000) else "minmax"
        if cfg.recon_act_quant == "auto":
            # W8A8 per-tensor static: quantizers on during reconstruction (our choice, METHOD.md 4);
            # W4A8 per-token: off during reconstruction, as in the authors' code.
            decided["recon_act_quant"] = "on" if scheme.static_activations else "off"
        if cfg.compile == "auto":   # on from COMPILE_MIN_ITERS steps per block where a compiler exists
            decided["compile"] = cfg.iters >= COMPILE_MIN_ITERS and compile_unavailable("cpu") is None
        return cfg.replace(**decided)

    def checkpoint_settings(self, cfg: ReconConfig) -> dict[str, Any]:
        """The settings part of the block-checkpoint identity: the resolved settings without the execution
        ones, the schedule always named (as releases before typed configs named it)."""
        return self.keyed_settings(cfg) | {"lr_schedule": cfg.lr_schedule}

    def checkpoint_identity(self, scheme: Scheme, cfg: ReconConfig, calib: Calibration) -> str:
        """What names a cell's block checkpoints: the method, scheme, `checkpoint_settings` and the calibration
        windows (and the method's version from 2 on)."""
        ident = {"m": self.name, "s": scheme.name, "c": self.checkpoint_settings(cfg), "calib": calib.description}
        if self.version != 1:
            ident["v"] = self.version
        return hashlib.sha256(json.dumps(ident, sort_keys=True, default=str).encode()).hexdigest()

    def make_learnable(self, name: str, linear: nn.Linear, scheme: Scheme, scale: torch.Tensor, zero: torch.Tensor,
                       config: ReconConfig, generator: torch.Generator, **kw) -> LearnableQuantLinear:
        raise NotImplementedError

    # ---- optional hooks (OmniQuant's block-level equivalent transformation uses them) ---------------
    upfront_static_ranges: ClassVar[bool] = True   # observe W8A8 ranges on the whole model before the walk

    def prepare_block(self, ctx: BlockContext, cfg: ReconConfig, n_train: int) -> Any:
        """Before the block's linears become learnable: returns block-level state (or None)."""
        return None

    def learnable_kwargs(self, state: Any, name: str) -> dict:
        """Extra keyword arguments for `make_learnable` of linear `name`, given prepare_block's state."""
        return {}

    def init_learnables(self, ctx: BlockContext, learn: dict, state: Any, cfg: ReconConfig, n_train: int) -> None:
        """After the learnables exist, before the initial (Figure-2 'before') errors are measured."""

    def param_groups(self, learn: dict, state: Any, cfg: ReconConfig) -> list[dict]:
        """Optimizer parameter groups; default: every learnable at one learning rate (METHOD.md 2)."""
        return [{"params": [p for m in learn.values() for p in m.learnables()], "lr": cfg.lr}]

    def finish_block(self, ctx: BlockContext, state: Any, cfg: ReconConfig, n_train: int) -> None:
        """After the linears are frozen, before the final errors and the block checkpoint."""

    # ---- the run ----------------------------------------------------------------------------------
    def _quantize(self, model: nn.Module, scheme: Scheme, config: ReconConfig, calib: Calibration | None
                  ) -> dict[str, Any]:
        if calib is None:
            raise UserError(f"{self.name} needs calibration data.")
        cfg = self.resolve(scheme, config)
        self._compile_refused = None
        ids = calib.input_ids
        n_held = cfg.heldout_samples
        if n_held >= len(ids):
            raise UserError(f"heldout_samples ({n_held}) must be smaller than the calibration set ({len(ids)}).")
        n_train = len(ids) - n_held
        seed = int(calib.description.get("seed", 0))

        act_qparams: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
        # train_precision=authors: the model on the fp16 grid from here on, and the block forwards (FP targets, the
        # quantized chain) in fp16 as in the authors' fp16 model; the training steps decide their own autocast
        # (_reconstruct_block)
        authors = cfg.train_precision == "authors"
        fp16 = precision.authors_fp16_model(model, self.compute_device(model)) if authors else contextlib.nullcontext()
        smoothing: dict[str, Any] = {}
        if scheme.static_activations and self.upfront_static_ranges:
            if cfg.smooth_alpha > 0:
                from lrq.smooth import smooth_model
                smoothing = smooth_model(model, ids[:n_train], alpha=cfg.smooth_alpha)
            ranges = observe_input_ranges(model, ids[:n_train])
            act_qparams = {k: qparams_from_range(lo.clamp(max=0), hi.clamp(min=0), scheme.a_bits)
                           for k, (lo, hi) in ranges.items()}

        def process(ctx: BlockContext) -> None:
            ctx.stats.update(self._reconstruct_block(ctx, scheme, cfg, act_qparams, n_train, seed))

        restore = quantized_block_restorer(scheme)

        ckpt = None
        if self.checkpoint_dir is not None:
            ckpt = BlockCheckpoint(self.checkpoint_dir, self.checkpoint_identity(scheme, cfg, calib))
        with fp16:
            per_block = walk_blocks(model, ids, process, need_targets=True, desc=f"{self.name} {scheme.name}",
                                    checkpoint=ckpt, restore=restore, device=self.device)
        stats: dict[str, Any] = {
            "n_learnable": sum(b["n_learnable"] for b in per_block),
            **walk_time_stats(per_block),
            # the training loops alone, and the median step (blocks trained by this run; earlier results lack them)
            "train_time_s": sum(b.get("train_s", 0.0) for b in per_block),
            "step_s_median": (statistics.median(b["step_s"] for b in per_block if b.get("step_s") is not None)
                              if any(b.get("step_s") is not None for b in per_block) else None),
            # blocks whose training steps ran under torch.compile (earlier results may lack the field)
            "compiled_blocks": sum(bool(b.get("compiled")) for b in per_block),
            # why compile=on ran eagerly from some block on (check_compiled_step), or None
            "compile_refused": next((b["compile_refused"] for b in per_block if b.get("compile_refused")), None),
            "resolved_config": cfg.as_dict(), "train_samples": n_train, "heldout_samples": n_held,
            # what the training steps really ran at: bf16 autocast only where the preset and the run allow it
            "train_precision": (("authors: fp16 model and freeze, steps under fp16 autocast with a GradScaler"
                                 if self._fp16_steps(scheme, cfg) else
                                 "authors: fp16 model and freeze, fp32 steps") if authors else
                                "bf16" if cfg.autocast and precision.current(self.device) == "bf16" else "fp32"),
            "block_errors": [{k: b[k] for k in ("calib_before", "calib_after", "heldout_before", "heldout_after")}
                             for b in per_block],
        }
        for k in ("calib_before", "calib_after", "heldout_before", "heldout_after"):
            stats[f"mean_block_{k}"] = sum(b[k] for b in per_block) / len(per_block)
        from lrq.smooth import merge_fold_stats
        return stats | smoothing | merge_fold_stats(per_block)   # the W8A8 smoothing's / OmniQuant LET's checks

    def _reconstruct_block(self, ctx: BlockContext, scheme: Scheme, cfg: ReconConfig, act_qparams: dict, n_train: int,
                           seed: int) -> dict:
        """The module docstring's steps 1 to 5 on one block (the walk checkpoints it): its statistics."""
        block, i, kw = ctx.block, ctx.index, ctx.kwargs
        x_all, y_all = ctx.q_inputs.data, ctx.fp_targets.data
        if not (torch.isfinite(x_all).all() and torch.isfinite(y_all).all()):
            raise UserError(f"the calibration activations entering block {i} contain NaN or inf: the model or the "
                            f"calibration data is broken (check the model's FP perplexity and the calibration text).")
        gen = torch.Generator().manual_seed(seed * 100_003 + i)
        state = self.prepare_block(ctx, cfg, n_train)
        learn = self._swap_in_learnables(ctx, scheme, cfg, act_qparams, gen, state)
        groups, params = self._trainable(block, learn, state, cfg)
        n_learn = sum(p.numel() for p in params)
        self.init_learnables(ctx, learn, state, cfg, n_train)
        win = _Windows.of(x_all, y_all, n_train, cfg.error_samples)
        with _frozen(block, learn):  # at initialisation the learnables are exactly RTN: measure that fast
            out = {"block": i, "n_learnable": n_learn, "calib_before": block_error(block, *win.calib, kw),
                   "heldout_before": block_error(block, *win.heldout, kw)}
        if cfg.iters > 0:
            t = self._start_training(ctx, scheme, cfg, learn, groups, params, gen, win, n_train, out)
            self._train_steps(t, cfg, out)
        for name, m in learn.items():   # the authors freeze in fp16, after .half() of the whole model
            set_submodule(block, name, m.freeze(half=cfg.train_precision == "authors"))
        for p in params:
            p.requires_grad_(False)
        self.finish_block(ctx, state, cfg, n_train)
        out["calib_after"] = block_error(block, *win.calib, kw)
        out["heldout_after"] = block_error(block, *win.heldout, kw)
        if made_worse(out):
            log.warning("block %d: training ended with a higher calibration error than its RTN start (%.4g > %.4g): "
                        "the steps or the learning rate do not suit this model (--set lr=..., --set iters=...)",
                        i, out["calib_after"], out["calib_before"])
        return out

    def _fp16_steps(self, scheme: Scheme, cfg: ReconConfig) -> bool:
        """train_precision=authors where the authors' script trains the scheme under fp16 autocast with a
        GradScaler (`authors_amp`)."""
        return cfg.train_precision == "authors" and _scheme_key(scheme) in self.authors_amp

    def _swap_in_learnables(self, ctx: BlockContext, scheme: Scheme, cfg: ReconConfig, act_qparams: dict,
                            gen: torch.Generator, state: Any) -> dict[str, LearnableQuantLinear]:
        """Step 1: every linear of the block replaced by its learnable quantizer (s1/z by min/max or the
        clipping search), in the block's order (the generator draws LRQ's U in that order)."""
        block, i = ctx.block, ctx.index
        learn: dict[str, LearnableQuantLinear] = {}
        for name, lin in block_linears(block).items():
            w = lin.weight.detach().float()
            if cfg.s1_init == "search":
                scale, zero = search_qparams(w, scheme.w_bits, scheme.group_size, cfg.search_grid, cfg.search_norm)
            else:
                scale, zero = minmax_qparams(w, scheme.w_bits, scheme.group_size)
            full = f"model.layers.{i}.{name}"
            m = self.make_learnable(name, lin, scheme, scale, zero, cfg, gen, quantize_output=name in KV_LINEARS,
                                    act_range=act_qparams.get(full), act_quant=cfg.recon_act_quant == "on",
                                    **self.learnable_kwargs(state, name))
            set_submodule(block, name, m)
            learn[name] = m
        return learn

    def _trainable(self, block: nn.Module, learn: dict, state: Any, cfg: ReconConfig
                   ) -> tuple[list[dict], list[nn.Parameter]]:
        """The optimizer's parameter groups and their parameters, the only ones of the block left trainable."""
        for p in block.parameters():
            p.requires_grad_(False)
        groups = self.param_groups(learn, state, cfg)
        params = [p for g in groups for p in g["params"]]
        for p in params:
            p.requires_grad_(True)
        return groups, params

    def _start_training(self, ctx: BlockContext, scheme: Scheme, cfg: ReconConfig, learn: dict, groups: list[dict],
                        params: list[nn.Parameter], gen: torch.Generator, win: _Windows, n_train: int,
                        out: dict) -> _Training:
        """Step 3's set-up: Adam, the schedule, the first batch order, the steps' precision and module (compiled
        or not); continued from the saved training state where there is one of this block (`train_state_path`),
        else with the curve's first point (when `curve_every`)."""
        block, i = ctx.block, ctx.index
        opt = torch.optim.Adam(groups)
        sched = (torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=cfg.iters, eta_min=0.0)
                 if cfg.lr_schedule == "cosine" else None)
        order = torch.randperm(n_train, generator=gen)
        dev = next(block.parameters()).device    # the walk put the block on the compute device
        # bf16 autocast when the preset allows it (`autocast`) and the run's precision is bf16; with
        # train_precision=authors, fp16 autocast and a GradScaler where the authors' script uses them, fp32 else
        amp = self._fp16_steps(scheme, cfg)
        if cfg.train_precision == "authors":
            autocast = precision.authors_fp16(dev, enabled=amp)
        else:
            autocast = precision.autocast(dev, enabled=cfg.autocast)
        scaler = torch.amp.GradScaler(dev.type) if amp else None
        t = _Training(ctx, learn, params, win, n_train, dev, block, autocast, gen, opt, sched, scaler, order)
        saved = self._load_train_state(i, cfg.iters, params)
        t.fwd = self._step_module(t, cfg, out)
        if saved is not None:   # continue an interrupted training exactly where its last save left it
            t.restore(saved)
            out["resumed"] = list(saved.get("resumed", [])) + [{"step": t.first, "train_s_before": t.train_before}]
            log.info("block %d: training resumed at step %d of %d from %s", i, t.first, cfg.iters,
                     self.train_state_path)
        elif self.curve_every:
            t.curve = [t.curve_point(0, math.nan)]
        return t

    def _step_module(self, t: _Training, cfg: ReconConfig, out: dict) -> nn.Module:
        """The module the training steps call: the block, or its compiled step where `compile` is on and the
        compiled step passes `check_compiled_step` (after a failure, every later block of the run is eager)."""
        block, bs, dev = t.ctx.block, cfg.batch_size, t.dev
        fwd = compiled_step(block, cfg.compile is True and not self._compile_refused, dev)
        if fwd is not block:
            xt, yt = t.win.train
            why = check_compiled_step(fwd, block, t.params, xt[:bs].to(dev), yt[:bs].to(dev), t.ctx.kwargs,
                                      t.autocast)
            if why:   # every later block runs eagerly too: the same code generator would build its step
                self._compile_refused = f"block {t.ctx.index}: the compiled training step is wrong here: {why}"
                log.warning("%s; training eagerly from this block on (--set compile=off skips the "
                            "compilation).", self._compile_refused)
                fwd = block
        out["compiled"] = fwd is not block
        if self._compile_refused:
            out["compile_refused"] = self._compile_refused
        return fwd

    def _train_steps(self, t: _Training, cfg: ReconConfig, out: dict) -> None:
        """Step 3: the training steps from `t.first` on, each reported, the curve measured and the training
        state saved every `curve_every` steps; the loss, times and curve into `out`."""
        ctx, iters = t.ctx, cfg.iters
        i = ctx.index
        bar = tqdm(range(t.first, iters), desc=f"block {i + 1}/{ctx.n_blocks}", initial=t.first, total=iters,
                   leave=False)
        t_loop = t_step = time.perf_counter()
        for step in bar:
            t.step(step, cfg)
            if step % 10 == 0 or step == iters - 1:
                bar.set_postfix(loss=f"{t.loss:.4g}")
            progress.update(f"block {i + 1}/{ctx.n_blocks} step {step + 1}/{iters}",
                            (i + (step + 1) / iters) / ctx.n_blocks)
            if self.curve_every and ((step + 1) % self.curve_every == 0 or step == iters - 1):
                t.curve.append(t.curve_point(step + 1, t.loss))
            now = time.perf_counter()
            t.step_times.append(now - t_step)
            t_step = now
            if self.train_state_path and self.curve_every and (step + 1) % self.curve_every == 0 \
                    and step < iters - 1:
                self._save_train_state(t.saved(self.train_state_key, iters, step + 1,
                                               t.train_before + now - t_loop, out.get("resumed", [])))
        out["final_loss"] = t.loss
        out["train_s"] = t.train_before + time.perf_counter() - t_loop
        out["step_s"] = statistics.median(t.step_times[1:] or t.step_times)
        if t.scaler is not None:
            out["amp_skipped_steps"] = t.skipped
        if self.curve_every:
            out["curve"] = t.curve

    def _load_train_state(self, block: int, iters: int, params: list[nn.Parameter]) -> dict | None:
        """The saved training of this block (see `train_state_path`), or None where there is none, or where
        the file belongs to another run, block, step count or set of learnables (then it is trained anew)."""
        path = self.train_state_path
        if not path or not os.path.exists(path):
            return None
        try:
            saved = torch.load(path, map_location="cpu", weights_only=True)
        except Exception as e:   # a torn or foreign file: the run goes on from the start, never from garbage
            log.warning("block %d: the saved training state %s cannot be read (%s); training from step 0",
                        block, path, e)
            return None
        why = None
        if saved.get("key") != self.train_state_key:
            why = "it belongs to another run (another key)"
        elif saved.get("block") != block or saved.get("iters") != iters:
            why = f"it belongs to block {saved.get('block')} of {saved.get('iters')} steps"
        elif [tuple(t.shape) for t in saved["params"]] != [tuple(p.shape) for p in params]:
            why = "its learnables have other shapes"
        if why:
            log.warning("block %d: not resuming from %s: %s; training from step 0", block, path, why)
            return None
        return saved

    def _save_train_state(self, state: dict) -> None:
        atomic_write(self.train_state_path, lambda tmp: torch.save(state, tmp), fsync=False)


class _frozen:
    """Temporarily replace learnable linears by their frozen QuantLinear (dequantized once, not per batch)."""

    def __init__(self, block: nn.Module, learn: dict[str, LearnableQuantLinear]):
        self.block, self.learn = block, learn

    def __enter__(self):
        for name, m in self.learn.items():
            set_submodule(self.block, name, m.freeze())
        return self

    def __exit__(self, *a):
        for name, m in self.learn.items():
            set_submodule(self.block, name, m)
        return False


@dataclass(frozen=True, eq=False)
class _Windows:
    """A block's calibration windows, (inputs, targets) each: the training ones, and the Figure-2 error windows:
    the first `error_samples` training windows and (up to as many) held-out ones."""
    train: tuple[torch.Tensor, torch.Tensor]
    calib: tuple[torch.Tensor, torch.Tensor]
    heldout: tuple[torch.Tensor, torch.Tensor]

    @classmethod
    def of(cls, x_all: torch.Tensor, y_all: torch.Tensor, n_train: int, n_err: int) -> _Windows:
        xt, yt, xh, yh = x_all[:n_train], y_all[:n_train], x_all[n_train:], y_all[n_train:]
        return cls((xt, yt), (xt[:n_err], yt[:n_err]), (xh[:n_err], yh[:n_err]))


@dataclass(eq=False)
class _Training:
    """One block's training in progress: what it trains and how its steps run, and where it stands: the
    optimizer's, the schedule's, the GradScaler's and the generator's state, the batch order, the step, the
    loss, the curve and step times so far (what a saved training state keeps besides the learnables)."""
    ctx: BlockContext
    learn: dict[str, LearnableQuantLinear]
    params: list[nn.Parameter]
    win: _Windows
    n_train: int
    dev: torch.device
    fwd: nn.Module                      # what the steps call: the block, or its compiled step
    autocast: Any
    gen: torch.Generator
    opt: torch.optim.Optimizer
    sched: Any                          # the cosine schedule, or None (constant learning rates)
    scaler: Any                         # fp16 autocast's GradScaler, or None
    order: torch.Tensor                 # the batch order of the current pass over the training windows
    pos: int = 0                        # where the next batch starts in `order`
    first: int = 0                      # the step this process starts at (> 0: resumed)
    loss: float = math.nan
    skipped: int = 0                    # fp16 steps that overflowed, skipped as the GradScaler does
    # wall time of every step (the first includes a compiled step's first call): what the planner's probe prices
    # (bench.run.plan._measure_training) and what a cell's stats report beside it
    step_times: list[float] = field(default_factory=list)
    train_before: float = 0.0           # seconds of training before the resumed step
    curve: list[dict] = field(default_factory=list)         # the curve's points so far (`curve_every`)

    def curve_point(self, step: int, loss: float) -> dict:
        with _frozen(self.ctx.block, self.learn):
            return _curve_point(step, loss, self.ctx.block, self.win.calib, self.win.heldout, self.ctx.kwargs)

    def step(self, step: int, cfg: ReconConfig) -> None:
        """One training step on the next batch (a new batch order after each pass over the windows)."""
        bs, i, dev = cfg.batch_size, self.ctx.index, self.dev
        if self.pos + bs > self.n_train:
            self.order, self.pos = torch.randperm(self.n_train, generator=self.gen), 0
        idx = self.order[self.pos:self.pos + bs]
        self.pos += bs
        xt, yt = self.win.train
        with torch.enable_grad(), self.autocast:
            y = self.fwd(xt[idx].to(dev), **self.ctx.kwargs)
            y = y[0] if isinstance(y, tuple) else y
            loss = block_loss(y, yt[idx].to(dev))
        self.loss = loss.item()
        self.opt.zero_grad(set_to_none=True)
        if self.scaler is not None:   # a step whose fp16 forward overflowed is skipped, as the GradScaler does
            self.skipped += not math.isfinite(self.loss)
            if self.skipped > max(100, cfg.iters // 10):
                raise ReconstructionError(f"block {i}: {self.skipped} of {step + 1} fp16 steps overflowed "
                                          f"(lr {cfg.lr}): train_precision=authors diverges here.")
            self.scaler.scale(loss).backward()
            self.scaler.step(self.opt)
            self.scaler.update()
        else:
            if not math.isfinite(self.loss):
                raise ReconstructionError(
                    f"block {i}: the reconstruction loss became {self.loss} at step {step} (lr {cfg.lr}). "
                    f"Lower the learning rate (--set lr=...) or turn on fp32 (--set autocast=False).")
            loss.backward()
            self.opt.step()
        if self.sched is not None:
            self.sched.step()

    def saved(self, key: str, iters: int, step: int, train_s: float, resumed: list) -> dict:
        """The training state, `step` steps done, to resume from (`ReconstructionMethod._load_train_state`)."""
        return {"key": key, "block": self.ctx.index, "iters": iters, "step": step,
                "params": [p.detach().clone() for p in self.params], "opt": self.opt.state_dict(),
                "sched": self.sched.state_dict() if self.sched is not None else None,
                "scaler": self.scaler.state_dict() if self.scaler is not None else None,
                "gen": self.gen.get_state(), "order": self.order, "pos": self.pos, "loss": self.loss,
                "skipped": self.skipped, "step_times": self.step_times, "curve": self.curve,
                "train_s": train_s, "resumed": resumed}

    def restore(self, saved: dict) -> None:
        """Continue from a state `saved` wrote: the learnables, the optimizer, ..., exactly as they were."""
        with torch.no_grad():
            for p, t in zip(self.params, saved["params"]):
                p.copy_(t)
        self.opt.load_state_dict(saved["opt"])
        if self.sched is not None:
            self.sched.load_state_dict(saved["sched"])
        if self.scaler is not None:
            self.scaler.load_state_dict(saved["scaler"])
        self.gen.set_state(saved["gen"])
        self.order, self.pos, self.first = saved["order"], saved["pos"], saved["step"]
        self.loss, self.skipped, self.step_times = saved["loss"], saved["skipped"], list(saved["step_times"])
        self.train_before = saved["train_s"]
        self.curve = list(saved["curve"])

