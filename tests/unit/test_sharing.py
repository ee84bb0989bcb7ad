"""The note before an MLX ring job whose ranks fill this machine's cores (compare/machine/sharing.py): said where
the ring's polling must take a core from a rank that computes, and nowhere else."""
from common.config import RunConfig
from compare.machine import sharing


def note(cores: int, **fields) -> str | None:
    return sharing.ring_polling_note(RunConfig.from_dict({"preset": "tiny", "framework": "mlx", **fields}), cores)


def test_the_note_names_the_ranks_threads_and_cores_where_the_ring_fills_them():
    line = note(2, nproc=4)
    assert line is not None and line.startswith("mlx x4 on the ring backend: 4 ranks of 1 thread fill this "
                                                "machine's 2 cores") and "0.37 s" in line
    assert note(4, nproc=2, threads_per_rank=2).startswith("mlx x2 on the ring backend: 2 ranks of 2 threads")


def test_no_note_with_a_core_to_spare_another_backend_one_rank_torch_or_other_machines():
    assert note(4, nproc=2) is None  # 2 one-thread ranks on 4 cores: the polling has cores of its own
    assert note(2, nproc=2, backend="mpi") is None
    assert note(1, nproc=1) is None
    assert sharing.ring_polling_note(RunConfig.from_dict({"preset": "tiny", "framework": "torch", "nproc": 4}), 2) \
        is None
    # ranks on other machines too: how many share these cores is not known here
    assert note(1, nproc=1, nnodes=2, node_rank=0, hostfile="hosts.json") is None
    assert note(2, nproc=2, hostfile="hosts.json") is None
