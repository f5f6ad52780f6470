"""The Responses API's store (``store``, OpenAI's default): each stored response object, and the conversation it ended
(its input's messages, without ``instructions``, which OpenAI does not carry over, then its answer), so that
``previous_response_id`` continues it and ``GET`` / ``DELETE /v1/responses/{id}`` read and drop it; a background
response (background.py) is stored as it starts, with its job. In memory, the last ``capacity`` responses (a server
restart forgets them, as vLLM's store); a response dropped while its job runs has the job cancelled. Touched only on
the event loop."""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from . import protocol as P

if TYPE_CHECKING:
    from .background import Job

CAPACITY = 1024  # responses kept; the oldest is dropped first


@dataclass
class Stored:
    response: dict  # the response object as answered (a background one: as it started, until its job ends)
    history: list[P.ChatMessage]  # the conversation through this response's answer
    job: Job | None = None  # a background response's, kept for its events after it ends
    input: list[dict] = field(default_factory=list)  # its own input as OpenAI's items (GET .../input_items)

    @property
    def running(self) -> bool:
        return self.job is not None and not self.job.done

    def current(self) -> dict:
        """The response object as it stands."""
        return self.job.snapshot() if self.running else self.response


class ResponseStore:
    def __init__(self, capacity: int = CAPACITY):
        if capacity < 1:
            raise ValueError(f"a response store holds at least one response, got capacity {capacity}")
        self.capacity = capacity
        self._items: OrderedDict[str, Stored] = OrderedDict()

    def get(self, rid: str) -> Stored | None:
        return self._items.get(rid)

    def put(self, rid: str, stored: Stored) -> None:
        self._items[rid] = stored
        self._items.move_to_end(rid)
        while len(self._items) > self.capacity:
            _cancel(self._items.popitem(last=False)[1])

    def update(self, rid: str, stored: Stored) -> None:
        """``put``, for a response still stored: one deleted or dropped meanwhile stays gone."""
        if rid in self._items:
            self._items[rid] = stored

    def delete(self, rid: str) -> bool:
        return _cancel(self._items.pop(rid, None)) is not None

    def cancel_all(self) -> list:
        """Cancel every running job (the server is stopping) -> their tasks, to await."""
        jobs = [s.job for s in self._items.values() if s.running]
        for job in jobs:
            job.cancel()
        return [job.task for job in jobs]

    def __len__(self) -> int:
        return len(self._items)


def _cancel(stored: Stored | None) -> Stored | None:
    if stored is not None and stored.job is not None:
        stored.job.cancel()
    return stored


def answer_messages(items: list[dict]) -> list[P.ChatMessage]:
    """A response's output items as the chat history's assistant message: its text and its calls."""
    text = "".join(p["text"] for i in items if i["type"] == "message" for p in i["content"])
    calls = [P.ToolCall(id=i["call_id"], function=P.FunctionCall(name=i["name"], arguments=i["arguments"]))
             for i in items if i["type"] == "function_call"]
    if not text and not calls:
        return [P.ChatMessage(role="assistant", content="")]
    return [P.ChatMessage(role="assistant", content=text or None, tool_calls=calls or None)]
