"""AsyncEngine: the Engine driven by one background thread, many requests streaming concurrently over asyncio.

    engine = AsyncEngine(EngineConfig(...))
    async for out in engine.generate(prompt_ids, params, request_id):   # StepOutputs, the last has finished=True
        ...
    engine.abort(request_id)                                            # from anywhere, at any time

The model thread owns the Engine; other threads talk to it only through a command queue (add / abort, and an
embedding's forward between two steps), and it answers through each request's asyncio.Queue via
``loop.call_soon_threadsafe``. ``add_request`` awaits the engine's verdict, so a bad or refused request raises
(ValueError, QueueFullError) before any streaming starts. A consumer that stops iterating (client disconnect, task
cancellation) aborts its request and frees its KV.
"""

from __future__ import annotations

import asyncio
import queue
import threading
import traceback
from collections.abc import AsyncIterator

from .. import kernels
from ..beam import BeamHypothesis, BeamSearchParams, engine_search, sparse_logprobs, step_params
from ..pooling import PoolingParams
from ..request import StepOutput
from ..sampling import SamplingParams
from .config import EngineConfig
from .engine import Engine


# While the engine's background warm-up runs, an idle loop looks this often whether it has ended, and if so finishes
# it there (Engine.wait_until_ready: a missing cost profile measured, a stored one checked) rather than in the next
# request's first step (a first start's profile of SmolLM2 took 3.5 s of its first request: 28 tok/s).
WARMUP_POLL_S = 0.5


class EngineStoppedError(RuntimeError):
    """The engine loop has died (e.g. a tensor-parallel worker was lost): no request can run any more."""


class RequestStream:
    """The StepOutputs of one request, in order; iterating to the end or closing it early are both fine."""

    def __init__(self, engine: AsyncEngine, request_id: str, q: asyncio.Queue):
        self.engine, self.request_id, self._q, self.finished = engine, request_id, q, False

    def __aiter__(self):
        return self

    async def __anext__(self) -> StepOutput:
        if self.finished:
            raise StopAsyncIteration
        item = await self._q.get()
        if isinstance(item, BaseException):
            self.finished = True
            raise item
        self.finished = item.finished
        return item

    def close(self) -> None:
        """Abort the request unless it already finished (idempotent)."""
        if not self.finished:
            self.finished = True
            self.engine.abort(self.request_id)


class AsyncEngine:
    def __init__(self, config: EngineConfig | Engine):
        self.engine = config if isinstance(config, Engine) else Engine(config)
        if self.engine.device.type == "cpu":
            # The engine is built here and stepped by the loop thread: this thread's OpenMP workers would stay
            # beside the loop thread's, more threads than cores, and every parallel region of a step would wait for
            # a sleeping worker (a lone request at half speed: kernels.release_thread_pool)
            kernels.release_thread_pool()
        self._cmds: queue.SimpleQueue = queue.SimpleQueue()
        self._wake = threading.Event()
        self._streams: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = {}
        self._stopped = False
        self._ids = 0
        self.error: BaseException | None = None  # set if the model loop died
        self._thread = threading.Thread(target=self._loop, name="infer-engine", daemon=True)
        self._thread.start()

    # -- client side (any thread / event loop) -----------------------------------------------------------------
    async def add_request(self, prompt_ids: list[int], params: SamplingParams | None = None,
                          request_id: str | None = None, prompt: str | None = None,
                          speculate: bool = True, prediction: list[int] | None = None,
                          priority: int = 0, lora: str | None = None) -> RequestStream:
        if self.error is not None:
            raise EngineStoppedError(f"the engine loop has stopped: {self.error}")
        if request_id is None:
            self._ids += 1
            request_id = f"areq-{self._ids}"
        loop, q = asyncio.get_running_loop(), asyncio.Queue()
        accepted = loop.create_future()
        args = (list(prompt_ids), params or SamplingParams(), request_id, prompt, speculate, prediction, priority,
                lora)
        self._cmds.put(("add", args, loop, q, accepted))
        self._wake.set()
        await accepted  # raises what Engine.add_request raised
        return RequestStream(self, request_id, q)

    async def generate(self, prompt_ids: list[int], params: SamplingParams | None = None,
                       request_id: str | None = None) -> AsyncIterator[StepOutput]:
        stream = await self.add_request(prompt_ids, params, request_id)
        try:
            async for out in stream:
                yield out
        finally:
            stream.close()  # consumer went away early: abort and free its KV

    async def beam_search(self, prompt_ids: list[int], params: BeamSearchParams,
                          request_id: str | None = None, lora: str | None = None) -> list[BeamHypothesis]:
        """vLLM's ``EngineClient.beam_search``: ``params.beam_width`` hypotheses, best first, as ``LLM.beam_search``
        finds them (``infer.beam``). Each step asks the engine for every running beam's next-token law: a request of
        one token whose logprobs are the search's ``keep`` likeliest (all a step reads), decoded plainly, batched
        beside other requests, the beams' common past from the prefix cache where it is on. ValueError
        (``beam.engine_search``) before any request if the search cannot run."""
        search = engine_search(self.engine, prompt_ids, params)
        if request_id is None:
            self._ids += 1
            request_id = f"abeam-{self._ids}"
        step = step_params(search)
        while not search.done:
            # added together, so that one engine step takes them all
            adds = [asyncio.ensure_future(self.add_request(list(prompt_ids) + beam, step,
                                                           f"{request_id}-{search.cur}-{i}", speculate=False,
                                                           lora=lora))
                    for i, beam in enumerate(search.beams())]
            try:
                streams = await asyncio.gather(*adds)
                alts = [[o async for o in s][-1].top_logprobs for s in streams]
            finally:
                for a in adds:
                    if a.done() and not a.cancelled() and a.exception() is None:
                        a.result().close()
                    else:
                        a.cancel()
            if any(a is None for a in alts):  # aborted under us (the server shut down)
                raise EngineStoppedError("beam search aborted: the engine stopped its requests")
            search.step(sparse_logprobs(alts))
        return search.finished

    async def embed(self, prompt_ids: list[int], params: PoolingParams | None = None):
        """``Engine.embed`` on the model thread, between two steps (the model is that thread's): the prompt's
        embedding [hidden_size], or the ValueError that names why it cannot be embedded."""
        return await self._call(lambda: self.engine.embed(prompt_ids, params))

    @property
    def lora_modules(self) -> dict[str, str]:
        """The per-request LoRA adapters loaded now, name -> directory (Engine.loras; a snapshot, any thread)."""
        return self.engine.loras.loaded

    @property
    def lora_loading(self) -> bool:
        """Whether adapters can be loaded and unloaded while it runs (EngineConfig.enable_lora)."""
        return self.engine.loras.dynamic

    async def load_lora(self, name: str, path: str, replace: bool = False) -> None:
        """``Engine.load_lora`` on the model thread, between two steps (the ValueError that names why not)."""
        await self._call(lambda: self.engine.load_lora(name, path, replace))

    async def unload_lora(self, name: str) -> None:
        """``Engine.unload_lora`` on the model thread, between two steps (the ValueError that names why not)."""
        await self._call(lambda: self.engine.unload_lora(name))

    async def _call(self, fn):
        """``fn()`` on the model thread between two steps -> its result, or what it raised."""
        if self.error is not None:
            raise EngineStoppedError(f"the engine loop has stopped: {self.error}")
        loop = asyncio.get_running_loop()
        done = loop.create_future()
        self._cmds.put(("call", fn, loop, done))
        self._wake.set()
        return await done

    def abort(self, request_id: str) -> None:
        self._cmds.put(("abort", request_id))
        self._wake.set()

    def abort_all(self) -> None:
        """Abort every request in flight; each stream ends with a final output (finish_reason "abort")."""
        for rid in list(self._streams):
            self.abort(rid)

    def shutdown(self) -> None:
        self._stopped = True
        self._wake.set()
        self._thread.join(timeout=10)
        if not self._thread.is_alive():  # a step still running owns the tensor-parallel channel: leave it to exit
            self.engine.close()

    # -- model thread ------------------------------------------------------------------------------------------
    def _push(self, request_id: str, item) -> None:
        target = self._streams.get(request_id)
        if target is None:
            return
        loop, q = target
        if isinstance(item, BaseException) or item.finished:
            del self._streams[request_id]
        try:
            loop.call_soon_threadsafe(q.put_nowait, item)
        except RuntimeError:  # the client's event loop is closed: nobody is listening any more
            pass

    def _handle(self, cmd) -> None:
        if cmd[0] == "add":
            _, (ids, params, rid, prompt, speculate, prediction, priority, lora), loop, q, accepted = cmd
            try:
                self.engine.add_request(ids, params, rid, prompt, speculate=speculate, prediction=prediction,
                                        priority=priority, lora=lora)
            except Exception as e:  # noqa: BLE001 - handed to the caller, who raises it
                loop.call_soon_threadsafe(_settle, accepted, e)
                return
            self._streams[rid] = (loop, q)
            loop.call_soon_threadsafe(_settle, accepted, None)
        elif cmd[0] == "call":
            _, fn, loop, done = cmd
            try:
                result = fn()
            except Exception as e:  # noqa: BLE001 - handed to the caller, who raises it
                loop.call_soon_threadsafe(_settle, done, e)
                return
            loop.call_soon_threadsafe(_resolve, done, result)
        else:
            out = self.engine.abort(cmd[1])
            if out is not None:
                self._push(cmd[1], out)
            else:
                self._streams.pop(cmd[1], None)

    def _loop(self) -> None:
        warming = self.engine.warmup is not None  # until the warm-up is finished (here while idle, else in a step)
        try:
            while not self._stopped:
                while True:
                    try:
                        self._handle(self._cmds.get_nowait())
                    except queue.Empty:
                        break
                if not self.engine.has_unfinished:
                    warming = warming and not self.engine.wait_until_ready(timeout=0)
                    self._wake.wait(WARMUP_POLL_S if warming else None)
                    self._wake.clear()
                    continue
                for out in self.engine.step():
                    self._push(out.request_id, out)
        except BaseException as e:  # noqa: BLE001 - a dead loop must not leave clients waiting forever
            traceback.print_exc()
            self.error = e
            for rid in list(self._streams):
                self._push(rid, EngineStoppedError(f"engine failure: {e}"))


def _settle(fut: asyncio.Future, err: BaseException | None) -> None:
    if fut.done():
        return
    if err is None:
        fut.set_result(None)
    else:
        fut.set_exception(err)


def _resolve(fut: asyncio.Future, result) -> None:
    if not fut.done():  # the caller may have gone (cancelled)
        fut.set_result(result)
