"""The unit lane starts no training process: a test that does fails here, naming what it started."""
import os
import shlex
import subprocess

import pytest

# What starts training (or a browser): the CLI, the rank launchers and a rank's own entry points (as
# `python -m MODULE` or a script path), and the launcher programs.
MODULES = ("compare.cli", "compare.launch.spawn", "mlx_impl.launch", "torch_impl.launch", "mlx_impl.sample",
           "torch_impl.sample", "mlx.launch", "peers.mlx_lm_peer", "peers.hf_peer")
PROGRAMS = ("dpcompare", "mlx.launch", "torchrun", "mpirun", "chromium", "chromium-browser")


def starts_training(args) -> str | None:
    """The word in a command line that starts training; the code of `python -c CODE` is not a command."""
    argv = shlex.split(args) if isinstance(args, str) else [os.fsdecode(a) for a in args]
    skip = False
    for arg in argv:
        if skip:
            skip = False
            continue
        skip = arg == "-c"
        module_path = arg[:-3].replace("/", ".") if arg.endswith(".py") else None
        for module in MODULES:
            if arg == module or (module_path and module_path.endswith(module)):
                return module
        if os.path.basename(arg) in PROGRAMS:
            return os.path.basename(arg)
    return None


@pytest.fixture(autouse=True)
def no_training_process(monkeypatch, request):
    popen_init = subprocess.Popen.__init__

    def guarded(self, args, *rest, **kwargs):
        word = starts_training(args)
        if word is not None:
            pytest.fail(f"{request.node.nodeid} starts a training process ({word!r} in its command line): "
                        "move it to tests/integration", pytrace=False)
        popen_init(self, args, *rest, **kwargs)

    monkeypatch.setattr(subprocess.Popen, "__init__", guarded)


@pytest.fixture
def no_figures(monkeypatch):
    """A report written without its figures, for tests that read its tables and lines: matplotlib takes 1-3 s a
    report (tests/unit/test_report.py checks that every figure is drawn)."""
    monkeypatch.setattr("compare.report.writer.make_plots", lambda *args, **kwargs: {})
