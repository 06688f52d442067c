"""The example family passes Metrale's conformance kit against its own NumPy reference."""

from __future__ import annotations

import pytest
from metrale.testing import FamilyConformance

from reference import build_checkpoint, reference_logits


class TestParallelBlockConformance(FamilyConformance):
    @pytest.fixture(scope="class")
    @classmethod
    def conformance_checkpoint(cls, tmp_path_factory):
        return build_checkpoint(tmp_path_factory.mktemp("parallel_block"))

    def reference_logits(self, checkpoint, token_ids):
        return reference_logits(checkpoint, token_ids)
