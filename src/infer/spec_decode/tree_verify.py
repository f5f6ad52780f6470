"""Verification of token trees (SpecInfer, Miao et al. 2024): pure functions beside the chain verifier (verify.py).

A batch of trees: ``tokens [B, N]`` and ``parents [B, N]``. Node 0 of each row is its last token g (unfed, the root);
nodes 1 .. num_nodes[b]-1 are drafts, each after its parent (``parents[b, i] < i``; -1 for the root and padding).
``p [B, N, V]``: the target's next-token distribution after the path root .. node i (one verify forward with the
tree attention mask gives all of them); ``q [B, N, V]``: the distribution node i was drawn from, or None when every
draft is deterministic (q = one-hot on the draft: an n-gram, a top-k expansion).

Results, as for chains: the accepted path's node indices ``path [B, D]`` (-1 padded, root excluded), ``num_accepted
[B]``, ``output_tokens [B, D+1]``: the accepted drafts, then one recovered (at a rejection) or bonus (at a leaf)
token, -1 padded. D is the deepest node's depth.

Greedy: follow, from the root, the child whose token is the target's argmax at its parent (the first such child
by index); stop where none is; emit the argmax there. Every emitted token is the target's greedy choice.

Sampled, exact (SpecInfer's multi-step speculative sampling, i.e. recursive rejection over the children): at node
u with residual r = p_u, try u's children c in index order: accept c with probability min(1, r(t_c) / q_c(t_c));
at a rejection r <- norm(max(0, r - q_c)) and try the next child. Each try is one speculative-sampling step of r
with an independent draw t_c ~ q_c, so what leaves u (an accepted child, or a draw from the final residual) is
distributed exactly as p_u (Leviathan et al. 2023, Theorem 1, applied child by child). Siblings must be independent
draws (each from its own q_c, given the path to u). With deterministic drafts (q = one-hot) this is "sample p_u
once and follow the child that matches". ``wrong_independent_acceptance`` (tests only) keeps r = p_u for every
sibling, the shortcut the distribution test must catch.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

PAD = -1


@dataclass
class TreeResult:
    path: torch.Tensor  # [B, D] long: accepted nodes, root excluded, -1 padded
    num_accepted: torch.Tensor  # [B] long
    output_tokens: torch.Tensor  # [B, D+1] long: accepted drafts, then the recovered / bonus token, -1 padded
    is_bonus: torch.Tensor  # [B] bool: the path ended at a leaf (all its drafts accepted)


def tree_depths(parents: torch.Tensor) -> torch.Tensor:
    """[B, N] -> depth of each node (root 0; the position offset of its token). Parents precede children."""
    depth = torch.zeros_like(parents)
    for i in range(1, parents.shape[1]):  # over nodes (a few dozen), batched over rows
        par = parents[:, i]
        depth[:, i] = torch.where(par >= 0, depth.gather(1, par.clamp(min=0)[:, None])[:, 0] + 1, 0)
    return depth


def ancestor_mask(parents: torch.Tensor) -> torch.Tensor:
    """[B, N] -> [B, N, N] bool: node i may attend node j iff j is i or one of its ancestors (the tree attention
    mask within the drafted block; every node also sees the whole cached context)."""
    B, N = parents.shape
    mask = torch.eye(N, dtype=torch.bool, device=parents.device).expand(B, N, N).clone()
    rows = torch.arange(B, device=parents.device)
    for i in range(1, N):
        par = parents[:, i]
        has = par >= 0
        mask[has, i] |= mask[rows[has], par[has]]
    return mask


def _result(paths: list[list[int]], outs: list[list[int]], bonus: list[bool], device) -> TreeResult:
    D = max((len(p) for p in paths), default=0)
    path = torch.full((len(paths), D), PAD, dtype=torch.long)
    out = torch.full((len(paths), D + 1), PAD, dtype=torch.long)
    for b, (p, o) in enumerate(zip(paths, outs)):
        path[b, :len(p)] = torch.tensor(p, dtype=torch.long)
        out[b, :len(o)] = torch.tensor(o, dtype=torch.long)
    return TreeResult(path.to(device), torch.tensor([len(p) for p in paths], device=device), out.to(device),
                      torch.tensor(bonus, device=device))


def greedy_tree_verify(tokens: torch.Tensor, parents: torch.Tensor, num_nodes, top: torch.Tensor) -> TreeResult:
    """``top [B, N]``: the target's argmax after each node. Longest path of children matching their parent's argmax."""
    B, N = tokens.shape
    n = torch.as_tensor(num_nodes, device=tokens.device)
    valid = torch.arange(N, device=tokens.device)[None] < n[:, None]
    # good[i]: node i is on an accepted path (its token is its parent's argmax, and its parent is good)
    good = torch.zeros(B, N, dtype=torch.bool, device=tokens.device)
    good[:, 0] = True
    for i in range(1, N):
        par = parents[:, i].clamp(min=0)
        ok = valid[:, i] & (parents[:, i] >= 0) & (tokens[:, i] == top.gather(1, par[:, None])[:, 0])
        good[:, i] = ok & good.gather(1, par[:, None])[:, 0]
    depth = tree_depths(parents).masked_fill(~good, -1)
    # the deepest good node, the lowest index among equals (argmax returns the first maximum)
    end = depth.argmax(1).tolist()
    par_host, tok_host, top_host = parents.tolist(), tokens.tolist(), top.tolist()
    paths, outs, bonus = [], [], []
    for b in range(B):
        p, u = [], end[b]
        while u > 0:
            p.append(u)
            u = par_host[b][u]
        p.reverse()
        paths.append(p)
        outs.append([tok_host[b][i] for i in p] + [top_host[b][end[b]]])
        bonus.append(not any(par_host[b][i] == end[b] for i in range(1, int(n[b]))))
    return _result(paths, outs, bonus, tokens.device)


def tree_verify(tokens: torch.Tensor, parents: torch.Tensor, num_nodes, p: torch.Tensor, q: torch.Tensor | None,
                generators: list[torch.Generator | None], wrong_independent_acceptance: bool = False) -> TreeResult:
    """Exact recursive rejection sampling over each row's tree (module docstring). Loops over rows and the nodes of
    one path (host side, a few dozen steps a round), never over the vocabulary."""
    B, N, V = p.shape
    par_host, tok_host = parents.tolist(), tokens.tolist()
    paths, outs, bonus = [], [], []
    for b in range(B):
        g = generators[b]
        children = [[] for _ in range(N)]
        for i in range(1, int(num_nodes[b])):
            children[par_host[b][i]].append(i)
        u, path, out = 0, [], []
        while True:
            r = p[b, u].float()
            nxt = None
            for c in children[u]:
                t = tok_host[b][c]
                qc = None if q is None else q[b, c].float()
                q_t = 1.0 if qc is None else float(qc[t])
                if float(torch.rand((), generator=g, device=p.device)) * q_t < float(r[t]):
                    nxt = c
                    break
                if wrong_independent_acceptance:
                    continue
                # the residual of this step: norm(max(0, r - q_c)); a one-hot q_c removes t
                if qc is None:
                    r = r.clone()
                    r[t] = 0.0
                else:
                    r = (r - qc).clamp(min=0.0)
                total = r.sum()
                r = r / total if total > 0 else p[b, u].float()  # r == q_c exactly: any law of r is r itself
            if nxt is None:  # no child taken: one token from the residual, the round ends here
                out.append(int(torch.multinomial(r, 1, generator=g)))
                bonus.append(not children[u])
                break
            path.append(nxt)
            out.append(tok_host[b][nxt])
            u = nxt
        paths.append(path)
        outs.append(out)
    return _result(paths, outs, bonus, p.device)
