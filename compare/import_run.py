"""`dpcompare import-run PATH`: read a user's mlx_lm.lora or Trainer/trl run, print the recipe it makes with each
choice's source and what cannot be known, and write it as a file `--recipe` takes (common/imported/).

Nothing is written into the run's folder: the recipe goes to --out (default runs/recipes/TOOL-FOLDER.json under
the directory dpcompare was started in), and only after every check passed.
"""
from __future__ import annotations

import argparse
import dataclasses
from pathlib import Path

from common.config import RunConfig
from common.config_sources import coerce
from common.errors import UserError
from common.imported import ImportedRun, read_run, write_recipe


def add_parser(sub) -> None:
    p = sub.add_parser("import-run", help="read your own mlx_lm.lora or Trainer/trl run and write its recipe "
                                          "(docs/your-runs.md)")
    p.add_argument("path", help="an mlx_lm.lora adapter folder (adapter_config.json) or a Trainer/trl output folder "
                                "(trainer_state.json, peft's adapter_config.json)")
    p.add_argument("--log", help="mlx_lm.lora's console output saved to a file: its logged train losses")
    p.add_argument("--out", help="the recipe file to write (.json; default runs/recipes/TOOL-FOLDER.json)")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="a choice the run's files do not hold (grad_clip=0.3, global_batch_size=16, ...): said as "
                        "yours in the recipe's sources")
    p.set_defaults(handler=cmd_import_run, paths={})


def imported(path: str, log: str | None, sets: list[str], start_dir: Path) -> ImportedRun:
    run = read_run(start_dir / path, start_dir / log if log else None)
    fields = {f.name: f.type for f in dataclasses.fields(RunConfig)}
    for item in sets:
        key, sep, text = item.partition("=")
        if not sep or key not in fields:
            raise UserError(f"import-run --set {item!r}: give KEY=VALUE with KEY a config field (grad_clip, lr, ...)")
        run.set(key, coerce(key, text, fields[key]), "yours (import-run --set)")
    return run


def cmd_import_run(args: argparse.Namespace) -> int:
    run = imported(args.path, args.log, args.set, args.start_dir)
    out = Path(args.out) if args.out else Path("runs/recipes") / f"{run.tool}-{Path(run.path).name}.json"
    out = (args.start_dir / out).resolve()
    run_dir = Path(run.path).resolve()
    if out == run_dir or run_dir in out.parents:
        raise UserError(f"import-run: --out {out} lies inside the run's folder, which import-run never writes to")
    written = write_recipe(run, out)
    print("\n".join(run.describe()))
    print(f"wrote {written}: give it as --recipe {written} (flags override its choices)")
    return 0
