"""Reading LoRA adapters (metrale/loading/lora.py) as PEFT saves them: each module's weights, rank and
scale (rsLoRA, rank and alpha patterns) as PEFT's own modules hold them, the deltas as PEFT's
modules compute them, trainable-token rows, and every refusal (another PEFT type, DoRA, biases,
unknown tensors, another base model, ranks above the limit, a config that disagrees with the
tensors or the model, non-finite values, bad requests)."""

from __future__ import annotations

import json
import re
import shutil
from types import SimpleNamespace

import numpy as np
import pytest

from metrale.errors import AdapterError, ConfigError
from metrale.kernels.lora_tiles import (
    ADAPTER_TILE_ROWS,
    adapter_tile_capacity,
    adapter_tiles,
    check_adapter_tiles,
    padded_adapter_tiles,
)
from metrale.loading.lora import LoRARequest, load_adapter, names_the_served_model, served_model_names

HIDDEN, INTER, VOCAB, LAYERS, KV_DIM = 64, 96, 128, 2, 32
TARGETS = {"self_attn.q_proj": (HIDDEN, HIDDEN), "self_attn.k_proj": (KV_DIM, HIDDEN),
           "self_attn.v_proj": (KV_DIM, HIDDEN), "self_attn.o_proj": (HIDDEN, HIDDEN),
           "mlp.gate_proj": (INTER, HIDDEN), "mlp.up_proj": (INTER, HIDDEN), "mlp.down_proj": (HIDDEN, INTER)}


def peft_model(**lora):
    """A tiny Llama wrapped by PEFT with ``lora`` (LoraConfig fields), its LoRA weights random."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=INTER,
                                         num_hidden_layers=LAYERS, num_attention_heads=4, num_key_value_heads=2))
    peft = get_peft_model(model, LoraConfig(**lora))
    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, parameter in peft.named_parameters():
            if "lora_" in name or "trainable_tokens" in name:
                parameter.copy_(0.3 * torch.randn(parameter.shape, generator=generator))
    return peft.eval()


def load(path, **overrides):
    options = dict(num_layers=LAYERS, vocab_size=VOCAB, hidden_size=HIDDEN, max_lora_rank=16)
    return load_adapter(LoRARequest("a", 1, path), TARGETS, **{**options, **overrides})


@pytest.mark.parametrize("rslora", [False, True])
def test_modules_ranks_and_scales_are_peft_s(tmp_path, rslora):
    import torch

    peft = peft_model(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj", "down_proj"], use_rslora=rslora,
                      rank_pattern={"v_proj": 4}, alpha_pattern={"down_proj": 5})
    peft.save_pretrained(tmp_path)
    adapter = load(tmp_path)
    assert sorted(adapter.modules) == sorted((layer, name) for layer in range(LAYERS)
                                             for name in ("self_attn.q_proj", "self_attn.v_proj", "mlp.down_proj"))
    assert adapter.rank == 8 and adapter.token_rows == {}
    x = np.random.default_rng(2).standard_normal((3, HIDDEN)).astype(np.float32)
    for (layer, name), module in adapter.modules.items():
        reference = peft.base_model.model.model.layers[layer].get_submodule(name)
        assert module.rank == reference.r["default"]
        assert module.scale == pytest.approx(reference.scaling["default"])
        inputs = x if name != "mlp.down_proj" else np.random.default_rng(3).standard_normal((3, INTER)).astype(np.float32)
        with torch.no_grad():
            tensor = torch.from_numpy(inputs)
            expected = (reference(tensor) - reference.base_layer(tensor)).numpy()
        np.testing.assert_allclose(module.delta(inputs), expected, rtol=1e-5, atol=1e-5)


def test_trainable_tokens_are_the_rows_peft_puts_in(tmp_path):
    import torch

    peft = peft_model(r=4, lora_alpha=8, target_modules=["o_proj"], trainable_token_indices={"embed_tokens": [3, 70]})
    peft.save_pretrained(tmp_path)
    adapter = load(tmp_path)
    indices, rows = adapter.token_rows["embed_tokens"]
    assert indices.tolist() == [3, 70] and rows.shape == (2, HIDDEN)
    ids = torch.tensor([[3, 70, 5]])
    with torch.no_grad():
        embedded = peft.get_input_embeddings()(ids)[0].numpy()
        with peft.disable_adapter():
            base = peft.get_input_embeddings()(ids)[0].numpy()
    np.testing.assert_allclose(embedded[:2], rows, rtol=1e-6, atol=1e-6)
    assert not np.allclose(embedded[:2], base[:2])
    np.testing.assert_allclose(embedded[2], base[2])  # other rows are the base model's


@pytest.fixture
def saved(tmp_path):
    """A folder with a small valid adapter, to be spoilt by each refusal test."""
    peft_model(r=4, lora_alpha=8, target_modules=["q_proj"]).save_pretrained(tmp_path / "good")
    return tmp_path / "good"


def edit_config(folder, **changes):
    path = folder / "adapter_config.json"
    config = json.loads(path.read_text())
    config.update(changes)
    path.write_text(json.dumps(config))


@pytest.mark.parametrize("changes, match", [
    ({"peft_type": "IA3"}, "only LORA adapters"),
    ({"use_dora": True}, "DoRA"),
    ({"bias": "all"}, "biases"),
    ({"fan_in_fan_out": True}, "fan_in_fan_out"),
    ({"target_parameters": ["mlp.experts.gate_up_proj"]}, "MoE experts"),
    ({"modules_to_save": ["lm_head"]}, "modules_to_save"),
    ({"r": 0}, "r must be a positive integer"),
    ({"trainable_token_indices": {"embed_tokens": [1]}}, "trainable tokens configured"),
])
def test_unsupported_configs_are_refused(saved, changes, match):
    edit_config(saved, **changes)
    with pytest.raises(AdapterError, match=match):
        load(saved)


def test_weights_that_do_not_fit_are_refused(saved, tmp_path):
    from safetensors.numpy import load_file, save_file

    with pytest.raises(AdapterError, match="max_lora_rank=2"):
        load(saved, max_lora_rank=2)
    with pytest.raises(AdapterError, match="the base model has 1 layers"):
        load(saved, num_layers=1)
    with pytest.raises(AdapterError, match="another base model"):
        load_adapter(LoRARequest("a", 1, saved), {**TARGETS, "self_attn.q_proj": (HIDDEN, 2 * HIDDEN)},
                     num_layers=LAYERS, vocab_size=VOCAB, hidden_size=HIDDEN, max_lora_rank=16)
    with pytest.raises(AdapterError, match="not served for this model"):
        load_adapter(LoRARequest("a", 1, saved), {"mlp.down_proj": (HIDDEN, INTER)}, num_layers=LAYERS,
                     vocab_size=VOCAB, hidden_size=HIDDEN, max_lora_rank=16)
    weights = saved / "adapter_model.safetensors"
    tensors = load_file(str(weights))
    spoilt = tmp_path / "spoilt"
    shutil.copytree(saved, spoilt)
    save_file({**tensors, "base_model.model.model.norm.weight": np.ones(HIDDEN, np.float32)},
              str(spoilt / "adapter_model.safetensors"))
    with pytest.raises(AdapterError, match="norm.weight"):
        load(spoilt)
    save_file({k: v for k, v in tensors.items() if "lora_B" not in k}, str(spoilt / "adapter_model.safetensors"))
    with pytest.raises(AdapterError, match="lora_A and lora_B"):
        load(spoilt)
    (spoilt / "adapter_model.safetensors").write_bytes(b"not safetensors")
    with pytest.raises(AdapterError, match="not a safetensors file"):
        load(spoilt)
    with pytest.raises(AdapterError, match="missing: no such folder"):
        load(tmp_path / "missing")
    with pytest.raises(AdapterError, match="adapter_model.safetensors: not a folder"):
        load(spoilt / "adapter_model.safetensors")
    (tmp_path / "empty").mkdir()
    with pytest.raises(AdapterError, match="empty: no adapter_config.json"):
        load(tmp_path / "empty")
    with pytest.raises(AdapterError, match="no such folder"):
        load(tmp_path / "nul\x00byte")


@pytest.mark.parametrize("changes, match", [
    ({"r": 1000000}, r"rank 1000000 is above max_lora_rank=16 \(r in adapter_config.json\)"),
    ({"r": 8}, r"layer 0 self_attn.q_proj: r is 8 in adapter_config.json, but lora_A and lora_B have rank 4"),
    ({"r": 2}, r"r is 2 in adapter_config.json, but lora_A and lora_B have rank 4"),
    ({"rank_pattern": {"q_proj": 2}}, r"rank_pattern\['q_proj'\] is 2 in adapter_config.json, but .* rank 4"),
    ({"rank_pattern": {r"layers\.1\.self_attn\.q_proj": 8}}, r"layer 1 self_attn.q_proj: rank_pattern.* is 8"),
    ({"rank_pattern": {"q_proj": 64}}, r"rank 64 is above max_lora_rank=16 \(rank_pattern\['q_proj'\]"),
    ({"r": 4.0}, "r must be a positive integer, got 4.0"),
    ({"r": True}, "r must be a positive integer, got True"),
    ({"rank_pattern": {"q_proj": 2.5}}, r"rank_pattern\['q_proj'\] must be a positive integer, got 2.5"),
    ({"rank_pattern": {"(": 2}}, r"rank_pattern key '\(' is not a regular expression"),
])
def test_a_rank_other_than_the_tensors_is_refused(saved, changes, match):
    """``r`` (or the ``rank_pattern`` value that applies to a module, PEFT's rule) must be the
    rank the module's lora_A and lora_B have."""
    edit_config(saved, **changes)
    with pytest.raises(AdapterError, match=match):
        load(saved)


def test_a_rank_above_max_lora_rank_is_refused_from_the_config_or_the_tensors(tmp_path):
    peft_model(r=32, lora_alpha=8, target_modules=["q_proj"]).save_pretrained(tmp_path / "big")
    with pytest.raises(AdapterError, match=r"rank 32 is above max_lora_rank=16 \(r in adapter_config.json\)"):
        load(tmp_path / "big")
    edit_config(tmp_path / "big", r=4)  # the config hides the tensors' rank
    with pytest.raises(AdapterError, match=r"rank 32 is above max_lora_rank=16 \(lora_A and lora_B\)"):
        load(tmp_path / "big")


@pytest.mark.parametrize("changes, match", [
    ({"lora_alpha": float("nan")}, "lora_alpha must be a finite positive number, got nan"),
    ({"lora_alpha": float("inf")}, "lora_alpha must be a finite positive number, got inf"),
    ({"lora_alpha": 10**400}, "lora_alpha must be a finite positive number, got 1000"),
    ({"lora_alpha": -8}, "lora_alpha must be a finite positive number, got -8"),
    ({"lora_alpha": 0}, "lora_alpha must be a finite positive number, got 0"),
    ({"lora_alpha": "8"}, "lora_alpha must be a finite positive number, got '8'"),
    ({"lora_alpha": True}, "lora_alpha must be a finite positive number, got True"),
    ({"lora_alpha": None}, "lora_alpha must be a finite positive number, got None"),
    ({"alpha_pattern": {"q_proj": float("nan")}}, r"alpha_pattern\['q_proj'\] must be a finite positive number"),
    ({"alpha_pattern": {"q_proj": float("-inf")}}, r"alpha_pattern\['q_proj'\] must be a finite positive number"),
])
def test_an_alpha_that_is_not_a_finite_positive_number_is_refused(saved, changes, match):
    edit_config(saved, **changes)
    with pytest.raises(AdapterError, match=match):
        load(saved)


@pytest.mark.parametrize("changes, match", [
    ({"target_modules": ["c_attn"]}, r"target_modules \['c_attn'\] matches no module of the base model that LoRA "
                                     r"is served on \(mlp.down_proj, .*self_attn.v_proj\)"),
    ({"target_modules": r".*\.c_attn"}, r"target_modules '.*c_attn' matches no module"),
    ({"target_modules": ["q_proj", "embed_tokens"]}, "selects model.embed_tokens: LoRA on embed_tokens is not served"),
    ({"target_modules": "lm_head"}, "selects lm_head: LoRA on lm_head is not served"),
    ({"target_modules": ["v_proj"]}, r"the tensors adapt model.layers.0.self_attn.q_proj, which target_modules "
                                     r"\['v_proj'\] does not select"),
    ({"target_modules": []}, r"the tensors adapt model.layers.0.self_attn.q_proj, which target_modules \[\] does"),
    ({"target_modules": r"model\.layers\.1\..*"}, "the tensors adapt model.layers.0.self_attn.q_proj"),
    ({"exclude_modules": ["q_proj"]}, r"target_modules \['q_proj'\] less exclude_modules \['q_proj'\] matches no"),
    ({"target_modules": ["q_proj", "v_proj"], "exclude_modules": r".*\.q_proj"},
     r"the tensors adapt model.layers.0.self_attn.q_proj, which target_modules \['q_proj', 'v_proj'\] less "
     r"exclude_modules '.*q_proj' does not select"),
    ({"target_modules": "("}, r"target_modules '\(' is not a regular expression"),
    ({"target_modules": 5}, "target_modules must be a list of module names or a regular expression, got 5"),
    ({"exclude_modules": [1]}, r"exclude_modules must be a list of module names or a regular expression, got \[1\]"),
    ({"base_model_name_or_path": 3}, "base_model_name_or_path must be a string, got 3"),
])
def test_target_modules_that_disagree_with_the_model_or_the_tensors_are_refused(saved, changes, match):
    edit_config(saved, **changes)
    with pytest.raises(AdapterError, match=match):
        load(saved)


@pytest.mark.parametrize("targets, match", [
    (["q_proj", "kv_b_proj"], "target_modules entry 'kv_b_proj' selects self_attn.kv_b_proj, which this model does "
                              "not serve LoRA on: decode folds it"),
    (["q_proj", "model.layers.1.self_attn.kv_b_proj"], "entry 'model.layers.1.self_attn.kv_b_proj' selects "
                                                       "self_attn.kv_b_proj"),
    (["q_proj", "experts"], "entry 'experts' selects mlp.experts, which .*: the routed experts"),
    (["q_proj", "gate"], "entry 'gate' selects mlp.gate, which .*: the router"),
])
def test_target_modules_naming_a_projection_the_model_refuses_are_refused(saved, targets, match):
    """The tensors hold q_proj only: the config names a projection the model does not serve
    LoRA on, which would otherwise go unnoticed."""
    edit_config(saved, target_modules=targets)
    refused = {r"self_attn\.kv_b_proj": "decode folds it", r"mlp\.experts(\..*)?": "the routed experts",
               r"mlp\.gate": "the router"}
    with pytest.raises(AdapterError, match=match):
        load_adapter(LoRARequest("a", 1, saved), TARGETS, num_layers=LAYERS, vocab_size=VOCAB, hidden_size=HIDDEN,
                     max_lora_rank=16, refused=refused)
    edit_config(saved, target_modules=["q_proj", "gate_proj"])  # the dense MLP's, not the experts'
    load_adapter(LoRARequest("a", 1, saved), TARGETS, num_layers=LAYERS, vocab_size=VOCAB, hidden_size=HIDDEN,
                 max_lora_rank=16, refused=refused)


@pytest.mark.parametrize("lora, edits, adapted", [
    (dict(target_modules=r".*\.layers\.1\.self_attn\.(q|v)_proj"), {}, {(1, "self_attn.q_proj"), (1, "self_attn.v_proj")}),
    (dict(target_modules="all-linear"), {}, {(layer, name) for layer in range(LAYERS) for name in TARGETS}),
    (dict(target_modules=["q_proj"]), {"target_modules": ["q_proj", "q_a_proj", "c_attn"]},
     {(layer, "self_attn.q_proj") for layer in range(LAYERS)}),
    (dict(target_modules=["q_proj"]), {"target_modules": "all-linear"}, {(layer, "self_attn.q_proj") for layer in range(LAYERS)}),
    (dict(target_modules=["q_proj", "v_proj"], exclude_modules=["v_proj"]), {},
     {(layer, "self_attn.q_proj") for layer in range(LAYERS)}),
])
def test_target_modules_peft_writes_are_read(tmp_path, lora, edits, adapted):
    """A regular expression, all-linear (saved as the names it selected), entries for modules of
    other models beside this one's (PEFT only refuses a selection that matches nothing),
    exclude_modules."""
    peft_model(r=4, lora_alpha=8, **lora).save_pretrained(tmp_path / "a")
    if edits:
        edit_config(tmp_path / "a", **edits)
    assert set(load(tmp_path / "a").modules) == adapted


def spoil_tensor(folder, part, index, value):
    """Write ``value`` at ``index`` of the first tensor of ``folder``'s adapter whose name holds
    ``part``; its name."""
    from safetensors.numpy import load_file, save_file

    path = folder / "adapter_model.safetensors"
    tensors = load_file(str(path))
    key = sorted(k for k in tensors if part in k)[0]
    tensors[key][index] = value
    save_file(tensors, str(path))
    return key


@pytest.mark.parametrize("value", [np.nan, np.inf, -np.inf])
@pytest.mark.parametrize("part", ["lora_A", "lora_B", "trainable_tokens_delta"])
def test_non_finite_adapter_weights_are_refused_naming_the_tensor(tmp_path, part, value):
    peft_model(r=4, lora_alpha=8, target_modules=["q_proj"], trainable_token_indices=[3, 7]).save_pretrained(tmp_path)
    key = spoil_tensor(tmp_path, part, (1, 2), value)
    with pytest.raises(AdapterError, match=re.escape(f"tensor {key!r} holds 1 NaN or infinite values (the first at "
                                                     "index (1, 2))")):
        load(tmp_path)


def test_the_served_model_goes_by_its_folder_its_hub_name_and_its_recorded_name(tmp_path):
    snapshot = tmp_path / "hub" / "models--meta-llama--Llama-3.1-8B" / "snapshots" / "0123abc"
    snapshot.mkdir(parents=True)
    names = served_model_names(SimpleNamespace(path=snapshot, config={"_name_or_path": "org/Tuned-8B"}))
    assert {str(snapshot), "meta-llama/Llama-3.1-8B", "org/Tuned-8B"} <= names
    for same in ("meta-llama/Llama-3.1-8B", "META-LLAMA/llama-3.1-8b", "/elsewhere/Llama-3.1-8B/", "org/Tuned-8B",
                 str(snapshot), str(tmp_path / "hub" / "." / snapshot.relative_to(tmp_path / "hub"))):
        assert names_the_served_model(same, names), same
    for other in ("meta-llama/Llama-3.1-70B", "Qwen/Qwen3-8B", "/models/llama", "\0"):
        assert not names_the_served_model(other, names), other
    plain = served_model_names(SimpleNamespace(path=tmp_path, config={}))
    assert plain == {str(tmp_path), str(tmp_path.resolve())}


@pytest.mark.parametrize("fields, match", [
    (("", 1, "x"), "lora_name"), (("a", 0, "x"), "lora_int_id"), (("a", True, "x"), "lora_int_id"),
    (("a", 1, ""), "lora_path"),
])
def test_bad_requests_are_refused(fields, match):
    with pytest.raises(ConfigError, match=match):
        LoRARequest(*fields)


@pytest.mark.parametrize("seed", range(6))
def test_adapter_tiles_list_every_row_once_in_tiles_of_its_slot(seed):
    rng = np.random.default_rng(seed)
    rows = int(rng.integers(1, 80))
    slots = rng.integers(0, int(rng.integers(1, 12)), rows)
    tiles = adapter_tiles(slots)
    counts = tiles[:, 1]
    used = int((counts > 0).sum())
    assert len(tiles) == adapter_tile_capacity(rows) and (counts[:used] > 0).all() and not counts[used:].any()
    listed = [row for tile in tiles[:used] for row in tile[2 : 2 + tile[1]]]
    assert sorted(listed) == list(range(rows))
    for slot, count, *members in tiles[:used]:
        assert 1 <= count <= ADAPTER_TILE_ROWS and (slots[members[:count]] == slot).all()
        assert members[:count] == sorted(members[:count]) and all(m == -1 for m in members[count:])
    check_adapter_tiles("test", slots, tiles)


def test_adapter_tiles_fit_the_capacity_of_the_worst_mix():
    # 9 rows of one slot and one row of each of seven others: each slot's last tile partly empty.
    slots = np.array([1] * 9 + list(range(2, 9)))
    tiles = adapter_tiles(slots)
    assert int((tiles[:, 1] > 0).sum()) == 2 + 7 <= adapter_tile_capacity(len(slots))
    assert len(adapter_tiles(slots, 40)) == 40  # a graph's table: room for any mix
    with pytest.raises(ValueError, match="cannot hold"):
        adapter_tiles(slots, 8)


def test_tiles_that_do_not_match_the_slots_are_refused():
    slots = np.array([1, 0, 1, 2])
    tiles = adapter_tiles(slots)
    assert tiles[1, :4].tolist() == [1, 2, 0, 2]  # slot 1: rows 0 and 2
    for change, match in ((lambda t: t.__setitem__((1, 0), 2), "another adapter slot"),
                          (lambda t: t.__setitem__((1, 3), 0), "once"),
                          (lambda t: t.__setitem__((1, 1), 0), "the used ones first"),
                          (lambda t: t.__setitem__((0, 1), 9), "1 to 8 rows")):
        broken = tiles.copy()
        change(broken)
        with pytest.raises(ValueError, match=match):
            check_adapter_tiles("test", slots, broken)
    with pytest.raises(ValueError, match=r"\[T, 10\]"):
        check_adapter_tiles("test", slots, tiles[:, :5])


@pytest.mark.parametrize("rows, size", [(3, 4), (9, 32), (32, 32), (1, 17)])
def test_padded_tiles_add_the_padding_rows_as_the_base_model_s(rows, size):
    rng = np.random.default_rng(rows + size)
    slots = rng.integers(0, 5, rows)
    padded = padded_adapter_tiles(adapter_tiles(slots), rows, size, adapter_tile_capacity(size))
    assert len(padded) == adapter_tile_capacity(size)
    check_adapter_tiles("test", np.concatenate([slots, np.zeros(size - rows, slots.dtype)]), padded)
    with pytest.raises(ValueError, match="cannot hold"):
        padded_adapter_tiles(adapter_tiles(slots), rows, size, 0)
