"""The model both frameworks build: the Llama spec, HF configs, RoPE, precision policy, FLOPs and seeded init."""
