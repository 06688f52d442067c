"""Hook implementations of the dense family."""

from __future__ import annotations

from metrale.model.family import FamilyPlugin, FamilySpec
from metrale.model.hookspecs import CONTRACT_VERSION
from metrale.plugins.dense.config import DenseConfig
from metrale.plugins.dense.model import DenseModel

DENSE_FAMILY = FamilySpec(
    name="dense",
    architectures=("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM"),
    model_types=("llama", "mistral", "qwen2", "qwen3"),
    description="decoder-only transformers with GQA attention and a SwiGLU MLP",
)


class DensePlugin(FamilyPlugin):
    METRALE_CONTRACT_VERSION = CONTRACT_VERSION
    family = DENSE_FAMILY
    model_class = DenseModel
    config_class = DenseConfig


plugin = DensePlugin()
