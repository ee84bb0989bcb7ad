"""The names mlx_impl/ and torch_impl/ import from here, kept while those backends are rewritten (issue 36):
the fsdp rows now live with fsdp (common/parallel/fsdp.py) and the tp split with tp (common/parallel/tp.py).
New code imports from there; this module goes once the backends do."""
from common.parallel.fsdp import fsdp_rows
from common.parallel.tp import tp_index, tp_split_axis

__all__ = ["fsdp_rows", "tp_index", "tp_split_axis"]
