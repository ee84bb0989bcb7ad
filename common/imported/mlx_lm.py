"""An `mlx_lm.lora` adapter folder read back: adapter_config.json and, if given, the console log.

mlx_lm/lora.py (0.32.2) `train_model` writes `save_config(vars(args), adapter_path / "adapter_config.json")`: every
argument after its CONFIG_DEFAULTS and any YAML `-c` config were merged in, keys sorted. So every key below is
there in a real file; a key missing means an older or hand-made file, and the tool's default (CONFIG_DEFAULTS) is
taken and said. The console prints one line per `steps_per_report` iterations (mlx_lm/cli_ui.py
`TrainUI.report_train`: iteration, mean train loss since the last report, tok/s, trained tokens); mlx-lm before
0.30 printed "Iter N: Train loss X, ..." (both read).
"""
from __future__ import annotations

import re
from pathlib import Path
from typing import Any

from common.errors import UserError
from common.recipes import ALL_LINEARS

from .run import ImportedRun, local_folder, read_text

CFG = "adapter_config.json"
# mlx_lm/lora.py CONFIG_DEFAULTS, the values a missing key takes.
DEFAULTS: dict[str, Any] = {"fine_tune_type": "lora", "optimizer": "adam", "num_layers": 16, "batch_size": 4, "iters": 1000,
            "learning_rate": 1e-5, "steps_per_report": 10, "max_seq_length": 2048, "grad_accumulation_steps": 1,
            "lr_schedule": None, "lora_parameters": {"rank": 8, "dropout": 0.0, "scale": 20.0},
            "mask_prompt": False, "seed": 0}
LINEARS = ALL_LINEARS.split(",")
# mlx/optimizers/optimizers.py Adam.__init__ / AdamW.__init__ defaults.
OPTIMIZER_DEFAULTS = {"adam": {"betas": [0.9, 0.999], "eps": 1e-8, "bias_correction": False, "weight_decay": 0.0},
                      "adamw": {"betas": [0.9, 0.999], "eps": 1e-8, "bias_correction": False, "weight_decay": 0.01}}
ANSI = re.compile(r"\x1b\[[0-9;]*[A-Za-z]")
NEW_LINE = re.compile(r"^\s*(\d+)\s+(-?[0-9.]+(?:e[-+]?\d+)?|nan|inf)\s*[\u25bc\u25b2]")     # "  12    2.345 ▼  ..."
OLD_LINE = re.compile(r"Iter (\d+): Train loss (-?[0-9.]+(?:e[-+]?\d+)?|nan|inf)")


def is_mlx_lm(config: dict) -> bool:
    return "lora_parameters" in config or "fine_tune_type" in config


def read(folder: Path, config: dict, log: str | Path | None) -> ImportedRun:
    run = ImportedRun("mlx-lm", "mlx-lm", "mlx", str(folder))

    def get(key):
        if key in config:
            return config[key], f"{CFG} {key}"
        return DEFAULTS[key], f"mlx-lm's default (lora.py CONFIG_DEFAULTS {key}; not in {CFG})"

    kind, src = get("fine_tune_type")
    if kind != "lora":
        why = ("DoRA (magnitude vectors on the adapted weights) has no strategy in dpcompare" if kind == "dora" else
               "mlx-lm's full fine-tuning trains only the last num_layers blocks, which no strategy here does"
               if kind == "full" else f"unknown fine_tune_type {kind!r}")
        raise UserError(f"import-run: {folder / CFG} fine_tune_type = {kind!r}: {why}; LoRA runs are imported")
    params, psrc = get("lora_parameters")
    params = {**DEFAULTS["lora_parameters"], **(params or {})}
    psrc = f"{CFG} lora_parameters" if "lora_parameters" in config else psrc
    if float(params.get("dropout") or 0.0):
        raise UserError(f"import-run: {folder / CFG} lora_parameters.dropout = {params['dropout']}: dpcompare "
                        "trains LoRA without dropout (0 in every tool's default)")
    run.set("lora_rank", int(params["rank"]), f"{psrc}.rank")
    run.set("lora_scale_convention", "direct", "mlx-lm's LoRALinear: y + scale * (x @ lora_a) @ lora_b")
    run.set("lora_alpha", float(params["scale"]), f"{psrc}.scale (the scale itself)")
    keys = params.get("keys")
    if keys:
        names = [str(k).rsplit(".", 1)[-1] for k in keys]
        odd = [k for k, n in zip(keys, names) if n not in LINEARS]
        if odd:
            raise UserError(f"import-run: {folder / CFG} lora_parameters.keys {odd}: dpcompare adapts the Llama "
                            f"linears only ({ALL_LINEARS})")
        run.set("lora_targets", ",".join(n for n in LINEARS if n in names), f"{psrc}.keys")
    else:
        run.set("lora_targets", ALL_LINEARS, "mlx-lm's default: no keys = every Linear (tuner/utils.py)")
    layers, src = get("num_layers")
    run.set("lora_layers", 0 if int(layers) == -1 else int(layers), src + (" (-1: every block)" if layers == -1 else ""))

    _optimizer(run, config, get, folder)
    _schedule(run, config, get, folder)
    batch, src = get("batch_size")
    run.set("global_batch_size", int(batch), src + " (the whole batch: each rank takes batch_size / N)")
    accum, src = get("grad_accumulation_steps")
    if int(accum) != 1:
        run.set("grad_accum", int(accum), src)
        run.set("global_batch_size", int(batch) * int(accum), f"{CFG} batch_size x grad_accumulation_steps")
    iters, src = get("iters")  # iterations are micro-batches: an update every grad_accumulation_steps (trainer.py)
    accum = int(accum)
    run.set("steps", int(iters) // accum, src + (f" / grad_accumulation_steps {accum}" if accum > 1 else ""))
    length, src = get("max_seq_length")
    run.set("seq_len", int(length) - 1, src + " minus 1 (a row's targets)")
    mask, src = get("mask_prompt")
    run.set("mask_prompt", bool(mask), src)
    if config.get("grad_checkpoint"):
        run.unknown.append("grad_checkpoint true: recomputes activations, the same numbers; dpcompare does not")
    run.unknown += [
        "the number of ranks: mlx_lm.lora does not record it; --nproc 1 is assumed (per-rank normalization makes "
        "N matter)",
        f"the adapters' initial values (seed {config.get('seed', 0)} in mlx.random): the reproduction starts from "
        "dpcompare's seed, so the curves are judged on a tolerance",
        "the data order past the first epoch, and the rendering of the records by the tokenizer's chat template "
        "(docs/recipes.md)"]
    model = run.model = str(config.get("model", ""))
    folder_path, line = local_folder(model, f"{CFG} model")
    run.needs["--init-from"] = folder_path or line
    data = Path(str(config.get("data", "")))
    run.needs["--dataset"] = str((data / "train.jsonl").resolve()) if (data / "train.jsonl").exists() else (
        f"{CFG} data {str(data)!r} is not a local folder with train.jsonl here: pass --dataset FILE")
    report, _ = get("steps_per_report")
    run.log_window = max(1, int(report) // accum)
    if log is not None:
        steps, losses = parse_log(read_text(log, "the log"), str(log))
        kept = [(it // accum, v) for it, v in zip(steps, losses) if it % accum == 0]  # at an update
        run.logged_steps, run.logged_loss = [s for s, _ in kept], [v for _, v in kept]
        run.log_source = f"{Path(log).name}: mlx_lm.lora's report lines, every {report} iterations"
    else:
        run.unknown.append("the logged curve: mlx_lm.lora keeps it in its console output only; pass --log FILE")
    return run


def _optimizer(run: ImportedRun, config: dict, get, folder: Path) -> None:
    name, src = get("optimizer")
    name = str(name).lower()
    if name not in OPTIMIZER_DEFAULTS:
        raise UserError(f"import-run: {folder / CFG} optimizer = {name!r}: dpcompare has adam and adamw only")
    given = (config.get("optimizer_config") or {}).get(name) or {}
    unknown_keys = set(given) - set(OPTIMIZER_DEFAULTS[name])
    if unknown_keys:
        raise UserError(f"import-run: {folder / CFG} optimizer_config.{name} sets {sorted(unknown_keys)}, which "
                        "dpcompare's optimizers do not take")
    run.set("optimizer", name, src)
    for key, value in OPTIMIZER_DEFAULTS[name].items():
        where = (f"{CFG} optimizer_config.{name}.{key}" if key in given else
                 f"mlx's default (mlx/optimizers/optimizers.py {'AdamW' if name == 'adamw' else 'Adam'} {key})")
        value = given.get(key, value)
        if key == "betas":
            run.set("beta1", float(value[0]), where + "[0]")
            run.set("beta2", float(value[1]), where + "[1]")
        else:
            run.set({"eps": "adam_eps"}.get(key, key), value if key == "bias_correction" else float(value), where)
    run.set("grad_clip", 0.0, "mlx-lm's trainer: no clipping in train()")


def _schedule(run: ImportedRun, config: dict, get, folder: Path) -> None:
    lr, src = get("learning_rate")
    schedule, ssrc = get("lr_schedule")
    if not schedule:
        run.set("lr", float(lr), src)
        run.set("lr_schedule", "constant", ssrc + ": none, the bare learning rate")
        run.set("warmup_steps", 0, ssrc + ": none")
        return
    name, args = schedule.get("name"), list(schedule.get("arguments") or [])
    where = f"{CFG} lr_schedule"
    if name == "cosine_decay" and len(args) in (2, 3):
        init, decay, end = float(args[0]), int(args[1]), float(args[2]) if len(args) == 3 else 0.0
        run.set("lr", init, f"{where}.arguments[0] (the schedule's, not learning_rate)")
        run.set("lr_schedule", "cosine", f"{where}.name cosine_decay")
        run.set("lr_decay_steps", decay, f"{where}.arguments[1]")
        run.set("min_lr_ratio", end / init if init else 0.0, f"{where}.arguments[2] / arguments[0]")
    elif name == "linear_schedule" and len(args) == 3 and float(args[1]) == 0.0:
        run.set("lr", float(args[0]), f"{where}.arguments[0]")
        run.set("lr_schedule", "linear", f"{where}.name linear_schedule to 0")
        run.set("lr_decay_steps", int(args[2]), f"{where}.arguments[2]")
    else:
        raise UserError(f"import-run: {folder / CFG} lr_schedule {name!r} {args}: dpcompare has cosine_decay and "
                        "linear_schedule to 0 (lr_schedule.py)")
    warmup = int(schedule.get("warmup", 0) or 0)
    run.set("warmup_steps", warmup, f"{where}.warmup" if "warmup" in schedule else f"{where}: no warmup key")
    if warmup:
        run.unknown.append(f"warm-up shape: mlx-lm warms from warmup_init to lr over {warmup} steps, then starts "
                           "the decay at its step 0; dpcompare's cosine warms from lr / (warmup + 1): close, not equal")


def parse_log(text: str, name: str) -> tuple[list[int], list[float]]:
    """([iteration], [train loss]) of mlx_lm.lora's report lines (colours stripped); exit 2 if there is none."""
    steps, losses = [], []
    for line in ANSI.sub("", text).splitlines():
        match = NEW_LINE.match(line) or OLD_LINE.search(line)
        if match:
            steps.append(int(match.group(1)))
            losses.append(float(match.group(2)))
    if not steps:
        raise UserError(f"import-run: {name} has no mlx_lm.lora report line (\"  ITER  LOSS ▼ ...\" or \"Iter N: "
                        "Train loss X\"); give the console output of mlx_lm.lora --train")
    return steps, losses
