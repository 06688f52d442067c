"""Reading Hugging Face checkpoint folders: ``config.json``, safetensors, tokenizer.

A checkpoint folder holds ``config.json``, the weights as one ``model.safetensors`` or as shards
listed by ``model.safetensors.index.json``, and optionally ``tokenizer.json`` and
``generation_config.json``. Tensors are read lazily through memory maps; the reader records which
tensors a family consumed so that the conformance kit can show the mapping covers every tensor.

Opening a folder reads only metadata, and refuses a bad one with a
:class:`~metrale.errors.CheckpointError`: JSON files that are not objects, safetensors headers
the safetensors library would refuse, metadata fields of the wrong type. Families then check
``config.json`` against the tensors' shapes (:meth:`Checkpoint.expect_shape`,
:meth:`Checkpoint.expect_count`) before allocating anything sized by it.
"""

from __future__ import annotations

import contextlib
import json
import math
import re
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator, Literal, Sequence, overload

import numpy as np
import safetensors

from metrale.errors import CheckpointError, NonFiniteWeightError
from metrale.kernels.bf16 import bf16_to_float32, float32_to_bf16  # noqa: F401  (the checkpoint readers' conversions)
from metrale.loading.config_fields import ConfigFields

# safetensors dtype tag -> NumPy dtype of the stored bytes (bf16 is read as raw uint16).
_STORED_DTYPES = {
    "F64": np.float64,
    "F32": np.float32,
    "F16": np.float16,
    "BF16": np.uint16,
    "I64": np.int64,
    "I32": np.int32,
    "I16": np.int16,
    "I8": np.int8,
    "U8": np.uint8,
    "U16": np.uint16,
    "U32": np.uint32,
    "U64": np.uint64,
    "BOOL": np.bool_,
    # FP8 E4M3 (quantized weights, KV-cache scales) and E8M0 (microscaling exponents), as raw bytes.
    "F8_E4M3": np.uint8,
    "F8_E8M0": np.uint8,
}


#: Tensor dtypes that hold quantized codes: read only through a quantization format.
QUANTIZED_DTYPES = ("F8_E4M3", "F8_E8M0")


def check_finite(values: np.ndarray, label: str) -> None:
    """Raise :class:`~metrale.errors.NonFiniteWeightError` when ``values`` hold NaN or infinity."""
    finite = np.isfinite(values)
    if not finite.all():
        bad = int(finite.size - np.count_nonzero(finite))
        first = np.unravel_index(int(np.argmin(finite)), values.shape)
        raise NonFiniteWeightError(
            f"{label} holds {bad} NaN or infinite values (the first at index {tuple(int(i) for i in first)}); "
            "the checkpoint is corrupt"
        )


@dataclass(frozen=True)
class TensorInfo:
    """Where one tensor lives: its file, safetensors dtype tag, shape and byte range."""

    file: Path
    dtype: str
    shape: tuple[int, ...]
    begin: int
    end: int


#: The largest header the safetensors library accepts (its MAX_HEADER_SIZE); checked before the
#: header is read, so a corrupt length cannot make the reader allocate gigabytes.
MAX_HEADER_BYTES = 100_000_000


def _is_count(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def read_safetensors_header(path: Path) -> dict[str, TensorInfo]:
    """Parse and check the header of one ``.safetensors`` file, reading no tensor data.

    The engine's own checks name the tensor and the field: each entry has a supported dtype, a
    shape of non-negative ints and ``data_offsets`` whose length is the dtype's size times the
    number of elements, inside the file. Then the safetensors library validates the whole layout
    as it would before loading (tensors contiguous, in order, no two aliasing the same bytes, no
    hole, the file fully covered); its refusal becomes a :class:`CheckpointError` too.
    """

    def broken(reason: str) -> CheckpointError:
        return CheckpointError(f"{path} is not a valid safetensors file: {reason}")

    try:
        size = path.stat().st_size
        with open(path, "rb") as handle:
            prefix = handle.read(8)
            if len(prefix) < 8:
                raise broken(f"it has {size} bytes, fewer than the 8-byte header length")
            (header_len,) = struct.unpack("<Q", prefix)
            if header_len > MAX_HEADER_BYTES:
                raise broken(f"its header length {header_len} exceeds the {MAX_HEADER_BYTES} bytes safetensors allows")
            if header_len > size - 8:
                raise broken(f"its header claims {header_len} bytes but the file has {size}")
            header = json.loads(handle.read(header_len))
    except OSError as error:
        raise CheckpointError(f"{path} cannot be read: {error}") from error
    except (json.JSONDecodeError, UnicodeDecodeError) as error:
        raise broken(f"its header is not JSON ({error})") from error
    if not isinstance(header, dict):
        raise broken(f"its header is a {type(header).__name__}, not a JSON object")
    data_start = 8 + header_len
    infos = {}
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        if not isinstance(entry, dict) or not {"dtype", "shape", "data_offsets"} <= entry.keys():
            raise broken(f"tensor {name!r} has a malformed entry {entry!r}")
        dtype, shape, offsets = entry["dtype"], entry["shape"], entry["data_offsets"]
        if not isinstance(shape, list) or not all(_is_count(n) for n in shape):
            raise broken(f"tensor {name!r} has shape {shape!r}; expected a list of non-negative ints")
        if not isinstance(offsets, list) or len(offsets) != 2 or not all(_is_count(n) for n in offsets):
            raise broken(f"tensor {name!r} has data_offsets {offsets!r}; expected [begin, end], non-negative ints")
        if dtype not in _STORED_DTYPES:
            raise CheckpointError(f"{path}: tensor {name!r} has unsupported dtype {dtype!r} (served: "
                                  f"{', '.join(_STORED_DTYPES)})")
        begin, end = offsets
        if not begin <= end or data_start + end > size:
            raise broken(f"tensor {name!r} lies at bytes [{begin}, {end}) past the end of the data")
        expected = math.prod(shape) * np.dtype(_STORED_DTYPES[dtype]).itemsize
        if end - begin != expected:
            raise broken(
                f"tensor {name!r} of dtype {dtype} and shape {shape} needs {expected} bytes, "
                f"but its data_offsets [{begin}, {end}) hold {end - begin}"
            )
        infos[name] = TensorInfo(path, dtype, tuple(shape), data_start + begin, data_start + end)
    try:
        with safetensors.safe_open(str(path), framework="numpy"):
            pass
    except safetensors.SafetensorError as error:
        raise broken(str(error)) from None
    except OSError as error:
        raise CheckpointError(f"{path} cannot be read: {error}") from error
    return infos


class Checkpoint:
    """An opened checkpoint folder.

    ``config`` is the parsed ``config.json`` and ``fields`` its typed reader
    (:class:`~metrale.loading.config_fields.ConfigFields`, naming the file in its errors); :meth:`tensor`
    reads one tensor, converted to float32 and checked against an expected shape.
    """

    def __init__(self, path: str | Path, quantization: str | None = None) -> None:
        self.path = Path(path).expanduser()
        self.weight_format: Any = None
        if not self.path.is_dir():
            raise CheckpointError(f"checkpoint folder {str(self.path)!r} does not exist")
        self.config = self._read_json("config.json", required=True)
        self.generation_config = self._read_json("generation_config.json", required=False) or {}
        # The fields every family and the family lookup read, checked once here.
        self.fields = ConfigFields(self.config, str(self.path / "config.json"))
        self._model_type = self.fields.text("model_type", None)
        self._architectures = self.fields.texts("architectures", [])
        self._eos_token_ids = self._read_eos_token_ids()
        self._tensors = self._index_tensors()
        self._maps: dict[Path, np.memmap] = {}
        self._consumed: set[str] = set()
        self._progress: Any = None
        from metrale.loading.quantization import weight_format

        #: How the weights are quantized (:mod:`metrale.loading.quantization`): the checkpoint's
        #: ``quantization_config``, or ``quantization``'s online method; None: full precision.
        self.weight_format = weight_format(self.fields, quantization)

    # ----------------------------------------------------------------------------- reading

    @overload
    def _read_json(self, name: str, *, required: Literal[True]) -> dict[str, Any]: ...

    @overload
    def _read_json(self, name: str, *, required: bool) -> dict[str, Any] | None: ...

    def _read_json(self, name: str, *, required: bool) -> dict[str, Any] | None:
        """The JSON object in ``name``; anything but an object (a list, a number) is refused."""
        file = self.path / name
        if not file.exists():
            if required:
                raise CheckpointError(f"{self.path} has no {name}")
            return None
        try:
            value = json.loads(file.read_text())
        except (OSError, ValueError, RecursionError) as error:  # ValueError: bad JSON or UTF-8
            raise CheckpointError(f"{file} is not valid JSON: {error}") from error
        ConfigFields(value, str(file))  # raises unless it is a JSON object
        return value

    def _index_tensors(self) -> dict[str, TensorInfo]:
        index_name = "model.safetensors.index.json"
        index = self._read_json(index_name, required=False)
        weight_map: dict[str, str] = {}
        if index is not None:
            index_fields = ConfigFields(index, str(self.path / index_name))
            section = index_fields.section("weight_map") or ConfigFields({}, index_fields.source, "weight_map.")
            weight_map = dict(section.values)
            for tensor, shard in weight_map.items():
                # A plain file name: shards are read from the checkpoint folder and nowhere else.
                if not isinstance(shard, str) or Path(shard).name != shard or shard in ("", ".", ".."):
                    raise section.error(f"weight_map[{tensor!r}] is {shard!r}; expected a shard file name")
            files = sorted(set(weight_map.values()))
            if not files:
                raise CheckpointError(f"{self.path}/{index_name} has an empty weight_map")
        else:
            files = sorted(p.name for p in self.path.glob("*.safetensors"))
            if not files:
                raise CheckpointError(f"{self.path} holds no *.safetensors file")
        tensors: dict[str, TensorInfo] = {}
        for name in files:
            file = self.path / name
            if not file.is_file():
                what = "is not a regular file" if file.exists() else "is missing"
                listed = " listed in the index" if index is not None else ""
                raise CheckpointError(f"{self.path}: shard {name}{listed} {what}")
            for tensor, info in read_safetensors_header(file).items():
                if tensor in tensors:
                    raise CheckpointError(
                        f"{self.path}: tensor {tensor!r} is stored twice, in {tensors[tensor].file.name} and {name}"
                    )
                tensors[tensor] = info
        missing = set(weight_map) - set(tensors)
        if missing:
            raise CheckpointError(f"{self.path}: the index lists tensors no shard holds: {sorted(missing)[:5]}")
        return tensors

    def names(self) -> list[str]:
        """Every tensor name in the checkpoint."""
        return sorted(self._tensors)

    def has(self, name: str) -> bool:
        """Whether the checkpoint holds tensor ``name``, stored as it is named or quantized (a
        ``{module}.weight`` stored as its format's tensors)."""
        return name in self._tensors or self.is_quantized(name)

    def has_stored(self, name: str) -> bool:
        """Whether a tensor is stored under exactly ``name``."""
        return name in self._tensors

    def is_quantized(self, name: str) -> bool:
        """Whether weight ``name`` is stored (or, online, read) quantized."""
        return self.weight_format is not None and self.weight_format.holds(self, name)

    def shape_of(self, name: str) -> tuple[int, ...]:
        """The shape of tensor ``name``; for a quantized weight, of the matrix it stands for."""
        if name not in self._tensors and self.is_quantized(name):
            return tuple(self.weight_format.shape(self, name))
        return self.info(name).shape

    def quantized(self, name: str, shape: Sequence[int] | None = None, rows: slice | None = None,
                  columns: slice | None = None) -> Any:
        """The quantized weight ``name`` as a :class:`~metrale.kernels.quantized.QuantizedWeight` of
        host arrays (its ``rows`` / ``columns`` only, when given), checked against ``shape``."""
        if not self.is_quantized(name):
            raise CheckpointError(f"{self.path}: tensor {name!r} is not stored quantized")
        if shape is not None and tuple(shape) != self.shape_of(name):
            raise CheckpointError(
                f"{self.path}: tensor {name!r} has shape {list(self.shape_of(name))}, expected {list(shape)}")
        weight = self.weight_format.read(self, name, rows, columns)
        self._consumed.add(name)
        return weight

    def quantized_parts(self, parts: Sequence[tuple]) -> Any:
        """The weight ``parts`` (``(name, shape[, rows, columns])``, as ``backend.load_weight`` takes
        them) stacked along the rows as one :class:`~metrale.kernels.quantized.QuantizedWeight` of
        host arrays when every part is stored quantized; None when none is (a mix is refused)."""
        from metrale.loading.quantization import read_parts

        return read_parts(self, parts)

    def info(self, name: str) -> TensorInfo:
        try:
            return self._tensors[name]
        except KeyError:
            raise CheckpointError(f"{self.path}: tensor {name!r} is missing from the checkpoint") from None

    # ------------------------------------------------------------ config against the tensors

    def layer_indices(self, prefix: str = "model.layers.") -> list[int]:
        """The sorted indices ``i`` for which some tensor is named ``{prefix}{i}.…``.

        ``layer_indices()`` lists the decoder layers present; ``layer_indices(
        "model.layers.1.mlp.experts.")`` the routed experts of layer 1. Only names are read.
        """
        pattern = re.compile(re.escape(prefix) + r"(0|[1-9][0-9]*)\.")
        return sorted({int(match.group(1)) for name in self._tensors if (match := pattern.match(name))})

    def expect_count(self, count: int, prefix: str, *, because: str, extra_ok: bool = False) -> None:
        """Raise :class:`CheckpointError` unless ``{prefix}{i}.…`` tensors exist for exactly the
        indices ``0 .. count - 1`` (``extra_ok``: and possibly more at ``count`` and above, as
        DeepSeek's multi-token-prediction layers).

        ``because`` is the config field the count comes from (``"num_hidden_layers=4"``). Call it
        before building anything per layer or per expert, so a count of 10**9 in ``config.json``
        costs nothing: nothing of that size is created here either.
        """
        present = self.layer_indices(prefix)
        below = sum(1 for i in present if i < count)  # distinct, so == count means all of 0..count-1
        if below == count and (extra_ok or len(present) == count):
            return
        if not present:
            found = "none"
        elif present == list(range(len(present))):
            found = f"i = 0..{len(present) - 1} ({len(present)})"
        else:
            shown = ", ".join(str(i) for i in present[:8]) + (", ..." if len(present) > 8 else "")
            found = f"i in [{shown}] ({len(present)})"
        raise CheckpointError(
            f"{self.path}: config.json says {because}, but the checkpoint has {prefix}{{i}}.* tensors for {found}"
        )

    def expect_tensor(self, name: str, present: bool = True, *, because: str) -> None:
        """Raise :class:`CheckpointError` unless tensor ``name`` is present (``present=False``:
        absent), as the config fields in ``because`` imply; for instance a layer's MoE router,
        which a layer the config calls dense must not have."""
        if self.has(name) != present:
            implies, found = ("a tensor", "has none") if present else ("no tensor", "has one")
            raise CheckpointError(f"{self.path}: config.json's {because} implies {implies} {name!r}, but the "
                                  f"checkpoint {found}")

    def expect_embeddings(self, vocab_size: int, hidden_size: int, tie_word_embeddings: bool) -> None:
        """:meth:`expect_shape` for ``model.embed_tokens.weight`` ``[vocab_size, hidden_size]``
        and, when present (and it must be unless ``tie_word_embeddings``), ``lm_head.weight``."""
        vocab = f"vocab_size={vocab_size} hidden_size={hidden_size}"
        self.expect_shape("model.embed_tokens.weight", (vocab_size, hidden_size), because=vocab)
        if not tie_word_embeddings:
            self.expect_tensor("lm_head.weight", because="tie_word_embeddings=false")
        if self.has("lm_head.weight"):
            self.expect_shape("lm_head.weight", (vocab_size, hidden_size), because=vocab)

    def expect_shape(self, name: str, shape: Sequence[int], *, because: str) -> None:
        """Raise :class:`CheckpointError` unless tensor ``name`` exists with ``shape``.

        Reads the safetensors header only, never the data: families call it on a few
        representative tensors (the embedding, the first layer's projections) before allocating
        anything sized by ``config.json``, so a config whose sizes disagree with the weights is
        refused at once. ``because`` names the config fields the shape follows from, e.g.
        ``checkpoint.expect_shape(f"{p}.q_proj.weight", (heads * head_dim, hidden),
        because=f"num_attention_heads={heads} head_dim={head_dim} hidden_size={hidden}")``.
        """
        if not self.has(name):
            raise CheckpointError(f"{self.path}: config.json's {because} implies a tensor {name!r} of shape "
                                  f"{list(shape)}, but the checkpoint has none")
        actual = self.shape_of(name)
        if tuple(actual) != tuple(shape):
            raise CheckpointError(
                f"{self.path}: tensor {name!r} has shape {list(actual)}, but config.json's {because} "
                f"implies {list(shape)}"
            )

    def raw(self, name: str, shape: Sequence[int] | None = None) -> np.ndarray:
        """The stored array (bf16 as ``uint16``), checked against ``shape`` when given. Its values
        are not checked: a caller that uses them unconverted checks them (the CUDA backend does,
        on the device, after the upload)."""
        info = self._checked_info(name, shape)
        stored = np.dtype(_STORED_DTYPES[info.dtype])
        mapped = self._maps.get(info.file)
        if mapped is None:
            mapped = self._maps[info.file] = np.memmap(info.file, dtype=np.uint8, mode="r")
        array = mapped[info.begin : info.end].view(stored).reshape(info.shape)
        self._mark_read(name)
        return array

    def stored_bytes(self, name: str, shape: Sequence[int] | None = None,
                     rows: slice | None = None) -> tuple[Path, int, int] | None:
        """``(file, first byte, byte count)`` of tensor ``name`` as stored, or of ``rows`` of it (a
        slice of its first dimension), checked against ``shape`` like :meth:`raw` and counted as
        read; None, reading nothing, when ``rows`` is not one run of consecutive rows."""
        info = self._checked_info(name, shape)
        first, size = info.begin, info.end - info.begin
        if rows is not None:
            if not info.shape:
                raise CheckpointError(f"{self.path}: tensor {name!r} is a scalar; it has no rows to take")
            start, stop, step = rows.indices(info.shape[0])
            if step != 1:
                return None
            row_bytes = size // info.shape[0] if info.shape[0] else 0
            first, size = first + start * row_bytes, max(stop - start, 0) * row_bytes
        self._mark_read(name)
        return info.file, first, size

    def _checked_info(self, name: str, shape: Sequence[int] | None) -> TensorInfo:
        info = self.info(name)
        if shape is not None and tuple(shape) != info.shape:
            raise CheckpointError(
                f"{self.path}: tensor {name!r} has shape {list(info.shape)}, expected {list(shape)}"
            )
        stored = np.dtype(_STORED_DTYPES[info.dtype])
        count = int(np.prod(info.shape, dtype=np.int64))
        if info.end - info.begin != count * stored.itemsize:
            raise CheckpointError(f"{self.path}: tensor {name!r} has a byte range that does not match its shape")
        return info

    def _mark_read(self, name: str) -> None:
        self._consumed.add(name)
        if self._progress is not None:
            self._progress.update(1)

    def tensor(self, name: str, shape: Sequence[int] | None = None, rows: slice | None = None,
               columns: slice | None = None) -> np.ndarray:
        """The tensor as a float32 array, checked against ``shape`` when given, and refused
        (:class:`~metrale.errors.NonFiniteWeightError`) when it holds NaN or infinity. ``rows``
        / ``columns`` take a part of a matrix (a rank's shard, :mod:`metrale.backends.parallel`): only
        that part is read from the file and converted. A weight stored quantized comes back
        dequantized (:func:`~metrale.kernels.quantized.dequantize`), so code that computes with a
        weight on the host reads its values whatever the format."""
        # A weight stored as its format's codes (an FP8 or INT8 ``.weight``) is dequantized too; only
        # an online format reads a stored full-precision weight as it is.
        stored_quantized = name not in self._tensors or not getattr(self.weight_format, "online", False)
        if stored_quantized and self.is_quantized(name):
            from metrale.kernels.quantized import dequantize

            values = dequantize(self.quantized(name, shape, rows, columns))
            check_finite(values, f"{self.path}: tensor {name!r}")
            return values
        if name in self._tensors and self._tensors[name].dtype in QUANTIZED_DTYPES:
            from metrale.errors import UnsupportedQuantizationError

            method = self.weight_format.describe() if self.weight_format is not None else "none"
            raise UnsupportedQuantizationError(
                f"{self.path}: tensor {name!r} is stored as {self._tensors[name].dtype} codes, which no quantization "
                f"format of config.json (quantization method: {method}) describes; a quantized checkpoint needs its "
                "quantization_config (served methods: compressed-tensors, fp8, gptq, awq, mxfp4)")
        return self.stored_tensor(name, shape, rows, columns)

    def stored_tensor(self, name: str, shape: Sequence[int] | None = None, rows: slice | None = None,
                      columns: slice | None = None) -> np.ndarray:
        """Tensor ``name`` as stored, converted to float32 (FP8 E4M3 decoded, integers as they
        are): :meth:`tensor` without dequantization, for the readers of quantized formats."""
        info = self.info(name)
        array = self.raw(name, shape)
        if rows is not None or columns is not None:
            if array.ndim < 2 and columns is not None:
                raise CheckpointError(f"{self.path}: tensor {name!r} has no columns to take")
            array = array[rows if rows is not None else slice(None)]
            if columns is not None:
                array = array[:, columns]
        if info.dtype == "BF16":
            values = bf16_to_float32(array)
        elif info.dtype == "F8_E4M3":
            from metrale.kernels.quantized import fp8_e4m3_to_float32

            values = fp8_e4m3_to_float32(array)
        elif info.dtype == "F8_E8M0":
            from metrale.kernels.quantized import e8m0_to_float32

            values = e8m0_to_float32(array)
        else:
            values = np.array(array, dtype=np.float32)
        check_finite(values, f"{self.path}: tensor {name!r}")
        return values

    def skip(self, names: Sequence[str]) -> None:
        """Record tensors a family deliberately does not use (kept out of the coverage report)."""
        self._consumed.update(n for n in names if n in self._tensors)

    def unconsumed(self) -> list[str]:
        """Tensors no loader read nor skipped."""
        return sorted(set(self._tensors) - self._consumed)

    @contextlib.contextmanager
    def progress(self, description: str, enabled: bool = True) -> Iterator[None]:
        """Show a progress bar over the checkpoint's tensors while a family loads them."""
        if not enabled:
            yield
            return
        from tqdm.auto import tqdm

        with tqdm(total=len(self._tensors), desc=description, unit="tensor", leave=False) as bar:
            self._progress = bar
            try:
                yield
            finally:
                self._progress = None

    # ---------------------------------------------------------------------------- metadata

    @property
    def model_type(self) -> str | None:
        return self._model_type

    @property
    def architectures(self) -> list[str]:
        return list(self._architectures)

    def _read_eos_token_ids(self) -> list[int]:
        """``eos_token_id`` of ``generation_config.json``, else of ``config.json``: an id or a list
        of ids. Both files' values are checked, even the one that is not used."""
        found = []
        for name, values in (("generation_config.json", self.generation_config), ("config.json", self.config)):
            fields = ConfigFields(values, str(self.path / name))
            value = values.get("eos_token_id")
            if isinstance(value, list):
                found.append(fields.integers("eos_token_id"))
            elif value is not None:
                found.append([fields.integer("eos_token_id")])
        return found[0] if found else []

    def eos_token_ids(self) -> list[int]:
        """End-of-sequence ids from ``generation_config.json`` (falling back to ``config.json``)."""
        return list(self._eos_token_ids)

    def tokenizer(self) -> Any:
        """The ``tokenizers.Tokenizer`` of ``tokenizer.json``, or None when the folder has none."""
        return load_tokenizer(self.path)


def load_tokenizer(folder: str | Path) -> Any:
    """The ``tokenizers.Tokenizer`` of ``folder/tokenizer.json``, or None when there is none."""
    file = Path(folder) / "tokenizer.json"
    if not file.exists():
        return None
    from tokenizers import Tokenizer

    try:
        return Tokenizer.from_file(str(file))
    except Exception as error:  # tokenizers raises a bare Exception on parse errors
        raise CheckpointError(f"{file} cannot be loaded: {error}") from error
