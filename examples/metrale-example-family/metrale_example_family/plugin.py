"""The plugin object Metrale finds through the ``metrale`` entry point group."""

from __future__ import annotations

from typing import Any

from metrale.family import FamilyPlugin, FamilySpec

from metrale_example_family.model import ParallelBlockModel


class ParallelBlockPlugin(FamilyPlugin):
    #: The forward-contract version this plugin was written against.
    METRALE_CONTRACT_VERSION = "1.0"
    family = FamilySpec(
        name="parallel_block",
        architectures=("ParallelBlockForCausalLM",),
        model_types=("parallel_block",),
        description="decoder whose layers add attention and MLP in parallel",
    )
    model_class = ParallelBlockModel

    def load_model(self, checkpoint: Any, backend: Any, config: Any) -> ParallelBlockModel:
        return ParallelBlockModel(checkpoint, backend, config.max_model_len)


plugin = ParallelBlockPlugin()
