"""The Responses API's store (``store``, OpenAI's default): each stored response object, and the conversation it ended
(its input's messages, without ``instructions``, which OpenAI does not carry over, then its answer), so that
``previous_response_id`` continues it and ``GET`` / ``DELETE /v1/responses/{id}`` read and drop it. In memory, the
last ``capacity`` responses (a server restart forgets them, as vLLM's store); touched only on the event loop."""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

from . import protocol as P

CAPACITY = 1024  # responses kept; the oldest is dropped first


@dataclass
class Stored:
    response: dict  # the response object as answered
    history: list[P.ChatMessage]  # the conversation through this response's answer


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
            self._items.popitem(last=False)

    def delete(self, rid: str) -> bool:
        return self._items.pop(rid, None) is not None

    def __len__(self) -> int:
        return len(self._items)


def answer_messages(items: list[dict]) -> list[P.ChatMessage]:
    """A response's output items as the chat history's assistant message: its text and its calls."""
    text = "".join(p["text"] for i in items if i["type"] == "message" for p in i["content"])
    calls = [P.ToolCall(id=i["call_id"], function=P.FunctionCall(name=i["name"], arguments=i["arguments"]))
             for i in items if i["type"] == "function_call"]
    if not text and not calls:
        return [P.ChatMessage(role="assistant", content="")]
    return [P.ChatMessage(role="assistant", content=text or None, tool_calls=calls or None)]
