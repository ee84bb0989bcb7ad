"""The design card's rules: common/ and compare/ stay framework-free; the two backends mirror each other; the
import graph has no cycle and no upward import."""
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
# torch's the fixed byte count of DDP's buckets (fsdp.py reuses it); MLX's `wait_for` ends a phase in mx.eval
# (torch's Trainer.wait does it there). pp.py: torch hands torch.distributed.pipelining a stage module
# (`Stage`), times its backward with autograd marks (`BackwardMark`) and counts point-to-point sends in a
# dispatch mode (`SendCounter`, `NoCount`); MLX writes the schedule out and needs none of them. fsdp.py: MLX
# pads an uneven vocabulary itself and slices the pad logits off (`VocabShard`); FSDP2 pads inside; torch
# returns glibc's freed heap in the backward (`release_heap_in_backward`), where its peak comes; MLX evaluates
# the step as one lazy graph, with no hook inside its backward, and its fsdp meets the target without it
# (docs/benchmarks.md). load.py:
# MLX maps fsdp's wrapped paths to HF names (`hf_name`); torch reads a DTensor's shard (`local`) and places
# AdamW's moments as the parameters are (`filled_like`).
NAME_ONLY = {"comm.py": {"average_gradients"}, "ddp.py": {"sum_of_squares", "moments", "FixedCount", "wait_for"},
             "pp.py": {"Stage", "BackwardMark", "SendCounter", "NoCount"}, "fsdp.py": {"VocabShard", "release_heap_in_backward"},
             "load.py": {"hf_name", "local", "filled_like"}}


def test_mlx_impl_and_torch_impl_mirror_file_for_file_and_name_for_name():
    mlx_files = sorted(p.name for p in (ROOT / "mlx_impl").glob("*.py") if p.name not in FRAMEWORK_ONLY["mlx_impl"])
    torch_files = sorted(p.name for p in (ROOT / "torch_impl").glob("*.py")
                         if p.name not in FRAMEWORK_ONLY["torch_impl"])
    assert mlx_files == torch_files
    for name in ("step.py", "launch.py", "probe.py", "ddp.py", "fsdp.py", "pp.py", "comm.py", "trace.py", "load.py"):
        only = NAME_ONLY.get(name, set())
        assert public_names(ROOT / "mlx_impl" / name) - only == public_names(ROOT / "torch_impl" / name) - only, name
    # model.py: the same classes and functions (both RoPEs read common/model/rope.py's tables).
    assert public_names(ROOT / "mlx_impl" / "model.py") == public_names(ROOT / "torch_impl" / "model.py")


# ---- the import graph of the four packages: no cycle, nothing imported from a layer above --------------
PACKAGES = ("common", "mlx_impl", "torch_impl", "compare")
LAYER = {"common": 0, "mlx_impl": 1, "torch_impl": 1, "compare": 1}  # 1s import common only, not each other


def project_modules() -> dict[str, Path]:
    modules = {}
    for pkg in PACKAGES:
        for path in (ROOT / pkg).rglob("*.py"):
            parts = list(path.relative_to(ROOT).with_suffix("").parts)
            modules[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return modules


def import_graph() -> dict[str, set[str]]:
    """{module: the project modules it imports}, lazy imports inside functions included."""
    modules = project_modules()

    def known(name: str) -> str | None:
        while name and name not in modules:
            name = name.rpartition(".")[0]
        return name or None

    graph = {}
    for name, path in modules.items():
        package = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
        targets = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                targets |= {known(a.name) for a in node.names}
            elif isinstance(node, ast.ImportFrom):
                base = ".".join(package[:len(package) - node.level + 1] + [node.module or ""]).strip(".") \
                    if node.level else node.module or ""
                # `from pkg import module` names a module; `from module import name` names the module
                targets |= {known(f"{base}.{a.name}") if f"{base}.{a.name}" in modules else known(base)
                            for a in node.names}
        graph[name] = targets - {None, name}
    return graph


def test_the_import_graph_has_no_cycle_and_no_upward_import():
    graph = import_graph()
    upward = [f"{m} -> {t}" for m, targets in graph.items() for t in targets
              if t.split(".")[0] != m.split(".")[0] and LAYER[t.split(".")[0]] >= LAYER[m.split(".")[0]]]
    # compare's parts (launch/, report/, machine/) serve the commands at its top, never the other way round
    upward += [f"{m} -> {t}" for m, targets in graph.items() for t in targets
               if m.startswith("compare.") and m.count(".") == 2 and t.startswith("compare.") and t.count(".") == 1
               and t not in ("compare.launch", "compare.report", "compare.machine")]
    assert not upward, upward

    visiting, done, cycles = set(), set(), []

    def visit(module: str, path: list[str]) -> None:
        if module in visiting:
            cycles.append(path[path.index(module):] + [module])
            return
        if module in done:
            return
        visiting.add(module)
        for target in sorted(graph.get(module, ())):
            visit(target, path + [module])
        visiting.discard(module)
        done.add(module)

    for module in sorted(graph):
        visit(module, [])
    assert not cycles, cycles
