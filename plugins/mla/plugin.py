"""Hook implementations of the MLA family."""

from __future__ import annotations

from typing import Any

from metrale.family import FamilyPlugin, FamilySpec
from metrale.hookspecs import CONTRACT_VERSION, hookimpl
from metrale.plugins.mla.config import MlaConfig
from metrale.plugins.mla.model import MlaModel
from metrale.plugins.mla.mtp import mtp_drafter

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

    @hookimpl
    def metrale_drafters(self) -> dict[str, Any]:
        return {"mtp": mtp_drafter}


plugin = MlaPlugin()
