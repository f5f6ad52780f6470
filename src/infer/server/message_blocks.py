"""Anthropic's content blocks, both ways (messages.py serves the route). In: a conversation's ``text``, ``tool_use``
(an assistant's calls) and ``tool_result`` (the user's answers to them) blocks become the chat messages the
checkpoint's template reads, as OpenAI's tool calls and ``tool`` messages; custom tools become OpenAI functions and
``tool_choice`` ({"type": "auto" | "any" | "tool" | "none"}) OpenAI's choice, so that tools.py plans and reads the
calls for every API alike (``any`` and ``tool`` are structured output: exact under speculation). Out: what
``ToolCallReader`` reads of the answer (text, calls) becomes ``text`` and ``tool_use`` blocks in the order the model
wrote them, whole or as a stream's block events (a call's input as ``input_json_delta``)."""

from __future__ import annotations

import json

from . import protocol as P
from .errors import ApiError


def chat_messages(system: str | None, messages, text) -> list[P.ChatMessage]:
    """The conversation as chat messages: the system prompt first; a user message's tool results become ``tool``
    messages (before its text, as Anthropic orders them), an assistant's tool_use blocks its ``tool_calls``.
    ``text(content, param)``: a text-only content's text (a 400 for any other block)."""
    out = [P.ChatMessage(role="system", content=system)] if system else []
    for i, m in enumerate(messages):
        where = f"messages[{i}].content"
        if isinstance(m.content, str):
            out.append(P.ChatMessage(role=m.role, content=m.content))
            continue
        texts, calls, results = [], [], []
        for j, b in enumerate(m.content):
            at = f"{where}[{j}]"
            if b.type == "text":
                texts.append(b.text or "")
            elif b.type == "tool_use" and m.role == "assistant":
                if not b.id or not b.name or b.input is None:
                    raise ApiError(400, f"{at}: a tool_use block needs its id, name and input", param="messages")
                args = json.dumps(b.input, ensure_ascii=False, separators=(",", ":"))
                calls.append(P.ToolCall(id=b.id, function=P.FunctionCall(name=b.name, arguments=args)))
            elif b.type == "tool_result" and m.role == "user":
                if not b.tool_use_id:
                    raise ApiError(400, f"{at}: a tool_result block needs the tool_use_id it answers",
                                   param="messages")
                # (is_error has no place in a template's tool turn: the result's own text says what went wrong)
                content = b.content if b.content is not None else ""
                results.append(P.ChatMessage(role="tool", content=text(content, f"{at}.content"),
                                             tool_call_id=b.tool_use_id))
            elif b.type in ("tool_use", "tool_result"):
                owner = "an assistant" if b.type == "tool_use" else "a user"
                raise ApiError(400, f"{at}: a {b.type} block belongs in {owner} message", param="messages")
            else:
                text([b], at)  # the refusal that names the block
        if m.role == "assistant":
            out.append(P.ChatMessage(role="assistant", content="".join(texts) if texts or not calls else None,
                                     tool_calls=calls or None))
        else:
            out += results
            if texts or not results:
                out.append(P.ChatMessage(role="user", content="".join(texts)))
    return out


def chat_tools(tools) -> list[P.Tool] | None:
    """Custom tools as OpenAI functions (their input_schema the parameters); Anthropic's server tools (web search,
    code execution, ...) are refused by name: nothing here runs them."""
    if not tools:
        return None
    for i, t in enumerate(tools):
        if t.type not in (None, "custom"):
            raise ApiError(400, f"tools[{i}]: {t.type!r} is a server tool, which this server does not run: give "
                           "custom tools (name, description, input_schema), whose calls your code answers",
                           param="tools")
        if t.input_schema is None:
            raise ApiError(400, f"tools[{i}].input_schema: a custom tool needs the JSON schema of its input",
                           param="tools")
    return [P.Tool(type="function", function=P.FunctionDef(name=t.name, description=t.description,
                                                           parameters=t.input_schema)) for t in tools]


def openai_choice(choice, tools: list[P.Tool] | None, parser: str | None) -> tuple:
    """(OpenAI's tool_choice, parallel_tool_calls) of Anthropic's; "auto" (the default with tools) needs the
    server's parser of the model's own call format, refused here in Anthropic's terms."""
    kind = choice.type if choice is not None else ("auto" if tools else "none")
    if kind == "auto" and tools and parser is None:
        raise ApiError(400, "tool_choice 'auto' (the default with tools) needs a parser of the model's own call "
                       "format, which this server was not started with (infer serve --tool-call-parser): give "
                       "tool_choice {'type': 'any'} or {'type': 'tool', 'name': ...} (the answer is then a call, "
                       "constrained by the tools' input_schema), or {'type': 'none'}", param="tool_choice")
    if kind == "tool":
        if not choice.name:
            raise ApiError(400, "tool_choice: a 'tool' choice names the tool to call", param="tool_choice")
        picked = P.NamedToolChoice(type="function", function=P.FunctionName(name=choice.name))
    else:
        picked = {"auto": "auto", "any": "required", "none": "none"}[kind]
    return picked, not (choice is not None and choice.disable_parallel_tool_use)


class Blocks:
    """An answer's content blocks as ``ToolCallReader``'s deltas (or a plain answer's text) build them: ``add``
    returns the stream's events for a delta (a block opened, its delta), ``close`` the last block's stop."""

    def __init__(self):
        self.blocks: list[dict] = []
        self.args: dict[int, str] = {}  # a tool_use block's input, as JSON text so far
        self.open = False  # whether the last block has had no stop yet

    def add(self, delta: dict) -> list[tuple[str, dict]]:
        events = []
        if text := delta.get("content"):
            if not self.blocks or self.blocks[-1]["type"] != "text":
                events += self._open({"type": "text", "text": ""})
            self.blocks[-1]["text"] += text
            events.append(("content_block_delta", {"index": len(self.blocks) - 1,
                                                   "delta": {"type": "text_delta", "text": text}}))
        for call in delta.get("tool_calls", ()):
            if "id" in call:  # a call begins (OpenAI's "call_..." id as Anthropic's "toolu_...")
                events += self._open({"type": "tool_use", "id": "toolu_" + call["id"].removeprefix("call_"),
                                      "name": call["function"]["name"], "input": {}})
                self.args[len(self.blocks) - 1] = ""
            if part := call["function"].get("arguments"):
                self.args[len(self.blocks) - 1] += part
                events.append(("content_block_delta", {"index": len(self.blocks) - 1,
                                                       "delta": {"type": "input_json_delta", "partial_json": part}}))
        return events

    def _open(self, block: dict) -> list[tuple[str, dict]]:
        events = self.close() if self.blocks else []
        self.blocks.append(block)
        self.open = True
        return events + [("content_block_start", {"index": len(self.blocks) - 1, "content_block": dict(block)})]

    def close(self) -> list[tuple[str, dict]]:
        """The open block's stop (an answer with no block at all gets an empty text block, as a plain one has)."""
        events = self._open({"type": "text", "text": ""}) if not self.blocks else []
        if not self.open:
            return events
        self.open = False
        return events + [("content_block_stop", {"index": len(self.blocks) - 1})]

    def content(self) -> list[dict]:
        """The blocks whole: a tool_use block's input its JSON object; a call cut short by max_tokens (its input no
        whole object) is given as the text the model wrote, not as a call it never finished."""
        self.close()
        out = []
        for i, b in enumerate(self.blocks):
            if b["type"] == "tool_use":
                try:
                    value = json.loads(self.args[i] or "{}")
                except json.JSONDecodeError:
                    value = None
                b = {**b, "input": value} if isinstance(value, dict) else {"type": "text", "text": self.args[i]}
            out.append(b)
        return out
