"""DraftVocab: the drafter scores only N frequent tokens instead of the whole vocabulary (FR-Spec, Zhao et al. 2025).

Why: a small drafter's output layer can cost as much as its body. The shipped drafter's lm head is 8,192 x 128
(4 MB in float32) next to 1.6 MB of layers; it does not fit a core's 2 MB L2 beside them, so every draft step
streams it from L3 and evicts the layers. Scoring 2,048 rows (1 MB) cut a draft step from 0.56 to 0.41 ms here.

Lossless: speculative sampling is exact for *any* proposal q (Leviathan et al. 2023, Theorem 1). With a draft
vocabulary S, q(x) = 0 for x outside S: drafts are always in S, and the recovered token at a rejection is drawn
from norm(max(0, p - q)), which still covers every token. Greedy: the draft is the argmax within S; the target's
argmax decides as always. Only the acceptance rate can change: a position where the target's choice lies outside
S always rejects.

S = the ``size`` most frequent tokens of a corpus (a ranking shipped beside the drafter, ``draft_vocab.json``),
united with the prompt's own tokens in the library loop (code copies identifiers and literals from its context;
``including``). ids are kept ascending so the argmax within S breaks ties toward the lowest id, like argmax over V.
"""

from __future__ import annotations

import copy
import json
import os
import weakref
from collections.abc import Iterable, Sequence
from pathlib import Path

import torch

from ..model.layers import linear

RANKING_FILE = "draft_vocab.json"


def write_ranking(out_dir: str | os.PathLike, counts: Sequence[int], source: str,
                  recommended_size: int | None = None) -> Path:
    """Write ``draft_vocab.json``: every token id ordered by descending corpus count (ties: lower id first), and
    the size ``draft_vocab_size="auto"`` uses (measure it: benchmarks/draft_vocab.py)."""
    order = sorted(range(len(counts)), key=lambda i: (-int(counts[i]), i))
    path = Path(out_dir) / RANKING_FILE
    body = {"source": source, "vocab_size": len(counts), "ranked_token_ids": order,
            "counts": [int(counts[i]) for i in order]}
    if recommended_size is not None:
        body["recommended_size"] = int(recommended_size)
    path.write_text(json.dumps(body) + "\n")
    return path


def _ranking_file(drafter_dir: str | os.PathLike) -> Path:
    root = Path(drafter_dir)
    return (root.parent if root.is_file() else root) / RANKING_FILE


def recommended_size(drafter_dir: str | os.PathLike) -> int | None:
    """The ranking's ``recommended_size`` (else the fewest tokens covering 90% of its corpus); None without a
    ranking beside the drafter."""
    path = _ranking_file(drafter_dir)
    if not path.is_file():
        return None
    body = json.loads(path.read_text())
    if isinstance(body.get("recommended_size"), int):
        return body["recommended_size"]
    counts, seen = body.get("counts") or [], 0
    for i, c in enumerate(counts):
        seen += c
        if seen >= 0.9 * sum(counts):
            return i + 1
    return None


def load_ranking(drafter_dir: str | os.PathLike) -> list[int]:
    """The ranked token ids of ``drafter_dir/draft_vocab.json`` (beside the file for a .gguf drafter); a clear error
    if it is missing or malformed."""
    path = _ranking_file(drafter_dir)
    if not path.is_file():
        raise ValueError(f"draft_vocab_size needs a token ranking {path}: none found (write one with "
                         "infer.proposers.draft_vocab.write_ranking from token counts of a corpus)")
    try:
        ranked = json.loads(path.read_text())["ranked_token_ids"]
    except (json.JSONDecodeError, KeyError, TypeError) as e:
        raise ValueError(f"{path}: not a draft-vocabulary ranking ({e})") from None
    if not isinstance(ranked, list) or not all(isinstance(i, int) for i in ranked):
        raise ValueError(f"{path}: ranked_token_ids must be a list of token ids")
    return ranked


class DraftVocab:
    """A subset S of token ids and the drafter's lm-head rows for them.

    ``logits(hidden)`` -> float32 ``[..., N]`` over S (column j is token ``ids[j]``); ``expand`` scatters them
    into ``[..., V]`` with -inf outside S, which every sampling step maps to probability 0.
    """

    def __init__(self, full_weight: torch.Tensor, ids: Iterable[int]):
        V = full_weight.shape[0]
        ids = sorted(set(int(i) for i in ids))
        if not ids:
            raise ValueError("a draft vocabulary needs at least one token")
        if ids[0] < 0 or ids[-1] >= V:
            raise ValueError(f"draft vocabulary token ids must lie in [0, {V}), got {ids[0]}..{ids[-1]}")
        self.vocab_size = V
        self.id_list = ids  # host copy: greedy drafting maps an index to a token without a device op
        self.ids = torch.tensor(ids, dtype=torch.long, device=full_weight.device)  # [N]
        self.weight = full_weight[self.ids].contiguous()  # [N, H]: one dense GEMV, no gather per step
        self._full_weight = full_weight
        self.head: torch.nn.Module | None = None  # the rows quantized (``quantized``), which ``logits`` then uses
        self.extra_weight: torch.Tensor | None = None  # rows of tokens added to a quantized vocabulary (``including``)

    def quantized(self, quantization: str | None) -> DraftVocab:
        """The same vocabulary scored by its rows quantized (model.quant: int8 or a block type), so a draft step's
        scoring runs on infer's integer kernels like the drafter's layers; self for None."""
        if quantization is None:
            return self
        from ..model.quant import quantize_linears

        out = copy.copy(self)
        holder = torch.nn.Module()
        holder.rows = torch.nn.Linear(self.weight.shape[1], len(self.id_list), bias=False, device=self.weight.device,
                                      dtype=self.weight.dtype)
        holder.rows.weight.data = self.weight
        out.head = quantize_linears(holder, quantization).rows
        return out

    @classmethod
    def from_ranking(cls, drafter, ranking: Sequence[int], size: int) -> DraftVocab:
        V = drafter.config.vocab_size
        if isinstance(size, bool) or not isinstance(size, int) or not 1 <= size <= V:
            raise ValueError(f"draft_vocab_size must be an integer in [1, {V}] (the drafter's vocab_size), "
                             f"got {size!r}")
        if len(ranking) < size:
            raise ValueError(f"the token ranking has {len(ranking)} ids, fewer than draft_vocab_size {size}")
        return cls(drafter.lm_head_weight, ranking[:size])

    @property
    def size(self) -> int:
        return len(self.id_list)

    def including(self, token_ids: Iterable[int]) -> DraftVocab:
        """S united with ``token_ids`` (e.g. the prompt's); self when they are all in S already. A quantized vocabulary
        keeps its quantized rows and scores the added tokens' rows beside them, unquantized (ids then ascend within
        each part only: a tie between the parts goes to S's token)."""
        have = set(self.id_list)
        extra = sorted({int(t) for t in token_ids} - have)
        if not extra:
            return self
        if self.head is None:
            return DraftVocab(self._full_weight, have | set(extra))
        if self.extra_weight is not None:  # an extended one: rebuild from the base rows
            base = self.id_list[: self.head.out_features]
            return self._extend(base, sorted(set(self.id_list[len(base):]) | set(extra)))
        return self._extend(self.id_list, extra)

    def _extend(self, base: list[int], extra: list[int]) -> DraftVocab:
        if len(extra) < 2:  # never fewer than two added rows (PromptVocabs.widened says why): the lowest ids outside
            have = set(base) | set(extra)
            extra = sorted(extra + [i for i in range(self.vocab_size) if i not in have][:2 - len(extra)])
        out = copy.copy(self)
        out.id_list = base + extra
        out.ids = torch.tensor(out.id_list, dtype=torch.long, device=self._full_weight.device)
        out.extra_weight = self._full_weight[torch.tensor(extra, device=self._full_weight.device)].contiguous()
        return out

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden ``[..., H]`` -> float32 logits ``[..., N]`` over S (infer's kernels for a few rows on the CPU)."""
        if self.head is None:
            return linear(hidden, self.weight).float()
        scores = self.head(hidden)
        if self.extra_weight is not None:
            scores = torch.cat([scores, linear(hidden, self.extra_weight)], -1)
        return scores.float()

    def expand(self, sub_logits: torch.Tensor) -> torch.Tensor:
        """``[..., N]`` -> ``[..., V]``, -inf outside S (probability 0 after any temperature / top-k / top-p)."""
        full = sub_logits.new_full((*sub_logits.shape[:-1], self.vocab_size), float("-inf"))
        full[..., self.ids] = sub_logits
        return full

    def token(self, sub_index: torch.Tensor) -> torch.Tensor:
        """Indices into S -> token ids."""
        return self.ids[sub_index]


class HeadVocab(DraftVocab):
    """A drafter's own head over its fixed draft vocabulary (an EAGLE-3 head: ``draft_ids``, ``draft_logits``): no
    rows of another head to add, so prompts' tokens outside it are not added (``including`` is the identity)."""

    def __init__(self, head):
        self.vocab_size = head.config.vocab_size
        self.ids = head.draft_ids  # [N] ascending
        self.id_list = self.ids.tolist()
        self._head = head

    def including(self, token_ids: Iterable[int]) -> DraftVocab:
        return self

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self._head.draft_logits(hidden)


class PromptVocabs:
    """S united with the prompts of a batch's requests, cached per request and per batch (one subset per batch:
    one GEMV for all rows); None without a draft vocabulary."""

    def __init__(self, draft_vocab: DraftVocab | None):
        self.draft_vocab = draft_vocab
        self._of: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # Request -> its S + prompt
        self._batch: tuple[tuple[int, ...], DraftVocab] | None = None  # last batch's union, reused

    def __call__(self, reqs) -> DraftVocab | None:
        if self.draft_vocab is None:
            return None
        key = tuple(r.request_id for r in reqs)
        if self._batch is None or self._batch[0] != key:
            for r in reqs:
                if r not in self._of:
                    self._of[r] = self.widened(self.draft_vocab.including(r.prompt_ids))
            vocab = self._of[reqs[0]]
            for r in reqs[1:]:
                vocab = vocab.including(self._of[r].id_list)
            self._batch = (key, vocab)
        return self._batch[1]

    @staticmethod
    def widened(vocab: DraftVocab | None) -> DraftVocab | None:
        """``vocab`` with at least two added rows where its rows are quantized (``DraftVocab.quantized``): a compiled
        draft chain (EagleHead.draft_chain) then meets one layout, quantized rows and added ones, whatever the prompt
        (a vocabulary without added rows, or with one, would be a graph of its own). The tokens added beyond a
        prompt's are the lowest ids outside S: S may be any subset (lossless), and two more tokens change nothing
        else."""
        if vocab is None or getattr(vocab, "head", None) is None or vocab.extra_weight is not None:
            return vocab
        return vocab._extend(vocab.id_list, [])
