"""A verify replayed from the decode graphs (metrale/runner/graphs.py, ``run_verify``), checked
on the CPU backend: the verify's rows packed as decode rows of their own into a padded decode
rung, the way its graph reads them, give the eager verify's logits and leave the same cache, for
dense and MLA models; which verifies the graphs take."""

from __future__ import annotations

import numpy as np
import pytest

from metrale import LLM
from metrale.batch import ForwardBatch, Segment
from metrale.runner.graphs import (
    DECODE_RUNGS,
    CudaGraphRunner,
    Rung,
    as_decode_rows,
    decode_buffer_length,
    decode_rung_batch,
    pack_decode,
)
from metrale.sequence import SequenceState


def replayed_verify(model, runner: CudaGraphRunner, batch: ForwardBatch):
    """What the decode graph computes for a verify ``batch``: its decode rows packed into the rung
    and context bucket :meth:`CudaGraphRunner.run` picks, the real rows' logits kept."""
    rows = as_decode_rows(batch)
    size, bucket = runner.rung_size(rows.num_rows), runner.context_bucket(rows.max_context)
    width = runner.table_width(bucket)
    host = np.zeros(decode_buffer_length(size, runner.max_blocks), dtype=np.int32)
    pack_decode(host, size, width, rows)
    rung = Rung(size, host, host, decode_rung_batch(host, size, runner.max_blocks, model.max_model_len))
    model.verifying = False  # as run_verify records and replays it
    try:
        logits = model.forward_batch(rung.bucket_batch(bucket, width))
    finally:
        model.verifying = True
    assert logits.shape[0] == size
    return logits[: batch.num_rows]


def real_blocks(llm, seqs):
    blocks = sorted({b for s in seqs for b in s.block_table})
    assert 0 not in blocks
    return [[np.asarray(array)[blocks].copy() for array in vars(layer).values() if hasattr(array, "shape")]
            for layer in llm.cache.layers]


@pytest.mark.parametrize("family, variant", [("dense", "llama"), ("dense", "qwen3"), ("mla", "deepseek_v2"),
                                             ("mla", "deepseek_v3")])
def test_a_verify_as_decode_rows_equals_the_eager_verify(family_checkpoint_of, family, variant):
    rng = np.random.default_rng(len(variant))
    prompts = [rng.integers(1, 90, int(n)).tolist() for n in (5, 11, 3)]
    drafts = [[4, 9, 2], [7], [1, 1, 3, 8]]
    results = []
    for replayed in (False, True):
        llm = LLM(family_checkpoint_of(family, variant), device="cpu", show_progress=False, block_size=4,
                  max_model_len=128)
        model = llm.model
        runner = CudaGraphRunner(model, llm.backend)
        seqs = [SequenceState.from_prompt(list(p)) for p in prompts]
        for seq in seqs:
            llm.forward.prefill(seq.tokens, seq)
        if replayed:
            eager = model.forward_batch
            model.forward_batch = lambda batch: replayed_verify(model, runner, batch) if batch.segments else eager(batch)
        logits = np.asarray(llm.forward.verify([[s.tokens[-1], *d] for s, d in zip(seqs, drafts)], seqs))
        if replayed:
            del model.forward_batch
        assert logits.shape[0] == sum(len(d) + 1 for d in drafts)
        results.append((logits, real_blocks(llm, seqs), [s.num_cached for s in seqs]))
    (eager_logits, eager_cache, eager_cached), (logits, cache, cached) = results
    np.testing.assert_allclose(logits, eager_logits, rtol=1e-4, atol=1e-4)
    assert cached == eager_cached
    for layer, eager_layer in zip(cache, eager_cache):
        for array, eager_array in zip(layer, eager_layer):
            np.testing.assert_allclose(array, eager_array, rtol=1e-4, atol=1e-4)


def test_which_verifies_the_graphs_take(family_checkpoint_of):
    llm = LLM(family_checkpoint_of("dense"), device="cpu", show_progress=False, block_size=4, max_model_len=256)
    model = llm.model
    runner = CudaGraphRunner(model, llm.backend)
    seqs = [SequenceState.from_prompt([3, 4, 5]) for _ in range(2)]
    for seq in seqs:
        llm.forward.prefill(seq.tokens, seq)
        llm.cache.reserve(seq, seq.num_cached + 70)

    def verify_batch(rows, logits="all"):
        return ForwardBatch.build([Segment(s, [1] * rows, s.num_cached, logits) for s in seqs], 4)

    assert not runner.accepts_verify(verify_batch(3))  # not inside verify
    model.verifying = True
    try:
        assert runner.accepts_verify(verify_batch(3))
        assert not runner.accepts_verify(verify_batch(3, "last"))  # not every row's logits
        assert not runner.accepts_verify(verify_batch(DECODE_RUNGS[-1] // 2 + 1))  # past the largest rung
        model.verify_graph_capturable = False
        assert not runner.accepts_verify(verify_batch(3))
        model.verify_graph_capturable = True
        runner.disabled = "an op that cannot be captured"
        assert not runner.accepts_verify(verify_batch(3))
    finally:
        model.verifying = False


def test_models_with_recurrent_state_verify_eagerly(gdn_checkpoint):
    llm = LLM(gdn_checkpoint, device="cpu", show_progress=False, block_size=4, max_model_len=128)
    model = llm.model
    seq = SequenceState.from_prompt([3, 4, 5])
    llm.forward.prefill(seq.tokens, seq)
    llm.cache.reserve(seq, seq.num_cached + 3)
    model.verifying = True
    try:
        assert not CudaGraphRunner(model, llm.backend).accepts_verify(
            ForwardBatch.build([Segment(seq, [1, 2, 3], seq.num_cached, "all")], 4))
    finally:
        model.verifying = False
