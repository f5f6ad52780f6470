"""Library-level decoding loops for one sequence: autoregressive (greedy / sampled) and beam search."""

from __future__ import annotations

import torch

from .beam import BeamHypothesis, BeamSearch, BeamSearchParams
from .cache import KVCachePool, SlottedKVCache
from .model.llama import LlamaForCausalLM
from .request import Request
from .sampling import SamplingBatch, SamplingParams, argmax, logits_to_probs, make_generator, penalty_context, sample
from .logits_processors import apply_logits_processors_
from .token_bans import ban_bad_words_
from .tokenizer import Tokenizer


# BeamSearchParams lives in infer.beam; infer.generate keeps the name vLLM's users import from here
__all__ = ["BeamHypothesis", "BeamSearchParams", "TokenSampler", "autoregressive_generate", "beam_search_generate",
           "check_fits"]


def check_fits(model: LlamaForCausalLM, prompt_len: int, max_tokens: int) -> None:
    limit = model.config.max_position_embeddings
    if prompt_len == 0:
        raise ValueError("prompt is empty: at least one token is needed")
    if prompt_len + max_tokens > limit:
        raise ValueError(
            f"prompt ({prompt_len} tokens) + max_tokens ({max_tokens}) = {prompt_len + max_tokens} exceeds the "
            f"model's max_position_embeddings ({limit})"
        )


class TokenSampler:
    """Next-token choice for one request: the shared pipeline plus an incrementally kept penalty context (the
    ``context`` given is the prompt; each observed token is output)."""

    def __init__(self, params: SamplingParams, vocab_size: int, device, context: list[int],
                 generator: torch.Generator | None):
        self.batch = SamplingBatch.from_params([params], vocab_size, device)
        self.greedy = params.greedy
        self.generator = generator
        self.seen = penalty_context([context], vocab_size, device) if self.batch.use_penalty else None

    def probs(self, logits: torch.Tensor) -> torch.Tensor:
        """logits [1, V] -> probs [1, V] (the same pipeline speculative decoding applies)."""
        return logits_to_probs(logits, self.batch, self.seen)

    def __call__(self, logits: torch.Tensor) -> torch.Tensor:
        """logits [1, V] -> token [1]."""
        if self.greedy and self.seen is None and self.batch.logit_bias is None:
            return argmax(logits)  # fast path: no probabilities needed
        return sample(self.probs(logits), [self.generator], [self.greedy])

    def observe(self, token: int) -> None:
        if self.seen is not None:
            self.seen[0, token] += 1


@torch.inference_mode()
def autoregressive_generate(
    model: LlamaForCausalLM,
    prompt_ids: list[int],
    params: SamplingParams,
    eos_token_ids: list[int] | None = None,
    tokenizer: Tokenizer | None = None,
    generator: torch.Generator | None = None,
    kv: KVCachePool | None = None,
    request: Request | None = None,
) -> Request:
    """Decode one sequence token by token; returns the finished Request (output_ids, text, finish_reason)."""
    if params.structured is not None:
        raise ValueError("structured output runs on the engine (LLM, Engine): autoregressive_generate takes no grammar")
    if params.logprobs is not None or params.prompt_logprobs is not None:
        raise ValueError("logprobs are reported by the engine (LLM, Engine): autoregressive_generate computes none")
    if params.min_tokens:
        raise ValueError("min_tokens runs on the engine (LLM, Engine): autoregressive_generate masks no stop token")
    if params.n != 1:
        raise ValueError(f"autoregressive_generate decodes one sequence: SamplingParams.n must be 1, got {params.n} "
                         "(LLM.generate returns n)")
    eos = model.config.eos_token_ids if eos_token_ids is None else eos_token_ids
    prompt_ids = params.truncated(prompt_ids, model.config.max_position_embeddings)
    check_fits(model, len(prompt_ids), params.max_tokens)
    device = model.device
    if generator is None and not params.greedy:
        generator = make_generator(params.seed, device)
    req = request or Request(prompt_ids, params, eos, tokenizer, generator)
    kv = kv or SlottedKVCache.for_model(model, len(prompt_ids) + params.max_tokens)
    slot = kv.allocate(len(prompt_ids))
    try:
        sampler = TokenSampler(params, model.config.vocab_size, device, prompt_ids, generator)
        x = torch.tensor([prompt_ids], device=device)
        while True:
            meta = kv.prepare([slot], [x.shape[1]])
            hidden = model(x, meta.positions, kv, meta)
            logits = model.compute_logits(hidden[:, -1])  # [1, V]
            if params.logits_processors:
                apply_logits_processors_(logits, [req])
            if req.bad_words:
                ban_bad_words_(logits, [req])
            tok = sampler(logits)
            t = int(tok)  # host sync: stop conditions are decided on the host
            sampler.observe(t)
            if req.append(t):
                return req
            x = tok.view(1, 1)
    finally:
        kv.free(slot)


@torch.inference_mode()
def beam_search_generate(
    model: LlamaForCausalLM,
    prompt_ids: list[int],
    num_beams: int = 4,
    max_tokens: int = 16,
    eos_token_ids: list[int] | None = None,
    length_penalty: float = 1.0,
    early_stopping: bool | str = False,
) -> list[BeamHypothesis]:
    """Beam search with Hugging Face's semantics (batch of one; ``infer.beam.BeamSearch``) over the model's own KV
    slots, one per beam; returns up to ``num_beams`` hypotheses, best first."""
    search = BeamSearch(num_beams, max_tokens, model.config.eos_token_ids if eos_token_ids is None else eos_token_ids,
                        length_penalty, early_stopping)
    check_fits(model, len(prompt_ids), max_tokens)
    device, nb = model.device, num_beams
    kv = SlottedKVCache.for_model(model, len(prompt_ids) + max_tokens, max_slots=nb)
    slots = [kv.allocate() for _ in range(nb)]
    meta = kv.prepare([slots[0]], [len(prompt_ids)])
    hidden = model(torch.tensor([prompt_ids], device=device), meta.positions, kv, meta)
    logits = model.compute_logits(hidden[:, -1]).cpu()  # [1, V]: every beam is the prompt's at first
    kv.copy_slot([slots[0]] * (nb - 1), slots[1:])
    while (src_beams := search.step(logits.log_softmax(-1))) is not None:
        kv.copy_slot([slots[i] for i in src_beams.tolist()], slots)  # beam i continues from old beam src_beams[i]
        meta = kv.prepare(slots, [1] * nb)
        hidden = model(search.running[:, search.cur - 1:search.cur].to(device), meta.positions, kv, meta)
        logits = model.compute_logits(hidden[:, -1]).cpu()
    return search.finished
