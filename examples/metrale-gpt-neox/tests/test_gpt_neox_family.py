"""The GPT-NeoX family end to end on the CPU: found through its entry point, greedy generation
equal to transformers', legacy config fields, the fused-row regrouping, and the config and
tensor checks that refuse a broken checkpoint before loading it."""

from __future__ import annotations

import json
import shutil
from importlib import metadata

import numpy as np
import pytest
from metrale import LLM, SamplingParams
from metrale.checkpoint import Checkpoint
from metrale.errors import CheckpointError, ConfigError
from metrale.family import resolve_family
from metrale.plugin_manager import get_plugin_manager
from metrale.testing import max_relative_error
from metrale.testing.conformance import assert_varied_greedy
from metrale.testing.hf import hf_greedy, hf_reference_logits
from safetensors.numpy import load_file, save_file

from gpt_neox_checkpoints import VARIANTS, build_gpt_neox_checkpoint
from metrale_gpt_neox.config import GptNeoxConfig
from metrale_gpt_neox.layers import regroup_qkv_rows


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("gpt_neox")
    return {name: build_gpt_neox_checkpoint(name, root / name, seed=index) for index, name in enumerate(VARIANTS)}


def load(path, **options):
    return LLM(path, device="cpu", show_progress=False, **options)


def copy_checkpoint(source, target):
    shutil.copytree(source, target)
    return target


def edit_config(path, **changes):
    file = path / "config.json"
    config = json.loads(file.read_text())
    config.update(changes)
    file.write_text(json.dumps(config))


# ------------------------------------------------------------------------------ discovery


def test_plugin_is_installed_as_an_entry_point():
    found = {ep.name: ep for ep in metadata.entry_points(group="metrale")}
    assert "gpt_neox" in found, "the plugin is not installed: pip install ./examples/metrale-gpt-neox"
    assert found["gpt_neox"].dist.name == "metrale-gpt-neox"


def test_family_is_resolved_from_model_type_and_architectures(checkpoints):
    manager = get_plugin_manager()
    assert manager.distributions.get("gpt_neox") == "metrale-gpt-neox"
    assert resolve_family(manager, {"model_type": "gpt_neox", "architectures": ["GPTNeoXForCausalLM"]}).name == "gpt_neox"
    assert resolve_family(manager, {"architectures": ["GPTNeoXForCausalLM"]}).name == "gpt_neox"
    assert load(checkpoints["parallel"]).family.name == "gpt_neox"


# ----------------------------------------------------------------------------- generation


@pytest.mark.parametrize("name", list(VARIANTS))
def test_greedy_tokens_match_transformers(checkpoints, name):
    path = checkpoints[name]
    llm = load(path)
    rng = np.random.default_rng(7)
    prompts = [rng.integers(0, 128, n).tolist() for n in (1, 6, 25)]
    params = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
    outputs = [o.token_ids for o in llm.generate(prompts, params)]
    expected = [hf_greedy(path, prompt, max_new_tokens=16) for prompt in prompts]
    assert_varied_greedy(expected, llm.vocab_size)
    assert outputs == expected


def test_legacy_config_fields_are_read(checkpoints, tmp_path):
    """transformers 4.x wrote ``rotary_pct`` and ``rotary_emb_base`` at the top level (Pythia's
    config.json on the Hub); both must give the logits transformers computes from them."""
    path = copy_checkpoint(checkpoints["tied_unbiased"], tmp_path / "legacy")
    config = json.loads((path / "config.json").read_text())
    rope = config.pop("rope_parameters")
    config.update(rotary_pct=rope["partial_rotary_factor"], rotary_emb_base=rope["rope_theta"])
    (path / "config.json").write_text(json.dumps(config))
    assert GptNeoxConfig.from_dict(config).rotary_dim == 8 and GptNeoxConfig.from_dict(config).rope.theta == 5000
    ids = np.random.default_rng(3).integers(0, 128, 30).tolist()
    assert max_relative_error(load(path).score(ids), hf_reference_logits(path, ids)) <= 1e-4


def test_missing_rotary_pct_takes_transformers_default():
    config = {"vocab_size": 8, "hidden_size": 64, "intermediate_size": 8, "num_hidden_layers": 1,
              "num_attention_heads": 2}
    parsed = GptNeoxConfig.from_dict(config)
    assert parsed.rotary_dim == 8  # int(32 * 0.25)
    assert parsed.gelu_approximate == "none" and parsed.use_parallel_residual and parsed.attention_bias
    assert parsed.max_position_embeddings == 2048 and parsed.layer_norm_eps == 1e-5


def test_old_exports_buffers_are_skipped(checkpoints, tmp_path):
    """Older exports saved the causal mask, its fill value and inv_freq per layer; they are not read."""
    path = copy_checkpoint(checkpoints["parallel"], tmp_path / "buffers")
    tensors = load_file(str(path / "model.safetensors"))
    for i in range(3):
        prefix = f"gpt_neox.layers.{i}.attention"
        tensors[f"{prefix}.bias"] = np.tril(np.ones((1, 1, 256, 256), dtype=bool))
        tensors[f"{prefix}.masked_bias"] = np.array(-1e9, dtype=np.float32)
        tensors[f"{prefix}.rotary_emb.inv_freq"] = np.ones(2, dtype=np.float32)
    save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})
    llm = load(path)
    assert llm.checkpoint.unconsumed() == []
    ids = [5, 9, 17, 33, 65]
    assert max_relative_error(llm.score(ids), load(checkpoints["parallel"]).score(ids)) == 0


# ------------------------------------------------------------------------------- regrouping


def test_regrouped_rows_split_as_transformers_splits_them():
    """transformers views ``qkv`` as ``[n_h, 3 d]`` and chunks each head into q, k, v; the
    regrouped matrix gives the same q, k and v as its first, second and third thirds."""
    import torch

    heads, d, hidden, tokens = 4, 6, 24, 5
    rng = np.random.default_rng(0)
    weight = rng.standard_normal((3 * hidden, hidden)).astype(np.float32)
    bias = rng.standard_normal(3 * hidden).astype(np.float32)
    x = rng.standard_normal((tokens, hidden)).astype(np.float32)
    fused = torch.nn.functional.linear(torch.from_numpy(x), torch.from_numpy(weight), torch.from_numpy(bias))
    q, k, v = fused.view(tokens, heads, 3 * d).chunk(3, dim=-1)
    ours = x @ regroup_qkv_rows(weight, heads, d).T + regroup_qkv_rows(bias, heads, d)
    for index, part in enumerate((q, k, v)):
        np.testing.assert_allclose(ours[:, index * hidden : (index + 1) * hidden], part.reshape(tokens, hidden).numpy(),
                                   rtol=1e-5, atol=1e-5)


# --------------------------------------------------------------------- refused checkpoints


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"hidden_act": "relu"}, "hidden_act"),
        ({"hidden_size": 66}, "not a multiple of num_attention_heads"),
        ({"rotary_pct": 0.1, "rope_parameters": None}, "rotary dimension"),
        ({"layer_norm_eps": "1e-5"}, "layer_norm_eps"),
        ({"use_parallel_residual": 1}, "use_parallel_residual"),
        ({"num_hidden_layers": 4}, "num_hidden_layers=4"),
        ({"num_hidden_layers": 10**9}, "num_hidden_layers=1000000000"),
        ({"intermediate_size": 128}, "intermediate_size=128"),
        ({"vocab_size": 100}, "vocab_size=100"),
        ({"attention_bias": False}, "attention_bias=false"),
        ({"tie_word_embeddings": False}, "tie_word_embeddings=false"),
    ],
)
def test_broken_checkpoints_are_refused_before_loading(checkpoints, tmp_path, changes, message):
    source = checkpoints["tied_unbiased"] if "tie_word_embeddings" in changes else checkpoints["parallel"]
    path = copy_checkpoint(source, tmp_path / "broken")
    edit_config(path, **changes)
    with pytest.raises(CheckpointError, match=message):
        load(path)


def test_context_longer_than_the_positions_is_refused(checkpoints):
    with pytest.raises(ConfigError, match="max_position_embeddings=256"):
        load(checkpoints["parallel"], max_model_len=512)


def test_config_reads_the_checkpoint_fields(checkpoints):
    checkpoint = Checkpoint(checkpoints["sequential"])
    config = GptNeoxConfig.from_dict(checkpoint.config, source=checkpoint.fields.source)
    assert (config.num_layers, config.num_heads, config.head_dim, config.rotary_dim) == (3, 4, 16, 16)
    assert config.gelu_approximate == "tanh" and not config.use_parallel_residual
    config.check_tensors(checkpoint)
    assert checkpoint.unconsumed() == sorted(checkpoint.names()), "check_tensors read tensor data"
