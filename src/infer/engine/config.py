"""EngineConfig: every knob of the serving engine, validated once at construction (D8)."""

from __future__ import annotations

import os
from dataclasses import dataclass

BACKENDS = ("contiguous", "paged")
COMPILE_AUTO_MIN_PARAMS = 50_000_000


@dataclass
class EngineConfig:
    model: str | os.PathLike
    draft_model: str | os.PathLike | None = None
    use_speculative_decoding: bool | None = None  # None: on exactly when a draft_model is given
    spec_length: int = 5  # K: drafts per round
    # Speculation only pays while the target's K+1-token verify is cheap next to a decode step; at large batch
    # sizes the target is no longer weight-bound and plain decode wins. Rounds run while the decode batch has at
    # most this many requests (None: always). Lossless either way: the drafter just catches up later.
    spec_max_batch_size: int | None = None
    use_egag: bool = False  # entropy-adaptive K per request, within [gamma_min, gamma_max] (default spec_length)
    gamma_min: int = 1
    gamma_max: int | None = None
    egag_ema_beta: float = 0.0
    # The drafter scores only this many of the most frequent tokens (ranking: draft_model/draft_vocab.json);
    # None: the whole vocabulary. Lossless either way (spec.draft_vocab); it trades acceptance for cheaper drafts.
    draft_vocab_size: int | None = None
    tokenizer: str | os.PathLike | None = None
    kv_cache_backend: str = "paged"  # "contiguous" | "paged"
    block_size: int = 16
    num_kv_blocks: int | None = None  # per pool; None: from kv_cache_memory_mb, else enough for every slot
    kv_cache_memory_mb: float | None = None  # target pool budget (the draft pool gets as many blocks)
    max_batch_size: int = 8  # concurrent running requests (KV slots)
    max_seq_len: int | None = None  # None: the model's max_position_embeddings
    max_num_batched_tokens: int = 512  # tokens per step: decode tokens first, the rest goes to prefill chunks
    max_waiting_requests: int | None = None  # None: unbounded queue
    enable_prefix_caching: bool = False
    dtype: str = "float32"
    device: str = "cpu"
    # Weight-only quantization of the target ("int8" | "int4" | None): see infer.model.quant. Speculation stays
    # lossless relative to the quantized target.
    quantization: str | None = None
    # torch.compile the decode/verify steps (infer.model.compile). None (auto): on for models of at least
    # COMPILE_AUTO_MIN_PARAMS parameters, where the step is bound by memory bandwidth and compiling pays for its
    # start-up; tiny models (tests, the demo pair) stay eager. False: never.
    compile: bool | None = None
    seed: int | None = None  # seeds requests that bring no seed of their own

    def __post_init__(self):
        def bad(msg):
            raise ValueError(f"EngineConfig: {msg}")

        if self.use_speculative_decoding is None:
            self.use_speculative_decoding = self.draft_model is not None
        if self.use_speculative_decoding and self.draft_model is None:
            bad("use_speculative_decoding=True requires draft_model")
        if not self.use_speculative_decoding and self.draft_model is not None:
            bad("draft_model is given but use_speculative_decoding=False: drop one of them")
        for name in ("spec_length", "block_size", "max_batch_size", "max_num_batched_tokens"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                bad(f"{name} must be an integer >= 1, got {v!r}")
        for name in ("num_kv_blocks", "max_seq_len", "spec_max_batch_size", "max_waiting_requests"):
            v = getattr(self, name)
            if v is not None and (not isinstance(v, int) or isinstance(v, bool) or v < 1):
                bad(f"{name} must be an integer >= 1 or None, got {v!r}")
        if self.use_egag:
            if not self.use_speculative_decoding:
                bad("use_egag adapts the draft length: it needs speculative decoding (a draft_model)")
            from ..spec.adaptive import EntropyAdaptiveGamma

            try:
                EntropyAdaptiveGamma(self.gamma_min, self.egag_gamma_max, self.egag_ema_beta)
            except ValueError as e:
                bad(str(e))
        if self.draft_vocab_size is not None:
            if not self.use_speculative_decoding:
                bad("draft_vocab_size restricts the drafter's vocabulary: it needs speculative decoding (a draft_model)")
            if isinstance(self.draft_vocab_size, bool) or not isinstance(self.draft_vocab_size, int) \
                    or self.draft_vocab_size < 1:
                bad(f"draft_vocab_size must be an integer >= 1 or None, got {self.draft_vocab_size!r}")
        if self.kv_cache_backend not in BACKENDS:
            bad(f"kv_cache_backend must be one of {BACKENDS}, got {self.kv_cache_backend!r}")
        if self.kv_cache_memory_mb is not None and not self.kv_cache_memory_mb > 0:
            bad(f"kv_cache_memory_mb must be > 0, got {self.kv_cache_memory_mb!r}")
        if self.num_kv_blocks is not None and self.kv_cache_memory_mb is not None:
            bad("give num_kv_blocks or kv_cache_memory_mb, not both")
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
        if self.compile not in (None, True, False):
            bad(f"compile must be True, False or None (auto), got {self.compile!r}")
        if self.seed is not None and (not isinstance(self.seed, int) or isinstance(self.seed, bool)):
            bad(f"seed must be an integer or None, got {self.seed!r}")
        if self.max_seq_len is not None and self.use_speculative_decoding and self.max_seq_len < 2:
            bad("max_seq_len must be >= 2 with speculative decoding")

    @property
    def egag_gamma_max(self) -> int:
        return self.spec_length if self.gamma_max is None else self.gamma_max

    @property
    def max_draft(self) -> int:
        """The most drafts any round can hold (sizes KV lookahead)."""
        return max(self.spec_length, self.egag_gamma_max) if self.use_egag else self.spec_length
