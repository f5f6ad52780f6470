"""Start-up progress: what infer is doing while a person waits (kernel build, model load, compilation, profiling).

The library is silent by default; the commands (`infer chat | demo | serve | generate`) call ``enable()``. Then

    with progress.stage("building infer's CPU kernels (first start only)"):   # blocks the caller
        ...
    progress.note("decode step compiled in 8.1 s")                            # one line, e.g. from a background stage

On a terminal a stage run by the main thread is a live spinner with its elapsed seconds (rich), so nothing waits
silently; elsewhere (a log, a pipe, a benchmark's capture) and in a background thread (engine.warmup's compiling) a
stage prints one line when it starts and one when it ends.

A background stage never spins: the chat streams its replies and reads what a person types on the same terminal,
and a spinner redraws its line (a carriage return and an erase) over whatever was written there since. For the same
reason a command that streams (``infer chat``, ``infer demo``) wraps each reply, and each wait for input, in
``held()``: background threads' lines wait there and are printed, whole, when it ends.
"""

from __future__ import annotations

import sys
import threading
import time
from contextlib import contextmanager

_out = None  # the stream stages report to; None: silent (the library's default)
_lock = threading.Lock()  # background stages report from their own thread
_held: list[str] | None = None  # background threads' lines while held() (None: printed at once)
_depth = 0  # held() blocks open


def enable(stream=None) -> None:
    """Report stages on ``stream`` (default stderr) from now on."""
    global _out
    _out = stream or sys.stderr


def disable() -> None:
    global _out
    _out = None


def enabled() -> bool:
    return _out is not None


def note(message: str) -> None:
    """One line (when enabled); a background thread's waits while ``held()``."""
    if _out is not None:
        with _lock:
            if _held is not None and threading.current_thread() is not threading.main_thread():
                _held.append(message)
            else:
                _print(message)


def _print(message: str) -> None:
    print(f"infer: {message}", file=_out, flush=True)


@contextmanager
def held():
    """Background threads' lines wait while the block runs (a reply streaming, a person typing), then are printed
    on lines of their own; a stage that both began and ended meanwhile is printed as its end line alone."""
    global _held, _depth
    with _lock:
        _depth += 1
        if _held is None:
            _held = []
    try:
        yield
    finally:
        with _lock:
            _depth -= 1
            lines, done = (_held, _depth == 0)
            if done:
                _held = None
            if done and _out is not None:
                ends = {m.split(": ", 1)[0] for m in lines if ": " in m}
                for m in lines:
                    if not (m.endswith(" ...") and m[:-4] in ends):
                        _print(m)


@contextmanager
def stage(name: str):
    """Report ``name`` while the block runs: a spinner with elapsed time on a terminal, else a start and an end
    line. The end says how long it took, or that it failed."""
    if _out is None:
        yield
        return
    t0 = time.perf_counter()
    status = _spinner(name)
    if status is None:
        note(f"{name} ...")
    outcome = "failed"
    try:
        yield
        outcome = "done"
    except Exception:
        raise
    except BaseException:  # interrupted (Ctrl-C, the process exiting): not a failure of the stage
        outcome = "stopped"
        raise
    finally:
        if status is not None:
            status.stop()
        note(f"{name}: {outcome} after {time.perf_counter() - t0:.1f} s")


def _spinner(name: str):
    """A running rich status on a terminal, from the main thread (None elsewhere, or without rich)."""
    if not getattr(_out, "isatty", lambda: False)() or threading.current_thread() is not threading.main_thread():
        return None
    try:
        from rich.console import Console
    except ImportError:
        return None
    t0 = time.perf_counter()
    console = Console(file=_out)

    class Elapsed:  # re-rendered by rich on every refresh: the seconds keep counting
        def __rich__(self):
            return f"infer: {name} ({time.perf_counter() - t0:.0f} s)"

    status = console.status(Elapsed())
    status.start()
    return status
