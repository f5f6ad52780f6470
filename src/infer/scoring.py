"""Scoring and reranking by embeddings (vLLM's ``LLM.score``, ``/score`` and ``/rerank`` for a bi-encoder): a
pair of texts scores the cosine of their two embeddings (infer.pooling), one text against many or many pairwise.

A generative checkpoint read as a bi-encoder: each text is embedded alone (its own forward, no KV block), so a
score is the same whatever else is scored with it, and a text met twice in one call (the query of a one-to-many
call) is embedded once. The cosine is taken whatever the PoolingParams' ``normalize`` (unit vectors or not, the
same score), in float32; 1 for a text against itself.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class ScoringOutput:
    score: float


@dataclass
class ScoringRequestOutput:
    """vLLM's: ``outputs.score`` of one pair, the tokens of its two texts as read (first's, then second's)."""

    request_id: str
    prompt_token_ids: list[int]
    outputs: ScoringOutput
    finished: bool = True


def pair_up(n1: int, n2: int) -> list[tuple[int, int]]:
    """The pairs vLLM's score forms from n1 first and n2 second texts: one first text against each second one
    (1 to N), or the i-th against the i-th (N to N). Anything else is a ValueError naming the counts."""
    if n1 < 1 or n2 < 1:
        raise ValueError(f"scoring needs at least one text on each side, got {n1} and {n2}")
    if n1 == 1:
        return [(0, j) for j in range(n2)]
    if n1 != n2:
        raise ValueError(f"got {n1} first texts and {n2} second ones: give one first text (scored against each "
                         "second one) or as many as the second ones (scored pairwise)")
    return [(i, i) for i in range(n1)]


def cosine(a: torch.Tensor, b: torch.Tensor) -> float:
    """The cosine of two embeddings [H] (0 where one is all zeros: nothing to compare)."""
    return torch.nn.functional.cosine_similarity(a.float(), b.float(), dim=0, eps=1e-12).item()


def rank(scores: list[float], top_n: int = 0) -> list[int]:
    """Indices by score, best first, ties in input order; ``top_n`` > 0 keeps the first top_n (vLLM's rerank)."""
    order = sorted(range(len(scores)), key=lambda i: -scores[i])
    return order[:top_n] if top_n > 0 else order
