"""The GPT-NeoX decoder (transformers' ``GPTNeoXForCausalLM``).

.. code-block:: text

   x = embed_in[token_ids]
   for each layer:
       parallel:   x = x + attention(ln_in(x)) + mlp(ln_post(x))
       sequential: x = x + attention(ln_in(x));  x = x + mlp(ln_post(x))
   logits = final_layer_norm(x) @ embed_out^T

LayerNorms carry a bias; attention is multi-head (no GQA) with RoPE on the first ``rotary_dim``
dims of each head; the MLP is ``dense_4h_to_h(gelu(dense_h_to_4h(h)))`` with biases.
"""

from __future__ import annotations

from typing import Any

from metrale.batch import ForwardBatch
from metrale.cache.spec import CacheSpec, PagedKVSpec
from metrale.checkpoint import Checkpoint
from metrale.family import FamilyModel
from metrale.layers.attention import AttentionGeometry

from metrale_gpt_neox.config import EMBEDDING, FINAL_NORM, LAYERS, GptNeoxConfig
from metrale_gpt_neox.layers import GeluMlp, LayerNormWeights, NeoxAttention, NeoxLayer

#: Buffers older exports saved beside the weights (the causal mask, its fill value, the RoPE
#: frequencies); they are recomputed, never read.
IGNORED_TENSOR_SUFFIXES = (".attention.bias", ".attention.masked_bias", ".attention.rotary_emb.inv_freq")


class GptNeoxModel(FamilyModel):
    """A loaded GPT-NeoX model. Every op it calls is graph-safe and its forward reads nothing
    back from the device, so decode steps are captured into CUDA graphs."""

    graph_capturable = True

    def __init__(self, config: GptNeoxConfig, checkpoint: Checkpoint, backend: Any, max_model_len: int) -> None:
        # Before anything sized by the config (RoPE table, per-layer lists, weights) is built.
        config.check_tensors(checkpoint)
        super().__init__(backend, vocab_size=config.vocab_size, max_model_len=max_model_len)
        self.config = c = config
        geometry = AttentionGeometry(
            hidden_size=c.hidden_size,
            num_heads=c.num_heads,
            num_kv_heads=c.num_heads,
            head_dim=c.head_dim,
            inv_freq=backend.constant(c.rope.inverse_frequencies()),  # [rotary_dim / 2]
            attention_factor=c.rope.attention_factor(),
        )
        self.embed = backend.load_weight(checkpoint, (EMBEDDING, (c.vocab_size, c.hidden_size)))
        self.layers = [self._load_layer(checkpoint, f"{LAYERS}{index}", geometry) for index in range(c.num_layers)]
        self.final_norm = LayerNormWeights.load(checkpoint, backend, FINAL_NORM, c.hidden_size)
        head = c.head_name(checkpoint)
        self.lm_head = self.embed if head is None else backend.load_weight(checkpoint, (head, (c.vocab_size, c.hidden_size)))
        checkpoint.skip([n for n in checkpoint.names() if n.startswith(LAYERS) and n.endswith(IGNORED_TENSOR_SUFFIXES)])

    def _load_layer(self, checkpoint: Checkpoint, prefix: str, geometry: AttentionGeometry) -> NeoxLayer:
        c, backend = self.config, self.backend
        return NeoxLayer(
            input_norm=LayerNormWeights.load(checkpoint, backend, f"{prefix}.input_layernorm", c.hidden_size),
            attention=NeoxAttention.load(checkpoint, backend, f"{prefix}.attention", geometry, c.rotary_dim,
                                         bias=c.attention_bias),
            post_norm=LayerNormWeights.load(checkpoint, backend, f"{prefix}.post_attention_layernorm", c.hidden_size),
            mlp=GeluMlp.load(checkpoint, backend, f"{prefix}.mlp", c.hidden_size, c.intermediate_size,
                             c.gelu_approximate),
            parallel=c.use_parallel_residual,
            eps=c.layer_norm_eps,
        )

    def cache_spec(self) -> CacheSpec:
        c = self.config
        return CacheSpec(tuple(PagedKVSpec(c.num_heads, c.head_dim) for _ in self.layers))

    def forward_batch(self, batch: ForwardBatch) -> Any:
        ops = self.backend.ops
        x, residual = ops.embedding(self.embed, batch.token_ids), None
        for layer, cache_layer in zip(self.layers, self.cache.layers):
            x, residual = layer.forward(self.backend, x, residual, cache_layer, batch)
        rows = batch.logits_rows
        norm = self.final_norm
        h, _ = ops.layernorm_residual(x[rows], residual[rows], norm.weight, norm.bias, self.config.layer_norm_eps)
        return ops.linear(h, self.lm_head)
