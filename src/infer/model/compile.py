"""torch.compile (inductor) for the few-token steps: decode (1 token per row) and verify (K+1 per row).

Decoding a small model on CPU is bound by two things eager PyTorch does badly: the Python and dispatch cost of
~20 ops per layer, and one-row ``F.linear`` calls that stream weights at half the memory bandwidth. Compiling
the forward removes the first (inductor fuses the norms, rotary and elementwise work into a few C++ kernels)
and, with ``layers.linear``'s matrix-vector form, the second.

    compile_model(model)          # model.forward / compute_logits now use the compiled twins for <= max_tokens

What is compiled and what is not:
- ``model._forward`` (embedding -> layers -> norm) when a KV cache is given and T <= ``max_tokens``; prefill
  chunks stay eager (compute-bound already, and every chunk length would be another graph).
- ``model._logits`` for up to ``max_tokens`` rows.
- Automatic dynamic shapes (``dynamic=None``): the first call of a step compiles with its exact sizes; the first
  size that changes (the cache length, at the second token) recompiles once with that size symbolic, and that
  graph then serves every length (no recompilation storm). Sizes that never change stay static, which gives
  inductor better kernels than ``dynamic=True`` (SmolLM2 bf16 decode: 9.3 vs 10.1 ms a step). A few graphs
  remain: one per structurally different step (single-row decode, a masked multi-token verify, a batch).
- Inductor's compiled artifacts persist on disk (``cache_dir``, default ``~/.cache/infer/inductor``): a second
  start replays them and pays only Dynamo's tracing.

The eager path stays the reference: ``compile=False`` (``--no-compile``) never touches torch.compile.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch

DEFAULT_CACHE_DIR = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "infer" / "inductor"


# A decode step is ~250 small fused kernels (norms, rotary, residuals over 576-wide rows) around the matrix-vector
# products. Inductor splits any loop over >= 512 elements across threads; at that size the OpenMP fork/join costs
# more than the work (SmolLM2 bf16: 63 -> 73 tok/s with this threshold). The products stay parallel.
INDUCTOR_OPTIONS = {"cpp.min_chunk_size": 16384}


@dataclass
class CompiledSteps:
    forward: Callable  # (input_ids [B, T], positions [B, T], kv, attn_meta) -> hidden [B, T, H]
    logits: Callable  # hidden [..., H] -> float32 logits [..., V]
    max_tokens: int  # steps with at most this many tokens per row use them


def configure_cache(cache_dir: str | os.PathLike | None = None) -> Path:
    """Point inductor's on-disk caches at ``cache_dir`` (default ``~/.cache/infer/inductor``), unless the user chose
    a directory with TORCHINDUCTOR_CACHE_DIR. Inductor's own default lives in the temp directory, which a reboot
    may empty; it also writes that default into the environment when torch._inductor is imported, so a value equal
    to the default counts as not chosen."""
    from torch._inductor.runtime.cache_dir_utils import default_cache_dir

    current = os.environ.get("TORCHINDUCTOR_CACHE_DIR")
    if current and os.path.abspath(current) != os.path.abspath(default_cache_dir()):
        return Path(current)
    path = Path(cache_dir or DEFAULT_CACHE_DIR)
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError:  # read-only home: keep inductor's default
        return Path(current or default_cache_dir())
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(path)
    torch._inductor.config.fx_graph_cache = True
    return path


def compile_model(model, max_tokens: int = 16, cache_dir: str | os.PathLike | None = None):
    """Attach compiled decode/verify steps to ``model`` (in place; returns it). Idempotent."""
    if max_tokens < 1:
        raise ValueError(f"max_tokens must be >= 1, got {max_tokens}")
    if model.compiled is None:
        configure_cache(cache_dir)
        # Each structural variant (decode, masked verify, paged gather, ...) is one graph; allow a few more than
        # the default 8 before dynamo gives up and runs eager.
        torch._dynamo.config.cache_size_limit = max(torch._dynamo.config.cache_size_limit, 32)
        model.compiled = CompiledSteps(torch.compile(model._forward, dynamic=None, options=INDUCTOR_OPTIONS),
                                       torch.compile(model._logits, dynamic=None, options=INDUCTOR_OPTIONS),
                                       max_tokens)
    model.compiled.max_tokens = max_tokens
    return model
