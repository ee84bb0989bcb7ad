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


# ---- the two backends mirror each other: the same files, public names, class members and method parameters ------
def public_names(path: Path) -> set[str]:
    tree = ast.parse(path.read_text())
    return {n.name for n in tree.body if isinstance(n, (ast.FunctionDef, ast.ClassDef)) and not n.name.startswith("_")}


def class_members(path: Path) -> dict[str, dict[str, tuple[str, ...] | None]]:
    """{public class: {member: its parameter names (a method), or None (an attribute)}}. The members are the
    public methods, properties (attributes to a caller) and class attributes with a value, and __init__ (the
    constructor's shape is part of the mirror); bare annotations are declarations for the type checker."""
    classes = {}
    for node in ast.parse(path.read_text()).body:
        if not isinstance(node, ast.ClassDef) or node.name.startswith("_"):
            continue
        members: dict[str, tuple[str, ...] | None] = {}
        for item in node.body:
            if isinstance(item, ast.FunctionDef) and (not item.name.startswith("_") or item.name == "__init__"):
                args = item.args
                is_property = any(isinstance(d, ast.Name) and d.id == "property" for d in item.decorator_list)
                members[item.name] = None if is_property else \
                    tuple(a.arg for a in args.posonlyargs + args.args + args.kwonlyargs)
            elif isinstance(item, ast.Assign):
                members.update({t.id: None for t in item.targets if isinstance(t, ast.Name) and not t.id.startswith("_")})
            elif isinstance(item, ast.AnnAssign) and item.value is not None and isinstance(item.target, ast.Name) \
                    and not item.target.id.startswith("_"):
                members[item.target.id] = None
        classes[node.name] = members
    return classes


# Files with no counterpart in the other framework, and why (each file's docstring says more).
# fast_exp.py: MLX's CPU exp runs one element at a time, torch's is vectorised (mlx_impl/fast_exp.py).
# kernel_choice.py: times MLX's selectable CPU kernels (the exp, the bf16 matmul route) for `auto`; torch has none.
# adamw.py: torch's AdamW update without a torch.optim.Optimizer, whose construction imports torch._dynamo
# (torch_impl/adamw.py); MLX's step builds mlx.optimizers.AdamW, which costs nothing to import.
FRAMEWORK_ONLY = {"mlx_impl": {"fast_exp.py", "kernel_choice.py"}, "torch_impl": {"adamw.py"}}
# Public names that only one framework has, per file: (the names, why).
NAME_ONLY = {
    "quantized.py": ({"QuantizedProduct", "dequantized_product"}, "a quantized product's own backward: torch's is an "
                     "autograd.Function, MLX's an mx.custom_function built per bit width and group size"),
    "comm.py": ({"average_gradients", "Watch", "FixedCount", "AllReduceCounter", "SendCounter"},
                "MLX averages the gradients itself (torch's DDP and FSDP2 do it in their hooks); torch counts a step's "
                "collectives with what sees them: dispatch modes for all-reduces and sends, a fixed count for DDP's "
                "C++ buckets (MLX counts them as its compiled functions are traced)"),
    "microsteps.py": ({"to_device"}, "an MLX array needs no move to a device: mx.array(batch) is all"),
    "cp.py": ({"released"}, "a torch cp rank gives glibc's freed heap back after each attention (its RSS peaked on "
              "freed blocks); MLX's step takes its buffers from its own allocator's cache"),
    "grads.py": ({"norm_dtype"}, "torch sums the norm in float64, which MPS lacks; MLX sums float32 trees"),
    "tp.py": ({"RowParallelLinear", "GradSumRMSNorm"}, "MLX writes Megatron's g and f layers out; torch's DTensor "
              "ColwiseParallel, RowwiseParallel and PrepareModuleInput are them"),
    "pp.py": ({"Stage", "BackwardMark"}, "torch hands torch.distributed.pipelining a stage module and times its "
              "backward with autograd marks; MLX writes the schedule out and times it there"),
    "fsdp.py": ({"VocabShard", "release_heap_in_backward"}, "MLX pads an uneven vocabulary itself and slices the pad "
                "logits off (FSDP2 pads inside); torch returns glibc's freed heap in the backward, where its peak "
                "comes, and MLX, one lazy graph with no hook inside its backward, meets the target without it "
                "(docs/benchmarks.md)"),
    "load.py": ({"hf_name", "local", "filled_like"}, "MLX maps fsdp's wrapped paths to HF names; torch reads a "
                "DTensor's shard and places AdamW's moments as the parameters are"),
}
# Public class members that only one framework has, per "file:class" ("file:*": every class of the file).
STRATEGIES = ("ddp.py:Replicated", "fsdp.py:Sharding", "tp.py:TensorParallel", "pp.py:Pipeline", "step.py:StepStrategy",
              "mesh.py:DataParallelOver", "mesh.py:ShardedTensorParallel", "zero.py:ZeroRedundancy")
MEMBER_ONLY = [
    (STRATEGIES, {"reduce_gradients", "keeps_grads"}, "where the gradients are reduced: MLX after the backward "
     "(reduce_gradients), torch inside it, where DDP's bucket views must stay allocated (common/train/protocols.py)"),
    (("zero.py:ZeroRedundancy",), {"is_shard"}, "MLX reduces in the Trainer's update (zero2 at two ranks over "
     "send/recv: before it) and tells gradients already reduced, or a step timed without its sync, by their shapes; "
     "torch reduces (zero2) or keeps its rows (zero1) at the end of its passes, which know whether they synced"),
    (("zero.py:ShardedOptimizer",), {"init", "update", "state", "step", "zero_grad"}, "an MLX optimizer is "
     "initialised and updates a model from a gradient tree (its state a property of mlx.optimizers.Optimizer); "
     "torch's steps its parameters' .grad and zeroes them (adamw.py)"),
    (("fsdp.py:Sharding",), {"is_sharded"}, "MLX tells a shard by its parameter path (fully_shard's wrapper); "
     "torch's shards are DTensors"),
    (("fsdp.py:Sharding",), {"eval_losses"}, "torch frees the units FSDP2 keeps gathered after an eval's forward; "
     "MLX gathers inside its lazy graph and keeps nothing"),
    (("comm.py:CommCounter",), {"add", "add_all", "attribute", "each_call", "first_step"}, "MLX counts collectives as its "
     "compiled functions are traced; torch counts a strategy's first step under what sees them"),
    (("microsteps.py:StepFunctions",), {"micro_step", "eval_step", "model", "wrapped"}, "what a strategy runs of the "
     "Trainer: MLX its compiled micro-step and eval, torch its model, bare and as the step runs it"),
    (("model.py:*", "quantized.py:*", "cp.py:UlyssesAttention", "cp.py:RingAttention"), {"forward"}, "a torch module's entry point; MLX's is __call__"),
    (("cp.py:UlyssesAttention",), {"release_heap"}, "torch's cp attention gives glibc's freed heap back (cp.py "
     "released); MLX's step takes its buffers from its own allocator's cache"),
    (("model.py:Embedding",), {"reset_parameters"}, "torch draws a module's weights as it builds it, on the meta "
     "device too, where the draw imports torch._dynamo; MLX's modules draw nothing that a rank would skip"),
]


def backend_files() -> list[str]:
    return sorted(p.name for p in (ROOT / "mlx_impl").glob("*.py") if p.name not in FRAMEWORK_ONLY["mlx_impl"])


def member_only(file: str, cls: str) -> set[str]:
    return set().union(*(names for keys, names, _ in MEMBER_ONLY if f"{file}:{cls}" in keys or f"{file}:*" in keys))


def test_mlx_impl_and_torch_impl_mirror_file_for_file_and_name_for_name():
    torch_files = sorted(p.name for p in (ROOT / "torch_impl").glob("*.py") if p.name not in FRAMEWORK_ONLY["torch_impl"])
    assert backend_files() == torch_files
    for name in backend_files():
        only = NAME_ONLY.get(name, (set(), ""))[0]
        mlx, torch = public_names(ROOT / "mlx_impl" / name), public_names(ROOT / "torch_impl" / name)
        assert mlx - only == torch - only, (name, sorted(mlx ^ torch))
        # An entry that no longer names a framework-only name is stale: it would hide the next one.
        assert only <= mlx ^ torch, (name, sorted(only - (mlx ^ torch)))


def test_every_mirrored_class_has_the_same_public_members_and_method_parameters():
    """Replicated, Sharding, TensorParallel, Pipeline, the Trainer, CommCounter, the model's modules...: a member
    added on one side only, or a method whose parameters differ, fails here; MEMBER_ONLY above lists the few true
    framework differences, each with its reason."""
    differences, used = [], set()
    for name in backend_files():
        mlx, torch = class_members(ROOT / "mlx_impl" / name), class_members(ROOT / "torch_impl" / name)
        for cls in sorted(mlx.keys() & torch.keys()):
            only = member_only(name, cls)
            one_sided = (mlx[cls].keys() ^ torch[cls].keys())
            differences += [f"{name}:{cls}.{m} on one side only" for m in sorted(one_sided - only)]
            used |= {(name, cls, m) for m in one_sided & only}
            differences += [f"{name}:{cls}.{m}{mlx[cls][m]} vs {torch[cls][m]}"
                            for m in sorted(mlx[cls].keys() & torch[cls].keys()) if mlx[cls][m] != torch[cls][m]]
    assert not differences, differences
    stale = [(keys, m) for keys, names, _ in MEMBER_ONLY for m in names
             if not any(m == used_m and (f"{f}:{c}" in keys or f"{f}:*" in keys) for f, c, used_m in used)]
    assert not stale, stale


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


def test_no_module_passes_400_lines():
    """Short modules with one job (../shared/STYLE.md): one that grows past 400 lines holds a second job to split."""
    long = {str(path.relative_to(ROOT)): n for package in ("common", "compare", "mlx_impl", "torch_impl", "tests",
                                                            "benchmarks")
            for path in (ROOT / package).rglob("*.py") if (n := len(path.read_text().splitlines())) > 400}
    assert not long, long
