"""The speculative round: propose -> verify -> accept -> roll back -> emit, over a batch of decode requests.

This is the only implementation: the engine's decode step runs it for every batch (``LLM``, ``serve``), and the
library's ``speculative_generate`` runs it for a batch of one.

A round for B decode requests, request b at sequence length L_b (the target's cache holds L_b - 1 tokens: the
last token g_b is unfed):

  K        K_b per request from the spec-length policy (pinned, goodput "auto", EGAG), capped by what the request
           has left: K_b <= max_tokens left - 1 and L_b + K_b <= max_seq_len. All K_b = 0: a plain decode step.
  propose  the proposer's drafts t_b1 .. t_bn_b, n_b <= K_b, with q [B, K, V] or None (deterministic drafts)
  verify   one target forward over [g_b, t_b1 .. t_bn_b], padded to [B, K+1], at positions L_b - 1 ..  -> p
  accept   verify() (pure, batched; a greedy batch: greedy_accept on the host, where the drafts and the argmax
           already are): a_b accepted drafts + one recovered or bonus token per row
  rollback the KV manager truncates the target to L_b + a_b and the drafter to at most that (lengths only)
  emit     tokens one by one through Request.append: stop conditions act on accepted tokens only

p comes from the same sampling pipeline as q, with the penalties' context grown by t_b1..t_bj at
position j, so every emitted token is distributed exactly as autoregressive sampling from the target (Leviathan
et al. 2023) under the default ExactAcceptance. Rows with K_b = 0 are plain decodes inside the same verify pass.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from ..proposers.base import DraftBatch, Proposal, Proposer
from ..request import Request, StepOutput
from ..sampling import SamplingBatch, argmax, ban_early_stops_, logits_to_probs, request_contexts
from ..logits_processors import apply_logits_processors_
from ..token_bans import ban_bad_words_, chain_drafted
from .acceptance import AcceptancePolicy, ExactAcceptance
from .grammar import RoundGrammar, forced_drafts, with_forced
from .tree import MAX_NODES, TreeShape
from .tree_round import tree_fits, tree_round
from .verify import greedy_accept, rejection_sample_tempered, verify


# spec_tree="auto": the shape a lone request gets without a cost model, and the lookahead "auto" reserves
AUTO_TREE = TreeShape(depth=5, width=3, budget=15)
# "auto" gives a tree more nodes than the chain's K only while its verify costs at most this much more than the
# chain's (benchmarks/trees.py: on the 2-vCPU CPU a verify is compute-bound beyond ~3 tokens, and the ~1.3x longer
# accepted length of a 15-node tree does not pay for a verify ~2.7x as dear as the 5-token chain's)
TREE_SLACK = 0.10


def token_source(j: int, n: int, k: int, bonus) -> str:
    """StepOutput.source of the j-th token a row emits in a round of k drafts, n of them accepted."""
    if not k:
        return "target"
    return "accepted" if j < n else "bonus" if bool(bonus) else "recovered"


@dataclass
class RoundRecord:
    """One request's part of one round (the debug view and SpecStats read these)."""

    k: int  # drafts judged this round
    drafted: list[int]
    num_accepted: int
    emitted: list[int]  # tokens actually appended (stops may cut the accepted run)
    bonus: bool  # final token was a bonus (all accepted) rather than recovered
    expected_accept: list[float]  # sum_x min(p, q) per draft position
    p_rejected: float | None = None  # p(t) and q(t) of the rejected draft
    q_rejected: float | None = None
    h_norm: float | None = None  # drafter's normalised entropy (EGAG)
    nodes: int = 0  # a tree round: draft nodes verified (``drafted`` is then the accepted path; k the tree's depth)

    @property
    def tested(self) -> int:
        """Draft positions actually judged: up to and including the first rejection."""
        return min(self.num_accepted + 1, self.k)


class SpeculativeDecoder:
    def __init__(self, runner, kv, proposer: Proposer, spec_length, acceptance: AcceptancePolicy | None = None,
                 tree: TreeShape | str | None = None):
        """``runner``: executes the target (ModelRunner); ``kv``: the KV manager; ``spec_length``: a policy of
        spec_decode.spec_length; ``tree``: None (chains), a TreeShape (trees, spec_decode.tree_round) or "auto"."""
        self.runner, self.kv, self.proposer, self.spec_length = runner, kv, proposer, spec_length
        self.acceptance = acceptance or ExactAcceptance()
        self.tree = tree
        self.on_round = None  # optional callback(RoundRecord, Request), e.g. the debug view
        self.ready = True  # False: decode plainly (the engine's warm-up is still building compiled steps / costs)
        # True: a lone request drafts before ``ready`` all the same where its round runs none of the graphs being
        # built (the target's one-call steps, the drafter's one-call round: Engine._start_warmup decides; _early)
        self.lone_ready = False
        self.profile_now = None  # auto K: measures the cost model (spec_decode.setup.build_decoder)
        self.check_costs = None  # auto K with a stored cost model: checks it once, measures it anew if it is off

    def tree_shape(self, reqs: list[Request], k: int) -> TreeShape | None:
        """This round's tree, or None for a chain. A pinned shape: always (where it fits). "auto" with a cost model
        (auto K): a tree of at least the chain's k nodes, cut by the drafter's scores (at equal verify width the best
        k nodes of a tree accept more than the top-1 chain of k: benchmarks/trees.py), and more nodes as far as the
        cost model prices the wider verify within TREE_SLACK of the chain's (many where extra rows are nearly free,
        a memory-bound target; none on a compute-bound CPU verify). Beside other rows, a tree only where it gets more
        nodes than the chain, else the chain (a tree's draft steps feed w tokens a row). Without a cost model
        (pinned K, EGAG): AUTO_TREE for a lone request, chains beside others."""
        shape = self.tree
        if shape == "auto":
            costs = getattr(self.spec_length, "costs", None)
            shape = AUTO_TREE if costs is None and len(reqs) == 1 else None
            if costs is not None and 0 < k < MAX_NODES:
                B, chain = len(reqs), costs.verify_cost(len(reqs), k + 1)
                n = max(m for m in range(k, MAX_NODES) if m == k or
                        costs.verify_cost(B, m + 1) <= (1 + TREE_SLACK) * chain)
                d = min(k, AUTO_TREE.depth)  # deeper paths rarely survive to their end
                width = min(max(2, -(-n // d)), self.kv.lookahead // d)
                # beside other rows, no more nodes than the chain's: a chain (a tree drafts w tokens a row a step)
                if width >= 2 and (B == 1 or n > k):
                    shape = TreeShape(d, width, min(n, d * width, MAX_NODES - 1))
        if not isinstance(shape, TreeShape) or not self.proposer.supports_tree or not tree_fits(self, reqs, shape):
            return None
        return shape

    def caps(self, reqs: list[Request]) -> list[int]:
        """The most drafts each request can take: one fewer than the tokens it may still emit, and no position past
        max_seq_len (the overflow guard); none when the batch is too large to speculate, the request asked not
        to (``Request.speculate``) or draws its next token as a prefill would (``Request.plain_next``), or before
        the decoder is ``ready`` (its compiled steps and cost model are still being built: engine.warmup), except a
        lone request whose round needs none of them (``_early``)."""
        if not (self.ready or self._early(reqs)) or not self.kv.speculating(len(reqs)):
            return [0] * len(reqs)
        return [max(0, min(self.kv.lookahead, r.params.max_tokens - len(r.output_ids) - 1,
                           self.kv.max_seq_len - r.num_tokens)) if r.speculate and not r.plain_next else 0
                for r in reqs]

    def _early(self, reqs: list[Request]) -> bool:
        """Whether these rows draft before the warm-up is done: one request (``lone_ready``) whose round is the
        one-call one: no grammar (its masks go through the drafter's single steps), no penalty or bias (its
        pipeline drafts in single steps too), no EGAG (it reads the drafter's raw logits); chains only (``decode``
        leaves trees until ready). The tokens are the same either way (every step gives eager's bits); only the
        speed differs."""
        if not self.lone_ready or len(reqs) != 1 or self.spec_length.needs_logits:
            return False
        return reqs[0].grammar is None and not reqs[0].params.reshapes_logits

    @torch.inference_mode()
    def decode(self, reqs: list[Request]) -> list[tuple[Request, StepOutput]]:
        t_in = time.perf_counter()  # the step's wall time, less its timed forwards, is its overhead
        caps = self.caps(reqs)
        ks = self.spec_length.choose(reqs, caps) if any(caps) else caps
        # structured output: where the grammar forces the next tokens, they are the row's drafts (free, exact)
        forced = forced_drafts(reqs, caps) if any(caps) and any(r.grammar is not None for r in reqs) else {}
        ks = [0 if b in forced else k for b, k in enumerate(ks)]
        if max(ks) == 0 and not forced:
            return self._plain(reqs, t_in)
        # trees once ready only: a tree's verify is a compiled graph (the one-call forward takes chains)
        shape = self.tree_shape(reqs, max(ks)) if self.tree is not None and not forced and self.ready else None
        if shape is not None:  # the round's K is each tree's depth, at most the shape's
            return tree_round(self, reqs, [min(k, shape.depth) for k in ks], shape, t_in)
        runner, B, V, dev = self.runner, len(reqs), self.runner.vocab_size, self.runner.device
        params = [r.params for r in reqs]
        fast_greedy = all(p.greedy and not p.reshapes_logits for p in params)
        sampling = None if fast_greedy else SamplingBatch.from_params(params, V, dev)
        seen = request_contexts(reqs, V, dev) if sampling is not None and sampling.use_penalty else None
        gens = [r.generator for r in reqs]
        keep_logits = self.spec_length.needs_logits  # EGAG reads the drafter's raw logits
        K = max(max(ks), max(map(len, forced.values()), default=0))
        grammar = RoundGrammar.of(reqs, K, V)  # structured output: masks for every judged position
        t0 = time.perf_counter()
        # auto K verifies the greedy rows' drafts worth it (spec_length.cut), by the drafter's confidence in each; not
        # where a grammar follows the drafts (its matchers have taken them all)
        policy = self.spec_length
        cut = policy.cuts and grammar is None and (policy.cut_drawn or any(p.greedy for p in params))
        # a lone row's round as long as its drafter's confidence carries it (auto K: spec_length.stop)
        stop = policy.stop(reqs, caps, ks) if hasattr(policy, "stop") and grammar is None and not forced and \
            not keep_logits and B == 1 and ks[0] else None
        prop = self.proposer.propose(DraftBatch(reqs, ks, sampling, seen, gens, V, dev, keep_logits, grammar, cut,
                                                stop)) if max(ks) else Proposal(torch.zeros(B, 0, dtype=torch.long),
                                                                                [0] * B)
        if forced:
            prop = with_forced(prop, forced, K, V)
        t1 = time.perf_counter()
        lens = [r.num_tokens for r in reqs]
        nd = prop.num_draft
        host = prop.drafts.tolist()
        if grammar is not None:  # drafts the grammar forbids are cut (grammar.py: the same law)
            nd = grammar.finish(reqs, host, nd)
        elif cut and prop.confidence is not None:
            nd = policy.cut(reqs, nd, prop.confidence.tolist(), prop.free, [not p.greedy for p in params])
        if max(nd) == 0:  # nothing to verify (no n-gram matched anywhere; every draft forbidden, or cut)
            if grammar is not None:
                grammar.release()
            for r, n in zip(reqs, lens):  # a draft model fed its drafts: back to the target's L - 1 entries
                self.kv.rollback(r, n - 1)
            # the drafting (every draft cut) is a draft round's cost, not the plain step's overhead: counted there, a
            # lone SmolLM2 row's plain-step overhead read 0.5-0.8 ms against ~0.1, and auto K priced plain steps so
            self._time_drafting(prop)
            return self._plain(reqs, t_in + (t1 - t0))
        K = max(nd)
        drafts = prop.drafts[:, :K]  # [B, K]
        # a sampled batch of plain temperature laws is judged where the rule reads p and q (verify's
        # rejection_sample_tempered): q over the drafter's vocabulary as it drew it, p computed there
        tempered = sampling is not None and sampling.tempered_only and self.on_round is None
        q_sub = prop.q_over_draft_vocab() if tempered else None
        q = q_sub[0][:, :K] if q_sub is not None else None if prop.q is None else prop.q[:, :K]  # [B, K, V or N]

        # -- verify: [g, t_1 .. t_n] per row in one target forward -> p_0 .. p_K --------------------------------
        rows = [[r.last_token] + host[b][:nd[b]] for b, r in enumerate(reqs)]
        hidden = runner.forward(runner.model, self.kv.pool, [r.slot for r in reqs], rows, reqs=reqs)  # [B, K+1, H]
        logits = runner.model.compute_logits(hidden, torch.tensor([len(x) for x in rows]))  # [B, K+1, V], pads 0
        if any(p.logits_processors for p in params):  # position j: the request's functions, after the j drafts
            apply_logits_processors_(logits, reqs, chain_drafted([host[b][:nd[b]] for b in range(len(reqs))]))
        if any(p.min_tokens for p in params):  # position j: no stop token before the row's min_tokens
            ban_early_stops_(logits, reqs)
        if any(r.bad_words for r in reqs):  # position j: no bad word completed by the output and the j drafts before
            ban_bad_words_(logits, reqs, chain_drafted([host[b][:nd[b]] for b in range(len(reqs))]))
        if grammar is not None:  # p' = the target restricted to what the grammar allows, at each position
            grammar.apply(reqs, logits)
            grammar.release()  # the matchers follow the emitted tokens from here (Request.append)
        if fast_greedy:  # the drafts and the target's argmax meet on the host (verify.greedy_accept)
            top = argmax(logits).tolist()  # [B][K+1]: the round's one host sync
            n_acc, out_tokens, is_bonus = greedy_accept(host, nd, top)
            res = None
        else:
            if tempered:  # p = softmax(logits / T), read where judged
                res = rejection_sample_tempered(drafts, q, logits, sampling.temperature, gens, nd, self.acceptance,
                                                None if q_sub is None else q_sub[1])
            else:
                nd_t = torch.tensor(nd, device=dev)
                p_seen = None
                if seen is not None:  # position j's penalty context: the row's plus t_1 .. t_j
                    grow = torch.nn.functional.one_hot(drafts, V).cumsum(1).to(seen.dtype)  # [B, K, V]
                    p_seen = torch.cat([seen[:, None], seen[:, None] + grow], 1).view(B * (K + 1), V)
                p = logits_to_probs(logits.view(B * (K + 1), V), sampling.expand(K + 1), p_seen).view(B, K + 1, V)
                res = verify(drafts, q, p, gens, [pr.greedy for pr in params], nd_t, self.acceptance,
                             diagnostics=self.on_round is not None)  # E[accept] etc.: the debug view's alone
            # the round's one host sync
            n_acc, out_tokens, is_bonus = res.num_accepted.tolist(), res.output_tokens.tolist(), res.is_bonus.tolist()
        t2 = time.perf_counter()
        if self.ready:
            self.spec_length.timed(B, sum(map(len, rows)) / B, t2 - t1)  # its real tokens a row: pads skipped
        usual = self._time_drafting(prop)
        forwards_s = t2 - t0

        # -- accept, roll back, emit ---------------------------------------------------------------------------
        outputs = []
        for b, r in enumerate(reqs):
            k, n = nd[b], n_acc[b]
            # keep g and the n accepted drafts; token j was judged by the target's p_j
            emitted = self.settle(r, lens[b], k, n, out_tokens[b], hidden[b, :n + 1], logits[b], range(n + 1),
                                  is_bonus[b], outputs)
            h = self.spec_length.observe(r, k, n, None if prop.logits is None or b in forced else prop.logits[b, :k],
                                         free=bool(prop.free and prop.free[b]))
            if k and self.on_round is not None:
                # greedy: p(t_j) is 1 where the argmax is the draft, else 0, and a draft's q is 1
                expected = [float(top[b][j] == host[b][j]) for j in range(k)] if res is None else \
                    res.expected_accept[b, :k].tolist()
                rec = RoundRecord(k, host[b][:k], n, emitted, is_bonus[b], expected, h_norm=h)
                if n < k:
                    rec.p_rejected, rec.q_rejected = (expected[n], 1.0) if res is None else \
                        (float(res.p_draft[b, n]), float(res.q_draft[b, n]))
                self.on_round(rec, r)
        if usual:  # a lazy prefill's round says nothing about a round's bookkeeping
            self.spec_length.round_overhead(B, True, time.perf_counter() - t_in - forwards_s)
        return outputs

    def settle(self, r: Request, length: int, k: int, n: int, tokens: list[int], kept_states: torch.Tensor,
               logits: torch.Tensor, judged_at, bonus, outputs: list) -> list[int]:
        """One row's round after verification (chain or tree): roll the caches back to g and the n accepted drafts
        (``length`` + n positions), hand the target's states there to the proposer, count the round, and emit
        ``tokens[:n + 1]`` (token j judged at ``logits[judged_at[j]]``) until a stop. Returns the tokens emitted."""
        runner = self.runner
        self.kv.rollback(r, length + n)
        if runner.feature_sink is not None:  # states at g and the accepted drafts only, never at rejected ones
            runner.feature_sink(r, length - 1, kept_states)
        if k:
            r.record_round(k, n)
            runner.stats.record_round(k, n)
        else:
            r.num_target_forwards += 1
        emitted = []
        for j, t in enumerate(tokens[:n + 1]):
            outputs.append((r, runner.emit(r, t, logits[judged_at[j]], token_source(j, n, k, bonus), k)))
            emitted.append(t)
            if r.finished:
                break
        return emitted

    def _time_drafting(self, prop) -> bool:
        """Hand a round's drafting times to auto K -> whether the round was a usual one (timed). The drafter's lazy
        prefills are timed apart (a one-time cost per row); a first step that brought more than a round's worth of
        tokens (after rounds at K = 0) says little about a round's first step. Before ready (_early) nothing is
        timed: the warm-up's compiler shares the cores."""
        if not self.ready:
            return False
        usual = prop.catch_up <= self.kv.lookahead + 1
        if prop.model_steps and usual:
            self.spec_length.drafted(prop.model_rows, prop.model_steps, prop.first_s, prop.steps_s)
        if prop.catch_up_tokens:
            self.spec_length.caught_up(prop.catch_up_tokens, prop.catch_up_s)
        return usual

    def _plain(self, reqs: list[Request], t_in: float) -> list[tuple[Request, StepOutput]]:
        """K = 0 for every row: one ordinary decode step (the drafter catches up lazily when it drafts again)."""
        self.runner.stats.num_plain_decode_steps += 1
        t0 = time.perf_counter()
        tokens, logits = self.runner.decode_forward(reqs)  # tokens are on the host: the step's work is done
        forward_s = time.perf_counter() - t0
        outputs = self.runner.emit_decoded(reqs, tokens, logits)
        if self.ready:  # before, the step may have run eagerly: not what the cost model prices
            self.spec_length.timed(len(reqs), 1, forward_s)
            self.spec_length.round_overhead(len(reqs), False, time.perf_counter() - t_in - forward_s)
        return outputs
