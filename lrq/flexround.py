"""FlexRound (Lee et al., ICML 2023): element-wise learnable division for rounding.

    D = theta1 + Theta2 + theta3,  Theta2 [Cout, Cin] and theta3 [Cout, 1] start at 0 (METHOD.md 1).
Learnable scale parameters per matrix: Cout * Cin + 2 * Cout (per-channel).
"""

from __future__ import annotations

import torch
from torch import nn

from lrq.engine import ReconstructionMethod
from lrq.learnable import LearnableQuantLinear
from lrq.methods import register


class FlexRoundLinear(LearnableQuantLinear):
    def __init__(self, linear, scheme, scale, zero, **kw):
        super().__init__(linear, scheme, scale, zero, **kw)
        dev = self.weight.device   # on the weight's device: a block reconstructed on a GPU trains there
        self.theta2 = nn.Parameter(torch.zeros(self.out_features, self.in_features, device=dev))
        self.theta3 = nn.Parameter(torch.zeros(self.out_features, 1, device=dev))

    def extra_log_divisor(self):
        return self.theta2 + self.theta3


def flexround_param_count(cout: int, cin: int, n_groups: int = 1) -> int:
    return cout * cin + cout * n_groups + cout


@register
class FlexRound(ReconstructionMethod):
    name = "flexround"
    summary = "learnable element-wise division (s1, S2, s3) trained by block reconstruction"
    # The authors' Llama-2 learning rates range 4e-4 .. 3e-3 (METHOD.md table); quick: fewer, shorter steps.
    # Llama-2-7B rows of the authors' table: (lr, s1 search) per scheme family.
    paper_table = {"w3": (2.5e-3, False), "w4": (3e-3, False), "w4a8": (5e-4, True), "w8a8": (5e-4, True)}
    quick_lr = {"w3": 1e-2, "w4": 1e-2, "w4a8": 1e-2, "w8a8": 1e-2 / 16}
    learnable_fraction = 1.0   # a full scaling matrix per weight
    authors_amp = ("w3", "w4", "w4a8", "w8a8")   # every 7B FlexRound script: fp16 autocast + GradScaler

    def make_learnable(self, name, linear, scheme, scale, zero, config, generator, **kw):
        return FlexRoundLinear(linear, scheme, scale, zero, **kw)
