"""infer: an LLM inference engine for Llama-family checkpoints with lossless speculative decoding."""

from .llm import LLM
from .model.lora import LoRARequest
from .pooling import PoolingParams
from .request import RequestOutput
from .sampling import SamplingParams
from .speculative import SpecStats, speculative_generate

__all__ = ["LLM", "LoRARequest", "PoolingParams", "RequestOutput", "SamplingParams", "SpecStats", "speculative_generate"]
__version__ = "0.1.0"
