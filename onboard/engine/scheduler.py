"""Continuous batching with chunked prefill and preemption by recompute.

Each step serves running sequences first (a decode token each, or the next prefill chunk), then
admits waiting ones first come first served while the token budget, the sequence cap and the KV
cache allow. A running sequence that needs a block nobody can give preempts the most recently
arrived running sequence (possibly itself): its blocks are freed and it waits at the front of the
queue to recompute prompt and generated tokens.  In exact numerics a waiting prompt that fits in
a step is admitted only whole, so its prefill has the rows it would have alone.

A sequence that scores its prompt (prompt logprobs) never reuses cached prefix blocks, as in vLLM:
positions served from the cache would have no logits.  Nor does any sequence of a model with
per-sequence state (linear attention): its state at the end of a cached prefix is not kept.
"""

import bisect
from collections import deque
from dataclasses import dataclass, field

from onboard.engine.block_manager import BlockManager
from onboard.engine.config import EngineConfig
from onboard.engine.sequence import Sequence, SequenceStatus


@dataclass
class ScheduledSeq:
    """One sequence's work in a step: tokens [seq.num_computed_tokens, + num_new_tokens)."""

    seq: Sequence
    num_new_tokens: int
    num_proposals: int = 0  # of the new tokens, draft proposals to verify (each gets a logits row)
    samples: bool = field(init=False)  # the step ends on the sequence's last token, so it samples
    # Of the new tokens, the leading ones whose logits score the next prompt token (prompt logprobs).
    num_prompt_rows: int = field(init=False)

    def __post_init__(self) -> None:
        start = self.seq.num_computed_tokens
        self.samples = start + self.num_new_tokens == len(self.seq)
        scored_end = min(start + self.num_new_tokens, self.seq.num_prompt_tokens - 1)
        self.num_prompt_rows = max(0, scored_end - start) if self.seq.scores_prompt else 0


class Scheduler:
    def __init__(self, config: EngineConfig, block_manager: BlockManager):
        if block_manager.block_size != config.block_size:
            raise ValueError(f"block manager block_size {block_manager.block_size} != config {config.block_size}")
        if -(-config.max_model_len // config.block_size) > block_manager.num_blocks:
            # Otherwise a lone sequence could outgrow the cache and preempt itself forever.
            raise ValueError(f"{block_manager.num_blocks} KV blocks cannot hold max_model_len={config.max_model_len}")
        self.config = config
        self.block_manager = block_manager
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []  # by arrival, so the last is the preemption victim
        self.num_preemptions = 0

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    @property
    def num_running(self) -> int:
        return len(self.running)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def add(self, seq: Sequence) -> None:
        if not 0 < len(seq) <= self.config.max_model_len:
            raise ValueError(f"sequence {seq.seq_id} has {len(seq)} tokens; allowed 1..{self.config.max_model_len}")
        if seq.block_size != self.config.block_size:
            raise ValueError(f"sequence block_size {seq.block_size} != config {self.config.block_size}")
        seq.status = SequenceStatus.WAITING
        self.waiting.append(seq)

    def schedule(self) -> list[ScheduledSeq]:
        if not self.has_unfinished():
            if self.config.check_invariants_when_idle:
                self.block_manager.check_invariants([])
            return []
        budget = self.config.max_num_batched_tokens
        scheduled: list[ScheduledSeq] = []
        preempted = False
        i = 0
        while i < len(self.running) and budget > 0 and len(scheduled) < self.config.max_num_seqs:
            seq = self.running[i]
            while not self.block_manager.can_append(seq):
                victim = self.running.pop()  # never one scheduled this step: those come before index i
                self._preempt(victim)
                preempted = True
                if victim is seq:
                    break
            else:
                self.block_manager.may_append(seq)
                scheduled.append(ScheduledSeq(seq, min(len(seq) - seq.num_computed_tokens, budget)))
                budget -= scheduled[-1].num_new_tokens
                i += 1
        # Admitting right after a preemption would only take the blocks the preempted sequence needs back.
        while (
            not preempted
            and self.waiting
            and budget > 0
            and len(self.running) < self.config.max_num_seqs
            and len(scheduled) < self.config.max_num_seqs
            and self.block_manager.can_allocate(self.waiting[0], reuse_prefix=self._reuse_prefix(self.waiting[0]))
        ):
            if self._would_split(self.waiting[0], budget):
                break
            seq = self.waiting.popleft()
            self.block_manager.allocate(seq, reuse_prefix=self._reuse_prefix(seq))
            seq.status = SequenceStatus.RUNNING
            bisect.insort(self.running, seq, key=lambda s: s.arrival)
            scheduled.append(ScheduledSeq(seq, min(len(seq) - seq.num_computed_tokens, budget)))
            budget -= scheduled[-1].num_new_tokens
        return scheduled

    def _would_split(self, seq: Sequence, budget: int) -> bool:
        """Exact numerics: a prompt that fits in a step is not cut to this step's leftover budget;
        it waits for a step with room, as alone it is prefilled whole.  (One longer than a whole
        step is chunked anyway.)"""
        remaining = len(seq) - seq.num_computed_tokens
        return self.config.numerics == "exact" and budget < remaining <= self.config.max_num_batched_tokens

    @property
    def prefix_caching(self) -> bool:
        """Off for a model with per-sequence state: a cached prefix would need the state at its
        end, which the engine does not snapshot (`state_cache.py`)."""
        return self.config.enable_prefix_caching and self.block_manager.state_slots is None

    def _reuse_prefix(self, seq: Sequence) -> bool:
        return self.prefix_caching and not seq.scores_prompt

    def _preempt(self, seq: Sequence) -> None:
        self.block_manager.deallocate(seq)
        seq.status = SequenceStatus.WAITING
        self.waiting.appendleft(seq)
        self.num_preemptions += 1

    def reserve_lookahead(self, item: ScheduledSeq, proposals: list[int]) -> bool:
        """Append draft proposals to a scheduled decoding sequence and reserve their cache slots,
        so that this step verifies them; False, with nothing changed, when the cache cannot."""
        seq = item.seq
        seq.token_ids.extend(proposals)
        if not proposals or not self.block_manager.can_append(seq):
            del seq.token_ids[len(seq) - len(proposals) :]
            return False
        self.block_manager.may_append(seq)
        item.num_new_tokens += len(proposals)
        item.num_proposals = len(proposals)
        return True

    def release_rejected(self, seq: Sequence) -> None:
        """After verification: register the verified tokens' blocks, free the rejected ones' slots."""
        self.block_manager.mark_computed(seq, seq.num_computed_tokens)
        self.block_manager.truncate(seq)

    def postprocess(self, scheduled: list[ScheduledSeq], sampled: dict[int, int]) -> None:
        """Record a step's work: computed tokens, prefix-cache registration, sampled tokens (seq_id -> token)."""
        for item in scheduled:
            seq = item.seq
            if seq.is_finished:  # aborted while the step ran
                continue
            seq.num_computed_tokens += item.num_new_tokens
            self.block_manager.mark_computed(seq, seq.num_computed_tokens)
            if item.samples:
                seq.append_token(sampled[seq.seq_id])

    def finish(self, seq: Sequence, reason: str) -> None:
        """End `seq` (a stop condition met, or an abort) and free its blocks."""
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        self.block_manager.deallocate(seq)
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = reason

    def abort(self, seq_id: int) -> bool:
        seq = next((s for s in (*self.waiting, *self.running) if s.seq_id == seq_id), None)
        if seq is None:
            return False
        self.finish(seq, "abort")
        if self.config.check_invariants_when_idle:
            self.block_manager.check_invariants(self.running)
        return True
