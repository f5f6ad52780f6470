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
    from infer.beam import BeamSearchParams
    from infer.generate import beam_search_generate

    with torch._dynamo.config.patch(error_on_recompile=True):
        assert _ids(llm.generate(PROMPTS, GREEDY)) == eager  # two at a time, of different lengths
        assert _ids(llm.generate(PROMPTS[:1], GREEDY)) == eager[:1]  # alone, on the blocks the batch left
        # a beam search's steps are engine requests on the same graphs (run on the model's own KV slots, they cost
        # a compile per shape: 156 s of SmolLM2's 24 tokens)
        beams = llm.beam_search(PROMPTS[0], BeamSearchParams(beam_width=3, max_tokens=8))[0].sequences
    want = beam_search_generate(LLM(gqa_dir, compile=False).model, llm.tokenizer.encode(PROMPTS[0]), 3, 8,
                                llm.eos_token_ids)
    assert [s.token_ids for s in beams] == [h.token_ids for h in want]
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
    # each compiles in its own warm-up thread while the others serve: FX's tracing stays in the tracing thread
    # (model/fx_threads.py; this test once failed in CI on that race, tests/test_fx_threads.py shows it)
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


def test_trace_settings_hold_during_a_compiled_call_only(gqa_dir):
    """On the CPU a compiled step is traced with the module's tensors as constants of its graph (not inputs that
    Dynamo's code fetches before every call: ~0.2 ms a SmolLM2 decode step) and a draft chain or round without duck shapes
    (model.compile, _trace_settings). Dynamo's and FX's configs are per thread: the settings are in force while a
    compiled call runs, and the caller's thread gets its own values back, also when the call raises."""
    import torch.fx.experimental._config as fx_config

    from infer.model.compile import _trace_settings, _traced_with
    from infer.testing import random_llama

    seen = []

    def compiled(fail=False):
        seen.append((torch._dynamo.config.install_free_tensors, fx_config.use_duck_shape))
        if fail:
            raise RuntimeError("boom")

    model = random_llama(16)
    for name, want in (("_forward", (True, True)), ("_round", (True, False))):
        seen.clear()
        call = _traced_with(compiled, _trace_settings(model, name))
        call()
        with pytest.raises(RuntimeError, match="boom"):
            call(fail=True)
        assert seen == [want, want]
        assert (torch._dynamo.config.install_free_tensors, fx_config.use_duck_shape) == (False, True)
    llm = LLM(gqa_dir, compile=True, max_batch_size=1)  # the real steps: the same tokens (above), nothing left on
    assert llm.generate(PROMPTS[:1], GREEDY) and not torch._dynamo.config.install_free_tensors


def test_a_compiled_round_over_another_quantized_vocabulary_runs_eagerly():
    """A quantized draft vocabulary's head is a module a compiled round reaches through its arguments, so its weights
    are constants of the round's graphs and no guard tells another head of the same shapes apart: a second one (an
    engine sharing the drafter with another vocabulary) must not run the first one's graphs (EagleHead._graphs)."""
    from infer import kernels
    from infer.cache.slotted import SlottedKVCache
    from infer.model.compile import compile_model
    from infer.proposers.draft_vocab import DraftVocab
    from infer.testing import random_heads, random_llama

    kernels.available()  # loaded before tracing, as an engine does (else the load's file work breaks the graph)
    target = random_llama(64, seed=0)
    head = random_heads(target, "eagle", seed=3)
    compile_model(head)
    c, H = head.config, target.config.hidden_size
    vocabs = [DraftVocab(w, range(0, 64, 2)).quantized("q8_0").including([5, 9, 11])
              for w in (target.lm_head_weight, target.lm_head_weight.flip(1).contiguous())]
    pool = SlottedKVCache(1, c.num_key_value_heads, c.head_dim, 64, max_slots=2)
    slots = [pool.allocate(24), pool.allocate(24)]
    g = torch.Generator().manual_seed(1)
    with torch.inference_mode():
        meta = pool.prepare(slots, [7, 7])
        head(torch.randint(0, 64, (2, 7), generator=g), torch.randn(2, 7, H, generator=g), meta.positions, pool, meta)
        x, f = torch.randint(0, 64, (2, 3), generator=g), torch.randn(2, 3, H, generator=g)
        u, temp, last = torch.rand(2, 3, dtype=torch.float64, generator=g), torch.tensor([0.7, 1.3]), torch.tensor([2, 0])

        def run(vocab, eager):
            for s in slots:
                pool.truncate_to(s, 7)
            metas = [pool.prepare(slots, [3, 1])] + pool.prepare_run(slots, 2)
            if eager:
                return head._round(x, f, last, pool, metas, vocab, temp, u)
            return head.draft_round(x, f, last, pool, metas, vocab, temp, u)

        def same(got, want):  # drafts and last outputs bit for bit; q to float32 rounding (inductor's fused softmax)
            return torch.equal(got[0], want[0]) and torch.equal(got[1], want[1]) and \
                torch.allclose(got[2], want[2], rtol=0, atol=1e-6)

        first = run(vocabs[0], eager=False)  # traces the round's graph with the first vocabulary's head
        assert same(first, run(vocabs[0], eager=True))
        second, want = run(vocabs[1], eager=False), run(vocabs[1], eager=True)
    assert same(second, want)
    assert not torch.allclose(first[2], want[2], atol=1e-2)  # the two heads' laws differ: a stale head would show


class _Branchy(torch.nn.Module):
    """A method whose graph depends on a size (a guard on it) and with a default argument."""

    def __init__(self):
        super().__init__()
        self.w = torch.nn.Parameter(torch.randn(8), requires_grad=False)

    @property
    def device(self):
        return self.w.device

    def _forward(self, x, scale=None):
        y = x * self.w if x.shape[0] > 3 else x - self.w
        return y if scale is None else y * scale


def test_compiled_graphs_are_entered_directly_and_by_their_guards():
    """model.compile's _GraphEntry runs a compiled method's graphs without Dynamo's frame hook (benchmarks/
    call_entry.py): the first of Dynamo's cache entries whose guards pass the call runs. A call whose guards reject
    every graph (here a size on the other side of the method's branch, which a guard-blind entry would run through
    the wrong graph) goes to Dynamo, which compiles it; entries dropped by torch._dynamo.reset are not run."""
    from infer.model import compile as compile_module

    torch._dynamo.reset()
    mod = _Branchy()
    compiling, run_only = compile_module._compile_method(mod, "_forward", {}, dynamic=True)
    fallbacks = []
    for entry in (compiling, run_only):
        fallback = entry.fallback
        entry.fallback = lambda *a, fallback=fallback: fallbacks.append(a) or fallback(*a)
    big, big2, small = torch.randn(5, 8), torch.randn(7, 8), torch.randn(2, 8)
    with torch.inference_mode():
        assert torch.equal(compiling(big), mod._forward(big)) and len(fallbacks) == 1  # compiled by Dynamo
        # another size on the same side of the branch: the same (dynamic) graph, entered directly, default filled in
        assert torch.equal(compiling(big2), mod._forward(big2)) and len(fallbacks) == 1
        assert torch.equal(run_only(big2, None), mod._forward(big2)) and len(fallbacks) == 1  # the run-only twin too
        # a guard said no (scale was None when the graph was traced): Dynamo's run-only twin runs it eagerly
        assert torch.equal(run_only(big2, 2.0), mod._forward(big2, 2.0)) and len(fallbacks) == 2
        assert torch.equal(compiling(small), mod._forward(small)) and len(fallbacks) == 3  # a guard said no
        assert torch.equal(compiling(small), mod._forward(small)) and len(fallbacks) == 3  # now it has its graph
        compile_module.DIRECT_ENTRY = False
        try:  # through the frame hook: the same answers, every call by Dynamo
            assert torch.equal(compiling(big), mod._forward(big)) and len(fallbacks) == 4
        finally:
            compile_module.DIRECT_ENTRY = True
        # the graph's code reads no global but Dynamo's own: it runs over those, the graph's function unwrapped
        assert all(run.__globals__ is not compiling._globals for run in compiling._direct.values())
        torch._dynamo.reset()
        assert torch.equal(compiling(small), mod._forward(small)) and len(fallbacks) == 5


def test_the_entry_that_ran_last_is_asked_first():
    """Dynamo moves the cache entry that passes to the front of its list; the direct entry, which leaves that list
    as it is, asks the entry that ran last first, then the others in Dynamo's order: a step that repeats its graph
    walks one guard tree (a cold walk is ~10-20 us an entry), and a change of graph still finds the right one."""
    from infer.model import compile as compile_module

    torch._dynamo.reset()
    mod = _Branchy()
    compiling, _ = compile_module._compile_method(mod, "_forward", {}, dynamic=True)
    big, small = torch.randn(5, 8), torch.randn(2, 8)
    asked = []
    lookup = compiling._entries

    class _Counted:  # a cache entry whose guard checks are logged
        def __init__(self, entry):
            self.entry, self.code = entry, entry.code

        @property
        def guard_manager(self):
            entry = self.entry

            class _Check:
                def check(self, local):
                    asked.append(entry.code)
                    return entry.guard_manager.check(local)
            return _Check()

    with torch.inference_mode():
        compiling(big), compiling(small)  # two graphs (either side of the branch)
        compiling._entries = lambda code: [_Counted(e) for e in lookup(code)]
        for x, other in ((small, big), (big, small)):
            asked.clear()
            assert torch.equal(compiling(x), mod._forward(x))
            ran = compiling._last
            asked.clear()
            assert torch.equal(compiling(x), mod._forward(x))
            assert asked == [ran]  # the same graph again: one guard check
            asked.clear()
            assert torch.equal(compiling(other), mod._forward(other))
            assert asked[0] == ran and len(asked) == 2 and compiling._last == asked[1] != ran


class _Broken(_Branchy):
    def _forward(self, x, scale=None):
        y = x * self.w
        torch._dynamo.graph_break()  # two graphs, and the code between them reads a global of its own
        return y + 1


def test_a_graph_with_a_break_is_entered_over_its_modules_globals():
    """An entry whose code reads globals of the module's own (a graph break's resume function) runs over the module's
    globals, not a copy that could go stale."""
    from infer.model import compile as compile_module

    mod = _Broken()
    compiling, _ = compile_module._compile_method(mod, "_forward", {}, dynamic=True)
    x = torch.randn(5, 8)
    with torch.inference_mode():
        for _ in range(3):
            assert torch.equal(compiling(x), mod._forward(x))
    assert compiling._direct and all(run.__globals__ is compiling._globals for run in compiling._direct.values())


def test_a_compiled_engine_serves_from_its_graphs_directly(gqa_dir, eager, monkeypatch):
    """Once an engine's steps are compiled, a request of shapes seen before never goes through Dynamo's frame hook:
    every compiled call is entered directly (_GraphEntry), with the tokens of eager decoding."""
    from infer.model.compile import _GraphEntry

    llm = LLM(gqa_dir, draft_model=gqa_dir, spec_length=3, compile=True, max_batch_size=1)
    assert llm.engine.wait_until_ready(timeout=600)
    assert _ids(llm.generate(PROMPTS, GREEDY)) == eager
    steps = [llm.model.compiled, llm.engine.decoder.proposer.drafter.compiled]
    entries = [e for c in steps if c is not None for pair in c.methods.values() for e in pair]
    assert entries
    direct, hooked = [], []
    for entry in entries:
        fallback = entry.fallback
        entry.fallback = lambda *a, fallback=fallback: hooked.append(1) or fallback(*a)
    call = _GraphEntry.__call__
    monkeypatch.setattr(_GraphEntry, "__call__", lambda self, *a: direct.append(1) or call(self, *a))
    assert _ids(llm.generate(PROMPTS, GREEDY)) == eager
    assert direct and not hooked
