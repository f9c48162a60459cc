from __future__ import annotations

import random

import pytest

from lockgate.llm.kv_cache import BlockManager, InvariantError
from lockgate.llm.sequence import SamplingParams, Sequence

BS = 4


def make_seq(tokens: list[int], seq_id: str = "s") -> Sequence:
    return Sequence.from_prompt(seq_id, tokens, SamplingParams(), arrival=0.0)


def computed(bm: BlockManager, seq: Sequence) -> None:
    """Pretend the model computed every token of the sequence."""
    seq.num_computed_tokens = seq.num_tokens
    bm.cache_blocks(seq)


def test_allocate_and_free_return_every_block() -> None:
    bm = BlockManager(8, BS)
    seq = make_seq(list(range(10)))
    assert bm.can_allocate(seq)
    bm.allocate(seq)
    assert len(seq.block_table) == 3 and bm.num_free_blocks == 5
    assert bm.usage == pytest.approx(3 / 8)
    bm.check_invariants([seq])
    bm.free(seq)
    assert seq.block_table == [] and bm.num_free_blocks == 8
    bm.check_invariants([])


def test_can_allocate_refuses_when_blocks_run_out() -> None:
    bm = BlockManager(3, BS)
    assert not bm.can_allocate(make_seq(list(range(13))))  # 4 blocks
    assert bm.can_allocate(make_seq(list(range(12))))


def test_prefix_sharing_counts_references_and_hits() -> None:
    bm = BlockManager(16, BS, enable_prefix_caching=True)
    a = make_seq(list(range(10)), "a")
    bm.allocate(a)
    computed(bm, a)
    b = make_seq([*range(8), 50, 51, 52], "b")  # shares two full blocks
    bm.allocate(b)
    assert b.block_table[:2] == a.block_table[:2]
    assert b.block_table[2] != a.block_table[2]
    assert b.num_cached_tokens == 8 and b.num_computed_tokens == 8
    assert [bm.blocks[i].ref_count for i in a.block_table] == [2, 2, 1]
    assert bm.prefix_cache_queries == 21 and bm.prefix_cache_hits == 8
    bm.check_invariants([a, b])
    bm.free(a)
    bm.free(b)
    bm.check_invariants([])


def test_fully_cached_prompt_still_computes_its_last_token() -> None:
    bm = BlockManager(16, BS)
    a = make_seq(list(range(8)), "a")
    bm.allocate(a)
    computed(bm, a)
    b = make_seq(list(range(8)), "b")
    bm.allocate(b)
    assert b.num_cached_tokens == 4  # the last block is recomputed, not shared
    assert b.block_table[0] == a.block_table[0] and b.block_table[1] != a.block_table[1]
    bm.check_invariants([a, b])


def test_same_tokens_after_a_different_prefix_do_not_hit() -> None:
    bm = BlockManager(16, BS)
    a = make_seq([1, 2, 3, 4, 9, 9, 9, 9, 0], "a")
    bm.allocate(a)
    computed(bm, a)
    b = make_seq([5, 6, 7, 8, 9, 9, 9, 9, 0], "b")  # block 2 equal, parent differs
    bm.allocate(b)
    assert b.num_cached_tokens == 0
    assert set(a.block_table).isdisjoint(b.block_table)


def test_a_cache_salt_shares_cached_blocks_only_with_its_own() -> None:
    """vLLM's cache_salt: the same prompt hits the blocks of its salt, never another's."""
    bm = BlockManager(16, BS, enable_prefix_caching=True)
    tokens = list(range(9))

    def salted(salt: str | None, seq_id: str) -> Sequence:
        params = SamplingParams(cache_salt=salt)
        return Sequence.from_prompt(seq_id, tokens, params, arrival=0.0)

    first = salted("alpha", "a")
    bm.allocate(first)
    computed(bm, first)
    assert bm.num_cached_prefix_tokens(salted("alpha", "b")) == 8
    assert bm.num_cached_prefix_tokens(salted("beta", "c")) == 0
    assert bm.num_cached_prefix_tokens(salted(None, "d")) == 0
    bm.check_invariants([first])


def test_blocks_are_published_only_once_computed() -> None:
    bm = BlockManager(16, BS)
    a = make_seq(list(range(12)), "a")
    bm.allocate(a)
    a.num_computed_tokens = 5  # one chunk done: only block 0 is complete
    bm.cache_blocks(a)
    b = make_seq(list(range(12)), "b")
    bm.allocate(b)
    assert b.num_cached_tokens == 4


def test_freed_cached_blocks_survive_and_are_revived() -> None:
    bm = BlockManager(4, BS)
    a = make_seq(list(range(9)), "a")
    bm.allocate(a)
    computed(bm, a)
    cached = a.block_table[:2]
    bm.free(a)
    assert bm.num_free_blocks == 4
    b = make_seq(list(range(9)), "b")
    assert bm.can_allocate(b)
    bm.allocate(b)
    assert b.block_table[:2] == cached and b.num_cached_tokens == 8
    assert bm.num_free_blocks == 1  # revived blocks left the free list
    bm.check_invariants([b])


def test_eviction_is_least_recently_freed_first() -> None:
    bm = BlockManager(4, BS)
    old = make_seq([*list(range(4)), 99], "old")
    new = make_seq([*list(range(10, 14)), 99], "new")
    for seq in (old, new):
        bm.allocate(seq)
        computed(bm, seq)
    old_block, new_block = old.block_table[0], new.block_table[0]
    bm.free(old)
    bm.free(new)
    # unhashed tail blocks go first, then the older cached block
    filler = make_seq(list(range(50, 62)), "filler")  # 3 blocks
    bm.allocate(filler)
    assert old_block in filler.block_table and new_block not in filler.block_table
    assert bm.blocks[new_block].hash is not None
    assert bm.num_cached_prefix_tokens(make_seq([*list(range(10, 14)), 98])) == 4
    assert bm.num_cached_prefix_tokens(make_seq([*list(range(4)), 98])) == 0


def test_evicted_block_is_no_longer_a_hit() -> None:
    bm = BlockManager(2, BS)
    a = make_seq(list(range(5)), "a")
    bm.allocate(a)
    computed(bm, a)
    bm.free(a)
    b = make_seq(list(range(100, 108)), "b")  # needs both blocks: evicts a's
    bm.allocate(b)
    bm.free(b)
    c = make_seq(list(range(5)), "c")
    bm.allocate(c)
    assert c.num_cached_tokens == 0
    bm.check_invariants([c])


def test_append_adds_a_block_at_the_boundary() -> None:
    bm = BlockManager(4, BS)
    seq = make_seq(list(range(4)))
    bm.allocate(seq)
    computed(bm, seq)
    seq.append_token(7)
    assert bm.can_append(seq)
    bm.may_append(seq)
    assert len(seq.block_table) == 2
    seq.append_token(8)
    bm.may_append(seq)  # same block
    assert len(seq.block_table) == 2


def test_check_invariants_catches_a_wrong_ref_count() -> None:
    bm = BlockManager(4, BS)
    seq = make_seq(list(range(4)))
    bm.allocate(seq)
    bm.blocks[seq.block_table[0]].ref_count = 2
    with pytest.raises(InvariantError, match="ref_count"):
        bm.check_invariants([seq])


def test_prefix_caching_off_never_hits() -> None:
    bm = BlockManager(8, BS, enable_prefix_caching=False)
    a = make_seq(list(range(9)), "a")
    bm.allocate(a)
    computed(bm, a)
    b = make_seq(list(range(9)), "b")
    bm.allocate(b)
    assert b.num_cached_tokens == 0 and not bm.hash_to_block_id


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_random_operations_keep_invariants(seed: int) -> None:
    rng = random.Random(seed)
    bm = BlockManager(24, BS)
    prefixes = [[rng.randrange(5) for _ in range(rng.randrange(1, 12))] for _ in range(4)]
    live: list[Sequence] = []
    for step in range(3000):
        op = rng.random()
        if op < 0.3:  # new sequence, often sharing a prefix
            tokens = rng.choice(prefixes) + [rng.randrange(5) for _ in range(rng.randrange(0, 9))]
            seq = make_seq(tokens, f"s{step}")
            if bm.can_allocate(seq):
                bm.allocate(seq)
                live.append(seq)
        elif op < 0.65 and live:  # compute a chunk, or decode one token
            seq = rng.choice(live)
            if seq.num_computed_tokens < seq.num_tokens:
                seq.num_computed_tokens = min(
                    seq.num_tokens, seq.num_computed_tokens + rng.randrange(1, 6)
                )
                bm.cache_blocks(seq)
            else:
                seq.append_token(rng.randrange(5))
                if bm.can_append(seq):
                    bm.may_append(seq)
                else:  # out of blocks: preempt it
                    bm.free(seq)
                    live.remove(seq)
        elif live:  # finish or preempt
            seq = live.pop(rng.randrange(len(live)))
            bm.free(seq)
        if step % 50 == 0:
            bm.check_invariants(live)
    bm.check_invariants(live)
    for seq in live:
        bm.free(seq)
    bm.check_invariants([])
    assert bm.num_free_blocks == bm.num_total_blocks
    assert bm.prefix_cache_hits > 0


def test_prefix_keys_are_blake2b_chained_and_a_match_checks_ancestry() -> None:
    from lockgate.llm.kv_cache import _ROOT_HASH, chain_hash

    first = chain_hash(_ROOT_HASH, [1, 2, 3, 4])
    assert isinstance(first, bytes) and len(first) == 16
    assert chain_hash(_ROOT_HASH, [1, 2, 3, 4]) == first  # deterministic across processes
    assert chain_hash(first, [5, 6, 7, 8]) != chain_hash(_ROOT_HASH, [5, 6, 7, 8])
    bm = BlockManager(16, 4)
    a = make_seq(list(range(12)), "a")
    bm.allocate(a)
    a.num_computed_tokens = 12
    bm.cache_blocks(a)
    # a block whose hash matches but whose recorded parent is another one is not shared
    second = bm.blocks[a.block_table[1]]
    second.parent = b"someone else's block"
    b = make_seq([*range(12), 99], "b")
    assert bm.can_allocate(b)
    bm.allocate(b)
    assert b.num_cached_tokens == 4  # the first block only
    bm.check_invariants([a, b])
