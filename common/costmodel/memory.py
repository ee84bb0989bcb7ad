"""Memory per rank: the terms every strategy shares, composed with the strategy's own (common/parallel/), and
the predicted peak with the frameworks' fitted factors (summary.json's memory_prediction, the report's table).

    params      4 x the parameters the rank holds (fp32 master weights under every dtype); grads the same;
                optimizer 2 x params (AdamW's two moments) -- as summary.json's state_bytes counts them; each the
                strategy's `state_elements` (zero1, zero2 shard the moments and zero2 the gradients, not the weights)
    activations one micro-batch's saved tensors (the strategy's activation_bytes)
    gathered    whole parameters held beside the shards at the peak (the strategy's gathered_bytes: fsdp)
    update      AdamW writes new parameters before the old ones are freed: one more copy of the rank's
    reused_pages (predicted_peak, 0 or negative) torch's gradients under glibc's heap threshold, written into the
                pages the freed activations left: counted once (HEAP_REUSED_BELOW_BYTES)
    overhead    the calibration run's peak (RSS on a CPU, the framework's allocator peak on a GPU) minus the
                above at the calibration point: the runtime, libraries, buffers, and the error of the
                activation count, taken as fixed.
"""
from __future__ import annotations

import math

from common.costmodel.workload import Workload
from common.model.weights import parameter_shapes
from common.parallel import layout
from common.parallel.layout import MASTER_BYTES, Layout, largest_tensor_bytes

# The predicted peak's framework terms, fitted (relative least squares) to the peak RSS of 21 runs on the
# reference machine (AMD EPYC Zen 5, 2 cores, shared: docs/benchmarks.md "Memory per rank, predicted and
# measured"): `small` with a 512-token and with GPT-2's vocabulary and `base`, 4 steps at seq 128 and global
# batch 8, ddp at N=1 and 2, fsdp and tp at 2, both frameworks. Fitted: MLX activations x0.80, update x1.46,
# 60 MB; torch x0.97, x0.15, 73 MB; rounded below. MLX's update and reduce terms were fitted again once the
# sharded strategies stopped building the whole model (issue 25: those runs' peaks had been start-up's):
# 16 runs of `base` at 12 and 24 layers, ddp at N=1 and 2, fsdp and tp at 2 (bench_memory.py
# --with-one-rank): update x0.94, reduce x0.67 (every run then within 9 %), rounded below.
#   activations  the share of activation_bytes' count a framework keeps: MLX's compiled step fuses some of it
#   update       copies of the rank's parameters alive in the update: MLX's AdamW writes new parameters and
#                moments before the old ones are freed; torch's foreach AdamW updates in place
#   reduce       where the gradient reduction copies the gradients (ddp at N > 1: the strategy's
#                copies_gradients_for_reduce): MLX's nn.average_gradients
#                concatenates them into all_reduce_size groups and all-sums those. torch's DDP reduces in
#                its buckets, which the gradients are views of (gradient_as_bucket_view), yet from the third
#                step on its rank holds 0.8x its parameters more than the rest of this model counts (`base`,
#                12 layers: 3,848-3,914 MiB at 3 to 12 steps against 3,542 at 2, and flat from 4 to 12 steps
#                at N=1; most likely the buckets DDP builds again after its first step, the first ones freed
#                into the heap): fitted to the runs of 3 or more steps, so 2-step runs come out 9-12 % high
#   workspace    the allocator's and the compiled graph's buffers, the token cache's mapped pages
ACTIVATION_FACTOR = {"mlx": 0.8, "torch": 1.0}
UPDATE_FACTOR = {"mlx": 1.0, "torch": 0.0}
REDUCE_FACTOR = {"mlx": 0.7, "torch": 0.8}
WORKSPACE_BYTES = {"mlx": 60e6, "torch": 70e6}
# glibc serves a tensor under its mmap threshold (32 MB once the first steps have raised it: common/train/heap.py)
# from its heap, and keeps the pages a freed tensor leaves; a larger tensor is a mapping of its own, given back when
# freed. So torch's gradients under the threshold are written into the pages the backward's freed activations left,
# and add nothing beyond them, while larger ones come on top: torch `base` (719 MB of parameters, 411 MB of them in
# tensors under 32 MB) was predicted 8-11 % over at ddp x1 and x2 on the Zen 5 while every gradient was summed, the
# 1B shape (671 MB of 4,943 under it) 6 % under. MLX's allocator keeps its own cache of freed buffers by size, which
# the factors above were fitted with: 0, nothing taken off.
HEAP_REUSED_BELOW_BYTES = {"mlx": 0, "torch": 32 * 2**20}
# Copies of the largest trained tensor torch's AdamW holds at once in its update on a CPU (`torch.optim.adam`'s
# single-tensor path, foreach being for accelerators: the square root, the bias-corrected denominator and a third),
# measured as the resident pages one step adds: 2.98-3.00 tensors at 10 MB and at 1,049 MB (the Zen 5, torch 2.13;
# benchmarks/bench_update_rss.py). Above the heap's threshold they are new mappings beside the whole state: the
# "update" phase. MLX's update writes new parameters beside the old, UPDATE_FACTOR, in the summed phase.
UPDATE_TEMPORARIES = {"mlx": 0, "torch": 3}


def memory_bytes(lay: Layout, w: Workload, overhead_bytes: float = 0.0) -> dict:
    """Bytes per rank at the step's peak under the strategy `lay`: the state the rank holds, one micro-batch's
    activations, fsdp's gathered parameters, AdamW's update (one more copy of the rank's parameters, measured
    above), and a fixed overhead (the caller's)."""
    held = lay.state_elements(w.spec, w.framework)  # zero1, zero2: whole parameters beside sharded moments
    params = lay.local_parameters(w.spec, w.framework) * MASTER_BYTES  # what AdamW updates (and writes anew)
    parts = {"params": held["params"] * MASTER_BYTES, "grads": held["grads"] * MASTER_BYTES,
             "optimizer": held["optimizer"] * MASTER_BYTES,
             "activations": lay.activation_bytes(w), "gathered": lay.gathered_bytes(w),
             "update": params, "overhead": overhead_bytes}
    return {**parts, "total": sum(parts.values())}


def predicted_peak(strategy: str, w: Workload, n: int, fixed_bytes: float, rank: int = 0,
                   checkpoint_format: str = "hf", mesh: str = "") -> dict:
    """A rank's peak RSS from the shapes and its measured fixed footprint alone (nothing calibrated on the
    run's own peak): the largest of the step's (memory_bytes with the framework's factors, the fixed footprint
    and the workspace, less torch's reused pages), the update's after the backward (`after_backward`: the state,
    the reduction's buffers and UPDATE_TEMPORARIES) and the checkpoint's (the state, the fixed footprint, the
    workspace and what saving holds; `peak_at` says which: "step", "update" or "checkpoint"). The start-up is not
    counted: a sharded rank reads only its own part of the model (issue 25), less than it holds in a step. `mesh`: the
    axes of strategy "mesh" ("dp=2,tp=2")."""
    lay = layout(strategy, n, mesh)
    parts = memory_bytes(lay, w)
    framework = w.framework if w.framework in WORKSPACE_BYTES else "torch"
    parts.update(fixed=fixed_bytes, workspace=WORKSPACE_BYTES[framework],
                 activations=parts["activations"] * ACTIVATION_FACTOR[framework],
                 update=parts["params"] * UPDATE_FACTOR[framework],
                 reduce=parts["grads"] * REDUCE_FACTOR[framework] if lay.copies_gradients_for_reduce else 0.0)
    del parts["overhead"], parts["total"]
    # torch's gradients under glibc's threshold, written into the freed activations' pages (HEAP_REUSED_BELOW_BYTES):
    # counted once, so the step's sum takes those pages off (a part of its own, 0 or negative)
    parts["reused_pages"] = -min(parts["activations"], parts["grads"] * small_tensor_share(w.spec, framework))
    step = sum(parts.values())
    # after the backward: the state, the reduction's buffers and the update's copies (UPDATE_TEMPORARIES)
    update = (step - parts["activations"] - parts["reused_pages"] - parts["gathered"]
              + UPDATE_TEMPORARIES[framework] * largest_tensor_bytes(w.spec))
    parts["checkpoint"] = lay.checkpoint_bytes(w, rank, checkpoint_format)
    saving = (fixed_bytes + parts["workspace"] + parts["params"] + parts["grads"] + parts["optimizer"]
              + parts["checkpoint"])
    phases = {"step": step, "update": update, "checkpoint": saving}
    peak_at = max(phases, key=phases.__getitem__)  # the first of equals
    return {**parts, "step": step, "after_backward": update, "saving": saving, "peak_at": peak_at,
            "total": phases[peak_at]}


def small_tensor_share(spec, framework: str) -> float:
    """The share of the parameters in tensors under `framework`'s heap threshold (small_tensor_elements)."""
    shapes = parameter_shapes(spec)
    return small_tensor_elements(shapes, framework) / sum(math.prod(s) for s in shapes.values())


def small_tensor_elements(shapes: dict, framework: str) -> int:
    """Elements of the float32 tensors of `shapes` under `framework`'s heap threshold (HEAP_REUSED_BELOW_BYTES), whose
    gradients reuse the freed activations' pages: 0 for MLX, whose own allocator the factors were fitted with."""
    below = HEAP_REUSED_BELOW_BYTES.get(framework, 0)
    return sum(n for n in map(math.prod, shapes.values()) if n * MASTER_BYTES < below)
