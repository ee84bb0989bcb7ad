"""A transformers Trainer (or trl SFTTrainer) output folder read back: trainer_state.json and peft's
adapter_config.json. training_args.bin is a pickle (torch.save of TrainingArguments) and is never opened, so what
only it holds (the optimizer, betas, eps, weight decay, max_grad_norm, the ranks) is the Trainer's default, said
so, or given with `--set`; the learning rate and its schedule are read off log_history's learning_rate.

trainer_state.json (transformers/trainer_callback.py TrainerState): log_history (one entry per logging step: loss,
grad_norm, learning_rate, epoch, step), max_steps, logging_steps, train_batch_size (per device). The folder's own
file is written by `trainer.save_state()`; each checkpoint-N/ has one, and the latest is taken where the folder has
none. peft's adapter_config.json (peft/tuners/lora/config.py LoraConfig): r, lora_alpha, target_modules,
lora_dropout, bias, use_rslora, use_dora, layers_to_transform, modules_to_save.
"""
from __future__ import annotations

import re
from pathlib import Path

from common.errors import UserError
from common.recipes import ALL_LINEARS
from common.train.lr_schedule import SCHEDULES

from .run import ImportedRun, local_folder, read_json

STATE = "trainer_state.json"
PICKLE_ONLY = ("import-run: {path} holds training_args.bin alone, a pickle that dpcompare never unpickles; give the "
               "Trainer's output folder with trainer_state.json (trainer.save_state(), or a checkpoint-N/ folder)")
TRAINER_DEFAULT = "the Trainer's default (training_args.py {key}), assumed: training_args.bin is not read"
LINEARS = ALL_LINEARS.split(",")


def find_state(folder: Path) -> Path | None:
    if (folder / STATE).is_file():
        return folder / STATE
    checkpoints = [p for p in folder.glob("checkpoint-*") if re.fullmatch(r"checkpoint-\d+", p.name)
                   and (p / STATE).is_file()]
    return max(checkpoints, key=lambda p: int(p.name.split("-")[1])) / STATE if checkpoints else None


def read(folder: Path, config: dict | None, log) -> ImportedRun:
    state_path = find_state(folder)
    assert state_path is not None
    state = read_json(state_path)
    if log is not None:
        raise UserError("import-run: --log is for mlx_lm.lora's console output; a Trainer's curve is read from "
                        f"{STATE} log_history")
    if not isinstance(state.get("log_history"), list) or "max_steps" not in state:
        raise UserError(f"import-run: {state_path} has no log_history list or max_steps: not a Trainer's {STATE}")
    if config is None and (state_path.parent / "adapter_config.json").is_file():
        config = read_json(state_path.parent / "adapter_config.json")
    trl = _is_trl(folder)
    run = ImportedRun("trl" if trl else "trainer", "trl" if trl else "peft", "torch", str(folder))
    sname = state_path.relative_to(folder)
    _lora(run, config, folder)
    history = state["log_history"]
    points = [(int(e["step"]), float(e["loss"])) for e in history if "loss" in e and "step" in e]
    run.logged_steps, run.logged_loss = [s for s, _ in points], [v for _, v in points]
    run.log_window = int(state.get("logging_steps") or 1)
    run.log_source = f"{sname} log_history loss: the Trainer's mean over each logging_steps window"
    steps = int(state["max_steps"])
    run.set("steps", steps, f"{sname} max_steps")
    per_device = state.get("train_batch_size")
    if per_device:
        run.set("global_batch_size", int(per_device), f"{sname} train_batch_size (per device) x 1 rank, assumed")
    _schedule(run, [(int(e["step"]), float(e["learning_rate"])) for e in history
                    if "learning_rate" in e and "step" in e], steps, sname)
    for name, key in (("optimizer", "optim adamw_torch"), ("beta1", "adam_beta1"), ("beta2", "adam_beta2"),
                      ("adam_eps", "adam_epsilon"), ("weight_decay", "weight_decay"), ("grad_clip", "max_grad_norm"),
                      ("bias_correction", "optim adamw_torch")):
        run.set(name, {"optimizer": "adamw", "beta1": 0.9, "beta2": 0.999, "adam_eps": 1e-8, "weight_decay": 0.0,
                       "grad_clip": 1.0, "bias_correction": True}[name], TRAINER_DEFAULT.format(key=key))
    run.unknown += [
        "the number of ranks and gradient accumulation (training_args.bin): 1 rank, no accumulation assumed; "
        "give --set global_batch_size=... if the run had more",
        "max_grad_norm, the optimizer, betas, eps and weight decay (training_args.bin): the Trainer's defaults, "
        "assumed; give --set grad_clip=... etc. where yours differed",
        "the sequence length, the dataset and whether the prompt was masked: pass --seq-len, --dataset and "
        "--mask-prompt as your run had them",
        "the data order (torch's RandomSampler) and the adapters' initial values: the reproduction uses "
        "dpcompare's, so the curves are judged on a tolerance"]
    return run


def _is_trl(folder: Path) -> bool:
    card = folder / "README.md"
    try:
        return card.is_file() and re.search(r"^\s*-\s*(trl|sft)\s*$", card.read_text(errors="replace"), re.M) is not None
    except OSError:
        return False


def _lora(run: ImportedRun, config: dict | None, folder: Path) -> None:
    if config is None:
        raise UserError(f"import-run: {folder} has no peft adapter_config.json: full fine-tuning runs are not "
                        "imported yet (dpcompare's full training is the dpcompare recipe)")
    cfg = "adapter_config.json"
    if str(config.get("peft_type", "")).upper() != "LORA":
        raise UserError(f"import-run: {folder / cfg} peft_type = {config.get('peft_type')!r}: only LoRA is imported")
    refusals = {"use_dora": "DoRA", "modules_to_save": "modules trained whole beside the adapters",
                "rank_pattern": "per-module ranks", "alpha_pattern": "per-module alphas",
                "target_parameters": "adapters on parameters", "use_qalora": "QA-LoRA"}
    for key, what in refusals.items():
        if config.get(key):
            raise UserError(f"import-run: {folder / cfg} {key} = {config[key]!r}: {what}, which no dpcompare "
                            "strategy can take")
    if float(config.get("lora_dropout") or 0.0):
        raise UserError(f"import-run: {folder / cfg} lora_dropout = {config['lora_dropout']}: dpcompare trains LoRA "
                        "without dropout")
    if str(config.get("bias", "none")) != "none":
        raise UserError(f"import-run: {folder / cfg} bias = {config['bias']!r}: dpcompare trains no biases")
    r, alpha = int(config.get("r", 8)), float(config.get("lora_alpha", 8))
    run.set("lora_rank", r, f"{cfg} r")
    if config.get("use_rslora"):
        run.set("lora_scale_convention", "direct", f"{cfg} use_rslora: scale = lora_alpha / sqrt(r)")
        run.set("lora_alpha", alpha / r ** 0.5, f"{cfg} lora_alpha / sqrt(r)")
    else:
        run.set("lora_scale_convention", "alpha-over-rank", "peft's LoraLayer: scaling = lora_alpha / r")
        run.set("lora_alpha", alpha, f"{cfg} lora_alpha")
    targets = config.get("target_modules")
    if targets == "all-linear":
        run.set("lora_targets", ALL_LINEARS, f"{cfg} target_modules all-linear")
    elif targets:
        names = sorted(targets) if isinstance(targets, list) else [targets]
        odd = [n for n in names if n not in LINEARS]
        if odd:
            raise UserError(f"import-run: {folder / cfg} target_modules {odd}: dpcompare adapts the Llama linears "
                            f"only ({ALL_LINEARS})")
        run.set("lora_targets", ",".join(n for n in LINEARS if n in names), f"{cfg} target_modules")
    layers = config.get("layers_to_transform")
    if layers is not None:
        run.unknown.append(f"{cfg} layers_to_transform {layers}: dpcompare adapts the last K blocks; the list "
                           "must be the last ones, which needs the model's depth (checked when it runs)")
        count = len(layers) if isinstance(layers, list) else 1
        run.set("lora_layers", count, f"{cfg} layers_to_transform (taken as the last {count})")
    base = run.model = str(config.get("base_model_name_or_path") or "")
    path, line = local_folder(base, f"{cfg} base_model_name_or_path")
    run.needs["--init-from"] = path or line


def _schedule(run: ImportedRun, points: list[tuple[int, float]], steps: int, sname) -> None:
    """The schedule (kind, peak lr, warm-up) whose values at the logged steps are the logged learning rates.

    transformers 5.23 logs at step s (1-based) the rate update s used, lr_lambda(s - 1) (measured: warm-up 2 logs
    0, lr / 2, lr at steps 1, 2, 3), which is common/train/lr_schedule.py's 0-based step s - 1."""
    if not points:
        run.unknown.append(f"the learning rate and its schedule: {sname} logs no learning_rate; the Trainer's "
                           "defaults assumed (5e-5, linear, no warm-up)")
        return
    for name in ("constant", "linear", "cosine"):
        for warmup in range(0, steps + 1):
            if name == "cosine" and warmup:
                break  # transformers' cosine warm-up is not dpcompare's
            factors = [(SCHEDULES[name].lr(s - 1, 1.0, warmup, steps, 0.0), lr) for s, lr in points]
            peak = [lr / f for f, lr in factors if f > 1e-12]
            if not peak:
                continue
            lr = max(peak)
            if all(abs(f * lr - v) <= 1e-6 * lr + 1e-12 for f, v in factors):
                how = f"fitted to {sname} log_history learning_rate ({len(points)} points)"
                run.set("lr", float(f"{lr:.6g}"), how)
                run.set("lr_schedule", name, how)
                run.set("warmup_steps", warmup, how)
                if name == "cosine":
                    run.set("min_lr_ratio", 0.0, how + ": cosine to 0")
                return
    raise UserError(f"import-run: the learning rates in {sname} log_history fit no schedule dpcompare has "
                    "(constant, linear or cosine, with a linear warm-up)")
