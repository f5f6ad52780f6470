"""Loader: local dirs, sharded checkpoints, hub ids from the local cache only, and clear errors."""

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from infer.config import parse_dtype
from infer.model import load_model


def _copy(src, dst):
    shutil.copytree(src, dst)
    return dst


def test_sharded_checkpoint_loads_identically(gqa_dir, tmp_path):
    from transformers import LlamaForCausalLM

    hf = LlamaForCausalLM.from_pretrained(gqa_dir)
    hf.save_pretrained(tmp_path / "sharded", max_shard_size="20KB")
    assert (tmp_path / "sharded" / "model.safetensors.index.json").is_file()
    for f in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(gqa_dir / f, tmp_path / "sharded" / f)
    a, b = load_model(gqa_dir), load_model(tmp_path / "sharded")
    ids = torch.arange(10)[None]
    assert torch.equal(a.compute_logits(a(ids)), b.compute_logits(b(ids)))


def test_missing_directory():
    with pytest.raises(FileNotFoundError, match="does not exist"):
        load_model("/nonexistent/model/dir")


def test_hub_id_not_in_cache_is_refused_without_download(monkeypatch, tmp_path):
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path))
    with pytest.raises(FileNotFoundError, match="local Hugging Face cache"):
        load_model("meta-llama/Llama-3.2-1B-Instruct")


def test_hub_id_found_in_local_cache(monkeypatch, tmp_path, gqa_dir):
    """A hub id resolves when its snapshot is in the HF cache layout (models--org--name/snapshots/<rev>)."""
    repo = tmp_path / "models--acme--tiny"
    snap = repo / "snapshots" / "0123456789abcdef0123456789abcdef01234567"
    shutil.copytree(gqa_dir, snap)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text("0123456789abcdef0123456789abcdef01234567")
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path))
    import huggingface_hub.constants as c

    monkeypatch.setattr(c, "HF_HUB_CACHE", str(tmp_path))
    m = load_model("acme/tiny")
    assert m.config.hidden_size == 48


def test_missing_config(gqa_dir, tmp_path):
    d = _copy(gqa_dir, tmp_path / "m")
    (d / "config.json").unlink()
    with pytest.raises(FileNotFoundError, match="config.json"):
        load_model(d)


def test_missing_weights(gqa_dir, tmp_path):
    d = _copy(gqa_dir, tmp_path / "m")
    (d / "model.safetensors").unlink()
    with pytest.raises(FileNotFoundError, match="model.safetensors"):
        load_model(d)


def test_unsupported_architecture_is_named(gqa_dir, tmp_path):
    d = _copy(gqa_dir, tmp_path / "m")
    cfg = json.loads((d / "config.json").read_text())
    cfg["architectures"] = ["MistralForCausalLM"]
    (d / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="MistralForCausalLM"):
        load_model(d)
    cfg["model_type"] = "gpt2"
    (d / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="gpt2"):
        load_model(d)


def test_shape_mismatch_names_the_tensor(gqa_dir, tmp_path):
    d = _copy(gqa_dir, tmp_path / "m")
    sd = load_file(d / "model.safetensors")
    name = "model.layers.1.mlp.up_proj.weight"
    sd[name] = sd[name][:-1].contiguous()
    save_file(sd, d / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"model\.layers\.1\.mlp\.up_proj\.weight"):
        load_model(d)


def test_missing_tensor_is_named(gqa_dir, tmp_path):
    d = _copy(gqa_dir, tmp_path / "m")
    sd = load_file(d / "model.safetensors")
    del sd["model.norm.weight"]
    save_file(sd, d / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"model\.norm\.weight"):
        load_model(d)


def test_unknown_dtype(gqa_dir):
    with pytest.raises(ValueError, match="unknown dtype 'float8'"):
        load_model(gqa_dir, dtype="float8")
    assert parse_dtype("bf16") is torch.bfloat16


def test_eos_list_and_llama3_rope_are_read(llama3_dir):
    m = load_model(llama3_dir)
    assert len(m.config.eos_token_ids) == 2
    assert m.config.rope.type == "llama3" and m.config.rope.factor == 8.0
    assert m.config.tie_word_embeddings and m.lm_head is None


@pytest.mark.parametrize("shape", ["gqa", "llama3"])
def test_save_model_round_trips_and_transformers_reads_it(ckpt_dirs, tmp_path, shape):
    from transformers import LlamaForCausalLM

    from infer.model import save_model

    m = load_model(ckpt_dirs[shape])
    save_model(m, tmp_path / "out", dtype="float32")
    again = load_model(tmp_path / "out")
    ref = LlamaForCausalLM.from_pretrained(tmp_path / "out", dtype=torch.float32).eval()
    ids = torch.arange(12)[None]
    with torch.no_grad():
        a = m.compute_logits(m(ids))
        assert torch.equal(a, again.compute_logits(again(ids)))
        assert (ref(ids).logits - a).abs().max() <= 1e-4
