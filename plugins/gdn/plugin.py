"""Hook implementations of the GDN hybrid family."""

from __future__ import annotations

import logging
from typing import Any

from metrale.errors import ConfigError
from metrale.family import FamilyPlugin, FamilySpec
from metrale.hookspecs import CONTRACT_VERSION
from metrale.plugins.gdn.config import GdnConfig
from metrale.plugins.gdn.model import GdnModel

logger = logging.getLogger(__name__)

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

    def load_model(self, checkpoint: Any, backend: Any, config: Any) -> GdnModel:
        gdn = GdnConfig.from_dict(checkpoint.config, source=checkpoint.fields.source)
        max_model_len = config.max_model_len or gdn.max_position_embeddings
        if max_model_len > gdn.max_position_embeddings:
            raise ConfigError(
                f"max_model_len={max_model_len} exceeds the checkpoint's max_position_embeddings="
                f"{gdn.max_position_embeddings}"
            )
        model = GdnModel(gdn, checkpoint, backend, max_model_len)
        unused = checkpoint.unconsumed()
        if unused:
            logger.warning("%s: %d tensors are not used by the GDN family: %s", checkpoint.path, len(unused), unused[:8])
        return model


plugin = GdnPlugin()
