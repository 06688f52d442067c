"""Mixed steps at padded shapes (metrale/runner/graphs.py), checked on the CPU backend: a mixed
batch packed the way a captured graph reads it (decode rows padded to their rung, the prompt chunk
to its bucket) gives the eager step's logits and leaves the real sequences' caches exactly as the
eager step does (to float32 rounding), for every dense variant (sliding window included)."""

from __future__ import annotations

import numpy as np
import pytest

from metrale import LLM
from metrale.batch import ForwardBatch, Segment
from metrale.runner.graphs import (
    MIXED_DECODE_RUNGS,
    MIXED_PROMPT_BUCKETS,
    CudaGraphRunner,
    MixedRung,
    mixed_batch,
    mixed_buffer_length,
    mixed_logits_rows,
    pack_mixed,
)
from metrale.sequence import SequenceState


def padded_forward(model, runner: CudaGraphRunner, batch: ForwardBatch):
    """What a mixed graph computes for ``batch``: the padded shape run whole, the asked rows kept."""
    decode, prompt = runner.mixed_shape(batch)
    host = np.zeros(mixed_buffer_length(decode, prompt, runner.max_blocks), dtype=np.int32)
    pack_mixed(host, decode, prompt, runner.max_blocks, batch)
    logits = model.forward_batch(mixed_batch(host, decode, prompt, runner.max_blocks, model.max_model_len))
    assert logits.shape[0] == decode + 1
    return logits[mixed_logits_rows(batch, decode)]


def started(llm: LLM, prompts):
    """Sequences with their prompts cached, as a running batch holds them."""
    seqs = [SequenceState.from_prompt(list(p)) for p in prompts]
    for seq in seqs:
        llm.forward.prefill(seq.tokens, seq)
    return seqs


def real_blocks(llm: LLM, seqs):
    blocks = sorted({b for s in seqs for b in s.block_table})
    assert 0 not in blocks
    return [(np.asarray(layer.k)[blocks].copy(), np.asarray(layer.v)[blocks].copy()) for layer in llm.cache.layers]


@pytest.mark.parametrize(("decode_rows", "prefix", "chunk", "is_last"), [(3, 0, 9, True), (1, 5, 7, True), (5, 4, 70, False)])
def test_a_padded_mixed_step_equals_the_eager_step(dense_checkpoint, decode_rows, prefix, chunk, is_last):
    rng = np.random.default_rng(decode_rows)
    running = [rng.integers(1, 90, int(n)).tolist() for n in rng.integers(3, 14, decode_rows)]
    joining = rng.integers(1, 90, prefix + chunk + 3).tolist()
    results = []
    for padded in (False, True):
        llm = LLM(dense_checkpoint, device="cpu", show_progress=False, block_size=4, max_model_len=128)
        model = llm.model
        runner = CudaGraphRunner(model, llm.backend)
        seqs = started(llm, running)
        seq = SequenceState.from_prompt(joining)
        if prefix:
            llm.forward.prefill_chunk(joining, seq, 0, prefix, False)
        if padded:
            eager = model.forward_batch
            model.forward_batch = lambda batch: padded_forward(model, runner, batch) if batch.segments else eager(batch)
        out = llm.forward.mixed_forward([7] * decode_rows, seqs, joining, seq, prefix, chunk, is_last)
        if padded:
            del model.forward_batch
        logits = np.asarray(out.decode_logits)
        if is_last:
            logits = np.concatenate([logits, np.asarray(out.prefill_logits)])
        else:
            assert out.prefill_logits is None
        results.append((logits, real_blocks(llm, seqs + [seq]), [s.num_cached for s in seqs + [seq]]))
        # The next decode step of every sequence sees the same cache either way.
        results[-1] += (np.asarray(llm.forward.decode_batch([3] * (decode_rows + 1), seqs + [seq])),)
    (eager_logits, eager_cache, eager_cached, eager_next), (logits, cache, cached, following) = results
    np.testing.assert_allclose(logits, eager_logits, rtol=1e-5, atol=1e-5)
    assert cached == eager_cached
    for (k, v), (eager_k, eager_v) in zip(cache, eager_cache):  # (products over more rows round differently)
        np.testing.assert_allclose(k, eager_k, rtol=1e-5, atol=1e-5)
        np.testing.assert_allclose(v, eager_v, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(following, eager_next, rtol=1e-5, atol=1e-5)


def test_the_padding_rows_touch_only_the_dummy_block():
    max_blocks, block_size = 6, 4
    seqs = [SequenceState.from_prompt([1, 2, 3]) for _ in range(3)]
    for index, seq in enumerate(seqs):
        seq.block_table = [2 * index + 1, 2 * index + 2]
        seq.num_cached = 3 if index < 2 else 1
    segments = [Segment(seqs[0], [5], 3), Segment(seqs[1], [6], 3), Segment(seqs[2], [8, 9, 10, 11], 1, "none")]
    batch = ForwardBatch.build(segments, block_size)
    runner = CudaGraphRunner.__new__(CudaGraphRunner)
    runner.disabled, runner.mixed_disabled = None, None
    assert runner.mixed_shape(batch) == (16, 64)
    host = np.full(mixed_buffer_length(4, 64, max_blocks), -1, dtype=np.int32)
    pack_mixed(host, 4, 64, max_blocks, batch)
    view = mixed_batch(host, 4, 64, max_blocks, 24)
    assert view.token_ids[:2].tolist() == [5, 6] and view.token_ids[4:8].tolist() == [8, 9, 10, 11]
    assert not view.token_ids[2:4].any() and not view.token_ids[8:].any()
    assert view.positions.tolist() == [3, 3, 0, 0, 1, 2, 3, 4] + [4] * 60
    assert view.slot_mapping.tolist() == [7, 15, 0, 0, 21, 22, 23, 24] + [0] * 60
    assert view.seq_index.tolist() == [0, 1, 2, 3] + [4] * 64
    assert view.logits_rows.tolist() == [0, 1, 2, 3, 7]  # the chunk asked for none: its row is computed, not returned
    assert mixed_logits_rows(batch, 4) == [0, 1]
    assert view.block_tables.tolist() == [[1, 2, 0, 0, 0, 0], [3, 4, 0, 0, 0, 0], [0] * 6, [0] * 6, [5, 6, 0, 0, 0, 0]]
    assert list(view.row_starts) == [0, 1, 2, 3, 4, 68]


def test_only_mixed_steps_within_the_rungs_and_buckets_are_padded():
    runner = CudaGraphRunner.__new__(CudaGraphRunner)
    runner.disabled, runner.mixed_disabled = None, None

    def shape(decode, chunk, logits="last"):
        seqs = [SequenceState.from_prompt([1] * 2) for _ in range(decode + 1)]
        for seq in seqs:
            seq.block_table, seq.num_cached = list(range(1, 1 + (chunk + 8) // 4 + 1)), 1
        segments = [Segment(s, [4], 1) for s in seqs[:decode]] + [Segment(seqs[-1], [4] * chunk, 1, logits)]
        return runner.mixed_shape(ForwardBatch.build(segments, 4))

    assert shape(3, 9) == (16, 64)
    assert shape(MIXED_DECODE_RUNGS[-1], MIXED_PROMPT_BUCKETS[-1]) == (MIXED_DECODE_RUNGS[-1], MIXED_PROMPT_BUCKETS[-1])
    assert shape(17, 65) == (32, 128)
    assert shape(97, 65) == (128, 128)
    assert shape(0, 9) is None  # a prefill chunk alone
    assert shape(MIXED_DECODE_RUNGS[-1] + 1, 9) is None
    assert shape(3, MIXED_PROMPT_BUCKETS[-1] + 1) is None
    assert shape(3, 9, "all") is None
    runner.mixed_disabled = "an op without a CUDA kernel"
    assert shape(3, 9) is None


def test_graphs_recorded_ahead_cover_every_rung_and_bucket_the_engine_can_reach():
    runner = CudaGraphRunner.__new__(CudaGraphRunner)
    runner.disabled, runner.mixed_disabled, runner.mixed_rungs = None, None, {}
    runner._model = lambda: None  # a model without LoRA: the base model's graphs only
    recorded = []
    runner._fill_mixed = lambda rung, batch: None
    runner._record = lambda batch, mixed=False: (recorded.append(batch), ("graph", "output", "logits", {}))[1]
    # (the stub rung's batch names its shape)
    runner._new_mixed_rung = lambda decode, prompt: MixedRung(decode, prompt, None, None, (decode, prompt))
    runner.capture_mixed(4, 300)
    assert recorded == [(16, 64), (16, 128), (16, 256), (16, 384)]
    runner.capture_mixed(127, 2048)  # the shapes above are not recorded again
    assert len(recorded) == len(MIXED_DECODE_RUNGS) * len(MIXED_PROMPT_BUCKETS)
    assert set(runner.mixed_rungs) == set(recorded)
    runner.mixed_disabled = "an op without a CUDA kernel"
    runner.mixed_rungs = {}
    runner.capture_mixed(4, 300)
    assert not runner.mixed_rungs
