"""Real ``config.json`` files of widely served Hub checkpoints (tests/data/hub_configs, their
provenance in SOURCES.md), each checked two ways:

* the family that :func:`metrale.model.family.resolve_family` picks reads the file as it is, and
  a file no family serves is refused with :class:`~metrale.errors.UnsupportedModelError`;
* a shrunk copy -- the same file with the layer count cut to the fewest layers that still hold
  every layer kind (sliding and full attention, dense and sparse MLP, Gated DeltaNet and
  attention; two at least, so that one layer feeds another) and the widths made small, every
  other field kept -- gets random weights from transformers, and metrale's logits on the CPU
  match transformers' within 1e-4 relative, on a prompt of :data:`PROMPT_LENGTH` tokens;
* a shrunk copy with one kept feature changed no longer matches: the comparison sees the
  features (:data:`SENSITIVITY`).

The real weights of these checkpoints are not run here; ``tools/checkpoints/check_hub_configs.py``
runs the files at their real widths (layer count cut) outside CI.

What a shrunk copy changes, and nothing else:

* ``num_hidden_layers`` (and a ``layer_types`` list, cut to it);
* widths: hidden size, MLP and expert sizes, head counts (the query heads per key-value head
  kept), head sizes, latent ranks, Gated DeltaNet heads, expert counts (the experts per token
  kept) and the vocabulary, token ids moved inside the smaller vocabulary;
* sliding windows in use, cut to :data:`WINDOW` tokens so that the prompt spans several windows;
* LongRoPE's ``original_max_position_embeddings`` (and ``max_position_embeddings``, the ratio
  of the two kept) cut to :data:`LONGROPE_CONTEXT`, so that both factor tables are reached;
* ``quantization_config`` is dropped: the random weights are float32.

Fields the file leaves out stay out, so the families' defaults are exercised as well. The
Gemma-3 checkpoints on the Hub (``Gemma3ForConditionalGeneration``) are multimodal: metrale refuses
the whole file and serves its ``text_config`` (``gemma3_text``) as a ``Gemma3ForCausalLM``.
"""

from __future__ import annotations

import copy
import json
import math
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from metrale import LLM
from metrale.errors import UnsupportedModelError
from metrale.model.family import resolve_family
from metrale.model.plugin_manager import get_plugin_manager
from metrale.testing import max_relative_error

HUB_CONFIGS = Path(__file__).resolve().parents[1] / "data" / "hub_configs"
TOLERANCE = 1e-4
#: Widths of a shrunk copy.
VOCAB = 256
HIDDEN = 64
HEAD_DIM = 16
MOE_INTERMEDIATE = 32
SHARED_EXPERT_INTERMEDIATE = 48
#: Sliding windows in use are cut to this many tokens; prompts are :data:`PROMPT_LENGTH` long.
WINDOW = 8
PROMPT_LENGTH = 40
#: LongRoPE's pretraining context in a shrunk copy.
LONGROPE_CONTEXT = 32
#: Model types whose norms compute ``1 + w`` (their weights are perturbed around 0).
ZERO_CENTRED_NORMS = ("gemma2", "gemma3_text", "qwen3_next")
#: Multimodal wrappers whose ``text_config`` a family serves, by ``model_type``, with the
#: architecture that serves the text model alone.
TEXT_CONFIG_ARCHITECTURES = {"gemma3": "Gemma3ForCausalLM"}


def hub_config_files() -> list[Path]:
    return sorted(HUB_CONFIGS.glob("*.json"))


def load_hub_config(name: str) -> dict[str, Any]:
    return json.loads((HUB_CONFIGS / f"{name}.json").read_text())


def text_model_config(config: dict[str, Any]) -> dict[str, Any] | None:
    """The text model of a multimodal wrapper as a causal-LM ``config.json`` (None for a plain
    causal LM)."""
    architecture = TEXT_CONFIG_ARCHITECTURES.get(config.get("model_type"))
    if architecture is None or "text_config" not in config:
        return None
    return {"architectures": [architecture], **config["text_config"]}


def served_configs() -> list[tuple[str, dict[str, Any]]]:
    """(case name, config) of every causal LM in the vendored files: the files themselves and the
    text models of multimodal wrappers (named ``<file>:text_config``)."""
    cases = []
    for path in hub_config_files():
        config = json.loads(path.read_text())
        text = text_model_config(config)
        if text is not None:
            cases.append((f"{path.stem}:text_config", text))
        else:
            cases.append((path.stem, config))
    return cases


# ----------------------------------------------------------------------------------- layer kinds


def attention_kind(config: dict[str, Any], layer: int) -> str:
    """How layer ``layer`` attends, as transformers builds it from ``config``."""
    model_type = config["model_type"]
    if config.get("layer_types"):
        return config["layer_types"][layer]
    if model_type == "qwen3_next":
        return "full_attention" if (layer + 1) % config.get("full_attention_interval", 4) == 0 else "linear_attention"
    if model_type in ("gemma2", "gemma3_text"):
        pattern = config.get("sliding_window_pattern", 2 if model_type == "gemma2" else 6)
        return "full_attention" if (layer + 1) % pattern == 0 else "sliding_attention"
    if model_type in ("qwen2", "qwen3", "qwen2_moe", "qwen3_moe"):
        sliding = config.get("use_sliding_window") and config.get("sliding_window") is not None
        return "sliding_attention" if sliding and layer >= config.get("max_window_layers", 0) else "full_attention"
    if model_type in ("mistral", "mixtral", "phi3") and config.get("sliding_window") is not None:
        return "sliding_attention"
    return "full_attention"


def mlp_kind(config: dict[str, Any], layer: int) -> str:
    """Whether layer ``layer``'s MLP is a dense one or a mixture of experts."""
    model_type = config["model_type"]
    if model_type in ("qwen2_moe", "qwen3_moe", "qwen3_next"):
        sparse = (layer not in config.get("mlp_only_layers", []) and config.get("num_experts", 0) > 0
                  and (layer + 1) % config.get("decoder_sparse_step", 1) == 0)
        return "sparse" if sparse else "dense"
    if model_type in ("deepseek_v2", "deepseek_v3"):
        sparse = (config.get("n_routed_experts") and layer >= config.get("first_k_dense_replace", 0)
                  and layer % config.get("moe_layer_freq", 1) == 0)
        return "sparse" if sparse else "dense"
    if model_type in ("mixtral", "gpt_oss"):
        return "sparse"
    return "dense"


def layer_kinds(config: dict[str, Any], layers: int) -> list[tuple[str, str]]:
    return [(attention_kind(config, layer), mlp_kind(config, layer)) for layer in range(layers)]


def fewest_layers(config: dict[str, Any], minimum: int = 1) -> int:
    """The fewest leading layers (at least ``minimum``) that hold every layer kind of ``config``."""
    total = config["num_hidden_layers"]
    every = set(layer_kinds(config, total))
    for count in range(min(minimum, total), total + 1):
        if set(layer_kinds(config, count)) == every:
            return count
    return total


def cut_layers(config: dict[str, Any], minimum: int = 1) -> dict[str, Any]:
    """``config`` with its layer count cut to :func:`fewest_layers` (its ``layer_types`` with it)."""
    cut = copy.deepcopy(config)
    count = fewest_layers(config, minimum)
    cut["num_hidden_layers"] = count
    if cut.get("layer_types"):
        cut["layer_types"] = cut["layer_types"][:count]
    if cut.get("mlp_only_layers"):
        cut["mlp_only_layers"] = [layer for layer in cut["mlp_only_layers"] if layer < count]
    return cut


def without_quantization(config: dict[str, Any]) -> dict[str, Any]:
    """``config`` without ``quantization_config``: its random weights are float32."""
    return {key: value for key, value in config.items() if key != "quantization_config"}


# ------------------------------------------------------------------------------------- widths


def uses_sliding_window(config: dict[str, Any]) -> bool:
    """Whether some layer slides over a window shorter than the model's context (a window past
    ``max_position_embeddings``, such as Phi-3.5's 262144, never takes effect)."""
    window = config.get("sliding_window")
    context = config.get("max_position_embeddings")
    if window is None or (context is not None and window >= context):
        return False
    layers = config["num_hidden_layers"]
    return any(attention_kind(config, layer) == "sliding_attention" for layer in range(layers))


def is_longrope(config: dict[str, Any]) -> bool:
    scaling = config.get("rope_scaling") or config.get("rope_parameters") or {}
    return (scaling.get("rope_type") or scaling.get("type")) == "longrope"


def shrink_token_ids(config: dict[str, Any], vocab: int) -> None:
    """Move token ids (``*_token_id(s)``, ``*_token_index``) inside a vocabulary of ``vocab``."""
    for key, value in config.items():
        if key.endswith(("_token_id", "_token_ids", "_token_index")) and value is not None:
            config[key] = [v % vocab for v in value] if isinstance(value, list) else value % vocab


def shrink_widths(config: dict[str, Any]) -> dict[str, Any]:
    """``config`` at small widths, every feature kept (module docstring). Only fields the file
    sets are changed, so left-out fields keep their defaults."""
    small = copy.deepcopy(config)

    def scale(key: str, value: int) -> None:
        if key in small and small[key] is not None:
            small[key] = value

    heads = config.get("num_attention_heads")
    kv_heads = config.get("num_key_value_heads") or heads
    if heads is not None:
        group = heads // kv_heads
        small_kv = min(kv_heads, 2)
        scale("num_attention_heads", small_kv * group)
        scale("num_key_value_heads", small_kv)
        small_heads = small_kv * group
        if is_longrope(config):
            # LongRoPE's factors are one per rotary frequency: the head size stays.
            head_dim = config["hidden_size"] // heads
            small["hidden_size"] = small_heads * head_dim
        elif "head_dim" in config:
            small["head_dim"] = HEAD_DIM
            small["hidden_size"] = HIDDEN
        else:
            small["hidden_size"] = max(HIDDEN, small_heads * HEAD_DIM)
    elif "hidden_size" in small:
        small["hidden_size"] = HIDDEN
        small["head_dim"] = HEAD_DIM
    hidden = small.get("hidden_size", HIDDEN)
    if "query_pre_attn_scalar" in config and "head_dim" in config:
        small["query_pre_attn_scalar"] = config["query_pre_attn_scalar"] * small["head_dim"] // config["head_dim"]
    scale("intermediate_size", 3 * hidden // 2)
    scale("moe_intermediate_size", MOE_INTERMEDIATE)
    scale("shared_expert_intermediate_size", SHARED_EXPERT_INTERMEDIATE)
    top_k = config.get("num_experts_per_tok") or config.get("experts_per_token") or 2
    for key in ("num_experts", "num_local_experts", "n_routed_experts"):
        if config.get(key):
            experts = max(2 * top_k, 8)
            if key == "n_routed_experts" and config.get("n_group"):
                experts = config["n_group"] * max(4, math.ceil(2 * top_k / config["n_group"]))
            small[key] = min(config[key], experts)
    # Multi-head latent attention and Gated DeltaNet.
    scale("kv_lora_rank", 32)
    scale("q_lora_rank", 48)
    scale("qk_nope_head_dim", HEAD_DIM)
    scale("qk_rope_head_dim", 8)
    scale("v_head_dim", HEAD_DIM)
    if "linear_num_key_heads" in config:
        ratio = config["linear_num_value_heads"] // config["linear_num_key_heads"]
        small["linear_num_key_heads"] = 2
        small["linear_num_value_heads"] = 2 * ratio
        small["linear_key_head_dim"] = HEAD_DIM
        small["linear_value_head_dim"] = HEAD_DIM
    if "vocab_size" in config:
        small["vocab_size"] = VOCAB
        shrink_token_ids(small, VOCAB)
    if uses_sliding_window(config):
        for key in ("sliding_window", "sliding_window_size"):
            if small.get(key) is not None:
                small[key] = min(small[key], WINDOW)
    if is_longrope(config):
        ratio = config["max_position_embeddings"] // config["original_max_position_embeddings"]
        small["original_max_position_embeddings"] = LONGROPE_CONTEXT
        small["max_position_embeddings"] = LONGROPE_CONTEXT * ratio
    return small


def shrunk_copy(config: dict[str, Any]) -> dict[str, Any]:
    """The shrunk copy of ``config`` (module docstring), two layers at least."""
    return shrink_widths(without_quantization(cut_layers(config, minimum=2)))


# ------------------------------------------------------------------------------ checkpoints


def write_hf_checkpoint(config: dict[str, Any], folder: Path, seed: int) -> Path:
    """Random weights for ``config`` written by transformers (:func:`metrale.testing.hf.build_hf_checkpoint`),
    ``config.json`` then replaced by ``config`` itself, so that metrale and transformers read the
    fields as the Hub file spells them. A router bias (a buffer, which the perturbation skips) is
    set to noise as well."""
    import torch
    import transformers
    from safetensors.torch import load_file, save_file

    from metrale.testing.hf import build_hf_checkpoint

    fields = {key: value for key, value in config.items() if key not in ("architectures", "model_type")}
    hf_config = transformers.AutoConfig.for_model(config["model_type"], **fields)
    model_class = getattr(transformers, config["architectures"][0])
    build_hf_checkpoint(model_class, hf_config, folder, seed=seed,
                        zero_centred_norms=config["model_type"] in ZERO_CENTRED_NORMS)
    (folder / "config.json").write_text(json.dumps(config, indent=2))
    weights = folder / "model.safetensors"
    tensors = load_file(weights)
    biases = [name for name in tensors if name.endswith("e_score_correction_bias")]
    if biases:
        generator = torch.Generator().manual_seed(seed + 1)
        for name in biases:
            tensors[name] = 0.5 * torch.randn(tensors[name].shape, generator=generator)
        save_file(tensors, weights, metadata={"format": "pt"})
    return folder


def prompt(length: int, vocab: int, seed: int) -> list[int]:
    return np.random.default_rng(seed).integers(0, vocab, length).tolist()


def compare_with_transformers(folder: Path, token_ids: list[int], **options: Any) -> float:
    """The largest relative error of metrale's CPU logits against transformers' (float32)."""
    from metrale.testing.hf import hf_reference_logits

    with LLM(str(folder), device="cpu", show_progress=False, **options) as llm:
        ours = llm.score(token_ids)
    return max_relative_error(ours, hf_reference_logits(folder, token_ids))


# ------------------------------------------------------------------------------------ tests

ALL_FILES = [path.stem for path in hub_config_files()]
SERVED = served_configs()


@pytest.fixture(scope="module")
def plugin_manager():
    return get_plugin_manager(entry_points=False)


def test_every_family_has_a_real_config():
    families = {resolve_family(get_plugin_manager(entry_points=False), config).name for _, config in SERVED}
    assert families >= {"dense", "moe", "mla", "gdn", "gemma", "olmo2", "phi3"}


@pytest.mark.parametrize("name", ALL_FILES)
def test_the_family_reads_the_file_or_refuses_it(plugin_manager, name):
    config = load_hub_config(name)
    if text_model_config(config) is not None:
        with pytest.raises(UnsupportedModelError, match=config["architectures"][0]):
            resolve_family(plugin_manager, config)
        config = text_model_config(config)
    family = resolve_family(plugin_manager, config)
    family_config = plugin_manager.get_plugin(family.name).config_class.from_dict(config, source=f"{name}.json")
    assert family_config is not None


@pytest.mark.parametrize("name, config", SERVED, ids=[name for name, _ in SERVED])
def test_the_shrunk_copy_keeps_every_layer_kind(name, config):
    small = shrunk_copy(config)
    total = set(layer_kinds(config, config["num_hidden_layers"]))
    assert set(layer_kinds(small, small["num_hidden_layers"])) == total
    for key in ("rope_scaling", "rope_theta", "tie_word_embeddings", "attention_bias", "partial_rotary_factor",
                "attn_logit_softcapping", "final_logit_softcapping", "num_experts_per_tok", "norm_topk_prob",
                "scoring_func", "topk_method", "n_group", "topk_group", "routed_scaling_factor", "first_k_dense_replace"):
        if key in config and not (key == "rope_scaling" and is_longrope(config)):
            assert small[key] == config[key], key


def seed_of(name: str) -> int:
    return sum(map(ord, name)) % 1000


@pytest.mark.parametrize("name, config", SERVED, ids=[name for name, _ in SERVED])
def test_the_shrunk_copy_matches_transformers(tmp_path, name, config):
    small = shrunk_copy(config)
    folder = write_hf_checkpoint(small, tmp_path / "checkpoint", seed=seed_of(name))
    vocab = small.get("vocab_size", VOCAB)
    if is_longrope(small):
        # One RoPE table per served model, chosen by max_model_len: the short factors up to the
        # pretraining context, the long ones past it (transformers picks by the prompt's length).
        context = small["original_max_position_embeddings"]
        errors = [compare_with_transformers(folder, prompt(context - 8, vocab, 1), max_model_len=context),
                  compare_with_transformers(folder, prompt(context + 8, vocab, 2), max_model_len=4 * context)]
    else:
        errors = [compare_with_transformers(folder, prompt(PROMPT_LENGTH, vocab, 1), max_model_len=256)]
    assert max(errors) <= TOLERANCE, f"{name}: relative errors {errors}"


def drop_rope_scaling(config):
    config["rope_scaling"] = None


def shrink_yarn(config):
    config["rope_scaling"] = {**config["rope_scaling"], "factor": config["rope_scaling"]["factor"] / 4}


def flatten_long_factors(config):
    config["rope_scaling"] = {**config["rope_scaling"], "long_factor": [1.0] * len(config["rope_scaling"]["long_factor"])}


def widen_window(config):
    config["sliding_window"] += 1


def drop_final_softcap(config):
    config["final_logit_softcapping"] = None


def keep_top_k_weights(config):
    config["norm_topk_prob"] = not config["norm_topk_prob"]


#: (case, what a copy changes): a metrale checkpoint with that one field changed must no longer
#: match transformers' logits of the unchanged one -- each kept feature bends the shrunk model.
SENSITIVITY = [
    ("meta-llama__Llama-3.1-8B-Instruct", drop_rope_scaling),
    ("deepseek-ai__DeepSeek-V3", shrink_yarn),
    ("microsoft__Phi-4-mini-instruct", flatten_long_factors),
    ("google__gemma-2-9b-it", widen_window),
    ("google__gemma-2-9b-it", drop_final_softcap),
    ("google__gemma-3-4b-it:text_config", drop_rope_scaling),
    ("Qwen__Qwen3-Next-80B-A3B-Thinking", keep_top_k_weights),
]


@pytest.mark.parametrize("name, change", SENSITIVITY, ids=[f"{name}-{change.__name__}" for name, change in SENSITIVITY])
def test_a_changed_feature_no_longer_matches(tmp_path, name, change):
    """The comparison notices the features a shrunk copy keeps: metrale serving a copy with one of
    them changed is far from transformers' logits of the real one."""
    from metrale.testing.hf import hf_reference_logits

    small = shrunk_copy(dict(SERVED)[name])
    folder = write_hf_checkpoint(small, tmp_path / "checkpoint", seed=seed_of(name))
    changed = tmp_path / "changed"
    changed.mkdir()
    for file in folder.iterdir():
        (changed / file.name).write_bytes(file.read_bytes())
    config = json.loads((changed / "config.json").read_text())
    change(config)
    (changed / "config.json").write_text(json.dumps(config))
    if is_longrope(small):
        context = small["original_max_position_embeddings"]
        token_ids, options = prompt(context + 8, VOCAB, 2), {"max_model_len": 4 * context}
    else:
        token_ids, options = prompt(PROMPT_LENGTH, VOCAB, 1), {"max_model_len": 256}
    with LLM(str(changed), device="cpu", show_progress=False, **options) as llm:
        ours = llm.score(token_ids)
    assert max_relative_error(ours, hf_reference_logits(folder, token_ids)) > 100 * TOLERANCE
