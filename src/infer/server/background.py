"""Background responses (OpenAI's ``background``, which needs ``store``): the answer runs as a task on the event loop
whoever listens, and keeps every event it streams, so that ``GET /v1/responses/{id}`` reads its state as it goes,
``GET ...?stream=true&starting_after=n`` streams it (again) from any event, and ``POST .../cancel`` stops it: its
engine request is aborted, and the response is stored "cancelled" with the output it had. A client that goes away
stops nothing (that is the point of the mode); deleting the response, or the store dropping it, cancels it."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

from .completions import _close
from .response_items import Answer


class Job:
    """One background response. Invariants: ``log[i]`` is the SSE text of the event numbered ``i``
    (``sequence_number``); once ``done``, the log is whole and the answer has been handed to the store (completed,
    incomplete, failed or cancelled)."""

    def __init__(self, answer: Answer):
        self.answer = answer
        self.log: list[str] = []
        self.done = False
        self._grown = asyncio.Event()  # set (then replaced) each time the log grows or the job ends
        self.task = asyncio.ensure_future(self._run())
        self.task.add_done_callback(self._ended)

    async def _run(self) -> None:
        async for event in self.answer.events(created="queued"):
            self._append(event)

    def _ended(self, task: asyncio.Task) -> None:
        # cancelled, even before its first step: its engine request aborted here (the events' own clean-up has run
        # only if they had started), the response stored as far as it got
        _close([self.answer.c], self.answer.state.metrics)
        if task.cancelled():
            self.answer.final("cancelled")
        elif (e := task.exception()) is not None:  # (the events answer an engine's error themselves)
            self.answer.final("failed", f"generation failed: {e}")
        self.done = True
        self._wake()

    def _append(self, event: str) -> None:
        self.log.append(event)
        self._wake()

    def _wake(self) -> None:
        self._grown.set()
        self._grown = asyncio.Event()

    def snapshot(self) -> dict:
        """The response as it stands while it runs: "queued" until its first token, then "in_progress"."""
        return self.answer.response("in_progress" if self.answer.c.outputs else "queued")

    async def tail(self, after: int = -1) -> AsyncIterator[str]:
        """The events numbered after ``after``: those logged, then each as it comes, to the job's end."""
        i = max(after + 1, 0)
        while True:
            while i < len(self.log):
                yield self.log[i]
                i += 1
            if self.done:
                return
            await self._grown.wait()  # (no await between the checks and this: the loop cannot miss a wake-up)

    def cancel(self) -> None:
        """Ask the job to stop (it ends on the loop's next turn); nothing if it has ended."""
        if not self.done:
            self.task.cancel()

    async def stop(self) -> None:
        """Cancel the job and wait for its end, the cancelled response stored (``_ended`` runs first: it was the
        task's first done-callback)."""
        self.cancel()
        await asyncio.wait({self.task})
