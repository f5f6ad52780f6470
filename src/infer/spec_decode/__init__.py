"""Speculative decoding, written once for every path: the round (round.py), verification, trees, the cost model and
K policies. The proposers, whatever drafts, live in infer.proposers; the library's speculative_generate beside the
LLM (infer.speculative). Names are loaded on first use, so that infer.proposers can import this package's modules
(trees) while the round imports the proposer seam."""

import importlib

_EXPORTS = {"RoundRecord": "round", "SpeculativeDecoder": "round", "VerifyResult": "verify",
            "greedy_verify": "verify", "rejection_sample": "verify", "verify": "verify"}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    if name in _EXPORTS:
        return getattr(importlib.import_module(f".{_EXPORTS[name]}", __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
