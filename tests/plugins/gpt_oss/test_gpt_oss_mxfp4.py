"""GPT-OSS with MXFP4 experts (as the released checkpoints store them) against transformers run on
the dequantized weights: logits, greedy tokens, tensor-parallel ranks; the test's MXFP4 encoding
checked against transformers' own decoding of it."""

from __future__ import annotations

import numpy as np
import pytest
from gpt_oss_mxfp4 import QUANTIZED_STACKS, quantize_mxfp4, write_mxfp4_twins

from metrale import LLM, SamplingParams
from metrale.errors import QuantizationError
from metrale.kernels.quantized import QuantizedWeight
from metrale.loading.checkpoint import Checkpoint
from metrale.testing import max_relative_error
from metrale.testing.conformance import check_tensor_parallel
from metrale.testing.hf import hf_greedy, hf_reference_logits

TOLERANCE = 1e-4


def load(path, **options):
    return LLM(path, device="cpu", show_progress=False, **options)


def random_ids(length, seed, vocab=128):
    return np.random.default_rng(seed).integers(0, vocab, length).tolist()


@pytest.fixture(scope="module")
def mxfp4_twins(tmp_path_factory):
    """``(quantized, dequantized)``: a tiny GPT-OSS whose experts are 64 wide, so that each of two
    ranks holds whole MXFP4 blocks of the down projections' columns."""
    from transformers import GptOssConfig, GptOssForCausalLM

    from conftest import GPT_OSS_BASE
    from metrale.testing.hf import build_hf_checkpoint

    root = tmp_path_factory.mktemp("gpt-oss-mxfp4")
    yarn = {"rope_type": "yarn", "factor": 16.0, "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False,
            "original_max_position_embeddings": 16, "rope_theta": 150000.0}
    config = GptOssConfig(**{**GPT_OSS_BASE, "intermediate_size": 64}, num_key_value_heads=2, num_experts_per_tok=2,
                          swiglu_limit=0.75, rope_parameters=yarn)
    source = build_hf_checkpoint(GptOssForCausalLM, config, root / "source", seed=90)
    write_mxfp4_twins(source, root / "mxfp4", root / "dequantized")
    return root / "mxfp4", root / "dequantized"


def test_the_encoding_is_what_transformers_decodes(mxfp4_twins):
    """The test's blocks and scales decode, by transformers' MXFP4 integration, to the values the
    dequantized twin holds."""
    import torch
    from safetensors.numpy import load_file

    try:
        from transformers.integrations.mxfp4 import convert_moe_packed_tensors
    except ImportError as error:
        pytest.skip(f"transformers' MXFP4 integration does not import: {error}")
    quantized, dequantized = (load_file(str(folder / "model.safetensors")) for folder in mxfp4_twins)
    for stack in QUANTIZED_STACKS:
        name = f"model.layers.1.{stack}"
        decoded = convert_moe_packed_tensors(torch.from_numpy(quantized[f"{name}_blocks"]),
                                             torch.from_numpy(quantized[f"{name}_scales"]), dtype=torch.float32)
        np.testing.assert_array_equal(decoded.numpy(), dequantized[name])
        assert name not in quantized


def test_quantize_mxfp4_rounds_to_the_nearest_code():
    rng = np.random.default_rng(0)
    matrix = rng.standard_normal((3, 5, 64)).astype(np.float32)
    blocks, scales, values = quantize_mxfp4(matrix)
    assert blocks.shape == (3, 5, 2, 16) and scales.shape == (3, 5, 2)
    step = np.exp2(scales.astype(np.float32) - 127)[..., None]  # the finest code spacing is 0.5 * scale
    error = np.abs(values - matrix).reshape(3, 5, 2, 32)
    assert (error <= step + 1e-6).all()  # at most half the widest spacing (2, between 4 and 6)


def test_the_experts_load_quantized(mxfp4_twins):
    quantized, _ = mxfp4_twins
    assert Checkpoint(quantized).is_quantized("model.layers.0.mlp.experts.gate_up_proj")
    experts = load(quantized).model.layers[0].moe.experts
    assert isinstance(experts.gate_up, QuantizedWeight) and experts.gate_up.codes_format == "mxfp4"
    assert experts.gate_up.shape == (4 * 128, 64) and experts.down.shape == (4 * 64, 64)


@pytest.mark.parametrize("length", [1, 9, 40])
def test_score_matches_transformers_on_the_dequantized_weights(mxfp4_twins, length):
    quantized, dequantized = mxfp4_twins
    ids = random_ids(length, 40 + length)
    error = max_relative_error(load(quantized).score(ids), hf_reference_logits(dequantized, ids))
    assert error <= TOLERANCE, f"relative error {error:.3g}"


def test_greedy_generation_matches_transformers_on_the_dequantized_weights(mxfp4_twins):
    quantized, dequantized = mxfp4_twins
    prompt = random_ids(11, 98)
    ours = load(quantized).generate(prompt, SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True))
    assert ours[0].token_ids == hf_greedy(dequantized, prompt, 24)


@pytest.mark.parametrize("expert_parallel", [False, True])
def test_tensor_parallel_ranks_match_the_whole_model(mxfp4_twins, expert_parallel):
    quantized, _ = mxfp4_twins
    check_tensor_parallel(quantized, 2, random_ids(40, 41), expert_parallel=expert_parallel, tolerance=TOLERANCE)


def test_a_split_off_the_mxfp4_blocks_is_refused(tmp_path, gpt_oss_checkpoints):
    """Experts 96 wide split over two ranks leave each rank 48 columns of the down projections, off
    MXFP4's blocks of 32: refused, naming the tensor; expert parallelism keeps experts whole."""
    from metrale.backends.parallel import Shard, rank_context, run_ranks

    write_mxfp4_twins(gpt_oss_checkpoints["gpt_oss"], tmp_path / "mxfp4", tmp_path / "dequantized")

    def rank(communicator):
        with rank_context(Shard(communicator.rank, 2), communicator):
            load(tmp_path / "mxfp4")

    with pytest.raises(QuantizationError, match=r"experts.down_proj: a rank's columns \[0, 48\) does not fall on"):
        run_ranks(2, rank)
    check_tensor_parallel(tmp_path / "mxfp4", 2, random_ids(12, 3), expert_parallel=True, tolerance=TOLERANCE)
