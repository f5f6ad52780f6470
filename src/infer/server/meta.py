"""Routes about the server itself rather than generation: liveness, the version, the model list and card, Prometheus
metrics."""

from __future__ import annotations

from fastapi import APIRouter
from fastapi.responses import Response
from prometheus_client import CONTENT_TYPE_LATEST

from .. import __version__
from . import protocol as P
from .errors import error_response
from .state import CurrentState

router = APIRouter()


@router.get("/health")
async def health(state: CurrentState):
    if state.engine.error is not None:
        return error_response(503, f"engine loop stopped: {state.engine.error!r}", "server_error")
    return {"status": "ok"}


@router.get("/version")
async def version():
    """vLLM's: the server's version."""
    return {"version": __version__}


def _card(state) -> dict:
    return {"id": state.served_model_name, "object": "model", "created": P.now(), "owned_by": "infer",
            "max_model_len": state.max_seq_len}


@router.get("/v1/models")
async def models(state: CurrentState):
    return {"object": "list", "data": [_card(state)]}


@router.get("/v1/models/{model:path}")
async def model(model: str, state: CurrentState):
    """OpenAI's retrieve (``client.models.retrieve``): the served model's card, else a 404 naming it."""
    if model != state.served_model_name:
        return error_response(404, f"model {model!r} does not exist; this server serves {state.served_model_name!r}",
                              "not_found_error", "model")
    return _card(state)


@router.get("/metrics", response_class=Response,
            responses={200: {"content": {CONTENT_TYPE_LATEST.split(";")[0]: {"schema": {"type": "string"}}},
                             "description": "Prometheus text exposition format"}})
async def prometheus(state: CurrentState):
    return Response(state.metrics.render(), media_type=CONTENT_TYPE_LATEST)
