"""The peers: the users' own trainers (mlx-lm's, transformers' Trainer with peft), fed dpcompare's batches and writing
a run directory like any backend's (docs/peers.md)."""
