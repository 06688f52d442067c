"""``LLM.get_tokenizer()`` answers the calls vLLM users make on theirs (against the checkpoint's
own tokenizer read by the ``tokenizers`` library and its chat template rendered by transformers),
and the vLLM prompt types run as their dict forms do."""

from __future__ import annotations

import pytest

from metrale import LLM, SamplingParams, TextPrompt, TokensPrompt
from metrale.errors import InvalidRequestError


@pytest.fixture(scope="module")
def llm():
    return LLM("tiny-dense", device="cpu", show_progress=False)


def test_encode_decode_and_call_are_the_checkpoint_tokenizer_s(llm):
    from tokenizers import Tokenizer as Reference

    reference = Reference.from_file(str(llm.tokenizer_path / "tokenizer.json"))
    tokenizer = llm.get_tokenizer()
    text = "The quick brown fox jumps over the lazy dog."
    assert tokenizer.encode(text) == reference.encode(text).ids
    assert tokenizer.encode(text, add_special_tokens=False) == reference.encode(text, add_special_tokens=False).ids
    assert tokenizer(text)["input_ids"] == tokenizer.encode(text)
    assert tokenizer([text, "hi"])["input_ids"] == [tokenizer.encode(text), tokenizer.encode("hi")]
    ids = tokenizer.encode(text)
    assert tokenizer.decode(ids) == reference.decode(ids, skip_special_tokens=True)
    assert tokenizer.decode(ids, skip_special_tokens=False) == reference.decode(ids, skip_special_tokens=False)
    assert tokenizer.convert_ids_to_tokens(ids) == [reference.id_to_token(i) for i in ids]
    assert tokenizer.convert_tokens_to_ids(tokenizer.convert_ids_to_tokens(ids)) == ids
    assert tokenizer.vocab_size == llm.vocab_size and tokenizer.model_max_length == llm.max_model_len
    assert tokenizer.eos_token_id in llm.eos_token_ids


def test_apply_chat_template_is_transformers(llm):
    from transformers import AutoTokenizer

    reference = AutoTokenizer.from_pretrained(str(llm.tokenizer_path))
    messages = [{"role": "user", "content": "What is two plus two?"}]
    tokenizer = llm.get_tokenizer()
    assert (tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
            == reference.apply_chat_template(messages, tokenize=False, add_generation_prompt=True))
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True)
    rendered = reference.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert ids == reference(rendered, add_special_tokens=False)["input_ids"]


def test_vllm_prompt_types_run_as_their_dicts(llm):
    params = SamplingParams(max_tokens=6, temperature=0.0)
    ids = llm.get_tokenizer().encode("Once upon a time")
    by_ids = llm.generate(TokensPrompt(prompt_token_ids=ids), params)[0]
    by_text = llm.generate(TextPrompt(prompt="Once upon a time"), params)[0]
    assert by_ids.outputs[0].token_ids == by_text.outputs[0].token_ids
    assert by_ids.prompt_token_ids == ids


def test_a_bad_call_is_a_typed_error(llm):
    with pytest.raises(InvalidRequestError):
        llm.get_tokenizer()(42)
