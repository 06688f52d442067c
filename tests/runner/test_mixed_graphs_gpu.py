"""Mixed steps replayed from CUDA graphs at padded shapes (``-m gpu``): the same logits as eager
mixed steps, the same cache for the next step, recorded once per shape and replayed after."""

from __future__ import annotations

import numpy as np
import pytest

from metrale import LLM, SamplingParams
from metrale.sequence import SequenceState
from metrale.testing import max_relative_error

pytestmark = pytest.mark.gpu

BF16_TOLERANCE = 2e-2

# (decode rows, cached prefix of the joining prompt, chunk length, last chunk), in an order that
# records (16, 64) and (32, 256) and then replays each.
CASES = [(3, 0, 9, True), (3, 5, 40, True), (2, 2, 33, False), (4, 0, 64, True), (20, 0, 200, True), (17, 3, 129, True)]


def mixed_step(llm, case, seed):
    """Logits of one mixed step (decode rows, then the chunk's last row when it is the last) and of
    the decode step after it, as NumPy arrays (read on the engine's stream: a replay returns before
    the GPU has run it)."""
    to_numpy = llm.backend.to_numpy
    decode_rows, prefix, chunk, is_last = case
    rng = np.random.default_rng(seed)
    seqs = [SequenceState.from_prompt(rng.integers(1, 128, int(n)).tolist()) for n in rng.integers(3, 40, decode_rows)]
    for seq in seqs:
        llm.forward.prefill(seq.tokens, seq)
    joining = rng.integers(1, 128, prefix + chunk + 2).tolist()
    seq = SequenceState.from_prompt(joining)
    if prefix:
        llm.forward.prefill_chunk(joining, seq, 0, prefix, False)
    out = llm.forward.mixed_forward([7] * decode_rows, seqs, joining, seq, prefix, chunk, is_last)
    rows = [to_numpy(out.decode_logits)] + ([to_numpy(out.prefill_logits)] if is_last else [])
    assert (out.prefill_logits is None) is not is_last
    following = to_numpy(llm.forward.decode_batch([3] * (decode_rows + 1), seqs + [seq]))
    for s in seqs + [seq]:
        llm.cache.release(s)
    return np.concatenate(rows), following


@pytest.mark.parametrize("name", ["llama", "qwen3", "mistral"])
def test_replayed_mixed_steps_give_the_eager_logits(dense_checkpoints, name):
    options = dict(device="cuda", show_progress=False, block_size=4, max_model_len=256, max_num_seqs=32)
    graphed, eager = LLM(dense_checkpoints[name], **options), LLM(dense_checkpoints[name], cuda_graphs=False, **options)
    graphs = graphed.model.runner.graphs
    for seed, case in enumerate(CASES):
        got, got_next = mixed_step(graphed, case, seed)
        want, want_next = mixed_step(eager, case, seed)
        assert got.shape == want.shape
        assert max_relative_error(got, want) <= BF16_TOLERANCE, (case, max_relative_error(got, want))
        assert max_relative_error(got_next, want_next) <= BF16_TOLERANCE, case
    assert set(graphs.mixed_rungs) == {(16, 64), (32, 256)}
    assert all(rung.graph is not None for rung in graphs.mixed_rungs.values())
    assert eager.model.runner.graphs is None


def test_mixed_graphs_are_recorded_ahead_and_replayed_by_the_engine(dense_checkpoints, monkeypatch):
    path = dense_checkpoints["qwen3"]
    llm = LLM(path, device="cuda", show_progress=False, block_size=4, max_num_seqs=5, max_num_batched_tokens=300)
    llm.capture_graphs(mixed=True)
    graphs = llm.model.runner.graphs
    assert set(graphs.mixed_rungs) == {(16, 64), (16, 128), (16, 256), (16, 384)}
    recorded = {key: rung.graph for key, rung in graphs.mixed_rungs.items()}
    replays = []
    run_mixed = graphs.run_mixed
    monkeypatch.setattr(graphs, "run_mixed",
                        lambda batch, feed=None: replays.append(graphs.mixed_shape(batch)) or run_mixed(batch, feed))
    prompts = [np.random.default_rng(n).integers(1, 128, n).tolist() for n in (30, 3, 90, 11, 7, 200, 40, 5)]
    # Requests that finish at different steps, so that waiting ones join a running batch.
    lengths = [3, 14, 5, 9, 12, 6, 8, 4]
    outputs = llm.generate(prompts, [SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True) for n in lengths])
    assert [len(o.token_ids) for o in outputs] == lengths and all(o.error is None for o in outputs)
    assert replays and all(shape[0] == 16 for shape in replays)
    assert all(graphs.mixed_rungs[key].graph is graph for key, graph in recorded.items())
    assert set(graphs.mixed_rungs) == set(recorded)  # no mixed step needed a shape not recorded ahead


def test_a_family_without_mixed_graphs_runs_its_mixed_steps_eagerly(dense_checkpoints, monkeypatch):
    from metrale.plugins.dense.model import DenseModel

    monkeypatch.setattr(DenseModel, "mixed_graph_capturable", False)
    llm = LLM(dense_checkpoints["llama"], device="cuda", show_progress=False, block_size=4)
    graphs = llm.model.runner.graphs
    assert graphs.mixed_disabled
    llm.generate([[1, 2, 3], [4, 5, 6, 7, 8, 9]], SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True))
    assert not graphs.mixed_rungs
