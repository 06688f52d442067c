"""The FP8 E4M3 paged cache (``kv_cache_dtype="fp8"``): its codec, per-slot scales, static scales,
the ops' references reading and writing it, its sizing and the typed errors of bad values."""

from __future__ import annotations

import numpy as np
import pytest

from metrale.backends.base import CpuBackend
from metrale.cache.spec import CacheSpec, PagedKVSpec, PagedLatentSpec
from metrale.cache.store import ModelCache, cache_itemsizes, plan_num_blocks
from metrale.config import CacheConfig, EngineConfig, EnvironmentConfig
from metrale.errors import ConfigError, UnsupportedQuantizationError
from metrale.kernels.attention import paged_attention_reference, paged_kv_write_reference
from metrale.kernels.attention_latent import latent_attention_reference, latent_cache_write_reference
from metrale.kernels.kv_cache_fp8 import Fp8CacheArray, cache_rows
from metrale.kernels.quantized import FP8_E4M3_MAX

#: E4M3 keeps 3 mantissa bits: a value rounds to within half a step, 2**-4 of its magnitude.
FP8_RELATIVE_STEP = 2.0**-4


def _rows(rng: np.random.Generator, *shape: int) -> np.ndarray:
    return (rng.standard_normal(shape) * rng.uniform(0.01, 50, shape[:-1])[..., None]).astype(np.float32)


def test_a_written_row_reads_back_within_fp8_precision_with_a_scale_per_slot_and_head():
    rng = np.random.default_rng(0)
    cache = Fp8CacheArray.zeros((4, 8, 3, 16))
    rows = _rows(rng, 5, 3, 16)  # heads of very different magnitudes
    slots = np.array([0, 9, 17, 30, 31])
    cache.write(slots, rows)
    back = cache.rows(slots)
    # Each (row, head) is quantized on its own: the error is relative to that head's amax.
    amax = np.abs(rows).max(axis=-1, keepdims=True)
    assert np.all(np.abs(back - rows) <= FP8_RELATIVE_STEP * amax + 1e-12)
    np.testing.assert_allclose(cache.scales.reshape(-1, 3)[slots], amax[..., 0] / FP8_E4M3_MAX, rtol=1e-6)
    assert cache.codes.dtype == np.uint8 and cache.scales.dtype == np.float32
    assert cache.scales.shape == (4, 8, 3)
    # Slots never written keep code 0 (value 0); padding rows (slot -1) are not stored.
    cache.write(np.array([-1]), np.full((1, 3, 16), 7.0, np.float32))
    assert not cache.rows(np.array([1])).any()


def test_a_row_does_not_depend_on_the_rows_written_beside_it():
    rng = np.random.default_rng(1)
    alone, together = Fp8CacheArray.zeros((2, 4, 2, 8)), Fp8CacheArray.zeros((2, 4, 2, 8))
    rows = _rows(rng, 3, 2, 8)
    alone.write(np.array([5]), rows[1:2])
    together.write(np.array([4, 5, 6]), rows)
    np.testing.assert_array_equal(alone.rows(np.array([5])), together.rows(np.array([5])))


def test_a_static_scale_is_used_when_the_cache_has_one():
    cache = Fp8CacheArray.zeros((2, 4, 1, 4), static_scale=0.5)
    values = np.array([[[0.5, -1.0, 100.0, 1000.0]]], np.float32)
    cache.write(np.array([3]), values)
    assert cache.scales.reshape(-1)[3] == 0.5
    # 1000 / 0.5 saturates at 448: the static scale bounds what the cache can hold.
    np.testing.assert_allclose(cache.rows(np.array([3])), [[[0.5, -1.0, 100.0, 224.0]]], rtol=FP8_RELATIVE_STEP)


def test_paged_attention_over_an_fp8_cache_is_close_to_the_float_cache():
    rng = np.random.default_rng(2)
    blocks, block, kv, d, heads, length = 6, 4, 2, 16, 4, 13
    float_k, float_v = np.zeros((blocks, block, kv, d), np.float32), np.zeros((blocks, block, kv, d), np.float32)
    fp8_k, fp8_v = Fp8CacheArray.zeros(float_k.shape), Fp8CacheArray.zeros(float_v.shape)
    keys, values = _rows(rng, length, kv, d), _rows(rng, length, kv, d)
    table = np.array([[3, 1, 5, 2]], np.int32)
    slots = table[0, np.arange(length) // block] * block + np.arange(length) % block
    paged_kv_write_reference(float_k, float_v, slots, keys, values)
    paged_kv_write_reference(fp8_k, fp8_v, slots, keys, values)
    q = rng.standard_normal((3, heads, d)).astype(np.float32) * 0.1
    args = (table, np.zeros(3, np.int32), np.array([4, 9, 12], np.int32), d**-0.5)
    expected = paged_attention_reference(q, float_k, float_v, *args)
    got = paged_attention_reference(q, fp8_k, fp8_v, *args)
    assert np.abs(got - expected).max() <= 2 * FP8_RELATIVE_STEP * np.abs(values).max()


def test_the_latent_cache_writes_and_reads_fp8_rows():
    rng = np.random.default_rng(3)
    rank, rope, block = 16, 8, 4
    kv_a = rng.standard_normal((6, rank + rope)).astype(np.float32)
    inv_freq = (1.0 / 10000 ** (np.arange(0, rope, 2) / rope)).astype(np.float32)
    positions, slots = np.arange(6, dtype=np.int32), np.array([4, 5, 6, 7, 12, 13])
    norm = np.ones(rank, np.float32)
    float_cache, fp8_cache = np.zeros((4, block, rank + rope), np.float32), Fp8CacheArray.zeros((4, block, rank + rope))
    for cache in (float_cache, fp8_cache):
        latent_cache_write_reference(kv_a, norm, 1e-6, positions, inv_freq, 1.0, False, slots, cache)
    assert fp8_cache.scales.shape == (4, block)
    exact, rows = cache_rows(float_cache, slots), cache_rows(fp8_cache, slots)
    assert np.all(np.abs(rows - exact) <= FP8_RELATIVE_STEP * np.abs(exact).max(axis=1, keepdims=True) + 1e-12)
    q = rng.standard_normal((1, 2, rank + rope)).astype(np.float32)
    args = (np.array([[1, 3, 0]], np.int32), np.zeros(1, np.int32), np.array([5], np.int32), rank, 0.2)
    np.testing.assert_allclose(latent_attention_reference(q, fp8_cache, *args),
                               latent_attention_reference(q, float_cache, *args), atol=0.1)


def test_the_model_cache_allocates_fp8_layers_with_the_specs_static_scales():
    spec = CacheSpec((PagedKVSpec(2, 8, k_scale=0.25, v_scale=0.5), PagedLatentSpec(12), PagedKVSpec(1, 4)))
    cache = ModelCache(spec, CpuBackend(), block_size=4, num_blocks=3, num_state_slots=1, kv_cache_dtype="fp8")
    first, latent, last = cache.layers
    assert isinstance(first.k, Fp8CacheArray) and first.k.shape == (4, 4, 2, 8) and first.k.scales.shape == (4, 4, 2)
    assert (first.k.static_scale, first.v.static_scale, last.k.static_scale) == (0.25, 0.5, None)
    assert latent.latent.shape == (4, 4, 12) and latent.latent.scales.shape == (4, 4)
    plain = ModelCache(spec, CpuBackend(), block_size=4, num_blocks=3, num_state_slots=1)
    assert plain.layers[0].k.dtype == np.float32  # a float cache ignores the static scales


def test_blocks_for_a_memory_budget_follow_the_bytes_per_token():
    spec = CacheSpec((PagedKVSpec(2, 16), PagedLatentSpec(24)))
    float_bytes = spec.bytes_per_token(4)  # 2 * 2 * 16 * 4 + 24 * 4
    fp8_bytes = spec.bytes_per_token(1, 4)  # one byte per value, a float32 scale per head (K, V) and latent row
    assert (float_bytes, fp8_bytes) == (2 * 2 * 16 * 4 + 24 * 4, 2 * 2 * 16 + 24 + (2 * 2 + 1) * 4)
    memory = 1 << 20
    float_blocks = plan_num_blocks(spec, 16, memory, 4, max_num_seqs=1 << 20, max_model_len=1 << 20)
    fp8_blocks = plan_num_blocks(spec, 16, memory, 1, max_num_seqs=1 << 20, max_model_len=1 << 20, scale_itemsize=4)
    assert float_blocks == memory // (16 * float_bytes) - 1
    assert fp8_blocks == memory // (16 * fp8_bytes) - 1
    assert fp8_blocks > 3 * float_blocks


@pytest.mark.parametrize("value", ["fp8_e5m2", "bf16", "FP8", "", None, 8])
def test_kv_cache_dtypes_not_served_raise_a_typed_error(value):
    with pytest.raises(UnsupportedQuantizationError, match="kv_cache_dtype"):
        CacheConfig(kv_cache_dtype=value)
    with pytest.raises(UnsupportedQuantizationError):
        EngineConfig.from_options({"kv_cache_dtype": value}, EnvironmentConfig())


@pytest.mark.parametrize("value", ["auto", "fp8", "fp8_e4m3"])
def test_kv_cache_dtypes_served_reach_the_cache_config(value):
    config = EngineConfig.from_options({"kv_cache_dtype": value, "device": "cpu"}, EnvironmentConfig())
    assert config.cache.kv_cache_dtype == value


def test_an_fp8_cache_on_the_gpu_holds_codes_and_scales_for_every_paged_layer():
    """Keys, values and MLA's latents are all served in FP8 on the GPU: codes of a byte and a
    float32 scale a slot (and head), the scales starting at 1."""

    class FakeCudaBackend:
        name = "cuda"
        cache_dtype = np.uint16

        def zeros(self, shape, dtype):
            return np.zeros(shape, dtype)

    backend = FakeCudaBackend()
    assert cache_itemsizes(backend, "auto") == (2, 0)
    assert cache_itemsizes(backend, "fp8") == (1, 4)
    cache = ModelCache(CacheSpec((PagedKVSpec(1, 4), PagedLatentSpec(8))), backend, block_size=4, num_blocks=2,
                       num_state_slots=1, kv_cache_dtype="fp8")
    keys, latent = cache.layers[0].k, cache.layers[1].latent
    for array, scales_shape in ((keys, (3, 4, 1)), (latent, (3, 4))):
        assert isinstance(array, Fp8CacheArray) and array.codes.dtype == np.uint8
        assert array.scales.shape == scales_shape and np.all(array.scales == 1.0)


def test_static_scales_of_a_spec_are_checked():
    with pytest.raises(ConfigError, match="k_scale"):
        CacheSpec((PagedKVSpec(1, 4, k_scale=0.0),)).validate()
    with pytest.raises(ConfigError, match="scale"):
        CacheSpec((PagedLatentSpec(4, scale=float("nan")),)).validate()
