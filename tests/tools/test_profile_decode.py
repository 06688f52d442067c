"""tools/profiling/profile_decode.py: the bytes each op of a decode step must read, behind its GB/s column."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
from tool_module import load_tool


@pytest.fixture(scope="module")
def profile_decode():
    return load_tool("profiling/profile_decode.py", "metrale_tools_profile_decode")


def bits(*shape):
    return np.zeros(shape, np.uint16)


def test_products_count_their_weights(profile_decode):
    label, read = profile_decode.op_label_and_bytes("linear", (bits(1, 64), bits(32, 64)), np.asarray)
    assert label == "linear 1x64 @ 32x64" and read == 32 * 64 * 2
    x = np.zeros((2, 64), np.float32)
    label, read = profile_decode.op_label_and_bytes(
        "rmsnorm_mlp", (x, None, bits(64), 1e-5, 0.0, bits(256, 64), bits(64, 128)), np.asarray)
    assert label == "rmsnorm_mlp 2x64 @ 256x64 + 64x128" and read == (256 * 64 + 64 * 128) * 2


def test_attention_counts_each_rows_cached_keys_and_values(profile_decode):
    k_cache, v_cache = bits(10, 16, 4, 64), bits(10, 16, 4, 64)  # 4 KV heads of 64 dims
    batch = SimpleNamespace(positions=np.array([99, 9], np.int32))
    q = np.zeros((2, 8, 64), np.float32)
    _, read = profile_decode.op_label_and_bytes("paged_attention", (q, k_cache, v_cache, batch, 0.1, None), np.asarray)
    assert read == (100 + 10) * 4 * (64 + 64) * 2
    _, windowed = profile_decode.op_label_and_bytes("paged_attention", (q, k_cache, v_cache, batch, 0.1, 32), np.asarray)
    assert windowed == (32 + 10) * 4 * (64 + 64) * 2
    latent = bits(10, 16, 576)
    _, read = profile_decode.op_label_and_bytes("latent_attention", (q, latent, batch, 512, 0.1), np.asarray)
    assert read == 110 * 576 * 2


def test_experts_count_each_chosen_expert_once(profile_decode):
    hidden, inter, experts = 64, 32, 8
    x = np.zeros((3, hidden), np.float32)
    chosen = np.array([[1, 2], [2, 5], [1, 5]], np.int32)
    gate_up, down = bits(experts * 2 * inter, hidden), bits(experts * hidden, inter)
    label, read = profile_decode.op_label_and_bytes("moe_experts", (x, chosen, None, gate_up, down), np.asarray)
    assert label == "moe_experts 3x64 top-2 of 8" and read == 3 * (2 * inter * hidden + hidden * inter) * 2


def test_the_recurrent_state_is_read_and_written(profile_decode):
    state = np.zeros((5, 4, 16, 16), np.float32)  # 5 slots of 4 heads of 16x16
    qkvz = np.zeros((2, 100), np.float32)
    arguments = (qkvz, None, None, None, None, None, state, None)
    assert profile_decode.op_label_and_bytes("gdn_decode", arguments, np.asarray)[1] == 2 * 2 * 4 * 16 * 16 * 4


def test_other_ops_have_no_count(profile_decode):
    assert profile_decode.op_label_and_bytes("qkv_rope_cache", (np.zeros((1, 96)),), np.asarray) == (
        "qkv_rope_cache 1x96", None)
