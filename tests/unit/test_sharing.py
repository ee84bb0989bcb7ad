"""The note before an MLX ring job whose ranks fill this machine's cores (compare/machine/sharing.py): said where
the ring's polling must take a core from a rank that computes, and nowhere else."""
import pytest

from common.config import RunConfig
from compare.machine import sharing


def note(cores: int, **fields) -> str | None:
    return sharing.ring_polling_note(RunConfig.from_dict({"preset": "tiny", "framework": "mlx", **fields}), cores)


def test_the_note_names_the_ranks_threads_and_cores_where_the_ring_fills_them():
    line = note(2, nproc=4)
    assert line is not None and line.startswith("mlx x4 on the ring backend: 4 ranks of 1 thread fill this "
                                                "machine's 2 cores") and "0.33 s" in line
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


@pytest.mark.usefixtures("no_figures")
def test_the_report_warns_of_the_rings_polling_for_mlx_ring_runs_that_fill_the_cores(tmp_path):
    """The same rule in the report, for what a reader of it was not shown on the terminal (fake runs: 2 CPUs)."""
    from unit.fake_runs import make_run

    from compare.report.parity import Tolerances
    from compare.report.writer import write_report

    runs = [make_run(tmp_path, "mlx", 1), make_run(tmp_path, "mlx", 2), make_run(tmp_path, "torch", 2),
            make_run(tmp_path, "mlx", 2, name="mlx-mpi-n2", config={"backend": "mpi"})]
    warnings = write_report(runs, tmp_path / "report", Tolerances(), {"peaks": {}})["verdicts"]["warnings"]
    polling = [w for w in warnings if "polls its sockets" in w]
    assert len(polling) == 1 and polling[0].startswith("mlx x2 ring: MLX's ring polls its sockets") \
        and "fill the 2 CPUs" in polling[0], warnings
    assert "MLX's ring polls its sockets" in (tmp_path / "report" / "report.md").read_text()
