"""Which sequences run in the next step, and how many of their tokens.

Two queues, as in nano-vllm: ``waiting`` (not holding KV blocks) and ``running`` (holding them).
Each step spends a token budget (``max_batched_tokens``):

1. running sequences that decode (one token each) go first, so a long prompt never stalls them;
2. then running sequences part-way through a chunked prefill get what budget is left;
3. then waiting sequences are admitted, oldest first, while the batch has room and their first
   chunk fits in the free blocks.

When a running sequence needs a block and none is free, the newest running sequence that is not
yet in this step is preempted: its blocks are released (their contents stay in the prefix cache)
and it goes back to the front of the waiting queue, to be recomputed later. The oldest sequence
is therefore never starved; if even it cannot grow because it alone fills the pool, it finishes
with "length".
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field

from .kv_cache import BlockManager
from .sequence import FinishReason, Sequence, SequenceStatus


@dataclass
class ScheduledBatch:
    seqs: list[Sequence] = field(default_factory=list)
    num_new_tokens: list[int] = field(default_factory=list)
    # Sequences the scheduler ended itself (the pool cannot hold them); the engine reports them.
    finished: list[Sequence] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return sum(self.num_new_tokens)

    def __len__(self) -> int:
        return len(self.seqs)

    def add(self, seq: Sequence, num_new_tokens: int) -> None:
        self.seqs.append(seq)
        self.num_new_tokens.append(num_new_tokens)


class Scheduler:
    def __init__(self, block_manager: BlockManager, *, max_batch_size: int,
                 max_batched_tokens: int):
        if max_batch_size < 1:
            raise ValueError(f"max_batch_size must be >= 1, got {max_batch_size}")
        if max_batched_tokens < 1:
            raise ValueError(f"max_batched_tokens must be >= 1, got {max_batched_tokens}")
        self.block_manager = block_manager
        self.max_batch_size = max_batch_size
        self.max_batched_tokens = max_batched_tokens
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        # Blocks kept free when admitting next to running sequences, so that admitting does not
        # immediately force a preemption on the next decode.
        self.watermark_blocks = max(1, block_manager.num_blocks // 100)
        self.step_index = 0
        self.num_preemptions = 0

    # ------------------------------------------------------------------------------- queues

    def add(self, seq: Sequence) -> None:
        seq.status = SequenceStatus.WAITING
        self.waiting.append(seq)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def finish(self, seq: Sequence, reason: FinishReason, *, invalidate: bool = False) -> None:
        """Take a sequence out of the queues and release its blocks."""
        if seq.status is SequenceStatus.FINISHED:
            return
        if seq.status is SequenceStatus.RUNNING:
            self.running.remove(seq)
        else:
            try:
                self.waiting.remove(seq)
            except ValueError:
                pass
        self.block_manager.free(seq, invalidate=invalidate)
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = reason

    # ------------------------------------------------------------------------------ schedule

    def schedule(self) -> ScheduledBatch:
        batch = ScheduledBatch()
        in_batch: set[int] = set()  # ids of sequences scheduled this step
        budget = self.max_batched_tokens
        bm = self.block_manager

        # Decodes first, then unfinished prefills; both in admission order.
        decoding = [s for s in self.running if s.num_uncomputed_tokens == 1]
        prefilling = [s for s in self.running if s.num_uncomputed_tokens > 1]
        for seq in decoding + prefilling:
            if budget == 0:
                break
            if seq.status is not SequenceStatus.RUNNING:
                continue  # preempted earlier in this loop
            num_new = min(seq.num_uncomputed_tokens, budget)
            if num_new > 1:
                # A prefill chunk shrinks to the room there is rather than preempting anyone.
                room = (len(seq.block_table) + bm.num_free_blocks) * bm.block_size \
                    - seq.num_computed_tokens
                # With no room at all, ask for one block's worth: older sequences must progress
                # even if that means preempting newer ones.
                num_new = min(num_new, room) if room > 0 else min(num_new, bm.block_size)
            if not self._make_room(seq, num_new, in_batch, batch):
                continue
            self._schedule(seq, num_new, batch, in_batch)
            budget -= num_new

        # Admit waiting sequences, oldest (and just-preempted) first.
        while self.waiting and budget > 0 and len(self.running) < self.max_batch_size:
            seq = self.waiting[0]
            reserve = self.watermark_blocks if self.running else 0
            first_admission = seq.timings.first_scheduled_step is None
            # Alone, a sequence takes what the pool holds: one that has outgrown the pool (it
            # grew while others ran, then was preempted) then ends with "length" as it runs.
            num_new = bm.admit(seq, budget, reserve=reserve, allow_partial=not self.running)
            if num_new == 0:
                break
            self.waiting.popleft()
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            if first_admission:
                seq.num_cached_prompt_tokens = min(seq.num_computed_tokens,
                                                   seq.num_prompt_tokens)
                seq.timings.first_scheduled_step = self.step_index
                seq.timings.queue_time = time.monotonic() - seq.timings.arrival_time
            self._schedule(seq, num_new, batch, in_batch)
            budget -= num_new

        self.step_index += 1
        return batch

    def _schedule(self, seq: Sequence, num_new: int, batch: ScheduledBatch,
                  in_batch: set[int]) -> None:
        batch.add(seq, num_new)
        in_batch.add(id(seq))
        self.block_manager.commit(seq, seq.num_computed_tokens + num_new)

    def _make_room(self, seq: Sequence, num_new: int, in_batch: set[int],
                   batch: ScheduledBatch) -> bool:
        """Get ``seq`` the blocks for ``num_new`` tokens, preempting newer sequences if needed.

        False when ``seq`` itself had to give way (it is then waiting or finished).
        """
        bm = self.block_manager
        while not bm.append(seq, num_new):
            victim = next((s for s in reversed(self.running) if id(s) not in in_batch), None)
            if victim is not None and victim is not seq:
                self._preempt(victim)
                continue
            if len(self.running) > 1:
                self._preempt(seq)  # others hold the blocks; wait for them
            else:
                # Alone and still out of blocks: the pool cannot hold this sequence any longer.
                self.finish(seq, FinishReason.LENGTH)
                batch.finished.append(seq)
            return False
        return True

    def _preempt(self, seq: Sequence) -> None:
        self.running.remove(seq)
        self.block_manager.free(seq)
        seq.status = SequenceStatus.WAITING
        seq.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(seq)
