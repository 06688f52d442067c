"""The built-in dense family passes the conformance kit against transformers."""

from __future__ import annotations

import pytest

from metrale.testing import FamilyConformance
from metrale.testing.hf import hf_reference_logits


class TestDenseConformance(FamilyConformance):
    tensor_parallel_sizes = (2, 4)
    @pytest.fixture(scope="class", params=["llama", "qwen2", "qwen3", "mistral"])
    @classmethod
    def conformance_checkpoint(cls, request, dense_checkpoints):
        return dense_checkpoints[request.param]

    def reference_logits(self, checkpoint, token_ids):
        return hf_reference_logits(checkpoint, token_ids)
