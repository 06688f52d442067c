"""The built-in MoE family passes the conformance kit against transformers."""

from __future__ import annotations

import pytest

from metrale.testing import FamilyConformance
from metrale.testing.hf import hf_reference_logits


class TestMoeConformance(FamilyConformance):
    tensor_parallel_sizes = (2,)
    expert_parallel = True

    @pytest.fixture(scope="class", params=["qwen3_moe", "qwen2_moe", "mixtral"])
    @classmethod
    def conformance_checkpoint(cls, request, moe_checkpoints):
        return moe_checkpoints[request.param]

    def reference_logits(self, checkpoint, token_ids):
        return hf_reference_logits(checkpoint, token_ids)
