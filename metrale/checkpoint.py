"""Reading Hugging Face checkpoint folders: ``config.json``, safetensors, tokenizer.

A checkpoint folder holds ``config.json``, the weights as one ``model.safetensors`` or as shards
listed by ``model.safetensors.index.json``, and optionally ``tokenizer.json`` and
``generation_config.json``. Tensors are read lazily through memory maps; the reader records which
tensors a family consumed so that the conformance kit can show the mapping covers every tensor.
"""

from __future__ import annotations

import contextlib
import json
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator, Sequence

import numpy as np

from metrale.errors import CheckpointError, NonFiniteWeightError

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
    "BOOL": np.bool_,
}


def bf16_to_float32(raw: np.ndarray) -> np.ndarray:
    """Widen bf16 values stored as ``uint16`` to float32 (exact: bf16 is fp32's top half)."""
    return (raw.astype(np.uint32) << 16).view(np.float32)


def float32_to_bf16(values: np.ndarray) -> np.ndarray:
    """Round float32 to bf16 (nearest, ties to even), returned as ``uint16``."""
    bits = np.ascontiguousarray(values, dtype=np.float32).view(np.uint32)
    rounding = ((bits >> 16) & 1) + np.uint32(0x7FFF)
    rounded = ((bits + rounding) >> 16).astype(np.uint16)
    nan = np.isnan(values)
    if nan.any():
        rounded[nan] = np.uint16(0x7FC0)
    return rounded


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


def read_safetensors_header(path: Path) -> dict[str, TensorInfo]:
    """Parse and check the header of one ``.safetensors`` file."""

    def broken(reason: str) -> CheckpointError:
        return CheckpointError(f"{path} is not a valid safetensors file: {reason}")

    try:
        size = path.stat().st_size
        with open(path, "rb") as handle:
            prefix = handle.read(8)
            if len(prefix) < 8:
                raise broken(f"it has {size} bytes, fewer than the 8-byte header length")
            (header_len,) = struct.unpack("<Q", prefix)
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
        try:
            dtype, shape, (begin, end) = entry["dtype"], tuple(entry["shape"]), entry["data_offsets"]
            shape = tuple(int(n) for n in shape)
            begin, end = int(begin), int(end)
        except (KeyError, TypeError, ValueError):
            raise broken(f"tensor {name!r} has a malformed entry {entry!r}") from None
        if dtype not in _STORED_DTYPES:
            raise CheckpointError(f"{path}: tensor {name!r} has unsupported dtype {dtype}")
        if not 0 <= begin <= end or data_start + end > size:
            raise broken(f"tensor {name!r} lies at bytes [{begin}, {end}) past the end of the data")
        infos[name] = TensorInfo(path, dtype, shape, data_start + begin, data_start + end)
    return infos


class Checkpoint:
    """An opened checkpoint folder.

    ``config`` is the parsed ``config.json``; :meth:`tensor` reads one tensor, converted to
    float32 and checked against an expected shape.
    """

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path).expanduser()
        if not self.path.is_dir():
            raise CheckpointError(f"checkpoint folder {str(self.path)!r} does not exist")
        self.config = self._read_json("config.json", required=True)
        self.generation_config = self._read_json("generation_config.json", required=False) or {}
        self._tensors = self._index_tensors()
        self._maps: dict[Path, np.memmap] = {}
        self._consumed: set[str] = set()
        self._progress: Any = None

    # ----------------------------------------------------------------------------- reading

    def _read_json(self, name: str, *, required: bool) -> dict[str, Any] | None:
        file = self.path / name
        if not file.exists():
            if required:
                raise CheckpointError(f"{self.path} has no {name}")
            return None
        try:
            return json.loads(file.read_text())
        except (OSError, json.JSONDecodeError) as error:
            raise CheckpointError(f"{file} is not valid JSON: {error}") from error

    def _index_tensors(self) -> dict[str, TensorInfo]:
        index = self._read_json("model.safetensors.index.json", required=False)
        if index is not None:
            files = sorted(set(index.get("weight_map", {}).values()))
            if not files:
                raise CheckpointError(f"{self.path}/model.safetensors.index.json has an empty weight_map")
        else:
            files = sorted(p.name for p in self.path.glob("*.safetensors"))
            if not files:
                raise CheckpointError(f"{self.path} holds no *.safetensors file")
        tensors: dict[str, TensorInfo] = {}
        for name in files:
            file = self.path / name
            if not file.exists():
                raise CheckpointError(f"{self.path}: shard {name} listed in the index is missing")
            tensors.update(read_safetensors_header(file))
        if index is not None:
            missing = set(index["weight_map"]) - set(tensors)
            if missing:
                raise CheckpointError(f"{self.path}: the index lists tensors no shard holds: {sorted(missing)[:5]}")
        return tensors

    def names(self) -> list[str]:
        """Every tensor name in the checkpoint."""
        return sorted(self._tensors)

    def has(self, name: str) -> bool:
        return name in self._tensors

    def info(self, name: str) -> TensorInfo:
        try:
            return self._tensors[name]
        except KeyError:
            raise CheckpointError(f"{self.path}: tensor {name!r} is missing from the checkpoint") from None

    def raw(self, name: str, shape: Sequence[int] | None = None) -> np.ndarray:
        """The stored array (bf16 as ``uint16``), checked against ``shape`` when given. Its values
        are not checked: a caller that uses them unconverted checks them (the CUDA backend does,
        on the device, after the upload)."""
        info = self.info(name)
        if shape is not None and tuple(shape) != info.shape:
            raise CheckpointError(
                f"{self.path}: tensor {name!r} has shape {list(info.shape)}, expected {list(shape)}"
            )
        stored = np.dtype(_STORED_DTYPES[info.dtype])
        count = int(np.prod(info.shape, dtype=np.int64))
        if info.end - info.begin != count * stored.itemsize:
            raise CheckpointError(f"{self.path}: tensor {name!r} has a byte range that does not match its shape")
        mapped = self._maps.get(info.file)
        if mapped is None:
            mapped = self._maps[info.file] = np.memmap(info.file, dtype=np.uint8, mode="r")
        array = mapped[info.begin : info.end].view(stored).reshape(info.shape)
        self._consumed.add(name)
        if self._progress is not None:
            self._progress.update(1)
        return array

    def tensor(self, name: str, shape: Sequence[int] | None = None) -> np.ndarray:
        """The tensor as a float32 array, checked against ``shape`` when given, and refused
        (:class:`~metrale.errors.NonFiniteWeightError`) when it holds NaN or infinity."""
        info = self.info(name)
        array = self.raw(name, shape)
        values = bf16_to_float32(array) if info.dtype == "BF16" else np.array(array, dtype=np.float32)
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
        return self.config.get("model_type")

    @property
    def architectures(self) -> list[str]:
        return list(self.config.get("architectures") or [])

    def eos_token_ids(self) -> list[int]:
        """End-of-sequence ids from ``generation_config.json`` (falling back to ``config.json``)."""
        for source in (self.generation_config, self.config):
            value = source.get("eos_token_id")
            if value is None:
                continue
            return [int(v) for v in (value if isinstance(value, list) else [value])]
        return []

    def tokenizer(self) -> Any:
        """The ``tokenizers.Tokenizer`` of ``tokenizer.json``, or None when the folder has none."""
        file = self.path / "tokenizer.json"
        if not file.exists():
            return None
        from tokenizers import Tokenizer

        try:
            return Tokenizer.from_file(str(file))
        except Exception as error:  # tokenizers raises a bare Exception on parse errors
            raise CheckpointError(f"{file} cannot be loaded: {error}") from error
