"""EGAG, entropy-adaptive gamma: the drafter's confidence sets the next round's draft length.

After each round we take the drafter's normalised entropy H_norm = H(softmax(draft logits)) / log V, averaged
over the round's draft positions (0 = certain, 1 = uniform), optionally smooth it with an exponential moving
average (beta = 0: no smoothing), and map it linearly onto [gamma_min, gamma_max]: a confident drafter drafts
long, an unsure one short. The raw (untempered) drafter distribution is used so greedy decoding adapts too.
The choice of K never affects the output distribution (any K is lossless); it only trades draft work against
acceptance.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch


@dataclass
class EntropyAdaptiveGamma:
    gamma_min: int = 1
    gamma_max: int = 8
    ema_beta: float = 0.0
    h_norm: float | None = None  # smoothed normalised entropy so far
    history: list[tuple[float, int]] = field(default_factory=list)  # per round: (H_norm used, K chosen)

    def __post_init__(self):
        if self.gamma_min < 1:
            raise ValueError(f"gamma_min must be >= 1, got {self.gamma_min}")
        if self.gamma_max < self.gamma_min:
            raise ValueError(f"gamma_min ({self.gamma_min}) must be <= gamma_max ({self.gamma_max})")
        if not 0.0 <= self.ema_beta < 1.0:
            raise ValueError(f"egag_ema_beta must be in [0, 1), got {self.ema_beta}")

    def next_gamma(self) -> int:
        """K for the next round (gamma_max before any entropy has been seen)."""
        if self.h_norm is None:
            k = self.gamma_max
        else:
            k = round(self.gamma_max - self.h_norm * (self.gamma_max - self.gamma_min))
        k = min(self.gamma_max, max(self.gamma_min, k))
        self.history.append((float("nan") if self.h_norm is None else self.h_norm, k))
        return k

    def observe(self, draft_logits: torch.Tensor) -> float:
        """draft_logits [K, V] of the round just drafted -> the round's mean H_norm; updates the EMA."""
        logp = draft_logits.float().log_softmax(-1)
        h = -(logp.exp() * logp).nan_to_num().sum(-1).mean().item() / math.log(draft_logits.shape[-1])
        self.h_norm = h if self.h_norm is None else self.ema_beta * self.h_norm + (1 - self.ema_beta) * h
        return h
