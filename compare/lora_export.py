"""A LoRA run's checkpoint for the tools its users run (`dpcompare export RUN --out DIR [--adapters mlx-lm|peft]`).

A LoRA checkpoint holds the adapters and their moments; the frozen base is the run's seed (or --init-from) file
(common/model/lora.py). So the export writes:
- without --adapters: the fused HF folder, every adapted weight W + scale * B A, the rest the base's;
- --adapters peft: DIR/adapter_model.safetensors (`base_model.model.<module>.lora_A.weight` (r, in), `lora_B.weight`
  (out, r)) and adapter_config.json, for `PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(DIR/base),
  DIR)`;
- --adapters mlx-lm: DIR/adapters.safetensors (`<module>.lora_a` (in, r), `lora_b` (r, out): the transposes) and
  adapter_config.json (`fine_tune_type`, `num_layers`, `lora_parameters`: rank, scale, dropout, keys), for
  `mlx_lm.generate --model DIR/base --adapter-path DIR`;
with the base beside the adapters as DIR/base, an HF folder with the run's tokenizer, so each command above works
from DIR alone. A quantized base (QLoRA, common/model/quantize.py) stays in MLX's layout for mlx-lm, and is
dequantized (float32 s * q + b, the values the run computed on) for peft and in the fused folder. Tensors are read and written one at a time.
"""
from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Callable

import numpy as np

from common.checkpoint.sharded import write_safetensors
from common.checkpoint.tensorsource import SafetensorsSource, TensorSource
from common.errors import UserError
from common.fsutil import atomic_write_text
from common.model.lora import TARGET_PATHS, Adapters
from common.model.quantize import DequantizedSource, Quantization
from common.runplan import RunPlan

ADAPTER_FORMATS = ("mlx-lm", "peft")


def adapters_of(run_dir: Path) -> tuple[RunPlan, Adapters | None]:
    plan = RunPlan.read(run_dir)
    trained = plan.config.trained
    return plan, trained if isinstance(trained, Adapters) else None


def fused_weights(plan: RunPlan, adapters: Adapters, ckpt: Path) -> tuple[dict[str, tuple], Callable[[str], np.ndarray]]:
    """(the HF folder's shapes, read(name)): the base's tensors, each adapted one with scale * B A added."""
    base = base_source(plan)
    lora = SafetensorsSource(ckpt / "model.safetensors")
    modules = set(adapters.modules(plan.spec))

    def read(name: str) -> np.ndarray:
        weight = base.read(name)
        module = name.removesuffix(".weight")
        if module in modules:
            a, b = lora.read(module + ".lora_A"), lora.read(module + ".lora_B")
            weight = (weight.astype(np.float64) + adapters.scale * (b.astype(np.float64) @ a)).astype(np.float32)
        return weight

    return {name: base.shape(name) for name in base.names()}, read


def write_fused(plan: RunPlan, adapters: Adapters, ckpt: Path, dest: Path) -> None:
    shapes, read = fused_weights(plan, adapters, ckpt)
    write_safetensors(dest, shapes, read, metadata={"format": "pt"})


def base_source(plan: RunPlan) -> TensorSource:
    """The frozen base as float32 HF tensors: the seed (or --init-from) file, dequantized where it is quantized."""
    base = SafetensorsSource(Path(plan.seed_checkpoint) / "model.safetensors")
    storage = plan.config.base_storage
    return DequantizedSource(base, storage, plan.spec) if isinstance(storage, Quantization) else base


def write_base(plan: RunPlan, dest: Path, kind: str) -> None:
    """The frozen base as the run read it, its seed (or --init-from) file copied; a quantized base stays quantized
    for mlx-lm (which reads MLX's layout), and is written dequantized for peft (transformers does not)."""
    if kind == "peft" and isinstance(plan.config.base_storage, Quantization):
        base = base_source(plan)
        write_safetensors(dest, {n: base.shape(n) for n in base.names()}, base.read, metadata={"format": "pt"})
    else:
        shutil.copy2(Path(plan.seed_checkpoint) / "model.safetensors", dest)


def base_config(plan: RunPlan, kind: str) -> dict:
    """What the base folder's config.json adds to the checkpoint's: mlx-lm's `quantization` for a quantized base."""
    storage = plan.config.base_storage
    if kind == "mlx-lm" and isinstance(storage, Quantization):
        return {"quantization": storage.describe(), "quantization_config": storage.describe()}
    return {}


def write_adapters(plan: RunPlan, adapters: Adapters, ckpt: Path, out: Path, kind: str) -> None:
    """The adapters in `kind`'s layout (module docstring), into `out`."""
    lora = SafetensorsSource(ckpt / "model.safetensors")
    modules = adapters.modules(plan.spec)
    if kind == "peft":
        names = {f"base_model.model.{m}.lora_{x}.weight": (f"{m}.lora_{x}", False) for m in modules for x in "AB"}
        config = {"peft_type": "LORA", "task_type": "CAUSAL_LM", "r": adapters.rank, "lora_alpha": adapters.alpha,
                  "target_modules": list(adapters.targets), "lora_dropout": 0.0, "bias": "none",
                  "fan_in_fan_out": False, "inference_mode": True, "init_lora_weights": True,
                  "layers_to_transform": list(adapters.blocks(plan.spec)) if adapters.layers else None,
                  "base_model_name_or_path": "base", "use_rslora": False, "modules_to_save": None}
        weights_file, config_file = "adapter_model.safetensors", "adapter_config.json"
    else:
        names = {f"{m}.lora_{x.lower()}": (f"{m}.lora_{x}", True) for m in modules for x in "AB"}
        config = {"fine_tune_type": "lora", "num_layers": len(adapters.blocks(plan.spec)),
                  "lora_parameters": {"rank": adapters.rank, "scale": adapters.scale, "dropout": 0.0,
                                      "keys": [TARGET_PATHS[t] for t in TARGET_PATHS if t in adapters.targets]}}
        weights_file, config_file = "adapters.safetensors", "adapter_config.json"

    def read(name: str) -> np.ndarray:
        source, transpose = names[name]
        value = lora.read(source)
        return np.ascontiguousarray(value.T) if transpose else value

    shapes = {name: tuple(reversed(lora.shape(src))) if t else lora.shape(src) for name, (src, t) in names.items()}
    write_safetensors(out / weights_file, shapes, read, metadata={"format": "pt"} if kind == "peft" else None)
    atomic_write_text(out / config_file, json.dumps(config, indent=2))


def check_kind(kind: str | None, adapters: Adapters | None, run_dir: Path) -> None:
    if kind is None:
        return
    if kind not in ADAPTER_FORMATS:
        raise UserError(f"--adapters {kind!r}: allowed: {', '.join(ADAPTER_FORMATS)}")
    if adapters is None:
        raise UserError(f"--adapters {kind}: {run_dir} trained every parameter, not LoRA adapters; export it "
                        "without --adapters")
