"""LoRA adapters in PEFT's format: what a request names, what an adapter holds, how it is read.

An adapter folder holds ``adapter_config.json`` and ``adapter_model.safetensors`` as PEFT's
``save_pretrained`` writes them. :func:`load_adapter` reads it against the projections a model
offers (``targets``: each projection's name inside a decoder layer and its ``(out, in)`` size)
and returns a :class:`LoraAdapter`:

* per layer and projection a :class:`LoraModule`: ``delta(x) = scale * (x A^T) B^T`` with
  ``A [r, in]``, ``B [out, r]``; ``r`` is the module's own rank (``rank_pattern`` where a key
  matches the module's name, else ``r``: the tensors must have that rank), ``scale`` its
  ``alpha / r``, or ``alpha / sqrt(r)`` with rsLoRA (``use_rslora``), ``alpha`` from
  ``alpha_pattern`` where a key matches the module's name, else ``lora_alpha``;
* per token matrix (``embed_tokens``, ``lm_head``) the rows it replaces (PEFT's trainable tokens,
  ``trainable_token_indices``): their indices and new values.

The config and the tensors must agree: ``target_modules`` (PEFT's rule: a list entry selects the
modules named it or ending in ``.`` and it, a string is a regular expression the whole module name
matches) must select a projection the model serves, must not name one it refuses, and must select
every module the tensors adapt.

Everything else is refused with :class:`~metrale.errors.AdapterError` before any of it is used:
another PEFT type, DoRA, LoRA biases, ``fan_in_fan_out``, LoRA on parameters (MoE experts),
``modules_to_save``, a tensor this reader does not place, a shape the base model does not have,
a rank other than the config's or above ``max_lora_rank``, a ``lora_alpha`` that is not a finite
positive number, a NaN or infinity in a tensor, token indices outside the vocabulary. An adapter
is never applied partly or to the wrong projection.
"""
from __future__ import annotations

import contextlib
import json
import math
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Collection, Mapping

import numpy as np

from metrale.errors import AdapterError, ConfigError

if TYPE_CHECKING:
    from metrale.loading.checkpoint import Checkpoint

ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"

#: The token matrices an adapter may replace rows of, by their name in PEFT's files.
TOKEN_MATRICES = {"embed_tokens": "model.embed_tokens", "lm_head": "lm_head"}

_PREFIX = "base_model.model."
_LAYER_KEY = re.compile(r"model\.layers\.(0|[1-9][0-9]*)\.(.+)\.lora_([AB])\.weight")
_TOKEN_KEY = re.compile(r"(.+)\.token_adapter\.trainable_tokens_delta")


@dataclass(frozen=True)
class LoRARequest:
    """The adapter a request runs with (vLLM's fields): ``lora_name`` names it (in outputs and
    the server's ``model`` field), ``lora_int_id`` (a positive integer) identifies it in the
    engine, ``lora_path`` is its folder."""

    lora_name: str
    lora_int_id: int
    lora_path: str | Path

    def __post_init__(self) -> None:
        if not isinstance(self.lora_name, str) or not self.lora_name:
            raise ConfigError(f"LoRARequest.lora_name must be a non-empty string, got {self.lora_name!r}")
        if isinstance(self.lora_int_id, bool) or not isinstance(self.lora_int_id, int) or self.lora_int_id < 1:
            raise ConfigError(f"LoRARequest.lora_int_id must be a positive integer, got {self.lora_int_id!r}")
        if not isinstance(self.lora_path, (str, Path)) or not str(self.lora_path):
            raise ConfigError(f"LoRARequest.lora_path must be a folder path, got {self.lora_path!r}")


@dataclass
class LoraModule:
    """One projection's update ``scale * (x A^T) B^T``: ``a [r, in]``, ``b [out, r]`` (float32)."""

    a: np.ndarray
    b: np.ndarray
    scale: float

    @property
    def rank(self) -> int:
        return int(self.a.shape[0])

    def delta(self, x: np.ndarray) -> np.ndarray:
        """The update of inputs ``x [N, in]``: ``[N, out]`` float32."""
        return (self.scale * ((np.asarray(x, dtype=np.float32) @ self.a.T) @ self.b.T)).astype(np.float32)


@dataclass
class LoraAdapter:
    """A loaded adapter: ``modules[(layer, projection)]``, ``token_rows[matrix] = (indices [n],
    rows [n, H])`` (see the module docstring); ``rank`` is the largest module rank;
    ``base_model_name_or_path`` the model it was trained on, as its config names it (None when
    it does not)."""

    name: str
    int_id: int
    path: Path
    modules: dict[tuple[int, str], LoraModule] = field(default_factory=dict)
    token_rows: dict[str, tuple[np.ndarray, np.ndarray]] = field(default_factory=dict)
    base_model_name_or_path: str | None = None

    @property
    def rank(self) -> int:
        return max((module.rank for module in self.modules.values()), default=0)


#: PEFT's ``target_modules`` shorthand for every linear layer but the output layer (the saved
#: config usually lists the modules it selected instead).
ALL_LINEAR = "all-linear"


def _pattern_match(patterns: Mapping[str, Any], name: str) -> tuple[str, Any] | None:
    """The first ``(key, value)`` of ``patterns`` whose key matches the end of module ``name``
    (PEFT's rule: the key, as a regular expression, after a dot or at the start), or None."""
    for key, value in patterns.items():
        if re.fullmatch(rf"(.*\.)?(?:{key})", name):
            return key, value
    return None


def _pattern_value(patterns: Mapping[str, Any], name: str) -> Any:
    """The value of :func:`_pattern_match`, or None."""
    match = _pattern_match(patterns, name)
    return None if match is None else match[1]


def _is_positive_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value > 0


def _is_finite_positive(value: Any) -> bool:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return False
    try:
        number = float(value)
    except OverflowError:  # an int no float holds
        return False
    return math.isfinite(number) and number > 0


def _check_regex(pattern: str, label: str) -> None:
    try:
        re.compile(pattern)
    except re.error as error:
        raise AdapterError(f"{label} is not a regular expression ({error})") from None


def _read_config(folder: Path) -> dict[str, Any]:
    path = folder / ADAPTER_CONFIG
    try:
        if not folder.is_dir():
            what = "not a folder" if folder.exists() else "no such folder"
            raise AdapterError(f"{folder}: {what} (an adapter is a PEFT folder holding {ADAPTER_CONFIG} and "
                               f"{ADAPTER_WEIGHTS})")
        found = path.is_file()
    except OSError as error:  # a folder this process may not look into, say
        raise AdapterError(f"{folder}: cannot be read ({error.strerror or error})") from None
    if not found:
        raise AdapterError(f"{folder}: no {ADAPTER_CONFIG} (a PEFT adapter folder holds {ADAPTER_CONFIG} and "
                           f"{ADAPTER_WEIGHTS})")
    try:
        config = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as error:
        raise AdapterError(f"{path}: not readable JSON ({error})") from None
    if not isinstance(config, dict):
        raise AdapterError(f"{path}: not a JSON object")
    refusals = [
        (config.get("peft_type", "LORA") != "LORA", f"peft_type {config.get('peft_type')!r}: only LORA adapters are served"),
        (bool(config.get("use_dora")), "use_dora: DoRA adapters are not served"),
        (config.get("bias", "none") != "none" or bool(config.get("lora_bias")),
         "LoRA biases are not served (bias must be 'none')"),
        (bool(config.get("fan_in_fan_out")), "fan_in_fan_out adapters (Conv1D layers) are not served"),
        (bool(config.get("target_parameters")), "LoRA on parameters (target_parameters, such as MoE experts) is not served"),
        (bool(config.get("modules_to_save")), "modules_to_save is not served (trainable_token_indices replaces token rows)"),
        (bool(config.get("layer_replication")), "layer_replication is not served"),
    ]
    for refused, why in refusals:
        if refused:
            raise AdapterError(f"{path}: {why}")
    _check_ranks_and_alphas(config, path)
    _check_module_fields(config, path)
    return config


def _check_ranks_and_alphas(config: Mapping[str, Any], path: Path) -> None:
    """``r`` and the values of ``rank_pattern`` positive integers, ``lora_alpha`` and the values
    of ``alpha_pattern`` finite positive numbers (a NaN or infinite alpha would scale every update
    into NaN), the patterns' keys regular expressions."""
    if not _is_positive_int(config.get("r")):
        raise AdapterError(f"{path}: r must be a positive integer, got {config.get('r')!r}")
    if not _is_finite_positive(config.get("lora_alpha")):
        raise AdapterError(f"{path}: lora_alpha must be a finite positive number, got {config.get('lora_alpha')!r}")
    for key, valid, what in (("rank_pattern", _is_positive_int, "a positive integer"),
                             ("alpha_pattern", _is_finite_positive, "a finite positive number")):
        patterns = config.get(key) or {}
        if not isinstance(patterns, dict):
            raise AdapterError(f"{path}: {key} must be an object, got {patterns!r}")
        for pattern, value in patterns.items():
            _check_regex(rf"(.*\.)?(?:{pattern})", f"{path}: {key} key {pattern!r}")
            if not valid(value):
                raise AdapterError(f"{path}: {key}[{pattern!r}] must be {what}, got {value!r}")


def _check_module_fields(config: Mapping[str, Any], path: Path) -> None:
    """``target_modules`` and ``exclude_modules`` each absent, a list of module names or a
    regular expression; ``base_model_name_or_path`` absent or a string."""
    for key in ("target_modules", "exclude_modules"):
        value = config.get(key)
        if isinstance(value, str):
            _check_regex(value, f"{path}: {key} {value!r}")
        elif value is not None and not (isinstance(value, list) and all(isinstance(v, str) for v in value)):
            raise AdapterError(f"{path}: {key} must be a list of module names or a regular expression, got {value!r}")
    base = config.get("base_model_name_or_path")
    if base is not None and not isinstance(base, str):
        raise AdapterError(f"{path}: base_model_name_or_path must be a string, got {base!r}")


def _token_indices(config: Mapping[str, Any], path: Path) -> dict[str, list[int]]:
    """``trainable_token_indices`` as ``{matrix: indices}`` (a list means ``embed_tokens``)."""
    value = config.get("trainable_token_indices")
    if value is None:
        return {}
    if isinstance(value, list):
        value = {"embed_tokens": value}
    if not isinstance(value, dict):
        raise AdapterError(f"{path}: trainable_token_indices must be a list or an object, got {value!r}")
    out = {}
    for matrix, indices in value.items():
        if matrix not in TOKEN_MATRICES:
            raise AdapterError(f"{path}: trainable tokens on {matrix!r} are not served (only on {sorted(TOKEN_MATRICES)})")
        if not isinstance(indices, list) or not all(isinstance(i, int) and not isinstance(i, bool) for i in indices):
            raise AdapterError(f"{path}: trainable_token_indices[{matrix!r}] must be a list of token ids")
        out[matrix] = indices
    return out


def _selects(selection: str | list[str] | None, name: str) -> bool:
    """Whether a ``target_modules`` or ``exclude_modules`` value selects the module ``name``
    (PEFT's rule: a string is a regular expression the whole name matches, :data:`ALL_LINEAR`
    every projection; a list entry is the name or its end after a dot)."""
    if selection is None:
        return False
    if isinstance(selection, str):
        return selection == ALL_LINEAR or re.fullmatch(selection, name) is not None
    return any(name == entry or name.endswith("." + entry) for entry in selection)


def _refuse_token_matrix_targets(targets: str | list[str], path: Path) -> None:
    """LoRA on the embedding or the LM head is not served (trainable tokens replace their rows)."""
    if targets == ALL_LINEAR:  # PEFT leaves the output layer out; the embedding is no linear layer
        return
    for matrix, name in TOKEN_MATRICES.items():
        if _selects(targets, name):
            raise AdapterError(f"{path}: target_modules {targets!r} selects {name}: LoRA on {matrix} is not served "
                               "(trainable_token_indices replaces rows of it)")


def _refuse_refused_targets(targets: str | list[str], path: Path, served: Collection[tuple[int, str]],
                            refused: Mapping[str, str]) -> None:
    """Refuse a list entry that names a projection the model refuses LoRA on, with the reason,
    even when the tensors leave it out (the config would then promise an update that never
    happens). An entry names a projection by its full name, its name inside a layer, or its end
    after one of the blocks the served projections sit in (``kv_b_proj``: ``self_attn.kv_b_proj``).
    A regular expression cannot be checked this way: the tensors it produced are."""
    if not refused or not isinstance(targets, list):
        return
    blocks = {".".join(parts[:end]) for parts in (name.split(".") for _, name in served) for end in range(1, len(parts))}
    for entry in targets:
        inside = re.fullmatch(r"(?:.*\.)?layers\.[0-9]+\.(.+)", entry)
        candidates = [inside.group(1)] if inside else [entry] + sorted(f"{block}.{entry}" for block in blocks)
        for candidate in candidates:
            reason = _pattern_value(refused, candidate)
            if reason is not None:
                raise AdapterError(f"{path}: target_modules entry {entry!r} selects {candidate}, which this model "
                                   f"does not serve LoRA on: {reason}")


def _check_targets(config: Mapping[str, Any], path: Path, adapted: Collection[tuple[int, str]],
                   served: Collection[tuple[int, str]], refused: Mapping[str, str]) -> None:
    """``target_modules`` (less ``exclude_modules``) against the model's ``served`` projections
    (``(layer, name)``) and the ``adapted`` ones the tensors hold (see the module docstring).
    Without ``target_modules`` there is nothing to compare: the tensors say what is adapted."""
    targets, excluded = config.get("target_modules"), config.get("exclude_modules")
    if targets is None:
        return

    def chosen(layer: int, name: str) -> bool:
        full = f"model.layers.{layer}.{name}"
        return _selects(targets, full) and not _selects(excluded, full)

    selection = f"target_modules {targets!r}" + (f" less exclude_modules {excluded!r}" if excluded else "")
    _refuse_token_matrix_targets(targets, path)
    _refuse_refused_targets(targets, path, served, refused)
    if targets and not any(chosen(layer, name) for layer, name in served):
        raise AdapterError(f"{path}: {selection} matches no module of the base model that LoRA is served on "
                           f"({', '.join(sorted({name for _, name in served}))})")
    for layer, name in sorted(adapted):
        if not chosen(layer, name):
            raise AdapterError(f"{path}: the tensors adapt model.layers.{layer}.{name}, which {selection} does not "
                               "select")


def _float_tensor(value: np.ndarray, key: str, weights_path: Path) -> np.ndarray:
    """``value`` as float32, refused when it holds a NaN or an infinity (one would turn every
    output of the adapter's requests into NaN)."""
    with np.errstate(over="ignore"):  # a value float32 cannot hold becomes inf, refused below
        array = np.asarray(value, dtype=np.float32)
    finite = np.isfinite(array)
    if not finite.all():
        first = tuple(int(i) for i in np.unravel_index(int(np.argmin(finite)), array.shape))
        raise AdapterError(f"{weights_path}: tensor {key!r} holds {int(finite.size - np.count_nonzero(finite))} NaN or "
                           f"infinite values (the first at index {first})")
    return array


def _configured_rank(config: Mapping[str, Any], name: str) -> tuple[int, str]:
    """The rank module ``name`` has by the config, and the field that says it (PEFT's rule:
    the first ``rank_pattern`` key matching the name, else ``r``)."""
    match = _pattern_match(config.get("rank_pattern") or {}, name)
    return (int(config["r"]), "r") if match is None else (int(match[1]), f"rank_pattern[{match[0]!r}]")


def _lora_module(config: Mapping[str, Any], where: str, name: str, a: np.ndarray, b: np.ndarray,
                 shape: tuple[int, int], max_lora_rank: int) -> LoraModule:
    """The module of ``lora_A`` ``a`` and ``lora_B`` ``b`` for a projection of ``shape`` ``(out,
    in)`` named ``name`` (``model.layers.<i>.<projection>``), checked against the config."""
    out_features, in_features = shape
    if a.ndim != 2 or b.ndim != 2 or a.shape[1] != in_features or b.shape[0] != out_features or b.shape[1] != a.shape[0]:
        raise AdapterError(f"{where}: lora_A {list(a.shape)} and lora_B {list(b.shape)} do not fit a projection of "
                           f"{in_features} -> {out_features} (an adapter for another base model?)")
    rank, source = _configured_rank(config, name)
    if rank > max_lora_rank:
        raise AdapterError(f"{where}: rank {rank} is above max_lora_rank={max_lora_rank} ({source} in {ADAPTER_CONFIG})")
    if a.shape[0] > max_lora_rank:
        raise AdapterError(f"{where}: rank {a.shape[0]} is above max_lora_rank={max_lora_rank} (lora_A and lora_B)")
    if a.shape[0] != rank:
        raise AdapterError(f"{where}: {source} is {rank} in {ADAPTER_CONFIG}, but lora_A and lora_B have rank "
                           f"{a.shape[0]}")
    alpha = _pattern_value(config.get("alpha_pattern") or {}, name)
    alpha = float(config["lora_alpha"] if alpha is None else alpha)
    scale = alpha / math.sqrt(rank) if config.get("use_rslora") else alpha / rank
    return LoraModule(a, b, scale)


def load_adapter(request: LoRARequest, targets: Mapping[str, tuple[int, int]], *, num_layers: int, vocab_size: int,
                 hidden_size: int, max_lora_rank: int, refused: Mapping[str, str] | None = None,
                 served: Collection[tuple[int, str]] | None = None) -> LoraAdapter:
    """Read ``request``'s adapter for a model of ``num_layers`` decoder layers whose layers offer
    ``targets`` (``{"self_attn.q_proj": (out, in), ...}``); ``refused`` names projections the model
    does not serve LoRA on, with the reason; ``served`` lists the ``(layer, projection)`` pairs it
    serves (every layer's ``targets`` when None). See the module docstring. Raises
    :class:`~metrale.errors.AdapterError` naming what does not fit."""
    from safetensors.numpy import load_file

    folder = Path(request.lora_path)
    config = _read_config(folder)
    weights_path = folder / ADAPTER_WEIGHTS
    try:
        found = weights_path.is_file()
    except OSError as error:
        raise AdapterError(f"{weights_path}: cannot be read ({error.strerror or error})") from None
    if not found:
        raise AdapterError(f"{folder}: no {ADAPTER_WEIGHTS}")
    try:
        tensors = load_file(str(weights_path))
    except Exception as error:  # a torn or foreign file: safetensors raises several types
        raise AdapterError(f"{weights_path}: not a safetensors file ({error})") from None
    adapter = LoraAdapter(request.lora_name, request.lora_int_id, folder,
                          base_model_name_or_path=config.get("base_model_name_or_path") or None)
    halves: dict[tuple[int, str], dict[str, np.ndarray]] = {}
    token_tensors: dict[str, np.ndarray] = {}
    for key, value in tensors.items():
        name = key.removeprefix(_PREFIX)
        layer_match, token_match = _LAYER_KEY.fullmatch(name), _TOKEN_KEY.fullmatch(name)
        if layer_match:
            layer, projection, half = int(layer_match.group(1)), layer_match.group(2), layer_match.group(3)
            if layer >= num_layers:
                raise AdapterError(f"{weights_path}: {key} is for layer {layer}; the base model has {num_layers} layers")
            reason = _pattern_value(refused or {}, projection)
            if reason is not None:
                raise AdapterError(f"{weights_path}: LoRA on {projection!r} is not served: {reason}")
            if projection not in targets:
                raise AdapterError(f"{weights_path}: LoRA on {projection!r} is not served for this model (it serves "
                                   f"{', '.join(sorted(targets))})")
            halves.setdefault((layer, projection), {})[half] = _float_tensor(value, key, weights_path)
        elif token_match and token_match.group(1) in TOKEN_MATRICES.values():
            matrix = next(k for k, v in TOKEN_MATRICES.items() if v == token_match.group(1))
            token_tensors[matrix] = _float_tensor(value, key, weights_path)
        else:
            raise AdapterError(f"{weights_path}: tensor {key!r} is not a LoRA or trainable-token tensor this engine "
                               "places")
    for (layer, projection), pair in sorted(halves.items()):
        where = f"{weights_path}: layer {layer} {projection}"
        if set(pair) != {"A", "B"}:
            raise AdapterError(f"{where}: lora_A and lora_B must both be present")
        adapter.modules[(layer, projection)] = _lora_module(config, where, f"model.layers.{layer}.{projection}",
                                                            pair["A"], pair["B"], targets[projection], max_lora_rank)
    if served is None:
        served = [(layer, name) for layer in range(num_layers) for name in targets]
    _check_targets(config, folder / ADAPTER_CONFIG, adapter.modules, served, refused or {})
    indices = _token_indices(config, folder / ADAPTER_CONFIG)
    if set(indices) != set(token_tensors):
        raise AdapterError(f"{folder}: trainable tokens configured for {sorted(indices)} but stored for "
                           f"{sorted(token_tensors)}")
    for matrix, ids in indices.items():
        rows = token_tensors[matrix]
        if rows.shape != (len(ids), hidden_size):
            raise AdapterError(f"{weights_path}: {matrix} trainable tokens have shape {list(rows.shape)}, expected "
                               f"{[len(ids), hidden_size]}")
        if any(not 0 <= i < vocab_size for i in ids) or len(set(ids)) != len(ids):
            raise AdapterError(f"{folder}: {matrix} trainable token ids must be distinct and below the vocabulary "
                               f"size {vocab_size}")
        adapter.token_rows[matrix] = (np.asarray(ids, dtype=np.int64), rows)
    if not adapter.modules and not adapter.token_rows:
        raise AdapterError(f"{folder}: the adapter holds no LoRA module and no trainable tokens")
    return adapter


def served_model_names(checkpoint: "Checkpoint") -> set[str]:
    """The names the model of ``checkpoint`` goes by: its folder (as given and resolved), the Hub
    name of the Hugging Face cache folder it sits in (``models--org--name``), and its
    ``config.json``'s ``_name_or_path`` (what it was saved from, when recorded)."""
    folder = Path(checkpoint.path)
    resolved = folder.resolve()
    names = {str(folder), str(resolved)}
    names.update(part.removeprefix("models--").replace("--", "/") for part in resolved.parts
                 if part.startswith("models--"))
    recorded = checkpoint.config.get("_name_or_path")
    if isinstance(recorded, str) and recorded:
        names.add(recorded)
    return names


def _last_component(name: str) -> str:
    return name.replace("\\", "/").rstrip("/").rsplit("/", 1)[-1].lower()


def names_the_served_model(name: str, served_names: Collection[str]) -> bool:
    """Whether ``name`` (an adapter's ``base_model_name_or_path``: a Hub name or a folder) names
    one of ``served_names`` (:func:`served_model_names`): the same string, the same folder, or
    the same last path component whatever the case (``meta-llama/Llama-3.1-8B`` and
    ``/models/Llama-3.1-8B``: a model copied or downloaded elsewhere keeps its name)."""
    if name in served_names:
        return True
    with contextlib.suppress(OSError, ValueError):  # a Hub name or a string no path can be
        if str(Path(name).expanduser().resolve()) in served_names:
            return True
    return _last_component(name) in {_last_component(served) for served in served_names}
