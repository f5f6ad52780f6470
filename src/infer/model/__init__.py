from .gguf import GGUFCheckpoint, gguf_file_of
from .llama import LlamaForCausalLM
from .loader import load_config, load_model, resolve_model_path, save_model

__all__ = ["GGUFCheckpoint", "LlamaForCausalLM", "gguf_file_of", "load_config", "load_model", "resolve_model_path",
           "save_model"]
