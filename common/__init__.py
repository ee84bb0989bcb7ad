"""Framework-neutral parts of dpcompare: model spec and seed weights, config, data, sharding,
LR schedule, metrics and checkpoint formats, and the training loop's bookkeeping.

Nothing in this package imports mlx or torch; both backends build on it.
"""
