"""The built-in GDN family passes the conformance kit against transformers."""

from __future__ import annotations

import pytest

from metrale.testing import FamilyConformance
from metrale.testing.hf import hf_reference_logits


class TestGdnConformance(FamilyConformance):
    tensor_parallel_sizes = (2,)
    expert_parallel = True
    chunk_sizes = (1, 5, 16, 64)
    prompt_lengths = (1, 7, 40, 150)  # 150: the chunked rule runs three chunks of 64

    @pytest.fixture(scope="class")
    @classmethod
    def conformance_checkpoint(cls, gdn_checkpoint):
        return gdn_checkpoint

    def reference_logits(self, checkpoint, token_ids):
        return hf_reference_logits(checkpoint, token_ids)
