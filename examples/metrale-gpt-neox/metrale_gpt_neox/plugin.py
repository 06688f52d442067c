"""The plugin object Metrale finds through the ``metrale`` entry point group."""

from __future__ import annotations

from metrale.family import FamilyPlugin, FamilySpec

from metrale_gpt_neox.config import GptNeoxConfig
from metrale_gpt_neox.model import GptNeoxModel

GPT_NEOX_FAMILY = FamilySpec(
    name="gpt_neox",
    architectures=("GPTNeoXForCausalLM",),
    model_types=("gpt_neox",),
    description="GPT-NeoX and Pythia: LayerNorm, partial rotary, parallel or sequential residual, GELU MLP",
)


class GptNeoxPlugin(FamilyPlugin):
    #: The forward-contract version this plugin was written against.
    METRALE_CONTRACT_VERSION = "1.1"
    family = GPT_NEOX_FAMILY
    model_class = GptNeoxModel
    #: FamilyPlugin.load_model reads the config with it, bounds max_model_len by
    #: max_position_embeddings and builds GptNeoxModel(config, checkpoint, backend, max_model_len).
    config_class = GptNeoxConfig


plugin = GptNeoxPlugin()
