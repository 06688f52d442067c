"""Bad input at every public entry point gets a typed MetraleError naming the bad value -- never a
bare built-in exception, a silent reinterpretation, or a large allocation -- and leaves the LLM
serving. Values that pass validation never crash the sampler."""

from __future__ import annotations

import time

import numpy as np
import pytest

from metrale import LLM, SamplingParams
from metrale.entrypoints.cli import main
from metrale.errors import (
    ConfigError,
    EmptyPromptError,
    InvalidRequestError,
    MetraleError,
    TokenizerMissingError,
    UnknownOptionError,
)

GREEDY = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def tiny():
    return LLM("tiny-dense", device="cpu", show_progress=False)


def assert_still_serving(llm):
    assert llm.cache.holdings() == (0, 0) and not llm.engine.has_unfinished()
    assert len(llm.generate([1, 2, 3], GREEDY)[0].token_ids) == 4


# ----------------------------------------------------------------------------- SamplingParams


@pytest.mark.parametrize("field, value", [
    ("max_tokens", 0), ("max_tokens", 1.0), ("max_tokens", True), ("max_tokens", "16"), ("max_tokens", None),
    ("temperature", -1), ("temperature", float("nan")), ("temperature", float("inf")), ("temperature", "0.7"),
    ("temperature", True), ("temperature", None), ("temperature", 10**400), ("top_p", -(10**400)),
    ("top_k", -2), ("top_k", 1.5), ("top_k", True), ("top_k", "5"),
    ("top_p", 0.0), ("top_p", 1.5), ("top_p", float("nan")), ("top_p", None),
    ("seed", -1), ("seed", 2**64), ("seed", 2**70), ("seed", "x"), ("seed", 1.5), ("seed", True),
    ("stop", 5), ("stop", [5]), ("stop", [""]), ("stop", {"a": 1}), ("stop", ["\ud800"]),
    ("stop_token_ids", [-1]), ("stop_token_ids", ["a"]), ("stop_token_ids", 7), ("stop_token_ids", [True]),
    ("ignore_eos", "false"), ("ignore_eos", 1), ("ignore_eos", None),
])
def test_sampling_params_refuse_bad_values_at_construction_and_assignment(field, value):
    with pytest.raises(InvalidRequestError, match=field):
        SamplingParams(**{field: value})
    params = SamplingParams()
    before = getattr(params, field)
    with pytest.raises(InvalidRequestError, match=field):
        setattr(params, field, value)
    assert getattr(params, field) == before


def test_sampling_params_values_are_canonical_and_cannot_be_mutated_in_place():
    params = SamplingParams(temperature=1, stop="x", stop_token_ids=[np.int64(3)], seed=np.uint64(2**64 - 1))
    assert params.temperature == 1.0 and isinstance(params.temperature, float)
    assert params.stop == ("x",) and params.stop_token_ids == (3,) and params.seed == 2**64 - 1
    with pytest.raises(AttributeError):
        params.stop.append("y")
    with pytest.raises(UnknownOptionError):
        params.temprature = 0.5


def test_an_edited_temperature_is_checked(tiny):
    params = SamplingParams(max_tokens=3)
    with pytest.raises(InvalidRequestError):
        params.temperature = -1
    params.temperature = 0.0
    assert tiny.generate([1, 2, 3], params)[0].token_ids == tiny.generate([1, 2, 3], SamplingParams(
        max_tokens=3, temperature=0.0))[0].token_ids


def test_tiny_temperatures_are_greedy_and_huge_top_k_keeps_every_token(tiny):
    prompt = [5, 6, 7, 8]
    greedy = tiny.generate(prompt, SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True))[0].token_ids
    for temperature in (1e-40, 1e-30, 9e-6):
        tokens = tiny.generate(prompt, SamplingParams(max_tokens=6, temperature=temperature, ignore_eos=True))[0].token_ids
        assert tokens == greedy
    unbounded = SamplingParams(max_tokens=6, temperature=0.9, seed=5, ignore_eos=True)
    huge_k = SamplingParams(max_tokens=6, temperature=0.9, seed=5, ignore_eos=True, top_k=10**12)
    assert tiny.generate(prompt, huge_k)[0].token_ids == tiny.generate(prompt, unbounded)[0].token_ids


def test_seeds_at_the_edges_of_their_range(tiny):
    top = SamplingParams(max_tokens=5, temperature=1.0, seed=2**64 - 1, ignore_eos=True)
    zero = SamplingParams(max_tokens=5, temperature=1.0, seed=0, ignore_eos=True)
    assert tiny.generate([1, 2, 3], top)[0].token_ids == tiny.generate([1, 2, 3], top)[0].token_ids
    assert tiny.generate([1, 2, 3], top)[0].token_ids != tiny.generate([1, 2, 3], zero)[0].token_ids


# ------------------------------------------------------------------------------ engine options


@pytest.mark.parametrize("options", [
    dict(seed="x"), dict(seed=-1), dict(seed=2**64), dict(max_num_seqs="4"), dict(max_num_seqs=0),
    dict(max_num_seqs=2.0), dict(max_num_batched_tokens=None), dict(enable_prefix_caching=1),
    dict(enable_prefix_caching="yes"), dict(cuda_graphs="false"), dict(block_size=0), dict(block_size=4096),
    dict(block_size=True), dict(num_blocks=0), dict(num_blocks=1.5), dict(memory_bytes=-5),
    dict(num_state_slots=0), dict(num_state_snapshots=-1), dict(max_model_len=0), dict(max_model_len="64"),
    dict(device=None), dict(device="gpu"), dict(device=0), dict(num_blocks=10**400), dict(max_num_seqs=10**400),
    dict(num_state_slots=2**41), dict(memory_bytes=2**61), dict(max_model_len=10**20),
])
def test_engine_options_are_type_checked_before_loading(options):
    started = time.perf_counter()
    with pytest.raises(ConfigError) as raised:
        LLM("tiny-dense", show_progress=False, **{"device": "cpu", **options})
    name = next(iter(options))
    assert name in str(raised.value)
    assert time.perf_counter() - started < 2


def test_show_progress_and_plugin_manager_are_checked():
    with pytest.raises(InvalidRequestError, match="show_progress"):
        LLM("tiny-dense", device="cpu", show_progress="no")
    with pytest.raises(ConfigError, match="plugin_manager"):
        LLM("tiny-dense", device="cpu", plugin_manager="x")


@pytest.mark.parametrize("options, message", [
    (dict(num_blocks=10**9), "more than the"),
    (dict(max_num_seqs=10**9, max_model_len=16), "more than the"),
    (dict(num_state_snapshots=10**9), "more than the"),
])
def test_a_cache_larger_than_memory_is_refused_before_it_is_allocated(options, message):
    started = time.perf_counter()
    with pytest.raises(ConfigError, match=message):
        model = "tiny-dense" if "num_blocks" in options else "tiny-gdn"  # the others size recurrent state
        LLM(model, device="cpu", show_progress=False, **options)
    assert time.perf_counter() - started < 5


def test_a_model_path_that_is_a_file_or_not_a_path(tmp_path):
    file = tmp_path / "weights.bin"
    file.write_bytes(b"x")
    with pytest.raises(MetraleError, match="is a file"):
        LLM(file, device="cpu")
    for model in (None, ""):
        with pytest.raises(MetraleError, match="checkpoint folder"):
            LLM(model, device="cpu")


# ------------------------------------------------------------------------------------ prompts


@pytest.mark.parametrize("prompts, error, fragment", [
    (None, InvalidRequestError, "None"),
    (b"Return the", InvalidRequestError, "bytes"),
    (5, InvalidRequestError, "int"),
    (1.5, InvalidRequestError, "float"),
    ([], EmptyPromptError, "no prompts"),
    ([[]], EmptyPromptError, "no tokens"),
    ("", EmptyPromptError, "empty"),
    ([b"x"], InvalidRequestError, "bytes"),
    (["ok", None], InvalidRequestError, "prompt 1"),
    ([[1, True]], InvalidRequestError, "bool"),
    ([[1, 2.0]], InvalidRequestError, "float"),
    ([[1, "2"]], InvalidRequestError, "str"),
    ([[1, [2]]], InvalidRequestError, "list"),
    (np.array([[1.5, 2.0]]), InvalidRequestError, "float"),
    (np.array(5), InvalidRequestError, "shape"),
    ("bad \ud800 text", InvalidRequestError, "not valid Unicode"),
    ({"prompt": "a", "prompt_token_ids": [1, 2.5]}, InvalidRequestError, "float"),
    ({"text": "a"}, InvalidRequestError, "holds 'prompt'"),
    ({"prompt": b"a"}, InvalidRequestError, "bytes"),
    ({"prompt_token_ids": "abc"}, InvalidRequestError, "list of ints"),
    ([{"prompt": "a"}, {"prompts": "b"}], InvalidRequestError, "prompt 1"),
])
def test_bad_prompts_are_typed_errors_and_leave_the_llm_serving(tiny, prompts, error, fragment):
    with pytest.raises(error, match=fragment):
        tiny.generate(prompts, GREEDY)
    assert_still_serving(tiny)


def test_prompt_dicts_mean_what_vllm_means(tiny):
    text = tiny.generate("Return the", GREEDY)[0]
    assert tiny.generate({"prompt": "Return the"}, GREEDY)[0].token_ids == text.token_ids
    ids = tiny.encode("Return the")
    by_ids = tiny.generate({"prompt_token_ids": ids}, GREEDY)
    assert len(by_ids) == 1 and by_ids[0].token_ids == text.token_ids and by_ids[0].prompt_token_ids == ids
    many = tiny.generate([{"prompt": "Return the"}, {"prompt_token_ids": ids}, ids, np.array(ids)], GREEDY)
    assert [o.token_ids for o in many] == [text.token_ids] * 4


@pytest.fixture(scope="module")
def without_tokenizer(dense_checkpoints):
    """An LLM on a checkpoint without tokenizer.json."""
    return LLM(dense_checkpoints["llama"], device="cpu", show_progress=False)


def test_a_prompt_dict_whose_text_and_ids_disagree_is_refused(tiny):
    """Both keys: the ids must be the text's encoding, with special tokens (as a text prompt gets
    them) or without (as a chat template's text is encoded); else they would run while the
    output reported another prompt."""
    text = "Return the"
    chat_text = tiny.render_chat([{"role": "user", "content": "hi"}])
    for prompt, ids in ((text, tiny.encode(text)), (text, tiny.encode(text, add_special_tokens=False)),
                        (chat_text, tiny.encode(chat_text, add_special_tokens=False))):
        output = tiny.generate({"prompt": prompt, "prompt_token_ids": ids}, GREEDY)[0]
        assert output.prompt == prompt and output.prompt_token_ids == ids
    ids = tiny.encode(text)
    for wrong in (tiny.encode("Open a file"), ids + ids[-1:], ids[:-1], [ids[0]] + ids):
        with pytest.raises(InvalidRequestError, match=r"prompt 0: 'prompt' and 'prompt_token_ids' disagree: the text "
                                                      r"'Return the' encodes to"):
            tiny.generate({"prompt": text, "prompt_token_ids": wrong}, GREEDY)
        with pytest.raises(InvalidRequestError, match="disagree"):
            tiny.generate_stream([{"prompt_token_ids": ids}, {"prompt": text, "prompt_token_ids": wrong}], GREEDY)
    assert_still_serving(tiny)


def test_a_tokenized_prompt_is_not_tokenized_again(tiny, monkeypatch):
    """A caller that encoded the text itself (the server, chat) hands over a TokenizedPrompt: a
    long prompt is not tokenized a second time to be checked."""
    text = "Return the " * 20
    ids = tiny.encode(text)
    encoded = []
    original = tiny.encode
    monkeypatch.setattr(tiny, "encode", lambda *args, **kwargs: encoded.append(args) or original(*args, **kwargs))
    output = tiny.generate(tiny.tokenized_prompt(ids, text), GREEDY)[0]
    assert encoded == [] and output.prompt == text and output.prompt_token_ids == ids
    tiny.generate({"prompt": text, "prompt_token_ids": ids}, GREEDY)
    assert len(encoded) == 1  # a user's dict is checked


def test_a_prompt_dict_with_both_keys_needs_a_tokenizer(without_tokenizer):
    with pytest.raises(TokenizerMissingError, match="prompt 0 gives both 'prompt' and 'prompt_token_ids', but .* has "
                                                    "no tokenizer.json to check that they agree"):
        without_tokenizer.generate({"prompt": "hello", "prompt_token_ids": [1, 2, 3]}, GREEDY)
    assert len(without_tokenizer.generate({"prompt_token_ids": [1, 2, 3]}, GREEDY)[0].token_ids) == 4


def test_stop_strings_without_a_tokenizer_are_refused_at_every_entry_point(without_tokenizer):
    """Stop strings are looked for in the decoded text: without tokenizer.json they would never
    fire. generate, generate_stream, AsyncLLM.submit and EngineProcess.submit all check requests
    through the front end (the server answers 400: tests/entrypoints/server/test_server_without_tokenizer.py)."""
    import asyncio

    from metrale.entrypoints.async_llm import AsyncLLM
    from metrale.entrypoints.engine_process import EngineProcess

    llm, stop = without_tokenizer, SamplingParams(max_tokens=4, stop=["x", "yz"])
    match = r"stop=\['x', 'yz'\]: .* has no tokenizer.json, and stop strings are found in the decoded text"
    with pytest.raises(TokenizerMissingError, match=match):
        llm.generate([1, 2, 3], stop)
    with pytest.raises(TokenizerMissingError, match=match):
        llm.generate_stream([1, 2, 3], stop)

    async def submit(engine):
        return engine.submit([1, 2, 3], stop)

    engine = AsyncLLM(llm.checkpoint.path, device="cpu", show_progress=False)  # (shutdown closes its LLM)
    try:
        with pytest.raises(TokenizerMissingError, match=match):
            asyncio.run(submit(engine))
    finally:
        engine.shutdown()
    process = EngineProcess(llm.checkpoint.path, device="cpu", show_progress=False)
    try:
        with pytest.raises(TokenizerMissingError, match=match):
            asyncio.run(submit(process))
    finally:
        process.shutdown()


def test_stop_token_ids_without_a_tokenizer_still_stop(without_tokenizer):
    first = without_tokenizer.generate([1, 2, 3], GREEDY)[0].token_ids
    output = without_tokenizer.generate([1, 2, 3], SamplingParams(max_tokens=4, temperature=0.0,
                                                                  stop_token_ids=[first[1]]))[0]
    assert output.finish_reason == "stop" and output.token_ids == first[:2]


def test_a_prompt_starting_with_bos_gets_no_second_one(tiny):
    bos = tiny.bos_token_id
    bos_text = tiny.tokenizer.id_to_token(bos)
    plain = tiny.encode("Return the")
    assert plain[0] == bos and plain.count(bos) == 1
    assert tiny.encode(bos_text + "Return the") == plain
    assert tiny.generate(bos_text + "Return the", GREEDY)[0].prompt_token_ids == plain


@pytest.mark.parametrize("call", [
    lambda llm: llm.encode(None), lambda llm: llm.encode(b"x"), lambda llm: llm.encode("\udcff"),
    lambda llm: llm.decode(None), lambda llm: llm.decode("abc"), lambda llm: llm.decode([1.5]),
    lambda llm: llm.decode([-1]), lambda llm: llm.decode([2**70]), lambda llm: llm.decode([llm.vocab_size]),
    lambda llm: llm.score("text"), lambda llm: llm.score(None), lambda llm: llm.score([]),
    lambda llm: llm.score([1, 10**9]), lambda llm: llm.generate(["a"], "params"),
    lambda llm: llm.generate(["a"], [GREEDY, GREEDY]), lambda llm: llm.generate(["a"], [None]),
    lambda llm: llm.generate(["a"], GREEDY, use_tqdm="no"),
])
def test_other_entry_points_refuse_bad_input_with_typed_errors(tiny, call):
    with pytest.raises(MetraleError):
        call(tiny)
    assert_still_serving(tiny)


# ----------------------------------------------------------------------------------------- CLI


@pytest.mark.parametrize("args, fragment", [
    (["--max-tokens", "0"], "max_tokens"),
    (["--temperature", "-1"], "temperature"),
    (["--top-p", "0"], "top_p"),
    (["--seed", str(2**70)], "seed"),
    (["--model", "/no/such/folder"], "/no/such/folder"),
    (["--stream", "a", "b"], "one continuation"),
])
def test_cli_bad_input_is_one_line_and_exit_2(args, fragment, capsys):
    assert main(["generate", "--no-progress", "--device", "cpu", *args, "hello"]) == 2
    err = capsys.readouterr().err
    assert fragment in err and "Traceback" not in err
    assert len([line for line in err.splitlines() if line.startswith("metrale: error:")]) == 1


def test_cli_refuses_a_prompt_that_is_not_text(capsys):
    assert main(["generate", "--no-progress", "--device", "cpu", "bad \udcff byte"]) == 2
    assert "not valid Unicode" in capsys.readouterr().err


def test_cli_stream_checks_the_prompt_before_printing_it(capsys):
    assert main(["generate", "--no-progress", "--device", "cpu", "--stream", "bad \udcff byte"]) == 2
    captured = capsys.readouterr()
    assert captured.out == "" and "not valid Unicode" in captured.err


def test_cli_stops_quietly_when_its_reader_goes_away(tmp_path):
    """``metrale generate ... | head -c0``: no traceback when stdout closes."""
    import os
    import subprocess
    import sys

    reader, writer = os.pipe()
    os.close(reader)
    result = subprocess.run(
        [sys.executable, "-m", "metrale", "generate", "--no-progress", "--device", "cpu", "--max-tokens", "4", "Return the"],
        stdout=writer, stderr=subprocess.PIPE, text=True, cwd=tmp_path,
    )
    os.close(writer)
    assert "Traceback" not in result.stderr and result.returncode == 1


def test_auto_says_once_why_it_runs_on_the_cpu(monkeypatch, caplog):
    from metrale.backends import devices as backend

    monkeypatch.setattr(backend, "_cpu_fallback_logged", False)
    monkeypatch.setattr(backend, "cuda_unavailable_reason", lambda: "no CUDA device is available")
    with caplog.at_level("WARNING", logger="metrale.backends.base"):
        assert backend.get_backend("auto").name == "cpu"
        assert backend.get_backend("auto").name == "cpu"
    said = [r.getMessage() for r in caplog.records if "runs on the CPU" in r.getMessage()]
    assert said == ["device='auto' runs on the CPU: no CUDA device is available"]
