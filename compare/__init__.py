"""The framework-neutral side of dpcompare: CLI, launching backends as subprocesses, watching their
ranks, judging parity and writing reports. Nothing here imports mlx or torch."""
