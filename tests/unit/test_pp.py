"""Pipeline parallelism (--strategy pp), without starting ranks: the split, the schedules (simulated with
sends that wait for their receives), the analytic bubble, the estimate, and bad input refused with exit 2."""
import pytest

from common.config import RunConfig
from common.errors import UserError
from common.parallel.pipeline import bubble_fraction, compute_order, split_idle, stage_layers, stage_of
from common.parallel.pipeline_timing import micro_step_s
from common.model.spec import preset
from common.parallel import check_strategy, comm_bytes_per_step_estimate, data_parallel
from common.model.weights import parameter_shapes
from helpers import FAST, dpcompare_here


# ---- the split ----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("layers, stages, expected", [(2, 2, [(0, 1), (1, 2)]), (5, 2, [(0, 3), (3, 5)]),
                                                      (7, 3, [(0, 3), (3, 5), (5, 7)]), (4, 4, [(0, 1), (1, 2), (2, 3), (3, 4)])])
def test_blocks_are_split_contiguously_and_as_evenly_as_possible(layers, stages, expected):
    assert [(r.start, r.stop) for r in (stage_layers(layers, stages, s) for s in range(stages))] == expected


def test_every_parameter_lives_on_exactly_one_stage_embedding_first_head_last():
    spec = preset("tiny").with_(n_layers=5)
    owners = {name: stage_of(name, spec.n_layers, 3) for name in parameter_shapes(spec)}
    assert owners["model.embed_tokens.weight"] == 0
    assert owners["model.norm.weight"] == owners["lm_head.weight"] == 2
    assert [owners[f"model.layers.{i}.mlp.up_proj.weight"] for i in range(5)] == [0, 0, 1, 1, 2]


# ---- the schedules ------------------------------------------------------------------------------------------
def _simulate(schedule: str, stages: int, micro: int, forward_s: float = 1.0, backward_s: float = 2.0):
    """Every stage's operations played with rendezvous sends (a send completes only together with its receive,
    at the later of the two stages' clocks; sends take no time): the step's length when all stages finish, None
    on a deadlock. The cost model's own player (common/parallel/pipeline_timing.py), in its strictest mode."""
    try:
        return micro_step_s(schedule, stages, micro, forward_s, backward_s, [0.0] * (stages - 1), rendezvous=True)
    except RuntimeError:
        return None


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_schedules_never_deadlock_even_when_every_send_waits_for_its_receive(schedule):
    for stages in range(2, 9):
        for micro in range(1, 17):
            assert _simulate(schedule, stages, micro) is not None, (schedule, stages, micro)


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_each_schedule_idles_exactly_the_analytic_bubble_when_stages_are_even(schedule):
    """Forward 1, backward 2 on every stage, sends free: the step lasts (M + p - 1) pieces, so a stage idles
    (p - 1) / (M + p - 1). The gpipe schedule before this test idled 0.385 at p=2, M=8 (0.111 analytic)."""
    for stages in range(2, 6):
        for micro in (1, 2, 4, 8, 16):
            window = _simulate(schedule, stages, micro)
            assert 1 - micro * 3.0 / window == pytest.approx(bubble_fraction(stages, micro)), (stages, micro)


def test_each_stage_runs_every_forward_and_backward_once_backward_after_forward():
    for schedule in ("gpipe", "1f1b"):
        for stage in range(4):
            order = compute_order(schedule, stage, 4, 6)
            assert sorted(order) == sorted([("F", i) for i in range(6)] + [("B", i) for i in range(6)])
            assert all(order.index(("F", i)) < order.index(("B", i)) for i in range(6))


def test_1f1b_keeps_at_most_p_minus_s_micro_batches_in_flight_gpipe_all():
    def in_flight(order):
        live = peak = 0
        for kind, _ in order:
            live += 1 if kind == "F" else -1
            peak = max(peak, live)
        return peak

    assert [in_flight(compute_order("1f1b", s, 4, 8)) for s in range(4)] == [4, 3, 2, 1]
    assert [in_flight(compute_order("gpipe", s, 4, 8)) for s in range(3)] == [8, 8, 8]


def test_the_busiest_stage_idles_the_bubble_and_the_others_wait_on_it_beyond_that():
    assert split_idle([0.25, 0.12]) == {"busiest_stage": 1, "bubble": 0.12, "imbalance": [pytest.approx(0.13), 0.0]}
    assert split_idle([0.3, None, 0.2])["busiest_stage"] == 2 and split_idle([None, None]) is None


def test_the_analytic_bubble_is_p_minus_1_over_m_plus_p_minus_1():
    assert bubble_fraction(2, 2) == pytest.approx(1 / 3)
    assert bubble_fraction(2, 4) == pytest.approx(0.2)
    assert bubble_fraction(2, 8) == pytest.approx(1 / 9)
    assert bubble_fraction(4, 4) == pytest.approx(3 / 7)


def test_pp_reads_the_whole_batch_on_every_rank_and_estimates_the_activations_of_one_boundary():
    assert data_parallel("pp", 1, 2) == (0, 1)
    spec = preset("tiny")
    # global batch 8 = micro-batch 4 x grad accum 2; seq 32: the activations (8, 32, dim) in float32
    assert comm_bytes_per_step_estimate("pp", spec, 2, 4, 32, 2) == 8 * 32 * spec.dim * 4
    assert comm_bytes_per_step_estimate("pp", spec, 1, 8, 32, 1) == 0
    # bf16: the activations cross in the compute dtype (measured: 32768 bytes sent per step on tiny, as here)
    assert comm_bytes_per_step_estimate("pp", spec, 2, 8, 32, 1, "bfloat16") == 8 * 32 * spec.dim * 2


# ---- bad input ----------------------------------------------------------------------------------------------
def test_pp_refuses_more_stages_than_blocks_naming_the_numbers_and_runs_tied_embeddings():
    with pytest.raises(UserError, match=r"4 stages .* model\.n_layers = 2 < 4"):
        check_strategy("pp", preset("tiny"), 4)
    with pytest.raises(UserError, match="at least 2"):
        check_strategy("pp", preset("tiny"), 1)
    check_strategy("pp", preset("tiny"), 2)
    check_strategy("pp", preset("tiny").with_(tie_embeddings=True), 2)  # the embedding group (test_tied_pp.py)


def test_pp_microbatches_must_divide_each_micro_steps_batch():
    RunConfig.from_dict({"strategy": "pp", "nproc": 2, "global_batch_size": 8, "grad_accum": 2,
                         "pp_microbatches": 4})
    with pytest.raises(UserError, match=r"--pp-microbatches 3 .* global batch size 8 / grad accum 2 = 4"):
        RunConfig.from_dict({"strategy": "pp", "nproc": 2, "global_batch_size": 8, "grad_accum": 2,
                             "pp_microbatches": 3})
    with pytest.raises(UserError, match="unknown pp_schedule 'zb'"):
        RunConfig.from_dict({"strategy": "pp", "nproc": 2, "pp_schedule": "zb"})
    RunConfig.from_dict({"strategy": "ddp", "pp_microbatches": 3})  # only pp cuts the batch


@pytest.mark.parametrize("extra, named", [
    (("--nproc", 3), "--strategy pp over 3 stages needs at least one transformer block per stage, but "
                     "model.n_layers = 2 < 3"),
    (("--nproc", 2, "--pp-microbatches", 3), "--pp-microbatches 3 must divide"),
    (("--nproc", 2, "--pp-schedule", "interleaved"), "unknown pp_schedule 'interleaved'")])
def test_pp_that_cannot_run_exits_2_with_one_line_and_writes_nothing(extra, named, cache_dir, tmp_path):
    out = tmp_path / "never"
    proc = dpcompare_here("run", *FAST, "--framework", "torch", "--strategy", "pp", *extra, "--steps", 2,
                          "--out", out, cache_dir=cache_dir)
    assert proc.returncode == 2, proc.stderr
    assert named in proc.stderr and len(proc.stderr.strip().splitlines()) == 1
    assert not out.exists()


@pytest.mark.parametrize("fields, pieces", [
    ({"mesh": "dp=2,pp=2", "nproc": 4, "global_batch_size": 8, "grad_accum": 2, "framework": "torch"}, 2),
    ({"strategy": "pp", "nproc": 2, "global_batch_size": 8}, 4),
    ({"strategy": "pp", "nproc": 2, "global_batch_size": 6, "framework": "mlx"}, 3),
    ({"strategy": "pp", "nproc": 4, "global_batch_size": 10, "framework": "torch"}, 5),  # a piece per stage
    ({"strategy": "pp", "nproc": 4, "global_batch_size": 10, "framework": "mlx"}, 2),
])
def test_the_default_pieces_are_the_largest_count_up_to_4_dividing_the_micro_step_and_torch_gets_one_per_stage(
        fields, pieces):
    backend = "mpi" if fields.get("framework") == "mlx" and "mesh" in fields else "auto"
    cfg = RunConfig.from_dict({"preset": "tiny", "backend": backend, **fields, "model": {"n_layers": 4}})
    assert cfg.pp_microbatches == 0 and cfg.pp_pieces == pieces
    with pytest.raises(UserError, match="must divide the batch of each micro-step"):  # an explicit misfit: exit 2
        cfg.replace(pp_microbatches=pieces + 1 if pieces < 5 else 3)
