"""The public library entry point: ``LLM(model=...).generate(prompts, params)``."""

from __future__ import annotations

import os

import torch

from .cache import SlottedKVCache
from .config import parse_dtype
from .generate import autoregressive_generate, check_fits
from .model.loader import load_model, resolve_model_path
from .request import Request, RequestOutput
from .sampling import SamplingParams, make_generator
from .spec.adaptive import EntropyAdaptiveGamma
from .spec.speculative import check_compatible, speculative_generate
from .tokenizer import Tokenizer


def _spec_metrics(stats) -> dict:
    return {"accepted_per_position": stats.accepted_per_position,
            "drafted_per_position": stats.drafted_per_position,
            "expected_acceptance": stats.expected_acceptance,
            "realized_acceptance": stats.realized_acceptance,
            "num_rounds": len(stats.rounds)}


class LLM:
    """Load a Llama checkpoint and its tokenizer once; generate for many prompts.

    ``model`` is a checkpoint directory or a hub id already in the local Hugging Face cache (nothing is ever
    downloaded). ``tokenizer`` defaults to the model directory.
    """

    def __init__(self, model: str | os.PathLike, dtype: str | torch.dtype = "float32", device: str = "cpu",
                 tokenizer: str | os.PathLike | None = None, seed: int | None = None,
                 draft_model: str | os.PathLike | None = None, spec_length: int = 5, use_egag: bool = False,
                 gamma_min: int = 1, gamma_max: int | None = None, egag_ema_beta: float = 0.0):
        if not isinstance(spec_length, int) or spec_length < 1:
            raise ValueError(f"spec_length (K) must be an integer >= 1, got {spec_length!r}")
        if use_egag:  # validate the bounds now, not at the first request
            EntropyAdaptiveGamma(gamma_min, spec_length if gamma_max is None else gamma_max, egag_ema_beta)
        self.spec_length, self.use_egag = spec_length, use_egag
        self.egag_args = dict(gamma_min=gamma_min, gamma_max=gamma_max, egag_ema_beta=egag_ema_beta)
        self.model_path = resolve_model_path(model)
        self.dtype = parse_dtype(dtype)
        self.device = torch.device(device)
        self.model = load_model(self.model_path, self.dtype, self.device)
        self.tokenizer = Tokenizer(tokenizer or self.model_path, extra_eos_token_ids=self.model.config.eos_token_ids)
        self.eos_token_ids = self.tokenizer.eos_token_ids
        self.draft_model = None
        if draft_model is not None:
            self.draft_path = resolve_model_path(draft_model)
            self.draft_model = load_model(self.draft_path, self.dtype, self.device)
            check_compatible(self.model, self.draft_model, str(self.model_path), str(self.draft_path))
            draft_tok = Tokenizer(self.draft_path)
            if draft_tok.hf.get_vocab() != self.tokenizer.hf.get_vocab():
                raise ValueError(f"drafter {self.draft_path} and target {self.model_path} have different tokenizers "
                                 "(token -> id maps differ): speculative decoding needs the same vocabulary")
        self._seed_rng = make_generator(seed, "cpu")  # seeds requests that bring no seed of their own
        self._kv: SlottedKVCache | None = None

    # -- inputs ------------------------------------------------------------------------------------------------
    def _prompt_ids(self, prompt: str | list[int]) -> tuple[str | None, list[int]]:
        if isinstance(prompt, str):
            if not prompt:
                raise ValueError("prompt is empty: at least one token is needed")
            return prompt, self.tokenizer.encode(prompt)
        if isinstance(prompt, (list, tuple)) and all(isinstance(t, int) for t in prompt):
            ids = list(prompt)
            if not ids:
                raise ValueError("prompt is empty: at least one token is needed")
            V = self.model.config.vocab_size
            bad = [t for t in ids if not 0 <= t < V]
            if bad:
                raise ValueError(f"prompt token ids out of range [0, {V}): {bad[:5]}")
            return None, ids
        raise TypeError(f"a prompt is a string or a list of token ids, got {type(prompt).__name__}")

    def _generator(self, params: SamplingParams) -> torch.Generator | None:
        if params.greedy:
            return None
        seed = params.seed if params.seed is not None else int(
            torch.randint(0, 2**62, (1,), generator=self._seed_rng))
        return make_generator(seed, self.device)

    def _cache(self, need: int) -> SlottedKVCache:
        if self._kv is None or self._kv.max_seq_len < need:
            self._kv = SlottedKVCache.for_model(self.model, max(need, 256))
        return self._kv

    def make_requests(self, prompts, sampling_params=None) -> list[Request]:
        if isinstance(prompts, str) or (isinstance(prompts, list) and prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        prompts = list(prompts)
        if sampling_params is None:
            sampling_params = SamplingParams()
        params = [sampling_params] * len(prompts) if isinstance(sampling_params, SamplingParams) else list(sampling_params)
        if len(params) != len(prompts):
            raise ValueError(f"got {len(params)} SamplingParams for {len(prompts)} prompts")
        reqs = []
        for prompt, p in zip(prompts, params):
            text, ids = self._prompt_ids(prompt)
            check_fits(self.model, len(ids), p.max_tokens)  # every prompt is checked before any work starts
            reqs.append(Request(ids, p, self.eos_token_ids, self.tokenizer, self._generator(p), prompt=text))
        return reqs

    # -- generation --------------------------------------------------------------------------------------------
    def generate(self, prompts: str | list[str] | list[int] | list[list[int]],
                 sampling_params: SamplingParams | list[SamplingParams] | None = None,
                 debug: bool | callable = False) -> list[RequestOutput]:
        """One RequestOutput per prompt, in order. Prompts are strings or lists of token ids.

        ``debug`` (speculative only): True prints every round; a callable receives (RoundRecord, Request).
        """
        if debug and self.draft_model is None:
            raise ValueError("debug shows speculative rounds: it needs a draft_model")
        outputs = []
        if self.draft_model is not None:
            for req in self.make_requests(prompts, sampling_params):
                _, stats = speculative_generate(
                    self.model, self.draft_model, req.prompt_ids, req.params, gamma=self.spec_length,
                    eos_token_ids=self.eos_token_ids, tokenizer=self.tokenizer, generator=req.generator,
                    use_egag=self.use_egag, request=req, debug=debug, **self.egag_args)
                outputs.append(RequestOutput.from_request(req, speculative=True, metrics=_spec_metrics(stats)))
            return outputs
        for req in self.make_requests(prompts, sampling_params):
            kv = self._cache(req.num_tokens + req.params.max_tokens)
            autoregressive_generate(self.model, req.prompt_ids, req.params, self.eos_token_ids, self.tokenizer,
                                    req.generator, kv=kv, request=req)
            outputs.append(RequestOutput.from_request(req))
        return outputs

    def chat(self, messages: list[dict], sampling_params: SamplingParams | None = None) -> RequestOutput:
        """Apply the checkpoint's chat template to one conversation and generate the assistant's reply."""
        ids = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True)
        return self.generate([ids], sampling_params)[0]
