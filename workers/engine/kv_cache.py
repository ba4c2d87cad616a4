"""The paged KV cache's bookkeeping: which block holds what, who uses it, what can be reused.

The cache is a pool of ``num_blocks`` fixed-size blocks (``block_size`` token slots each). A
sequence owns a block table, the list of its blocks in order. Blocks are reference-counted so that
sequences whose prompts start alike share the blocks of the common prefix (prefix caching).

A full block is known by a hash chained over every token up to its end, so a hash identifies the
whole prefix, not just the block's own tokens. When the last user of a hashed block lets go, the
block keeps its contents and stays findable; such unreferenced cached blocks are reused in LRU
order only when no never-used block is left. This class never hands out more blocks than the pool
has: callers ask, and get ``False``/``0`` when it does not fit.

Only the engine's step loop calls into this; it is not thread-safe.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from typing import Protocol

_ROOT_HASH = 0x5EED  # the "previous block" hash of a sequence's first block


def chain_hash(prev_hash: int, tokens: tuple[int, ...]) -> int:
    """Hash of a block given the hash of everything before it. Deterministic across runs."""
    return hash((prev_hash, tokens))


class HasBlocks(Protocol):
    """The part of a Sequence the block manager reads and writes."""

    token_ids: list[int]
    block_table: list[int]
    block_hashes: list[int]
    num_committed_blocks: int
    num_computed_tokens: int
    uses_prefix_cache: bool  # False: computes its whole prompt (its blocks are still cached for others)


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, *, enable_prefix_caching: bool = True):
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {num_blocks}")
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.ref_counts = [0] * num_blocks
        self._block_hash: list[int | None] = [None] * num_blocks
        self._block_tokens: list[tuple[int, ...] | None] = [None] * num_blocks
        self._hash_to_block: dict[int, int] = {}
        self._free: deque[int] = deque(range(num_blocks))  # unreferenced, holding nothing useful
        self._evictable: OrderedDict[int, None] = OrderedDict()  # unreferenced cached, LRU first
        # Prefix-cache statistics, in tokens.
        self.prefix_queries = 0
        self.prefix_hits = 0

    # ----------------------------------------------------------------------------------- sizes

    @property
    def num_free_blocks(self) -> int:
        """Blocks a caller can get now (never used, or cached but unreferenced)."""
        return len(self._free) + len(self._evictable)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - self.num_free_blocks

    @property
    def num_cached_blocks(self) -> int:
        return len(self._hash_to_block)

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    # ----------------------------------------------------------------------- sequence lifetime

    def admit(self, seq: HasBlocks, token_budget: int, *, reserve: int = 0,
              allow_partial: bool = False) -> int:
        """Give a sequence that holds no blocks its cached prefix and the blocks of its first chunk.

        Returns how many tokens the sequence should compute now (``num_computed_tokens`` is set
        past the cached prefix), or 0 when the chunk does not fit while keeping ``reserve``
        blocks free, in which case nothing changed. ``allow_partial`` shrinks the chunk to the
        blocks there are instead (for a sequence that has the whole pool to itself).
        """
        assert not seq.block_table, "admit() is for sequences without blocks"
        cached = self._match_prefix(seq)
        num_cached_tokens = len(cached) * self.block_size
        num_new = min(len(seq.token_ids) - num_cached_tokens, token_budget)
        if num_new <= 0:
            return 0
        needed = self.blocks_for(num_cached_tokens + num_new) - len(cached)
        # Reviving a cached block takes it out of the free count, like a fresh allocation.
        revived = sum(1 for b in cached if self.ref_counts[b] == 0)
        available = self.num_free_blocks - revived - reserve
        if available < needed:
            if not allow_partial:
                return 0
            num_new = (len(cached) + available) * self.block_size - num_cached_tokens
            if num_new <= 0:
                return 0
            needed = self.blocks_for(num_cached_tokens + num_new) - len(cached)
        for block in cached:
            self._acquire(block)
        seq.block_table = cached
        seq.num_committed_blocks = len(cached)
        seq.num_computed_tokens = num_cached_tokens
        if self.enable_prefix_caching:
            self.prefix_queries += len(seq.token_ids)
            self.prefix_hits += num_cached_tokens
        for _ in range(needed):
            seq.block_table.append(self._take_free_block())
        return num_new

    def can_append(self, seq: HasBlocks, num_new_tokens: int) -> bool:
        needed = self.blocks_for(seq.num_computed_tokens + num_new_tokens) - len(seq.block_table)
        return needed <= self.num_free_blocks

    def append(self, seq: HasBlocks, num_new_tokens: int) -> bool:
        """Grow a running sequence's table to hold ``num_new_tokens`` more. False = no room."""
        needed = self.blocks_for(seq.num_computed_tokens + num_new_tokens) - len(seq.block_table)
        if needed > self.num_free_blocks:
            return False
        for _ in range(needed):
            seq.block_table.append(self._take_free_block())
        return True

    def commit(self, seq: HasBlocks, num_computed_tokens: int) -> None:
        """Make the blocks that ``num_computed_tokens`` fills findable by later requests.

        Called when a step is scheduled: a request admitted later in the same step may share
        them, which is safe because each layer writes the whole step's K/V before attending.
        """
        if not self.enable_prefix_caching:
            return
        num_full = min(num_computed_tokens, len(seq.token_ids)) // self.block_size
        first = seq.num_committed_blocks  # blocks before it were dealt with at earlier steps
        if num_full <= first:
            return
        self._extend_hashes(seq, num_full)
        seq.num_committed_blocks = num_full
        for index in range(first, num_full):
            block = seq.block_table[index]
            if self._block_hash[block] is not None:
                continue
            block_hash = seq.block_hashes[index]
            if block_hash in self._hash_to_block:
                continue  # another block already caches this prefix; keep that one
            self._block_hash[block] = block_hash
            start = index * self.block_size
            self._block_tokens[block] = tuple(seq.token_ids[start:start + self.block_size])
            self._hash_to_block[block_hash] = block

    def free(self, seq: HasBlocks, *, invalidate: bool = False) -> None:
        """Release a sequence's blocks. ``invalidate`` forgets their contents (a failed step)."""
        # Tail first: among equally old cached blocks, the longest prefixes are evicted first.
        for block in reversed(seq.block_table):
            if invalidate:
                self._forget(block)
            self.ref_counts[block] -= 1
            assert self.ref_counts[block] >= 0
            if self.ref_counts[block] == 0:
                if self._block_hash[block] is not None:
                    self._evictable[block] = None
                else:
                    self._free.append(block)
        seq.block_table = []
        seq.num_committed_blocks = 0
        seq.num_computed_tokens = 0

    def reset_prefix_cache(self) -> None:
        """Forget every cached block nobody is using."""
        while self._evictable:
            block, _ = self._evictable.popitem(last=False)
            self._forget(block)
            self._free.append(block)

    # -------------------------------------------------------------------------------- helpers

    def _extend_hashes(self, seq: HasBlocks, num_full_blocks: int) -> None:
        hashes = seq.block_hashes
        tokens = seq.token_ids
        size = self.block_size
        prev = hashes[-1] if hashes else _ROOT_HASH
        for index in range(len(hashes), num_full_blocks):
            prev = chain_hash(prev, tuple(tokens[index * size:(index + 1) * size]))
            hashes.append(prev)

    def _match_prefix(self, seq: HasBlocks) -> list[int]:
        """The cached blocks holding the longest prefix of the sequence's tokens.

        At least one token is always left to compute: its logits give the next token.
        """
        if not self.enable_prefix_caching or not seq.uses_prefix_cache:
            return []
        num_candidates = (len(seq.token_ids) - 1) // self.block_size
        self._extend_hashes(seq, num_candidates)
        matched: list[int] = []
        size = self.block_size
        for index in range(num_candidates):
            block = self._hash_to_block.get(seq.block_hashes[index])
            if block is None:
                break
            start = index * size
            if self._block_tokens[block] != tuple(seq.token_ids[start:start + size]):
                break  # a hash collision: treat as a miss
            matched.append(block)
        return matched

    def _acquire(self, block: int) -> None:
        if self.ref_counts[block] == 0:
            self._evictable.pop(block, None)
        self.ref_counts[block] += 1

    def _take_free_block(self) -> int:
        if self._free:
            block = self._free.popleft()
        else:
            block, _ = self._evictable.popitem(last=False)  # least recently used
            self._forget(block)
        assert self.ref_counts[block] == 0
        self.ref_counts[block] = 1
        return block

    def _forget(self, block: int) -> None:
        block_hash = self._block_hash[block]
        if block_hash is not None:
            if self._hash_to_block.get(block_hash) == block:
                del self._hash_to_block[block_hash]
            self._block_hash[block] = None
            self._block_tokens[block] = None
