"""The GDN hybrid family: Qwen3-Next (gated attention and Gated DeltaNet layers, MoE)."""
