"""Scheduler: which requests run this step, and with how many tokens. It knows nothing of speculation: the KV
manager answers the KV questions (``can_fit``, ``decode_tokens``) and does the allocation (``admit``, ``free``).

Each step, in order:
  1. decode every running request that has finished its prefill, oldest first; if their KV growth does not fit,
     preempt the newest running request (its K/V is dropped and recomputed later) until it does;
  2. spend the rest of the token budget (``max_num_batched_tokens``) on prefill chunks: first requests already
     prefilling, then new admissions from the waiting queue while slots and KV capacity allow.
The oldest running request always fits alone (``Engine.add_request`` checks this), so the engine always makes
progress: preemption goes newest-first and the waiting queue is first-come first-served.

With ``scheduling_policy="priority"`` (vLLM's) "oldest" reads "first by (priority, arrival)", lower priority values
first: the waiting queue is kept in that order, and the running request preempted is the last in it. The first
running request still fits alone and is never preempted, so the engine still makes progress; a low priority may wait
as long as higher ones keep arriving (as in vLLM). Under "fcfs" every priority is 0 and the order is arrival's.

A request of a LoRA adapter is admitted with its adapter's slot (engine.adapters: ``LoRASlots.acquire``); where every
slot holds another adapter that a running request reads, it keeps its place and the requests behind it are admitted
(vLLM's, for more loaded adapters than max_loras). Passed over LORA_PATIENCE times in a row, the requests behind it
take no slot: the running requests finish, a slot frees and it goes on.
"""

from __future__ import annotations

import bisect
from collections import deque
from dataclasses import dataclass, field

from ..request import Request, RequestStatus
from .config import EngineConfig

# admissions in a row a request may find no slot for its LoRA adapter (every slot serving running requests of other
# adapters) before the requests behind it stop taking slots: those drain as their requests finish, and it gets one
# (a steady stream of another adapter's requests would otherwise keep every slot busy for good)
LORA_PATIENCE = 16


@dataclass
class SchedulerOutput:
    prefill: list[tuple[Request, int]] = field(default_factory=list)  # (request, chunk length)
    decode: list[Request] = field(default_factory=list)
    preempted: list[Request] = field(default_factory=list)
    admitted: list[Request] = field(default_factory=list)

    @property
    def empty(self) -> bool:
        return not self.prefill and not self.decode


def is_prefilling(req: Request) -> bool:
    return req.num_computed < req.num_tokens - 1


class Scheduler:
    def __init__(self, cfg: EngineConfig, kv, loras=None):
        self.cfg, self.kv = cfg, kv  # the KV manager
        self.loras = loras  # the LoRA slots (engine.adapters): a request gets its adapter's slot when admitted
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []  # admission order: oldest first
        self.num_preemptions = 0

    def add(self, req: Request) -> None:
        req.status = RequestStatus.WAITING
        self._enqueue(req)

    @staticmethod
    def _rank(req: Request) -> tuple:
        return req.priority, req.arrival_time, req.seq

    def _enqueue(self, req: Request) -> None:
        """Into the waiting queue at its rank: behind every request that ranks before it (under "fcfs" the rank is
        arrival's, so a new request goes last and a preempted one, older than any never admitted, first)."""
        if not self.waiting or self._rank(self.waiting[-1]) <= self._rank(req):
            self.waiting.append(req)
        else:
            bisect.insort(self.waiting, req, key=self._rank)

    def _victim(self) -> Request:
        """The running request to preempt: the last by rank (the newest under "fcfs")."""
        return max(self.running, key=self._rank)

    @property
    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def abort(self, req: Request) -> None:
        """Remove a request wherever it is and free everything it holds."""
        if req in self.running:
            self.running.remove(req)
        elif req in self.waiting:
            self.waiting.remove(req)
        self.kv.free(req)
        req.abort()
        req.status = RequestStatus.FINISHED

    def retire(self) -> list[Request]:
        """Free the requests that finished this step."""
        done = [r for r in self.running if r.finished]
        for r in done:
            self.running.remove(r)
            self.kv.free(r)
            r.status = RequestStatus.FINISHED
        return done

    def _preempt(self, req: Request, out: SchedulerOutput) -> None:
        self.running.remove(req)
        self.kv.free(req)  # recompute later: prompt + output so far are prefilled again
        req.status = RequestStatus.WAITING
        req.num_preemptions += 1
        self.num_preemptions += 1
        self._enqueue(req)
        out.preempted.append(req)

    def schedule(self) -> SchedulerOutput:
        while True:
            out = self._try_schedule()
            if not out.empty or out.admitted or not self.running:
                return out
            # running requests exist but none could take a step (their prefills do not fit together): make room
            self._preempt(self._victim(), out)

    def _try_schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        decode = [r for r in self.running if not is_prefilling(r)]
        while decode and not self.kv.can_fit(decode, []):
            victim = self._victim()
            self._preempt(victim, out)
            if victim in decode:
                decode.remove(victim)
        out.decode = decode
        budget = self.cfg.max_num_batched_tokens - self.kv.decode_tokens(len(decode))
        for r in self.running:
            if budget <= 0:
                break
            if is_prefilling(r):
                chunk = min(r.num_tokens - r.num_computed, budget)
                if not self.kv.can_fit(decode, out.prefill + [(r, chunk)]):
                    break
                out.prefill.append((r, chunk))
                budget -= chunk
        if self.waiting:  # a decode step with nothing queued reads nothing more
            busy = {r.lora for r in self.running if r.lora}  # slots running requests read: not written this step
            passed = []  # requests whose adapter finds no slot this step: they keep their place in the queue
            try:
                self._admit(out, decode, budget, busy, passed)
            finally:  # whatever happened, nothing leaves the queue unadmitted
                self.waiting.extendleft(reversed(passed))
        return out

    def _admit(self, out: SchedulerOutput, decode: list[Request], budget: int, busy: set[int],
               passed: list[Request]) -> None:
        """New admissions from the waiting queue into ``out``, while slots, KV capacity and ``budget`` allow."""
        starved = False  # a request behind which no other takes a slot (LORA_PATIENCE)
        while self.waiting and budget > 0 and len(self.running) < self.cfg.max_batch_size:
            r = self.waiting[0]
            if r.lora_name is not None and self.loras is not None:
                slot = None if starved else self.loras.acquire(r.lora_name, busy)
                if slot is None:  # every slot holds another adapter a running request reads: the next may go
                    r.lora_waits += 1
                    starved = starved or r.lora_waits > LORA_PATIENCE
                    passed.append(self.waiting.popleft())
                    continue
                r.lora, r.lora_waits = slot, 0
            chunk = min(r.num_tokens, budget)
            if not self.kv.can_fit(decode, out.prefill + [(r, chunk)]):
                break
            self.kv.admit(r)  # may start past a cached prefix, whose blocks it now holds
            if is_prefilling(r):
                chunk = min(r.num_tokens - r.num_computed, budget)
                if not self.kv.can_fit(decode, out.prefill + [(r, chunk)]):
                    self.kv.free(r)  # the hit blocks cost capacity too: undo, retry next step
                    break
            else:  # a one-token prompt, or a cache hit of all but the last token, whose next token is drawn as a
                # prefill's (Request.plain_next) by whichever step decodes it
                r.plain_next = r.num_computed > 0
            self.waiting.popleft()
            r.status = RequestStatus.RUNNING
            self.running.append(r)
            busy.add(r.lora)
            out.admitted.append(r)
            if is_prefilling(r):
                out.prefill.append((r, chunk))
                budget -= chunk
            elif self.kv.can_fit(out.decode + [r], out.prefill):  # a one-token prompt, or a full cache hit
                out.decode.append(r)
                budget -= self.kv.decode_tokens(1)
