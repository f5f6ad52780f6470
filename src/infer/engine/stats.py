"""Engine-wide counters (D9 and the server's /metrics read these; the engine only ever increments them)."""

from __future__ import annotations

from dataclasses import dataclass, field

from ..request import count_per_position


@dataclass
class EngineStats:
    prompt_tokens: int = 0  # prompt tokens run through the target (recomputation after preemption included)
    generation_tokens: int = 0
    prefix_cache_hit_tokens: int = 0
    num_preemptions: int = 0
    num_steps: int = 0
    requests_finished: dict[str, int] = field(default_factory=dict)  # finish_reason -> count
    # speculative decoding
    num_drafts: int = 0  # speculation rounds, summed over requests
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_position: list[int] = field(default_factory=list)  # [k]: rounds whose draft k was accepted
    drafted_per_position: list[int] = field(default_factory=list)
    tree_rounds: int = 0  # rounds that verified token trees (spec_tree), and their draft nodes summed over rows
    tree_nodes: int = 0
    num_plain_decode_steps: int = 0  # decode steps that skipped speculation (batch above spec_max_batch_size)

    def record_round(self, num_draft: int, num_accepted: int) -> None:
        self.num_drafts += 1
        self.num_draft_tokens += num_draft
        self.num_accepted_tokens += num_accepted
        count_per_position(self.drafted_per_position, self.accepted_per_position, num_draft, num_accepted)

    @property
    def acceptance_rate(self) -> float | None:
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else None
