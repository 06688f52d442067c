"""The shared multi-token-prediction block (metrale/layers/mtp.py) on the CPU: it loads only when
every tensor it needs is there, and its forward is the formula of docs/families.rst ("MTP
modules"), plain and zero-centred norms alike. The families' modules against PyTorch references
are in tests/plugins/test_mtp.py."""

from __future__ import annotations

import json

import numpy as np
import pytest
from safetensors.numpy import save_file

from metrale.backends.devices import get_backend
from metrale.batch import ForwardBatch, Segment
from metrale.layers.loading import DecoderEnds
from metrale.layers.mtp import MtpModule, MtpTensors
from metrale.loading.checkpoint import Checkpoint
from metrale.ops import build_op_registry
from metrale.sequence import SequenceState

HIDDEN, VOCAB = 8, 11
TENSORS = MtpTensors("m.enorm.weight", "m.hnorm.weight", "m.eh_proj.weight", "m.head_norm.weight",
                     ("m.layer.weight",))


def cpu_backend():
    backend = get_backend("cpu")
    backend.use_ops(build_op_registry())
    return backend


def write_checkpoint(folder, rng, leave_out=()):
    tensors = {
        "m.enorm.weight": 1 + 0.2 * rng.standard_normal(HIDDEN),
        "m.hnorm.weight": 1 + 0.2 * rng.standard_normal(HIDDEN),
        "m.eh_proj.weight": 0.3 * rng.standard_normal((HIDDEN, 2 * HIDDEN)),
        "m.head_norm.weight": 1 + 0.2 * rng.standard_normal(HIDDEN),
        "m.layer.weight": 0.3 * rng.standard_normal((HIDDEN, HIDDEN)),
    }
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps({"model_type": "test"}))
    save_file({name: value.astype(np.float32) for name, value in tensors.items() if name not in leave_out},
              str(folder / "model.safetensors"))
    return Checkpoint(folder)


def rms(x, weight, eps, offset):
    return x / np.sqrt((x * x).mean(-1, keepdims=True) + eps) * (offset + weight)


@pytest.mark.parametrize("missing", TENSORS.required)
def test_an_incomplete_module_loads_nothing(tmp_path, missing):
    checkpoint = write_checkpoint(tmp_path, np.random.default_rng(1), leave_out=(missing,))
    layers = []
    module = MtpModule.load(checkpoint, cpu_backend(), TENSORS, HIDDEN, lambda: layers.append(1))
    assert module is None and layers == []
    assert sorted(checkpoint.unconsumed()) == sorted(set(TENSORS.required) - {missing})


@pytest.mark.parametrize("offset", [0.0, 1.0])
def test_the_forward_is_the_modules_formula(tmp_path, offset):
    rng = np.random.default_rng(7)
    checkpoint = write_checkpoint(tmp_path, rng)
    backend = cpu_backend()
    layer_weight = checkpoint.tensor("m.layer.weight", (HIDDEN, HIDDEN))
    module = MtpModule.load(checkpoint, backend, TENSORS, HIDDEN, lambda: layer_weight, offset)
    assert module is not None and checkpoint.unconsumed() == []
    ends = DecoderEnds(embed=rng.standard_normal((VOCAB, HIDDEN)).astype(np.float32),
                       norm=np.ones(HIDDEN, np.float32),
                       lm_head=rng.standard_normal((VOCAB, HIDDEN)).astype(np.float32))
    tokens = [3, 9, 1]
    seq = SequenceState.from_prompt([5, *tokens])
    seq.block_table = [0]
    batch = ForwardBatch.build([Segment(seq, tokens, 0, "all")], 4)
    hidden = rng.standard_normal((len(tokens), HIDDEN)).astype(np.float32)
    seen = []

    def run_layer(layer, x):
        # A stand-in decoder layer: out = x W^T, the residual its input.
        seen.append(layer)
        return x @ layer.T, x

    eps = 1e-6
    logits, states = module.forward(backend, ends, batch, hidden, eps, run_layer)
    weights = {name: checkpoint.tensor(name) for name in TENSORS.required}
    joined = np.concatenate([rms(ends.embed[tokens], weights["m.enorm.weight"], eps, offset),
                             rms(hidden, weights["m.hnorm.weight"], eps, offset)], axis=1)
    x = joined @ weights["m.eh_proj.weight"].T
    summed = x @ layer_weight.T + x
    expected = rms(summed, weights["m.head_norm.weight"], eps, offset) @ ends.lm_head.T
    assert seen and seen[0] is layer_weight
    np.testing.assert_allclose(np.asarray(states), summed, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(np.asarray(logits), expected, rtol=1e-4, atol=1e-4)
