"""The direct launcher's argument handling (numba's kernel ABI), without a GPU: what decides an
argument's kind and the parameters an array is flattened into."""

from __future__ import annotations

import numpy as np

from metrale.kernels import _device


class FakeDeviceArray:
    """An object with a CUDA array interface (what CuPy and numba device arrays offer)."""

    def __init__(self, shape, dtype, strides=None, ptr=0x1000):
        self.__cuda_array_interface__ = {
            "shape": tuple(shape), "typestr": np.dtype(dtype).str, "strides": strides, "data": (ptr, False), "version": 3,
        }


def test_an_array_flattens_into_numbas_parameters():
    array = FakeDeviceArray((3, 5), np.float32, ptr=0xABC0)
    # meminfo, parent, size, itemsize, data, shape, strides (bytes, C order when none are given)
    assert _device._array_params(array) == (0, 0, 15, 4, 0xABC0, 3, 5, 20, 4)
    strided = FakeDeviceArray((3, 5), np.uint16, strides=(64, 2), ptr=0x2000)
    assert _device._array_params(strided) == (0, 0, 15, 2, 0x2000, 3, 5, 64, 2)


def test_argument_kinds_tell_layouts_and_scalar_types_apart():
    dense = _device._argument_kind(FakeDeviceArray((3, 5), np.float32))
    assert dense == _device._argument_kind(FakeDeviceArray((3, 5), np.float32, strides=(20, 4)))
    assert dense != _device._argument_kind(FakeDeviceArray((3, 5), np.float32, strides=(40, 4)))  # a row slice
    assert dense != _device._argument_kind(FakeDeviceArray((3, 5), np.float32, strides=(4, 12)))  # Fortran order
    assert dense != _device._argument_kind(FakeDeviceArray((3, 5), np.uint16))
    assert dense != _device._argument_kind(FakeDeviceArray((15,), np.float32))
    assert _device._argument_kind(np.float32(1.0)) != _device._argument_kind(np.int32(1))
    assert _device._argument_kind(1) != _device._argument_kind(1.0)


def test_unit_extents_do_not_break_contiguity():
    assert _device._contiguous((5, 1), (4, 999), 4)
    assert not _device._contiguous((5, 2), (4, 8), 4)
