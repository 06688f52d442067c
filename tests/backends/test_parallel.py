"""Shards and the simulated ranks' collectives (metrale.backends.parallel)."""

from __future__ import annotations

import numpy as np
import pytest

from metrale.backends.parallel import Shard, SoloCommunicator, rows_of, run_ranks
from metrale.errors import ConfigError


def test_a_rank_s_part_and_the_errors_for_parts_that_do_not_split():
    assert [Shard(rank, 4).split(12, "heads") for rank in range(4)] == [slice(0, 3), slice(3, 6), slice(6, 9),
                                                                      slice(9, 12)]
    with pytest.raises(ConfigError, match="intermediate_size=10 does not split evenly over tensor_parallel_size=4"):
        Shard(1, 4).split(10, "intermediate_size")
    for bad in ({"rank": 2, "size": 2}, {"rank": 0, "size": 0}, {"rank": -1, "size": 2}, {"rank": 0, "size": True}):
        with pytest.raises(ConfigError):
            Shard(**bad)
    np.testing.assert_array_equal(rows_of(np.arange(12).reshape(6, 2), slice(1, 2), block=2), [[4, 5], [6, 7]])


def test_kv_heads_split_or_replicated_with_the_query_heads_that_read_them():
    # 8 query heads, 4 kv heads (2 query heads each) over 2 ranks: 2 kv heads each.
    assert [Shard(rank, 2).kv_heads(8, 4) for rank in range(2)] == [slice(0, 2), slice(2, 4)]
    # 8 query heads, 2 kv heads over 4 ranks: ranks 0-1 read kv head 0, ranks 2-3 kv head 1.
    assert [Shard(rank, 4).kv_heads(8, 2) for rank in range(4)] == [slice(0, 1), slice(0, 1), slice(1, 2),
                                                                   slice(1, 2)]
    for rank in range(4):  # each rank's query heads are those its kv head serves
        queries, kv = Shard(rank, 4).split(8, "heads"), Shard(rank, 4).kv_heads(8, 2)
        assert all(q // 4 == kv.start for q in range(queries.start, queries.stop))
    with pytest.raises(ConfigError, match="num_key_value_heads=3"):
        Shard(0, 4).kv_heads(12, 3)


def test_threaded_ranks_reduce_and_gather_in_rank_order():
    def work(comm):
        x = np.full((2, 3), comm.rank + 1, np.float32)
        return comm.all_reduce(x), comm.all_gather(x[:, :1] * 10, axis=1), comm.all_reduce(x * 2)

    results = run_ranks(3, work)
    for summed, gathered, again in results:
        np.testing.assert_array_equal(summed, np.full((2, 3), 6))
        np.testing.assert_array_equal(gathered, [[10, 20, 30], [10, 20, 30]])
        np.testing.assert_array_equal(again, np.full((2, 3), 12))
    solo = SoloCommunicator()
    x = np.ones(3)
    assert solo.all_reduce(x) is x and solo.all_gather(x) is x


def test_a_failing_rank_releases_the_others_and_its_error_is_raised():
    def work(comm):
        if comm.rank == 1:
            raise ValueError("rank 1 broke")
        return comm.all_reduce(np.ones(2))

    with pytest.raises(ValueError, match="rank 1 broke"):
        run_ranks(3, work)
