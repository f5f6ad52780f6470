"""Engine: models, tokenizer, scheduler and runner behind ``add_request`` / ``step`` / ``abort``.

    engine = Engine(EngineConfig(model=..., draft_model=...))
    engine.add_request(prompt_ids, params)          # validated now: a bad request never enters the queue
    while engine.has_unfinished: outputs = engine.step()

Not thread-safe: one thread drives it (AsyncEngine runs it in a background thread and feeds it through a queue).
"""

from __future__ import annotations

import os
from contextlib import nullcontext

import torch

from .. import kernels, progress
from ..config import parse_dtype
from ..model.compile import compile_model
from ..model.draft_heads import DraftHead, load_heads
from ..model.hugepages import place_on_hugepages
from ..model.llama import LlamaForCausalLM
from ..model.loader import checkpoint_dtype, load_model, resolve_model_path
from ..model.lora import apply_lora, load_lora
from ..model.quant import quantize_linears, quantize_model
from ..pooling import PoolingParams, embed_prompt
from ..request import Request, RequestStatus, StepOutput
from ..sampling import SamplingParams, make_generator
from ..token_bans import bad_words_ids
from ..drafters import drafter_kind
from ..proposers.draft_vocab import DraftVocab
from ..structured import GrammarCompiler
from ..spec_decode.setup import build_decoder, check_compatible, draft_vocab_for
from ..tokenizer import Tokenizer
from .adapters import LoRASlots
from .config import COMPILE_AUTO_MIN_PARAMS, MODEL_PROPOSERS, EngineConfig
from .kv_manager import KVManager, make_pool
from .runner import ModelRunner
from .scheduler import Scheduler
from .stats import EngineStats
from .warmup import Warmup


class QueueFullError(RuntimeError):
    """The waiting queue is at ``max_waiting_requests``; try again later."""


class Engine:
    def __init__(self, config: EngineConfig, model: LlamaForCausalLM | None = None,
                 draft_model: LlamaForCausalLM | None = None, tokenizer: Tokenizer | None = None,
                 draft_vocab: DraftVocab | None = None, draft_tokenizer: Tokenizer | None = None):
        """Models load from ``config.model`` / ``config.draft_model``; tests may pass loaded ones instead (then
        ``tokenizer`` may be None: no stop strings or text, EOS from the model's config), and a ready
        ``draft_vocab`` instead of ``config.draft_vocab_size`` (whose ranking is read beside the drafter).
        ``draft_tokenizer``: a passed-in drafter's tokenizer, when it is not the target's (drafting across
        vocabularies, proposers.cross_tokenizer)."""
        self.config = cfg = config
        self.device = torch.device(cfg.device)
        self.tp = None  # the tensor-parallel executor when tensor_parallel_size > 1
        if model is None:
            self.model_path = resolve_model_path(cfg.model)
            self.dtype = checkpoint_dtype(self.model_path) if cfg.dtype == "auto" else parse_dtype(cfg.dtype)
            if cfg.tensor_parallel_size > 1:
                self._start_tensor_parallel()
            else:
                self.model = load_model(self.model_path, self.dtype, self.device)
            tokenizer = Tokenizer(cfg.tokenizer or self.model_path, extra_eos_token_ids=self.model.config.eos_token_ids)
        elif cfg.tensor_parallel_size > 1:
            raise ValueError("tensor_parallel_size > 1 loads the checkpoint in every rank's process: give its path "
                             "(EngineConfig.model), not a loaded model")
        else:
            self.model_path, self.model, self.dtype = str(cfg.model), model, model.dtype
        if cfg.quantization and self.model.quantization != cfg.quantization:
            quantize_model(self.model, cfg.quantization)  # the target only: a drafter is small already
        if cfg.lora is not None:  # over the weights as loaded (quantized or not): model.lora
            apply_lora(self.model, load_lora(cfg.lora), cfg.lora_scale)
        # per-request adapters, each in a slot (Request.lora, given at admission), and slots for more (enable_lora)
        self.loras = LoRASlots(self.model, cfg.lora_modules, cfg.lora_scale, cfg.enable_lora, cfg.max_loras,
                               cfg.max_lora_rank, cfg.max_cpu_loras)
        if self.device.type == "cpu":
            kernels.available()  # build or load infer's CPU kernels now, not inside the first (compiled) step
        self.compiled = self._maybe_compile(self.model)
        if self.device.type == "cpu" and not (self.compiled and self._compiles_in_background()):
            # decode streams the weights: 2 MiB pages read them up to ~7% faster. A background warm-up moves them
            # itself, off the critical path (~1 s for SmolLM2 in float32; engine.warmup)
            place_on_hugepages(self.model)
        self.tokenizer = tokenizer
        self.eos_token_ids = tokenizer.eos_token_ids if tokenizer else list(self.model.config.eos_token_ids)
        self.max_seq_len = min(cfg.max_seq_len or 10**9, self.model.config.max_position_embeddings)
        self.stats = EngineStats()
        self.draft_model = draft_model
        self.bridge = None  # a drafter with a vocabulary of its own: the text between the tokenizers
        if cfg.proposer in MODEL_PROPOSERS:
            if draft_model is None:
                self.draft_path = resolve_model_path(cfg.draft_model)
                # a kind this version cannot run is named before anything loads
                if drafter_kind(self.draft_path) == "draft_model":
                    self.draft_model = load_model(self.draft_path, self.dtype, self.device)  # the target's dtype
                    draft_tokenizer = self._check_draft_tokenizer()
                else:  # heads that draft from the target's hidden states, borrowing its embedding and LM head
                    self.draft_model = load_heads(self.draft_path, self.model)
            elif isinstance(draft_model, DraftHead):
                draft_model.attach(self.model)
            elif draft_tokenizer is not None and (tokenizer is None or
                                                  draft_tokenizer.hf.get_vocab() == tokenizer.hf.get_vocab()):
                draft_tokenizer = None  # the same vocabulary (or no target tokenizer: then the error below)
            if draft_tokenizer is not None:  # its own KV pool and positions: the target's length is not bound
                self._bridge_vocabularies(draft_tokenizer, draft_vocab)
            else:
                check_compatible(self.model, self.draft_model, str(self.model_path), str(cfg.draft_model))
                self.max_seq_len = min(self.max_seq_len, self.draft_model.config.max_position_embeddings)
            if self.bridge is not None:
                draft_vocab = None
            elif draft_vocab is None:  # "auto" looks beside a drafter loaded here; a passed-in one brings its own
                size = None if draft_model is not None and cfg.draft_vocab_size == "auto" else cfg.draft_vocab_size
                draft_vocab = draft_vocab_for(self.draft_model, cfg.draft_model, size)
            elif draft_vocab.vocab_size != self.draft_model.config.vocab_size:
                raise ValueError(f"draft_vocab was built for a vocabulary of {draft_vocab.vocab_size} tokens, the "
                                 f"drafter has {self.draft_model.config.vocab_size}")
            if cfg.draft_quantization is not None:  # draft steps on infer's integer kernels (EngineConfig says when)
                self._quantize_drafter(cfg.draft_quantization)
                draft_vocab = draft_vocab.quantized(cfg.draft_quantization) if draft_vocab is not None else None
            if self.compiled and hasattr(self.draft_model, "_forward") and self.bridge is None:  # not Medusa
                compile_model(self.draft_model)  # its graphs are built by the warm-up, before rounds draft
        self.draft_vocab = draft_vocab
        if self.compiled:  # whole rotary tables now: a table that grows mid-request would recompile the step
            self.model.rotary.reserve(self.max_seq_len, self.device, self.model.dtype)
            if getattr(self.draft_model, "compiled", None) is not None:  # a drafter's positions are the target's
                # in the dtype its steps ask for: an LM's own, a head's activations' (the target's states)
                dtype = self.draft_model.dtype if isinstance(self.draft_model, LlamaForCausalLM) else self.model.dtype
                self.draft_model.rotary.reserve(self.max_seq_len, self.device, dtype)
        # the story of a step: the scheduler asks the KV manager what fits, the runner executes the models, and the
        # speculative decoder (when on) replaces the runner's decode step with a propose/verify round
        # Medusa keeps no cache; a drafter of another vocabulary keeps its own (positions of its own tokens)
        pooled = self.draft_model if getattr(self.draft_model, "has_kv", True) and self.bridge is None else None
        self.kv = KVManager(self.model, cfg, self.max_seq_len, self.stats, pooled, cfg.max_spec_length)
        self.runner = ModelRunner(self.model, self.kv, self.stats)
        cross = None if self.bridge is None else (self.bridge, self._own_draft_pool())
        self.decoder = build_decoder(cfg, self.runner, self.kv, self.draft_model, draft_vocab, cross=cross,
                                     defer_profile=self.compiled) if cfg.use_speculative_decoding else None
        self.warmup = self._start_warmup() if self.compiled else None
        self.scheduler = Scheduler(cfg, self.kv, self.loras)
        self.requests: dict[str, Request] = {}
        self._seed_rng = make_generator(cfg.seed, "cpu")
        self._initial_free_kv = self.kv.free_kv_tokens()
        self._num_threads = torch.get_num_threads()  # the engine thread's: see step()
        self._grammars: GrammarCompiler | None = None  # built at the first constrained request (~1 s: llguidance)

    def _start_warmup(self) -> Warmup | None:
        """Build the compiled steps (engine.warmup): in a background thread where a step run eagerly meanwhile gives
        the same bits (infer's CPU kernels), else now. None if this model's (and drafter's) graphs for these pool
        layouts and widths were built already (another engine over the same models)."""
        decoder = self.decoder
        warmup = Warmup(self, self.config.max_spec_length if decoder else 0, tree=bool(decoder and decoder.tree))
        if warmup.lone_native and self.config.max_batch_size == 1 and not (decoder and decoder.tree):
            # one KV slot whose chain steps are one C++ call each: the warm-up builds nothing, and what would need a
            # graph (a penalised, biased or constrained row's single draft steps) runs eagerly (the same bits) rather
            # than compiling in the request's step: SmolLM2's penalised replies in `infer chat` took 6-13 s for
            # 19-40 tokens while each shape compiled, against ~0.2 s eagerly
            for compiled in (self.model.compiled, getattr(self.draft_model, "compiled", None)):
                if compiled is not None:
                    compiled.compiling = -1
        if not warmup.stages:
            place_on_hugepages(self.model)  # a no-op where the first engine's warm-up did it
            self._finish_warmup(None)  # the graphs exist (or are being built): profile now if no profile is stored
            return None
        warmup.claim()
        background = self._compiles_in_background()
        if decoder is not None:
            decoder.ready = False  # drafts wait for compiled verify steps and a cost model (_finish_warmup)
            decoder.lone_ready = background and self._lone_rounds_native(warmup)  # a lone request's need not
        warmup.start(background)
        if not background:
            self._finish_warmup(warmup)
        return warmup

    def _lone_rounds_native(self, warmup: Warmup) -> bool:
        """Whether a lone request's speculative rounds run none of the graphs the warm-up builds, so they may draft
        from the first request (SpeculativeDecoder.lone_ready): every verify width through the target's one-call
        forward (LlamaForCausalLM.runs_natively), the drafter's round one C++ call (Proposer.lone_round_native) or
        no compiled drafter, and a cost model at hand for auto K (a first start profiles after the warm-up)."""
        return getattr(self.decoder.spec_length, "costs", True) is not None and warmup.lone_native

    def _compiles_in_background(self) -> bool:
        """Whether a compiled target's steps are built in a background thread: where a step run eagerly meanwhile
        gives the same bits (infer's CPU kernels: model.compile says why)."""
        return self.config.compile_in_background and self.device.type == "cpu" and kernels.available()

    def _finish_warmup(self, warmup: Warmup | None) -> None:
        """Once the compiled steps exist: check a stored cost model, or profile a missing one (now fast: no graph left
        to build), save it, and let the decoder draft."""
        decoder = self.decoder
        if decoder is None or (warmup is not None and not warmup.ready):
            return
        if decoder.check_costs is not None:  # a stored profile: checked once, against this process's forwards
            check, decoder.check_costs = decoder.check_costs, None
            check()
        if decoder.profile_now is not None and decoder.spec_length.costs is None:
            decoder.profile_now()
        decoder.ready = True

    def wait_until_ready(self, timeout: float | None = None) -> bool:
        """Block until the compiled steps are built and the decoder drafts (True), or ``timeout`` seconds pass
        (False). Only timings need it: the engine serves the same tokens before."""
        if self.warmup is not None and not self.warmup.wait(timeout):
            return False
        self._finish_warmup(self.warmup)
        return True

    def _start_tensor_parallel(self) -> None:
        """Load rank 0's copy, check that it shards, start the workers, keep rank 0's shard (engine.tp_executor)."""
        from ..model.tp import check_shardable
        from .tp_executor import TensorParallelExecutor

        cfg, world = self.config, self.config.tensor_parallel_size
        kind = drafter_kind(resolve_model_path(cfg.draft_model)) if cfg.proposer in MODEL_PROPOSERS else None
        if kind not in (None, "draft_model"):
            raise ValueError(f"drafter {cfg.draft_model} is {kind} heads, which borrow the target's embedding and LM "
                             "head; under tensor parallelism those are sharded: use a draft model or proposer='ngram'")
        model = load_model(self.model_path, self.dtype, "cpu")  # moved after sharding: 1/N of it on the device
        check_shardable(model.config, world)  # both named before any worker starts
        self.tp = TensorParallelExecutor(world, self.model_path, self.dtype, cfg.device)
        self.device = self.tp.device
        self.model = self.tp.wrap(model).to(self.device)

    def close(self) -> None:
        """Stop the background warm-up and the tensor-parallel workers, if any (idempotent). A closed engine still
        serves, eagerly where a graph was not built."""
        if self.warmup is not None:
            self.warmup.stop()
        if self.tp is not None:
            self.tp.close()

    def _maybe_compile(self, model: LlamaForCausalLM) -> bool:
        """Compile the target's decode/verify steps if ``config.compile`` says so (None: by model size)."""
        want = self.config.compile
        if want is None:
            want = sum(p.numel() for p in model.parameters()) + sum(b.numel() for b in model.buffers()) \
                >= COMPILE_AUTO_MIN_PARAMS
        if want:  # one numerics for decode and verify, plain and speculating (model.compile)
            compile_model(model)
        return bool(want)

    def _quantize_drafter(self, quantization: str) -> None:
        """Quantize the drafter's own weights in place (a head's borrowed embedding and LM head stay the target's);
        a drafter passed in already quantized, or already compiled by another engine, is left as it is."""
        drafter = self.draft_model
        if getattr(drafter, "compiled", None) is not None or getattr(drafter, "quantized", None):
            return
        if isinstance(drafter, DraftHead):
            quantize_linears(drafter, quantization)
            drafter.quantized = quantization
        elif drafter.quantization is None:
            quantize_model(drafter, quantization)

    def _check_draft_tokenizer(self) -> Tokenizer | None:
        """The drafter's tokenizer when its vocabulary is not the target's (then drafts cross between them), else
        None; a shared vocabulary with other EOS ids is an error."""
        draft_tok = Tokenizer(self.draft_path)
        if self.tokenizer is not None and draft_tok.hf.get_vocab() != self.tokenizer.hf.get_vocab():
            return draft_tok
        if self.tokenizer is not None and set(draft_tok.eos_token_ids) - set(self.eos_token_ids):
            raise ValueError(f"drafter {self.draft_path} has EOS ids {draft_tok.eos_token_ids} but target "
                             f"{self.model_path} has {self.eos_token_ids}")
        return None

    def _bridge_vocabularies(self, draft_tok: Tokenizer, draft_vocab) -> None:
        """Draft across vocabularies (proposers.cross_tokenizer): text between the tokenizers, said in one line."""
        from ..proposers.vocab_bridge import VocabBridge

        cfg, name = self.config, getattr(self, "draft_path", None) or self.config.draft_model
        if self.tokenizer is None:
            raise ValueError("a drafter with a vocabulary of its own needs the target's tokenizer too")
        if draft_vocab is not None or isinstance(cfg.draft_vocab_size, int):
            raise ValueError(f"draft_vocab_size restricts a drafter of the target's vocabulary; drafter {name} has "
                             "its own (drop draft_vocab_size)")
        self.bridge = VocabBridge(self.tokenizer, draft_tok, self.model.config.vocab_size,
                                  self.draft_model.config.vocab_size, self.eos_token_ids, draft_tok.eos_token_ids)
        progress.note(f"drafter {name} has its own vocabulary ({draft_tok.vocab_size} tokens, the target "
                      f"{self.tokenizer.vocab_size}, {self.bridge.num_shared} shared): drafts are re-tokenised "
                      f"({cfg.cross_tokenizer}-level)")

    def _own_draft_pool(self):
        """The KV pool of a drafter with its own vocabulary: room for twice the target's tokens (a smaller
        vocabulary spells a text in more tokens), within the drafter's positions."""
        cfg, c = self.config, self.draft_model.config
        length = min(c.max_position_embeddings, 2 * self.max_seq_len + 2 * cfg.max_spec_length + 2)
        blocks = getattr(self.kv.pool, "num_blocks", None)
        return make_pool(self.draft_model, cfg, length, prefix_caching=False,
                         num_blocks=None if blocks is None else 2 * blocks)

    # -- requests ----------------------------------------------------------------------------------------------
    def check_request(self, prompt_ids: list[int], params: SamplingParams, prediction: list[int] | None = None) -> None:
        """Raise ValueError naming the problem if this request can never run (or its prediction is no token ids)."""
        prompt_ids = params.truncated(prompt_ids, self.max_seq_len)
        n = len(prompt_ids)
        if n == 0:
            raise ValueError("prompt is empty: at least one token is needed")
        V = self.model.config.vocab_size
        for what, ids in (("prompt", prompt_ids), ("prediction", prediction or ())):
            _check_token_ids(what, ids, V)
        if n + params.max_tokens > self.max_seq_len:
            raise ValueError(f"prompt ({n} tokens) + max_tokens ({params.max_tokens}) = {n + params.max_tokens} "
                             f"exceeds the maximum sequence length {self.max_seq_len} (max_seq_len, capped by the model's "
                             f"max_position_embeddings {self.model.config.max_position_embeddings})")
        lookahead = self.config.max_spec_length
        if self._initial_free_kv < min(n + params.max_tokens + lookahead, self.max_seq_len):
            raise ValueError(f"prompt ({n} tokens) + max_tokens ({params.max_tokens}) needs more KV cache than the "
                             f"whole pool holds ({self._initial_free_kv} tokens): raise num_kv_blocks")
        if params.n != 1:
            raise ValueError(f"SamplingParams.n must be 1 for an engine request, got {params.n}: one request is one "
                             "sequence (LLM.generate and the server make n requests of n)")
        params.check_vocab(V)
        if params.bad_words:  # text needs the tokenizer; a ban of every allowed token would leave no law at all
            words = bad_words_ids(params.bad_words, self.tokenizer)
            if (top := max(max(w) for w in words)) >= V:  # ids as given, or a tokenizer larger than the logits
                raise ValueError(f"SamplingParams.bad_words names token {top}, outside the vocabulary [0, {V})")
            if params.allowed_token_ids is not None and \
                    set(params.allowed_token_ids) <= {w[0] for w in words if len(w) == 1}:
                raise ValueError("SamplingParams.bad_words ban every one of allowed_token_ids: no token is left to "
                                 "generate")
        if params.min_tokens and params.allowed_token_ids is not None and set(params.allowed_token_ids) <= \
                set(params.stop_token_ids) | (set() if params.ignore_eos else set(self.eos_token_ids)):
            raise ValueError("SamplingParams.min_tokens holds back every one of allowed_token_ids (each a stop "
                             "token): no token is left to generate")
        if params.structured is not None:
            self.grammars().compile(params.structured)  # a bad schema, regex or grammar is named here

    def check_priority(self, priority) -> None:
        """ValueError unless ``priority`` is an integer this engine's scheduling policy takes (any, under
        "priority"; 0 under "fcfs", which would otherwise ignore it)."""
        if isinstance(priority, bool) or not isinstance(priority, int):
            raise ValueError(f"priority must be an integer, got {priority!r}")
        if priority != 0 and self.config.scheduling_policy != "priority":
            raise ValueError(f"priority {priority} needs scheduling_policy='priority' (this engine serves requests "
                             "first come, first served)")

    def check_embedding(self, prompt_ids: list[int], params: PoolingParams) -> list[int]:
        """The prompt's tokens as its embedding reads them (``truncate_prompt_tokens``); ValueError naming the
        problem where it cannot be embedded."""
        if self.tp is not None:
            raise ValueError("embeddings run in one process: this engine shards its model over "
                             f"{self.config.tensor_parallel_size} (tensor_parallel_size)")
        ids = params.read_prompt(list(prompt_ids), self.max_seq_len)
        if not ids:
            raise ValueError("prompt is empty: at least one token is needed")
        _check_token_ids("prompt", ids, self.model.config.vocab_size)
        if len(ids) > self.max_seq_len:
            raise ValueError(f"prompt ({len(ids)} tokens) exceeds the maximum sequence length {self.max_seq_len} "
                             "(truncate_prompt_tokens keeps its last tokens)")
        return ids

    def embed(self, prompt_ids: list[int], params: PoolingParams | None = None) -> torch.Tensor:
        """One prompt's embedding [hidden_size], float32 on the CPU (infer.pooling): a forward of its own, no KV
        block taken, every request's state left as it was; call it between steps (AsyncEngine.embed does)."""
        params = params or PoolingParams()
        return embed_prompt(self.model, self.check_embedding(prompt_ids, params), params).cpu()

    def grammars(self) -> GrammarCompiler:
        """The structured-output compiler for this engine's tokenizer and logits width (infer.structured)."""
        if self._grammars is None:
            self._grammars = GrammarCompiler(self.tokenizer, self.model.config.vocab_size, self.eos_token_ids)
        return self._grammars

    def add_request(self, prompt_ids: list[int], params: SamplingParams | None = None,
                    request_id: str | None = None, prompt: str | None = None,
                    generator: torch.Generator | None = None, eos_token_ids: list[int] | None = None,
                    speculate: bool = True, prediction: list[int] | None = None, priority: int = 0,
                    lora: str | None = None) -> Request:
        """Queue one request. ``generator`` / ``eos_token_ids`` override the request's own RNG (from params.seed)
        and the engine's EOS ids (library calls on loaded models use them); ``speculate=False`` decodes it plainly
        on a speculating engine (its output is the same either way: only its speed differs). ``prediction``: token
        ids the output is expected to repeat (OpenAI's predicted outputs), which the suffix proposers copy drafts
        from; other proposers ignore it, and the output is the same either way. ``priority`` (vLLM's; lower is
        sooner): the request's rank under ``scheduling_policy="priority"``, 0 under "fcfs". ``lora``: the name of
        the adapter (EngineConfig.lora_modules, load_lora) the target applies to this request; None: the base model."""
        params = params or SamplingParams()
        self.check_priority(priority)
        self.loras.check(lora)
        prompt_ids = params.truncated(prompt_ids, self.max_seq_len)  # vLLM's truncate_prompt_tokens
        self.check_request(prompt_ids, params, prediction)
        if request_id is not None and request_id in self.requests:
            raise ValueError(f"request id {request_id!r} is already in use")
        limit = self.config.max_waiting_requests
        if limit is not None and len(self.scheduler.waiting) >= limit:
            raise QueueFullError(f"the waiting queue is full ({limit} requests)")
        if generator is None:
            generator = self._generator(params)
        eos = self.eos_token_ids if eos_token_ids is None else eos_token_ids
        grammar = self.grammars().matcher(params.structured) if params.structured is not None else None
        req = Request(prompt_ids, params, eos, self.tokenizer, generator, request_id=request_id, prompt=prompt,
                      grammar=grammar, prediction=prediction)
        req.speculate, req.priority = speculate, priority
        # its slot (Request.lora) is given at admission (Scheduler: LoRASlots.acquire)
        req.lora_name, req.lora_salt, req.lora_path = lora, self.loras.salt(lora), self.loras.path(lora)
        self.requests[req.request_id] = req
        self.scheduler.add(req)
        return req

    @property
    def lora_names(self) -> list[str]:
        """The names of the adapters loaded now (EngineConfig.lora_modules, load_lora), in load order."""
        return list(self.loras.loaded)

    def check_lora(self, name: str | None) -> None:
        """ValueError naming the adapters there are, unless ``name`` is one of them (None: the base model)."""
        self.loras.check(name)

    def load_lora(self, name: str, path: str | os.PathLike, replace: bool = False) -> None:
        """vLLM's ``/v1/load_lora_adapter``: the PEFT directory ``path`` read as ``name`` (EngineConfig.enable_lora;
        up to max_cpu_loras at once, max_loras of them in one batch), for requests that name it from the next step
        on; ``replace`` (vLLM's ``load_inplace``): over the adapter loaded as ``name``, which no unfinished request may
        name. ValueError naming the problem, nothing changed. Call it between steps (AsyncEngine.load_lora does)."""
        self.loras.load(name, path, replace, self._lora_users(name))

    def unload_lora(self, name: str) -> None:
        """vLLM's ``/v1/unload_lora_adapter``: forget ``name`` and empty its slot; ValueError if no adapter has that
        name or an unfinished request names it (nothing already accepted loses its adapter)."""
        self.loras.unload(name, self._lora_users(name))

    def _lora_users(self, name: str) -> int:
        """How many unfinished requests name the adapter ``name`` (waiting ones too: they keep it)."""
        return sum(r.lora_name == name for r in self.requests.values() if r.status != RequestStatus.FINISHED)

    def _generator(self, params: SamplingParams) -> torch.Generator | None:
        if params.greedy:
            return None
        seed = params.seed if params.seed is not None else int(torch.randint(0, 2**62, (1,), generator=self._seed_rng))
        return make_generator(seed, self.device)

    def abort(self, request_id: str) -> StepOutput | None:
        """Stop a request wherever it is; frees its KV at once. Returns its final output (None if unknown)."""
        req = self.requests.pop(request_id, None)
        if req is None or req.status == RequestStatus.FINISHED:
            return None
        self.scheduler.abort(req)
        self._count_finished(req)
        if self.decoder is not None:
            self.decoder.proposer.finished(req)
        return StepOutput(req.request_id, None, req.stream_text(), True, "abort",
                          num_cached_tokens=req.num_cached_tokens or 0)

    # -- the loop ----------------------------------------------------------------------------------------------
    @property
    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished

    def step(self) -> list[StepOutput]:
        """Schedule, run one batched forward (or one speculative round), retire what finished."""
        if self.decoder is not None and not self.decoder.ready:
            self._finish_warmup(self.warmup)  # a no-op until the background warm-up is done
        if self.warmup is not None and torch.get_num_threads() != self._num_threads:
            # Another thread may step this engine (AsyncEngine's loop), and a warm-up that could not set its own
            # thread's count alone (kernels.one_thread_here) set torch's default: the constructing thread's count
            torch.set_num_threads(self._num_threads)
        plan = self.scheduler.schedule()
        with self.warmup.engine_turn() if self.warmup is not None else nullcontext():
            outputs = self.runner.prefill(plan.prefill)
            if plan.decode:
                outputs += (self.decoder or self.runner).decode(plan.decode)
        for req in self.scheduler.retire():
            self.requests.pop(req.request_id, None)
            self._count_finished(req)
            if self.decoder is not None:
                self.decoder.proposer.finished(req)
        self.stats.num_steps += 1
        self.stats.num_preemptions = self.scheduler.num_preemptions
        return [o for _, o in outputs]

    def _count_finished(self, req: Request) -> None:
        reason = req.finish_reason or "abort"
        self.stats.requests_finished[reason] = self.stats.requests_finished.get(reason, 0) + 1

    def run(self, requests: list[Request]) -> list[Request]:
        """Step until every given request has finished (the library's batch mode)."""
        while any(not r.finished for r in requests):
            self.step()
        return requests

    # -- introspection -----------------------------------------------------------------------------------------
    @property
    def num_running(self) -> int:
        return len(self.scheduler.running)

    @property
    def num_waiting(self) -> int:
        return len(self.scheduler.waiting)

    def free_kv_tokens(self) -> int:
        return self.kv.free_kv_tokens()

    @property
    def initial_free_kv_tokens(self) -> int:
        return self._initial_free_kv


def _check_token_ids(what: str, ids, vocab_size: int) -> None:
    """ValueError naming the first few of ``ids`` that are not token ids of [0, vocab_size)."""
    bad = [t for t in ids if not (isinstance(t, int) and not isinstance(t, bool) and 0 <= t < vocab_size)]
    if bad:
        raise ValueError(f"{what} token ids out of range [0, {vocab_size}): {bad[:5]}")
