"""Batch-invariant mode (``batch_invariant=True``, docs/serving.rst "Batch-invariant mode"): on the
CPU a prompt's logits are bitwise the same alone and in a batch, with chunked prefill, prefix-cache
hits and mixed decode + prefill steps; the default mode is not; on the GPU the ops without an invariant
kernel are refused and the others bound to their invariant kernels (tests/engine/test_batch_invariant_gpu.py
runs them)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from metrale import LLM, SamplingParams
from metrale.backends.base import CpuBackend
from metrale.config import EngineConfig, EnvironmentConfig
from metrale.errors import ConfigError
from metrale.kernels import batch_invariant
from metrale.kernels.attention import paged_attention_reference
from metrale.models import embedded_model_path
from metrale.ops.plugin_kernels import capturing

#: Mixed lengths: one-token prompts, prompts within a block, prompts of several blocks.
PROMPT_LENGTHS = (3, 17, 40, 9, 33, 1, 25, 12)
GREEDY = SamplingParams(max_tokens=4, temperature=0.0)


def prompts(shared_prefix: int = 0, seed: int = 1) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    prefix = [int(t) for t in rng.integers(3, 120, size=shared_prefix)]
    return [prefix + [int(t) for t in rng.integers(3, 120, size=n)] for n in PROMPT_LENGTHS]


def on_host(array) -> np.ndarray:
    """A batch's index array on the host (on the GPU the prepared batch holds CuPy arrays)."""
    return np.asarray(array.get() if hasattr(array, "get") else array)


class Recorded:
    """Every logits row the model returns eagerly, by ``(prompt, position)``, and whether a step
    mixed decode rows with prompt rows."""

    def __init__(self, llm: LLM) -> None:
        self.logits: dict[tuple[tuple[int, ...], int], list[np.ndarray]] = {}
        self.mixed_steps = 0
        model, inner = llm.model, llm.model.forward_batch

        def forward_batch(batch):
            out = inner(batch)
            if capturing(llm.backend):
                return out  # a graph's capture: nothing may be read back (its replays are not recorded either)
            host = llm.backend.to_numpy(out)
            starts = on_host(batch.row_starts)
            lengths = np.diff(starts)
            self.mixed_steps += bool((lengths == 1).any() and (lengths > 1).any())
            for index, row in enumerate(on_host(batch.logits_rows)):
                segment_index = int(np.searchsorted(starts, row, side="right") - 1)
                if segment_index >= len(batch.segments):
                    continue  # a padding row of a captured shape
                segment = batch.segments[segment_index]
                position = segment.start + int(row - starts[segment_index])
                key = (tuple(segment.seq.tokens[: segment.seq.prompt_len]), position)
                self.logits.setdefault(key, []).append(host[index].copy())
            return out

        model.forward_batch = forward_batch


def run(path: Path, batch: list[list[int]], *, alone: bool, params: SamplingParams = GREEDY, repeat: int = 1,
        **options) -> tuple[list[list[int]], Recorded]:
    """The tokens of every prompt (of the last of ``repeat`` runs) and the logits recorded, run
    one prompt after the other (``alone``) or all at once."""
    options.setdefault("device", "cpu")
    with LLM(path, show_progress=False, overlap_scheduling=False, **options) as llm:
        recorded = Recorded(llm)
        for _ in range(repeat):
            if alone:
                outputs = [llm.generate([{"prompt_token_ids": p}], params)[0] for p in batch]
            else:
                outputs = llm.generate([{"prompt_token_ids": p} for p in batch], params)
        return [list(o.outputs[0].token_ids) for o in outputs], recorded


def differing(alone: Recorded, together: Recorded) -> list:
    """The keys whose logits are not bitwise those of the prompt run alone."""
    return [key for key, rows in alone.logits.items()
            if key not in together.logits or not all(np.array_equal(rows[0], row) for row in together.logits[key])]


@pytest.fixture
def family_checkpoint(request):
    name = request.param
    if name.startswith("tiny-"):
        return Path(embedded_model_path(name))
    fixture, variant = name.split(":")
    return request.getfixturevalue(fixture)[variant]


FAMILIES = ["tiny-dense", "tiny-mla", "tiny-gdn", "moe_checkpoints:qwen3_moe", "gemma_checkpoints:gemma2",
            "gpt_oss_checkpoints:gpt_oss"]


@pytest.mark.parametrize("family_checkpoint", FAMILIES, indirect=True)
def test_a_prompt_gives_the_same_bits_alone_and_in_a_batch(family_checkpoint):
    batch = prompts()
    tokens, alone = run(family_checkpoint, batch, alone=True, batch_invariant=True, enable_prefix_caching=False)
    together_tokens, together = run(family_checkpoint, batch, alone=False, batch_invariant=True,
                                    enable_prefix_caching=False)
    assert together_tokens == tokens
    assert not differing(alone, together)
    # Chunked prefill (chunks of a block), with decode rows and prompt chunks in the same steps.
    chunked_tokens, chunked = run(family_checkpoint, batch, alone=False, batch_invariant=True,
                                  enable_prefix_caching=False, max_num_batched_tokens=16)
    assert chunked_tokens == tokens
    # (The scheduler runs an MLA prompt whole, alone in its step: no chunks, no mixed steps.)
    assert chunked.mixed_steps > 0 or family_checkpoint.name == "tiny-mla"
    assert not differing(alone, chunked)


@pytest.mark.parametrize("family_checkpoint", ["tiny-dense", "tiny-mla", "tiny-gdn", "moe_checkpoints:qwen3_moe",
                                               "gemma_checkpoints:gemma3"], indirect=True)
def test_prefix_cache_hits_give_the_same_bits(family_checkpoint):
    batch = prompts(shared_prefix=32)
    tokens, alone = run(family_checkpoint, batch, alone=True, batch_invariant=True, enable_prefix_caching=False)
    # The second run hits the first's cached prefixes (the shared one and each whole prompt's blocks).
    hit_tokens, hits = run(family_checkpoint, batch, alone=False, batch_invariant=True, repeat=2,
                           max_num_batched_tokens=24)
    assert hit_tokens == tokens
    assert not differing(alone, hits)


def test_seeded_sampling_reproduces_alone_and_in_a_batch():
    path = Path(embedded_model_path("tiny-dense"))
    batch = prompts()
    params = [SamplingParams(max_tokens=6, temperature=1.0, top_p=0.9, seed=100 + i) for i in range(len(batch))]
    with LLM(path, device="cpu", show_progress=False, batch_invariant=True) as llm:
        alone = [llm.generate([{"prompt_token_ids": p}], [q])[0].outputs[0].token_ids for p, q in zip(batch, params)]
        together = [o.outputs[0].token_ids for o in llm.generate([{"prompt_token_ids": p} for p in batch], params)]
    with LLM(path, device="cpu", show_progress=False, batch_invariant=True, max_num_batched_tokens=16) as llm:
        chunked = [o.outputs[0].token_ids for o in llm.generate([{"prompt_token_ids": p} for p in batch], params)]
    assert [list(t) for t in together] == [list(t) for t in alone] == [list(t) for t in chunked]


def test_the_default_mode_is_not_batch_invariant():
    """What the option changes: without it, some logits of a prompt run alone differ in their bits
    from the same prompt's in a batch (BLAS runs another kernel for one row than for many)."""
    path = Path(embedded_model_path("tiny-dense"))
    batch = prompts()
    _, alone = run(path, batch, alone=True, enable_prefix_caching=False)
    _, together = run(path, batch, alone=False, enable_prefix_caching=False)
    assert differing(alone, together)


# ------------------------------------------------------------------------------- the kernels


@pytest.mark.parametrize("out, inner", [(48, 64), (1000, 256), (300, 77)])
def test_a_row_of_a_product_is_that_row_alone(out, inner):
    rng = np.random.default_rng(0)
    weight = rng.standard_normal((out, inner)).astype(np.float32)
    x = rng.standard_normal((70, inner)).astype(np.float32)
    single = np.stack([batch_invariant.linear(x[i : i + 1], weight)[0] for i in range(len(x))])
    for rows in (1, 2, 7, 15, 16, 17, 33, 70):
        for first in (0, 3):
            assert np.array_equal(batch_invariant.linear(x[first : first + rows], weight), single[first : first + rows])
    exact = x.astype(np.float64) @ weight.T.astype(np.float64)
    assert np.abs(single - exact).max() <= 1e-6 * np.abs(exact).max() * np.sqrt(inner)


def test_attention_row_by_row_is_the_reference_and_invariant():
    rng = np.random.default_rng(2)
    blocks, block_size, kv_heads, heads, dim = 12, 4, 2, 4, 8
    k_cache = rng.standard_normal((blocks, block_size, kv_heads, dim)).astype(np.float32)
    v_cache = rng.standard_normal((blocks, block_size, kv_heads, dim)).astype(np.float32)
    tables = np.array([[1, 2, 3, 4, 5], [6, 7, 8, 9, 10]], dtype=np.int32)
    seq_index = np.array([0, 0, 0, 0, 0, 1, 1], dtype=np.int32)
    positions = np.array([3, 4, 5, 6, 17, 0, 9], dtype=np.int32)
    q = rng.standard_normal((len(positions), heads, dim)).astype(np.float32)
    sinks = rng.standard_normal(heads).astype(np.float32)
    for window, softcap, sink in ((None, None, None), (3, 20.0, sinks)):
        rows = batch_invariant.attention_rows(q, k_cache, v_cache, tables, seq_index, positions, 0.3, window, softcap,
                                              sink)
        reference = paged_attention_reference(q, k_cache, v_cache, tables, seq_index, positions, 0.3, window, softcap,
                                              sink)
        np.testing.assert_allclose(rows, reference, rtol=1e-5, atol=1e-6)
        for row in range(len(positions)):
            alone = batch_invariant.attention_rows(q[row : row + 1], k_cache, v_cache, tables, seq_index[row : row + 1],
                                                   positions[row : row + 1], 0.3, window, softcap, sink)
            assert np.array_equal(alone[0], rows[row])


def test_the_invariant_kernels_compute_their_ops():
    from metrale.ops.builtin import builtin_registry
    from metrale.ops.check import run_kernel_examples

    registry, backend = builtin_registry(), CpuBackend(EnvironmentConfig(batch_invariant=True))
    checked = set()
    for kernel in registry.kernels:
        if kernel.backend == "cpu" and kernel.enabled is not None and registry.ops[kernel.op].examples is not None:
            count, problems = run_kernel_examples(registry, kernel, backend)
            assert count and not problems, problems
            checked.add(kernel.op)
    assert {"linear", "linear_silu", "head_linear", "moe_route", "moe_experts_clamped", "lora_linear",
            "lora_expand"} <= checked


def test_gated_deltanet_prompts_token_by_token_are_the_chunked_form():
    from metrale.kernels import gated_delta

    rng = np.random.default_rng(3)
    tokens, heads, dk, dv, channels, taps = 23, 2, 8, 16, 12, 4
    starts, slots = np.array([0, 1, 11, 23], dtype=np.int32), np.array([3, 1, 2], dtype=np.int32)
    q, k = (rng.standard_normal((tokens, heads, dk)).astype(np.float32) * 0.3 for _ in range(2))
    v = rng.standard_normal((tokens, heads, dv)).astype(np.float32)
    g = -np.abs(rng.standard_normal((tokens, heads))).astype(np.float32) * 0.2
    beta = rng.uniform(0.1, 0.9, (tokens, heads)).astype(np.float32)
    state = rng.standard_normal((4, heads, dk, dv)).astype(np.float32) * 0.1
    inputs = rng.standard_normal((tokens, channels)).astype(np.float32)
    weight = rng.standard_normal((channels, taps)).astype(np.float32)
    conv = rng.standard_normal((4, channels, taps - 1)).astype(np.float32)
    ours, theirs = state.copy(), state.copy()
    np.testing.assert_allclose(batch_invariant.gdn_prompt_rule(q, k, v, g, beta, ours, slots, starts),
                               gated_delta.prompt_rule_reference(q, k, v, g, beta, theirs, slots, starts),
                               rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(ours, theirs, rtol=1e-4, atol=1e-5)
    ours, theirs = conv.copy(), conv.copy()
    np.testing.assert_allclose(batch_invariant.gdn_conv_prompts(inputs, weight, ours, slots, starts),
                               gated_delta.conv_prompts_reference(inputs, weight, theirs, slots, starts),
                               rtol=1e-5, atol=1e-6)
    assert np.array_equal(ours, theirs)


def test_the_op_table_binds_the_invariant_kernels_under_the_setting():
    from metrale.ops.builtin import builtin_registry

    invariant, default = CpuBackend(EnvironmentConfig(batch_invariant=True)), CpuBackend(EnvironmentConfig())
    assert invariant.ops.linear is batch_invariant.linear
    # (The split kernel stays bound behind it, never reached: the invariant kernel has no condition.)
    assert invariant.ops.paged_attention.kernels[0][1] is batch_invariant.paged_attention
    assert default.ops.linear is not batch_invariant.linear
    assert invariant.batch_invariant and not default.batch_invariant
    serving = builtin_registry().serving("gdn_prompt_rule", "cpu", EnvironmentConfig())
    assert serving[0] == "metrale.kernels.batch_invariant.gdn_prompt_rule [metrale] when batch_invariant=True " \
                         "(off in this environment)"


# ------------------------------------------------------------------------------ the option


def test_the_option_is_type_checked_and_reaches_the_backend_settings():
    with pytest.raises(ConfigError, match="batch_invariant"):
        EngineConfig(batch_invariant="yes")
    assert EngineConfig(batch_invariant=True).environment.batch_invariant
    assert not EngineConfig().environment.batch_invariant


def test_on_the_gpu_ops_without_an_invariant_kernel_are_refused_and_the_others_bound():
    """The GPU's kernels under batch_invariant=True: the ops whose kernels sum otherwise in other
    batches are refused with a typed error (a model calling them fails to load), the products and
    attention bound to the invariant kernels, the fused decode ops to their composites."""
    from metrale.ops.builtin import builtin_registry
    from metrale.ops.selection import CUDA_BATCH_VARIANT_OPS

    registry = builtin_registry()
    invariant = EnvironmentConfig(batch_invariant=True)
    for op in CUDA_BATCH_VARIANT_OPS:
        first = registry.kernels_for(op, "cuda")[0]
        assert first.name == "refused" and first.enabled(invariant) and not first.enabled(EnvironmentConfig())
        with pytest.raises(ConfigError, match=f"batch_invariant=True on the GPU serves {op} for no call"):
            first.build(None)()
    firsts = {op: next(kernel for kernel in registry.kernels_for(op, "cuda") if kernel.enabled(invariant))
              for op in ("linear", "linear_silu", "rmsnorm_linear", "rmsnorm_mlp", "paged_attention")}
    assert firsts["linear"].name == "metrale.kernels.decode_gemv (plain, the batch-invariant order)"
    products = [kernel.name for kernel in registry.kernels_for("linear", "cuda")
                if kernel.enabled is not None and kernel.enabled(invariant)]
    assert products[1] == "metrale.kernels.linear_invariant (tiled, the decode kernel's order)"
    assert firsts["paged_attention"].name.startswith("metrale.kernels.attention_mma (decode rows in its decode rows' form")
    for op in ("linear_silu", "rmsnorm_linear", "rmsnorm_mlp"):
        assert firsts[op].name.endswith("(their kernels)") and "batch_invariant=True" in firsts[op].condition


def test_a_family_that_does_not_say_it_runs_invariant_is_refused():
    from types import SimpleNamespace

    from metrale.loading.model import load_model
    from metrale.model.family import FamilyModel

    class Unsaid(FamilyModel):
        pass

    backend = CpuBackend(EnvironmentConfig(batch_invariant=True))
    model = Unsaid(backend, vocab_size=8, max_model_len=8)
    manager = SimpleNamespace(hook=SimpleNamespace(metrale_load_model=lambda **kwargs: model))
    family = SimpleNamespace(name="unsaid")
    with pytest.raises(ConfigError, match="batch_invariant_capable"):
        load_model(manager, family, None, backend, EngineConfig(batch_invariant=True))
    assert load_model(manager, family, None, CpuBackend(EnvironmentConfig()), EngineConfig()) is model
