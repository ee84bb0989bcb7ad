"""Multi-node flags are checked before anything starts (the two-host jobs are in tests/integration)."""
import pytest

from helpers import FAST, dpcompare_here


@pytest.mark.parametrize("args, expected", [
    (("--framework", "mlx", "--nnodes", 2), "needs --hostfile"),
    (("--framework", "mlx", "--nnodes", 2, "--hostfile", "HOSTS", "--nproc", 2), "--nproc 1"),
    (("--framework", "mlx", "--nnodes", 4, "--hostfile", "HOSTS"), "lists 2 nodes but --nnodes is 4"),
    (("--framework", "mlx", "--nnodes", 2, "--hostfile", "BAD"), "is not IP:PORT"),
    (("--framework", "mlx", "--nnodes", 2, "--hostfile", "HOSTS", "--backend", "mpi"), "ring backend"),
    (("--framework", "torch", "--nnodes", 2), "--rdzv-endpoint"),
    (("--framework", "torch", "--nnodes", 2, "--node-rank", 2, "--rdzv-endpoint", "h:1"), "node_rank 2"),
])
def test_multi_node_flags_are_checked_before_anything_starts(args, expected, cache_dir, tmp_path):
    (tmp_path / "HOSTS").write_text('[["10.0.0.1:5000"], ["10.0.0.2:5000"]]')
    (tmp_path / "BAD").write_text('[["10.0.0.1"], ["10.0.0.2:5000"]]')
    args = [tmp_path / a if a in ("HOSTS", "BAD") else a for a in args]
    proc = dpcompare_here("run", *FAST, *args, "--out", tmp_path / "run", cache_dir=cache_dir)
    assert proc.returncode == 2 and expected in proc.stderr, proc.stderr
    assert not (tmp_path / "run").exists()


def test_a_bad_host_wait_is_refused_before_anything_starts(cache_dir, tmp_path):
    hostfile = tmp_path / "hosts.json"
    hostfile.write_text('[{"ssh": "127.0.0.1", "ips": ["127.0.0.1"]}, {"ssh": "mac2", "ips": ["10.0.0.2"]}]')
    proc = dpcompare_here("run", *FAST, "--framework", "mlx", "--nproc", 2, "--hostfile", hostfile, "--max-restarts", 1,
                          "--out", tmp_path / "run", cache_dir=cache_dir, env={"DPCOMPARE_HOST_WAIT_S": "soon"})
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1, proc.stderr
    assert "DPCOMPARE_HOST_WAIT_S='soon': expected the seconds a restart waits for a host" in proc.stderr
    assert not (tmp_path / "run").exists()
