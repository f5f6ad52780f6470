"""Per-request state: prompt, output tokens, streamed text, stop conditions and counters.

``append(token)`` is the one place stop conditions are decided (EOS list, stop token ids, stop strings,
max_tokens), so every decoding loop — autoregressive, speculative, batched — ends a sequence identically:
exactly at the first token that triggers a stop, with nothing after it.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field

import torch

from .sampling import SamplingParams
from .tokenizer import IncrementalDetokenizer, Tokenizer

_ids = itertools.count()


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
        self.eos = frozenset(() if params.ignore_eos else eos_token_ids)
        self.stop_ids = frozenset(params.stop_token_ids)
        self.output_ids: list[int] = []
        self.text = ""
        self.finish_reason: str | None = None  # "stop" | "length" | "abort"
        self.stop_reason: int | str | None = None  # the token id or stop string that ended it
        self._detok: IncrementalDetokenizer | None = tokenizer.detokenizer(prompt_ids) if tokenizer else None
        self._max_stop = max((len(s) for s in params.stop), default=0)
        # speculative counters (stay zero without speculation)
        self.num_draft_tokens = 0
        self.num_accepted_tokens = 0
        self.num_target_forwards = 0

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids)

    def all_ids(self) -> list[int]:
        return self.prompt_ids + self.output_ids

    def append(self, token: int) -> bool:
        """Record one generated token; returns True if the request is now finished."""
        assert not self.finished, "append() after the request finished"
        self.output_ids.append(token)
        if token in self.eos or token in self.stop_ids:
            self._finish("stop", token)  # the stop token is in output_ids, not in the text
        elif self._detok is not None:
            delta = self._detok.push(token)
            if delta:
                self._append_text(delta)
        if not self.finished and len(self.output_ids) >= self.params.max_tokens:
            if self._detok is not None:
                self._append_text(self._detok.flush())
            if not self.finished:
                self._finish("length", None)
        return self.finished

    def _append_text(self, delta: str) -> None:
        start = max(0, len(self.text) - self._max_stop + 1)
        self.text += delta
        if self._max_stop:
            window = self.text[start:]
            hits = [(window.find(s), s) for s in self.params.stop if s in window]
            if hits:
                idx, s = min(hits)
                self.text = self.text[: start + idx]  # the stop string itself is not part of the output
                self._finish("stop", s)

    def _finish(self, reason: str, stop_reason) -> None:
        self.finish_reason, self.stop_reason = reason, stop_reason

    def abort(self) -> None:
        if not self.finished:
            self._finish("abort", None)


@dataclass
class RequestOutput:
    """What the library returns for one prompt."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    text: str
    token_ids: list[int]  # generated ids only
    finish_reason: str | None
    stop_reason: int | str | None = None
    # speculative decoding (None without it)
    acceptance_rate: float | None = None
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    mean_accepted_length: float | None = None
    metrics: dict = field(default_factory=dict)

    @classmethod
    def from_request(cls, req: Request, speculative: bool = False, metrics: dict | None = None) -> RequestOutput:
        out = cls(req.request_id, req.prompt, req.prompt_ids, req.text, list(req.output_ids), req.finish_reason,
                  req.stop_reason, metrics=metrics or {})
        if speculative:
            out.num_draft_tokens, out.num_accepted_tokens = req.num_draft_tokens, req.num_accepted_tokens
            out.acceptance_rate = req.num_accepted_tokens / req.num_draft_tokens if req.num_draft_tokens else 0.0
            out.mean_accepted_length = (len(req.output_ids) / req.num_target_forwards
                                        if req.num_target_forwards else None)
        return out
