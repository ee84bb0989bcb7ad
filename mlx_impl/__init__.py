"""The MLX side: the Llama model and its data-parallel training."""
