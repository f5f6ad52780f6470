"""The proposer seam: whatever guesses the next K tokens of each request (a draft model, n-gram lookup, ...).

    proposal = proposer.propose(DraftBatch(reqs, ks, sampling, seen, generators, vocab_size, device))
    proposal.drafts      [B, K] long   row b's guesses in drafts[b, :num_draft[b]], K = max(ks)
    proposal.num_draft   [B]           <= ks[b]: a proposer may guess fewer (an n-gram with no match: none)
    proposal.q           [B, K, V] or None: the distribution each draft was drawn from; None means every draft is
                                       deterministic (q = one-hot on it), which verification handles exactly
    proposal.logits      [B, K, V] or None: raw draft logits, only when ``keep_logits`` (EGAG, debug)

Invariants every proposer keeps (the round relies on them for losslessness):
- drafts are a function of the request's tokens (``Request.all_ids()``), the proposer's own models and each row's
  generator only; a proposer never touches the target's KV cache;
- where q is given, q[b, j] is computed with the row's sampling pipeline (``logits_to_probs`` with the same
  params as the target, the penalty context grown by drafts[b, :j]) and drafts[b, j] is a draw from it;
- state a proposer keeps per request (a draft KV slot, an n-gram index) describes tokens of the sequence only,
  never unaccepted drafts: the round rolls the draft KV back with the target's (KVManager.rollback).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass

import torch

from ..request import Request
from ..sampling import SamplingBatch


@dataclass
class DraftBatch:
    """One round's decode requests as a proposer sees them."""

    reqs: list[Request]
    ks: list[int]  # drafts asked of each row (0: none)
    sampling: SamplingBatch | None  # None: every row greedy without a penalty (argmax drafting, q not needed)
    seen: torch.Tensor | None  # [B, V] bool context tokens, when a repetition penalty is on
    generators: list[torch.Generator | None]
    vocab_size: int
    device: torch.device
    keep_logits: bool = False

    @property
    def K(self) -> int:
        return max(self.ks)


@dataclass
class Proposal:
    drafts: torch.Tensor  # [B, K] long
    num_draft: list[int]  # [B]
    q: torch.Tensor | None = None  # [B, K, V]
    logits: torch.Tensor | None = None  # [B, K, V]
    catch_up: int = 0  # most tokens a row brought to the batched first draft step (beyond 2: some catching up)
    catch_up_tokens: int = 0  # tokens fed to the proposer's model alone, before drafting (lazy prefills)
    catch_up_s: float = 0.0  # and the seconds they took (not a draft step's cost)


class Proposer(ABC):
    """Guesses continuations; see the module docstring for the invariants."""

    name = "?"
    uses_draft_model = False  # True: the KV manager keeps a draft pool in lockstep with the target's

    @abstractmethod
    def propose(self, batch: DraftBatch) -> Proposal:
        """Up to ``batch.ks[b]`` drafts for each row."""

    def pending(self, req: Request) -> int:
        """Tokens of ``req`` the proposer must consume before it can draft, beyond an ordinary step's one or two
        (a draft model's lazy prefill of the prompt, or of the text decoded while the row sat at K = 0): a one-time
        cost of drafting for the row, which the goodput K policy weighs. 0 for proposers without a model."""
        return 0


def one_hot_q(drafts: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """q [B, K, V] of deterministic drafts: one-hot on each draft (entries past a row's num_draft are never judged)."""
    return torch.nn.functional.one_hot(drafts.clamp(min=0), vocab_size).float()
