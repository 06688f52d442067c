"""The NCCL communicator (metrale.backends.parallel.NcclCommunicator) on one GPU, as a group of one rank:
CuPy's NCCL binding initialises, the collectives return their input's values in new arrays, and
they replay from a CUDA graph with new inputs (the decode graphs capture them). Groups of several
GPUs need a machine with several."""

from __future__ import annotations

import numpy as np
import pytest

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module")
def communicator():
    from cupy.cuda import nccl

    from metrale.backends.parallel import NcclCommunicator, nccl_unique_id

    if not nccl.available:
        pytest.skip("CuPy finds no NCCL library on this machine")

    group = NcclCommunicator(0, 1, nccl_unique_id())
    yield group
    group.close()


def test_a_group_of_one_returns_its_input(communicator):
    import cupy

    x = cupy.asarray(np.arange(12, dtype=np.float32).reshape(3, 4))
    reduced = communicator.all_reduce(x)
    gathered = communicator.all_gather(x, axis=-1)
    assert reduced.data.ptr != x.data.ptr
    np.testing.assert_array_equal(cupy.asnumpy(reduced), cupy.asnumpy(x))
    np.testing.assert_array_equal(cupy.asnumpy(gathered), cupy.asnumpy(x))
    with pytest.raises(Exception, match="float32, float16 or int32"):
        communicator.all_reduce(cupy.zeros(4, dtype=np.float64))


def test_the_collectives_replay_from_a_graph(communicator):
    import cupy

    stream = cupy.cuda.Stream(non_blocking=True)
    x = cupy.zeros((2, 8), dtype=np.float32)
    with stream:
        communicator.all_reduce(x)  # (NCCL's first call outside the capture)
        stream.synchronize()
        stream.begin_capture()
        out = communicator.all_reduce(x * 2)
        graph = stream.end_capture()
        for value in (1.0, 5.0):
            x.fill(value)
            graph.launch(stream)
            stream.synchronize()
            np.testing.assert_array_equal(cupy.asnumpy(out), np.full((2, 8), 2 * value, np.float32))
