from .llama import LlamaForCausalLM
from .loader import load_config, load_model, resolve_model_path

__all__ = ["LlamaForCausalLM", "load_config", "load_model", "resolve_model_path"]
