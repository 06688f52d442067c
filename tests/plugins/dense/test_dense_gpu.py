"""The cuda backend against the cpu backend, graph replay against eager runs (``-m gpu``)."""

from __future__ import annotations

import numpy as np
import pytest
from gpu_checks import held_out_ids, load  # noqa: E402

from metrale import SamplingParams
from metrale.sequence import SequenceState
from metrale.testing import max_relative_error

pytestmark = pytest.mark.gpu

BF16_TOLERANCE = 2e-2


def check_against_cpu(path, ids, what, decided_only=False):
    """bf16 tolerance on the logits and >= 99% teacher-forced top-1 agreement.

    With ``decided_only`` the agreement counts positions whose top-2 margin (on the CPU) exceeds
    twice the largest logit error seen: random-weight models have many near-ties that bf16
    rounding flips, and those say nothing about the engine. At least half the positions must
    count.
    """
    cpu = load(path, "cpu").score(ids)
    gpu = load(path, "cuda").score(ids)
    error = max_relative_error(gpu, cpu)
    same = gpu.argmax(-1) == cpu.argmax(-1)
    top2 = np.sort(cpu, axis=-1)[:, -2:]
    decided = (top2[:, 1] - top2[:, 0]) > 2 * np.abs(gpu - cpu).max()
    counted = decided if decided_only else np.ones_like(decided)
    agreement = float(same[counted].mean())
    print(f"{what}: relative error {error:.3g}, top-1 agreement {float(same.mean()):.4f} over all {len(ids)} "
          f"positions, {agreement:.4f} over the {int(counted.sum())} counted")
    assert error <= BF16_TOLERANCE, f"{what}: relative error {error:.3g}"
    assert counted.mean() >= 0.5, f"{what}: only {int(counted.sum())} positions are decided"
    assert agreement >= 0.99, f"{what}: top-1 agreement {agreement:.4f}"


@pytest.fixture(scope="module")
def bf16_checkpoints(tmp_path_factory):
    """The conftest's dense variants saved in bf16, as real checkpoints are: both backends then
    read the same weights and differ only in activation precision."""
    import torch

    from conftest import dense_configs
    from metrale.testing.hf import build_hf_checkpoint

    root = tmp_path_factory.mktemp("bf16")
    return {
        name: build_hf_checkpoint(cls, config, root / name, seed=index, dtype=torch.bfloat16)
        for index, (name, (cls, config)) in enumerate(dense_configs().items())
    }


@pytest.mark.parametrize("name", ["llama", "qwen2", "qwen3", "mistral"])
def test_random_checkpoints_match_the_cpu_backend(bf16_checkpoints, name):
    ids = np.random.default_rng(0).integers(0, 128, 256).tolist()
    check_against_cpu(bf16_checkpoints[name], ids, name, decided_only=True)


def test_tiny_dense_matches_the_cpu_backend():
    llm = load("tiny-dense", "cpu")
    check_against_cpu(llm.checkpoint.path, held_out_ids(llm), "tiny-dense")


def test_graph_replay_gives_the_eager_tokens(dense_checkpoints):
    path = dense_checkpoints["llama"]
    prompts = [np.random.default_rng(n).integers(0, 128, n).tolist() for n in (3, 11, 30)]
    params = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    graphs = load(path, "cuda").generate(prompts, params)
    eager = load(path, "cuda", cuda_graphs=False).generate(prompts, params)
    assert [o.token_ids for o in graphs] == [o.token_ids for o in eager]


def test_graphs_of_every_context_bucket_give_the_eager_tokens():
    """Sequences that grow past the 512-token bucket while they decode replay the graph of the
    next bucket (recorded then), with the eager tokens."""
    prompts = [np.random.default_rng(n).integers(0, 3072, n).tolist() for n in (490, 505, 40)]
    params = SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True)
    llm = load("tiny-dense", "cuda", max_model_len=1024)
    graphs = llm.generate(prompts, params)
    eager = load("tiny-dense", "cuda", cuda_graphs=False, max_model_len=1024).generate(prompts, params)
    assert [o.token_ids for o in graphs] == [o.token_ids for o in eager]
    recorded = {bucket for rung in llm.model.runner.graphs.rungs.values() for bucket, _ in rung.graphs}
    assert recorded == {512, 1024}


def test_decode_batch_equals_single_decodes(dense_checkpoints):
    llm = load(dense_checkpoints["qwen3"], "cuda")
    prompts = [[1, 2, 3], [9, 8, 7, 6, 5], [4] * 20]
    together = [SequenceState.from_prompt(p) for p in prompts]
    alone = [SequenceState.from_prompt(p) for p in prompts]
    for prompt, a, b in zip(prompts, together, alone):
        llm.forward.prefill(prompt, a)
        llm.forward.prefill(prompt, b)
    for step in range(20):
        tokens = [(7 * step + i) % 128 for i in range(3)]
        batched = llm.backend.to_numpy(llm.forward.decode_batch(tokens, together))
        singles = np.stack([llm.backend.to_numpy(llm.forward.decode(t, s))[0] for t, s in zip(tokens, alone)])
        assert max_relative_error(batched, singles) <= BF16_TOLERANCE
        assert (batched.argmax(-1) == singles.argmax(-1)).all()


def test_error_during_capture_is_discarded_and_the_next_call_runs(dense_checkpoints):
    path = dense_checkpoints["mistral"]
    llm = load(path, "cuda")
    reference = load(path, "cuda", cuda_graphs=False)
    seqs = {id(m): SequenceState.from_prompt([5, 6, 7]) for m in (llm, reference)}
    for m in (llm, reference):
        m.forward.prefill([5, 6, 7], seqs[id(m)])
    original = llm.backend.ops.paged_attention

    def failing(*args):
        if llm.backend.stream.is_capturing():
            raise RuntimeError("injected failure while capturing")
        return original(*args)

    llm.backend.ops.paged_attention = failing
    with pytest.raises(RuntimeError, match="injected failure while capturing"):
        llm.forward.decode_batch([9], [seqs[id(llm)]])
    assert not llm.backend.stream.is_capturing()
    llm.backend.ops.paged_attention = original
    got = llm.backend.to_numpy(llm.forward.decode_batch([9], [seqs[id(llm)]]))
    expected = reference.backend.to_numpy(reference.forward.decode_batch([9], [seqs[id(reference)]]))
    assert max_relative_error(got, expected) <= BF16_TOLERANCE
    # The graph recorded on the retry replays correctly too.
    got = llm.backend.to_numpy(llm.forward.decode_batch([4], [seqs[id(llm)]]))
    expected = reference.backend.to_numpy(reference.forward.decode_batch([4], [seqs[id(reference)]]))
    assert max_relative_error(got, expected) <= BF16_TOLERANCE


def test_seeded_sampling_repeats_on_the_device():
    llm = load("tiny-dense", "cuda")
    params = SamplingParams(max_tokens=24, temperature=0.9, top_p=0.9, top_k=50, seed=17)
    first = llm.generate(["Return the", "Open a"], params)
    second = llm.generate(["Return the", "Open a"], params)
    assert [o.token_ids for o in first] == [o.token_ids for o in second]
    assert all(o.text for o in first)


def test_backend_sampler_matches_the_host_sampler_for_every_row_count():
    import cupy

    from metrale.backends.cuda import CudaBackend
    from metrale.runner.sampling import CudaSampler, sample_rows

    backend = CudaBackend()
    sampler = CudaSampler(backend)
    rng = np.random.default_rng(5)
    kinds = [
        SamplingParams(temperature=0.0),
        SamplingParams(temperature=0.8, top_k=20),
        SamplingParams(temperature=1.1, top_p=0.7),
        SamplingParams(temperature=0.6, top_k=50, top_p=0.9),
    ]
    # Row counts repeat: the first call of a shape runs the kernel and records its graph, the
    # later ones replay the graph on the kept buffers with new contents.
    for rows in (1, 3, 1, 7, 3, 1, 3):
        logits = (3 * rng.standard_normal((rows, 1000))).astype(np.float32)
        params = [kinds[(rows + i) % len(kinds)] for i in range(rows)]
        seeds = rng.integers(0, 2**63, rows).tolist()
        steps = rng.integers(0, 500, rows).tolist()
        with backend.activate():
            device_logits = cupy.asarray(logits)
        assert sampler.sample(device_logits, params, seeds, steps) == sample_rows(logits, params, seeds, steps)
    assert all(buffers.graph for buffers in sampler._buffers.values())


def test_a_nan_in_a_bf16_weight_is_found_on_the_device(tmp_path):
    import shutil

    from test_nonfinite import poison

    from metrale.errors import NonFiniteWeightError
    from metrale.models import embedded_model_path

    folder = tmp_path / "model"
    shutil.copytree(embedded_model_path("tiny-dense"), folder)
    poison(folder, "model.layers.1.self_attn.o_proj.weight", 0x7FC0)
    with pytest.raises(NonFiniteWeightError, match="o_proj"):
        load(folder, "cuda")


def test_close_gives_the_device_memory_back():
    import cupy

    def used():
        free, total = cupy.cuda.runtime.memGetInfo()
        return total - free

    before = used()
    llm = load("tiny-dense", "cuda", num_blocks=100_000)  # 16 KiB a block: 1.6 GB
    llm.generate("Return the", SamplingParams(max_tokens=4))
    assert used() - before > 1 << 30
    llm.close()
    assert used() - before < 256 << 20
