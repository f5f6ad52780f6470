"""The CUDA path: the engine's plain and speculative steps on a GPU, checked as the CPU suite checks them.

On a GPU machine ``python -m pytest tests/test_cuda.py`` runs them on CUDA; without one (CI) the same checks run on
the CPU, which keeps this file itself working (``INFER_TEST_DEVICE`` names a device: "cuda" where none is present
skips them). Covered, on the device:
- plain greedy decoding equal to transformers' greedy (float32, on the CPU) on a tiny checkpoint;
- greedy parity of every proposer with plain decoding (float32): a draft model, n-gram, suffix, the EAGLE / EAGLE-3
  / Medusa heads, a token tree, both KV backends, a batch that preempts;
- the exact joint law of two tokens under sampling through the batched engine (chi-square, as
  test_engine_distribution.py; float32 and bfloat16), and a lossy acceptance rule caught by the same check;
- quantized targets (q8_0, q4_1, int8: CUDA has no infer kernels, so their matmuls dequantize) and compiled steps
  (inductor's Triton kernels): speculation still reproduces plain decoding exactly.
"""

import os
import random

import pytest
import torch

from infer.engine import Engine, EngineConfig
from infer.model import load_model
from infer.sampling import SamplingParams
from infer.testing import make_tiny_llama, random_heads, random_llama

from test_spec_distribution import N, V, chi2_pvalue, exact_joint

DEVICE = os.environ.get("INFER_TEST_DEVICE", "cuda" if torch.cuda.is_available() else "cpu")
pytestmark = pytest.mark.skipif(DEVICE.startswith("cuda") and not torch.cuda.is_available(),
                                reason="INFER_TEST_DEVICE names CUDA, and torch sees no CUDA device")

GREEDY = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)


def _prompts(vocab: int, n: int = 6, seed: int = 1) -> list[list[int]]:
    rnd = random.Random(seed)
    return [[rnd.randrange(0, vocab) for _ in range(rnd.randrange(3, 20))] for _ in range(n)]


def _engine(target, drafter=None, **cfg) -> Engine:
    cfg = {"model": "target", "device": DEVICE, "block_size": 4, **cfg}
    if drafter is not None:
        cfg.setdefault("draft_model", "drafter")
    return Engine(EngineConfig(**cfg), model=target, draft_model=drafter)


def _run(eng: Engine, prompts, params=GREEDY) -> list[list[int]]:
    return [r.output_ids for r in eng.run([eng.add_request(p, params, eos_token_ids=[]) for p in prompts])]


@pytest.fixture(scope="module")
def tiny(gqa_dir, tmp_path_factory):
    """A tiny checkpoint and a weak 1-layer drafter sharing its tokenizer, both on the device."""
    d = make_tiny_llama(tmp_path_factory.mktemp("drafter"), "gqa", seed=1, num_hidden_layers=1)
    return load_model(gqa_dir, device=DEVICE), load_model(d, device=DEVICE)


def test_the_models_are_on_the_device(tiny):
    target, drafter = tiny
    assert target.device.type == torch.device(DEVICE).type == drafter.device.type


def test_plain_greedy_equals_transformers(gqa_dir, hf_model, tiny):
    """Our model on the device against transformers' on the CPU: the argmax of each full forward, token by token
    (no cache on their side, so nothing of ours is shared with the reference)."""
    target, _ = tiny
    hf = hf_model(gqa_dir)
    prompts = _prompts(target.config.vocab_size, n=4)
    for p, got in zip(prompts, _run(_engine(target), prompts)):
        ids = list(p)
        with torch.no_grad():
            for _ in range(GREEDY.max_tokens):
                ids.append(int(hf(torch.tensor([ids])).logits[0, -1].argmax()))
        assert got == ids[len(p):]


@pytest.mark.parametrize("backend", ["paged", "contiguous"])
@pytest.mark.parametrize("how", ["draft K=3", "draft auto K", "ngram", "suffix", "hybrid", "tree"])
def test_speculation_equals_plain_greedy(tiny, backend, how):
    """float32: an eager bfloat16 step of 1 token and one of K + 1 round differently (another GEMM, on the CPU too),
    so bfloat16 greedy outputs part at near-ties; its sampled law is checked below."""
    target, drafter = tiny
    prompts = _prompts(target.config.vocab_size)
    prompts += [p + p for p in prompts[:2]]  # repeats: the n-gram and suffix proposers find matches
    want = _run(_engine(target, kv_cache_backend=backend), prompts)
    cfg = {"draft K=3": dict(spec_length=3), "draft auto K": dict(spec_length="auto"),
           "ngram": dict(proposer="ngram", spec_length=3), "suffix": dict(proposer="suffix", spec_length=3),
           "hybrid": dict(proposer="hybrid", spec_length=3), "tree": dict(spec_length=3, spec_tree="3x2")}[how]
    eng = _engine(target, None if how in ("ngram", "suffix") else drafter, kv_cache_backend=backend, **cfg)
    if how == "draft auto K":
        _price_drafts_cheap(eng)
    assert _run(eng, prompts) == want
    assert eng.stats.num_draft_tokens > 0  # the rounds drafted: parity was not plain decoding twice


def _price_drafts_cheap(eng: Engine) -> None:
    """Auto K drafts where the cost model says drafting pays. On an H100 a tiny drafter's step is launch-bound, as
    costly as the tiny target's, and auto K rightly drafted nothing on one backend; a flat verify and near-free
    draft steps make it draft, so the parity check covers its rounds (the measured costs then update the model)."""
    from infer.spec_decode.cost_model import CostModel

    B, k = eng.config.max_batch_size, eng.config.spec_length_max
    eng.decoder.spec_length.costs = CostModel.from_points(B, k, {(b, t): 1e-3 for b in (1, B) for t in (1, k + 1)},
                                                          {b: 1e-6 for b in (1, B)})


@pytest.mark.parametrize("kind", ["eagle", "eagle3", "medusa"])
def test_heads_equal_plain_greedy_in_a_batch_that_preempts(kind):
    target = random_llama(64, seed=0).to(DEVICE)
    head = random_heads(target, kind, seed=3)
    prompts = _prompts(64, n=8)
    want = _run(_engine(target), prompts)
    eng = _engine(target, head, spec_length=3, max_batch_size=6, num_kv_blocks=14)
    assert _run(eng, prompts) == want
    assert eng.stats.num_preemptions > 0
    assert eng.free_kv_tokens() == eng.initial_free_kv_tokens


@pytest.mark.parametrize("quantization", ["q8_0", "q4_1", "int8"])
def test_quantized_target_speculation_equals_plain(gqa_dir, quantization):
    target = load_model(gqa_dir, device=DEVICE)
    drafter = load_model(gqa_dir, device=DEVICE)  # self-drafting: every draft is judged, most accepted
    prompts = _prompts(target.config.vocab_size, n=4)
    want = _run(_engine(target, quantization=quantization), prompts)
    assert target.quantization == quantization
    eng = _engine(target, drafter, spec_length=3, quantization=quantization)
    assert _run(eng, prompts) == want


def test_compiled_steps_equal_eager_and_speculation_equals_plain(gqa_dir):
    eager = load_model(gqa_dir, device=DEVICE)
    prompts = _prompts(eager.config.vocab_size, n=3)
    want = _run(_engine(eager, compile=False), prompts)
    target, drafter = load_model(gqa_dir, device=DEVICE), load_model(gqa_dir, device=DEVICE)
    plain = _engine(target, compile=True)
    assert plain.compiled
    assert _run(plain, prompts) == want  # a tiny checkpoint's peaked logits: no rounding flips a greedy choice
    spec = _engine(load_model(gqa_dir, device=DEVICE), drafter, compile=True, spec_length=3)
    assert _run(spec, prompts) == want


def _pvalue(params, head: str | None = None, dtype=torch.float32, **cfg) -> float:
    """N concurrent sampled requests on the device: the chi-square p-value of the first two generated tokens (one
    round: a one-token prompt has no prefill to sample from) against the target's exact law (on the CPU)."""
    target_cpu = random_llama(V, seed=0).to(dtype)
    target = random_llama(V, seed=0).to(DEVICE, dtype)
    if head is None:
        drafter = random_llama(V, seed=1, noise_from=0, noise=0.3).to(DEVICE, dtype)
        prompt, first = [1], 1
    else:  # a head drafts from the prefill's state: token 1 comes from the prefill, 2 and 3 from the round
        drafter = random_heads(target, head, seed=3)
        prompt, first = [1, 2], 2
    eng = _engine(target, drafter, spec_length=2, max_batch_size=32, seed=1234, **cfg)
    counts = torch.zeros(V, V)
    for out in _run(eng, [prompt] * N, params):
        counts[out[first - 1], out[first]] += 1
    assert 0.1 < eng.stats.acceptance_rate < 0.9  # drafts are judged, and rejected often
    return chi2_pvalue(counts, exact_joint(target_cpu, params, first=first, prompt=prompt))


T1 = SamplingParams(temperature=1.0, max_tokens=4)


@pytest.mark.parametrize("case", ["draft model", "draft model, contiguous", "T=0.7+top-k+top-p", "bfloat16",
                                  "eagle head", "tree", "eagle3 head, T=0.7+top-k+top-p"])
def test_joint_distribution_equals_target(case):
    """"eagle3 head, T=0.7+top-k+top-p": the filtered rows draw their drafts at their plain temperature inside the
    head's round (proposers.base.temperature_law_drafts), on the device."""
    params = SamplingParams(temperature=0.7, top_k=5, top_p=0.9, max_tokens=4) if "top-k" in case else T1
    cfg = {"draft model, contiguous": dict(kv_cache_backend="contiguous"), "tree": dict(spec_tree="2x2"),
           "bfloat16": dict(dtype=torch.bfloat16)}.get(case, {})
    head = "eagle" if case == "eagle head" else "eagle3" if case.startswith("eagle3") else None
    assert _pvalue(params, head=head, **cfg) > 0.001


def test_a_lossy_rule_is_caught_on_the_device():
    assert _pvalue(T1, acceptance="skip_adjustment") < 1e-4
