"""Slurm without daemons: what dpcompare reads of an allocation, the srun step it builds for each backend, the
variables each task gets, the sbatch script --submit writes, and the inputs it refuses. The Slurm commands are
fakes on PATH (tests/integration/test_slurm.py runs the real ones)."""
import json
import shlex
from pathlib import Path

import pytest

from common.config import RunConfig
from compare.cli import build_parser
from compare.flags import config_from_args
from compare.launch import slurm
from compare.launch.launchers import build_command
from compare.launch.slurm_rank import expand_counts, rank_env
from compare.submit import SCRIPT, SubmitOptions, sbatch_script, submit_runs
from helpers import FAST, dpcompare_here

SRUN_MPI_LIST = "MPI plugin types are...\n\tpmix\n\tnone\n\tpmi2\nspecific pmix plugin versions available: pmix_v4\n"


def fake_tools(directory: Path, **scripts: str) -> Path:
    """Executables named after the keywords, each running its shell script; the directory, for PATH."""
    directory.mkdir(parents=True, exist_ok=True)
    for name, body in scripts.items():
        path = directory / name
        path.write_text(f"#!/bin/sh\n{body}\n")
        path.chmod(0o755)
    return directory


@pytest.fixture
def allocation(tmp_path, monkeypatch):
    """allocation(nodelist, tasks_per_node, hosts=..., mpi_list=...): this process inside a Slurm job of those
    nodes, with a fake scontrol that expands the node list to `hosts` and a fake srun offering `mpi_list`."""
    def enter(nodelist: str, tasks_per_node: str, hosts: tuple = (), mpi_list: str = SRUN_MPI_LIST) -> Path:
        listing = "\n".join(hosts)
        bin_dir = fake_tools(tmp_path / "bin",
                             scontrol=f'[ "$1 $2 $3" = "show hostnames {nodelist}" ] && printf "{listing}\\n"',
                             srun=f'[ "$1" = "--mpi=list" ] && printf "{mpi_list}"')
        monkeypatch.setenv("PATH", f"{bin_dir}:/usr/bin:/bin")
        monkeypatch.setenv("SLURM_JOB_ID", "4242")
        monkeypatch.setenv("SLURM_JOB_NODELIST", nodelist)
        monkeypatch.setenv("SLURM_TASKS_PER_NODE", tasks_per_node)
        return bin_dir

    return enter


def test_slurm_count_lists_expand_to_one_count_per_node():
    assert expand_counts("2(x3),1") == [2, 2, 2, 1]
    assert expand_counts("4") == [4]
    with pytest.raises(ValueError, match="not a Slurm count list"):
        expand_counts("2(x)")


def test_the_allocation_lists_its_nodes_as_scontrol_expands_them_and_ranks_fill_them_in_order(allocation):
    allocation("n[01-03]", "2(x2),1", hosts=("n01", "n02", "n03"))
    alloc = slurm.allocation()
    assert alloc == slurm.Allocation("4242", ("n01", "n02", "n03"), (2, 2, 1))
    assert alloc.tasks == 5
    assert slurm.rank_hosts(alloc, 3) == ["n01", "n01", "n02"]


def test_a_plain_host_name_needs_no_scontrol(monkeypatch, tmp_path):
    monkeypatch.setenv("PATH", str(tmp_path))  # nothing there
    assert slurm.hostnames("gpu7") == ["gpu7"]


def test_inconsistent_allocation_variables_are_one_line_errors(allocation):
    allocation("n[1-2]", "2", hosts=("n1", "n2"))
    with pytest.raises(slurm.UserError, match=r"2 nodes \(n\[1-2\]\) but tasks for 1"):
        slurm.allocation()


def step_for(tmp_path, **fields):
    """(argv, environment added) of the srun step build_command makes for this run (MLX's bundled BLAS: no
    library is probed in this new cache, 0.4-1.6 s a probe, as the step's BLAS is not what is checked)."""
    cfg = RunConfig.from_dict({"cache_dir": str(tmp_path / "cache"), "mlx_cpu_jit": "baseline", "mlx_blas": "bundled",
                               **fields})
    argv, extra, _ = build_command(cfg, tmp_path / "run")
    return argv, extra


def test_torch_ranks_meet_at_a_store_on_the_first_host_of_the_node_list(allocation, tmp_path):
    bin_dir = allocation("n[1-2]", "1(x2)", hosts=("n1", "n2"))
    argv, extra = step_for(tmp_path, framework="torch", nproc=2)
    assert argv[:3] == [str(bin_dir / "srun"), "--ntasks=2", "--nodes=2"]
    assert argv[argv.index("-m") + 1] == "compare.launch.slurm_rank"
    assert argv[-3:] == ["-m", "torch_impl.launch", str(tmp_path / "run")]
    assert extra["MASTER_ADDR"] == "n1" and int(extra["MASTER_PORT"]) > 0
    # Rank r on line r: what the store's host and the ring's addresses assume.
    assert "--distribution=arbitrary" in argv
    assert Path(extra["SLURM_HOSTFILE"]).read_text().split() == ["n1", "n2"]


def test_an_mlx_ring_gets_one_address_per_rank_written_from_the_node_list(allocation, tmp_path):
    import socket

    here = socket.gethostname()
    allocation(here, "2")  # this host, whatever its name resolves to: loopback
    argv, extra = step_for(tmp_path, framework="mlx", nproc=2)
    assert f"--nodelist={here}" in argv and "--mpi=pmix" not in " ".join(argv)
    ring = json.loads(Path(extra[slurm.RING_HOSTFILE_ENV]).read_text())
    ports = [int(entry[0].rsplit(":", 1)[1]) for entry in ring]
    assert [entry[0].rsplit(":", 1)[0] for entry in ring] == ["127.0.0.1", "127.0.0.1"]
    assert ports[1] == ports[0] + 1


@pytest.mark.parametrize("offered, plugin", [(SRUN_MPI_LIST, "pmix"), ("MPI plugin types are...\n\tnone\n\tpmi2\n",
                                                                        "pmi2")])
def test_mlx_mpi_ranks_take_their_rank_from_srun_pmix_or_else_pmi2(allocation, tmp_path, offered, plugin):
    allocation("vm", "2", mpi_list=offered)
    argv, extra = step_for(tmp_path, framework="mlx", nproc=2, backend="mpi")
    assert f"--mpi={plugin}" in argv
    assert "MASTER_ADDR" not in extra and slurm.RING_HOSTFILE_ENV not in extra


def test_each_task_gets_the_variables_torchrun_and_mlx_launch_would_set():
    task = {"SLURM_PROCID": "3", "SLURM_NTASKS": "4", "SLURM_LOCALID": "1", "SLURM_NODEID": "1",
            "SLURM_STEP_TASKS_PER_NODE": "2(x2)", slurm.RING_HOSTFILE_ENV: "/runs/x/slurm_ring_hosts.json"}
    assert rank_env(task) == {"RANK": "3", "WORLD_SIZE": "4", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2",
                              "MLX_RANK": "3", "MLX_HOSTFILE": "/runs/x/slurm_ring_hosts.json"}


def test_auto_uses_srun_only_inside_an_allocation_and_local_turns_it_off(monkeypatch):
    monkeypatch.delenv("SLURM_JOB_ID", raising=False)
    assert not slurm.uses_slurm(RunConfig())
    monkeypatch.setenv("SLURM_JOB_ID", "7")
    assert slurm.uses_slurm(RunConfig())
    assert not slurm.uses_slurm(RunConfig(launcher="local"))
    assert not slurm.uses_slurm(RunConfig(link="1gbit", nproc=2))  # an emulated link names its own ranks


def test_a_cancelled_allocation_counts_as_a_stop_and_a_running_one_does_not(allocation, monkeypatch, tmp_path):
    bin_dir = allocation("vm", "2")
    for state, revoked in (("RUNNING", False), ("CANCELLED", True), ("", True)):
        fake_tools(bin_dir, squeue=f'echo "{state}"')
        assert slurm.allocation_revoked(RunConfig()) is revoked, state
    fake_tools(bin_dir, squeue='echo "slurm_load_jobs error: Unable to contact slurm controller" >&2; exit 1')
    assert not slurm.allocation_revoked(RunConfig())  # no answer is no claim


def script_config(tmp_path) -> RunConfig:
    args = build_parser().parse_args(["compare", *FAST, "--steps", "20", "--lr", "1e-3", "--set", "model.n_layers=3",
                                      "--trace", "--set", "torch_compile=true", "--out", str(tmp_path / "cmp")])
    base = config_from_args(args, framework="torch", nproc=2, launcher="slurm")
    return base.replace(out=str(tmp_path / "cmp" / "torch-n2"))


def exec_line(script: str) -> list[str]:
    joined = script.replace("\\\n", " ")
    return shlex.split(next(line for line in joined.splitlines() if line.startswith("exec ")))[1:]


def test_the_sbatch_script_runs_the_same_config_with_absolute_paths(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    cfg = script_config(Path("."))  # a relative --out
    options = SubmitOptions(partition="debug", time="00:10:00", nodes=4, account="lecture", cwd=Path("."))
    script = sbatch_script(cfg, options)
    run_dir = (tmp_path / "cmp" / "torch-n2").resolve()
    header = [line for line in script.splitlines() if line.startswith("#SBATCH")]
    assert header == ["#SBATCH --job-name=dpcompare-torch-n2", "#SBATCH --ntasks=2",
                      f"#SBATCH --output={run_dir}/slurm-%j.out", f"#SBATCH --chdir={tmp_path.resolve()}",
                      "#SBATCH --nodes=2", "#SBATCH --partition=debug", "#SBATCH --time=00:10:00",
                      "#SBATCH --account=lecture"]
    argv = exec_line(script)
    assert argv[1:4] == ["-m", "compare.cli", "run"] and Path(argv[0]).is_absolute()
    again = config_from_args(build_parser().parse_args(argv[3:]))
    assert again == cfg.replace(out=str(run_dir), cache_dir=str(cfg.cache_path.resolve()))


def test_the_sbatch_script_is_valid_shell(tmp_path):
    import subprocess

    path = tmp_path / SCRIPT
    path.write_text(sbatch_script(script_config(tmp_path), SubmitOptions()))
    assert subprocess.run(["bash", "-n", str(path)], capture_output=True, text=True).returncode == 0


def test_a_job_that_ends_without_a_summary_is_a_failed_run_naming_its_output(tmp_path, monkeypatch):
    bin_dir = fake_tools(tmp_path / "bin", sbatch='echo "77;cluster"',
                         squeue='echo "slurm_load_jobs error: Invalid job id specified" >&2; exit 1',
                         scontrol='echo "JobId=77 JobState=FAILED Reason=NonZeroExitCode ExitCode=1:0"')
    monkeypatch.setenv("PATH", f"{bin_dir}:/usr/bin:/bin")
    cfg = script_config(tmp_path)
    run_dirs, failed = submit_runs({("torch x2", Path(cfg.out)): cfg}, SubmitOptions())
    assert run_dirs == [Path(cfg.out)] and (Path(cfg.out) / SCRIPT).is_file()
    assert failed == [("torch x2", f"job 77 ended (FAILED exit code 1:0) without writing summary.json; see "
                                   f"{Path(cfg.out).resolve()}/slurm-77.out")]


def one_line_error(proc, *words):
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("dpcompare: error:"), proc.stderr
    for word in words:
        assert word in lines[0], lines[0]


def test_submit_without_sbatch_on_path_is_refused_in_one_line(tmp_path, monkeypatch):
    monkeypatch.setenv("PATH", str(fake_tools(tmp_path / "empty")))
    proc = dpcompare_here("compare", *FAST, "--submit", "slurm", "--out", tmp_path / "cmp", cache_dir=tmp_path)
    one_line_error(proc, "sbatch is not on PATH")
    assert not (tmp_path / "cmp").exists()


def test_a_dry_run_prints_every_script_and_needs_no_slurm(tmp_path, monkeypatch):
    monkeypatch.setenv("PATH", str(fake_tools(tmp_path / "empty")))
    proc = dpcompare_here("compare", *FAST, "--submit", "slurm", "--dry-run", "--frameworks", "mlx,torch",
                          "--nproc", "1,2", "--out", tmp_path / "cmp", cache_dir=tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.count("#!/bin/bash") == 4 and proc.stdout.count("--launcher slurm") == 4
    assert not (tmp_path / "cmp").exists()  # printed, not written


def test_an_allocation_smaller_than_nproc_is_refused_before_anything_starts(allocation, tmp_path):
    allocation("vm", "1")
    proc = dpcompare_here("run", *FAST, "--framework", "torch", "--nproc", "2", "--out", tmp_path / "r",
                          cache_dir=tmp_path)
    one_line_error(proc, "Slurm job 4242 has 1 task", "--nproc is 2")


def test_a_run_inside_an_allocation_takes_the_jobs_task_count_unless_told(allocation):
    allocation("vm", "4")
    assert slurm.sized_to_allocation(RunConfig(), nproc_given=False).nproc == 4
    assert slurm.sized_to_allocation(RunConfig(nproc=2), nproc_given=True).nproc == 2
    assert slurm.sized_to_allocation(RunConfig(launcher="local"), nproc_given=False).nproc == 1


@pytest.mark.parametrize("args, words", [
    (("run", "--launcher", "slurm"), ("SLURM_JOB_ID is not set",)),
    (("run", "--launcher", "slurm", "--nproc", "2", "--link", "1gbit"), ("cannot be combined with",)),
    (("compare", "--partition", "debug", "--time", "10"), ("--partition, --time go with --submit slurm",)),
    (("compare", "--submit", "slurm", "--launcher", "local"), ("drop --launcher local",)),
    (("compare", "--submit", "slurm", "--dry-run", "--nodes", "0"), ("--nodes must be positive",)),
])
def test_slurm_flags_out_of_place_are_refused_in_one_line(tmp_path, monkeypatch, args, words):
    monkeypatch.delenv("SLURM_JOB_ID", raising=False)
    one_line_error(dpcompare_here(*args, "--out", tmp_path / "x", cache_dir=tmp_path), *words)
