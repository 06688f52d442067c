"""Chat templates (metrale.entrypoints.chat): rendered exactly as transformers' apply_chat_template renders them,
read from the places transformers reads them, with typed errors for bad messages and templates."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pytest

from metrale.entrypoints.chat import ChatTemplate, check_messages, read_special_tokens
from metrale.errors import CheckpointError, ConfigError, InvalidRequestError
from metrale.models import embedded_model_path

TINY = ["tiny-dense", "tiny-mla", "tiny-gdn"]
TOKENIZER = embedded_model_path("tiny-dense") / "tokenizer.json"


# ----------------------------------------------------------------------------- helpers


def make_checkpoint(folder: Path, config: dict | None = None, *, jinja: str | None = None, extra: dict | None = None,
                    special_tokens_map: dict | None = None) -> Path:
    """A checkpoint folder with the tiny tokenizer, ``config`` as tokenizer_config.json, ``jinja`` as
    chat_template.jinja and ``extra`` (name -> source) as additional_chat_templates/NAME.jinja."""
    folder.mkdir(parents=True, exist_ok=True)
    shutil.copy(TOKENIZER, folder / "tokenizer.json")
    if config is not None:
        (folder / "tokenizer_config.json").write_text(json.dumps({"tokenizer_class": "PreTrainedTokenizerFast", **config}))
    if jinja is not None:
        (folder / "chat_template.jinja").write_text(jinja)
    for name, source in (extra or {}).items():
        (folder / "additional_chat_templates").mkdir(exist_ok=True)
        (folder / "additional_chat_templates" / f"{name}.jinja").write_text(source)
    if special_tokens_map is not None:
        (folder / "special_tokens_map.json").write_text(json.dumps(special_tokens_map))
    return folder


def hf_tokenizer(folder: Path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(folder))


def hf_render(folder: Path, messages, **kwargs) -> str:
    return hf_tokenizer(folder).apply_chat_template(messages, tokenize=False, **kwargs)


def assert_renders_like_transformers(folder: Path, messages, **kwargs) -> str:
    expected = hf_render(folder, messages, **kwargs)
    rendered = ChatTemplate.from_checkpoint(folder).render(messages, **kwargs)
    assert rendered == expected
    return rendered


# ----------------------------------------------------------------------------- conversations

USER = [{"role": "user", "content": "Return the number of items."}]
MULTI_TURN = [
    {"role": "system", "content": "You answer questions about Python.  "},
    {"role": "user", "content": "What does len() do?"},
    {"role": "assistant", "content": "It returns the number of items."},
    {"role": "user", "content": "And héllo <b> & ünïcode?"},
]
PARTS = [
    {"role": "user", "content": [{"type": "text", "text": "Open "}, {"type": "text", "text": "a file"}]},
    {"role": "assistant", "content": None},
    {"role": "user", "content": "again"},
]
WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city.",
        "parameters": {"type": "object", "properties": {"city": {"type": "string", "description": "Its name, é"}},
                       "required": ["city"]},
    },
}
TOOL_CALL = [
    {"role": "system", "content": "Use the tools."},
    {"role": "user", "content": "Weather in Paris?"},
    {"role": "assistant", "content": "",
     "tool_calls": [{"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]},
    {"role": "tool", "content": "22 C, sunny"},
    {"role": "user", "content": "Thanks."},
]
REASONING = [
    {"role": "user", "content": "2+2?"},
    {"role": "assistant", "content": "4", "reasoning_content": "Two and two make four."},
    {"role": "user", "content": "3+3?"},
    {"role": "assistant", "content": "6", "reasoning": "Three and three."},
]


# ----------------------------------------------------------------------------- realistic templates

LLAMA3 = r"""{{- bos_token }}
{%- if custom_tools is defined %}
    {%- set tools = custom_tools %}
{%- endif %}
{%- if not tools_in_user_message is defined %}
    {%- set tools_in_user_message = true %}
{%- endif %}
{%- if not date_string is defined %}
    {%- if strftime_now is defined %}
        {%- set date_string = strftime_now("%d %b %Y") %}
    {%- else %}
        {%- set date_string = "26 Jul 2024" %}
    {%- endif %}
{%- endif %}
{%- if not tools is defined %}
    {%- set tools = none %}
{%- endif %}

{#- This block extracts the system message, so we can slot it into the right place. #}
{%- if messages[0]['role'] == 'system' %}
    {%- set system_message = messages[0]['content']|trim %}
    {%- set messages = messages[1:] %}
{%- else %}
    {%- set system_message = "" %}
{%- endif %}

{{- "<|start_header_id|>system<|end_header_id|>\n\n" }}
{%- if tools is not none %}
    {{- "Environment: ipython\n" }}
{%- endif %}
{{- "Cutting Knowledge Date: December 2023\n" }}
{{- "Today Date: " + date_string + "\n\n" }}
{{- system_message }}
{{- "<|eot_id|>" }}

{%- if tools_in_user_message and not tools is none %}
    {%- if messages | length != 0 %}
        {%- set first_user_message = messages[0]['content']|trim %}
        {%- set messages = messages[1:] %}
    {%- else %}
        {{- raise_exception("Cannot put tools in the first user message when there's no first user message!") }}
    {%- endif %}
    {{- '<|start_header_id|>user<|end_header_id|>\n\n' -}}
    {{- "Given the following functions, please respond with a JSON for a function call " }}
    {{- "with its proper arguments that best answers the given prompt.\n\n" }}
    {{- 'Respond in the format {"name": function name, "parameters": dictionary of argument name and its value}.' }}
    {{- "Do not use variables.\n\n" }}
    {%- for t in tools %}
        {{- t | tojson(indent=4) }}
        {{- "\n\n" }}
    {%- endfor %}
    {{- first_user_message + "<|eot_id|>"}}
{%- endif %}

{%- for message in messages %}
    {%- if not (message.role == 'ipython' or message.role == 'tool' or 'tool_calls' in message) %}
        {{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n'+ message['content'] | trim + '<|eot_id|>' }}
    {%- elif 'tool_calls' in message %}
        {%- if not message.tool_calls|length == 1 %}
            {{- raise_exception("This model only supports single tool-calls at once!") }}
        {%- endif %}
        {%- set tool_call = message.tool_calls[0].function %}
        {{- '<|start_header_id|>assistant<|end_header_id|>\n\n' -}}
        {{- '{"name": "' + tool_call.name + '", ' }}
        {{- '"parameters": ' }}
        {{- tool_call.arguments | tojson }}
        {{- "}" }}
        {{- "<|eot_id|>" }}
    {%- elif message.role == "tool" or message.role == "ipython" %}
        {{- "<|start_header_id|>ipython<|end_header_id|>\n\n" }}
        {%- if message.content is mapping or message.content is iterable %}
            {{- message.content | tojson }}
        {%- else %}
            {{- message.content }}
        {%- endif %}
        {{- "<|eot_id|>" }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|start_header_id|>assistant<|end_header_id|>\n\n' }}
{%- endif %}
"""

QWEN3 = r"""{%- if tools %}
    {{- '<|im_start|>system\n' }}
    {%- if messages[0].role == 'system' %}
        {{- messages[0].content + '\n\n' }}
    {%- endif %}
    {{- "# Tools\n\nYou may call one or more functions to assist with the user query.\n\n<tools>" }}
    {%- for tool in tools %}
        {{- "\n" }}
        {{- tool | tojson }}
    {%- endfor %}
    {{- "\n</tools><|im_end|>\n" }}
{%- else %}
    {%- if messages[0].role == 'system' %}
        {{- '<|im_start|>system\n' + messages[0].content + '<|im_end|>\n' }}
    {%- endif %}
{%- endif %}
{%- set ns = namespace(multi_step_tool=true, last_query_index=messages|length - 1) %}
{%- for message in messages[::-1] %}
    {%- set index = (messages|length - 1) - loop.index0 %}
    {%- if ns.multi_step_tool and message.role == "user" and message.content is string
           and not(message.content.startswith('<tool_response>') and message.content.endswith('</tool_response>')) %}
        {%- set ns.multi_step_tool = false %}
        {%- set ns.last_query_index = index %}
    {%- endif %}
{%- endfor %}
{%- for message in messages %}
    {%- if message.content is string %}
        {%- set content = message.content %}
    {%- else %}
        {%- set content = '' %}
    {%- endif %}
    {%- if (message.role == "user") or (message.role == "system" and not loop.first) %}
        {{- '<|im_start|>' + message.role + '\n' + content + '<|im_end|>' + '\n' }}
    {%- elif message.role == "assistant" %}
        {%- set reasoning_content = '' %}
        {%- if message.reasoning_content is string %}
            {%- set reasoning_content = message.reasoning_content %}
        {%- else %}
            {%- if '</think>' in content %}
                {%- set reasoning_content = content.split('</think>')[0].rstrip('\n').split('<think>')[-1].lstrip('\n') %}
                {%- set content = content.split('</think>')[-1].lstrip('\n') %}
            {%- endif %}
        {%- endif %}
        {%- if loop.index0 > ns.last_query_index %}
            {%- if loop.last or (not loop.last and reasoning_content) %}
                {{- '<|im_start|>' + message.role + '\n<think>\n' + reasoning_content.strip('\n') + '\n</think>\n\n'
                    + content.lstrip('\n') }}
            {%- else %}
                {{- '<|im_start|>' + message.role + '\n' + content }}
            {%- endif %}
        {%- else %}
            {{- '<|im_start|>' + message.role + '\n' + content }}
        {%- endif %}
        {%- if message.tool_calls %}
            {%- for tool_call in message.tool_calls %}
                {%- if (loop.first and content) or (not loop.first) %}
                    {{- '\n' }}
                {%- endif %}
                {%- if tool_call.function %}
                    {%- set tool_call = tool_call.function %}
                {%- endif %}
                {{- '<tool_call>\n{"name": "' }}
                {{- tool_call.name }}
                {{- '", "arguments": ' }}
                {%- if tool_call.arguments is string %}
                    {{- tool_call.arguments }}
                {%- else %}
                    {{- tool_call.arguments | tojson }}
                {%- endif %}
                {{- '}\n</tool_call>' }}
            {%- endfor %}
        {%- endif %}
        {{- '<|im_end|>\n' }}
    {%- elif message.role == "tool" %}
        {%- if loop.first or (messages[loop.index0 - 1].role != "tool") %}
            {{- '<|im_start|>user' }}
        {%- endif %}
        {{- '\n<tool_response>\n' }}
        {{- content }}
        {{- '\n</tool_response>' }}
        {%- if loop.last or (messages[loop.index0 + 1].role != "tool") %}
            {{- '<|im_end|>\n' }}
        {%- endif %}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\n' }}
    {%- if enable_thinking is defined and enable_thinking is false %}
        {{- '<think>\n\n</think>\n\n' }}
    {%- endif %}
{%- endif %}
"""

MISTRAL = r"""{%- if messages[0]['role'] == 'system' %}
    {%- set system_message = messages[0]['content'] %}
    {%- set loop_messages = messages[1:] %}
{%- else %}
    {%- set loop_messages = messages %}
{%- endif %}
{{- bos_token }}
{%- for message in loop_messages %}
    {%- if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}
        {{- raise_exception('After the optional system message, conversation roles must alternate '
                            + 'user/assistant/user/assistant/...') }}
    {%- endif %}
    {%- if message['role'] == 'user' %}
        {%- if loop.first and system_message is defined %}
            {{- ' [INST] ' + system_message + '\n\n' + message['content'] + ' [/INST]' }}
        {%- else %}
            {{- ' [INST] ' + message['content'] + ' [/INST]' }}
        {%- endif %}
    {%- elif message['role'] == 'assistant' %}
        {{- ' ' + message['content'] + eos_token}}
    {%- else %}
        {{- raise_exception('Only user and assistant roles are supported, '
                            + 'with the exception of an initial optional system message!') }}
    {%- endif %}
{%- endfor %}
"""

# {% generation %} blocks, a plain (non-"-") template with trim_blocks/lstrip_blocks doing the work, and loop controls.
GENERATION = """{% for message in messages %}
{% if message['role'] == 'system' %}{% continue %}{% endif %}
{{ '<|im_start|>' + message['role'] + '\n' }}
{% if message['role'] == 'assistant' %}
{% generation %}{{ message['content'] + '<|im_end|>' }}{% endgeneration %}

{% else %}
    {{ message['content'] }}<|im_end|>
{% endif %}
{% if message['content'] == 'STOP' %}{% break %}{% endif %}
{% endfor %}
{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}
"""

DOCUMENTS = """{{ bos_token }}{% if documents %}<documents>
{% for document in documents %}Document {{ loop.index0 }}
{% for key, value in document.items() %}{{ key }}: {{ value }}
{% endfor %}{% endfor %}</documents>
{% endif %}{% for message in messages %}<|{{ message.role }}|>{{ message.content }}{% if not loop.last %}
{% endif %}{% endfor %}{% if add_generation_prompt %}<|assistant|>{% endif %}"""

TOJSON = """{{ tools | tojson }}|{{ tools | tojson(indent=2) }}|{{ tools | tojson(separators=(',', ':'), sort_keys=true) }}|\
{{ messages[-1].content | tojson }}|{{ messages[-1].content | tojson(ensure_ascii=true) }}|{{ {'<a>': 'b&c'} | tojson }}"""

TEMPLATES = {
    "llama3": (LLAMA3, {"bos_token": "<|begin_of_text|>", "eos_token": "<|eot_id|>"}),
    "qwen3": (QWEN3, {"eos_token": "<|im_end|>", "pad_token": "<|endoftext|>", "bos_token": None}),
    "mistral": (MISTRAL, {"bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>"}),
    "generation": (GENERATION, {"eos_token": {"__type": "AddedToken", "content": "<|im_end|>", "lstrip": False}}),
    "documents": (DOCUMENTS, {"bos_token": "<|startoftext|>"}),
    "tojson": (TOJSON, {}),
}

#: (template, conversation, render keyword arguments) that must render the same as transformers.
CASES = [
    ("llama3", USER, {"add_generation_prompt": True, "date_string": "26 Jul 2024"}),
    ("llama3", MULTI_TURN, {"add_generation_prompt": False, "date_string": "1 Jan 2025"}),
    ("llama3", TOOL_CALL, {"add_generation_prompt": True, "tools": [WEATHER_TOOL], "date_string": "26 Jul 2024"}),
    ("llama3", TOOL_CALL, {"add_generation_prompt": True, "tools": [WEATHER_TOOL], "tools_in_user_message": False,
                           "date_string": "26 Jul 2024"}),
    ("qwen3", USER, {"add_generation_prompt": True}),
    ("qwen3", MULTI_TURN, {"add_generation_prompt": True, "enable_thinking": False}),
    ("qwen3", MULTI_TURN, {"add_generation_prompt": False}),
    ("qwen3", TOOL_CALL, {"add_generation_prompt": True, "tools": [WEATHER_TOOL]}),
    ("qwen3", REASONING, {"add_generation_prompt": False}),
    ("qwen3", [*REASONING[:2], {"role": "assistant", "content": "<think>\nhm\n</think>\n\nfive"}],
     {"add_generation_prompt": False}),
    ("qwen3", PARTS, {"add_generation_prompt": True}),
    ("mistral", USER, {"add_generation_prompt": True}),
    ("mistral", MULTI_TURN, {"add_generation_prompt": False}),
    ("generation", MULTI_TURN, {"add_generation_prompt": True}),
    ("generation", [*MULTI_TURN[:2], {"role": "user", "content": "STOP"}, *MULTI_TURN[2:]], {"add_generation_prompt": False}),
    ("documents", USER, {"add_generation_prompt": True,
                         "documents": [{"title": "len", "text": "Return the length."}, {"title": "iter", "text": "é"}]}),
    ("documents", MULTI_TURN, {"add_generation_prompt": False, "documents": []}),
    ("tojson", MULTI_TURN, {"add_generation_prompt": False, "tools": [WEATHER_TOOL, {"b": 1, "a": [1.5, None, True]}]}),
]


@pytest.fixture(scope="module")
def template_folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("templates")
    return {name: make_checkpoint(root / name, {**tokens, "chat_template": source})
            for name, (source, tokens) in TEMPLATES.items()}


@pytest.mark.parametrize("template, messages, kwargs", CASES, ids=[f"{c[0]}-{i}" for i, c in enumerate(CASES)])
def test_realistic_templates_render_like_transformers(template_folders, template, messages, kwargs):
    rendered = assert_renders_like_transformers(template_folders[template], messages, **kwargs)
    texts = [m["content"].strip() for m in messages if isinstance(m.get("content"), str) and m["content"].strip()]
    assert texts and any(text in rendered for text in texts)  # the comparison is not between two empty strings


def test_llama3_default_date_comes_from_strftime_now(template_folders):
    ours = ChatTemplate.from_checkpoint(template_folders["llama3"])
    before = ours.render(USER)
    expected = hf_render(template_folders["llama3"], USER, add_generation_prompt=True)
    assert expected in (before, ours.render(USER))  # the same day, unless the test straddled midnight
    assert "Today Date: 26 Jul 2024" not in before


def test_render_defaults_to_adding_the_generation_prompt(template_folders):
    ours = ChatTemplate.from_checkpoint(template_folders["qwen3"])
    assert ours.render(USER) == hf_render(template_folders["qwen3"], USER, add_generation_prompt=True)
    assert ours.render(USER).endswith("<|im_start|>assistant\n")
    assert not ours.render(USER, add_generation_prompt=False).endswith("<|im_start|>assistant\n")


def test_raise_exception_message_reaches_the_caller(template_folders):
    import jinja2

    bad = [{"role": "user", "content": "a"}, {"role": "user", "content": "b"}]
    message = "conversation roles must alternate user/assistant/user/assistant/..."
    with pytest.raises(jinja2.TemplateError, match=re.escape(message)):
        hf_render(template_folders["mistral"], bad, add_generation_prompt=True)
    with pytest.raises(InvalidRequestError, match=re.escape(message)):
        ChatTemplate.from_checkpoint(template_folders["mistral"]).render(bad)
    two_calls = [USER[0], {"role": "assistant", "tool_calls": [TOOL_CALL[2]["tool_calls"][0]] * 2}]
    with pytest.raises(InvalidRequestError, match="only supports single tool-calls"):
        ChatTemplate.from_checkpoint(template_folders["llama3"]).render(two_calls, date_string="x")


def test_extra_variables_override_special_tokens(template_folders):
    kwargs = {"add_generation_prompt": False, "bos_token": "[BOS]"}
    rendered = assert_renders_like_transformers(template_folders["mistral"], USER, **kwargs)
    assert rendered.startswith("[BOS] [INST]")


def test_messages_are_not_modified_and_not_shared(template_folders):
    messages = json.loads(json.dumps(REASONING + [{"role": "user", "content": None, "name": None}]))
    copy = json.loads(json.dumps(messages))
    ChatTemplate.from_checkpoint(template_folders["qwen3"]).render(messages)
    assert messages == copy
    checked = check_messages(messages)
    checked[0]["content"] = "changed"
    assert messages[0]["content"] == "2+2?"


def test_none_values_are_dropped_and_reasoning_aliased_as_in_transformers(tmp_path):
    source = ("{% for m in messages %}{{ m|dictsort|tojson }};{{ 'content' in m }};{{ m.thinking }}|{{ m.reasoning_content }}\n"
              "{% endfor %}")
    folder = make_checkpoint(tmp_path / "m", {"chat_template": source})
    messages = [
        {"role": "user", "content": None, "name": None},
        {"role": "assistant", "content": "x", "thinking": "t", "reasoning_content": None},
        {"role": "assistant", "content": "y", "reasoning": "r"},
        {"role": "assistant", "content": "z", "reasoning_content": "rc", "thinking": "th"},
    ]
    rendered = assert_renders_like_transformers(folder, messages, add_generation_prompt=False)
    assert rendered.splitlines()[0].endswith(";False;|") and "r|r" in rendered


# ----------------------------------------------------------------------------- the tiny models


@pytest.mark.parametrize("name", TINY)
@pytest.mark.parametrize("messages", [USER, MULTI_TURN, PARTS, REASONING], ids=["user", "multi-turn", "parts", "reasoning"])
@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_tiny_models_render_like_transformers(name, messages, add_generation_prompt):
    assert_renders_like_transformers(embedded_model_path(name), messages, add_generation_prompt=add_generation_prompt)


@pytest.mark.parametrize("name", TINY)
def test_tiny_templates_use_the_tokenizers_own_tokens(name):
    from tokenizers import Tokenizer

    folder = embedded_model_path(name)
    tokenizer = Tokenizer.from_file(str(folder / "tokenizer.json"))
    config = json.loads((folder / "config.json").read_text())
    generation = json.loads((folder / "generation_config.json").read_text())
    template = ChatTemplate.from_checkpoint(folder)
    bos, eos = config["bos_token_id"], generation["eos_token_id"]
    assert template.bos_token == tokenizer.id_to_token(bos) and template.eos_token == tokenizer.id_to_token(eos)
    assert template.special_tokens["pad_token"] == tokenizer.id_to_token(config["pad_token_id"])
    added = {token.content for token in tokenizer.get_added_tokens_decoder().values()}
    text = template.render(MULTI_TURN + [{"role": "assistant", "content": "Yes."}, USER[0]])
    # No marker that looks like a special token but would be spelt out in pieces.
    assert set(re.findall(r"<\|[^<>]*?\|>", text + template.source)) <= added
    ids = tokenizer.encode(text, add_special_tokens=False).ids
    assert ids[0] == bos and ids.count(eos) == 3  # the BOS, and the end of each of the two assistant turns
    assert tokenizer.decode(ids, skip_special_tokens=False) == text
    reply = tokenizer.encode("Yes.", add_special_tokens=False).ids
    end = ids.index(eos, 1 + ids[1:].index(eos) + 1)
    assert ids[end - len(reply) : end] == reply  # the assistant's text ends right where its EOS is
    assert text.endswith("### assistant\n")


@pytest.mark.parametrize("name", TINY)
def test_rendered_chat_is_tokenized_without_adding_special_tokens(name):
    """transformers encodes the rendered chat with add_special_tokens=False: the BOS the template
    writes is the only one. The tiny tokenizers prepend BOS otherwise, which would double it."""
    from tokenizers import Tokenizer

    folder = embedded_model_path(name)
    tokenizer = Tokenizer.from_file(str(folder / "tokenizer.json"))
    text = ChatTemplate.from_checkpoint(folder).render(MULTI_TURN)
    expected = hf_tokenizer(folder).apply_chat_template(MULTI_TURN, add_generation_prompt=True, return_dict=False)
    assert list(expected) == tokenizer.encode(text, add_special_tokens=False).ids
    assert tokenizer.encode(text).ids[:2] == [0, 0]


@pytest.mark.parametrize("name", TINY)
def test_tiny_model_cards_mention_the_template(name):
    card = (embedded_model_path(name) / "README.md").read_text()
    assert "chat template" in card and "tokenizer_config.json" in card


# ----------------------------------------------------------------------------- where templates come from

A = "A{{ messages[0].content }}{{ eos_token }}"
B = "B{{ messages[0].content }}{% if tools %}{{ tools|length }}{% endif %}"


def test_chat_template_jinja_takes_precedence_over_tokenizer_config(tmp_path):
    folder = make_checkpoint(tmp_path / "m", {"chat_template": B, "eos_token": "</s>"}, jinja=A)
    template = ChatTemplate.from_checkpoint(folder)
    assert template.source == A and template.origin == str(folder / "chat_template.jinja")
    assert assert_renders_like_transformers(folder, USER, add_generation_prompt=True) == "AReturn the number of items.</s>"


def test_named_templates_in_tokenizer_config(tmp_path):
    config = {"chat_template": [{"name": "tool_use", "template": B}, {"name": "default", "template": A}], "eos_token": "</s>"}
    folder = make_checkpoint(tmp_path / "m", config)
    assert ChatTemplate.from_checkpoint(folder).source == A
    assert assert_renders_like_transformers(folder, USER).startswith("A")
    assert assert_renders_like_transformers(folder, USER, tools=[WEATHER_TOOL]) == "BReturn the number of items.1"


def test_additional_chat_template_files(tmp_path):
    folder = make_checkpoint(tmp_path / "m", {"chat_template": "C", "eos_token": "!"}, jinja=A, extra={"tool_use": B})
    template = ChatTemplate.from_checkpoint(folder)
    assert sorted(template.templates) == ["default", "tool_use"]
    assert assert_renders_like_transformers(folder, USER) == "AReturn the number of items.!"
    assert assert_renders_like_transformers(folder, USER, tools=[WEATHER_TOOL]) == "BReturn the number of items.1"


def test_named_templates_without_a_default_are_refused(tmp_path):
    folder = make_checkpoint(tmp_path / "m", {"chat_template": [{"name": "tool_use", "template": B}]})
    with pytest.raises(CheckpointError, match="none named 'default'"):
        ChatTemplate.from_checkpoint(folder)


def test_override_by_path_and_by_source(tmp_path):
    folder = make_checkpoint(tmp_path / "m", {"chat_template": B, "eos_token": "</s>"}, jinja=B)
    file = tmp_path / "mine.jinja"
    file.write_text(A)
    for override in (file, str(file), A):
        template = ChatTemplate.from_checkpoint(folder, override=override)
        assert template.source == A and template.render(USER) == "AReturn the number of items.</s>"
    assert ChatTemplate.from_checkpoint(folder, override=file).origin == str(file)
    assert "override" in ChatTemplate.from_checkpoint(folder, override=A).origin


def test_override_works_without_a_checkpoint_template(tmp_path):
    folder = make_checkpoint(tmp_path / "m", {"eos_token": "</s>"})
    assert ChatTemplate.from_checkpoint(folder) is None
    assert ChatTemplate.from_checkpoint(folder, override=A).render(USER).endswith("</s>")


@pytest.mark.parametrize("override", ["missing.jinja", "", Path("missing.jinja"), 42])
def test_override_that_is_neither_a_file_nor_source_is_refused(tmp_path, override):
    folder = make_checkpoint(tmp_path / "m", {"chat_template": A})
    with pytest.raises(ConfigError):
        ChatTemplate.from_checkpoint(folder, override=override)


def test_none_when_the_checkpoint_has_no_template(tmp_path):
    assert ChatTemplate.from_checkpoint(make_checkpoint(tmp_path / "bare")) is None
    assert ChatTemplate.from_checkpoint(make_checkpoint(tmp_path / "config", {"eos_token": "</s>"})) is None
    assert ChatTemplate.from_checkpoint(make_checkpoint(tmp_path / "null", {"chat_template": None})) is None
    with pytest.raises(CheckpointError, match="not a checkpoint folder"):
        ChatTemplate.from_checkpoint(tmp_path / "nowhere")


# ----------------------------------------------------------------------------- special tokens

SHOW_TOKENS = ("{{ bos_token }}|{{ eos_token }}|{{ unk_token }}|{{ pad_token }}|{{ image_token }}|{{ boi_token }}"
               "|{{ add_bos_token }}")


@pytest.mark.parametrize("config, special_map", [
    ({"bos_token": {"__type": "AddedToken", "content": "<s>", "lstrip": False, "special": True}, "eos_token": "</s>",
      "image_token": "<img>", "add_bos_token": True, "unk_token": None, "model_max_length": 8}, None),
    ({"bos_token": "<s>", "eos_token": "</s>"},
     {"eos_token": {"content": "<EOS2>"}, "unk_token": "<unk>", "image_token": "<i2>"}),
    ({"bos_token": "<s>", "eos_token": "</s>", "added_tokens_decoder": {}}, {"eos_token": "<EOS2>"}),
    ({"eos_token": "</s>", "extra_special_tokens": {"boi_token": "<boi>"}, "additional_special_tokens": ["<x>"]}, None),
    ({"eos_token": "</s>"}, {"extra_special_tokens": {"boi_token": "<b2>"}, "pad_token": "<pad>"}),
], ids=["added-token", "special-map", "special-map-ignored", "extra", "extra-in-map"])
def test_special_tokens_are_read_as_transformers_reads_them(tmp_path, config, special_map):
    folder = make_checkpoint(tmp_path / "m", {**config, "chat_template": SHOW_TOKENS}, special_tokens_map=special_map)
    assert read_special_tokens(folder) == hf_tokenizer(folder).special_tokens_map
    assert_renders_like_transformers(folder, USER)


def test_special_tokens_as_strings_or_objects(tmp_path):
    folder = make_checkpoint(tmp_path / "m", {"chat_template": A, "bos_token": {"content": "<s>"}, "eos_token": "</s>"})
    template = ChatTemplate.from_checkpoint(folder)
    assert (template.bos_token, template.eos_token) == ("<s>", "</s>")


# ----------------------------------------------------------------------------- malformed checkpoints


@pytest.mark.parametrize("where", ["tokenizer_config", "jinja", "override", "named"])
def test_template_syntax_error_is_a_checkpoint_error_naming_the_source(tmp_path, where):
    broken = "{% for m in messages %}\n{{ m.content }\n"
    config = {"chat_template": broken} if where == "tokenizer_config" else {"chat_template": A}
    if where == "named":
        config = {"chat_template": [{"name": "default", "template": A}, {"name": "rag", "template": broken}]}
    folder = make_checkpoint(tmp_path / "m", config, jinja=broken if where == "jinja" else None)
    source = {"tokenizer_config": "tokenizer_config.json", "jinja": "chat_template.jinja", "override": "override",
              "named": "'rag'"}[where]
    with pytest.raises(CheckpointError, match=re.escape(source)) as caught:
        ChatTemplate.from_checkpoint(folder, override=broken if where == "override" else None)
    assert "line 2" in str(caught.value)


def test_unknown_filter_is_a_checkpoint_error(tmp_path):
    folder = make_checkpoint(tmp_path / "m", {"chat_template": "{{ messages | no_such_filter }}"})
    with pytest.raises(CheckpointError, match="no_such_filter"):
        ChatTemplate.from_checkpoint(folder)


@pytest.mark.parametrize("text, match", [
    ("{not json", "not valid JSON"),
    ("[1, 2]", "JSON object"),
    (json.dumps({"chat_template": 5}), "chat_template must be"),
    (json.dumps({"chat_template": [{"name": "default"}]}), r"chat_template\[0\]"),
    (json.dumps({"chat_template": [{"name": "default", "template": 3}]}), "'default' must be a string"),
    (json.dumps({"chat_template": A, "eos_token": 5}), "eos_token"),
    (json.dumps({"chat_template": A, "bos_token": {"id": 1}}), "bos_token"),
])
def test_malformed_tokenizer_config_is_a_checkpoint_error(tmp_path, text, match):
    folder = make_checkpoint(tmp_path / "m")
    (folder / "tokenizer_config.json").write_text(text)
    with pytest.raises(CheckpointError, match=match):
        ChatTemplate.from_checkpoint(folder)


def test_unreadable_template_file_is_a_checkpoint_error(tmp_path):
    folder = make_checkpoint(tmp_path / "m")
    (folder / "chat_template.jinja").write_bytes(b"\xff\xfe{{ x }}")
    with pytest.raises(CheckpointError, match="chat_template.jinja"):
        ChatTemplate.from_checkpoint(folder)


# ----------------------------------------------------------------------------- bad requests


@pytest.fixture(scope="module")
def tiny_template():
    return ChatTemplate.from_checkpoint(embedded_model_path("tiny-dense"))


class Opaque:
    pass


def _self_containing():
    parts: list = [{"type": "text", "text": "x"}]
    message = {"role": "user", "content": "x", "meta": parts}
    parts.append(parts)
    return [message]


@pytest.mark.parametrize("messages, match", [
    ("hello", "messages must be a list"),
    ({"role": "user", "content": "x"}, "messages must be a list"),
    ([], "at least one message"),
    (["hello"], r"messages\[0\] must be a dict"),
    ([{"content": "x"}], r"messages\[0\] must have a non-empty string 'role'"),
    ([USER[0], {"role": 3, "content": "x"}], r"messages\[1\] must have a non-empty string 'role'"),
    ([{"role": "", "content": "x"}], "non-empty string 'role'"),
    ([{"role": "user", "content": 5}], r"messages\[0\]\['content'\] must be a string, None or a list"),
    ([{"role": "user", "content": {"type": "text", "text": "x"}}], "must be a string, None or a list"),
    ([{"role": "user", "content": ["x"]}], r"\['content'\]\[0\] must be a content part"),
    ([{"role": "user", "content": [{"text": "x"}]}], r"\[0\] must have a string 'type'"),
    ([{"role": "user", "content": [{"type": "text", "text": "x"}, {"type": "image_url", "image_url": {"url": "u"}}]}],
     r"\['content'\]\[1\] is a content part of type 'image_url'; this model takes text only"),
    ([{"role": "user", "content": [{"type": "image"}]}], "takes text only"),
    ([{"role": "user", "content": [{"type": "input_audio", "input_audio": {}}]}], "takes text only"),
    ([{"role": "user", "content": [{"type": "text", "text": None}]}], "'text' must be a string"),
    ([{"role": "user", "content": "x", "name": Opaque()}], r"messages\[0\]\['name'\] is .*Opaque.*JSON values only"),
    ([{"role": "user", "content": "x", "tool_calls": [{"f": {1, 2}}]}], r"\['tool_calls'\]\[0\]\['f'\] is"),
    ([{"role": "user", "content": "x", "meta": {(1, 2): "v"}}], "keys must be strings"),
    (_self_containing(), "contains itself"),
])
def test_bad_messages_are_refused(tiny_template, messages, match):
    with pytest.raises(InvalidRequestError, match=match):
        tiny_template.render(messages)


@pytest.mark.parametrize("kwargs, match", [
    ({"tools": WEATHER_TOOL}, "tools must be None or a list"),
    ({"tools": [print]}, r"tools\[0\] must be a dict"),
    ({"tools": ["get_weather"]}, r"tools\[0\] must be a dict"),
    ({"documents": "text"}, "documents must be None or a list"),
    ({"documents": [["title", "text"]]}, r"documents\[0\] must be a dict"),
    ({"add_generation_prompt": "yes"}, "add_generation_prompt must be True or False"),
    ({"add_generation_prompt": 1}, "add_generation_prompt must be True or False"),
    ({"enable_thinking": Opaque()}, "enable_thinking is"),
])
def test_bad_render_options_are_refused(tiny_template, kwargs, match):
    with pytest.raises(InvalidRequestError, match=match):
        tiny_template.render(USER, **kwargs)


def test_numpy_values_and_tuples_are_plain_data(tiny_template):
    import numpy as np

    messages = [{"role": "user", "content": "x", "n": np.int64(3), "flag": np.bool_(False), "t": (1, 2)}]
    checked = check_messages(messages)
    assert checked[0]["n"] == 3 and type(checked[0]["n"]) is int and checked[0]["flag"] is False
    assert checked[0]["t"] == (1, 2)
    assert tiny_template.render(messages) == tiny_template.render([{"role": "user", "content": "x"}])


# ----------------------------------------------------------------------------- the sandbox


@pytest.mark.parametrize("source, match", [
    ("{{ ''.__class__.__mro__ }}", "unsafe"),
    ("{{ messages.__class__.__base__.__subclasses__() }}", "unsafe"),
    ("{% set x = cycler.__init__.__globals__ %}{{ x }}", "unsafe"),
    ("{{ messages.append(1) }}", "unsafe"),
    ("{{ messages[0].update({'role': 'x'}) }}", "unsafe"),
    ("{{ dict.__class__.__mro__ }}", "unsafe"),
    ("{% set ns = namespace(_secret=1) %}{{ ns._secret }}", "_secret"),
    ("{% set ns = namespace(a=1) %}{% set ns._b = 2 %}", "_b"),
    ("{{ range(10**9) | length }}", "Range too big"),
    ("{{ 'a' + 1 }}", "TypeError"),
    ("{{ no_such_variable.attribute }}", "no_such_variable"),
    ("{{ messages | tojson(indent=messages) }}", "TypeError"),
    ("{% macro f(n) %}{{ f(n) }}{% endmacro %}{{ f(1) }}", "RecursionError"),
])
def test_template_failures_are_invalid_request_errors(source, match):
    template = ChatTemplate(source, {"eos_token": "</s>"})
    with pytest.raises(InvalidRequestError, match=match) as caught:
        template.render(USER)
    assert "the chat template" in str(caught.value)


def test_sandbox_refusals_match_transformers(tmp_path):
    """The same attribute access that transformers' sandbox refuses is refused here (and the
    private attribute alone, unused, renders as nothing in both)."""
    import jinja2

    folder = make_checkpoint(tmp_path / "m", {"chat_template": "[{{ ''.__class__ }}]"})
    assert assert_renders_like_transformers(folder, USER) == "[]"
    folder = make_checkpoint(tmp_path / "n", {"chat_template": "{{ ''.__class__.__mro__ }}"})
    with pytest.raises(jinja2.exceptions.SecurityError):
        hf_render(folder, USER)
    with pytest.raises(InvalidRequestError, match="access to attribute '__class__' of 'str' object is unsafe"):
        ChatTemplate.from_checkpoint(folder).render(USER)


def test_namespace_dict_and_loop_helpers_work(tmp_path):
    source = ("{% set ns = namespace(n=0, seen=dict(a=1)) %}{% for m in messages %}{% set ns.n = ns.n + 1 %}"
              "{% if loop.last %}{{ ns.n }} {{ loop.length }} {{ ns.seen | tojson }} {{ dict.fromkeys(['x'], 0) | tojson }}"
              "{% endif %}{% endfor %}")
    folder = make_checkpoint(tmp_path / "m", {"chat_template": source})
    assert assert_renders_like_transformers(folder, MULTI_TURN) == '4 4 {"a": 1} {"x": 0}'


def test_constructor_checks_its_arguments():
    with pytest.raises(CheckpointError, match="none named 'default'"):
        ChatTemplate({"rag": A})
    with pytest.raises(CheckpointError, match="bos_token"):
        ChatTemplate(A, {"bos_token": 1})
    with pytest.raises(CheckpointError, match="not a valid Jinja template"):
        ChatTemplate("{% if %}", origin="my template")
    with pytest.raises(CheckpointError, match="Jinja source"):
        ChatTemplate(None)
    template = ChatTemplate(A, {"eos_token": "</s>"}, origin="here")
    assert template.eos_token == "</s>" and template.bos_token is None and "here" in repr(template)
