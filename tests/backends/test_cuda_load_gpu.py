"""CudaBackend.load_weight's staged read of bf16 weights (metrale/loading/staged_read.py): stacked
parts and runs of rows land on the device as the host's concatenation of the stored arrays does,
across chunk boundaries; a NaN is refused and the next load still works."""

from __future__ import annotations

import json

import numpy as np
import pytest

pytestmark = pytest.mark.gpu


@pytest.fixture
def checkpoint_folder(tmp_path):
    import torch
    from safetensors.torch import save_file

    generator = torch.Generator().manual_seed(0)
    tensors = {f"w.{i}": torch.randn(300, 64, generator=generator).to(torch.bfloat16) for i in range(3)}
    tensors["norm"] = torch.randn(64, generator=generator).to(torch.bfloat16)
    tensors["scale"] = torch.randn(5, 64, generator=generator)  # float32: the host path
    save_file(dict(list(tensors.items())[:2]), str(tmp_path / "model-00001-of-00002.safetensors"))
    save_file(dict(list(tensors.items())[2:]), str(tmp_path / "model-00002-of-00002.safetensors"))
    index = {"weight_map": {name: f"model-0000{1 + (i >= 2)}-of-00002.safetensors" for i, name in enumerate(tensors)}}
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps(index))
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama"}))
    return tmp_path


@pytest.mark.parametrize("chunk_bytes", [1000, 8 << 20])
def test_staged_parts_equal_the_stored_arrays(checkpoint_folder, monkeypatch, chunk_bytes):
    import cupy

    from metrale.backends.cuda import CudaBackend
    from metrale.loading import staged_read
    from metrale.loading.checkpoint import Checkpoint

    monkeypatch.setattr(staged_read, "CHUNK_BYTES", chunk_bytes)
    monkeypatch.setattr(staged_read, "READ_WORKERS", 3)
    backend = CudaBackend()
    checkpoint = Checkpoint(checkpoint_folder)
    try:
        stacked = backend.load_weight(checkpoint, ("w.0", (300, 64)), ("w.2", (300, 64), slice(10, 250), None),
                                      ("w.1", (300, 64), slice(299, None), None))
        expected = np.concatenate([checkpoint.raw("w.0"), checkpoint.raw("w.2")[10:250], checkpoint.raw("w.1")[299:]])
        assert stacked.dtype == np.uint16 and stacked.shape == (541, 64)
        np.testing.assert_array_equal(cupy.asnumpy(stacked), expected)
        np.testing.assert_array_equal(cupy.asnumpy(backend.load_weight(checkpoint, ("norm", (64,)))),
                                      checkpoint.raw("norm"))
        # A rank's columns and a float32 tensor take the host path, with the same result.
        columns = backend.load_weight(checkpoint, ("w.1", (300, 64), None, slice(16, 32)))
        np.testing.assert_array_equal(cupy.asnumpy(columns), checkpoint.raw("w.1")[:, 16:32])
        backend.finish_loading()
        assert backend._reader is None
        again = backend.load_weight(checkpoint, ("w.1", (300, 64)))  # a new ring after finish_loading
        np.testing.assert_array_equal(cupy.asnumpy(again), checkpoint.raw("w.1"))
    finally:
        backend.close()


def test_a_nan_is_refused_and_the_next_weight_still_loads(checkpoint_folder, monkeypatch):
    import cupy
    import torch
    from safetensors.torch import load_file, save_file

    from metrale.backends.cuda import CudaBackend
    from metrale.errors import NonFiniteWeightError
    from metrale.loading import staged_read
    from metrale.loading.checkpoint import Checkpoint

    path = checkpoint_folder / "model-00001-of-00002.safetensors"
    tensors = load_file(str(path))
    tensors["w.1"][217, 3] = torch.nan
    save_file(tensors, str(path))
    monkeypatch.setattr(staged_read, "CHUNK_BYTES", 4096)
    backend = CudaBackend()
    checkpoint = Checkpoint(checkpoint_folder)
    try:
        with pytest.raises(NonFiniteWeightError, match=r"1 NaN or infinite values in 'w.0' / 'w.1'"):
            backend.load_weight(checkpoint, ("w.0", (300, 64)), ("w.1", (300, 64)))
        clean = backend.load_weight(checkpoint, ("w.1", (300, 64), slice(0, 217), None))
        np.testing.assert_array_equal(cupy.asnumpy(clean), checkpoint.raw("w.1")[:217])
    finally:
        backend.close()
