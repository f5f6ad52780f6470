"""A /v1/responses answer (responses.py) as it is built: the reader's deltas become output items (a message whose
``output_text`` part grows, a ``function_call`` item per call whose arguments grow) and, streamed, the typed events
that say so, numbered by ``sequence_number``; a whole answer is the same reading done once, then ``response()``."""

from __future__ import annotations

import copy
import json
import uuid
from typing import TYPE_CHECKING

from pydantic import BaseModel

from . import protocol as P
from .completions import _Choice, _close, _logprobs_payload
from .state import ServerState

if TYPE_CHECKING:
    from .responses import ResponsesRequest


class Answer:
    """A response's output items, built from the choice's text as it comes (streamed: as events)."""

    def __init__(self, state: ServerState, body: ResponsesRequest, rid: str, choice: _Choice, logprobs: bool,
                 on_done=None):
        """``on_done(response)``: called with the final response object (the store keeps it)."""
        self.state, self.body, self.rid, self.c, self.logprobs = state, body, rid, choice, logprobs
        self.on_done = on_done or (lambda response: None)
        self.created = P.now()
        self.items: list[dict] = []  # output items in order: the message (opened at its first text), the calls
        self.message: dict | None = None
        self.calls: dict[int, dict] = {}  # a call's index in the reader -> its item
        self.seq = 0

    def read(self, text: str, outs: list, final: bool = False) -> list[tuple[str, dict]]:
        """Take ``text`` (and the outputs that wrote it) into the items -> the events that say so."""
        delta = self.c.reader.feed(text, final) if self.c.reader else {"content": text} if text else {}
        events = self._open_message() if delta.get("content") else []
        if delta.get("content"):
            part = self.message["content"][0]
            part["text"] += delta["content"]
            lp = _logprobs_payload(self.state.tokenizer, outs, True)["content"] if self.logprobs and outs else []
            part["logprobs"] += lp
            events.append(("response.output_text.delta", self._at(self.message, content_index=0,
                                                                  delta=delta["content"], logprobs=lp)))
        for call in delta.get("tool_calls", ()):
            item = self.calls.get(call["index"])
            if item is None:
                item = self.calls[call["index"]] = {
                    "type": "function_call", "id": f"fc_{uuid.uuid4().hex}", "call_id": call["id"],
                    "name": call["function"]["name"], "arguments": "", "status": "in_progress"}
                events.append(self._added(item))
            if call["function"].get("arguments"):
                item["arguments"] += call["function"]["arguments"]
                events.append(("response.function_call_arguments.delta",
                               self._at(item, delta=call["function"]["arguments"])))
        return events

    def _open_message(self) -> list[tuple[str, dict]]:
        """The message item and its text part, opened at the first text (events: their ``added``)."""
        if self.message is not None:
            return []
        self.message = {"type": "message", "id": f"msg_{uuid.uuid4().hex}", "status": "in_progress",
                        "role": "assistant", "content": []}
        events = [self._added(self.message)]
        part = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
        self.message["content"].append(part)
        return events + [("response.content_part.added", self._at(self.message, content_index=0,
                                                                  part=copy.deepcopy(part)))]

    def _added(self, item: dict) -> tuple[str, dict]:
        self.items.append(item)
        return "response.output_item.added", {"output_index": len(self.items) - 1, "item": copy.deepcopy(item)}

    def _at(self, item: dict, **kw) -> dict:
        return {"item_id": item["id"], "output_index": self.items.index(item), **kw}

    def finish(self) -> list[tuple[str, dict]]:
        """The events that close every item (an answer without tools has its message, empty or not)."""
        events = self._open_message() if self.c.reader is None else []
        for i, item in enumerate(self.items):
            item["status"] = "completed"
            if item["type"] == "message":
                part = item["content"][0]
                events += [("response.output_text.done", self._at(item, content_index=0, text=part["text"],
                                                                  logprobs=part["logprobs"])),
                           ("response.content_part.done", self._at(item, content_index=0, part=part))]
            else:
                events.append(("response.function_call_arguments.done", self._at(item, arguments=item["arguments"])))
            events.append(("response.output_item.done", {"output_index": i, "item": item}))
        return events

    def response(self, status: str | None = None, error: str | None = None) -> dict:
        """The response object; ``status`` None: as the finished choice says. "queued" or "in_progress": no output
        yet; "cancelled" or "failed" (``error`` says why): the items as far as they got, ``incomplete``."""
        reason = self.c.finish_reason
        if status is None:
            for item in self.items:
                item["status"] = "completed" if reason != "length" else "incomplete"
            status = {"length": "incomplete", "abort": "cancelled"}.get(reason, "completed")
        elif status in ("cancelled", "failed"):
            for item in self.items:
                item["status"] = "incomplete" if item["status"] == "in_progress" else item["status"]
        b, fmt = self.body, self.body.text.format if self.body.text and self.body.text.format else None
        usage = P.usage(len(self.c.prompt_ids), len(self.c.outputs), self.c.draft, self.c.accepted,
                        self.state.speculative, self.c.cached)
        return {
            "id": self.rid, "object": "response", "created_at": self.created, "status": status,
            "error": None if error is None else {"code": "server_error", "message": error},
            "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
            "instructions": b.instructions, "max_output_tokens": b.max_output_tokens, "model": b.model,
            "output": [] if status in ("queued", "in_progress") else self.items,
            "parallel_tool_calls": b.parallel_tool_calls, "previous_response_id": b.previous_response_id,
            "reasoning": None, "store": b.store, "background": bool(b.background),
            "temperature": b.temperature,
            "text": {"format": fmt.model_dump(by_alias=True, exclude_none=True) if fmt else {"type": "text"}},
            "tool_choice": b.tool_choice.model_dump() if isinstance(b.tool_choice, BaseModel) else
            b.tool_choice or ("auto" if b.tools else "none"),
            "tools": [t.model_dump() for t in b.tools or ()], "top_p": b.top_p,
            "truncation": b.truncation or "disabled",
            "metadata": b.metadata or {}, "top_logprobs": b.top_logprobs,
            "usage": {"input_tokens": usage["prompt_tokens"], "input_tokens_details": usage["prompt_tokens_details"],
                      "output_tokens": usage["completion_tokens"], "output_tokens_details": {"reasoning_tokens": 0},
                      "total_tokens": usage["total_tokens"], "acceptance_rate": usage["acceptance_rate"],
                      "num_draft_tokens": usage["num_draft_tokens"],
                      "num_accepted_tokens": usage["num_accepted_tokens"]}}

    def final(self, status: str | None = None, error: str | None = None) -> dict:
        """The finished response object (``response``'s arguments), handed to ``on_done`` (the store) as it is
        answered."""
        response = self.response(status, error)
        self.on_done(response)
        return response

    def _event(self, kind: str, data: dict) -> str:
        self.seq += 1
        return f"event: {kind}\ndata: {json.dumps({'type': kind, 'sequence_number': self.seq - 1, **data})}\n\n"

    async def events(self, created: str = "in_progress"):
        """OpenAI's typed events, ``response.created`` (its status ``created``: "queued" in the background) to
        ``response.completed`` / ``.incomplete``, or an ``error`` then ``response.failed``."""
        c = self.c
        try:
            yield self._event("response.created", {"response": self.response(created)})
            yield self._event("response.in_progress", {"response": self.response("in_progress")})
            pending = []  # outputs whose text is not out yet (held back for a stop string)
            try:
                async for out in c.stream:
                    c.observe(out, self.state.metrics)
                    if out.token_id is not None:
                        pending.append(out)
                    if not out.text and not out.finished:
                        continue
                    for kind, data in self.read(out.text, pending, final=out.finished):
                        yield self._event(kind, data)
                    pending = []
            except Exception as e:  # noqa: BLE001 - surfaced to the client as OpenAI's error event
                message = f"generation failed: {e}"
                yield self._event("error", {"code": "server_error", "message": message, "param": None})
                yield self._event("response.failed", {"response": self.final("failed", message)})
                return
            for kind, data in self.finish():
                yield self._event(kind, data)
            done = self.final()
            kind = {"completed": "response.completed", "incomplete": "response.incomplete"}.get(
                done["status"], "response.failed")
            yield self._event(kind, {"response": done})
        finally:  # normal end, client disconnect (cancellation) or error: abort whatever still runs
            _close([c], self.state.metrics)
