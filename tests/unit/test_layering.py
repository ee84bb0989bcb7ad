"""The design card's rules: common/ and compare/ stay framework-free; the two backends mirror each other."""
import ast
import subprocess
import sys
from pathlib import Path

from helpers import ROOT, SHARED_DATA

FRAMEWORKS = {"mlx", "torch"}


def imported_modules(path: Path) -> set[str]:
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names |= {alias.name.split(".")[0] for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module.split(".")[0])
    return names


def test_common_and_compare_import_neither_framework():
    offenders = [f"{p.relative_to(ROOT)} imports {sorted(imported_modules(p) & FRAMEWORKS)}"
                 for pkg in ("common", "compare") for p in sorted((ROOT / pkg).rglob("*.py"))
                 if imported_modules(p) & FRAMEWORKS]
    assert not offenders, offenders


def test_preparing_a_run_loads_no_framework_even_indirectly(tmp_path):
    tokenizer = SHARED_DATA / "gpt2" if (SHARED_DATA / "gpt2").exists() else "builtin"
    code = (
        "import sys; from common.config import RunConfig; from compare.launch.runner import prepare_inputs;"
        f"cfg = RunConfig.from_dict({{'tokenizer': {str(tokenizer)!r}, 'cache_dir': {str(tmp_path)!r},"
        "'builtin_corpus_bytes': 200000, 'quiet': True});"
        "prepare_inputs(cfg); import compare.cli, compare.report.writer, compare.matrix;"
        "print(sorted(m for m in ('torch', 'mlx', 'transformers') if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


def public_names(path: Path) -> set[str]:
    tree = ast.parse(path.read_text())
    return {n.name for n in tree.body if isinstance(n, (ast.FunctionDef, ast.ClassDef)) and not n.name.startswith("_")}


# Files with no counterpart in the other framework, and why (each file's docstring says more).
FRAMEWORK_ONLY = {"mlx_impl": set(), "torch_impl": set()}
# Public names with no counterpart: torch averages gradients inside DDP, MLX in mlx_impl/comm.py; MLX's
# ddp.py holds the helpers its fsdp.py and tp.py share on gradient trees and the flat optimizer state,
# torch's the fixed byte count of DDP's buckets (fsdp.py reuses it).
NAME_ONLY = {"comm.py": {"average_gradients"}, "ddp.py": {"sum_of_squares", "moments", "FixedCount"}}


def test_mlx_impl_and_torch_impl_mirror_file_for_file_and_name_for_name():
    mlx_files = sorted(p.name for p in (ROOT / "mlx_impl").glob("*.py") if p.name not in FRAMEWORK_ONLY["mlx_impl"])
    torch_files = sorted(p.name for p in (ROOT / "torch_impl").glob("*.py")
                         if p.name not in FRAMEWORK_ONLY["torch_impl"])
    assert mlx_files == torch_files
    for name in ("step.py", "launch.py", "fabric.py", "ddp.py", "fsdp.py", "comm.py", "trace.py"):
        only = NAME_ONLY.get(name, set())
        assert public_names(ROOT / "mlx_impl" / name) - only == public_names(ROOT / "torch_impl" / name) - only, name
    # model.py: the same classes and functions, except torch's own RoPE table (MLX has nn.RoPE).
    assert public_names(ROOT / "mlx_impl" / "model.py") == public_names(ROOT / "torch_impl" / "model.py") - {"RoPE"}
