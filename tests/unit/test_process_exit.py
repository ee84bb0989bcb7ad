"""A framework process ends through exit_now (common/train/process_exit.py): its code and its last unflushed output
arrive, and nothing of the interpreter's teardown runs after it."""
import os
import subprocess
import sys

from common.train.process_exit import MPI_RANK_VARIABLES
from helpers import ROOT


def test_exit_now_keeps_the_code_and_the_buffered_output_and_skips_the_teardown():
    code = ("import atexit, sys\n"
            "from common.train.process_exit import exit_now\n"
            "atexit.register(lambda: print('teardown ran'))\n"
            "sys.stdout.write('no newline yet'); sys.stderr.write('err tail')\n"
            "exit_now(3)\n")
    # an explicit environment without MPI's variables: a test in this worker that started MPI in-process (Open MPI's
    # singleton) leaves them in the C environment a child would otherwise inherit
    env = {k: v for k, v in os.environ.items() if k not in MPI_RANK_VARIABLES}
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=60, env=env)
    assert (proc.returncode, proc.stdout, proc.stderr) == (3, "no newline yet", "err tail")


def test_an_mpi_rank_ends_the_usual_way_so_that_mpi_is_finalized():
    code = ("import atexit\n"
            "from common.train.process_exit import exit_now\n"
            "atexit.register(lambda: print('teardown ran'))\n"
            "exit_now(0)\n")
    for variable in ("OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "PMIX_RANK"):
        proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=60,
                              env={**os.environ, variable: "2"})
        assert (proc.returncode, proc.stdout) == (0, "teardown ran\n"), variable


def test_every_entry_point_that_imports_a_framework_leaves_through_exit_now():
    """The two frameworks' entry points and the peers', file for file: one that forgets pays 1-1.5 s a torch process."""
    for package in ("mlx_impl", "torch_impl", "peers"):
        for path in sorted((ROOT / package).glob("*.py")):
            text = path.read_text()
            if 'if __name__ == "__main__":' in text:
                assert "exit_now(main())" in text, path


def test_imports_uncollected_holds_collection_inside_then_freezes_and_restores_it():
    """common/train/collector.py: no collection runs while a framework imports; what the imports made is frozen; the
    collector is left as it was found (a caller that had disabled it keeps it disabled)."""
    import gc

    from common.train.collector import imports_uncollected

    try:
        for enabled in (True, False):
            (gc.enable if enabled else gc.disable)()
            with imports_uncollected():
                assert not gc.isenabled()
                made = [[index] for index in range(3)]  # tracked containers, as a module's objects
            assert gc.isenabled() is enabled
            # frozen: tracked, but in none of the collector's three generations (gc.get_objects lists those)
            assert all(gc.is_tracked(obj) for obj in made)
            assert not any(any(obj is other for other in gc.get_objects()) for obj in made)
    finally:
        gc.unfreeze()
        gc.enable()


def test_both_rank_launchers_import_inside_imports_uncollected():
    """Mirrored: mlx_impl/launch.py and torch_impl/launch.py import their trainer with the collector held."""
    for package in ("mlx_impl", "torch_impl"):
        text = (ROOT / package / "launch.py").read_text()
        body = text[text.index("def main("):]
        assert body.index("with imports_uncollected():") < body.index("from .step import Trainer"), package
