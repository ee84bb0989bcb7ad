"""The session's shared training runs, as fixtures (how each is trained, and the helpers that read them:
runs.py). A new slow test reads `matrix` (or extends its flags), or one of the `uninterrupted` and `ddp_one`
runs, before it starts a run of its own: each `dpcompare compare` costs a minute on the slow CI machine. Each is
trained once per session, under pytest-xdist too (the matrix by the xdist controller before the workers start,
the others by whichever worker asks first: runs.train_once)."""
from pathlib import Path

import pytest

from helpers import FAST
from integration.jobs import stop_leftovers
from integration.runs import (HALF, HORIZON, LINK_RUN_ENV, MATRIX_ENV, PP_MICROBATCHES, SETUP, Matrix, build_link_run,
                              build_matrix, built_in_background, reference_flags, shared_root, train_once,
                              train_padded)


@pytest.fixture(scope="session")
def matrix(cache_dir, tmp_path_factory) -> Matrix:
    """The matrix, once for the session. Tests read it; none may write into it. Under pytest-xdist it is built
    in a process of its own from the session's start, while the workers run the other tests (tests/conftest.py),
    and its readers are scheduled last."""
    root = built_in_background(MATRIX_ENV)
    if root is not None:
        return Matrix(root / "cmp", root / "golden.json", SETUP, (root / "stdout.txt").read_text())
    return build_matrix(tmp_path_factory.mktemp("matrix"), cache_dir)


@pytest.fixture(scope="session")
def shaped_link_run(cache_dir, tmp_path_factory) -> Path:
    """The shaped-link compare's directory (torch-n1, torch-n2), once for the session; skipped where links
    cannot be emulated. Under pytest-xdist it is built in the background, after the matrix (tests/conftest.py)."""
    from helpers import skip_unless_links

    skip_unless_links()
    root = built_in_background(LINK_RUN_ENV)
    return root / "cmp" if root is not None else build_link_run(tmp_path_factory.mktemp("shaped-link"), cache_dir)


@pytest.fixture(scope="session")
def uninterrupted(cache_dir, tmp_path_factory):
    """uninterrupted(framework, strategy, nproc) -> the run directory, trained on first use."""
    root = shared_root(tmp_path_factory)

    def run(framework: str, strategy: str, nproc: int) -> Path:
        pp = ("--pp-microbatches", PP_MICROBATCHES) if strategy == "pp" else ()
        return train_once(root, f"uninterrupted-{framework}-{strategy}-n{nproc}",
                          (*FAST, *HORIZON, "--steps", 20, "--framework", framework, "--strategy", strategy,
                           "--nproc", nproc, "--checkpoint-every", HALF, *pp), cache_dir)

    return run


@pytest.fixture(scope="session")
def ddp_one(cache_dir, tmp_path_factory):
    """ddp_one(framework, sequence) -> the ddp x1 run of reference_flags, the reference of test_tp.py's and
    test_pp.py's equality tests (but those judged on the `uninterrupted` runs), trained on first use (once for
    both files; the padding one is also `padded`'s ddp x1 run without accumulation, test_training.py's
    accumulation reference)."""
    root = shared_root(tmp_path_factory)

    def get(framework: str, sequence: str) -> Path:
        if sequence == "padding":
            return train_padded(root, cache_dir, framework, 1, 1)
        return train_once(root, f"ddp1-{framework}-{sequence}",
                          (*FAST, *reference_flags(framework, sequence), "--nproc", 1), cache_dir)

    return get


@pytest.fixture(scope="session")
def padded(cache_dir, tmp_path_factory):
    """padded(framework, nproc, grad_accum, strategy="ddp") -> a 10-step run of padded sequences on
    reference_flags (grad_clip below the norms: every invariance below also holds for the clipped update, whose
    global norm each rank must count over the whole batch), trained on first use: test_training.py's
    accumulation and data-parallel invariance and test_fsdp.py's padding case judge the same runs (ddp x1
    accumulating 2 is the reference of both invariances; ddp x2 accumulating 2 is both the data-parallel side
    and fsdp's reference), and ddp x1 without accumulation is ddp_one's padding reference."""
    root = shared_root(tmp_path_factory)

    def get(framework: str, nproc: int, grad_accum: int, strategy: str = "ddp") -> Path:
        return train_padded(root, cache_dir, framework, nproc, grad_accum, strategy)

    return get


@pytest.fixture(autouse=True)
def no_job_left_behind():
    """Every background job a test started (integration/jobs.py `start`) is stopped when the test ends."""
    yield
    stop_leftovers()
