"""Weights moved onto huge pages (model/hugepages.py): same values, tied weights still tied, same outputs."""

import pytest
import torch

from infer import LLM, SamplingParams
from infer.model import load_model
from infer.model.hugepages import HUGE_PAGE, hugepages_supported, place_on_hugepages
from infer.model.quant import quantize_model


@pytest.mark.parametrize("quantization", [None, "int8"])
def test_place_on_hugepages_keeps_every_value_and_tie(ckpt_dirs, quantization):
    model = quantize_model(load_model(ckpt_dirs["tied"], torch.float32), quantization)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    unique = {id(t): t.nbytes for t in (*model.parameters(), *model.buffers())}  # incl. non-persistent buffers
    x = torch.randint(0, model.config.vocab_size, (1, 9))
    logits = model.compute_logits(model(x))
    moved = place_on_hugepages(model)
    if not hugepages_supported():
        assert moved == 0
        return
    assert moved == sum(unique.values())  # every tensor once (a tied head has no tensor of its own)
    after = model.state_dict()
    assert before.keys() == after.keys() and all(torch.equal(before[k], after[k]) for k in before)
    first = next(iter(model.parameters()))
    assert first.data_ptr() % HUGE_PAGE == 0  # the arena starts on a 2 MiB boundary
    if quantization is None:
        assert model.lm_head is None  # tied: compute_logits still reads the (moved) embedding
    assert torch.equal(model.compute_logits(model(x)), logits)


def test_engine_places_cpu_weights_and_generates_the_same(gqa_dir):
    p = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    llm = LLM(gqa_dir, compile=False)
    if hugepages_supported():
        assert next(iter(llm.model.parameters())).data_ptr() % HUGE_PAGE == 0
    ref = load_model(gqa_dir, torch.float32)
    ids = [[5, 7, 11, 13]]
    out = llm.generate(ids, p)[0].token_ids
    x = torch.tensor(ids)
    assert torch.equal(llm.model.compute_logits(llm.model(x)), ref.compute_logits(ref(x)))
    assert len(out) == 12


def test_kv_storage_is_zeroed_on_hugepages_and_writable_to_its_end():
    from infer.cache.base import kv_storage

    rows = HUGE_PAGE // (3 * 64 * 2) + 7  # past one huge page: the arena's path where THP is offered
    t = kv_storage((rows, 3, 64), torch.bfloat16, torch.device("cpu"))
    assert t.shape == (rows, 3, 64) and t.dtype == torch.bfloat16 and t.is_contiguous()
    assert not t.any()  # zeros: masked keys meet the attention with weight 0 (kv_storage)
    if hugepages_supported():
        assert t.data_ptr() % HUGE_PAGE == 0
    t[-1] = 1.5
    t[0, 0, 0] = -2
    assert t[-1].float().sum().item() == 1.5 * 3 * 64 and t[0, 0, 0].item() == -2 and not t[1:-1].any()
    small = kv_storage((4, 3, 64), torch.float32, torch.device("cpu"))  # under a huge page: calloc's zeros
    assert small.shape == (4, 3, 64) and not small.any()
