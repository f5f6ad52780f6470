"""EngineConfig: every knob of the serving engine, validated once at construction (D8)."""

from __future__ import annotations

import math
import os
from dataclasses import dataclass

BACKENDS = ("contiguous", "paged")
PROPOSERS = ("draft", "ngram", "hybrid", "suffix", "suffix-hybrid")
MODEL_PROPOSERS = ("draft", "hybrid", "suffix-hybrid")  # those with a draft model
SUFFIX_PROPOSERS = ("suffix", "suffix-hybrid")  # those with a suffix tree (the suffix_* options)
SPEC_LENGTHS = ("auto", "egag")
COMPILE_AUTO_MIN_PARAMS = 50_000_000
# SuffixProposer's arguments and defaults, as the suffix_* fields below hold them (tests/test_suffix.py checks
# they match the proposer's own)
SUFFIX_DEFAULTS = {"max_depth": 24, "max_tokens": 1_000_000, "min_prob": 0.3, "length_factor": 1.0, "min_match": 1,
                   "own_length_factor": 2.0}


@dataclass
class EngineConfig:
    model: str | os.PathLike
    draft_model: str | os.PathLike | None = None
    # Speculative decoding: None (default) turns it on exactly when a draft_model or a proposer is given; True
    # without a draft_model speculates with prompt lookup (proposer "ngram").
    use_speculative_decoding: bool | None = None
    # Who drafts: "draft" (the draft model), "ngram" (prompt lookup over the request's own tokens), "hybrid" (n-gram
    # where the context matches, else the draft model), "suffix" (a suffix tree over this engine's earlier and running
    # requests: proposers/suffix.py), "suffix-hybrid" (the suffix tree's copies where it has some, else the draft
    # model). None: "draft" with a draft_model, else "ngram".
    proposer: str | None = None
    # K, drafts per round: "auto" picks per request per round the K in 0..spec_length_max that maximises expected
    # tokens per second from measured costs (spec_decode.spec_length); "egag" follows the drafter's entropy within
    # [spec_length_min, spec_length_max]; an integer pins K.
    spec_length: int | str = "auto"
    spec_length_min: int = 1
    spec_length_max: int = 8
    egag_ema_beta: float = 0.0
    # A hard cap on top of "auto": rounds run only while the decode batch has at most this many requests (None: the
    # cost model alone decides).
    spec_max_batch_size: int | None = None
    # Token trees (spec_decode.tree_round): None drafts chains; "DEPTHxWIDTH[:NODES]" (e.g. "5x3:15") drafts a tree
    # per request each round, depth = the round's K (at most DEPTH), WIDTH children kept a depth, NODES drafts
    # verified; "auto": with auto K, a tree of at least K nodes and more where the cost model prices them nearly free
    # (SpeculativeDecoder.tree_shape); with K pinned, a tree for a lone decode request, chains beside others.
    spec_tree: str | None = None
    prompt_lookup_min: int = 2  # n-gram sizes the "ngram" / "hybrid" proposers match, longest first
    prompt_lookup_max: int = 4
    # The "suffix" proposer (proposers/suffix.py; vLLM's suffix_decoding_* options): the longest substring the tree
    # holds (max_tree_depth), the tokens kept before the oldest finished requests are evicted, the least probability
    # a drafted continuation keeps (min_token_prob), the drafts per matched token (max_spec_factor), the shortest
    # match that drafts, and the request's own tree's drafts per matched token (None: no tree of its own text).
    suffix_max_depth: int = SUFFIX_DEFAULTS["max_depth"]
    suffix_max_tokens: int = SUFFIX_DEFAULTS["max_tokens"]
    suffix_min_prob: float = SUFFIX_DEFAULTS["min_prob"]
    suffix_length_factor: float = SUFFIX_DEFAULTS["length_factor"]
    suffix_min_match: int = SUFFIX_DEFAULTS["min_match"]
    suffix_own_length_factor: float | None = SUFFIX_DEFAULTS["own_length_factor"]
    # "suffix-hybrid": a row copies from the tree, instead of taking the draft model's drafts, where the tree expects
    # at least this many of its drafts accepted (the sum of their prefixes' probabilities; 0: wherever it has a draft).
    # 1.0: on SmolLM2's held-out chat the tree's unsure copies lost to the EAGLE head's drafts (docs/benchmarks.md).
    suffix_min_score: float = 1.0
    # Verification of sampled rows: "exact" (lossless). "typical" and "lenient" are LOSSY opt-ins that accept more
    # drafts at the price of the output distribution (spec_decode.acceptance).
    acceptance: str = "exact"
    lenience: float = 0.5
    typical_epsilon: float = 0.09
    typical_delta: float = 0.3
    # The drafter scores only this many of the most frequent tokens (ranking: draft_model/draft_vocab.json).
    # "auto": the ranking's recommended size when a ranking ships beside the drafter, else the whole vocabulary;
    # None: the whole vocabulary. Lossless either way (proposers.draft_vocab).
    draft_vocab_size: int | str | None = "auto"
    # A drafter whose tokenizer is not the target's (proposers.cross_tokenizer): "string" re-tokenises its text
    # (any target token can be drafted), "intersection" drafts the tokens both vocabularies share with q. Lossless.
    cross_tokenizer: str = "string"
    tokenizer: str | os.PathLike | None = None
    kv_cache_backend: str = "paged"  # "contiguous" | "paged"
    block_size: int = 16
    num_kv_blocks: int | None = None  # per pool; None: from kv_cache_memory_mb, else enough for every slot
    kv_cache_memory_mb: float | None = None  # target pool budget (the draft pool gets as many blocks)
    max_batch_size: int = 8  # concurrent running requests (KV slots)
    max_seq_len: int | None = None  # None: the model's max_position_embeddings
    max_num_batched_tokens: int = 512  # tokens per step: decode tokens first, the rest goes to prefill chunks
    max_waiting_requests: int | None = None  # None: unbounded queue
    # vLLM's: "fcfs" admits requests in arrival order; "priority" by each request's priority (lower first, then
    # arrival), and where KV runs short it preempts the running request of the lowest priority (engine.scheduler)
    scheduling_policy: str = "fcfs"
    # Keep full prompt blocks for later prompts that start the same way (a drafter's blocks too: kv_manager), as vLLM
    # and llama-server do by default. None (auto): on with the paged backend, which it needs.
    enable_prefix_caching: bool | None = None
    dtype: str = "auto"  # "auto": the checkpoint's own (config.json torch_dtype; float32 for GGUF), or a dtype name
    device: str = "cpu"
    # Quantization of the target: "int8" (weight-only) | "q8_0" | "q4_0" | "q4_1" (llama.cpp's blocks, int8
    # activations; "int4" = "q4_1") | "gguf" (each tensor in its file's block type, Q4_K too) | None: see
    # infer.model.quant. Speculation stays lossless relative to the quantized target.
    quantization: str | None = None
    # Quantization of the drafter (a draft model's or a head's projections, and its draft-vocabulary rows), one of
    # the same names or None; "auto": "q8_0" where the target is quantized on the CPU (a draft step then runs on
    # infer::qlinear like the target's steps; Q8_0 keeps the drafter's own argmax, at about half bfloat16's bytes),
    # else None. Lossless either way: drafts are only proposals.
    draft_quantization: str | None = "auto"
    # torch.compile the decode/verify steps (infer.model.compile). None (auto): on for models of at least
    # COMPILE_AUTO_MIN_PARAMS parameters, where the step is bound by memory bandwidth and compiling pays for its
    # start-up; tiny models (tests, the demo pair) stay eager. False: never.
    compile: bool | None = None
    # With compile: build the compiled steps in a background thread and serve meanwhile (a step without its graph
    # yet runs eagerly, bit for bit the same: engine.warmup); False builds them all before the engine serves.
    # Engines whose eager and compiled steps may differ in rounding (no infer CPU kernels: CUDA) always build first.
    compile_in_background: bool = True
    seed: int | None = None  # seeds requests that bring no seed of their own
    # Shard the target over this many processes (engine.tp_executor, model/tp.py): rank 0 is this process and runs
    # the engine, the others hold the other shards. Eager, unquantized weights; a draft model or n-gram drafts.
    tensor_parallel_size: int = 1
    # A LoRA adapter on the target (model.lora: a PEFT directory, applied at run time over the loaded weights; vLLM's
    # --lora-modules, llama.cpp's --lora) and its scale (llama.cpp's --lora-scaled; 1: as trained)
    lora: str | os.PathLike | None = None
    lora_scale: float = 1.0
    # Adapters that each request picks by name (vLLM's --lora-modules name=path; Engine.add_request's ``lora``, the
    # server's ``model`` field), all loaded at start, every row of a batch with its own or none (model.lora); each at
    # lora_scale. Not beside ``lora`` (one adapter on every request).
    lora_modules: dict[str, str | os.PathLike] | None = None
    # Adapters loaded while the engine runs (vLLM's enable_lora, max_loras, max_lora_rank): Engine.load_lora /
    # unload_lora, a LoRARequest with a path (LLM.generate), the server's /v1/load_lora_adapter. Every product gets
    # max_loras slots of max_lora_rank columns at start, so loading recompiles nothing; lora_modules fill the first.
    # max_cpu_loras (None: max_loras) adapters may be loaded at once: a request whose adapter sits in no slot waits
    # until a slot no running request reads takes it (engine.adapters), the requests behind it going on meanwhile.
    enable_lora: bool = False
    max_loras: int = 1
    max_lora_rank: int = 16
    max_cpu_loras: int | None = None

    def __post_init__(self):
        def bad(msg):
            raise ValueError(f"EngineConfig: {msg}")

        if self.use_speculative_decoding is None:
            self.use_speculative_decoding = self.draft_model is not None or self.proposer is not None
        if not self.use_speculative_decoding and self.draft_model is not None:
            bad("draft_model is given but use_speculative_decoding=False: drop one of them")
        if self.proposer is None and self.use_speculative_decoding:
            self.proposer = "draft" if self.draft_model is not None else "ngram"
        if self.proposer is not None:
            if not self.use_speculative_decoding:
                bad(f"proposer={self.proposer!r} needs use_speculative_decoding=True")
            if self.proposer not in PROPOSERS:
                bad(f"proposer must be one of {PROPOSERS}, got {self.proposer!r}")
            if self.proposer in MODEL_PROPOSERS and self.draft_model is None:
                bad(f"proposer={self.proposer!r} needs a draft_model")
            if self.proposer in ("ngram", "suffix") and self.draft_model is not None:
                bad(f"proposer={self.proposer!r} drafts without a model: drop draft_model (or use proposer='hybrid' "
                    "or 'suffix-hybrid')")
        for name in ("block_size", "max_batch_size", "max_num_batched_tokens", "spec_length_min", "spec_length_max",
                     "prompt_lookup_min", "prompt_lookup_max"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                bad(f"{name} must be an integer >= 1, got {v!r}")
        if self.spec_length not in SPEC_LENGTHS and (
                not isinstance(self.spec_length, int) or isinstance(self.spec_length, bool) or self.spec_length < 1):
            bad(f"spec_length must be an integer >= 1 (K pinned), 'auto' or 'egag', got {self.spec_length!r}")
        if self.spec_length_min > self.spec_length_max:
            bad(f"spec_length_min ({self.spec_length_min}) must be <= spec_length_max ({self.spec_length_max})")
        if not 0.0 <= self.egag_ema_beta < 1.0:
            bad(f"egag_ema_beta must be in [0, 1), got {self.egag_ema_beta!r}")
        if self.prompt_lookup_min > self.prompt_lookup_max:
            bad(f"prompt_lookup_min ({self.prompt_lookup_min}) must be <= prompt_lookup_max ({self.prompt_lookup_max})")
        suffix = self.suffix_options
        if isinstance(self.suffix_min_score, bool) or not isinstance(self.suffix_min_score, (int, float)) \
                or not self.suffix_min_score >= 0:
            bad(f"suffix_min_score must be a number >= 0, got {self.suffix_min_score!r}")
        if self.suffix_min_score != 1.0 and self.proposer != "suffix-hybrid":
            bad(f"suffix_min_score weighs the suffix tree's copies against a draft model's drafts, which only "
                f"proposer='suffix-hybrid' does (proposer={self.proposer!r}): drop it")
        if self.proposer in SUFFIX_PROPOSERS:
            from ..proposers.suffix import check_options

            try:
                check_options(**suffix, name="suffix_{}")
            except ValueError as e:
                bad(str(e))
        else:
            changed = [f"suffix_{k}" for k, v in suffix.items() if v != SUFFIX_DEFAULTS[k]]
            if changed:
                bad(f"{', '.join(changed)}: options of the suffix proposer, which is not on "
                    f"(proposer={self.proposer!r}); set proposer='suffix' or 'suffix-hybrid', or drop them")
        if self.spec_tree is not None:
            from ..spec_decode.tree import TreeShape

            if not self.use_speculative_decoding:
                bad("spec_tree shapes the drafts of speculative decoding: turn speculation on (a draft_model or a "
                    "proposer)")
            if self.acceptance != "exact":
                bad(f"spec_tree verifies exactly; acceptance={self.acceptance!r} applies to chains only")
            if self.spec_tree != "auto":
                try:
                    self.spec_tree = str(TreeShape.parse(self.spec_tree))
                except ValueError as e:
                    bad(str(e))
        for name in ("num_kv_blocks", "max_seq_len", "spec_max_batch_size", "max_waiting_requests"):
            v = getattr(self, name)
            if v is not None and (not isinstance(v, int) or isinstance(v, bool) or v < 1):
                bad(f"{name} must be an integer >= 1 or None, got {v!r}")
        from ..spec_decode.acceptance import make_policy

        try:
            make_policy(self.acceptance, self.lenience, self.typical_epsilon, self.typical_delta)
        except ValueError as e:
            bad(str(e))
        if self.draft_vocab_size == "auto":
            self.draft_vocab_size = "auto" if self.proposer in MODEL_PROPOSERS else None
        elif self.draft_vocab_size is not None:
            if self.proposer not in MODEL_PROPOSERS:
                bad("draft_vocab_size restricts the drafter's vocabulary: it needs a draft_model")
            if isinstance(self.draft_vocab_size, bool) or not isinstance(self.draft_vocab_size, int) \
                    or self.draft_vocab_size < 1:
                bad(f"draft_vocab_size must be an integer >= 1, 'auto' or None, got {self.draft_vocab_size!r}")
        if self.scheduling_policy not in ("fcfs", "priority"):
            bad(f"scheduling_policy must be 'fcfs' or 'priority', got {self.scheduling_policy!r}")
        if self.cross_tokenizer not in ("string", "intersection"):
            bad(f"cross_tokenizer must be 'string' or 'intersection', got {self.cross_tokenizer!r}")
        if self.kv_cache_backend not in BACKENDS:
            bad(f"kv_cache_backend must be one of {BACKENDS}, got {self.kv_cache_backend!r}")
        if self.kv_cache_memory_mb is not None and not self.kv_cache_memory_mb > 0:
            bad(f"kv_cache_memory_mb must be > 0, got {self.kv_cache_memory_mb!r}")
        if self.num_kv_blocks is not None and self.kv_cache_memory_mb is not None:
            bad("give num_kv_blocks or kv_cache_memory_mb, not both")
        if self.enable_prefix_caching is None:
            self.enable_prefix_caching = self.kv_cache_backend == "paged"
        if self.kv_cache_backend == "contiguous":
            if self.enable_prefix_caching:
                bad("enable_prefix_caching needs kv_cache_backend='paged' (prefix blocks are shared pages)")
            if self.num_kv_blocks is not None or self.kv_cache_memory_mb is not None:
                bad("num_kv_blocks / kv_cache_memory_mb size the paged backend; the contiguous one holds "
                    "max_batch_size x max_seq_len")
        if self.quantization is not None:
            from ..model.quant import QUANTIZATIONS

            if self.quantization not in QUANTIZATIONS:
                bad(f"quantization must be one of {QUANTIZATIONS} or None, got {self.quantization!r}")
        if self.draft_quantization == "auto":
            self.draft_quantization = "q8_0" if self.quantization is not None and self.device == "cpu" else None
        if self.draft_quantization is not None:
            from ..model.quant import QUANTIZATIONS

            if self.draft_quantization not in QUANTIZATIONS or self.draft_quantization == "gguf":
                bad(f"draft_quantization must be one of {tuple(q for q in QUANTIZATIONS if q != 'gguf')}, 'auto' "
                    f"or None, got {self.draft_quantization!r}")
        if self.compile not in (None, True, False):
            bad(f"compile must be True, False or None (auto), got {self.compile!r}")
        if not isinstance(self.compile_in_background, bool):
            bad(f"compile_in_background must be True or False, got {self.compile_in_background!r}")
        if self.seed is not None and (not isinstance(self.seed, int) or isinstance(self.seed, bool)):
            bad(f"seed must be an integer or None, got {self.seed!r}")
        tp = self.tensor_parallel_size
        if not isinstance(tp, int) or isinstance(tp, bool) or tp < 1:
            bad(f"tensor_parallel_size must be an integer >= 1, got {tp!r}")
        if tp > 1:
            if self.quantization is not None:
                bad("tensor_parallel_size > 1 shards unquantized weights: drop quantization")
            if self.compile:
                bad("tensor_parallel_size > 1 runs eager (the collectives are not compiled): drop compile")
            self.compile = False
        if self.lora is not None:
            if not isinstance(self.lora, (str, os.PathLike)) or not os.path.isdir(self.lora):
                bad(f"lora must be a PEFT adapter's directory, got {self.lora!r}")
            if tp > 1:
                bad("lora runs in one process: tensor_parallel_size > 1 shards the target without it")
        if self.lora_modules is not None:
            mods = self.lora_modules
            if not isinstance(mods, dict) or not mods:
                bad(f"lora_modules must be a non-empty dict of adapter name -> PEFT directory, got {mods!r}")
            for name, path in mods.items():
                if not isinstance(name, str) or not name.strip() or name != name.strip():
                    bad(f"lora_modules: adapter names must be non-empty strings without outer spaces, got {name!r}")
                if not isinstance(path, (str, os.PathLike)) or not os.path.isdir(path):
                    bad(f"lora_modules[{name!r}] must be a PEFT adapter's directory, got {path!r}")
            if self.lora is not None:
                bad("lora (one adapter on every request) and lora_modules (each request picks one) exclude each "
                    "other: name the adapter in lora_modules instead")
            if tp > 1:
                bad("lora_modules run in one process: tensor_parallel_size > 1 shards the target without them")
        if self.max_cpu_loras is None:
            self.max_cpu_loras = self.max_loras if isinstance(self.max_loras, int) else 1
        for name in ("max_loras", "max_lora_rank", "max_cpu_loras"):
            n = getattr(self, name)
            if isinstance(n, bool) or not isinstance(n, int) or n < 1:
                bad(f"{name} must be an integer >= 1, got {n!r}")
        if self.max_cpu_loras < self.max_loras:
            bad(f"max_cpu_loras ({self.max_cpu_loras}) must be at least max_loras ({self.max_loras}): the adapters "
                "loaded at once include those in a batch")
        if self.enable_lora:
            if self.lora is not None:
                bad("lora (one adapter on every request) and enable_lora (adapters each request picks, loaded at run "
                    "time) exclude each other")
            if self.lora_modules and len(self.lora_modules) > self.max_cpu_loras:
                bad(f"lora_modules names {len(self.lora_modules)} adapters, max_cpu_loras is {self.max_cpu_loras}: "
                    "raise max_cpu_loras (max_loras of them run in one batch)")
            if tp > 1:
                bad("enable_lora runs in one process: tensor_parallel_size > 1 shards the target without adapters")
        scale = self.lora_scale
        if isinstance(scale, bool) or not isinstance(scale, (int, float)) or not math.isfinite(scale):
            bad(f"lora_scale must be a finite number, got {scale!r}")
        if self.max_seq_len is not None and self.use_speculative_decoding and self.max_seq_len < 2:
            bad("max_seq_len must be >= 2 with speculative decoding")
        self._check_device(bad)

    def _check_device(self, bad) -> None:
        """The device is named and present: the engine runs on the CPU or CUDA, and a missing GPU is said here, not
        as torch's assertion from deep inside loading the weights."""
        import torch

        try:
            dev = torch.device(self.device)
        except (RuntimeError, TypeError):
            dev = None
        if dev is None or dev.type not in ("cpu", "cuda"):
            bad(f"device must be 'cpu', 'cuda' or 'cuda:N', got {self.device!r}")
        if dev.type == "cuda":
            if not torch.cuda.is_available():
                bad(f"device={self.device!r}, but CUDA is not available here (torch {torch.__version__}: "
                    f"{'a CPU-only build' if torch.version.cuda is None else 'no GPU visible'}); use device='cpu'")
            if dev.index is not None and dev.index >= torch.cuda.device_count():
                bad(f"device={self.device!r}, but only {torch.cuda.device_count()} CUDA device(s) are visible")

    @property
    def suffix_options(self) -> dict:
        """The suffix_* fields as SuffixProposer's keyword arguments."""
        return {k: getattr(self, "suffix_" + k) for k in SUFFIX_DEFAULTS}

    @property
    def max_spec_length(self) -> int:
        """The most drafts any round can hold (the KV lookahead); 0 without speculation."""
        if not self.use_speculative_decoding:
            return 0
        k = self.spec_length if isinstance(self.spec_length, int) else self.spec_length_max
        tree = self.tree_shape
        return k if tree is None else max(k, tree.depth * tree.width)  # a drafter's cache takes depth x width

    @property
    def tree_shape(self):
        """spec_tree as a TreeShape (the one "auto" uses for a lone request), or None."""
        if self.spec_tree is None:
            return None
        from ..spec_decode.round import AUTO_TREE
        from ..spec_decode.tree import TreeShape

        return AUTO_TREE if self.spec_tree == "auto" else TreeShape.parse(self.spec_tree)
