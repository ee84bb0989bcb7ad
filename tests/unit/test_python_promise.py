"""pyproject's requires-python is the promise pip checks before it installs dpcompare: it must hold for every
standard-library module the packages import (tomllib came in 3.11; the promise said 3.10, so Ubuntu 22.04's
Python installed dpcompare and then failed at its first config read), and for the Python that runs CI."""
import ast
import sys
import tomllib
from pathlib import Path

from helpers import ROOT

PACKAGES = ("common", "compare", "mlx_impl", "torch_impl")
# Standard-library modules newer than 3.10, with the version that brought them.
NEWER_STDLIB = {"tomllib": (3, 11), "wsgiref.types": (3, 12)}


def promised_floor() -> tuple[int, int]:
    text = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["requires-python"]
    assert text.startswith(">="), text
    major, minor = text[2:].split(".")[:2]
    return int(major), int(minor)


def imported_modules(path: Path) -> set[str]:
    tree = ast.parse(path.read_text())
    names = {alias.name for node in ast.walk(tree) if isinstance(node, ast.Import) for alias in node.names}
    return names | {node.module for node in ast.walk(tree) if isinstance(node, ast.ImportFrom) and node.module}


def test_requires_python_covers_every_stdlib_module_the_packages_import_and_this_python():
    floor = promised_floor()
    needed = {module: version for package in PACKAGES for path in (ROOT / package).rglob("*.py")
              for module in imported_modules(path) if (version := NEWER_STDLIB.get(module))}
    assert needed, "the check would pass vacuously: no module of NEWER_STDLIB is imported"
    too_new = {module: version for module, version in needed.items() if version > floor}
    assert not too_new, f"requires-python >={floor[0]}.{floor[1]} but the packages import {too_new}"
    assert sys.version_info[:2] >= floor
