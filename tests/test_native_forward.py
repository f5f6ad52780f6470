"""A lone row's few-token forward as one C++ call (LlamaForCausalLM.native, infer::llama_forward in
kernels/lm_round.cpp): the module's bits, cache writes and captured layers; taken only where it can run the step; and
the steps still compiled (batches, trees) giving the same bits, so a token's logits do not depend on which path ran
its step (model/compile.py)."""

import pytest
import torch

from infer import LLM, SamplingParams
from infer.cache.paged import PagedKVCachePool
from infer.cache.slotted import SlottedKVCache
from infer.model.llama import LlamaForCausalLM
from infer.model.quant import quantize_model
from infer.testing import random_llama


def _model(fmt="q4_1", dtype=torch.bfloat16, layers=3):
    return quantize_model(random_llama(96, seed=3, hidden_size=64, num_layers=layers).to(dtype), fmt)


@pytest.fixture
def counted(monkeypatch):
    calls = []
    orig = LlamaForCausalLM._native_forward
    monkeypatch.setattr(LlamaForCausalLM, "_native_forward", lambda *a: calls.append(a[1].shape) or orig(*a))
    return calls


def _steps(model, pool, slots, widths, native, seed=0):
    """Feed each slot in turn random chunks of the given widths (slots alternate, so with several slots their blocks
    interleave and a row's keys are read through storage rows) -> each forward's output."""
    g = torch.Generator().manual_seed(seed)
    outs = []
    LlamaForCausalLM.native = native
    try:
        for T in widths:
            for s in slots:
                ids = torch.randint(0, model.config.vocab_size, (1, T), generator=g)
                meta = pool.prepare([s], [T])
                with torch.inference_mode():
                    outs.append(model(ids, meta.positions, pool, meta).clone())
    finally:
        LlamaForCausalLM.native = True
    return outs


def _with_lora(model, seed=0):
    """A random LoRA adapter on some products of every kind (model.lora), ranks 2-5, some layers left bare."""
    from infer.model.lora import LoRAAdapter, apply_lora

    c, g = model.config, torch.Generator().manual_seed(seed)
    q, kv = c.num_attention_heads * c.head_dim, c.num_key_value_heads * c.head_dim
    shapes = {"q_proj": (q, c.hidden_size), "v_proj": (kv, c.hidden_size), "o_proj": (c.hidden_size, q),
              "up_proj": (c.intermediate_size, c.hidden_size), "down_proj": (c.hidden_size, c.intermediate_size)}
    weights = {(layer, m): (torch.randn(2 + i % 4, n_in, generator=g) * 0.2,
                            torch.randn(n_out, 2 + i % 4, generator=g) * 0.2, 0.5)
               for layer in range(c.num_hidden_layers) for i, (m, (n_out, n_in)) in enumerate(shapes.items())
               if (layer + i) % 3}
    apply_lora(model, LoRAAdapter("random", weights))
    return model


@pytest.mark.parametrize("fmt", ["q4_1", "q8_0", "q4_1+lora"])
@pytest.mark.parametrize("interleaved", [False, True])
@pytest.mark.parametrize("aux", [(), (0, 2)])
def test_the_one_call_forward_gives_the_modules_bits(fmt, interleaved, aux, counted):
    """Decode, verify and short-chunk widths after a prompt (fed by the module: 20 > kernels.MAX_ROWS): the same
    outputs (the final norm, then the captured layers) and the same keys and values in every layer as the module's
    eager steps, on consecutive blocks (slices) and on blocks interleaved with another row's (storage rows). With a
    LoRA adapter the op adds each product's delta as LoRALinear does."""
    model = _model(fmt.split("+")[0])
    if fmt.endswith("+lora"):
        _with_lora(model)
    model.capture_layers(aux)
    widths = [20, 1, 4, 1, 1, 16, 3]
    results = []
    for native in (True, False):
        pool = PagedKVCachePool.for_model(model, 40, 4, 256, 2)
        slots = [pool.allocate() for _ in range(2 if interleaved else 1)]
        results.append((_steps(model, pool, slots, widths, native), pool))
    (a, pa), (b, pb) = results
    assert len(counted) == len(a) - len(results[0][0]) // len(widths)  # every step but the prompt's ran natively
    assert all(x.shape == y.shape and torch.equal(x, y) for x, y in zip(a, b))
    assert a[-1].shape[-1] == (1 + len(aux)) * model.config.hidden_size
    assert all(torch.equal(x, y) for x, y in zip(pa.k + pa.v, pb.k + pb.v))


@pytest.mark.parametrize("interleaved", [False, True])
def test_a_native_step_is_the_forward_of_a_prepared_plan(interleaved, counted):
    """``native_step`` (the runner's lone chain rows: no plan built) takes the blocks and length that ``prepare`` would
    and gives ``forward``'s bits, outputs and cache alike, on consecutive blocks and on blocks interleaved with another
    row's; the runner takes it for a lone row and ``forward`` for a batch."""
    from infer.engine.runner import ModelRunner

    model = _model("q8_0")
    model.capture_layers((1,))
    g = torch.Generator().manual_seed(5)
    chunks = [torch.randint(0, 96, (T,), generator=g).tolist() for T in (7, 1, 4, 16, 2)]
    results = []
    for native in (True, False):
        pool = PagedKVCachePool.for_model(model, 40, 4, 256, 2)
        slots = [pool.allocate() for _ in range(2 if interleaved else 1)]
        assert model.runs_natively(pool)  # what the runner asks before a native_step
        outs = []
        with torch.inference_mode():
            for ids in chunks:
                for s in slots:
                    if native:
                        outs.append(model.native_step(ids, pool, s))
                    else:
                        meta = pool.prepare([s], [len(ids)])
                        outs.append(model(torch.tensor([ids]), meta.positions, pool, meta))
        results.append((outs, pool, [pool.seq_len(s) for s in slots]))
    (a, pa, la), (b, pb, lb) = results
    assert la == lb and all(x.shape == y.shape and torch.equal(x, y) for x, y in zip(a, b))
    assert all(torch.equal(x, y) for x, y in zip(pa.k + pa.v, pb.k + pb.v))
    runner = ModelRunner.__new__(ModelRunner)
    runner.device = model.device
    pool = PagedKVCachePool.for_model(model, 40, 4, 256, 2)
    s, t = pool.allocate(), pool.allocate()
    calls = len(counted)
    with torch.inference_mode():
        lone = runner.forward(model, pool, [s], [chunks[0]])
        runner.forward(model, pool, [s, t], [chunks[1], chunks[1]])  # a batch: the module's path
    assert torch.equal(lone, a[0]) and len(counted) == calls + 1


def test_the_one_call_forward_runs_only_where_it_can(counted):
    """A batch, a token tree, a contiguous pool, a float32 model and an unquantized one take the module's path."""
    from infer.cache.base import TreeAttn

    model = _model()
    pool = PagedKVCachePool.for_model(model, 40, 4, 256, 3)
    a, b = pool.allocate(), pool.allocate()
    with torch.inference_mode():
        meta = pool.prepare([a, b], [3, 3])
        model(torch.zeros(2, 3, dtype=torch.long), meta.positions, pool, meta)
        tree = TreeAttn(positions=torch.tensor([[0, 1, 1]]), base=[0],
                        visible=torch.tensor([[[1, 0, 0], [1, 1, 0], [1, 0, 1]]], dtype=torch.bool))
        c = pool.allocate()
        meta = pool.prepare([c], [3], tree=tree)
        assert meta.tree
        model(torch.zeros(1, 3, dtype=torch.long), meta.positions, pool, meta)
        contiguous = SlottedKVCache.for_model(model, 64)
        s = contiguous.allocate()
        meta = contiguous.prepare([s], [2])
        model(torch.zeros(1, 2, dtype=torch.long), meta.positions, contiguous, meta)
        for other in (_model(dtype=torch.float32), random_llama(96, seed=3, hidden_size=64).to(torch.bfloat16)):
            p = PagedKVCachePool.for_model(other, 40, 4, 256, 1)
            s = p.allocate()
            meta = p.prepare([s], [2])
            other(torch.zeros(1, 2, dtype=torch.long), meta.positions, p, meta)
    assert counted == []
    with torch.inference_mode():
        meta = pool.prepare([a], [2])
        model(torch.zeros(1, 2, dtype=torch.long), meta.positions, pool, meta)
    assert counted == [(1, 2)]


def test_bad_storage_rows_are_refused_with_a_clear_error():
    model = _model()
    pool = PagedKVCachePool.for_model(model, 40, 4, 256, 1)
    s = pool.allocate()
    meta = pool.prepare([s], [3])
    meta.row0, meta.read_pos = None, torch.tensor([[0, 1, 10 ** 6]])
    with pytest.raises(RuntimeError, match="storage row outside the cache"), torch.inference_mode():
        model(torch.zeros(1, 3, dtype=torch.long), meta.positions, pool, meta)


def test_compiled_steps_give_the_one_call_forwards_bits():
    """A batch's steps stay compiled: a row's outputs there must be the bits its lone steps (one C++ call) and the
    eager steps give, or a request's tokens would depend on whether it ran alone or beside others, and a speculating
    engine (whose rows finish at other steps) would part from a plain one at near-ties. With inductor's fast defaults
    the compiled steps rounded the residual adds otherwise (model/compile.py)."""
    from infer.model.compile import compile_model

    model = _model(layers=2)
    compiled = _model(layers=2)
    compile_model(compiled)
    outs = []
    for m in (model, compiled):
        pool = PagedKVCachePool.for_model(m, 40, 4, 256, 2)
        slots = [pool.allocate(), pool.allocate()]
        g = torch.Generator().manual_seed(1)
        got = []
        for T in (9, 1, 4, 1):
            ids = torch.randint(0, 96, (2, T), generator=g)
            meta = pool.prepare(slots, [T, T])
            with torch.inference_mode():
                got.append(m(ids, meta.positions, pool, meta).clone())
        outs.append(got)
    assert compiled.compiled is not None
    assert all(torch.equal(x, y) for x, y in zip(*outs))


def test_engines_keep_greedy_parity_with_lone_rows_in_one_call(ckpt_dirs, counted):
    """Plain and speculating engines over a bfloat16 Q4_1 target, two requests at a time and then one alone: the lone
    rows' decode, verify and K = 0 steps run as one call, the batches' steps through the module, and both engines
    write the same tokens."""
    d = ckpt_dirs["mha"]
    kw = dict(dtype="bfloat16", quantization="q4_1", compile=False, max_batch_size=2, block_size=4)
    greedy = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    prompts = ["def fib(n):", "The quick brown fox", "import os"]
    plain = LLM(d, **kw)
    spec = LLM(d, draft_model=d, spec_length=3, **kw)
    want = [o.token_ids for o in plain.generate(prompts, greedy)]
    lone = len(counted)
    assert lone > 0
    assert [o.token_ids for o in spec.generate(prompts, greedy)] == want
    assert len(counted) > lone and spec.engine.stats.num_draft_tokens > 0
    assert any(shape[1] > 1 for shape in counted[lone:])  # verifies among them


def test_weights_moved_after_a_step_are_the_ones_read():
    """model.hugepages replaces each weight buffer by a copy on huge pages while the engine serves: the next step must
    read the new buffers (the old ones freed), not the ones a first step found."""
    model = _model()
    pool = PagedKVCachePool.for_model(model, 40, 4, 256, 1)
    s = pool.allocate()
    with torch.inference_mode():
        meta = pool.prepare([s], [1])
        model(torch.zeros(1, 1, dtype=torch.long), meta.positions, pool, meta)
        qkv = model.layers[0].self_attn.qkv_proj
        qkv._buffers["packed"] = qkv.packed.clone()  # as model.hugepages._place moves every buffer,
        model._on_hugepages = True  # then marks the model moved
        meta = pool.prepare([s], [1])
        model(torch.zeros(1, 1, dtype=torch.long), meta.positions, pool, meta)
    assert model._native_args[0][0][0] is qkv.packed
