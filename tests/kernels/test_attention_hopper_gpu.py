"""The Hopper prompt attention (wgmma with TMA loads, sm_90a) against the NumPy reference: GQA,
head sizes 64, 128 and 256, MLA's expanded form (keys of 192 dims, values of 128), pages of 8, 16,
32 and 256 rows, prompt chunks after a cached prefix, several sequences, sliding windows, logit
soft caps and sinks, a long prompt over a long prefix, capture into a CUDA graph; and the same
answer as the ``mma.sync`` kernel within bf16 rounding."""

from __future__ import annotations

import numpy as np
import pytest
from kernel_helpers import rel_error
from test_attention_mma_gpu import attention_case

from metrale.kernels import attention, attention_hopper, attention_mma
from metrale.loading.checkpoint import bf16_to_float32

pytestmark = pytest.mark.gpu


@pytest.fixture(autouse=True)
def hopper():
    if not attention_hopper.available():
        pytest.skip("the wgmma kernel needs a compute capability 9.0 device (sm_90a)")


def run(q, k_cache, v_cache, tables, seq_index, positions, starts, scale, window=None, softcap=None, sinks=None,
        stream=None):
    import cupy as cp

    out = cp.zeros((len(positions), q.shape[1] * v_cache.shape[3]), dtype=np.uint16)
    attention_hopper.prefill_attention(
        cp.asarray(q), cp.asarray(k_cache), cp.asarray(v_cache), cp.asarray(tables), cp.asarray(seq_index),
        cp.asarray(positions), cp.asarray(attention_hopper.query_tiles(starts, q.shape[2], v_cache.shape[3])), scale,
        window, out, stream,
        softcap=softcap, sinks=None if sinks is None else cp.asarray(sinks))
    return bf16_to_float32(cp.asnumpy(out))


@pytest.mark.parametrize("heads, kv_heads, head_dim, value_dim", [
    (32, 8, 128, 128), (32, 8, 64, 64), (16, 16, 128, 128), (14, 2, 64, 64), (16, 2, 256, 256), (16, 16, 192, 128),
])
@pytest.mark.parametrize("block_size", [8, 16, 256])
@pytest.mark.parametrize("window", [None, 100])
def test_prefill_attention_matches_the_reference(heads, kv_heads, head_dim, value_dim, block_size, window):
    rng = np.random.default_rng(heads + head_dim + block_size)
    chunks = [(0, 200), (77, 64), (300, 1), (5, 129)]
    q, k_cache, v_cache, tables, seq_index, positions, starts = attention_case(
        rng, heads, kv_heads, head_dim, block_size, chunks, value_dim)
    scale = head_dim**-0.5
    expected = attention.paged_attention_reference(
        q, bf16_to_float32(k_cache), bf16_to_float32(v_cache), tables, seq_index, positions, scale, window
    ).reshape(len(positions), -1)
    # bf16 queries and probabilities on top of the bf16 output.
    assert rel_error(run(q, k_cache, v_cache, tables, seq_index, positions, starts, scale, window), expected) <= 2e-2


@pytest.mark.parametrize("head_dims", attention_hopper.THREE_CONSUMER_FORMS)
@pytest.mark.parametrize("consumers", [2, 3])
@pytest.mark.parametrize("block_size, window", [(16, None), (256, 100)])
def test_both_consumer_counts_match_the_reference(monkeypatch, head_dims, consumers, block_size, window):
    """The forms of two and three consumer warpgroups (tiles of 128 and 192 rows), whichever the
    head sizes take by default."""
    monkeypatch.setattr(attention_hopper, "THREE_CONSUMER_HEAD_DIMS", frozenset({head_dims} if consumers == 3 else ()))
    assert attention_hopper.tile_rows(*head_dims) == 64 * consumers
    rng = np.random.default_rng(consumers + block_size)
    chunks = [(0, 400), (77, 64), (300, 1), (5, 193)]
    q, k_cache, v_cache, tables, seq_index, positions, starts = attention_case(
        rng, 16, 4, head_dims[0], block_size, chunks, head_dims[1])
    scale = head_dims[0] ** -0.5
    expected = attention.paged_attention_reference(
        q, bf16_to_float32(k_cache), bf16_to_float32(v_cache), tables, seq_index, positions, scale, window
    ).reshape(len(positions), -1)
    assert rel_error(run(q, k_cache, v_cache, tables, seq_index, positions, starts, scale, window), expected) <= 2e-2


@pytest.mark.parametrize("heads, kv_heads, head_dim", [(64, 8, 64), (16, 8, 256), (32, 8, 128)])
@pytest.mark.parametrize("softcap, with_sinks", [(3.0, False), (None, True), (3.0, True)])
@pytest.mark.parametrize("window", [None, 100])
def test_prefill_attention_caps_logits_and_counts_sinks_as_the_reference(heads, kv_heads, head_dim, softcap, with_sinks,
                                                                          window):
    rng = np.random.default_rng(heads + head_dim + (window or 0))
    chunks = [(0, 200), (77, 64), (5, 129)]
    q, k_cache, v_cache, tables, seq_index, positions, starts = attention_case(rng, heads, kv_heads, head_dim, 32,
                                                                               chunks)
    q *= 3.0  # queries large enough that the cap bends the logits
    sinks = (rng.standard_normal(heads) + 2.0).astype(np.float32) if with_sinks else None
    scale = head_dim**-0.5
    expected = attention.paged_attention_reference(
        q, bf16_to_float32(k_cache), bf16_to_float32(v_cache), tables, seq_index, positions, scale, window, softcap,
        sinks).reshape(len(positions), -1)
    plain = attention.paged_attention_reference(
        q, bf16_to_float32(k_cache), bf16_to_float32(v_cache), tables, seq_index, positions, scale, window
    ).reshape(len(positions), -1)
    assert rel_error(plain, expected) > 0.1  # the cap and the sinks change the answer
    got = run(q, k_cache, v_cache, tables, seq_index, positions, starts, scale, window, softcap, sinks)
    assert rel_error(got, expected) <= 2e-2


def test_a_long_prompt_over_a_long_prefix_agrees_with_the_mma_kernel():
    import cupy as cp

    rng = np.random.default_rng(9)
    q, k_cache, v_cache, tables, seq_index, positions, starts = attention_case(rng, 32, 8, 128, 16, [(4000, 700)])
    scale = 128**-0.5
    expected = attention.paged_attention_reference(
        q, bf16_to_float32(k_cache), bf16_to_float32(v_cache), tables, seq_index, positions, scale
    ).reshape(len(positions), -1)
    got = run(q, k_cache, v_cache, tables, seq_index, positions, starts, scale)
    assert rel_error(got, expected) <= 2e-2
    out = cp.zeros((len(positions), 32 * 128), dtype=np.uint16)
    attention_mma.prefill_attention(
        cp.asarray(q), cp.asarray(k_cache), cp.asarray(v_cache), cp.asarray(tables), cp.asarray(seq_index),
        cp.asarray(positions), cp.asarray(attention_mma.query_tiles(starts)), scale, None, out)
    mma = bf16_to_float32(cp.asnumpy(out))
    # Both round the queries and probabilities to bf16; they differ in the order of the sums only.
    assert rel_error(got, mma) <= 1e-2


def test_prefill_attention_replays_in_a_cuda_graph():
    import cupy as cp

    rng = np.random.default_rng(3)
    q, k_cache, v_cache, tables, seq_index, positions, starts = attention_case(rng, 16, 16, 192, 16, [(10, 300)], 128)
    expected = attention.paged_attention_reference(
        q, bf16_to_float32(k_cache), bf16_to_float32(v_cache), tables, seq_index, positions, 0.1
    ).reshape(len(positions), -1)
    arguments = [cp.asarray(a) for a in (q, k_cache, v_cache, tables, seq_index, positions,
                                         attention_hopper.query_tiles(starts, 192, 128))]
    out = cp.zeros((len(positions), 16 * 128), dtype=np.uint16)
    stream = cp.cuda.Stream(non_blocking=True)
    attention_hopper.prefill_attention(*arguments, 0.1, None, out, stream)  # compiled outside the capture
    out[...] = 0
    cp.cuda.Device().synchronize()
    with stream:
        stream.begin_capture()
        attention_hopper.prefill_attention(*arguments, 0.1, None, out, stream)
        graph = stream.end_capture()
    graph.launch(stream)
    stream.synchronize()
    assert rel_error(bf16_to_float32(cp.asnumpy(out)), expected) <= 2e-2



def test_a_model_through_the_registry_gives_the_mma_kernels_logits(tmp_path):
    """A Llama of 128-dim heads: the default registry serves its prompts with this kernel, whose
    logits are as close to transformers' float32 forward of the same checkpoint as those of a
    registry that puts the mma.sync kernel first (a plugin) are, and greedy continuations agree but
    for near ties."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from metrale import LLM, SamplingParams, hookimpl
    from metrale.model.plugin_manager import get_plugin_manager
    from metrale.ops.selection import attention_kernels
    from metrale.testing.hf import build_hf_checkpoint

    config = LlamaConfig(vocab_size=512, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=128, max_position_embeddings=2048)
    folder = build_hf_checkpoint(LlamaForCausalLM, config, tmp_path / "llama", seed=0, dtype=torch.bfloat16)

    class MmaAttentionFirst:
        METRALE_CONTRACT_VERSION = "1.1"

        @hookimpl
        def metrale_register_ops(self, registry):
            for kernel in attention_kernels():
                if kernel.op == "paged_attention_prompt" and kernel.name == "metrale.kernels.attention_mma (tensor cores)":
                    registry.add_kernel(kernel)

    prompts = [np.random.default_rng(n).integers(0, 512, n).tolist() for n in (700, 300, 9)]
    params = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
    logits, tokens = {}, {}
    for hopper in (False, True):
        manager = get_plugin_manager()
        if not hopper:
            manager.register(MmaAttentionFirst(), name="mma-attention-first")
        llm = LLM(folder, device="cuda", show_progress=False, max_model_len=2048, plugin_manager=manager)
        assert ("attention_hopper" in llm.backend.ops.paged_attention_prompt.kernels[0][0].name) == hopper
        logits[hopper] = llm.score(prompts[0])
        outputs = llm.generate(prompts, params, use_tqdm=False)
        llm.close()
        assert all(o.error is None and len(o.token_ids) == 16 for o in outputs)
        tokens[hopper] = [o.token_ids for o in outputs]
    reference = LlamaForCausalLM.from_pretrained(folder, dtype=torch.float32)
    with torch.no_grad():
        expected = reference(torch.tensor([prompts[0]])).logits[0].numpy()
    errors = {hopper: rel_error(logits[hopper], expected) for hopper in logits}
    # Both kernels round the queries and probabilities to bf16; neither may stray further from float32.
    assert errors[True] <= 1.25 * errors[False] + 1e-3, errors
    pairs = [(a, b) for hopper, plain in zip(tokens[True], tokens[False]) for a, b in zip(hopper, plain)]
    assert sum(a == b for a, b in pairs) >= 0.9 * len(pairs)
