"""The Phi-3 family passes the conformance kit against transformers, tensor-parallel included:
the plain checkpoint, and the LongRoPE one with prompts past its pretraining context (served with
its whole context, so with the long factors, as transformers scores them)."""

from __future__ import annotations

import pytest

from metrale.testing import FamilyConformance
from metrale.testing.hf import hf_reference_logits

from .conftest import ORIGINAL_CONTEXT


class TestPhi3Conformance(FamilyConformance):
    tensor_parallel_sizes = (2,)

    @pytest.fixture(scope="class")
    @classmethod
    def conformance_checkpoint(cls, phi3_checkpoints):
        return phi3_checkpoints["phi3"]

    def reference_logits(self, checkpoint, token_ids):
        return hf_reference_logits(checkpoint, token_ids)


class TestPhi4MiniConformance(TestPhi3Conformance):
    prompt_lengths = (ORIGINAL_CONTEXT + 1, 40, 57)

    @pytest.fixture(scope="class")
    @classmethod
    def conformance_checkpoint(cls, phi3_checkpoints):
        return phi3_checkpoints["phi4_mini"]
