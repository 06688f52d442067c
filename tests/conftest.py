"""Shared fixtures: tiny random-weight Hugging Face checkpoints of the dense and MLA families."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest


def pytest_configure(config):
    """Kernels run under numba's CUDA simulator unless the run selects GPU tests (-m gpu). The
    host's matrix libraries run one thread a test process (unless the environment says otherwise):
    the tests' products are small, and with a process per core (``-n auto``) their own thread
    pools only contend for the cores (several times slower)."""
    if "gpu" in (config.getoption("markexpr") or "").replace("not gpu", ""):
        return
    # NumPy's BLAS is loaded by now (the plugins import it): limited where it runs; torch's
    # thread pool takes OMP_NUM_THREADS when torch is first imported.
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    threads = os.environ["OMP_NUM_THREADS"].split(",")[0].strip()
    if threads.isdigit() and int(threads) > 0:
        from threadpoolctl import threadpool_limits

        threadpool_limits(limits=int(threads))
    if "numba" in sys.modules and os.environ.get("NUMBA_ENABLE_CUDASIM") != "1":
        raise pytest.UsageError("numba was imported before the CUDA simulator could be enabled")
    os.environ["NUMBA_ENABLE_CUDASIM"] = "1"
    # The simulator's block manager polls its threads while holding the GIL; a short switch
    # interval lets the simulated threads reach their barriers sooner.
    sys.setswitchinterval(5e-5)
    # Each block's shared arrays made once, under a lock (the simulator's own lookup races).
    from metrale.testing.kernel_check import serialize_simulated_shared_arrays

    serialize_simulated_shared_arrays()


BASE = dict(
    vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=3, num_attention_heads=4,
    max_position_embeddings=256,
)


def dense_configs():
    """(name, model class, config) of the four dense variants docs/families.rst lists ("Checking against transformers")."""
    from transformers import (
        LlamaConfig,
        LlamaForCausalLM,
        MistralConfig,
        MistralForCausalLM,
        Qwen2Config,
        Qwen2ForCausalLM,
        Qwen3Config,
        Qwen3ForCausalLM,
    )

    llama3 = {"rope_type": "llama3", "rope_theta": 5e5, "factor": 8.0, "low_freq_factor": 1.0,
              "high_freq_factor": 4.0, "original_max_position_embeddings": 16}
    return {
        "llama": (LlamaForCausalLM, LlamaConfig(**BASE, num_key_value_heads=2, rms_norm_eps=1e-5, rope_parameters=llama3)),
        "qwen2": (Qwen2ForCausalLM, Qwen2Config(**BASE, num_key_value_heads=2, rope_theta=1e6, tie_word_embeddings=True)),
        "qwen3": (Qwen3ForCausalLM, Qwen3Config(**BASE, num_key_value_heads=2, head_dim=32)),
        "mistral": (MistralForCausalLM, MistralConfig(**BASE, num_key_value_heads=1, sliding_window=4)),
    }


@pytest.fixture(scope="session")
def dense_checkpoints(tmp_path_factory) -> dict[str, Path]:
    """One float32 checkpoint folder per dense variant."""
    from metrale.testing.hf import build_hf_checkpoint

    root = tmp_path_factory.mktemp("dense")
    return {
        name: build_hf_checkpoint(cls, config, root / name, seed=index)
        for index, (name, (cls, config)) in enumerate(dense_configs().items())
    }


@pytest.fixture(params=["llama", "qwen2", "qwen3", "mistral"])
def dense_checkpoint(request, dense_checkpoints) -> Path:
    return dense_checkpoints[request.param]


MLA_BASE = dict(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=3, num_attention_heads=4,
            max_position_embeddings=256)
MLA_FIELDS = dict(num_key_value_heads=4, kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=12,
           n_routed_experts=8, num_experts_per_tok=3, moe_intermediate_size=24, first_k_dense_replace=1)


def mla_configs():
    """(model class, config) of the DeepSeek-V2 (group-limited routing, YaRN, no q LoRA) and
    DeepSeek-V3 (q LoRA, sigmoid routing with bias, YaRN with mscale != mscale_all_dim) tests."""
    from transformers import DeepseekV2Config, DeepseekV2ForCausalLM, DeepseekV3Config, DeepseekV3ForCausalLM

    yarn = {"type": "yarn", "rope_type": "yarn", "original_max_position_embeddings": 64, "beta_fast": 32,
            "beta_slow": 1, "rope_theta": 10000.0}
    return {
        "deepseek_v2": (DeepseekV2ForCausalLM, DeepseekV2Config(
            **MLA_BASE, **MLA_FIELDS, q_lora_rank=None, n_shared_experts=2, topk_method="group_limited_greedy", n_group=4,
            topk_group=2, routed_scaling_factor=1.5,
            rope_scaling={**yarn, "factor": 4.0, "mscale": 0.707, "mscale_all_dim": 0.707})),
        "deepseek_v3": (DeepseekV3ForCausalLM, DeepseekV3Config(
            **MLA_BASE, **MLA_FIELDS, q_lora_rank=24, n_shared_experts=1, n_group=4, topk_group=2, routed_scaling_factor=2.5,
            rope_scaling={**yarn, "factor": 40.0, "mscale": 1.0, "mscale_all_dim": 0.8})),
    }


def build_mla_checkpoint(model_class, config, path, seed, dtype=None):
    """Perturbed weights, and a router bias that is not zero (a buffer the generic perturbation skips)."""
    import torch

    from metrale.testing.hf import perturb_weights

    torch.manual_seed(seed)
    model = model_class(config).eval()
    perturb_weights(model, seed)
    generator = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, buffer in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                buffer.copy_(0.3 * torch.randn(buffer.shape, generator=generator))
    if dtype is not None:
        model = model.to(dtype)
    model.save_pretrained(path)
    return path


@pytest.fixture(scope="session")
def mla_checkpoints(tmp_path_factory):
    """Tiny perturbed DeepSeek-V2 and DeepSeek-V3 checkpoint folders."""
    root = tmp_path_factory.mktemp("mla")
    return {name: build_mla_checkpoint(cls, config, root / name, seed=20 + index)
            for index, (name, (cls, config)) in enumerate(mla_configs().items())}


def training_tool():
    """``tools/checkpoints/train_tiny_models.py`` as a module (its MTP module is the reference of the engine's)."""
    import importlib.util
    import sys

    path = Path(__file__).resolve().parents[1] / "tools" / "checkpoints" / "train_tiny_models.py"
    spec = importlib.util.spec_from_file_location("metrale_tools_train_tiny_models", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="session")
def mla_mtp_checkpoint(mla_checkpoints, tmp_path_factory):
    """(folder, reference model, reference MTP module): the tiny DeepSeek-V3 checkpoint with a
    perturbed multi-token-prediction module added as ``model.layers.{L}.*`` (float32)."""
    import json
    import shutil

    import torch
    from safetensors.torch import load_file, save_file
    from transformers import DeepseekV3ForCausalLM

    from metrale.testing.hf import perturb_weights

    source = mla_checkpoints["deepseek_v3"]
    folder = tmp_path_factory.mktemp("mtp") / "deepseek_v3"
    shutil.copytree(source, folder)
    model = DeepseekV3ForCausalLM.from_pretrained(source, torch_dtype=torch.float32).eval()
    tool = training_tool()
    mtp = tool.mtp_module(model).float().eval()
    perturb_weights(mtp, 41)
    tensors = load_file(folder / "model.safetensors")
    tensors.update({name: value.float() for name, value in tool.mtp_tensors(mtp, model.config).items()})
    save_file(tensors, folder / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((folder / "config.json").read_text())
    config["num_nextn_predict_layers"] = 1
    (folder / "config.json").write_text(json.dumps(config))
    return folder, model, mtp


def gdn_config():
    """(model class, config) of the tiny Qwen3-Next test: two GDN and two gated-attention layers
    (interval 2), MoE everywhere but a dense layer 2 (docs/families.rst, "Checking against transformers")."""
    from transformers import Qwen3NextConfig, Qwen3NextForCausalLM

    return Qwen3NextForCausalLM, Qwen3NextConfig(
        **{**BASE, "num_hidden_layers": 4}, num_key_value_heads=2, head_dim=16, linear_conv_kernel_dim=4,
        linear_key_head_dim=8, linear_value_head_dim=16, linear_num_key_heads=2, linear_num_value_heads=4,
        num_experts=8, num_experts_per_tok=3, moe_intermediate_size=24, shared_expert_intermediate_size=40,
        full_attention_interval=2, mlp_only_layers=[2])


@pytest.fixture(scope="session")
def gdn_checkpoint(tmp_path_factory):
    """A tiny perturbed Qwen3-Next checkpoint folder (zero-centred norms around 0)."""
    from metrale.testing.hf import build_hf_checkpoint

    cls, config = gdn_config()
    return build_hf_checkpoint(cls, config, tmp_path_factory.mktemp("gdn") / "qwen3_next", seed=30,
                               zero_centred_norms=True)



@pytest.fixture(scope="session")
def gdn_mtp_checkpoint(gdn_checkpoint, tmp_path_factory):
    """(folder, reference model, reference MTP module): the tiny Qwen3-Next checkpoint with a
    perturbed multi-token-prediction module added as ``mtp.*`` (float32)."""
    import shutil

    import torch
    from safetensors.torch import load_file, save_file
    from transformers import Qwen3NextForCausalLM

    from metrale.testing.hf import perturb_weights

    folder = tmp_path_factory.mktemp("gdn-mtp") / "qwen3_next"
    shutil.copytree(gdn_checkpoint, folder)
    model = Qwen3NextForCausalLM.from_pretrained(gdn_checkpoint, torch_dtype=torch.float32).eval()
    tool = training_tool()
    mtp = tool.mtp_module(model).float().eval()
    perturb_weights(mtp, 43, zero_centred_norms=True)
    tensors = load_file(folder / "model.safetensors")
    tensors.update({name: value.float() for name, value in tool.mtp_tensors(mtp, model.config).items()})
    save_file(tensors, folder / "model.safetensors", metadata={"format": "pt"})
    return folder, model, mtp


# ============================================================ corrupt copies of the embedded models


@pytest.fixture
def family_checkpoint_of(request):
    """``checkpoint(family, variant=None)``: the tiny checkpoint of ``family`` ("dense": a
    ``dense_checkpoints`` variant, Llama by default; "mla": an ``mla_checkpoints`` one,
    DeepSeek-V2 by default; "gdn": the Qwen3-Next one)."""

    def checkpoint(family, variant=None):
        if family == "gdn":
            return request.getfixturevalue("gdn_checkpoint")
        fixture, default = {"dense": ("dense_checkpoints", "llama"), "mla": ("mla_checkpoints", "deepseek_v2")}[family]
        return request.getfixturevalue(fixture)[variant or default]

    return checkpoint


@pytest.fixture(scope="session")
def warm_plugin_manager():
    """A plugin manager shared by the bad-checkpoint tests, after one good load has imported every
    module a load needs (so that their imports do not count in a load's memory peak)."""
    import metrale
    from metrale.model.plugin_manager import get_plugin_manager

    manager = get_plugin_manager()
    for name in ("tiny-dense", "tiny-mla", "tiny-gdn"):
        metrale.LLM(name, device="cpu", show_progress=False, plugin_manager=manager)
    return manager


def edited_copy(model: str, folder: Path, edit=None) -> Path:
    """A copy of the embedded checkpoint ``model`` in ``folder``, its config.json passed through
    ``edit`` (which changes the dict in place, or returns the new JSON value)."""
    import json
    import shutil

    from metrale.models import embedded_model_path

    shutil.copytree(embedded_model_path(model), folder)
    if edit is not None:
        config = json.loads((folder / "config.json").read_text())
        edited = edit(config)
        (folder / "config.json").write_text(json.dumps(config if edited is None else edited))
    return folder


def set_fields(**fields):
    """An ``edit`` for :func:`edited_copy`: set top-level fields (None writes ``null``); ``__`` in
    a name reaches into a section (``rope_parameters__factor``)."""

    def edit(config):
        for name, value in fields.items():
            *sections, last = name.split("__")
            target = config
            for section in sections:
                target = target.setdefault(section, {})
            target[last] = value

    return edit


def load_refused(path: Path, match: str, manager, *, peak_mb: float = 64, seconds: float = 5.0):
    """Load ``path`` on the CPU and expect a :class:`CheckpointError` matching ``match``, raised
    before more than ``peak_mb`` MB were allocated (tracemalloc) and within ``seconds``."""
    import time
    import tracemalloc

    import metrale
    from metrale.errors import CheckpointError

    tracemalloc.start()
    start = time.perf_counter()
    try:
        with pytest.raises(CheckpointError, match=match) as info:
            metrale.LLM(path, device="cpu", show_progress=False, plugin_manager=manager)
    finally:
        elapsed = time.perf_counter() - start
        peak = tracemalloc.get_traced_memory()[1]
        tracemalloc.stop()
    assert peak < peak_mb * 2**20, f"{peak / 2**20:.0f} MB allocated before the refusal: {info.value}"
    assert elapsed < seconds, f"the refusal took {elapsed:.1f} s: {info.value}"
    return info.value


# ----------------------------------------------------------------------- the MoE family
# Tiny MoE checkpoints written by transformers: Qwen3-MoE (QK-norm, renormalised top-k, a dense
# layer among the sparse ones), Qwen2-MoE (attention biases, the gated shared expert, sparse every
# second layer) and Mixtral (its expert names, a sliding window shorter than the prompts).

MOE_BASE = dict(vocab_size=128, hidden_size=64, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
                max_position_embeddings=256, rms_norm_eps=1e-6)


def moe_configs():
    from transformers import (
        MixtralConfig,
        MixtralForCausalLM,
        Qwen2MoeConfig,
        Qwen2MoeForCausalLM,
        Qwen3MoeConfig,
        Qwen3MoeForCausalLM,
    )

    return {
        "qwen3_moe": (Qwen3MoeForCausalLM, Qwen3MoeConfig(
            **MOE_BASE, head_dim=16, intermediate_size=96, moe_intermediate_size=32, num_experts=8,
            num_experts_per_tok=3, norm_topk_prob=True, mlp_only_layers=[1])),
        "qwen2_moe": (Qwen2MoeForCausalLM, Qwen2MoeConfig(
            **MOE_BASE, intermediate_size=96, moe_intermediate_size=32, shared_expert_intermediate_size=48,
            num_experts=6, num_experts_per_tok=2, decoder_sparse_step=2, tie_word_embeddings=True)),
        "mixtral": (MixtralForCausalLM, MixtralConfig(
            **MOE_BASE, intermediate_size=48, num_local_experts=4, num_experts_per_tok=2, sliding_window=8)),
    }


@pytest.fixture(scope="session")
def moe_checkpoints(tmp_path_factory):
    from metrale.testing.hf import build_hf_checkpoint

    root = tmp_path_factory.mktemp("moe")
    return {name: build_hf_checkpoint(cls, config, root / name, seed=40 + index)
            for index, (name, (cls, config)) in enumerate(moe_configs().items())}


@pytest.fixture(params=["qwen3_moe", "qwen2_moe", "mixtral"])
def moe_checkpoint(request, moe_checkpoints):
    return moe_checkpoints[request.param]


# Tiny random-weight Gemma-2 and Gemma-3 checkpoints written by transformers (float32, zero-centred
# norms as Gemma stores them): prompts of 40 tokens pass their 8-token sliding windows, and the
# soft caps are small enough to bend the random logits.
GEMMA_BASE = dict(vocab_size=128, hidden_size=64, intermediate_size=96, num_attention_heads=4, num_key_value_heads=2,
                  head_dim=16, max_position_embeddings=256, rms_norm_eps=1e-6, sliding_window=8,
                  query_pre_attn_scalar=24)


def gemma_configs():
    from transformers import Gemma2Config, Gemma2ForCausalLM, Gemma3ForCausalLM, Gemma3TextConfig

    return {
        "gemma2": (Gemma2ForCausalLM, Gemma2Config(
            **GEMMA_BASE, num_hidden_layers=4, attn_logit_softcapping=3.0, final_logit_softcapping=5.0)),
        "gemma3": (Gemma3ForCausalLM, Gemma3TextConfig(
            **GEMMA_BASE, num_hidden_layers=4,
            layer_types=["sliding_attention", "full_attention", "sliding_attention", "full_attention"],
            rope_parameters={"full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1_000_000.0},
                             "sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0}})),
    }


def build_gemma(name, folder, seed, dtype=None):
    from metrale.testing.hf import build_hf_checkpoint

    cls, config = gemma_configs()[name]
    return build_hf_checkpoint(cls, config, folder, seed=seed, dtype=dtype, zero_centred_norms=True)


@pytest.fixture(scope="session")
def gemma_checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("gemma")
    return {name: build_gemma(name, root / name, seed=60 + index) for index, name in enumerate(gemma_configs())}


@pytest.fixture(params=["gemma2", "gemma3"])
def gemma_checkpoint(request, gemma_checkpoints):
    return gemma_checkpoints[request.param]


# ----------------------------------------------------------------------- the GPT-OSS family
# Tiny random-weight GPT-OSS checkpoints written by transformers (float32; sinks and expert biases
# perturbed like every weight): "gpt_oss" alternates 8-token sliding windows with full layers,
# runs YaRN (truncate false, as the released config) past a 16-token original context, and clamps
# its SwiGLU at 0.75, where these weights reach past the clamps; "gpt_oss_mqa" has one key/value
# head, top-1 routing, plain RoPE and layer_types of its own.
GPT_OSS_BASE = dict(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=4, num_attention_heads=4,
                    head_dim=16, num_local_experts=4, max_position_embeddings=256, sliding_window=8)


def gpt_oss_configs():
    from transformers import GptOssConfig, GptOssForCausalLM

    yarn = {"rope_type": "yarn", "factor": 16.0, "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False,
            "original_max_position_embeddings": 16, "rope_theta": 150000.0}
    return {
        "gpt_oss": (GptOssForCausalLM, GptOssConfig(
            **GPT_OSS_BASE, num_key_value_heads=2, num_experts_per_tok=2, swiglu_limit=0.75, rope_parameters=yarn)),
        "gpt_oss_mqa": (GptOssForCausalLM, GptOssConfig(
            **GPT_OSS_BASE, num_key_value_heads=1, num_experts_per_tok=1, swiglu_limit=1.0,
            layer_types=["full_attention", "sliding_attention", "sliding_attention", "full_attention"],
            rope_parameters={"rope_type": "default", "rope_theta": 10000.0})),
    }


@pytest.fixture(scope="session")
def gpt_oss_checkpoints(tmp_path_factory):
    from metrale.testing.hf import build_hf_checkpoint

    root = tmp_path_factory.mktemp("gpt-oss")
    return {name: build_hf_checkpoint(cls, config, root / name, seed=80 + index)
            for index, (name, (cls, config)) in enumerate(gpt_oss_configs().items())}


@pytest.fixture(params=["gpt_oss", "gpt_oss_mqa"])
def gpt_oss_checkpoint(request, gpt_oss_checkpoints):
    return gpt_oss_checkpoints[request.param]
