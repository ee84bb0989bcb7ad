"""Recipes: each tool's complete set of training choices, one frozen object each (`--recipe NAME`).

dpcompare's MLX and torch Trainers share one careful recipe (its own, `dpcompare`). People who compare MLX with
PyTorch run `mlx_lm.lora` on one side and transformers' Trainer or trl's SFTTrainer with peft on the other, each
with its own defaults, so their curves part for reasons neither framework is to blame for. A recipe names those
defaults; every choice in it is a RunConfig field with a flag of its own, which overrides the recipe
(`--recipe mlx-lm --loss-normalization global-tokens`). Both frameworks implement every choice, each as one more
object behind an interface they already have (lr_schedule.py, normalization.py, model/lora.py, data/sequences.py,
the optimizer). Precedence: RunConfig defaults < recipe < TOML < flags.

Every value below is read from the tool's source at the versions this project pins or read (mlx-lm 0.32, mlx
0.32.4, peft 0.21.2, transformers 5.23, trl 1.16), the file and key beside it. docs/recipes.md has the table.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from common.errors import UserError

# The choices, in the order a chain between two recipes takes them (`compare --recipes A,B`, compare/chain.py):
# the data's choices first (which targets count, how rows are padded), then how the loss is normalized, then what
# trains, then the optimizer, its learning rate and schedule, and clipping. Interactions make the order matter, so
# it is fixed and stated in the report. Each is one RunConfig field.
CHOICES = ("data_order", "sequence", "mask_convention", "padding_rule", "loss_normalization", "lora_rank", "lora_scale_convention",
           "lora_alpha", "lora_targets", "lora_layers", "optimizer", "bias_correction", "lr", "beta1", "beta2",
           "adam_eps", "weight_decay", "lr_schedule", "warmup_steps", "min_lr_ratio", "grad_clip")

ALL_LINEARS = "q_proj,k_proj,v_proj,o_proj,gate_proj,up_proj,down_proj"


@dataclass(frozen=True)
class Recipe:
    name: str
    tool: str                                      # what it reproduces, in words
    values: dict = field(default_factory=dict)     # RunConfig field -> value; a field left out keeps its default

    def fields(self) -> dict:
        return dict(self.values)


DPCOMPARE = Recipe("dpcompare", "dpcompare's own defaults (common/config.py RunConfig)", {
    "data_order": "dpcompare",                     # one seeded stream, each rank a contiguous slice (data/sampler.py)
    "sequence": "packing",                         # plain text packed into full rows (records are one row each)
    "mask_convention": "exact",                    # every real target, nothing else
    "padding_rule": "seq-len",                     # every row padded to --seq-len
    "loss_normalization": "global-tokens",         # summed token losses / global count (normalization.py)
    "lora_scale_convention": "alpha-over-rank",    # peft's: scale = alpha / rank
    "lora_alpha": 0.0,                             # 0: 2 x rank, a scale of 2
    "lora_targets": "",                            # "": q_proj,v_proj
    "lora_layers": 0,                              # every block
    "optimizer": "adamw", "bias_correction": True, "lr": 3e-4, "beta1": 0.9, "beta2": 0.95, "adam_eps": 1e-8,
    "weight_decay": 0.1, "lr_schedule": "cosine", "warmup_steps": 10, "min_lr_ratio": 0.1, "grad_clip": 1.0,
})

MLX_LM = Recipe("mlx-lm", "mlx_lm.lora 0.32's defaults (LoRA, Adam), as `mlx_lm.lora --train` runs them", {
    "data_order": "mlx-lm",             # tuner/trainer.py iterate_batches: sorted by length, batches permuted
    "sequence": "padding",              # tuner/datasets.py TextDataset: one document a row, never packed
    "mask_convention": "mlx-lm",        # tuner/trainer.py default_loss: steps <= length keeps one pad target a row
    "padding_rule": "mlx-lm",           # tuner/trainer.py iterate_batches: pad_to = 32, 1 + 32 ceil(max / 32)
    "loss_normalization": "per-rank",   # tuner/trainer.py: each rank's ce.sum() / ntoks, then average_gradients
    "lora_rank": 8,                     # lora.py CONFIG_DEFAULTS lora_parameters.rank
    "lora_scale_convention": "direct",  # tuner/lora.py LoRALinear: y + scale * (x @ lora_a) @ lora_b
    "lora_alpha": 20.0,                 # lora.py CONFIG_DEFAULTS lora_parameters.scale (used as the scale)
    "lora_targets": ALL_LINEARS,        # tuner/utils.py linear_to_lora_layers: no keys -> every Linear (mlx-lm #515)
    "lora_layers": 16,                  # lora.py CONFIG_DEFAULTS num_layers (the last 16 blocks)
    "optimizer": "adam",                # lora.py CONFIG_DEFAULTS optimizer, optimizer_config.adam = {}
    "bias_correction": False,           # mlx/optimizers/optimizers.py Adam.__init__ bias_correction=False
    "lr": 1e-5,                         # lora.py CONFIG_DEFAULTS learning_rate
    "beta1": 0.9, "beta2": 0.999,       # mlx/optimizers/optimizers.py Adam.__init__ betas=[0.9, 0.999]
    "adam_eps": 1e-8,                   # ... eps=1e-8
    "weight_decay": 0.0,                # Adam has none
    "lr_schedule": "constant",          # lora.py CONFIG_DEFAULTS lr_schedule None: the bare learning rate
    "warmup_steps": 0,                  # tuner/utils.py build_schedule: warmup only when a schedule names one
    "grad_clip": 0.0,                   # tuner/trainer.py train: no clip_grad_norm in its step
})

PEFT = Recipe("peft", "peft's LoraConfig defaults under transformers' Trainer (DDP, torch AdamW)", {
    "data_order": "dpcompare",                 # a seeded shuffle (torch's RandomSampler stream is not reproduced)
    "sequence": "padding",                     # one example a row, padded by the collator
    "mask_convention": "exact",                # labels -100 on masked tokens, shifted once (LlamaForCausalLM loss)
    "padding_rule": "longest",                 # data/data_collator.py DataCollatorWithPadding: padding=True
    "loss_normalization": "global-tokens",     # training_args.py average_tokens_across_devices=True
                                               # (num_items_in_batch summed over ranks)
    "lora_rank": 8,                            # peft tuners/lora/config.py LoraConfig.r = 8
    "lora_scale_convention": "alpha-over-rank",  # peft tuners/lora/layer.py scaling = lora_alpha / r
    "lora_alpha": 8.0,                         # LoraConfig.lora_alpha = 8
    "lora_targets": "q_proj,v_proj",           # peft utils/constants.py TRANSFORMERS_MODELS_TO_LORA_TARGET_MODULES_
                                               # MAPPING["llama"]
    "lora_layers": 0,                          # LoraConfig.layers_to_transform None: every block
    "optimizer": "adamw",                      # training_args.py optim adamw_torch (adamw_torch_fused: same math)
    "bias_correction": True,                   # torch.optim.AdamW always corrects
    "lr": 5e-5,                                # training_args.py learning_rate
    "beta1": 0.9, "beta2": 0.999,              # training_args.py adam_beta1, adam_beta2
    "adam_eps": 1e-8,                          # training_args.py adam_epsilon
    "weight_decay": 0.0,                       # training_args.py weight_decay
    "lr_schedule": "linear",                   # training_args.py lr_scheduler_type "linear" (optimization.py
                                               # _get_linear_schedule_with_warmup_lr_lambda)
    "warmup_steps": 0,                         # training_args.py warmup_steps 0, warmup_ratio None
    "grad_clip": 1.0,                          # training_args.py max_grad_norm
})

# trl's SFTTrainer takes the same peft_config and the TrainingArguments it extends; sft_config.py overrides only
# what is named here. completion_only_loss None masks the prompt of prompt/completion records: --mask-prompt.
TRL = Recipe("trl", "trl 1.16's SFTTrainer + SFTConfig defaults with peft's LoraConfig defaults", {
    **PEFT.values,
    "lr": 2e-5,                                # trl/trainer/sft_config.py SFTConfig.learning_rate
    "padding_rule": "longest",                 # sft_config.py pad_to_multiple_of "auto" -> None: the longest row
    "sequence": "padding",                     # sft_config.py SFTConfig.packing = False
})

RECIPES = {r.name: r for r in (DPCOMPARE, MLX_LM, PEFT, TRL)}


def recipe(name: str) -> Recipe:
    if str(name).endswith(".json"):
        return recipe_file(name)
    if name not in RECIPES:
        raise UserError(f"unknown recipe {name!r}; allowed: {', '.join(RECIPES)}, or a recipe file (.json) that "
                        "`dpcompare import-run` wrote")
    return RECIPES[name]


def recipe_file(path: str) -> Recipe:
    """A recipe file written by `dpcompare import-run` (common/imported/): its `values` are RunConfig fields, every
    choice of the imported run over the recipe it started from; the file also keeps each value's source."""
    import json
    from pathlib import Path
    try:
        data = json.loads(Path(path).read_text())
    except OSError as err:
        raise UserError(f"--recipe {path}: cannot read it ({err.strerror})") from None
    except json.JSONDecodeError as err:
        raise UserError(f"--recipe {path}: not JSON ({err})") from None
    if not isinstance(data, dict) or not str(data.get("format", "")).startswith("dpcompare-recipe/") \
            or not isinstance(data.get("values"), dict):
        raise UserError(f"--recipe {path}: not a recipe file (`dpcompare import-run` writes them)")
    # known by its path from now on, as the built-in ones by name (config_checks.py checks the recipe is known)
    RECIPES[str(path)] = Recipe(str(path), str(data.get("tool", "imported")), dict(data["values"]))
    return RECIPES[str(path)]


def with_recipe(values: dict) -> dict:
    """A config's values with its recipe's under them: `values` (TOML and flags) override the recipe."""
    return {**recipe(values.get("recipe") or DPCOMPARE.name).fields(), **values}
