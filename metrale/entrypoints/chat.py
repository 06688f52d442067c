"""Chat templates: turning a conversation into the prompt text the model was trained on.

A chat model expects its conversations written in one exact format — role markers, special tokens,
where the turns end — and its checkpoint says which, as a `Jinja <https://jinja.palletsprojects.com>`_
template. :class:`ChatTemplate` reads that template and renders it exactly as Hugging Face
transformers' ``tokenizer.apply_chat_template(messages, tokenize=False)`` does, so that a model
served by Metrale sees the same prompt text it sees under transformers.

Where the template comes from
-----------------------------

:meth:`ChatTemplate.from_checkpoint` looks, in this order, for

1. the ``override`` argument: the path of a template file, or the template's source itself (a
   string that is not an existing file and holds ``{``, ``}`` or a newline; any other string is
   refused as a file that does not exist);
2. the checkpoint's ``chat_template.jinja`` (the *default* template), together with the named
   templates of its ``additional_chat_templates/NAME.jinja`` files; when any of these files exist,
   ``tokenizer_config.json``'s templates are not read, as in transformers;
3. the ``chat_template`` key of ``tokenizer_config.json``: a string, or a list of
   ``{"name": ..., "template": ...}`` objects (older checkpoints with several templates).

A checkpoint with none of these has no template (``from_checkpoint`` returns None). Of several
named templates, the one named ``"default"`` is rendered, except that a request with ``tools``
uses the one named ``"tool_use"`` when there is one (transformers' choice too); a set of named
templates without a ``"default"`` is refused.

The special tokens
------------------

Templates write special tokens through variables: ``bos_token``, ``eos_token``, ``unk_token``,
``sep_token``, ``pad_token``, ``cls_token``, ``mask_token`` and the model-specific ones (any other
key of ``tokenizer_config.json`` ending in ``_token`` whose value is a token, such as Gemma's
``image_token``, and the entries of an ``extra_special_tokens`` object). A token is stored either
as its string or as an ``AddedToken`` object (``{"content": "<s>", "lstrip": false, ...}``), whose
``content`` is the string. A legacy ``special_tokens_map.json`` overrides these values when
``tokenizer_config.json`` has no ``added_tokens_decoder``, as transformers reads it. Flags such as
``add_bos_token`` are not tokens and are not passed.

What the template sees
----------------------

:meth:`ChatTemplate.render` passes the variables transformers passes: ``messages``,
``add_generation_prompt``, ``tools``, ``documents``, the special tokens, and any extra keyword
arguments (``enable_thinking=False``, for example), which take precedence over a special token of
the same name. Before rendering, the messages are checked and copied (the caller's objects are
never modified, nor shown to the template):

* ``messages`` is a non-empty list of dicts, each with a non-empty string ``role``;
* a message's ``content`` is a string, None, or a list of content parts. Parts are OpenAI-style
  ``{"type": "text", "text": "..."}`` dicts and are passed as they are (templates join them); a
  part of any other type (an image, audio, a file) is refused, since these models take text only;
* a key whose value is None is dropped, as transformers drops it: templates see ``content=None``
  as a message without content;
* a message's reasoning, given as ``reasoning_content``, ``thinking`` or ``reasoning``, is passed
  under ``reasoning_content`` and ``thinking`` both (the names templates read);
* ``tools`` and ``documents`` are None or lists of dicts (tools as JSON schemas);
* every value — in messages, tools, documents and extra variables — is plain JSON data: strings,
  numbers, booleans, None, lists and dicts (NumPy scalars are taken as their Python value).

The template runs in Jinja's immutable sandbox with ``trim_blocks`` and ``lstrip_blocks`` and the
``loopcontrols`` extension (``{% break %}``, ``{% continue %}``), with transformers' additions:
the ``tojson`` filter (``json.dumps`` with ``ensure_ascii=False`` and the optional ``indent``,
``separators`` and ``sort_keys``; Jinja's own escapes HTML characters), the ``raise_exception(message)``
and ``strftime_now(format)`` functions, a ``namespace`` that refuses attributes starting with an
underscore, and the ``{% generation %}`` block that marks assistant text for training masks
(rendered as its body). The sandbox refuses access to private attributes (``''.__class__``) and
to methods that modify data (``messages.append``).

Errors
------

* A template with a syntax error is refused when it is loaded, with a
  :class:`~metrale.errors.CheckpointError` naming the file (or the override) and the line;
  unreadable files and malformed ``tokenizer_config.json`` entries get one too, and an
  ``override`` that is neither a file nor template source a :class:`~metrale.errors.ConfigError`.
* Messages that break the rules above get an :class:`~metrale.errors.InvalidRequestError` naming
  the offending message or value.
* Whatever goes wrong while the template runs — ``raise_exception`` (its message is kept), an
  undefined variable, a refused attribute, a type error in the template's arithmetic — is an
  :class:`~metrale.errors.InvalidRequestError` too; no Jinja exception reaches the caller.

Tokenizing the result
---------------------

The rendered text already holds every special token the model needs (a template that wants a BOS
writes ``{{ bos_token }}``). It must be tokenized *without* adding special tokens again, as
transformers' ``apply_chat_template(tokenize=True)`` encodes it with ``add_special_tokens=False``;
otherwise a tokenizer that prepends BOS would double it.
"""

from __future__ import annotations

import json
import re
from datetime import datetime
from pathlib import Path
from typing import Any, Mapping

import jinja2
import jinja2.ext
import jinja2.nodes
import jinja2.sandbox
import jinja2.utils
import numpy as np

from metrale.errors import CheckpointError, ConfigError, InvalidRequestError, MetraleError
from metrale.validation import check_bool

#: The file a checkpoint's default chat template is read from first.
TEMPLATE_FILE = "chat_template.jinja"

#: The folder of a checkpoint's other named templates, one ``NAME.jinja`` file each.
TEMPLATE_DIR = "additional_chat_templates"

#: The tokenizer settings file that may hold the template and holds the special tokens.
TOKENIZER_CONFIG_FILE = "tokenizer_config.json"

#: The legacy file of special tokens, read when ``tokenizer_config.json`` lacks ``added_tokens_decoder``.
SPECIAL_TOKENS_MAP_FILE = "special_tokens_map.json"

#: The standard special-token variables (transformers' ``SPECIAL_TOKENS_ATTRIBUTES``).
SPECIAL_TOKEN_NAMES = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")

#: The name of the template rendered when a checkpoint has several.
DEFAULT_TEMPLATE = "default"

#: The name of the template rendered for a request with ``tools``, when the checkpoint has one.
TOOL_USE_TEMPLATE = "tool_use"

#: The names a message's reasoning may be given under; it is passed under the first and ``thinking``.
REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")

#: The oldest Jinja whose sandbox has no known escape (transformers requires it too).
MINIMUM_JINJA = (3, 1, 6)

# Characters every template source holds and no file name does (a literal override has one).
_TEMPLATE_CHARACTERS = ("{", "}", "\n")


# ----------------------------------------------------------------------------- the environment


def _raise_exception(message: Any) -> None:
    """``raise_exception(message)`` in a template: refuse the request with ``message``."""
    raise InvalidRequestError(f"the chat template refused the messages: {message}")


def _tojson(value: Any, ensure_ascii: bool = False, indent: Any = None, separators: Any = None, sort_keys: bool = False) -> str:
    """The ``tojson`` filter: ``json.dumps`` without Jinja's HTML escaping, as transformers defines it."""
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(format: str) -> str:
    """``strftime_now(format)`` in a template: the local time now, formatted."""
    return datetime.now().strftime(format)


class _TemplateDict:
    """The ``dict`` global: builds dicts, but exposes nothing of the ``dict`` type itself."""

    def __call__(self, *args: Any, **kwargs: Any) -> dict:
        return dict(*args, **kwargs)

    def fromkeys(self, *args: Any, **kwargs: Any) -> dict:
        return dict.fromkeys(*args, **kwargs)


class _Namespace(jinja2.utils.Namespace):
    """The ``namespace`` global: Jinja's, refusing attribute names that start with an underscore."""

    def __init__(*args: Any, **kwargs: Any) -> None:  # no named self: namespace(self=...) must work
        self, args = args[0], args[1:]
        attributes = dict(*args, **kwargs)
        for name in attributes:
            _Namespace._check_name(name)
        jinja2.utils.Namespace.__init__(self, attributes)

    def __setitem__(self, name: str, value: Any) -> None:
        _Namespace._check_name(name)
        jinja2.utils.Namespace.__setitem__(self, name, value)

    @staticmethod
    def _check_name(name: Any) -> None:
        if isinstance(name, str) and name.startswith("_"):
            raise jinja2.exceptions.SecurityError(f"a chat template cannot set the attribute {name!r} of a namespace")


class _GenerationBlock(jinja2.ext.Extension):
    """``{% generation %}...{% endgeneration %}``: marks assistant text (transformers uses it for
    training masks); rendering outputs the body unchanged."""

    tags = {"generation"}

    def parse(self, parser: Any) -> jinja2.nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_render_body"), [], [], body).set_lineno(lineno)

    def _render_body(self, caller: Any) -> str:
        return caller()


def _environment() -> jinja2.sandbox.ImmutableSandboxedEnvironment:
    version = tuple(int(part) for part in re.findall(r"\d+", jinja2.__version__)[:3])
    if version < MINIMUM_JINJA:
        raise ImportError(
            f"chat templates need jinja2 >= {'.'.join(map(str, MINIMUM_JINJA))} (older sandboxes can be escaped); "
            f"jinja2 {jinja2.__version__} is installed"
        )
    environment = jinja2.sandbox.ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[_GenerationBlock, jinja2.ext.loopcontrols]
    )
    environment.filters["tojson"] = _tojson
    environment.globals["raise_exception"] = _raise_exception
    environment.globals["strftime_now"] = _strftime_now
    environment.globals["dict"] = _TemplateDict()
    environment.globals["namespace"] = _Namespace
    return environment


# ----------------------------------------------------------------------------- checking inputs


def _describe(value: Any) -> str:
    text = repr(value)
    return f"{text[:80]}... ({type(value).__name__})" if len(text) > 80 else f"{text} ({type(value).__name__})"


def _plain_key(key: Any, where: str) -> Any:
    if key is None or type(key) in (str, int, float, bool):
        return key
    if isinstance(key, (str, int, float, np.generic)):
        return _plain(key, where, set())
    raise InvalidRequestError(f"{where} has a key {_describe(key)}; keys must be strings")


def _plain(value: Any, where: str, active: set[int]) -> Any:
    """A copy of ``value`` made of plain JSON types only, or InvalidRequestError naming ``where``."""
    if value is None or type(value) in (str, int, float, bool):
        return value
    if isinstance(value, str):
        return str.__str__(value)
    if isinstance(value, int):
        return int.__int__(value)
    if isinstance(value, float):
        return float.__float__(value)
    if isinstance(value, np.generic) and isinstance(value.item(), (bool, int, float, str)):
        return value.item()
    if isinstance(value, (Mapping, list, tuple)):
        if id(value) in active:
            raise InvalidRequestError(f"{where} contains itself")
        active.add(id(value))
        try:
            if isinstance(value, Mapping):
                return {_plain_key(k, where): _plain(v, f"{where}[{k!r}]", active) for k, v in value.items()}
            items = [_plain(v, f"{where}[{i}]", active) for i, v in enumerate(value)]
            return items if isinstance(value, list) else tuple(items)
        finally:
            active.discard(id(value))
    raise InvalidRequestError(
        f"{where} is {_describe(value)}; chat messages, tools, documents and template variables hold JSON values only "
        "(strings, numbers, booleans, None, lists and dicts)"
    )


def _check_content(content: Any, where: str) -> None:
    if isinstance(content, str):
        return
    if not isinstance(content, list):
        raise InvalidRequestError(
            f"{where} must be a string, None or a list of content parts ({{'type': 'text', 'text': ...}}), "
            f"got {_describe(content)}"
        )
    for index, part in enumerate(content):
        label = f"{where}[{index}]"
        if not isinstance(part, Mapping):
            raise InvalidRequestError(f"{label} must be a content part ({{'type': 'text', 'text': ...}}), got {_describe(part)}")
        kind = part.get("type")
        if not isinstance(kind, str):
            raise InvalidRequestError(f"{label} must have a string 'type' ('text'), got {_describe(kind)}")
        if kind != "text":
            raise InvalidRequestError(
                f"{label} is a content part of type {kind!r}; this model takes text only ({{'type': 'text', 'text': ...}} parts)"
            )
        if not isinstance(part.get("text"), str):
            raise InvalidRequestError(f"{label} is a text part whose 'text' must be a string, got {_describe(part.get('text'))}")


def check_messages(messages: Any) -> list[dict[str, Any]]:
    """The messages as a chat template sees them: checked against the module's rules and copied
    into plain dicts, with None values dropped and reasoning aliased (see the module docstring).

    Raises :class:`~metrale.errors.InvalidRequestError` naming the first offending message.
    """
    if not isinstance(messages, (list, tuple)):
        raise InvalidRequestError(f"messages must be a list of dicts with 'role' and 'content', got {_describe(messages)}")
    if not messages:
        raise InvalidRequestError("messages must hold at least one message, got an empty list")
    checked = []
    for index, message in enumerate(messages):
        where = f"messages[{index}]"
        if not isinstance(message, Mapping):
            raise InvalidRequestError(f"{where} must be a dict with 'role' and 'content', got {_describe(message)}")
        role = message.get("role")
        if not isinstance(role, str) or not role:
            raise InvalidRequestError(f"{where} must have a non-empty string 'role', got {_describe(role)}")
        if message.get("content") is not None:
            _check_content(message["content"], f"{where}['content']")
        plain = {_plain_key(k, where): _plain(v, f"{where}[{k!r}]", set()) for k, v in message.items() if v is not None}
        reasoning = next((plain[field] for field in REASONING_FIELDS if field in plain), None)
        if reasoning is not None:
            plain = {"thinking": reasoning, **plain, "reasoning_content": reasoning}
        checked.append(plain)
    return checked


def _check_dicts(name: str, value: Any, what: str) -> list[dict[str, Any]] | None:
    if value is None:
        return None
    if not isinstance(value, (list, tuple)):
        raise InvalidRequestError(f"{name} must be None or a list of {what}, got {_describe(value)}")
    for index, item in enumerate(value):
        if not isinstance(item, Mapping):
            raise InvalidRequestError(f"{name}[{index}] must be a dict ({what}), got {_describe(item)}")
    return [_plain(item, f"{name}[{index}]", set()) for index, item in enumerate(value)]


# ----------------------------------------------------------------------------- reading checkpoints


def _read_text(path: Path, error: type[MetraleError]) -> str:
    try:
        return path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as failure:
        raise error(f"{path} cannot be read: {failure}") from failure


def _read_json_object(path: Path) -> dict[str, Any]:
    """The JSON object in ``path``; ``{}`` when there is no such file."""
    if not path.is_file():
        return {}
    try:
        data = json.loads(_read_text(path, CheckpointError))
    except json.JSONDecodeError as failure:
        raise CheckpointError(f"{path} is not valid JSON: {failure}") from failure
    if not isinstance(data, dict):
        raise CheckpointError(f"{path} must hold a JSON object, got {type(data).__name__}")
    return data


def _token_text(value: Any) -> str | None:
    """The string of a serialised token: the string itself, or an AddedToken object's ``content``."""
    if isinstance(value, str):
        return value
    if isinstance(value, Mapping) and isinstance(value.get("content"), str):
        return value["content"]
    return None


def _collect_tokens(tokens: dict[str, str], settings: Mapping[str, Any], path: Path) -> None:
    for key, value in settings.items():
        if key == "extra_special_tokens" and isinstance(value, Mapping):
            entries = list(value.items())
        elif isinstance(key, str) and key.endswith("_token"):
            entries = [(key, value)]
        else:
            continue
        for name, token in entries:
            if token is None:
                tokens.pop(name, None)
                continue
            text = _token_text(token)
            if text is not None:
                tokens[name] = text
            elif name in SPECIAL_TOKEN_NAMES:
                raise CheckpointError(f"{path}: {name} must be a string or a {{'content': ...}} token, got {_describe(token)}")


def read_special_tokens(folder: str | Path) -> dict[str, str]:
    """The special-token variables of the checkpoint in ``folder`` (name -> string), read from
    ``tokenizer_config.json`` and ``special_tokens_map.json`` as the module docstring says."""
    folder = Path(folder)
    config_path = folder / TOKENIZER_CONFIG_FILE
    config = _read_json_object(config_path)
    tokens: dict[str, str] = {}
    _collect_tokens(tokens, config, config_path)
    if "added_tokens_decoder" not in config:
        map_path = folder / SPECIAL_TOKENS_MAP_FILE
        _collect_tokens(tokens, _read_json_object(map_path), map_path)
    return tokens


def _config_templates(config: Mapping[str, Any], path: Path) -> dict[str, str]:
    value = config.get("chat_template")
    if value is None:
        return {}
    if isinstance(value, str):
        return {DEFAULT_TEMPLATE: value}
    if isinstance(value, Mapping):
        entries = list(value.items())
    elif isinstance(value, list):
        entries = []
        for index, entry in enumerate(value):
            if not (isinstance(entry, Mapping) and isinstance(entry.get("name"), str) and "template" in entry):
                raise CheckpointError(
                    f"{path}: chat_template[{index}] must be an object with a string 'name' and a 'template', "
                    f"got {_describe(entry)}"
                )
            entries.append((entry["name"], entry["template"]))
    else:
        raise CheckpointError(f"{path}: chat_template must be a string or a list of named templates, got {_describe(value)}")
    for name, source in entries:
        if not isinstance(source, str):
            raise CheckpointError(f"{path}: the chat template {name!r} must be a string, got {_describe(source)}")
    return dict(entries)


def _override_source(override: str | Path) -> tuple[str, str]:
    """The source of an ``override`` and a description of where it came from."""
    if isinstance(override, Path):
        if not override.is_file():
            raise ConfigError(f"the chat template file {override} does not exist")
        return _read_text(override, ConfigError), str(override)
    if not isinstance(override, str):
        raise ConfigError(f"the chat template override must be a path or Jinja source, got {_describe(override)}")
    try:
        is_file = Path(override).is_file()
    except (OSError, ValueError):  # too long for a file name, or holds a NUL
        is_file = False
    if is_file:
        return _read_text(Path(override), ConfigError), override
    if not any(character in override for character in _TEMPLATE_CHARACTERS):
        raise ConfigError(f"the chat template override {override!r} is neither an existing file nor Jinja source")
    return override, "the chat template given as an override"


# ----------------------------------------------------------------------------- the template


class ChatTemplate:
    """A checkpoint's chat template and the special-token strings it writes.

    ``source`` is the template (Jinja source), or named templates (name -> source) of which one
    is named ``"default"``; ``special_tokens`` maps variable names such as ``"bos_token"`` to
    their strings. ``origin`` says where the template came from, for error messages: one
    description, or one per template name. Every template is compiled at once; a syntax error
    raises :class:`~metrale.errors.CheckpointError`. Usually built by :meth:`from_checkpoint`.
    """

    def __init__(
        self,
        source: str | Mapping[str, str],
        special_tokens: Mapping[str, str] | None = None,
        *,
        origin: str | Mapping[str, str] = "the chat template",
    ):
        if not isinstance(source, (str, Mapping)):
            raise CheckpointError(f"a chat template must be Jinja source or named sources, got {_describe(source)}")
        templates = {DEFAULT_TEMPLATE: source} if isinstance(source, str) else dict(source)
        origins = {name: origin if isinstance(origin, str) else origin.get(name, "the chat template") for name in templates}
        where = origin if isinstance(origin, str) else ", ".join(sorted(set(origin.values())))
        if DEFAULT_TEMPLATE not in templates:
            raise CheckpointError(f"{where} has chat templates named {sorted(templates)} but none named {DEFAULT_TEMPLATE!r}")
        tokens = dict(special_tokens or {})
        for name, token in tokens.items():
            if not isinstance(name, str) or not isinstance(token, str):
                raise CheckpointError(f"{where}: the special token {name!r} must be a string, got {_describe(token)}")
        environment = _environment()
        compiled = {}
        for name, text in templates.items():
            if not isinstance(text, str):
                raise CheckpointError(f"{origins[name]}: the chat template {name!r} must be a string, got {_describe(text)}")
            try:
                compiled[name] = environment.from_string(text)
            except jinja2.TemplateSyntaxError as error:
                label = "" if len(templates) == 1 else f" (template {name!r})"
                raise CheckpointError(
                    f"{origins[name]}{label} is not a valid Jinja template: {error.message} (line {error.lineno})"
                ) from error
            except jinja2.TemplateError as error:
                raise CheckpointError(f"{origins[name]} is not a valid Jinja template: {error}") from error
        #: Every template by name; ``"default"`` is always there.
        self.templates: dict[str, str] = templates
        #: The special-token variables (name -> string) passed to the template.
        self.special_tokens: dict[str, str] = tokens
        #: Where the template came from (a path, or a description), as error messages name it.
        self.origin: str = where
        self._compiled = compiled

    @property
    def source(self) -> str:
        """The Jinja source of the default template."""
        return self.templates[DEFAULT_TEMPLATE]

    @property
    def bos_token(self) -> str | None:
        """The beginning-of-sequence token string, or None when the checkpoint names none."""
        return self.special_tokens.get("bos_token")

    @property
    def eos_token(self) -> str | None:
        """The end-of-sequence token string, or None when the checkpoint names none."""
        return self.special_tokens.get("eos_token")

    def __repr__(self) -> str:
        return f"ChatTemplate(origin={self.origin!r}, templates={sorted(self.templates)}, special_tokens={self.special_tokens!r})"

    @classmethod
    def from_checkpoint(cls, folder: str | Path, override: str | Path | None = None) -> ChatTemplate | None:
        """The chat template of the checkpoint in ``folder``, or None when it has none.

        ``override`` replaces the checkpoint's template: the path of a template file, or the
        template's source. The special tokens always come from the checkpoint. Raises
        :class:`~metrale.errors.CheckpointError` for unreadable or malformed files and templates
        with a syntax error, :class:`~metrale.errors.ConfigError` for an ``override`` that is
        neither an existing file nor template source.
        """
        folder = Path(folder)
        if not folder.is_dir():
            raise CheckpointError(f"{folder} is not a checkpoint folder")
        tokens = read_special_tokens(folder)
        if override is not None:
            source, origin = _override_source(override)
            return cls(source, tokens, origin=origin)
        files = {}
        if (folder / TEMPLATE_FILE).is_file():
            files[DEFAULT_TEMPLATE] = folder / TEMPLATE_FILE
        if (folder / TEMPLATE_DIR).is_dir():
            for path in sorted((folder / TEMPLATE_DIR).glob("*.jinja")):
                files[path.name.removesuffix(".jinja")] = path
        if files:
            templates = {name: _read_text(path, CheckpointError) for name, path in files.items()}
            return cls(templates, tokens, origin={name: str(path) for name, path in files.items()})
        config_path = folder / TOKENIZER_CONFIG_FILE
        templates = _config_templates(_read_json_object(config_path), config_path)
        if not templates:
            return None
        return cls(templates, tokens, origin=f"{config_path} (chat_template)")

    def render(
        self,
        messages: list[dict[str, Any]],
        *,
        add_generation_prompt: bool = True,
        tools: list[dict[str, Any]] | None = None,
        documents: list[dict[str, Any]] | None = None,
        **extra: Any,
    ) -> str:
        """The prompt text of a conversation, as transformers'
        ``apply_chat_template(messages, tokenize=False, ...)`` renders it.

        ``add_generation_prompt`` appends the header of the assistant's reply (the prompt to
        generate from); ``tools`` (JSON schemas) and ``documents`` are passed to the template;
        ``extra`` keyword arguments become template variables too. Encode the result without
        adding special tokens (module docstring). Raises
        :class:`~metrale.errors.InvalidRequestError` for messages that break the module's rules
        and for anything that goes wrong while the template runs.
        """
        chat = check_messages(messages)
        add_generation_prompt = check_bool("add_generation_prompt", add_generation_prompt)
        tool_schemas = _check_dicts("tools", tools, "tool JSON schemas")
        document_list = _check_dicts("documents", documents, "documents")
        variables = {**self.special_tokens, **{name: _plain(value, name, set()) for name, value in extra.items()}}
        name = TOOL_USE_TEMPLATE if tools is not None and TOOL_USE_TEMPLATE in self._compiled else DEFAULT_TEMPLATE
        try:
            return self._compiled[name].render(
                messages=chat, tools=tool_schemas, documents=document_list, add_generation_prompt=add_generation_prompt,
                **variables,
            )
        except MetraleError:
            raise
        except jinja2.TemplateError as error:
            raise InvalidRequestError(f"the chat template of {self.origin} failed on these messages: {error}") from error
        except MemoryError:
            raise
        except Exception as error:  # the template's own Python errors: TypeError, OverflowError, ...
            raise InvalidRequestError(
                f"the chat template of {self.origin} failed on these messages: {type(error).__name__}: {error}"
            ) from error
