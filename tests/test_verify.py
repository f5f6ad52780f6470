"""spec_decode/verify.py on constructed p and q: the output distribution is p, acceptance is sum_x min(p, q); the
same for deterministic drafts (q=None); the lossy acceptance rules are detectably lossy."""

import pytest
import torch
from scipy.stats import binomtest, chisquare

from infer.spec_decode.acceptance import LenientAcceptance, SkipAdjustment, TypicalAcceptance
from infer.spec_decode.verify import PAD, greedy_verify, rejection_sample, rejection_sample_tempered, verify

N = 40000  # rows = independent trials, one batched call


def run_k1(p_vec, q_vec, policy=None, seed=0):
    """One-draft speculative sampling N times: draft t ~ q, verify against p. Returns (tokens, accepted)."""
    g = torch.Generator().manual_seed(seed)
    V = len(p_vec)
    p = torch.tensor(p_vec, dtype=torch.float32)
    q = torch.tensor(q_vec, dtype=torch.float32)
    drafts = torch.multinomial(q.expand(N, V), 1, replacement=True, generator=g)  # [N, 1]
    P = torch.stack([p, p])[None].expand(N, 2, V)  # bonus distribution = p as well
    res = rejection_sample(drafts, q[None, None].expand(N, 1, V), P, g, policy=policy)
    return res.output_tokens[:, 0], res.num_accepted


CASES = {
    "disjoint supports": ([0.5, 0.5, 0.0, 0.0], [0.0, 0.0, 0.3, 0.7]),
    "p equals q": ([0.1, 0.2, 0.3, 0.4], [0.1, 0.2, 0.3, 0.4]),
    "one-hot q": ([0.25, 0.25, 0.25, 0.25], [0.0, 1.0, 0.0, 0.0]),
    "truncated supports": ([0.6, 0.4, 0.0, 0.0, 0.0], [0.0, 0.2, 0.5, 0.3, 0.0]),  # top-k'd p, top-p'd q
    "overlapping": ([0.05, 0.15, 0.5, 0.3], [0.4, 0.3, 0.2, 0.1]),
}


@pytest.mark.parametrize("case", list(CASES))
def test_output_distribution_is_p(case):
    p, q = CASES[case]
    tokens, _ = run_k1(p, q)
    counts = torch.bincount(tokens, minlength=len(p)).float()
    support = torch.tensor(p) > 0
    assert counts[~support].sum() == 0, "a token outside p's support was emitted"
    expected = torch.tensor(p)[support] * N
    assert chisquare(counts[support].numpy(), expected.numpy()).pvalue > 0.001


@pytest.mark.parametrize("case", list(CASES))
def test_acceptance_frequency_is_sum_min_p_q(case):
    p, q = CASES[case]
    _, accepted = run_k1(p, q)
    alpha = torch.minimum(torch.tensor(p), torch.tensor(q)).sum().item()
    k = int(accepted.sum())
    if alpha in (0.0, 1.0):
        assert k == round(alpha * N)
    else:
        assert binomtest(k, N, alpha).pvalue > 0.001


@pytest.mark.parametrize("policy", [SkipAdjustment(), LenientAcceptance(0.5), TypicalAcceptance()],
                         ids=lambda p: p.name)
def test_the_lossy_rules_are_detectably_lossy(policy):
    """Each lossy rule, on the same check that passes the exact rule: the output is NOT p. Lenience and typical
    acceptance also accept more than sum_x min(p, q) (what they are for)."""
    p, q = CASES["overlapping"]
    tokens, accepted = run_k1(p, q, policy=policy)
    counts = torch.bincount(tokens, minlength=4).float()
    assert chisquare(counts.numpy(), (torch.tensor(p) * N).numpy()).pvalue < 1e-6
    alpha = torch.minimum(torch.tensor(p), torch.tensor(q)).sum().item()
    if not isinstance(policy, SkipAdjustment):
        assert accepted.float().mean() > alpha + 0.05


@pytest.mark.parametrize("case", list(CASES))
def test_deterministic_drafts_without_q(case):
    """q=None (an n-gram's guess t, fixed): accept with probability p(t), else sample p without t. Output is p, and
    the acceptance frequency is p(t)."""
    p_vec, _ = CASES[case]
    V, t = len(p_vec), 1
    p = torch.tensor(p_vec)
    g = torch.Generator().manual_seed(2)
    drafts = torch.full((N, 1), t)
    res = rejection_sample(drafts, None, torch.stack([p, p])[None].expand(N, 2, V), g)
    counts = torch.bincount(res.output_tokens[:, 0], minlength=V).float()
    support = p > 0
    assert counts[~support].sum() == 0
    assert chisquare(counts[support].numpy(), (p[support] * N).numpy()).pvalue > 0.001
    k = int(res.num_accepted.sum())
    assert k == round(p_vec[t] * N) if p_vec[t] in (0.0, 1.0) else binomtest(k, N, p_vec[t]).pvalue > 0.001
    # the same guess as an explicit one-hot q gives the same law (and the same draws: one uniform, V exponentials)
    g2 = torch.Generator().manual_seed(2)
    one_hot = torch.nn.functional.one_hot(drafts, V).float()
    again = rejection_sample(drafts, one_hot, torch.stack([p, p])[None].expand(N, 2, V), g2)
    assert torch.equal(again.output_tokens, res.output_tokens)


def test_multi_position_chain_and_bonus():
    """K=2: the first emitted token follows p0; when both drafts are accepted the bonus follows p2."""
    g = torch.Generator().manual_seed(1)
    V = 3
    p = torch.tensor([[0.2, 0.5, 0.3], [0.6, 0.2, 0.2], [0.1, 0.1, 0.8]])
    q = torch.tensor([[0.3, 0.4, 0.3], [0.5, 0.3, 0.2]])
    drafts = torch.stack([torch.multinomial(q[k].expand(N, V), 1, True, generator=g)[:, 0] for k in range(2)], 1)
    res = rejection_sample(drafts, q[None].expand(N, 2, V), p[None].expand(N, 3, V), g)
    first = torch.bincount(res.output_tokens[:, 0], minlength=V).float()
    assert chisquare(first.numpy(), (p[0] * N).numpy()).pvalue > 0.001
    all_in = res.num_accepted == 2
    assert torch.equal(all_in, res.is_bonus)
    bonus = torch.bincount(res.output_tokens[all_in, 2], minlength=V).float()
    assert chisquare(bonus.numpy(), (p[2] * all_in.sum()).numpy()).pvalue > 0.001


def test_output_layout_and_padding():
    drafts = torch.tensor([[5, 6, 7], [5, 6, 7], [5, 6, 7]])
    argmax = torch.tensor([[5, 6, 7, 9], [5, 1, 7, 9], [0, 6, 7, 9]])
    r = greedy_verify(drafts, argmax)
    assert r.num_accepted.tolist() == [3, 1, 0]
    assert r.output_tokens.tolist() == [[5, 6, 7, 9], [5, 1, PAD, PAD], [0, PAD, PAD, PAD]]
    assert r.is_bonus.tolist() == [True, False, False]


def test_rows_with_fewer_drafts():
    """num_draft < K (near max_tokens): accepting all of a row's drafts takes the bonus at its own position."""
    drafts = torch.tensor([[5, 6, -1], [5, 6, 7]])
    argmax = torch.tensor([[5, 6, 8, 9], [5, 6, 8, 9]])
    r = greedy_verify(drafts, argmax, num_draft=[2, 3])
    assert r.output_tokens.tolist() == [[5, 6, 8, PAD], [5, 6, 8, PAD]]
    assert r.is_bonus.tolist() == [True, False]


def test_mixed_greedy_and_sampled_rows():
    V = 4
    p = torch.tensor([[0.1, 0.6, 0.2, 0.1]] * 2)[None].expand(2, 2, V).clone()
    p[0] = torch.tensor([0.0, 1.0, 0.0, 0.0])  # a greedy row's pipeline output is one-hot
    q = torch.tensor([[0.25] * 4])[None].expand(2, 1, V)
    drafts = torch.tensor([[1], [3]])
    gens = [None, torch.Generator().manual_seed(0)]
    r = verify(drafts, q, p, gens, greedy=[True, False])
    assert r.num_accepted[0] == 1 and r.output_tokens[0].tolist() == [1, 1]  # greedy: match, bonus argmax
    assert r.expected_accept.shape == (2, 1) and r.p_draft[1, 0] == pytest.approx(0.1)


def test_randomness_only_from_the_generator():
    p = torch.tensor([[[0.3, 0.7], [0.5, 0.5]]])
    q = torch.tensor([[[0.9, 0.1]]])
    d = torch.tensor([[0]])
    outs = [rejection_sample(d, q, p, [torch.Generator().manual_seed(3)]).output_tokens for _ in range(2)]
    torch.manual_seed(123)  # the global RNG must not matter
    outs.append(rejection_sample(d, q, p, [torch.Generator().manual_seed(3)]).output_tokens)
    assert torch.equal(outs[0], outs[1]) and torch.equal(outs[0], outs[2])


@pytest.mark.parametrize("with_q", [True, False])
def test_the_cpu_kernel_draws_what_the_torch_rule_draws(monkeypatch, with_q):
    """On CPU the exact rule runs in C++ (infer::rejection_sample, kernels/sample.cpp). With the same generators it
    accepts exactly the drafts the torch rule accepts (the same uniforms, the same comparison) and draws the same
    final tokens but where a uniform falls within rounding of a boundary (the residual is summed in another order):
    rows with fewer drafts than K, truncated supports, bonus and recovered tokens alike. Never a zero-probability
    token."""
    from infer import kernels
    from infer.spec_decode import verify as vmod

    if not kernels.available():
        pytest.skip("no C++ toolchain to build infer's kernels")
    B, K, V = 3000, 3, 50
    g = torch.Generator().manual_seed(7)
    p = torch.rand(B, K + 1, V, generator=g) ** 4
    p[..., V // 2:] *= (torch.rand(B, K + 1, 1, generator=g) < 0.5)  # half the rows' p truncated (top-k'd)
    p /= p.sum(-1, keepdim=True)
    q = torch.softmax(3 * torch.randn(B, K, V, generator=g), -1)
    drafts = torch.multinomial(q.view(-1, V), 1, generator=g).view(B, K)
    nd = torch.randint(1, K + 1, (B,), generator=g)

    def run():
        gens = [torch.Generator().manual_seed(100 + b) for b in range(B)]
        return rejection_sample(drafts, q if with_q else None, p, gens, nd, diagnostics=False)

    fast = run()
    monkeypatch.setattr(vmod, "_kernel_applies", lambda *a: False)
    ref = run()
    assert torch.equal(fast.num_accepted, ref.num_accepted) and torch.equal(fast.is_bonus, ref.is_bonus)
    assert 0 < int(fast.is_bonus.sum()) < B  # both kinds of final token were drawn
    same = (fast.output_tokens == ref.output_tokens).all(1).float().mean()
    assert same > 0.995, same
    final = fast.output_tokens.gather(1, fast.num_accepted[:, None])[:, 0]
    p_final = p[torch.arange(B), fast.num_accepted, final]
    assert (p_final > 0).all()  # a recovered token comes from max(0, p - q) <= p: never outside p's support


def test_the_cpu_kernel_rejects_bad_input():
    from infer import kernels

    if not kernels.available():
        pytest.skip("no C++ toolchain to build infer's kernels")
    p, d, nd = torch.rand(1, 3, 5), torch.tensor([[0, 9]]), torch.tensor([2])
    u, uf = torch.zeros(1, 2), torch.zeros(1, dtype=torch.float64)
    with pytest.raises(RuntimeError, match="outside the vocabulary"):
        torch.ops.infer.rejection_sample(p, d, None, nd, u, uf)
    with pytest.raises(RuntimeError, match="u_final must be float64"):
        torch.ops.infer.rejection_sample(p, d.clamp(max=4), None, nd, u, uf.float())
    with pytest.raises(RuntimeError, match="q must be float32"):
        torch.ops.infer.rejection_sample(p, d.clamp(max=4), torch.rand(1, 2, 4), nd, u, uf)


def _tempered_case(B, K, V, seed):
    g = torch.Generator().manual_seed(seed)
    logits = 3 * torch.randn(B, K + 1, V, generator=g)
    logits[..., V // 2:] -= 30 * (torch.rand(B, K + 1, 1, generator=g) < 0.3)  # some rows nearly truncated
    temperature = 0.3 + torch.rand(B, generator=g)
    q = torch.softmax(logits[:, :K] / temperature[:, None, None] + torch.randn(B, K, V, generator=g), -1)
    drafts = torch.multinomial(q.reshape(-1, V), 1, generator=g).view(B, K)
    nd = torch.randint(1, K + 1, (B,), generator=g)
    return logits, temperature, q, drafts, nd


@pytest.mark.parametrize("with_q", [True, False, "over a draft vocabulary"])
@pytest.mark.parametrize("rows", [1, 2000], ids=["one row a call", "2000 rows a call"])
def test_the_tempered_kernel_draws_what_softmax_and_the_rule_draw(monkeypatch, with_q, rows):
    """rejection_sample_tempered: p = softmax(logits / T) computed by the kernel where the rule reads it
    (infer::rejection_sample_logits), against p computed first and the torch rule. The same uniforms: the same
    acceptances and the same final tokens but where a uniform falls within rounding of a boundary (p's last bits,
    the residual's order of summation); a lone row's passes run over the threads, a batch's rows apart."""
    from infer import kernels
    from infer.spec_decode import verify as vmod

    if not kernels.available():
        pytest.skip("no C++ toolchain to build infer's kernels")
    B, K, V = 2000, 3, 300
    logits, temperature, q, drafts, nd = _tempered_case(B, K, V, 11)
    ids = None
    if with_q == "over a draft vocabulary":  # q over 100 of the 300 tokens, in no order (drafts drawn there)
        ids = torch.randperm(V, generator=torch.Generator().manual_seed(3))[:100]
        q = torch.softmax(torch.randn(B, K, len(ids), generator=torch.Generator().manual_seed(4)), -1)
        drafts = ids[torch.multinomial(q.reshape(-1, len(ids)), 1).view(B, K)]

    def run():
        gens = [torch.Generator().manual_seed(100 + b) for b in range(B)]
        parts = [rejection_sample_tempered(drafts[b:b + rows], q[b:b + rows] if with_q else None, logits[b:b + rows],
                                           temperature[b:b + rows], gens[b:b + rows], nd[b:b + rows], q_ids=ids)
                 for b in range(0, B, rows)]
        return (torch.cat([r.num_accepted for r in parts]), torch.cat([r.is_bonus for r in parts]),
                torch.cat([r.output_tokens for r in parts]))

    fast = run()
    monkeypatch.setattr(vmod, "_kernel_applies", lambda *a: False)
    ref = run()
    assert torch.equal(fast[0], ref[0]) and torch.equal(fast[1], ref[1])
    assert 0 < int(fast[1].sum()) < B  # bonus and recovered tokens both drawn
    same = (fast[2] == ref[2]).all(1).float().mean()
    assert same > 0.995, same


def test_the_tempered_kernel_samples_p():
    """The final token's law under rejection_sample_tempered (kernel path) is p = softmax(logits / T): drafts
    from a q far from p, recovered and bonus tokens together; a lossy rule on the same check fails it."""
    from infer import kernels

    if not kernels.available():
        pytest.skip("no C++ toolchain to build infer's kernels")
    V, T = 6, 0.7
    logits = torch.tensor([[1.0, 0.2, -0.5, 2.0, 0.0, -3.0], [0.3, 0.3, 1.5, -1.0, 0.5, 0.0]])
    p = (logits / T).softmax(-1)
    q = torch.tensor([0.4, 0.3, 0.1, 0.05, 0.1, 0.05])
    g = torch.Generator().manual_seed(5)
    drafts = torch.multinomial(q.expand(N, V), 1, replacement=True, generator=g)
    res = rejection_sample_tempered(drafts, q[None, None].expand(N, 1, V).contiguous(),
                                    logits[None].expand(N, 2, V).contiguous(), torch.full((N,), T), g)
    first = torch.bincount(res.output_tokens[:, 0], minlength=V).float()
    assert chisquare(first.numpy(), (p[0] * N).numpy()).pvalue > 0.001
    bonus = res.num_accepted == 1
    assert binomtest(int(bonus.sum()), N, torch.minimum(p[0], q).sum().item()).pvalue > 0.001
    second = torch.bincount(res.output_tokens[bonus, 1], minlength=V).float()
    assert chisquare(second.numpy(), (p[1] * bonus.sum()).numpy()).pvalue > 0.001
    lossy = rejection_sample_tempered(drafts, q[None, None].expand(N, 1, V).contiguous(),
                                      logits[None].expand(N, 2, V).contiguous(), torch.full((N,), T),
                                      torch.Generator().manual_seed(5), policy=SkipAdjustment())
    counts = torch.bincount(lossy.output_tokens[:, 0], minlength=V).float()
    assert chisquare(counts.numpy(), (p[0] * N).numpy()).pvalue < 1e-6


def test_the_tempered_kernel_rejects_bad_input():
    from infer import kernels

    if not kernels.available():
        pytest.skip("no C++ toolchain to build infer's kernels")
    logits, d, nd = torch.randn(1, 3, 5), torch.tensor([[0, 9]]), torch.tensor([2])
    u, uf, t = torch.zeros(1, 2), torch.zeros(1, dtype=torch.float64), torch.tensor([0.7])
    with pytest.raises(RuntimeError, match="outside the vocabulary"):
        torch.ops.infer.rejection_sample_logits(logits, t, d, None, nd, u, uf)
    with pytest.raises(RuntimeError, match="temperature must be > 0"):
        torch.ops.infer.rejection_sample_logits(logits, torch.tensor([0.0]), d.clamp(max=4), None, nd, u, uf)
    with pytest.raises(RuntimeError, match="temperature must be float32"):
        torch.ops.infer.rejection_sample_logits(logits, t.double(), d.clamp(max=4), None, nd, u, uf)
    with pytest.raises(RuntimeError, match="logits must be float32"):
        torch.ops.infer.rejection_sample_logits(logits.double(), t, d.clamp(max=4), None, nd, u, uf)
    with pytest.raises(RuntimeError, match="q_ids must be distinct"):
        torch.ops.infer.rejection_sample_logits(logits, t, d.clamp(max=4), torch.rand(1, 2, 2), nd, u, uf,
                                                torch.tensor([3, 3]))
    with pytest.raises(RuntimeError, match=r"q must be float32 \[1, 2, 2\]"):
        torch.ops.infer.rejection_sample_logits(logits, t, d.clamp(max=4), torch.rand(1, 2, 5), nd, u, uf,
                                                torch.tensor([1, 3]))


def test_float64_uniforms_take_the_kernel_too():
    """Under a float64 default dtype the acceptance uniforms are float64: the kernel compares in their precision."""
    p = torch.tensor([[[0.3, 0.7], [0.5, 0.5]]])
    d = torch.tensor([[1]])
    old = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    try:
        outs = [rejection_sample(d, None, p, [torch.Generator().manual_seed(s)]).output_tokens for s in range(200)]
    finally:
        torch.set_default_dtype(old)
    accepted = sum(int(o[0, 0] == 1 and o[0, 1] >= 0) for o in outs)
    assert 100 < accepted < 180  # accepted with probability p(1) = 0.7


def test_greedy_accept_on_the_host_agrees_with_greedy_verify():
    """The round's greedy path compares on the host (greedy_accept): the same accepted counts, output tokens and
    bonus flags as the batched tensor rule, over random drafts that agree with the argmax for a random prefix, rows
    of fewer drafts (padding that happens to match included) and rows of none."""
    from infer.spec_decode.verify import greedy_accept

    g = torch.Generator().manual_seed(0)
    for _ in range(200):
        B, K = int(torch.randint(1, 5, (1,), generator=g)), int(torch.randint(1, 7, (1,), generator=g))
        top = torch.randint(0, 4, (B, K + 1), generator=g)  # a small vocabulary: chance matches past a miss
        drafts = top[:, :K].clone()
        miss = torch.rand(B, K, generator=g) < 0.3
        drafts[miss] = (drafts[miss] + 1) % 4
        nd = torch.randint(0, K + 1, (B,), generator=g)
        ref = greedy_verify(drafts, top, nd)
        n, out, bonus = greedy_accept(drafts.tolist(), nd.tolist(), top.tolist())
        assert n == ref.num_accepted.tolist()
        assert bonus == ref.is_bonus.tolist()
        assert out == [row[:m + 1] for row, m in zip(ref.output_tokens.tolist(), n)]
        assert all(PAD not in row for row in out)
