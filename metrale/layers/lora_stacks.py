"""The adapter slots of a model on the device: per fused projection a :class:`LoraStack` (every
slot's ``A`` rows after the projection's own weight, every slot's ``B`` side by side), per token
matrix a :class:`LoraTokenRows`, and a model's :class:`LoraLayout` of them (what
:meth:`~metrale.model.family.FamilyModel.enable_lora` returns). The products over them are in
:mod:`metrale.layers.lora`."""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np

from metrale.errors import ConfigError, UnsupportedQuantizationError
from metrale.kernels.quantized import QuantizedWeight

if TYPE_CHECKING:
    from metrale.loading.lora import LoraModule

#: The most rows of one token matrix (embedding, LM head) an adapter may replace.
MAX_LORA_TOKEN_ROWS = 256


def _weight_dtype(backend: Any) -> Any:
    return backend.weight(np.zeros((1,), np.float32)).dtype


@dataclass
class LoraStack:
    """The adapter slots of one fused projection of one layer, on the device.

    ``names`` are the projections the fused weight stacks (PEFT's module names inside a decoder
    layer, e.g. ``("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj")``), ``out_sizes``
    their output rows, in order; ``in_size`` their input width. For ``S`` adapter slots, ``G``
    projections and rank ``R`` (``max_lora_rank``), ``W = G R`` (:attr:`width`):

    * ``weight [M + S W, in]`` is the projection's own weight (``M = sum(out_sizes)`` rows,
      :attr:`base`, which the model uses in place of the weight it loaded) followed by every
      slot's ``A``: slot ``s``'s ``W`` rows hold each projection's ``A`` in its own ``R`` rows
      (zero past a module's rank and where the adapter leaves a projection alone). One product
      with ``weight`` gives a row's projection and its shrunk products for every slot at once
      (the op ``lora_expand`` then adds each row's own slot's update); :attr:`a` is the same
      ``A`` rows seen as ``[S, W, in]`` (the op ``lora_linear``).
    * ``b [M, S W]`` holds every slot's ``scale * B`` side by side, block-diagonal: slot ``s``'s
      projection ``g`` at columns ``(s - 1) W + g R`` and the output rows of projection ``g`` (zero
      elsewhere, and past a module's rank): one product with ``b`` serves every row whatever its
      slot.

    A fused weight may hold a projection's rows in another order, or in two places (Qwen3-Next's
    ``q_proj``, whose query and gate rows are regrouped): ``row_maps[g]``, when given, lists the
    rows of the module's ``B`` that part ``g`` takes, and ``module_rows[g]`` the module's own
    output size; a name may then appear in several parts.

    On a rank of a tensor-parallel group the stack is over the rank's part of the projection:
    ``row_maps`` select the rank's output rows of each module's ``B`` (a column-parallel product:
    q/k/v, gate/up), or ``column_map`` its input columns of each module's ``A`` (a row-parallel
    product: o, down; ``module_in`` the whole input width), so the rank's update is its part of
    the whole one, summed over the ranks with the product's own output.
    """

    names: tuple[str, ...]
    out_sizes: tuple[int, ...]
    in_size: int
    rank: int
    weight: Any
    b: Any
    row_maps: tuple[Any, ...] = ()
    module_rows: tuple[int, ...] = ()
    column_map: slice | None = None
    module_in: int | None = None

    @classmethod
    def allocate(cls, backend: Any, names: tuple[str, ...], out_sizes: tuple[int, ...], weight: Any, *,
                 max_loras: int, max_lora_rank: int, row_maps: tuple[Any, ...] = (),
                 module_rows: tuple[int, ...] = (), column_map: slice | None = None,
                 module_in: int | None = None) -> "LoraStack":
        """A stack over ``weight [M, in]`` (the projection's weight as the backend holds it),
        copied into the stack's extended weight."""
        if len(names) != len(out_sizes) or not names:
            raise ConfigError(f"a LoRA stack needs one output size per projection, got {names} and {out_sizes}")
        if isinstance(weight, QuantizedWeight):
            # The stack extends the projection's own matrix with the adapters' rows: one product
            # for both, which a quantized matrix cannot join.
            raise UnsupportedQuantizationError(
                f"LoRA adapters over quantized weights ({weight.source or weight.codes_format}: {', '.join(names)}) "
                "are not served; serve the full-precision checkpoint with enable_lora")
        rows, in_size = (int(extent) for extent in weight.shape)
        if rows != sum(out_sizes):
            raise ConfigError(f"a LoRA stack over {names} needs a weight of {sum(out_sizes)} rows, got {rows}")
        dtype, rank, width = _weight_dtype(backend), max_lora_rank, len(names) * max_lora_rank
        extended = backend.zeros((rows + max_loras * width, in_size), dtype)
        stream = getattr(backend, "stream", None)  # the copy on the engine's stream, as the zeros
        with stream if stream is not None else contextlib.nullcontext():
            extended[:rows] = weight
        return cls(tuple(names), tuple(int(s) for s in out_sizes), in_size, rank, extended,
                   backend.zeros((rows, max_loras * width), dtype),
                   tuple(row_maps), tuple(module_rows) or tuple(int(s) for s in out_sizes), column_map, module_in)

    @property
    def width(self) -> int:
        """``W = G R``: a slot's columns of :attr:`b`, its rows of :attr:`a`."""
        return len(self.names) * self.rank

    @property
    def slots(self) -> int:
        """``S``: the adapter slots (``max_loras``)."""
        return int(self.b.shape[1]) // self.width

    @property
    def base(self) -> Any:
        """The projection's own weight ``[M, in]``: the first rows of :attr:`weight` (a view)."""
        return self.weight[: sum(self.out_sizes)]

    @property
    def a(self) -> Any:
        """Every slot's ``A`` ``[S, W, in]``: the last rows of :attr:`weight` (a view)."""
        return self.weight[sum(self.out_sizes) :].reshape(self.slots, self.width, self.in_size)

    @property
    def targets(self) -> dict[str, tuple[int, int]]:
        """``{name: (out, in)}`` of the projections this stack serves."""
        columns = self.module_in if self.module_in is not None else self.in_size
        return {name: (out, columns) for name, out in zip(self.names, self.module_rows)}

    def host_slot(self, modules: list["LoraModule | None"]) -> tuple[np.ndarray, np.ndarray]:
        """One slot's ``(a [G R, in], b [out, G R])`` for ``modules`` (one per projection, None
        where the adapter leaves it alone)."""
        rank = self.rank
        a = np.zeros((len(self.names) * rank, self.in_size), np.float32)
        b = np.zeros((sum(self.out_sizes), len(self.names) * rank), np.float32)
        start = 0
        for index, (module, out) in enumerate(zip(modules, self.out_sizes)):
            if module is not None:
                rows = module.b if not self.row_maps or self.row_maps[index] is None else module.b[self.row_maps[index]]
                a[index * rank : index * rank + module.rank] = (
                    module.a if self.column_map is None else module.a[:, self.column_map])
                b[start : start + out, index * rank : index * rank + module.rank] = module.scale * rows
            start += out
        return a, b

    def write(self, backend: Any, slot: int, modules: list["LoraModule | None"]) -> None:
        """Put ``modules`` in ``slot`` (zeros where a module is None)."""
        a, b = self.host_slot(modules)
        width, first = self.width, sum(self.out_sizes) + (slot - 1) * self.width
        self.weight[first : first + width] = backend.weight(a)
        self.b[:, (slot - 1) * width : slot * width] = backend.weight(b)


@dataclass
class LoraTokenRows:
    """The rows adapters replace in one token matrix: ``tokens [S + 1, T]`` (int32, -1 past an
    adapter's rows) and ``rows [S + 1, T, H]`` (float32) per slot; slot 0 replaces none."""

    matrix: str
    tokens: Any
    rows: Any

    @classmethod
    def allocate(cls, backend: Any, matrix: str, hidden_size: int, *, max_loras: int,
                 max_rows: int = MAX_LORA_TOKEN_ROWS) -> "LoraTokenRows":
        tokens = backend.xp.asarray(np.full((max_loras + 1, max_rows), -1, np.int32))
        return cls(matrix, tokens, backend.zeros((max_loras + 1, max_rows, hidden_size), np.float32))

    def write(self, backend: Any, slot: int, entry: tuple[np.ndarray, np.ndarray] | None) -> None:
        width = int(self.tokens.shape[1])
        tokens = np.full(width, -1, np.int32)
        rows = np.zeros((width, int(self.rows.shape[2])), np.float32)
        if entry is not None:
            ids, values = entry
            tokens[: len(ids)], rows[: len(ids)] = ids, values
        self.tokens[slot] = backend.xp.asarray(tokens)
        self.rows[slot] = backend.constant(rows)


@dataclass
class LoraLayout:
    """What a model serves of LoRA (:meth:`~metrale.model.family.FamilyModel.enable_lora`): per decoder
    layer its :class:`LoraStack`\\ s, the token matrices whose rows adapters may replace, and the
    projections it refuses with the reason (``{"mlp.experts": "..."}``: an adapter that targets
    one is refused naming it)."""

    stacks: list[tuple[int, LoraStack]]
    token_rows: dict[str, LoraTokenRows] = field(default_factory=dict)
    refused: dict[str, str] = field(default_factory=dict)

    @property
    def num_slots(self) -> int:
        """Slots including the base model's slot 0 (``max_loras + 1``)."""
        if self.stacks:
            return self.stacks[0][1].slots + 1
        arrays = [rows.tokens for rows in self.token_rows.values()]
        return int(arrays[0].shape[0]) if arrays else 1

    def targets(self) -> dict[str, tuple[int, int]]:
        out: dict[str, tuple[int, int]] = {}
        for _, stack in self.stacks:
            out.update(stack.targets)
        return out
