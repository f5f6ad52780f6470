"""Verification of drafted tokens: pure, batched functions over tensors.

Shapes: B requests, K drafted tokens each (a row may draft fewer: ``num_draft[b] <= K``), V vocabulary.
Positions of the target's distributions: ``p[:, k]`` is the target's next-token distribution after the context
plus the first k drafts, so ``p[:, k]`` judges draft ``k`` (0-based) and ``p[:, num_draft]`` gives the bonus.

Results are named as vLLM does: *accepted* draft tokens, then one *recovered* token (drawn from the residual
at the first rejection) or, when every draft was accepted, one *bonus* token (drawn from p after the last draft).
``output_tokens [B, K+1]`` holds accepted + final token, padded with -1; ``num_accepted [B]``.

Speculative sampling (Leviathan et al. 2023, Algorithm 1; Chen et al. 2023): accept draft t with probability
min(1, p(t)/q(t)); at the first rejection sample from norm(max(0, p - q)). Then every emitted token is
distributed exactly as p. Greedy rows (temperature 0) accept while the target's argmax equals the draft and
need no randomness. Randomness comes only from each row's own ``torch.Generator``.

Deterministic drafts (an n-gram proposer has no q: ``q=None``) are the case q = one-hot(t): accept t with
probability p(t); at a rejection sample from p with t removed and renormalised. Still exact.

On CPU the exact rule for float32 p runs row by row in C++ (``infer::rejection_sample``, kernels/sample.cpp: the same
uniforms, the same acceptances; the final draw summed in another order, so the same law), ~0.15 ms a sampled round
of 4 drafts where the tensor ops below took ~0.9 ms. The tensor ops remain the rule everywhere else (CUDA, the lossy
rules) and the reference the kernel is tested against.

``policy`` picks the acceptance rule for sampled rows. ``ExactAcceptance`` (the default) is the lossless rule
above; ``TypicalAcceptance`` and ``LenientAcceptance`` are LOSSY opt-ins that accept more drafts and no longer
reproduce p (tests/test_spec_distribution.py shows the chi-square test rejecting them).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .acceptance import AcceptancePolicy, ExactAcceptance

from ..sampling import argmax, inverse_cdf

PAD = -1


@dataclass
class VerifyResult:
    output_tokens: torch.Tensor  # [B, K+1] long: accepted drafts then the recovered/bonus token, -1 padded
    num_accepted: torch.Tensor  # [B] long, 0..num_draft[b]
    is_bonus: torch.Tensor  # [B] bool: the final token is a bonus (all drafts accepted), else recovered
    expected_accept: torch.Tensor | None = None  # [B, K] sum_x min(p, q) per draft position (nan past num_draft)
    p_draft: torch.Tensor | None = None  # [B, K] p(t_k) of each draft under the target
    q_draft: torch.Tensor | None = None  # [B, K] q(t_k) of each draft under the drafter

    @property
    def num_emitted(self) -> torch.Tensor:
        return self.num_accepted + 1


def _num_draft(num_draft, B, K, device) -> torch.Tensor:
    if num_draft is None:
        return torch.full((B,), K, dtype=torch.long, device=device)
    return torch.as_tensor(num_draft, dtype=torch.long, device=device)


def _first_rejection(accept: torch.Tensor) -> torch.Tensor:
    """accept [B, K] bool -> number of leading accepts [B]."""
    return accept.long().cumprod(dim=1).sum(dim=1)


def _assemble(draft_tokens, n, final_token) -> torch.Tensor:
    """[B, K] drafts, [B] accepted count, [B] final token -> [B, K+1] output, -1 padded."""
    B, K = draft_tokens.shape
    idx = torch.arange(K + 1, device=draft_tokens.device)[None, :]
    out = torch.full((B, K + 1), PAD, dtype=torch.long, device=draft_tokens.device)
    out[:, :K] = torch.where(idx[:, :K] < n[:, None], draft_tokens, PAD)
    return out.scatter_(1, n[:, None], final_token[:, None])


def greedy_verify(draft_tokens: torch.Tensor, target_argmax: torch.Tensor, num_draft=None) -> VerifyResult:
    """draft_tokens [B, K], target_argmax [B, K+1] -> accept while argmax == draft; then the target's argmax."""
    B, K = draft_tokens.shape
    nd = _num_draft(num_draft, B, K, draft_tokens.device)
    valid = torch.arange(K, device=draft_tokens.device)[None, :] < nd[:, None]
    n = _first_rejection((target_argmax[:, :K] == draft_tokens) & valid)
    final = target_argmax.gather(1, n[:, None]).squeeze(1)
    return VerifyResult(_assemble(draft_tokens, n, final), n, n == nd)


def greedy_accept(drafts: list[list[int]], num_draft: list[int], target_argmax: list[list[int]]
                  ) -> tuple[list[int], list[list[int]], list[bool]]:
    """greedy_verify's rule on the host: drafts [B][>= n_b], target_argmax [B][K+1] -> (accepted [B], output tokens
    [B][n_b' + 1]: the accepted drafts then the target's argmax after them, bonus [B]). Why a host twin: a greedy
    round has its drafts and the target's argmax on the host anyway (the one sync it needs), and comparing a few
    tokens there takes microseconds where greedy_verify's dozen small tensor ops take ~0.2 ms, ~2% of a round on a
    2-core CPU. tests/test_verify.py holds the two to the same answers."""
    accepted, out, bonus = [], [], []
    for d, k, top in zip(drafts, num_draft, target_argmax):
        n = 0
        while n < k and d[n] == top[n]:
            n += 1
        accepted.append(n)
        out.append(top[:n + 1])  # the accepted drafts are the argmax there
        bonus.append(n == k)
    return accepted, out, bonus

def _uniforms(generators, B, K, device, nd: torch.Tensor) -> torch.Tensor:
    """[B, K] uniforms. With one generator per row, row b draws exactly ``nd[b]`` of them (the rest are 1 and
    never judged), so a request's random stream does not depend on what else shares its batch."""
    if isinstance(generators, torch.Generator) or generators is None:
        return torch.rand(B, K, generator=generators, device=device)
    u = torch.ones(B, K, device=device)
    for b, (g, n) in enumerate(zip(generators, nd.tolist())):
        u[b, :n] = torch.rand(n, generator=g, device=device)
    return u


def _final_uniforms(generators, B, device) -> torch.Tensor:
    """[B] float64: each row's uniform for its final (recovered or bonus) token, drawn after its acceptance ones."""
    if isinstance(generators, torch.Generator) or generators is None:
        return torch.rand(B, dtype=torch.float64, generator=generators, device=device)
    return torch.stack([torch.rand((), dtype=torch.float64, generator=g, device=device) for g in generators])


def _row_uniforms(generators, B, K, device, nd: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """(u [B, K], u_final [B] float64) as _uniforms and _final_uniforms draw them, each row from its own generator
    (nd[b] uniforms, then the final one), for the kernels, which never read u past a row's nd: a lone row's in two
    draws, its u padded with 1 (a sampled round's host work runs cold: ~0.09 ms for the general form's five ops)."""
    if B != 1 or isinstance(generators, torch.Generator) or generators is None:
        nd_t = torch.tensor(nd, device=device)
        return _uniforms(generators, B, K, device, nd_t), _final_uniforms(generators, B, device)
    g, n = generators[0], nd[0]
    u = torch.rand(1, n, generator=g, device=device)
    if n < K:
        u = torch.nn.functional.pad(u, (0, K - n), value=1.0)
    return u, torch.rand(1, dtype=torch.float64, generator=g, device=device)


def over_vocab(q: torch.Tensor, ids: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """q [B, K, N] over a draft vocabulary's token ids [N] -> [B, K, vocab_size], 0 outside them (one scatter)."""
    return torch.zeros(*q.shape[:2], vocab_size, device=q.device).scatter_(2, ids.expand(*q.shape), q)


def _sample_rows(probs: torch.Tensor, generators) -> torch.Tensor:
    """One draw per row of probs [B, V], one uniform a row (sampling.inverse_cdf)."""
    return inverse_cdf(probs, _final_uniforms(generators, probs.shape[0], probs.device))


def _kernel_applies(p, q, policy, K) -> bool:
    """Whether infer::rejection_sample (kernels/sample.cpp) serves this call: exact acceptance on CPU, float32."""
    if not (K and p.is_cpu and p.dtype == torch.float32 and isinstance(policy, ExactAcceptance)
            and (q is None or q.dtype == torch.float32)):
        return False
    from .. import kernels

    return kernels.available()


def draft_diagnostics(draft_tokens, q, p, num_draft=None):
    """Per draft position: p(t), q(t) and the expected acceptance sum_x min(p, q) (nan past num_draft). [B, K] each.

    These do not influence sampling; they let a user compare realised acceptance with what theory predicts.
    """
    B, K = draft_tokens.shape
    valid = torch.arange(K, device=p.device)[None, :] < _num_draft(num_draft, B, K, p.device)[:, None]
    p_t, q_t = _draft_probs(draft_tokens, q, p)
    if q is None:  # deterministic drafts: q is one-hot on t, so sum_x min(p, q) = p(t)
        return p_t, q_t, p_t.masked_fill(~valid, float("nan"))
    expected = torch.minimum(p[:, :K], q).sum(-1).masked_fill(~valid, float("nan"))
    return p_t, q_t, expected


def rejection_sample(
    draft_tokens: torch.Tensor,  # [B, K]
    q: torch.Tensor | None,  # [B, K, V] drafter's probabilities (after the sampling pipeline); None: one-hot drafts
    p: torch.Tensor,  # [B, K+1, V] target's probabilities (same pipeline)
    generators: list[torch.Generator] | torch.Generator | None,
    num_draft=None,  # [B] drafts per row (default K)
    policy: AcceptancePolicy | None = None,
    diagnostics: bool = True,
) -> VerifyResult:
    """Speculative sampling over a batch. With the default ``ExactAcceptance`` every emitted token is distributed
    exactly as p.

    Edge cases are exact: p(t) = 0 always rejects; p == q never rejects (and if rounding makes it reject, the
    residual is 0 everywhere and we sample p, which equals it in exact arithmetic); zero-probability tokens of
    truncated supports (top-k / top-p / min-p) are never drawn from a residual, since max(0, 0 - q) = 0.
    Random draws per row, in order: num_draft[b] uniforms, then one for the final token.
    ``diagnostics=False`` leaves ``expected_accept`` out (sum_x min(p, q): a pass over [B, K, V] that only the
    debug view reads).
    """
    policy = policy or ExactAcceptance()
    B, K = draft_tokens.shape
    device = p.device
    nd = _num_draft(num_draft, B, K, device)
    if _kernel_applies(p, q, policy, K):  # the same rule, row by row in C++ (kernels/sample.cpp)
        u = _uniforms(generators, B, K, device, nd)
        n, tokens = torch.ops.infer.rejection_sample(p, draft_tokens, q, nd, u, _final_uniforms(generators, B, device))
        diag = draft_diagnostics(draft_tokens, q, p, nd) if diagnostics else (None, None, None)
        return VerifyResult(tokens, n, n == nd, diag[2], diag[0], diag[1])
    valid = torch.arange(K, device=device)[None, :] < nd[:, None]  # [B, K]
    if diagnostics:
        p_t, q_t, expected = draft_diagnostics(draft_tokens, q, p, nd)  # [B, K] each
    else:
        p_t, q_t, expected = *_draft_probs(draft_tokens, q, p), None
    u = _uniforms(generators, B, K, device, nd)
    n = _first_rejection(policy.accept(u, p_t, q_t, p[:, :K]) & valid)
    bonus = n == nd
    rows = torch.arange(B, device=device)
    p_n = p[rows, n]  # [B, V]: the distribution that judged the first rejected draft, or the bonus's
    if q is None and isinstance(policy, ExactAcceptance):
        # q_n = one-hot(t_n): norm(max(0, p - q)) is p with t_n removed. Unnormalised is fine (inverse_cdf scales
        # its uniform by the row's total); where nothing is left (p was one-hot on t_n) p itself, as the rule says.
        # A bonus row keeps p_n whole (its t_n entry is written back as it was).
        t_n = draft_tokens[rows, n.clamp(max=K - 1)].clamp(min=0)  # [B]
        final_dist = p_n.clone()
        final_dist[rows, t_n] = torch.where(bonus, p_n[rows, t_n], 0.0)
        final_dist = torch.where(final_dist.sum(-1, keepdim=True) > 0, final_dist, p_n)
    else:
        if q is None:  # q_n = one-hot(t_n) for the other rules, which read it whole
            t_n = draft_tokens[rows, n.clamp(max=K - 1)].clamp(min=0)
            q_n = torch.zeros_like(p_n).index_put_((rows, t_n), torch.ones_like(t_n, dtype=p_n.dtype))
        else:
            q_n = q[rows, n.clamp(max=K - 1)]  # [B, V]
        final_dist = torch.where(bonus[:, None], p_n, policy.residual(p_n, q_n))
    final = _sample_rows(final_dist, generators)
    return VerifyResult(_assemble(draft_tokens, n, final), n, bonus, expected, p_t, q_t)


def rejection_sample_tempered(draft_tokens: torch.Tensor, q: torch.Tensor | None, logits: torch.Tensor,
                              temperature: torch.Tensor, generators, num_draft=None,
                              policy: AcceptancePolicy | None = None,
                              q_ids: torch.Tensor | None = None) -> VerifyResult:
    """``rejection_sample`` for rows that all sample from the plain temperature law: p = softmax(logits / T)
    (logits [B, K+1, V], temperature [B] > 0; sampling.logits_to_probs with no other stage: no top-k, top-p, min-p
    or penalty, no greedy row); ``num_draft`` a tensor or a host list. On CPU with the exact rule one kernel computes
    p at the positions the rule reads (infer::rejection_sample_logits: a position's law where a draft is judged, the
    final token's once) instead of the whole [B, K+1, V] first; the same uniforms in the same order, so the same
    draws as computing p and calling ``rejection_sample`` but where a uniform falls within rounding of a boundary
    (p's last bits). No diagnostics.
    ``q_ids``: q is given over a draft vocabulary, [B, K, N] over these distinct token ids (0 elsewhere:
    Proposal.q_sub), and is read there, never scattered into [B, K, V]."""
    policy = policy or ExactAcceptance()
    B, K = draft_tokens.shape
    if _kernel_applies(logits, q, policy, K):
        nd_host = [K] * B if num_draft is None else \
            num_draft.tolist() if isinstance(num_draft, torch.Tensor) else list(num_draft)
        u, u_final = _row_uniforms(generators, B, K, logits.device, nd_host)
        nd = torch.tensor(nd_host, device=logits.device)
        n, tokens = torch.ops.infer.rejection_sample_logits(logits, temperature, draft_tokens, q, nd, u, u_final,
                                                            q_ids)
        return VerifyResult(tokens, n, n == nd)
    nd = _num_draft(num_draft, B, K, logits.device)
    if q is not None and q_ids is not None:
        q = over_vocab(q, q_ids, logits.shape[-1])
    p = (logits.float() / temperature[:, None, None]).softmax(-1)
    return rejection_sample(draft_tokens, q, p, generators, nd, policy, diagnostics=False)


def _draft_probs(draft_tokens, q, p) -> tuple[torch.Tensor, torch.Tensor]:
    """p(t_k) and q(t_k) of each draft, [B, K] each (q = 1 for deterministic drafts)."""
    K = draft_tokens.shape[1]
    idx = draft_tokens.clamp(min=0)[..., None]
    p_t = p[:, :K].gather(2, idx).squeeze(2)
    return p_t, (torch.ones_like(p_t) if q is None else q.gather(2, idx).squeeze(2))


def verify(draft_tokens, q, p, generators, greedy: list[bool] | torch.Tensor, num_draft=None,
           policy: AcceptancePolicy | None = None, diagnostics: bool = True) -> VerifyResult:
    """Route each row: greedy rows by argmax match (no randomness), the rest by rejection sampling.

    Returns the combined VerifyResult with the diagnostics (p_draft, q_draft, expected_accept) filled in, or with
    ``diagnostics=False`` without them (a round that no debug view reads skips their passes over the vocabulary).
    """
    B, K = draft_tokens.shape
    # a host list's flags route the batch without a device sync (the round passes one)
    all_g, any_g = (all(greedy), any(greedy)) if isinstance(greedy, list) else (None, None)
    greedy = torch.as_tensor(greedy, dtype=torch.bool, device=p.device)
    if all_g is None:
        all_g, any_g = bool(greedy.all()), bool(greedy.any())
    nd = _num_draft(num_draft, B, K, p.device)
    if all_g:
        res = greedy_verify(draft_tokens, argmax(p), nd)
    elif not any_g:
        return rejection_sample(draft_tokens, q, p, generators, nd, policy, diagnostics)  # its diagnostics are whole
    else:
        rows_g, rows_s = greedy.nonzero().squeeze(1), (~greedy).nonzero().squeeze(1)
        gens = [generators[i] for i in rows_s.tolist()] if isinstance(generators, (list, tuple)) else generators
        rg = greedy_verify(draft_tokens[rows_g], argmax(p[rows_g]), nd[rows_g])
        rs = rejection_sample(draft_tokens[rows_s], None if q is None else q[rows_s], p[rows_s], gens, nd[rows_s],
                              policy, diagnostics=False)
        res = VerifyResult(torch.empty(B, K + 1, dtype=torch.long, device=p.device), torch.empty_like(nd),
                           torch.empty_like(greedy))
        for rows, r in ((rows_g, rg), (rows_s, rs)):
            res.output_tokens[rows], res.num_accepted[rows], res.is_bonus[rows] = (
                r.output_tokens, r.num_accepted, r.is_bonus)
    if diagnostics:
        res.p_draft, res.q_draft, res.expected_accept = draft_diagnostics(draft_tokens, q, p, nd)
    return res
