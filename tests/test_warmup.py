"""Start-up: the cost profile kept on disk (spec_decode.profile_store) and the compiled steps built in the background
(engine.warmup) while the engine already serves, with the same tokens whatever has been compiled so far."""

import faulthandler
import json
import subprocess
import sys
import threading
import time
import warnings
from types import SimpleNamespace

import pytest
import torch

from infer import LLM, SamplingParams, kernels
from infer.engine import warmup
from infer.model.hugepages import hugepages_supported
from infer.spec_decode import setup
from infer.spec_decode.profile_store import ProfileStore

PROMPTS = ["def fib(n):", "The quick brown fox", "import os"]
GREEDY = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)


def _ids(outs):
    return [o.token_ids for o in outs]


def _speculating(path, **kw):
    return LLM(path, draft_model=path, compile=False, max_batch_size=2, **kw)


def _profile(profile_dir):
    files = sorted(profile_dir.glob("costs-*.json"))
    assert len(files) == 1, files
    return files[0]


def test_a_second_engine_reads_the_stored_profile(gqa_dir, profile_dir, monkeypatch):
    first = _speculating(gqa_dir)
    path = _profile(profile_dir)
    assert not first.engine.decoder.cost_store.loaded

    def no_profiling(*a, **k):
        raise AssertionError("profiled although a stored profile matches")

    monkeypatch.setattr(setup, "measure_costs", no_profiling)
    second = _speculating(gqa_dir)
    assert second.engine.decoder.cost_store.loaded and _profile(profile_dir) == path
    got, want = second.engine.decoder.spec_length.costs, first.engine.decoder.spec_length.costs
    assert (got.verify, got.draft, got.draft_first) == (want.verify, want.draft, want.draft_first)
    assert _ids(second.generate(PROMPTS, GREEDY)) == _ids(first.generate(PROMPTS, GREEDY))


def test_a_stored_profile_out_of_proportion_is_measured_again(gqa_dir, profile_dir):
    """A stored profile whose widths past 2 tokens price 6x what they cost (as one taken under a sampling profiler did):
    the next start's check times one row's widths, finds them out of proportion and profiles again, saving the new
    shape; a profile in proportion (the one just saved) is kept as read."""
    first = _speculating(gqa_dir)
    path = _profile(profile_dir)
    data = json.loads(path.read_text())
    row = data["costs"]["verify"][1]  # one row's verify at T = 0 .. k_max + 1
    data["costs"]["verify"][1] = row[:3] + [x * 6 for x in row[3:]]
    path.write_text(json.dumps(data))
    second = _speculating(gqa_dir)
    assert second.engine.wait_until_ready()  # the check runs once the warm-up is done (Engine._finish_warmup)
    got = second.engine.decoder.spec_length.costs
    assert second.engine.decoder.cost_store.loaded and second.engine.decoder.check_costs is None
    want = first.engine.decoder.spec_length.costs.verify[1]
    assert got.verify[1][5] / got.verify[1][1] < 3 * want[5] / want[1]  # the shape measured, not the one stored
    assert json.loads(path.read_text())["costs"]["verify"][1] == got.verify[1]  # and saved
    third = _speculating(gqa_dir)
    assert third.engine.wait_until_ready()
    assert third.engine.decoder.spec_length.costs.verify == got.verify  # in proportion: kept


def test_an_engine_over_models_this_process_profiled_measures_nothing(monkeypatch):
    """A second engine over the same model objects (speculative_generate builds one a call) reads the cost model the
    first measured, from the process (no file: models passed in loaded have none), and neither profiles nor checks it."""
    from infer.engine import Engine, EngineConfig
    from infer.testing import random_llama

    target, drafter = random_llama(64, seed=0), random_llama(64, seed=1)

    def engine():
        return Engine(EngineConfig(model="target", draft_model="drafter", compile=False, max_batch_size=1),
                      model=target, draft_model=drafter)

    first = engine()
    assert first.decoder.spec_length.costs is not None

    def no_profiling(*a, **k):
        raise AssertionError("profiled although this process measured these models")

    monkeypatch.setattr(setup, "measure_costs", no_profiling)
    monkeypatch.setattr(setup, "stored_costs_hold", no_profiling)
    second = engine()
    assert second.wait_until_ready() and second.decoder.spec_length.costs is first.decoder.spec_length.costs


def test_another_setting_gets_a_profile_of_its_own(gqa_dir, profile_dir):
    _speculating(gqa_dir)
    _speculating(gqa_dir, spec_length_max=3)  # the widths profiled differ
    assert len(list(profile_dir.glob("costs-*.json"))) == 2


def test_a_quantized_drafter_gets_a_profile_of_its_own(gqa_dir, profile_dir):
    """The drafter's own quantization changes what a round costs (an int8 drafter's lone round is one C++ call, ~10x
    cheaper than its bfloat16 steps): a profile stored for one is never read as the other's (the demo pair's eager
    rounds, read as its Q8_0 drafter's, priced rounds of 4 drafts at 2.5 ms against 0.25 and kept K <= 3)."""
    _speculating(gqa_dir)
    second = _speculating(gqa_dir, draft_quantization="q8_0")
    assert not second.engine.decoder.cost_store.loaded
    assert len(list(profile_dir.glob("costs-*.json"))) == 2


def test_the_draft_prices_rounds_measured_survive_a_restart(gqa_dir, profile_dir):
    """What the engine saves (at exit; here called) carries each k's measured round of drafts, and the next start
    prices its rounds from them, not from the profile's lone draft step."""
    first = _speculating(gqa_dir)
    costs = first.engine.decoder.spec_length.costs
    # rounds of 2 and 3 drafts measured at a third of the profile's price (whether a tiny model's rounds draft at
    # all is auto K's call, timed: set here)
    for k in (2, 3):
        costs.refresh_draft(1, k, costs.draft_cost(1, k) / 3)
    first.engine.decoder.cost_store.save(costs)
    second = _speculating(gqa_dir)
    got = second.engine.decoder.spec_length.costs
    assert second.engine.decoder.cost_store.loaded and got.rounds == costs.rounds
    assert got.draft_costs(1, costs.k_max) == costs.draft_costs(1, costs.k_max)
    assert got.draft_costs(1, costs.k_max) != _profile_only(got).draft_costs(1, costs.k_max)


def _profile_only(c):
    """The same cost model with no round measured: its draft prices are the start-up profile's."""
    return type(c)(c.max_batch, c.k_max, c.verify, c.draft, c.draft_first)


@pytest.mark.parametrize("damage", ["truncated", "foreign", "bad table", "bad rounds"])
def test_a_corrupt_or_foreign_profile_is_reported_and_rebuilt(gqa_dir, profile_dir, damage):
    _speculating(gqa_dir)
    path = _profile(profile_dir)
    good = json.loads(path.read_text())
    if damage == "truncated":
        path.write_text(path.read_text()[:40])
    elif damage == "foreign":  # another torch's profile under this name
        path.write_text(json.dumps({**good, "key": {**good["key"], "torch": "0.0"}}))
    elif damage == "bad table":
        path.write_text(json.dumps({**good, "costs": {**good["costs"], "draft": [1.0]}}))
    else:  # a round of more drafts than the profile's widest
        rounds = [{str(good["costs"]["k_max"] + 1): 1e-3}] * len(good["costs"]["draft"])
        path.write_text(json.dumps({**good, "costs": {**good["costs"], "rounds": rounds}}))
    with pytest.warns(RuntimeWarning, match=f"cost profile {path}.*profiling anew"):
        llm = _speculating(gqa_dir)
    assert not llm.engine.decoder.cost_store.loaded
    rebuilt = json.loads(path.read_text())  # measured again and saved over the bad file
    assert rebuilt["key"] == good["key"] and len(rebuilt["costs"]["draft"]) == len(good["costs"]["draft"])
    assert all(o.token_ids for o in llm.generate(PROMPTS, GREEDY))


def test_concurrent_saves_never_leave_a_broken_file(gqa_dir, profile_dir):
    """Two processes saving at once while this one reads: every read finds a whole profile (temporary file, rename)."""
    _speculating(gqa_dir)
    path = _profile(profile_dir)
    good = json.loads(path.read_text())
    script = ("import json, sys; from infer.spec_decode.profile_store import ProfileStore, _from_json\n"
              "d = json.load(open(sys.argv[1])); s = ProfileStore(sys.argv[2]); c = _from_json(d['costs'])\n"
              "for _ in range(300): s.save(d['key'], c)\n")
    writers = [subprocess.Popen([sys.executable, "-c", script, str(path), str(profile_dir)]) for _ in range(2)]
    store, reads = ProfileStore(profile_dir), 0
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a partial file would warn
        while any(w.poll() is None for w in writers):
            assert store.load(good["key"]) is not None
            reads += 1
    assert [w.returncode for w in writers] == [0, 0] and reads > 0
    assert not list(profile_dir.glob("*.tmp"))  # no temporary file left behind
    assert store.load(good["key"]).verify == _profile_costs(good).verify


def _profile_costs(data):
    from infer.spec_decode.profile_store import _from_json

    return _from_json(data["costs"])


def test_an_unwritable_cache_dir_only_costs_a_profile_per_start(gqa_dir, tmp_path, monkeypatch):
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    monkeypatch.setattr("infer.spec_decode.profile_store.default_dir", lambda: blocker / "profiles")
    llm = _speculating(gqa_dir)
    assert llm.engine.decoder.spec_length.costs is not None
    assert all(o.token_ids for o in llm.generate(PROMPTS, GREEDY))


# --- the compiled steps built in the background --------------------------------------------------------------------

needs_kernels = pytest.mark.skipif(not kernels.available(), reason="eager = compiled bit for bit needs infer's kernels")


@pytest.fixture
def held_warmup(monkeypatch):
    """Each warm-up stage waits for ``release()`` before it runs: the test decides how far the compiling got."""
    gate, entered = threading.Semaphore(0), threading.Semaphore(0)

    def holding(real):
        def held(*args, **kw):
            entered.release()
            gate.acquire()
            return real(*args, **kw)
        return held

    monkeypatch.setattr(warmup, "run_steps", holding(warmup.run_steps))
    monkeypatch.setattr(warmup, "run_draft_steps", holding(warmup.run_draft_steps))  # a compiled drafter's stage

    class Control:
        def wait_entered(self):
            assert entered.acquire(timeout=60), "the warm-up thread did not start a stage"

        def release(self, n=1):
            for _ in range(n):
                gate.release()

    control = Control()
    yield control
    control.release(100)  # never leave the thread parked


@needs_kernels
def test_first_tokens_are_served_before_compiling_ends_and_match_at_every_stage(gqa_dir, held_warmup):
    """Greedy parity across the moments the graphs become ready: before any exists (every step eager), between
    stages (some steps take a graph, others run eagerly), and after, with the same tokens as a plain eager engine
    (one numerics: a speculating engine's compiled decode and verify with inductor's defaults, no emulated casts,
    give a plain engine's eager tokens in bfloat16 too). The decoder drafts only once the verify steps are built;
    once all are, no request stops to compile, whatever its length. bfloat16, the served dtype, where eager and
    compiled rounding could part; float32's compiled speculation against eager: test_compile.py (every graph of a
    batched engine, then a lone request)."""
    kw = dict(dtype="bfloat16", max_batch_size=1)
    expected = _ids(LLM(gqa_dir, compile=False, **kw).generate(PROMPTS, GREEDY))
    llm = LLM(gqa_dir, compile=True, draft_model=gqa_dir, spec_length=3, **kw)
    engine = llm.engine
    assert engine.warmup is not None and not engine.warmup.ready
    held_warmup.wait_entered()  # the thread runs and waits at its first stage: nothing compiled yet
    assert _ids(llm.generate(PROMPTS, GREEDY)) == expected
    assert not engine.warmup.ready and engine.stats.num_draft_tokens == 0  # served eagerly, without drafting
    for _ in engine.warmup.stages[:-1]:  # one stage more each time, generating between
        held_warmup.release()
        held_warmup.wait_entered()
        assert _ids(llm.generate(PROMPTS, GREEDY)) == expected
    held_warmup.release()
    assert engine.wait_until_ready(timeout=600) and engine.warmup.error is None
    assert sorted(engine.warmup.seconds) == sorted(what for what, _ in engine.warmup.stages)
    with torch._dynamo.config.patch(error_on_recompile=True):  # every graph a lone request needs was built
        assert _ids(llm.generate(PROMPTS, GREEDY)) == expected
        # other prompt and output lengths reuse them (the sizes that vary were made dynamic up front)
        out = llm.generate(["x" * 7, "a b c d e f g h i j"], SamplingParams(temperature=0, max_tokens=40))
    assert all(o.token_ids for o in out)
    assert engine.stats.num_draft_tokens > 0


@needs_kernels
def test_serving_while_the_thread_compiles_gives_the_eager_tokens(gqa_dir):
    """No hold this time: requests run while graphs appear under them, until the warm-up is done."""
    expected = _ids(LLM(gqa_dir, compile=False, max_batch_size=1).generate(PROMPTS, GREEDY))
    llm = LLM(gqa_dir, compile=True, max_batch_size=1)
    rounds, deadline = 0, time.monotonic() + 600
    while not llm.engine.warmup.ready or rounds == 0:
        assert _ids(llm.generate(PROMPTS, GREEDY)) == expected
        rounds += 1
        if time.monotonic() > deadline:  # a warm-up that never finishes under load: say where each thread is
            faulthandler.dump_traceback(all_threads=True)
            pytest.fail(f"the warm-up was not done after {rounds} rounds of requests (10 min)")
    assert llm.engine.warmup.error is None
    # the warm-up also moved the weights onto 2 MiB pages (Engine.__init__ leaves that to it), under the requests
    assert getattr(llm.model, "_on_hugepages", False) == hugepages_supported()
    assert _ids(llm.generate(PROMPTS, GREEDY)) == expected


def _native_pair(seed=0):
    """A bfloat16 target and an EAGLE-3 head, its projections in Q8_0 blocks: a lone row's steps one call of
    infer::llama_forward once the engine quantizes the target, the head's round one call of infer::eagle3_round."""
    from infer.model.quant import quantize_linears
    from infer.testing import random_heads, random_llama

    target = random_llama(64, seed=seed, hidden_size=64).to(torch.bfloat16)
    head = quantize_linears(random_heads(target, "eagle3", seed=3), "q8_0")
    head.quantized = "q8_0"
    return target, head


@needs_kernels
def test_a_lone_request_drafts_before_the_warmup_ends_where_its_round_needs_no_graph(held_warmup):
    """Where a lone request's round runs none of the graphs being built (the target's one-call steps, the head's
    one-call round) it drafts from the first request, the warm-up held at its first stage, with plain decoding's
    greedy tokens; a batch of two does not draft until the warm-up is done (its steps are graphs being built), nor
    does a lone request on an engine whose target runs through the module (unquantized)."""
    from infer.engine import Engine, EngineConfig
    from infer.generate import autoregressive_generate

    target, head = _native_pair()
    eng = Engine(EngineConfig(model="target", draft_model="drafter", spec_length=3, max_batch_size=2, compile=True,
                              quantization="q8_0", block_size=4), model=target, draft_model=head)
    assert eng.warmup is not None and eng.decoder.lone_ready and not eng.decoder.ready
    held_warmup.wait_entered()
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    prompts = [[1, 2, 3, 4, 5, 1, 2, 3], [7, 3, 9, 1, 4, 4, 2, 8, 5, 6, 1, 3, 2, 2, 9, 7, 0, 5, 3, 1, 8, 6, 4, 2]]
    frames = dict(torch._dynamo.utils.counters["frames"])
    for prompt in prompts:
        drafted = eng.stats.num_draft_tokens
        want = autoregressive_generate(eng.model, prompt, params, eos_token_ids=[]).output_ids
        assert eng.run([eng.add_request(prompt, params)])[0].output_ids == want
        assert eng.stats.num_draft_tokens > drafted and not eng.warmup.ready
    # the engine compiled nothing itself, the head's steps included: they are the warm-up's to build (beside it an
    # EAGLE head's step compiled in the request's own step, and SmolLM2's lone replies ran at 2-4 tok/s)
    assert dict(torch._dynamo.utils.counters["frames"]) == frames
    drafted = eng.stats.num_draft_tokens
    eng.run([eng.add_request(p, params) for p in prompts])  # side by side from the first step to the last
    assert eng.stats.num_draft_tokens == drafted and not eng.warmup.ready
    # a finished request's head catch-up (KVManager.free -> EagleProposer.release) feeds the entries no round fed, of
    # any width, once: eagerly, never compiling in the request's step, also once the warm-up is done and a miss may
    # compile (as here: the head's steps no longer the warm-up's, which stays held) -- the steps after its first round,
    # decoded plainly, give a width no graph was built for, which compiled there before
    head.compiled.compiling = None
    frames = dict(torch._dynamo.utils.counters["frames"])
    fresh = [4, 8, 1, 6, 2, 9, 3, 5, 0, 7, 2]  # no prefix-cache hit: its entries are fed where the engine feeds them
    req = eng.add_request(fresh, SamplingParams(temperature=0, max_tokens=16, ignore_eos=True))
    while eng.stats.num_draft_tokens == drafted:
        eng.step()
    req.speculate = False
    while not req.finished:
        eng.step()
    assert len(req.output_ids) == 16 and dict(torch._dynamo.utils.counters["frames"]) == frames

    target, head = _native_pair()
    eng = Engine(EngineConfig(model="target", draft_model="drafter", spec_length=3, max_batch_size=1, compile=True,
                              block_size=4), model=target, draft_model=head)
    assert eng.warmup is not None and not eng.decoder.lone_ready
    eng.run([eng.add_request(prompts[0], params)])
    assert eng.stats.num_draft_tokens == 0 and not eng.warmup.ready


@needs_kernels
def test_an_engine_whose_lone_steps_are_one_call_builds_no_graph_for_them(held_warmup):
    """A lone row whose steps are one C++ call each (the target's infer::llama_forward, the head's
    infer::eagle3_round) takes no graph: at max_batch_size 1 there is no warm-up at all and nothing is compiled (the
    compiler is never built, not even by the logits' step), the decoder drafts from the first request with plain
    decoding's greedy tokens; with batches, only the batched stages are built."""
    from infer.engine import Engine, EngineConfig
    from infer.generate import autoregressive_generate

    target, head = _native_pair()
    eng = Engine(EngineConfig(model="target", draft_model="drafter", spec_length=3, max_batch_size=1, compile=True,
                              quantization="q8_0", block_size=4), model=target, draft_model=head)
    assert eng.compiled and eng.warmup is None and eng.decoder.ready
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    prompt = [7, 3, 9, 1, 4, 4, 2, 8, 5, 6, 1, 3, 2, 2, 9, 7, 0, 5, 3, 1, 8, 6, 4, 2]
    got = eng.run([eng.add_request(prompt, params)])[0].output_ids
    assert eng.stats.num_draft_tokens > 0
    assert eng.model.compiled.run_forward is None  # never built: no Dynamo, no graph
    # rows whose rounds are not one call (penalties and a bias: the head's single steps and the pipeline) run
    # eagerly too, never compiling in their step (SmolLM2's penalised `infer chat` replies took seconds so)
    penalised = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, frequency_penalty=0.5,
                               repetition_penalty=1.2, logit_bias={3: 2.0})
    got_penalised = eng.run([eng.add_request(prompt, penalised)])[0].output_ids
    eng.run([eng.add_request(prompt, SamplingParams(temperature=0.7, max_tokens=24, presence_penalty=0.5, seed=1))])
    assert eng.stats.num_draft_tokens > 0
    for compiled in (eng.model.compiled, getattr(head, "compiled", None)):
        assert compiled is None or compiled.run_forward is None
    # (the references after: they run the module over a cache of its own, where the compiled steps do apply)
    assert got == autoregressive_generate(eng.model, prompt, params, eos_token_ids=[]).output_ids
    assert got_penalised == autoregressive_generate(eng.model, prompt, penalised, eos_token_ids=[]).output_ids

    target, head = _native_pair()
    eng = Engine(EngineConfig(model="target", draft_model="drafter", spec_length=3, max_batch_size=2, compile=True,
                              quantization="q8_0", block_size=4), model=target, draft_model=head)
    held_warmup.wait_entered()  # held at its first stage (nothing compiled): which stages it has is the point
    assert [w for w, _ in eng.warmup.stages] == ["batched steps (up to 2 rows)", "the drafter's batched steps"]


def test_the_compiler_is_imported_by_the_warmup_not_on_the_way_to_a_first_token(gqa_dir):
    """Importing Dynamo is ~1 s of Python (infer serve's first token: 4.9 -> 3.4 s once no module imported it at
    start): infer's modules and an engine serving without a graph never import it; the warm-up thread does."""
    code = (
        "import sys\n"
        "import infer, infer.cli, infer.server.__main__, infer.server.app, infer.engine.async_engine\n"
        "from infer import LLM, SamplingParams\n"
        "llm = LLM(sys.argv[1], draft_model=sys.argv[1], compile=False, spec_length=2)\n"
        "assert llm.generate(['def f(x):'], SamplingParams(temperature=0, max_tokens=8))[0].token_ids\n"
        "print(sorted(m for m in sys.modules if m.startswith(('torch._dynamo', 'torch._inductor'))))\n")
    out = subprocess.run([sys.executable, "-c", code, str(gqa_dir)], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip().splitlines()[-1] == "[]"


def test_compiling_in_the_foreground_is_still_there(gqa_dir):
    llm = LLM(gqa_dir, compile=True, compile_in_background=False, max_batch_size=1)
    assert llm.engine.warmup.ready and llm.engine.warmup._thread is None


def test_the_warmup_stages_follow_need():
    stages = [what for what, _ in warmup.warmup_stages(k_max=4, tree=False, max_batch=8)]
    assert stages[0] == "the decode step" and stages[1].startswith("verify") and stages[2].startswith("batched")
    stages = [what for what, _ in warmup.warmup_stages(k_max=4, tree=False, max_batch=8, draft=True)]
    assert stages[1].startswith("verify") and stages[2] == "the drafter's steps" and stages[3].startswith("batched")
    assert stages[4] == "the drafter's batched steps"
    # batched steps up to a compiled step's widest (short prefill chunks of several rows run compiled too)
    kw = dict(warmup.warmup_stages(k_max=4, tree=False, max_batch=8, chunk=16))["batched steps (up to 8 rows)"]
    assert kw["widths"][-1] == 16 and kw["batches"] == [2, 4, 8]
    assert [what for what, _ in warmup.warmup_stages(k_max=0, tree=False, max_batch=1)] == ["the decode step"]


@needs_kernels
def test_a_second_engine_over_the_same_compiled_model_still_gets_a_cost_model(gqa_dir):
    """The graphs of a model are built once (CompiledSteps.warmed): a second engine over it builds only its own
    drafter's (another object), and must still profile (a loaded model has no file to key a stored profile by)."""
    from infer.engine.config import EngineConfig
    from infer.engine.engine import Engine
    from infer.model.loader import load_model

    target = load_model(gqa_dir)
    engines = [Engine(EngineConfig(model="target", draft_model="drafter", compile=True, max_batch_size=1),
                      model=target, draft_model=load_model(gqa_dir)) for _ in range(2)]
    assert engines[0].warmup is not None and [w for w, _ in engines[1].warmup.stages] == ["the drafter's steps"]
    assert engines[1].wait_until_ready(timeout=600) and engines[1].decoder.spec_length.costs is not None
    assert engines[0].wait_until_ready(timeout=600) and engines[0].decoder.spec_length.costs is not None


@needs_kernels
def test_a_failed_warmup_leaves_the_engine_serving_eagerly_and_compiling_nothing(gqa_dir, monkeypatch):
    """A compiler failure in the warm-up (a broken toolchain, a cache it cannot use) is reported and the engine
    keeps serving eagerly, the same tokens; no later step tries the failing compiler inside a request."""
    def broken(*a, **k):
        raise RuntimeError("C++ compile error\nline two\n" + "compiler output\n" * 50)

    monkeypatch.setattr(warmup, "run_steps", broken)
    expected = _ids(LLM(gqa_dir, compile=False, max_batch_size=1).generate(PROMPTS, GREEDY))
    llm = LLM(gqa_dir, compile=True, max_batch_size=1)
    assert llm.engine.wait_until_ready(timeout=60)
    assert isinstance(llm.engine.warmup.error, RuntimeError) and llm.model.compiled.compiling == -1
    compiled = llm.model.compiled
    assert compiled.steps() == (compiled.run_forward, compiled.run_logits)  # graphs that exist, else eager

    def no_compiling(*a, **k):
        raise AssertionError("a step took the compiling entry point after the warm-up failed")

    compiled.forward = compiled.logits = no_compiling
    assert _ids(llm.generate(PROMPTS, GREEDY)) == expected


@needs_kernels
def test_the_warmup_thread_runs_one_openmp_thread_and_leaves_the_others_theirs(gqa_dir, monkeypatch):
    """The warm-up thread computes with one OpenMP thread, and only it: torch.set_num_threads(1) there also set
    torch's process default, which a thread copies on its first at::parallel_for in each library; the kernels'
    first call in the engine thread then cut SmolLM2 to one thread (~0.75x after start-up)."""
    counts, real = [], warmup.run_steps

    def counted(*args, **kw):
        counts.append(torch.get_num_threads())
        return real(*args, **kw)

    monkeypatch.setattr(warmup, "run_steps", counted)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        llm = LLM(gqa_dir, compile=True, max_batch_size=1)
        assert llm.engine.wait_until_ready(timeout=600) and llm.engine.warmup.error is None
        assert counts and set(counts) == {1}
        seen = []

        def fresh_thread():  # its first kernel call initialises its count from torch's default
            torch.ops.infer.linear(torch.ones(1, 4), torch.ones(3, 4))
            seen.append(torch.get_num_threads())

        thread = threading.Thread(target=fresh_thread)
        thread.start()
        thread.join()
        assert seen == [2] and torch.get_num_threads() == 2
        llm.generate(PROMPTS[:1], GREEDY)
        assert torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(before)


def test_a_step_waiting_on_a_lock_the_parked_warmup_holds_still_ends():
    """The warm-up thread parks at Python calls while the engine steps (Warmup.engine_turn); parked while holding a
    lock the step needs (an import's, logging's), it must not wait for the step forever: after MAX_PARK_S it runs
    beside the step, lets go of the lock, and the step ends."""
    w = object.__new__(warmup.Warmup)
    w._thread, w.done, w._open, w._lock = threading.current_thread(), threading.Event(), threading.Event(), \
        threading.Lock()
    w._open.set()
    w._stepping, w._steps, w._let_run, w._closed_at, w._stop = False, 0, -1, 0.0, False
    shared, holding, stepped = threading.Lock(), threading.Event(), threading.Event()

    def busy():
        return sum(range(10))

    def warm():  # the warm-up thread: takes the lock, then works through Python calls holding it
        sys.settrace(w._gate)
        try:
            with shared:
                holding.set()
                for _ in range(40):
                    busy()
                    time.sleep(0.005)
        finally:
            sys.settrace(None)

    def step():  # the engine: a step that needs the lock
        with w.engine_turn():
            with shared:
                pass
        stepped.set()

    t = threading.Thread(target=warm, daemon=True)
    t.start()
    assert holding.wait(10)
    e = threading.Thread(target=step, daemon=True)
    e.start()
    assert stepped.wait(20), "the engine's step waited forever on the parked warm-up"
    t.join(10)
    w.done.set()


def test_the_gate_never_stops_the_thread_inside_an_import(tmp_path, monkeypatch):
    """A warm-up stopped inside an import would leave a half-made module in sys.modules for the whole process (a
    later test's compile then failed importing networkx): the gate lets the import finish and stops at the next
    call after it."""
    (tmp_path / "infer_gate_probe.py").write_text("import sys\nFRAME = sys._getframe()\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    import infer_gate_probe

    gate = warmup.Warmup.__new__(warmup.Warmup)
    gate._stop = True
    assert warmup._importing(infer_gate_probe.FRAME) and not warmup._importing(sys._getframe())
    assert gate._gate(infer_gate_probe.FRAME, "call", None) is None  # inside the import: not stopped
    infer_frame = SimpleNamespace(f_code=SimpleNamespace(co_filename=warmup.__file__), f_back=None)
    with pytest.raises(warmup._Stopped):
        gate._gate(infer_frame, "call", None)  # at infer's next call after it: stopped


def test_a_stop_never_lands_in_another_librarys_cleanup():
    """A stop that arrives just before a library's cleanup call (logging's Handler.handle calls self.release() in
    its `finally`) must let that call run: stopped there, the thread died holding the handler's lock and the next
    logging call anywhere hung (a test session, in logging.shutdown). The thread stops at infer's next call."""
    gate = warmup.Warmup.__new__(warmup.Warmup)
    gate._stop, gate._open, gate._steps, gate._let_run = False, threading.Event(), 0, -1
    gate._open.set()
    lock, outcome = threading.Lock(), []

    def release():  # this file is not infer's code: a library's, as far as the gate can tell
        lock.release()

    def work():
        gate._stop = True  # Warmup.stop() comes now: the next call is the cleanup's

    def run():
        sys.settrace(gate._gate)
        try:
            lock.acquire()
            try:
                work()
            finally:
                release()
            warmup._importing(sys._getframe())  # infer's code: stopped here
            outcome.append("ran on")
        except warmup._Stopped:
            outcome.append("stopped")
        finally:
            sys.settrace(None)

    t = threading.Thread(target=run, daemon=True)
    t.start()
    t.join(10)
    assert outcome == ["stopped"]
    assert lock.acquire(timeout=1), "the stopped thread kept the lock"


def test_a_stop_right_after_the_engine_starts_ends_the_thread_quietly(gqa_dir, monkeypatch):
    """A script that builds an LLM and ends (no close(): the interpreter's exit stops the warm-up) while the thread
    has not begun its stages: the stop lands at its first traced call, which was outside the run's try, and the
    process printed the thread's _Stopped traceback at exit. Here the thread is held until the stop is asked for."""
    held = {}

    def hold_until_stopped():  # runs in the warm-up thread before its gate is set: where the stop used to land next
        deadline = time.time() + 10
        while not getattr(held.get("warmup"), "_stop", False) and time.time() < deadline:
            time.sleep(0.01)
        return True

    errors = []
    monkeypatch.setattr(warmup.kernels, "one_thread_here", hold_until_stopped)
    monkeypatch.setattr(threading, "excepthook", lambda args: errors.append(args.exc_type))
    llm = LLM(gqa_dir, compile=True, max_batch_size=1)
    held["warmup"] = llm.engine.warmup
    llm.engine.warmup.stop(timeout=30)
    assert llm.engine.warmup.done.is_set() and not llm.engine.warmup._thread.is_alive()
    assert errors == [] and llm.engine.warmup.error is None


def test_run_steps_covers_tree_verifies_ragged_batches_and_a_lone_row_after_them(gqa_dir):
    """What the warm-up runs decides which graphs exist before requests come: a lone row's tree verifies; a batch's
    rows at contexts of different lengths (masked steps, as served); then one of its rows alone on the blocks the
    batch interleaved."""
    eng = LLM(gqa_dir, max_batch_size=2, block_size=4, compile=False).engine
    calls, forward = [], eng.runner.forward

    def recorded(model, pool, slots, rows, tree=None):
        calls.append((len(slots), sorted({len(r) for r in rows}), tree is not None))
        return forward(model, pool, slots, rows, tree)

    eng.runner.forward = recorded
    with torch.inference_mode():
        warmup.run_steps(eng.runner, eng.kv.pool, eng.max_seq_len, [1, 4], rows=1, tree=True)
        assert (1, [4], True) in calls  # a star of 4 nodes
        calls.clear()
        warmup.run_steps(eng.runner, eng.kv.pool, eng.max_seq_len, [1, 4], rows=2)
    assert calls[0] == (2, [warmup.PROFILE_CONTEXT, warmup.PROFILE_CONTEXT + 1], False)  # two prompt lengths
    assert (2, [4], False) in calls and (1, [4], False) in calls and (1, [1], False) in calls
    assert eng.free_kv_tokens() == eng.initial_free_kv_tokens  # the scratch slots are freed


@needs_kernels
def test_an_idle_server_engine_finishes_the_warmup_before_its_next_request(gqa_dir, monkeypatch):
    """AsyncEngine (the server's loop) meets the warm-up's end while idle and finishes it there (Engine._finish_warmup:
    a missing cost profile measured, a stored one checked), so the next request does not (a first start's profile
    took 3.5 s of SmolLM2's first request). The stages are stubbed and so is the finish (with no graph built, its
    profile would compile them): what is tested is who finishes the warm-up, and when."""
    from infer.engine import Engine, EngineConfig
    from infer.engine.async_engine import AsyncEngine

    monkeypatch.setattr(warmup, "run_steps", lambda *a, **k: None)
    monkeypatch.setattr(warmup, "run_draft_steps", lambda *a, **k: None)
    finished = threading.Event()

    def finish(self, w):
        if w is not None and w.ready and threading.current_thread().name == "infer-engine":
            finished.set()

    monkeypatch.setattr(Engine, "_finish_warmup", finish)
    eng = AsyncEngine(EngineConfig(model=gqa_dir, draft_model=gqa_dir, compile=True, max_batch_size=2))
    try:
        assert eng.engine.warmup is not None and eng.engine.warmup.wait(300)
        assert finished.wait(30)  # within a poll of the warm-up's end, no request sent
    finally:
        eng.shutdown()


@needs_kernels
def test_the_switch_interval_is_short_while_a_warmup_thread_runs(gqa_dir, held_warmup):
    """The engine gets the GIL back from the warm-up within WARMUP_SWITCH_S, not the interpreter's 5 ms, while the
    thread runs; the interval before it is back once the thread has ended (here stopped)."""
    before = sys.getswitchinterval()
    llm = LLM(gqa_dir, compile=True, max_batch_size=2)
    held_warmup.wait_entered()
    assert sys.getswitchinterval() == min(before, warmup.WARMUP_SWITCH_S)
    stopper = threading.Thread(target=llm.engine.warmup.stop)
    stopper.start()
    while not llm.engine.warmup._stop:
        time.sleep(0.001)
    held_warmup.release()  # the thread goes on to its stage's first call into infer's code, and stops there
    stopper.join(60)
    assert llm.engine.warmup.done.is_set() and sys.getswitchinterval() == before


def test_two_warmup_threads_share_the_short_interval():
    """The interval is the interpreter's: the last of several warm-up threads to end restores it, not the first."""
    before = sys.getswitchinterval()
    warmup._fast_switch(True)
    warmup._fast_switch(True)
    warmup._fast_switch(False)
    assert sys.getswitchinterval() == min(before, warmup.WARMUP_SWITCH_S)
    warmup._fast_switch(False)
    assert sys.getswitchinterval() == before


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="niceness per thread is Linux's")
def test_the_warmup_thread_lowers_its_own_priority_only():
    """The warm-up thread runs at WARMUP_NICE (its C++ work would otherwise take the cores from the engine's steps);
    the thread that started it keeps its own."""
    import os

    seen = {}

    def run():
        warmup._lower_priority()
        seen["thread"] = os.getpriority(os.PRIO_PROCESS, threading.get_native_id())

    before = os.getpriority(os.PRIO_PROCESS, threading.get_native_id())
    t = threading.Thread(target=run)
    t.start()
    t.join()
    assert seen["thread"] == max(before, warmup.WARMUP_NICE)
    assert os.getpriority(os.PRIO_PROCESS, threading.get_native_id()) == before
