"""`dpcompare import-run PATH`: a user's own training run read back as a recipe (docs/your-runs.md).

Two kinds of folder are read, never written: an `mlx_lm.lora` adapter folder (its adapter_config.json is the run's
`vars(args)`, with its console log if given: mlx_lm.py) and a transformers Trainer or trl SFTTrainer output folder
(trainer_state.json and peft's adapter_config.json; training_args.bin is a pickle and is never opened:
trainer.py). Each choice of the run is given with where it came from: the file and key, the tool's default, or an
assumption. What neither file records is listed as unknown. The result is written as a recipe file that
`--recipe PATH.json` takes (common/recipes.py), with the run's logged curve beside it, for `compare --recipe-from`.
Framework-free: JSON and text only.
"""
from __future__ import annotations

from pathlib import Path

from common.errors import UserError

from . import mlx_lm, trainer
from .run import Choice, ImportedRun, read_json, write_recipe

__all__ = ["Choice", "ImportedRun", "read_run", "write_recipe"]


def read_run(path: str | Path, log: str | Path | None = None) -> ImportedRun:
    """The run in `path` (a folder, or its adapter_config.json or trainer_state.json), or exit 2 in one line."""
    p = Path(path)
    if not p.exists():
        raise UserError(f"import-run: {p} does not exist; give an mlx_lm.lora adapter folder or a Trainer output "
                        "folder")
    if p.is_file():
        if p.name == "training_args.bin":
            raise UserError(trainer.PICKLE_ONLY.format(path=p.parent))
        if p.name not in ("adapter_config.json", "trainer_state.json"):
            raise UserError(f"import-run: {p} is neither an adapter_config.json nor a trainer_state.json; give the "
                            "run's folder")
        p = p.parent
    try:
        names = {q.name for q in p.iterdir()}
    except OSError as err:
        raise UserError(f"import-run: cannot read the folder {p} ({err.strerror})") from None
    config = read_json(p / "adapter_config.json") if "adapter_config.json" in names else None
    if config is not None and mlx_lm.is_mlx_lm(config):
        return mlx_lm.read(p, config, log)
    if trainer.find_state(p) is not None:
        return trainer.read(p, config, log)
    if "training_args.bin" in names:
        raise UserError(trainer.PICKLE_ONLY.format(path=p))
    raise UserError(f"import-run: {p} holds neither mlx_lm.lora's adapter_config.json (with lora_parameters and "
                    "fine_tune_type) nor a Trainer's trainer_state.json")
