"""Assembling a SpeculativeDecoder from an EngineConfig: proposer, K policy (with its measured costs), acceptance.

The cost model of ``spec_length="auto"`` is profiled once per (target, drafter, pool backend, batch limit, K_max)
and kept on the target model, so a second engine over the same models (or the library's ``speculative_generate``,
which builds a batch-of-one engine per call) reuses it, and on disk (profile_store), so a later process on the same
machine and setting starts with it; every round then refreshes it with what it measured.
"""

from __future__ import annotations

import atexit
import os
import time
import weakref

import torch

from .. import progress
from ..model.draft_heads import Eagle3Head, EagleHead, MedusaHeads
from ..model.llama import LlamaForCausalLM
from ..proposers.base import Proposer
from ..proposers.cross_tokenizer import CrossTokenizerProposer
from ..proposers.draft_model import DraftModelProposer
from ..proposers.draft_vocab import DraftVocab, load_ranking, recommended_size
from ..proposers.eagle import EagleProposer
from ..proposers.medusa import MedusaProposer
from ..proposers.ngram import HybridProposer, NgramProposer
from .acceptance import make_policy
from .cost_model import CostModel, profile_costs, profile_widths, same_shape
from .profile_store import ProfileStore, file_identity, profile_key
from .round import SpeculativeDecoder
from .spec_length import EntropySpecLength, FixedSpecLength, GoodputSpecLength
from .tree import MAX_NODES, TreeShape

_COSTS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # target model -> {key: CostModel}
PROFILE_CONTEXT = 32  # tokens of context in the profiling slots (a short prompt: weights dominate a step)


def check_compatible(target: LlamaForCausalLM, drafter: LlamaForCausalLM, target_name="target",
                     drafter_name="drafter") -> None:
    tv, dv = target.config.vocab_size, drafter.config.vocab_size
    if tv != dv:
        raise ValueError(f"drafter {drafter_name} has vocab_size {dv} but target {target_name} has {tv}: "
                         "speculative decoding needs one shared vocabulary")


def draft_vocab_for(drafter: LlamaForCausalLM, drafter_path, size) -> DraftVocab | None:
    """``draft_vocab_size`` -> the DraftVocab: None: none; "auto": the ranking's recommended size if a ranking ships
    beside the drafter (else none); an integer: that many of the ranking's tokens (the ranking must exist)."""
    if size is None or drafter_path is None:
        return None
    from ..model.loader import resolve_model_path

    path = resolve_model_path(drafter_path)
    if size == "auto":
        size = recommended_size(path)
        if size is None:
            return None
        size = min(size, drafter.config.vocab_size)
    return DraftVocab.from_ranking(drafter, load_ranking(path), size)


def model_proposer(drafter, kv, runner, draft_vocab: DraftVocab | None, cross=None, method="string") -> Proposer:
    """The proposer for a drafter of each kind (model.draft_heads: heads that draft from the target's states;
    ``cross``: (VocabBridge, its own KV pool) for a drafter with a vocabulary of its own)."""
    if cross is not None:
        bridge, pool = cross
        return CrossTokenizerProposer(drafter, bridge, pool, runner.forward, runner.vocab_size, method)
    if isinstance(drafter, (EagleHead, Eagle3Head)):  # EAGLE-3 brings its own draft vocabulary
        proposer = EagleProposer(drafter, kv, draft_vocab)
        kv.draft_release = proposer.release  # before a slot's blocks are offered to the prefix cache
        return proposer
    if isinstance(drafter, MedusaHeads):
        return MedusaProposer(drafter, draft_vocab)
    return DraftModelProposer(drafter, kv, runner.forward, draft_vocab)


def build_decoder(cfg, runner, kv, drafter: LlamaForCausalLM | None, draft_vocab: DraftVocab | None,
                  costs: CostModel | None = None, defer_profile: bool = False, cross=None) -> SpeculativeDecoder:
    """The decoder for ``cfg``. Auto K's cost model comes from, in order: ``costs``; this process (another engine
    over the same models and settings); the profile store on disk (profile_store); a measurement now, unless
    ``defer_profile`` (the compiled steps are still being built: engine.warmup), in which case the decoder does not
    draft until ``decoder.profile_now()`` has run."""
    if cfg.proposer == "ngram":
        proposer = NgramProposer(cfg.prompt_lookup_min, cfg.prompt_lookup_max)
    elif cfg.proposer == "suffix":
        from ..proposers.suffix import SuffixProposer

        proposer = SuffixProposer(**cfg.suffix_options)
    else:
        proposer = model_proposer(drafter, kv, runner, draft_vocab, cross, cfg.cross_tokenizer)
        if cfg.proposer == "hybrid":
            proposer = HybridProposer(NgramProposer(cfg.prompt_lookup_min, cfg.prompt_lookup_max), proposer)
        elif cfg.proposer == "suffix-hybrid":
            from ..proposers.suffix import SuffixProposer

            proposer = HybridProposer(SuffixProposer(**cfg.suffix_options), proposer, "suffix-hybrid",
                                      cfg.suffix_min_score)
    if proposer.uses_features:
        runner.feature_sink = proposer.observe
    tree = None if cfg.spec_tree is None else "auto" if cfg.spec_tree == "auto" else cfg.tree_shape
    if isinstance(tree, TreeShape) and not proposer.supports_tree:
        raise ValueError(f"spec_tree={cfg.spec_tree!r}: the {proposer.name} proposer drafts chains only")
    decoder = SpeculativeDecoder(runner, kv, proposer, None,
                                 make_policy(cfg.acceptance, cfg.lenience, cfg.typical_epsilon, cfg.typical_delta),
                                 tree)
    if isinstance(cfg.spec_length, int):
        decoder.spec_length = FixedSpecLength(cfg.spec_length)
    elif cfg.spec_length == "egag":
        decoder.spec_length = EntropySpecLength(cfg.spec_length_min, cfg.spec_length_max, cfg.egag_ema_beta)
    else:
        max_batch = min(cfg.max_batch_size, cfg.spec_max_batch_size or cfg.max_batch_size)
        # with trees, verify widths up to a tree's nodes are priced too ("auto" compares a tree's verify with a chain's)
        widest = cfg.spec_length_max if tree is None else max(cfg.spec_length_max, MAX_NODES - 1)
        key = (id(drafter), cfg.proposer, type(kv.pool).__name__, max_batch, widest,
               cfg.cross_tokenizer if cross else None)
        cache = _COSTS.setdefault(runner.model, {})
        store = CostStore(cfg, runner.model, kv, max_batch, widest, cross is not None)
        costs = costs or cache.get(key) or store.load()
        decoder.spec_length = GoodputSpecLength(cfg.spec_length_max, costs)  # costs None: no drafts until profiled
        decoder.spec_length.pending, decoder.spec_length.offers = proposer.pending, proposer.offers
        if proposer.drafts_either_way:
            decoder.spec_length.decline = proposer.decline

        def profile_now(why: str = "first start with these settings") -> None:
            with progress.stage(f"profiling what a speculative round costs ({why})"):
                cache[key] = decoder.spec_length.costs = measure_costs(decoder, max_batch, widest)
            store.save(decoder.spec_length.costs)

        decoder.profile_now, decoder.cost_store = profile_now, store
        if costs is not None:
            cache[key] = costs
        elif not defer_profile:
            profile_now()
        if store.loaded:
            # a profile taken under other conditions (a busy machine, a profiler attached) keeps its shape across
            # restarts: rounds refit its level, never the widths it prices too dear, which auto K then never drafts
            def check_now() -> None:
                with progress.stage("checking the stored profile of a speculative round's costs"):
                    holds = stored_costs_hold(decoder, costs, widest)
                if not holds:
                    profile_now("the stored profile's widths disagree with this machine now")

            decoder.check_costs = check_now
        # at exit, the model as the rounds refreshed it (CostModel.refresh_*) replaces the file: the next start
        # begins from the levels measured in use, not from the start-up profile
        ref = weakref.ref(decoder)
        atexit.register(lambda: (d := ref()) is not None and d.ready and d.spec_length.costs is not None
                        and d.cost_store.save(d.spec_length.costs))
    return decoder


class CostStore:
    """The profile store (profile_store) bound to one engine's setting: ``load()``, ``save(costs)``."""

    def __init__(self, cfg, model: LlamaForCausalLM, kv, max_batch: int, widest: int, cross: bool = False):
        from ..model.loader import resolve_model_path

        def identity(path):  # a checkpoint given by path; a model passed in loaded (tests: a label) has none
            try:
                return file_identity(resolve_model_path(path)) if isinstance(path, (str, os.PathLike)) else None
            except (FileNotFoundError, ValueError):
                return None

        self.store = ProfileStore()
        self.key = profile_key(model=identity(cfg.model), dtype=str(model.dtype), quantization=model.quantization,
                               compiled=model.compiled is not None, device=str(model.device),
                               drafter=identity(cfg.draft_model), draft_quantization=cfg.draft_quantization,
                               proposer=cfg.proposer, spec_tree=cfg.spec_tree,
                               draft_vocab_size=cfg.draft_vocab_size, pool=type(kv.pool).__name__,
                               block_size=cfg.block_size, max_batch=max_batch, widest=widest,
                               **({"cross_tokenizer": cfg.cross_tokenizer} if cross else {}),
                               **({"lora": file_identity(cfg.lora), "lora_scale": cfg.lora_scale} if cfg.lora else {}))
        # a target passed in loaded (no checkpoint path) has no identity to key a file by: kept in memory only
        self.enabled = self.key["model"] is not None
        self.loaded = False  # whether the cost model in use came from the file

    def load(self) -> CostModel | None:
        costs = self.store.load(self.key) if self.enabled else None
        self.loaded = costs is not None
        return costs

    def save(self, costs: CostModel) -> None:
        if self.enabled:
            self.store.save(self.key, costs)


CATCH_UP_PROFILE = 256  # tokens of the lone drafter prefill that prices a lazy catch-up (a typical prompt)


def time_catch_up(runner, drafter, dpool, max_seq_len: int) -> float:
    """Seconds per token of a lone drafter prefill of a prompt-sized row (what a lazy catch-up costs; rounds refresh
    it). 0.0 when the pool cannot hold one such row."""
    n = min(CATCH_UP_PROFILE, max_seq_len - 1)
    if n < 1 or not dpool.can_fit([(None, n)]):
        return 0.0
    slot = dpool.allocate(n)
    try:
        best = float("inf")
        for _ in range(2):  # the best of two (a shared machine only ever slows a run down)
            dpool.truncate_to(slot, 0)
            t0 = time.perf_counter()
            runner.forward(drafter, dpool, [slot], [[1] * n])
            best = min(best, time.perf_counter() - t0)
        return best / n
    finally:
        dpool.free(slot)


def _verify_seconds(runner, kv, slots: list[int], t: int, n_ctx: int) -> float:
    """Seconds of one target forward of t tokens on each of ``slots`` (holding n_ctx tokens, and again after) and its
    logits, as a round's verify."""
    t0 = time.perf_counter()
    hidden = runner.forward(runner.model, kv.pool, slots, [[1] * t] * len(slots))
    lens = torch.tensor([t] * len(slots)) if t > 1 else None  # as a round's verify (a plain step's: none)
    runner.model.compute_logits(hidden, lens).max(-1).indices.tolist()  # the host sync a round ends with
    seconds = time.perf_counter() - t0
    for s in slots:
        kv.pool.truncate_to(s, n_ctx)
    return seconds


@torch.inference_mode()
def stored_costs_hold(decoder: SpeculativeDecoder, costs: CostModel, k_max: int, repeats: int = 3) -> bool:
    """Whether a cost model read from the store still prices this machine's verify widths in proportion: one row's
    forward at each profiled width (the best of ``repeats``) against its price (cost_model.same_shape). True where
    the pool has no room for a scratch row (nothing to compare)."""
    runner, kv = decoder.runner, decoder.kv
    n_ctx = max(1, min(PROFILE_CONTEXT, kv.max_seq_len - k_max - 1))
    if not kv.pool.can_fit([(None, n_ctx + k_max + 1)]):
        return True
    slot = kv.pool.allocate(n_ctx + k_max + 1)
    try:
        runner.forward(runner.model, kv.pool, [slot], [[1] * n_ctx])
        _verify_seconds(runner, kv, [slot], 1, n_ctx)  # a first call's one-time costs
        def best(t: int) -> float:
            return min(_verify_seconds(runner, kv, [slot], t, n_ctx) for _ in range(repeats))

        measured = {t: best(t) for t in profile_widths(k_max)}
        if not same_shape(costs, measured):
            # once more, each width's best of both: a burst of another tenant's work can slow all of one width's
            # repeats, and a profile taken again in that burst would be stored with its shape (a CI run's third
            # start re-profiled a profile saved seconds before; docs/benchmarks.md, "a chat engine builds no graph")
            measured = {t: min(s, best(t)) for t, s in measured.items()}
    finally:
        kv.pool.free(slot)
    return same_shape(costs, measured)


@torch.inference_mode()
def measure_costs(decoder: SpeculativeDecoder, max_batch: int, k_max: int) -> CostModel:
    """Time target forwards of B rows x T tokens and draft steps of B rows on scratch slots of the real pools."""
    runner, kv = decoder.runner, decoder.kv
    drafter = getattr(decoder.proposer, "model", decoder.proposer)  # a hybrid's drafter is its model proposer
    # a drafter's pool: the KV manager's lockstep one, or one of its own (a drafter with another vocabulary)
    dpool = kv.draft_pool if drafter.uses_draft_model else getattr(drafter, "own_pool", None)
    # as many rows and as much context as the pools hold now (a small pool profiles small batches; the cost model
    # extrapolates beyond them, and rounds at those sizes refresh it)
    n_ctx = max(1, min(PROFILE_CONTEXT, kv.max_seq_len - k_max - 1))
    B = max_batch

    def fits(b: int) -> bool:
        return kv.pool.can_fit([(None, n_ctx + k_max + 1)] * b) and (
            dpool is None or dpool.can_fit([(None, n_ctx + 1)] * b))

    while B > 1 and not fits(B):
        B //= 2
    if not fits(B):  # not even one profiling slot: the paper's flat model (a verify costs one decode step)
        return CostModel.from_points(max_batch, k_max, {(1, 1): 1.0, (1, 2): 1.0}, {1: 0.05} if dpool else {})
    ctx = [1] * n_ctx
    held: list[tuple] = []  # (pool, slot): freed whatever happens

    def prefill(model, pool, size: int, n: int) -> list[int]:
        new = [pool.allocate(size) for _ in range(n)]
        held.extend((pool, s) for s in new)
        if new:
            runner.forward(model, pool, new, [ctx] * n)
        return new

    try:
        # the rows of B > 1 first, then row 0 alone: it gets consecutive blocks, as a request alone in the pool
        # does, so the one-row steps run (and compile) the same paths as a lone request's rounds will
        others = prefill(runner.model, kv.pool, n_ctx + k_max + 1, B - 1)
        slots = prefill(runner.model, kv.pool, n_ctx + k_max + 1, 1) + others
        catch_up, dslots = 0.0, None
        if dpool is not None:
            for n in (B - 1, 1):  # row 0 alone last, as for the target
                new = [dpool.allocate(n_ctx + 1) for _ in range(n)]
                held.extend((dpool, s) for s in new)
                if new:
                    drafter.scratch_fill(new, n_ctx)
                dslots = new + (dslots or [])
            if isinstance(drafter, (DraftModelProposer, CrossTokenizerProposer)):
                catch_up = time_catch_up(runner, drafter.drafter, dpool, kv.max_seq_len)

        def run_verify(b: int, t: int) -> float:
            return _verify_seconds(runner, kv, slots[:b], t, n_ctx)

        def run_draft(b: int) -> float:
            t0 = time.perf_counter()
            drafter.scratch_step(dslots, b)
            seconds = time.perf_counter() - t0
            for s in dslots or []:
                dpool.truncate_to(s, n_ctx)
            return seconds

        run_verify(1, 1)  # first calls pay one-time costs (allocations, a compiled graph)
        priced = drafter.scratch_step(dslots, 1)  # False: drafting costs nothing worth timing (n-gram lookup)
        for s in dslots or []:
            dpool.truncate_to(s, n_ctx)
        costs = profile_costs(run_verify, run_draft if priced else None, B, k_max, max_batch)
        costs.catch_up = catch_up
        return costs
    finally:
        for pool, s in held:
            pool.free(s)
