"""Token trees: their shape, how proposers grow them, and the padded batch a verify forward takes.

A round's tree for one request (host side, a few dozen nodes): node 0 is the root, the request's last token g (unfed);
every other node is a draft token after its parent's path, ``parents[i] < i``. ``scores[i]`` is the drafter's log
probability of the path root .. i, which ranks nodes when the tree is cut to its node budget: a child never scores
above its parent, so the best ``budget`` nodes always form a tree (EAGLE-2's re-ranking; Li et al. 2024).

Growth (``grow``), EAGLE-2's dynamic tree: the drafter's top-``width`` tokens after the root are depth 1; at each
next depth every frontier node proposes its top-``width`` children and the ``width`` best paths among all of them
(by score) become the new frontier. So a depth costs one drafter step over ``width`` tokens a row, the same number
of steps a chain of that length costs, and the tree keeps width x depth nodes before the cut to the budget.

Candidates are deterministic (the drafter's top tokens, not draws), so verification is exact by "sample the target
once at the node, follow the child that matches" (tree_verify with q = None) under any sampling parameters.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Callable

import torch

from .. import kernels
from ..cache.base import TreeAttn

# Nodes (root included) of one verify row: a forward of at most this many tokens stays on the batch-invariant CPU
# kernels (kernels.MAX_ROWS), which keeps a tree node's logits bit-identical to plain decoding's.
MAX_NODES = kernels.MAX_ROWS


@dataclass
class TreeShape:
    """``depth``: the most drafts on a path; ``width``: children kept per depth; ``budget``: draft nodes verified
    (default and cap: width x depth, at most MAX_NODES - 1). Written ``"DxW"`` or ``"DxW:N"`` (e.g. "4x3:12")."""

    depth: int
    width: int
    budget: int | None = None

    def __post_init__(self):
        for name in ("depth", "width"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"spec_tree {name} must be an integer >= 1, got {v!r}")
        most = min(self.depth * self.width, MAX_NODES - 1)
        if self.budget is None:
            self.budget = most
        if isinstance(self.budget, bool) or not isinstance(self.budget, int) or not 1 <= self.budget <= most:
            raise ValueError(f"spec_tree budget must be an integer in [1, {most}] (depth x width, and at most "
                             f"{MAX_NODES - 1} drafts: a verify row holds {MAX_NODES} tokens), got {self.budget!r}")

    @classmethod
    def parse(cls, text: str) -> TreeShape:
        m = re.fullmatch(r"\s*(\d+)\s*x\s*(\d+)\s*(?::\s*(\d+))?\s*", str(text))
        if not m:
            raise ValueError(f"spec_tree must be None, 'auto' or a shape 'DEPTHxWIDTH[:NODES]' such as '4x3' or "
                             f"'5x3:15', got {text!r}")
        return cls(int(m[1]), int(m[2]), None if m[3] is None else int(m[3]))

    def __str__(self) -> str:
        return f"{self.depth}x{self.width}:{self.budget}"


@dataclass
class DraftTree:
    """One row's tree (module docstring). Children of a node carry distinct tokens (``add`` merges equal ones)."""

    root: int
    tokens: list[int] = field(default_factory=list)
    parents: list[int] = field(default_factory=list)
    scores: list[float] = field(default_factory=list)

    def __post_init__(self):
        if not self.tokens:
            self.tokens, self.parents, self.scores = [self.root], [-1], [0.0]

    def __len__(self) -> int:
        return len(self.tokens)

    def add(self, parent: int, token: int, score: float) -> int:
        """Append ``token`` under ``parent`` (or return the child that holds it already, keeping the better score)."""
        for i in range(parent + 1, len(self.tokens)):
            if self.parents[i] == parent and self.tokens[i] == token:
                self.scores[i] = max(self.scores[i], score)
                return i
        self.tokens.append(int(token))
        self.parents.append(parent)
        self.scores.append(float(score))
        return len(self.tokens) - 1

    def add_path(self, tokens: list[int], score: float = 0.0) -> None:
        """Merge a chain of drafts (an n-gram continuation) below the root, every node scored ``score``."""
        u = 0
        for t in tokens:
            u = self.add(u, t, score)

    def depth(self, i: int) -> int:
        d = 0
        while i > 0:
            i, d = self.parents[i], d + 1
        return d

    def prune(self, budget: int, max_depth: int | None = None) -> DraftTree:
        """The root and the ``budget`` best-scored nodes no deeper than ``max_depth`` (ties: lower index first, so
        a parent always precedes its children)."""
        ok = [i for i in range(1, len(self)) if max_depth is None or self.depth(i) <= max_depth]
        keep = sorted(sorted(ok, key=lambda i: (-self.scores[i], i))[:budget])
        new = {0: 0}
        out = DraftTree(self.root)
        for i in keep:  # parents precede children, and a kept node's parent is kept (it scores at least as well)
            new[i] = len(out)
            out.tokens.append(self.tokens[i])
            out.parents.append(new[self.parents[i]])
            out.scores.append(self.scores[i])
        return out


def to_batch(trees: list[DraftTree], device) -> tuple[torch.Tensor, torch.Tensor, list[int]]:
    """Padded ``tokens [B, N]``, ``parents [B, N]`` (-1 padding) and each row's node count."""
    N = max(len(t) for t in trees)
    tokens = torch.zeros(len(trees), N, dtype=torch.long)
    parents = torch.full((len(trees), N), -1, dtype=torch.long)
    for b, t in enumerate(trees):
        tokens[b, :len(t)] = torch.tensor(t.tokens)
        parents[b, :len(t)] = torch.tensor(t.parents)
    return tokens.to(device), parents.to(device), [len(t) for t in trees]


def top_children(logits: torch.Tensor, k: int, draft_vocab=None) -> tuple[torch.Tensor, torch.Tensor]:
    """logits [..., V] (or [..., N] over a draft vocabulary) -> the ``k`` most likely tokens' log probabilities and
    ids, each [..., k]."""
    logp = logits.float().log_softmax(-1)
    vals, idx = logp.topk(min(k, logp.shape[-1]), -1)
    return vals, idx if draft_vocab is None else draft_vocab.token(idx)


# step(tokens [n, w], parent_slot [n, w] or None) -> (log probs [n, w, w], token ids [n, w, w]): feed one depth's
# frontier (whose parents are slots of the previous frontier; None at depth 1, whose parent is the root) and return
# each fed node's top-w children
Step = Callable[[torch.Tensor, torch.Tensor | None], tuple[torch.Tensor, torch.Tensor]]


def grow(trees: list[DraftTree], first: tuple[torch.Tensor, torch.Tensor], step: Step, depths: list[int],
         width: int) -> None:
    """Grow each row's tree (holding only its root) in place to ``depths[b]`` levels (module docstring).

    ``first``: the top children of the root, (log probs [n, w], ids [n, w]). Rows stop growing at their own depth
    (the step still feeds them, to keep one batch; their extra children are not added)."""
    n = len(trees)
    score, tok = first  # [n, w]
    w = score.shape[1]
    host_tok, host_score = tok.tolist(), score.tolist()
    frontier = [[trees[b].add(0, host_tok[b][i], host_score[b][i]) for i in range(w)] for b in range(n)]
    parent_slot = None  # depth 1's parent is the root
    for d in range(2, max(depths) + 1):
        vals, ids = step(tok, parent_slot)  # [n, w, k]
        k = vals.shape[2]
        total = (score[:, :, None] + vals).reshape(n, w * k)  # path log probability of each candidate child
        score, best = total.topk(min(width, w * k), -1)  # [n, w']
        parent_slot = best // k
        tok = ids.reshape(n, w * k).gather(1, best)
        w = score.shape[1]
        host_tok, host_score, host_par = tok.tolist(), score.tolist(), parent_slot.tolist()
        frontier = [[trees[b].add(frontier[b][host_par[b][i]], host_tok[b][i], host_score[b][i])
                     if d <= depths[b] else -1 for i in range(w)] for b in range(n)]


class FrontierFeed:
    """Where a drafter with a KV cache puts a growing tree's nodes: each depth's frontier is appended at the next
    ``w`` columns after ``base`` (the row's cache length before the tree), at one position, each node seeing the
    context and its ancestors among the nodes fed before it. ``plan`` once per ``grow`` step, in order."""

    def __init__(self, base: list[int], columns: int, device):
        self.base, self.device = base, device
        self.vis = torch.zeros(len(base), 1, max(columns, 1), dtype=torch.bool, device=device)  # [n, w, W]
        self.fed = self.depth = 0

    def plan(self, tok: torch.Tensor, parent_slot: torch.Tensor | None) -> tuple[torch.Tensor, TreeAttn]:
        """-> (each node's parent slot in the previous frontier [n, w] (zeros at depth 1), the forward's TreeAttn)."""
        n, w = tok.shape
        pick = torch.zeros(n, w, dtype=torch.long, device=self.device) if parent_slot is None else parent_slot
        vis = self.vis.gather(1, pick[:, :, None].expand(n, w, self.vis.shape[2])).clone()  # the ancestors' columns
        ar = torch.arange(w, device=self.device)
        vis[:, ar, self.fed + ar] = True  # and its own
        self.depth = 1 if parent_slot is None else self.depth + 1
        pos = torch.tensor(self.base, device=self.device)[:, None] + (self.depth - 1)  # depth j at base + j - 1
        self.vis, self.fed = vis, self.fed + w
        return pick, TreeAttn(pos.expand(n, w), self.base, vis)
