"""LoRA adapters (infer.model.lora, EngineConfig.lora): a PEFT adapter applied at run time gives Hugging Face's
logits with the adapter merged into the weights, on float and quantized targets; greedy speculation with an adapted
target is still plain decoding token for token; what cannot be applied is refused naming the problem."""

import json
import math

import pytest
import torch
from safetensors.torch import save_file

from infer import LLM, SamplingParams
from infer.engine import EngineConfig
from infer.model.llama import LlamaForCausalLM
from infer.model.lora import LoRALinear, apply_lora, load_lora

ATTN, MLP = ("q_proj", "k_proj", "v_proj", "o_proj"), ("gate_proj", "up_proj", "down_proj")
PROMPTS = ["def fib(n):", "hello world, hello again"]
GREEDY = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)


def _shapes(base_dir) -> dict[str, tuple[int, int]]:
    """[out, in] of each projection of the checkpoint."""
    c = json.loads((base_dir / "config.json").read_text())
    hd = c.get("head_dim") or c["hidden_size"] // c["num_attention_heads"]
    h, q, kv, i = c["hidden_size"], c["num_attention_heads"] * hd, c["num_key_value_heads"] * hd, c["intermediate_size"]
    return {"q_proj": (q, h), "k_proj": (kv, h), "v_proj": (kv, h), "o_proj": (h, q), "gate_proj": (i, h),
            "up_proj": (i, h), "down_proj": (h, i)}


def write_adapter(out, base_dir, targets=ATTN + MLP, r=4, alpha=8, seed=0, layers=(0, 1), b_std=0.3, **config):
    """A PEFT LoRA directory with random A and B (a trained adapter's B is not PEFT's zero init)."""
    out.mkdir(parents=True, exist_ok=True)
    g = torch.Generator().manual_seed(seed)
    shapes, tensors = _shapes(base_dir), {}
    for layer in layers:
        for p in targets:
            o, i = shapes[p]
            key = f"base_model.model.model.layers.{layer}.{'self_attn' if p in ATTN else 'mlp'}.{p}"
            tensors[f"{key}.lora_A.weight"] = torch.randn(r, i, generator=g) * 0.3
            tensors[f"{key}.lora_B.weight"] = torch.randn(o, r, generator=g) * b_std
    save_file(tensors, str(out / "adapter_model.safetensors"))
    cfg = {"peft_type": "LORA", "r": r, "lora_alpha": alpha, "target_modules": list(targets), "bias": "none",
           "lora_dropout": 0.0, "fan_in_fan_out": False, "use_rslora": False, "use_dora": False,
           "modules_to_save": None, **config}
    (out / "adapter_config.json").write_text(json.dumps(cfg))
    return out


def merged_hf(base_dir, adapter_dir, scale=1.0):
    """transformers' model with W + scale * s * B A merged into each adapted weight (what PEFT's merge does)."""
    from safetensors.torch import load_file
    from transformers import LlamaForCausalLM

    ref = LlamaForCausalLM.from_pretrained(base_dir, dtype=torch.float32).eval()
    cfg = json.loads((adapter_dir / "adapter_config.json").read_text())
    tensors = load_file(str(adapter_dir / "adapter_model.safetensors"))
    params = dict(ref.named_parameters())
    with torch.no_grad():
        for name, a in tensors.items():
            if ".lora_A." not in name:
                continue
            b = tensors[name.replace(".lora_A.", ".lora_B.")]
            r = a.shape[0]
            s = cfg["lora_alpha"] / (math.sqrt(r) if cfg.get("use_rslora") else r)
            params[name.removeprefix("base_model.model.").replace(".lora_A.weight", ".weight")] += scale * s * b @ a
    return ref


@pytest.fixture(scope="module")
def adapter(gqa_dir, tmp_path_factory):
    return write_adapter(tmp_path_factory.mktemp("lora") / "all", gqa_dir)


def _logits(llm, text):
    ids = torch.tensor([llm.tokenizer.encode(text)])
    return llm.model.compute_logits(llm.model(ids))[0], ids


@pytest.mark.parametrize("kind", ["all", "q_v_rslora", "scaled"])
def test_logits_are_hugging_faces_with_the_adapter_merged(gqa_dir, adapter, tmp_path, kind):
    path, scale = adapter, 1.0
    if kind == "q_v_rslora":  # PEFT's common default targets, rsLoRA's scaling, a rank of its own, one layer
        path = write_adapter(tmp_path / "qv", gqa_dir, ("q_proj", "v_proj"), r=3, alpha=5, seed=1, layers=(1,),
                             use_rslora=True)
    if kind == "scaled":
        scale = 0.5
    llm = LLM(gqa_dir, dtype="float32", lora=str(path), lora_scale=scale, max_batch_size=1)
    got, ids = _logits(llm, PROMPTS[0])
    want = merged_hf(gqa_dir, path, scale)(ids).logits[0]
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    base = LLM(gqa_dir, dtype="float32", max_batch_size=1)
    assert (got - _logits(base, PROMPTS[0])[0]).abs().max() > 1e-2  # the adapter changes the model
    assert sum(isinstance(m, LoRALinear) for m in llm.model.modules()) == (8 if kind != "q_v_rslora" else 1)


@pytest.mark.parametrize("setting", [dict(dtype="float32"), dict(dtype="bfloat16"),
                                     dict(dtype="bfloat16", quantization="q4_1")])
def test_greedy_speculation_with_an_adapter_is_plain_decoding(gqa_dir, tmp_path, setting, monkeypatch):
    """The adapted target verifies; its drafter (the base model) knows nothing of the adapter, so it is rejected
    more, and the tokens are plain decoding's all the same. Quantized bfloat16: the base's llama.cpp blocks stay as
    stored, and a lone row's steps go through the one-call forward, which adds the adapter's products itself."""
    adapter = write_adapter(tmp_path / "mild", gqa_dir, b_std=0.05)  # the drafter still agrees now and then
    plain = LLM(gqa_dir, lora=str(adapter), max_batch_size=2, block_size=4, **setting)
    want = [o.outputs[0].token_ids for o in plain.generate(PROMPTS, GREEDY)]
    base = LLM(gqa_dir, max_batch_size=2, block_size=4, **setting)
    assert want != [o.outputs[0].token_ids for o in base.generate(PROMPTS, GREEDY)]
    spec = LLM(gqa_dir, lora=str(adapter), draft_model=gqa_dir, spec_length=3, max_batch_size=2, block_size=4,
               **setting)
    # Q4_1 blocks in bfloat16: a lone row's steps run as one C++ call, the adapter's products in it
    assert spec.model.runs_natively(spec.engine.kv.pool) == ("quantization" in setting)
    assert f"lora: {adapter.name}, speculating" in spec.describe()  # `infer chat`'s banner
    native = []
    orig = LlamaForCausalLM._native_forward
    monkeypatch.setattr(LlamaForCausalLM, "_native_forward", lambda *a: native.append(1) or orig(*a))
    for prompts in (PROMPTS, PROMPTS[:1]):  # a batch, and a lone row (the one-call path's case)
        got = [o.outputs[0].token_ids for o in spec.generate(prompts, GREEDY)]
        assert got == want[:len(prompts)]
    assert bool(native) == ("quantization" in setting)
    stats = spec.engine.stats
    assert 0 < stats.num_accepted_tokens < stats.num_draft_tokens


def test_what_cannot_be_applied_is_refused_naming_it(gqa_dir, adapter, tmp_path):
    cases = [
        (dict(use_dora=True), "use_dora"),
        (dict(bias="all"), "bias 'all'"),
        (dict(modules_to_save=["lm_head"]), "modules_to_save"),
        (dict(peft_type="IA3"), "peft_type 'IA3'"),
        (dict(lora_alpha=None), "no numeric lora_alpha"),
    ]
    for i, (config, match) in enumerate(cases):
        with pytest.raises(ValueError, match=match):
            load_lora(write_adapter(tmp_path / f"c{i}", gqa_dir, ("q_proj",), **config))
    head = write_adapter(tmp_path / "head", gqa_dir, ("q_proj",))
    save_file({"base_model.model.lm_head.lora_A.weight": torch.zeros(4, 48),
               "base_model.model.lm_head.lora_B.weight": torch.zeros(10, 4)}, str(head / "adapter_model.safetensors"))
    with pytest.raises(ValueError, match="adapts a module this runtime does not"):
        load_lora(head)
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match="no adapter_config.json"):
        load_lora(tmp_path / "empty")
    model = LLM(gqa_dir, dtype="float32", max_batch_size=1).model
    deep = write_adapter(tmp_path / "deep", gqa_dir, ("q_proj",), layers=(5,))
    with pytest.raises(ValueError, match="adapts layer 5, the model has 2"):
        apply_lora(model, load_lora(deep))
    wide = write_adapter(tmp_path / "wide", gqa_dir, ("down_proj",))
    lora = load_lora(wide)
    (layer, module), (a, b, s) = next(iter(lora.weights.items()))
    lora.weights[layer, module] = (torch.zeros(4, 7), b, s)
    with pytest.raises(ValueError, match="down_proj maps 7 -> 48, the model's 96 -> 48"):
        apply_lora(model, lora)
    assert not any(isinstance(m, LoRALinear) for m in model.modules())  # nothing changed by a refusal
    apply_lora(model, load_lora(adapter))
    with pytest.raises(ValueError, match="carries a LoRA adapter already"):
        apply_lora(model, load_lora(adapter))
    with pytest.raises(ValueError, match="lora must be a PEFT adapter's directory"):
        EngineConfig(model=str(gqa_dir), lora=str(tmp_path / "missing"))
    with pytest.raises(ValueError, match="lora_scale must be a finite number"):
        EngineConfig(model=str(gqa_dir), lora=str(adapter), lora_scale=float("nan"))
    with pytest.raises(ValueError, match="tensor_parallel_size > 1 shards the target without it"):
        EngineConfig(model=str(gqa_dir), lora=str(adapter), tensor_parallel_size=2)


def test_the_command_line_takes_an_adapter(gqa_dir, adapter, tmp_path, capsys):
    """``--lora`` / ``--lora-scale`` on every command that loads a model: `infer generate` prints the adapted model's
    greedy text; a directory that is no adapter is one clear line, before anything loads."""
    from infer import cli, progress

    args = ["generate", "--model", str(gqa_dir), "--prompt", "def fib", "--max-tokens", "8", "--temperature", "0"]
    try:
        assert cli.main(args + ["--lora", str(adapter), "--lora-scale", "0.5"]) == 0
        eight = SamplingParams(temperature=0, max_tokens=8)
        want = LLM(gqa_dir, lora=str(adapter), lora_scale=0.5).generate(["def fib"], eight)[0].outputs[0].text
        assert capsys.readouterr().out == "def fib" + want + "\n"
        assert cli.main(args + ["--lora", str(tmp_path / "nothing")]) == 2
    finally:
        progress.disable()
    err = capsys.readouterr().err
    assert "lora must be a PEFT adapter's directory" in err and "Traceback" not in err
