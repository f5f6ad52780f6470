"""Scoring by embeddings (infer.scoring, LLM.score): a pair's score is the cosine of the two texts' LLM.embed
vectors, the pairs are vLLM's (one against many, or pairwise), each distinct text is embedded once, a score is the
same whatever is scored beside it, and bad input is refused before anything runs."""

import pytest
import torch

from infer import LLM, PoolingParams
from infer.scoring import pair_up, rank

QUERY = "def fib(n):"
DOCS = ["def fib(n): return n", "hello world, hello again", "a"]


@pytest.fixture(scope="module")
def llm(gqa_dir):
    return LLM(gqa_dir, dtype="float32", max_batch_size=2, block_size=4)


def _cos(a, b):
    a, b = torch.tensor(a), torch.tensor(b)
    return (a @ b / (a.norm() * b.norm())).item()


def test_pairs_are_one_against_many_or_pairwise():
    assert pair_up(1, 3) == [(0, 0), (0, 1), (0, 2)]
    assert pair_up(2, 2) == [(0, 0), (1, 1)]
    assert pair_up(1, 1) == [(0, 0)]
    for n1, n2 in ((2, 3), (3, 1), (0, 2), (1, 0)):
        with pytest.raises(ValueError, match=f"{n1} first texts and {n2}|at least one text"):
            pair_up(n1, n2)


def test_rank_is_best_first_ties_in_input_order_and_top_n_keeps_the_best():
    assert rank([0.1, 0.9, 0.5, 0.9]) == [1, 3, 2, 0]
    assert rank([0.1, 0.9, 0.5, 0.9], top_n=2) == [1, 3]
    assert rank([0.3, 0.2], top_n=5) == [0, 1]


@pytest.mark.parametrize("pooling", ["last", "mean"])
def test_a_score_is_the_cosine_of_the_two_embeddings(llm, pooling):
    params = PoolingParams(pooling)
    outs = llm.score(QUERY, DOCS, params)
    q = llm.embed(QUERY, params)[0]
    docs = llm.embed(DOCS, params)
    assert len(outs) == len(DOCS)
    for o, d in zip(outs, docs):
        assert o.prompt_token_ids == q.prompt_token_ids + d.prompt_token_ids
        assert o.outputs.score == pytest.approx(_cos(q.outputs.embedding, d.outputs.embedding), abs=1e-6)
    assert len({round(o.outputs.score, 6) for o in outs}) == len(DOCS)  # the documents score apart
    unnormalized = llm.score(QUERY, DOCS, PoolingParams(pooling, normalize=False))
    assert [o.outputs.score for o in unnormalized] == pytest.approx([o.outputs.score for o in outs], abs=1e-5)
    assert llm.score(QUERY, QUERY, params)[0].outputs.score == pytest.approx(1.0, abs=1e-6)


def test_pairwise_scores_equal_each_pair_scored_alone_and_each_text_is_embedded_once(llm, monkeypatch):
    firsts = [QUERY, DOCS[1]]
    together = [o.outputs.score for o in llm.score(firsts, DOCS[:2])]
    alone = [llm.score(a, b)[0].outputs.score for a, b in zip(firsts, DOCS[:2])]
    assert together == alone  # bit for bit: each text's forward runs alone
    calls = []
    embed = llm.engine.embed
    monkeypatch.setattr(llm.engine, "embed", lambda ids, p=None: (calls.append(ids), embed(ids, p))[1])
    llm.score(QUERY, [DOCS[0], DOCS[0], DOCS[2]])
    assert len(calls) == 3  # the query once, the repeated document once
    ids = llm.tokenizer.encode(DOCS[2])
    assert llm.score({"prompt_token_ids": ids}, DOCS[2])[0].outputs.score == pytest.approx(1.0, abs=1e-6)


def test_bad_input_is_refused_before_anything_runs(llm, monkeypatch):
    calls = []
    monkeypatch.setattr(llm.engine, "embed", lambda *a: calls.append(a))
    with pytest.raises(ValueError, match="2 first texts and 3"):
        llm.score([QUERY, DOCS[0]], DOCS)
    with pytest.raises(ValueError, match="prompt is empty"):
        llm.score(QUERY, [DOCS[0], ""])
    with pytest.raises(ValueError, match="exceeds the maximum sequence length"):
        llm.score(QUERY, [DOCS[0], [1] * (llm.engine.max_seq_len + 1)])
    with pytest.raises(TypeError, match="pooling_params is a PoolingParams"):
        llm.score(QUERY, DOCS, [PoolingParams()])
    with pytest.raises(ValueError, match="at least one text"):
        llm.score(QUERY, [])
    assert calls == []
