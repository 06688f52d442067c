"""Hook implementations of the MoE family."""

from __future__ import annotations

from metrale.model.family import FamilyPlugin, FamilySpec
from metrale.model.hookspecs import CONTRACT_VERSION
from metrale.plugins.moe.config import MoeConfig
from metrale.plugins.moe.model import MoeModel

MOE_FAMILY = FamilySpec(
    name="moe",
    architectures=("Qwen3MoeForCausalLM", "Qwen2MoeForCausalLM", "MixtralForCausalLM"),
    model_types=("qwen3_moe", "qwen2_moe", "mixtral"),
    description="decoder-only transformers with GQA attention and softmax-routed SwiGLU experts",
)


class MoePlugin(FamilyPlugin):
    METRALE_CONTRACT_VERSION = CONTRACT_VERSION
    family = MOE_FAMILY
    model_class = MoeModel
    config_class = MoeConfig


plugin = MoePlugin()
