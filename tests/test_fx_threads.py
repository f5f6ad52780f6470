"""torch.fx tracing confined to its thread (infer.model.fx_threads): while one thread traces (inductor does, in the
middle of a background compile), another thread's eager modules and compiled functions run as they would alone,
and the tracing thread's graph is the one FX would record anyway."""

import threading

import torch
import torch.fx

from infer.model.fx_threads import confine_fx_tracing


class _Block(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = torch.nn.Linear(4, 4)

    def forward(self, x):
        return self.proj(x).relu()


def _while_another_thread_traces(calls: dict) -> dict:
    """Run each of ``calls`` in this thread while another thread is inside ``torch.fx.symbolic_trace``: name ->
    None where it returned, else the exception's text."""
    inside, release = threading.Event(), threading.Event()

    def traced(x):
        inside.set()
        release.wait(30)
        return x + 1

    tracer = threading.Thread(target=torch.fx.symbolic_trace, args=(traced,))
    tracer.start()
    assert inside.wait(30)
    results = {}
    try:
        for name, call in calls.items():
            try:
                call()
                results[name] = None
            except Exception as e:  # noqa: BLE001 (the test reports what failed)
                results[name] = f"{type(e).__name__}: {e}"
    finally:
        release.set()
        tracer.join(30)
    return results


def test_other_threads_run_while_one_traces():
    assert confine_fx_tracing()
    block = _Block()
    compiled = torch.compile(lambda x: x * 2, backend="eager")  # after confine: torch.compile reads the flag's check
    compiled(torch.ones(3))
    run_only = torch._dynamo.run(compiled)
    results = _while_another_thread_traces({
        "eager module": lambda: block(torch.ones(4)),  # FX's Module.__call__: "module is not installed as a submodule"
        "compiled function": lambda: compiled(torch.ones(3)),  # the flag: "Detected that you are using FX ..."
        "run-only": lambda: run_only(torch.ones(3)),
    })
    assert results == {"eager module": None, "compiled function": None, "run-only": None}


def test_the_tracing_thread_still_traces():
    assert confine_fx_tracing()
    call, getattr_ = torch.nn.Module.__call__, torch.nn.Module.__getattr__
    graph = torch.fx.symbolic_trace(_Block()).graph
    assert [n.op for n in graph.nodes] == ["placeholder", "call_module", "call_method", "output"]
    assert torch.nn.Module.__call__ is call and torch.nn.Module.__getattr__ is getattr_  # restored after the trace
    compiled = torch.compile(lambda x: x + 1, backend="eager")
    try:  # inside its own trace a thread still sees the flag: FX over a compiled function is refused as before
        torch.fx.symbolic_trace(lambda x: compiled(x))
        raised = None
    except RuntimeError as e:
        raised = str(e)
    assert raised is not None and "symbolically trace" in raised
