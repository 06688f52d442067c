"""``metrale bench``: decode and prefill throughput on the GPU, beside Hugging Face transformers.

For each model shape the benchmark builds a bf16 checkpoint with random weights (no download),
loads it into Metrale (timing load and graph capture), times batched decode steps with CUDA
events (median step time) and whole-prompt prefills, and runs the same measurements on
transformers in the same process. Decode is memory-bound: the floor of one step is the bytes it
must read (every weight once, plus the KV cache) over the device-to-device copy bandwidth
measured at the start of the run.

Decode is timed two ways. ``decode_bN`` is one step at a time: the forward, the device sampler and
the tokens read back before the next step starts, so the host's work between steps is on the
clock. ``decode_bN_loop`` is the step as :meth:`~metrale.entrypoints.llm.LLM.generate` runs it (overlap
scheduling: the next step is queued while one runs): the median time between the starts of
consecutive decode graph replays of ``N`` rows while ``N`` sequences decode together.
"""

from __future__ import annotations

import json
import statistics
import time
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any, Callable

SHAPES: dict[str, dict[str, Any]] = {
    "llama-1b": dict(  # Llama-3.2-1B
        vocab_size=128256, hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
        num_attention_heads=32, num_key_value_heads=8, head_dim=64, tie_word_embeddings=True,
        rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0, "factor": 32.0, "low_freq_factor": 1.0,
                         "high_freq_factor": 4.0, "original_max_position_embeddings": 8192},
    ),
    "llama-8b": dict(  # Llama-3.1-8B
        vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
        num_attention_heads=32, num_key_value_heads=8, head_dim=128, tie_word_embeddings=False,
        rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
                         "high_freq_factor": 4.0, "original_max_position_embeddings": 8192},
    ),
    "llama-70b": dict(  # Llama-3.1-70B: 141 GB in bf16, more than one H200 holds
        vocab_size=128256, hidden_size=8192, intermediate_size=28672, num_hidden_layers=80,
        num_attention_heads=64, num_key_value_heads=8, head_dim=128, tie_word_embeddings=False,
        rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
                         "high_freq_factor": 4.0, "original_max_position_embeddings": 8192},
    ),
}

#: Shapes too large for one GPU in bf16: benchmarked only in the ``--quantization`` formats, their
#: checkpoints written straight in those formats with their codes left as holes of sparse files
#: (no bf16 checkpoint, no bf16 or transformers run, no accuracy).
QUANTIZED_ONLY_SHAPES = ("llama-70b",)

#: MLA shapes (built as DeepseekV2ForCausalLM checkpoints).
MLA_SHAPES: dict[str, dict[str, Any]] = {
    "deepseek-v2-lite": dict(  # DeepSeek-V2-Lite: 15.7 B parameters, 2.4 B activated per token
        vocab_size=102400, hidden_size=2048, intermediate_size=10944, num_hidden_layers=27, num_attention_heads=16,
        num_key_value_heads=16, q_lora_rank=None, kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64,
        v_head_dim=128, moe_intermediate_size=1408, n_routed_experts=64, num_experts_per_tok=6, n_shared_experts=2,
        first_k_dense_replace=1, topk_method="greedy", n_group=1, topk_group=1, routed_scaling_factor=1.0,
        tie_word_embeddings=False, max_position_embeddings=163840,
        rope_scaling={"type": "yarn", "rope_type": "yarn", "factor": 40.0, "original_max_position_embeddings": 4096,
                      "beta_fast": 32, "beta_slow": 1, "mscale": 0.707, "mscale_all_dim": 0.707,
                      "rope_theta": 10000.0},
    ),
}
SHAPES.update(MLA_SHAPES)

#: Qwen3-Next-like shapes (Qwen3NextForCausalLM checkpoints): the 80B model's kinds of layers and
#: widths, with fewer layers and experts so that it fits one GPU.
GDN_SHAPES: dict[str, dict[str, Any]] = {
    "qwen3-next-small": dict(  # 12 layers (9 Gated DeltaNet, 3 gated attention), 128 experts: 5.9 B parameters
        vocab_size=151936, hidden_size=2048, intermediate_size=5120, num_hidden_layers=12, num_attention_heads=16,
        num_key_value_heads=2, head_dim=256, linear_conv_kernel_dim=4, linear_key_head_dim=128,
        linear_value_head_dim=128, linear_num_key_heads=16, linear_num_value_heads=32, num_experts=128,
        num_experts_per_tok=10, moe_intermediate_size=512, shared_expert_intermediate_size=512,
        full_attention_interval=4, tie_word_embeddings=False, max_position_embeddings=262144,
    ),
}
SHAPES.update(GDN_SHAPES)

#: Routed-experts shapes with dense GQA attention: the released models' widths, experts and
#: attention, with half their layers so that a bf16 checkpoint fits the GPU machine's disk (the
#: floors count the layers built).
MOE_SHAPES: dict[str, dict[str, Any]] = {
    "qwen3-30b-a3b": dict(  # Qwen3-30B-A3B, 24 of its 48 layers: 15.6 B parameters
        model_type="qwen3_moe", vocab_size=151936, hidden_size=2048, intermediate_size=6144, num_hidden_layers=24,
        num_attention_heads=32, num_key_value_heads=4, head_dim=128, num_experts=128, num_experts_per_tok=8,
        moe_intermediate_size=768, norm_topk_prob=True, tie_word_embeddings=False, rope_theta=1000000.0,
        max_position_embeddings=40960,
    ),
    "gpt-oss-20b": dict(  # gpt-oss-20b in bf16, 12 of its 24 layers: 11.0 B parameters
        model_type="gpt_oss", vocab_size=201088, hidden_size=2880, intermediate_size=2880, num_hidden_layers=12,
        num_attention_heads=64, num_key_value_heads=8, head_dim=64, num_local_experts=32, num_experts_per_tok=4,
        sliding_window=128, attention_bias=True, tie_word_embeddings=False, max_position_embeddings=131072,
        rope_parameters={"rope_type": "yarn", "rope_theta": 150000.0, "factor": 32.0, "beta_fast": 32.0,
                         "beta_slow": 1.0, "original_max_position_embeddings": 4096, "truncate": False},
    ),
}
SHAPES.update(MOE_SHAPES)


@dataclass
class BenchOptions:
    shapes: tuple[str, ...] = ("llama-1b", "llama-8b")
    batch_sizes: tuple[int, ...] = (1, 32)
    context: int = 512  # tokens already cached when the timed decode steps start
    decode_steps: int = 64
    prefill_lengths: tuple[int, ...] = (512, 2048)
    #: ``(cached, new)``: also time a chunk of ``new`` prompt tokens after ``cached`` ones (None: not).
    prefix_chunk: tuple[int, int] | None = None
    hf: bool = True
    hf_compile: bool = False
    hf_decode_tokens: int = 32
    #: Each shape's cold (every compilation cache empty) and cached start (:func:`start_times`).
    start_times: bool = True
    workdir: Path = Path("/tmp/metrale-bench")
    output: Path | None = None
    #: Quantized formats timed beside bf16 (:data:`metrale.benchmarks.quantized.FORMATS`).
    quantization: tuple[str, ...] = ()
    #: Also time the bf16 model with an FP8 KV cache (``kv_cache_dtype="fp8"``), beside the bf16 cache.
    kv_cache_fp8: bool = False
    #: Also time the model in batch-invariant mode (``batch_invariant=True``), beside the default, and
    #: check that its greedy tokens are the same alone and batched (:func:`bench_batch_invariant`).
    batch_invariant: bool = False


def _progress(total: int, description: str):
    from tqdm.auto import tqdm

    return tqdm(total=total, desc=description, leave=False)


def _cuda_time(function: Callable[[], Any], repeats: int, warmup: int = 2, stream: Any = None) -> float:
    """Median seconds of ``function`` measured with CUDA events on ``stream`` (after ``warmup``
    calls); ``stream`` None is CuPy's current stream."""
    import cupy

    stream = stream or cupy.cuda.get_current_stream()
    for _ in range(warmup):
        function()
    times = []
    for _ in range(repeats):
        start, stop = cupy.cuda.Event(), cupy.cuda.Event()
        start.record(stream)
        function()
        stop.record(stream)
        stop.synchronize()
        times.append(cupy.cuda.get_elapsed_time(start, stop) / 1000.0)
    return statistics.median(times)


def copy_bandwidth() -> float:
    """Device-to-device copy bandwidth in bytes/s (bytes read + written), 4 GiB buffers."""
    import cupy

    source = cupy.ones(1 << 31, dtype=cupy.uint16)
    target = cupy.empty_like(source)
    seconds = _cuda_time(lambda: target.__setitem__(slice(None), source), repeats=10)
    return 2 * source.nbytes / seconds


def model_config(shape: str) -> tuple[Any, Any]:
    """``(config, model class)`` of ``shape``'s transformers model."""
    if shape in MLA_SHAPES:
        from transformers import DeepseekV2Config, DeepseekV2ForCausalLM

        return DeepseekV2Config(**SHAPES[shape], rms_norm_eps=1e-6), DeepseekV2ForCausalLM
    if shape in GDN_SHAPES:
        from transformers import Qwen3NextConfig, Qwen3NextForCausalLM

        return Qwen3NextConfig(**SHAPES[shape], rms_norm_eps=1e-6), Qwen3NextForCausalLM
    if shape in MOE_SHAPES:
        fields = {key: value for key, value in SHAPES[shape].items() if key != "model_type"}
        if SHAPES[shape]["model_type"] == "gpt_oss":
            from transformers import GptOssConfig, GptOssForCausalLM

            return GptOssConfig(**fields, rms_norm_eps=1e-5), GptOssForCausalLM
        from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

        return Qwen3MoeConfig(**fields, rms_norm_eps=1e-6), Qwen3MoeForCausalLM
    from transformers import LlamaConfig, LlamaForCausalLM

    return LlamaConfig(**SHAPES[shape], max_position_embeddings=131072, rms_norm_eps=1e-5), LlamaForCausalLM


def build_checkpoint(shape: str, folder: Path) -> Path:
    """Save a random-weight bf16 checkpoint of ``shape`` (Llama, or DeepSeek-V2 for the MLA
    shapes; built on the GPU)."""
    import torch

    if (folder / "config.json").exists():
        return folder
    config, model_class = model_config(shape)
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = model_class(config).to(torch.bfloat16)
    model.save_pretrained(folder)
    del model
    torch.cuda.empty_cache()
    return folder


def expected_experts(experts: int, top_k: int, batch: int) -> float:
    """Distinct experts a step of ``batch`` tokens reads, each token choosing ``top_k`` of
    ``experts`` uniformly: ``E (1 - (1 - k/E)^B)``."""
    return experts * (1.0 - (1.0 - top_k / experts) ** batch)


def weight_bytes(shape: str, batch: int | None = None) -> int:
    """bf16 bytes of the weights a decode step of ``batch`` tokens reads (None: every weight).

    For the MLA shapes only the routed experts the step's tokens choose count, in expectation
    (:func:`expected_experts`); attention, dense layers, shared experts, routers and the
    embedding rows are always read."""
    s = SHAPES[shape]
    h, layers, v = s["hidden_size"], s["num_hidden_layers"], s["vocab_size"]
    embeddings = v * h * (1 if s["tie_word_embeddings"] else 2)
    if shape in GDN_SHAPES:
        return _gdn_weight_bytes(s, batch)
    if shape in MOE_SHAPES:
        return _moe_weight_bytes(s, batch)
    if shape not in MLA_SHAPES:
        i = s["intermediate_size"]
        q, kv = s["num_attention_heads"] * s["head_dim"], s["num_key_value_heads"] * s["head_dim"]
        per_layer = h * (q + 2 * kv) + q * h + 3 * h * i + 2 * h
        return 2 * (layers * per_layer + embeddings + h)
    heads, r, d_n, d_r, d_v = (s["num_attention_heads"], s["kv_lora_rank"], s["qk_nope_head_dim"],
                               s["qk_rope_head_dim"], s["v_head_dim"])
    q_in = s["q_lora_rank"] or h
    q = (h * s["q_lora_rank"] + s["q_lora_rank"] if s["q_lora_rank"] else 0) + q_in * heads * (d_n + d_r)
    attention = q + h * (r + d_r) + r + r * heads * (d_n + d_v) + heads * d_v * h
    dense = s["first_k_dense_replace"]
    experts, top_k, width = s["n_routed_experts"], s["num_experts_per_tok"], s["moe_intermediate_size"]
    read = experts if batch is None else expected_experts(experts, top_k, batch)
    # The router is float32: its H x E values weigh as twice as many bf16 ones.
    moe_layer = 3 * h * width * (s["n_shared_experts"] + read) + 2 * h * experts
    total = layers * (attention + 2 * h) + dense * 3 * h * s["intermediate_size"] + (layers - dense) * moe_layer \
        + embeddings + h
    return int(2 * total)


def _moe_weight_bytes(s: dict[str, Any], batch: int | None) -> int:
    # bf16 values count 2 bytes; the float32 routers 4 (GPT-OSS's router is bf16 with a float32
    # bias, its experts and attention carry biases, its heads a sink each).
    h, v, layers = s["hidden_size"], s["vocab_size"], s["num_hidden_layers"]
    gpt_oss = s["model_type"] == "gpt_oss"
    heads, kv_heads, d = s["num_attention_heads"], s["num_key_value_heads"], s["head_dim"]
    experts = s["num_local_experts"] if gpt_oss else s["num_experts"]
    top_k = s["num_experts_per_tok"]
    width = s["intermediate_size"] if gpt_oss else s["moe_intermediate_size"]
    read = experts if batch is None else expected_experts(experts, top_k, batch)
    attention = 2 * (h * (heads + 2 * kv_heads) * d + heads * d * h)
    if gpt_oss:
        attention += 2 * ((heads + 2 * kv_heads) * d + h) + 4 * heads
        expert = 2 * (3 * h * width + 2 * width + h)
        router = 2 * h * experts + 4 * experts
    else:
        attention += 2 * 2 * d  # q_norm, k_norm
        expert = 2 * 3 * h * width
        router = 4 * h * experts
    per_layer = attention + router + expert * read + 2 * 2 * h
    return int(layers * per_layer + 2 * v * h * (1 if s["tie_word_embeddings"] else 2) + 2 * h)


def embedding_bytes(shape: str) -> int:
    """bf16 bytes of the embedding and the LM head (one table when tied)."""
    s = SHAPES[shape]
    return 2 * s["vocab_size"] * s["hidden_size"] * (1 if s["tie_word_embeddings"] else 2)


def _gdn_layers(s: dict[str, Any]) -> list[bool]:
    """Per layer: True for a Gated DeltaNet layer, False for gated attention."""
    interval = s["full_attention_interval"]
    return [(i + 1) % interval != 0 for i in range(s["num_hidden_layers"])]


def _gdn_weight_bytes(s: dict[str, Any], batch: int | None) -> int:
    # bf16 values count 2 bytes; the float32 ones (routers, shared-expert gates, conv weights,
    # A_log, dt_bias, gated norms) 4.
    h, v = s["hidden_size"], s["vocab_size"]
    hk, hv, dk, dv, width = (s["linear_num_key_heads"], s["linear_num_value_heads"], s["linear_key_head_dim"],
                             s["linear_value_head_dim"], s["linear_conv_kernel_dim"])
    heads, kv_heads, d = s["num_attention_heads"], s["num_key_value_heads"], s["head_dim"]
    experts, top_k = s["num_experts"], s["num_experts_per_tok"]
    read = experts if batch is None else expected_experts(experts, top_k, batch)
    channels = 2 * hk * dk + hv * dv
    delta = 2 * h * (2 * hk * dk + 2 * hv * dv + 2 * hv + hv * dv) + 4 * (channels * width + 2 * hv + dv)
    attention = 2 * (h * heads * 2 * d + 2 * h * kv_heads * d + heads * d * h + 2 * d)
    moe = 2 * 3 * h * s["moe_intermediate_size"] * read + 2 * 3 * h * s["shared_expert_intermediate_size"] \
        + 4 * h * (experts + 1)
    per_layer = [(delta if gdn else attention) + moe + 2 * 2 * h for gdn in _gdn_layers(s)]
    return int(sum(per_layer) + 2 * v * h * (1 if s["tie_word_embeddings"] else 2) + 2 * h)


#: The prompt lengths of ``metrale bench --prefill-sweep``, and the chunk after a cached prefix it
#: also times (cached, new).
PREFILL_SWEEP_LENGTHS = (512, 1024, 2048, 4096, 8192, 16384, 32768, 131072)
PREFILL_SWEEP_CHUNK = (8192, 512)


def prefill_repeats(length: int) -> int:
    """Timed prefills of a prompt of ``length`` tokens: 5, 3 past 16,384 tokens, 2 past 65,536
    (a 131,072-token prefill of an 8B shape takes seconds)."""
    return 5 if length <= 16384 else 3 if length <= 65536 else 2


def prefill_flops(shape: str, length: int, cached: int = 0) -> float:
    """Floating-point operations of a prefill of ``length`` prompt tokens after ``cached`` ones:
    two per multiply-add of every weight a token uses (the routed experts it chooses, not the
    embedding table; the LM head for the last token only), plus the attention products over the
    visible (row, key) pairs (causal) and, for Gated DeltaNet layers, the state update per token."""
    s = SHAPES[shape]
    h, v = s["hidden_size"], s["vocab_size"]
    embedding_bytes = 2 * v * h * (1 if s["tie_word_embeddings"] else 2)
    if shape in MLA_SHAPES or shape in GDN_SHAPES or shape in MOE_SHAPES:
        per_token = (weight_bytes(shape, 1) - embedding_bytes) / 2  # bf16 values of one token's weights
    else:
        per_token = (weight_bytes(shape) - embedding_bytes) / 2
    pairs = length * cached + length * (length + 1) / 2
    layers = s["num_hidden_layers"]
    if shape in MLA_SHAPES:
        attention = 2 * s["num_attention_heads"] * (s["qk_nope_head_dim"] + s["qk_rope_head_dim"] + s["v_head_dim"]) * layers
        recurrent = 0.0
    elif shape in GDN_SHAPES:
        gdn = sum(_gdn_layers(s))
        attention = 4 * s["num_attention_heads"] * s["head_dim"] * (layers - gdn)
        recurrent = 4 * s["linear_num_value_heads"] * s["linear_key_head_dim"] * s["linear_value_head_dim"] * gdn * length
    elif s.get("sliding_window"):
        # GPT-OSS: half the layers attend over the last sliding_window positions only.
        window = s["sliding_window"]
        windowed = sum(min(cached + row + 1, window) for row in range(length))
        attention = 4 * s["num_attention_heads"] * s["head_dim"] * layers / 2
        return 2 * per_token * length + 2 * v * h + attention * (pairs + windowed)
    else:
        attention = 4 * s["num_attention_heads"] * s["head_dim"] * layers
        recurrent = 0.0
    return 2 * per_token * length + 2 * v * h + attention * pairs + recurrent


def state_bytes_per_sequence(shape: str) -> int:
    """Bytes of recurrent state a decode step reads and writes per sequence (0 without GDN layers)."""
    s = SHAPES[shape]
    if shape not in GDN_SHAPES:
        return 0
    channels = 2 * s["linear_num_key_heads"] * s["linear_key_head_dim"] + s["linear_num_value_heads"] * s["linear_value_head_dim"]
    per_layer = 4 * (s["linear_num_value_heads"] * s["linear_key_head_dim"] * s["linear_value_head_dim"]
                     + channels * (s["linear_conv_kernel_dim"] - 1))
    return 2 * per_layer * sum(_gdn_layers(s))


def kv_bytes_read(shape: str, context: int, fp8: bool = False) -> int:
    """Cache bytes one sequence's decode step reads at ``context`` cached tokens: every layer's
    keys and values, a sliding-window layer's over its window only (GPT-OSS's alternate layers)."""
    s = SHAPES[shape]
    window = s.get("sliding_window") if shape in MOE_SHAPES else None
    if not window:
        return context * kv_bytes_per_token(shape, fp8)
    per_layer = kv_bytes_per_token(shape, fp8) // s["num_hidden_layers"]
    windowed = s["num_hidden_layers"] // 2
    return per_layer * (context * (s["num_hidden_layers"] - windowed) + min(context, window) * windowed)


def kv_bytes_per_token(shape: str, fp8: bool = False) -> int:
    """Cache bytes a token's keys and values take (bf16; with ``fp8``, a byte a value and a float32
    scale a head, or a latent row, :mod:`metrale.kernels.kv_cache_fp8`)."""
    s = SHAPES[shape]
    if shape in MLA_SHAPES:  # one latent row a token and layer (FP8: its codes and one scale)
        width = s["kv_lora_rank"] + s["qk_rope_head_dim"]
        return s["num_hidden_layers"] * (width + 4 if fp8 else 2 * width)
    head = s["head_dim"] + 4 if fp8 else 2 * s["head_dim"]
    if shape in GDN_SHAPES:
        attention_layers = s["num_hidden_layers"] - sum(_gdn_layers(s))
        return 2 * attention_layers * s["num_key_value_heads"] * head
    return 2 * s["num_hidden_layers"] * s["num_key_value_heads"] * head


_START_PROBE = """
import time
started = time.perf_counter()
import sys
from metrale import LLM, SamplingParams
llm = LLM(sys.argv[1], device="cuda", max_model_len=1024, max_num_seqs=2, show_progress=False)
loaded = time.perf_counter()
llm.capture_graphs([1])
llm.generate([[1, 2, 3]], SamplingParams(max_tokens=4, temperature=0.0), use_tqdm=False)
print(loaded - started, time.perf_counter() - started)
"""


#: The compilation caches a fresh process fills, each as the environment variable that moves it:
#: numba's, Metrale's sm_90a cubins and CuPy's kernels.
START_CACHES = {"NUMBA_CACHE_DIR": "numba", "METRALE_KERNEL_CACHE": "kernels", "CUPY_CACHE_DIR": "cupy"}


def start_times(folder: Path, cache_dir: Path) -> dict[str, float]:
    """Seconds from process start to a model ready to decode (load, kernel compilation, graph
    capture, a first generation), with every compilation cache empty (:data:`START_CACHES`, all
    under ``cache_dir``) and again with the caches that run left."""
    import os
    import shutil
    import subprocess
    import sys

    shutil.rmtree(cache_dir, ignore_errors=True)
    env = {**os.environ, **{variable: str(cache_dir / name) for variable, name in START_CACHES.items()}}
    result: dict[str, float] = {}
    for label in ("cold", "cached"):
        out = subprocess.run([sys.executable, "-c", _START_PROBE, str(folder)], env=env, capture_output=True,
                             text=True, check=True)
        load, ready = (float(v) for v in out.stdout.split()[-2:])
        result[f"{label}_start_s"] = ready
        result[f"{label}_load_s"] = load
    return result


def bench_metrale(shape: str, folder: Path, options: BenchOptions, bandwidth: float,
                  quantization: str | None = None, kv_cache_fp8: bool = False,
                  batch_invariant: bool = False) -> dict[str, Any]:
    """Metrale's decode, prefill and load times on ``folder``; with ``quantization`` (a format of
    :data:`metrale.benchmarks.quantized.FORMATS`) the floor counts that format's bytes, and an online
    format is asked for at load; with ``kv_cache_fp8`` the cache is FP8 and the floor counts its bytes;
    with ``batch_invariant`` the model runs in batch-invariant mode."""
    import numpy as np

    from metrale.backends.cuda import CudaBackend
    from metrale.entrypoints.llm import LLM
    from metrale.params import SamplingParams
    from metrale.sequence import SequenceState

    result: dict[str, Any] = {}
    max_batch = max(options.batch_sizes)
    chunk_end = sum(options.prefix_chunk) if options.prefix_chunk else 0
    max_len = max(options.context + options.decode_steps + 16, max(options.prefill_lengths, default=0) + 16,
                  chunk_end + 16)
    # No longer than the checkpoint's positions (a prompt as long as they are still fits).
    positions = json.loads((folder / "config.json").read_text()).get("max_position_embeddings")
    if positions:
        longest = max([*options.prefill_lengths, chunk_end, options.context + options.decode_steps])
        if longest > int(positions):
            from metrale.errors import ConfigError

            raise ConfigError(f"{shape}: {longest} tokens exceed the checkpoint's {positions} positions")
        max_len = min(max_len, int(positions))
    started = time.perf_counter()
    from metrale.benchmarks import quantized as formats

    online = formats.FORMATS[quantization].online if quantization else None
    llm = LLM(folder, device="cuda", max_model_len=max_len, max_num_seqs=max_batch + 1, show_progress=True,
              quantization=online, kv_cache_dtype="fp8" if kv_cache_fp8 else "auto", batch_invariant=batch_invariant)
    backend = llm.backend
    assert isinstance(backend, CudaBackend)  # device="cuda" gives the CUDA backend or raises
    backend.synchronize()
    result["load_s"] = time.perf_counter() - started
    started = time.perf_counter()
    llm.capture_graphs(options.batch_sizes)
    result["capture_s"] = time.perf_counter() - started
    rng = np.random.default_rng(0)
    vocab = llm.vocab_size
    for batch in options.batch_sizes:
        seqs = [SequenceState.from_prompt(rng.integers(0, vocab, options.context).tolist()) for _ in range(batch)]
        for seq in seqs:
            llm.forward.prefill(seq.tokens, seq)
        tokens = [int(t) for t in rng.integers(0, vocab, batch)]
        steps = options.decode_steps

        greedy = [SamplingParams(temperature=0.0)] * batch
        seeds = list(range(batch))

        def step() -> None:
            # What the generation loop does every step: the forward, then the device sampler
            # (greedy here) and the tokens read back.
            logits = llm.forward.decode_batch(tokens, seqs)
            llm.engine.sampler.sample(logits, greedy, seeds, [0] * batch)

        seconds = _cuda_time(step, repeats=steps, stream=backend.stream)
        context = options.context + steps // 2
        weights_read = weight_bytes(shape, batch)
        if quantization:
            weights_read = formats.quantized_step_bytes(weights_read, embedding_bytes(shape), quantization)
        bytes_read = (weights_read + batch * kv_bytes_read(shape, context, kv_cache_fp8)
                      + batch * state_bytes_per_sequence(shape))
        floor = bytes_read / bandwidth
        result[f"decode_b{batch}"] = {
            "step_ms": seconds * 1e3,
            "tok_s": batch / seconds,
            "achieved_GBps": bytes_read / seconds / 1e9,
            "floor_ms": floor * 1e3,
            "fraction_of_floor": floor / seconds,
        }
        for seq in seqs:
            llm.cache.release(seq)
        loop_seconds = engine_loop_seconds(llm, batch, options.context, steps, rng)
        if loop_seconds is not None:
            result[f"decode_b{batch}_loop"] = {
                "step_ms": loop_seconds * 1e3,
                "tok_s": batch / loop_seconds,
                "achieved_GBps": bytes_read / loop_seconds / 1e9,
                "floor_ms": floor * 1e3,
                "fraction_of_floor": floor / loop_seconds,
            }
    for length in options.prefill_lengths:
        prompt = rng.integers(0, vocab, length).tolist()

        def prefill() -> None:
            seq = SequenceState.from_prompt(prompt)
            llm.forward.prefill(prompt, seq)
            llm.cache.release(seq)

        seconds = _cuda_time(prefill, repeats=prefill_repeats(length), warmup=1, stream=backend.stream)
        result[f"prefill_{length}"] = {"ms": seconds * 1e3, "tok_s": length / seconds,
                                       "TFLOPs": prefill_flops(shape, length) / seconds / 1e12}
    if options.prefix_chunk:
        cached, new = options.prefix_chunk
        prompt = rng.integers(0, vocab, cached + new).tolist()

        def chunk_after_prefix() -> None:
            # The prefix is prefilled outside the timed chunk: one sequence per sample.
            seq = SequenceState.from_prompt(prompt)
            llm.forward.prefill_chunk(prompt, seq, 0, cached, False)
            backend.synchronize()
            started = time.perf_counter()
            llm.forward.prefill_chunk(prompt, seq, cached, new, True)
            backend.synchronize()
            chunk_seconds.append(time.perf_counter() - started)
            llm.cache.release(seq)

        chunk_seconds: list[float] = []
        for _ in range(4):
            chunk_after_prefix()
        seconds = statistics.median(chunk_seconds[1:])
        result[f"prefill_{new}_after_{cached}"] = {"ms": seconds * 1e3, "tok_s": new / seconds,
                                                   "TFLOPs": prefill_flops(shape, new, cached) / seconds / 1e12}
    llm.close()  # frees the device memory before the next benchmark runs
    release_device_pools()
    return result


def release_device_pools() -> None:
    """After an engine closed (which empties its backend's pool): collect the garbage cycles that
    may still hold device arrays, then give every block CuPy's pools keep (pinned ones too) back to
    the driver, so that the next measurement (transformers' among them) has the device."""
    import gc

    import cupy

    gc.collect()
    cupy.get_default_memory_pool().free_all_blocks()
    cupy.get_default_pinned_memory_pool().free_all_blocks()


def engine_loop_seconds(llm: Any, batch: int, context: int, steps: int, rng: Any) -> float | None:
    """The decode step of ``batch`` sequences as ``LLM.generate`` runs it: ``batch`` prompts of
    ``context`` random tokens generate ``steps + 8`` tokens each (greedy, no stop), with CUDA
    events around every graph replay; the median interval between the starts of consecutive
    ``batch``-row decode replays (:func:`steady_step_seconds`). None without decode graphs."""
    import cupy

    from metrale.params import SamplingParams

    graphs = getattr(getattr(llm.model, "runner", None), "graphs", None)
    if graphs is None or graphs.disabled is not None:
        return None
    prompts = [rng.integers(0, llm.vocab_size, context).tolist() for _ in range(batch)]
    graphs.replay_events = []
    try:
        llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=steps + 8, ignore_eos=True), use_tqdm=False)
        events = graphs.replay_events
    finally:
        graphs.replay_events = None
    if not events:
        return None
    events[-1][1].synchronize()
    first = events[0][0]
    starts = [(cupy.cuda.get_elapsed_time(first, start) / 1e3, rows) for start, _, rows in events]
    return steady_step_seconds(starts, graphs.rung_size(batch))


def steady_step_seconds(starts: list[tuple[float, int]], rows: int, minimum: int = 8) -> float | None:
    """The median of the intervals between consecutive replays that both ran the ``rows``-row
    decode graph, from ``starts`` (each replay's start in seconds and its padded decode rows, 0 for
    a mixed step, in stream order): the steady step once every sequence decodes, without the steps
    where prompts were still being prefilled or sequences had finished. None when fewer than
    ``minimum`` such intervals were seen."""
    intervals = [b[0] - a[0] for a, b in zip(starts, starts[1:]) if a[1] == rows and b[1] == rows]
    return statistics.median(intervals) if len(intervals) >= minimum else None


def bench_hf(folder: Path, options: BenchOptions, compile_model: bool) -> dict[str, Any]:
    import torch
    from transformers import AutoModelForCausalLM

    result: dict[str, Any] = {}
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.bfloat16).to("cuda").eval()
    if compile_model:
        from transformers import CompileConfig

        # With a static cache, generate compiles the decoding forward itself (its CUDA-graph mode);
        # wrapping forward in torch.compile as well would compile it twice.
        model.generation_config.cache_implementation = "static"
        model.generation_config.compile_config = CompileConfig(fullgraph=True, mode="reduce-overhead")
    vocab = model.config.vocab_size
    generator = torch.Generator().manual_seed(0)

    def generate(batch: int, new_tokens: int) -> float:
        ids = torch.randint(0, vocab, (batch, options.context), generator=generator).cuda()
        torch.cuda.synchronize()
        started = time.perf_counter()
        with torch.no_grad():
            model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens,
                           min_new_tokens=new_tokens, do_sample=False, pad_token_id=0)
        torch.cuda.synchronize()
        return time.perf_counter() - started

    for batch in options.batch_sizes:
        # Warm up at the longest length timed: a static cache is sized by it, and a larger one
        # (a new cache shape) would recompile inside a timed call.
        generate(batch, 1 + options.hf_decode_tokens)
        first = generate(batch, 1)
        total = generate(batch, 1 + options.hf_decode_tokens)
        seconds = (total - first) / options.hf_decode_tokens
        result[f"decode_b{batch}"] = {"step_ms": seconds * 1e3, "tok_s": batch / seconds}
    # Prefill is timed for eager only: generate compiles just the one-token decoding forward.
    # The last position's logits only, as Metrale's prefill and transformers' own generate make them.
    for length in options.prefill_lengths if not compile_model else ():
        ids = torch.randint(0, vocab, (1, length), generator=generator).cuda()
        repeats = max(1, prefill_repeats(length) - 2)
        try:
            with torch.no_grad():
                model(ids, logits_to_keep=1)
                torch.cuda.synchronize()
                started = time.perf_counter()
                for _ in range(repeats):
                    model(ids, logits_to_keep=1)
                torch.cuda.synchronize()
        except torch.OutOfMemoryError as error:  # one length too long for the device: the others still count
            result[f"prefill_{length}_error"] = failure(error)
            ids = None
            torch.cuda.empty_cache()
            continue
        seconds = (time.perf_counter() - started) / repeats
        result[f"prefill_{length}"] = {"ms": seconds * 1e3, "tok_s": length / seconds}
    model = None  # (a closure shares the variable: clearing it frees the weights before empty_cache)
    torch.cuda.empty_cache()
    return result


def failure(error: BaseException) -> str:
    """How a measurement failed, for the results: the error's type and message, and where it was
    raised (the innermost frame: a launch's or a kernel's arguments are usually the story)."""
    import traceback

    frames = traceback.extract_tb(error.__traceback__)
    where = f" (at {Path(frames[-1].filename).name}:{frames[-1].lineno}, in {frames[-1].name})" if frames else ""
    return f"{type(error).__name__}: {error}{where}"


def run(options: BenchOptions) -> dict[str, Any]:
    import cupy

    device = cupy.cuda.runtime.getDeviceProperties(0)
    results: dict[str, Any] = {"device": device["name"].decode(), "options": {
        k: (str(v) if isinstance(v, Path) else v) for k, v in vars(options).items()}}
    results["copy_bandwidth_TBps"] = copy_bandwidth() / 1e12
    bandwidth = results["copy_bandwidth_TBps"] * 1e12
    options.workdir.mkdir(parents=True, exist_ok=True)
    hf_runs = [(label, compiled) for label, compiled in (("hf_eager", False), ("hf_compiled", True))
               if options.hf and (options.hf_compile or not compiled)]
    extra_runs = int(options.kv_cache_fp8) + int(options.batch_invariant)
    stages = len(options.shapes) * (2 + int(options.start_times) + len(hf_runs) + len(options.quantization)
                                    + extra_runs)
    def save() -> None:
        # After every stage: a run cut short keeps what it measured.
        if options.output is not None:
            options.output.write_text(json.dumps(results, indent=2))

    with _progress(stages, "bench") as bar:
        for shape in options.shapes:
            entry: dict[str, Any] = {"weight_GB": weight_bytes(shape) / 1e9}
            results[shape] = entry
            # Every shape's start times: each family compiles kernels of its own.
            metrale_stages = 2 + int(options.start_times)
            done = 0
            if shape in QUANTIZED_ONLY_SHAPES:
                for name in options.quantization:
                    bar.set_description(f"{shape}: Metrale {name}")
                    try:
                        entry[f"metrale_{name}"] = bench_quantized(shape, options, bandwidth, name)
                    except Exception as error:
                        entry[f"metrale_{name}_error"] = failure(error)
                    save()
                bar.update(metrale_stages + len(hf_runs) + len(options.quantization) + extra_runs)
                continue
            try:
                bar.set_description(f"{shape}: writing the checkpoint")
                started = time.perf_counter()
                folder = build_checkpoint(shape, options.workdir / shape)
                entry["build_s"] = time.perf_counter() - started
                bar.update()
                done += 1
                bar.set_description(f"{shape}: Metrale")
                entry["metrale"] = bench_metrale(shape, folder, options, bandwidth)
                save()
                bar.update()
                done += 1
                if metrale_stages == 3:
                    bar.set_description(f"{shape}: start times")
                    entry["metrale"].update(start_times(folder, options.workdir / "start-caches"))
                    bar.update()
                    done += 1
            except Exception as error:  # report and go on with the other measurements
                entry["metrale_error"] = failure(error)
                bar.update(metrale_stages - done)  # the skipped stages, so the bar still ends full

            def measure(description: str, key: str, run: Callable[[], Any]) -> None:
                """One more measurement of the shape: its result under ``key`` (``key_error`` if
                it fails, the others going on), saved, the bar a stage on."""
                bar.set_description(f"{shape}: {description}")
                try:
                    entry[key] = run()
                except Exception as error:
                    entry[f"{key}_error"] = failure(error)
                save()
                bar.update()

            for name in options.quantization:
                measure(f"Metrale {name}", f"metrale_{name}", partial(bench_quantized, shape, options, bandwidth, name))
            if options.kv_cache_fp8:
                measure("Metrale, FP8 KV cache", "metrale_kv_fp8", lambda: bench_fp8_cache(shape, options, bandwidth))
            if options.batch_invariant:
                measure("Metrale, batch-invariant", "metrale_batch_invariant",
                        lambda: bench_batch_invariant(shape, options, bandwidth))
            for label, compiled in hf_runs:
                measure(f"transformers {'compiled' if compiled else 'eager'}", label,
                        partial(bench_hf, options.workdir / shape, options, compiled))
            save()
    return results


def bench_quantized(shape: str, options: BenchOptions, bandwidth: float, name: str) -> dict[str, Any]:
    """:func:`bench_metrale` on ``shape`` in quantized format ``name`` (its checkpoint written from the
    bf16 one), and its accuracy against the bf16 model: the logit error relative to the largest
    logit and the top-1 agreement over a 256-token prompt's positions."""
    import numpy as np

    from metrale.benchmarks import quantized as formats
    from metrale.entrypoints.llm import LLM

    source = options.workdir / shape
    if shape in QUANTIZED_ONLY_SHAPES:
        if formats.FORMATS[name].online:
            raise ValueError(f"{shape} has no bf16 checkpoint to quantize online; use a written format")
        # Hollow: the codes are holes of sparse files, the 71 GB of FP8 codes more than a bench
        # machine's disk may hold (the step's time does not depend on their values).
        folder = formats.write_random_quantized_checkpoint(model_config(shape), options.workdir / f"{shape}-{name}",
                                                           name, hollow=True)
        return bench_metrale(shape, folder, options, bandwidth, quantization=name)
    folder, _ = formats.checkpoint_in_format(source, options.workdir, name)
    result = bench_metrale(shape, folder, options, bandwidth, quantization=name)
    prompt = np.random.default_rng(7).integers(0, SHAPES[shape]["vocab_size"], 256).tolist()
    with LLM(source, device="cuda", max_model_len=512, max_num_seqs=2, show_progress=False) as reference:
        reference_logits = reference.score(prompt)
    with LLM(folder, device="cuda", max_model_len=512, max_num_seqs=2, show_progress=False,
             quantization=formats.FORMATS[name].online) as quantized:
        result["accuracy"] = formats.accuracy(reference_logits, quantized, prompt)
    return result


def bench_fp8_cache(shape: str, options: BenchOptions, bandwidth: float) -> dict[str, Any]:
    """:func:`bench_metrale` on ``shape``'s bf16 checkpoint with an FP8 KV cache, the blocks its
    memory holds against the bf16 cache's, and its accuracy against the bf16 cache (teacher-forced
    logits over a prompt of ``options.context`` tokens)."""
    import numpy as np

    from metrale.benchmarks import quantized as formats
    from metrale.entrypoints.llm import LLM

    folder = options.workdir / shape
    result = bench_metrale(shape, folder, options, bandwidth, kv_cache_fp8=True)
    prompt = np.random.default_rng(7).integers(0, SHAPES[shape]["vocab_size"], options.context).tolist()
    # A budget the blocks fill before max_num_seqs * max_model_len caps them (on the 8B shape at
    # 8,192 tokens: 1,024 bf16 blocks of 16 tokens, about twice as many FP8 ones, under the cap of
    # 4,104). A compact cache (MLA's latent rows) takes more sequences to reach that cap; a shape
    # with recurrent state keeps 8 (its state slots come out of the same budget).
    budget = 2 << 30
    tokens = options.context + 16
    sequences = 8 if state_bytes_per_sequence(shape) else max(8, -(-5 * budget // (2 * kv_bytes_per_token(shape) * tokens)))
    limits: dict[str, Any] = {"max_model_len": tokens, "max_num_seqs": sequences}
    with LLM(folder, device="cuda", show_progress=False, memory_bytes=budget, **limits) as reference:
        reference_logits = reference.score(prompt)
        bf16_blocks = reference.cache.num_blocks
    with LLM(folder, device="cuda", show_progress=False, memory_bytes=budget, kv_cache_dtype="fp8", **limits) as fp8:
        result["accuracy"] = formats.accuracy(reference_logits, fp8, prompt)
        result["blocks_per_GiB_vs_bf16"] = fp8.cache.num_blocks / bf16_blocks
    return result


#: Prompts and greedy tokens of :func:`bench_batch_invariant`'s check.
INVARIANCE_PROMPTS = 32
INVARIANCE_TOKENS = 16


def bench_batch_invariant(shape: str, options: BenchOptions, bandwidth: float) -> dict[str, Any]:
    """:func:`bench_metrale` on ``shape``'s bf16 checkpoint in batch-invariant mode, and the check
    the mode exists for: :data:`INVARIANCE_PROMPTS` prompts (random lengths of 16 to 512 tokens)
    decoded greedily for :data:`INVARIANCE_TOKENS` tokens each alone and all together; ``identical``
    counts the prompts whose tokens agree (``of`` the prompts)."""
    import numpy as np

    from metrale.entrypoints.llm import LLM
    from metrale.params import SamplingParams

    folder = options.workdir / shape
    result = bench_metrale(shape, folder, options, bandwidth, batch_invariant=True)
    rng = np.random.default_rng(11)
    vocab = SHAPES[shape]["vocab_size"]
    prompts = [rng.integers(0, vocab, int(n)).tolist() for n in rng.integers(16, 513, INVARIANCE_PROMPTS)]
    greedy = SamplingParams(max_tokens=INVARIANCE_TOKENS, temperature=0.0, ignore_eos=True)
    with LLM(folder, device="cuda", show_progress=False, batch_invariant=True, max_model_len=1024,
             max_num_seqs=INVARIANCE_PROMPTS) as llm:
        alone = [llm.generate([prompt], greedy, use_tqdm=False)[0].token_ids for prompt in prompts]
        together = [output.token_ids for output in llm.generate(prompts, greedy, use_tqdm=False)]
    result["invariance"] = {"identical": sum(a == b for a, b in zip(alone, together)), "of": len(prompts)}
    return result


def table(results: dict[str, Any]) -> str:
    """The result as a plain-text table."""
    lines = [f"device: {results['device']}   copy bandwidth: {results['copy_bandwidth_TBps']:.2f} TB/s"]
    header = f"{'shape':10} {'engine':12} {'metric':14} {'value':>12} {'GB/s':>8} {'floor %':>8} {'TFLOP/s':>8}"
    lines += [header, "-" * len(header)]
    for shape in results["options"]["shapes"]:
        entry = results.get(shape, {})
        engines = ["metrale"] + [f"metrale_{name}" for name in results["options"].get("quantization", ())]
        engines += ["metrale_kv_fp8"] if results["options"].get("kv_cache_fp8") else []
        engines += ["metrale_batch_invariant"] if results["options"].get("batch_invariant") else []
        for engine in engines + ["hf_eager", "hf_compiled"]:
            data = entry.get(engine)
            if data is None:
                if f"{engine}_error" in entry:
                    lines.append(f"{shape:10} {engine:12} error: {entry[f'{engine}_error'][:60]}")
                continue
            for key, value in data.items():
                if key == "accuracy":
                    lines.append(f"{shape:10} {engine:12} {'logit error':14} {value['logit_error']:12.4f}")
                    lines.append(f"{shape:10} {engine:12} {'greedy agree':14} {value['greedy_agreement']:12.4f}")
                    continue
                if key == "invariance":
                    lines.append(f"{shape:10} {engine:12} {'identical':14} {value['identical']:>8} of {value['of']}")
                    continue
                if isinstance(value, str):  # a measurement that failed (``prefill_131072_error``)
                    lines.append(f"{shape:10} {engine:12} {key:14} {value[:60]}")
                    continue
                if not isinstance(value, dict):
                    lines.append(f"{shape:10} {engine:12} {key:14} {value:12.2f}")
                    continue
                rate = value.get("tok_s")
                gbps = value.get("achieved_GBps")
                fraction = value.get("fraction_of_floor")
                tflops = value.get("TFLOPs")
                columns = [
                    " " * 8 if gbps is None else f"{gbps:8.0f}",
                    " " * 8 if fraction is None else f"{100 * fraction:8.1f}",
                    " " * 8 if tflops is None else f"{tflops:8.1f}",
                ]
                lines.append(f"{shape:10} {engine:12} {key + ' tok/s':14} {rate:12.1f} {' '.join(columns)}".rstrip())
        lines += [f"{shape:10} {label:12} {key:14} {ratio:11.2f}x" for label, key, ratio in speedups(entry)]
    return "\n".join(lines)


def speedups(entry: dict[str, Any]) -> list[tuple[str, str, float]]:
    """``(vs engine, metric, Metrale tok/s over theirs)`` for every metric both measured; each
    quantized format's against Metrale's bf16 (``fp8 vs bf16``)."""
    ours = entry.get("metrale") or {}
    rows = []
    for engine in (key for key in entry if key.startswith("metrale_") and not key.endswith("_error")):
        for key, value in (entry.get(engine) or {}).items():
            other = ours.get(key)
            if isinstance(value, dict) and isinstance(other, dict) and value.get("tok_s") and other.get("tok_s"):
                rows.append((f"{engine[len('metrale_'):]} vs bf16", key, value["tok_s"] / other["tok_s"]))
    for engine in ("hf_eager", "hf_compiled"):
        theirs = entry.get(engine) or {}
        for key, value in ours.items():
            other = theirs.get(key)
            if isinstance(value, dict) and isinstance(other, dict) and value.get("tok_s") and other.get("tok_s"):
                rows.append((f"vs {engine}", key, value["tok_s"] / other["tok_s"]))
    return rows
