"""The glue kernels' NumPy references reproduce the families' own array code bit for bit.

Each test runs the family method itself (Gated DeltaNet ``_delta``, ``_delta_prompts``,
``_split_heads``, ``_moe``; MLA ``_attention`` and ``_absorbed``) on the CPU with NumPy, its
backend ops replaced by stand-ins that hand over given projection outputs and capture what the
method computes from them, and compares that with the reference on the same inputs. Replacing
the family code by the ops these references specify therefore changes no value.
"""

from __future__ import annotations

import functools
from types import SimpleNamespace

import numpy as np
import pytest

from metrale.kernels import attention_latent, gated, gated_delta
from metrale.plugins.gdn import model as gdn_model
from metrale.plugins.gdn.model import GdnModel, l2_normalised
from metrale.plugins.mla.model import MlaModel, rotate

HEAD_GEOMETRIES = [(2, 2, 3, 5), (2, 4, 3, 2), (3, 6, 8, 4)]  # (H_k, H_v, d_k, d_v)
NUMPY_BACKEND = SimpleNamespace(xp=np)


class Captured(Exception):
    """Raised by a stand-in op to stop the family method once it has what the test needs."""


def gdn_self(key_heads, value_heads, key_dim, value_dim, ops=None, **methods):
    """A stand-in for a loaded GdnModel: the config fields and backend its mixer methods read."""
    config = SimpleNamespace(linear_key_heads=key_heads, linear_value_heads=value_heads, linear_key_dim=key_dim,
                             linear_value_dim=value_dim, rms_norm_eps=1e-6, conv_kernel=4)
    fake = SimpleNamespace(config=config, backend=SimpleNamespace(xp=np, ops=ops))
    for name, method in methods.items():
        setattr(fake, name, method)
    return fake


def returns_weight(x, weight, bias=None):
    """``ops.linear`` stand-in: the "weight" is the projection output the test chose."""
    return weight


@pytest.mark.parametrize("key_heads, value_heads, key_dim, value_dim", HEAD_GEOMETRIES)
def test_ungroup_and_gates_reproduce_the_delta_projections(key_heads, value_heads, key_dim, value_dim):
    rng = np.random.default_rng(80)
    rows, ratio = 5, value_heads // key_heads
    qkvz = rng.standard_normal((rows, key_heads * (2 * key_dim + 2 * ratio * value_dim))).astype(np.float32)
    ba = (5 * rng.standard_normal((rows, 2 * value_heads))).astype(np.float32)
    a_log = rng.uniform(-2, 1, value_heads).astype(np.float32)
    dt_bias = rng.standard_normal(value_heads).astype(np.float32)
    seen = {}

    def decode(w, cache_layer, inputs, g, beta, batch):
        seen.update(inputs=inputs, g=g, beta=beta)
        return np.zeros((rows, value_heads, value_dim), np.float32)

    def gated_rmsnorm(out, z, weight, eps):
        seen["z"] = z
        return out

    ops = SimpleNamespace(linear=returns_weight, gated_rmsnorm=gated_rmsnorm)
    fake = gdn_self(key_heads, value_heads, key_dim, value_dim, ops, _delta_decode=decode)
    weights = SimpleNamespace(qkvz=qkvz, ba=ba, a_log=a_log, dt_bias=dt_bias, norm=None, out=None)
    GdnModel._delta(fake, weights, None, np.zeros((rows, 1), np.float32), SimpleNamespace(row_starts=np.arange(rows + 1)))

    inputs, z = gated_delta.ungroup_reference(qkvz, key_heads, value_heads, key_dim, value_dim)
    g, beta = gated_delta.gates_reference(ba, a_log, dt_bias, key_heads)
    for name, expected in [("inputs", inputs), ("z", z), ("g", g), ("beta", beta)]:
        assert seen[name].dtype == expected.dtype == np.float32, name
        np.testing.assert_array_equal(seen[name], expected, err_msg=name)


def test_l2_normalisation_is_the_familys():
    rng = np.random.default_rng(81)
    x = rng.standard_normal((4, 3, 16)).astype(np.float32)
    x[0, 0] = 0.0
    assert gated_delta.L2_NORM_EPS == gdn_model.L2_NORM_EPS
    np.testing.assert_array_equal(gated_delta.l2_normalised_reference(x), l2_normalised(np, x))


@pytest.mark.parametrize("key_heads, value_heads, key_dim, value_dim", HEAD_GEOMETRIES)
def test_split_heads_reproduces_the_familys(key_heads, value_heads, key_dim, value_dim):
    rng = np.random.default_rng(82)
    mixed = rng.standard_normal((6, 2 * key_heads * key_dim + value_heads * value_dim)).astype(np.float32)
    family = GdnModel._split_heads(gdn_self(key_heads, value_heads, key_dim, value_dim), mixed)
    reference = gated_delta.split_heads_reference(mixed, key_heads, value_heads, key_dim, value_dim)
    for name, got, expected in zip("qkv", family, reference):
        assert expected.dtype == np.float32 and expected.flags["C_CONTIGUOUS"], name
        np.testing.assert_array_equal(got, expected, err_msg=name)


def test_conv_prompts_and_split_heads_reproduce_the_prompt_path():
    """``_delta_prompts`` over segments of 5, 1, 2 and 7 rows (two shorter than K - 1 = 3) from
    scattered slots: the q, k, v it hands to the rule and the conv states it leaves."""
    key_heads, value_heads, key_dim, value_dim, taps = 2, 4, 3, 2, 4
    rng = np.random.default_rng(83)
    channels = 2 * key_heads * key_dim + value_heads * value_dim
    starts = np.array([0, 5, 6, 8, 15], np.int32)
    slots = np.array([3, 1, 4, 2], np.int32)
    inputs = rng.standard_normal((int(starts[-1]), channels)).astype(np.float32)
    weight = rng.standard_normal((channels, taps)).astype(np.float32)
    conv_state = rng.standard_normal((5, channels, taps - 1)).astype(np.float32)
    seen = {}

    def prompt_rule(q, k, v, g, beta, state, rule_slots, rule_starts):
        seen.update(q=q, k=k, v=v)
        raise Captured

    fake = gdn_self(key_heads, value_heads, key_dim, value_dim, SimpleNamespace(gdn_prompt_rule=prompt_rule))
    fake._conv = functools.partial(GdnModel._conv, fake)
    fake._split_heads = functools.partial(GdnModel._split_heads, fake)
    family_state = conv_state.copy()
    batch = SimpleNamespace(row_starts=starts,
                            segments=[SimpleNamespace(seq=SimpleNamespace(state_slot=int(s))) for s in slots])
    with pytest.raises(Captured):
        GdnModel._delta_prompts(fake, SimpleNamespace(conv=weight), SimpleNamespace(conv=family_state, state=None),
                                inputs, None, None, batch)

    reference_state = conv_state.copy()
    mixed = gated_delta.conv_prompts_reference(inputs, weight, reference_state, slots, starts)
    np.testing.assert_array_equal(reference_state, family_state)
    for name, expected in zip("qkv", gated_delta.split_heads_reference(mixed, key_heads, value_heads, key_dim, value_dim)):
        np.testing.assert_array_equal(seen[name], expected, err_msg=name)


def test_gated_add_reproduces_the_shared_expert_gate(monkeypatch):
    """``_moe``'s last line: the routed output plus the shared expert's through its gate. The gate
    row is ``h . shared_gate``: with ``h`` the gate column and a unit weight it is the gate itself."""
    rng = np.random.default_rng(84)
    routed = rng.standard_normal((5, 24)).astype(np.float32)
    shared = rng.standard_normal((5, 24)).astype(np.float32)
    gate = (4 * rng.standard_normal((5, 1))).astype(np.float32)
    monkeypatch.setattr(gdn_model, "routed_experts", lambda backend, experts, h, chosen, weights: routed)
    monkeypatch.setattr(gdn_model, "swiglu_mlp", lambda backend, weights, h: shared)
    fake = SimpleNamespace(backend=NUMPY_BACKEND, route=lambda moe, h: (None, None))
    moe = SimpleNamespace(experts=None, shared=None, shared_gate=np.ones((1, 1), np.float32))
    family = GdnModel._moe(fake, moe, gate)
    expected = gated.gated_add_reference(routed, shared, gate)
    assert family.dtype == expected.dtype == np.float32
    np.testing.assert_array_equal(family, expected)


@pytest.mark.parametrize("interleaved", [False, True])
def test_rope_of_the_latent_query_is_rotate(interleaved):
    rng = np.random.default_rng(85)
    x = rng.standard_normal((4, 3, 8)).astype(np.float32)
    positions = np.array([0, 5, 70, 4095], np.int32)
    inv_freq = (1.0 / 10000 ** (np.arange(0, 8, 2) / 8)).astype(np.float32)
    empty = np.zeros((4, 3, 0), np.float32)
    np.testing.assert_array_equal(
        attention_latent.latent_query_reference(empty, x, positions, inv_freq, 1.3, interleaved),
        rotate(NUMPY_BACKEND, x, positions, inv_freq, 1.3, interleaved),
    )


@pytest.mark.parametrize("interleaved", [False, True])
def test_latent_query_reproduces_the_absorbed_decode_queries(interleaved):
    """MLA ``_attention`` on decode rows up to the latent attention: the queries it builds from
    the query projection and the latent queries of ``head_linear``."""
    rng = np.random.default_rng(86)
    rows, heads, rank, nope, rotary = 3, 4, 12, 6, 8
    q = rng.standard_normal((rows, heads * (nope + rotary))).astype(np.float32)
    q_latent = rng.standard_normal((rows, heads, rank)).astype(np.float32)
    positions = np.array([3, 900, 17], np.int32)
    inv_freq = (1.0 / 10000 ** (np.arange(0, rotary, 2) / rotary)).astype(np.float32)
    seen = {}

    def head_linear(x, weight):
        np.testing.assert_array_equal(x, q.reshape(rows, heads, nope + rotary)[:, :, :nope])
        return q_latent

    def latent_attention(queries, latent, batch, value_dim, scale):
        seen["queries"] = queries
        raise Captured

    ops = SimpleNamespace(linear=returns_weight, latent_cache_write=lambda *args: None, head_linear=head_linear,
                          latent_attention=latent_attention)
    config = SimpleNamespace(num_heads=heads, qk_nope_head_dim=nope, qk_rope_head_dim=rotary, kv_lora_rank=rank,
                             interleaved_rope=interleaved, v_head_dim=5)
    fake = SimpleNamespace(backend=SimpleNamespace(xp=np, ops=ops), config=config, inv_freq=inv_freq,
                           attention_factor=1.3, scale=0.1, absorbed_decode=True)
    fake._absorbed = functools.partial(MlaModel._absorbed, fake)
    weights = SimpleNamespace(q=q, kv_a=None, kv_a_bias=None, kv_a_norm=None, w_uk_t=None)
    batch = SimpleNamespace(positions=positions, row_starts=np.arange(rows + 1), slot_mapping=None)
    with pytest.raises(Captured):
        MlaModel._attention(fake, weights, SimpleNamespace(latent=None), np.zeros((rows, 1), np.float32), batch)

    expected = attention_latent.latent_query_reference(
        q_latent, q.reshape(rows, heads, nope + rotary), positions, inv_freq, 1.3, interleaved)
    assert seen["queries"].dtype == expected.dtype == np.float32
    np.testing.assert_array_equal(seen["queries"], expected)
