"""Model configuration parsed from a Hugging Face ``config.json`` (model/gguf.py builds one from GGUF metadata).

Only the fields our Llama implementation reads are kept; anything the model cannot honour is refused here with
a message that names it, so a checkpoint never loads into a silently different network.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import torch

SUPPORTED_ARCHITECTURES = ("LlamaForCausalLM",)
SUPPORTED_ROPE_TYPES = ("default", "llama3")

_DTYPES = {
    "float32": torch.float32,
    "fp32": torch.float32,
    "float": torch.float32,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float16": torch.float16,
    "fp16": torch.float16,
    "half": torch.float16,
}


def parse_dtype(dtype: str | torch.dtype) -> torch.dtype:
    """'float32' | 'bfloat16' | 'float16' (or a torch.dtype) -> torch.dtype; anything else is a ValueError."""
    if isinstance(dtype, torch.dtype):
        if dtype in (torch.float32, torch.bfloat16, torch.float16):
            return dtype
        raise ValueError(f"unsupported dtype {dtype}; use float32, bfloat16 or float16")
    key = str(dtype).lower().removeprefix("torch.")
    if key not in _DTYPES:
        raise ValueError(f"unknown dtype {dtype!r}; use one of float32, bfloat16, float16")
    return _DTYPES[key]


def _as_id_list(value) -> list[int]:
    if value is None:
        return []
    if isinstance(value, int):
        return [value]
    return [int(v) for v in value]


@dataclass
class RopeConfig:
    theta: float = 10000.0
    type: str = "default"
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192

    def __post_init__(self):
        if self.type not in SUPPORTED_ROPE_TYPES:
            raise ValueError(f"unsupported rope_scaling type {self.type!r}; supported: {SUPPORTED_ROPE_TYPES}")
        if self.theta <= 0:
            raise ValueError(f"rope_theta must be > 0, got {self.theta}")
        if self.type == "llama3" and self.high_freq_factor <= self.low_freq_factor:
            raise ValueError("rope_scaling: high_freq_factor must exceed low_freq_factor")


@dataclass
class ModelConfig:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    max_position_embeddings: int
    rms_norm_eps: float = 1e-6
    rope: RopeConfig = field(default_factory=RopeConfig)
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    mlp_bias: bool = False
    bos_token_id: int | None = None
    eos_token_ids: list[int] = field(default_factory=list)
    architecture: str = "LlamaForCausalLM"

    def __post_init__(self):
        if self.architecture not in SUPPORTED_ARCHITECTURES:
            raise ValueError(
                f"unsupported architecture {self.architecture!r}; infer implements {', '.join(SUPPORTED_ARCHITECTURES)}"
            )
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                     "num_key_value_heads", "head_dim", "max_position_embeddings"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)}")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(
                f"num_attention_heads ({self.num_attention_heads}) must be a multiple of "
                f"num_key_value_heads ({self.num_key_value_heads})"
            )
        if self.head_dim % 2:
            raise ValueError(f"head_dim must be even for rotary embeddings, got {self.head_dim}")

    @classmethod
    def from_dict(cls, d: dict) -> ModelConfig:
        archs = d.get("architectures") or ["LlamaForCausalLM"]
        model_type = d.get("model_type", "llama")
        if model_type != "llama":
            raise ValueError(f"unsupported model_type {model_type!r} (architectures {archs}); infer implements llama")
        act = d.get("hidden_act", "silu")
        if act != "silu":
            raise ValueError(f"unsupported hidden_act {act!r}; Llama uses silu")
        if d.get("pretraining_tp", 1) not in (1, None):
            # pretraining_tp only changes how HF splits matmuls; the math is identical, so it is ignored.
            pass
        heads = d["num_attention_heads"]
        # transformers < 5 keeps rope_theta top-level and scaling in rope_scaling; >= 5 folds both into rope_parameters.
        rp = dict(d.get("rope_parameters") or {})
        rs = dict(d.get("rope_scaling") or {})
        merged = {**rs, **rp}
        rope_type = merged.get("rope_type", merged.get("type", "default"))
        rope = RopeConfig(
            theta=float(merged.get("rope_theta", d.get("rope_theta", 10000.0))),
            type=rope_type,
            factor=float(merged.get("factor", 1.0)),
            low_freq_factor=float(merged.get("low_freq_factor", 1.0)),
            high_freq_factor=float(merged.get("high_freq_factor", 4.0)),
            original_max_position_embeddings=int(
                merged.get("original_max_position_embeddings", d.get("max_position_embeddings", 8192))
            ),
        )
        return cls(
            architecture=archs[0],
            vocab_size=d["vocab_size"],
            hidden_size=d["hidden_size"],
            intermediate_size=d["intermediate_size"],
            num_hidden_layers=d["num_hidden_layers"],
            num_attention_heads=heads,
            num_key_value_heads=d.get("num_key_value_heads") or heads,
            head_dim=d.get("head_dim") or d["hidden_size"] // heads,
            max_position_embeddings=d.get("max_position_embeddings", 2048),
            rms_norm_eps=d.get("rms_norm_eps", 1e-6),
            rope=rope,
            tie_word_embeddings=bool(d.get("tie_word_embeddings", False)),
            attention_bias=bool(d.get("attention_bias", False)),
            mlp_bias=bool(d.get("mlp_bias", False)),
            bos_token_id=d.get("bos_token_id"),
            eos_token_ids=_as_id_list(d.get("eos_token_id")),
        )

    @classmethod
    def from_file(cls, path: str | Path) -> ModelConfig:
        with open(path) as f:
            d = json.load(f)
        try:
            return cls.from_dict(d)
        except KeyError as e:
            raise ValueError(f"{path}: missing required field {e.args[0]!r}") from None
        except ValueError as e:
            raise ValueError(f"{path}: {e}") from None
