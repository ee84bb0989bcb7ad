"""Documents to training samples: sources, the builtin corpus, tokenizers, the token cache, sequences and the sampler."""
