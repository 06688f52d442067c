"""The paged-cache bookkeeping: BlockAllocator, StateSlotPool (through ModelCache), ModelCache,
CacheSpec validation and plan_num_blocks.

Expected values are written out by hand from the documented layouts and rules in
metrale/cache/{blocks,spec,store}.py, never read back from the code under test.
"""

from __future__ import annotations

import math

import numpy as np
import pytest

from metrale.backends.base import CpuBackend
from metrale.cache import (
    BlockAllocator,
    CacheSpec,
    ModelCache,
    PagedKVSpec,
    PagedLatentSpec,
    RecurrentStateSpec,
)
from metrale.cache.store import plan_num_blocks
from metrale.errors import CacheError, ConfigError, OutOfCacheBlocksError
from metrale.sequence import SequenceState


def _seq(length: int = 3) -> SequenceState:
    return SequenceState.from_prompt(list(range(1, length + 1)))


def _ref_counts(allocator: BlockAllocator) -> list[int]:
    return [allocator.ref_count(b) for b in range(1, allocator.num_blocks + 1)]


# ================================================================================ BlockAllocator


def test_allocator_hands_out_every_block_but_the_dummy():
    allocator = BlockAllocator(6)
    blocks = allocator.allocate(6)
    assert sorted(blocks) == [1, 2, 3, 4, 5, 6]
    assert 0 not in blocks
    assert allocator.num_free == 0
    assert all(allocator.ref_count(b) == 1 for b in blocks)
    with pytest.raises(OutOfCacheBlocksError):
        allocator.allocate(1)


def test_allocator_blocks_are_distinct_across_calls():
    allocator = BlockAllocator(10)
    first = allocator.allocate(3)
    second = allocator.allocate(4)
    assert len(set(first) | set(second)) == 7
    assert set(first).isdisjoint(second)
    assert allocator.num_free == 3


def test_allocate_is_all_or_nothing():
    allocator = BlockAllocator(5)
    held = allocator.allocate(3)
    before = _ref_counts(allocator)
    with pytest.raises(OutOfCacheBlocksError) as info:
        allocator.allocate(3)
    assert isinstance(info.value, CacheError)
    # Nothing was taken: the two free blocks are still free and still allocatable.
    assert allocator.num_free == 2
    assert _ref_counts(allocator) == before
    rest = allocator.allocate(2)
    assert sorted(held + rest) == [1, 2, 3, 4, 5]


def test_allocate_zero_takes_nothing():
    allocator = BlockAllocator(3)
    assert allocator.allocate(0) == []
    assert allocator.num_free == 3


def test_free_returns_blocks_for_reuse():
    allocator = BlockAllocator(4)
    blocks = allocator.allocate(4)
    allocator.free(blocks[1:3])
    assert allocator.num_free == 2
    assert allocator.ref_count(blocks[1]) == 0 and allocator.ref_count(blocks[2]) == 0
    assert allocator.ref_count(blocks[0]) == 1 and allocator.ref_count(blocks[3]) == 1
    again = allocator.allocate(2)
    assert sorted(again) == sorted(blocks[1:3])
    with pytest.raises(OutOfCacheBlocksError):
        allocator.allocate(1)


def test_shared_block_is_freed_only_when_every_reference_is_dropped():
    allocator = BlockAllocator(3)
    (block,) = allocator.allocate(1)
    allocator.share(block)
    allocator.share(block)
    assert allocator.ref_count(block) == 3
    allocator.free([block])
    assert allocator.ref_count(block) == 2
    assert allocator.num_free == 2
    allocator.free([block, block])  # two references in one call: allowed, it has two
    assert allocator.ref_count(block) == 0
    assert allocator.num_free == 3


def test_double_free_raises():
    allocator = BlockAllocator(3)
    (block,) = allocator.allocate(1)
    allocator.free([block])
    with pytest.raises(CacheError):
        allocator.free([block])
    assert allocator.num_free == 3  # the free list did not gain a duplicate
    assert sorted(allocator.allocate(3)) == [1, 2, 3]


def test_freeing_a_never_allocated_block_raises():
    allocator = BlockAllocator(3)
    allocator.allocate(1)
    with pytest.raises(CacheError):
        allocator.free([3])


@pytest.mark.parametrize("block", [0, -1, 5, 100])
def test_freeing_an_id_out_of_range_raises(block):
    allocator = BlockAllocator(4)
    allocator.allocate(4)
    with pytest.raises(CacheError):
        allocator.free([block])
    assert allocator.num_free == 0


def test_freeing_one_block_twice_beyond_its_refcount_raises_and_changes_nothing():
    allocator = BlockAllocator(4)
    a, b = allocator.allocate(2)
    before = _ref_counts(allocator)
    with pytest.raises(CacheError):
        allocator.free([a, b, a])
    assert _ref_counts(allocator) == before
    assert allocator.num_free == 2


def test_free_with_one_bad_id_frees_none_of_the_good_ones():
    allocator = BlockAllocator(4)
    a, b = allocator.allocate(2)
    with pytest.raises(CacheError):
        allocator.free([a, 7])
    assert allocator.ref_count(a) == 1 and allocator.ref_count(b) == 1
    assert allocator.num_free == 2


@pytest.mark.parametrize("block", [0, 4, 2])
def test_share_rejects_dummy_out_of_range_and_free_blocks(block):
    allocator = BlockAllocator(3)
    allocator.allocate(1)  # block 1 allocated; 2 is free, 0 is the dummy, 4 is out of range
    with pytest.raises(CacheError):
        allocator.share(block)


@pytest.mark.parametrize("num_blocks", [0, -3])
def test_allocator_needs_a_block(num_blocks):
    with pytest.raises(CacheError):
        BlockAllocator(num_blocks)


def test_dummy_block_survives_many_allocate_free_cycles():
    rng = np.random.default_rng(7)
    allocator = BlockAllocator(8)
    held: list[int] = []
    for _ in range(300):
        if held and rng.random() < 0.5:
            count = int(rng.integers(1, len(held) + 1))
            picks = [held.pop(int(rng.integers(0, len(held)))) for _ in range(count)]
            allocator.free(picks)
        else:
            count = int(rng.integers(0, allocator.num_free + 1))
            got = allocator.allocate(count)
            assert 0 not in got
            assert set(got).isdisjoint(held)
            held.extend(got)
        assert allocator.num_free == 8 - len(held)
        assert allocator.ref_count(0) == 0


# ======================================================================== state slots via ModelCache

STATE = RecurrentStateSpec(conv_shape=(6, 3), state_shape=(2, 4, 5))


def _state_cache(num_state_slots: int = 3) -> ModelCache:
    spec = CacheSpec((PagedKVSpec(2, 4), STATE, RecurrentStateSpec(conv_shape=(5,), state_shape=(3, 2))))
    return ModelCache(spec, CpuBackend(), block_size=4, num_blocks=8, num_state_slots=num_state_slots)


def _state_layers(cache: ModelCache):
    return [layer for layer in cache.layers if hasattr(layer, "state")]


def test_state_layers_have_the_documented_shapes_and_dtypes():
    cache = _state_cache(num_state_slots=3)
    first, second = _state_layers(cache)
    assert first.conv.shape == (4, 6, 3) and first.state.shape == (4, 2, 4, 5)
    assert second.conv.shape == (4, 5) and second.state.shape == (4, 3, 2)
    assert first.state.dtype == np.float32 and second.state.dtype == np.float32
    assert first.conv.dtype == np.dtype(CpuBackend.cache_dtype)


def test_state_slot_is_zeroed_on_allocation_after_a_previous_owner_wrote_to_it():
    cache = _state_cache(num_state_slots=2)
    rng = np.random.default_rng(11)
    owner, bystander = _seq(), _seq()
    cache.reserve(owner, 3)
    cache.reserve(bystander, 3)
    slot, other = owner.state_slot, bystander.state_slot
    assert slot != other
    for layer in _state_layers(cache):
        layer.conv[slot] = rng.standard_normal(layer.conv[slot].shape) + 3.0
        layer.state[slot] = rng.standard_normal(layer.state[slot].shape) - 3.0
        layer.conv[other] = rng.standard_normal(layer.conv[other].shape) + 5.0
        layer.state[other] = rng.standard_normal(layer.state[other].shape) + 5.0
    kept = [(layer.conv[other].copy(), layer.state[other].copy()) for layer in _state_layers(cache)]
    assert all(np.abs(layer.conv[slot]).min() > 0 for layer in _state_layers(cache))

    cache.release(owner)
    newcomer = _seq()
    cache.reserve(newcomer, 2)
    assert newcomer.state_slot == slot  # the only free slot: the one the old owner dirtied
    for layer, (conv, state) in zip(_state_layers(cache), kept):
        assert not np.any(layer.conv[slot]), f"conv not zeroed: max abs {np.abs(layer.conv[slot]).max()}"
        assert not np.any(layer.state[slot]), f"state not zeroed: max abs {np.abs(layer.state[slot]).max()}"
        # The other sequence's slot is untouched.
        assert np.array_equal(layer.conv[other], conv)
        assert np.array_equal(layer.state[other], state)


def test_state_slot_is_owned_by_one_sequence():
    cache = _state_cache(num_state_slots=3)
    pool = cache.state_slots
    a, b = _seq(), _seq()
    cache.reserve(a, 2)
    cache.reserve(b, 2)
    assert a.state_slot != b.state_slot
    assert pool.owner(a.state_slot) == a.seq_id
    assert pool.owner(b.state_slot) == b.seq_id
    with pytest.raises(CacheError):
        pool.allocate(a)  # already owns one


def test_releasing_a_state_slot_twice_raises():
    cache = _state_cache()
    pool = cache.state_slots
    seq = _seq()
    cache.reserve(seq, 2)
    pool.release(seq)
    assert seq.state_slot is None
    with pytest.raises(CacheError):
        pool.release(seq)
    assert pool.num_free == 3


def test_releasing_a_slot_owned_by_another_sequence_raises():
    cache = _state_cache()
    pool = cache.state_slots
    owner, thief = _seq(), _seq()
    cache.reserve(owner, 2)
    thief.state_slot = owner.state_slot  # a forged claim on the owner's slot
    with pytest.raises(CacheError):
        pool.release(thief)
    assert pool.owner(owner.state_slot) == owner.seq_id
    assert pool.num_free == 2
    pool.release(owner)
    assert pool.num_free == 3


def test_state_slot_zero_is_never_handed_out():
    cache = _state_cache(num_state_slots=4)
    dummy_rows = []
    rng = np.random.default_rng(3)
    for layer in _state_layers(cache):
        layer.conv[0] = rng.standard_normal(layer.conv[0].shape) + 2.0
        layer.state[0] = rng.standard_normal(layer.state[0].shape) + 2.0
        dummy_rows.append((layer.conv[0].copy(), layer.state[0].copy()))
    seqs = [_seq() for _ in range(4)]
    for seq in seqs:
        cache.reserve(seq, 1)
    assert sorted(s.state_slot for s in seqs) == [1, 2, 3, 4]
    with pytest.raises(CacheError):
        cache.reserve(_seq(), 1)
    for layer, (conv, state) in zip(_state_layers(cache), dummy_rows):
        assert np.array_equal(layer.conv[0], conv) and np.array_equal(layer.state[0], state)


def test_state_only_model_takes_no_blocks():
    cache = ModelCache(CacheSpec((STATE,)), CpuBackend(), block_size=4, num_blocks=3, num_state_slots=2)
    seq = _seq()
    cache.reserve(seq, 100)  # far more tokens than 3 blocks could hold
    assert seq.block_table == []
    assert cache.num_free_blocks == 3
    assert seq.state_slot in (1, 2)
    cache.release(seq)
    assert seq.state_slot is None and cache.state_slots.num_free == 2


def test_block_only_model_has_no_state_pool():
    cache = ModelCache(CacheSpec((PagedKVSpec(1, 2),)), CpuBackend(), block_size=2, num_blocks=3, num_state_slots=4)
    assert cache.state_slots is None
    seq = _seq()
    cache.reserve(seq, 3)
    assert seq.state_slot is None


# ============================================================================ ModelCache (paged)


def test_paged_layer_shapes_follow_the_docstring():
    spec = CacheSpec((
        PagedKVSpec(num_kv_heads=2, head_dim=8),
        PagedKVSpec(num_kv_heads=3, head_dim=6, v_head_dim=5, sliding_window=4),
        PagedLatentSpec(width=12),
    ))
    cache = ModelCache(spec, CpuBackend(), block_size=4, num_blocks=7, num_state_slots=1)
    kv, kv_mla_like, latent = cache.layers
    assert kv.k.shape == (8, 4, 2, 8) and kv.v.shape == (8, 4, 2, 8)
    assert kv_mla_like.k.shape == (8, 4, 3, 6) and kv_mla_like.v.shape == (8, 4, 3, 5)
    assert latent.latent.shape == (8, 4, 12)
    assert cache.dummy_block == 0
    assert cache.num_free_blocks == 7
    assert cache.state_slots is None


def _kv_cache(block_size: int = 4, num_blocks: int = 8) -> ModelCache:
    spec = CacheSpec((PagedKVSpec(2, 4), PagedLatentSpec(6)))
    return ModelCache(spec, CpuBackend(), block_size=block_size, num_blocks=num_blocks, num_state_slots=1)


@pytest.mark.parametrize(
    "table_len, num_tokens, expected",
    [(0, 0, 0), (0, 1, 1), (0, 4, 1), (0, 5, 2), (0, 12, 3), (0, 13, 4), (2, 8, 0), (2, 9, 1), (3, 5, 0)],
)
def test_blocks_needed(table_len, num_tokens, expected):
    cache = _kv_cache(block_size=4)
    seq = _seq()
    seq.block_table = list(range(1, table_len + 1))
    assert cache.blocks_needed(seq, num_tokens) == expected


def test_reserve_grows_the_block_table_and_slot_mapping_matches_a_hand_computation():
    cache = _kv_cache(block_size=4, num_blocks=8)
    a, b = _seq(), _seq()
    cache.reserve(a, 4)  # a: one block
    cache.reserve(b, 5)  # b: two blocks
    cache.reserve(a, 10)  # a: grows to three blocks, interleaved with b's
    assert len(a.block_table) == 3 and len(b.block_table) == 2
    assert set(a.block_table).isdisjoint(b.block_table)
    assert 0 not in a.block_table + b.block_table
    assert cache.num_free_blocks == 3
    cache.reserve(a, 12)  # still fits three blocks: nothing more taken
    assert len(a.block_table) == 3 and cache.num_free_blocks == 3

    # Force a known, non-contiguous table and check slot = block * block_size + offset by hand.
    a_table = list(a.block_table)
    mapping = cache.slot_mapping(a, 2, 10)
    positions = list(range(2, 10))
    expected = [a_table[p // 4] * 4 + p % 4 for p in positions]
    assert mapping.tolist() == expected
    assert mapping.dtype == np.int64

    fixed = _seq()
    fixed.block_table = [5, 2, 7]
    assert cache.slot_mapping(fixed, 0, 12).tolist() == [20, 21, 22, 23, 8, 9, 10, 11, 28, 29, 30, 31]
    assert cache.slot_mapping(fixed, 3, 6).tolist() == [23, 8, 9]
    assert cache.slot_mapping(fixed, 11, 12).tolist() == [31]


def test_slot_mapping_past_the_table_raises():
    cache = _kv_cache(block_size=4)
    seq = _seq()
    cache.reserve(seq, 6)
    assert cache.slot_mapping(seq, 0, 8).shape == (8,)
    with pytest.raises(CacheError):
        cache.slot_mapping(seq, 0, 9)


def test_slot_mapping_addresses_the_flat_cache_rows():
    """Writing at the mapped flat slots lands in the block/offset the block table names."""
    cache = _kv_cache(block_size=4, num_blocks=6)
    seq = _seq()
    cache.reserve(seq, 7)
    layer = cache.layers[0]
    rng = np.random.default_rng(5)
    values = rng.standard_normal((7, 2, 4)).astype(np.float32) + 1.0
    flat = layer.k.reshape(-1, 2, 4)
    flat[cache.slot_mapping(seq, 0, 7)] = values
    for p in range(7):
        block, offset = seq.block_table[p // 4], p % 4
        assert np.array_equal(layer.k[block, offset], values[p])
    assert not np.any(layer.k[0])  # the dummy block was not written


def test_reserve_is_all_or_nothing_when_blocks_run_out():
    cache = _kv_cache(block_size=4, num_blocks=4)
    hog, seq = _seq(), _seq()
    cache.reserve(hog, 9)  # three blocks
    cache.reserve(seq, 2)  # one block: the cache is now full
    table = list(seq.block_table)
    with pytest.raises(OutOfCacheBlocksError):
        cache.reserve(seq, 9)  # needs two more
    assert seq.block_table == table
    assert cache.num_free_blocks == 0
    cache.release(hog)
    cache.reserve(seq, 9)
    assert len(seq.block_table) == 3 and cache.num_free_blocks == 1


def test_release_returns_blocks_and_resets_the_sequence():
    cache = _state_cache(num_state_slots=2)
    seq = _seq()
    cache.reserve(seq, 13)
    seq.num_cached = 13
    assert len(seq.block_table) == 4 and cache.num_free_blocks == 4
    cache.release(seq)
    assert seq.block_table == [] and seq.num_cached == 0 and seq.state_slot is None
    assert cache.num_free_blocks == 8 and cache.state_slots.num_free == 2
    cache.release(seq)  # an emptied sequence has nothing left to return
    assert cache.num_free_blocks == 8


def test_release_of_a_shared_block_keeps_it_for_the_other_holder():
    cache = _kv_cache(block_size=4, num_blocks=4)
    a, b = _seq(), _seq()
    cache.reserve(a, 4)
    (shared,) = a.block_table
    cache.allocator.share(shared)
    b.block_table = [shared]
    cache.release(a)
    assert cache.allocator.ref_count(shared) == 1
    assert cache.num_free_blocks == 3
    cache.release(b)
    assert cache.allocator.ref_count(shared) == 0
    assert cache.num_free_blocks == 4


# ============================================================================= CacheSpec.validate


@pytest.mark.parametrize(
    "layers",
    [
        (),
        ("not a spec",),
        (PagedKVSpec(0, 4),),
        (PagedKVSpec(2, -4),),
        (PagedKVSpec(2, 4.0),),
        (PagedKVSpec(2, 4, v_head_dim=0),),
        (PagedKVSpec(2, 4, sliding_window=0),),
        (PagedLatentSpec(0),),
        (PagedLatentSpec(3.5),),
        (RecurrentStateSpec(conv_shape=(), state_shape=(2, 2)),),
        (RecurrentStateSpec(conv_shape=(4, 0), state_shape=(2, 2)),),
        (RecurrentStateSpec(conv_shape=(4, 2), state_shape=(2, -1)),),
        (RecurrentStateSpec(conv_shape=(4, 2.0), state_shape=(2, 2)),),
        (PagedKVSpec(2, 4), PagedLatentSpec(-1)),
    ],
)
def test_cache_spec_validate_rejects_bad_specs(layers):
    spec = CacheSpec(layers)
    with pytest.raises(ConfigError):
        spec.validate()
    with pytest.raises(ConfigError):
        ModelCache(spec, CpuBackend(), block_size=4, num_blocks=2, num_state_slots=1)


def test_cache_spec_validate_accepts_a_good_spec():
    spec = CacheSpec((PagedKVSpec(2, 4, v_head_dim=3, sliding_window=8), PagedLatentSpec(5), STATE))
    spec.validate()
    assert spec.uses_blocks and spec.uses_state_slots
    # K: 2 heads x 4 + V: 2 heads x 3, plus a latent of 5; recurrent state is per sequence.
    assert spec.values_per_token() == 2 * 4 + 2 * 3 + 5


# =============================================================================== plan_num_blocks


def test_plan_num_blocks_is_capped_by_memory():
    spec = CacheSpec((PagedKVSpec(2, 4), PagedKVSpec(2, 4)))  # 32 values per token
    block_size, itemsize = 4, 4
    bytes_per_block = 32 * block_size * itemsize  # 512
    memory = 10 * bytes_per_block + 511  # ten blocks fit: nine usable plus the dummy block
    result = plan_num_blocks(spec, block_size, memory, itemsize, max_num_seqs=4, max_model_len=10_000)
    assert result == 9


def test_plan_num_blocks_is_capped_by_the_sequences_in_flight():
    spec = CacheSpec((PagedLatentSpec(8),))
    block_size = 16
    # Each of 3 sequences of 100 tokens rounds up to ceil(100 / 16) = 7 blocks.
    result = plan_num_blocks(spec, block_size, 1 << 30, 4, max_num_seqs=3, max_model_len=100)
    assert result == 3 * math.ceil(100 / block_size)


def test_plan_num_blocks_returns_at_least_one_block():
    spec = CacheSpec((PagedKVSpec(4, 64),))
    assert plan_num_blocks(spec, 16, 10, 4, max_num_seqs=2, max_model_len=1000) == 1


def test_llm_cache_holds_max_num_seqs_sequences_of_max_model_len(dense_checkpoints):
    from metrale import LLM

    llm = LLM(dense_checkpoints["llama"], device="cpu", show_progress=False, max_model_len=100, max_num_seqs=8)
    per_sequence = math.ceil(100 / llm.cache.block_size)
    assert llm.cache.num_blocks >= 8 * per_sequence, (
        f"{llm.cache.num_blocks} blocks for 8 sequences needing {per_sequence} blocks each"
    )


def test_state_slots_come_out_of_the_cache_budget(gdn_checkpoint):
    """The recurrent-state rows (slots, dummy, snapshots) are paid from memory_bytes before blocks."""
    from metrale import LLM

    spec_llm = LLM(gdn_checkpoint, device="cpu", show_progress=False, num_blocks=4)
    spec = spec_llm.forward.cache_spec()
    per_slot = spec.state_bytes_per_slot()
    assert per_slot == 4 * 2 * ((2 * 2 * 8 + 4 * 16) * 3 + 4 * 8 * 16)  # two GDN layers of the tiny model
    budget = 200_000
    rows = 16 + 1 + 16  # max(num_state_slots, max_num_seqs) = 16, the dummy slot, 16 snapshots
    llm = LLM(gdn_checkpoint, device="cpu", show_progress=False, memory_bytes=budget + rows * per_slot,
              max_num_seqs=16, block_size=4)
    bytes_per_block = spec.values_per_token() * 4 * 4
    assert llm.cache.num_blocks == budget // bytes_per_block - 1
