"""The built-in MLA family passes the conformance kit against transformers."""

from __future__ import annotations

import pytest

from metrale.testing import FamilyConformance
from metrale.testing.hf import hf_reference_logits


class TestMlaConformance(FamilyConformance):
    tensor_parallel_sizes = (2, 4)
    expert_parallel = True
    @pytest.fixture(scope="class", params=["deepseek_v2", "deepseek_v3"])
    @classmethod
    def conformance_checkpoint(cls, request, mla_checkpoints):
        return mla_checkpoints[request.param]

    def reference_logits(self, checkpoint, token_ids):
        return hf_reference_logits(checkpoint, token_ids)
