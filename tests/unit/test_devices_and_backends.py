"""Macs and GPUs without the hardware: the stream MLX communicates on, the jaccl backends and both forms of
mlx.launch's hostfile, backends a build lacks, MPS with several torch ranks, and the end-of-run step check.
The command lines are checked as built; real runs here use the CPU."""
import json
import random
import sys

import numpy as np
import pytest

from common.config import RunConfig
from common.errors import UserError
from common.train.rank_checks import TrainingError, check_same_step
from compare.launch.hosts import check_hostfile, effective_backend, read_mlx_hostfile, ring_hosts, with_hostfile_backend
from compare.launch.launchers import build_command, device_note
from helpers import FAST, dpcompare_here

MESH = [  # what `mlx.distributed_config --backend jaccl` writes for three Macs cabled pairwise
    {"ssh": "mac1", "ips": ["10.0.0.1"], "rdma": [None, "rdma_en3", "rdma_en4"]},
    {"ssh": "mac2", "ips": ["10.0.0.2"], "rdma": ["rdma_en3", None, "rdma_en5"]},
    {"ssh": "mac3", "ips": ["10.0.0.3"], "rdma": ["rdma_en4", "rdma_en5", None]},
]


def write(path, data):
    path.write_text(json.dumps(data))
    return str(path)


def mlx_cfg(**fields):
    cfg = RunConfig(framework="mlx", global_batch_size=12, **fields)  # splits over 1 to 4 ranks
    cfg.validate()
    return cfg


# ---- the communication stream -------------------------------------------------------------------

def test_communication_stream_is_the_cpu_stream_when_asked_and_mlx_default_otherwise_on_a_cpu():
    import mlx.core as mx

    from mlx_impl.comm import communication_stream

    mx.set_default_device(mx.cpu)
    assert communication_stream(RunConfig(communication_stream="cpu")) == mx.cpu
    assert communication_stream(RunConfig(communication_stream="default")) is None
    assert communication_stream(RunConfig(communication_stream="auto")) is None  # only a Metal GPU needs it
    with pytest.raises(UserError, match="communication_stream"):
        RunConfig.from_dict({"communication_stream": "gpu"})
    with pytest.raises(UserError, match="nccl"):
        RunConfig.from_dict({"device": "cuda", "communication_stream": "cpu"})


def test_a_compiled_function_counts_its_collectives_at_every_call_not_only_at_its_trace():
    """pp x tp's last stage compiles its vjp with tp's all-reduces inside (mlx_impl/pp.py): every piece's call
    counts them, as an uncompiled call would; a new shape is a new trace, counted once more."""
    import mlx.core as mx

    from mlx_impl.comm import CommCounter

    comm = CommCounter()

    def doubling():  # a new function each time: mx.compile keeps one trace per function
        def doubled(x):
            comm.add(x)  # what tp's layers do as they trace an all-reduce
            return x * 2
        return doubled

    plain = mx.compile(doubling())
    for _ in range(3):
        mx.eval(plain(mx.ones((4, 8))))
    assert comm.traced_bytes == 4 * 8 * 4  # compiled alone: the trace's count only
    comm.traced_bytes = 0
    each = comm.each_call(mx.compile(doubling()))
    for _ in range(3):
        mx.eval(each(mx.ones((4, 8))))
    assert comm.traced_bytes == 3 * 4 * 8 * 4
    for _ in range(2):
        mx.eval(each(mx.ones((2, 8))))
    assert comm.traced_bytes == 3 * 4 * 8 * 4 + 2 * 2 * 8 * 4

# ---- jaccl, nccl and the hostfile forms --------------------------------------------------------

@pytest.mark.parametrize("backend", ["jaccl", "jaccl-ring"])
def test_jaccl_backends_start_through_mlx_launch_with_the_hostfile_and_the_rank_environment(backend, tmp_path):
    hostfile = write(tmp_path / "hosts.json", MESH)
    cfg = mlx_cfg(nproc=3, backend=backend, hostfile=hostfile, threads_per_rank=2)
    check_hostfile(cfg)
    argv, extra, _ = build_command(cfg, tmp_path / "run")
    split = argv.index("--")
    launcher, entry = argv[:split], argv[split + 1:]
    assert "mlx.launch" in " ".join(launcher) or "distributed_utils.launch" in " ".join(launcher)
    assert launcher[launcher.index("--backend") + 1] == backend
    assert launcher[launcher.index("--hostfile") + 1] == hostfile
    # Ranks on other Macs get only what mlx.launch exports, so the thread settings travel as --env.
    assert "--env=OMP_NUM_THREADS=2" in launcher and extra["OMP_NUM_THREADS"] == "2"
    assert entry == [sys.executable, "-m", "mlx_impl.launch", str(tmp_path / "run")]


def test_mlx_nccl_on_one_machine_lets_mlx_launch_set_the_nccl_environment(tmp_path):
    argv, _, _ = build_command(mlx_cfg(nproc=2, device="cuda"), tmp_path)
    launcher = argv[:argv.index("--")]
    assert launcher[launcher.index("--backend") + 1] == "nccl" and launcher[launcher.index("-n") + 1] == "2"
    assert int(launcher[launcher.index("--nccl-port") + 1]) > 0  # a free one: mlx.launch's 12345 may be taken


def test_jaccl_ring_starts_ranks_with_the_jaccl_init_backend():
    from mlx_impl.launch import INIT_BACKEND

    assert INIT_BACKEND.get("jaccl-ring") == "jaccl" and INIT_BACKEND.get("ring", "ring") == "ring"


def test_both_hostfile_forms_parse_and_the_object_form_names_the_backend_unless_the_flag_does(tmp_path):
    listed = write(tmp_path / "list.json", MESH)
    wrapped = write(tmp_path / "object.json", {"backend": "jaccl-ring", "envs": ["MLX_METAL_FAST_SYNCH=1"],
                                               "hosts": MESH})
    assert read_mlx_hostfile(listed).hosts == read_mlx_hostfile(wrapped).hosts
    assert read_mlx_hostfile(wrapped).envs == ["MLX_METAL_FAST_SYNCH=1"]
    assert effective_backend(mlx_cfg(nproc=3, hostfile=listed)) == "ring"
    assert with_hostfile_backend(mlx_cfg(nproc=3, hostfile=wrapped)).backend == "jaccl-ring"
    assert effective_backend(mlx_cfg(nproc=3, hostfile=wrapped, backend="ring")) == "ring"
    # The node-rank ring (no ssh) reads the object form too, ports assigned as mlx.launch does.
    assert ring_hosts(mlx_cfg(nnodes=3, hostfile=wrapped)) == [["10.0.0.1:32323"], ["10.0.0.2:32324"],
                                                               ["10.0.0.3:32325"]]


def _without(index, peer):
    hosts = json.loads(json.dumps(MESH))
    hosts[index]["rdma"][peer] = None
    return hosts


@pytest.mark.parametrize("backend, hosts, expected", [
    ("ring", [{"ssh": "mac1"}, {"ssh": "mac2", "ips": ["10.0.0.2"]}, {"ssh": "mac3", "ips": ["10.0.0.3"]}],
     'give mac1 "ips"'),
    ("jaccl", [{**h, "rdma": h["rdma"][:2]} for h in MESH], "one RDMA device per host"),
    ("jaccl", [{**MESH[0], "rdma": ["rdma_en2", "rdma_en3", "rdma_en4"]}, *MESH[1:]], "null for itself"),
    ("jaccl", _without(0, 2), "mac1 lists no RDMA device toward mac3"),
    ("jaccl", [{**MESH[0], "ips": []}, *MESH[1:]], r"rank 0 \(mac1\) needs"),
    ("ring", {"hosts": MESH, "bogus": 1}, "unknown keys: bogus"),
])
def test_a_hostfile_that_does_not_fit_its_backend_is_refused_naming_the_problem(backend, hosts, expected, tmp_path):
    cfg = mlx_cfg(nproc=3, backend=backend, hostfile=write(tmp_path / "hosts.json", hosts))
    with pytest.raises(UserError, match=expected):
        check_hostfile(cfg)


def test_jaccl_ring_needs_rdma_toward_its_neighbours_only(tmp_path):
    four = [{"ssh": f"mac{i}", "ips": [f"10.0.0.{i}"],
             "rdma": [None if j == i or (j - i) % 4 == 2 else f"rdma_en{j}" for j in range(4)]} for i in range(4)]
    check_hostfile(mlx_cfg(nproc=4, backend="jaccl-ring", hostfile=write(tmp_path / "ring.json", four)))
    with pytest.raises(UserError, match="no RDMA device toward mac2"):
        check_hostfile(mlx_cfg(nproc=4, backend="jaccl", hostfile=str(tmp_path / "ring.json")))


# ---- MPS and the end-of-run step check ---------------------------------------------------------

def test_torch_on_mps_with_several_ranks_is_accepted_and_noted_as_running_on_the_cpu():
    cfg = RunConfig.from_dict({"framework": "torch", "device": "mps", "nproc": 2})
    assert cfg.resolved_backend == "gloo"
    assert "ran on the CPU with gloo" in device_note(cfg)
    assert device_note(cfg.replace(nproc=1)) is None and device_note(RunConfig(nproc=2)) is None


class FakeTrainer:
    """all_sum as if the other ranks had reported `others`."""

    def __init__(self, others):
        self.others = others

    def all_sum(self, values, over="data"):
        return np.asarray(values) + sum(np.array([1.0, step]) for step in self.others)


def test_ranks_that_end_at_different_steps_fail_and_ranks_at_the_same_step_pass():
    check_same_step(FakeTrainer([]), 10)
    check_same_step(FakeTrainer([10, 10, 10]), 10)
    with pytest.raises(TrainingError, match="ranks ended at different steps: this rank at 10"):
        check_same_step(FakeTrainer([12]), 10)


@pytest.mark.skipif(sys.platform == "darwin", reason="a Mac's MLX may have jaccl")
def test_a_backend_this_mlx_lacks_exits_2_with_one_line_before_anything_starts(cache_dir, tmp_path):
    two_macs = [{**MESH[0], "rdma": [None, "rdma_en3"]}, {**MESH[1], "rdma": ["rdma_en3", None]}]
    hostfile = write(tmp_path / "hosts.json", {"backend": "jaccl", "hosts": two_macs})
    proc = dpcompare_here("run", *FAST, "--framework", "mlx", "--nproc", 2, "--hostfile", hostfile, "--out",
                          tmp_path / "out", cache_dir=cache_dir)
    assert proc.returncode == 2 and proc.stdout == ""
    assert proc.stderr.count("\n") == 1 and "--backend jaccl" in proc.stderr and "has no jaccl backend" in proc.stderr
    assert not (tmp_path / "out").exists()


def test_compare_refuses_a_device_one_framework_lacks_before_the_first_run(cache_dir, tmp_path):
    """Every run of the matrix is checked up front: a device the second framework lacks exits 2 with one
    line and writes nothing, instead of a failed run after the first one has trained."""
    from compare.machine.backends import PROBES, PROBE_IMPORTS, probe_flags

    # all() stops at the first framework that sees none: torch, whose import takes seconds, is asked only where
    # MLX sees a GPU.
    if all(probe_flags(PROBE_IMPORTS[fw] + f"; print(int(bool({PROBES[key]})))", 1)[0]
           for fw, key in (("mlx", ("mlx", "device")), ("torch", ("torch", "cuda")))):
        pytest.skip("both frameworks see a GPU here")
    out = tmp_path / "cmp"
    proc = dpcompare_here("compare", *FAST, "--steps", 1, "--frameworks", "mlx,torch", "--nproc", 1,
                          "--device", "cuda", "--out", out, cache_dir=cache_dir)
    assert proc.returncode == 2 and proc.stdout == "", proc.stderr
    assert proc.stderr.count("\n") == 1 and "--device cuda" in proc.stderr and "sees no cuda device" in proc.stderr
    assert not out.exists()


def test_a_local_mpi_job_starts_mpirun_by_name_so_the_native_kernel_compiler_stays_first_on_path(tmp_path,
                                                                                                 monkeypatch):
    """Open MPI takes an absolute mpirun path as --prefix and puts its bin/ first on the ranks' PATH, ahead of the
    -march=native g++ (measured: 0 of 36 kernels of an MPI job had AVX, 36 of 36 started by name); across hosts
    the prefix is what finds Open MPI there, so a hostfile job keeps the path."""
    from compare.machine import environment

    monkeypatch.setattr(environment, "mpirun", lambda: "/opt/ompi/bin/mpirun")
    monkeypatch.setattr(environment, "mpirun_is_openmpi", lambda: True)
    argv, extra, _ = build_command(mlx_cfg(nproc=2, backend="mpi"), tmp_path / "run")
    assert argv[0] == "mpirun" and ("PATH" in argv) == ("PATH" in extra)  # the wrapper's PATH, where there is one
    hostfile = tmp_path / "hosts.txt"
    hostfile.write_text("mac1 slots=1\nmac2 slots=1\n")
    argv, _, _ = build_command(mlx_cfg(nproc=2, backend="mpi", hostfile=str(hostfile)), tmp_path / "run2")
    assert argv[0] == "/opt/ompi/bin/mpirun"


def test_ring_ports_are_chosen_below_the_ephemeral_range_and_skip_a_taken_one(monkeypatch):
    """The ranks' listening ports come from below the kernel's ephemeral range, which outgoing connections take
    from (a CI run lost an MLX ring rank to one taken between its choice and its bind), and a block with a port
    already listened on is never given."""
    import socket

    from compare.machine import environment

    low = environment._ephemeral_low()
    for _ in range(20):
        base = environment.free_port_block(3)
        assert environment.LISTEN_PORTS_FROM <= base and base + 3 <= low
    # the only candidates B..B+4 (a range starting at B+7): hold B..B+3, so B+4 is the one block. B is a window free
    # now, drawn at random: the suite's other runs listen on blocks of this range, and a port one of them closed
    # stays taken for a minute (TIME_WAIT), so a fixed window failed a CI run ("no block of 3 free ports").
    draw = random.Random()
    while True:
        start = draw.randrange(environment.LISTEN_PORTS_FROM, low - 7)
        if all(environment._port_free(port) for port in range(start, start + 7)):
            break
    monkeypatch.setattr(environment, "LISTEN_PORTS_FROM", start)
    monkeypatch.setattr(environment, "_ephemeral_low", lambda: start + 7)
    held = []
    try:
        for port in range(start, start + 4):
            sock = socket.socket()
            sock.bind(("127.0.0.1", port))
            sock.listen()
            held.append(sock)
        assert environment.free_port_block(3) == start + 4
    finally:
        for sock in held:
            sock.close()
