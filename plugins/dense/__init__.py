"""The dense family: Llama, Mistral, Qwen2 and Qwen3 decoder-only transformers.

Its layers (:mod:`metrale.plugins.dense.layers`) are public: other families reuse the attention
block and the SwiGLU MLP.
"""
