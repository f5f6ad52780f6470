"""torch.fx's symbolic tracing confined to the thread that traces.

``torch.fx.Tracer.trace`` changes the whole process while it runs: it replaces ``torch.nn.Module.__call__`` and
``__getattr__`` on the class, and sets a module-level flag that every ``torch.compile``d function checks before it
runs (``is_fx_symbolic_tracing``: "Detected that you are using FX to symbolically trace a dynamo-optimized
function"). Inductor traces this way in the middle of a compile: ``make_fx`` for every graph AOTAutograd captures,
and ``torch.fx.symbolic_trace`` once per process at the first lowering (loop_body's ``InterpreterShim``). infer
compiles in a background warm-up thread while other threads go on serving, so during those moments another thread's
eager forward failed in FX's wrapper ("module is not installed as a submodule": the module is not part of the graph
being traced) and its call of a compiled step (one no graph accepted yet, which goes through Dynamo's frame hook)
failed on the flag. Both were seen: a cold-cache start (2026-11-26) and a CI run with three compiled models in one
process (2026-12-01).

``confine_fx_tracing()`` makes the three per thread, once per process: the class attributes a trace installs act
only in the thread that installed them (other threads get what the attribute was before), and the flag reads True
only in a thread inside ``Tracer.trace``. What a trace records in its own thread is unchanged. Dynamo serializes
its compiles (one lock per process), so two traces never interleave in a way this would have to order.

Private torch internals: if one of them is missing (another torch), nothing is changed and the race stays what it
was. Call it before the ``torch.compile`` calls it should cover: ``torch.compile`` reads the flag's check function
when it wraps a function.
"""

from __future__ import annotations

import functools
import threading

import torch

_done = False
_local = threading.local()  # depth: how many Tracer.trace calls this thread is inside


def confine_fx_tracing() -> bool:
    """Install the per-thread behaviour (idempotent); False where this torch lacks the internals it replaces."""
    global _done
    if _done:
        return True
    from torch.fx import _symbolic_trace as st

    if not all(hasattr(st, n) for n in ("_Patcher", "Tracer", "is_fx_symbolic_tracing", "is_fx_tracing")):
        return False
    trace, patch_method = st.Tracer.trace, st._Patcher.patch_method
    symbolic, any_tracing = st.is_fx_symbolic_tracing, st.is_fx_tracing

    @functools.wraps(trace)
    def trace_counted(self, *args, **kwargs):
        _local.depth = getattr(_local, "depth", 0) + 1
        try:
            return trace(self, *args, **kwargs)
        finally:
            _local.depth -= 1

    def here() -> bool:
        return getattr(_local, "depth", 0) > 0

    @functools.wraps(symbolic)
    def is_fx_symbolic_tracing() -> bool:
        return here() and symbolic()

    @functools.wraps(any_tracing)
    def is_fx_tracing() -> bool:
        return here() and any_tracing()

    @functools.wraps(patch_method)
    def patch_method_here(self, cls, name, new_fn, deduplicate=True):
        if cls is torch.nn.Module and name in ("__call__", "__getattr__"):
            owner, before, patched = threading.get_ident(), getattr(cls, name), new_fn

            @functools.wraps(patched)
            def new_fn(*args, **kwargs):  # noqa: F811 (the thread's choice around the tracer's function)
                return (patched if threading.get_ident() == owner else before)(*args, **kwargs)

        return patch_method(self, cls, name, new_fn, deduplicate)

    st.Tracer.trace = trace_counted
    st._Patcher.patch_method = patch_method_here
    st.is_fx_symbolic_tracing, st.is_fx_tracing = is_fx_symbolic_tracing, is_fx_tracing
    _done = True
    return True
