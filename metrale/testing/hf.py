"""Hugging Face transformers as the reference of a conformance test (needs torch + transformers).

* :func:`build_hf_checkpoint` saves a tiny random-weight model with ``save_pretrained``, weights
  perturbed so that no norm is an identity and no bias is zero (:ref:`families-testing`);
* :func:`hf_reference_logits` runs transformers in float32 and returns every position's logits;
  :func:`hf_greedy` its greedy continuation;
* :class:`TransformersConformance` is the whole conformance kit against transformers, for a
  model class and a config.

Loaded transformers models are cached (a few at a time) by the *contents* of the checkpoint's
files, not by its path: a checkpoint rewritten in place is loaded again.
"""

from __future__ import annotations

import hashlib
from functools import lru_cache
from pathlib import Path
from typing import Any, Sequence

import numpy as np
import pytest

from metrale.testing.conformance import FamilyConformance


def perturb_weights(model: Any, seed: int, *, zero_centred_norms: bool = False) -> None:
    """Replace every parameter with seeded noise: norm weights ``1 + 0.2 N`` (``0.2 N`` when
    zero-centred), everything else -- biases, norm biases included -- ``0.15 N``."""
    import torch

    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            noise = torch.randn(parameter.shape, generator=generator, dtype=torch.float32)
            if name.endswith(".bias"):
                value = 0.15 * noise  # biases stay biases, a LayerNorm's included
            elif name.endswith("norm.weight") or "layernorm" in name or name.endswith("norm"):
                value = 0.2 * noise + (0.0 if zero_centred_norms else 1.0)
            else:
                value = 0.15 * noise
            parameter.copy_(value.to(parameter.dtype))


def build_hf_checkpoint(
    model_class: Any,
    config: Any,
    path: str | Path,
    *,
    seed: int = 0,
    dtype: Any = None,
    zero_centred_norms: bool = False,
    max_shard_size: str | None = None,
) -> Path:
    """Instantiate ``model_class(config)``, perturb its weights, ``save_pretrained`` to ``path``."""
    import torch

    torch.manual_seed(seed)
    model = model_class(config).eval()
    perturb_weights(model, seed, zero_centred_norms=zero_centred_norms)
    if dtype is not None:
        model = model.to(dtype)
    path = Path(path)
    kwargs = {"max_shard_size": max_shard_size} if max_shard_size else {}
    model.save_pretrained(path, **kwargs)
    return path


def checkpoint_digest(path: str | Path) -> str:
    """A digest of the contents of every file in the checkpoint folder ``path``. Files are hashed
    once per (size, modification time): a file rewritten in place is hashed again."""
    folder = Path(path)
    digest = hashlib.blake2b(digest_size=16)
    for file in sorted(p for p in folder.iterdir() if p.is_file()):
        stat = file.stat()
        digest.update(file.name.encode() + b"\0" + _file_digest(str(file), stat.st_size, stat.st_mtime_ns))
    return digest.hexdigest()


@lru_cache(maxsize=256)
def _file_digest(file: str, size: int, mtime_ns: int) -> bytes:
    digest = hashlib.blake2b(digest_size=16)
    with open(file, "rb") as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            digest.update(block)
    return digest.digest()


def _load(path: str) -> Any:
    return _load_by_content(str(Path(path).resolve()), checkpoint_digest(path))


@lru_cache(maxsize=8)
def _load_by_content(path: str, digest: str) -> Any:
    import torch
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


def hf_reference_logits(path: str | Path, token_ids: Sequence[int]) -> np.ndarray:
    """transformers' float32 logits ``[len, vocab]`` for ``token_ids``."""
    import torch

    model = _load(str(path))
    with torch.no_grad():
        logits = model(torch.tensor([list(token_ids)], dtype=torch.long)).logits[0]
    return logits.float().numpy()


def hf_greedy(path: str | Path, token_ids: Sequence[int], max_new_tokens: int) -> list[int]:
    """transformers' ``generate(do_sample=False)`` continuation, never stopping early."""
    import torch

    model = _load(str(path))
    ids = torch.tensor([list(token_ids)], dtype=torch.long)
    with torch.no_grad():
        out = model.generate(
            ids,
            attention_mask=torch.ones_like(ids),  # never infer padding from a token id
            max_new_tokens=max_new_tokens,
            do_sample=False,
            eos_token_id=None,
            pad_token_id=0,
        )
    return out[0, len(token_ids) :].tolist()



class TransformersConformance(FamilyConformance):
    """The conformance kit with transformers as the reference, ready made.

    Set ``hf_model_class`` (a transformers ``...ForCausalLM`` class) and ``hf_config`` (its
    config, or a callable returning one), and every check of
    :class:`~metrale.testing.FamilyConformance` runs against a tiny random-weight checkpoint of
    that model, built with ``save_pretrained`` (weights perturbed by :func:`perturb_weights`)::

        from transformers import GPTNeoXConfig, GPTNeoXForCausalLM
        from metrale.testing.hf import TransformersConformance

        class TestGptNeox(TransformersConformance):
            hf_model_class = GPTNeoXForCausalLM
            hf_config = staticmethod(lambda: GPTNeoXConfig(hidden_size=64, ...))

    ``zero_centred_norms`` perturbs norm weights around 0 instead of 1 (families whose norms
    compute ``1 + w``); ``checkpoint_seed`` seeds the weights.
    """

    hf_model_class: Any = None
    hf_config: Any = None
    zero_centred_norms: bool = False
    checkpoint_seed: int = 0

    @pytest.fixture(scope="class")
    @classmethod
    def conformance_checkpoint(cls, tmp_path_factory: Any) -> Path:
        if cls.hf_model_class is None or cls.hf_config is None:
            raise TypeError(f"{cls.__name__} must set hf_model_class and hf_config")
        config = cls.hf_config() if callable(cls.hf_config) else cls.hf_config
        return build_hf_checkpoint(cls.hf_model_class, config, tmp_path_factory.mktemp("transformers"),
                                   seed=cls.checkpoint_seed, zero_centred_norms=cls.zero_centred_norms)

    def reference_logits(self, checkpoint: Path, token_ids: list[int]) -> np.ndarray:
        return hf_reference_logits(checkpoint, token_ids)


def build_peft_adapter(checkpoint: str | Path, folder: str | Path, *, seed: int = 0, scale: float = 0.2,
                       **lora: Any) -> Any:
    """A PEFT LoRA adapter (``lora``: ``peft.LoraConfig`` fields) on the transformers model at
    ``checkpoint``, its LoRA and trainable-token weights ``scale`` times seeded noise (PEFT starts
    ``lora_B`` at zero), saved to ``folder``; returns the ``PeftModel`` (float32, eval mode)."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(checkpoint), dtype=torch.float32)
    peft = get_peft_model(model, LoraConfig(**lora))
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, parameter in peft.named_parameters():
            if "lora_" in name or "trainable_tokens" in name:
                parameter.copy_(scale * torch.randn(parameter.shape, generator=generator))
    peft.save_pretrained(str(folder))
    return peft.eval()
