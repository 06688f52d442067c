"""Hook implementations of the GDN hybrid family."""

from __future__ import annotations

from metrale.model.family import FamilyPlugin, FamilySpec
from metrale.model.hookspecs import CONTRACT_VERSION
from metrale.plugins.gdn.config import GdnConfig
from metrale.plugins.gdn.model import GdnModel

GDN_FAMILY = FamilySpec(
    name="gdn",
    architectures=("Qwen3NextForCausalLM",),
    model_types=("qwen3_next",),
    description="hybrids of gated attention and Gated DeltaNet layers (fixed-size recurrent state), with MoE",
)


class GdnPlugin(FamilyPlugin):
    METRALE_CONTRACT_VERSION = CONTRACT_VERSION
    family = GDN_FAMILY
    model_class = GdnModel
    config_class = GdnConfig


plugin = GdnPlugin()
