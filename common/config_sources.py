"""Where a RunConfig's values come from, read and typed: a TOML file (read_toml, its paths resolved against the
file's own directory), an HF-format folder (--init-from: folder_spec, has_tokenizer, and the --preset it may
restate), and each TOML or flag value turned into its field's type (coerce). common/config.py's RunConfig is
built from these; this module imports nothing of it.
"""
from __future__ import annotations

import json
import tomllib
from pathlib import Path

from common.errors import UserError
from common.model.spec import ModelSpec, preset


def read_toml(path: str) -> dict:
    """The file's values, with its paths (common/paths.py CONFIG_PATHS) resolved against the file's own
    directory, as users of such files expect: `dataset = "data/train.txt"` sits beside the config."""
    from common.paths import resolve_config_paths

    try:
        with open(path, "rb") as f:
            values = tomllib.load(f)
    except FileNotFoundError:
        raise UserError(f"config file {path} not found") from None
    except tomllib.TOMLDecodeError as err:
        raise UserError(f"config file {path} is not valid TOML: {err}") from None
    except OSError as err:
        raise UserError(f"config file {path} cannot be read: {err.strerror}") from None
    return resolve_config_paths(values, Path(path).absolute().parent, f" in {path}")


def folder_spec(directory: str) -> ModelSpec:
    """The model spec of an HF-format folder's config.json (its weights are checked when loaded)."""
    path = Path(directory) / "config.json"
    if not path.is_file():
        raise UserError(f"--init-from {directory}: {path} not found: expected an HF-format Llama folder")
    try:
        from common.model.hfconfig import from_hf_config

        return from_hf_config(json.loads(path.read_text()))
    except json.JSONDecodeError as err:
        raise UserError(f"{path} is not valid JSON: {err}") from None


def has_tokenizer(directory: Path) -> bool:
    return (directory / "tokenizer.json").is_file() or (directory / "tokenizer_config.json").is_file()


def check_preset_matches_folder(preset_name: str, directory: str) -> None:
    """A --preset given with --init-from may only name the folder's architecture (any vocab size)."""
    named, folder = preset(preset_name), folder_spec(directory)
    for key, value in named.to_dict().items():
        if key != "vocab_size" and value != folder.to_dict()[key]:
            raise UserError(f"--preset {preset_name} contradicts {Path(directory) / 'config.json'}: model.{key} "
                            f"is {value!r} in the preset, {folder.to_dict()[key]!r} in the folder; drop --preset "
                            "(--init-from sets the model)")


def coerce(name: str, value, annotation: str):
    """TOML and CLI values into the field's type, with a message naming the field when impossible."""
    kind = annotation if isinstance(annotation, str) else getattr(annotation, "__name__", str(annotation))
    if kind == "dict":
        if not isinstance(value, dict):
            raise UserError(f"{name} must be a table of model fields")
        return value
    try:
        if kind == "bool":
            if isinstance(value, str):
                if value.lower() not in ("true", "false", "1", "0", "yes", "no"):
                    raise ValueError
                return value.lower() in ("true", "1", "yes")
            return bool(value)
        if kind == "int":
            if isinstance(value, float) and not value.is_integer():
                raise ValueError
            if isinstance(value, bool):
                raise ValueError
            return int(value)
        if kind == "float":
            if isinstance(value, bool):
                raise ValueError
            return float(value)
        return str(value)
    except (TypeError, ValueError):
        raise UserError(f"{name} must be {kind}, got {value!r}") from None
