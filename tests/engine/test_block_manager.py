"""BlockManager: paging, reference counts, block 0 reserved, prefix sharing and eviction."""
import pytest

from lmjax.engine.block_manager import BlockManager
from lmjax.engine.sequence import Sequence

BS = 4


def seq(seq_id, tokens):
    return Sequence(seq_id=seq_id, prompt_token_ids=list(tokens))


def compute(bm, s, n):
    """What the scheduler + step do for `n` new tokens: allocate, 'compute', register."""
    bm.append(s, n)
    s.num_computed_tokens += n
    bm.register_full_blocks(s)


def test_allocate_and_free_return_blocks_and_never_block_zero():
    bm = BlockManager(num_blocks=8, block_size=BS)
    assert bm.num_free_blocks == 7 and bm.usage == 0.0
    a = seq(1, range(10))
    bm.append(a, 10)
    assert len(a.block_table) == 3 and 0 not in a.block_table
    assert bm.num_free_blocks == 4
    assert all(bm.ref_counts[b] == 1 for b in a.block_table)
    a.num_computed_tokens = 10
    bm.append(a, 2)  # positions 10, 11 still fit block 3
    assert len(a.block_table) == 3
    bm.append(a, 3)  # position 12.. needs a 4th block
    assert len(a.block_table) == 4
    assert bm.slot(a, 5) == a.block_table[1] * BS + 1
    assert bm.slots(a, 3, 3) == [bm.slot(a, p) for p in (3, 4, 5)]
    bm.free(a)
    assert a.block_table == [] and bm.num_free_blocks == 7
    assert bm.ref_counts == [0] * 8


def test_exhaustion():
    bm = BlockManager(num_blocks=4, block_size=BS)  # 3 usable blocks = 12 slots
    a, b = seq(1, range(8)), seq(2, range(8))
    assert bm.can_append(a, 8)
    bm.append(a, 8)
    assert bm.can_append(b, 4) and not bm.can_append(b, 5)
    assert not bm.can_append(b, 4, reserve=1)
    with pytest.raises(RuntimeError, match="out of KV blocks"):
        bm.append(b, 8)
    bm.append(b, 4)
    assert bm.num_free_blocks == 0 and bm.usage == 1.0
    assert sorted(a.block_table + b.block_table) == [1, 2, 3]


def test_block_zero_never_handed_out_under_churn():
    bm = BlockManager(num_blocks=5, block_size=2, enable_prefix_caching=True)
    for i in range(50):
        s = seq(i, [i % 3] * (1 + i % 8))
        bm.match_prefix(s)
        compute(bm, s, s.num_uncomputed)
        assert 0 not in s.block_table
        bm.free(s)
    assert bm.num_free_blocks == 4 and bm.ref_counts[0] == 0


def test_prefix_sharing_of_a_common_three_block_prefix():
    bm = BlockManager(num_blocks=16, block_size=BS, enable_prefix_caching=True)
    prefix = list(range(100, 112))  # 3 full blocks
    a, b = seq(1, prefix + [1, 2]), seq(2, prefix + [7, 8, 9])
    assert bm.match_prefix(a) == 0
    compute(bm, a, a.num_uncomputed)
    assert bm.match_prefix(b) == 12
    assert b.num_computed_tokens == b.num_prefix_cached_tokens == 12
    assert b.block_table == a.block_table[:3]
    assert [bm.ref_counts[x] for x in a.block_table] == [2, 2, 2, 1]
    compute(bm, b, b.num_uncomputed)
    assert b.block_table[3] != a.block_table[3]  # the partial block is private
    assert bm.prefix_cache_queries == 14 + 15 and bm.prefix_cache_hits == 12
    assert bm.hit_rate == pytest.approx(12 / 29)
    bm.free(a)
    assert [bm.ref_counts[x] for x in b.block_table] == [1, 1, 1, 1]
    bm.free(b)
    assert bm.num_free_blocks == 15


def test_fully_cached_sequence_leaves_its_last_block_uncomputed():
    bm = BlockManager(num_blocks=16, block_size=BS, enable_prefix_caching=True)
    a = seq(1, range(12))
    compute(bm, a, 12)
    b = seq(2, range(12))  # the same 3 full blocks
    assert bm.match_prefix(b) == 8
    assert b.num_uncomputed == 4 and b.block_table == a.block_table[:2]
    c = seq(3, range(13))  # one token past the cached blocks: all 3 shared
    assert bm.match_prefix(c) == 12 and c.num_uncomputed == 1


def test_match_stops_at_first_miss_and_hash_depends_on_the_parent():
    bm = BlockManager(num_blocks=16, block_size=BS, enable_prefix_caching=True)
    a = seq(1, [1, 1, 1, 1, 2, 2, 2, 2, 3])
    compute(bm, a, 9)
    b = seq(2, [9, 9, 9, 9, 2, 2, 2, 2, 3])  # same 2nd block, different parent
    assert bm.match_prefix(b) == 0
    c = seq(3, [1, 1, 1, 1, 5, 5, 5, 5, 3])
    assert bm.match_prefix(c) == 4


def test_freed_cached_blocks_are_reused_by_hash_then_evicted_lru():
    bm = BlockManager(num_blocks=5, block_size=BS, enable_prefix_caching=True)  # 4 usable
    a = seq(1, range(9))  # 2 full blocks + 1 partial
    compute(bm, a, 9)
    full = a.block_table[:2]
    bm.free(a)
    assert bm.num_free_blocks == 4  # cached blocks count as free
    b = seq(2, range(9))
    assert bm.match_prefix(b) == 8 and b.block_table == full
    assert bm.num_free_blocks == 2
    bm.free(b)
    # A stranger takes 3 blocks: the one plain free block first, then the LRU cached ones.
    # free(b) released the tail first, so full[1] is older than full[0] and goes first.
    c = seq(3, [50] * 12)
    compute(bm, c, 12)
    assert full[1] in c.block_table and full[0] not in c.block_table
    d = seq(4, range(9))
    assert bm.match_prefix(d) == 4 and d.block_table == [full[0]]


def test_a_reused_block_loses_its_hash():
    bm = BlockManager(num_blocks=3, block_size=BS, enable_prefix_caching=True)  # 2 usable
    a = seq(1, range(5))
    compute(bm, a, 5)
    first = a.block_table[0]
    h = bm.block_hash[first]
    assert h is not None and bm.hash_to_block[h] == first
    bm.free(a)
    c = seq(2, [7] * 8)
    bm.append(c, 8)  # needs both blocks: evicts the cached one
    assert first in c.block_table and bm.block_hash[first] is None and h not in bm.hash_to_block
    c.num_computed_tokens = 2  # half full: not registered
    bm.register_full_blocks(c)
    assert all(bm.block_hash[x] is None for x in c.block_table)
    bm.free(c)
    assert bm.match_prefix(seq(3, range(5))) == 0


def test_twin_blocks_computed_concurrently_stay_private():
    bm = BlockManager(num_blocks=8, block_size=BS, enable_prefix_caching=True)
    a, b = seq(1, range(6)), seq(2, range(6))
    bm.match_prefix(a), bm.match_prefix(b)  # both miss: nothing cached yet
    compute(bm, a, 6)
    compute(bm, b, 6)
    assert a.block_table[0] != b.block_table[0]
    a0, b0 = a.block_table[0], b.block_table[0]
    assert bm.hash_to_block[a.block_hashes[0]] == a0  # the first registration wins
    bm.free(a), bm.free(b)
    assert bm.num_free_blocks == 7
    assert bm.block_hash[b0] is None  # the twin is not the registered copy: plain free block
    c = seq(3, range(6))
    assert bm.match_prefix(c) == 4 and c.block_table == [a0] and bm.ref_counts[a0] == 1


def test_cancel_admission_undoes_the_match():
    bm = BlockManager(num_blocks=8, block_size=BS, enable_prefix_caching=True)
    a = seq(1, range(9))
    compute(bm, a, 9)
    q, h = bm.prefix_cache_queries, bm.prefix_cache_hits
    b = seq(2, range(10))
    assert bm.match_prefix(b) == 8
    bm.cancel_admission(b)
    assert b.block_table == [] and b.num_computed_tokens == 0
    assert (bm.prefix_cache_queries, bm.prefix_cache_hits) == (q, h)
    assert [bm.ref_counts[x] for x in a.block_table] == [1, 1, 1]


def test_prefix_caching_off_matches_nothing():
    bm = BlockManager(num_blocks=8, block_size=BS)
    a = seq(1, range(9))
    compute(bm, a, 9)
    assert bm.match_prefix(seq(2, range(9))) == 0 and bm.prefix_cache_queries == 0
    assert all(h is None for h in bm.block_hash)


def test_sequence_token_views():
    s = Sequence(seq_id=1, prompt_token_ids=[1, 2, 3], output_token_ids=[4, 5])
    assert s.token_ids == [1, 2, 3, 4, 5] and s.num_tokens == 5 and s.num_prompt_tokens == 3
    assert [s.token_slice(a, b) for a, b in [(0, 2), (1, 4), (3, 5), (0, 5)]] == [
        [1, 2], [2, 3, 4], [4, 5], [1, 2, 3, 4, 5]]
    s.num_computed_tokens = 4
    assert s.num_uncomputed == 1 and s.last_token_id == 5
    assert Sequence(seq_id=2, prompt_token_ids=[9]).arrival > s.arrival
    with pytest.raises(ValueError, match="empty prompt"):
        Sequence(seq_id=3, prompt_token_ids=[])
