"""The SwiGLU MLP: its weights, loading, shape checks and forward.

A public building block: any family may build its model from it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from metrale.batch import ForwardBatch
from metrale.layers.lora import linear_with_lora, lora_active, normed_projection
from metrale.loading.checkpoint import Checkpoint


@dataclass
class MlpWeights:
    """``gate_up [2 I, H]`` (gate rows first), ``down [H, I]``; optional biases; the adapter
    slots of the two products when LoRA is on (:mod:`metrale.layers.lora`)."""

    gate_up: Any
    down: Any
    gate_up_bias: Any = None
    down_bias: Any = None
    lora_gate_up: Any = None
    lora_down: Any = None
    #: On a rank of a tensor-parallel group: the rank's part of the intermediate size (rows of
    #: ``gate_proj`` and ``up_proj``, columns of ``down_proj``) and the whole size; None on a
    #: whole model. The adapter stacks take the same part of an adapter.
    shard_part: slice | None = None
    module_size: int | None = None


def load_mlp_weights(
    checkpoint: Checkpoint, backend: Any, prefix: str, hidden_size: int, intermediate_size: int, *, bias: bool = False
) -> MlpWeights:
    """Read ``{prefix}.{gate,up,down}_proj`` and fuse gate and up. On a rank of a
    tensor-parallel group (``backend.shard``) its part of the intermediate size only: those gate
    and up rows and ``down_proj``'s columns (the ranks' outputs are summed, ``down_proj``'s bias
    added on rank 0 only)."""
    shard = backend.shard
    part = shard.split(intermediate_size, "intermediate_size")
    weights = MlpWeights(
        gate_up=backend.load_weight(
            checkpoint,
            (f"{prefix}.gate_proj.weight", (intermediate_size, hidden_size), part, None),
            (f"{prefix}.up_proj.weight", (intermediate_size, hidden_size), part, None),
        ),
        down=backend.load_weight(checkpoint, (f"{prefix}.down_proj.weight", (hidden_size, intermediate_size), None,
                                              part)),
    )
    if shard.sharded:
        weights.shard_part, weights.module_size = part, intermediate_size
    if bias:
        gate_b = checkpoint.tensor(f"{prefix}.gate_proj.bias", (intermediate_size,))[part]
        up_b = checkpoint.tensor(f"{prefix}.up_proj.bias", (intermediate_size,))[part]
        weights.gate_up_bias = backend.constant(np.concatenate([gate_b, up_b]))
        down_b = checkpoint.tensor(f"{prefix}.down_proj.bias", (hidden_size,))
        weights.down_bias = backend.constant(down_b) if shard.rank == 0 else None
    return weights


def expect_mlp_shapes(checkpoint: Checkpoint, prefix: str, hidden_size: int, intermediate_size: int, *,
                      because: str) -> None:
    """Check (headers only) that ``{prefix}.{gate,up,down}_proj`` have the shapes
    :func:`load_mlp_weights` will ask for; ``because`` names the config fields they follow from."""
    checkpoint.expect_shape(f"{prefix}.gate_proj.weight", (intermediate_size, hidden_size), because=because)
    checkpoint.expect_shape(f"{prefix}.up_proj.weight", (intermediate_size, hidden_size), because=because)
    checkpoint.expect_shape(f"{prefix}.down_proj.weight", (hidden_size, intermediate_size), because=because)


def swiglu_mlp(backend: Any, weights: MlpWeights, h: Any, batch: ForwardBatch | None = None,
               reduce: bool = True) -> Any:
    """``down(silu(gate(h)) * up(h))`` for ``h [N, H]`` (with each row's adapter update when
    ``batch`` has adapter rows); on a rank of a tensor-parallel group summed over the ranks unless
    ``reduce`` is False (the caller sums)."""
    ops = backend.ops
    if not reduce:
        return ops.linear(ops.linear_silu(h, weights.gate_up, weights.gate_up_bias), weights.down, weights.down_bias)
    if batch is not None and lora_active(batch, weights.lora_gate_up, weights.lora_down):
        act = linear_with_lora(backend, h, weights.gate_up, weights.gate_up_bias, weights.lora_gate_up, batch,
                               swiglu=True)
        return backend.all_reduce(linear_with_lora(backend, act, weights.down, weights.down_bias, weights.lora_down,
                                                   batch))
    # (On a rank of a tensor-parallel group: its part of the intermediate size, summed over the ranks.)
    return backend.all_reduce(ops.linear(ops.linear_silu(h, weights.gate_up, weights.gate_up_bias), weights.down,
                                         weights.down_bias))


def normed_swiglu_mlp(backend: Any, weights: MlpWeights, x: Any, residual: Any, norm_weight: Any, eps: float,
                      norm_offset: float = 0.0, batch: ForwardBatch | None = None) -> tuple[Any, Any]:
    """:func:`swiglu_mlp` of ``rmsnorm(x + residual)`` (through the ``rmsnorm_mlp`` op: two
    kernels where the backend has them; the norm apart when ``batch`` has adapter rows); returns
    ``(MLP output, x + residual)``."""
    if batch is not None and lora_active(batch, weights.lora_gate_up, weights.lora_down):
        act, summed = normed_projection(backend, x, residual, norm_weight, eps, weights.gate_up, weights.lora_gate_up,
                                        batch, offset=norm_offset, bias=weights.gate_up_bias, swiglu=True)
        out = linear_with_lora(backend, act, weights.down, weights.down_bias, weights.lora_down, batch)
        return backend.all_reduce(out), summed
    out, summed = backend.ops.rmsnorm_mlp(x, residual, norm_weight, eps, norm_offset, weights.gate_up, weights.down,
                                          weights.gate_up_bias, weights.down_bias)
    return backend.all_reduce(out), summed


def geglu_mlp(backend: Any, weights: MlpWeights, h: Any, approximate: str, batch: ForwardBatch | None = None) -> Any:
    """``down(gelu(gate(h)) * up(h))`` for ``h [N, H]`` (GeGLU; ``approximate`` ``"tanh"`` or
    ``"none"``, torch's forms of GELU), with each row's adapter update when ``batch`` has adapter
    rows; on a rank of a tensor-parallel group summed over the ranks."""
    ops = backend.ops
    if batch is not None and lora_active(batch, weights.lora_gate_up, weights.lora_down):
        gate_up = linear_with_lora(backend, h, weights.gate_up, weights.gate_up_bias, weights.lora_gate_up, batch)
        act = ops.gelu_and_mul(gate_up, approximate)
        return backend.all_reduce(linear_with_lora(backend, act, weights.down, weights.down_bias, weights.lora_down,
                                                   batch))
    act = ops.gelu_and_mul(ops.linear(h, weights.gate_up, weights.gate_up_bias), approximate)
    return backend.all_reduce(ops.linear(act, weights.down, weights.down_bias))
