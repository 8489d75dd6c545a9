"""LRQ (Lee et al., NAACL 2025): low-rank weight-scaling matrices for block reconstruction.

    D = theta1 + L @ U + r2 + c2,  L [Cout, r] = 0, U [r, Cin] ~ U(-1/sqrt(Cin), 1/sqrt(Cin)),
    r2 [Cout, 1] = 0, c2 [1, Cin] = 0 (METHOD.md 1). Starts exactly at RTN with the initial s1.
Learnable scale parameters per matrix: r * (Cout + Cin) + 2 * Cout + Cin (per-channel).

Rank rules: "official" reproduces the authors' shape rule (full FlexRound-style scaling for some
shapes, r = 2048 or 1024 otherwise, capped at min(Cout, Cin)); "llama2-7b-like" transfers the structure
that rule gives Llama-2-7B by ratio (attention low rank at r = Cin / 4, MLP full); "uniform" uses `rank` everywhere;
"fraction" uses round(rank_fraction * min(Cout, Cin)) (the default for small models: r = 1024 exceeds
a 576-wide model, and 1024 / 4096 = 0.25 is the ratio the authors use on Llama-2-7B attention).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

import torch
from torch import nn

from lrq.arch import ATTENTION_LINEARS
from lrq.config import setting
from lrq.engine import ReconConfig, ReconstructionMethod, recon_presets
from lrq.errors import UserError
from lrq.flexround import FlexRoundLinear
from lrq.learnable import LearnableQuantLinear
from lrq.methods import register


def official_rank(cout: int, cin: int) -> int | None:
    """The authors' rule; None means a full (FlexRound-style) scaling matrix for this shape."""
    if (cout <= 4096 and cin > 4096) or (cout > 4096 and cin <= 4096) or cout == cin == 8192:
        return None
    if cout >= 8192 and cin >= 8192:
        return min(2048, cout, cin)
    return min(1024, cout, cin)


ATTENTION = tuple(name.split(".")[-1] for name in ATTENTION_LINEARS)  # q, k, v, o
RankRule = Literal["official", "llama2-7b-like", "uniform", "fraction"]
RANK_RULES: tuple[str, ...] = RankRule.__args__


def choose_rank(cout: int, cin: int, rule: RankRule, rank: int, fraction: float, name: str | None = None) -> int | None:
    """The rank of linear `name` ([cout, cin]) under `rule`; None: a full FlexRound-style scaling matrix."""
    if rule == "official":
        return official_rank(cout, cin)
    if rule == "llama2-7b-like":
        # the structure the authors' rule gives Llama-2-7B, transferred by ratio: attention low rank at
        # r = Cin / 4 (1,024 of 4,096 there), MLP matrices (4096 x 11008) full FlexRound-style scaling
        if name is None:
            raise ValueError("the llama2-7b-like rank rule needs the linear's name")
        return max(1, min(cin // 4, cout)) if name.split(".")[-1] in ATTENTION else None
    if rule == "uniform":
        return max(1, min(rank, cout, cin))
    if rule == "fraction":
        return max(1, round(fraction * min(cout, cin)))
    raise UserError(f"unknown LRQ rank rule {rule!r}: choose {', '.join(RANK_RULES)} (--set rank_rule=...).")


class LRQLinear(LearnableQuantLinear):
    def __init__(self, linear, scheme, scale, zero, rank: int, generator: torch.Generator | None = None,
                 product_fp32: bool = False, **kw):
        super().__init__(linear, scheme, scale, zero, **kw)
        self.rank = rank
        self.product_fp32 = product_fp32   # L @ U formed in float32 under autocast (LRQConfig.lowrank_product)
        bound = 1.0 / math.sqrt(self.in_features)  # kaiming_uniform(a=sqrt(5)) on an [r, Cin] matrix
        dev = self.weight.device   # U is drawn on the CPU (the seeded generator's), so any device starts alike
        self.L = nn.Parameter(torch.zeros(self.out_features, rank, device=dev))
        self.U = nn.Parameter(torch.empty(rank, self.in_features).uniform_(-bound, bound, generator=generator).to(dev))
        self.r2 = nn.Parameter(torch.zeros(self.out_features, 1, device=dev))
        self.c2 = nn.Parameter(torch.zeros(1, self.in_features, device=dev))

    def extra_log_divisor(self):
        """L @ U + r2 + c2. Under bf16 autocast the product is formed in bf16 (relative error about 4e-3, against
        5e-7 in float32) while FlexRound's full matrix enters in float32; `product_fp32` forms it in float32 there
        too (the authors' W3A16 runs were float32 throughout)."""
        dev = self.L.device.type
        if self.product_fp32 and torch.is_autocast_enabled(dev):
            with torch.autocast(dev, enabled=False):
                return self.L.float() @ self.U.float() + self.r2 + self.c2
        return self.L @ self.U + self.r2 + self.c2


def lrq_param_count(cout: int, cin: int, rank: int, n_groups: int = 1) -> int:
    return rank * (cout + cin) + cout * n_groups + cout + cin


@dataclass(frozen=True, eq=False)
class LRQConfig(ReconConfig):
    """LRQ's settings: the reconstruction settings and the rank of L @ U (module docstring: the rank rules)."""
    rank_rule: RankRule = "fraction"
    rank: int = setting(1024, lo=1)                          # the uniform rule's rank (capped at min(Cout, Cin))
    rank_fraction: float = setting(0.25, lo=0, hi=1, lo_open=True)   # the fraction rule's r / min(Cout, Cin)
    # where L @ U is formed under autocast: "autocast" (at the autocast precision, as before) or "fp32"
    lowrank_product: Literal["autocast", "fp32"] = setting("autocast", neutral="autocast")


@register
class LRQ(ReconstructionMethod):
    name = "lrq"
    summary = "low-rank weight-scaling matrices (s1, L, U, r2, c2) trained by block reconstruction"
    # The authors' Llama-2 learning rates range 4e-4 .. 9e-4 (METHOD.md table).
    # the long preset: the structure the paper measured on Llama-2-7B (attention low rank, MLP full)
    settings = LRQConfig
    presets = recon_presets(LRQConfig, quick={"rank_rule": "fraction"}, paper={"rank_rule": "official"},
                            long={"rank_rule": "llama2-7b-like"})
    # Llama-2-7B rows of the authors' table: (lr, s1 search) per scheme family.
    paper_table = {"w3": (6e-4, True), "w4": (9e-4, False), "w4a8": (5e-4, True), "w8a8": (5e-4, True)}
    quick_lr = {"w3": 1e-2, "w4": 1e-2, "w4a8": 1e-2, "w8a8": 1e-2 / 16}
    learnable_fraction = 0.6
    authors_amp = ("w4", "w4a8")   # the 7B W4A16 and W4A8 scripts: fp16 autocast + GradScaler
    compare_learnables_with = "flexround"   # the paper's point: far fewer learnable scales than FlexRound

    def make_learnable(self, name, linear, scheme, scale, zero, config: LRQConfig, generator, **kw
                       ) -> LearnableQuantLinear:
        r = choose_rank(linear.out_features, linear.in_features, config.rank_rule, config.rank,
                        config.rank_fraction, name)
        if r is None:
            return FlexRoundLinear(linear, scheme, scale, zero, **kw)
        return LRQLinear(linear, scheme, scale, zero, rank=r, generator=generator,
                         product_fp32=config.lowrank_product == "fp32", **kw)
