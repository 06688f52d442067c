"""Hook implementations of the MLA family."""

from __future__ import annotations

import logging
from typing import Any

from metrale.errors import ConfigError
from metrale.family import FamilyPlugin, FamilySpec
from metrale.hookspecs import CONTRACT_VERSION
from metrale.plugins.mla.config import MlaConfig
from metrale.plugins.mla.model import MlaModel

logger = logging.getLogger(__name__)

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

    def load_model(self, checkpoint: Any, backend: Any, config: Any) -> MlaModel:
        mla = MlaConfig.from_dict(checkpoint.config, source=checkpoint.fields.source)
        max_model_len = config.max_model_len or mla.max_position_embeddings
        if max_model_len > mla.max_position_embeddings:
            raise ConfigError(
                f"max_model_len={max_model_len} exceeds the checkpoint's max_position_embeddings="
                f"{mla.max_position_embeddings}"
            )
        model = MlaModel(mla, checkpoint, backend, max_model_len)
        unused = checkpoint.unconsumed()
        if unused:
            logger.warning("%s: %d tensors are not used by the MLA family: %s", checkpoint.path, len(unused), unused[:8])
        return model


plugin = MlaPlugin()
