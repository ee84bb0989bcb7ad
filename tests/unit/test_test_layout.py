"""The tests' own layout: a test module imports helper modules (tests/helpers.py, tests/unit/fake_runs.py,
tests/integration/runs.py, ...), never another test module or a conftest. Importing one runs its tests'
module code a second time under another name, and ties a file's helpers to the tests that happen to hold them."""
import ast
from pathlib import Path

TESTS = Path(__file__).resolve().parents[1]


def imported_modules(tree: ast.AST) -> list[str]:
    """Every module an `import` or `from ... import` names, with the names a `from` brings in (any may be a
    module: `from integration import test_faults`)."""
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = "." * node.level + (node.module or "")
            found.append(base)
            found += [base + ("" if base.endswith(".") or not base else ".") + alias.name for alias in node.names]
    return found


def is_test_or_conftest(module: str) -> bool:
    last = module.rsplit(".", 1)[-1]
    return last.startswith("test_") or last == "conftest"


def test_no_test_module_or_conftest_imports_a_test_module_or_a_conftest():
    files = sorted(TESTS.rglob("test_*.py")) + sorted(TESTS.rglob("conftest.py"))
    assert len(files) > 50, "the walk found the test files"
    offenders = [f"{path.relative_to(TESTS)}: {module}"
                 for path in files for module in imported_modules(ast.parse(path.read_text()))
                 if is_test_or_conftest(module)]
    assert not offenders, "move what they share into a helper module:\n" + "\n".join(offenders)


def test_the_check_sees_every_form_of_import():
    code = ("import unit.test_parity\nfrom unit.test_parity import make_run\nfrom integration import test_faults as f\n"
            "from integration.conftest import HORIZON\nfrom . import conftest\n"
            "def later():\n    from unit import test_tracking\n"
            "from helpers import FAST\nfrom unit.fake_runs import make_run\nimport test_helpers_are_not_here.x\n")
    flagged = [m for m in imported_modules(ast.parse(code)) if is_test_or_conftest(m)]
    assert sorted(flagged) == [".conftest", "integration.conftest", "integration.test_faults", "unit.test_parity",
                               "unit.test_parity", "unit.test_tracking"]
