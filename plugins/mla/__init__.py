"""The MLA family: DeepSeek-V2 and DeepSeek-V3 (multi-head latent attention, MoE)."""
