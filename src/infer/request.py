"""Per-request state: prompt, output tokens, streamed text, stop conditions and counters.

``append(token)`` is the one place stop conditions are decided (EOS list, stop token ids, stop strings,
max_tokens), so every decoding loop — autoregressive, speculative, batched — ends a sequence identically:
exactly at the first token that triggers a stop, with nothing after it.
"""

from __future__ import annotations

import enum
import itertools
import time
from dataclasses import dataclass, field

import torch

from .logits_processors import bind_processors
from .model.lora import LoRARequest
from .sampling import SamplingParams
from .token_bans import bad_words_ids
from .tokenizer import IncrementalDetokenizer, Tokenizer

_ids = itertools.count()
_arrivals = itertools.count()


def count_per_position(drafted: list[int], accepted: list[int], num_draft: int, num_accepted: int) -> None:
    """One round into per-draft-position counters: positions 0..num_draft-1 drafted, 0..num_accepted-1 accepted."""
    while len(drafted) < num_draft:
        drafted.append(0)
        accepted.append(0)
    for i in range(num_draft):
        drafted[i] += 1
        accepted[i] += i < num_accepted


class RequestStatus(enum.Enum):
    WAITING = "waiting"  # queued (new, or preempted: its K/V was dropped and will be recomputed)
    RUNNING = "running"  # holds KV slots; prefilling (num_computed < num_tokens) or decoding
    FINISHED = "finished"


class Request:
    def __init__(
        self,
        prompt_ids: list[int],
        params: SamplingParams,
        eos_token_ids: list[int] | tuple[int, ...] = (),
        tokenizer: Tokenizer | None = None,
        generator: torch.Generator | None = None,
        request_id: str | None = None,
        prompt: str | None = None,
        grammar=None,
        prediction: list[int] | None = None,
    ):
        if not prompt_ids:
            raise ValueError("prompt is empty: at least one token is needed")
        if params.stop and tokenizer is None:
            raise ValueError("stop strings need a tokenizer to detokenize the output")
        self.request_id = request_id if request_id is not None else f"req-{next(_ids)}"
        self.prompt = prompt
        self.prompt_ids = list(prompt_ids)
        self.params = params
        self.generator = generator
        # structured output (infer.structured.Matcher): its state is output_ids, advanced here; None: unconstrained
        self.grammar = grammar
        # OpenAI's predicted output: token ids the output is expected to repeat, a copy source for the suffix
        # proposers' drafts (their own tree of the request); speed only, the output is the same without it
        self.prediction = list(prediction) if prediction else None
        self.eos = frozenset(() if params.ignore_eos else eos_token_ids)
        self.stop_ids = frozenset(params.stop_token_ids)
        self.stops = self.eos | self.stop_ids  # the tokens that end it (masked before params.min_tokens)
        # the token sequences the output never completes (params.bad_words, tokenized: infer.token_bans)
        self.bad_words = bad_words_ids(params.bad_words, tokenizer) if params.bad_words else None
        # params.logits_processors with their forms read once (infer.logits_processors)
        self.logits_processors = bind_processors(params.logits_processors)
        self.output_ids: list[int] = []
        # log p of each output token and its top alternatives (params.logprobs; runner.emit appends), and of each prompt
        # token given those before it, with its rank in the target's law (1: the likeliest; params.prompt_logprobs; the
        # prefill fills them, the first entry stays None)
        self.logprobs: list[tuple[float, list[tuple[int, float]]]] | None = [] if params.logprobs is not None else None
        self.prompt_logprobs: list[tuple[float, list[tuple[int, float]], int] | None] | None = (
            [None] * len(prompt_ids) if params.prompt_logprobs is not None else None)
        self.text = ""
        self.finish_reason: str | None = None  # "stop" | "length" | "abort"
        self.stop_reason: int | str | None = None  # the token id or stop string that ended it
        self._detok: IncrementalDetokenizer | None = \
            tokenizer.detokenizer(prompt_ids, params.skip_special_tokens) if tokenizer else None
        self._max_stop = max((len(s) for s in params.stop), default=0)
        # speculative counters (stay zero without speculation)
        self.num_draft_tokens = 0
        self.num_accepted_tokens = 0
        self.num_target_forwards = 0
        self.speculation_acceptance_rates: list[float] = []  # per round: accepted / drafted
        self.accepted_per_position: list[int] = []  # [k]: rounds whose draft k was accepted
        self.drafted_per_position: list[int] = []  # [k]: rounds that drafted position k
        self.speculate = True  # False: this request never drafts (plain decoding beside speculating requests)
        # True: the next token is drawn by a plain step, as a prefill draws it (a request admitted with all but its
        # last token in the prefix cache decodes at once: drafted, its seeded draws would differ from the same
        # request's where nothing was cached; a one-token prompt, never cached, drafts from its first step)
        self.plain_next = False
        self.priority = 0  # scheduling_policy "priority": lower is admitted first, preempted last
        # the LoRA adapter the target applies to this request's rows (its slot: engine.adapters; 0: none), its name
        # and directory, and the prefix cache's salt for its K/V (unique to the adapter's load)
        self.lora, self.lora_name, self.lora_path, self.lora_salt = 0, None, None, 0
        self.lora_waits = 0  # admissions in a row its adapter found no slot for (Scheduler: LORA_PATIENCE)
        # engine state
        self.status = RequestStatus.WAITING
        self.slot: int | None = None  # target KV slot while running
        self.num_computed = 0  # leading tokens of all_ids() whose K/V the target cache holds
        self.num_cached_tokens: int | None = None  # prompt tokens its first admission found in the prefix cache
        self.num_preemptions = 0
        self.arrival_time = time.monotonic()
        self.seq = next(_arrivals)  # arrival order where two stamps tie
        self.first_token_time: float | None = None  # time.monotonic() at the first append (time to first token)
        self.finish_time: float | None = None  # ... and when a finish reason was set
        self._streamed = 0  # characters of text already handed out by stream_text()

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids)

    def all_ids(self) -> list[int]:
        return self.prompt_ids + self.output_ids

    @property
    def last_token(self) -> int:
        return self.output_ids[-1] if self.output_ids else self.prompt_ids[-1]

    def token_slice(self, start: int, end: int | None = None) -> list[int]:
        """``all_ids()[start:end]`` without building the whole sequence (decode steps read only its tail)."""
        n = len(self.prompt_ids)
        end = self.num_tokens if end is None else min(end, self.num_tokens)
        if start >= n:
            return self.output_ids[start - n:end - n]
        return self.prompt_ids[start:end] + self.output_ids[:max(0, end - n)]

    def append(self, token: int) -> bool:
        """Record one generated token; returns True if the request is now finished."""
        assert not self.finished, "append() after the request finished"
        if self.first_token_time is None:
            self.first_token_time = time.monotonic()
        self.plain_next = False
        self.output_ids.append(token)
        if self.grammar is not None and not self.grammar.accept(token):
            # every token is drawn under its mask, so this is a bug, not bad input: end the request, keep its text
            self._finish("abort", "grammar")
        elif token in self.eos or token in self.stop_ids:
            self._finish("stop", token)  # the stop token is in output_ids, not in the text
        elif self._detok is not None:
            delta = self._detok.push(token)
            if delta:
                self._append_text(delta, len(self.output_ids) >= self.params.min_tokens)
        if not self.finished and len(self.output_ids) >= self.params.max_tokens:
            if self._detok is not None:
                self._append_text(self._detok.flush())
            if not self.finished:
                self._finish("length", None)
        return self.finished

    def _append_text(self, delta: str, stops: bool = True) -> None:
        """Add decoded text; a stop string in the window the delta may complete ends the request (``stops``: once
        params.min_tokens are out, as vLLM checks)."""
        start = max(0, len(self.text) - self._max_stop + 1)
        self.text += delta
        if self._max_stop and stops:
            window = self.text[start:]
            hits = [(window.find(s), s) for s in self.params.stop if s in window]
            if hits:
                idx, s = min(hits)
                # the stop string itself is not part of the output, unless asked (include_stop_str_in_output)
                self.text = self.text[: start + idx + (len(s) if self.params.include_stop_str_in_output else 0)]
                self._finish("stop", s)

    def _finish(self, reason: str, stop_reason) -> None:
        self.finish_reason, self.stop_reason = reason, stop_reason
        self.finish_time = time.monotonic()

    def abort(self) -> None:
        if not self.finished:
            self._finish("abort", None)

    def record_round(self, num_draft: int, num_accepted: int) -> None:
        """Speculation counters for one round (D9)."""
        self.num_draft_tokens += num_draft
        self.num_accepted_tokens += num_accepted
        self.num_target_forwards += 1
        if num_draft:
            self.speculation_acceptance_rates.append(num_accepted / num_draft)
        count_per_position(self.drafted_per_position, self.accepted_per_position, num_draft, num_accepted)

    @property
    def acceptance_rate(self) -> float | None:
        """Mean of the per-round acceptance rates (None before any speculative round)."""
        r = self.speculation_acceptance_rates
        return sum(r) / len(r) if r else None

    def stream_text(self) -> str:
        """Text not yet handed out that can no longer change.

        A stop string may still cut the text back, so the last ``len(longest stop) - 1`` characters are held
        until the request finishes.
        """
        end = len(self.text) if self.finished else max(self._streamed, len(self.text) - max(0, self._max_stop - 1))
        delta, self._streamed = self.text[self._streamed:end], end
        return delta


@dataclass
class StepOutput:
    """One generated token of one request.

    Under speculative decoding a single engine step may produce several StepOutputs for the same request (every
    accepted token and the final recovered/bonus token), in order. ``acceptance_rate`` and the counters are
    filled on the final output of a speculative request only.
    """

    request_id: str
    token_id: int | None  # None only for a request that ends without a new token (abort)
    text: str  # new stable text (may be empty: held back for stop strings or incomplete UTF-8)
    finished: bool = False
    finish_reason: str | None = None
    acceptance_rate: float | None = None
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    num_cached_tokens: int = 0  # on the final output: prompt tokens served from the prefix cache (vLLM's)
    stop_reason: int | str | None = None  # on the final output: the token id or stop string that ended it
    logprob: float | None = None  # log p(token) under the target's (processed) distribution
    top_logprobs: list[tuple[int, float]] | None = None
    # how the token came: "target" (a plain step: prefill or decode), "accepted" (a draft the target accepted),
    # "recovered" (drawn from the residual at a rejection), "bonus" (after every draft of its round was accepted);
    # round_k: drafts in its round (0 for a plain step)
    source: str = "target"
    round_k: int = 0
    # the request's first output only, where it asked for them (SamplingParams.prompt_logprobs): Request.prompt_logprobs
    prompt_logprobs: list[tuple[float, list[tuple[int, float]], int] | None] | None = None


@dataclass
class CompletionOutput:
    """One generated sequence of a prompt (vLLM's): ``RequestOutput.outputs[index]``."""

    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None
    stop_reason: int | str | None = None
    logprobs: list[tuple[float, list[tuple[int, float]]]] | None = None
    cumulative_logprob: float | None = None  # the sum of its tokens' logprobs (where SamplingParams.logprobs asked)

    @classmethod
    def from_request(cls, req: Request, index: int = 0) -> CompletionOutput:
        logprobs = None if req.logprobs is None else list(req.logprobs)
        return cls(index, req.text, list(req.output_ids), req.finish_reason, req.stop_reason, logprobs,
                   None if logprobs is None else sum(lp for lp, _ in logprobs))


@dataclass
class RequestOutput:
    """What the library returns for one prompt: its first sequence in the fields (as a sequence of one reads them),
    every sequence (``SamplingParams.n``) in ``outputs``, as vLLM's ``out.outputs[0].text``."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    text: str
    token_ids: list[int]  # generated ids only
    finish_reason: str | None
    stop_reason: int | str | None = None
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache (vLLM's; 0 with it off)
    # speculative decoding (None without it)
    acceptance_rate: float | None = None
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    mean_accepted_length: float | None = None
    metrics: dict = field(default_factory=dict)
    # SamplingParams.logprobs: (log p, [(token, log p) of the top alternatives]) per generated token; prompt_logprobs:
    # the same per prompt token and its rank, 1 for the likeliest (None for the first, which nothing predicts)
    logprobs: list[tuple[float, list[tuple[int, float]]]] | None = None
    prompt_logprobs: list[tuple[float, list[tuple[int, float]], int] | None] | None = None
    outputs: list[CompletionOutput] = field(default_factory=list)
    lora_request: LoRARequest | None = None  # the adapter it ran with (vLLM's): its name, load number and directory

    @classmethod
    def from_requests(cls, reqs: list[Request], speculative: bool = False) -> RequestOutput:
        """One prompt's n sequences (SamplingParams.n): the first's fields, and each in ``outputs``."""
        out = cls.from_request(reqs[0], speculative)
        out.outputs = [CompletionOutput.from_request(r, j) for j, r in enumerate(reqs)]
        return out

    @classmethod
    def from_request(cls, req: Request, speculative: bool = False, metrics: dict | None = None) -> RequestOutput:
        metrics = dict(metrics or {})
        # time.monotonic() stamps, as vLLM's RequestOutput.metrics: TTFT = first_token - arrival; decode speed from
        # first_token to finish (excludes the prompt's prefill)
        metrics.setdefault("arrival_time", req.arrival_time)
        metrics.setdefault("first_token_time", req.first_token_time)
        metrics.setdefault("finish_time", req.finish_time)
        if speculative:
            metrics.setdefault("accepted_per_position", list(req.accepted_per_position))
            metrics.setdefault("drafted_per_position", list(req.drafted_per_position))
            metrics.setdefault("speculation_acceptance_rates", list(req.speculation_acceptance_rates))
        out = cls(req.request_id, req.prompt, req.prompt_ids, req.text, list(req.output_ids), req.finish_reason,
                  req.stop_reason, req.num_cached_tokens or 0, metrics=metrics,
                  logprobs=None if req.logprobs is None else list(req.logprobs),
                  prompt_logprobs=None if req.prompt_logprobs is None else list(req.prompt_logprobs),
                  outputs=[CompletionOutput.from_request(req)],
                  lora_request=LoRARequest(req.lora_name, req.lora_salt, req.lora_path) if req.lora_name else None)
        if speculative:
            out.num_draft_tokens, out.num_accepted_tokens = req.num_draft_tokens, req.num_accepted_tokens
            out.acceptance_rate = req.num_accepted_tokens / req.num_draft_tokens if req.num_draft_tokens else 0.0
            out.mean_accepted_length = (len(req.output_ids) / req.num_target_forwards
                                        if req.num_target_forwards else None)
        return out
