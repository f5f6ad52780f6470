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


def _card(state, name: str) -> dict:
    """A model id's card; an adapter's names the base model as its parent and its directory as its root (vLLM's)."""
    card = {"id": name, "object": "model", "created": P.now(), "owned_by": "infer", "max_model_len": state.max_seq_len}
    if name in state.lora_modules:
        card.update(root=state.lora_modules[name], parent=state.served_model_name)
    return card


@router.get("/v1/models")
async def models(state: CurrentState):
    """The base model's card, then each LoRA adapter's (EngineConfig.lora_modules), which requests name as their
    model."""
    return {"object": "list", "data": [_card(state, name) for name in state.model_ids()]}


@router.get("/v1/models/{model:path}")
async def model(model: str, state: CurrentState):
    """OpenAI's retrieve (``client.models.retrieve``): the served model's card, else a 404 naming it."""
    if model not in state.model_ids():
        ids = ", ".join(map(repr, state.model_ids()))
        return error_response(404, f"model {model!r} does not exist; this server serves {ids}", "not_found_error",
                              "model")
    return _card(state, model)


@router.get("/metrics", response_class=Response,
            responses={200: {"content": {CONTENT_TYPE_LATEST.split(";")[0]: {"schema": {"type": "string"}}},
                             "description": "Prometheus text exposition format"}})
async def prometheus(state: CurrentState):
    return Response(state.metrics.render(), media_type=CONTENT_TYPE_LATEST)
