"""AsyncEngine: many concurrent streams through one background model loop; abort and early exit free KV;
refused requests raise before streaming."""

import asyncio
import os
import subprocess
import sys

import pytest

from infer.engine import EngineConfig, QueueFullError
from infer.engine.async_engine import AsyncEngine
from infer.llm import LLM
from infer.sampling import SamplingParams

PROMPTS = [[5, 6, 7], [40, 41], [100, 7, 8, 9, 10, 11], [3], [250, 251, 252, 253]]


@pytest.fixture(scope="module")
def engine(gqa_dir):
    eng = AsyncEngine(EngineConfig(model=gqa_dir, draft_model=gqa_dir, spec_length=3, max_batch_size=3,
                                   block_size=4, max_waiting_requests=8))
    yield eng
    eng.shutdown()


async def _collect(engine, prompt, params, rid=None):
    return [o async for o in engine.generate(prompt, params, rid)]


def test_concurrent_streams_equal_the_library(engine, gqa_dir):
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)

    async def main():
        return await asyncio.gather(*[_collect(engine, p, params) for p in PROMPTS])

    streams = asyncio.run(main())
    expect = LLM(gqa_dir).generate(PROMPTS, params)
    for outs, ref in zip(streams, expect):
        assert [o.token_id for o in outs] == ref.token_ids
        assert "".join(o.text for o in outs) == ref.text
        assert outs[-1].finished and not any(o.finished for o in outs[:-1])
        assert outs[-1].acceptance_rate is not None
    eng = engine.engine
    assert eng.free_kv_tokens() == eng.initial_free_kv_tokens


def test_abort_and_early_exit_free_kv(engine):
    params = SamplingParams(temperature=0, max_tokens=200, ignore_eos=True)

    async def main():
        async def leave_early():
            async for _ in engine.generate([5, 6, 7], params):
                break  # the consumer goes away after one token: the stream aborts its request

        async def aborted():
            stream = await engine.add_request([8, 9], params, request_id="to-abort")
            first = await stream.__anext__()
            engine.abort("to-abort")
            rest = [o async for o in stream]
            return first, rest

        _, (first, rest) = await asyncio.gather(leave_early(), aborted())
        for _ in range(100):  # the abort of the early leaver is processed by the model thread
            if not engine.engine.has_unfinished:
                break
            await asyncio.sleep(0.02)
        return first, rest

    first, rest = asyncio.run(main())
    assert first.token_id is not None and rest[-1].finish_reason == "abort"
    eng = engine.engine
    assert not eng.has_unfinished and eng.free_kv_tokens() == eng.initial_free_kv_tokens


def test_refused_requests_raise_before_streaming(engine):
    async def main():
        with pytest.raises(ValueError, match="prompt is empty"):
            await engine.add_request([], SamplingParams())
        with pytest.raises(ValueError, match="max_seq_len"):
            await engine.add_request([1, 2], SamplingParams(max_tokens=10**6))
        long = SamplingParams(max_tokens=200, ignore_eos=True)
        first = await engine.add_request([1, 2], long, request_id="dup")
        with pytest.raises(ValueError, match="already in use"):
            await engine.add_request([1, 2], long, request_id="dup")
        first.close()

    asyncio.run(main())


def test_full_queue_is_refused(gqa_dir):
    eng = AsyncEngine(EngineConfig(model=gqa_dir, max_batch_size=1, max_waiting_requests=1))
    try:
        async def main():
            params = SamplingParams(temperature=0, max_tokens=50, ignore_eos=True)
            streams = [await eng.add_request([5, 6], params)]
            while eng.engine.num_running == 0:  # admitted: the queue is empty again
                await asyncio.sleep(0.005)
            streams.append(await eng.add_request([5, 7], params))  # waits behind it (max_batch_size 1)
            errors = 0
            for _ in range(3):
                try:
                    streams.append(await eng.add_request([5, 8], params))
                except QueueFullError:
                    errors += 1
            for s in streams:
                s.close()
            return errors

        assert asyncio.run(main()) == 3
    finally:
        eng.shutdown()


RELEASE_SCRIPT = """
import os, threading, torch
from infer import kernels
torch.set_num_threads(2)
def tasks():
    return len(os.listdir("/proc/self/task"))
before = tasks()
x = torch.ones(1 << 22)
for _ in range(20):
    x.mul_(1.0)  # parallel regions in this thread: libgomp starts this thread's worker
with_pool = tasks()
released = kernels.release_thread_pool()
print(before, with_pool, released, tasks())
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="counts threads in /proc")
def test_release_thread_pool_lets_the_callers_openmp_workers_exit():
    """The builder's OpenMP workers must go (kernels.release_thread_pool): beside the loop thread's own, libgomp manages
    more threads than cores and each of a step's parallel regions waits for a sleeping worker (a server's lone
    requests ran at half speed)."""
    out = subprocess.run([sys.executable, "-c", RELEASE_SCRIPT], capture_output=True, text=True, timeout=120,
                         env={**os.environ, "OMP_NUM_THREADS": "2"})
    before, with_pool, released, after = out.stdout.split()[-4:]
    assert released == "True", out.stderr[-2000:]
    assert int(with_pool) > int(before) and int(after) < int(with_pool)


def test_the_async_engine_releases_the_builders_openmp_workers(gqa_dir, monkeypatch):
    """AsyncEngine, built in one thread and stepped in its loop thread, releases the building thread's pool."""
    import threading

    from infer import kernels

    callers = []
    monkeypatch.setattr(kernels, "release_thread_pool", lambda: callers.append(threading.current_thread()) or True)
    eng = AsyncEngine(EngineConfig(model=gqa_dir, max_batch_size=1))
    eng.shutdown()
    assert callers == [threading.current_thread()]
