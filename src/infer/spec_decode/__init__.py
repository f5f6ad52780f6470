from .generate import SpecStats, speculative_generate
from .round import RoundRecord, SpeculativeDecoder
from .verify import VerifyResult, greedy_verify, rejection_sample, verify

__all__ = ["RoundRecord", "SpecStats", "SpeculativeDecoder", "VerifyResult", "greedy_verify", "rejection_sample",
           "speculative_generate", "verify"]
