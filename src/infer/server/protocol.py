"""OpenAI wire format: request bodies (pydantic, validated) and response builders. The engine never sees these."""

from __future__ import annotations

import json
import time
import uuid
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from ..sampling import MAX_LOGPROBS, SamplingParams, truncate_prompt
from ..structured import StructuredOutput


# Strict types, as OpenAI's API: "16" is not an integer and "yes" not a boolean (an integer is still a number).
# Unknown OpenAI fields (user, ...) are accepted and ignored; the OpenAI fields that would change the output and that
# infer does not implement are refused when they ask for anything (``_unsupported``), never dropped in silence.
STRICT = ConfigDict(extra="ignore", strict=True)


def _unsupported(what: str, off=(None, 0, "", [], {})):
    """A validator refusing a field whose value asks for something (anything but the values in ``off``: its default,
    0, empty)."""
    def check(value):
        if value not in off:
            raise ValueError(f"not supported by this server ({what})")
        return value
    return check


def _neg(ids):
    raise ValueError(f"token ids must be >= 0, got {[t for t in ids if t < 0][:5]}")


def valid_truncation(value):
    """``truncate_prompt_tokens`` (vLLM's): None, >= 1 (the prompt's last tokens kept) or -1 (as many as fit)."""
    if value is None or value >= 1 or value == -1:
        return value
    raise ValueError(f"must be >= 1 (the prompt's last tokens kept), or -1 (as many as the context holds), got {value}")


def valid_text(value):
    """Strings (nested in lists) must be encodable Unicode: JSON's "\\ud800" decodes to a lone surrogate, which no
    tokenizer can encode."""
    items = value if isinstance(value, list) else [value]
    for v in items:
        if isinstance(v, list):
            valid_text(v)
        elif isinstance(v, str):
            try:
                v.encode("utf-8")
            except UnicodeEncodeError as e:
                raise ValueError(f"contains {v[e.start:e.end]!r}, a lone surrogate: not valid Unicode text") from None
    return value


class StreamOptions(BaseModel):
    model_config = STRICT

    include_usage: bool = False
    continuous_usage_stats: bool = False  # vLLM's: with include_usage, every chunk carries the usage so far too
    # infer's extension (OpenAI clients ignore it): each chunk's choice carries "spec": {"tokens": [{"source":
    # "target" | "accepted" | "recovered" | "bonus", "k": drafts in that token's round}, ...]}, one per token
    include_spec: bool = False


class JsonSchemaFormat(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True, populate_by_name=True)

    name: str = "response"
    description: str | None = None
    schema_: dict = Field(default_factory=dict, alias="schema")  # a JSON Schema (OpenAI's field name)
    strict: bool | None = None


class ResponseFormat(BaseModel):
    """OpenAI's ``response_format``: plain text, any JSON object, or JSON that follows a schema."""

    model_config = STRICT

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class Prediction(BaseModel):
    """OpenAI's predicted output: text the answer is expected to repeat (a file being edited). The suffix proposers
    (SmolLM2's default) copy drafts from it; the answer is the same without it."""

    model_config = STRICT

    type: Literal["content"]
    content: str | list[ContentPart]

    _valid_content = field_validator("content")(valid_text)

    def text(self) -> str:
        return self.content if isinstance(self.content, str) else "".join(p.text or "" for p in self.content)


class StructuredOutputs(BaseModel):
    """infer's extension (vLLM's ``structured_outputs``): exactly one of a JSON schema, any JSON object, a regular
    expression, a list of choices, or a grammar (Lark, or GBNF/EBNF with ``::=`` rules from ``root``)."""

    model_config = STRICT

    json_: dict | str | None = Field(None, alias="json")
    json_object: bool | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None


class Sampling(BaseModel):
    """The sampling fields every generation route takes (OpenAI's, and vLLM's extensions as its clients send them:
    stop tokens, the stop string kept in the text, a minimum length, banned words and allowed tokens)."""

    model_config = STRICT

    temperature: float = Field(1.0, ge=0.0, le=2.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    top_k: int = -1
    min_p: float = Field(0.0, ge=0.0, le=1.0)
    repetition_penalty: float = Field(1.0, gt=0.0)
    presence_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    frequency_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    stop: str | list[str] | None = None
    seed: int | None = None
    ignore_eos: bool = False
    speculation: bool = True  # infer's extension: false decodes this request plainly (same output, its own speed)
    logit_bias: dict[str, float] | None = None  # OpenAI's: {"token id": bias in [-100, 100]}
    stop_token_ids: list[int] | None = None
    include_stop_str_in_output: bool = False
    min_tokens: int = Field(0, ge=0)
    bad_words: list[str] | None = None  # words the output never completes (infer.token_bans)
    allowed_token_ids: list[int] | None = None  # the only tokens the output holds
    skip_special_tokens: bool | None = None  # None: true (vLLM's default); false writes special tokens out
    truncate_prompt_tokens: int | None = None  # the prompt's last this many tokens (-1: as many as the context holds)

    _valid_stop = field_validator("stop")(valid_text)
    _allowed = field_validator("allowed_token_ids")(lambda v: v if v is None or all(t >= 0 for t in v) else _neg(v))
    _stop_ids = field_validator("stop_token_ids")(lambda v: v if v is None or all(t >= 0 for t in v) else _neg(v))
    _truncate = field_validator("truncate_prompt_tokens")(valid_truncation)

    def read_prompt(self, ids: list[int], max_seq_len: int) -> list[int]:
        """The prompt's tokens as the request reads them (``truncate_prompt_tokens``)."""
        return truncate_prompt(ids, self.truncate_prompt_tokens, max_seq_len)

    def sampling_params(self, max_tokens: int, logprobs: int | None, seed_offset: int = 0,
                        structured: StructuredOutput | None = None,
                        prompt_logprobs: int | None = None) -> SamplingParams:
        seed = None if self.seed is None else self.seed + seed_offset  # n > 1: distinct, reproducible choices
        return SamplingParams(temperature=self.temperature, top_k=self.top_k, top_p=self.top_p, min_p=self.min_p,
                              repetition_penalty=self.repetition_penalty, presence_penalty=self.presence_penalty,
                              frequency_penalty=self.frequency_penalty, logit_bias=self.logit_bias or None,
                              max_tokens=max_tokens, stop=self.stop, stop_token_ids=self.stop_token_ids,
                              include_stop_str_in_output=self.include_stop_str_in_output, min_tokens=self.min_tokens,
                              bad_words=self.bad_words or None, allowed_token_ids=self.allowed_token_ids,
                              skip_special_tokens=self.skip_special_tokens is not False,
                              truncate_prompt_tokens=self.truncate_prompt_tokens,
                              seed=seed, ignore_eos=self.ignore_eos, logprobs=logprobs, structured=structured,
                              prompt_logprobs=prompt_logprobs)


class _Common(Sampling):
    model: str
    max_tokens: int | None = Field(None, ge=1)
    n: int = Field(1, ge=1, le=16)
    stream: bool = False
    stream_options: StreamOptions | None = None
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputs | None = None  # infer's extension: regex, choice, grammar (or JSON)
    prediction: Prediction | None = None  # OpenAI's predicted output: a copy source for drafts (speed only)
    priority: int = 0  # vLLM's: lower is served sooner, where the server runs --scheduling-policy priority
    # vLLM's older names of structured output (guided_json, _regex, _choice, _grammar: structured_outputs' json,
    # regex, choice, grammar)
    guided_json: dict | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    # vLLM's: log p of each prompt token given those before it, its rank and this many alternatives (answered as
    # vLLM does: a completion choice's prompt_logprobs, a chat completion's; not streamed)
    prompt_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    # vLLM's beam search (server/beams.py): n beams, best first; the score divides by length ** length_penalty;
    # early_stopping ends the search once n hypotheses have ended
    use_beam_search: bool | None = False  # None as false (clients that send every field)
    length_penalty: float = 1.0
    early_stopping: bool = False
    # vLLM extensions infer does not implement: accepted at their defaults, refused with a 400 naming them
    # otherwise, never dropped in silence
    logits_processors: list | None = None

    _valid_guided = field_validator("guided_regex", "guided_choice", "guided_grammar")(valid_text)
    _no_processors = field_validator("logits_processors")(_unsupported(
        "logits processors are Python functions: the library's SamplingParams takes them"))

    def structured(self) -> tuple[StructuredOutput | None, str | None]:
        """The constraint asked for and the field that asked (for a 400 naming it); ValueError if it is malformed."""
        fmt, ext = self.response_format, self.structured_outputs
        guided = {k: getattr(self, f"guided_{k}") for k in ("json", "regex", "choice", "grammar")
                  if getattr(self, f"guided_{k}") is not None}
        if guided:
            if len(guided) > 1 or ext is not None or (fmt is not None and fmt.type != "text"):
                raise ValueError("guided: give one of guided_json, guided_regex, guided_choice, guided_grammar, and "
                                 "neither response_format nor structured_outputs beside it")
            ext = StructuredOutputs.model_validate(guided)
        if fmt is not None and fmt.type != "text" and ext is not None:
            raise ValueError("give response_format or structured_outputs, not both")
        try:
            if fmt is not None and fmt.type == "json_object":
                return StructuredOutput(json_object=True), "response_format"
            if fmt is not None and fmt.type == "json_schema":
                if fmt.json_schema is None:
                    raise ValueError("response_format of type json_schema needs a json_schema object with a schema")
                return StructuredOutput(json_schema=fmt.json_schema.schema_), "response_format"
            if ext is not None:
                return StructuredOutput(json_schema=ext.json_, json_object=bool(ext.json_object), regex=ext.regex,
                                        choice=ext.choice, grammar=ext.grammar), "structured_outputs"
        except ValueError as e:
            field = "response_format" if ext is None else f"guided_{next(iter(guided))}" if guided else \
                "structured_outputs"
            raise ValueError(f"{field}: {e}") from None
        return None, None


class CompletionRequest(_Common):
    prompt: str | list[str] | list[int] | list[list[int]]
    logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = None
    tools: list | None = None

    _no_tools = field_validator("tools")(_unsupported("tools are the chat route's: /v1/chat/completions"))
    _no_suffix = field_validator("suffix")(_unsupported("no insertion after a suffix"))
    _best_of = field_validator("best_of")(_unsupported("n choices are; best_of is not", off=(None, 1)))

    _valid_prompt = field_validator("prompt")(valid_text)


class FunctionDef(BaseModel):
    model_config = STRICT

    name: str = Field(pattern=r"^[a-zA-Z0-9_-]{1,64}$")
    description: str | None = None
    parameters: dict | None = None  # a JSON Schema; none: the function takes no arguments
    strict: bool | None = None


class Tool(BaseModel):
    """OpenAI's tool: a function the model may call (tools.py answers it)."""

    model_config = STRICT

    type: Literal["function"]
    function: FunctionDef


def tool_dicts(tools: list[Tool] | None) -> list[dict] | None:
    """The tools as a chat template reads them: OpenAI's JSON, every field present (as vLLM gives them: a template
    reading ``function.parameters`` of a function without any meets null, not an undefined that fails)."""
    return [t.model_dump() for t in tools] if tools else None


class FunctionName(BaseModel):
    model_config = STRICT

    name: str


class NamedToolChoice(BaseModel):
    model_config = STRICT

    type: Literal["function"]
    function: FunctionName


class FunctionCall(BaseModel):
    model_config = STRICT

    name: str
    arguments: str  # JSON text, as the API answers it


class ToolCall(BaseModel):
    """A call an assistant's message made (a conversation's history, sent back with the tool's result)."""

    model_config = STRICT

    id: str | None = None
    type: Literal["function"] = "function"
    function: FunctionCall

    def template_form(self) -> dict:
        """As chat templates read a call: its arguments an object (templates write them with ``tojson``)."""
        try:
            arguments = json.loads(self.function.arguments)
        except json.JSONDecodeError:
            arguments = self.function.arguments
        return {"id": self.id, "type": "function", "function": {"name": self.function.name, "arguments": arguments}}


class ContentPart(BaseModel):
    """One part of a chat message's content: text (another type, an image, is refused: ``ChatMessage.unread``)."""

    model_config = STRICT

    type: str
    text: str | None = None

    _valid_text = field_validator("text")(valid_text)


class ChatMessage(BaseModel):
    model_config = STRICT

    role: Literal["system", "user", "assistant", "tool", "developer"]
    content: str | list[ContentPart] | None = None
    tool_calls: list[ToolCall] | None = None  # an assistant's calls
    tool_call_id: str | None = None  # a tool's result: the call it answers
    name: str | None = None

    _valid_content = field_validator("content")(valid_text)

    def template_form(self) -> dict:
        """The message as the chat template reads it (the checkpoint's template decides what the model sees of it)."""
        out = {"role": self.role, "content": self.text()}
        if self.tool_calls:
            out["tool_calls"] = [c.template_form() for c in self.tool_calls]
        out.update({k: getattr(self, k) for k in ("tool_call_id", "name") if getattr(self, k) is not None})
        return out

    def unread(self) -> str | None:
        """The type of the first content part that is not text (the model reads text only), or None."""
        if isinstance(self.content, list):
            return next((p.type for p in self.content if p.type != "text"), None)
        return None

    def text(self) -> str:
        if isinstance(self.content, list):  # content parts: their text
            return "".join(p.text or "" for p in self.content if p.type == "text")
        return self.content or ""


class ChatCompletionRequest(_Common):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    # vLLM's chat extensions: the reply opens the assistant's turn (add_generation_prompt), or continues the last
    # message, an assistant's begun (continue_final_message: a prefilled answer); the checkpoint's own template
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template: str | None = None  # a request's own template: taken where the server trusts it (chat_render)
    chat_template_kwargs: dict[str, Any] | None = None  # the template's extra variables (enable_thinking, ...)
    # OpenAI's tool calling (tools.py): "none", "required" or a named function; "auto" (the default with tools) needs
    # the server's --tool-call-parser
    tools: list[Tool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool = True
    # OpenAI's fields that would change the answer and that this server does not serve: refused by name
    functions: list | None = None
    function_call: str | dict | None = None
    audio: dict | None = None
    modalities: list[str] | None = None
    web_search_options: dict | None = None
    reasoning_effort: str | None = None
    verbosity: str | None = None

    _no_functions = field_validator("functions", "function_call")(_unsupported(
        "the legacy functions: give tools and tool_choice", off=(None, [], "none")))
    _no_audio = field_validator("audio")(_unsupported("this model writes text only"))
    _text_only = field_validator("modalities")(_unsupported("this model writes text only", off=(None, [], ["text"])))
    _no_search = field_validator("web_search_options")(_unsupported("no web search"))
    _no_effort = field_validator("reasoning_effort", "verbosity")(_unsupported(
        "this model does not reason apart from its answer, nor take a verbosity"))


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:24]}"


def error_body(message: str, type_: str, param: str | None = None, code: str | int | None = None) -> dict:
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}


def usage(prompt_tokens: int, completion_tokens: int, draft: int, accepted: int, speculative: bool,
          cached: int = 0) -> dict:
    """Standard token counts (``cached``: prompt tokens served from the prefix cache, OpenAI's
    ``prompt_tokens_details``) plus speculation: acceptance_rate = accepted / drafted tokens (None without it)."""
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens, "prompt_tokens_details": {"cached_tokens": cached},
            "acceptance_rate": (accepted / draft if draft else 0.0) if speculative else None,
            "num_draft_tokens": draft, "num_accepted_tokens": accepted}


def completion_chunk(rid: str, model: str, created: int, choices: list[dict], usage_: dict | None = None,
                     chat: bool = False) -> dict:
    body = {"id": rid, "object": "chat.completion.chunk" if chat else "text_completion", "created": created,
            "model": model, "choices": choices}
    if usage_ is not None:
        body["usage"] = usage_
    return body


def now() -> int:
    return int(time.time())
