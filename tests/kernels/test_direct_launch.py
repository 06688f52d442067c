"""The direct launcher's argument handling (numba's kernel ABI), without a GPU: what decides an
argument's kind and the parameters an array is flattened into."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np

from metrale.kernels import _device


class FakeDeviceArray:
    """An object with a CUDA array interface only (as a numba device array offers)."""

    def __init__(self, shape, dtype, strides=None, ptr=0x1000):
        self.__cuda_array_interface__ = {
            "shape": tuple(shape), "typestr": np.dtype(dtype).str, "strides": strides, "data": (ptr, False), "version": 3,
        }


class FakeCupyArray:
    """The attributes of a CuPy array the launcher reads (no array interface: reading it would fail)."""

    def __init__(self, host: np.ndarray, ptr: int):
        self.data = SimpleNamespace(ptr=ptr)
        self.shape, self.strides, self.dtype, self.itemsize = host.shape, host.strides, host.dtype, host.itemsize


def kind(arg):
    return _device.describe_argument(arg)[0]


def params(arg):
    return _device.describe_argument(arg)[1]


def test_an_array_flattens_into_numbas_parameters():
    # meminfo, parent, size, itemsize, data, shape, strides (bytes, C order when none are given)
    assert params(FakeDeviceArray((3, 5), np.float32, ptr=0xABC0)) == (0, 0, 15, 4, 0xABC0, 3, 5, 20, 4)
    assert params(FakeDeviceArray((3, 5), np.uint16, strides=(64, 2), ptr=0x2000)) == (0, 0, 15, 2, 0x2000, 3, 5, 64, 2)
    host = np.zeros((4, 6), np.float32)[:, 1:4]
    assert params(FakeCupyArray(host, 0x3000)) == (0, 0, 12, 4, 0x3000, 4, 3, 24, 4)


def test_cupy_arrays_and_array_interfaces_of_one_layout_are_one_kind():
    host = np.zeros((3, 5), np.float32)
    assert kind(FakeCupyArray(host, 0x10)) == kind(FakeDeviceArray((3, 5), np.float32))
    assert kind(FakeCupyArray(host[:, :2], 0x10)) == kind(FakeDeviceArray((3, 2), np.float32, strides=(20, 4)))


def test_argument_kinds_tell_layouts_and_scalar_types_apart():
    dense = kind(FakeDeviceArray((3, 5), np.float32))
    assert dense == kind(FakeDeviceArray((3, 5), np.float32, strides=(20, 4)))
    assert dense != kind(FakeDeviceArray((3, 5), np.float32, strides=(40, 4)))  # a row slice
    assert dense != kind(FakeDeviceArray((3, 5), np.float32, strides=(4, 12)))  # Fortran order
    assert dense != kind(FakeDeviceArray((3, 5), np.uint16))
    assert dense != kind(FakeDeviceArray((15,), np.float32))
    assert kind(np.float32(1.0)) != kind(np.int32(1))
    assert kind(1) != kind(1.0) != kind(True)
    assert params(np.float32(1.0)) is None


def test_a_view_carries_its_description():
    view = SimpleNamespace(_launch_description=("kind", (1, 2)))
    assert _device.describe_argument(view) == ("kind", (1, 2))


def test_unit_extents_do_not_break_contiguity():
    assert _device._contiguous((5, 1), (4, 999), 4)
    assert not _device._contiguous((5, 2), (4, 8), 4)
