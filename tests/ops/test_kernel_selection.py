"""The kernel choices of the registry (metrale.ops.selection): settings as conditions, the split of
a step's attention rows, and the same kernel for the same call as the launchers chose before the
choice moved into the registry."""

from __future__ import annotations

import math
from types import SimpleNamespace

import numpy as np
import pytest

from metrale.backends.base import CpuBackend
from metrale.config import EnvironmentConfig, read_environment
from metrale.errors import OpRegistrationError
from metrale.model.hookspecs import hookimpl
from metrale.model.plugin_manager import get_plugin_manager
from metrale.ops import Kernel, build_op_registry
from metrale.ops.builtin import builtin_registry
from metrale.ops.selection import STAGED_MAX_BLOCK_ELEMENTS, leading_single_rows


class KernelPlugin:
    METRALE_CONTRACT_VERSION = "1.1"

    def __init__(self, kernels):
        self.kernels = list(kernels)

    @hookimpl
    def metrale_register_ops(self, registry):
        for kernel in self.kernels:
            registry.add_kernel(kernel)


def registry_with(*kernels):
    manager = get_plugin_manager(entry_points=False)
    manager.register(KernelPlugin(kernels), name="kernel_plugin")
    return build_op_registry(manager)


def chosen(op, backend_name, environment, *args, registry=None):
    """The kernel the registry runs for a call (its name), without building any."""
    for kernel in (registry or builtin_registry()).kernels_for(op, backend_name):
        if kernel.enabled is not None and not kernel.enabled(environment):
            continue
        if kernel.when is None or kernel.when(*args):
            return kernel.name
    return "reference"


# ---------------------------------------------------------------------------------- settings


def test_a_kernel_a_setting_turns_off_is_not_bound_and_says_so():
    calls = []
    reference = builtin_registry().ops["rmsnorm"].reference

    def build(backend):
        return lambda *args: calls.append(1) or reference(*args)

    kernel = Kernel("rmsnorm", "cpu", "test.tensor_cores", build=build, enabled=lambda env: env.decode_mma,
                    condition="METRALE_DECODE_MMA is not 0")
    registry = registry_with(kernel)
    x, weight = np.ones((2, 8), np.float32), np.ones(8, np.float32)
    on, off = CpuBackend(EnvironmentConfig()), CpuBackend(EnvironmentConfig(decode_mma=False))
    for backend in (on, off):
        backend.use_ops(registry)
        backend.ops.rmsnorm(x, weight, 1e-6)
    assert calls == [1]  # the backend whose settings turn it off runs the reference
    assert registry.serving("rmsnorm", "cpu") == ["test.tensor_cores [kernel_plugin] when METRALE_DECODE_MMA is not 0",
                                                  "reference [metrale]"]
    with pytest.raises(OpRegistrationError, match="condition in words"):
        Kernel("rmsnorm", "cpu", "test.unsaid", build=build, enabled=lambda env: True)


def test_metrale_decode_mma_reaches_the_tensor_core_decode_kernel_as_a_setting():
    kernels = [k for k in builtin_registry().kernels_for("paged_attention_decode", "cuda") if "decode_mma" in k.name]
    assert len(kernels) == 2  # an FP8 cache's and a bf16 cache's
    for kernel in kernels:
        assert kernel.condition.startswith("METRALE_DECODE_MMA is not 0")
        assert kernel.enabled(read_environment({}))
        assert not kernel.enabled(read_environment({"METRALE_DECODE_MMA": "0"}))


def test_no_kernel_module_reads_the_environment():
    """The settings reach kernels through the backend (metrale.config is the only reader)."""
    from pathlib import Path

    import metrale.kernels

    for path in Path(metrale.kernels.__file__).parent.glob("*.py"):
        text = path.read_text(encoding="utf-8")
        for word in ("os.environ", "environment_flag", "getenv", "from metrale.config", "import metrale.config"):
            assert word not in text, f"{path.name} reads the environment ({word})"


# --------------------------------------------------------------------------- attention rows


def test_leading_single_rows():
    assert leading_single_rows(np.array([0, 1, 2, 3])) == 3  # decode rows only
    assert leading_single_rows(np.array([0, 1, 2, 9])) == 2  # two decode rows, then a chunk
    assert leading_single_rows(np.array([0, 7, 8])) == 0  # a chunk first: its rows and the row after it are prompt rows
    assert leading_single_rows(np.array([0])) == 0


class Spy:
    """CPU kernels of the two internal attention ops recording the rows they serve."""

    def __init__(self):
        self.calls = []

    def kernels(self):
        registry = builtin_registry()

        def recording(op):
            reference = registry.ops[op].reference

            def build(backend):
                def run(q, k_cache, v_cache, batch, scale, window, out, first, softcap=None, sinks=None):
                    self.calls.append((op, q.shape[0], first, softcap, sinks is not None))
                    return reference(q, k_cache, v_cache, batch, scale, window, out, first, softcap, sinks)

                return run

            return Kernel(op, "cpu", f"spy.{op}", build=build)

        return [recording("paged_attention_decode"), recording("paged_attention_prompt")]


def mixed_batch(rng, heads=4, kv_heads=2, head_dim=8, block_size=4):
    """Two decode rows (positions 6 and 9), then a prompt chunk of five rows at positions 3..7."""
    k_cache = rng.standard_normal((12, block_size, kv_heads, head_dim)).astype(np.float32)
    v_cache = rng.standard_normal((12, block_size, kv_heads, head_dim)).astype(np.float32)
    batch = SimpleNamespace(block_tables=np.array([[3, 1, 0], [2, 5, 7], [4, 6, 0]]), seq_index=np.array([0, 1, 2, 2, 2, 2, 2]),
                            positions=np.array([6, 9, 3, 4, 5, 6, 7]), row_starts=np.array([0, 1, 2, 7]), max_context=10,
                            extras={})
    q = rng.standard_normal((7, heads, head_dim)).astype(np.float32)
    return q, k_cache, v_cache, batch


@pytest.mark.parametrize("softcap, with_sinks", [(None, False), (7.0, True)])
def test_a_mixed_step_splits_its_rows_between_the_decode_and_prompt_ops(softcap, with_sinks):
    spy = Spy()
    backend = CpuBackend()
    backend.use_ops(registry_with(*spy.kernels()))
    rng = np.random.default_rng(3)
    q, k_cache, v_cache, batch = mixed_batch(rng)
    sinks = rng.standard_normal(4).astype(np.float32) if with_sinks else None
    out = backend.ops.paged_attention(q, k_cache, v_cache, batch, 0.3, None, softcap, sinks)
    assert spy.calls == [("paged_attention_decode", 2, 0, softcap, with_sinks),
                         ("paged_attention_prompt", 7, 2, softcap, with_sinks)]
    expected = builtin_registry().ops["paged_attention"].reference(q, k_cache, v_cache, batch, 0.3, None, softcap, sinks)
    np.testing.assert_allclose(out, expected, rtol=1e-6, atol=1e-6)
    # A decode step: the decode op alone; a prefill step: the prompt op alone.
    spy.calls.clear()
    decode = SimpleNamespace(**{**vars(batch), "row_starts": np.array([0, 1, 2])})
    backend.ops.paged_attention(q[:2], k_cache, v_cache, decode, 0.3, None)
    prompt = SimpleNamespace(**{**vars(batch), "row_starts": np.array([0, 7])})
    backend.ops.paged_attention(q, k_cache, v_cache, prompt, 0.3, None)
    assert [call[:3] for call in spy.calls] == [("paged_attention_decode", 2, 0), ("paged_attention_prompt", 7, 0)]


def test_prompt_rows_no_prompt_kernel_serves_go_to_the_decode_kernels_a_row_at_a_time():
    """The last kernel of paged_attention_prompt on the GPU, here bound on the CPU: the prompt rows
    through paged_attention_decode, from the first prompt row on."""
    (fallback,) = [k for k in builtin_registry().kernels_for("paged_attention_prompt", "cuda") if k.unconditional]
    spy = Spy()
    registry = registry_with(*spy.kernels()[:1])
    registry.add_kernel(Kernel("paged_attention_prompt", "cpu", fallback.name, build=fallback.build))
    backend = CpuBackend()
    backend.use_ops(registry)
    rng = np.random.default_rng(4)
    q, k_cache, v_cache, batch = mixed_batch(rng)
    out = backend.ops.paged_attention(q, k_cache, v_cache, batch, 0.3, 5)
    assert [call[:3] for call in spy.calls] == [("paged_attention_decode", 2, 0), ("paged_attention_decode", 5, 2)]
    expected = builtin_registry().ops["paged_attention"].reference(q, k_cache, v_cache, batch, 0.3, 5)
    np.testing.assert_allclose(out, expected, rtol=1e-6, atol=1e-6)


# ------------------------------------------------------ the same kernels as the launchers chose


def launchers_decode_choice(heads, kv_heads, head_dim, value_dim, rows, max_context, decode_mma=True):
    """The decode kernel the launchers picked (kernels/attention.py's paged_attention) for these rows."""
    from metrale.kernels import attention_decode_mma, attention_grouped, attention_staged

    if decode_mma and attention_decode_mma.supports(heads, kv_heads, head_dim, value_dim):
        return "attention_decode_mma"
    if attention_grouped.supports(heads, kv_heads, head_dim, value_dim):
        splits = attention_grouped.split_count(rows, heads, kv_heads, max_context)
        if (attention_staged.supports(heads, kv_heads, head_dim, head_dim)
                and math.ceil(max_context / splits) * head_dim <= STAGED_MAX_BLOCK_ELEMENTS):
            return "attention_staged"
        return "attention_grouped"
    return "attention "


def launchers_prompt_choice(heads, kv_heads, head_dim, value_dim):
    """The prompt-row kernel metrale/ops/cuda.py's paged_attention picked."""
    from metrale.kernels import attention_mma, attention_prefill

    if attention_mma.supports(heads, kv_heads, head_dim, value_dim):
        return "attention_mma"
    if attention_prefill.supports(heads, kv_heads, head_dim, value_dim):
        return "attention_prefill"
    return "a row at a time"


GEOMETRIES = [(heads, kv, d, dv) for heads, kv in ((8, 8), (14, 2), (32, 8), (40, 2), (64, 1), (64, 8))
              for d, dv in ((16, 16), (32, 32), (64, 64), (80, 80), (96, 96), (128, 128), (192, 128), (256, 256))]


@pytest.mark.parametrize("heads, kv_heads, head_dim, value_dim", GEOMETRIES)
def test_the_registry_chooses_the_kernels_the_launchers_chose(heads, kv_heads, head_dim, value_dim, monkeypatch):
    from metrale.kernels import attention_decode_mma

    monkeypatch.setattr(attention_decode_mma, "SIMULATED", False)  # its geometries as on a GPU
    for decode_mma in (True, False):
        environment = EnvironmentConfig(decode_mma=decode_mma)
        for rows in (1, 4, 32):
            for max_context in (64, 512, 4096):
                q, k_cache = np.empty((rows, heads, head_dim), np.float32), np.empty((1, 16, kv_heads, head_dim), np.uint16)
                v_cache, out = np.empty((1, 16, kv_heads, value_dim), np.uint16), None
                batch = SimpleNamespace(max_context=max_context)
                got = chosen("paged_attention_decode", "cuda", environment, q, k_cache, v_cache, batch, 0.1, None, out, 0)
                want = launchers_decode_choice(heads, kv_heads, head_dim, value_dim, rows, max_context, decode_mma)
                assert got.startswith(f"metrale.kernels.{want}"), (rows, max_context, decode_mma, got)
        got = chosen("paged_attention_prompt", "cuda", environment, q, k_cache, v_cache, batch, 0.1, None, out, 1)
        assert launchers_prompt_choice(heads, kv_heads, head_dim, value_dim) in got


def test_softcap_and_sinks_go_to_the_kernels_that_serve_them(monkeypatch):
    from metrale.kernels import attention_decode_mma

    monkeypatch.setattr(attention_decode_mma, "SIMULATED", False)
    environment = EnvironmentConfig()
    q, k_cache = np.empty((4, 32, 64), np.float32), np.empty((1, 16, 8, 64), np.uint16)
    batch = SimpleNamespace(max_context=512)
    sinks = np.zeros(32, np.float32)
    for softcap, with_sinks in ((None, False), (30.0, False), (None, True)):
        options = (softcap, sinks if with_sinks else None)
        plain = softcap is None and not with_sinks
        decode = chosen("paged_attention_decode", "cuda", environment, q, k_cache, k_cache, batch, 0.1, None, None, 0,
                        *options)
        prompt = chosen("paged_attention_prompt", "cuda", environment, q, k_cache, k_cache, batch, 0.1, None, None, 0,
                        *options)
        # The tensor-core kernels of both kinds of rows serve soft caps and sinks.
        assert "attention_decode_mma" in decode and prompt.startswith("metrale.kernels.attention_mma")
        # Without the tensor-core decode kernel: the per-head CUDA-core kernels.
        decode = chosen("paged_attention_decode", "cuda", EnvironmentConfig(decode_mma=False), q, k_cache, k_cache,
                        batch, 0.1, None, None, 0, *options)
        cores = launchers_decode_choice(32, 8, 64, 64, 4, 512, decode_mma=False) if plain else "attention "
        assert decode.startswith(f"metrale.kernels.{cores}")
    serving = builtin_registry().serving("paged_attention_decode", "cuda")
    # An FP8 cache's kernels serve softcap and sinks too: the tensor-core one, the CUDA-core one past it.
    assert "an FP8 cache, K and V heads of 32, 64, 128 or 256 dims" in serving[0]
    assert serving[1].endswith("when an FP8 cache")
    assert "attention_decode_mma" in serving[2] and "softcap" not in serving[2]
    assert all("no softcap, no sinks" in line for line in serving[3:-1]) and " when " not in serving[-1]
    prompt_serving = builtin_registry().serving("paged_attention_prompt", "cuda")
    # The Hopper kernel (bf16 caches), an FP8 cache's tensor-core and row-at-a-time kernels, then the
    # bf16 tensor-core one: all serve softcap and sinks.
    assert "attention_hopper" in prompt_serving[0] and "softcap" not in prompt_serving[0]
    assert "an FP8 cache" in prompt_serving[1] and prompt_serving[2].endswith("when an FP8 cache")
    assert "attention_mma" in prompt_serving[3] and "softcap" not in prompt_serving[3]


def test_prompt_rows_on_compute_capability_9_take_the_hopper_kernel_where_it_serves(monkeypatch):
    from metrale.kernels import attention_hopper
    from metrale.kernels.kv_cache_fp8 import Fp8CacheArray

    batch = SimpleNamespace(max_context=512)
    q = np.empty((4, 32, 128), np.float32)

    def prompt(k_cache, v_cache, query=q, softcap=None, sinks=None):
        return chosen("paged_attention_prompt", "cuda", EnvironmentConfig(), query, k_cache, v_cache, batch, 0.1, None,
                      None, 0, softcap, sinks)

    cache = np.empty((4, 16, 8, 128), np.uint16)
    assert not attention_hopper.available()  # no device here: the mma.sync kernel
    assert prompt(cache, cache).startswith("metrale.kernels.attention_mma")
    monkeypatch.setattr(attention_hopper, "available", lambda: True)
    assert prompt(cache, cache).startswith("metrale.kernels.attention_hopper")
    assert prompt(cache, cache, softcap=30.0, sinks=np.zeros(32, np.float32)).startswith(
        "metrale.kernels.attention_hopper")
    # Pages of 4 rows, heads of 96 dims, an FP8 cache: the other kernels.
    small_pages = np.empty((4, 4, 8, 128), np.uint16)
    assert prompt(small_pages, small_pages).startswith("metrale.kernels.attention_mma")
    odd = np.empty((4, 16, 8, 96), np.uint16)
    assert not prompt(odd, odd, query=np.empty((4, 32, 96), np.float32)).startswith("metrale.kernels.attention_hopper")
    fp8 = Fp8CacheArray(np.zeros((4, 16, 8, 128), np.uint8), np.ones((4, 16, 8), np.float32))
    assert prompt(fp8, fp8).startswith("metrale.kernels.attention_mma (tensor cores, each step's codes")


def test_an_fp8_cache_goes_to_the_fp8_kernels():
    from metrale.kernels.kv_cache_fp8 import Fp8CacheArray

    q = np.empty((4, 32, 64), np.float32)
    cache = Fp8CacheArray(np.zeros((1, 16, 8, 64), np.uint8), np.ones((1, 16, 8), np.float32))
    batch = SimpleNamespace(max_context=512)
    for softcap, sinks in ((None, None), (30.0, np.zeros(32, np.float32))):
        decode = chosen("paged_attention_decode", "cuda", EnvironmentConfig(), q, cache, cache, batch, 0.1, None, None,
                        0, softcap, sinks)
        prompt = chosen("paged_attention_prompt", "cuda", EnvironmentConfig(), q, cache, cache, batch, 0.1, None, None,
                        0, softcap, sinks)
        # (q's 64 dims are the tensor-core prompt kernel's; the decode one is not served in the simulator)
        assert decode.startswith("metrale.kernels.attention_fp8") and prompt.startswith("metrale.kernels.attention_mma")
    odd = Fp8CacheArray(np.zeros((1, 16, 8, 96), np.uint8), np.ones((1, 16, 8), np.float32))
    prompt = chosen("paged_attention_prompt", "cuda", EnvironmentConfig(), np.empty((4, 32, 96), np.float32), odd, odd,
                    batch, 0.1, None, None, 0, None, None)
    assert prompt.startswith("paged_attention_decode")  # 96 dims: the rows as decode rows


def test_an_fp8_cache_goes_to_the_tensor_core_decode_kernel_where_it_serves_the_geometry(monkeypatch):
    from metrale.kernels import attention_decode_mma
    from metrale.kernels.kv_cache_fp8 import Fp8CacheArray

    monkeypatch.setattr(attention_decode_mma, "SIMULATED", False)
    batch = SimpleNamespace(max_context=512)
    for head_dim, expected in ((128, "metrale.kernels.attention_decode_mma"), (96, "metrale.kernels.attention_fp8")):
        q = np.empty((4, 32, head_dim), np.float32)
        cache = Fp8CacheArray(np.zeros((1, 16, 8, head_dim), np.uint8), np.ones((1, 16, 8), np.float32))
        decode = chosen("paged_attention_decode", "cuda", EnvironmentConfig(), q, cache, cache, batch, 0.1, None, None,
                        0, 30.0, None)
        assert decode.startswith(expected), head_dim
        off = chosen("paged_attention_decode", "cuda", EnvironmentConfig(decode_mma=False), q, cache, cache, batch, 0.1,
                     None, None, 0, None, None)
        assert off.startswith("metrale.kernels.attention_fp8")
    qkv = np.empty((4, (32 + 16) * 64), np.float32)
    write = chosen("qkv_rope_cache", "cuda", EnvironmentConfig(), qkv, None, None, None, 1.0, 32, 8, 64, cache, cache)
    assert write.startswith("metrale.kernels.qkv_rope (each key and value row quantized")  # one kernel
    wide = Fp8CacheArray(np.zeros((1, 16, 1, 640), np.uint8), np.ones((1, 16, 1), np.float32))
    wide_write = chosen("qkv_rope_cache", "cuda", EnvironmentConfig(), np.empty((4, 3 * 640), np.float32), None, None,
                        None, 1.0, 1, 1, 640, wide, wide)
    assert "attention_fp8" in wide_write  # heads past the fused form's limit: the rows, then the quantized write
    plain = chosen("qkv_rope_cache", "cuda", EnvironmentConfig(), qkv, None, None, None, 1.0, 32, 8, 64,
                   np.empty((1, 16, 8, 64), np.uint16), np.empty((1, 16, 8, 64), np.uint16))
    assert plain == "metrale.kernels.qkv_rope"


@pytest.mark.parametrize("rows, expected", [(1, "(CUDA C++)"), (2, "(CUDA C++)"), (3, "per head")])
def test_head_linear_takes_the_kernels_up_to_its_row_limit(rows, expected):
    x, weight = np.zeros((rows, 16, 128), np.float32), np.zeros((16 * 512, 128), np.uint16)
    assert expected in chosen("head_linear", "cuda", EnvironmentConfig(), x, weight)
    # A layout the CUDA C++ kernel does not read (in not a multiple of 8): the numba kernel.
    odd = np.zeros((1, 16, 100), np.float32), np.zeros((16 * 512, 100), np.uint16)
    assert chosen("head_linear", "cuda", EnvironmentConfig(), *odd) == "metrale.kernels.head_linear"


@pytest.mark.parametrize("tokens, expected", [(8, "moe_decode"), (9, "moe_grouped"), (700, "moe_grouped")])
def test_moe_experts_by_tokens(tokens, expected):
    hidden, inter, experts, top_k = 2048, 1408, 64, 6
    args = (np.zeros((tokens, hidden), np.uint16), np.zeros((tokens, top_k), np.int32), np.zeros((tokens, top_k), np.float32),
            np.zeros((experts * 2 * inter, 0), np.uint16), np.zeros((experts * hidden, inter), np.uint16))
    assert expected in chosen("moe_experts", "cuda", EnvironmentConfig(), *args)


@pytest.mark.parametrize("tokens, expected", [(4, "moe_route_decode"), (64, "router-logits kernel"),
                                              (65, "router logits by cuBLAS")])
def test_moe_route_by_tokens(tokens, expected):
    args = (np.zeros((tokens, 2048), np.uint16), np.zeros((64, 2048), np.float32), None, "greedy", 1, 1, 6, False, 1.0)
    assert expected in chosen("moe_route", "cuda", EnvironmentConfig(), *args)


def test_silu_and_mul_by_dtype_and_layout():
    environment = EnvironmentConfig()
    assert "(CUDA C++)" in chosen("silu_and_mul", "cuda", environment, np.zeros((3, 64), np.uint16))
    assert "(bf16 bits)" in chosen("silu_and_mul", "cuda", environment, np.zeros((3, 60), np.uint16))  # I not 8k
    assert "(float32)" in chosen("silu_and_mul", "cuda", environment, np.zeros((3, 64), np.float32))


def test_rmsnorm_residual_by_layout():
    environment = EnvironmentConfig()
    weight = np.zeros(4096, np.uint16)
    assert "(CUDA C++)" in chosen("rmsnorm_residual", "cuda", environment, np.zeros((2, 4096), np.float32), None, weight,
                                  1e-6)
    assert "(CUDA C++)" not in chosen("rmsnorm_residual", "cuda", environment, np.zeros((2, 4098), np.float32), None,
                                      np.zeros(4098, np.uint16), 1e-6)


def test_latent_attention_and_the_gated_delta_rule_by_geometry():
    environment = EnvironmentConfig()
    assert "mma" in chosen("latent_attention", "cuda", environment, np.zeros((2, 16, 576), np.float32), None, None, 512, 0.1)
    assert "mma" not in chosen("latent_attention", "cuda", environment, np.zeros((2, 8, 576), np.float32), None, None, 512,
                               0.1)
    q, v = np.zeros((5, 4, 128), np.float32), np.zeros((5, 4, 128), np.float32)
    assert "chunked" in chosen("gdn_prompt_rule", "cuda", environment, q, q, v, None, None, None, None, None)
    assert "recurrence" in chosen("gdn_prompt_rule", "cuda", environment, q[:, :, :96], q[:, :, :96], v, None, None, None,
                                  None, None)


@pytest.mark.parametrize("stacks, tokens, chosen", [
    ("bf16", 8, "moe_clamped (bf16 stacks)"),
    ("bf16", 9, "moe_grouped"),
    ("mxfp4", 127, "moe_clamped (MXFP4"),
    ("mxfp4", 128, "moe_grouped"),
    ("int4 act-order", 127, "moe_clamped (bf16 stacks)"),  # dequantized, pair by pair
    ("int4 act-order", 128, "moe_grouped"),
])
def test_gpt_oss_experts_take_the_grouped_kernels_for_many_tokens(stacks, tokens, chosen):
    """bf16 stacks from GROUPED_EXPERTS_MIN_TOKENS tokens, weight-only quantized stacks (dequantized
    for the call) from GROUPED_DEQUANTIZED_EXPERTS_MIN_TOKENS; below that MXFP4 in registers and
    other quantized stacks dequantized, pair by pair."""
    from metrale.kernels.quantized import QuantizedWeight
    from metrale.ops.selection import clamped_experts_kernels

    hidden, inter, experts, top_k = 64, 32, 4, 2

    def stack(rows, inner):
        if stacks == "bf16":
            return np.zeros((rows, inner), np.uint16)
        codes = np.zeros((rows, inner // 2), np.uint8)
        if stacks == "mxfp4":
            return QuantizedWeight("mxfp4", codes, np.ones((rows, inner // 32), np.float32), (1, 32), (rows, inner))
        return QuantizedWeight("int4", codes, np.ones((rows, inner // 32), np.float32), (1, 32), (rows, inner),
                               input_order=np.arange(inner, dtype=np.int32)[::-1].copy())

    arguments = (np.zeros((tokens, hidden), np.float32), np.zeros((tokens, top_k), np.int32),
                 np.zeros((tokens, top_k), np.float32), stack(experts * 2 * inter, hidden), stack(experts * hidden, inter),
                 1.702, 7.0)
    first = next(k for k in clamped_experts_kernels() if k.when is None or k.when(*arguments))
    assert chosen in first.name


@pytest.mark.parametrize("codes, activations, rows, expected", [
    ("fp8", "fp8_token", 1, "fp8_gemv"),
    ("fp8", "fp8_token", 7, "fp8_gemv"),
    ("fp8", "fp8_tensor", 3, "fp8_gemv"),
    ("fp8", "fp8_token", 8, "FP8 tensor cores"),
    ("fp8", "fp8_tensor", 32, "FP8 tensor cores"),
    ("fp8", "fp8_group", 1, "fp8_gemv"),  # block-wise FP8: the sums scaled block by block
    ("fp8", "fp8_group", 32, "fp8_gemv"),
    ("fp8", "fp8_group", 33, "staged input"),
    ("int4", "weight_only", 32, "int4_gemv"),
    ("int4-g32", "weight_only", 4, "quantized_gemv (decode GEMV)"),  # groups under 128 columns
    ("fp8", "fp8_token", 33, "FP8 tensor cores"),
    ("int4", "weight_only", 33, "staged input"),
])
def test_quantized_decode_rows_by_format_and_row_count(codes, activations, rows, expected):
    """FP8 weights whose scales factor out of the sums take FP8 tensor cores from
    FP8_TENSOR_CORE_MIN_ROWS rows and the FP8 GEMV below; block-wise FP8 the FP8 GEMV up to its 32
    rows; 4-bit weights in groups of 128 the 4-bit GEMV; other formats the quantized decode GEMV up
    to its 32 rows."""
    from metrale.kernels.quantized import QuantizedWeight
    from metrale.ops.selection import FP8_TENSOR_CORE_MIN_ROWS

    assert FP8_TENSOR_CORE_MIN_ROWS == 8
    out, inner = 64, 256
    if codes == "fp8":
        block = (128, 128) if activations == "fp8_group" else (1, inner)
        scales = np.ones((-(-out // block[0]), -(-inner // block[1])), np.float32)
        weight = QuantizedWeight("fp8", np.zeros((out, inner), np.uint8), scales, block, (out, inner),
                                 activations=activations,
                                 input_scale=np.asarray(0.1, np.float32) if activations == "fp8_tensor" else None)
    else:
        group = 32 if codes == "int4-g32" else 128
        weight = QuantizedWeight("int4", np.zeros((out, inner // 2), np.uint8), np.ones((out, inner // group), np.float32),
                                 (1, group), (out, inner))
    assert expected in chosen("linear", "cuda", EnvironmentConfig(), np.zeros((rows, inner), np.float32), weight)
