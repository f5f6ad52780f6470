"""torch.compile (inductor) for the few-token steps: decode (1 token per row) and verify (K+1 per row).

Decoding a small model on CPU is bound by two things eager PyTorch does badly: the Python and dispatch cost of
~20 ops per layer, and one-row ``F.linear`` calls that stream weights at a third to a half of the memory bandwidth.
The products go to infer's own CPU kernels (infer.kernels: ``infer::linear``, ``infer::attention``), which inductor
calls as opaque ops; compiling the forward removes the rest (inductor fuses the norms, rotary and elementwise work
into a few C++ loops) and, with the guard filter below, most of Dynamo's per-call cost.

    compile_model(model)          # model.forward / compute_logits now use the compiled twins for <= max_tokens

What is compiled and what is not:
- ``model._forward`` (embedding -> layers -> norm) when a KV cache is given and T <= ``max_tokens``; prefill
  chunks stay eager (compute-bound already, and every chunk length would be another graph).
- ``model._logits`` for up to ``max_tokens`` rows, on CUDA. Not on the CPU: there the head is one opaque kernel
  call and a cast, and a compiled call only adds its entry and wrapper (SmolLM2's head after the body's products,
  compiled against eager, the same bits: 1.25 against 1.02 ms at one row, 1.77 against 1.34 at five; AMD EPYC Zen 4).
- Automatic dynamic shapes (``dynamic=None``): the first call of a step compiles with its exact sizes; the first
  size that changes (the cache length, at the second token) recompiles once with that size symbolic, and that
  graph then serves every length (no recompilation storm). Sizes that never change stay static, which gives
  inductor better kernels than ``dynamic=True``. A few graphs remain: one per structurally different step
  (single-row decode, a masked multi-token verify, a batch).
- Guards: Dynamo re-checks every tensor a graph reads before each call (~370 for SmolLM2, ~0.5 ms). ``step_guards``
  keeps only those that can tell one step from another; the model's weights are fixed once it is compiled
  (``quantize_model`` refuses a compiled model), and each model gets its own copy of the step's code object, so
  two models never share graphs.
- Weights: on the CPU the model's tensors enter each graph as its own attributes, not as inputs fetched through
  their attribute chains before every call (~0.2 ms a SmolLM2 decode step: ``_trace_settings``).
- Entry: a compiled step is called through ``_GraphEntry``, which looks up Dynamo's cache entries and runs the first
  whose guards pass, without Dynamo's frame hook (~100 us of a cold call: benchmarks/call_entry.py).
- Inductor's compiled artifacts persist on disk (``cache_dir``, default ``~/.cache/infer/inductor``): a second
  start replays them and pays only Dynamo's tracing.

The eager path stays the reference: ``compile=False`` (``--no-compile``) never touches torch.compile.
"""

from __future__ import annotations

import inspect
import os
import re
import threading
import types
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import torch

from ..cachedir import cache_dir, drop_damaged
from .fx_threads import confine_fx_tracing

DEFAULT_CACHE_DIR = cache_dir("inductor")


# A decode step is ~250 small fused kernels (norms, rotary, residuals over 576-wide rows) around the matrix-vector
# products. Inductor splits any loop over >= 512 elements across threads; at that size the OpenMP fork/join costs
# more than the work (SmolLM2 bf16: 63 -> 73 tok/s with this threshold). The products stay parallel.
INDUCTOR_OPTIONS = {"cpp.min_chunk_size": 16384}
# Speculation needs a token's logits to be bit-identical whether the target computes it alone (decode) or among K+1
# (verify), whichever path runs the step: a lone row's step as one C++ call (LlamaForCausalLM.native), a batch's
# compiled graph, the eager steps the background warm-up serves meanwhile. On the CPU every reduction and every
# multi-op bfloat16 chain of a few-token step is an infer kernel (products, attention, norm, rope, silu * up:
# kernels/pointwise.cpp says why); what inductor fuses around them is the residual adds, and with its fast defaults
# it does not round those as eager does: SmolLM2's compiled decode step differed from its eager one in ~5% of the
# first layer's outputs and in most of the last's (2026-12-03; our reading, not traced: a layer's two adds fused
# across the opaque norm between them, the sum rounded once). Emulating eager's casts gives the three paths one
# numerics, checked bit for bit (tests/test_native_forward.py); its price (~10% of a bfloat16 step when it was
# measured) is paid only by the steps still compiled on the CPU: batches, trees, models the one-call forward does
# not run.
# On the CPU the graph's wrapper (the code that calls those kernels and allocates their buffers) is C++ rather than
# Python: ~1 ms less a step for SmolLM2 int8 (~8 ms). Built as its own library, which keeps the first compile near
# the Python wrapper's (89 s vs 67 s for the demo's steps; 184 s otherwise); warm starts are the same.
CPU_INDUCTOR_OPTIONS = {**INDUCTOR_OPTIONS, "cpp_wrapper": True, "cpp_wrapper_build_separate": True,
                        "emulate_precision_casts": True}


def cpu_options() -> dict:
    """CPU_INDUCTOR_OPTIONS with the thread count fixed at this (the engine's) thread's: inductor otherwise plans its
    C++ kernels for the compiling thread's count, and the background warm-up compiles with one thread
    (engine.warmup: a second OpenMP team slows every parallel region of the engine's). Not ``dynamic_threads``
    (the caller's count read at run time): it would keep the warm-up's few runs of each graph on one thread, but
    made every SmolLM2 step ~10% slower for good (121-125 against 136 tok/s, AMD EPYC, 2 cores)."""
    return {**CPU_INDUCTOR_OPTIONS, "cpp.threads": torch.get_num_threads()}


# Each structural variant of a step (one row or a batch, one token or several, a tree's mask, a paged gather, ...) is
# one graph; allow more than Dynamo's default 8 before it gives up and runs the step eagerly.
RECOMPILE_LIMIT = 32


# Dynamo guards every tensor a graph reads: ~370 for SmolLM2 (weights, 60 KV tensors, rotary tables) plus the module
# tree, ~0.5 ms a call. Once compiled, the model's weights and modules never change shape (quantize_model refuses a
# compiled model) and a pool's layers all share one shape, so only these guards tell one step's graph from another:
# the inputs, the plan (attn_meta), the pool's type and first layer, the rotary tables (they grow) and the layers the
# forward returns beside the final state (an EAGLE-3 drafter's: LlamaForCausalLM.capture_layers).
_KV_LAYER_GUARD = re.compile(r"kv\.[kv]\[[1-9]")


def step_guards(entries) -> list[bool]:
    """torch.compile's guard_filter_fn: keep a guard unless it is on the model's own state or on a KV layer > 0, or
    is GLOBAL_STATE. That one holds the calling thread's torch thread count (besides autocast and the default dtype,
    which infer never changes): the background warm-up compiles with one thread (engine.warmup) for an engine that
    runs with two, and the kernels are planned for the engine's count either way (``cpu_options``)."""
    return [not ((e.name.startswith("self") and "rotary" not in e.name and "aux_layers" not in e.name)
                 or _KV_LAYER_GUARD.match(e.name) or e.guard_type == "GLOBAL_STATE") for e in entries]


# One build at a time, across models: the first imports Dynamo, and two threads importing it at once (a target's
# warm-up thread, a drafter built in the engine thread) could see a half-initialised module. (The failures once
# blamed on such a race, networkx's `utils.configs` missing in a later test, came from a warm-up thread stopped in
# the middle of an import: engine.warmup's gate no longer stops or parks a thread there.)
# torch.fx's tracing changes the whole process while it runs (Module.__call__ patched, a flag every compiled function
# checks), and inductor traces in the middle of a compile: another thread's eager forward or compiled call failed
# there (a cold-cache start, a CI run). ``build`` confines it to the tracing thread first (fx_threads).
_BUILD_LOCK = threading.Lock()


@dataclass
class CompiledSteps:
    """The compiled steps and, for each, a run-only twin over the same graphs, made on first need.

    Making them imports Dynamo and inductor (~2 s, Python-heavy): ``build`` runs where it is first needed, in a
    background warm-up's thread (engine.warmup) rather than on the way to a first token. Until it has run, other
    threads run the model's own code eagerly (``steps()`` returns None).
    While a background warm-up compiles, ``compiling`` holds its thread's id: calls from any other thread take the
    run-only twins, which use a graph where one exists and otherwise run the step's own code eagerly instead of
    compiling (torch._dynamo.run). Eager and compiled steps give the same bits (every reduction of a few-token step
    is an infer kernel: kernels/norm.cpp), so which one ran never shows in the tokens."""

    build: Callable  # () -> {method name: (compiling, run-only)}: "_forward", and "_logits" / "_chain" where defined
    max_tokens: int  # steps with at most this many tokens per row use them
    forward: Callable | None = None  # (input_ids [B, T], positions [B, T], kv, attn_meta) -> hidden [B, T, H]
    logits: Callable | None = None  # hidden [..., H] -> float32 logits [..., V]
    run_forward: Callable | None = None  # run-only twins: never compile
    run_logits: Callable | None = None
    methods: dict = field(default_factory=dict)  # every compiled method: name -> (compiling, run-only)
    compiling: int | None = None  # the warm-up thread's ident while it runs; None: every caller may compile
    # whether the head is compiled too (not on the CPU: its products are infer's kernels). False: asking for the
    # logits' step never builds, so an engine whose every step runs natively never imports the compiler
    has_logits: bool = True
    warmed: set = field(default_factory=set)  # engine.warmup keys already run on this model (pool layout, widths)

    def ensure_built(self) -> None:
        if self.run_forward is not None:  # every step asks: no lock once built
            return
        with _BUILD_LOCK:
            if self.run_forward is None:
                built = self.build()
                self.logits, self.run_logits = built.get("_logits", (None, None))
                self.methods = built
                self.forward, self.run_forward = built["_forward"]  # last: the others are set when this is

    def steps(self) -> tuple[Callable | None, Callable | None]:
        """(forward, logits) for the calling thread; (None, None): run the model's own code eagerly."""
        if self.compiling is None or self.compiling == threading.get_ident():
            self.ensure_built()
            return self.forward, self.logits
        return self.run_forward, self.run_logits  # None until the warm-up thread has made them

    def method(self, name: str) -> Callable | None:
        """The compiled method ``name`` for the calling thread (as ``steps``); None: run the model's own eagerly."""
        if self.compiling is None or self.compiling == threading.get_ident():
            self.ensure_built()
            return self.methods[name][0]
        pair = self.methods.get(name) if self.run_forward is not None else None
        return None if pair is None else pair[1]


def kernels_build() -> str:
    """The CPU kernels' build (its sources, flags and torch), which names the default cache's subdirectory: a compiled
    graph calls infer's ops through their schemas, and inductor's cache keys do not cover a custom op's schema, so a
    graph cached for an older ``infer::attention`` would call the new one with the old arguments (a crash)."""
    from .. import kernels

    return kernels.build_name()


def configure_cache(cache_dir: str | os.PathLike | None = None) -> Path:
    """Point inductor's on-disk caches at ``cache_dir`` (default ``~/.cache/infer/inductor/<kernels' build>``,
    ``kernels_build``), unless the user chose
    a directory with TORCHINDUCTOR_CACHE_DIR. Inductor's own default lives in the temp directory, which a reboot
    may empty; it also writes that default into the environment when torch._inductor is imported, so a value equal
    to the default counts as not chosen."""
    from torch._inductor.runtime.cache_dir_utils import default_cache_dir

    current = os.environ.get("TORCHINDUCTOR_CACHE_DIR")
    if current and os.path.abspath(current) != os.path.abspath(default_cache_dir()):
        return Path(current)
    path = Path(cache_dir or DEFAULT_CACHE_DIR / kernels_build())
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError:  # read-only home: keep inductor's default
        return Path(current or default_cache_dir())
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(path)
    torch._inductor.config.fx_graph_cache = True
    return path


def drop_damaged_entries() -> int:
    """Remove damaged files from inductor's on-disk cache (cachedir.drop_damaged: truncated libraries, objects and
    pickles, modules whose text no longer matches their name), each reported in one warning; inductor rebuilds what
    is missing. Without this a library truncated by a stopped build makes every later start fail to compile the
    graphs that load it. Returns how many were removed."""
    from torch._inductor.runtime.cache_dir_utils import cache_dir as inductor_cache_dir

    return len(drop_damaged(Path(inductor_cache_dir())))


def _traced_with(compiled: Callable, settings: dict) -> Callable:
    """``compiled`` with {config module: {name: value}} in force while it runs: settings that matter only while a
    call traces (Dynamo's and FX's configs are per thread). Set around each call (~4 us a setting; config.patch,
    its context manager, costs ~16 us) rather than for the caller's thread for good: a user's own torch.compile in
    that thread would inherit them."""
    pairs = [(cfg, name, value) for cfg, values in settings.items() for name, value in values.items()]

    def call(*args, **kwargs):
        changed = []
        for cfg, name, value in pairs:
            old = getattr(cfg, name)
            if old != value:
                setattr(cfg, name, value)
                changed.append((cfg, name, old))
        try:
            return compiled(*args, **kwargs)
        finally:
            for cfg, name, old in changed:
                setattr(cfg, name, old)

    return call


def _trace_settings(model, name: str) -> dict:
    """What ``model.<name>`` is traced with.

    - Dynamo's ``install_free_tensors`` (on the CPU): the module's parameters, buffers and tensor attributes enter the
      graph as its own attributes instead of inputs. As inputs, the code Dynamo runs before the graph on every call
      fetched each one through its attribute chain (``self.layers[7].mlp.down.packed``: ~240 for SmolLM2), shown by
      torch.profiler as "Pregraph bytecode", ~0.2 ms a call. The same ops, so the same bits. A/B on one model (two
      compiled forwards over the same weights, AMD EPYC Zen 4, SmolLM2 Q4_1/bf16, 200 tokens of context, 95 paired
      repeats): a decode step's forward 4.35 -> 4.15 ms (median of the pairs: 1.038x); a 5-token verify's unchanged
      (7.57 against 7.57 ms). What it asks: a
      tensor a graph read is not replaced afterwards (``p.data = ...``), or, its guards being filtered out
      (``step_guards``), the graph goes on computing with the old one. A compiled model's weights are fixed
      (quantize_model refuses it; huge pages are placed before the first compile: engine.warmup); the rotary tables'
      guards are kept, so a grown table recompiles (Engine.__init__ reserves them whole). On CUDA, last checked on a
      lent GPU before this setting, Dynamo's default stays.
    - For a draft chain or round (every size dynamic), no duck shapes: a symbol of its own for every size. Sizes that
      happen to be equal when a graph is traced (two added vocabulary rows, two KV heads) would otherwise be guarded
      equal, and a prompt adding three rows recompile."""
    import torch.fx.experimental._config  # noqa: F401 (the module, for the attribute below)

    settings = {}
    if model.device.type == "cpu":
        settings[torch._dynamo.config] = {"install_free_tensors": True}
    if name in ("_chain", "_round"):
        settings[torch.fx.experimental._config] = {"use_duck_shape": False}
    return settings


def _compile_method(model, name: str, options: dict, dynamic: bool | None = None) -> tuple[Callable, Callable]:
    """torch.compile ``model.<name>`` with graphs of its own -> (compiling, run-only) callables over one cache.

    Dynamo keeps its compiled graphs on the function's code object, shared by every instance of the class; with the
    guards on the model's state filtered out (``step_guards``), another model would match this one's graphs. A copy
    of the code object per model gives each model its own cache.
    """
    fn = getattr(type(model), name)
    code = fn.__code__.replace(co_name=f"{name}_{id(model):x}")
    own = types.MethodType(types.FunctionType(code, fn.__globals__, code.co_name, fn.__defaults__, fn.__closure__),
                           model)
    # the limit goes with the function: Dynamo's config is per thread, and the warm-up compiles in a thread of its own
    limit = {"recompile_limit": RECOMPILE_LIMIT} if "recompile_limit" in inspect.signature(torch.compile).parameters \
        else {}
    compiled = torch.compile(own, dynamic=dynamic, options=options, **limit)
    settings = _trace_settings(model, name)
    compiling = _traced_with(compiled, settings) if settings else compiled
    return _GraphEntry(own, compiling), _GraphEntry(own, torch._dynamo.run(own))


# Whether a compiled method's graphs are entered directly (_GraphEntry); False: always through Dynamo's frame hook.
DIRECT_ENTRY = True


class _GraphEntry:
    """A compiled method, its graphs entered without Dynamo's frame hook: Dynamo's own lookup, done here.

    Why: a step's call through ``torch.compile`` walks Dynamo's frame evaluation, its wrappers and the compiled
    region's entry before the graph runs, and a round makes its calls cold (the target's weights have just streamed
    through the caches), where that walk costs most (benchmarks/call_entry.py). Dynamo keeps, on the method's code
    object, a list of cache entries: each a guard manager and the transformed code that runs its graph (its inputs
    gathered, the compiled function called, its outputs rebuilt). This does what Dynamo's C lookup does with them:
    the first entry whose guards pass the call's arguments runs its code, the entry that ran last asked first (Dynamo
    moves the entry that passes to the front of its list), then the others in Dynamo's order. Nothing is skipped
    that decides which graph runs (the same guards, read afresh at every call: entries added by a compile, or
    dropped by ``torch._dynamo.reset``, are seen at once); what is skipped is the frame hook's own work. A call no
    entry accepts goes to ``fallback`` (the compiling callable, or the run-only twin), which compiles or runs
    eagerly as it would have, and so does every call made while a Dynamo callback is set (inside a compiled
    region). An entry's code calls its graph through Dynamo's disable wrapper, whose work (the frame callback set
    to None and back, the compile stance read) only matters under such a callback: where the entry's code reads no
    global but the ones Dynamo installed, it runs here over those alone, the graph's function unwrapped (~60 us of a
    cold call)."""

    def __init__(self, own, fallback):
        self.fallback, self.own = fallback, own
        fn = own.__func__
        self._code, self._globals, self._closure = fn.__code__, fn.__globals__, fn.__closure__
        names = self._code.co_varnames[: self._code.co_argcount]
        self._names = names
        self._defaults = dict(zip(names[len(names) - len(fn.__defaults__ or ()):], fn.__defaults__ or ()))
        self._direct = {}  # transformed code -> a function running it
        self._last = None  # the transformed code of the entry that ran last
        self._entries, self._callback = _dynamo_lookup()
        # positional parameters only (every compiled step's): their names are the frame's first locals
        self._plain = not (self._code.co_flags & (inspect.CO_VARARGS | inspect.CO_VARKEYWORDS)) and \
            self._code.co_kwonlyargcount == 0

    def __call__(self, *args):
        if DIRECT_ENTRY and self._entries is not None and self._plain and len(args) < len(self._names) and \
                self._callback() is None:
            args = (self.own.__self__, *args)
            if len(args) < len(self._names):
                args = (*args, *(self._defaults[n] for n in self._names[len(args):]))
            local = dict(zip(self._names, args))
            entries = self._entries(self._code)
            # the entry that ran last is asked first, as Dynamo's own lookup moves the entry that passes to the front
            # of its list (a list these direct calls leave as it is): a speculating target alternates runs of
            # one-token steps and verifies, and the head's round has a graph per draft count; each entry asked in
            # vain walks its guards cold (~10-20 us)
            last = self._last
            for entry in entries:
                if entry.code is last:
                    if entry.guard_manager.check(local):
                        return self._direct[last](*args)
                    break
            for entry in entries:
                if entry.code is not last and entry.guard_manager.check(local):
                    run = self._direct.get(entry.code)
                    if run is None:
                        run = self._direct[entry.code] = types.FunctionType(
                            entry.code, _installed_globals(entry.code, self._globals), None, None, self._closure)
                    self._last = entry.code
                    return run(*args)
            args = args[1:]
        return self.fallback(*args)


def _installed_globals(code, module_globals: dict) -> dict:
    """The globals an entry's transformed ``code`` runs with: if every global it may read is one Dynamo installed
    (its compiled function, its imports), those alone, the compiled function out of its disable wrapper; otherwise
    the module's own (a name another part of the module could rebind stays live)."""
    names = [n for n in code.co_names if n in module_globals]  # also attribute names that happen to be globals
    if not all(n.startswith(("__compiled_fn", "__import_")) for n in names):
        return module_globals
    lean = {"__builtins__": module_globals["__builtins__"]}
    for n in names:
        fn = module_globals[n]
        lean[n] = fn.__wrapped__ if getattr(fn, "_torchdynamo_disable", False) and hasattr(fn, "__wrapped__") else fn
    return lean


def _dynamo_lookup() -> tuple[Callable | None, Callable | None]:
    """(Dynamo's cache entries of a code object, the thread's frame callback): private helpers; (None, None) without
    them, and calls go through the frame hook. Imported here, at the first _GraphEntry (a build, in the warm-up
    thread), not with this module: importing torch._dynamo is ~1 s of Python, and at start it held up the first
    token (infer serve with SmolLM2's defaults: /health 4.8 -> 3.3 s, first token 4.9 -> 3.4 s, medians of 5)."""
    try:
        from torch._C._dynamo.eval_frame import get_eval_frame_callback
        from torch._dynamo.eval_frame import _debug_get_cache_entry_list
    except ImportError:  # pragma: no cover
        return None, None
    return _debug_get_cache_entry_list, get_eval_frame_callback


def compile_model(model, max_tokens: int = 16, cache_dir: str | os.PathLike | None = None):
    """Attach compiled decode/verify steps to ``model`` (in place; returns it). Idempotent.

    ``model``: a LlamaForCausalLM (its ``_forward`` and ``_logits``), or a drafter head with a ``_forward`` of its own
    (model.draft_heads: an EAGLE head's draft step over its cache), whose ``forward`` dispatches the same way, and a
    ``_chain`` (draft steps run back to back, greedy or drawn, one graph per number of steps: ``draft_chain``)."""
    if max_tokens < 1:
        raise ValueError(f"max_tokens must be >= 1, got {max_tokens}")
    if model.compiled is None:
        # the options now: inductor plans its C++ kernels for this (the engine's) thread count, wherever build runs
        options = {**(cpu_options() if model.device.type == "cpu" else INDUCTOR_OPTIONS),
                   "guard_filter_fn": step_guards}

        def build():
            confine_fx_tracing()  # before torch.compile, which reads the tracing flag's check when it wraps
            configure_cache(cache_dir)
            torch._dynamo.config.cache_size_limit = max(torch._dynamo.config.cache_size_limit, RECOMPILE_LIMIT)
            # a copy each: torch.compile takes guard_filter_fn out of the dict it is given
            # a draft chain's graphs: every size dynamic from the first (its list of plans would otherwise compile
            # each length twice, static then dynamic, and each vocabulary and row count apart)
            # the head eager on the CPU (see above)
            names = ("_forward", "_chain", "_round") if model.device.type == "cpu" else \
                ("_forward", "_logits", "_chain", "_round")
            return {name: _compile_method(model, name, dict(options), True if name in ("_chain", "_round") else None)
                    for name in names if hasattr(model, name)}

        model.compiled = CompiledSteps(build, max_tokens, has_logits=model.device.type != "cpu")
    model.compiled.max_tokens = max_tokens
    return model
