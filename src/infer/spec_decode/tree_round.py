"""The speculative round over token trees: propose trees -> verify all nodes in one forward -> compact -> emit.

A round for B decode requests, request b at sequence length L_b (the target's cache holds L_b - 1 tokens):

  propose  the proposer grows a tree per row (spec_decode.tree) up to depth d_b, cut to the node budget: node 0 is
           the last token g_b, nodes 1 .. N_b - 1 drafts, each after its parent
  verify   one target forward over every row's nodes, written at cache columns L_b - 1 .. L_b + N_b - 2 (as a chain
           of N_b tokens would be), each at rotary position L_b - 1 + depth and seeing the context and its own
           ancestors (TreeAttn) -> p at every node
  accept   greedy_tree_verify / tree_verify (pure): the accepted path, n_b drafts, plus one recovered or bonus token
  compact  the path's nodes' K/V move to positions L_b .. L_b + n_b - 1 (n_b entries a layer, KVCachePool.move);
           the KV manager then truncates to L_b + n_b: the rest of the tree is gone (a length)
  emit     tokens one by one through Request.append, as the chain round does

Lossless: a node's hidden state equals the one the target computes for the same tokens as a sequence (same keys, in
the same order, at the same positions; bit-identical on infer's CPU kernels, so greedy output equals plain
decoding's), and the candidates are deterministic, so "sample p once at a node, follow the child that matches" emits
every token with the target's law (tree_verify). The penalty context of node i grows by the drafts on its path.
"""

from __future__ import annotations

import time

import torch

from ..cache.base import TreeAttn
from ..proposers.base import DraftBatch
from ..sampling import SamplingBatch, argmax, ban_early_stops_, logits_to_probs, request_contexts
from ..logits_processors import apply_logits_processors_
from ..token_bans import ban_bad_words_, tree_drafted
from ..structured import mask_bias
from .grammar import prune_tree
from .tree import TreeShape, to_batch
from .tree_verify import ancestor_mask, greedy_tree_verify, tree_depths, tree_verify


def tree_fits(dec, reqs, shape: TreeShape) -> bool:
    """Whether every row has room for this round's tree: the target writes up to ``budget`` drafts after L - 1, a
    drafter with a cache up to depth x width entries (KVManager.lookahead reserves max(K_max, that))."""
    ahead = shape.depth * shape.width
    return dec.kv.lookahead >= ahead and all(r.num_tokens + ahead <= dec.kv.max_seq_len for r in reqs)


@torch.inference_mode()
def tree_round(dec, reqs, depths: list[int], shape: TreeShape, t_in: float):
    """One round of ``dec`` (a SpeculativeDecoder) over trees up to ``depths[b]`` deep -> [(request, StepOutput)]."""
    from .round import RoundRecord  # round.py imports this module

    runner, kv = dec.runner, dec.kv
    B, V, dev = len(reqs), runner.vocab_size, runner.device
    params = [r.params for r in reqs]
    fast_greedy = all(p.greedy and not p.reshapes_logits for p in params)
    sampling = None if fast_greedy else SamplingBatch.from_params(params, V, dev)
    seen = request_contexts(reqs, V, dev) if sampling is not None and sampling.use_penalty else None
    gens = [r.generator for r in reqs]
    t0 = time.perf_counter()
    grown = dec.proposer.propose_tree(DraftBatch(reqs, depths, sampling, seen, gens, V, dev), shape.width)
    trees = [t.prune(shape.budget, d) for t, d in zip(grown, depths)]
    masks = {}  # structured output: row -> the grammar's mask at each of its nodes (forbidden branches dropped)
    for b, r in enumerate(reqs):
        if r.grammar is not None:
            trees[b], masks[b] = prune_tree(r, trees[b])
    t1 = time.perf_counter()
    if all(len(t) == 1 for t in trees):  # nothing drafted anywhere
        return dec._plain(reqs, t_in)
    tokens, parents, num_nodes = to_batch(trees, dev)  # [B, N]
    N = tokens.shape[1]
    depth = tree_depths(parents)  # [B, N]
    lens = [r.num_tokens for r in reqs]
    base = [n - 1 for n in lens]  # the root's column and position
    attn = TreeAttn(torch.tensor(base, device=dev)[:, None] + depth, base, ancestor_mask(parents))
    hidden = runner.forward(runner.model, kv.pool, [r.slot for r in reqs], [t.tokens for t in trees], attn, reqs)
    logits = runner.model.compute_logits(hidden, torch.tensor([len(t.tokens) for t in trees]))  # [B, N, V], pads 0
    if any(p.logits_processors for p in params):  # node i: the request's functions, after the drafts on its path
        apply_logits_processors_(logits, reqs, tree_drafted(trees))
    if any(p.min_tokens for p in params):  # a node at depth d: no stop token before the row's min_tokens
        ban_early_stops_(logits, reqs, depth)
    if any(r.bad_words for r in reqs):  # node i: no bad word completed by the output and the drafts on its path
        ban_bad_words_(logits, reqs, tree_drafted(trees))
    for b, m in masks.items():  # p' at every node: the target restricted to what the grammar allows after its path
        logits[b, :len(m)] += mask_bias(m, V).to(dev)
    if fast_greedy:
        res = greedy_tree_verify(tokens, parents, num_nodes, argmax(logits))
    else:
        p_seen = None
        if seen is not None:  # node i's penalty context: the sequence plus the drafts on its path (root excluded)
            onehot = torch.nn.functional.one_hot(tokens, V).float()
            onehot[:, 0] = 0.0
            path = torch.bmm(attn.visible.float(), onehot).round().to(seen.dtype)  # [B, N, V]: counts on the path
            p_seen = (seen[:, None] + path).view(B * N, V)
        p = logits_to_probs(logits.view(B * N, V), sampling.expand(N), p_seen).view(B, N, V)
        res = tree_verify(tokens, parents, num_nodes, p, None, gens)
    paths, n_acc, out_tokens = res.path.tolist(), res.num_accepted.tolist(), res.output_tokens.tolist()
    t2 = time.perf_counter()
    costs = getattr(dec.spec_length, "costs", None)
    if costs is not None:  # what a verify of N tokens a row costs now ("auto" weighs trees by it)
        costs.refresh_verify(B, N, t2 - t1)
    runner.stats.tree_rounds += 1
    runner.stats.tree_nodes += sum(num_nodes) - B

    outputs, depth_of = [], depth.max(1).values.tolist()  # a tree's depth: the round's K for its row
    # rows whose drafts were copies (n-gram, suffix tree; asked before the rows grow): auto K counts their acceptance
    # apart and calibrates their confidences, as after a chain round
    free = [d > 0 and dec.proposer.free_drafts(r, d) is not None for r, d in zip(reqs, depths)]
    for b, r in enumerate(reqs):
        n, k = n_acc[b], depth_of[b]
        path = paths[b][:n]
        if path != list(range(1, n + 1)):  # the accepted nodes to the positions their tokens hold
            kv.pool.move(r.slot, [base[b] + i for i in path], [lens[b] + j for j in range(n)])
        # token j was judged at the path's node j - 1 (the root first)
        emitted = dec.settle(r, lens[b], k, n, out_tokens[b], hidden[b, [0] + path], logits[b], [0] + path,
                             res.is_bonus[b], outputs)
        dec.spec_length.observe(r, k, n, None, free=free[b])
        if k and dec.on_round is not None:
            dec.on_round(RoundRecord(k, [trees[b].tokens[i] for i in path], n, emitted, bool(res.is_bonus[b]),
                                     [], nodes=len(trees[b]) - 1), r)  # no E[accept] for a tree
    dec.spec_length.round_overhead(B, True, time.perf_counter() - t_in - (t2 - t0))
    return outputs
