"""Acceptance rules for sampled rows: the lossless one, and LOSSY opt-ins that trade fidelity for acceptance.

Every rule answers two questions for a chain of drafts t_1..t_K (shapes: B rows, K drafts, V vocabulary):
  accept(u, p_t, q_t, p)   u [B, K] uniforms, p(t_k) and q(t_k) [B, K], p [B, K, V]  -> accepted [B, K] bool
  residual(p_n, q_n)       at the first rejection: the distribution [B, V] the replacement token is drawn from
Greedy rows never reach these (they accept while the target's argmax equals the draft).

Only ``ExactAcceptance`` keeps the output distributed exactly as the target's p (Leviathan et al. 2023,
Theorem 1). The others are labelled lossy in their names' docstrings, off by default, and the chi-square test
(tests/test_spec_distribution.py) rejects each of them: that is what shows the test protects the default.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


def _normalised_residual(p_n: torch.Tensor, q_n: torch.Tensor) -> torch.Tensor:
    """norm(max(0, p - q)); where it has no mass (p == q up to rounding) p itself, which it equals exactly."""
    residual = (p_n - q_n).clamp_(min=0.0)
    mass = residual.sum(-1, keepdim=True)
    return torch.where(mass > 0, residual / mass.clamp(min=1e-38), p_n)


class AcceptancePolicy:
    lossless = False
    name = "?"

    def accept(self, u, p_t, q_t, p) -> torch.Tensor:
        raise NotImplementedError

    def residual(self, p_n, q_n) -> torch.Tensor:
        raise NotImplementedError


@dataclass
class ExactAcceptance(AcceptancePolicy):
    """Speculative sampling: accept t with probability min(1, p(t)/q(t)); resample from norm(max(0, p - q))."""

    lossless = True
    name = "exact"

    def accept(self, u, p_t, q_t, p):
        return u * q_t < p_t  # u < p/q without a division (q(t) > 0: t was drawn from q); p/q >= 1 always accepts

    def residual(self, p_n, q_n):
        return _normalised_residual(p_n, q_n)


@dataclass
class LenientAcceptance(AcceptancePolicy):
    """LOSSY. Leviathan et al. 2023, appendix A.5: compare p with l * q instead of q (lenience l in (0, 1]).

    Accepts with probability min(1, p(t) / (l q(t))), resamples from norm(max(0, p - l q)); l = 1 is exact. No token
    is then emitted with probability above p(x) / l, but the output is no longer p.
    """

    lenience: float = 0.5
    name = "lenient"

    def __post_init__(self):
        if not 0.0 < self.lenience <= 1.0:
            raise ValueError(f"lenience must be in (0, 1], got {self.lenience!r}")

    def accept(self, u, p_t, q_t, p):
        return u * self.lenience * q_t < p_t

    def residual(self, p_n, q_n):
        return _normalised_residual(p_n, self.lenience * q_n)


@dataclass
class TypicalAcceptance(AcceptancePolicy):
    """LOSSY. Medusa's typical acceptance (Cai et al. 2024; seed 003): accept a draft whose target probability
    exceeds min(epsilon, delta * exp(-H(p))) (a confident target demands more), the longest such prefix; at the
    first failure sample from p itself. Ignores q, so any drafter's habits leak into the output."""

    epsilon: float = 0.09
    delta: float = 0.3
    name = "typical"

    def __post_init__(self):
        if not 0.0 < self.epsilon <= 1.0 or not self.delta > 0.0:
            raise ValueError(f"typical acceptance needs epsilon in (0, 1] and delta > 0, got {self.epsilon!r}, "
                             f"{self.delta!r}")

    def accept(self, u, p_t, q_t, p):
        entropy = -(p * p.clamp(min=1e-30).log()).sum(-1)  # [B, K]
        return p_t > torch.minimum(torch.full_like(entropy, self.epsilon), self.delta * (-entropy).exp())

    def residual(self, p_n, q_n):
        return p_n


@dataclass
class SkipAdjustment(AcceptancePolicy):
    """LOSSY debug switch (seed 000's ``skip_sample_adjustment``): exact acceptance, but at a rejection sample
    from p instead of norm(max(0, p - q)), ignoring that q already proposed there."""

    name = "skip_adjustment"

    def accept(self, u, p_t, q_t, p):
        return u * q_t < p_t

    def residual(self, p_n, q_n):
        return p_n


POLICIES = {"exact": ExactAcceptance, "lenient": LenientAcceptance, "typical": TypicalAcceptance,
            "skip_adjustment": SkipAdjustment}


def make_policy(name: str, lenience: float = 0.5, typical_epsilon: float = 0.09,
                typical_delta: float = 0.3) -> AcceptancePolicy:
    if name not in POLICIES:
        raise ValueError(f"acceptance must be one of {tuple(POLICIES)}, got {name!r}")
    if name == "lenient":
        return LenientAcceptance(lenience)
    if name == "typical":
        return TypicalAcceptance(typical_epsilon, typical_delta)
    return POLICIES[name]()
