"""Leviathan, Kalman & Matias (2023), section 3: what speculation should buy, from alpha and c.

alpha: expected acceptance rate of one draft token, E[sum_x min(p(x), q(x))].
c:     cost of one drafter step divided by the cost of one target step (decode, same runtime).
K:     drafted tokens per round (gamma in the paper).
v:     cost of the target's (K+1)-token verify divided by one target step. The paper takes v = 1 (a parallel
       forward is as fast as one token's); on a CPU it is 1.1-2x, so ``walltime_improvement(..., verify_cost=v)``
       with a measured v says how much of the gap to the paper's prediction that premium alone explains.
"""

from __future__ import annotations


def _check(alpha: float, k: int | None = None, c: float | None = None) -> None:
    if not 0.0 <= alpha <= 1.0:
        raise ValueError(f"alpha must be in [0, 1], got {alpha}")
    if k is not None and k < 0:
        raise ValueError(f"K must be >= 0, got {k}")
    if c is not None and c < 0:
        raise ValueError(f"c must be >= 0, got {c}")


def expected_tokens_per_round(alpha: float, k: int) -> float:
    """E[tokens emitted per target forward] = (1 - alpha^(K+1)) / (1 - alpha)  (= K+1 when alpha = 1)."""
    _check(alpha, k)
    if alpha == 1.0:
        return float(k + 1)
    return (1.0 - alpha ** (k + 1)) / (1.0 - alpha)


def walltime_improvement(alpha: float, k: int, c: float, verify_cost: float = 1.0) -> float:
    """Expected speedup over autoregressive decoding: (1 - alpha^(K+1)) / ((1 - alpha)(K c + v)), v = 1 in the paper."""
    _check(alpha, k, c)
    if not verify_cost > 0:  # also refuses NaN
        raise ValueError(f"verify_cost must be > 0, got {verify_cost}")
    return expected_tokens_per_round(alpha, k) / (k * c + verify_cost)


def optimal_k(alpha: float, c: float, k_max: int = 64) -> int:
    """The K in 1..k_max maximising walltime_improvement (ties: the smaller K)."""
    _check(alpha, None, c)
    return max(range(1, k_max + 1), key=lambda k: (walltime_improvement(alpha, k, c), -k))


def alpha_from_acceptance(num_accepted: int, num_drafted: int) -> float:
    """Estimate of alpha from counts (accepted / drafted). Biased low when rounds are cut short by max_tokens."""
    return num_accepted / num_drafted if num_drafted else 0.0
