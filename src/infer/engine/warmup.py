"""Building the compiled steps: before the engine serves, or in a background thread while it serves.

Inductor specialises a graph on the sizes it first sees (context length, the first block's row, mask widths, rows)
and recompiles, ~40 s for SmolLM2 cold and a few seconds warm, when they change. Steps of every width a round may
verify, at two contexts, in two places of the pool and at a few batch sizes make those sizes dynamic up front, so a
request's rounds do not stop to compile. That is ~15 graphs: a minute and more even when inductor's on-disk cache
holds them all (Dynamo re-traces each at every start), which is why it runs in the background.

Background (``EngineConfig.compile_in_background``, the default on the CPU with infer's kernels): a thread first does what the
first token does not need (moves the weights onto 2 MiB pages, the same values; imports the compiler:
model.compile.CompiledSteps; removes damaged entries from inductor's cache), then runs the steps on a *twin* of each
pool (the same layout, so the same guards, over storage of its own: no KV the engine owns is touched), in order of
need: the one-row decode step, the one-row verify widths (and tree verifies), then batches.
Meanwhile the engine's own calls take the run-only steps (model.compile.CompiledSteps): a graph where one is ready,
else the same code eagerly. Both give the same bits, so the tokens never depend on how far the warm-up got (tests:
test_warmup.py). The speculative decoder drafts only once ``ready`` (an eager verify costs several decode steps, and
the cost model prices compiled ones), except a lone request whose round runs none of the graphs being built: the
target's one-call steps and the drafter's one-call round, with a stored cost model (SpeculativeDecoder.lone_ready,
Engine._lone_rounds_native): `infer chat` speculates from its first reply. When the thread is done, the engine may
compile on a miss again, as before. Where a lone row's every step is one C++ call (``Warmup._lone_steps_native``),
its stages are not built at all: only the batched ones are, and an engine of one KV slot (`infer chat`, the demo)
starts no warm-up, never imports the compiler and runs at full speed from its first reply.

An engine whose eager and compiled steps may round differently (no infer kernels: CUDA, or a failed kernel build)
runs the same warm-up in the foreground instead.
"""

from __future__ import annotations

import atexit
import os
import sys
import threading
import time
import weakref
from contextlib import contextmanager

import torch

from .. import kernels, progress
from ..cache.base import TreeAttn
from ..cache.paged import PagedKVCachePool
from ..model.compile import drop_damaged_entries
from ..model.hugepages import place_on_hugepages
from ..spec_decode.cost_model import profile_widths
from ..spec_decode.setup import PROFILE_CONTEXT
from ..spec_decode.tree import MAX_NODES
from ..spec_decode.tree_verify import ancestor_mask, tree_depths
# While the warm-up thread runs, each engine step is followed by a pause of this fraction of its duration, so the
# warm-up progresses under a constant load too (the engine keeps 2/3 of the time).
WARMUP_SHARE = 0.5
IDLE_S = 0.02  # the engine counts as idle (the warm-up runs freely) this long after its last step
# The warm-up parks at a Python call, where it may hold a lock (an import's, logging's, the compiler's) that the
# engine's step then waits for: a step still running after this long is let run beside the warm-up instead of
# waiting on it forever (a slower step, never a stuck one; both threads compute the same bits either way).
MAX_PARK_S = 1.0


# The warm-up thread's niceness (Linux: per thread; the compiler's worker processes it starts inherit it). The gate
# keeps its Python off the engine's steps, but not its C++ (inductor's passes, the C++ compiler's workers): beside it
# a chat engine's lone replies ran at 25-29 tok/s, 55-57 with the thread at 19 (SmolLM2 plain, Intel Xeon, 2 cores,
# benchmarks/early_drafts.py); the warm-up then ends a few seconds later (24-29 -> 30-32 s), on the time the engine
# leaves idle.
WARMUP_NICE = 19


# The interpreter's switch interval while a warm-up thread runs. The gate parks the warm-up at its next Python call,
# but the engine first has to get the GIL back from it: each return from an op (the lone steps' C++ calls release the
# GIL) waited up to sys.getswitchinterval(), 5 ms by default, against a round of ~10 ms. At 0.5 ms, SmolLM2's lone
# requests beside a warm start's warm-up ran at 180 tok/s median against 136 (64-token chat replies, AMD EPYC Zen 4,
# `LLM("smollm2", max_batch_size=8)`), the warm-up itself 237 s against 216 (its thread switched out more often).
WARMUP_SWITCH_S = 0.0005
_switch_lock = threading.Lock()
_switch_users = 0  # warm-up threads running (the interval is the interpreter's: restored when the last one ends)
_switch_saved = 0.005


def _fast_switch(on: bool) -> None:
    """Lower the switch interval while any warm-up thread runs; restore the one before when the last ends."""
    global _switch_users, _switch_saved
    with _switch_lock:
        if on:
            if _switch_users == 0:
                _switch_saved = sys.getswitchinterval()
                sys.setswitchinterval(min(_switch_saved, WARMUP_SWITCH_S))
            _switch_users += 1
        else:
            _switch_users -= 1
            if _switch_users == 0:
                sys.setswitchinterval(_switch_saved)


def _lower_priority() -> None:
    """The calling thread at WARMUP_NICE, where the OS allows it (a no-op elsewhere)."""
    try:
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), WARMUP_NICE)
    except (AttributeError, OSError):
        pass


_RUNNING: weakref.WeakSet = weakref.WeakSet()  # warm-ups whose thread was started
# The warm-up thread is stopped only at a call into infer's own code. Stopped at any call, it could be stopped at one
# that another library's cleanup makes before releasing a lock (logging's Handler.handle calls self.release() in its
# `finally`): the thread then died holding the lock, and the next logging call anywhere waited forever (a test
# session hung in logging.shutdown). infer's code holds no lock across a call, and the thread reaches it often: the
# kernels' shape functions while Dynamo traces, run_steps between graphs.
_OWN_CODE = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep


def stop_all() -> None:
    """Stop every warm-up thread still running (at interpreter exit; tests, between tests)."""
    for w in list(_RUNNING):
        w.stop()


atexit.register(stop_all)


class _Stopped(BaseException):
    """Raised inside the warm-up thread by ``Warmup.stop``."""


class _AdapterRow:
    """A warm-up row standing for a request of LoRA adapter ``lora`` (what ModelRunner.forward reads of one)."""

    def __init__(self, lora: int):
        self.lora = lora


@torch.inference_mode()
def run_steps(runner, pool, max_seq_len: int, widths: list[int], rows: int = 1, tree: bool = False) -> None:
    """Run decode/verify steps of ``rows`` rows x each of ``widths`` tokens on scratch slots of ``pool``, at two
    contexts (in two places of the pool: the second slots sit after the first), so every graph those steps need
    exists afterwards with its sizes dynamic. ``tree``: star-shaped tree verifies of each width too (their plan
    differs: positions apart from the columns written). Stops early where the pool cannot hold the slots."""
    model, widest, held, spacer = runner.model, max(widths), [], None
    # rows of LoRA adapter 1 (Request.lora), where the target carries per-request adapters: their steps read the rows'
    # adapters (AttnMeta.adapters), a graph of their own
    adapted = [_AdapterRow(1)] * rows if getattr(model, "lora_adapters", 0) else None
    try:
        for ctx in (PROFILE_CONTEXT, PROFILE_CONTEXT + widest + 1):
            # a batch's rows at contexts of different lengths, as a served batch's are: their steps then carry a
            # mask, a decode step's too (rows of one length need none, and would build the maskless graph only:
            # served batches then compiled theirs mid-request, ~1 s each, a 4x slower first pass at 8 requests)
            lens = [ctx + i for i in range(rows)]
            size = max(lens) + widest
            if held and not pool.can_fit([(None, size)] * rows):  # a pool for one sequence: the second context
                for s in held:  # where the first was (its length still differs, which is what makes it dynamic)
                    pool.free(s)
                held = []
                if isinstance(pool, PagedKVCachePool) and pool.can_fit([(None, 1)] + [(None, size)] * rows):
                    # a block further on (a spare slot holds the first): a lone row's storage row of position 0
                    # (AttnMeta.row0) is 0 only in a pool's first blocks, and a graph traced at 0 holds for 0 alone;
                    # with the prefix cache a lone request lands past the cached blocks its predecessors left
                    spacer = pool.allocate(1)
                    pool.prepare([spacer], [1])
            if size > max_seq_len or not pool.can_fit([(None, size)] * rows):
                return
            slots = [pool.allocate(size) for _ in range(rows)]
            held += slots
            runner.forward(model, pool, slots, [[1] * n for n in lens])  # the prompts: eager
            for t in widths:
                if adapted:  # a target with per-request adapters: its steps with an adapter's rows too
                    runner.forward(model, pool, slots, [[1] * t] * rows, reqs=adapted)
                    for s, n in zip(slots, lens):
                        pool.truncate_to(s, n)
                hidden = runner.forward(model, pool, slots, [[1] * t] * rows)
                # verify (its pads' lengths, as a round passes them), decode
                model.compute_logits(hidden, torch.tensor([t] * rows) if t > 1 else None)
                model.compute_logits(hidden[:, -1:])
                for s, n in zip(slots, lens):
                    pool.truncate_to(s, n)
                if tree and rows == 1 and t > 1:  # a star: every node a child of the root
                    parents = torch.tensor([[-1] + [0] * (t - 1)], device=runner.device)
                    attn = TreeAttn(ctx - 1 + tree_depths(parents), [ctx - 1], ancestor_mask(parents))
                    pool.truncate_to(slots[0], ctx - 1)
                    model.compute_logits(runner.forward(model, pool, slots, [[1] * t], attn), torch.tensor([t]))
                    pool.truncate_to(slots[0], ctx)
            if rows > 1:  # one row alone on blocks interleaved with the others' (a request after a batch: gathers)
                for t in widths:
                    for reqs in ([None, adapted[:1]] if adapted else [None]):
                        runner.forward(model, pool, slots[:1], [[1] * t], **({"reqs": reqs} if reqs else {}))
                        pool.truncate_to(slots[0], lens[0])
    finally:
        for s in held + ([spacer] if spacer is not None else []):
            pool.free(s)


@torch.inference_mode()
def run_draft_steps(proposer, pool, max_seq_len: int, widths: list[int], rows: int = 1) -> None:
    """The draft steps of ``rows`` rows (Proposer.warm_steps) at two contexts on ``pool``, a twin of the draft pool:
    every graph of a compiled drafter those need exists afterwards, with its sizes dynamic (as run_steps for the
    target). The second context's slots sit one block further into the pool (a spacer holds the first): a lone
    row's storage row of position 0 (``AttnMeta.row0``) is 0 only for the pool's first slot, and a graph traced at 0
    holds for 0 alone."""
    spacer = None
    try:
        for ctx in (PROFILE_CONTEXT, PROFILE_CONTEXT + max(widths) + 1):
            size = ctx + rows + max(widths)
            if size > min(max_seq_len, pool.max_seq_len) or not pool.can_fit([(None, size)] * rows):
                return
            proposer.warm_steps(pool, ctx, widths, rows)
            if spacer is None and pool.can_fit([(None, 1)] + [(None, size)] * rows):
                spacer = pool.allocate(1)
                pool.prepare([spacer], [1])
    finally:
        if spacer is not None:
            pool.free(spacer)


def _twin(pool, model):
    """A twin of ``pool`` to build graphs on (KVCachePool.twin: its pages committed only where written); a paged one
    with a slot more (its storage the same shape), so a lone row's steps are built a block into the pool too
    (run_steps, run_draft_steps). A contiguous pool's storage is sized by its slots: none more there."""
    return pool.twin(model, spare_slots=int(isinstance(pool, PagedKVCachePool)))


def warmup_stages(k_max: int, tree: bool, max_batch: int, draft: bool = False,
                  chunk: int | None = None) -> list[tuple[str, dict]]:
    """(what, run_steps keywords) in order of need: a lone request's decode step, its verify widths (a round's
    K + 1 tokens; tree verifies up to a tree's nodes), a compiled drafter's steps (``draft``), then the batch sizes
    the cost model profiles (rows of B > 1), their widths up to ``chunk`` tokens (the most a compiled step takes:
    prefill chunks that short, batched, run compiled too)."""
    widths = profile_widths(k_max)
    stages = [("the decode step", {"widths": [1]})]
    if k_max:
        verify = widths if not tree else sorted(set(widths) | {MAX_NODES})
        stages.append((f"verify steps of up to {max(verify)} tokens", {"widths": verify, "tree": tree}))
    if k_max and draft:
        stages.append(("the drafter's steps", {"widths": widths, "draft": True}))
    batches = [b for b in (2, 4, 8, 16, 32, 64) if b <= max_batch]
    if batches:
        wide = sorted(set(widths) | ({chunk} if chunk else set()))
        stages.append((f"batched steps (up to {batches[-1]} rows)", {"widths": wide, "batches": batches}))
        if k_max and draft:
            stages.append(("the drafter's batched steps", {"widths": wide, "draft": True, "batches": batches}))
    return stages


def _stoppable(frame) -> bool:
    """Whether the warm-up thread may be stopped at this call: infer's own code (_OWN_CODE), not inside an import."""
    return frame.f_code.co_filename.startswith(_OWN_CODE) and not _importing(frame)


def _importing(frame) -> bool:
    """Whether ``frame`` runs inside an import (importlib's frames below it). A warm-up thread stopped there leaves a
    half-initialised module in sys.modules, and every later import of it in the process fails: the first compile
    imports much of torch (networkx among it), and a test's warm-up stopped at its end broke the next test's
    compiles ("module 'networkx.utils' has no attribute 'configs'"). Parked there, it would hold the module's import
    lock against the engine thread."""
    while frame is not None:
        if frame.f_code.co_filename.startswith("<frozen importlib"):
            return True
        frame = frame.f_back
    return False


class Warmup:
    """Builds an engine's compiled steps; ``start(background)``, then ``ready`` / ``wait()``.

    ``engine``: the Engine (its runner, pools, model and limits are read; the engine itself is never called)."""

    def __init__(self, engine, k_max: int, tree: bool):
        self.runner, self.kv, self.model = engine.runner, engine.kv, engine.model
        self.max_seq_len = engine.max_seq_len
        max_batch = engine.config.max_batch_size
        # a compiled drafter's steps run on a twin of the draft pool (its model proposer: a hybrid's drafter)
        drafter = engine.draft_model
        self.drafter = drafter if getattr(drafter, "compiled", None) is not None else None
        proposer = engine.decoder.proposer if engine.decoder is not None else None
        self.proposer = getattr(proposer, "model", proposer)
        draft = self.drafter is not None and self.kv.draft_pool is not None
        # what the built graphs depend on besides the model: another engine with the same key builds none of them
        # (the target's in model.compiled.warmed, the drafter's in its own)
        self.key = (type(self.kv.pool).__name__, repr(sorted(self.kv.pool.layout().items())), k_max, tree, max_batch)
        self.draft_key = (repr(sorted(self.kv.draft_pool.layout().items())), k_max) if draft else None
        stages = warmup_stages(k_max, tree, max_batch, draft, self.model.compiled.max_tokens)
        self.lone_native = self._lone_steps_native()
        if self.lone_native and not tree:  # a tree's verify masks: a graph
            # a lone row's steps are one C++ call each and take no graph, so only the batched stages are built (none
            # at max_batch_size 1): `infer chat`'s first replies ran at 54-114 tok/s beside a compiler building
            # graphs they never used, against 184-250 without it (SmolLM2, Zen 4), and its rounds as fast after
            stages = [(w, kw) for w, kw in stages if kw.get("batches")]
        target_built = self.key in self.model.compiled.warmed
        drafter_built = not draft or self.draft_key in self.drafter.compiled.warmed
        self.stages = [(w, kw) for w, kw in stages if (drafter_built if kw.get("draft") else target_built) is False]
        self.done = threading.Event()
        self.error: BaseException | None = None
        self.seconds: dict[str, float] = {}  # stage -> wall seconds, for the start-up benchmark
        self._thread: threading.Thread | None = None
        self._open = threading.Event()  # set while the warm-up thread may run (engine_turn, _gate)
        self._open.set()
        self._lock = threading.Lock()
        self._stepping = False  # an engine step is running
        self._steps = 0  # engine steps begun (engine_turn)
        self._let_run = -1  # the step the warm-up no longer parks for (MAX_PARK_S)
        self._closed_at = 0.0  # when the engine last took the time back
        self._stop = False

    def _lone_steps_native(self) -> bool:
        """Whether a lone row's chain steps run without a graph: the target's decode and every verify width through
        its one-call forward (LlamaForCausalLM.runs_natively), and the drafter's round as one C++ call
        (Proposer.lone_round_native) or no compiled drafter."""
        if self.kv.lookahead + 1 > kernels.MAX_ROWS or not self.model.runs_natively(self.kv.pool):
            return False
        return self.drafter is None or self.proposer.lone_round_native()

    def claim(self) -> None:
        """Mark this warm-up's graphs as being built (another engine over the same models builds them no more)."""
        if any(not kw.get("draft") for _, kw in self.stages):
            self.model.compiled.warmed.add(self.key)
        if any(kw.get("draft") for _, kw in self.stages):
            self.drafter.compiled.warmed.add(self.draft_key)

    def _unclaim(self) -> None:
        self.model.compiled.warmed.discard(self.key)
        if self.draft_key is not None:
            self.drafter.compiled.warmed.discard(self.draft_key)

    def _draft_steps(self, widths: list[int], rows: int = 1) -> None:
        """The drafter's steps (``rows`` at once), on a twin of the draft pool; rounds draft only once this has run
        (Engine._finish_warmup). The twin is made outside inference mode, as the engine's pools are: the graphs are
        guarded on the cache tensors' kind."""
        self.drafter.compiled.ensure_built()
        run_draft_steps(self.proposer, _twin(self.kv.draft_pool, self.drafter), self.max_seq_len, widths, rows)

    @property
    def ready(self) -> bool:
        return self.done.is_set()

    def start(self, background: bool) -> None:
        pool = self.kv.pool
        if not background and self.model.device.type != "cpu":
            self._run(pool)  # the real pool, which nothing uses yet: a twin would hold a second cache on the GPU
            return
        twin = _twin(pool, self.model)  # allocated before any thread: a failure is raised here
        if not background:
            self._run(twin)
            return
        self._thread = threading.Thread(target=self._run, args=(twin,), name="infer-warmup", daemon=True)
        for compiled in self._compileds():
            compiled.compiling = -1  # from now on only the warm-up compiles (its ident is set in the thread)
        _fast_switch(True)  # undone as the thread ends (_run)
        try:
            self._thread.start()
        except BaseException:
            _fast_switch(False)
            raise
        _RUNNING.add(self)

    @contextmanager
    def engine_turn(self):
        """Run an engine step with the warm-up thread parked, then give it a share of the time.

        An eager step calls ~700 ATen ops and each releases the GIL; with another Python thread busy (tracing is pure
        Python), getting it back costs up to a switch interval (5 ms) every time: an eager SmolLM2 step took ~300 ms
        beside the tracer instead of ~13 ms alone. So the warm-up thread runs only while the engine lets it: for
        WARMUP_SHARE of each step's time right after the step, and whenever the engine has been idle for IDLE_S
        (no request). Elsewhere it parks at its next Python call (``_gate``, its trace hook), also while the engine's
        caller handles a step's outputs and schedules the next; never for more than MAX_PARK_S at a time."""
        if self._thread is None or self.done.is_set():
            yield
            return
        with self._lock:
            self._stepping = True
            self._steps += 1
            self._open.clear()
        t0 = time.perf_counter()
        try:
            yield
        finally:
            spent = time.perf_counter() - t0
            with self._lock:
                self._stepping = False
                self._open.set()
            time.sleep(WARMUP_SHARE * spent)
            with self._lock:
                self._open.clear()
                self._closed_at = time.perf_counter()

    def _gate(self, frame, event, arg):
        """sys.settrace hook of the warm-up thread, called at each Python call: parks while the engine works; stops
        the thread once ``stop()`` was called, at its next call into infer's code (``_stoppable``: never inside an
        import or another library's code). Raising unsets the hook, so the unwinding's own calls run untraced.
        Returns None: no per-line tracing."""
        if self._stop:
            if not _stoppable(frame):
                return  # it runs on to infer's next call (a compile in progress ends first)
            raise _Stopped
        if self._open.is_set() or self._let_run == self._steps or _importing(frame):
            return
        parked = time.perf_counter()
        while not self._open.wait(IDLE_S):
            if self._stop:
                if not _stoppable(frame):  # parked in another library's code: run on to infer's next call
                    return
                raise _Stopped
            with self._lock:
                now = time.perf_counter()
                if not self._stepping and now - self._closed_at >= IDLE_S:
                    self._open.set()  # the engine went idle: full speed until its next step
                    return
                if self._stepping and now - parked >= MAX_PARK_S:  # it may wait on a lock this thread holds:
                    self._let_run = self._steps  # run beside it until it ends
                    return

    def stop(self, timeout: float = 60.0) -> None:
        """Stop the warm-up thread at its next Python call and wait for it (the compiler it may be waiting on
        finishes first). Called at interpreter exit: a daemon thread still inside torch's C++ code when Python
        finalises aborts the process."""
        thread = self._thread
        if thread is None or not thread.is_alive():
            return
        self._stop = True
        self._open.set()
        thread.join(timeout)

    def wait(self, timeout: float | None = None) -> bool:
        """Block until every stage has run (True), or ``timeout`` seconds pass (False)."""
        return self.done.wait(timeout)

    def _compileds(self) -> list:
        """The compiled steps this warm-up builds: the target's, and the drafter's where it has its own. The
        drafter's too must be left to the warm-up thread: an EAGLE head's step asked for by the engine compiled in
        the request's own step beside the warm-up (SmolLM2's lone replies at 2-4 tok/s for minutes on 2 cores)."""
        return [self.model.compiled] + ([self.drafter.compiled] if self.drafter is not None else [])

    def _run(self, pool) -> None:
        for compiled in self._compileds():
            compiled.compiling = threading.get_ident()
        if self._thread is not None:
            # One OpenMP thread here: while a second thread that ran a parallel region lives, libgomp counts more
            # threads than cores and its workers sleep between regions, making each of the engine's regions wait
            # for a wake-up (an eager SmolLM2 step ran at half speed). This thread's count only: see one_thread_here.
            if not kernels.one_thread_here():
                torch.set_num_threads(1)  # Engine.step restores the engine thread's count
        start = time.perf_counter()
        try:
            if self._thread is not None:
                # inside the try: a stop() at once (a script ending right after it built the engine) raises _Stopped
                # at the first call the gate sees, and an uncaught one printed a traceback at the process's exit
                sys.settrace(self._gate)  # this thread only
                _lower_priority()
                # the engine left this to us (Engine.__init__): the same values on 2 MiB pages, swapped in tensor by
                # tensor; a step reading some old and some new tensors computes the same bits
                place_on_hugepages(self.model)
            self.model.compiled.ensure_built()  # imports Dynamo and inductor (CompiledSteps): not on a token's path
            drop_damaged_entries()  # before anything loads them
            for what, kw in self.stages:
                t0 = time.perf_counter()
                with progress.stage(f"compiling {what}"):
                    if kw.get("draft"):
                        for rows in kw.get("batches", [1]):
                            self._draft_steps(kw["widths"], rows)
                        self.seconds[what] = time.perf_counter() - t0
                        continue
                    for rows in kw.get("batches", [1]):
                        run_steps(self.runner, pool, self.max_seq_len, kw["widths"], rows, kw.get("tree", False))
                self.seconds[what] = time.perf_counter() - t0
            if self._thread is not None:
                progress.note(f"compiled steps ready after {time.perf_counter() - start:.1f} s: full speed from here")
        except _Stopped:
            self._unclaim()  # not built: another engine over these models builds them again
        except Exception as e:  # the engine keeps serving eagerly (same tokens); say why it stays slow
            self.error = e
            why = " ".join([line.strip() for line in str(e).splitlines() if line.strip()][:2])  # compiler logs are long
            progress.note(f"compiling failed ({type(e).__name__}: {why}); steps without a graph run eagerly")
        finally:
            sys.settrace(None)
            if self._thread is not None:
                _fast_switch(False)
            # From now on a miss compiles where it happens, as without a warm-up; after a failure nothing compiles
            # again (-1: no thread's ident), so a request never meets the failing compiler in its own step.
            for compiled in self._compileds():
                compiled.compiling = None if self.error is None and not self._stop else -1
            self.done.set()
