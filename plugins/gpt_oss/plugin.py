"""Hook implementations of the GPT-OSS family."""

from __future__ import annotations

from metrale.model.family import FamilyPlugin, FamilySpec
from metrale.model.hookspecs import CONTRACT_VERSION
from metrale.plugins.gpt_oss.config import GptOssConfig
from metrale.plugins.gpt_oss.model import GptOssModel

GPT_OSS_FAMILY = FamilySpec(
    name="gpt_oss",
    architectures=("GptOssForCausalLM",),
    model_types=("gpt_oss",),
    description="GPT-OSS: GQA attention with sinks and alternating sliding windows, clamped-SwiGLU experts (bf16 or MXFP4)",
)


class GptOssPlugin(FamilyPlugin):
    METRALE_CONTRACT_VERSION = CONTRACT_VERSION
    family = GPT_OSS_FAMILY
    model_class = GptOssModel
    config_class = GptOssConfig


plugin = GptOssPlugin()
