"""The public API: LLM, SamplingParams, RequestOutput, and its errors."""

from __future__ import annotations

import numpy as np
import pytest

from metrale import LLM, SamplingParams, hookimpl
from metrale.errors import (
    BackendUnavailableError,
    CheckpointError,
    ConfigError,
    EmptyPromptError,
    InvalidRequestError,
    MetraleError,
    PromptTooLongError,
    TokenizerMissingError,
    TokenOutOfRangeError,
    UnknownOptionError,
)
from metrale.testing.hf import hf_greedy

GREEDY = dict(temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def tiny():
    return LLM("tiny-dense", device="cpu", show_progress=False)


@pytest.fixture(scope="module")
def llama(dense_checkpoints):
    return LLM(dense_checkpoints["llama"], device="cpu", show_progress=False)


# ------------------------------------------------------------------------------ generation


def test_text_prompt_round_trip(tiny):
    out = tiny.generate("Return the", SamplingParams(max_tokens=6, **GREEDY))[0]
    assert out.prompt == "Return the"
    assert out.prompt_token_ids == tiny.encode("Return the")
    assert len(out.token_ids) == 6 and out.finish_reason == "length"
    assert out.text == tiny.decode(out.token_ids)
    assert out.num_prompt_tokens == len(out.prompt_token_ids) and out.num_generated_tokens == 6


def test_greedy_matches_transformers(dense_checkpoints, llama):
    prompt = np.random.default_rng(7).integers(0, llama.vocab_size, 7).tolist()
    ours = llama.generate(prompt, SamplingParams(max_tokens=24, **GREEDY))[0].token_ids
    assert ours == hf_greedy(dense_checkpoints["llama"], prompt, 24)


def test_batch_equals_one_by_one(llama):
    rng = np.random.default_rng(3)
    prompts = [rng.integers(0, llama.vocab_size, n).tolist() for n in (1, 5, 19, 33, 8)]
    params = SamplingParams(max_tokens=10, **GREEDY)
    together = llama.generate(prompts, params)
    alone = [llama.generate(p, params)[0] for p in prompts]
    assert [o.token_ids for o in together] == [o.token_ids for o in alone]
    assert [o.request_id for o in together] == sorted((o.request_id for o in together), key=int)


def test_more_prompts_than_max_num_seqs(dense_checkpoints, llama):
    small = LLM(dense_checkpoints["llama"], device="cpu", show_progress=False, max_num_seqs=2)
    rng = np.random.default_rng(4)
    prompts = [rng.integers(0, 128, 6).tolist() for _ in range(5)]
    params = SamplingParams(max_tokens=5, **GREEDY)
    assert [o.token_ids for o in small.generate(prompts, params)] == [o.token_ids for o in llama.generate(prompts, params)]


def test_per_prompt_sampling_params(llama):
    outs = llama.generate([[1, 2, 3], [4, 5]], [SamplingParams(max_tokens=2, **GREEDY), SamplingParams(max_tokens=5, **GREEDY)])
    assert [len(o.token_ids) for o in outs] == [2, 5]


def test_same_seed_same_tokens_and_different_seeds_differ(llama):
    def run(seed):
        return llama.generate([5, 6, 7], SamplingParams(max_tokens=20, temperature=1.0, seed=seed, ignore_eos=True))[0].token_ids

    assert run(11) == run(11)
    assert run(11) != run(12)


def test_unseeded_requests_are_reproducible_per_engine_seed(dense_checkpoints):
    params = SamplingParams(max_tokens=12, temperature=1.0, ignore_eos=True)
    runs = [LLM(dense_checkpoints["llama"], device="cpu", show_progress=False, seed=5).generate([[1, 2], [3, 4]], params)
            for _ in range(2)]
    assert [o.token_ids for o in runs[0]] == [o.token_ids for o in runs[1]]


def test_stop_string_cuts_the_text(tiny):
    free = tiny.generate("Return the", SamplingParams(max_tokens=24, **GREEDY))[0]
    stop = free.text[5:8]
    assert stop.strip(), f"pick a visible stop string from {free.text!r}"
    out = tiny.generate("Return the", SamplingParams(max_tokens=24, stop=[stop], **GREEDY))[0]
    assert out.finish_reason == "stop" and out.stop_reason == stop
    assert out.text == free.text[: free.text.find(stop)]
    assert out.token_ids == free.token_ids[: len(out.token_ids)]


def test_stop_token_id_ends_generation_and_is_kept(llama):
    free = llama.generate([9, 8, 7], SamplingParams(max_tokens=16, **GREEDY))[0].token_ids
    stop = free[4]
    out = llama.generate([9, 8, 7], SamplingParams(max_tokens=16, stop_token_ids=[stop], **GREEDY))[0]
    assert out.token_ids == free[: free.index(stop) + 1]
    assert out.finish_reason == "stop" and out.stop_reason == stop


def test_eos_ends_generation_unless_ignored(dense_checkpoints):
    llm = LLM(dense_checkpoints["qwen3"], device="cpu", show_progress=False)
    free = llm.generate([3, 1, 4], SamplingParams(max_tokens=12, **GREEDY))[0].token_ids
    llm.eos_token_ids = [free[2]]
    stopped = llm.generate([3, 1, 4], SamplingParams(max_tokens=12, temperature=0.0))[0]
    assert stopped.token_ids == free[: free.index(free[2]) + 1] and stopped.finish_reason == "stop"
    ignored = llm.generate([3, 1, 4], SamplingParams(max_tokens=12, **GREEDY))[0]
    assert ignored.token_ids == free


def test_generation_stops_at_the_context_limit(dense_checkpoints):
    llm = LLM(dense_checkpoints["llama"], device="cpu", show_progress=False, max_model_len=12)
    out = llm.generate(list(range(10)), SamplingParams(max_tokens=50, **GREEDY))[0]
    # Positions 0..11 hold 10 prompt tokens and 2 decoded ones; the last sampled token needs no slot.
    assert len(out.token_ids) == 3 and out.finish_reason == "length"


def test_score_shape_and_consistency(llama):
    ids = [3, 14, 15, 92, 65, 35]
    logits = llama.score(ids)
    assert logits.shape == (6, llama.vocab_size) and logits.dtype == np.float32
    first = llama.generate(ids, SamplingParams(max_tokens=1, **GREEDY))[0].token_ids[0]
    assert first == int(np.argmax(logits[-1]))


# ---------------------------------------------------------------------------------- errors


@pytest.mark.parametrize(
    "prompt, error",
    [
        ("", EmptyPromptError),
        ([], EmptyPromptError),
        ([1, -1, 2], TokenOutOfRangeError),
        ([1, 128], TokenOutOfRangeError),
        (list(range(100)) * 3, PromptTooLongError),
        ([1.5, 2], InvalidRequestError),
        ([None], InvalidRequestError),
    ],
)
def test_bad_prompts_raise_typed_errors(llama, prompt, error):
    free = llama.cache.num_free_blocks
    with pytest.raises(error) as raised:
        llama.generate([[1, 2, 3], prompt], SamplingParams(max_tokens=3))
    assert isinstance(raised.value, MetraleError) and isinstance(raised.value, ValueError)
    assert llama.cache.num_free_blocks == free
    assert len(llama.generate([1, 2], SamplingParams(max_tokens=2))[0].token_ids) == 2


def test_error_messages_carry_the_bad_value(llama):
    with pytest.raises(TokenOutOfRangeError, match="128"):
        llama.score([1, 128])
    with pytest.raises(PromptTooLongError, match="300"):
        llama.score(list(range(100)) * 3)
    with pytest.raises(InvalidRequestError, match="-2"):
        SamplingParams(max_tokens=-2)


def test_text_prompt_without_tokenizer(llama):
    with pytest.raises(TokenizerMissingError):
        llama.generate("hello")


@pytest.mark.parametrize(
    "options",
    [dict(max_tokens=0), dict(max_tokens=1.5), dict(temperature=-1.0), dict(top_p=0.0), dict(top_p=1.5),
     dict(top_k=-3), dict(seed=-1), dict(stop=[""]), dict(stop_token_ids=[-4])],
)
def test_bad_sampling_values(options):
    with pytest.raises(InvalidRequestError):
        SamplingParams(**options)


def test_unknown_options_are_typed_errors(dense_checkpoints):
    with pytest.raises(UnknownOptionError, match="max_token"):
        SamplingParams(max_token=3)
    with pytest.raises(UnknownOptionError) as raised:
        LLM(dense_checkpoints["llama"], device="cpu", max_model_length=64)
    assert isinstance(raised.value, TypeError) and "max_model_length" in str(raised.value)


def test_params_count_must_match_prompts(llama):
    with pytest.raises(InvalidRequestError, match="2 sampling params for 3 prompts"):
        llama.generate([[1], [2], [3]], [SamplingParams(), SamplingParams()])


def test_bad_engine_options(dense_checkpoints):
    with pytest.raises(ConfigError):
        LLM(dense_checkpoints["llama"], device="tpu")
    with pytest.raises(ConfigError, match="max_position_embeddings"):
        LLM(dense_checkpoints["llama"], device="cpu", max_model_len=100000, show_progress=False)
    with pytest.raises(CheckpointError, match="tiny-dense"):
        LLM("no-such-model", device="cpu")


def test_cuda_without_a_cuda_backend_is_a_typed_error(dense_checkpoints):
    with pytest.raises(BackendUnavailableError, match="cpu"):
        LLM(dense_checkpoints["llama"], device="cuda", show_progress=False)


def test_failure_mid_generation_releases_every_block(dense_checkpoints):
    llm = LLM(dense_checkpoints["llama"], device="cpu", show_progress=False)
    free = llm.cache.num_free_blocks

    class FailOnThirdDecode:
        steps = 0

        @hookimpl
        def metrale_stamp(self, model, step):
            if step.method == "decode_batch":
                self.steps += 1
                if self.steps == 3:
                    raise RuntimeError("injected decode failure")

    llm.plugin_manager.register(FailOnThirdDecode(), name="fail-on-third-decode")
    with pytest.raises(RuntimeError, match="injected"):
        llm.generate([[1, 2, 3], [4, 5, 6, 7]], SamplingParams(max_tokens=8, **GREEDY))
    assert llm.cache.num_free_blocks == free
    llm.plugin_manager.unregister(name="fail-on-third-decode")
    assert len(llm.generate([1, 2], SamplingParams(max_tokens=4, **GREEDY))[0].token_ids) == 4
