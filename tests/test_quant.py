"""Quantized targets (weight-only int8/int4; llama.cpp's Q8_0/Q4_0/Q4_1 blocks with int8 activations): the kernels
compute with the weights they store, and speculation stays exactly lossless relative to the quantized target (greedy
parity on both KV backends, the chi-square test on the sampled law)."""

import pytest
import torch

from infer.engine import Engine, EngineConfig
from infer.model.quant import BlockLinear, Int8Linear, quantize_blocks, quantize_model
from infer.sampling import SamplingParams
from infer.testing import random_llama

from test_spec_distribution import N, V, chi2_pvalue, exact_joint


def _blocks(fmt):
    def make(w, b, cdt):
        return BlockLinear.quantize(w, b, cdt, fmt)
    make.__name__ = fmt
    return make


@pytest.mark.parametrize("cls", [Int8Linear, _blocks("q8_0"), _blocks("q4_0"), _blocks("q4_1")],
                         ids=lambda c: c.__name__)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_quantized_linear_computes_with_its_own_weights(cls, dtype):
    torch.manual_seed(0)
    w, b, x = torch.randn(96, 128) * 0.05, torch.randn(96), torch.randn(2, 3, 128)
    q = cls(w, b.to(dtype), torch.bfloat16)
    deq = q.dequantized_weight().float()
    groups = w.view(96, -1, 32)
    fmt = getattr(q, "fmt", None)
    step = ((groups.amax(-1) - groups.amin(-1)).max() / 15 if fmt == "q4_1"
            else groups.abs().amax() / 7.5 if fmt == "q4_0"  # d = max / -8, the other end 7 steps away
            else groups.abs().amax() / 127 if fmt == "q8_0" else w.abs().amax() / 127)
    assert (deq - w).abs().max() <= step / 2 + 1e-3  # round-to-nearest: half a quantization step
    y = q(x.to(dtype))
    assert y.shape == (2, 3, 96) and y.dtype == dtype
    ref = x.to(torch.bfloat16).float() @ deq.t() + b
    # bfloat16 activations in the weight-only kernels; int8 blocks (a 1/254 of each block's range) in qlinear
    assert (y.float() - ref).abs().max() < 0.05


def test_quantize_model_replaces_every_projection_and_unties_the_head():
    model = random_llama(V, hidden_size=32)
    logits = model.compute_logits(model(torch.tensor([[1, 2, 3]])))
    quantize_model(model, "int8")
    kinds = {type(m).__name__ for m in model.modules()}
    assert "Int8Linear" in kinds and "Linear" not in kinds and model.quantization == "int8"
    q_logits = model.compute_logits(model(torch.tensor([[1, 2, 3]])))
    assert (q_logits - logits).abs().max() < 0.1 * logits.abs().max()  # close to, not equal to, the original
    with pytest.raises(ValueError, match="quantization"):
        quantize_model(random_llama(V), "int3")
    with pytest.raises(ValueError, match="already quantized"):
        quantize_model(model, "q4_1")


@pytest.mark.parametrize("fmt", ["q8_0", "q4_0", "q4_1"])
def test_block_quantization_keeps_an_8_bit_head_as_llama_cpp_does(fmt):
    model = random_llama(V, hidden_size=32)
    head = model.lm_head_weight.detach().float().clone()
    quantize_model(model, fmt)
    layers = [m for name, m in model.named_modules() if isinstance(m, BlockLinear) and name != "lm_head"]
    assert len(layers) == 4 * len(model.layers) and all(m.fmt == fmt for m in layers)
    assert model.lm_head.fmt == "q8_0" and torch.equal(model.lm_head.blocks(), quantize_blocks(head, "q8_0"))
    assert quantize_model(random_llama(V, hidden_size=32), "int4").layers[0].mlp.down_proj.fmt == "q4_1"  # a name
    with pytest.raises(ValueError, match="must be uint8"):
        BlockLinear(torch.zeros(8, 10, dtype=torch.uint8), "q8_0", 64, None, torch.bfloat16)


def _greedy(engine, prompts, n=20):
    reqs = [engine.add_request(p, SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)) for p in prompts]
    return [r.output_ids for r in engine.run(reqs)]


@pytest.mark.parametrize("kind", ["int8", "q8_0", "q4_0", "q4_1"])
@pytest.mark.parametrize("backend", ["paged", "contiguous"])
def test_speculation_on_a_quantized_target_equals_its_greedy_output(kind, backend):
    target = quantize_model(random_llama(64, seed=0, hidden_size=64), kind)
    drafter = random_llama(64, seed=1, noise_from=0, noise=0.3, hidden_size=64)
    prompts = [[1, 2, 3], [5, 9, 11, 40, 2], [7]]
    cfg = dict(model="t", kv_cache_backend=backend, block_size=4, quantization=kind)
    plain = _greedy(Engine(EngineConfig(**cfg), model=target), prompts)
    spec_engine = Engine(EngineConfig(draft_model="d", spec_length=3, **cfg), model=target, draft_model=drafter)
    assert _greedy(spec_engine, prompts) == plain
    assert 0 < spec_engine.stats.num_accepted_tokens < spec_engine.stats.num_draft_tokens  # drafts were judged


@pytest.mark.parametrize("kind", ["int8", "q4_1"])  # q4_1 stands for the block types: one kernel
def test_sampled_law_of_a_quantized_target(kind):
    """N requests drafted from their first token reproduce the quantized target's exact joint law."""
    target = quantize_model(random_llama(V, seed=0), kind)
    drafter = random_llama(V, seed=1, noise_from=0, noise=0.3)
    eng = Engine(EngineConfig(model="t", draft_model="d", spec_length=2, max_batch_size=32, block_size=4, seed=7),
                 model=target, draft_model=drafter)
    params = SamplingParams(temperature=1.0, max_tokens=3)
    reqs = eng.run([eng.add_request([1, 2, 3], params) for _ in range(N)])
    counts = torch.zeros(V, V)
    for r in reqs:
        counts[r.output_ids[0], r.output_ids[1]] += 1
    assert 0.2 < eng.stats.acceptance_rate < 0.95
    assert chi2_pvalue(counts, exact_joint(target, params, first=1, prompt=[1, 2, 3])) > 0.001
