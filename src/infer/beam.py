"""Beam search with Hugging Face's semantics as a state machine over next-token log-probs: whoever computes them drives
it (``generate.beam_search_generate`` over its own KV slots; ``LLM.beam_search`` and ``AsyncEngine.beam_search``, the
server's, through engine requests, as vLLM does), so every path picks the same beams from the same laws."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .sampling import MAX_LOGPROBS, SamplingParams


@dataclass
class BeamSearchParams:
    """vLLM's beam-search parameters (``LLM.beam_search``, the server's ``use_beam_search``): ``beam_width`` beams of
    up to ``max_tokens`` tokens, scored with Hugging Face's semantics (``BeamSearch``); deterministic, so
    ``temperature`` must be 0."""

    beam_width: int
    max_tokens: int
    ignore_eos: bool = False
    temperature: float = 0.0
    length_penalty: float = 1.0
    early_stopping: bool = False

    def __post_init__(self):
        for name in ("beam_width", "max_tokens"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ValueError(f"BeamSearchParams.{name} must be an integer >= 1, got {v!r}")
        if self.temperature != 0:
            raise ValueError(f"BeamSearchParams.temperature must be 0 (this beam search is deterministic, Hugging "
                             f"Face's), got {self.temperature!r}")


@dataclass
class BeamHypothesis:
    token_ids: list[int]  # generated ids only
    score: float  # sum of log-probs / (generated length ** length_penalty)


class BeamSearch:
    """One prompt's search: ``num_beams`` running beams of up to ``max_tokens`` tokens.

    Each step keeps the top ``keep = max(2, 1 + n_eos) * num_beams`` continuations so that ``num_beams`` unfinished
    beams survive even when the best ones end; a continuation that ends (EOS or max_tokens) among the top
    ``num_beams`` becomes a finished hypothesis scored ``logprob / length ** length_penalty``. The search stops
    when no running beam can beat the worst kept hypothesis (HF's heuristic for ``early_stopping=False``), when
    ``num_beams`` hypotheses exist and ``early_stopping=True``, or when every continuation has ended.

    Invariant: a step reads only each beam's ``keep`` likeliest tokens (the global top ``keep`` over all beams lies in
    their union), so a caller may pass a row that is -inf outside them (``sparse_logprobs``).
    """

    def __init__(self, num_beams: int, max_tokens: int, eos_token_ids: list[int], length_penalty: float = 1.0,
                 early_stopping: bool | str = False):
        if num_beams < 1:
            raise ValueError(f"num_beams must be >= 1, got {num_beams}")
        if max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {max_tokens}")
        self.nb, self.max_tokens = num_beams, max_tokens
        self.eos = torch.tensor(list(eos_token_ids), dtype=torch.long)
        self.length_penalty, self.early_stopping = length_penalty, early_stopping
        self.keep = max(2, 1 + len(eos_token_ids)) * num_beams
        self.running = torch.zeros(num_beams, max_tokens, dtype=torch.long)  # [nb, max_tokens]
        self.scores = torch.full((num_beams,), -1e9)
        self.scores[0] = 0.0  # only beam 0 is real at first: avoids nb copies of the same continuation
        self.cur = 0  # tokens each running beam holds
        self.finished: list[BeamHypothesis] = []
        self.can_improve = True
        self.done = False

    def beams(self) -> list[list[int]]:
        """The running beams' tokens (one at the first step: the others are copies of it)."""
        n = 1 if self.cur == 0 else self.nb
        return self.running[:n, :self.cur].tolist()

    def step(self, logprobs: torch.Tensor) -> torch.Tensor | None:
        """``logprobs`` [len(beams()), V]: each running beam's next-token log-probs -> for each new beam the old beam
        it continues ([nb]; its token is ``running[:, cur - 1]``), or None once the search has ended."""
        nb, cur = self.nb, self.cur
        V = logprobs.shape[-1]
        scores = (logprobs.float().expand(nb, V) + self.scores[:, None]).view(-1)  # [nb * V]
        top_scores, top_idx = scores.topk(self.keep)
        src, tok = top_idx // V, top_idx % V
        cand = self.running[src]
        cand[:, cur] = tok
        ended = torch.isin(tok, self.eos) | (cur + 1 >= self.max_tokens)  # [keep]
        # Finished hypotheses: only among the top nb candidates, only while improvement is still possible.
        full = len(self.finished) >= nb
        if self.can_improve and not (full and self.early_stopping is True):
            for r in range(nb):
                if ended[r]:
                    self.finished.append(BeamHypothesis(cand[r, :cur + 1].tolist(),
                                                        float(top_scores[r]) / (cur + 1) ** self.length_penalty))
            self.finished.sort(key=lambda h: -h.score)
            del self.finished[nb:]
        live = top_scores + ended.float() * -1e9
        nxt = live.topk(nb).indices
        self.running, self.scores, src_beams = cand[nxt], live[nxt], src[nxt]
        self.cur = cur + 1
        if len(self.finished) >= nb:  # HF: best running score at the most hopeful length vs the worst kept hypothesis
            lp = self.length_penalty
            best_len = self.max_tokens if (self.early_stopping == "never" and lp > 0) else cur + 1
            self.can_improve = self.can_improve and float(self.scores[0]) / best_len ** lp > self.finished[-1].score
        if (not self.can_improve or bool(ended.all()) or (len(self.finished) >= nb and self.early_stopping is True)
                or self.cur >= self.max_tokens):
            self.done = True
            return None
        return src_beams


def engine_search(engine, prompt_ids: list[int], params: BeamSearchParams) -> BeamSearch:
    """The search of ``prompt_ids`` that ``engine`` (an Engine) steps through requests (``step_params``), or
    ValueError naming why it cannot run: the prompt cannot (the engine's checks), or the width needs more
    alternatives a step than a request reports (vLLM's limit too: its max_logprobs)."""
    eos = [] if params.ignore_eos else engine.eos_token_ids
    search = BeamSearch(params.beam_width, params.max_tokens, eos, params.length_penalty, params.early_stopping)
    if search.keep > MAX_LOGPROBS:
        per = search.keep // params.beam_width
        raise ValueError(f"beam width {params.beam_width} too wide: a step reads {per} alternatives per beam (2, or "
                         f"1 + the {len(eos)} EOS ids), at most {MAX_LOGPROBS} in all: a width of at most "
                         f"{MAX_LOGPROBS // per}")
    engine.check_request(list(prompt_ids), SamplingParams(max_tokens=params.max_tokens))
    return search


def step_params(search: BeamSearch) -> SamplingParams:
    """An engine request scoring one running beam (its prompt: the search's prompt and the beam's tokens): one plain
    token, and the ``keep`` likeliest next tokens under the target's own law, all a step reads."""
    return SamplingParams(temperature=0, max_tokens=1, logprobs=search.keep, ignore_eos=True)


def sparse_logprobs(alternatives: list[list[tuple[int, float]]], vocab_size: int | None = None) -> torch.Tensor:
    """[len(alternatives), vocab_size] log-probs, -inf outside each row's (token, log p) alternatives (vocab_size
    None: just wide enough for them; a step's choice does not depend on the width)."""
    if vocab_size is None:
        vocab_size = 1 + max(t for alts in alternatives for t, _ in alts)
    out = torch.full((len(alternatives), vocab_size), float("-inf"))
    for row, alts in zip(out, alternatives):
        if alts:
            ids, lps = zip(*alts)
            row[list(ids)] = torch.tensor(lps)
    return out
