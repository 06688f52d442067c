"""Hook implementations of the Gemma family."""

from __future__ import annotations

from metrale.model.family import FamilyPlugin, FamilySpec
from metrale.model.hookspecs import CONTRACT_VERSION
from metrale.plugins.gemma.config import GemmaConfig
from metrale.plugins.gemma.model import GemmaModel

GEMMA_FAMILY = FamilySpec(
    name="gemma",
    architectures=("Gemma2ForCausalLM", "Gemma3ForCausalLM"),
    model_types=("gemma2", "gemma3_text"),
    description="Gemma-2 and Gemma-3 text: sandwich norms, alternating sliding-window layers, GeGLU, soft-capping",
)


class GemmaPlugin(FamilyPlugin):
    METRALE_CONTRACT_VERSION = CONTRACT_VERSION
    family = GEMMA_FAMILY
    model_class = GemmaModel
    config_class = GemmaConfig


plugin = GemmaPlugin()
