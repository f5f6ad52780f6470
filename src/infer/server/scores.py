"""vLLM's ``/score`` and ``/rerank`` (Jina's and Cohere's rerank shape) on the served model read as a bi-encoder:
a pair scores the cosine of its two texts' embeddings (infer.scoring; each pooled as ``/v1/embeddings`` pools,
the server's ``--pooling``). ``/score``: one ``text_1`` against each ``text_2``, or lists of one length pairwise;
``/rerank``: the documents by their score against the query, best first, ``top_n`` of them (0: all). Every text
is tokenised and checked before any is embedded, a text met twice is embedded once, and each embedding runs on the
engine's thread between two steps."""

from __future__ import annotations

from fastapi import APIRouter
from pydantic import BaseModel, field_validator
from starlette.concurrency import run_in_threadpool

from ..engine.async_engine import EngineStoppedError
from ..pooling import PoolingParams
from ..scoring import cosine, pair_up, rank
from . import protocol as P
from .completions import _check_model, _prompt_ids
from .errors import ApiError
from .state import CurrentState

router = APIRouter()


class _Pooled(BaseModel):
    model_config = P.STRICT

    model: str
    truncate_prompt_tokens: int | None = None  # vLLM's: each text's last n tokens (-1: as many as the context holds)

    _truncate = field_validator("truncate_prompt_tokens")(P.valid_truncation)


class ScoreRequest(_Pooled):
    text_1: str | list[str]
    text_2: str | list[str]

    _valid = field_validator("text_1", "text_2")(P.valid_text)


class RerankDocument(BaseModel):
    model_config = P.STRICT

    text: str


class RerankRequest(_Pooled):
    query: str
    documents: list[str | RerankDocument]
    top_n: int = 0  # 0: every document
    return_documents: bool = True  # Cohere's; vLLM always returns them

    _valid = field_validator("query")(P.valid_text)
    @field_validator("top_n")
    @classmethod
    def _top_n(cls, v: int) -> int:
        if v < 0:
            raise ValueError(f"must be >= 0 (the best documents kept; 0: all), got {v}")
        return v

    def texts(self) -> list[str]:
        return [d if isinstance(d, str) else d.text for d in self.documents]


async def _scores(state, firsts: list[str], seconds: list[str], params: PoolingParams,
                  names: tuple[str, str]) -> tuple[list[float], int]:
    """Each pair's cosine and the tokens read (each distinct text once)."""
    try:
        pairs = pair_up(len(firsts), len(seconds))
    except ValueError as e:
        raise ApiError(400, str(e), param=names[1] if firsts and len(firsts) == 1 else names[0]) from None
    for name, texts in zip(names, (firsts, seconds)):
        if "" in texts:
            raise ApiError(400, f"{name} holds an empty text: nothing to embed", param=name)
    unique = list(dict.fromkeys(firsts + seconds))
    ids = await run_in_threadpool(_prompt_ids, state.tokenizer, unique, state.vocab_size)
    checked = {}
    for text, i in zip(unique, ids):  # every text checked before any runs
        try:
            checked[text] = state.engine.engine.check_embedding(i, params)
        except ValueError as e:
            name = names[0] if text in firsts else names[1]
            raise ApiError(400, f"{name}: {e}", param=name) from None
    vectors = {}
    for text, i in checked.items():
        try:
            vectors[text] = await state.engine.embed(i, params)  # [hidden_size] float32
        except EngineStoppedError as e:  # e.g. the model thread died: nothing can run now
            raise ApiError(503, str(e), "server_error") from e
    tokens = sum(len(i) for i in checked.values())
    state.metrics.embedded(len(checked), tokens)
    return [cosine(vectors[firsts[i]], vectors[seconds[j]]) for i, j in pairs], tokens


def _params(state, body: _Pooled) -> PoolingParams:
    return PoolingParams(state.pooling, True, body.truncate_prompt_tokens)


@router.post("/score")
@router.post("/v1/score")
async def score(body: ScoreRequest, state: CurrentState):
    _check_model(state, body.model, "scoring")
    firsts, seconds = ([t] if isinstance(t, str) else t for t in (body.text_1, body.text_2))
    scores, tokens = await _scores(state, firsts, seconds, _params(state, body), ("text_1", "text_2"))
    return {"id": P.new_id("score"), "object": "list", "created": P.now(), "model": state.served_model_name,
            "data": [{"index": i, "object": "score", "score": s} for i, s in enumerate(scores)],
            "usage": {"prompt_tokens": tokens, "total_tokens": tokens, "completion_tokens": 0}}


@router.post("/rerank")
@router.post("/v1/rerank")
@router.post("/v2/rerank")
async def rerank(body: RerankRequest, state: CurrentState):
    _check_model(state, body.model, "reranking")
    docs = body.texts()
    if not docs:
        raise ApiError(400, "documents is empty: give at least one document to rank", param="documents")
    scores, tokens = await _scores(state, [body.query], docs, _params(state, body), ("query", "documents"))
    results = [{"index": i, "relevance_score": scores[i], **({"document": {"text": docs[i]}}
                                                              if body.return_documents else {})}
               for i in rank(scores, body.top_n)]
    return {"id": P.new_id("rerank"), "model": state.served_model_name, "usage": {"total_tokens": tokens},
            "results": results}
