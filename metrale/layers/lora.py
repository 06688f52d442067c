"""LoRA in the building blocks of :mod:`metrale.layers`: the adapter slots of a block's
projections (:class:`~metrale.lora.LoraStack`) and the products that add their updates.

A family serves LoRA by building its stacks in :meth:`~metrale.family.FamilyModel.enable_lora`
(these helpers do it for the blocks here and attach them to the blocks' weights) and returning a
:class:`~metrale.lora.LoraLayout`. A block then adds each row's update after a projection
whenever the step has rows of an adapter (``batch.adapter_slots`` is not None); a step of the
base model runs exactly as without LoRA.
"""

from __future__ import annotations

from typing import Any

from metrale.batch import ForwardBatch
from metrale.lora import LoraStack, LoraTokenRows


def lora_active(batch: ForwardBatch, *stacks: Any) -> bool:
    """Whether the step has adapter rows and one of ``stacks`` is there to update."""
    return batch.adapter_slots is not None and any(stack is not None for stack in stacks)


def linear_with_lora(backend: Any, x: Any, weight: Any, bias: Any, stack: LoraStack | None, batch: ForwardBatch) -> Any:
    """``linear(x, weight, bias)`` plus each row's adapter update of ``stack`` (the op
    ``lora_linear``) when the step has adapter rows."""
    y = backend.ops.linear(x, weight, bias)
    if stack is None or batch.adapter_slots is None:
        return y
    return backend.ops.lora_linear(y, x, stack.a, stack.b, batch.adapter_slots, batch.adapter_route)


def normed_projection(backend: Any, x: Any, residual: Any, norm_weight: Any, eps: float, weight: Any,
                      stack: LoraStack | None, batch: ForwardBatch, offset: float = 1.0) -> tuple[Any, Any]:
    """``(linear(rmsnorm(x + residual)) with the rows' adapter updates, x + residual)``: the op
    ``rmsnorm_linear`` when the step has no adapter rows (or ``stack`` is None), else the norm and
    the product apart. ``offset`` 1.0 is a zero-centred norm's."""
    if not lora_active(batch, stack):
        return backend.ops.rmsnorm_linear(x, residual, norm_weight, eps, offset, weight)
    normed, summed = backend.ops.rmsnorm_residual(x, residual, norm_weight, eps, offset)
    return linear_with_lora(backend, normed, weight, None, stack, batch), summed


def new_stack(backend: Any, names: tuple[str, ...], out_sizes: tuple[int, ...], in_size: int, limits: dict,
              **layout: Any) -> LoraStack:
    """A :class:`~metrale.lora.LoraStack` with ``limits`` (``max_loras``, ``max_lora_rank``) and
    ``layout`` (``row_maps``, ``module_rows``)."""
    return LoraStack.allocate(backend, names, out_sizes, in_size, **limits, **layout)


def attention_lora(backend: Any, weights: Any, geometry: Any, limits: dict, prefix: str = "self_attn") -> list[LoraStack]:
    """Stacks for a :class:`~metrale.layers.attention.AttentionWeights` (``{prefix}.q_proj`` /
    ``k_proj`` / ``v_proj`` fused, ``{prefix}.o_proj``), attached to it."""
    g = geometry
    q_rows, kv_rows = g.num_heads * g.head_dim, g.num_kv_heads * g.head_dim
    weights.lora_qkv = new_stack(backend, (f"{prefix}.q_proj", f"{prefix}.k_proj", f"{prefix}.v_proj"),
                                 (q_rows, kv_rows, kv_rows), g.hidden_size, limits)
    weights.lora_o = new_stack(backend, (f"{prefix}.o_proj",), (g.hidden_size,), q_rows, limits)
    return [weights.lora_qkv, weights.lora_o]


def mlp_lora(backend: Any, weights: Any, hidden_size: int, intermediate_size: int, limits: dict,
             prefix: str = "mlp") -> list[LoraStack]:
    """Stacks for a :class:`~metrale.layers.mlp.MlpWeights` (``{prefix}.gate_proj`` / ``up_proj``
    fused, ``{prefix}.down_proj``), attached to it."""
    weights.lora_gate_up = new_stack(backend, (f"{prefix}.gate_proj", f"{prefix}.up_proj"),
                                     (intermediate_size, intermediate_size), hidden_size, limits)
    weights.lora_down = new_stack(backend, (f"{prefix}.down_proj",), (hidden_size,), intermediate_size, limits)
    return [weights.lora_gate_up, weights.lora_down]


def ends_lora(backend: Any, ends: Any, hidden_size: int, max_loras: int) -> dict[str, LoraTokenRows]:
    """Token rows an adapter may replace in a :class:`~metrale.layers.loading.DecoderEnds`'s
    embedding and LM head, attached to it."""
    ends.token_rows = {matrix: LoraTokenRows.allocate(backend, matrix, hidden_size, max_loras=max_loras)
                       for matrix in ("embed_tokens", "lm_head")}
    return ends.token_rows
