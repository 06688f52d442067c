"""An explicit ``null`` in config.json is read as transformers' config class reads it: where the
class types the field as optional, by its rule for None; where it does not, refused (the class
refuses the file). An absent field still takes the class default, so the two can differ."""

from __future__ import annotations

import pytest

from metrale.errors import CheckpointError
from metrale.plugins.dense.config import DenseConfig
from metrale.plugins.gdn.config import GdnConfig
from metrale.plugins.mla.config import MlaConfig

DENSE = dict(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2)
MLA = dict(DENSE, kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=12, n_routed_experts=8,
           num_experts_per_tok=3, moe_intermediate_size=24, first_k_dense_replace=1, n_group=4, topk_group=2,
           q_lora_rank=24)
GDN = dict(DENSE, head_dim=16, linear_conv_kernel_dim=4, linear_key_head_dim=8, linear_value_head_dim=16,
           linear_num_key_heads=2, linear_num_value_heads=4, num_experts=8, num_experts_per_tok=3,
           moe_intermediate_size=24, shared_expert_intermediate_size=40, full_attention_interval=2)

READERS = {"dense": (DenseConfig, DENSE), "mla": (MlaConfig, MLA), "gdn": (GdnConfig, GDN)}
MODEL_TYPES = {"llama": "dense", "mistral": "dense", "qwen2": "dense", "qwen3": "dense", "deepseek_v2": "mla",
               "deepseek_v3": "mla", "qwen3_next": "gdn"}


def read(model_type, **fields):
    reader, base = READERS[MODEL_TYPES[model_type]]
    return reader.from_dict({**base, "model_type": model_type, **fields})


def without(model_type, name, **fields):
    reader, base = READERS[MODEL_TYPES[model_type]]
    return reader.from_dict({k: v for k, v in {**base, "model_type": model_type, **fields}.items() if k != name})


REFUSED = "refused"

# (model type, field set to null, what the reader makes of it: REFUSED, or {attribute: value}).
NULLS = [
    ("llama", "num_key_value_heads", {"num_kv_heads": 4}),
    ("qwen2", "num_key_value_heads", {"num_kv_heads": 4}),  # absent: 32
    ("qwen3", "num_key_value_heads", {"num_kv_heads": 4}),
    ("mistral", "num_key_value_heads", REFUSED),
    ("llama", "head_dim", {"head_dim": 16}),
    ("mistral", "head_dim", {"head_dim": 16}),
    ("qwen3", "head_dim", REFUSED),  # absent: 128
    ("qwen2", "head_dim", REFUSED),
    ("llama", "rms_norm_eps", REFUSED),
    ("qwen3", "rms_norm_eps", REFUSED),
    ("llama", "attention_bias", REFUSED),
    ("qwen3", "attention_bias", REFUSED),
    ("llama", "mlp_bias", REFUSED),
    ("llama", "tie_word_embeddings", REFUSED),
    ("mistral", "max_position_embeddings", REFUSED),
    ("mistral", "sliding_window", {"sliding_window": None}),
    ("qwen2", "sliding_window", {"sliding_window": None}),
    ("qwen2", "use_sliding_window", REFUSED),
    ("qwen3", "max_window_layers", REFUSED),
    ("llama", "rope_scaling", {"rope": read("llama").rope}),
    ("llama", "rope_parameters", {"rope": read("llama").rope}),
    ("deepseek_v2", "q_lora_rank", {"q_lora_rank": None}),  # absent: 1536
    ("deepseek_v3", "q_lora_rank", {"q_lora_rank": None}),
    ("deepseek_v3", "topk_group", {"topk_group": 1}),
    ("deepseek_v3", "norm_topk_prob", {"norm_topk_prob": False}),  # absent: true
    ("deepseek_v3", "rope_interleave", {"interleaved_rope": False}),  # absent: true
    ("deepseek_v3", "n_routed_experts", REFUSED),
    ("deepseek_v3", "moe_intermediate_size", REFUSED),
    ("deepseek_v2", "first_k_dense_replace", REFUSED),
    ("deepseek_v3", "routed_scaling_factor", REFUSED),
    ("deepseek_v2", "rms_norm_eps", REFUSED),
    ("qwen3_next", "head_dim", REFUSED),
    ("qwen3_next", "num_experts", REFUSED),
    ("qwen3_next", "rms_norm_eps", REFUSED),
    ("qwen3_next", "norm_topk_prob", REFUSED),
    ("qwen3_next", "full_attention_interval", REFUSED),
    ("qwen3_next", "layer_types", {"given_layer_types": None}),
    ("qwen3_next", "mlp_only_layers", {"mlp_only_layers": frozenset()}),
]


@pytest.mark.parametrize("model_type, field, expected", NULLS, ids=[f"{t}-{f}" for t, f, _ in NULLS])
def test_a_null_reads_as_transformers_reads_it(model_type, field, expected):
    if expected == REFUSED:
        with pytest.raises(CheckpointError, match=rf"config\.json: {field} is null; expected .*null is not accepted"):
            read(model_type, **{field: None})
    else:
        config = read(model_type, **{field: None})
        assert {name: getattr(config, name) for name in expected} == expected


def test_null_and_absent_differ_where_transformers_makes_them_differ():
    wide = dict(hidden_size=128, num_attention_heads=64)
    assert without("qwen2", "num_key_value_heads", **wide).num_kv_heads == 32
    assert read("qwen2", num_key_value_heads=None, **wide).num_kv_heads == 64
    assert without("qwen3", "head_dim").head_dim == 128
    assert without("deepseek_v2", "q_lora_rank").q_lora_rank == 1536
    assert without("deepseek_v3", "norm_topk_prob").norm_topk_prob is True
    assert without("deepseek_v3", "rope_interleave").interleaved_rope is True


TRANSFORMERS_CLASSES = {"llama": "LlamaConfig", "mistral": "MistralConfig", "qwen2": "Qwen2Config",
                        "qwen3": "Qwen3Config", "deepseek_v2": "DeepseekV2Config", "deepseek_v3": "DeepseekV3Config",
                        "qwen3_next": "Qwen3NextConfig"}
# Where transformers' class takes the null but the model then fails on it (or tests its truth),
# so the class alone does not show the reader's answer: what the model does instead.
MODEL_RULES = {
    ("qwen2", "head_dim"): "Qwen2's attention takes getattr(config, 'head_dim', ...), None, as the head size",
    ("deepseek_v3", "norm_topk_prob"): "the MoE tests `if self.norm_topk_prob`",
    ("deepseek_v3", "rope_interleave"): "the attention tests `if self.config.rope_interleave`",
    ("deepseek_v3", "topk_group"): "the router takes the top None groups; read as one group",
    ("qwen3_next", "full_attention_interval"): "the class computes (i + 1) % None",
}


@pytest.mark.parametrize("model_type, field, expected", NULLS, ids=[f"{t}-{f}" for t, f, _ in NULLS])
def test_the_table_is_what_transformers_does(model_type, field, expected):
    """The table above against transformers' own config classes: a null they refuse is refused,
    a null they take gives the value they resolve it to."""
    transformers = pytest.importorskip("transformers")
    if (model_type, field) in MODEL_RULES:
        pytest.skip(MODEL_RULES[(model_type, field)])
    cls = getattr(transformers, TRANSFORMERS_CLASSES[model_type])
    _, base = READERS[MODEL_TYPES[model_type]]
    arguments = {**base, field: None}
    if expected == REFUSED:
        with pytest.raises(Exception, match=field):
            cls(**arguments)
        return
    resolved = cls(**arguments)
    names = {"num_kv_heads": "num_key_value_heads", "given_layer_types": "layer_types", "interleaved_rope": None,
             "rope": None}
    for name, value in expected.items():
        theirs = names.get(name, name)
        if theirs is None or (name == "given_layer_types" and value is None):
            continue
        got = getattr(resolved, theirs)
        assert (set(got) if isinstance(value, frozenset) else got) == (set(value) if isinstance(value, frozenset)
                                                                      else value), (name, got)
