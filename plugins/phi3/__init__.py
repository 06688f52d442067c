"""The Phi-3 family: Phi-3 and Phi-4 (``Phi3ForCausalLM``) -- the dense family's pre-norm layer
with the checkpoint's fused ``qkv_proj`` and ``gate_up_proj``, partial rotary, a sliding window
on every layer, and LongRoPE (:mod:`metrale.loading.rope`)."""
