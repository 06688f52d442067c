"""Hook implementations of the OLMo-2 family."""

from __future__ import annotations

from metrale.model.family import FamilyPlugin, FamilySpec
from metrale.model.hookspecs import CONTRACT_VERSION
from metrale.plugins.olmo2.config import Olmo2Config
from metrale.plugins.olmo2.model import Olmo2Model

OLMO2_FAMILY = FamilySpec(
    name="olmo2",
    architectures=("Olmo2ForCausalLM",),
    model_types=("olmo2",),
    description="post-norm decoder-only transformers with whole-projection q/k RMSNorm and a SwiGLU MLP",
)


class Olmo2Plugin(FamilyPlugin):
    METRALE_CONTRACT_VERSION = CONTRACT_VERSION
    family = OLMO2_FAMILY
    model_class = Olmo2Model
    config_class = Olmo2Config


plugin = Olmo2Plugin()
