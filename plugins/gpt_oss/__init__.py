"""The GPT-OSS family (:ref:`families-gpt-oss`): attention with learned sinks and alternating
sliding-window layers, and routed experts with biases and a clamped SwiGLU, stored at full
precision or MXFP4 -- built from the attention block of :mod:`metrale.layers.attention` and the
experts block of :mod:`metrale.layers.experts`."""
