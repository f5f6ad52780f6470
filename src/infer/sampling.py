"""Sampling parameters and the one logits -> probabilities pipeline used everywhere.

Order (Hugging Face's): repetition penalty -> temperature -> top-k -> top-p -> min-p. Temperature 0 is greedy:
the distribution is one-hot on the argmax of the penalised logits; so is any temperature below GREEDY_TEMPERATURE
(as vLLM does below 1e-5): dividing logits by a temperature near 1e-38 overflows float32 and would sample garbage. Speculative decoding applies exactly this
pipeline to the drafter (q) and the target (p), so truncated supports and penalties are accounted for in the
acceptance test. Randomness comes only from each request's own ``torch.Generator``.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field, replace

import torch

from .logits_processors import check_processors
from .structured import KINDS, StructuredOutput

GREEDY_TEMPERATURE = 1e-5  # temperatures below this are greedy (SamplingParams sets them to 0)
SEED_RANGE = (0, 2**64)  # a torch.Generator's seeds; outside them it would overflow or wrap (-1 == 2**64 - 1)
MAX_LOGPROBS = 20  # alternatives a token's logprobs report at most (OpenAI's top_logprobs limit; vLLM's default)


@dataclass
class SamplingParams:
    temperature: float = 1.0
    top_k: int = 0  # <= 0: off
    top_p: float = 1.0
    min_p: float = 0.0
    repetition_penalty: float = 1.0  # multiplicative, on tokens of the prompt or the output (CTRL, HF, vLLM)
    presence_penalty: float = 0.0  # OpenAI's: subtracted once from tokens the output holds
    frequency_penalty: float = 0.0  # OpenAI's: subtracted per occurrence in the output
    # OpenAI's logit_bias: {token id: bias in [-100, 100]} added to those logits before anything else (JSON's string
    # keys are read as ids); -100 bans a token, 100 all but forces it
    logit_bias: dict[int, float] | None = None
    max_tokens: int = 16
    stop: list[str] | str | None = None
    stop_token_ids: list[int] | None = None
    seed: int | None = None
    ignore_eos: bool = False
    logprobs: int | None = None  # report log p(token) under the target (and this many top alternatives); None: off
    # constrain the output (infer.structured): a StructuredOutput, or its fields as a dict, e.g. {"regex": "[0-9]+"}
    structured: StructuredOutput | dict | None = None
    # vLLM's extensions, last (the fields before them keep their places). prompt_logprobs: log p of each prompt token
    # after the first under the target, given the tokens before it (and this many top alternatives); None: off; such
    # a prompt is computed whole (no prefix-cache hit)
    prompt_logprobs: int | None = None
    include_stop_str_in_output: bool = False  # the text keeps the stop string that ended it
    # none of the request's stops (EOS, stop_token_ids, stop strings) ends it before this many tokens; its stop tokens
    # are masked out of the target's law there (ban_early_stops_)
    min_tokens: int = 0
    # vLLM's: this many sequences for the prompt, each its own request (LLM.generate; the server's n): sequence j
    # draws with seed + j where a seed is given
    n: int = 1
    # vLLM's: the output never completes one of these words (infer.token_bans): each a string (tokenized as vLLM
    # does, as written and after a space) or a list of token ids (Hugging Face's bad_words_ids)
    bad_words: list[str | list[int]] | str | None = None
    # vLLM's: the output holds only these tokens (every other logit -inf, before anything else)
    allowed_token_ids: list[int] | None = None
    # vLLM's: the text leaves out special tokens (BOS, chat markers); False writes them as the tokenizer spells them
    skip_special_tokens: bool = True
    # vLLM's: only the prompt's last this many tokens are read (left truncation); -1: as many as the engine's
    # max_seq_len; None: the whole prompt
    truncate_prompt_tokens: int | None = None
    # vLLM's (and Hugging Face's logits_processor): functions (output_ids, logits) -> logits or (prompt_ids,
    # output_ids, logits) -> logits, applied in order to each position's logits before every other rule; they must
    # keep no state across calls (speculation calls them for drafts it then rejects: infer.logits_processors)
    logits_processors: list | None = None

    def __post_init__(self):
        def bad(name, why):
            raise ValueError(f"SamplingParams.{name} {why}, got {getattr(self, name)!r}")

        if not isinstance(self.temperature, (int, float)) or self.temperature != self.temperature or self.temperature < 0:
            bad("temperature", "must be a number >= 0 (0 means greedy)")
        if self.temperature < GREEDY_TEMPERATURE:
            self.temperature = 0.0
        if not isinstance(self.top_k, int) or isinstance(self.top_k, bool):
            bad("top_k", "must be an integer (<= 0 means off)")
        if not isinstance(self.top_p, (int, float)) or not 0.0 < self.top_p <= 1.0:
            bad("top_p", "must be in (0, 1]")
        if not isinstance(self.min_p, (int, float)) or not 0.0 <= self.min_p <= 1.0:
            bad("min_p", "must be in [0, 1]")
        if not isinstance(self.repetition_penalty, (int, float)) or not self.repetition_penalty > 0:
            bad("repetition_penalty", "must be > 0")
        for name in ("presence_penalty", "frequency_penalty"):
            v = getattr(self, name)
            if not isinstance(v, (int, float)) or isinstance(v, bool) or not -2.0 <= v <= 2.0:
                bad(name, "must be a number in [-2, 2] (0: off)")
        if not isinstance(self.max_tokens, int) or isinstance(self.max_tokens, bool) or self.max_tokens < 1:
            bad("max_tokens", "must be an integer >= 1")
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        if any(not isinstance(s, str) or not s for s in self.stop):
            bad("stop", "must be non-empty strings")
        self.stop_token_ids = list(self.stop_token_ids or [])
        if any(not isinstance(t, int) or t < 0 for t in self.stop_token_ids):
            bad("stop_token_ids", "must be non-negative integers")
        if not isinstance(self.min_tokens, int) or isinstance(self.min_tokens, bool) or \
                not 0 <= self.min_tokens <= self.max_tokens:
            bad("min_tokens", f"must be an integer in [0, max_tokens = {self.max_tokens}]")
        if not isinstance(self.n, int) or isinstance(self.n, bool) or self.n < 1:
            bad("n", "must be an integer >= 1")
        if self.seed is not None and self.n > 1 and isinstance(self.seed, int) and self.seed + self.n > SEED_RANGE[1]:
            bad("seed", f"+ n must stay below 2**64 (sequence j draws with seed + j), n = {self.n}")
        k = self.truncate_prompt_tokens
        if k is not None and (not isinstance(k, int) or isinstance(k, bool) or not (k >= 1 or k == -1)):
            bad("truncate_prompt_tokens", "must be an integer >= 1, -1 (the engine's max_seq_len) or None")
        for name in ("include_stop_str_in_output", "skip_special_tokens"):
            if not isinstance(getattr(self, name), bool):
                bad(name, "must be a boolean")
        if self.seed is not None and (not isinstance(self.seed, int) or isinstance(self.seed, bool)
                                      or not SEED_RANGE[0] <= self.seed < SEED_RANGE[1]):
            bad("seed", "must be an integer in [0, 2**64) or None")
        if self.logit_bias is not None:
            try:
                self.logit_bias = {int(t): float(b) for t, b in dict(self.logit_bias).items()}
            except (TypeError, ValueError):
                bad("logit_bias", "must map token ids to numbers")
            if any(t < 0 or not -100.0 <= b <= 100.0 for t, b in self.logit_bias.items()):
                bad("logit_bias", "must map token ids >= 0 to biases in [-100, 100]")
            self.logit_bias = self.logit_bias or None
        for name in ("logprobs", "prompt_logprobs"):
            v = getattr(self, name)
            if v is not None and (not isinstance(v, int) or isinstance(v, bool) or not 0 <= v <= MAX_LOGPROBS):
                bad(name, f"must be an integer in [0, {MAX_LOGPROBS}] or None")
        if isinstance(self.structured, dict):
            try:
                self.structured = StructuredOutput(**self.structured)
            except TypeError as e:
                bad("structured", f"takes the fields {', '.join(KINDS)} ({e})")
        if self.structured is not None and not isinstance(self.structured, StructuredOutput):
            bad("structured", "must be a StructuredOutput, a dict of its fields, or None")
        if self.min_tokens and self.structured is not None:  # a finished grammar allows its end alone: no token left
            bad("min_tokens", "cannot go with structured output (the grammar decides where the output ends)")
        if isinstance(self.bad_words, str):
            self.bad_words = [self.bad_words]
        if self.bad_words is not None:
            words = self.bad_words if isinstance(self.bad_words, (list, tuple)) else [None]
            for w in words:
                if isinstance(w, str) and w.strip():
                    continue
                if isinstance(w, (list, tuple)) and w and all(
                        isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in w):
                    continue
                bad("bad_words", "must be a list of words, each a string with a non-space character or a non-empty "
                                 "list of token ids >= 0")
            self.bad_words = [w if isinstance(w, str) else list(w) for w in words] or None
        if self.allowed_token_ids is not None:
            ids = self.allowed_token_ids
            if not isinstance(ids, (list, tuple, set, frozenset)) or not ids or any(
                    not isinstance(t, int) or isinstance(t, bool) or t < 0 for t in ids):
                bad("allowed_token_ids", "must be a non-empty list of token ids >= 0")
            self.allowed_token_ids = sorted(set(ids))
        self.logits_processors = check_processors(self.logits_processors)
        for name in ("bad_words", "allowed_token_ids"):  # the grammar's mask and these could leave no token at all
            if getattr(self, name) is not None and self.structured is not None:
                bad(name, "cannot go with structured output (restrict the output in the grammar instead)")

    def truncated(self, prompt_ids: list[int], max_len: int) -> list[int]:
        """The prompt as the request reads it: its last ``truncate_prompt_tokens`` tokens (-1: ``max_len``)."""
        return truncate_prompt(prompt_ids, self.truncate_prompt_tokens, max_len)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def penalised(self) -> bool:
        """Whether a penalty reshapes the logits (each needs the row's ``penalty_context``)."""
        return self.repetition_penalty != 1.0 or self.presence_penalty != 0.0 or self.frequency_penalty != 0.0

    def check_vocab(self, vocab_size: int) -> None:
        """ValueError naming ``logit_bias`` or ``allowed_token_ids`` if it names a token outside [0, vocab_size) (the
        engine asks at ``add_request``, before any step, and checks ``bad_words`` there once tokenized; a batch's
        tensors are built only from checked laws)."""
        if self.logit_bias is not None and max(self.logit_bias) >= vocab_size:
            raise ValueError(f"SamplingParams.logit_bias names token {max(self.logit_bias)}, outside the vocabulary "
                             f"[0, {vocab_size})")
        if self.allowed_token_ids is not None and self.allowed_token_ids[-1] >= vocab_size:
            raise ValueError(f"SamplingParams.allowed_token_ids names token {self.allowed_token_ids[-1]}, outside the "
                             f"vocabulary [0, {vocab_size})")

    @property
    def reshapes_logits(self) -> bool:
        """Whether the law sampled is not the model's logits' own (a penalty, a bias or allowed tokens): a greedy row
        then takes the argmax of the reshaped logits, through the pipeline, not the raw argmax. (Bad words and
        min_tokens are bans on the logits themselves, in place, before any path reads them.)"""
        return self.penalised or self.logit_bias is not None or self.allowed_token_ids is not None


def truncate_prompt(prompt_ids: list[int], keep: int | None, max_len: int) -> list[int]:
    """vLLM's ``truncate_prompt_tokens``: the last ``keep`` tokens (-1: ``max_len``; None: all)."""
    if keep is None:
        return prompt_ids
    keep = max_len if keep == -1 else keep
    return prompt_ids[-keep:] if len(prompt_ids) > keep else prompt_ids


def make_generator(seed: int | None, device: torch.device | str = "cpu") -> torch.Generator:
    """A request's private RNG: seeded -> reproducible whatever else runs; unseeded -> fresh entropy."""
    g = torch.Generator(device=device)
    g.manual_seed(seed if seed is not None else random.SystemRandom().randrange(2**63))
    return g


# SamplingBatch.from_params's tensors by the rows' laws (values, vocabulary size, device, inference mode); cleared
# when full
_BATCHES: dict[tuple, SamplingBatch] = {}
_BATCHES_MAX = 256


@dataclass
class SamplingBatch:
    """Per-row parameters as tensors, plus host flags so disabled stages cost nothing."""

    temperature: torch.Tensor  # [N]
    top_k: torch.Tensor  # [N] long, V where off
    top_p: torch.Tensor  # [N]
    min_p: torch.Tensor  # [N]
    repetition_penalty: torch.Tensor  # [N]
    presence_penalty: torch.Tensor  # [N]
    frequency_penalty: torch.Tensor  # [N]
    greedy: torch.Tensor  # [N] bool
    all_greedy: bool
    use_top_k: bool
    use_top_p: bool
    use_min_p: bool
    use_penalty: bool
    rows: list[SamplingParams] = field(repr=False, default_factory=list)
    logit_bias: torch.Tensor | None = None  # [N, V] float32 where a row has one (0 elsewhere), else None

    @classmethod
    def from_params(cls, params: list[SamplingParams], vocab_size: int, device) -> SamplingBatch:
        """The batch of these rows' laws. Its tensors are built once per distinct list of laws (by value, so a
        SamplingParams changed between calls is read anew) and shared after: every consumer reads them, none writes.
        A speculating engine asks every round (and its proposers per subset of rows), and six small tensors a call
        were ~0.1 ms of a sampled round's cold host work. Kept apart by inference mode too: each caller gets the kind
        of tensor it would have built (an inference tensor cannot be saved for autograd, and a compiled draft round
        traced with inference tensors guards on it: another kind would recompile it)."""
        key = (tuple((p.temperature, p.top_k, p.top_p, p.min_p, p.repetition_penalty, p.presence_penalty,
                      p.frequency_penalty, p.logit_bias and tuple(sorted(p.logit_bias.items())),
                      p.allowed_token_ids and tuple(p.allowed_token_ids))
                     for p in params), vocab_size,
               str(device), torch.is_inference_mode_enabled())
        hit = _BATCHES.get(key)
        if hit is None:
            hit = cls._build(params, vocab_size, device)
            if len(_BATCHES) >= _BATCHES_MAX:  # a server's many distinct batches: start over, never grow unbounded
                _BATCHES.clear()
            _BATCHES[key] = hit
        return replace(hit, rows=list(params))  # the shared tensors and flags, with the rows asked for

    @classmethod
    def _build(cls, params: list[SamplingParams], vocab_size: int, device) -> SamplingBatch:
        def t(vals, dtype=torch.float32):
            return torch.tensor(vals, dtype=dtype, device=device)

        bias = None  # the logit bias, and -inf outside a row's allowed tokens (whatever their bias)
        if any(p.logit_bias or p.allowed_token_ids for p in params):
            bias = torch.zeros(len(params), vocab_size)
            for i, p in enumerate(params):
                p.check_vocab(vocab_size)
                for tok, b in (p.logit_bias or {}).items():
                    bias[i, tok] = b
                if p.allowed_token_ids is not None:
                    out = torch.ones(vocab_size, dtype=torch.bool)
                    out[p.allowed_token_ids] = False
                    bias[i, out] = float("-inf")
            bias = bias.to(device)

        return cls(
            temperature=t([p.temperature if p.temperature > 0 else 1.0 for p in params]),
            top_k=t([p.top_k if 0 < p.top_k < vocab_size else vocab_size for p in params], torch.long),
            top_p=t([p.top_p for p in params]),
            min_p=t([p.min_p for p in params]),
            repetition_penalty=t([p.repetition_penalty for p in params]),
            presence_penalty=t([p.presence_penalty for p in params]),
            frequency_penalty=t([p.frequency_penalty for p in params]),
            greedy=t([p.greedy for p in params], torch.bool),
            all_greedy=all(p.greedy for p in params),
            use_top_k=any(0 < p.top_k < vocab_size and not p.greedy for p in params),
            use_top_p=any(p.top_p < 1.0 and not p.greedy for p in params),
            use_min_p=any(p.min_p > 0.0 and not p.greedy for p in params),
            use_penalty=any(p.penalised for p in params),
            rows=list(params),
            logit_bias=bias,
        )

    @property
    def tempered_only(self) -> bool:
        """Every row samples from its plain temperature law, softmax(logits / T): no greedy row, no top-k, top-p,
        min-p or penalty (known from the host's flags, no device sync)."""
        return bool(self.rows) and not (self.use_top_k or self.use_top_p or self.use_min_p or self.use_penalty) \
            and self.logit_bias is None and not any(p.greedy for p in self.rows)

    def expand(self, n: int) -> SamplingBatch:
        """Repeat each row ``n`` times (row-major), e.g. for K+1 verification positions per request."""
        rep = lambda x: x.repeat_interleave(n, dim=0)  # noqa: E731
        return SamplingBatch(rep(self.temperature), rep(self.top_k), rep(self.top_p), rep(self.min_p),
                             rep(self.repetition_penalty), rep(self.presence_penalty), rep(self.frequency_penalty),
                             rep(self.greedy), self.all_greedy, self.use_top_k,
                             self.use_top_p, self.use_min_p, self.use_penalty,
                             [p for p in self.rows for _ in range(n)],
                             None if self.logit_bias is None else rep(self.logit_bias))

    def over(self, ids: torch.Tensor) -> SamplingBatch:
        """The same laws over a draft vocabulary's columns ``ids`` (a drafter's logits there): the bias sliced. A row
        whose allowed tokens all lie outside the columns drafts unbiased there (a law of nothing would be NaN): any q
        is lossless, and the target's p, 0 on every such draft, rejects it."""
        if self.logit_bias is None:
            return self
        bias = self.logit_bias[:, ids]
        if any(p.allowed_token_ids is not None for p in self.rows):
            bias = torch.where(torch.isinf(bias).all(-1, keepdim=True), 0.0, bias)
        return replace(self, logit_bias=bias)


def apply_repetition_penalty(logits: torch.Tensor, seen: torch.Tensor, penalty: torch.Tensor) -> torch.Tensor:
    """logits [N, V]; seen [N, V] bool (token occurred in the context); penalty [N].

    CTRL / Hugging Face rule: a seen token's logit is divided by the penalty if positive, multiplied if negative.
    """
    pen = penalty[:, None]
    scaled = torch.where(logits > 0, logits / pen, logits * pen)
    return torch.where(seen, scaled, logits)


# A row's penalty context, [N, V] int32: how often each token occurs in the row's output, plus IN_PROMPT where it
# occurs in the prompt. One tensor serves the three penalties (repetition: > 0, prompt or output, as HF and vLLM;
# presence and frequency: the output's count, % IN_PROMPT, as OpenAI and vLLM), and a draft extends it by plain
# addition (context + one_hot(draft)): a speculative round's positions each see the context plus the drafts before.
IN_PROMPT = 1 << 24


def penalty_context(seqs: list[list[int]], vocab_size: int, device, output_from: list[int] | None = None
                    ) -> torch.Tensor:
    """[N, V] int32 (``IN_PROMPT``'s layout) for sequences ``seqs`` (prompt + output so far), row i's output
    starting at ``output_from[i]`` (None: no output, every token a prompt's)."""
    n = len(seqs)
    starts = [len(c) for c in seqs] if output_from is None else list(output_from)

    def padded(parts: list[list[int]]) -> torch.Tensor:  # the pads land in a spare column, vocab_size
        width = max(1, max(len(c) for c in parts))
        ids = torch.full((n, width), vocab_size, dtype=torch.long)
        for i, c in enumerate(parts):
            ids[i, : len(c)] = torch.as_tensor(c, dtype=torch.long)
        return ids.to(device)

    ctx = torch.zeros(n, vocab_size + 1, dtype=torch.int32, device=device)
    ctx.scatter_(1, padded([c[:o] for c, o in zip(seqs, starts)]), IN_PROMPT)
    outs = [c[o:] for c, o in zip(seqs, starts)]
    if any(outs):
        idx = padded(outs)
        ctx.scatter_add_(1, idx, torch.ones(idx.shape, dtype=torch.int32, device=device))
    return ctx[:, :vocab_size]


def request_contexts(reqs, vocab_size: int, device) -> torch.Tensor:
    """``penalty_context`` of engine requests (their ``prompt_ids`` and ``output_ids``)."""
    return penalty_context([r.prompt_ids + r.output_ids for r in reqs], vocab_size, device,
                           [len(r.prompt_ids) for r in reqs])


def ban_early_stops_(logits: torch.Tensor, reqs, depth: torch.Tensor | None = None) -> None:
    """min_tokens (vLLM's rule): where a row's token would come before its ``params.min_tokens``-th, its stop tokens
    (EOS, stop_token_ids: ``Request.stops``) get -inf logits, in place, before anything reads them. logits [B, V] (each
    row's next token), [B, T, V] (a verify: position j is the row's next token + j) or a tree's [B, N, V] with
    ``depth`` [B, N] (node i: the next token + its depth). Every path that samples, verifies or drafts against the
    target reads these logits, so the law stays exact under speculation (a drafted stop is rejected there)."""
    for b, r in enumerate(reqs):
        short = r.params.min_tokens - len(r.output_ids)
        if short <= 0 or not r.stops:
            continue
        ids = torch.tensor(sorted(r.stops), device=logits.device)
        if logits.dim() == 2:
            logits[b, ids] = float("-inf")
            continue
        at = depth[b] < short if depth is not None else torch.arange(logits.shape[1], device=logits.device) < short
        logits[b, at.nonzero()[:, :1], ids] = float("-inf")  # [positions, 1] x [ids]: each position's stops


def apply_penalties(logits: torch.Tensor, ctx: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
    """logits [N, V] with each row's penalties applied over its context ``ctx`` [N, V] (``penalty_context``): the
    repetition penalty on every token of the prompt or output, then the output's counts times the frequency penalty
    and, where it holds the token at all, the presence penalty subtracted (vLLM's order; OpenAI's formula)."""
    logits = apply_repetition_penalty(logits, ctx > 0, batch.repetition_penalty)
    counts = (ctx % IN_PROMPT).to(logits.dtype)
    return logits - batch.frequency_penalty[:, None] * counts - batch.presence_penalty[:, None] * (counts > 0)


def logits_to_probs(logits: torch.Tensor, batch: SamplingBatch, context: torch.Tensor | None = None) -> torch.Tensor:
    """logits [N, V] (float32) -> probabilities [N, V] after the logit bias, penalties (over each row's
    ``context``, a ``penalty_context``), temperature, top-k, top-p, min-p.

    Greedy rows come back one-hot on the argmax of the penalised logits. Masked tokens get probability exactly 0.
    """
    logits = logits.float()
    if batch.logit_bias is not None:
        logits = logits + batch.logit_bias
    if batch.use_penalty:
        if context is None:
            raise ValueError("a penalty needs each row's penalty context (sampling.penalty_context)")
        logits = apply_penalties(logits, context, batch)
    if batch.all_greedy:
        return _one_hot_argmax(logits)
    logits = logits / batch.temperature[:, None]
    if batch.use_top_k or batch.use_top_p:
        logits = _top_k_top_p(logits, batch)
    probs = logits.softmax(-1)
    if batch.use_min_p:
        # Drop tokens below min_p x the top probability, then renormalise.
        thresh = batch.min_p[:, None] * probs.max(-1, keepdim=True).values
        probs = torch.where(probs < thresh, 0.0, probs)
        probs = probs / probs.sum(-1, keepdim=True)
    if any(r.greedy for r in batch.rows) if batch.rows else batch.greedy.any():  # the host's flags: no sync
        probs = torch.where(batch.greedy[:, None], _one_hot_argmax(logits), probs)
    return probs


# Top-k / top-p candidates: a row keeps only some of its largest logits, so the vocabulary is not sorted whole (a
# full sort of SmolLM2's 49,152 logits took ~3.6 ms a row on 2 cores, most of a 4.6 ms decode step, and ~10 ms for a
# 5-token verify's rows); torch.topk selects the largest c in order (~0.09 ms at c = 64), c growing x8 from this
# until every top-p row's candidates hold its mass.
TOP_CANDIDATES = 64


def _top_k_top_p(logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
    """logits [N, V] (tempered) -> the same with every token outside each row's top-k and top-p set to -inf.

    By rank (largest first), top-k keeps ranks < top_k and top-p the smallest prefix whose mass reaches top_p: a rank
    goes once the mass strictly before it, over the top-k survivors, already reaches top_p (the first always stays).
    Every token whose logit equals the last kept rank's is kept too, so the kept set does not depend on how a sort
    orders equal logits (bfloat16 logits tie often: a full sort and torch.topk kept different tokens at the top-k
    boundary in half of SmolLM2's rows); Hugging Face's and vLLM's top-k keep ties the same way. Only the largest
    logits are needed: a row's candidates, the top c, decide it once c >= its top_k, or once their mass (normalised
    over the whole row, or over its top-k) reaches its top_p, since every later rank then has at least that mass
    before it. Rows with neither filter keep every token."""
    N, V = logits.shape
    k = batch.top_k  # [N], V where off
    p = batch.top_p if batch.use_top_p else torch.ones_like(batch.top_p)
    filtered = (k < V) | (p < 1.0)  # [N]
    # (V is the logits' width: a draft vocabulary's rows are narrower than the batch's vocabulary)
    c = min(V, max(TOP_CANDIDATES, int(torch.where(k < V, k, 0).max()) if batch.use_top_k else 0))
    whole = logits.logsumexp(-1) if batch.use_top_p else None  # [N] a row's normaliser where top-k does not cut
    while True:
        vals = logits.topk(c, dim=-1).values  # [N, c], largest first
        ranks = torch.arange(c, device=logits.device)[None, :]
        keep = ranks < k[:, None]
        if not batch.use_top_p:
            break
        # the mass over each row's top-k survivors: normalised over the candidates where top-k cut within them,
        # else over the whole row
        within = torch.where(keep, vals, float("-inf"))
        norm = torch.where(k < V, within.logsumexp(-1), whole)  # [N]
        prob = (within - norm[:, None]).exp()  # [N, c], 0 past top-k
        mass = prob.cumsum(-1)
        keep &= (mass - prob < p[:, None]) | (p[:, None] >= 1.0)  # top_p = 1 is off (float32 mass rounds to 1.0)
        # a top-p row is decided once its candidates' mass reaches top_p (or they are the whole row)
        if c == V or bool(((p >= 1.0) | (k <= c) & (k < V) | (mass[:, -1] >= p)).all()):
            break
        c = min(V, 8 * c)
    # keep is a prefix of the ranks (both rules are monotone in rank): its last rank's logit is the row's threshold
    # (a row of -inf only keeps nothing by rank: it stays as it was, and softmax makes it NaN as before)
    threshold = vals.gather(1, (keep.sum(-1, keepdim=True) - 1).clamp_(min=0))  # [N, 1]
    return torch.where(filtered[:, None] & (logits < threshold), float("-inf"), logits)


def argmax(x: torch.Tensor) -> torch.Tensor:
    """``x.argmax(-1)``, the first maximum on ties (NaN: the first NaN), as ``torch.argmax``. It runs once per
    decoded, drafted or verified token. On CPU, eagerly, infer's kernel (kernels/argmax.cpp: two vectorised passes,
    ~10 us over SmolLM2's 49,152 logits against ATen's ~130 us); else ``max``, 2-2.5x faster than ATen's argmax on
    CPU for a [1-8, 8192] row block (5 vs 11 us). Inside a compiled graph inductor writes its own reduction."""
    if x.is_cpu and x.dtype in _KERNEL_DTYPES and x.dim() and x.shape[-1] \
            and not torch.compiler.is_compiling() and (_kernel[0] if _kernel else _find_kernel()):
        return torch.ops.infer.argmax(x)
    return x.max(-1).indices


_KERNEL_DTYPES = (torch.float32, torch.bfloat16)
_kernel: list[bool] = []  # [whether infer's kernels load], asked once (the call is on every token's path)


def _find_kernel() -> bool:
    from . import kernels

    _kernel.append(kernels.available())
    return _kernel[0]


def _one_hot_argmax(logits: torch.Tensor) -> torch.Tensor:
    out = torch.zeros_like(logits)
    return out.scatter_(-1, argmax(logits)[:, None], 1.0)


def sample(probs: torch.Tensor, generators: list[torch.Generator | None], greedy: list[bool] | None = None) -> torch.Tensor:
    """Draw one token per row of ``probs`` [N, V] -> [N] long, each row from its own generator (one uniform a row);
    greedy rows take the argmax, drawing nothing."""
    N = probs.shape[0]
    greedy = greedy or [False] * N
    if all(greedy):
        return argmax(probs)
    u = torch.zeros(N, dtype=torch.float64, device=probs.device)
    for i in range(N):
        if not greedy[i]:
            u[i] = torch.rand((), dtype=torch.float64, generator=generators[i], device=probs.device)
    drawn = inverse_cdf(probs, u)
    return torch.where(torch.as_tensor(greedy, device=probs.device), argmax(probs), drawn) if any(greedy) else drawn


def inverse_cdf(probs: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """probs [N, V] (unnormalised is fine), u [N] uniforms in [0, 1) -> [N] long: the first token whose cumulative
    probability exceeds u x the row's total, i.e. a draw from the row's law. Cumulated in float64, so the law is
    the float32 one to ~1e-16. A zero-probability token is never drawn: its cumulative value equals its
    predecessor's. One uniform a row instead of an exponential race over the vocabulary (argmax p / Exp(1): V
    draws, ~1.1 ms a row for SmolLM2's 49,152 tokens on this CPU, against ~0.1 ms)."""
    cdf = probs.double().cumsum(-1)  # [N, V]
    target = (u.double() * cdf[:, -1])[:, None]
    return torch.searchsorted(cdf, target, right=True).squeeze(1).clamp_(max=probs.shape[-1] - 1)
