"""The built-in GPT-OSS family passes the conformance kit against transformers, tensor-parallel
over two ranks with the experts' intermediate size split and with expert parallelism."""

from __future__ import annotations

import pytest

from metrale.testing import FamilyConformance
from metrale.testing.hf import hf_reference_logits


class TestGptOssConformance(FamilyConformance):
    prompt_lengths = (1, 9, 40)
    tensor_parallel_sizes = (2,)
    expert_parallel = True

    @pytest.fixture(scope="class", params=["gpt_oss", "gpt_oss_mqa"])
    @classmethod
    def conformance_checkpoint(cls, request, gpt_oss_checkpoints):
        return gpt_oss_checkpoints[request.param]

    def reference_logits(self, checkpoint, token_ids):
        return hf_reference_logits(checkpoint, token_ids)
