"""The OLMo-2 family passes the conformance kit against transformers: with and without attention
biases, and as 2 and 4 simulated tensor-parallel ranks (with 4, the 2 key/value heads are each
held by two ranks, whose whole-projection key norm must count them once)."""

from __future__ import annotations

import olmo2_fixtures
import pytest

from metrale.testing import FamilyConformance
from metrale.testing.hf import hf_reference_logits

olmo2_checkpoints = olmo2_fixtures.olmo2_checkpoints


class TestOlmo2Conformance(FamilyConformance):
    tensor_parallel_sizes = (2, 4)

    @pytest.fixture(scope="class", params=olmo2_fixtures.VARIANTS)
    @classmethod
    def conformance_checkpoint(cls, request, olmo2_checkpoints):
        return olmo2_checkpoints[request.param]

    def reference_logits(self, checkpoint, token_ids):
        return hf_reference_logits(checkpoint, token_ids)
