"""The grouped MoE kernels' host side: the reference against a direct per-pair sum, the alignment's
host model and its invariants, the launchers' checks, and the CUDA C++ kernels themselves run on
the host through an emulation of the CUDA features they use (``cuda_emulation.h``; needs a C++20
compiler). Their real-GPU tests are tests/kernels/test_moe_grouped_gpu.py."""

from __future__ import annotations

import subprocess
from types import SimpleNamespace

import numpy as np
import pytest
from emulation import build_emulated

from metrale.errors import KernelArgumentError
from metrale.kernels import moe, moe_grouped
from metrale.loading.checkpoint import bf16_to_float32, float32_to_bf16


def experts_case(rng, tokens, top_k, hidden, inter, num_experts, choose):
    """bf16 ``x``, weights and stacked expert weights, and the choices ``choose`` makes."""
    x = float32_to_bf16(rng.standard_normal((tokens, hidden)).astype(np.float32))
    chosen = choose(rng, tokens, top_k, num_experts).astype(np.int32)
    weights = rng.random((tokens, top_k)).astype(np.float32)
    gate_up = float32_to_bf16((0.1 * rng.standard_normal((num_experts * 2 * inter, hidden))).astype(np.float32))
    down = float32_to_bf16((0.1 * rng.standard_normal((num_experts * hidden, inter))).astype(np.float32))
    return x, chosen, weights, gate_up, down


def distinct(rng, tokens, top_k, num_experts):
    """k distinct experts per token, uniformly."""
    return np.stack([rng.choice(num_experts, top_k, replace=False) for _ in range(tokens)])


def all_to_expert_0(rng, tokens, top_k, num_experts):
    """Expert 0 in every token's first slot, the rest distinct among the others."""
    others = [rng.choice(np.arange(1, num_experts), top_k - 1, replace=False) for _ in range(tokens)]
    return np.stack([np.concatenate([[0], rest]) for rest in others])


def few_experts(rng, tokens, top_k, num_experts):
    """Only the first k + 2 experts are ever chosen; the others get no pair."""
    return np.stack([rng.choice(min(num_experts, top_k + 2), top_k, replace=False) for _ in range(tokens)])


def per_pair(x, chosen, weights, gate_up, down):
    """The experts' sum pair by pair, in float64."""
    x, gate_up, down = (np.asarray(a, np.float64) for a in (x, gate_up, down))
    inter, hidden = down.shape[1], x.shape[1]
    out = np.zeros(x.shape)
    for n in range(x.shape[0]):
        for s in range(chosen.shape[1]):
            e = int(chosen[n, s])
            gate = gate_up[2 * inter * e : 2 * inter * e + inter] @ x[n]
            up = gate_up[2 * inter * e + inter : 2 * inter * (e + 1)] @ x[n]
            out[n] += weights[n, s] * (down[hidden * e : hidden * (e + 1)] @ (gate / (1 + np.exp(-gate)) * up))
    return out


# ------------------------------------------------------------------------------ references


@pytest.mark.parametrize("choose", [distinct, all_to_expert_0, few_experts])
def test_the_reference_is_the_per_pair_sum(choose):
    rng = np.random.default_rng(1)
    x, chosen, weights, gate_up, down = experts_case(rng, 37, 3, 24, 16, 7, choose)
    x, gate_up, down = bf16_to_float32(x), bf16_to_float32(gate_up), bf16_to_float32(down)
    got = moe_grouped.grouped_experts_reference(x, chosen, weights, gate_up, down)
    assert got.dtype == np.float32 and got.shape == (37, 24)
    np.testing.assert_allclose(got, per_pair(x, chosen, weights, gate_up, down), rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(got, moe.experts_reference(x, chosen, weights, gate_up, down), rtol=1e-5, atol=1e-6)


def test_a_large_negative_gate_gives_zero_not_nan():
    x = np.ones((1, 8), np.float32)
    gate_up = np.concatenate([np.full((1, 8), -20.0), np.ones((1, 8))]).astype(np.float32)  # I = 1, gate -160
    down = np.ones((8, 1), np.float32)
    out = moe_grouped.grouped_experts_reference(x, np.zeros((1, 1), np.int32), np.ones((1, 1), np.float32),
                                                gate_up, down)
    np.testing.assert_array_equal(out, np.zeros((1, 8), np.float32))


# ------------------------------------------------------------------------------- alignment


def check_alignment(sorted_pairs, tile_expert, chosen, num_experts, block_m):
    """The invariants the products rely on, for any order of each expert's pairs."""
    flat = chosen.reshape(-1)
    tiles = moe_grouped.max_tiles(flat.size, num_experts, block_m)
    assert sorted_pairs.shape == (tiles * block_m,) and tile_expert.shape == (tiles,)
    real = sorted_pairs[sorted_pairs >= 0]
    np.testing.assert_array_equal(np.sort(real), np.arange(flat.size))  # every pair exactly once
    assert set(np.unique(sorted_pairs[sorted_pairs < 0])) <= {-1}
    used = int((tile_expert >= 0).sum())
    assert (tile_expert[:used] >= 0).all() and (tile_expert[used:] == -1).all()  # used tiles first
    assert (np.diff(tile_expert[:used]) >= 0).all()  # in expert order
    assert (sorted_pairs[used * block_m :] == -1).all()
    for tile in range(used):
        rows = sorted_pairs[tile * block_m : (tile + 1) * block_m]
        pairs = rows[rows >= 0]
        assert (flat[pairs] == tile_expert[tile]).all()  # a tile's pairs are its expert's
        if pairs.size < block_m:  # padding only at the end of an expert's last tile
            assert (rows[: pairs.size] >= 0).all()
            assert tile + 1 == used or tile_expert[tile + 1] != tile_expert[tile]
    for expert in range(num_experts):  # an expert's tiles are consecutive and as few as possible
        count = int((flat == expert).sum())
        owned = np.flatnonzero(tile_expert == expert)
        assert owned.size == -(-count // block_m)
        if owned.size:
            assert (np.diff(owned) == 1).all()


@pytest.mark.parametrize("choose", [distinct, all_to_expert_0, few_experts])
@pytest.mark.parametrize("tokens, top_k, num_experts, block_m", [
    (300, 6, 64, 64), (2048, 10, 128, 64), (5, 2, 9, 64), (90, 2, 4, 16), (1, 1, 1, 64), (100, 8, 256, 128),
])
def test_alignment_invariants(choose, tokens, top_k, num_experts, block_m):
    rng = np.random.default_rng(tokens + top_k)
    chosen = choose(rng, tokens, top_k, num_experts).astype(np.int32)
    sorted_pairs, tile_expert = moe_grouped.align_reference(chosen, num_experts, block_m)
    check_alignment(sorted_pairs, tile_expert, chosen, num_experts, block_m)
    # The reference keeps each expert's pairs in increasing order.
    for tile in np.flatnonzero(tile_expert >= 0):
        rows = sorted_pairs[tile * block_m : (tile + 1) * block_m]
        assert (np.diff(rows[rows >= 0]) > 0).all()


def test_max_tiles_covers_the_worst_routing():
    """Every expert's run ends in a partial tile: ceil(P / block_m) full-size tiles are not enough,
    one extra tile per expert with pairs is."""
    block_m, num_experts = 64, 8
    for pairs in (1, 7, 63, 64, 65, 8 * 65, 1000):
        flat = np.arange(pairs) % num_experts  # as even as possible: many partial tiles
        needed = sum(-(-int((flat == e).sum()) // block_m) for e in range(num_experts))
        assert needed <= moe_grouped.max_tiles(pairs, num_experts, block_m)
    assert moe_grouped.max_tiles(0, 8) == 0
    assert moe_grouped.max_tiles(12288, 64) == 192 + 64


# ------------------------------------------------------------------------------- launchers


def test_supported_shapes():
    assert moe_grouped.supports(2048, 1408, 64)
    assert moe_grouped.supports(2048, 512, 128)
    assert moe_grouped.supports(72, 40, 1)
    assert not moe_grouped.supports(2048, 1407, 64)
    assert not moe_grouped.supports(2044, 1408, 64)
    assert not moe_grouped.supports(2048, 1408, moe_grouped.MAX_EXPERTS + 1)
    assert not moe_grouped.supports(2048, 1408, 0)


def test_tilings():
    assert moe_grouped.TILING.valid() and moe_grouped.TILING.threads == 128
    assert moe_grouped.TILING.shared_bytes <= 48 * 1024  # no opt-in needed for the default
    assert moe_grouped.Tiling(128, 128, 4, 2, 3).valid()
    assert not moe_grouped.Tiling(64, 128, 4, 4, 3).valid()  # 512 threads for 256 chunks of A
    assert not moe_grouped.Tiling(64, 72, 2, 2, 3).valid()
    assert not moe_grouped.Tiling(64, 128, 2, 2, 1).valid()
    assert moe_grouped.LARGE_TILING.valid()
    assert moe_grouped.tiling_for(2048, 6, 64) == moe_grouped.LARGE_TILING  # 192 pairs an expert
    assert moe_grouped.tiling_for(300, 6, 64) == moe_grouped.TILING  # 28 pairs an expert
    assert moe_grouped.Tiling(128, 256, 2, 4, 3, 64).valid()  # 166 KiB of shared memory: opted into
    assert moe_grouped.Tiling(128, 256, 2, 4, 3, 64).shared_bytes == 3 * 384 * 72 * 2
    assert not moe_grouped.Tiling(64, 128, 2, 2, 3, 48).valid()  # slices of 32 or 64
    assert not moe_grouped.Tiling(256, 256, 2, 4, 4, 64).valid()  # more shared memory than a block gets


def test_the_source_is_specialised_per_tiling():
    text = moe_grouped.source(moe_grouped.Tiling(128, 64, 4, 2, 2, 64))
    assert "__" + "BLOCK_M__" not in text and "#define BLOCK_M 128" in text and "#define STAGES 2" in text
    assert "__" + "BLOCK_K__" not in text and "#define BLOCK_K 64" in text
    assert "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32" in text
    assert "ldmatrix.sync.aligned.m8n8.x4.shared.b16" in text and "cp.async.cg.shared.global" in text
    for name in ("moe_align", "moe_grouped_gate_up", "moe_grouped_down", "moe_sum_pairs"):
        assert f" {name}(" in text
    assert text.count('extern "C" __global__') == 4


def grouped_arguments(tokens=100, top_k=2, hidden=64, inter=32, num_experts=4):
    pairs = tokens * top_k
    rows = moe_grouped.max_tiles(pairs, num_experts) * moe_grouped.BLOCK_M
    return dict(
        x=np.zeros((tokens, hidden), np.uint16), chosen=np.zeros((tokens, top_k), np.int32),
        weights=np.zeros((tokens, top_k), np.float32),
        gate_up=np.zeros((num_experts * 2 * inter, hidden), np.uint16),
        down=np.zeros((num_experts * hidden, inter), np.uint16), sorted_pairs=np.zeros(rows, np.int32),
        tile_expert=np.zeros(rows // moe_grouped.BLOCK_M, np.int32), act=np.zeros((rows, inter), np.uint16),
        pair_out=np.zeros((pairs, hidden), np.float32), out=np.zeros((tokens, hidden), np.float32),
    )


@pytest.mark.parametrize("change, message", [
    (dict(hidden=60), "unsupported"),
    (dict(inter=36), "unsupported"),
    (dict(num_experts=moe_grouped.MAX_EXPERTS + 1), "unsupported"),
])
def test_unsupported_shapes_are_refused_before_any_launch(change, message):
    with pytest.raises(KernelArgumentError, match=message):
        moe_grouped.grouped_experts(**grouped_arguments(**change))


@pytest.mark.parametrize("name, bad", [
    ("chosen", np.zeros((100, 2), np.int64)),
    ("weights", np.zeros((100, 3), np.float32)),
    ("act", np.zeros((64, 32), np.uint16)),
    ("pair_out", np.zeros((100, 64), np.float32)),
    ("out", np.zeros((100, 64), np.float64)),
])
def test_wrong_arguments_are_refused_before_any_launch(name, bad):
    arguments = grouped_arguments()
    arguments[name] = bad
    with pytest.raises(KernelArgumentError, match=name):
        moe_grouped.grouped_experts(**arguments)


def test_a_wrong_scratch_size_is_refused_by_the_alignment():
    with pytest.raises(KernelArgumentError, match="sorted_pairs"):
        moe_grouped.align(np.zeros((10, 2), np.int32), 4, np.zeros(64, np.int32), np.zeros(5, np.int32))


# ------------------------------------------------------------------------ the routed experts


def test_routed_experts_call_the_op_on_every_batch_size_off_the_cpu():
    from metrale.layers.experts import StackedExperts, routed_experts

    calls = []
    ops = SimpleNamespace(moe_experts=lambda *arguments: calls.append(arguments) or "op")
    backend = SimpleNamespace(name="cuda", ops=ops, all_reduce=lambda x: x)  # one rank
    experts = StackedExperts(gate_up="gate_up", down="down", experts=[])
    for tokens in (1, 64, 65, 4096):
        assert routed_experts(backend, experts, np.zeros((tokens, 8)), "chosen", "weights") == "op"
    assert len(calls) == 4 and calls[-1][3:] == ("gate_up", "down")


@pytest.mark.parametrize("tokens", [5, 100])
def test_routed_experts_on_the_cpu_match_the_reference(tokens):
    from metrale.backends.base import CpuBackend
    from metrale.layers.experts import MAX_PAIRWISE_TOKENS, StackedExperts, routed_experts
    from metrale.layers.mlp import MlpWeights

    rng = np.random.default_rng(tokens)
    hidden, inter, num_experts = 16, 8, 6
    x, chosen, weights, gate_up, down = experts_case(rng, tokens, 3, hidden, inter, num_experts, few_experts)
    x, gate_up, down = bf16_to_float32(x), bf16_to_float32(gate_up), bf16_to_float32(down)
    views = [MlpWeights(gate_up[2 * inter * e : 2 * inter * (e + 1)], down[hidden * e : hidden * (e + 1)])
             for e in range(num_experts)]
    got = routed_experts(CpuBackend(), StackedExperts(gate_up, down, views), x, chosen, weights)
    assert (tokens > MAX_PAIRWISE_TOKENS) == (tokens == 100)
    np.testing.assert_allclose(got, moe_grouped.grouped_experts_reference(x, chosen, weights, gate_up, down),
                               rtol=1e-5, atol=1e-6)


# ---------------------------------------------------------------- the kernels, emulated

EMULATION_MAIN = r"""

int main(int argc, char** argv) {
    if (argc != 12) return 2;
    const std::string folder = argv[1];
    const int tokens = std::atoi(argv[2]), top_k = std::atoi(argv[3]), hidden = std::atoi(argv[4]);
    const int inter = std::atoi(argv[5]), experts = std::atoi(argv[6]), tiles = std::atoi(argv[7]);
    emu::defer_copies = std::atoi(argv[8]);
    const int clamped = std::atoi(argv[9]);   // GPT-OSS's experts: biases and the clamped SwiGLU
    const float alpha = std::atof(argv[10]), limit = std::atof(argv[11]);
    const int pairs = tokens * top_k;
    const size_t rows = (size_t)tiles * BLOCK_M;
    auto* x = read<unsigned short>(folder + "/x", (size_t)tokens * hidden);
    auto* chosen = read<int>(folder + "/chosen", pairs);
    auto* weights = read<float>(folder + "/weights", pairs);
    auto* gate_up = read<unsigned short>(folder + "/gate_up", (size_t)experts * 2 * inter * hidden);
    auto* down = read<unsigned short>(folder + "/down", (size_t)experts * hidden * inter);
    const float* gate_up_bias = clamped ? read<float>(folder + "/gate_up_bias", (size_t)experts * 2 * inter) : nullptr;
    const float* down_bias = clamped ? read<float>(folder + "/down_bias", (size_t)experts * hidden) : nullptr;
    auto* sorted_pairs = allocate<int>(rows);
    auto* tile_expert = allocate<int>(tiles);
    auto* act = allocate<unsigned short>(rows * inter);
    auto* pair_out = allocate<float>((size_t)pairs * hidden);
    auto* out = allocate<float>((size_t)tokens * hidden);
    emu::launch({1, 1, 1}, {ALIGN_THREADS, 1, 1},
                [&] { moe_align(chosen, pairs, experts, BLOCK_M, tiles, sorted_pairs, tile_expert); });
    emu::launch({(unsigned)((inter + BLOCK_N / 2 - 1) / (BLOCK_N / 2)), (unsigned)tiles, 1}, {THREADS, 1, 1},
                [&] { moe_grouped_gate_up(x, gate_up, sorted_pairs, tile_expert, top_k, hidden, inter, act,
                                          gate_up_bias, clamped, alpha, limit); });
    emu::launch({(unsigned)((hidden + BLOCK_N - 1) / BLOCK_N), (unsigned)tiles, 1}, {THREADS, 1, 1},
                [&] { moe_grouped_down(act, down, sorted_pairs, tile_expert, weights, hidden, inter, pair_out,
                                       down_bias); });
    emu::launch({3, 1, 1}, {64, 1, 1}, [&] { moe_sum_pairs(pair_out, tokens, top_k, hidden, out); });
    write(folder + "/sorted_pairs", sorted_pairs, rows);
    write(folder + "/tile_expert", tile_expert, tiles);
    write(folder + "/act", act, rows * inter);
    write(folder + "/out", out, (size_t)tokens * hidden);
    return 0;
}
"""


@pytest.fixture(scope="module")
def emulated(tmp_path_factory):
    """Build the kernels of each tiling asked for against the emulation; return a runner."""
    folder = tmp_path_factory.mktemp("moe_grouped_emulated")
    builds: dict = {}

    def build(tiling):
        if tiling not in builds:
            builds[tiling] = build_emulated(folder / f"kernels_{'_'.join(map(str, tiling))}.cpp",
                                            moe_grouped.constants(tiling) + moe_grouped.KERNELS + EMULATION_MAIN)
        return builds[tiling]

    def run(tiling, x, chosen, weights, gate_up, down, defer_copies=True, biases=None, clamp=None):
        tokens, hidden = x.shape
        top_k, inter = chosen.shape[1], down.shape[1]
        num_experts = down.shape[0] // hidden
        tiles = moe_grouped.max_tiles(tokens * top_k, num_experts, tiling.block_m)
        case = folder / "case"
        case.mkdir(exist_ok=True)
        arrays = dict(x=x, chosen=chosen, weights=weights, gate_up=gate_up, down=down)
        if clamp is not None:
            arrays.update(gate_up_bias=biases[0], down_bias=biases[1])
        for name, array in arrays.items():
            np.ascontiguousarray(array).tofile(case / name)
        alpha, limit = clamp if clamp is not None else (0.0, 0.0)
        subprocess.run([str(build(tiling)), str(case), *map(str, (tokens, top_k, hidden, inter, num_experts, tiles)),
                        str(int(defer_copies)), str(int(clamp is not None)), repr(alpha), repr(limit)],
                       check=True, timeout=600)
        return SimpleNamespace(
            sorted_pairs=np.fromfile(case / "sorted_pairs", np.int32), tile_expert=np.fromfile(case / "tile_expert", np.int32),
            act=np.fromfile(case / "act", np.uint16).reshape(-1, inter),
            out=np.fromfile(case / "out", np.float32).reshape(tokens, hidden),
        )

    return run


@pytest.mark.slow
@pytest.mark.parametrize("tiling, shape, choose, defer_copies", [
    (moe_grouped.TILING, (40, 3, 72, 40, 5), distinct, True),  # H, I not multiples of a tile
    (moe_grouped.TILING, (7, 2, 64, 24, 9), distinct, True),  # N * k < BLOCK_M, experts without pairs
    (moe_grouped.TILING, (90, 2, 136, 72, 4), all_to_expert_0, True),  # one expert takes every token
    (moe_grouped.TILING, (33, 4, 96, 136, 12), few_experts, False),  # copies land at once; most experts idle
    (moe_grouped.Tiling(128, 64, 4, 2, 2), (50, 3, 80, 48, 6), distinct, True),
    (moe_grouped.Tiling(64, 256, 2, 4, 4), (30, 2, 264, 40, 3), distinct, True),
])
def test_the_kernels_run_emulated_match_the_reference(emulated, tiling, shape, choose, defer_copies):
    tokens, top_k, hidden, inter, num_experts = shape
    rng = np.random.default_rng(sum(shape))
    x, chosen, weights, gate_up, down = experts_case(rng, tokens, top_k, hidden, inter, num_experts, choose)
    got = emulated(tiling, x, chosen, weights, gate_up, down, defer_copies)
    check_alignment(got.sorted_pairs, got.tile_expert, chosen, num_experts, tiling.block_m)
    want_sorted, want_tiles = moe_grouped.align_reference(chosen, num_experts, tiling.block_m)
    np.testing.assert_array_equal(got.tile_expert, want_tiles)

    # Each pair's activation row, against float32 sums rounded to bf16 (a few bf16 steps apart at most).
    xf, gate_upf, downf = bf16_to_float32(x), bf16_to_float32(gate_up), bf16_to_float32(down)
    flat = chosen.reshape(-1)
    used = np.flatnonzero(got.tile_expert >= 0)
    slots = np.concatenate([np.arange(t * tiling.block_m, (t + 1) * tiling.block_m) for t in used])
    pairs = got.sorted_pairs[slots]
    assert not got.act[slots[pairs < 0]].any(), "padding rows of act hold zeros"
    real, pairs = slots[pairs >= 0], pairs[pairs >= 0]
    gate_rows = gate_upf.reshape(num_experts, 2, inter, hidden)[flat[pairs]]
    gate = np.einsum("pih,ph->pi", gate_rows[:, 0], xf[pairs // top_k])
    up = np.einsum("pih,ph->pi", gate_rows[:, 1], xf[pairs // top_k])
    expected_act = gate / (1 + np.exp(-gate)) * up
    act = bf16_to_float32(got.act[real])
    assert np.abs(act - expected_act).max() <= 2 ** -7 * np.abs(expected_act).max()

    expected = moe_grouped.grouped_experts_reference(xf, chosen, weights, gate_upf, downf)
    assert np.isfinite(got.out).all()
    assert np.abs(got.out - expected).max() <= 1e-2 * np.abs(expected).max()


@pytest.mark.slow
@pytest.mark.parametrize("shape, choose", [
    ((40, 4, 72, 40, 8), distinct),  # H, I not multiples of a tile
    ((70, 2, 64, 24, 4), all_to_expert_0),
])
def test_gpt_oss_experts_run_emulated_match_the_clamped_reference(emulated, shape, choose):
    """GPT-OSS's experts through the same launches: the biases and the clamped SwiGLU against
    metrale.kernels.moe_clamped's reference (the activations rounded to bf16 here, float32 there)."""
    from metrale.kernels import moe_clamped

    tokens, top_k, hidden, inter, num_experts = shape
    rng = np.random.default_rng(sum(shape) + 1)
    x, chosen, weights, gate_up, down = experts_case(rng, tokens, top_k, hidden, inter, num_experts, choose)
    gate_up_bias = rng.normal(0, 0.5, num_experts * 2 * inter).astype(np.float32)
    down_bias = rng.normal(0, 0.5, num_experts * hidden).astype(np.float32)
    alpha, limit = 1.702, 1.5  # a limit the gate and up sums cross, so both clamps act
    got = emulated(moe_grouped.TILING, x, chosen, weights, gate_up, down, biases=(gate_up_bias, down_bias),
                   clamp=(alpha, limit))
    expected = moe_clamped.clamped_experts_reference(bf16_to_float32(x), chosen, weights, bf16_to_float32(gate_up),
                                                     bf16_to_float32(down), alpha, limit, gate_up_bias, down_bias)
    assert np.isfinite(got.out).all()
    assert np.abs(got.out - expected).max() <= 1e-2 * np.abs(expected).max()
