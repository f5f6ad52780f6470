from .speculative import RoundRecord, SpecStats, speculative_generate
from .verify import VerifyResult, greedy_verify, rejection_sample, verify

__all__ = ["RoundRecord", "SpecStats", "VerifyResult", "greedy_verify", "rejection_sample", "speculative_generate",
           "verify"]
