"""Paged KV-cache bookkeeping: block ids, reference counts and automatic prefix caching.

Pure bookkeeping over integers; the tensors live with the model. A block holds the K/V of
`block_size` consecutive tokens of a sequence. Once a block is full and computed, it is
published under a hash chained from its parent block's hash, so a later sequence whose
prompt starts with the same tokens reuses it instead of computing it again. The hash is a
BLAKE2b digest of the parent's hash and the block's token ids (collision-resistant: a crafted
prompt cannot land on another request's cached block, as Python's `hash()` allowed), and a
match also checks the block's tokens and its parent's hash. Freed blocks keep
their contents and hash; they are evicted least recently freed first when a fresh block is
needed.
"""

from __future__ import annotations

import hashlib
from array import array
from collections import Counter, OrderedDict
from collections.abc import Iterable
from dataclasses import dataclass

from lockgate.llm.sequence import Sequence

_ROOT_HASH = b"lockgate-kv-root"


class InvariantError(AssertionError):
    """The allocator's state contradicts itself: a bug, never a client error."""


@dataclass(slots=True)
class Block:
    block_id: int
    ref_count: int = 0
    hash: bytes | None = None  # set once the block is full, computed and published
    token_ids: tuple[int, ...] = ()  # the tokens behind `hash`, to rule out collisions
    parent: bytes | None = None  # the hash of the block before it in its sequence


def root_hash(seq: Sequence) -> bytes:
    """The parent hash of a sequence's first block: one for all, or its cache salt's (vLLM's
    cache_salt: only sequences of the same salt share cached blocks)."""
    salt = seq.params.cache_salt
    if salt is None:
        return _ROOT_HASH
    return hashlib.blake2b(_ROOT_HASH + b"\0" + salt.encode(), digest_size=16).digest()


def chain_hash(parent_hash: bytes, token_ids: Iterable[int]) -> bytes:
    """BLAKE2b (16 bytes) of the parent block's hash and this block's token ids."""
    digest = hashlib.blake2b(parent_hash, digest_size=16)
    digest.update(array("q", token_ids).tobytes())
    return digest.digest()


class BlockManager:
    """Allocates KV blocks to sequences; methods come in check/act pairs."""

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True):
        if num_blocks < 1 or block_size < 1:
            raise ValueError(
                f"need num_blocks >= 1 and block_size >= 1, got {num_blocks}, {block_size}"
            )
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.blocks = [Block(i) for i in range(num_blocks)]
        self.free_blocks: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        self.hash_to_block_id: dict[bytes, int] = {}
        self.prefix_cache_queries = 0  # tokens looked up
        self.prefix_cache_hits = 0  # tokens found

    @property
    def num_total_blocks(self) -> int:
        return len(self.blocks)

    @property
    def num_free_blocks(self) -> int:
        return len(self.free_blocks)

    @property
    def usage(self) -> float:
        return 1.0 - len(self.free_blocks) / len(self.blocks)

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def num_cached_prefix_tokens(self, seq: Sequence) -> int:
        """Tokens `allocate` would serve from the prefix cache right now."""
        return len(self._cached_prefix(seq)) * self.block_size

    # allocate: all blocks for a sequence's current tokens, reusing its cached prefix

    def can_allocate(self, seq: Sequence) -> bool:
        hits = self._cached_prefix(seq)
        revived = sum(1 for b in hits if self.blocks[b].ref_count == 0)
        fresh = self.blocks_needed(seq.num_tokens) - len(hits)
        return len(self.free_blocks) - revived >= fresh

    def allocate(self, seq: Sequence) -> None:
        if seq.block_table:
            raise InvariantError(f"sequence {seq.seq_id} already holds blocks")
        hits = self._cached_prefix(seq)
        for block_id in hits:
            self._reference(block_id)
        fresh = self.blocks_needed(seq.num_tokens) - len(hits)
        seq.block_table = hits + [self._take_free_block() for _ in range(fresh)]
        seq.num_hashed_blocks = len(hits)
        seq.num_cached_tokens = len(hits) * self.block_size
        seq.num_computed_tokens = seq.num_cached_tokens
        if self.enable_prefix_caching:
            self.prefix_cache_queries += seq.num_tokens
            self.prefix_cache_hits += seq.num_cached_tokens

    # append: room for the sequence's newest token (decode), and `lookahead` positions after
    # it (draft tokens of speculative decoding)

    def can_append(self, seq: Sequence, lookahead: int = 0) -> bool:
        missing = self.blocks_needed(seq.num_tokens + lookahead) - len(seq.block_table)
        return missing <= len(self.free_blocks)

    def may_append(self, seq: Sequence, lookahead: int = 0) -> None:
        while len(seq.block_table) < self.blocks_needed(seq.num_tokens + lookahead):
            seq.block_table.append(self._take_free_block())

    def trim(self, seq: Sequence, num_tokens: int) -> None:
        """Keep the blocks that hold the sequence's first `num_tokens` positions and free the
        rest, tail first (they held rejected draft tokens: never published, handed out first)."""
        keep = self.blocks_needed(num_tokens)
        if keep < seq.num_hashed_blocks:
            raise InvariantError(f"sequence {seq.seq_id}: trimming published blocks")
        while len(seq.block_table) > keep:
            self._release(seq.block_table.pop())

    def free(self, seq: Sequence) -> None:
        """Drop the sequence's references; the tail is freed first so it is evicted first."""
        for block_id in reversed(seq.block_table):
            self._release(block_id)
        seq.block_table = []
        seq.num_hashed_blocks = 0

    def cache_blocks(self, seq: Sequence) -> None:
        """Publish the sequence's blocks that became full and computed."""
        if not self.enable_prefix_caching:
            return
        num_full = seq.num_computed_tokens // self.block_size
        if num_full <= seq.num_hashed_blocks:
            return
        hashes = self._block_hashes(seq, num_full)
        bs = self.block_size
        for i in range(seq.num_hashed_blocks, num_full):
            block = self.blocks[seq.block_table[i]]
            if block.hash is None and hashes[i] not in self.hash_to_block_id:
                block.hash = hashes[i]
                block.parent = hashes[i - 1] if i else root_hash(seq)
                block.token_ids = tuple(seq.token_ids[i * bs : (i + 1) * bs])
                self.hash_to_block_id[hashes[i]] = block.block_id
        seq.num_hashed_blocks = num_full

    def _block_hashes(self, seq: Sequence, num_full: int) -> list[bytes]:
        """Chained hashes of the sequence's first `num_full` full blocks (memoized on it)."""
        hashes, bs = seq.block_hashes, self.block_size
        for i in range(len(hashes), num_full):
            parent = hashes[i - 1] if i else root_hash(seq)
            hashes.append(chain_hash(parent, seq.token_ids[i * bs : (i + 1) * bs]))
        return hashes

    def _cached_prefix(self, seq: Sequence) -> list[int]:
        """Block ids of the longest cached prefix, leaving at least one token to compute."""
        if not (self.enable_prefix_caching and seq.reads_prefix_cache):
            return []
        bs = self.block_size
        hits: list[int] = []
        parent = root_hash(seq)
        for i, h in enumerate(self._block_hashes(seq, seq.num_tokens // bs)):
            block_id = self.hash_to_block_id.get(h)
            if block_id is None:
                break
            block = self.blocks[block_id]
            if block.parent != parent or block.token_ids != tuple(
                seq.token_ids[i * bs : (i + 1) * bs]
            ):
                break  # same hash, another history: never share it
            hits.append(block_id)
            parent = h
        if hits and len(hits) * bs >= seq.num_tokens:
            hits.pop()  # the last token must be computed to produce logits
        return hits

    def _release(self, block_id: int) -> None:
        block = self.blocks[block_id]
        block.ref_count -= 1
        if block.ref_count == 0:
            self.free_blocks[block_id] = None
            if block.hash is None:  # nothing worth keeping: hand it out first
                self.free_blocks.move_to_end(block_id, last=False)

    def _reference(self, block_id: int) -> None:
        block = self.blocks[block_id]
        if block.ref_count == 0:
            del self.free_blocks[block_id]
        block.ref_count += 1

    def _take_free_block(self) -> int:
        if not self.free_blocks:
            raise InvariantError("no free KV block: call can_allocate/can_append first")
        block_id, _ = self.free_blocks.popitem(last=False)
        block = self.blocks[block_id]
        if block.hash is not None:  # evict its cached contents
            del self.hash_to_block_id[block.hash]
            block.hash, block.token_ids, block.parent = None, (), None
        block.ref_count = 1
        return block_id

    def check_invariants(self, seqs: Iterable[Sequence]) -> None:
        """Raise InvariantError unless ref counts, free list and hash map agree with `seqs`."""
        refs = Counter(b for seq in seqs for b in seq.block_table)
        for block in self.blocks:
            if block.ref_count != refs[block.block_id]:
                raise InvariantError(
                    f"block {block.block_id}: ref_count {block.ref_count}, "
                    f"referenced by {refs[block.block_id]} block tables"
                )
            if (block.ref_count == 0) != (block.block_id in self.free_blocks):
                raise InvariantError(f"block {block.block_id}: free list disagrees with ref_count")
            if block.hash is not None and self.hash_to_block_id.get(block.hash) != block.block_id:
                raise InvariantError(f"block {block.block_id}: hash not mapped back to it")
        used = sum(1 for block in self.blocks if block.ref_count > 0)
        if used + len(self.free_blocks) != len(self.blocks):
            raise InvariantError(
                f"{used} used + {len(self.free_blocks)} free != {len(self.blocks)}"
            )
        for h, block_id in self.hash_to_block_id.items():
            if self.blocks[block_id].hash != h:
                raise InvariantError(
                    f"hash map points {h.hex()} at block {block_id} with another hash"
                )
