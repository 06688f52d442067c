"""Hook implementations of the MLA family."""

from __future__ import annotations

from metrale.model.family import FamilyPlugin, FamilySpec
from metrale.model.hookspecs import CONTRACT_VERSION
from metrale.plugins.mla.config import MlaConfig
from metrale.plugins.mla.model import MlaModel

MLA_FAMILY = FamilySpec(
    name="mla",
    architectures=("DeepseekV2ForCausalLM", "DeepseekV3ForCausalLM"),
    model_types=("deepseek_v2", "deepseek_v3"),
    description="multi-head latent attention over a compressed latent cache, with DeepSeek MoE",
)


class MlaPlugin(FamilyPlugin):
    METRALE_CONTRACT_VERSION = CONTRACT_VERSION
    family = MLA_FAMILY
    model_class = MlaModel
    config_class = MlaConfig


plugin = MlaPlugin()
