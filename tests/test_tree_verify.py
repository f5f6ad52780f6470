"""Tree verification (spec_decode/tree_verify.py), as pure functions: the tree attention mask and depths, greedy
tree verification (a chain tree agrees with the chain verifier), and the exact law of the first two tokens a
sampled tree round emits (chi-square against p(x1) p(x2 | x1), at temperature 1 and under top-k / top-p, with
drafted and with deterministic, even duplicated, children), which the shortcut of accepting siblings
independently fails."""

import pytest
import torch
from scipy.stats import chisquare

from infer.sampling import SamplingBatch, SamplingParams, logits_to_probs
from infer.spec_decode.tree_verify import ancestor_mask, greedy_tree_verify, tree_depths, tree_verify
from infer.spec_decode.verify import greedy_verify

#            0
#          /   \
#         1     2
#        / \     \
#       3   4     5
PARENTS = torch.tensor([[-1, 0, 0, 1, 1, 2]])


def test_depths_and_ancestor_mask():
    assert tree_depths(PARENTS).tolist() == [[0, 1, 1, 2, 2, 2]]
    m = ancestor_mask(PARENTS)[0]
    assert m[3].nonzero().flatten().tolist() == [0, 1, 3]
    assert m[5].nonzero().flatten().tolist() == [0, 2, 5]
    assert not m[1, 2] and not m[4, 3]  # siblings never see each other


def test_greedy_tree_verify_follows_the_argmax():
    tokens = torch.tensor([[9, 7, 8, 1, 2, 3]])
    top = torch.tensor([[8, 0, 3, 0, 0, 6]])  # argmax after root: 8 -> node 2; after node 2: 3 -> node 5
    r = greedy_tree_verify(tokens, PARENTS, [6], top)
    assert r.path.tolist() == [[2, 5]] and r.num_accepted.tolist() == [2]
    assert r.output_tokens.tolist() == [[8, 3, 6]] and r.is_bonus.tolist() == [True]
    top = torch.tensor([[7, 4, 0, 0, 0, 0]])  # node 1 accepted, none of its children: recovered 4
    r = greedy_tree_verify(tokens, PARENTS, [6], top)
    assert r.output_tokens.tolist() == [[7, 4]] and r.is_bonus.tolist() == [False]


def test_a_chain_tree_verifies_as_the_chain_does():
    g = torch.Generator().manual_seed(0)
    for _ in range(20):
        drafts = torch.randint(0, 4, (3, 4), generator=g)
        top = torch.randint(0, 4, (3, 5), generator=g)
        tokens = torch.cat([torch.zeros(3, 1, dtype=torch.long), drafts], 1)
        parents = torch.tensor([[-1, 0, 1, 2, 3]] * 3)
        tree = greedy_tree_verify(tokens, parents, [5, 5, 5], top)
        chain = greedy_verify(drafts, top, torch.tensor([4, 4, 4]))
        strip = lambda t: [[x for x in row if x >= 0] for row in t.tolist()]  # noqa: E731  (padding widths differ)
        assert strip(tree.output_tokens) == strip(chain.output_tokens)
        assert tree.num_accepted.tolist() == chain.num_accepted.tolist()


V, N = 5, 3000


def _laws(params: SamplingParams, seed: int):
    """A target with explicit laws: p1 = p(x1), p2[a] = p(x2 | x1 = a); and drafter laws q1, q2[a] (different)."""
    g = torch.Generator().manual_seed(seed)
    batch = SamplingBatch.from_params([params], V, "cpu")
    law = lambda logits: logits_to_probs(logits, batch.expand(len(logits)))  # noqa: E731
    p1, p2 = law(2 * torch.randn(1, V, generator=g))[0], law(2 * torch.randn(V, V, generator=g))
    q1, q2 = law(2 * torch.randn(1, V, generator=g))[0], law(2 * torch.randn(V, V, generator=g))
    return p1, p2, q1, q2


def _sample_pairs(p1, p2, q1, q2, drafted: bool, wrong=False) -> torch.Tensor:
    """N tree rounds over the tree above (two children of the root, two / one grandchildren), children drawn
    independently from q (drafted) or the top tokens of q, duplicates included (deterministic). Counts of (x1, x2);
    where a round emits one token, x2 is drawn from p(. | x1), as the next round would."""
    g = torch.Generator().manual_seed(1)
    counts = torch.zeros(V, V)
    for _ in range(N):
        if drafted:
            a, b = torch.multinomial(q1, 2, replacement=True, generator=g).tolist()
            c, d = torch.multinomial(q2[a], 2, replacement=True, generator=g).tolist()
            e = int(torch.multinomial(q2[b], 1, generator=g))
        else:  # deterministic: the top of q, a duplicate sibling, an n-gram-like guess
            a, b = int(q1.argmax()), int(q1.argmax())
            c, d, e = int(q2[a].argmax()), int(q2[a].argsort()[-2]), int(q2[b].argmax())
        tokens = torch.tensor([[0, a, b, c, d, e]])
        p = torch.stack([p1, p2[a], p2[b], p2[c], p2[d], p2[e]])[None]  # rows 3..5: p after 3 tokens (unused below)
        q = torch.stack([q1, q1, q1, q2[a], q2[a], q2[b]])[None] if drafted else None
        r = tree_verify(tokens, PARENTS, [6], p, q, [g], wrong_independent_acceptance=wrong)
        out = [t for t in r.output_tokens[0].tolist() if t >= 0]
        x1 = out[0]
        x2 = out[1] if len(out) > 1 else int(torch.multinomial(p2[x1], 1, generator=g))
        counts[x1, x2] += 1
    return counts


def _pvalue(counts, p1, p2) -> float:
    exact = (p1[:, None] * p2).flatten() * N
    assert counts.flatten()[exact == 0].sum() == 0, "a zero-probability pair was emitted"
    obs = counts.flatten()
    big = exact >= 5
    o = torch.cat([obs[big], obs[~big].sum()[None]])
    e = torch.cat([exact[big], exact[~big].sum()[None]])
    keep = e > 0
    return chisquare(o[keep].numpy(), e[keep].numpy() * o[keep].sum().item() / e[keep].sum().item()).pvalue


PARAMS = {"T=1": SamplingParams(temperature=1.0), "T=0.7+top-k+top-p": SamplingParams(temperature=0.7, top_k=4,
                                                                                       top_p=0.9)}


@pytest.mark.parametrize("drafted", [True, False], ids=["drafted", "deterministic"])
@pytest.mark.parametrize("name", list(PARAMS))
def test_tree_round_emits_the_targets_law(name, drafted):
    p1, p2, q1, q2 = _laws(PARAMS[name], seed=3)
    assert _pvalue(_sample_pairs(p1, p2, q1, q2, drafted), p1, p2) > 0.001


def test_accepting_siblings_independently_is_caught():
    p1, p2, q1, q2 = _laws(PARAMS["T=1"], seed=3)
    assert _pvalue(_sample_pairs(p1, p2, q1, q2, True, wrong=True), p1, p2) < 1e-4
