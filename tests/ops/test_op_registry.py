"""The op layer: declarations, kernels under conditions, plugin ops and kernels, the kernel check."""

from __future__ import annotations

import numpy as np
import pytest

from metrale import LLM, SamplingParams
from metrale.backends.base import CpuBackend
from metrale.errors import KernelMismatchError, OpNameClashError, OpRegistrationError, UnknownOpError
from metrale.model.hookspecs import hookimpl
from metrale.model.plugin_manager import get_plugin_manager
from metrale.ops import Kernel, Op, Operand, build_op_registry
from metrale.ops.builtin import builtin_registry
from metrale.ops.check import assert_kernels_match, check_plugin_kernels
from metrale.ops.selection import BATCH_INVARIANT_OPS

GREEDY = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)


class KernelPlugin:
    """A plugin adding ``kernels`` (and ``ops``) through metrale_register_ops."""

    METRALE_CONTRACT_VERSION = "1.1"

    def __init__(self, kernels=(), ops=()):
        self.kernels, self.ops = list(kernels), list(ops)

    @hookimpl
    def metrale_register_ops(self, registry):
        for op in self.ops:
            registry.declare(op)
        for kernel in self.kernels:
            registry.add_kernel(kernel)


def manager_with(plugin, name="kernel_plugin"):
    manager = get_plugin_manager(entry_points=False)
    manager.register(plugin, name=name)
    return manager


def counting_rmsnorm(calls, shift=0.0):
    reference = builtin_registry().ops["rmsnorm"].reference

    def rmsnorm(x, weight, eps, offset=0.0):
        calls.append(x.shape)
        return reference(x, weight, eps, offset) + np.float32(shift)

    return rmsnorm


def test_every_builtin_op_has_a_reference_and_a_cuda_kernel():
    import ast
    import inspect

    import metrale.ops

    registry = builtin_registry()
    for op in registry:
        assert callable(op.reference)
        assert [k.name for k in registry.kernels_for(op.name, "cuda")], f"{op.name} has no CUDA kernel"
    # (metrale.ops.cuda imports CuPy: read its methods from the source.)
    source = (inspect.getfile(metrale.ops).rsplit("/", 1)[0]) + "/cuda.py"
    tree = ast.parse(open(source).read())
    (kernels,) = [node for node in tree.body if isinstance(node, ast.ClassDef) and node.name == "CudaKernels"]
    methods = {node.name for node in kernels.body if isinstance(node, ast.FunctionDef)}
    # Every kernel bound to a CudaKernels method names one that exists.
    backend = type("Backend", (), {"kernels": type("Kernels", (), dict.fromkeys(methods, lambda *a: None))(),
                                   "name": "cuda", "xp": np})()
    for kernel in registry.kernels:
        if kernel.backend == "cuda":
            try:
                kernel.build(backend)
            except AttributeError as error:
                raise AssertionError(f"{kernel.op}: {kernel.name} names no CudaKernels method") from error
    # The fused ops served by composing other ops, and the split of paged_attention's rows, have
    # no method of their own.
    # (The batch-invariant CPU kernels, bound under batch_invariant=True only, are kernels of their own.)
    composed = {op for op in registry.ops
                if any(k.enabled is None for k in registry.kernels_for(op, "cpu"))}
    assert composed == {"rmsnorm_linear", "rmsnorm_mlp", "gdn_decode", "paged_attention"}
    invariant = {op for op in registry.ops if any(k.enabled is not None for k in registry.kernels_for(op, "cpu"))}
    assert invariant == set(BATCH_INVARIANT_OPS)


def test_the_cpu_table_runs_the_references():
    backend = CpuBackend()
    x = np.random.default_rng(0).standard_normal((3, 8)).astype(np.float32)
    weight = np.ones(8, dtype=np.float32)
    expected = x / np.sqrt((x * x).mean(axis=1, keepdims=True) + 1e-6)
    np.testing.assert_allclose(backend.ops.rmsnorm(x, weight, 1e-6), expected, rtol=1e-6)
    with pytest.raises(UnknownOpError, match="no op 'layer_magic'.*metrale_register_ops"):
        backend.ops.layer_magic(x)
    assert not hasattr(backend.ops, "layer_magic")


def test_a_plugin_kernel_overrides_a_builtin_op_and_the_engine_uses_it():
    reference = LLM("tiny-dense", device="cpu", show_progress=False).generate(["Return the"], GREEDY)[0].token_ids
    calls = []
    kernel = Kernel("rmsnorm", "cpu", "test.rmsnorm", build=lambda backend: counting_rmsnorm(calls))
    # The dense family runs the residual variant in its layers and plain rmsnorm only where a
    # model has no residual yet, so override both through one plugin.
    residual_calls = []
    residual_reference = builtin_registry().ops["rmsnorm_residual"].reference

    def residual(x, residual, weight, eps, offset=0.0):
        residual_calls.append(x.shape)
        return residual_reference(x, residual, weight, eps, offset)

    residual_kernel = Kernel("rmsnorm_residual", "cpu", "test.rmsnorm_residual", build=lambda backend: residual)
    llm = LLM("tiny-dense", device="cpu", show_progress=False,
              plugin_manager=manager_with(KernelPlugin([kernel, residual_kernel])))
    assert llm.generate(["Return the"], GREEDY)[0].token_ids == reference
    assert residual_calls, "the engine never called the plugin's kernel"
    registry = build_op_registry(manager_with(KernelPlugin([kernel])))
    assert registry.serving("rmsnorm", "cpu")[0] == "test.rmsnorm [kernel_plugin]"
    assert registry.serving("rmsnorm", "cpu")[1:] == []


def test_a_kernel_with_a_condition_serves_only_the_calls_it_applies_to():
    calls = []
    kernel = Kernel("rmsnorm", "cpu", "test.wide", build=lambda backend: counting_rmsnorm(calls),
                    when=lambda x, *args, **kwargs: x.shape[1] >= 16, condition="H >= 16")
    backend = CpuBackend()
    backend.use_ops(build_op_registry(manager_with(KernelPlugin([kernel]))))
    rng = np.random.default_rng(1)
    backend.ops.rmsnorm(rng.standard_normal((2, 8)).astype(np.float32), np.ones(8, np.float32), 1e-6)
    assert calls == []
    backend.ops.rmsnorm(rng.standard_normal((2, 16)).astype(np.float32), np.ones(16, np.float32), 1e-6)
    assert calls == [(2, 16)]
    serving = build_op_registry(manager_with(KernelPlugin([kernel]))).serving("rmsnorm", "cpu")
    assert serving == ["test.wide [kernel_plugin] when H >= 16", "reference [metrale]"]


def test_the_kernel_check_passes_a_right_kernel_and_catches_a_wrong_one():
    good = Kernel("rmsnorm", "cpu", "test.good", build=lambda backend: counting_rmsnorm([]))
    assert check_plugin_kernels(build_op_registry(manager_with(KernelPlugin([good]))), CpuBackend()) == []
    wrong = Kernel("rmsnorm", "cpu", "test.shifted", build=lambda backend: counting_rmsnorm([], shift=1e-2))
    registry = build_op_registry(manager_with(KernelPlugin([wrong])))
    with pytest.raises(KernelMismatchError, match=r"test\.shifted.*rmsnorm example 0 result 0: relative error"):
        assert_kernels_match(registry, CpuBackend())


def test_the_conformance_kit_fails_on_a_wrong_kernel(monkeypatch):
    from metrale.model import plugin_manager
    from metrale.testing.conformance import FamilyConformance

    wrong = Kernel("rmsnorm", "cpu", "test.shifted", build=lambda backend: counting_rmsnorm([], shift=1e-2))
    monkeypatch.setattr(plugin_manager, "get_plugin_manager", lambda: manager_with(KernelPlugin([wrong])))
    with pytest.raises(KernelMismatchError, match="test.shifted"):
        FamilyConformance().test_plugin_kernels_match_their_references()
    monkeypatch.setattr(plugin_manager, "get_plugin_manager", lambda: manager_with(KernelPlugin()))
    FamilyConformance().test_plugin_kernels_match_their_references()


def scaled_sum(x, y, scale):
    return (np.asarray(x, np.float32) + np.asarray(y, np.float32)) * np.float32(scale)


SCALED_SUM = Op(
    "scaled_sum", "``(x + y) * scale``.",
    (Operand("x", "[N, H]"), Operand("y", "[N, H]"), Operand("scale", kind="scalar")),
    (Operand("out", "[N, H]"),), scaled_sum,
    examples=lambda rng: [{"x": rng.standard_normal((2, 4)).astype(np.float32),
                           "y": rng.standard_normal((2, 4)).astype(np.float32), "scale": 0.5}],
)


def test_a_plugin_declares_a_new_op():
    backend = CpuBackend()
    backend.use_ops(build_op_registry(manager_with(KernelPlugin(ops=[SCALED_SUM]))))
    x, y = np.ones((2, 4), np.float32), np.full((2, 4), 3.0, np.float32)
    np.testing.assert_array_equal(backend.ops.scaled_sum(x, y, 0.5), np.full((2, 4), 2.0))
    registry = build_op_registry(manager_with(KernelPlugin(ops=[SCALED_SUM])))
    assert registry.ops["scaled_sum"].origin == "kernel_plugin"
    assert registry.serving("scaled_sum", "cuda") == ["host fallback of the reference [kernel_plugin]"]


def test_bad_declarations_are_refused_with_the_plugin_named():
    with pytest.raises(OpNameClashError, match="plugin 'kernel_plugin' declares op 'scaled_sum' twice"):
        build_op_registry(manager_with(KernelPlugin(ops=[SCALED_SUM, SCALED_SUM])))
    with pytest.raises(OpRegistrationError, match="op 'no_such_op', which is not declared"):
        build_op_registry(manager_with(KernelPlugin([Kernel("no_such_op", "cpu", "k", build=lambda b: None)])))
    with pytest.raises(OpRegistrationError, match="the reference takes"):
        Op("bad", "", (Operand("a"),), (), lambda b: b)
    with pytest.raises(OpRegistrationError, match="must say its condition"):
        Kernel("rmsnorm", "cpu", "k", build=lambda b: None, when=lambda *a: True)
    with pytest.raises(OpRegistrationError, match="backend must be"):
        Kernel("rmsnorm", "tpu", "k", build=lambda b: None)


def test_two_plugins_declaring_one_op_name_are_both_named():
    manager = get_plugin_manager(entry_points=False)
    manager.register(KernelPlugin(ops=[SCALED_SUM]), name="gemma2")
    manager.register(KernelPlugin(ops=[SCALED_SUM]), name="fast_ops")
    manager.distributions.update(gemma2="metrale-gemma2", fast_ops="fast-ops")
    with pytest.raises(OpNameClashError) as info:
        build_op_registry(manager)
    message, error = str(info.value), info.value
    assert error.op == "scaled_sum" and sorted(error.origins) == ["fast_ops", "gemma2"]
    first, second = error.origins
    distributions = {"gemma2": "metrale-gemma2", "fast_ops": "fast-ops"}
    assert (f"plugin {first!r} (distribution {distributions[first]!r}) and plugin {second!r} "
            f"(distribution {distributions[second]!r}) both declare op 'scaled_sum'") in message
    assert f"METRALE_BLOCKED_PLUGINS={second}" in message
    assert "built-in" not in message
    assert (error.plugin, error.distribution) == (second, distributions[second])
    # The engine refuses with the same error, whatever model it is asked to load.
    with pytest.raises(OpNameClashError, match="both declare op 'scaled_sum'"):
        LLM("tiny-dense", device="cpu", show_progress=False, plugin_manager=manager)


def test_a_plugin_declaring_a_builtin_op_is_told_to_register_a_kernel():
    gelu = builtin_registry().ops["gelu"]
    with pytest.raises(OpNameClashError, match=r"plugin 'kernel_plugin' declares op 'gelu', which is a built-in op of "
                                               r"Metrale; .* registers Kernel\('gelu', ...\)") as info:
        build_op_registry(manager_with(KernelPlugin(ops=[gelu])))
    assert info.value.origins == ("metrale", "kernel_plugin")


def test_a_failing_registration_names_the_plugin():
    class Broken:
        METRALE_CONTRACT_VERSION = "1.1"

        @hookimpl
        def metrale_register_ops(self, registry):
            raise RuntimeError("boom")

    with pytest.raises(OpRegistrationError, match="plugin 'broken': metrale_register_ops failed.*boom"):
        build_op_registry(manager_with(Broken(), name="broken"))


def test_the_decode_kernels_bound_by_default_come_before_the_unconditional_ones():
    registry = builtin_registry()
    assert registry.serving("rmsnorm_mlp", "cuda") == [
        "rmsnorm_residual, then linear_silu and linear (their kernels) [metrale] when batch_invariant=True",
        "metrale.kernels.fp8_gemv (the norm in the gated gate/up GEMV's prologue), then the down GEMV [metrale] when "
        "FP8 weights and inputs whose scales factor out of the sums, or block-wise FP8, rows the prologue stages in "
        "shared memory (up to 4), inner sizes multiples of 16, bf16 norm weights, no gate_up bias",
        "metrale.kernels.quantized_gemv (the norm written as the gate/up product's FP8 input rows where it serves "
        "them; rmsnorm_residual otherwise), the cuBLASLt FP8 gate/up product (bf16 out, the scales in its epilogue), "
        "metrale.kernels.quantized_gemv (the SwiGLU gate and the down product's FP8 input rows in one pass), the "
        "cuBLASLt FP8 down product [metrale] when FP8 weights and inputs whose scales factor out of the sums, N >= 8, "
        "no gate_up bias",
        "metrale.kernels.decode_gemv (the norm and the gate fused) [metrale] when N <= 1, bf16 weights, inner sizes "
        "a multiple of 32, no gate_up bias, weights of at most 128 MiB",
        "rmsnorm_residual, then linear_silu and linear (their kernels) [metrale]"]
    assert registry.serving("linear", "cuda") == [
        "metrale.kernels.decode_gemv (plain, the batch-invariant order) [metrale] when batch_invariant=True, bf16 "
        "weights, the inner size a multiple of 32, rows the decode kernel stages",
        "metrale.kernels.linear_invariant (tiled, the decode kernel's order) [metrale] when batch_invariant=True, "
        "bf16 weights, the inner size a multiple of 32",
        "refused [metrale] when batch_invariant=True, any other weight",
        "metrale.kernels.quantized_gemv (FP8 rows), cuBLASLt FP8 product (FP8 tensor cores) [metrale] when FP8 weights "
        "and inputs whose scales factor out of the sums, N >= 8",
        "metrale.kernels.fp8_gemv (FP8 decode GEMV, the scales applied once a sum or a 128-column block) [metrale] when "
        "FP8 weights and inputs whose scales factor out of the sums, or block-wise FP8 (blocks of 128 columns, inputs "
        "in groups of 128), at most 32 rows, the inner size a multiple of 16",
        "metrale.kernels.int4_gemv (4-bit decode GEMV, a group's sums scaled at once) [metrale] when 4-bit "
        "weight-only weights in groups of a multiple of 128 columns, at most 32 rows",
        "metrale.kernels.quantized_gemv (decode GEMV) [metrale] when a quantized weight, at most 32 rows, the inner "
        "size a multiple of 32",
        "metrale.kernels.quantized_gemv (staged input, bf16 dequantization), cuBLAS GEMM [metrale] when a quantized "
        "weight",
        "metrale.kernels.decode_gemv (float32 rows, rounded as they are staged) [metrale] when N <= 8, bf16 weights, "
        "inner sizes a multiple of 32, contiguous float32 rows",
        "metrale.kernels.decode_gemv [metrale] when N <= 8, bf16 weights, inner sizes a multiple of 32",
        "cuBLAS GEMM (metrale.kernels.linear) [metrale]"]
    assert registry.serving("rmsnorm_linear", "cuda")[1].startswith("metrale.kernels.fp8_gemv (the norm in its "
                                                                     "prologue) [metrale] when FP8 weights")
    assert registry.serving("rmsnorm_linear", "cuda")[2].startswith(
        "metrale.kernels.quantized_gemv (the norm written as the product's FP8 input rows), the cuBLASLt FP8 product "
        "[metrale] when FP8 weights and inputs whose scales factor out of the sums, N >= 8")
    assert registry.serving("rmsnorm_linear", "cuda")[3].startswith(
        "metrale.kernels.decode_gemv (the norm fused) [metrale] when N <= 2")
    experts = registry.serving("moe_experts", "cuda")
    assert experts[0] == "refused [metrale] when batch_invariant=True"
    assert experts[1].startswith("metrale.kernels.fp8_gemv (a routed pair a grid row")
    assert "when FP8 stacked weights" in experts[1]
    assert experts[2].startswith("metrale.kernels.quantized_moe_decode [metrale] when quantized stacked weights, N <= 8")
    assert experts[3].endswith("when quantized stacked weights")
    assert experts[4].startswith("metrale.kernels.moe_decode [metrale] when N <= 8")
    assert registry.serving("gdn_decode", "cuda")[0].startswith("metrale.kernels.gdn_decode [metrale] when")
    for op in ("linear", "rmsnorm_linear", "rmsnorm_mlp", "moe_experts", "gdn_decode"):
        assert registry.kernels_for(op, "cuda")[-1].when is None  # what serves every other call


def test_the_decode_gemv_kernels_take_what_they_serve():
    from metrale.ops.builtin import decode_gemv_kernels

    registry = builtin_registry().copy()
    for kernel in decode_gemv_kernels(max_rows=4):
        registry.from_plugin("tuning").add_kernel(kernel)
    kernels = {kernel.op: kernel for kernel in decode_gemv_kernels(max_rows=4)}  # (linear: the bf16 rows' kernel)
    serving = registry.serving("rmsnorm_linear", "cuda")[0]
    assert serving.startswith("metrale.kernels.decode_gemv (the norm fused) [tuning] when N <= 4")

    def bits(*shape):
        return np.zeros(shape, np.uint16)

    def floats(*shape):
        return np.zeros(shape, np.float32)

    norm_linear = kernels["rmsnorm_linear"].when
    assert norm_linear(floats(4, 64), None, bits(64), 1e-6, 0.0, bits(32, 64))
    assert not norm_linear(floats(5, 64), None, bits(64), 1e-6, 0.0, bits(32, 64))  # more rows than max_rows
    assert not norm_linear(floats(4, 80), None, bits(80), 1e-6, 0.0, bits(32, 80))  # not a multiple of 32
    assert not norm_linear(floats(4, 64), None, bits(64), 1e-6, 0.0, floats(32, 64))  # float32 weights (the CPU's)
    norm_mlp = kernels["rmsnorm_mlp"].when
    assert norm_mlp(floats(2, 64), None, bits(64), 1e-6, 0.0, bits(128, 64), bits(64, 64))
    assert not norm_mlp(floats(2, 64), None, bits(64), 1e-6, 0.0, bits(128, 64), bits(64, 64), floats(128))  # gate bias
    assert kernels["linear"].when(bits(3, 128), bits(16, 128)) and not kernels["linear"].when(bits(3, 100), bits(16, 100))
    (float_rows,) = [k for k in decode_gemv_kernels(max_rows=4) if k.op == "linear" and "float32" in k.name]
    assert float_rows.when(floats(3, 128), bits(16, 128)) and not float_rows.when(bits(3, 128), bits(16, 128))
    assert not float_rows.when(floats(3, 256)[:, ::2], bits(16, 128))  # rows that are not contiguous


def test_the_default_fused_mlp_serves_one_row_of_a_small_mlp():
    from metrale.ops.builtin import FUSED_MLP_MAX_BYTES, default_decode_kernels

    (mlp,) = [kernel for kernel in default_decode_kernels() if kernel.op == "rmsnorm_mlp"]

    class Weight:  # the shape and size of a bf16 weight, without its memory
        dtype = np.dtype(np.uint16)

        def __init__(self, rows, columns):
            self.shape, self.nbytes = (rows, columns), 2 * rows * columns

    x, norm = np.zeros((1, 2048), np.float32), np.zeros(2048, np.uint16)
    small = (Weight(16384, 2048), Weight(2048, 8192))  # a 1B-shaped MLP, 101 MB
    large = (Weight(28672, 4096), Weight(4096, 14336))  # an 8B-shaped one, 352 MB
    assert sum(w.nbytes for w in small) <= FUSED_MLP_MAX_BYTES < sum(w.nbytes for w in large)
    assert mlp.when(x, None, norm, 1e-5, 0.0, *small)
    assert not mlp.when(np.zeros((1, 4096), np.float32), None, np.zeros(4096, np.uint16), 1e-5, 0.0, *large)
    assert not mlp.when(np.zeros((2, 2048), np.float32), None, norm, 1e-5, 0.0, *small)  # two rows: unfused


def test_the_decode_moe_kernel_takes_decode_batches():
    from metrale.ops.builtin import moe_decode_kernels

    (kernel,) = moe_decode_kernels(max_tokens=4)
    assert kernel.op == "moe_experts"
    experts, weights = np.zeros((4, 6), np.int32), np.zeros((4, 6), np.float32)
    gate_up, down = np.zeros((0, 2048), np.uint16), np.zeros((0, 1408), np.uint16)  # only shapes and dtypes are read
    assert kernel.when(np.zeros((4, 2048), np.uint16), experts, weights, gate_up, down)
    assert not kernel.when(np.zeros((5, 2048), np.uint16), np.zeros((5, 6), np.int32), weights, gate_up, down)
    assert not kernel.when(np.zeros((4, 2048), np.uint16), experts, weights, gate_up, np.zeros((0, 1404), np.uint16))
    assert not kernel.when(np.zeros((4, 2048), np.uint16), experts, weights, gate_up.astype(np.float32), down)


def test_the_decode_router_kernel_is_a_default_and_takes_decode_batches():
    from metrale.ops.builtin import moe_route_decode_kernels

    default = [kernel for kernel in builtin_registry().kernels if kernel.op == "moe_route" and kernel.when][0]
    assert default.condition == moe_route_decode_kernels()[0].condition
    (kernel,) = moe_route_decode_kernels(max_tokens=4)
    assert kernel.op == "moe_route"
    gate = np.zeros((64, 2048), np.float32)  # only shapes and dtypes are read
    assert kernel.when(np.zeros((4, 2048), np.uint16), gate, None, "greedy", 1, 1, 6, False, 1.0)
    assert not kernel.when(np.zeros((5, 2048), np.uint16), gate, None, "greedy", 1, 1, 6, False, 1.0)
    assert not kernel.when(np.zeros((4, 2048), np.uint16), gate.astype(np.uint16), None, "greedy", 1, 1, 6, False, 1.0)
    assert not kernel.when(np.zeros((4, 2048), np.uint16), np.zeros((512, 2048), np.float32), None, "noaux_tc", 8, 4, 8,
                           True, 2.5)  # more experts than it serves
