"""Hook implementations of the dense family."""

from __future__ import annotations

import logging
from typing import Any

from metrale.errors import ConfigError
from metrale.family import FamilyPlugin, FamilySpec
from metrale.hookspecs import CONTRACT_VERSION
from metrale.plugins.dense.config import DenseConfig
from metrale.plugins.dense.model import DenseModel

logger = logging.getLogger(__name__)

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

    def load_model(self, checkpoint: Any, backend: Any, config: Any) -> DenseModel:
        dense = DenseConfig.from_dict(checkpoint.config, source=checkpoint.fields.source)
        max_model_len = config.max_model_len or dense.max_position_embeddings
        if max_model_len > dense.max_position_embeddings:
            raise ConfigError(
                f"max_model_len={max_model_len} exceeds the checkpoint's max_position_embeddings="
                f"{dense.max_position_embeddings}"
            )
        model = DenseModel(dense, checkpoint, backend, max_model_len)
        unused = checkpoint.unconsumed()
        if unused:
            logger.warning("%s: %d tensors are not used by the dense family: %s", checkpoint.path, len(unused), unused[:8])
        return model


plugin = DensePlugin()
