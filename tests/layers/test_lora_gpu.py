"""LoRA on the cuda backend (``-m gpu``): the kernels against their references at the 8B shape's
sizes with a mix of adapters and base-model rows; a model's logits with adapters against the CPU
backend's (bf16); a mixed-adapter batch replayed from the adapters' decode graphs against the same
batch run eagerly."""

from __future__ import annotations

import numpy as np
import pytest
from kernel_helpers import bf16, rel_error  # noqa: E402

from metrale import LLM, LoRARequest, SamplingParams
from metrale.kernels.lora_tiles import adapter_tile_capacity, adapter_tiles
from metrale.loading.checkpoint import bf16_to_float32, float32_to_bf16
from metrale.ops import builtin
from metrale.testing.hf import build_peft_adapter

pytestmark = pytest.mark.gpu

LORA_TOLERANCE = 5e-2

PROJECTIONS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def stack_at(rng, inner, outs, slots, rank=16):
    """``(a [S, W, in], b [out, S W])`` bf16 bits of a LoRA stack (``b`` block-diagonal)."""
    width = len(outs) * rank
    a = bf16(rng, (slots, width, inner), 0.05)
    b = np.zeros((sum(outs), slots * width), np.uint16)
    start = 0
    for group, out in enumerate(outs):
        for slot in range(slots):
            b[start : start + out, slot * width + group * rank : slot * width + (group + 1) * rank] = bf16(
                rng, (out, rank), 0.05)
        start += out
    return a, b, width


def cuda_backend():
    from metrale.backends.devices import get_backend
    from metrale.ops import build_op_registry

    backend = get_backend("cuda")
    backend.use_ops(build_op_registry())
    return backend


@pytest.mark.parametrize("inner, outs, x_bf16, slots, route", [
    (4096, (4096, 1024, 1024), True, 4, None), (14336, (4096,), True, 4, None), (4096, (14336, 14336), False, 4, None),
    (4096, (4096, 1024, 1024), True, 4, 3),  # a step of one adapter: the shrink with its A only
])
def test_lora_linear_at_the_8b_shape(inner, outs, x_bf16, slots, route):
    """A prompt step's path (the shrink and expand apart): 96 rows of rank-16 slots and
    base-model rows against the op's reference (the shrunk rows are bf16, as a product's inputs)."""
    import cupy as cp

    backend = cuda_backend()
    rng = np.random.default_rng(inner + (route or 0))
    rows = 96
    a, b, _ = stack_at(rng, inner, outs, slots)
    x = bf16(rng, (rows, inner)) if x_bf16 else rng.standard_normal((rows, inner)).astype(np.float32)
    row_slots = (rng.integers(0, slots + 1, rows) if route is None else np.where(rng.random(rows) < 0.7, route, 0))
    row_slots = row_slots.astype(np.int32)
    y = rng.standard_normal((rows, sum(outs))).astype(np.float32)
    expected = builtin.lora_linear(y.copy(), bf16_to_float32(x) if x_bf16 else x, bf16_to_float32(a),
                                   bf16_to_float32(b), row_slots, route)
    with backend.activate():
        got = backend.ops.lora_linear(cp.asarray(y), cp.asarray(x), cp.asarray(a), cp.asarray(b),
                                      cp.asarray(row_slots), route)
        backend.synchronize()
    assert rel_error(cp.asnumpy(got) - y, expected - y) <= 1e-2
    np.testing.assert_array_equal(cp.asnumpy(got)[row_slots == 0], y[row_slots == 0])


@pytest.mark.parametrize("inner, outs, slots, swiglu, one_slot", [
    (4096, (4096, 1024, 1024), 4, False, False), (14336, (4096,), 4, False, False),
    (4096, (14336, 14336), 4, True, False), (4096, (4096, 1024, 1024), 8, False, False),
    (4096, (14336, 14336), 4, True, True), (14336, (4096,), 4, False, True),
])
def test_lora_expand_at_the_8b_shape(inner, outs, slots, swiglu, one_slot):
    """A decode step's path: one product of 32 rows with the stack's extended weight (the
    projection's rows, then every slot's A), then the expand, against the op's reference; the
    rows of random slots (the base model's too) or all of one."""
    import cupy as cp

    backend = cuda_backend()
    rng = np.random.default_rng(inner + slots)
    rows, out = 32, sum(outs)
    a, b, width = stack_at(rng, inner, outs, slots)
    weight = np.concatenate([bf16(rng, (out, inner), 0.02), a.reshape(slots * width, inner)])
    x = bf16(rng, (rows, inner))
    row_slots = np.full(rows, 2, np.int32) if one_slot else rng.integers(0, slots + 1, rows).astype(np.int32)
    tiles = adapter_tiles(row_slots, adapter_tile_capacity(rows))  # a CUDA graph's table: room for any mix
    bias = rng.standard_normal(out).astype(np.float32)
    with backend.activate():
        ext = backend.ops.linear(cp.asarray(x), cp.asarray(weight))
        got = backend.ops.lora_expand(ext, cp.asarray(b), cp.asarray(row_slots), cp.asarray(tiles), width,
                                      cp.asarray(bias), swiglu)
        backend.synchronize()
        ext = cp.asnumpy(ext)
    got = bf16_to_float32(cp.asnumpy(got)) if swiglu else cp.asnumpy(got)
    rounded = ext.copy()  # the shrunk products in bf16, as the expand reads them
    rounded[:, out:] = bf16_to_float32(float32_to_bf16(ext[:, out:]))
    expected = builtin.lora_expand(rounded, bf16_to_float32(b), row_slots, tiles, width, bias, swiglu)
    base = builtin.lora_expand(rounded, np.zeros(b.shape, np.float32), row_slots, tiles, width, bias, swiglu)
    assert rel_error(got - base, expected - base) <= 1e-2
    assert rel_error(got, expected) <= (1e-2 if swiglu else 1e-5)
    # The products with the adapters' A came out of the same product as the projection.
    assert rel_error(ext[:, out:], bf16_to_float32(x) @ bf16_to_float32(a.reshape(slots * width, inner)).T) <= 1e-2


def adapters(checkpoint, tmp_path, count=3, scale=0.2, targets=PROJECTIONS):
    requests = []
    for index in range(count):
        build_peft_adapter(checkpoint, tmp_path / f"a{index}", seed=index, scale=scale, r=[8, 16, 4][index % 3],
                           lora_alpha=16, target_modules=targets,
                           trainable_token_indices={"embed_tokens": [5, 17], "lm_head": [3, 40]})
        requests.append(LoRARequest(f"a{index}", index + 1, tmp_path / f"a{index}"))
    return requests


# (PEFT turns MLP targets of models with fused experts into expert parameters: attention only there.)
FAMILY_TARGETS = {"dense": PROJECTIONS, "mla": ["q_proj", "q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "o_proj"],
                  "gdn": ["q_proj", "k_proj", "v_proj", "o_proj", "in_proj_qkvz", "in_proj_ba", "out_proj"]}


@pytest.mark.parametrize("family", ["dense", "mla", "gdn"])
def test_logits_with_adapters_match_the_cpu_backend(family_checkpoint_of, tmp_path, family):
    checkpoint = family_checkpoint_of(family)
    # Adapter weights of the base weights' size (0.15 N): bf16 rounds them as it rounds those.
    peft = build_peft_adapter(checkpoint, tmp_path / "adapter", seed=0, scale=0.05, r=8, lora_alpha=16,
                              target_modules=FAMILY_TARGETS[family],
                              trainable_token_indices={"embed_tokens": [5, 17], "lm_head": [3, 40]})
    request = LoRARequest("adapter", 1, tmp_path / "adapter")
    # The same function with the adapter merged into the weights: its bf16 error is what the GPU
    # gets for it without any adapter kernel (a model whose routing or attention amplifies bf16
    # roundings amplifies them with or without the adapter).
    peft.merge_and_unload().save_pretrained(str(tmp_path / "merged"))
    tokens = [5, 17, 99, 3, 42, 8, 61, 23, 77, 14, 2, 90]
    results, base, merged = [], [], []
    for device in ("cpu", "cuda"):
        with LLM(str(checkpoint), device=device, enable_lora=True, show_progress=False) as llm:
            results.append(llm.score(tokens, lora_request=request))
            base.append(llm.score(tokens))
        with LLM(str(tmp_path / "merged"), device=device, show_progress=False) as llm:
            merged.append(llm.score(tokens))
    effect, error = rel_error(results[0], base[0]), rel_error(results[1], results[0])
    base_error, merged_error = rel_error(base[1], base[0]), rel_error(merged[1], merged[0])
    print(f"{family}: the adapter moves the logits by {effect:.3g}; cuda against cpu: {error:.3g} with it, "
          f"{base_error:.3g} without, {merged_error:.3g} merged")
    assert rel_error(merged[0], results[0]) <= 1e-4  # the merged weights are the adapter's function
    assert base_error <= LORA_TOLERANCE
    # Each adapted projection rounds twice more to bf16 (the adapter's weights, its rank-R
    # product): within half as much again as the bf16 error of the model or of the merged one.
    allowed = 1.5 * max(base_error, merged_error, 2e-2)
    assert error <= allowed
    assert effect > allowed  # an adapter left out would fail


def test_mixed_adapter_decode_replays_from_graphs(dense_checkpoints, tmp_path):
    checkpoint = dense_checkpoints["qwen3"]
    requests = adapters(checkpoint, tmp_path)
    prompts = [[5, 17, 99, 3, 42], [8, 61, 23], [77, 14, 2, 90, 11, 12], [40, 3]]
    loras = [requests[0], None, requests[1], requests[2]]
    params = SamplingParams(max_tokens=8, temperature=0.0, logprobs=1)
    outputs = []
    for graphs in (False, True):
        with LLM(str(checkpoint), device="cuda", enable_lora=True, cuda_graphs=graphs, show_progress=False,
                 enable_prefix_caching=False) as llm:
            outputs.append(llm.generate(prompts, params, lora_request=loras))
            if graphs:
                runner = llm.model.runner.graphs
                assert any(lora for rung in runner.rungs.values() for (_, lora) in rung.graphs)
            assert llm.engine.check() == []
    for eager, replayed in zip(*outputs):
        first_eager, first_replayed = eager.outputs[0], replayed.outputs[0]
        # The first step's logprobs: the same rows through the same kernels, eager or replayed.
        top = first_eager.token_ids[0]
        assert abs(first_eager.logprobs[0][top].logprob - first_replayed.logprobs[0][top].logprob) <= 2e-2
        assert first_eager.token_ids[:2] == first_replayed.token_ids[:2]


def test_mixed_steps_with_adapters_replay_their_graphs(dense_checkpoints, tmp_path):
    """Decode rows of one adapter beside a prompt chunk of another: the mixed shape's adapters'
    graph, with the tokens of the same requests run eagerly."""
    checkpoint = dense_checkpoints["llama"]
    requests = adapters(checkpoint, tmp_path, 2)
    rng = np.random.default_rng(3)
    prompts = [rng.integers(1, 120, 5).tolist(), rng.integers(1, 120, 60).tolist()]
    params = SamplingParams(max_tokens=12, temperature=0.0, logprobs=1, ignore_eos=True)
    outputs = []
    for graphs in (False, True):
        with LLM(str(checkpoint), device="cuda", enable_lora=True, cuda_graphs=graphs, show_progress=False,
                 block_size=4, max_num_batched_tokens=16, enable_prefix_caching=False) as llm:
            outputs.append(llm.generate(prompts, params, lora_request=requests))
            assert llm.engine.calls.get("mixed_forward")
            if graphs:
                assert any(rung.lora_graph is not None for rung in llm.model.runner.graphs.mixed_rungs.values())
    for eager, replayed in zip(*outputs):
        top = eager.outputs[0].token_ids[0]
        assert abs(eager.outputs[0].logprobs[0][top].logprob - replayed.outputs[0].logprobs[0][top].logprob) <= 2e-2
