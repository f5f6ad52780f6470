"""OpenAI tool calling on /v1/chat/completions. A named function's ``tool_choice`` makes the answer that function's
arguments (JSON following its ``parameters`` schema), ``"required"`` a list of one or more calls (``[{"name": ...,
"parameters": {...}}, ...]``, vLLM's shape): both are structured output, so the law sampled is the target's
restricted to the calls the schemas allow (lossless under speculation, as any constraint). ``"none"`` answers in
text. ``"auto"`` (the default with tools) lets the model choose between text and calls written in its own format,
which a parser reads (``infer serve --tool-call-parser``, as vLLM's ``--enable-auto-tool-choice
--tool-call-parser``): ``hermes`` (``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``, Hermes / Qwen /
SmolLM3) or ``llama3_json`` (an answer that opens with ``{"name": ..., "parameters": {...}}``, Llama 3.1-3.3's
format). Without a parser "auto" is refused with a 400 that says what works instead, never answered as text in
silence.

The tools go to the checkpoint's chat template (``tools=``), which decides what the model sees of them: SmolLM2's
shows none, so its calls follow the schemas without their descriptions (and the server refuses a parser for it).

``ToolCallReader`` turns a choice's text, streamed or whole, into OpenAI's deltas: a named call's arguments as they
come, every other call whole as its JSON object closes, text as content."""

from __future__ import annotations

import json
import re
import uuid

from ..structured import StructuredOutput
from .errors import ApiError
from .protocol import Tool

PARSERS = ("hermes", "llama3_json")
NO_ARGUMENTS = {"type": "object", "properties": {}}


def plan(tools: list[Tool] | None, choice, parallel: bool,
         parser: str | None = None) -> tuple[str | None, StructuredOutput | None]:
    """(mode, constraint) of a request: mode None (text), "named", "required" or "auto" (the server's ``parser``
    reads the answer; no constraint); ApiError (400, naming the field) for what cannot be answered."""
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
        if parser is not None:
            return "auto", None
        raise ApiError(400, "tool_choice 'auto' (the default with tools) needs a parser of the model's own call "
                       "format, which this server was not started with (infer serve --tool-call-parser, as vLLM's "
                       "--enable-auto-tool-choice): give tool_choice 'required' or {'type': 'function', 'function': "
                       "{'name': ...}} (the answer is then a call, constrained by the tools' schemas), or 'none'",
                       param="tool_choice")
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


def _call(name: str, arguments) -> dict:
    """A call as OpenAI answers it: its arguments JSON text (compact, as structured output writes it)."""
    if not isinstance(arguments, str):
        arguments = json.dumps(arguments, ensure_ascii=False, separators=(",", ":"))
    return {"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
            "function": {"name": name, "arguments": arguments}}


def _delta(index: int, call: dict) -> dict:
    """A call as a stream's first delta of it (a copy: the call's arguments may still grow)."""
    return {"index": index, "id": call["id"], "type": "function", "function": dict(call["function"])}


def _as_call(text: str) -> dict | None:
    """A call from a model's JSON object ({"name", "arguments" | "parameters"}), or None if it is not one."""
    try:
        obj = json.loads(text)
    except json.JSONDecodeError:
        return None
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    args = obj.get("arguments", obj.get("parameters", {}))
    return _call(obj["name"], args) if isinstance(args, (dict, str)) else None


class _Objects:
    """Follows JSON text as it streams (strings with their escapes, and depth) and returns each object that closes
    at ``level`` (0: objects at the top, 1: a list's elements) as (the characters met at ``level`` before it since
    the last object: separators, or text that is no JSON; its text). ``rest`` is the open object, ``loose`` what
    came after the last."""

    def __init__(self, level: int):
        self.level, self.depth, self.in_string, self.escaped = level, 0, False, False
        self.rest = []  # the open object's characters
        self.loose, self.before = [], ""

    def feed(self, text: str) -> list[tuple[str, str]]:
        done = []
        for ch in text:
            if self.depth == self.level and ch == "{" and not self.in_string:  # an object opens
                self.before, self.loose = "".join(self.loose), []
            if self.depth > self.level or (self.depth == self.level and ch == "{"):
                self.rest.append(ch)
            elif self.depth == self.level and not self.in_string:
                self.loose.append(ch)
            if self.in_string:  # a string's brackets and escaped quotes are text
                if self.escaped:
                    self.escaped = False
                elif ch == "\\":
                    self.escaped = True
                elif ch == '"':
                    self.in_string = False
            elif ch == '"':
                self.in_string = True
            elif ch in "[{":
                self.depth += 1
            elif ch in "]}":
                self.depth -= 1
                if self.depth == self.level and ch == "}":
                    done.append((self.before, "".join(self.rest)))
                    self.rest = []
        return done


class ToolCallReader:
    """One choice's text -> chat deltas ({"content": ...}, {"tool_calls": [...]}, or both) and its final message.

    named: every piece of text is the call's arguments (the first delta carries its id and name). required: a JSON
    list of {"name", "parameters"} objects, each a call as it closes. auto, ``llama3_json``: an answer whose first
    character is "{" is calls (objects, ";" between them), any other is content; ``hermes``: content, but for each
    ``<tool_call>...</tool_call>`` (text that could still open one is held back). What does not read as a call is
    content. A reply cut by max_tokens keeps the calls it completed (finish_reason "length")."""

    OPEN, CLOSE = "<tool_call>", "</tool_call>"

    def __init__(self, mode: str, name: str | None = None, parser: str | None = None):
        self.mode, self.name, self.parser = mode, name, parser
        self.calls: list[dict] = []  # the final message's tool_calls
        self.content: list[str] = []
        self.objects = _Objects(1 if mode == "required" else 0)
        self.pending = ""  # auto: text not yet classified (llama3_json's start; hermes' possible tag, or a call)
        self.state = "start"  # auto: "start", "content", "calls" (llama3_json), "inside" (hermes: in a tag)
        self.blank = ""  # auto: blank text held back (_emit)
        self.raw = self.extra = ""  # llama3_json's calls: their text, and what in it is no call

    def feed(self, text: str, final: bool = False) -> dict:
        """The delta ``text`` adds ({} when it completes nothing yet); ``final``: the answer ends with it."""
        if self.mode == "named":
            if not self.calls:
                self.calls.append(_call(self.name, text))
                return {"tool_calls": [_delta(0, self.calls[0])]}
            if text:
                self.calls[0]["function"]["arguments"] += text
                return {"tool_calls": [{"index": 0, "function": {"arguments": text}}]}
            return {}
        if self.mode == "required":
            calls = [json.loads(t) for _, t in self.objects.feed(text)]
            return self._emit([_call(c["name"], c["parameters"]) for c in calls], "")
        if self.parser == "llama3_json":
            return self._llama3(text, final)
        return self._hermes(text, final)

    def _llama3(self, text: str, final: bool) -> dict:
        if self.state == "start":
            self.pending += text
            head = self.pending.lstrip()
            if not head:
                return {}
            self.state, text, self.pending = ("calls" if head[0] == "{" else "content"), self.pending, ""
        if self.state == "content":
            return self._emit([], text, final)
        # calls, each sent as it closes; what is no call waits for the end: content, all of the text if no call came
        self.raw += text
        calls = []
        for loose, obj in self.objects.feed(text):
            self.extra += loose.strip("; \n\t") and loose  # text between calls, not their separators
            call = _as_call(obj)
            if call is not None:
                calls.append(call)
            else:
                self.extra += obj
        if not final:
            return self._emit(calls, "")
        tail = "".join(self.objects.loose + self.objects.rest)  # after the last object, or one left open
        content = self.raw if not self.calls and not calls else self.extra + (tail.strip("; \n\t") and tail)
        return self._emit(calls, content, final)

    def _hermes(self, text: str, final: bool) -> dict:
        self.pending += text
        calls, content = [], ""
        while True:
            if self.state != "inside":
                at = self.pending.find(self.OPEN)
                if at < 0:  # all of it is content, but for an end that may open a tag
                    keep = 0 if final else next((n for n in range(len(self.OPEN) - 1, 0, -1)
                                                 if self.pending.endswith(self.OPEN[:n])), 0)
                    content += self.pending[:len(self.pending) - keep]
                    self.pending = self.pending[len(self.pending) - keep:]
                    break
                content, self.pending, self.state = content + self.pending[:at], self.pending[at + len(self.OPEN):], \
                    "inside"
            # the tag closes at the first "</tool_call>" after a whole call (the JSON may hold that text too)
            ends = [m.start() for m in re.finditer(re.escape(self.CLOSE), self.pending)] + [len(self.pending)] * final
            found = next(((e, c) for e in ends if (c := _as_call(self.pending[:e].strip())) is not None), None)
            if found is None and not final:
                break  # not a whole call yet
            end, call = found or (ends[0], None)  # no call: the text up to the first close (or all of it)
            body, closed = self.pending[:end], end < len(self.pending)
            if call is not None:
                calls.append(call)
            else:  # not a call: the text as the model wrote it
                content += self.OPEN + body + (self.CLOSE if closed else "")
            self.pending, self.state = self.pending[end + len(self.CLOSE):], "content"
            if not closed:
                break
        return self._emit(calls, content, final)

    def _emit(self, calls: list[dict], content: str, final: bool = False) -> dict:
        # trailing blanks wait for more text: the blank lines around calls are no content, a reply's are
        text = self.blank + content
        content = text.rstrip()
        self.blank = text[len(content):]
        if final and self.blank and not self.calls and not calls:
            content, self.blank = content + self.blank, ""
        delta = {}
        if content:
            self.content.append(content)
            delta["content"] = content
        if calls:
            self.calls.extend(calls)
            delta["tool_calls"] = [_delta(len(self.calls) - len(calls) + i, c) for i, c in enumerate(calls)]
        return delta

    def finish_reason(self, reason: str) -> str:
        """OpenAI's: a forced function's answer ends "stop", an answer of calls "tool_calls"; "length" stays."""
        if reason == "stop" and (self.mode == "required" or self.mode == "auto" and self.calls):
            return "tool_calls"
        return reason

    def message(self) -> dict:
        text = "".join(self.content)
        out = {"role": "assistant", "content": text if text or not self.calls else None}
        if self.calls:
            out["tool_calls"] = self.calls
        return out
