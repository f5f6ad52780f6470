"""Embeddings: a prompt's final hidden states pooled into one vector (vLLM's ``LLM.embed`` and ``/v1/embeddings``,
llama.cpp's ``--embeddings``), from the same checkpoint that generates.

A causal model's state at a position has read the text up to it, so a text's embedding is its last token's state
("last": vLLM's pooling for a generative Llama run as an embedding model) or the mean of every position's ("mean":
llama.cpp's ``--pooling mean``), L2-normalized unless asked not to be (then a dot product is the cosine). The
states are those the model's final norm writes (Hugging Face's ``last_hidden_state``), in float32.

Why a forward of its own and not the engine's prefill: the prompt's states are needed where a prefill keeps only
what the next token needs (its last state, its KV rows), and a prefix cache would skip positions a mean reads. The
forward runs without a KV cache (the model's ``kv=None`` path: causal attention over the given tokens), so it
takes no KV block and leaves every running request's state as it was: the engine runs it between its steps.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .sampling import truncate_prompt

POOLINGS = ("last", "mean")


@dataclass
class PoolingParams:
    """How a prompt becomes one vector. ``truncate_prompt_tokens``: keep the prompt's last n tokens (-1: as many as
    the model's context holds), as SamplingParams' (vLLM's)."""

    pooling: str = "last"
    normalize: bool = True
    truncate_prompt_tokens: int | None = None

    def __post_init__(self):
        if self.pooling not in POOLINGS:
            raise ValueError(f"pooling must be one of {', '.join(POOLINGS)}, got {self.pooling!r}")
        if not isinstance(self.normalize, bool):
            raise TypeError(f"normalize is a bool, got {type(self.normalize).__name__}")
        t = self.truncate_prompt_tokens
        if t is not None and (isinstance(t, bool) or not isinstance(t, int) or (t < 1 and t != -1)):
            raise ValueError(f"truncate_prompt_tokens must be >= 1 (the prompt's last tokens kept) or -1 (as many as "
                             f"the context holds), got {t!r}")

    def read_prompt(self, prompt_ids: list[int], max_len: int) -> list[int]:
        return truncate_prompt(prompt_ids, self.truncate_prompt_tokens, max_len)


@dataclass
class EmbeddingOutput:
    embedding: list[float]  # [hidden_size]


@dataclass
class EmbeddingRequestOutput:
    """vLLM's: ``outputs.embedding`` of one prompt, the tokens it read."""

    request_id: str
    prompt_token_ids: list[int]
    outputs: EmbeddingOutput
    finished: bool = True


def pool(hidden: torch.Tensor, params: PoolingParams) -> torch.Tensor:
    """hidden [T, H] (one prompt's final states) -> [H] float32."""
    h = hidden.float()
    v = h[-1] if params.pooling == "last" else h.mean(0)
    return torch.nn.functional.normalize(v, dim=0) if params.normalize else v


@torch.inference_mode()
def embed_prompt(model, prompt_ids: list[int], params: PoolingParams) -> torch.Tensor:
    """One prompt's embedding [H] (float32, on the model's device): a forward of the prompt alone, no KV cache."""
    ids = torch.tensor([prompt_ids], dtype=torch.long, device=model.device)
    hidden = model(ids)[0, :, :model.config.hidden_size]  # [T, H]; past H: an EAGLE-3 head's captured layers
    return pool(hidden, params)
