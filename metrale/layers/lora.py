"""LoRA in the building blocks of :mod:`metrale.layers`: the adapter slots of a block's
projections (:class:`~metrale.layers.lora_stacks.LoraStack`) and the products that add their updates.

A family serves LoRA by building its stacks in :meth:`~metrale.model.family.FamilyModel.enable_lora`
(these helpers do it for the blocks here and attach them to the blocks' weights) and returning a
:class:`~metrale.layers.lora_stacks.LoraLayout`. A block then adds each row's update after a projection
whenever the step has rows of an adapter (``batch.adapter_slots`` is not None); a step of the
base model runs exactly as without LoRA.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from metrale.batch import ForwardBatch
from metrale.errors import ConfigError
from metrale.layers.lora_stacks import LoraStack, LoraTokenRows


def lora_active(batch: ForwardBatch, *stacks: Any) -> bool:
    """Whether the step has adapter rows and one of ``stacks`` is there to update."""
    return batch.adapter_slots is not None and any(stack is not None for stack in stacks)


#: Rows up to which an adapted projection's shrink rides along its own product: one product with
#: the stack's extended weight (a few more rows than the weight's) and the op ``lora_expand``
#: (which reads the step's ``adapter_tiles``; a batch without them takes the other path).
#: Past it the projection keeps its own product and the op ``lora_linear`` shrinks and expands
#: apart (the expand's copy of a large output would cost more than a product of its own).
FOLDED_ROWS = 64


def _folded(x: Any, batch: ForwardBatch) -> bool:
    return int(x.shape[0]) <= FOLDED_ROWS and batch.adapter_tiles is not None


def linear_with_lora(backend: Any, x: Any, weight: Any, bias: Any, stack: LoraStack | None, batch: ForwardBatch,
                     swiglu: bool = False) -> Any:
    """``linear(x, weight, bias)`` plus each row's adapter update of ``stack`` when the step has
    adapter rows; with ``swiglu`` (``weight`` stacks gate and up rows) ``silu(gate) * up`` of it.
    ``weight`` is ``stack.base`` when there is a stack."""
    ops = backend.ops
    if stack is None or batch.adapter_slots is None:
        return ops.linear_silu(x, weight, bias) if swiglu else ops.linear(x, weight, bias)
    if _folded(x, batch):
        return ops.lora_expand(ops.linear(x, stack.weight), stack.b, batch.adapter_slots, batch.adapter_tiles,
                               stack.width, bias, swiglu)
    y = ops.lora_linear(ops.linear(x, weight, bias), x, stack.a, stack.b, batch.adapter_slots, batch.adapter_route)
    return ops.silu_and_mul(y) if swiglu else y


def normed_projection(backend: Any, x: Any, residual: Any, norm_weight: Any, eps: float, weight: Any,
                      stack: LoraStack | None, batch: ForwardBatch, offset: float = 1.0, bias: Any = None,
                      swiglu: bool = False) -> tuple[Any, Any]:
    """``(linear(rmsnorm(x + residual)) with the rows' adapter updates, x + residual)``: the op
    ``rmsnorm_linear`` (with the stack's extended weight and then ``lora_expand`` when the step has
    adapter rows, few enough to fold; else the norm and :func:`linear_with_lora` apart).
    ``offset`` 1.0 is a zero-centred norm's; ``swiglu`` as in :func:`linear_with_lora`."""
    ops = backend.ops
    if stack is None or not lora_active(batch, stack):
        projected, summed = ops.rmsnorm_linear(x, residual, norm_weight, eps, offset, weight, bias)
        return (ops.silu_and_mul(projected) if swiglu else projected), summed
    if _folded(x, batch):
        extended, summed = ops.rmsnorm_linear(x, residual, norm_weight, eps, offset, stack.weight)
        return (ops.lora_expand(extended, stack.b, batch.adapter_slots, batch.adapter_tiles, stack.width, bias, swiglu),
                summed)
    normed, summed = ops.rmsnorm_residual(x, residual, norm_weight, eps, offset)
    return linear_with_lora(backend, normed, weight, bias, stack, batch, swiglu), summed


def new_stack(backend: Any, owner: Any, attribute: str, names: tuple[str, ...], out_sizes: tuple[int, ...],
              limits: dict, **layout: Any) -> LoraStack:
    """A :class:`~metrale.layers.lora_stacks.LoraStack` over ``owner``'s weight ``attribute`` with ``limits``
    (``max_loras``, ``max_lora_rank``) and ``layout`` (``row_maps``, ``module_rows``); ``owner``'s
    attribute becomes the stack's :attr:`~metrale.layers.lora_stacks.LoraStack.base` (the same values, now the
    first rows of the stack's extended weight).

    On a rank of a tensor-parallel group ``layout`` must say the rank's part (``row_maps`` of a
    column-parallel product, ``column_map`` and ``module_in`` of a row-parallel one,
    :class:`~metrale.layers.lora_stacks.LoraStack`) and pass ``sharded=True`` (also where the
    projection is whole on every rank): a stack that does not is refused with a
    :class:`~metrale.errors.ConfigError`, as its family has not said how its adapters split."""
    shard = getattr(backend, "shard", None)
    says_its_part = layout.pop("sharded", False)
    if shard is not None and shard.sharded and not says_its_part:
        raise ConfigError(f"LoRA on {', '.join(names)} is not served with tensor parallelism (tensor_parallel_size="
                          f"{shard.size}): this family's adapter stacks do not say their part on a rank; leave "
                          "enable_lora out or use tensor_parallel_size=1")
    stack = LoraStack.allocate(backend, names, out_sizes, getattr(owner, attribute), **limits, **layout)
    setattr(owner, attribute, stack.base)
    return stack


def attention_lora(backend: Any, weights: Any, geometry: Any, limits: dict, prefix: str = "self_attn") -> list[LoraStack]:
    """Stacks for a :class:`~metrale.layers.attention.AttentionWeights` (``{prefix}.q_proj`` /
    ``k_proj`` / ``v_proj`` fused, ``{prefix}.o_proj``), attached to it."""
    g = geometry
    q_rows, kv_rows = g.num_heads * g.head_dim, g.num_kv_heads * g.head_dim
    names = (f"{prefix}.q_proj", f"{prefix}.k_proj", f"{prefix}.v_proj")
    qkv_parts: dict[str, Any] = {}
    o_parts: dict[str, Any] = {}
    if weights.shard_rows is not None and weights.module_sizes is not None:
        (q_part, kv_part), (q_size, kv_size) = weights.shard_rows, weights.module_sizes
        qkv_parts = {"row_maps": (np.arange(q_part.start, q_part.stop), np.arange(kv_part.start, kv_part.stop),
                                  np.arange(kv_part.start, kv_part.stop)),
                     "module_rows": (q_size, kv_size, kv_size), "sharded": True}
        o_parts = {"column_map": q_part, "module_in": q_size, "sharded": True}
    weights.lora_qkv = new_stack(backend, weights, "qkv", names, (q_rows, kv_rows, kv_rows), limits, **qkv_parts)
    weights.lora_o = new_stack(backend, weights, "o", (f"{prefix}.o_proj",), (g.hidden_size,), limits, **o_parts)
    return [weights.lora_qkv, weights.lora_o]


def mlp_lora(backend: Any, weights: Any, hidden_size: int, intermediate_size: int, limits: dict,
             prefix: str = "mlp") -> list[LoraStack]:
    """Stacks for a :class:`~metrale.layers.mlp.MlpWeights` (``{prefix}.gate_proj`` / ``up_proj``
    fused, ``{prefix}.down_proj``), attached to it."""
    gate_up_parts: dict[str, Any] = {}
    down_parts: dict[str, Any] = {}
    part, whole = weights.shard_part, weights.module_size
    if part is not None and whole is not None:
        rows = np.arange(part.start, part.stop)
        gate_up_parts = {"row_maps": (rows, rows), "module_rows": (whole, whole), "sharded": True}
        down_parts = {"column_map": part, "module_in": whole, "sharded": True}
        intermediate_size = part.stop - part.start
    weights.lora_gate_up = new_stack(backend, weights, "gate_up", (f"{prefix}.gate_proj", f"{prefix}.up_proj"),
                                     (intermediate_size, intermediate_size), limits, **gate_up_parts)
    weights.lora_down = new_stack(backend, weights, "down", (f"{prefix}.down_proj",), (hidden_size,), limits,
                                  **down_parts)
    return [weights.lora_gate_up, weights.lora_down]


def ends_lora(backend: Any, ends: Any, hidden_size: int, max_loras: int) -> dict[str, LoraTokenRows]:
    """Token rows an adapter may replace in a :class:`~metrale.layers.loading.DecoderEnds`'s
    embedding and LM head, attached to it."""
    ends.token_rows = {matrix: LoraTokenRows.allocate(backend, matrix, hidden_size, max_loras=max_loras)
                       for matrix in ("embed_tokens", "lm_head")}
    return ends.token_rows
