"""The built-in Gemma family passes the conformance kit against transformers."""

from __future__ import annotations

import pytest

from metrale.testing import FamilyConformance
from metrale.testing.hf import hf_reference_logits


class TestGemmaConformance(FamilyConformance):
    tensor_parallel_sizes = (2,)

    @pytest.fixture(scope="class", params=["gemma2", "gemma3"])
    @classmethod
    def conformance_checkpoint(cls, request, gemma_checkpoints):
        return gemma_checkpoints[request.param]

    def reference_logits(self, checkpoint, token_ids):
        return hf_reference_logits(checkpoint, token_ids)
