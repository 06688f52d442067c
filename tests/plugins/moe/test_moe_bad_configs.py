"""A MoE checkpoint whose config.json is wrong is refused with a CheckpointError naming the file,
the field and the value, before anything sized by the config is allocated (each case edits a copy
of the session's Qwen3-MoE and Mixtral checkpoints)."""

from __future__ import annotations

import json
import shutil

import pytest

from conftest import load_refused

HUGE = 10**9


def edited(source, folder, **fields):
    shutil.copytree(source, folder)
    config = json.loads((folder / "config.json").read_text())
    config.update(fields)
    (folder / "config.json").write_text(json.dumps(config))
    return folder


@pytest.mark.parametrize("field", ["num_local_experts", "moe_intermediate_size", "hidden_size", "num_hidden_layers"])
def test_huge_sizes_are_refused_before_any_allocation(tmp_path, moe_checkpoints, warm_plugin_manager, field):
    path = edited(moe_checkpoints["qwen3_moe"], tmp_path / "ckpt", **{field: HUGE})
    load_refused(path, f"{field}={HUGE}", warm_plugin_manager)


@pytest.mark.parametrize("fields, match", [
    ({"num_experts_per_tok": 9}, "num_experts_per_tok=9 is more than the 8 experts"),
    ({"num_experts_per_tok": None}, "num_experts_per_tok"),
    ({"norm_topk_prob": None}, "norm_topk_prob"),
    ({"norm_topk_prob": "yes"}, "norm_topk_prob"),
    ({"mlp_only_layers": [0, "one"]}, r"mlp_only_layers\[1\]"),
    ({"decoder_sparse_step": 0}, "decoder_sparse_step"),
])
def test_bad_expert_fields_are_refused(tmp_path, moe_checkpoints, warm_plugin_manager, fields, match):
    load_refused(edited(moe_checkpoints["qwen3_moe"], tmp_path / "ckpt", **fields), match, warm_plugin_manager)


def test_more_experts_declared_than_the_router_scores_are_refused(tmp_path, moe_checkpoints, warm_plugin_manager):
    load_refused(edited(moe_checkpoints["mixtral"], tmp_path / "ckpt", num_local_experts=5),
                 r"block_sparse_moe.gate.weight' has shape \[4, 64\], but config.json's num_local_experts=5",
                 warm_plugin_manager)
