"""torch.compile'd decode/verify steps: same tokens as eager, on both KV backends and under speculation, with
no recompilation once the step shapes have been seen; tiny models stay eager unless asked. (A lone request's
compiled speculation in bfloat16 against a plain eager engine: test_warmup.py, which builds the same graphs stage by
stage; in float32: test_a_batched_engine_builds_every_graph_at_start_up, its last request.)"""

import pytest
import torch

from infer import LLM, SamplingParams

PROMPTS = ["def fib(n):", "The quick brown fox", "import os"]
GREEDY = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)


def _ids(outs):
    return [o.token_ids for o in outs]


@pytest.fixture(scope="module")
def eager(gqa_dir):
    return _ids(LLM(gqa_dir, compile=False).generate(PROMPTS, GREEDY))


def test_tiny_models_stay_eager_by_default(gqa_dir):
    llm = LLM(gqa_dir)
    assert llm.engine.compiled is False and llm.model.compiled is None


@pytest.mark.parametrize("backend", ["paged", "contiguous"])
def test_compiled_greedy_equals_eager(gqa_dir, eager, backend):
    llm = LLM(gqa_dir, compile=True, kv_cache_backend=backend, max_batch_size=1)  # one row: the decode graph
    assert llm.engine.compiled and llm.model.compiled is not None
    assert _ids(llm.generate(PROMPTS, GREEDY)) == eager


def test_a_batched_engine_builds_every_graph_at_start_up(gqa_dir, eager):
    """Served batches are ragged (rows of several lengths: every step masked, a decode too) and leave a lone request
    on blocks interleaved with the others' (gathers, not slices): the warm-up builds those graphs as well, so once it
    is done neither a batch nor the request after it stops to compile (each such graph cost seconds mid-request)."""
    llm = LLM(gqa_dir, draft_model=gqa_dir, spec_length=3, compile=True, max_batch_size=2, block_size=4)
    assert llm.engine.wait_until_ready(timeout=600)
    with torch._dynamo.config.patch(error_on_recompile=True):
        assert _ids(llm.generate(PROMPTS, GREEDY)) == eager  # two at a time, of different lengths
        assert _ids(llm.generate(PROMPTS[:1], GREEDY)) == eager[:1]  # alone, on the blocks the batch left
    assert llm.engine.stats.num_draft_tokens > 0


def test_compiled_quantized_target_equals_eager(gqa_dir):
    """The weight-only kernels run as opaque ops inside the compiled graph: same tokens as the eager int8 model."""
    eager = LLM(gqa_dir, quantization="int8", compile=False, max_batch_size=1)
    compiled = LLM(gqa_dir, quantization="int8", compile=True, max_batch_size=1)
    assert _ids(compiled.generate(PROMPTS, GREEDY)) == _ids(eager.generate(PROMPTS, GREEDY))


def test_compiled_models_in_one_process_keep_their_own_graphs(ckpt_dirs):
    """Compiled steps skip the guards on model state (compile.step_guards): two models, of different shapes and
    precisions, compiled in one process must never run each other's graphs."""
    models = [(ckpt_dirs["gqa"], None), (ckpt_dirs["gqa"], "int8"), (ckpt_dirs["mha"], None)]
    eager = [_ids(LLM(d, quantization=q, compile=False, max_batch_size=1).generate(PROMPTS, GREEDY)) for d, q in models]
    compiled = [LLM(d, quantization=q, compile=True, max_batch_size=1) for d, q in models]
    for _ in range(2):  # interleaved: each call finds the others' graphs already built
        assert [_ids(llm.generate(PROMPTS, GREEDY)) for llm in compiled] == eager


def test_quantizing_a_compiled_model_is_refused(gqa_dir):
    from infer.model.quant import quantize_model

    llm = LLM(gqa_dir, compile=True, max_batch_size=1)
    with pytest.raises(ValueError, match="before compiling"):
        quantize_model(llm.model, "int8")


@pytest.mark.parametrize("kind", ["eagle", "eagle3", "draft_model"])
def test_quantized_compiled_drafters_keep_greedy_parity(gqa_dir, tmp_path, kind):
    """Issue 33's cheap draft steps: beside a quantized target the drafter is quantized too (Q8_0: its projections and
    draft-vocabulary rows on infer::qlinear) and, the target being compiled, so is its step (built by the warm-up on a
    twin of the draft pool), and an EAGLE head's round runs as one call (draft_round: its first step and up to
    CHAIN_MAX more, greedy or drawn at a plain temperature; for the EAGLE head over a draft vocabulary with the
    prompt's tokens added).
    Drafts are proposals: the tokens are still the quantized target's own."""
    from infer.model.draft_heads import save_heads
    from infer.model.loader import load_model
    from infer.model.quant import BlockLinear
    from infer.proposers.draft_vocab import write_ranking
    from infer.testing import random_heads

    drafter, extra = gqa_dir, {}
    if kind.startswith("eagle"):
        save_heads(random_heads(load_model(gqa_dir), kind, seed=3), tmp_path / "head", dtype=torch.float32)
        drafter = tmp_path / "head"
    if kind == "eagle":  # half the vocabulary (odd ids first): the prompts bring tokens from outside it
        V = load_model(gqa_dir).config.vocab_size
        write_ranking(drafter, [1 + (i % 2) for i in range(V)], "test: odd ids rank first")
        extra = {"draft_vocab_size": V // 2}
    want = _ids(LLM(gqa_dir, quantization="q8_0", compile=False, max_batch_size=1).generate(PROMPTS, GREEDY))
    llm = LLM(gqa_dir, quantization="q8_0", draft_model=drafter, spec_length=3, compile=True, max_batch_size=1,
              **extra)
    d = llm.engine.draft_model
    assert d.compiled is not None and any(isinstance(m, BlockLinear) for m in d.modules())
    assert llm.engine.wait_until_ready(timeout=600) and llm.engine.warmup.error is None
    chains = []
    if kind.startswith("eagle"):  # count the compiled rounds and chains run
        for name in ("_round", "_chain"):
            compiled, run_only = d.compiled.methods[name]
            d.compiled.methods[name] = (lambda *a, f=compiled, n=name: chains.append(n) or f(*a), run_only)
    with torch._dynamo.config.patch(error_on_recompile=True):  # the warm-up built the drafter's graphs too
        assert _ids(llm.generate(PROMPTS, GREEDY)) == want
        greedy_chains = len(chains)
        # a plain temperature: the chains draw
        assert all(_ids(llm.generate(PROMPTS, SamplingParams(temperature=0.8, max_tokens=16, seed=0))))
    assert llm.engine.stats.num_draft_tokens > 0
    assert (greedy_chains > 0 and len(chains) > greedy_chains) == kind.startswith("eagle")
    # K = 3: a round's drafts come from its one call, but where its catch-up is a short prompt's first, causal fill
    # (eager, then a chain)
    assert chains.count("_round") > chains.count("_chain") or not kind.startswith("eagle")


def test_the_graph_cache_is_kept_per_kernel_build(monkeypatch, tmp_path):
    """Compiled graphs call infer's ops by their schemas, which inductor's cache keys do not cover: the default cache
    directory is named by the kernels' build, so a graph cached for older kernels is never loaded for newer ones (a
    graph cached for the four-argument infer::attention aborted calling the five-argument one)."""
    from torch._inductor.runtime.cache_dir_utils import default_cache_dir

    from infer import kernels
    from infer.model import compile as compile_mod

    monkeypatch.setattr(compile_mod, "DEFAULT_CACHE_DIR", tmp_path / "inductor")
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", default_cache_dir())  # inductor's own default: not a user's choice
    assert compile_mod.configure_cache() == tmp_path / "inductor" / kernels.build_name()
    monkeypatch.setattr(kernels, "build_name", lambda: "infer_kernels_other")
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", default_cache_dir())
    assert compile_mod.configure_cache() == tmp_path / "inductor" / "infer_kernels_other"
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "mine"))  # a user's choice stands
    assert compile_mod.configure_cache() == tmp_path / "mine"
