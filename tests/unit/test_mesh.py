"""--mesh: named axes in one canonical order (pp, data, tp), the groups that share each axis, and the composed
Layout (common/parallel/composed.py) answering what the one-axis objects answer."""
import math
from dataclasses import replace

import pytest
from costmodel_fixtures import SPEC, summary

from common.config import RunConfig
from common.costmodel.calibrate import calibrate
from common.costmodel.links import Link
from common.costmodel.workload import Workload
from common.errors import UserError
from common.model.spec import ModelSpec
from common.parallel import describe_mesh, layout
from common.parallel.layout import total_parameters
from common.parallel.mesh import Mesh

TINY = ModelSpec.from_dict(SPEC)


def test_axes_take_the_canonical_order_whatever_order_they_are_written_in():
    assert Mesh.parse("tp=2,dp=3").axes == (("dp", 3), ("tp", 2))
    assert Mesh.parse("dp=2, pp=4").text == "pp=4,dp=2"
    assert Mesh.parse("tp=2,fsdp=2").names == ("fsdp", "tp")
    for bad, words in (("dp=2,dp=2", "twice"), ("xp=2", "AXIS=SIZE"), ("dp=two", "whole number"),
                       ("dp=0", "at least 1"), ("dp=2,fsdp=2", "data axes"), ("", "names no axis")):
        with pytest.raises(UserError, match=words):
            Mesh.parse(bad)


def test_tp_ranks_are_neighbours_and_pp_ranks_farthest_apart():
    mesh = Mesh.parse("pp=2,dp=2,tp=2")
    assert mesh.groups("tp") == [(0, 1), (2, 3), (4, 5), (6, 7)]
    assert mesh.groups("dp") == [(0, 2), (1, 3), (4, 6), (5, 7)]
    assert mesh.groups("pp") == [(0, 4), (1, 5), (2, 6), (3, 7)]
    assert mesh.group(5, "dp") == (5, 7) and mesh.coordinates(5) == {"pp": 1, "dp": 0, "tp": 1}
    assert describe_mesh("dp=2,tp=2") == ["dp=2: [0,2] [1,3]", "tp=2: [0,1] [2,3]"]
    # every rank is in exactly one group of each axis
    for name in mesh.names:
        assert sorted(r for g in mesh.groups(name) for r in g) == list(range(8))


def test_the_data_coordinate_slices_the_batch_and_model_ranks_of_a_replica_read_the_same():
    assert [layout("mesh", 4, "dp=2,tp=2").data_parallel(r) for r in range(4)] == [(0, 2), (0, 2), (1, 2), (1, 2)]
    assert [layout("mesh", 4, "dp=2,pp=2").data_parallel(r) for r in range(4)] == [(0, 2), (1, 2), (0, 2), (1, 2)]
    assert layout("mesh", 4, "fsdp=2,tp=2").dp_size == 2
    # the one-axis objects are unchanged
    assert [layout("ddp", 4).data_parallel(r) for r in range(4)] == [(r, 4) for r in range(4)]
    assert layout("tp", 2).data_parallel(1) == (0, 1) and layout("pp", 2).dp_size == 1


def test_state_work_and_traffic_compose_per_axis():
    w = Workload(TINY, 32, 8, grad_accum=2, framework="mlx")
    total = total_parameters(TINY)
    tp2, pp2 = layout("tp", 2), layout("pp", 2)
    dptp = layout("mesh", 4, "dp=2,tp=2")
    assert dptp.local_parameters(TINY) == tp2.local_parameters(TINY)
    assert dptp.work_fraction(w) == pytest.approx(tp2.work_fraction(w) / 2)
    assert layout("mesh", 4, "fsdp=2,tp=2").local_parameters(TINY) == pytest.approx(tp2.local_parameters(TINY) / 2)
    assert layout("mesh", 4, "dp=2,pp=2").state_fraction(w) == pytest.approx(pp2.local_parameters(TINY) / total)
    axes = {a.axis: a for a in dptp.axis_collectives(w)}
    assert {a: axes[a].group_size for a in axes} == {"dp": 2, "tp": 2}
    # tp's all-reduces carry one data rank's rows: half of one-axis tp's at the same global batch
    (tp_act,) = axes["tp"].collectives
    assert tp_act.nbytes * 2 == tp2.collectives(w)[0].nbytes and tp_act.calls == tp2.collectives(w)[0].calls
    # dp averages the gradients of the rank's tp share
    (grads,) = axes["dp"].collectives
    assert grads.nbytes * grads.calls == pytest.approx(4 * tp2.local_parameters(TINY), abs=grads.calls)
    assert dptp.collectives(w) == axes["dp"].collectives + axes["tp"].collectives


def test_pp_x_tp_splits_each_stages_blocks_over_its_tp_group():
    mesh = Mesh.parse("tp=2,pp=2")
    # stage s's tp rank i talks to stage s+1's tp rank i: the pp groups pair equal tp coordinates
    assert mesh.groups("tp") == [(0, 1), (2, 3)] and mesh.groups("pp") == [(0, 2), (1, 3)]
    pptp, pp2 = layout("mesh", 4, "pp=2,tp=2"), layout("pp", 2)
    pptp.check(TINY)
    shapes = __import__("common.model.weights", fromlist=["x"]).parameter_shapes(TINY)
    split = {k for k in shapes if k.split(".")[-2] in ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj",
                                                      "o_proj", "down_proj")}
    stages = [("model.embed", "model.layers.0."), ("model.layers.1.", "model.norm", "lm_head")]
    held = [sum(math.prod(s) // (2 if k in split else 1) for k, s in shapes.items() if k.startswith(prefixes))
            for prefixes in stages]
    assert pptp.local_parameters(TINY) == max(held) < pp2.local_parameters(TINY)
    # the slowest stage's FLOPs (its block over tp, the head whole on the last), stretched by the bubble
    w = Workload(TINY, 32, 8, grad_accum=2, pp_microbatches=4)
    assert pp2.work_fraction(w) / 2 < pptp.work_fraction(w) < pp2.work_fraction(w)
    axes = {a.axis: a for a in pptp.axis_collectives(w)}
    (tp_act,) = axes["tp"].collectives
    tp2 = layout("tp", 2).collectives(w)[0]
    # one of the two blocks per stage, once per pipeline piece (4 a micro-step) on a piece's rows
    assert (tp_act.nbytes, tp_act.calls) == (tp2.nbytes // 4, tp2.calls // 2 * 4)
    assert axes["pp"].collectives == pp2.collectives(w)
    # rank 0 counts the first stage's sends and its tp group's 4 all-reduces per block and micro-step
    assert pptp.comm_bytes_per_step_estimate(TINY, 4, 32, 2) == \
        pp2.comm_bytes_per_step_estimate(TINY, 4, 32, 2) + 4 * 1 * 2 * (4 * 32 * 64 * 4)
    with pytest.raises(UserError, match="tp=3 does not divide model.n_heads = 4"):
        layout("mesh", 6, "pp=2,tp=3").check(TINY)


def test_three_axes_are_a_pipeline_of_tp_split_stages_per_dp_replica():
    """pp x dp x tp at 8 ranks: what pp x tp holds and computes, on half the rows; tp's and pp's traffic at one data
    rank's rows, dp's all-reduce of the rank's stage share; refused combinations name it among the supported."""
    w = Workload(TINY, 32, 8, grad_accum=2, pp_microbatches=2, framework="mlx")
    three, pptp = layout("mesh", 8, "pp=2,dp=2,tp=2"), layout("mesh", 4, "pp=2,tp=2")
    three.check(TINY)
    assert three.local_parameters(TINY) == pptp.local_parameters(TINY)
    assert three.work_fraction(w) == pytest.approx(pptp.work_fraction(w) / 2)
    assert three.busy_fraction(w) == pytest.approx(pptp.busy_fraction(w) / 2)
    axes, two = ({a.axis: a for a in lay.axis_collectives(w)} for lay in (three, pptp))
    assert {a: axes[a].group_size for a in axes} == {"pp": 2, "dp": 2, "tp": 2}
    for axis in ("pp", "tp"):  # the same calls, each carrying half the rows
        assert [(2 * c.nbytes, c.calls) for c in axes[axis].collectives] == \
            [(c.nbytes, c.calls) for c in two[axis].collectives]
    (grads,) = axes["dp"].collectives
    assert grads.nbytes * grads.calls == pytest.approx(4 * pptp.local_parameters(TINY), abs=grads.calls)
    # rank 0 counts pp x tp's payload (at its data rank's micro-batch, as given) plus dp's all-reduce of its stage's gradients
    assert three.comm_bytes_per_step_estimate(TINY, 4, 32, 1) == pytest.approx(
        pptp.comm_bytes_per_step_estimate(TINY, 4, 32, 1) + 4 * pptp.rank0_model_share(TINY) * total_parameters(TINY),
        abs=4)
    with pytest.raises(UserError, match="composing pp x fsdp x tp is not supported; supported meshes: .*pp x dp x tp"):
        layout("mesh", 8, "pp=2,fsdp=2,tp=2").check(TINY)


def test_a_replicas_pipeline_waits_as_a_pipeline_alone_on_that_replicas_rows():
    """pp=2,dp=2 at a global batch of 32 is, on each dp replica, pp x2 at 16: the same pieces cross each boundary
    and each piece's slot is the rank's own compute, half the stage's whole-batch work. Over a link where a
    piece's send outlasts its slot, a slot counted at the whole batch hid part of the wait (MLX's pipelines over
    two levels with a core per rank ran 17-37 % slower than predicted, docs/scaling.md "Sitting 14"). Where ranks
    share cores the slot is as long as the piece's compute runs there. (MLX's order of operations: stage_ops.)"""
    cal = calibrate(summary("mlx", 1), TINY)
    w = replace(cal.workload, global_batch_size=32, pp_microbatches=4)
    whole = replace(cal, workload=w, forward_s=0.2, backward_s=0.4)
    half = replace(whole, workload=replace(w, global_batch_size=16), forward_s=0.1, backward_s=0.2)
    piece = layout("pp", 2).collectives(half.workload)[0].nbytes
    slot = (half.forward_s + half.backward_s) * layout("pp", 2).work_fraction(half.workload) / 5
    link = Link("slow", 0.0, piece / (1.5 * slot))  # a send takes 1.5 slots: the slot's length shows
    mesh = layout("mesh", 4, "pp=2,dp=2")
    (pp_axis,) = [a for a in mesh.axis_collectives(w) if a.axis == "pp"]
    assert pp_axis.collectives[0].nbytes == piece
    waited = mesh.axis_exposed_comm_s(whole, pp_axis, link, 0.0)
    assert waited == pytest.approx(layout("pp", 2).exposed_comm_s(half, layout("pp", 2).collectives(half.workload),
                                                                   link, 0.0), rel=1e-12)
    # link-bound: the 2M sends cross nearly one after another, a little of the pieces' compute between them
    assert 2 * 4 * 1.5 * slot - 2 * slot - 1e-12 <= waited <= 2 * 4 * 1.5 * slot
    # counted at the whole batch's slot, twice the rank's own, the wait would differ: the invariant has teeth
    doubled = replace(half, forward_s=0.2, backward_s=0.4)
    assert layout("pp", 2).exposed_comm_s(doubled, layout("pp", 2).collectives(half.workload), link, 0.0) != \
        pytest.approx(waited, rel=1e-3)
    # four ranks on two cores: each piece's compute takes twice as long, and more of the sends hide behind it
    shared = mesh.axis_exposed_comm_s(replace(whole, cores_shared_by=2.0), pp_axis, link, 0.0)
    assert shared < waited


def test_the_estimate_is_what_rank_0_counts_on_each_axis():
    # dp x tp: tp's activations at one data rank's micro-batch, plus dp's all-reduce of the tp share's gradients
    tp_part = layout("tp", 2).comm_bytes_per_step_estimate(TINY, 4, 32, 1)
    est = layout("mesh", 4, "dp=2,tp=2").comm_bytes_per_step_estimate(TINY, 4, 32, 1)
    assert est == tp_part + int(4 * layout("tp", 2).local_parameters(TINY))
    # dp x pp: the first stage's sends plus the dp all-reduce of the first stage's gradients
    first_stage = sum(math.prod(s) for k, s in __import__("common.model.weights", fromlist=["x"])
                      .parameter_shapes(TINY).items() if k.startswith(("model.embed", "model.layers.0.")))
    assert layout("mesh", 4, "dp=2,pp=2").comm_bytes_per_step_estimate(TINY, 4, 32, 1) == \
        layout("pp", 2).comm_bytes_per_step_estimate(TINY, 4, 32, 1) + 4 * first_stage
    assert layout("mesh", 4, "fsdp=2,tp=2").comm_bytes_per_step_estimate(TINY, 4, 32, 1) is None


def test_bad_meshes_are_refused_in_one_line_naming_the_numbers():
    cases = [("dp=2,tp=3", 6, "tp=3 does not divide model.n_heads = 4"),
             ("pp=4,dp=2", 8, "pp=4 stages need one transformer block each at least, but model.n_layers = 2 < 4"),
             ("dp=3,tp=2", 4, "holds 3 x 2 = 6 ranks, but the run has 4"),
             ("pp=2,fsdp=2", 4, "composing pp x fsdp is not supported"),
             ("dp=1,tp=2", 2, "axis dp=1 splits nothing")]
    for mesh, n, words in cases:
        with pytest.raises(UserError, match=words) as err:
            layout("mesh", n, mesh).check(TINY)
        assert "\n" not in str(err.value)
    # fsdp shards axis 0 of each block tensor as a tp rank holds it: gate_proj's 6 rows / tp 2 = 3, not by 2
    spec = ModelSpec.from_dict({**SPEC, "ffn_dim": 6})
    layout("fsdp", 2).check(spec)  # whole, 6 rows split in two
    with pytest.raises(UserError, match="fsdp=2 cannot shard model.layers.0.mlp.gate_proj.weight: axis 0 holds "
                                        "3 rows on each tp rank"):
        layout("mesh", 4, "fsdp=2,tp=2").check(spec)


def test_config_takes_a_mesh_and_a_one_axis_mesh_is_that_strategy():
    cfg = RunConfig.from_dict({"preset": "tiny", "nproc": 4, "mesh": "tp=2,dp=2", "framework": "torch"})
    assert (cfg.strategy, cfg.mesh, cfg.data_parallel_size, cfg.micro_batch_size) == ("mesh", "dp=2,tp=2", 2, 4)
    one = RunConfig.from_dict({"preset": "tiny", "nproc": 2, "mesh": "tp=2"})
    assert (one.strategy, one.mesh) == ("tp", "")
    assert RunConfig.from_dict({"preset": "tiny", "nproc": 4, "mesh": "dp=2,tp=2"}).resolved_backend == "mpi"
    with pytest.raises(UserError, match="ring backend cannot split"):
        RunConfig.from_dict({"preset": "tiny", "nproc": 4, "mesh": "dp=2,tp=2", "backend": "ring"})
    with pytest.raises(UserError, match="leave --strategy out"):
        RunConfig.from_dict({"preset": "tiny", "nproc": 4, "mesh": "dp=2,tp=2", "strategy": "fsdp"})
    with pytest.raises(UserError, match="composing pp x fsdp is not supported"):
        RunConfig.from_dict({"preset": "tiny", "nproc": 4, "mesh": "fsdp=2,pp=2"})
    assert RunConfig.from_dict({"preset": "tiny", "nproc": 4, "mesh": "tp=2,pp=2"}).mesh == "pp=2,tp=2"
    with pytest.raises(UserError, match="needs --mesh"):
        RunConfig.from_dict({"preset": "tiny", "nproc": 4, "strategy": "mesh"})


def test_compare_runs_a_mesh_at_its_rank_count_under_a_label_naming_its_axes(tmp_path):
    from compare.matrix import expand_matrix

    base = RunConfig(nproc=4, framework="torch")
    configs, left_out = expand_matrix(base, ["torch"], ["ddp", "mesh"], ["float32"], [1, 2, 4], tmp_path, "tp=2,dp=2")
    assert [label for label, _ in configs] == ["torch x1", "torch x2", "torch x4", "torch dp2xtp2 x4"]
    cfg = configs[("torch dp2xtp2 x4", tmp_path / "torch-dp2xtp2-n4")]
    assert (cfg.strategy, cfg.mesh, cfg.data_parallel_size) == ("mesh", "dp=2,tp=2", 2)
    assert sorted(left_out) == ["torch dp2xtp2 x1 left out: dp2xtp2 needs 2 or more ranks (its reference is the "
                                "ddp run)", "torch dp2xtp2 x2 left out: --mesh dp=2,tp=2 runs on 4 ranks"]


def test_cp_beside_tp_or_pp_cuts_that_axis_work_and_traffic_by_the_sequence():
    """tp x cp, pp x cp (issue 77): the model axis's state, 1/cp of its work, activations and activation traffic;
    cp's exchanges of a tp rank's heads in its stage's blocks; the cp group averages the rank's model share."""
    spec = ModelSpec.from_dict({**SPEC, "n_heads": 4, "n_kv_heads": 4})
    w = Workload(spec, 32, 8, framework="torch")
    tp2, pp2, cp2 = layout("tp", 2), layout("pp", 2), layout("cp", 2)
    (q, kv, _) = cp2.collectives(w)
    for mesh, model in (("tp=2,cp=2", tp2), ("pp=2,cp=2", pp2)):
        both = layout("mesh", 4, mesh)
        both.check(spec)
        assert both.local_parameters(spec) == pytest.approx(model.local_parameters(spec))
        assert both.work_fraction(w) == pytest.approx(model.work_fraction(w) / 2)
        assert both.activation_bytes(w) == pytest.approx(model.activation_bytes(w) / 2)
        axes = {a.axis: a.collectives for a in both.axis_collectives(w)}
        own = axes["tp" if "tp" in mesh else "pp"]
        assert [c.nbytes * 2 for c in own] == [c.nbytes for c in model.collectives(w)]
        *exchanges, grads = axes["cp"]
        assert sum(c.nbytes * c.calls for c in exchanges) == pytest.approx(
            (q.nbytes * q.calls + kv.nbytes * kv.calls) / 2, rel=0.01)  # half the heads, or half the blocks
        assert grads.nbytes * grads.calls == pytest.approx(4 * both.local_parameters(spec), abs=grads.calls)
        assert both.payload_bytes_per_step(spec, 8, 32, 1, "float32") is None  # cp's exchanges: not counted
    # Ulysses splits a tp rank's heads over cp: tiny's 2 kv heads cannot go to tp x cp = 4 ranks
    with pytest.raises(UserError, match="tp x cp = 4 must divide model.n_kv_heads = 2; use --cp-attention ring") as err:
        RunConfig.from_dict({"preset": "tiny", "nproc": 4, "mesh": "tp=2,cp=2", "framework": "torch"})
    assert "\n" not in str(err.value)
    RunConfig.from_dict({"preset": "tiny", "nproc": 4, "mesh": "tp=2,cp=2", "model": {"n_kv_heads": 4}})
    RunConfig.from_dict({"preset": "tiny", "nproc": 4, "mesh": "cp=2,pp=2", "cp_attention": "ring"})


def test_ring_beside_tp_needs_only_tp_to_divide_the_heads():
    """Ring passes whole key/value blocks of the heads a tp rank holds; Ulysses splits them again over cp (issue
    77): tiny (4 heads, 2 kv heads) runs tp=2,cp=2 under ring, and Ulysses stays refused in one line."""
    both = layout("mesh", 4, "tp=2,cp=2")
    both.check(TINY, "ring")
    RunConfig.from_dict({"preset": "tiny", "nproc": 4, "mesh": "tp=2,cp=2", "cp_attention": "ring",
                         "framework": "torch"})
    for check in (lambda: both.check(TINY), lambda: both.check(TINY, "ulysses"),
                  lambda: RunConfig.from_dict({"preset": "tiny", "nproc": 4, "mesh": "tp=2,cp=2",
                                               "cp_attention": "ulysses"})):
        with pytest.raises(UserError, match=r"^--mesh cp=2,tp=2: Ulysses splits .* tp x cp = 4 must divide "
                                            r"model.n_kv_heads = 2") as err:
            check()
        assert "\n" not in str(err.value)
    # tp itself must still divide the heads, whatever the attention
    with pytest.raises(UserError, match="tp=4 does not divide model.n_kv_heads = 2"):
        layout("mesh", 8, "tp=4,cp=2").check(TINY, "ring")


def test_four_axes_are_pp_x_dp_x_tp_on_half_the_sequence_with_cp_averaging_before_dp():
    """pp=2,dp=2,cp=2,tp=2 (issue 77): pp x dp x tp's state, half its work, activations and model-axis traffic;
    cp's exchanges of a tp rank's heads in its stage's blocks; cp then dp each all-reduce the rank's stage share
    (the frameworks' two averages, mesh.py ContextParallelOver)."""
    spec = ModelSpec.from_dict({**SPEC, "n_heads": 4, "n_kv_heads": 4})
    w = Workload(spec, 32, 8, framework="torch", pp_microbatches=2)
    four, three = layout("mesh", 16, "pp=2,dp=2,cp=2,tp=2"), layout("mesh", 8, "pp=2,dp=2,tp=2")
    four.check(spec)
    four.check(TINY, "ring")  # ring: tp alone divides tiny's 2 kv heads
    with pytest.raises(UserError, match="tp x cp = 4 must divide model.n_kv_heads = 2"):
        four.check(TINY)
    assert four.local_parameters(spec) == pytest.approx(three.local_parameters(spec))
    assert four.work_fraction(w) == pytest.approx(three.work_fraction(w) / 2)
    assert four.activation_bytes(w) == pytest.approx(three.activation_bytes(w) / 2)
    axes, alone = ({a.axis: a.collectives for a in m.axis_collectives(w)} for m in (four, three))
    for name in ("pp", "tp"):
        assert [c.nbytes * 2 for c in axes[name]] == [c.nbytes for c in alone[name]]
    assert axes["dp"] == alone["dp"]
    *exchanges, grads = axes["cp"]
    assert [c.what for c in exchanges] == ["all-to-all q/out", "all-to-all k/v"]
    assert (grads.nbytes, grads.calls) == (alone["dp"][0].nbytes, alone["dp"][0].calls)
    assert RunConfig.from_dict({"preset": "tiny", "nproc": 16, "mesh": "tp=2,cp=2,dp=2,pp=2", "cp_attention": "ring",
                                "pp_microbatches": 2}).data_parallel_size == 2
