"""The public library entry point: ``LLM(model=...).generate(prompts, params)``, on the serving engine."""

from __future__ import annotations

import os

import torch

from .engine import Engine, EngineConfig
from .request import Request, RequestOutput
from .sampling import SamplingParams


class LLM:
    """Load a Llama checkpoint (and optionally a drafter) once; generate for many prompts, batched.

    ``model`` is a checkpoint directory or a hub id already in the local Hugging Face cache (nothing is ever
    downloaded). Passing ``draft_model`` turns speculative decoding on. Any other EngineConfig field
    (``kv_cache_backend``, ``max_batch_size``, ``enable_prefix_caching``, ...) can be given as a keyword.
    """

    def __init__(self, model: str | os.PathLike, dtype: str | torch.dtype = "float32", device: str = "cpu",
                 tokenizer: str | os.PathLike | None = None, seed: int | None = None,
                 draft_model: str | os.PathLike | None = None, spec_length: int = 5, **engine_kwargs):
        if isinstance(dtype, torch.dtype):
            dtype = str(dtype).removeprefix("torch.")
        self.config = EngineConfig(model=model, draft_model=draft_model, spec_length=spec_length, dtype=dtype,
                                   device=device, tokenizer=tokenizer, seed=seed, **engine_kwargs)
        self.engine = Engine(self.config)
        self.model, self.draft_model, self.tokenizer = self.engine.model, self.engine.draft_model, self.engine.tokenizer
        self.model_path, self.eos_token_ids = self.engine.model_path, self.engine.eos_token_ids
        self.dtype, self.device, self.spec_length = self.engine.dtype, self.engine.device, spec_length
        self.draft_vocab = getattr(self.engine.runner, "draft_vocab", None)  # set by draft_vocab_size

    # -- inputs ------------------------------------------------------------------------------------------------
    def _prompt_ids(self, prompt: str | list[int]) -> tuple[str | None, list[int]]:
        if isinstance(prompt, str):
            if not prompt:
                raise ValueError("prompt is empty: at least one token is needed")
            return prompt, self.tokenizer.encode(prompt)
        if isinstance(prompt, (list, tuple)) and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
            return None, list(prompt)
        raise TypeError(f"a prompt is a string or a list of token ids, got {type(prompt).__name__}")

    def make_requests(self, prompts, sampling_params=None) -> list[Request]:
        """Validate every prompt first (nothing is queued if one is bad), then queue them all on the engine."""
        if isinstance(prompts, str) or (isinstance(prompts, list) and prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        prompts = list(prompts)
        if sampling_params is None:
            sampling_params = SamplingParams()
        params = [sampling_params] * len(prompts) if isinstance(sampling_params, SamplingParams) else list(sampling_params)
        if len(params) != len(prompts):
            raise ValueError(f"got {len(params)} SamplingParams for {len(prompts)} prompts")
        inputs = [self._prompt_ids(p) for p in prompts]
        for (_, ids), p in zip(inputs, params):
            self.engine.check_request(ids, p)
        return [self.engine.add_request(ids, p, prompt=text) for (text, ids), p in zip(inputs, params)]

    # -- generation --------------------------------------------------------------------------------------------
    def generate(self, prompts: str | list[str] | list[int] | list[list[int]],
                 sampling_params: SamplingParams | list[SamplingParams] | None = None,
                 debug: bool | callable = False) -> list[RequestOutput]:
        """One RequestOutput per prompt, in order. Prompts are strings or lists of token ids.

        ``debug`` (speculative only): True prints every round; a callable receives (RoundRecord, Request).
        """
        if debug and self.draft_model is None:
            raise ValueError("debug shows speculative rounds: it needs a draft_model")
        runner = self.engine.runner
        if debug:
            from .spec.debug import RoundPrinter

            runner.on_round = debug if callable(debug) else RoundPrinter(self.tokenizer)
        try:
            reqs = self.engine.run(self.make_requests(prompts, sampling_params))
        finally:
            if debug:
                runner.on_round = None
        spec = self.draft_model is not None
        return [RequestOutput.from_request(r, speculative=spec) for r in reqs]

    def stream(self, prompt: str | list[int], sampling_params: SamplingParams | None = None):
        """Generate for one prompt, yielding each StepOutput (token id, text delta, ...) as the engine makes it.

        Stopping the iteration early (``break``, or closing the generator) aborts the request and frees its KV.
        """
        (req,) = self.make_requests([prompt], sampling_params)
        try:
            while not req.finished:
                for out in self.engine.step():
                    if out.request_id == req.request_id:
                        yield out
        finally:
            if not req.finished:
                self.engine.abort(req.request_id)

    def chat(self, messages: list[dict], sampling_params: SamplingParams | None = None) -> RequestOutput:
        """Apply the checkpoint's chat template to one conversation and generate the assistant's reply."""
        ids = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True)
        return self.generate([ids], sampling_params)[0]
