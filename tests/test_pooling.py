"""Embeddings (infer.pooling, LLM.embed, Engine.embed): the final states pooled as Hugging Face computes them, a
prompt's vector the same whatever runs beside it, and bad input refused before anything runs."""

import copy

import pytest
import torch

from infer import LLM, PoolingParams, SamplingParams
from infer.model.loader import load_model
from infer.pooling import embed_prompt
from infer.testing import random_heads

PROMPTS = ["def fib(n):", "hello world, hello again", "a"]


@pytest.fixture(scope="module")
def llm(gqa_dir):
    return LLM(gqa_dir, dtype="float32", max_batch_size=2, block_size=4)


@pytest.fixture(scope="module")
def hf_states(gqa_dir):
    """The prompt's last_hidden_state [T, H] by transformers' LlamaModel (after the final norm)."""
    from transformers import LlamaModel

    ref = LlamaModel.from_pretrained(gqa_dir, dtype=torch.float32).eval()
    return lambda ids: ref(torch.tensor([ids])).last_hidden_state[0].detach()


@pytest.mark.parametrize("pooling", ["last", "mean"])
@pytest.mark.parametrize("normalize", [True, False])
def test_an_embedding_is_hugging_faces_last_hidden_state_pooled(llm, hf_states, pooling, normalize):
    outs = llm.embed(PROMPTS, PoolingParams(pooling, normalize))
    assert [o.prompt_token_ids for o in outs] == [llm.tokenizer.encode(p) for p in PROMPTS]
    for o in outs:
        h = hf_states(o.prompt_token_ids)
        want = h[-1] if pooling == "last" else h.mean(0)
        want = torch.nn.functional.normalize(want, dim=0) if normalize else want
        got = torch.tensor(o.outputs.embedding)
        assert got.shape == (llm.model.config.hidden_size,)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
        if normalize:
            assert abs(got.norm().item() - 1) < 1e-5


def test_last_and_mean_differ_and_a_prompt_embeds_alone_as_in_a_list(llm):
    last, mean = (llm.embed(PROMPTS[:2], PoolingParams(p)) for p in ("last", "mean"))
    assert all(a.outputs.embedding != b.outputs.embedding for a, b in zip(last, mean))
    alone = llm.embed({"prompt_token_ids": last[1].prompt_token_ids})[0]
    assert alone.outputs.embedding == last[1].outputs.embedding
    per_prompt = llm.embed(PROMPTS[:2], [PoolingParams("last"), PoolingParams("mean")])
    assert [o.outputs.embedding for o in per_prompt] == [last[0].outputs.embedding, mean[1].outputs.embedding]


def test_embedding_between_steps_leaves_the_running_requests_as_they_were(llm):
    """An embedding's forward takes no KV block and changes no running request: the same greedy tokens with embeds
    between the steps as without, the pool's free blocks unchanged by each embed."""
    eng, params = llm.engine, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    ids = [llm.tokenizer.encode(p) for p in PROMPTS[:2]]
    want = [o.outputs[0].token_ids for o in llm.generate([{"prompt_token_ids": i} for i in ids], params)]
    reqs = [eng.add_request(i, params) for i in ids]
    vec = llm.embed(PROMPTS[2])[0].outputs.embedding
    while eng.has_unfinished:
        eng.step()
        free = eng.free_kv_tokens()
        assert eng.embed(llm.tokenizer.encode(PROMPTS[2])).tolist() == vec
        assert eng.free_kv_tokens() == free
    assert [r.output_ids for r in reqs] == want
    assert eng.free_kv_tokens() == eng.initial_free_kv_tokens


def test_a_target_feeding_an_eagle3_head_embeds_its_final_state(gqa_dir):
    """A target that also hands an EAGLE-3 head its layers returns [final; layers] per position: the embedding is
    the final state's, as without the head."""
    plain = load_model(gqa_dir)
    feeding = copy.deepcopy(plain)
    random_heads(feeding, "eagle3")
    ids = [5, 9, 2, 7, 11]
    assert feeding(torch.tensor([ids])).shape[-1] > plain.config.hidden_size
    for pooling in ("last", "mean"):
        p = PoolingParams(pooling)
        torch.testing.assert_close(embed_prompt(feeding, ids, p), embed_prompt(plain, ids, p), rtol=0, atol=0)


def test_a_block_quantized_bfloat16_target_embeds_near_its_float32_self(gqa_dir, llm):
    """The integer kernels' path (Q8_0 blocks x int8 activations in bfloat16) without a cache: the same direction."""
    q = LLM(gqa_dir, dtype="bfloat16", quantization="q8_0", max_batch_size=1)
    for a, b in zip(q.embed(PROMPTS), llm.embed(PROMPTS)):
        cos = torch.dot(torch.tensor(a.outputs.embedding), torch.tensor(b.outputs.embedding)).item()
        assert cos > 0.99, cos


def test_bad_input_is_refused_before_any_prompt_runs(llm, monkeypatch):
    ran = []
    monkeypatch.setattr(llm.engine, "embed", lambda *a: ran.append(a))
    V, limit = llm.model.config.vocab_size, llm.engine.max_seq_len
    for prompts, params, words in (
            ([[1, 2], []], None, "prompt is empty"),
            (["ok", [1, V]], None, "out of range"),
            (["ok", [1] * (limit + 1)], None, "truncate_prompt_tokens"),
            ("ok", [PoolingParams(), PoolingParams()], "2 PoolingParams for 1 prompts"),
            ("ok", [], "0 PoolingParams for 1 prompts"),
            ("ok", SamplingParams(), "PoolingParams or a list of them")):
        with pytest.raises((ValueError, TypeError), match=words):
            llm.embed(prompts, params)
    assert ran == []
    for kwargs, words in (({"pooling": "cls"}, "pooling must be one of last, mean"),
                          ({"normalize": 1}, "normalize is a bool"),
                          ({"truncate_prompt_tokens": 0}, "truncate_prompt_tokens must be")):
        with pytest.raises((ValueError, TypeError), match=words):
            PoolingParams(**kwargs)
    monkeypatch.undo()
    long = [3] * (limit + 5)
    kept = llm.embed([long], PoolingParams(truncate_prompt_tokens=-1))[0]
    assert kept.prompt_token_ids == long[-limit:]
    assert llm.embed([long], PoolingParams(truncate_prompt_tokens=4))[0].prompt_token_ids == [3] * 4
