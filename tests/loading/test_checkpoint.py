"""metrale/loading/checkpoint.py and the dense loader: unreadable folders, broken tensors, shards, bf16/fp16.

References: transformers (float32) for logits, torch for bf16 rounding, safetensors' own reader for
tensor values. Broken checkpoints are made by editing a good one with safetensors.numpy.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import struct
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.numpy import load_file, save_file

import metrale
from conftest import dense_configs
from metrale.errors import CheckpointError
from metrale.loading.checkpoint import Checkpoint, bf16_to_float32, float32_to_bf16
from metrale.testing.hf import build_hf_checkpoint, hf_reference_logits

TOLERANCE = 1e-4


def _llm(path: Path):
    return metrale.LLM(path, device="cpu", show_progress=False)


def _token_ids(seed: int, length: int = 12, vocab: int = 128) -> list[int]:
    return np.random.default_rng(seed).integers(0, vocab, size=length).tolist()


def _assert_relative(actual: np.ndarray, expected: np.ndarray, tolerance: float, what: str) -> None:
    actual = np.asarray(actual, np.float64)
    expected = np.asarray(expected, np.float64)
    assert actual.shape == expected.shape, f"{what}: shape {actual.shape} != {expected.shape}"
    worst = float(np.abs(actual - expected).max())
    scale = float(np.abs(expected).max())
    assert scale > 0, f"{what}: the reference is all zeros"
    assert worst / scale <= tolerance, (
        f"{what}: max abs error {worst:.3g} / max abs reference {scale:.3g} = {worst / scale:.3g} > {tolerance}"
    )


def _assert_identical(actual: np.ndarray, expected: np.ndarray, what: str) -> None:
    assert actual.shape == expected.shape, f"{what}: shape {actual.shape} != {expected.shape}"
    worst = float(np.abs(np.asarray(actual, np.float64) - np.asarray(expected, np.float64)).max())
    assert worst == 0.0, f"{what}: max abs error {worst:.3g} (expected bit-identical)"


def _rewrite(source: Path, target: Path, tensors: dict[str, np.ndarray]) -> Path:
    """A copy of ``source``'s config.json next to ``tensors`` saved as one model.safetensors."""
    target.mkdir(parents=True)
    shutil.copy(source / "config.json", target / "config.json")
    save_file(tensors, str(target / "model.safetensors"))
    return target


@pytest.fixture(scope="module")
def llama(dense_checkpoints) -> Path:
    return dense_checkpoints["llama"]


@pytest.fixture(scope="module")
def llama_tensors(llama) -> dict[str, np.ndarray]:
    return load_file(str(llama / "model.safetensors"))


@pytest.fixture(scope="module")
def sharded_llama(tmp_path_factory) -> Path:
    """The conftest llama (same config, same seed) saved in several shards plus an index."""
    cls, config = dense_configs()["llama"]
    path = build_hf_checkpoint(cls, config, tmp_path_factory.mktemp("sharded") / "llama", seed=0, max_shard_size="40KB")
    return path


# =============================================================================== unreadable folders


def test_missing_folder(tmp_path):
    with pytest.raises(CheckpointError, match="nope"):
        Checkpoint(tmp_path / "nope")
    with pytest.raises(CheckpointError):
        _llm(tmp_path / "nope")


def test_missing_config_json(tmp_path, llama):
    shutil.copy(llama / "model.safetensors", tmp_path / "model.safetensors")
    with pytest.raises(CheckpointError, match="config.json"):
        Checkpoint(tmp_path)
    with pytest.raises(CheckpointError, match="config.json"):
        _llm(tmp_path)


@pytest.mark.parametrize("text", ['{"model_type": "llama",', "not json at all", ""])
def test_invalid_config_json(tmp_path, llama, text):
    shutil.copy(llama / "model.safetensors", tmp_path / "model.safetensors")
    (tmp_path / "config.json").write_text(text)
    with pytest.raises(CheckpointError, match="config.json"):
        _llm(tmp_path)


def test_invalid_generation_config_json(tmp_path, llama):
    shutil.copy(llama / "model.safetensors", tmp_path / "model.safetensors")
    shutil.copy(llama / "config.json", tmp_path / "config.json")
    (tmp_path / "generation_config.json").write_text("{oops")
    with pytest.raises(CheckpointError, match="generation_config.json"):
        Checkpoint(tmp_path)


def test_no_safetensors_file(tmp_path, llama):
    shutil.copy(llama / "config.json", tmp_path / "config.json")
    (tmp_path / "model.bin").write_bytes(b"\x00" * 64)
    with pytest.raises(CheckpointError, match="safetensors"):
        _llm(tmp_path)


@pytest.mark.parametrize("keep", [0, 5, 8, 30])
def test_safetensors_file_cut_inside_its_header(tmp_path, llama, keep):
    data = (llama / "model.safetensors").read_bytes()
    (header_len,) = struct.unpack("<Q", data[:8])
    assert keep < 8 + header_len
    shutil.copy(llama / "config.json", tmp_path / "config.json")
    (tmp_path / "model.safetensors").write_bytes(data[:keep])
    with pytest.raises(CheckpointError, match="model.safetensors"):
        _llm(tmp_path)


def test_safetensors_header_that_is_not_json(tmp_path, llama):
    shutil.copy(llama / "config.json", tmp_path / "config.json")
    body = b"\xff\xfe not json \x00"
    (tmp_path / "model.safetensors").write_bytes(struct.pack("<Q", len(body)) + body)
    with pytest.raises(CheckpointError):
        _llm(tmp_path)


def test_safetensors_file_with_its_data_cut_short(tmp_path, llama):
    data = (llama / "model.safetensors").read_bytes()
    (header_len,) = struct.unpack("<Q", data[:8])
    shutil.copy(llama / "config.json", tmp_path / "config.json")
    (tmp_path / "model.safetensors").write_bytes(data[: 8 + header_len + (len(data) - 8 - header_len) // 2])
    with pytest.raises(CheckpointError):
        _llm(tmp_path)


def test_safetensors_file_of_random_bytes(tmp_path, llama):
    shutil.copy(llama / "config.json", tmp_path / "config.json")
    garbage = np.random.default_rng(0).integers(0, 256, size=4096, dtype=np.uint8).tobytes()
    (tmp_path / "model.safetensors").write_bytes(garbage)
    with pytest.raises(CheckpointError):
        Checkpoint(tmp_path)


@pytest.mark.parametrize("header", [b"[1, 2]", b'{"w": {"dtype": "F32"}}', b'{"w": 3}'])
def test_safetensors_header_of_the_wrong_structure(tmp_path, llama, header):
    shutil.copy(llama / "config.json", tmp_path / "config.json")
    (tmp_path / "model.safetensors").write_bytes(struct.pack("<Q", len(header)) + header)
    with pytest.raises(CheckpointError):
        Checkpoint(tmp_path)


def test_index_listing_a_missing_shard(tmp_path, sharded_llama):
    copy = tmp_path / "ckpt"
    shutil.copytree(sharded_llama, copy)
    weight_map = json.loads((copy / "model.safetensors.index.json").read_text())["weight_map"]
    victim = sorted(set(weight_map.values()))[1]
    (copy / victim).unlink()
    with pytest.raises(CheckpointError, match=re.escape(victim)):
        _llm(copy)


def test_index_listing_a_tensor_no_shard_holds(tmp_path, sharded_llama):
    copy = tmp_path / "ckpt"
    shutil.copytree(sharded_llama, copy)
    index_file = copy / "model.safetensors.index.json"
    index = json.loads(index_file.read_text())
    index["weight_map"]["model.layers.0.ghost.weight"] = next(iter(index["weight_map"].values()))
    index_file.write_text(json.dumps(index))
    with pytest.raises(CheckpointError, match="ghost"):
        Checkpoint(copy)


def test_index_with_an_empty_weight_map(tmp_path, sharded_llama):
    copy = tmp_path / "ckpt"
    shutil.copytree(sharded_llama, copy)
    (copy / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": {}}))
    with pytest.raises(CheckpointError, match="weight_map"):
        Checkpoint(copy)


# ================================================================================ broken tensors


@pytest.mark.parametrize(
    "name", ["model.layers.1.mlp.up_proj.weight", "model.norm.weight", "lm_head.weight", "model.embed_tokens.weight"]
)
def test_missing_tensor_is_named(tmp_path, llama, llama_tensors, name):
    tensors = {k: v for k, v in llama_tensors.items() if k != name}
    assert len(tensors) == len(llama_tensors) - 1
    path = _rewrite(llama, tmp_path / "ckpt", tensors)
    with pytest.raises(CheckpointError) as info:
        _llm(path)
    assert name in str(info.value)


@pytest.mark.parametrize(
    "name, bad_shape",
    [
        ("model.layers.2.self_attn.k_proj.weight", (32, 63)),
        ("model.layers.0.mlp.down_proj.weight", (96, 64)),  # transposed
        ("model.layers.1.input_layernorm.weight", (65,)),
    ],
)
def test_tensor_of_the_wrong_shape_is_named_with_both_shapes(tmp_path, llama, llama_tensors, name, bad_shape):
    expected_shape = llama_tensors[name].shape
    assert expected_shape != bad_shape
    tensors = dict(llama_tensors)
    tensors[name] = np.random.default_rng(1).standard_normal(bad_shape).astype(np.float32)
    path = _rewrite(llama, tmp_path / "ckpt", tensors)
    with pytest.raises(CheckpointError) as info:
        _llm(path)
    message = str(info.value)

    def shape_pattern(shape):
        return r"[\[(]" + r",\s*".join(str(n) for n in shape) + r",?[\])]"

    assert name in message
    assert re.search(shape_pattern(expected_shape), message), f"expected shape {expected_shape} not in {message!r}"
    assert re.search(shape_pattern(bad_shape), message), f"found shape {bad_shape} not in {message!r}"


def test_rewritten_copy_of_a_good_checkpoint_still_loads(tmp_path, llama, llama_tensors):
    """The control of the two tests above: the rewrite itself does not break anything."""
    path = _rewrite(llama, tmp_path / "ckpt", dict(llama_tensors))
    ids = _token_ids(3)
    _assert_relative(_llm(path).score(ids), hf_reference_logits(llama, ids), TOLERANCE, "rewritten llama")


# ======================================================================================= shards


def test_sharded_checkpoint_matches_the_single_file_one_and_transformers(sharded_llama, llama):
    shards = sorted(p.name for p in sharded_llama.glob("*.safetensors"))
    assert len(shards) > 2
    assert (sharded_llama / "model.safetensors.index.json").exists()
    assert not (sharded_llama / "model.safetensors").exists()

    ids = _token_ids(4, length=16)
    sharded = _llm(sharded_llama).score(ids)
    single = _llm(llama).score(ids)
    _assert_identical(sharded, single, "sharded vs single-file logits")
    _assert_relative(sharded, hf_reference_logits(sharded_llama, ids), TOLERANCE, "sharded vs transformers")
    _assert_relative(single, hf_reference_logits(llama, ids), TOLERANCE, "single-file vs transformers")


def test_sharded_checkpoint_reads_every_tensor_from_its_shard(sharded_llama):
    checkpoint = Checkpoint(sharded_llama)
    index = json.loads((sharded_llama / "model.safetensors.index.json").read_text())["weight_map"]
    assert checkpoint.names() == sorted(index)
    for name in ("model.layers.2.mlp.gate_proj.weight", "lm_head.weight", "model.layers.0.self_attn.q_proj.weight"):
        expected = load_file(str(sharded_llama / index[name]))[name]
        _assert_identical(checkpoint.tensor(name, expected.shape), expected, name)


# ================================================================================= bf16 / fp16


@pytest.fixture(scope="module", params=[torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def half_checkpoint(request, tmp_path_factory):
    cls, config = dense_configs()["qwen3"]
    path = tmp_path_factory.mktemp("half") / str(request.param).split(".")[-1]
    return build_hf_checkpoint(cls, config, path, seed=5, dtype=request.param), request.param


def _stored_dtype_tags(path: Path) -> set[str]:
    data = (path / "model.safetensors").read_bytes()
    (header_len,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8 : 8 + header_len])
    return {entry["dtype"] for name, entry in header.items() if name != "__metadata__"}


def test_half_precision_checkpoint_matches_transformers(half_checkpoint):
    path, dtype = half_checkpoint
    assert _stored_dtype_tags(path) == {"BF16" if dtype == torch.bfloat16 else "F16"}
    ids = _token_ids(6, length=14)
    _assert_relative(_llm(path).score(ids), hf_reference_logits(path, ids), TOLERANCE, f"{dtype} checkpoint")


def test_half_precision_tensors_widen_exactly(half_checkpoint):
    from safetensors.torch import load_file as torch_load_file

    path, _ = half_checkpoint
    reference = torch_load_file(str(path / "model.safetensors"))
    checkpoint = Checkpoint(path)
    for name in ("model.layers.0.self_attn.q_proj.weight", "model.layers.1.self_attn.k_norm.weight", "model.norm.weight"):
        expected = reference[name].float().numpy()
        actual = checkpoint.tensor(name)
        assert actual.dtype == np.float32
        _assert_identical(actual, expected, name)


def _torch_bf16_bits(values: np.ndarray) -> np.ndarray:
    return torch.from_numpy(np.ascontiguousarray(values, np.float32)).to(torch.bfloat16).view(torch.int16).numpy().view(np.uint16)


def _bf16_test_values() -> np.ndarray:
    rng = np.random.default_rng(2024)
    finfo = np.finfo(np.float32)
    parts = [
        rng.standard_normal(4000).astype(np.float32),
        (rng.standard_normal(2000) * 1e-30).astype(np.float32),  # tiny
        (rng.standard_normal(2000) * 1e-40).astype(np.float32),  # float32 subnormals
        (rng.standard_normal(2000) * 1e35).astype(np.float32),  # large
        rng.uniform(-3e38, 3e38, 1000).astype(np.float32),  # near the top of the range
        # Exact ties: the low 16 bits are 0x8000, once with an even and once with an odd kept part.
        ((rng.integers(0x3F800000, 0x4F800000, 500, dtype=np.uint32) & ~np.uint32(0x1FFFF)) | 0x8000).view(np.float32),
        ((rng.integers(0x3F800000, 0x4F800000, 500, dtype=np.uint32) & ~np.uint32(0xFFFF)) | 0x18000).view(np.float32),
        -((rng.integers(0x00800000, 0x7F000000, 500, dtype=np.uint32) & ~np.uint32(0xFFFF)) | 0x8000).view(np.float32),
        np.array([finfo.max, -finfo.max, finfo.tiny, -finfo.tiny, np.inf, -np.inf, 0.0, -0.0, 1.0, -1.0], np.float32),
    ]
    return np.concatenate(parts).astype(np.float32)


def test_float32_to_bf16_rounds_like_torch():
    values = _bf16_test_values()
    assert np.isfinite(values[:-10]).all()
    actual = float32_to_bf16(values)
    expected = _torch_bf16_bits(values)
    assert actual.dtype == np.uint16
    mismatch = np.flatnonzero(actual != expected)
    widened_a = bf16_to_float32(actual).astype(np.float64)
    widened_e = torch.from_numpy(expected.view(np.int16)).view(torch.bfloat16).float().numpy().astype(np.float64)
    finite = np.isfinite(widened_e) & np.isfinite(widened_a)
    worst = float(np.abs(widened_a[finite] - widened_e[finite]).max()) if finite.any() else 0.0
    assert mismatch.size == 0, (
        f"{mismatch.size} values round differently from torch, e.g. {values[mismatch[:3]]} -> "
        f"{actual[mismatch[:3]]} vs {expected[mismatch[:3]]}; max abs error {worst:.3g}"
    )


def test_float32_to_bf16_of_nan_is_nan():
    values = np.array([np.nan, -np.nan, 1.5, np.float32(np.nan) * -1], np.float32)
    widened = bf16_to_float32(float32_to_bf16(values))
    assert np.isnan(widened[[0, 1, 3]]).all()
    assert widened[2] == 1.5


def test_bf16_to_float32_widens_like_torch():
    rng = np.random.default_rng(99)
    raw = rng.integers(0, 1 << 16, size=20000, dtype=np.uint32).astype(np.uint16)
    actual = bf16_to_float32(raw)
    expected = torch.from_numpy(raw.view(np.int16)).view(torch.bfloat16).float().numpy()
    assert actual.dtype == np.float32
    nan = np.isnan(expected)
    assert np.array_equal(np.isnan(actual), nan)
    assert np.array_equal(actual[~nan].view(np.uint32), expected[~nan].view(np.uint32)), (
        f"max abs error {float(np.abs(actual[~nan].astype(np.float64) - expected[~nan]).max()):.3g}"
    )


# ============================================================================ unconsumed / skip


def test_unconsumed_tracks_reads_and_skips(llama, llama_tensors):
    checkpoint = Checkpoint(llama)
    everything = sorted(llama_tensors)
    assert checkpoint.names() == everything
    assert checkpoint.unconsumed() == everything
    checkpoint.tensor("model.norm.weight")
    checkpoint.raw("lm_head.weight")
    checkpoint.skip(["model.layers.0.mlp.up_proj.weight", "not.in.the.checkpoint"])
    assert checkpoint.unconsumed() == sorted(
        set(everything) - {"model.norm.weight", "lm_head.weight", "model.layers.0.mlp.up_proj.weight"}
    )
    assert "not.in.the.checkpoint" not in checkpoint.names()
    checkpoint.skip(everything)
    assert checkpoint.unconsumed() == []


def test_dense_loader_consumes_every_tensor_and_leaves_extras_unconsumed(tmp_path, llama, llama_tensors):
    assert _llm(llama).checkpoint.unconsumed() == []
    tensors = dict(llama_tensors)
    rng = np.random.default_rng(8)
    tensors["model.layers.0.extra_adapter.weight"] = rng.standard_normal((4, 4)).astype(np.float32)
    # An old-export buffer the dense family recomputes: skipped, not reported.
    tensors["model.layers.1.self_attn.rotary_emb.inv_freq"] = rng.standard_normal(8).astype(np.float32)
    llm = _llm(_rewrite(llama, tmp_path / "ckpt", tensors))
    assert llm.checkpoint.unconsumed() == ["model.layers.0.extra_adapter.weight"]


# ================================================================================ eos token ids


def _eos_folder(tmp_path: Path, llama: Path, config_eos, generation_eos) -> Path:
    folder = tmp_path / "ckpt"
    folder.mkdir()
    shutil.copy(llama / "model.safetensors", folder / "model.safetensors")
    config = json.loads((llama / "config.json").read_text())
    config.pop("eos_token_id", None)
    if config_eos is not None:
        config["eos_token_id"] = config_eos
    (folder / "config.json").write_text(json.dumps(config))
    if generation_eos is not None:
        (folder / "generation_config.json").write_text(json.dumps({"eos_token_id": generation_eos, "bos_token_id": 1}))
    return folder


@pytest.mark.parametrize(
    "config_eos, generation_eos, expected",
    [
        (7, 9, [9]),  # generation_config.json wins
        (7, [9, 11, 3], [9, 11, 3]),
        (7, None, [7]),  # falls back to config.json
        ([4, 5], None, [4, 5]),
        (None, None, []),
    ],
)
def test_eos_token_ids(tmp_path, llama, config_eos, generation_eos, expected):
    assert Checkpoint(_eos_folder(tmp_path, llama, config_eos, generation_eos)).eos_token_ids() == expected


def test_eos_token_ids_reach_the_llm(tmp_path, llama):
    llm = _llm(_eos_folder(tmp_path, llama, 7, [12, 13]))
    assert llm.eos_token_ids == [12, 13]


def test_fixture_generation_config_eos(llama):
    written = json.loads((llama / "generation_config.json").read_text())["eos_token_id"]
    expected = written if isinstance(written, list) else [written]
    assert Checkpoint(llama).eos_token_ids() == expected


# ========================================================================== safetensors layouts

def _tiny_dense_copy(tmp_path: Path) -> Path:
    from metrale.models import embedded_model_path

    return Path(shutil.copytree(embedded_model_path("tiny-dense"), tmp_path / "ckpt"))


F32_2x2 = {"dtype": "F32", "shape": [2, 2]}


def _write_safetensors(path: Path, header: dict | bytes, body: bytes, header_len: int | None = None) -> None:
    raw = header if isinstance(header, bytes) else json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(raw) if header_len is None else header_len) + raw + body)


def test_a_valid_hand_written_safetensors_file_loads(tmp_path):
    """The control of the layouts below: two tensors back to back."""
    folder = _tiny_dense_copy(tmp_path)
    body = np.zeros(4, np.float32).tobytes() + np.arange(4, dtype=np.float32).tobytes()
    header = {"__metadata__": {"format": "np"}, "a": {**F32_2x2, "data_offsets": [0, 16]},
              "b": {**F32_2x2, "data_offsets": [16, 32]}}
    _write_safetensors(folder / "model.safetensors", header, body)
    checkpoint = Checkpoint(folder)
    assert checkpoint.names() == ["a", "b"]
    assert checkpoint.tensor("b", (2, 2)).tolist() == [[0, 1], [2, 3]]


# (entries besides a = F32 [2, 2] at [0, 16), body length, what the message says)
LAYOUTS = {
    "aliased": ({"b": {**F32_2x2, "data_offsets": [0, 16]}}, 16, r"invalid offset"),
    "overlapping": ({"b": {**F32_2x2, "data_offsets": [8, 24]}}, 24, r"invalid offset"),
    "hole": ({"b": {**F32_2x2, "data_offsets": [24, 40]}}, 40, r"invalid offset"),
    "trailing-bytes": ({"b": {**F32_2x2, "data_offsets": [16, 32]}}, 40, r"not fully covered"),
    "past-the-end": ({"b": {**F32_2x2, "data_offsets": [16, 48]}}, 32, r"'b' lies at bytes \[16, 48\) past the end"),
    "reversed": ({"b": {**F32_2x2, "data_offsets": [32, 16]}}, 32, r"'b' lies at bytes \[32, 16\)"),
    "size-mismatch": ({"b": {**F32_2x2, "data_offsets": [16, 28]}}, 28,
                      r"'b' of dtype F32 and shape \[2, 2\] needs 16 bytes, but its data_offsets \[16, 28\) hold 12"),
    "negative-dim": ({"b": {"dtype": "F32", "shape": [-1, 4], "data_offsets": [16, 32]}}, 32, r"'b' has shape \[-1, 4\]"),
    "float-dim": ({"b": {"dtype": "F32", "shape": [2.0, 2], "data_offsets": [16, 32]}}, 32, r"'b' has shape \[2\.0, 2\]"),
    "bool-dim": ({"b": {"dtype": "F32", "shape": [True, 4], "data_offsets": [16, 32]}}, 32, r"'b' has shape \[True, 4\]"),
    "string-shape": ({"b": {"dtype": "F32", "shape": "2x2", "data_offsets": [16, 32]}}, 32, r"'b' has shape '2x2'"),
    "three-offsets": ({"b": {**F32_2x2, "data_offsets": [16, 24, 32]}}, 32, r"'b' has data_offsets \[16, 24, 32\]"),
    "float-offset": ({"b": {**F32_2x2, "data_offsets": [16, 32.0]}}, 32, r"'b' has data_offsets \[16, 32\.0\]"),
    "e5m2-dtype": ({"b": {"dtype": "F8_E5M2", "shape": [2, 2], "data_offsets": [16, 20]}}, 20,
                   r"'b' has unsupported dtype 'F8_E5M2'"),
    "unknown-dtype": ({"b": {"dtype": "X32", "shape": [2, 2], "data_offsets": [16, 32]}}, 32,
                      r"'b' has unsupported dtype 'X32'"),
    "non-string-metadata": ({"__metadata__": {"format": 1}, "b": {**F32_2x2, "data_offsets": [16, 32]}}, 32,
                            r"invalid JSON in header"),
}


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_safetensors_layout_the_safetensors_library_refuses_is_refused(tmp_path, layout):
    entries, body_len, message = LAYOUTS[layout]
    folder = _tiny_dense_copy(tmp_path)
    _write_safetensors(folder / "model.safetensors", {"a": {**F32_2x2, "data_offsets": [0, 16]}, **entries},
                       bytes(body_len))
    with pytest.raises(CheckpointError, match=re.escape(str(folder / "model.safetensors")) + ".*" + message):
        Checkpoint(folder)


def test_safetensors_header_length_over_the_librarys_cap_is_refused_unread(tmp_path):
    folder = _tiny_dense_copy(tmp_path)
    _write_safetensors(folder / "model.safetensors", b"{}", b"", header_len=200_000_000)
    with pytest.raises(CheckpointError, match=r"header length 200000000 exceeds the 100000000 bytes"):
        Checkpoint(folder)


def test_tensor_aliasing_another_tensors_bytes_is_refused(tmp_path):
    """tiny-dense with layer 0's up_proj pointing at gate_proj's bytes (its own bytes cut out, so
    the file has no hole): without the layout check it loads, and computes something else."""
    folder = _tiny_dense_copy(tmp_path)
    file = folder / "model.safetensors"
    data = file.read_bytes()
    (header_len,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8 : 8 + header_len])
    victim, source = "model.layers.0.mlp.up_proj.weight", "model.layers.0.mlp.gate_proj.weight"
    body, offset = bytearray(), 0
    for name, entry in sorted(((n, e) for n, e in header.items() if n != "__metadata__"),
                              key=lambda item: item[1]["data_offsets"][0]):
        if name == victim:
            continue
        begin, end = entry["data_offsets"]
        body += data[8 + header_len + begin : 8 + header_len + end]
        entry["data_offsets"] = [offset, offset + end - begin]
        offset += end - begin
    header[victim]["data_offsets"] = header[source]["data_offsets"]
    _write_safetensors(file, header, bytes(body))
    with pytest.raises(CheckpointError, match=r"model\.safetensors is not a valid safetensors file: .*invalid offset"):
        _llm(folder)


# ================================================================== metadata that is not what it says


@pytest.mark.parametrize("name", ["config.json", "generation_config.json", "model.safetensors.index.json"])
@pytest.mark.parametrize("text, kind", [("[]", "an array"), ('"llama"', "a string"), ("3", "a number"),
                                        ("null", "null"), ("[{\"model_type\": \"llama\"}]", "an array")])
def test_json_file_that_is_not_an_object_is_refused(tmp_path, name, text, kind):
    folder = _tiny_dense_copy(tmp_path)
    (folder / name).write_text(text)
    with pytest.raises(CheckpointError, match=re.escape(f"{folder / name} holds {kind}")):
        Checkpoint(folder)


@pytest.mark.parametrize(
    "weight_map, message",
    [
        ([], r"weight_map is \[\]; expected a JSON object"),
        ({"model.norm.weight": 3}, r"weight_map\['model\.norm\.weight'\] is 3; expected a shard file name"),
        ({"model.norm.weight": "../model.safetensors"},
         r"weight_map\['model\.norm\.weight'\] is '\.\./model\.safetensors'; expected a shard file name"),
        ({"model.norm.weight": "/etc/passwd"},
         r"weight_map\['model\.norm\.weight'\] is '/etc/passwd'; expected a shard file name"),
    ],
)
def test_index_with_a_malformed_weight_map_is_refused(tmp_path, weight_map, message):
    folder = _tiny_dense_copy(tmp_path)
    (folder / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    with pytest.raises(CheckpointError, match=r"model\.safetensors\.index\.json: " + message):
        Checkpoint(folder)


def test_tensor_stored_in_two_shards_is_refused(tmp_path):
    folder = _tiny_dense_copy(tmp_path)
    save_file({"model.norm.weight": np.ones(128, np.float32)}, str(folder / "extra.safetensors"))
    with pytest.raises(CheckpointError, match=r"'model\.norm\.weight' is stored twice, in extra\.safetensors and "
                                              r"model\.safetensors"):
        Checkpoint(folder)


@pytest.mark.parametrize(
    "file, value, said",
    [
        ("generation_config.json", "x", 'eos_token_id is "x"'),
        ("generation_config.json", [1, "x"], 'eos_token_id[1] is "x"'),
        ("generation_config.json", True, "eos_token_id is true"),
        ("generation_config.json", -1, "eos_token_id is -1"),
        ("generation_config.json", 1.5, "eos_token_id is 1.5"),
        ("generation_config.json", {"id": 1}, 'eos_token_id is {"id": 1}'),
        ("config.json", "x", 'eos_token_id is "x"'),  # checked even where generation_config.json wins
    ],
)
def test_eos_token_id_that_is_not_a_token_id_is_refused(tmp_path, file, value, said):
    folder = _tiny_dense_copy(tmp_path)
    data = json.loads((folder / file).read_text())
    data["eos_token_id"] = value
    (folder / file).write_text(json.dumps(data))
    with pytest.raises(CheckpointError, match=re.escape(f"{folder / file}: {said}; expected")):
        Checkpoint(folder).eos_token_ids()


# ================================================================ config against the tensors: helpers


def test_layer_indices_and_the_expect_helpers_read_names_and_headers_only():
    checkpoint = Checkpoint(metrale.models.embedded_model_path("tiny-mla"))
    assert checkpoint.layer_indices() == [0, 1, 2, 3]  # three decoder layers and the MTP module's
    assert checkpoint.layer_indices("model.layers.1.mlp.experts.") == list(range(8))
    assert checkpoint.layer_indices("model.layers.0.mlp.experts.") == []
    checkpoint.expect_count(4, "model.layers.", because="num_hidden_layers=4")
    checkpoint.expect_count(3, "model.layers.", because="num_hidden_layers=3", extra_ok=True)
    for count, extra_ok in ((3, False), (5, True), (10**12, False)):
        with pytest.raises(CheckpointError, match=rf"num_hidden_layers={count}, but .* for i = 0\.\.3 \(4\)"):
            checkpoint.expect_count(count, "model.layers.", because=f"num_hidden_layers={count}", extra_ok=extra_ok)
    name = "model.layers.0.self_attn.kv_a_proj_with_mqa.weight"
    checkpoint.expect_shape(name, (48, 128), because="kv_lora_rank=32 qk_rope_head_dim=16 hidden_size=128")
    with pytest.raises(CheckpointError, match=re.escape(f"{name}' has shape [48, 128], but config.json's "
                                                        "kv_lora_rank=64 implies [80, 128]")):
        checkpoint.expect_shape(name, (80, 128), because="kv_lora_rank=64")
    with pytest.raises(CheckpointError, match=r"q_lora_rank=null implies a tensor 'x\.weight' of shape \[4\]"):
        checkpoint.expect_shape("x.weight", (4,), because="q_lora_rank=null")
    checkpoint.expect_tensor("model.layers.1.mlp.gate.weight", because="first_k_dense_replace=1")
    with pytest.raises(CheckpointError, match=r"first_k_dense_replace=2 implies no tensor 'model\.layers\.1\.mlp"):
        checkpoint.expect_tensor("model.layers.1.mlp.gate.weight", False, because="first_k_dense_replace=2")
    assert checkpoint.unconsumed() == checkpoint.names()  # no tensor was read


def test_a_shard_that_is_not_a_regular_file_is_refused_without_blocking(tmp_path):
    """A FIFO named like a shard would block a reader forever."""
    folder = _tiny_dense_copy(tmp_path)
    (folder / "model.safetensors").unlink()
    os.mkfifo(folder / "model.safetensors")
    with pytest.raises(CheckpointError, match="model.safetensors is not a regular file"):
        Checkpoint(folder)


def test_a_shard_of_a_matrix_reads_its_rows_and_columns(tmp_path, llama):
    """``tensor(name, rows=, columns=)``: a rank's part, bf16 converted, the shape still checked."""
    folder = tmp_path / "ckpt"
    shutil.copytree(llama, folder)
    checkpoint = Checkpoint(folder)
    name = "model.layers.0.self_attn.q_proj.weight"
    whole = checkpoint.tensor(name)
    np.testing.assert_array_equal(checkpoint.tensor(name, whole.shape, rows=slice(2, 5)), whole[2:5])
    np.testing.assert_array_equal(checkpoint.tensor(name, whole.shape, columns=slice(4, 8)), whole[:, 4:8])
    np.testing.assert_array_equal(checkpoint.tensor(name, rows=slice(1, 3), columns=slice(0, 2)), whole[1:3, :2])
    with pytest.raises(CheckpointError, match="expected"):
        checkpoint.tensor(name, (1, 1), rows=slice(0, 1))
    with pytest.raises(CheckpointError, match="no columns"):
        checkpoint.tensor("model.norm.weight", columns=slice(0, 2))
