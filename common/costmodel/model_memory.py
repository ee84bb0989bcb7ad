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

Three phases, and the peak is the largest (`peak_at`). "backward": the parts above summed, as the frameworks'
factors were fitted (memory.py: the state, every gradient, the update's copies and the activations, two logits-sized
arrays among them), except torch's gradients under glibc's mmap threshold (HEAP_REUSED_BELOW_BYTES): autograd frees a
block's activations as it writes its gradients, and glibc's heap keeps the freed pages and hands them to the
gradients, while a gradient above the threshold is a new mapping on top. "update": the whole state, the reduction's
buffers and the update's copies, torch's AdamW's three temporaries of its largest tensor among them
(UPDATE_TEMPORARIES), new mappings once the backward's pages are freed. torch's 1B full fine-tune at x1 (1 GB
embedding, 67 MB block matrices) peaked at 24.08 GB on the Zen 5: the sum of every part said 22.66, the update 23.19.
"head", where the probe measured what the head holds (`w.head_held`): the step's start of the backward, where the
head and its cross-entropy hold their logits-sized buffers (counted in the activations) and the vocabulary
matrices' gradients (in the gradients) beside every block's activations and the state, and no other gradient
(MLX's are the step's graph; torch's where the reduction does not keep them, GRADIENTS_KEPT); under fsdp also the
reduction's copies of the head matrix's whole gradient (the layout's head_gathered_bytes). The sum
misses the head where the vocabulary outweighs the model: MLX's cross-entropy holds 4-6 logits-sized buffers at its
peak where the sum counts 2, and `small`'s (28M parameters, 206 MB logits at 1,024 tokens) peak RSS was predicted
15-26 % short (docs/plan-model.md).
"""
from __future__ import annotations

import math
import os

from common.costmodel.memory import (ACTIVATION_FACTOR, REDUCE_FACTOR, UPDATE_FACTOR, UPDATE_TEMPORARIES,
                                     WORKSPACE_BYTES, small_tensor_elements)
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
# Whether a rank's gradients outlive its step where its reduction keeps them (ddp at N > 1): torch's DDP zeroes its
# bucket views in place (torch_impl/ddp.py keeps_grads), so they are resident through the next step's head; MLX's
# are outputs of the step's graph, freed with it.
GRADIENTS_KEPT = {"mlx": False, "torch": True}
# What the head holds at its peak, in float32 logits of the micro-batch, where no probe measured it (`dpcompare run`'s
# warning): the probe's resident count on the Zen 5, 2.9-3.3 for `small` and `base` in both frameworks, 2.1 (torch)
# and 4.1 (MLX) for the 1B shape under LoRA (docs/plan-model.md); a warning errs towards warning, so the largest.
HEAD_LOGITS_UNPROBED = 4.1
PARTS = ("weights", "gradients", "optimizer", "activations", "gathered", "update", "reduce", "dequantize")


def model_memory(lay: Layout, w: Workload, trained: Trained = FullModel(), storage=None,
                 overhead_bytes: float | None = None) -> dict:
    """{part: bytes per rank (module docstring), "overhead", "total"} of workload `w` under layout `lay`, the parts
    those of the phase at the peak (peak_phase)."""
    return peak_phase(lay, w, trained, storage, overhead_bytes)[1]


def peak_phase(lay: Layout, w: Workload, trained: Trained = FullModel(), storage=None,
               overhead_bytes: float | None = None) -> tuple[str, dict]:
    """("backward", "update" or "head", model_memory's parts of that phase, the largest): the head phase only where
    the probe measured what the head holds (`w.head_held`)."""
    fw = w.framework if w.framework in WORKSPACE_BYTES else "torch"
    spec = w.spec
    lora = isinstance(trained, Adapters)
    total = sum(math.prod(s) for s in parameter_shapes(spec).values())
    local_share = lay.local_parameters(spec, fw) / total
    # the share of each part a rank holds (zero1, zero2: whole weights beside sharded moments; others all alike)
    held = {part: elements / total for part, elements in lay.state_elements(spec, fw).items()}
    weight_share, grad_share, moment_share = held["params"], held["grads"], held["optimizer"] / 2
    bits = getattr(storage, "bits", 32) if storage is not None else 32
    base = storage.base_bytes(spec) if bits < 32 else sum(math.prod(s) for s in parameter_shapes(spec).values()) * 4
    trained_elements = trained.trained_parameters(spec) * (1.0 if lora else local_share)
    state = trained_elements * MASTER_BYTES
    whole_state = trained.trained_parameters(spec) * MASTER_BYTES
    shapes = trained.state_shapes(spec)
    small_gradients = small_tensor_elements(shapes, fw) * MASTER_BYTES * (1.0 if lora else local_share)
    logits = lay.logits_bytes(w)
    blocks_act = lay.activation_bytes(w) - 2 * logits  # every block's saved tensors
    if isinstance(trained, Adapters):  # the blocks below the lowest adapted one keep nothing for a backward that never runs
        blocks_act *= len(trained.blocks(spec)) / spec.n_layers
    activations = blocks_act + 2 * logits
    largest = max((math.prod(s) for s in parameter_shapes(spec).values() if len(s) == 2), default=0)
    parts = {
        "weights": base * weight_share + (whole_state * weight_share if lora else 0.0),
        "gradients": whole_state * grad_share,
        "optimizer": 2 * whole_state * moment_share,
        "activations": activations * ACTIVATION_FACTOR[fw],
        "gathered": lay.gathered_bytes(w),
        "update": state * UPDATE_FACTOR[fw],
        "reduce": state * REDUCE_FACTOR[fw] if lay.copies_gradients_for_reduce else 0.0,
        "dequantize": DEQUANTIZE_COPIES[fw] * min(largest * 4, BLOCK_BYTES) if bits < 32 else 0.0,
    }
    overhead = FIXED_BYTES[fw] + WORKSPACE_BYTES[fw] if overhead_bytes is None else overhead_bytes
    overhead += JOB_FIXED_BYTES[fw] if lay.mesh.size > 1 else 0.0
    # the gradients under glibc's threshold are written into the pages the freed activations left
    # (memory.py HEAP_REUSED_BELOW_BYTES): counted once, as gradients, and the activations' part is what is left
    phases = {"backward": {**parts, "activations": parts["activations"] - min(small_gradients, parts["activations"])}}
    # the update: the whole state, the reduction's buffers, and AdamW's temporaries of the largest trained tensor
    largest_trained = max((math.prod(s) for s in shapes.values()), default=0) * MASTER_BYTES
    phases["update"] = {**parts, "activations": 0.0, "gathered": 0.0, "dequantize": 0.0,
                        "update": parts["update"] + UPDATE_TEMPORARIES[fw] * largest_trained}
    if w.head_held is not None:
        kept = GRADIENTS_KEPT[fw] and lay.copies_gradients_for_reduce
        head_logits, head_bytes = w.head_held
        phases["head"] = {**parts, "gradients": (state if kept else 0.0) + head_bytes, "update": 0.0, "reduce": 0.0,
                          "gathered": parts["gathered"] + lay.head_gathered_bytes(w),
                          "activations": blocks_act * ACTIVATION_FACTOR[fw] + head_logits * logits}
    totals = {name: {**held, "overhead": overhead, "total": sum(held.values()) + overhead} for name, held in phases.items()}
    peak = max(totals, key=lambda name: totals[name]["total"])  # the first of equals: the summed phase
    return peak, totals[peak]


def op_profile_bytes(lay: Layout, w: Workload, trained: Trained = FullModel()) -> float:
    """What a run of one rank holds beyond its step's peak while it times its op classes after training (`dpcompare
    run`'s default at N=1, common/train/opprofile.py): the update's workload keeps a constant gradient of every
    trained parameter beside the model (mlx_impl/opclasses.py, torch_impl/opclasses.py `_update`) through the
    reference steps. At least that: torch's 1B full fine-tune on the Intel Xeon VM trained its steps at about 21 GB
    and was killed for memory at 24.9 GB in its profiled steps (4.9 GB of gradients); 0 at N > 1, which profiles
    nothing."""
    if lay.mesh.size > 1:
        return 0.0
    return trained.trained_parameters(w.spec) * MASTER_BYTES


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
