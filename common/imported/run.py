"""The imported run: its choices with their sources, what is unknown, its logged curve; the recipe file it writes."""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

from common.errors import UserError
from common.recipes import CHOICES, recipe

FORMAT = "dpcompare-recipe/1"
RECIPE_FIELDS = (*CHOICES, "lora_rank")


@dataclass(frozen=True)
class Choice:
    field: str       # a RunConfig field
    value: object
    source: str      # "adapter_config.json lora_parameters.rank", "mlx-lm's default (...)", "assumed: ..."


@dataclass
class ImportedRun:
    tool: str                    # mlx-lm, trainer or trl
    base: str                    # the recipe whose values lie under the run's (common/recipes.py)
    framework: str               # where the run was made: mlx or torch
    path: str
    choices: list[Choice] = field(default_factory=list)
    unknown: list[str] = field(default_factory=list)
    logged_steps: list[int] = field(default_factory=list)   # the last step of each logged window
    logged_loss: list[float] = field(default_factory=list)  # the tool's mean train loss over that window
    log_window: int = 1                                      # steps per logged point
    log_source: str = ""
    needs: dict = field(default_factory=dict)                # what to pass along: init_from, dataset, in words
    model: str = ""                                          # the model the run names (a folder or a hub name)

    def set(self, name: str, value, source: str) -> None:
        self.choices = [c for c in self.choices if c.field != name] + [Choice(name, value, source)]

    def values(self) -> dict:
        """The recipe: every choice (common/recipes.py CHOICES and the rank), the run's over its tool's defaults."""
        return {**recipe(self.base).fields(), **{c.field: c.value for c in self.choices if c.field in RECIPE_FIELDS}}

    def shape(self) -> dict:
        """The run's other settings (steps, batch, sequence length, prompt mask, ...): flags, not recipe choices."""
        return {c.field: c.value for c in self.choices if c.field not in RECIPE_FIELDS}

    def sources(self) -> dict:
        under = recipe(self.base)
        known = {c.field: c.source for c in self.choices}
        return {k: known.get(k, f"{under.name} recipe (common/recipes.py): the tool's default, not in the run's files")
                for k in {**self.values(), **self.shape()}}

    def flags(self) -> list[str]:
        """The shape as `compare` flags."""
        out = []
        for k, v in self.shape().items():
            flag = "--" + k.replace("_", "-")
            out += ([flag] if v is True else []) if isinstance(v, bool) else [flag, str(v)]
        return out

    def to_json(self) -> dict:
        return {"format": FORMAT, "name": f"{self.tool}:{Path(self.path).name}", "tool": self.tool,
                "base": self.base, "framework": self.framework, "imported_from": self.path,
                "values": self.values(), "shape": self.shape(), "flags": self.flags(), "sources": self.sources(),
                "unknown": self.unknown,
                "needs": self.needs, "model": self.model,
                "logged": {"steps": self.logged_steps, "loss": self.logged_loss, "window": self.log_window,
                           "source": self.log_source}}

    def describe(self) -> list[str]:
        lines = [f"{self.path}: {self.tool}'s run (made on {self.framework}); each choice and where it came from:"]
        everything, sources = {**self.values(), **self.shape()}, self.sources()
        width = max(len(k) for k in everything)
        for k, v in everything.items():
            lines.append(f"  {k:<{width}}  {v!r:<28}  {sources[k]}")
        if self.logged_steps:
            lines.append(f"logged curve: {len(self.logged_steps)} points, steps {self.logged_steps[0]}.."
                         f"{self.logged_steps[-1]}, each the mean of {self.log_window} step(s) ({self.log_source})")
        lines += ["cannot be known from these files:"] + [f"  - {u}" for u in self.unknown]
        lines += [f"pass: {k} {v}" for k, v in self.needs.items()]
        lines.append(f"the run's shape, as flags (not part of the recipe): {' '.join(self.flags())}")
        return lines


def read_json(path: Path) -> dict:
    try:
        data = json.loads(path.read_text())
    except OSError as err:
        raise UserError(f"import-run: cannot read {path} ({err.strerror})") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise UserError(f"import-run: {path} is not JSON ({err})") from None
    if not isinstance(data, dict):
        raise UserError(f"import-run: {path} holds a JSON {type(data).__name__}, not an object")
    return data


def read_text(path: str | Path, what: str) -> str:
    try:
        return Path(path).read_text(errors="replace")
    except OSError as err:
        raise UserError(f"import-run: cannot read {what} {path} ({err.strerror})") from None


def local_folder(name: str, key: str) -> tuple[str | None, str]:
    """(the absolute folder, None) where `name` is a local folder, else (None, the line that says what to pass)."""
    p = Path(str(name)).expanduser()
    if name and p.is_dir() and (p / "config.json").exists():
        return str(p.resolve()), ""
    return None, (f"{key} {name!r} is not a local model folder here (nothing is downloaded): pass --init-from DIR, "
                  "the folder you trained from")


def check_runnable(run: ImportedRun) -> None:
    """Exit 2 now if the reconstructed choices cannot run in dpcompare (before anything is written)."""
    from common.config import RunConfig
    try:
        # the prompt mask waits for the --dataset given later (it needs instruction records)
        RunConfig.from_dict({**run.values(), **run.shape(), "recipe": run.base, "mask_prompt": False})
    except UserError as err:
        raise UserError(f"import-run: {run.path}: the run's choices cannot be reproduced here: {err}") from None


def write_recipe(run: ImportedRun, out: Path) -> Path:
    check_runnable(run)
    out = Path(out)
    if out.exists() and out.is_dir():
        raise UserError(f"import-run: --out {out} is a folder; give a file name ending in .json")
    if out.suffix != ".json":
        raise UserError(f"import-run: --out {out}: a recipe file's name ends in .json (what --recipe takes)")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(run.to_json(), indent=1) + "\n")
    return out


def from_json(path: Path) -> ImportedRun:
    """A recipe file `import-run` wrote, read back as the run it describes (its curve and sources with it)."""
    data = read_json(Path(path))
    if not str(data.get("format", "")).startswith("dpcompare-recipe/") or not isinstance(data.get("values"), dict):
        raise UserError(f"{path}: not a recipe file (`dpcompare import-run` writes them)")
    run = ImportedRun(str(data.get("tool")), str(data.get("base")), str(data.get("framework")),
                      str(data.get("imported_from", path)))
    sources = data.get("sources") or {}
    for k, v in {**data["values"], **(data.get("shape") or {})}.items():
        run.set(k, v, sources.get(k, f"{Path(path).name} {k}"))
    logged = data.get("logged") or {}
    run.logged_steps, run.logged_loss = list(logged.get("steps") or []), list(logged.get("loss") or [])
    run.log_window, run.log_source = int(logged.get("window") or 1), str(logged.get("source") or "")
    run.unknown, run.needs = list(data.get("unknown") or []), dict(data.get("needs") or {})
    run.model = str(data.get("model") or "")
    return run
