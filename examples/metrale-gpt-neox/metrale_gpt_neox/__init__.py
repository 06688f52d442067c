"""A Metrale model family for GPT-NeoX checkpoints (``GPTNeoXForCausalLM``: Pythia, GPT-NeoX-20B)."""
