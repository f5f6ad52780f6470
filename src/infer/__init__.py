"""infer: an LLM inference engine for Llama-family checkpoints with lossless speculative decoding."""

from .llm import LLM
from .request import RequestOutput
from .sampling import SamplingParams

__all__ = ["LLM", "RequestOutput", "SamplingParams"]
__version__ = "0.1.0"
