"""Draft vocabulary (FR-Spec): the drafter scores a token subset. Head math, ranking files, greedy parity through
the library loop and the engine, and bad input. The sampled law with a subset is in the distribution tests."""

import json
import shutil

import pytest
import torch

from infer import LLM, SamplingParams
from infer.engine import EngineConfig
from infer.model import load_model
from infer.speculative import speculative_generate
from infer.proposers.draft_vocab import RANKING_FILE, DraftVocab, load_ranking, write_ranking
from infer.testing import make_tiny_llama

from test_speculative import PROMPTS, assert_greedy_parity


@pytest.fixture(scope="module")
def pair(gqa_dir, tmp_path_factory):
    """Target, a weak 1-layer drafter, and the drafter's directory with a ranking that puts odd ids first."""
    d = make_tiny_llama(tmp_path_factory.mktemp("drafter"), "gqa", seed=1, num_hidden_layers=1)
    target, drafter = load_model(gqa_dir), load_model(d)
    V = drafter.config.vocab_size
    write_ranking(d, [1 + (i % 2) for i in range(V)], "test: odd ids rank first")
    return target, drafter, d


def test_head_scores_exactly_the_subset_and_expands_with_minus_inf(pair):
    _, drafter, _ = pair
    V = drafter.config.vocab_size
    dv = DraftVocab(drafter.lm_head_weight, [7, 3, 3, 250])  # unsorted, duplicated: kept sorted and unique
    assert dv.id_list == [3, 7, 250] and dv.size == 3 and dv.vocab_size == V
    hidden = torch.randn(2, 5, drafter.config.hidden_size)
    full = drafter.compute_logits(hidden)  # [2, 5, V]
    sub = dv.logits(hidden)  # [2, 5, 3]
    assert sub.dtype == torch.float32
    torch.testing.assert_close(sub, full[..., [3, 7, 250]])
    big = dv.expand(sub)
    assert big.shape == full.shape
    torch.testing.assert_close(big[..., dv.ids], sub)
    outside = torch.ones(V, dtype=torch.bool)
    outside[dv.ids] = False
    assert torch.isinf(big[..., outside]).all() and (big[..., outside] < 0).all()
    # The subset's argmax is the argmax over V restricted to S, ties to the lowest id like argmax over V.
    assert torch.equal(dv.token(sub.argmax(-1)), big.argmax(-1))


def test_including_adds_tokens_and_reuses_itself_when_nothing_is_new(pair):
    _, drafter, _ = pair
    dv = DraftVocab(drafter.lm_head_weight, [1, 2])
    assert dv.including([2, 1]) is dv
    more = dv.including([9, 2])
    assert more.id_list == [1, 2, 9] and dv.id_list == [1, 2]
    torch.testing.assert_close(more.weight, drafter.lm_head_weight[[1, 2, 9]])


def test_a_quantized_vocabulary_scores_its_rows_on_the_block_kernel_and_adds_prompt_tokens_beside_them(pair):
    """DraftVocab.quantized (issue 33): the same ids, scored by Q8_0 rows (within Q8_0's error of the float rows);
    tokens added later (a prompt's) are scored unquantized beside them, their ids after the quantized part's."""
    from infer.model.quant import BlockLinear

    _, drafter, _ = pair
    dv = DraftVocab(drafter.lm_head_weight, range(0, 200, 3))
    q = dv.quantized("q8_0")
    assert isinstance(q.head, BlockLinear) and q.id_list == dv.id_list and dv.head is None
    hidden = torch.randn(3, drafter.config.hidden_size)
    exact = dv.logits(hidden)
    assert (q.logits(hidden) - exact).abs().max() <= 0.02 * exact.abs().max()
    more = q.including([1, 4, 3])  # 3 is in S already
    assert more.id_list == dv.id_list + [1, 4] and more.head is q.head
    got = more.logits(hidden)
    assert got.shape == (3, dv.size + 2)
    torch.testing.assert_close(got[:, -2:], drafter.compute_logits(hidden)[:, [1, 4]])
    assert torch.equal(more.token(torch.tensor([dv.size, dv.size + 1])), torch.tensor([1, 4]))
    assert more.including([4, 9, 11]).id_list == dv.id_list + [1, 4, 11]  # 9 is in S: rebuilt from the base rows
    assert q.quantized(None) is q


def test_ranking_round_trip_orders_by_count_then_id(tmp_path):
    write_ranking(tmp_path, [5, 9, 5, 0, 9], "test")
    assert load_ranking(tmp_path) == [1, 4, 0, 2, 3]
    data = json.loads((tmp_path / RANKING_FILE).read_text())
    assert data["counts"] == [9, 9, 5, 5, 0] and data["vocab_size"] == 5


@pytest.mark.parametrize("k", [1, 4])
def test_greedy_parity_with_a_draft_vocabulary(pair, k):
    """Half the vocabulary (odd ids) plus the prompt's tokens: the output is still the target's greedy output."""
    target, drafter, d = pair
    dv = DraftVocab.from_ranking(drafter, load_ranking(d), drafter.config.vocab_size // 2)
    assert_greedy_parity(target, drafter, spec_length=k, draft_vocab=dv)


def test_self_drafting_with_a_subset_rejects_exactly_outside_it(pair):
    """The target drafting for itself accepts every draft it can express; a target choice outside S (and not in
    the prompt) is the only thing that rejects. Both happen here, and the output stays the target's."""
    target, _, _ = pair
    dv = DraftVocab(target.lm_head_weight, range(0, target.config.vocab_size, 2))  # even ids
    runs = assert_greedy_parity(target, target, spec_length=3, draft_vocab=dv)
    for (out, stats), prompt in zip(runs, PROMPTS):
        allowed = set(dv.id_list) | set(prompt)
        for r in stats.rounds:
            assert all(t in allowed for t in r.drafted)
            if r.num_accepted < r.k:  # the target's token at the rejected position lies outside S
                assert r.emitted[-1] not in allowed
    rounds = [r for _, st in runs for r in st.rounds]
    assert any(r.num_accepted == r.k for r in rounds) and any(r.num_accepted < r.k for r in rounds)


def test_debug_egag_and_penalty_paths_accept_a_subset(pair):
    """EGAG reads the drafter's entropy from the expanded logits; the penalty path drafts from expanded probs."""
    target, drafter, d = pair
    dv = DraftVocab.from_ranking(drafter, load_ranking(d), 64)
    assert_greedy_parity(target, drafter, PROMPTS[:3], draft_vocab=dv, spec_length="egag", spec_length_max=4)
    assert_greedy_parity(target, drafter, PROMPTS[:3], spec_length=3, draft_vocab=dv, repetition_penalty=1.5)


def test_engine_greedy_parity_with_draft_vocab_size(gqa_dir, pair):
    _, _, d = pair
    prompts = ["def fib", "Hello world", "import os\n", "x = 1"]
    params = SamplingParams(temperature=0, max_tokens=20)
    base = LLM(gqa_dir).generate(prompts, params)
    llm = LLM(gqa_dir, draft_model=d, spec_length=3, draft_vocab_size=100, max_batch_size=3)
    assert llm.draft_vocab is not None and llm.draft_vocab.size == 100
    outs = llm.generate(prompts, params)
    assert [o.token_ids for o in outs] == [o.token_ids for o in base]
    assert sum(o.num_draft_tokens for o in outs) > 0


def test_bad_draft_vocab_input(gqa_dir, pair, tmp_path):
    _, drafter, d = pair
    V = drafter.config.vocab_size
    with pytest.raises(ValueError, match="needs a draft_model"):
        EngineConfig(model=gqa_dir, draft_vocab_size=10)
    for bad in (0, -3, True, 2.5):
        with pytest.raises(ValueError, match="draft_vocab_size"):
            EngineConfig(model=gqa_dir, draft_model=d, draft_vocab_size=bad)
    with pytest.raises(ValueError, match=rf"\[1, {V}\]"):
        LLM(gqa_dir, draft_model=d, draft_vocab_size=V + 1)
    no_ranking = tmp_path / "plain"
    shutil.copytree(d, no_ranking)
    (no_ranking / RANKING_FILE).unlink()
    with pytest.raises(ValueError, match="draft_vocab.json"):
        LLM(gqa_dir, draft_model=no_ranking, draft_vocab_size=10)
    (no_ranking / RANKING_FILE).write_text("{not json")
    with pytest.raises(ValueError, match="not a draft-vocabulary ranking"):
        load_ranking(no_ranking)
    (no_ranking / RANKING_FILE).write_text(json.dumps({"ranked_token_ids": [0, V + 5]}))
    with pytest.raises(ValueError, match="must lie in"):
        LLM(gqa_dir, draft_model=no_ranking, draft_vocab_size=2)
    with pytest.raises(ValueError, match="at least one token"):
        DraftVocab(drafter.lm_head_weight, [])
    other = DraftVocab(torch.zeros(V + 8, drafter.config.hidden_size), [0, 1])
    with pytest.raises(ValueError, match=f"vocabulary of {V + 8} tokens"):
        speculative_generate(load_model(gqa_dir), drafter, [0, 5], SamplingParams(temperature=0, max_tokens=3),
                             draft_vocab=other)
