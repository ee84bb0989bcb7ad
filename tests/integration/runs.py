"""The integration lane's shared runs, as plain functions and constants: how the session's matrix, shaped-link
compare and per-strategy runs are trained and read (the fixtures that hand them to tests live in conftest.py),
and what a test does with a copy of one (rewound, resumed_from, switched_at_a_checkpoint)."""
import json
import os
from dataclasses import dataclass
from pathlib import Path

from common.kernels import PIN_ENV
from helpers import FAST, dpcompare, losses

# Both frameworks at 1 and 2 ranks, every output switched on. Steps of ~50-200 ms on 2 cores keep timer noise small
# next to a step; 3 profile rounds of each kind (8 until no test judged the breakdown's figures: its accuracy is a
# benchmark's, on a quiet machine) give the breakdown, its spread and the report's tables.
STEPS, EVAL_EVERY, LR = 8, 4, "1e-3"
SETUP = (*FAST, "--seq-len", 128, "--global-batch-size", 32, "--steps", STEPS, "--lr", LR, "--eval-every", EVAL_EVERY,
         "--profile-steps", 3, "--op-profile", "--report-to", "tensorboard", "--link-probe")


@dataclass(frozen=True)
class Matrix:
    out: Path          # the compare's directory: mlx-n1, mlx-n2, torch-n1, torch-n2, report.*, summary.json
    baseline: Path     # --save-baseline of all four runs
    setup: tuple       # the flags every run got (a test re-running one of them passes these)
    stdout: str
    steps: int = STEPS
    eval_every: int = EVAL_EVERY
    lr: str = LR

    def run(self, framework: str, world_size: int) -> Path:
        return self.out / f"{framework}-n{world_size}"

    @property
    def summary(self) -> dict:
        return json.loads((self.out / "summary.json").read_text())


MATRIX_ENV = "DPCOMPARE_TEST_MATRIX"  # set by tests/conftest.py where it builds the matrix in the background
LINK_RUN_ENV = "DPCOMPARE_TEST_LINK_RUN"  # likewise for the shaped-link compare (shaped_link_run)
# The session's two shared builds (tests/conftest.py starts them in the background): (what, folder, the variable
# that tells the workers where, its builder below).
BACKGROUND = [("the shared matrix", "matrix", MATRIX_ENV, "build_matrix"),
              ("the shaped-link compare and two-level run", "shaped-link", LINK_RUN_ENV, "build_link_run")]


def build_matrix(root: Path, cache_dir: Path) -> Matrix:
    """`dpcompare compare` of mlx and torch at N=1,2 with eval, profile steps, --trace, tensorboard and a
    saved baseline, into `root`; what it printed is kept beside it (root/stdout.txt), or why it failed
    (root/error.txt: every reader then fails with that message)."""
    out, baseline = root / "cmp", root / "golden.json"
    try:
        # MLX's kernels as `auto` times them, as in a user's run (the rest of the suite pins them: tests/conftest.py)
        proc = dpcompare("compare", *SETUP, "--trace", "--frameworks", "mlx,torch", "--nproc", "1,2", "--out", out,
                         "--save-baseline", baseline, cache_dir=cache_dir, env={PIN_ENV: ""})
    except AssertionError as err:
        (root / "error.txt").write_text(str(err))
        raise
    (root / "stdout.txt").write_text(proc.stdout)
    return Matrix(out, baseline, SETUP, proc.stdout)


BUILT = ".built"  # written last by build_in_background, whether the build passed or failed


def build_in_background(root: Path, cache_dir: Path, builds: list[tuple[str, str]]) -> None:
    """The shared runs that tests/conftest.py starts in a process of their own when the session starts, one after
    another: each (folder, builder name) into root/folder, its failure written to error.txt, then BUILT. The
    xdist workers run the other tests meanwhile; a reader waits for BUILT (built_in_background)."""
    import time
    import traceback

    for folder, name in builds:
        where = root / folder
        where.mkdir(parents=True, exist_ok=True)
        started = time.monotonic()
        try:
            {"build_matrix": build_matrix, "build_link_run": build_link_run}[name](where, cache_dir)
        except AssertionError:
            pass  # the builder wrote error.txt
        except Exception:  # noqa: BLE001 - the readers fail with it, the other tests run
            (where / "error.txt").write_text(traceback.format_exc())
        (where / BUILT).write_text("")
        print(f"built {folder} in {time.monotonic() - started:.0f} s", flush=True)  # build.log, for the session's end


def built_in_background(env_name: str, timeout_s: float = 1500) -> Path | None:
    """The folder tests/conftest.py builds a shared run into in the background (None where it does not), once
    the build is over; its failure, written to its error.txt, fails the reader, and so does a build process that
    ended without finishing (its log is build.log beside the folder)."""
    import time

    if not os.environ.get(env_name):
        return None
    root = Path(os.environ[env_name])
    pid = int((root.parent / "build.pid").read_text())
    deadline = time.monotonic() + timeout_s
    while not (root / BUILT).exists():
        gone = not Path(f"/proc/{pid}").exists() if Path("/proc").exists() else False
        if gone or time.monotonic() > deadline:
            log = root.parent / "build.log"
            raise AssertionError(f"the shared run {root} was never built:\n"
                                 + (log.read_text()[-3000:] if log.exists() else ""))
        time.sleep(0.5)
    if (root / "error.txt").exists():
        raise AssertionError((root / "error.txt").read_text())
    return root


# torch at N=1 and 2 over an emulated 20 Mbit/s link (tests/integration/test_link.py: each step waits for the
# link, and the cost model's prediction is made over it). Over 8 timed steps the prediction's error was -5.1 % to
# +3.3 % in six runs alone (AMD EPYC Zen 5), and -17 % to +21 % beside the other worker: a benchmark's figure.
LINK_RATE, LINK_RATE_BPS = "20mbit", 20e6
LINK_ARGS = (*FAST, "--frameworks", "torch", "--nproc", "1,2", "--steps", 10, "--link", LINK_RATE, "--no-samples",
             "--link-probe")


# torch x4 over a two-level link, the run whose own all-reduce test_link.py turns into each level's rate (held to
# it from above). Two steps, no profile rounds: the link is checked, not the step.
TWO_LEVEL_ARGS = (*FAST, "--framework", "torch", "--nproc", 4, "--steps", 2, "--profile-steps", 0, "--link", "100mbit",
                  "--link-inner", "200mbit", "--group-size", 2, "--link-probe")


def build_link_run(root: Path, cache_dir: Path) -> Path:
    """The shaped-link compare into root/cmp, then the two-level link's run into root/two-level; why either
    failed goes to root/error.txt (its readers fail with it)."""
    try:
        dpcompare("compare", *LINK_ARGS, "--out", root / "cmp", cache_dir=cache_dir)
        dpcompare("run", *TWO_LEVEL_ARGS, "--out", root / "two-level", cache_dir=cache_dir)
    except AssertionError as err:
        (root / "error.txt").write_text(str(err))
        raise
    return root / "cmp"


def shared_root(tmp_path_factory) -> Path:
    """Where the session's shared runs live: under pytest-xdist one folder for every worker (a worker's
    basetemp is popen-gwN), so a run one worker trained is read, not trained again, by the other."""
    base = tmp_path_factory.getbasetemp()
    root = (base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base) / "shared-runs"
    root.mkdir(exist_ok=True)
    return root


def train_once(root: Path, name: str, args: tuple, cache_dir: Path) -> Path:
    """`dpcompare run ARGS --out root/name`, once for the whole session whichever worker asks first: the
    others wait on its lock and read the finished run (a run that failed is trained again by the next)."""
    import fcntl
    import shutil

    out = root / name
    with open(root / f"{name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not (out / ".trained").exists():
            shutil.rmtree(out, ignore_errors=True)
            dpcompare("run", *args, "--out", out, cache_dir=cache_dir)
            (out / ".trained").write_text("")
    return out


# The uninterrupted curve a switch at a checkpoint must continue, and what the cross-framework agreement
# tests of tp and fsdp compare: 20 steps at lr 1e-3 on a 20-step cosine, one run per (framework, strategy,
# world size) for the whole session (ddp's also give test_faults.py's resume its reference, fsdp's
# test_fsdp.py its packing case, and tp x2 and pp x2 against ddp x1 test_tp.py's and test_pp.py's packing
# cases). Each keeps its step-10 checkpoint: the first half of a switch (rewound). pp cuts each batch into 8
# micro-batches (1f1b, the default schedule): test_pp.py's case of M = 8. conftest.py's `uninterrupted` trains them.
HORIZON = ("--lr-decay-steps", 20, "--lr", "1e-3")
HALF = 10
PP_MICROBATCHES = 8


def rewound(run_dir: Path, to: Path, step: int = HALF) -> Path:
    """A copy of a session run at `to` with its checkpoints after `step` removed: what a run stopped at
    `step` leaves (the step-`step` checkpoint is the one it wrote on its way; --resume truncates the metrics
    after it). A test resumes it, in another framework or strategy or the same, instead of training the
    first `step` steps again."""
    import shutil

    from common.checkpoint.store import latest_checkpoint

    shutil.copytree(run_dir, to, ignore=shutil.ignore_patterns(".trained"))
    for checkpoint in (to / "checkpoints").glob("step_*"):
        if int(checkpoint.name.split("_")[1]) > step:
            shutil.rmtree(checkpoint)
    assert latest_checkpoint(to).name == f"step_{step:06d}", sorted((to / "checkpoints").iterdir())
    return to


def reference_flags(framework: str, sequence: str) -> tuple:
    """The 10-step run a tp or pp job must equal at one ddp rank. grad_clip below the norms (~0.9): the
    clipped update depends on the global norm summed over the ranks' shares (stages, or split layers)."""
    return ("--framework", framework, "--steps", 10, "--sequence", sequence, "--eval-every", 10,
            "--set", "grad_clip=0.5")


def train_padded(root: Path, cache_dir: Path, framework: str, nproc: int, grad_accum: int, strategy: str = "ddp"):
    """The padded runs: reference_flags(framework, "padding") (10 steps, grad_clip 0.5, an eval at step 10) at
    these ranks, accumulation and strategy. ddp x1 without accumulation is ddp_one's padding reference."""
    return train_once(root, f"padded-{framework}-{strategy}-n{nproc}-accum{grad_accum}",
                      (*FAST, *reference_flags(framework, "padding"), "--nproc", nproc, "--grad-accum", grad_accum,
                       "--strategy", strategy), cache_dir)


def resumed_from(run_dir: Path) -> int:
    """The step the last run in `run_dir` started after (its rank 0's status)."""
    return json.loads((run_dir / "ranks" / "rank0.json").read_text())["start_step"]


def switched_at_a_checkpoint(first: str, second: str, flags: dict, uninterrupted, cache_dir, tmp_path) -> tuple:
    """(losses of a run trained 10 steps as `first` then resumed to 20 as `second`, losses of the uninterrupted
    20-step `second` run). `first`/`second` are "FRAMEWORK STRATEGY"; flags[strategy] are its run flags
    (e.g. ("--strategy", "tp", "--nproc", 2)), on the uninterrupted runs' LR horizon. Where `first`'s flags
    are only its strategy and ranks, its 10 steps are the session's uninterrupted run rewound to step 10."""
    def args(which):
        framework, strategy = which.split()
        return ("--framework", framework, *flags[strategy], *HORIZON)

    def world(strategy):
        return dict(zip(flags[strategy][::2], flags[strategy][1::2])).get("--nproc", 1)

    def plain(strategy):
        pairs = zip(flags[strategy][::2], flags[strategy][1::2])
        return all(k in ("--strategy", "--nproc") or (k == "--set" and str(v).startswith("strategy="))
                   for k, v in pairs)

    framework, strategy = second.split()
    switched = tmp_path / "switched"
    if plain(first.split()[1]):
        rewound(uninterrupted(first.split()[0], first.split()[1], world(first.split()[1])), switched)
    else:
        dpcompare("run", *FAST, "--out", switched, *args(first), "--steps", HALF, cache_dir=cache_dir)
    dpcompare("run", *FAST, "--out", switched, *args(second), "--steps", 20, "--resume", cache_dir=cache_dir)
    assert resumed_from(switched) == HALF
    straight = losses(uninterrupted(framework, strategy, world(strategy)))  # 20 steps on the same horizon
    return losses(switched), straight
