"""A chat's prompt tokens, as every route that takes messages renders them: the server's chat template (the
checkpoint's, or ``--chat-template``), or a request's own ``chat_template`` where the server trusts requests with one
(vLLM's ``--trust-request-chat-template``: a template is code the server runs, sandboxed by Jinja but free to loop),
with the request's ``chat_template_kwargs`` as the template's extra variables. A template that cannot render the
messages (its own ``raise_exception``, a syntax or type error) is the request's 400, never a 500."""

from __future__ import annotations

from jinja2 import TemplateError
from starlette.concurrency import run_in_threadpool

from ..tokenizer import check_template_kwargs
from . import protocol as P
from .errors import ApiError
from .state import ServerState


def check_readable(messages: list[P.ChatMessage]) -> None:
    """A 400 naming the first content part the model cannot read: answering without what it shows (an image) would
    answer another question."""
    for i, m in enumerate(messages):
        if (kind := m.unread()) is not None:
            raise ApiError(400, f"messages[{i}]: content parts of type {kind!r} are not supported: this model reads "
                           "text only", param="messages")


def check_template(state: ServerState, template: str | None, where: str) -> None:
    """A 400 unless the chat can be rendered: a request's template needs the server's trust; without one the
    tokenizer must have a template (``where``: what to use instead, said in the error)."""
    if template is not None and not state.trust_request_chat_template:
        raise ApiError(400, "a request's chat_template is not supported by this server: it renders chats with its "
                       "own template unless it runs with --trust-request-chat-template (a template is code the "
                       "server runs)", param="chat_template")
    if template is not None and not template.strip():
        raise ApiError(400, "chat_template is empty: give a Jinja template, or leave it out", param="chat_template")
    if template is None and not state.tokenizer.has_chat_template:
        raise ApiError(400, f"this model's tokenizer has no chat template; {where}", param="messages")


async def render_chat(state: ServerState, messages: list[P.ChatMessage], add_generation_prompt: bool = True,
                      continue_final_message: bool = False, tools: list[dict] | None = None,
                      template: str | None = None, template_kwargs: dict | None = None,
                      param: str = "messages") -> list[int]:
    """The messages' prompt tokens (check_template first). A 400 names ``chat_template_kwargs`` where it sets a
    variable the renderer owns, else the request's template, or ``param`` (the messages the server's could not
    render)."""
    try:
        check_template_kwargs(template_kwargs)
    except ValueError as e:
        raise ApiError(400, str(e), param="chat_template_kwargs") from None
    try:
        asked = {k: v for k, v in (("chat_template", template), ("template_kwargs", template_kwargs))
                 if v is not None}
        return await run_in_threadpool(state.tokenizer.apply_chat_template, [m.template_form() for m in messages],
                                       add_generation_prompt=add_generation_prompt,
                                       continue_final_message=continue_final_message, tools=tools, **asked)
    except (TemplateError, TypeError, ValueError) as e:  # jinja2's syntax and runtime errors (raise_exception's
        # among them), a template's operation on the wrong type, transformers' checks of the messages
        raise ApiError(400, f"the chat template cannot render these messages: {type(e).__name__}: {e}",
                       param="chat_template" if template is not None else param) from None


async def render_request_chat(state: ServerState, body, instead: str, tools: list[dict] | None = None) -> list[int]:
    """The prompt tokens of a request body's ``messages`` where a route renders them as ``/tokenize`` does
    (``add_generation_prompt``, ``continue_final_message``, ``chat_template`` and its kwargs as the body gives them):
    the template checked (``instead``: what to use without one), the messages readable, the two flags consistent."""
    check_template(state, body.chat_template, instead)
    check_readable(body.messages)
    if body.continue_final_message and body.add_generation_prompt:
        raise ApiError(400, "continue_final_message continues the last message: add_generation_prompt must be "
                       "false", param="continue_final_message")
    return await render_chat(state, body.messages, body.add_generation_prompt, body.continue_final_message, tools,
                             body.chat_template, body.chat_template_kwargs)
