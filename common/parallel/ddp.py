"""ddp: replicated data parallelism. Every rank holds the whole model, reads 1/N of the global batch, and
the gradients are averaged (the default strategy). The framework code: mlx_impl/ddp.py, torch_impl/ddp.py.

Its cost (common/costmodel/, docs/scaling.md):

    f_work     1/N: the batch is split;  f_state 1: every rank updates every parameter
    traffic    the fp32 gradients, one all-reduce per bucket (torch bucket_cap_mb, MLX all_reduce_size_mb)
    memory     the whole state, and the copies of the gradients the all-reduce makes at N > 1 (MLX's
               nn.average_gradients concatenates them; torch's rebuilt buckets: memory.py REDUCE_FACTOR)
    exposed    (1 - overlap) x the all-reduces' time + sync_overhead_s. Its sync is timed apart from compute
               (the breakdown's `communication`, the synced minus the unsynced step), so a calibration run at
               N > 1 with a known link measures the overlap, 1 - exposed / modelled; a sync that costs more than
               the collectives alone is overlap 0 plus that excess as a fixed cost per step (copies, threads
               waiting for a core: common/costmodel/calibrate.py).
"""
from __future__ import annotations

import math
from typing import ClassVar

from common.costmodel.links import Collective, Link
from common.costmodel.workload import Workload
from common.model.precision import policy
from common.model.spec import ModelSpec
from common.parallel.layout import DTYPE_BYTES, Layout, Measured, total_parameters

DEFAULT_BUCKET_BYTES = {"mlx": 32 * 2**20, "torch": 25 * 2**20}  # RunConfig's all_reduce_size_mb, bucket_cap_mb


class DdpLayout(Layout):
    name: ClassVar[str] = "ddp"
    supports_biases: ClassVar[bool] = True
    collectives_inside_compute: ClassVar[bool] = False
    state_survives_a_lost_rank: ClassVar[bool] = True
    trains_adapters: ClassVar[bool] = True  # LoRA's frozen base and replicated adapters (common/model/lora.py)
    takes_uneven_shares: ClassVar[bool] = True  # --rank-shares (common/data/shares.py, docs/uneven.md)

    def local_parameters(self, spec: ModelSpec, framework: str = "torch") -> float:
        return total_parameters(spec)

    def work_fraction(self, w: Workload) -> float:
        return 1.0 / self.ranks

    def gradient_bytes(self, spec: ModelSpec, dtype: str) -> int:
        """Every gradient once, in the policy's reduce dtype (float32 in every policy)."""
        return total_parameters(spec) * DTYPE_BYTES[policy(dtype).reduce_dtype]

    def step_collectives(self, w: Workload, reduce_scatter: str) -> list[Collective]:
        if w.trained_elements is not None:  # LoRA: the adapters' gradients alone (the frozen base has none)
            return [gradient_all_reduce(w.trained_elements * DTYPE_BYTES[policy(w.dtype).reduce_dtype], w)]
        return [gradient_all_reduce(self.gradient_bytes(w.spec, w.dtype), w)]

    def payload_bytes_per_step(self, spec: ModelSpec, micro_batch_size: int, seq_len: int, grad_accum: int,
                               dtype: str) -> int:
        # The gradients the collectives above cut into buckets: their calls x nbytes equals it where the
        # buckets divide it, else falls short by under a byte per call (each bucket's size rounded down).
        return self.gradient_bytes(spec, dtype)

    def streamed_checkpoint_bytes(self, w: Workload, rank: int) -> float:
        return 0.0  # it writes views of its own state

    @property
    def copies_gradients_for_reduce(self) -> bool:
        return self.ranks > 1

    def exposed_comm_s(self, cal: Measured, colls: list[Collective], link: Link | None, comm_s: float) -> float:
        # A sync that costs more than the collectives alone (torch on 2 busy cores) is a fixed cost per step.
        return super().exposed_comm_s(cal, colls, link, comm_s) + (cal.sync_overhead_s if colls else 0.0)


def gradient_all_reduce(grad_bytes: float, w: Workload) -> Collective:
    """`grad_bytes` of gradients averaged in buckets (torch bucket_cap_mb, MLX all_reduce_size_mb): one call per
    bucket, of the buckets' mean size."""
    bucket = w.bucket_bytes or DEFAULT_BUCKET_BYTES.get(w.framework, 25 * 2**20)
    calls = max(1, math.ceil(grad_bytes / bucket))
    return Collective("all_reduce", int(grad_bytes / calls), calls, "gradients")
