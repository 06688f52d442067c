"""Gemma-2's logit soft cap and GPT-OSS's sinks through the shared attention block: the block's
output against transformers' eager attention of those models, on the CPU backend."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest

from metrale.backends.base import CpuBackend
from metrale.batch import ForwardBatch
from metrale.errors import ConfigError
from metrale.layers.attention import AttentionGeometry, AttentionWeights, attention_from_qkv, load_attention_weights

HEADS, KV_HEADS, HEAD_DIM, BLOCK = 4, 2, 8, 4


def one_prompt_batch(rows: int) -> ForwardBatch:
    """One sequence's first ``rows`` tokens in blocks 1, 2, ... of the cache."""
    blocks = np.arange(1, -(-rows // BLOCK) + 1, dtype=np.int64)[None]
    positions = np.arange(rows, dtype=np.int64)
    slots = blocks[0, positions // BLOCK] * BLOCK + positions % BLOCK
    return ForwardBatch(segments=[], token_ids=np.zeros(rows, np.int64), positions=positions,
                        seq_index=np.zeros(rows, np.int64), slot_mapping=slots, block_tables=blocks,
                        row_starts=np.array([0, rows]), logits_rows=np.array([rows - 1]), max_context=rows)


def block_output(geometry: AttentionGeometry, qkv: np.ndarray, sinks: np.ndarray | None) -> np.ndarray:
    """attention_from_qkv with RoPE that rotates by nothing and an identity output projection:
    the attention output itself, ``[rows, heads * head_dim]``."""
    backend = CpuBackend()
    width = HEADS * HEAD_DIM
    weights = AttentionWeights(qkv=None, o=np.eye(width, dtype=np.float32), sinks=sinks)
    blocks = -(-qkv.shape[0] // BLOCK) + 1
    cache = SimpleNamespace(k=np.zeros((blocks, BLOCK, KV_HEADS, HEAD_DIM), np.float32),
                            v=np.zeros((blocks, BLOCK, KV_HEADS, HEAD_DIM), np.float32))
    return attention_from_qkv(backend, geometry, weights, cache, qkv, one_prompt_batch(qkv.shape[0]))


def geometry(**options) -> AttentionGeometry:
    return AttentionGeometry(hidden_size=HEADS * HEAD_DIM, num_heads=HEADS, num_kv_heads=KV_HEADS, head_dim=HEAD_DIM,
                             inv_freq=np.zeros(HEAD_DIM // 2, np.float32), **options)


def eager(module_name: str, qkv: np.ndarray, **options) -> np.ndarray:
    """transformers' eager attention of ``module_name`` (gemma2, gpt_oss) over the same q, k, v with
    the causal mask, ``[rows, heads * head_dim]``."""
    torch = pytest.importorskip("torch")
    modeling = pytest.importorskip(f"transformers.models.{module_name}.modeling_{module_name}")
    rows = qkv.shape[0]
    q, k, v = np.split(qkv, [HEADS * HEAD_DIM, (HEADS + KV_HEADS) * HEAD_DIM], axis=1)

    def heads(x, count):
        return torch.from_numpy(x.reshape(rows, count, HEAD_DIM).transpose(1, 0, 2)[None].copy())

    mask = torch.triu(torch.full((rows, rows), float("-inf")), diagonal=1)[None, None]
    module = SimpleNamespace(num_key_value_groups=HEADS // KV_HEADS, head_dim=HEAD_DIM, training=False,
                             sinks=torch.from_numpy(options.pop("sinks")) if "sinks" in options else None)
    out, _ = modeling.eager_attention_forward(module, heads(q, HEADS), heads(k, KV_HEADS), heads(v, KV_HEADS), mask,
                                              scaling=HEAD_DIM**-0.5, dropout=0.0, **options)
    return out[0].reshape(rows, -1).numpy()


def test_the_soft_cap_is_gemma2s():
    qkv = 3 * np.random.default_rng(0).standard_normal((9, (HEADS + 2 * KV_HEADS) * HEAD_DIM)).astype(np.float32)
    got = block_output(geometry(softcap=2.0), qkv, None)
    np.testing.assert_allclose(got, eager("gemma2", qkv, softcap=2.0), rtol=1e-5, atol=1e-5)
    assert np.abs(got - block_output(geometry(), qkv, None)).max() > 1e-2  # the cap changes the result


def test_the_sinks_are_gpt_osss():
    rng = np.random.default_rng(1)
    qkv = 2 * rng.standard_normal((9, (HEADS + 2 * KV_HEADS) * HEAD_DIM)).astype(np.float32)
    sinks = rng.standard_normal(HEADS).astype(np.float32) + 1.0
    got = block_output(geometry(sinks=True), qkv, sinks)
    np.testing.assert_allclose(got, eager("gpt_oss", qkv, sinks=sinks), rtol=1e-5, atol=1e-5)
    assert np.abs(got - block_output(geometry(), qkv, None)).max() > 1e-2


def test_the_options_are_checked():
    for softcap in (0.0, -1.0, float("inf"), "30", True):
        with pytest.raises(ConfigError, match="softcap"):
            geometry(softcap=softcap)
    with pytest.raises(ConfigError, match="sinks"):
        geometry(sinks=1)


def test_the_sinks_load_with_a_ranks_heads():
    """``{prefix}.sinks`` read with the weights, and on a rank of two its query heads' part."""
    from metrale.backends.parallel import Shard

    sinks = np.arange(HEADS, dtype=np.float32) + 0.5

    class Checkpoint:
        def has(self, name):
            return name.endswith(".sinks")

        def tensor(self, name, shape=None, rows=None, columns=None):
            if name.endswith(".sinks"):
                assert tuple(shape) == (HEADS,)
                return sinks
            full = np.ones(shape, np.float32)
            return full[rows if rows is not None else slice(None)][:, columns if columns is not None else slice(None)]

    backend = CpuBackend()
    weights = load_attention_weights(Checkpoint(), backend, "layers.0.self_attn", geometry(sinks=True))
    np.testing.assert_array_equal(weights.sinks, sinks)
    assert load_attention_weights(Checkpoint(), backend, "layers.0.self_attn", geometry()).sinks is None
    backend.shard = Shard(rank=1, size=2)
    np.testing.assert_array_equal(load_attention_weights(Checkpoint(), backend, "p", geometry(sinks=True)).sinks,
                                  sinks[2:])


def test_a_block_without_the_options_calls_a_kernel_that_predates_them():
    """A plugin kernel of paged_attention written before softcap and sinks (six parameters) still
    serves blocks that use neither."""
    from metrale.model.hookspecs import hookimpl
    from metrale.model.plugin_manager import get_plugin_manager
    from metrale.ops import Kernel, build_op_registry
    from metrale.ops.builtin import builtin_registry

    reference = builtin_registry().ops["paged_attention"].reference
    calls = []

    def old_kernel(q, k_cache, v_cache, batch, scale, sliding_window):
        calls.append(q.shape)
        return reference(q, k_cache, v_cache, batch, scale, sliding_window)

    class Plugin:
        METRALE_CONTRACT_VERSION = "1.1"

        @hookimpl
        def metrale_register_ops(self, registry):
            registry.add_kernel(Kernel("paged_attention", "cpu", "old.attention", build=lambda backend: old_kernel))

    manager = get_plugin_manager(entry_points=False)
    manager.register(Plugin(), name="old")
    backend = CpuBackend()
    backend.use_ops(build_op_registry(manager))
    qkv = np.random.default_rng(2).standard_normal((5, (HEADS + 2 * KV_HEADS) * HEAD_DIM)).astype(np.float32)
    weights = AttentionWeights(qkv=None, o=np.eye(HEADS * HEAD_DIM, dtype=np.float32))
    cache = SimpleNamespace(k=np.zeros((3, BLOCK, KV_HEADS, HEAD_DIM), np.float32),
                            v=np.zeros((3, BLOCK, KV_HEADS, HEAD_DIM), np.float32))
    attention_from_qkv(backend, geometry(), weights, cache, qkv, one_prompt_batch(5))
    assert calls == [(5, HEADS, HEAD_DIM)]
