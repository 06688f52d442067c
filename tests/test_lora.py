"""Reading LoRA adapters (metrale/lora.py) as PEFT saves them: each module's weights, rank and
scale (rsLoRA, rank and alpha patterns) as PEFT's own modules hold them, the deltas as PEFT's
modules compute them, trainable-token rows, and every refusal (another PEFT type, DoRA, biases,
unknown tensors, another base model, ranks above the limit, bad requests)."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest

from metrale.errors import AdapterError, ConfigError
from metrale.lora import (
    ADAPTER_TILE_ROWS,
    LoRARequest,
    adapter_tile_capacity,
    adapter_tiles,
    check_adapter_tiles,
    load_adapter,
    padded_adapter_tiles,
)

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
    ({"r": 0}, "r must be a positive number"),
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
    with pytest.raises(AdapterError, match="no adapter_config.json"):
        load(tmp_path / "missing")


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
