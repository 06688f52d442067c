"""The tool-call and reasoning parsers: each built-in parser on text in its model's format, whole
and streamed in random chunks (the stream's deltas add up to the whole reply), broken syntax
answered as content, the exact split of reasoning, the JSON scanner, the structured-output prefix
of reasoning models, and the parsers' registry through the plugin hooks."""

from __future__ import annotations

import json
import random
import types

import pytest

from metrale.entrypoints.parsers import (
    ReasoningParser,
    ReasoningSplit,
    ReasoningStream,
    ToolCallParse,
    ToolCallStream,
    ToolParser,
    get_reasoning_parser,
    get_tool_parser,
    reasoning_parsers,
    scan_json,
    tool_parsers,
)
from metrale.errors import ConfigError, PluginError
from metrale.model.hookspecs import hookimpl
from metrale.model.plugin_manager import get_plugin_manager, register_plugin
from metrale.plugins.parsers.reasoning import DeepSeekR1ReasoningParser, HarmonyReasoningParser, Qwen3ReasoningParser
from metrale.plugins.parsers.tools import (
    DeepSeekV3ToolParser,
    HarmonyToolParser,
    HermesToolParser,
    Llama3JsonToolParser,
    MistralToolParser,
)

CHUNKINGS = 150


def chunks(text: str, rng: random.Random) -> list[int]:
    """Random cut points of ``text`` (its end last): one to a dozen pieces, sometimes one
    character each."""
    if len(text) < 2:
        return [len(text)]
    if rng.random() < 0.1:
        return list(range(1, len(text) + 1))
    cuts = sorted(rng.sample(range(1, len(text)), min(len(text) - 1, rng.randint(1, 12))))
    return cuts + [len(text)]


def streamed_calls(parser: ToolParser, text: str, rng: random.Random) -> tuple[str | None, list[tuple[str, str]], list]:
    """The reply as a stream of OpenAI deltas reassembles it: content, (name, arguments) per
    call, and the deltas themselves."""
    stream = ToolCallStream(parser)
    content = ""
    calls: dict[int, list[str]] = {}
    deltas = []
    for cut in chunks(text, rng):
        delta = stream.feed(text[:cut], final=cut == len(text))
        content += delta.content
        for item in delta.tool_calls:
            deltas.append(item)
            if "id" in item:
                assert item["index"] not in calls, "a call's first delta comes once"
                assert item["id"].startswith("call_") and item["type"] == "function"
                calls[item["index"]] = [item["function"]["name"], item["function"]["arguments"]]
            else:
                assert set(item) == {"index", "function"} and set(item["function"]) == {"arguments"}
                calls[item["index"]][1] += item["function"]["arguments"]
    assert sorted(calls) == list(range(len(calls)))
    reply = [(name, arguments) for name, arguments in (calls[i] for i in sorted(calls))]
    return (content if content.strip() or not reply else None), reply, deltas


def whole(parser: ToolParser, text: str) -> tuple[str | None, list[tuple[str, str]]]:
    extracted = parser.extract_tool_calls(text)
    return extracted.content, [(call.name, call.arguments) for call in extracted.tool_calls]


# (parser, reply text, content, calls)
TOOL_CASES = [
    ("hermes", HermesToolParser,
     'Let me look.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "days": [1, 2.5e3]}}\n</tool_call>\n'
     '<tool_call>\n{"name": "add", "arguments": {"a": -1, "b": "\\u00e9\\n"}}\n</tool_call>',
     "Let me look.\n", [("get_weather", '{"city": "Paris", "days": [1, 2.5e3]}'), ("add", '{"a": -1, "b": "\\u00e9\\n"}')]),
    ("hermes (Qwen3, arguments first, as a string)", HermesToolParser,
     '<tool_call>\n{"arguments": "{\\"q\\": 1}", "name": "search"}\n</tool_call>', None, [("search", '{"q": 1}')]),
    ("hermes without arguments, no closing tag", HermesToolParser, '<tool_call>{"name": "now"}', None, [("now", "{}")]),
    ("llama3_json", Llama3JsonToolParser, '{"name": "search", "parameters": {"query": "a \\"b\\" }"}}', None,
     [("search", '{"query": "a \\"b\\" }"}')]),
    ("llama3_json with python_tag, two calls", Llama3JsonToolParser,
     '<|python_tag|>{"name": "f", "parameters": {"x": 1}}; {"name": "g", "arguments": {}}', None,
     [("f", '{"x": 1}'), ("g", "{}")]),
    ("mistral array", MistralToolParser,
     'Sure [TOOL_CALLS] [{"name": "a", "arguments": {"x": [true, null]}}, {"name": "b", "arguments": {}}]',
     "Sure ", [("a", '{"x": [true, null]}'), ("b", "{}")]),
    ("mistral v11", MistralToolParser,
     '[TOOL_CALLS]get_weather[ARGS]{"city": "Rome"}[TOOL_CALLS]add[CALL_ID]a1B2c3[ARGS]{"a": 1}', None,
     [("get_weather", '{"city": "Rome"}'), ("add", '{"a": 1}')]),
    ("deepseek_v3", DeepSeekV3ToolParser,
     "Checking.<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>get_weather\n```json\n"
     '{"city": "Oslo"}\n```<｜tool▁call▁end｜>\n<｜tool▁call▁begin｜>function<｜tool▁sep｜>add\n```json\n{"a": 1}\n```'
     "<｜tool▁call▁end｜><｜tool▁calls▁end｜>",
     "Checking.", [("get_weather", '{"city": "Oslo"}'), ("add", '{"a": 1}')]),
    ("deepseek_v3.1", DeepSeekV3ToolParser,
     '<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>get_weather<｜tool▁sep｜>{"city": "Oslo"}<｜tool▁call▁end｜>'
     "<｜tool▁calls▁end｜>", None, [("get_weather", '{"city": "Oslo"}')]),
    ("openai (harmony)", HarmonyToolParser,
     "Checking.<|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>"
     '{"city": "SF"}<|call|>', "Checking.", [("get_weather", '{"city": "SF"}')]),
    ("openai (harmony), recipient in the role", HarmonyToolParser,
     '<|start|>assistant to=functions.lookup<|channel|>commentary json<|message|>{"id": 7}', None, [("lookup", '{"id": 7}')]),
]


@pytest.mark.parametrize(("parser_class", "text", "content", "calls"), [case[1:] for case in TOOL_CASES],
                         ids=[case[0] for case in TOOL_CASES])
def test_tool_parser_reads_its_format_whole_and_streamed(parser_class, text, content, calls):
    assert whole(parser_class(), text) == (content, calls)
    for name, arguments in calls:
        json.loads(arguments)
    rng = random.Random(7)
    for _ in range(CHUNKINGS):
        got_content, got_calls, _ = streamed_calls(parser_class(), text, rng)
        assert (got_content, got_calls) == (content, calls)


PLAIN_TEXTS = [
    (HermesToolParser, "No call here, only <tool and </tool_call> text."),
    (HermesToolParser, 'x <tool_call>{"name": "f", "arguments": {"a": }}</tool_call>'),
    (HermesToolParser, "<tool_call>not json</tool_call>"),
    (HermesToolParser, '<tool_call>{"arguments": {}}</tool_call>'),
    (HermesToolParser, '<tool_call>{"name": "f", "arguments": {"a": 1'),  # cut by max_tokens
    (Llama3JsonToolParser, '{"name": "Bob", "age": 3}'),
    (Llama3JsonToolParser, "Hello, world"),
    (Llama3JsonToolParser, '{"name": "f", "parameters": {"x": tru}}'),
    (MistralToolParser, "[TOOL_CALLS] oops"),
    (MistralToolParser, "[TOOL_CALLS][{'name': 'f'}]"),
    (DeepSeekV3ToolParser, "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>f\n{not fenced}"),
    (HarmonyToolParser, "<|channel|>commentary to=functions.f<|message|>{broken"),
    (HarmonyToolParser, ""),
]


@pytest.mark.parametrize(("parser_class", "text"), PLAIN_TEXTS, ids=[f"{c.__name__}-{i}" for i, (c, _) in enumerate(PLAIN_TEXTS)])
def test_broken_or_absent_calls_are_plain_content(parser_class, text):
    extracted = parser_class().extract_tool_calls(text)
    assert extracted.tool_calls == [] and not extracted.tools_called
    assert extracted.content == text


@pytest.mark.parametrize("parser_class", [HermesToolParser, Llama3JsonToolParser, MistralToolParser, DeepSeekV3ToolParser,
                                          HarmonyToolParser])
def test_tool_parsers_never_raise_on_random_text(parser_class):
    rng = random.Random(3)
    alphabet = list('{}[]":,; \n<>|/_abcxyz0123-.\\') + ["<tool_call>", "</tool_call>", "[TOOL_CALLS]", "[ARGS]",
                                                         "<|python_tag|>", "<|channel|>", "<|message|>", " to=functions.f",
                                                         "<｜tool▁calls▁begin｜>", "<｜tool▁call▁begin｜>", "<｜tool▁sep｜>",
                                                         '"name"', '"arguments"']
    for _ in range(300):
        text = "".join(rng.choice(alphabet) for _ in range(rng.randint(0, 40)))
        extracted = parser_class().extract_tool_calls(text)
        if not extracted.tool_calls:
            assert extracted.content == text
        for call in extracted.tool_calls:
            json.loads(call.arguments)
        streamed_calls(parser_class(), text, rng)


def test_a_stream_that_breaks_after_a_call_began_keeps_what_it_sent():
    stream = ToolCallStream(HermesToolParser())
    first = stream.feed('<tool_call>{"name": "f", "arguments": {"a": ')
    assert first.tool_calls[0]["function"]["name"] == "f"
    assert stream.feed('<tool_call>{"name": "f", "arguments": {"a": }', final=True).content == ""
    assert not stream.complete


def test_parallel_tool_calls_false_keeps_the_first_call():
    text = '<tool_call>{"name": "a", "arguments": {}}</tool_call><tool_call>{"name": "b", "arguments": {}}</tool_call>'
    stream = ToolCallStream(HermesToolParser(), limit=1)
    stream.feed(text, final=True)
    assert [call.name for call in stream.result().tool_calls] == ["a"]


def test_a_parser_that_raises_leaves_the_text_as_content():
    class Broken(ToolParser):
        def parse(self, text, final):
            raise RuntimeError("bug")

    assert Broken().extract_tool_calls("hello").content == "hello"


# ------------------------------------------------------------------------------------ reasoning

REASONING_CASES = [
    (DeepSeekR1ReasoningParser, {}, "I think </thi then</think>\n\nAnswer </think> x", "I think </thi then",
     "\n\nAnswer </think> x"),
    (DeepSeekR1ReasoningParser, {}, "<think>abc</think>def", "abc", "def"),
    (DeepSeekR1ReasoningParser, {}, "thinking, cut by max_tokens", "thinking, cut by max_tokens", ""),
    (Qwen3ReasoningParser, {}, "<think>\nhmm\n</think>\n\nHi", "\nhmm\n", "\n\nHi"),
    (Qwen3ReasoningParser, {}, "Hi <think>x</think>", "", "Hi <think>x</think>"),
    (Qwen3ReasoningParser, {"enable_thinking": False}, "<think>x</think>y", "", "<think>x</think>y"),
    (HarmonyReasoningParser, {}, "<|channel|>analysis<|message|>Need weather.<|end|><|start|>assistant<|channel|>final"
     "<|message|>It is sunny.", "Need weather.", "It is sunny."),
    (HarmonyReasoningParser, {}, "<|channel|>analysis<|message|>A<|end|><|start|>assistant<|channel|>commentary<|message|>"
     "Checking.<|end|><|start|>assistant<|channel|>commentary to=functions.f <|constrain|>json<|message|>{\"a\": 1}<|call|>",
     "A", 'Checking.<|start|>assistant<|channel|>commentary to=functions.f <|constrain|>json<|message|>{"a": 1}<|call|>'),
    (HarmonyReasoningParser, {}, "plain text only", "", "plain text only"),
]


def streamed_split(parser: ReasoningParser, text: str, rng: random.Random) -> tuple[str, str]:
    stream = ReasoningStream(parser)
    reasoning = content = ""
    for cut in chunks(text, rng):
        delta = stream.feed(text[:cut], final=cut == len(text))
        reasoning += delta.reasoning
        content += delta.content
    return reasoning, content


@pytest.mark.parametrize(("parser_class", "kwargs", "text", "reasoning", "content"), REASONING_CASES,
                         ids=[f"{c[0].__name__}-{i}" for i, c in enumerate(REASONING_CASES)])
def test_reasoning_parser_splits_whole_and_streamed(parser_class, kwargs, text, reasoning, content):
    split = parser_class(kwargs).split(text, True)
    assert (split.reasoning, split.content) == (reasoning, content)
    assert parser_class(kwargs).extract_reasoning_content(text) == (reasoning or None, content or None)
    rng = random.Random(11)
    for _ in range(CHUNKINGS):
        assert streamed_split(parser_class(kwargs), text, rng) == (reasoning, content)


@pytest.mark.parametrize("parser_class", [DeepSeekR1ReasoningParser, Qwen3ReasoningParser])
def test_think_split_is_exact_on_random_replies(parser_class):
    """Reasoning and content, with the markers, are the reply: nothing is lost or invented,
    whatever the reply holds and however it is streamed."""
    rng = random.Random(5)
    pieces = ["<think>", "</think>", "<", "/", "think", ">", "<th", "</th", "a", " ", "\n", "é", "ok"]
    for _ in range(400):
        text = "".join(rng.choice(pieces) for _ in range(rng.randint(0, 14)))
        parser = parser_class()
        split = parser.split(text, True)
        opened = text.startswith("<think>")
        closed = "</think>" in text[7 if opened else 0:]
        if opened or (parser_class is DeepSeekR1ReasoningParser):
            rebuilt = ("<think>" if opened else "") + split.reasoning + ("</think>" if closed else "") + split.content
        else:
            rebuilt = split.content
            assert split.reasoning == ""
        assert rebuilt == text, (text, split)
        assert streamed_split(parser_class(), text, rng) == (split.reasoning, split.content)


def test_harmony_split_streams_as_it_splits_whole_on_random_replies():
    rng = random.Random(8)
    pieces = ["<|start|>assistant", "<|channel|>", "analysis", "final", "commentary", " to=functions.f", "<|message|>",
              "<|end|>", "<|call|>", "text", " ", "{}", "<|", "|>"]
    for _ in range(300):
        text = "".join(rng.choice(pieces) for _ in range(rng.randint(0, 12)))
        split = HarmonyReasoningParser().split(text, True)
        assert streamed_split(HarmonyReasoningParser(), text, rng) == (split.reasoning, split.content)


def test_reasoning_then_tool_calls_read_from_the_content():
    text = '<think>The user wants weather.</think>\n<tool_call>{"name": "w", "arguments": {"c": "x"}}</tool_call>'
    split = Qwen3ReasoningParser().split(text, True)
    assert split.reasoning == "The user wants weather."
    extracted = HermesToolParser().extract_tool_calls(split.content)
    assert extracted.content is None and [(c.name, c.arguments) for c in extracted.tool_calls] == [("w", '{"c": "x"}')]


# ---------------------------------------------------------------------------------- JSON scanner

@pytest.mark.parametrize(("text", "status"), [
    ('{"a": [1, 2.5, -3e-2, true, false, null, "x\\"y\\u00e9"]}', "complete"),
    ("[]", "complete"), ("{}", "complete"), ('"s"', "complete"), ("12", "partial"), ('{"a": 1', "partial"),
    ('{"a": "\\u00', "partial"), ("[1, tr", "partial"), ('{"a": }', "invalid"), ("{'a': 1}", "invalid"),
    ("[1,]", "invalid"), ('{"a" 1}', "invalid"), ("01", "complete"), ("nul", "partial"), ("nope", "invalid"),
    ('"\\x"', "invalid"), ("[1 2]", "invalid"),
])
def test_scan_json(text, status):
    assert scan_json(text)[0] == status
    if status == "complete" and text != "01":
        assert json.loads(text[:scan_json(text)[1]]) is not None or text[:4] == "null"


def test_scan_json_agrees_with_json_on_every_prefix():
    document = '{"a": [1, {"b": "c\\n\\u0041"}, -2.5e+3, true], "d": null, "e": ""}'
    for end in range(len(document)):
        status, _ = scan_json(document[:end])
        assert status == "partial", document[:end]
    assert scan_json(document) == ("complete", len(document))


# ------------------------------------------------------------------------------ structured prefix


@pytest.fixture(scope="module")
def compiler():
    pytest.importorskip("llguidance")
    from metrale.loading.checkpoint import load_tokenizer
    from metrale.models import embedded_model_path
    from metrale.structured import GrammarCompiler

    path = embedded_model_path("tiny-dense")
    tokenizer = load_tokenizer(path)
    built = GrammarCompiler(tokenizer, tokenizer.get_vocab_size(), [0], isolated=False)
    yield built, tokenizer
    built.close()


def accepts(compiler, params, text: str) -> bool:
    built, tokenizer = compiler
    matcher = built.compile(params).matcher()
    return all(matcher.accept(token) for token in tokenizer.encode(text, add_special_tokens=False).ids) and \
        matcher.is_accepting


@pytest.mark.parametrize(("parser", "thinking", "direct"), [
    (Qwen3ReasoningParser(), "<think>plan {\"a\": 2}\n</think>\n\n", True),
    (DeepSeekR1ReasoningParser(), "plan</think>", False),
    (DeepSeekR1ReasoningParser(), "<think>plan</think>\n", False),
])
def test_a_structured_output_starts_after_the_thinking(compiler, parser, thinking, direct):
    from metrale.structured import StructuredOutputParams, after_prefix

    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"], "additionalProperties": False}
    params = after_prefix(StructuredOutputParams(json=schema), parser.structured_output_prefix())
    assert accepts(compiler, params, thinking + '{"a":1}')
    assert accepts(compiler, params, '{"a":1}') == direct
    assert not accepts(compiler, params, thinking + '{"b":1}')
    assert not accepts(compiler, params, thinking + "free text")
    for other in (StructuredOutputParams(regex="[0-9]{3}"), StructuredOutputParams(choice=["yes", "no"]),
                  StructuredOutputParams(grammar='start: "x" NUM\nNUM: /[0-9]+/')):
        wrapped = after_prefix(other, parser.structured_output_prefix())
        answer = {"regex": "123", "choice": "no", "grammar": "x42"}[other.kind]
        assert accepts(compiler, wrapped, thinking + answer)
        assert not accepts(compiler, wrapped, thinking + "zzz")


def test_qwen3_without_thinking_has_no_prefix():
    assert Qwen3ReasoningParser({"enable_thinking": False}).structured_output_prefix() is None
    assert "<|channel|>" in HarmonyReasoningParser().structured_output_prefix()


# -------------------------------------------------------------------------------------- registry


def test_the_built_in_parsers_are_declared_through_the_hooks():
    assert set(tool_parsers()) >= {"hermes", "llama3_json", "mistral", "deepseek_v3", "openai"}
    assert set(reasoning_parsers()) >= {"deepseek_r1", "qwen3", "openai_gptoss"}
    assert get_tool_parser("hermes") is HermesToolParser
    assert get_reasoning_parser("qwen3") is Qwen3ReasoningParser


def test_an_unknown_parser_name_is_a_config_error_listing_the_available_ones():
    with pytest.raises(ConfigError, match="hermes.*llama3_json"):
        get_tool_parser("nope")
    with pytest.raises(ConfigError, match="deepseek_r1"):
        get_reasoning_parser("hermes")


class _Echo(ToolParser):
    def parse(self, text, final):
        return ToolCallParse(len(text))


class _Nothing(ReasoningParser):
    def split(self, text, final):
        return ReasoningSplit("", text)


def plugin(version: str, **hooks) -> types.ModuleType:
    module = types.ModuleType("parsers_plugin")
    module.METRALE_CONTRACT_VERSION = version
    for name, function in hooks.items():
        setattr(module, name, hookimpl(function))
    return module


def test_a_plugin_adds_parsers_and_older_plugins_keep_working():
    manager = get_plugin_manager(entry_points=False)
    register_plugin(manager, plugin("1.4", metrale_tool_parsers=lambda: {"echo": _Echo},
                                    metrale_reasoning_parsers=lambda: {"nothing": _Nothing}), "mine", "my-dist")
    register_plugin(manager, plugin("1.2", metrale_drafters=lambda: {}), "old", "old-dist")  # written before 1.4
    assert get_tool_parser("echo", manager) is _Echo
    assert get_reasoning_parser("nothing", manager) is _Nothing
    assert "hermes" in tool_parsers(manager)


def test_a_parser_name_declared_twice_is_a_plugin_error():
    manager = get_plugin_manager(entry_points=False)
    register_plugin(manager, plugin("1.4", metrale_tool_parsers=lambda: {"hermes": _Echo}), "clash", "dist")
    with pytest.raises(PluginError, match="hermes.*parsers.*clash"):
        tool_parsers(manager)


def test_a_hook_returning_something_else_is_a_plugin_error():
    manager = get_plugin_manager(entry_points=False)
    register_plugin(manager, plugin("1.4", metrale_reasoning_parsers=lambda: {"x": "not a class"}), "bad", "dist")
    with pytest.raises(PluginError, match="bad"):
        reasoning_parsers(manager)
    manager = get_plugin_manager(entry_points=False)
    register_plugin(manager, plugin("1.4", metrale_tool_parsers=lambda: {"x": _Nothing}), "wrong", "dist")
    with pytest.raises(PluginError, match="ToolParser"):
        tool_parsers(manager)
