"""Hook implementations of the Phi-3 family."""

from __future__ import annotations

from metrale.model.family import FamilyPlugin, FamilySpec
from metrale.model.hookspecs import CONTRACT_VERSION
from metrale.plugins.phi3.config import Phi3Config
from metrale.plugins.phi3.model import Phi3Model

PHI3_FAMILY = FamilySpec(
    name="phi3",
    architectures=("Phi3ForCausalLM",),
    model_types=("phi3",),
    description="Phi-3 and Phi-4: GQA attention over a fused qkv_proj, a fused gate_up SwiGLU MLP, LongRoPE",
)


class Phi3Plugin(FamilyPlugin):
    METRALE_CONTRACT_VERSION = CONTRACT_VERSION
    family = PHI3_FAMILY
    model_class = Phi3Model
    config_class = Phi3Config


plugin = Phi3Plugin()
