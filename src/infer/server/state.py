"""What the route handlers share: one ServerState per app, on ``app.state.server``, reached through the
``CurrentState`` dependency, so a router works on any app that puts a ServerState (or a stand-in) there."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Annotated

from fastapi import Depends, Request

from ..engine.async_engine import AsyncEngine
from ..tokenizer import Tokenizer
from .metrics import ServerMetrics
from .response_store import ResponseStore


@dataclass
class ServerState:
    engine: AsyncEngine
    served_model_name: str
    metrics: ServerMetrics
    tokenizer: Tokenizer
    speculative: bool  # usage reports an acceptance rate only when a drafter runs
    max_seq_len: int  # a chat request without max_tokens may fill the context
    vocab_size: int  # token-id prompts are checked against it before anything decodes them (echo)
    tool_parser: str | None = None  # what reads tool_choice "auto"'s calls (tools.PARSERS); None: "auto" is refused
    responses: ResponseStore = field(default_factory=ResponseStore)  # /v1/responses' stored answers
    trust_request_chat_template: bool = False  # a request's chat_template is rendered (else refused: chat_render)
    pooling: str = "last"  # how /v1/embeddings pools an input's states (infer.pooling.POOLINGS)
    slots: bool = True  # GET /slots answers (llama-server's --slots; off: --no-slots)

    @classmethod
    def from_engine(cls, engine: AsyncEngine, served_model_name: str, tool_parser: str | None = None,
                    trust_request_chat_template: bool = False, pooling: str = "last",
                    slots: bool = True) -> ServerState:
        eng = engine.engine
        if served_model_name in eng.lora_names:
            raise ValueError(f"the served model name {served_model_name!r} is also a LoRA adapter's: rename one "
                             "(--served-model-name, --lora-modules)")
        return cls(engine, served_model_name, ServerMetrics(engine), eng.tokenizer, eng.draft_model is not None,
                   eng.max_seq_len, eng.model.config.vocab_size, tool_parser,
                   trust_request_chat_template=trust_request_chat_template, pooling=pooling, slots=slots)

    @property
    def lora_modules(self) -> dict[str, str]:
        """The engine's per-request LoRA adapters loaded now, name -> directory (EngineConfig.lora_modules, then
        /v1/load_lora_adapter's): model ids too, each naming its adapter."""
        return self.engine.lora_modules

    def model_ids(self) -> list[str]:
        """Every model id this server answers to: the base model's, then its adapters'."""
        return [self.served_model_name, *self.lora_modules]


async def server_state(request: Request) -> ServerState:  # async: FastAPI runs a sync dependency in a thread pool
    return request.app.state.server


CurrentState = Annotated[ServerState, Depends(server_state)]
