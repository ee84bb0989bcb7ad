"""The PyTorch side: the Llama model and its DDP training."""
