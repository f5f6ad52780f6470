"""Library-level decoding loops for one sequence: autoregressive (greedy / sampled) and beam search."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .cache import KVCachePool, SlottedKVCache
from .model.llama import LlamaForCausalLM
from .request import Request
from .sampling import SamplingBatch, SamplingParams, argmax, logits_to_probs, make_generator, penalty_context, sample
from .token_bans import ban_bad_words_
from .tokenizer import Tokenizer


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


@dataclass
class BeamSearchParams:
    """vLLM's beam-search parameters (``LLM.beam_search``): ``beam_width`` beams of up to ``max_tokens`` tokens,
    scored with Hugging Face's semantics (``beam_search_generate``); deterministic, so ``temperature`` must be 0."""

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
    """Beam search with Hugging Face's semantics (batch of one); returns up to ``num_beams`` hypotheses, best first.

    Each step keeps the top ``max(2, 1 + n_eos) * num_beams`` continuations so that ``num_beams`` unfinished
    beams survive even when the best ones end; a continuation that ends (EOS or max_tokens) among the top
    ``num_beams`` becomes a finished hypothesis scored ``logprob / length ** length_penalty``. The search stops
    when no running beam can beat the worst kept hypothesis (HF's heuristic for ``early_stopping=False``), when
    ``num_beams`` hypotheses exist and ``early_stopping=True``, or when every continuation has ended.
    """
    if num_beams < 1:
        raise ValueError(f"num_beams must be >= 1, got {num_beams}")
    if max_tokens < 1:
        raise ValueError(f"max_tokens must be >= 1, got {max_tokens}")
    check_fits(model, len(prompt_ids), max_tokens)
    eos = torch.tensor(model.config.eos_token_ids if eos_token_ids is None else eos_token_ids, dtype=torch.long)
    device, V, nb = model.device, model.config.vocab_size, num_beams
    keep = max(2, 1 + len(eos)) * nb
    kv = SlottedKVCache.for_model(model, len(prompt_ids) + max_tokens, max_slots=nb)
    slots = [kv.allocate() for _ in range(nb)]
    meta = kv.prepare([slots[0]], [len(prompt_ids)])
    hidden = model(torch.tensor([prompt_ids], device=device), meta.positions, kv, meta)
    logits = model.compute_logits(hidden[:, -1]).expand(nb, V).cpu()
    kv.copy_slot([slots[0]] * (nb - 1), slots[1:])
    running = torch.zeros(nb, max_tokens, dtype=torch.long)
    run_scores = torch.full((nb,), -1e9)
    run_scores[0] = 0.0  # only beam 0 is real at first: avoids nb copies of the same continuation
    finished: list[BeamHypothesis] = []
    can_improve = True
    for cur in range(max_tokens):
        scores = (logits.log_softmax(-1) + run_scores[:, None]).view(-1)  # [nb * V]
        top_scores, top_idx = scores.topk(keep)
        src, tok = top_idx // V, top_idx % V
        cand = running[src]
        cand[:, cur] = tok
        ended = torch.isin(tok, eos) | (cur + 1 >= max_tokens)  # [keep]
        # Finished hypotheses: only among the top nb candidates, only while improvement is still possible.
        full = len(finished) >= nb
        if can_improve and not (full and early_stopping is True):
            gen_len = cur + 1
            for r in range(nb):
                if ended[r]:
                    finished.append(BeamHypothesis(cand[r, :gen_len].tolist(),
                                                   float(top_scores[r]) / gen_len ** length_penalty))
            finished.sort(key=lambda h: -h.score)
            del finished[nb:]
        live = top_scores + ended.float() * -1e9
        nxt = live.topk(nb).indices
        running, run_scores, src_beams = cand[nxt], live[nxt], src[nxt]
        if len(finished) >= nb:  # HF: best running score at the most hopeful length vs the worst kept hypothesis
            best_len = max_tokens if (early_stopping == "never" and length_penalty > 0) else cur + 1
            can_improve = can_improve and float(run_scores[0]) / best_len ** length_penalty > finished[-1].score
        if not can_improve or bool(ended.all()) or (len(finished) >= nb and early_stopping is True):
            break
        kv.copy_slot([slots[i] for i in src_beams.tolist()], slots)  # beam i continues from old beam src_beams[i]
        meta = kv.prepare(slots, [1] * nb)
        hidden = model(running[:, cur:cur + 1].to(device), meta.positions, kv, meta)
        logits = model.compute_logits(hidden[:, -1]).cpu()
    return finished
