"""A tiny parallel-residual checkpoint and an independent float64 NumPy forward of it."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
from safetensors.numpy import load_file, save_file

CONFIG = {
    "architectures": ["ParallelBlockForCausalLM"],
    "model_type": "parallel_block",
    "vocab_size": 96,
    "hidden_size": 48,
    "intermediate_size": 80,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "rms_norm_eps": 1e-5,
    "rope_theta": 10000.0,
    "max_position_embeddings": 128,
}


def build_checkpoint(path: Path, seed: int = 0) -> Path:
    """Write ``config.json`` and ``model.safetensors`` with seeded random float32 weights."""
    c, rng = CONFIG, np.random.default_rng(seed)
    hidden, inter, head = c["hidden_size"], c["intermediate_size"], c["hidden_size"] // c["num_attention_heads"]
    q_rows, kv_rows = c["num_attention_heads"] * head, c["num_key_value_heads"] * head

    def matrix(rows, cols):
        return (0.15 * rng.standard_normal((rows, cols))).astype(np.float32)

    def norm(n):
        return (1 + 0.2 * rng.standard_normal(n)).astype(np.float32)

    tensors = {"model.embed_tokens.weight": matrix(c["vocab_size"], hidden)}
    for i in range(c["num_hidden_layers"]):
        p = f"model.layers.{i}"
        tensors.update({
            f"{p}.layernorm.weight": norm(hidden),
            f"{p}.self_attn.q_proj.weight": matrix(q_rows, hidden),
            f"{p}.self_attn.k_proj.weight": matrix(kv_rows, hidden),
            f"{p}.self_attn.v_proj.weight": matrix(kv_rows, hidden),
            f"{p}.self_attn.o_proj.weight": matrix(hidden, q_rows),
            f"{p}.mlp.gate_proj.weight": matrix(inter, hidden),
            f"{p}.mlp.up_proj.weight": matrix(inter, hidden),
            f"{p}.mlp.down_proj.weight": matrix(hidden, inter),
        })
    tensors["model.norm.weight"] = norm(hidden)
    tensors["lm_head.weight"] = matrix(c["vocab_size"], hidden)
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(c, indent=2))
    save_file(tensors, str(path / "model.safetensors"))
    return path


def reference_logits(path: Path, token_ids: list[int]) -> np.ndarray:
    """Full causal forward in float64, no cache: ``[len, vocab]``."""
    c = json.loads((path / "config.json").read_text())
    w = {k: v.astype(np.float64) for k, v in load_file(str(path / "model.safetensors")).items()}
    n_h, n_kv = c["num_attention_heads"], c["num_key_value_heads"]
    d = c["hidden_size"] // n_h
    eps = c["rms_norm_eps"]
    T = len(token_ids)

    def rms(x, weight):
        return x / np.sqrt((x * x).mean(-1, keepdims=True) + eps) * weight

    inv_freq = 1.0 / c["rope_theta"] ** (np.arange(0, d, 2) / d)
    angles = np.arange(T)[:, None] * inv_freq[None, :]
    cos, sin = np.cos(angles)[:, None, :], np.sin(angles)[:, None, :]

    def rope(x):  # x [T, heads, d], half-split pairs
        a, b = x[..., : d // 2], x[..., d // 2 :]
        return np.concatenate([a * cos - b * sin, b * cos + a * sin], axis=-1)

    x = w["model.embed_tokens.weight"][token_ids]
    causal = np.tril(np.ones((T, T), dtype=bool))
    for i in range(c["num_hidden_layers"]):
        p = f"model.layers.{i}"
        h = rms(x, w[f"{p}.layernorm.weight"])
        q = rope((h @ w[f"{p}.self_attn.q_proj.weight"].T).reshape(T, n_h, d))
        k = rope((h @ w[f"{p}.self_attn.k_proj.weight"].T).reshape(T, n_kv, d))
        v = (h @ w[f"{p}.self_attn.v_proj.weight"].T).reshape(T, n_kv, d)
        k, v = np.repeat(k, n_h // n_kv, axis=1), np.repeat(v, n_h // n_kv, axis=1)
        scores = np.einsum("thd,shd->hts", q, k) / np.sqrt(d)
        scores = np.where(causal[None], scores, -np.inf)
        probs = np.exp(scores - scores.max(-1, keepdims=True))
        probs /= probs.sum(-1, keepdims=True)
        attended = np.einsum("hts,shd->thd", probs, v).reshape(T, n_h * d) @ w[f"{p}.self_attn.o_proj.weight"].T
        gate, up = h @ w[f"{p}.mlp.gate_proj.weight"].T, h @ w[f"{p}.mlp.up_proj.weight"].T
        mlp = (gate / (1 + np.exp(-gate)) * up) @ w[f"{p}.mlp.down_proj.weight"].T
        x = x + attended + mlp
    return rms(x, w["model.norm.weight"]) @ w["lm_head.weight"].T
