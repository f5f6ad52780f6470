from .llama import LlamaForCausalLM
from .loader import load_config, load_model, resolve_model_path, save_model

__all__ = ["LlamaForCausalLM", "load_config", "load_model", "resolve_model_path", "save_model"]
