"""vLLM's ``/v1/load_lora_adapter`` and ``/v1/unload_lora_adapter``: LoRA adapters loaded and unloaded while the
server runs (``infer serve --enable-lora``: ``--max-loras`` slots of ``--max-lora-rank``), each then a model id
requests name, listed by ``/v1/models``. Both run on the engine's thread between two steps (AsyncEngine), so a step
never meets a half-written adapter. A loaded adapter's path is read on the server's disk: the API key guards these
routes as it guards the others."""

from __future__ import annotations

from fastapi import APIRouter
from fastapi.responses import PlainTextResponse
from pydantic import BaseModel, Field

from . import protocol as P
from .errors import ApiError
from .state import CurrentState

router = APIRouter()


class LoadLoRAAdapterRequest(BaseModel):
    model_config = P.STRICT

    lora_name: str = Field(min_length=1)
    lora_path: str = Field(min_length=1)
    load_inplace: bool = False  # vLLM's: replace an adapter loaded under this name (none may be using it)


class UnloadLoRAAdapterRequest(BaseModel):
    model_config = P.STRICT

    lora_name: str = Field(min_length=1)
    lora_int_id: int | None = None  # vLLM's field, not read: adapters are named


def _check_enabled(state) -> None:
    if not state.engine.lora_loading:
        raise ApiError(400, "this server loads LoRA adapters at start only: start it with --enable-lora (and "
                       "--max-loras, --max-lora-rank) to load them while it runs", param="lora_name")


@router.post("/v1/load_lora_adapter", response_class=PlainTextResponse)
async def load_lora_adapter(body: LoadLoRAAdapterRequest, state: CurrentState):
    _check_enabled(state)
    name = body.lora_name
    if name == state.served_model_name:
        raise ApiError(400, f"{name!r} is the served model's name: give the adapter another", param="lora_name")
    if name in state.lora_modules and not body.load_inplace:
        raise ApiError(400, f"a LoRA adapter named {name!r} is loaded already (from {state.lora_modules[name]!r}); "
                       "load_inplace replaces it", param="lora_name")
    await _engine_call(state.engine.load_lora(name, body.lora_path, body.load_inplace))
    return f"Success: LoRA adapter '{name}' added successfully."


@router.post("/v1/unload_lora_adapter", response_class=PlainTextResponse)
async def unload_lora_adapter(body: UnloadLoRAAdapterRequest, state: CurrentState):
    _check_enabled(state)
    if body.lora_name not in state.lora_modules:
        ids = ", ".join(map(repr, state.lora_modules)) or "none"
        raise ApiError(404, f"no LoRA adapter named {body.lora_name!r} is loaded (loaded: {ids})", "not_found_error",
                       "lora_name")
    await _engine_call(state.engine.unload_lora(body.lora_name))
    return f"Success: LoRA adapter '{body.lora_name}' removed successfully."


async def _engine_call(call) -> None:
    """Await an AsyncEngine call; its ValueError (no free slot, a directory that is not an adapter, one that does not
    fit, one in use) is the client's 400, naming the problem."""
    try:
        await call
    except ValueError as e:
        raise ApiError(400, str(e)) from None
