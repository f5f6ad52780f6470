"""OpenAI tool calling on /v1/chat/completions, as a constraint: a named function's ``tool_choice`` makes the answer
that function's arguments (JSON following its ``parameters`` schema), ``"required"`` makes it a list of one or more
calls (``[{"name": ..., "parameters": {...}}, ...]``, vLLM's shape), both through structured output, so the law sampled
is the target's restricted to the calls the schemas allow (lossless under speculation as any constraint is).
``"none"`` answers in text. ``"auto"``, the model choosing between text and a call, needs it to write calls in a
format a parser reads (vLLM: ``--enable-auto-tool-choice --tool-call-parser``); infer has no such parser, so it is
refused with a 400 that says what works instead, never answered as text in silence.

The tools go to the checkpoint's chat template (``tools=``), which decides what the model sees of them: SmolLM2's
shows none, so its calls follow the schemas without their descriptions.

``ToolCallReader`` turns a choice's text, streamed or whole, into OpenAI's deltas: a named call's arguments as they
come, a required list's calls each as its object closes."""

from __future__ import annotations

import json
import uuid

from ..structured import StructuredOutput
from .errors import ApiError
from .protocol import Tool


NO_ARGUMENTS = {"type": "object", "properties": {}}


def plan(tools: list[Tool] | None, choice, parallel: bool) -> tuple[str | None, StructuredOutput | None]:
    """(mode, constraint) of a request: mode None (text), "named" or "required"; ApiError (400, naming the field) for
    what cannot be answered."""
    if choice is None:
        choice = "auto" if tools else "none"
    if not tools:
        if choice != "none":
            raise ApiError(400, "tool_choice needs tools: give the functions the model may call", param="tool_choice")
        return None, None
    names = [t.function.name for t in tools]
    if len(set(names)) < len(names):
        raise ApiError(400, f"tools: function names must be unique, got {names}", param="tools")
    if choice == "none":
        return None, None
    if choice == "auto":
        raise ApiError(400, "tool_choice 'auto' (the default with tools) needs a parser of the model's own call format, "
                       "which this server does not have (as vLLM without --enable-auto-tool-choice): give tool_choice "
                       "'required' or {'type': 'function', 'function': {'name': ...}} (the answer is then a call, "
                       "constrained by the tools' schemas), or 'none'", param="tool_choice")
    if choice == "required":
        items = [{"type": "object", "properties": {"name": {"enum": [t.function.name]},
                                                   "parameters": t.function.parameters or NO_ARGUMENTS},
                  "required": ["name", "parameters"], "additionalProperties": False} for t in tools]
        schema = {"type": "array", "minItems": 1, "items": items[0] if len(items) == 1 else {"anyOf": items}}
        if not parallel:
            schema["maxItems"] = 1
        return "required", StructuredOutput(json_schema=schema)
    fn = next((t.function for t in tools if t.function.name == choice.function.name), None)
    if fn is None:
        raise ApiError(400, f"tool_choice names {choice.function.name!r}, which is not among the tools ({names})",
                       param="tool_choice")
    return "named", StructuredOutput(json_schema=fn.parameters or NO_ARGUMENTS)


def _call(name: str, arguments: str) -> dict:
    return {"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function", "function": {"name": name, "arguments": arguments}}


def _delta(index: int, call: dict) -> dict:
    """A call as a stream's first delta of it (a copy: the call's arguments may still grow)."""
    return {"index": index, "id": call["id"], "type": "function", "function": dict(call["function"])}


class ToolCallReader:
    """One choice's text -> chat deltas ({"content": ...} or {"tool_calls": [...]}) and its final message.

    named: every piece of text is the call's arguments (the first delta carries its id and name).
    required: the text is a JSON array of {"name", "parameters"} objects, compact (structured output's); a scanner
    follows strings and depth, and each object becomes a call as soon as it closes. A reply cut by max_tokens ends
    with the calls completed so far (finish_reason "length")."""

    def __init__(self, mode: str, name: str | None = None):
        self.mode, self.name = mode, name
        self.calls: list[dict] = []  # the final message's tool_calls
        self._element = []  # required: the characters of the object being read
        self._depth, self._in_string, self._escaped = 0, False, False

    def feed(self, text: str) -> dict:
        """The delta ``text`` adds ({} when it completes nothing yet)."""
        if self.mode == "named":
            if not self.calls:
                self.calls.append(_call(self.name, text))
                return {"tool_calls": [_delta(0, self.calls[0])]}
            if not text:
                return {}
            self.calls[0]["function"]["arguments"] += text
            return {"tool_calls": [{"index": 0, "function": {"arguments": text}}]}
        new = []
        for ch in text:
            if self._depth >= 2 or (self._depth == 1 and ch == "{"):
                self._element.append(ch)
            if self._in_string:  # a string's brackets and escaped quotes are text
                if self._escaped:
                    self._escaped = False
                elif ch == "\\":
                    self._escaped = True
                elif ch == '"':
                    self._in_string = False
                continue
            if ch == '"':
                self._in_string = True
            elif ch in "[{":
                self._depth += 1
            elif ch in "]}":
                self._depth -= 1
                if self._depth == 1 and ch == "}":  # an element of the list closed
                    obj = json.loads("".join(self._element))
                    self.calls.append(_call(obj["name"], json.dumps(obj["parameters"], ensure_ascii=False, separators=(",", ":"))))
                    new.append(_delta(len(self.calls) - 1, self.calls[-1]))
                    self._element = []
        return {"tool_calls": new} if new else {}

    def finish_reason(self, reason: str) -> str:
        """OpenAI's: a forced function's answer ends "stop", a list of calls "tool_calls"; "length" stays."""
        return "tool_calls" if self.mode == "required" and reason == "stop" else reason

    def message(self) -> dict:
        return {"role": "assistant", "content": None, "tool_calls": self.calls}
