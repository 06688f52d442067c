"""Public building blocks of decoder families: each owns its weights, their loading and its
forward, and computes only through ``backend.ops``.

* :mod:`metrale.layers.attention` -- grouped-query attention over the paged KV cache;
* :mod:`metrale.layers.mlp` -- the SwiGLU MLP;
* :mod:`metrale.layers.experts` -- stacked routed experts;
* :mod:`metrale.layers.loading` -- embeddings, final norm and LM head, shared by every family;
* :mod:`metrale.layers.mtp` -- the multi-token-prediction module of DeepSeek-V3 and Qwen3-Next.
"""
