"""Memory per rank of a model nobody trained here, full or LoRA, on a float32 or quantized base (`dpcompare plan
--model`, and `dpcompare run`'s warning before it starts a run that would not fit).

The parts, each predicted (the framework factors are memory.py's, fitted on measured runs):

    weights     the base the rank holds (its share under fsdp, tp and pp; a quantized base's packed words, scales
                and biases: common/model/quantize.py) plus LoRA's adapters, float32
    gradients   float32, of what trains on the rank (the adapters alone under LoRA)
    optimizer   AdamW's two float32 moments of what trains
    activations one micro-batch's saved tensors (the layout's count, memory.py's factor); under LoRA on the last k
                blocks only those blocks keep theirs (the blocks below run without a graph)
    gathered    whole parameters held beside the shards (fsdp)
    update      the copies AdamW's update holds (MLX writes new parameters before the old are freed)
    reduce      ddp's gradient reduction copies (MLX's grouped all-reduce)
    dequantize  a quantized product dequantizes a block of rows at a time in float32, in both frameworks on a CPU
                (the codes, their float copy, the product: three blocks of at most quantize.BLOCK_BYTES)
    overhead    the framework's own: the rank's fixed footprint and workspace, taken from the calibration run
                (its peak less the parts above at its own shapes), or memory.py's constants without one; at
                N > 1 plus what a job of several ranks adds to it (JOB_FIXED_BYTES)
"""
from __future__ import annotations

import math
import os

from common.costmodel.memory import ACTIVATION_FACTOR, REDUCE_FACTOR, UPDATE_FACTOR, WORKSPACE_BYTES
from common.costmodel.workload import Workload
from common.model.lora import Adapters, FullModel, Trained
from common.model.quantize import BLOCK_BYTES
from common.model.weights import parameter_shapes
from common.parallel.layout import MASTER_BYTES, Layout

# A rank's footprint before its model exists, where no run measured it (summary.json's fixed_rss_bytes on the
# reference machine: MLX about 54 MB at N=1 and 89 MB at N=2, torch about 370 MB; docs/scaling.md).
FIXED_BYTES = {"mlx": 60e6, "torch": 370e6}
# What a rank's fixed footprint adds in a job of more than one rank (the communication backend's libraries and
# buffers), measured as fixed_rss_bytes at N=2 less N=1 on tiny (Intel Xeon VM): MLX ring 44.3 -> 79.0 MB,
# torch gloo 232.5 -> 241.0 MB. A calibration run at N=1 lacks it, one at N > 1 has it (overhead_from_run).
JOB_FIXED_BYTES = {"mlx": 35e6, "torch": 8e6}
DEQUANTIZE_COPIES = {"mlx": 3, "torch": 3}
PARTS = ("weights", "gradients", "optimizer", "activations", "gathered", "update", "reduce", "dequantize")


def model_memory(lay: Layout, w: Workload, trained: Trained = FullModel(), storage=None,
                 overhead_bytes: float | None = None) -> dict:
    """{part: bytes per rank (module docstring), "overhead", "total"} of workload `w` under layout `lay`."""
    fw = w.framework if w.framework in WORKSPACE_BYTES else "torch"
    spec = w.spec
    lora = isinstance(trained, Adapters)
    local_share = lay.local_parameters(spec, fw) / sum(math.prod(s) for s in parameter_shapes(spec).values())
    bits = getattr(storage, "bits", 32) if storage is not None else 32
    base = storage.base_bytes(spec) if bits < 32 else sum(math.prod(s) for s in parameter_shapes(spec).values()) * 4
    trained_elements = trained.trained_parameters(spec) * (1.0 if lora else local_share)
    state = trained_elements * MASTER_BYTES
    activations = lay.activation_bytes(w)
    if isinstance(trained, Adapters):  # the blocks below the lowest adapted one keep nothing for a backward that never runs
        tokens = w.micro_rows(lay.dp_size) * w.seq_len
        logits = tokens * 2 * spec.vocab_size * 4
        activations = logits + (activations - logits) * len(trained.blocks(spec)) / spec.n_layers
    largest = max((math.prod(s) for s in parameter_shapes(spec).values() if len(s) == 2), default=0)
    parts = {
        "weights": base * local_share + (state if lora else 0.0),
        "gradients": state,
        "optimizer": 2 * state,
        "activations": activations * ACTIVATION_FACTOR[fw],
        "gathered": lay.gathered_bytes(w),
        "update": state * UPDATE_FACTOR[fw],
        "reduce": state * REDUCE_FACTOR[fw] if lay.copies_gradients_for_reduce else 0.0,
        "dequantize": DEQUANTIZE_COPIES[fw] * min(largest * 4, BLOCK_BYTES) if bits < 32 else 0.0,
    }
    overhead = FIXED_BYTES[fw] + WORKSPACE_BYTES[fw] if overhead_bytes is None else overhead_bytes
    overhead += JOB_FIXED_BYTES[fw] if lay.mesh.size > 1 else 0.0
    return {**parts, "overhead": overhead, "total": sum(parts.values()) + overhead}


def overhead_from_run(lay: Layout, w: Workload, peak_bytes: float | None, trained: Trained = FullModel(),
                      storage=None) -> float | None:
    """The framework's own memory as the calibration run measured it: its peak less the parts at its shapes (so
    predicting the run itself gives its peak back); None without a measured peak."""
    if not peak_bytes:
        return None
    parts = model_memory(lay, w, trained, storage, 0.0)  # with the job's fixed bytes at N > 1: not the run's own
    return max(0.0, peak_bytes - parts["total"])


def machine_memory_bytes() -> float | None:
    """The memory this machine can give a job now: Linux's MemAvailable (free memory and the caches it can drop),
    else the physical memory; None where the system says neither. Not the physical memory where it can say more:
    on the 25.3 GB Intel VM the system holds ~1.7 GB, and torch's 1B full fine-tune, predicted at 22.7 GB, was
    killed for memory at 21.7 GB resident with a probe beside it (issue 56)."""
    try:
        with open("/proc/meminfo") as meminfo:
            for line in meminfo:
                if line.startswith("MemAvailable:"):
                    return float(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    try:
        return float(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))
    except (ValueError, OSError, AttributeError):
        return None
