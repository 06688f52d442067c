"""Pooling requests on the cuda backend (``-m gpu``): the final-states steps run eagerly (never
replayed from a decode or mixed CUDA graph, even for one-token prompts, which have a decode
step's shape), their vectors follow the CPU's float32 ones up to the GPU's bf16 weights, and a
batch shares steps with generation under overlap scheduling without leaking a block."""

from __future__ import annotations

import numpy as np
import pytest

from metrale import LLM, SamplingParams
from metrale.engine.generation import make_request
from metrale.engine.pooling import make_pooling_group
from metrale.params import PoolingParams

pytestmark = pytest.mark.gpu

#: Cosine similarity a GPU vector (bf16 weights and cache) keeps with the CPU's float32 one.
MIN_COSINE = 0.995

PROMPTS = [[9], [3, 14, 15], list(range(5, 60)), [2, 7, 1, 8], [11]]


def vectors(outputs):
    return [np.asarray(o.outputs.embedding, dtype=np.float64) for o in outputs]


def cosine(a, b):
    return float(a @ b / (np.linalg.norm(a) * np.linalg.norm(b)))


@pytest.mark.parametrize("pooling", ["last", "mean"])
def test_gpu_embeddings_follow_the_cpu_and_never_replay_a_graph(dense_checkpoints, pooling):
    path = dense_checkpoints["qwen3"]
    cpu = LLM(path, device="cpu", show_progress=False)
    gpu = LLM(path, device="cuda", show_progress=False, max_num_batched_tokens=16, block_size=16)
    gpu.capture_graphs([1, 2, 4, 8])
    want = vectors(cpu.embed(PROMPTS, pooling=pooling))
    got = vectors(gpu.embed(PROMPTS, pooling=pooling))
    alone = [vectors(gpu.embed([prompt], pooling=pooling))[0] for prompt in PROMPTS]
    for g, w, a in zip(got, want, alone):
        assert g.shape == w.shape == (cpu.embedding_size,)  # states, not a graph's logits
        assert np.isfinite(g).all()
        assert cosine(g, w) >= MIN_COSINE
        assert cosine(g, a) >= MIN_COSINE
    assert gpu.engine.check() == []
    assert gpu.cache.allocator.num_free == gpu.cache.allocator.num_blocks


def test_gpu_pooling_beside_overlapped_generation(dense_checkpoints):
    path = dense_checkpoints["qwen3"]
    llm = LLM(path, device="cuda", show_progress=False, max_num_seqs=8, block_size=16, max_num_batched_tokens=32)
    assert llm.engine.overlap
    engine = llm.engine
    greedy = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    generating = [make_request(i, None, list(range(3 + i, 20 + i)), greedy, 0) for i in range(3)]
    pooling = [make_pooling_group(f"p{i}", None, prompt, PoolingParams("mean", True)).request
               for i, prompt in enumerate(PROMPTS)]
    for request in generating:
        engine.add_request(request)
    engine.step()
    engine.step()
    for request in pooling:
        engine.add_request(request)
    while engine.has_unfinished():
        engine.step()
    assert all(r.error is None and len(r.generated) == 24 for r in generating)
    cpu = LLM(path, device="cpu", show_progress=False)
    want = vectors(cpu.embed(PROMPTS, pooling="mean", normalize=True))
    for request, expected in zip(pooling, want):
        assert request.error is None
        assert cosine(np.asarray(request.embedding, dtype=np.float64), expected) >= MIN_COSINE
    assert engine.check() == []
    assert llm.cache.allocator.num_free == llm.cache.allocator.num_blocks
