"""The MoE family: dense GQA attention with softmax-routed SwiGLU experts -- Qwen3-MoE, Qwen2-MoE
(with its gated shared expert) and Mixtral -- built from the dense family's attention block and
the routed-experts block of :mod:`metrale.layers.experts`."""
