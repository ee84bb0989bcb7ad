"""Where one machine's ranks outnumber its cores, MLX's ranks are pinned one core each, round-robin, and torch's are
left to the kernel (common/train/placement.py; each framework's launch.py SHARED_CORES says why, with its runs)."""
import json
import os
import subprocess
import sys

import pytest

from common.config import RunConfig
from common.model.spec import PRESETS
from common.runplan import RunPlan
from common.train.placement import KERNEL, ROUND_ROBIN, cores_for

affinity = pytest.mark.skipif(not hasattr(os, "sched_setaffinity"), reason="no sched_setaffinity here (macOS)")


def test_round_robin_puts_consecutive_ranks_on_different_cores_and_only_where_ranks_outnumber_cores():
    # 4 ranks on 2 cores: a tp pair (0, 1) or ring neighbours never share a core; pipeline stages do
    assert [cores_for(r, 4, 1, [0, 1]) for r in range(4)] == [{0}, {1}, {0}, {1}]
    assert [cores_for(r, 4, 1, [4, 5, 6]) for r in range(4)] == [{4}, {5}, {6}, {4}]  # the job's own cores
    assert cores_for(1, 3, 2, [0, 1, 2, 3]) == {2, 3}  # each rank's threads together
    assert cores_for(0, 2, 1, [0, 1]) is None  # a core each already: the kernel's choice
    assert cores_for(0, 4, 2, [0, 1]) is None  # a rank's threads want every core
    assert cores_for(0, 1, 1, [0]) is None


def _plan(run_dir, ranks: int, **overrides) -> str:
    run_dir.mkdir(exist_ok=True)
    cfg = RunConfig.from_dict({"preset": "tiny", "nproc": ranks, "global_batch_size": ranks, **overrides})
    RunPlan(cfg, PRESETS["tiny"], run_dir / "cache", run_dir / "seed.safetensors").write(run_dir)
    return str(run_dir)


@affinity
@pytest.mark.parametrize("policy", [ROUND_ROBIN, KERNEL])
def test_a_rank_is_pinned_before_its_framework_starts_only_under_round_robin(tmp_path, policy):
    """The rank's process (a child here, as a launcher starts it) ends up on the one core round-robin gives rank 3
    of twice this machine's cores; under the kernel's policy, or with --no-pin-ranks, it keeps every core."""
    available = sorted(os.sched_getaffinity(0))
    ranks = 4 * len(available)
    probe = ("import json, os, sys; from common.train.placement import place_rank; "
             f"print(json.dumps([sorted(place_rank(sys.argv[1], {policy!r}) or []), sorted(os.sched_getaffinity(0))]))")
    env = {**os.environ, "RANK": "3", "SLURM_STEP_NUM_NODES": "1"}
    for run_dir, pinned in ((_plan(tmp_path / "on", ranks), policy == ROUND_ROBIN),
                            (_plan(tmp_path / "off", ranks, pin_ranks=False), False)):
        out = subprocess.run([sys.executable, "-c", probe, run_dir], env=env, capture_output=True, text=True,
                             check=True)
        said, mask = json.loads(out.stdout)
        if pinned:
            assert said == mask == [available[3 % len(available)]]
        else:
            assert said == [] and mask == available
    # an srun step over two nodes: rank 3 is not the third rank of this machine
    out = subprocess.run([sys.executable, "-c", probe, str(tmp_path / "on")], env={**env, "SLURM_STEP_NUM_NODES": "2"},
                         capture_output=True, text=True, check=True)
    assert json.loads(out.stdout) == [[], available]
