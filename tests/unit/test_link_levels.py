"""The cost model over two link levels (common/costmodel/levels.py, axes.py) and `dpcompare plan --meshes`
(compare/plan/meshes.py): each axis's collectives go on the level its ranks share, a machine's card is shared by
the axis's groups on it, one link is the old model, and the plan lists every valid mesh per N with its memory
and names the fastest and the fastest that fits."""
import json

import pytest
from costmodel_fixtures import SPEC, summary, write_run

from common.costmodel.calibrate import calibrate
from common.costmodel.levels import TwoLevelLink, axis_link, links_from_record
from common.costmodel.links import Collective, Link
from common.costmodel.predict import predict
from common.model.spec import ModelSpec
from common.parallel import layout
from common.parallel.mesh import Mesh
from common.parallel.pipeline_timing import micro_step_s
from compare.cli import main
from compare.plan.meshes import candidate, factorisations, mesh_plan

FAST, SLOW = Link("fast", 10e-6, 1e9), Link("slow", 100e-6, 1e7)
TWO_PER_MACHINE = TwoLevelLink(FAST, SLOW, 2)
# tiny refuses most meshes (2 layers, 2 kv heads); this one splits 16 ways on every axis
WIDE = {**SPEC, "n_layers": 16, "n_heads": 16, "n_kv_heads": 16, "ffn_dim": 256}


def levels(mesh: str, links=TWO_PER_MACHINE) -> dict:
    grid = Mesh.parse(mesh)
    return {name: (a.level, a.share, a.link.bandwidth_Bps) for name in grid.names
            for a in [axis_link(links, grid, name)]}


def test_tp_inside_a_machine_takes_the_inner_link_and_dp_across_shares_the_outer_card():
    # ranks 0,1 | 2,3: tp groups (0,1) (2,3) stay inside; dp groups (0,2) (1,3) both cross at once
    assert levels("dp=2,tp=2") == {"dp": ("outer", 2, 5e6), "tp": ("inner", 1, 1e9)}
    # pp outermost: its groups (0,2) (1,3) cross; dp (0,1) (2,3) inside
    assert levels("pp=2,dp=2") == {"pp": ("outer", 2, 5e6), "dp": ("inner", 1, 1e9)}
    # one ring over all four crosses the card once each way: not shared
    assert levels("dp=4") == {"dp": ("outer", 1, 1e7)}


def test_an_axis_partly_inside_a_machine_is_paced_by_its_crossing_hop_shared_by_its_groups_there():
    four = TwoLevelLink(FAST, SLOW, 4)  # two machines of 4: ranks 0-3 | 4-7
    # dp groups (0,2,4,6) and (1,3,5,7): each spans both machines, both on each machine
    assert levels("dp=4,tp=2", four) == {"dp": ("outer", 2, 5e6), "tp": ("inner", 1, 1e9)}
    assert levels("pp=2,tp=4", four) == {"pp": ("outer", 4, 2.5e6), "tp": ("inner", 1, 1e9)}
    assert levels("dp=2,tp=2", four) == {"dp": ("inner", 1, 1e9), "tp": ("inner", 1, 1e9)}  # one machine holds all


def test_a_pipeline_crosses_each_boundary_at_its_own_level_and_only_its_slow_hop_costs_the_slow_link():
    """pp x4 on machines of two: stages 0|1 and 2|3 share a machine, 1|2 cross. The fill and drain pay one slow
    hop of three each way, not three (sitting 8, torch pp x4 over 100mbit/1gbit: +83 % -> +57 %; sitting 6:
    +34 % -> +15 %, docs/scaling.md)."""
    pp4 = axis_link(TWO_PER_MACHINE, Mesh.parse("pp=4"), "pp").link
    assert [hop.name for hop in pp4.stage_hops] == ["fast", "slow", "fast"]
    assert not axis_link(TWO_PER_MACHINE, Mesh.parse("pp=2,dp=2"), "pp").link.stage_hops  # its one boundary crosses
    cal = calibrate(summary("torch", 1), ModelSpec.from_dict(WIDE))
    two_level, all_slow = (predict(cal, "pp", 4, links) for links in (TWO_PER_MACHINE, SLOW))
    all_fast = predict(cal, "pp", 4, FAST)
    assert all_fast.exposed_comm_s < two_level.exposed_comm_s < all_slow.exposed_comm_s
    # played with each boundary's own send (pipeline_timing.py): the middle one slow, the others fast
    send = [c for c in all_slow.collectives if c.kind == "send"][0].nbytes
    lay, w = layout("pp", 4), cal.workload
    slot = (cal.forward_s + cal.backward_s) * lay.rank_work_fraction(w) / (w.pp_microbatches + 3)
    f_s, b_s = (slot * x / (cal.forward_s + cal.backward_s) for x in (cal.forward_s, cal.backward_s))
    hops = [FAST.send_s(send, 4), SLOW.send_s(send, 4), FAST.send_s(send, 4)]
    played = micro_step_s("1f1b", 4, w.pp_microbatches, f_s, b_s, hops, batched=True) - \
        micro_step_s("1f1b", 4, w.pp_microbatches, f_s, b_s, [0.0] * 3, batched=True)  # torch's order
    assert two_level.exposed_comm_s == pytest.approx(played, rel=1e-9)


def test_one_link_puts_every_axis_on_it():
    assert levels("pp=2,dp=2", FAST) == {"pp": ("one link", 1, 1e9), "dp": ("one link", 1, 1e9)}


def test_two_equal_levels_predict_what_one_link_predicts_and_a_mesh_sums_its_axes_on_their_links():
    cal = calibrate(summary("torch", 1), ModelSpec.from_dict(WIDE))
    for strategy in ("ddp", "fsdp", "tp", "pp"):
        one = predict(cal, strategy, 2, SLOW)
        assert predict(cal, strategy, 2, TwoLevelLink(SLOW, SLOW, 1)).step_s == pytest.approx(one.step_s)
    p = predict(cal, "mesh", 4, TWO_PER_MACHINE, mesh="dp=2,tp=2")
    tp = [c for c in p.collectives if c.what == "activations"]
    dp = [c for c in p.collectives if c.what == "gradients"]
    assert tp and dp and p.levels == {"dp": "outer shared by 2", "tp": "inner"}
    halved = Link("slow/2", SLOW.hop_latency_s, SLOW.bandwidth_Bps / 2)
    assert p.comm_s == pytest.approx(sum(c.seconds(FAST, 2) for c in tp) + sum(c.seconds(halved, 2) for c in dp))
    # tp's all-reduces sit on the critical path whatever the calibration's overlap
    assert p.exposed_comm_s >= sum(c.seconds(FAST, 2) for c in tp)


def test_a_two_level_runs_record_gives_both_levels_and_an_unsplit_inner_level_falls_back_to_tcp():
    record = {"requested": "100mbit", "allreduce": {"world_size": 4, "latency_s": 7e-3, "bandwidth_Bps": 8e6},
              "group_size": 2, "inner": {"requested": "1gbit", "tcp_bandwidth_Bps": 1.2e8, "tcp_latency_s": 3e-5,
                                         "allreduce": {"world_size": 2, "latency_s": 2e-3, "bandwidth_Bps": 1.19e8}}}
    links = links_from_record(record)
    assert isinstance(links, TwoLevelLink) and links.group_size == 2
    assert links.outer.bandwidth_Bps == pytest.approx(8e6 * 6 / 4) and links.inner.bandwidth_Bps == pytest.approx(1.19e8)
    record["inner"]["allreduce"] = {"world_size": 2, "latency_s": None, "bandwidth_Bps": None, "note": "ring"}
    assert links_from_record(record).inner.bandwidth_Bps == 1.2e8  # the TCP probe's


def test_a_shared_outer_axis_takes_the_rate_its_groups_measured_crossing_at_once_and_an_unshared_one_the_jobs():
    """Sitting 13 (docs/scaling.md): where MPI's whole-job all-reduce over 4 ranks put the 100 Mbit/s hop at
    12 MB/s, its two 2-rank groups crossing at once can move 4 MB/s each, not 12 / 2."""
    record = {"requested": "100mbit", "allreduce": {"world_size": 4, "latency_s": 6e-4, "bandwidth_Bps": 8e6},
              "group_size": 2, "inner": {"requested": "1gbit", "tcp_bandwidth_Bps": 1.2e8, "tcp_latency_s": 3e-5},
              "allreduce_across": {"world_size": 2, "concurrent": 2, "latency_s": 4e-4, "bandwidth_Bps": 4e6}}
    links = links_from_record(record)
    assert isinstance(links, TwoLevelLink) and links.across is not None
    assert levels("dp=2,tp=2", links)["dp"] == ("outer", 2, pytest.approx(4e6))  # the groups' own: 2 ranks, 1 hop
    assert axis_link(links, Mesh.parse("dp=2,tp=2"), "dp").link.hop_latency_s == pytest.approx(4e-4 / 2)
    assert levels("dp=4", links)["dp"] == ("outer", 1, pytest.approx(8e6 * 6 / 4))  # one ring: the whole job's
    assert "2 groups at once" in links.source
    # machines of 4, an axis shared by 2 of the 4 groups measured at once: the card's rate, 4 x 4 MB/s, halved
    four = TwoLevelLink(FAST, SLOW, 4, across=Link("across", 1e-4, 4e6))
    assert levels("dp=4,tp=2", four)["dp"] == ("outer", 2, pytest.approx(8e6))
    record["allreduce_across"] = {"world_size": 2, "latency_s": None, "bandwidth_Bps": None, "note": "ring"}
    assert links_from_record(record).across is None
    assert levels("dp=2,tp=2", links_from_record(record))["dp"] == ("outer", 2, pytest.approx(8e6 * 6 / 4 / 2))


def test_a_shared_axis_collectives_wait_for_the_slowest_rank_of_the_groups_and_a_pipelines_sends_do_not():
    """Sitting 15 (docs/scaling.md): dp=2,tp=2 over two levels waited for the last of its ranks at each sync, not for
    rank 0's usual time. The record's `last_rank` (each call's slowest rank, fitted) prices an outer axis's
    collectives; a pipeline's sends keep rank 0's figure, and so does everything where it was not measured."""
    record = {"requested": "100mbit", "allreduce": {"world_size": 4, "latency_s": 6e-4, "bandwidth_Bps": 8e6},
              "group_size": 2, "inner": {"requested": "1gbit", "tcp_bandwidth_Bps": 1.2e8, "tcp_latency_s": 3e-5},
              "allreduce_across": {"world_size": 2, "concurrent": 2, "latency_s": 4e-4, "bandwidth_Bps": 4e6,
                                   "last_rank": {"latency_s": 5e-4, "bandwidth_Bps": 3e6}}}
    links = links_from_record(record)
    assert links.across_last is not None and "slowest rank" in links.source
    dp = axis_link(links, Mesh.parse("dp=2,tp=2"), "dp").link
    assert dp.bandwidth_Bps == pytest.approx(4e6) and dp.last_rank.bandwidth_Bps == pytest.approx(3e6)
    grads = Collective("all_reduce", 10**6, 1, "gradients")
    assert grads.seconds(dp, 2) == pytest.approx(5e-4 + 1e6 / 3e6)  # the slowest rank's all-reduce
    pp = axis_link(links, Mesh.parse("pp=2,dp=2"), "pp").link
    acts = Collective("send", 10**5, 8, "activations")
    assert acts.seconds(pp, 2) == pytest.approx(8 * (4e-4 / 2 + 1e5 / 4e6))  # rank 0's per-hop figures
    assert acts.seconds(pp, 2) < Collective("send", 10**5, 8, "").seconds(pp.last_rank, 2)
    del record["allreduce_across"]["last_rank"]
    unmeasured = axis_link(links_from_record(record), Mesh.parse("dp=2,tp=2"), "dp").link
    assert unmeasured.last_rank is None and grads.seconds(unmeasured, 2) == pytest.approx(4e-4 + 1e6 / 4e6)


def test_a_pipelines_sends_cross_at_the_tcp_streams_rate_where_the_job_measured_one_shared_as_the_card_is():
    """MPI's all-reduce across two machines of two gave 4.1 MB/s a group where one TCP stream had 12.1 MB/s for
    both; MLX's pp=2,tp=2 sends crossed at about 6 (docs/scaling.md). A send pays no all-reduce overheads: it takes
    the stream's rate, shared by the pipelines on a card; the collectives keep the all-reduce's figure."""
    record = {"requested": "100mbit", "tcp_bandwidth_Bps": 12e6, "tcp_latency_s": 1e-5,
              "allreduce": {"world_size": 4, "latency_s": 6e-4, "bandwidth_Bps": 8e6},
              "group_size": 2, "inner": {"requested": "1gbit", "tcp_bandwidth_Bps": 1.2e8, "tcp_latency_s": 3e-5},
              "allreduce_across": {"world_size": 2, "concurrent": 2, "latency_s": 4e-4, "bandwidth_Bps": 4e6}}
    links = links_from_record(record)
    pp = axis_link(links, Mesh.parse("pp=2,tp=2"), "pp")
    assert (pp.level, pp.share) == ("outer", 2) and pp.link.bandwidth_Bps == pytest.approx(4e6)
    assert pp.link.send_s(10**5, 2) == pytest.approx(4e-4 / 2 + 1e5 / 6e6)  # the stream's 12 MB/s, halved
    alone = axis_link(links, Mesh.parse("pp=4"), "pp").link  # one pipeline: the whole stream at its slow hop
    assert alone.stage_hops[1].send_s(10**5, 4) == pytest.approx(6e-4 / 6 + 1e5 / 12e6)
    del record["tcp_bandwidth_Bps"]  # not measured (a real link, or an older run): the all-reduce's figure
    assert axis_link(links_from_record(record), Mesh.parse("pp=2,tp=2"), "pp").link.send_s(10**5, 2) == \
        pytest.approx(4e-4 / 2 + 1e5 / 4e6)

def test_the_reports_link_line_gives_the_groups_crossing_at_once_beside_both_levels():
    from compare.report.render import link_line

    link = {"note": "two machines", "tcp_bandwidth_Bps": 12e6, "allreduce": {"world_size": 4, "latency_s": 6e-4,
                                                                            "bandwidth_Bps": 8e6},
            "inner": {"tcp_bandwidth_Bps": 1.2e8},
            "allreduce_across": {"world_size": 2, "concurrent": 2, "latency_s": 4e-4, "bandwidth_Bps": 4e6}}
    line = link_line({"label": "mlx dp2xtp2 x4", "link": link})
    assert "its all-reduce 8.0 MB/s over 4 ranks (96 Mbit/s per hop)" in line
    assert line.endswith("across machines, 2 groups at once, its all-reduce 4.0 MB/s over 2 ranks (32 Mbit/s per hop)")
    link["allreduce_across"]["last_rank"] = {"latency_s": 5e-4, "bandwidth_Bps": 3.2e6}
    assert link_line({"label": "x", "link": link}).endswith("(32 Mbit/s per hop), 3.2 MB/s by each call's slowest rank")
    del link["allreduce_across"]
    assert "across machines" not in link_line({"label": "x", "link": link})


def test_the_plan_enumerates_every_factorisation_with_one_data_axis_in_rank_order():
    assert factorisations(1) == [()]
    four = ("pp", "dp", "fsdp", "tp")  # the axes before cp; cp's meshes below
    assert {m for m in factorisations(4, four)} == {
        (("pp", 4),), (("dp", 4),), (("fsdp", 4),), (("tp", 4),), (("pp", 2), ("dp", 2)), (("pp", 2), ("fsdp", 2)),
        (("pp", 2), ("tp", 2)), (("dp", 2), ("tp", 2)), (("fsdp", 2), ("tp", 2))}
    for mesh in factorisations(16):
        names = [a for a, _ in mesh]
        assert names == sorted(names, key=("pp", "dp", "fsdp", "cp", "tp").index) and not {"dp", "fsdp"} <= set(names)
    # one axis 4; pairs (pp-dp, pp-fsdp, pp-tp, dp-tp, fsdp-tp) x (2x8, 4x4, 8x2) 15; pp-dp-tp, pp-fsdp-tp x 3 orders 6
    assert len(factorisations(16, four)) == len(set(factorisations(16, four))) == 25
    assert (("dp", 2), ("cp", 2)) in factorisations(4) and (("cp", 4),) in factorisations(4)
    assert candidate(()) == ("ddp", "") and candidate((("dp", 4),)) == ("ddp", "")
    assert candidate((("pp", 2), ("dp", 2))) == ("mesh", "pp=2,dp=2")


def test_plan_at_8_and_16_lists_the_valid_meshes_with_memory_and_names_the_fastest_that_fits(tmp_path, capsys):
    run = write_run(tmp_path / "torch-n1", summary("torch", 1))
    (run / "run_config.json").write_text(json.dumps({"config": summary("torch", 1)["config"], "spec": WIDE,
                                                     "world_size": 1}))
    cal = calibrate(summary("torch", 1), ModelSpec.from_dict(WIDE))
    free = mesh_plan(cal, TWO_PER_MACHINE, [8, 16], None)
    fastest = {n: next(r for r in free["rows"] if r["label"] == free["best"][n]["fastest"]) for n in (8, 16)}
    # a memory limit just under the fastest mesh's: the fastest that fits is another, and fits
    limit = min(r["memory_bytes"]["total"] for r in fastest.values()) - 1
    plan = mesh_plan(cal, TWO_PER_MACHINE, [8, 16], limit)
    for n in (8, 16):
        listed = [r for r in plan["rows"] if r["world_size"] == n]
        assert len(listed) >= 4 and all(r["memory_bytes"]["total"] > 0 and r["levels"] for r in listed)
        assert {r["label"] for r in listed} | {label for label, _ in plan["refused"].get(n, [])} == \
            {",".join(f"{a}={s}" for a, s in m) for m in factorisations(n)}
        best = plan["best"][n]
        assert best["fastest"] == min(listed, key=lambda r: r["step_s"])["label"]
        fitting = [r for r in listed if r["fits"]]
        assert best["fastest_fitting"] == (min(fitting, key=lambda r: r["step_s"])["label"] if fitting else None)
    assert any(plan["best"][n]["fastest"] != plan["best"][n]["fastest_fitting"] for n in (8, 16))
    code = main(["plan", "--from", str(run), "--meshes", "--nproc", "8,16", "--link-gbps", "0.1", "--latency-us",
                 "100", "--link-gbps-inner", "10", "--latency-us-inner", "5", "--group-size", "4",
                 "--device-memory-gb", str(limit / 1e9), "--out", str(tmp_path / "plan")])
    printed = capsys.readouterr().out
    assert code == 0 and "N=16: fastest " in printed and "fastest that fits" in printed and "tp inner" in printed
    saved = json.loads((tmp_path / "plan" / "plan.json").read_text())
    assert saved["link"]["group_size"] == 4 and saved["best"]["16"]["fastest"]
    # pp x tp, under-predicted in every loopback sitting (docs/scaling.md), carries its caveat; no other mesh does
    caveated = {r["label"] for r in saved["predictions"] if r.get("caveat")}
    assert caveated and all("pp=" in m and "tp=" in m for m in caveated)
    assert caveated == {r["label"] for r in saved["predictions"] if "pp=" in r["label"] and "tp=" in r["label"]}
    assert sum(line.startswith("† pp x tp: ") for line in printed.splitlines()) == 1
    assert any(line.startswith(("pp=2,tp=4 †", "pp=4,tp=2 †")) for line in printed.splitlines())


@pytest.mark.parametrize("flags, message", [
    (["--link-gbps-inner", "10", "--latency-us-inner", "5"], "a two-level link needs --group-size N"),
    (["--group-size", "2"], "--group-size needs the link inside a machine"),
    (["--group-size", "2", "--link-gbps-inner", "10"], "--link-gbps-inner and --latency-us-inner go together"),
])
def test_two_level_plan_flags_that_cannot_work_exit_2_in_one_line(tmp_path, capsys, flags, message):
    run = write_run(tmp_path / "torch-n1", summary("torch", 1))
    assert main(["plan", "--from", str(run), "--nproc", "4", *flags]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and message in err[0], err


def test_a_local_cpu_runs_compute_is_stretched_by_the_ranks_threads_per_core_and_nothing_else_is():
    from compare.plan import cores_shared_by

    run = {"world_size": 4, "threads_per_rank": 1, "machine": {"cpus": 2}, "device": "cpu", "config": {}}
    assert cores_shared_by(run) == 2.0
    assert cores_shared_by({**run, "world_size": 2}) == 1.0  # a core each
    assert cores_shared_by({**run, "threads_per_rank": 2}) == 4.0
    assert cores_shared_by({**run, "device": "cuda:0"}) == 1.0
    assert cores_shared_by({**run, "config": {"hostfile": "hosts.json"}}) == 1.0
    cal = calibrate(summary("torch", 1), ModelSpec.from_dict(WIDE))
    alone, shared = (predict(cal, "ddp", 4, SLOW, cores_shared_by=k) for k in (1.0, 2.0))
    assert shared.compute_s == pytest.approx(2 * alone.compute_s) and shared.exposed_comm_s == alone.exposed_comm_s
    # a pipeline's stages idle in its bubble and leave the core to others: less than twice, never under alone
    alone, shared = (predict(cal, "pp", 4, SLOW, cores_shared_by=k) for k in (1.0, 2.0))
    assert alone.compute_s < shared.compute_s < 2 * alone.compute_s
    # ... unless its backend polls while it waits (MLX's ring, compare/machine/sharing.py): the idle slots keep
    # the core, so the whole stage, bubble and all, is stretched
    mlx = calibrate(summary("mlx", 1), ModelSpec.from_dict(WIDE))
    alone, shared = (predict(mlx, "pp", 4, SLOW, backend="ring", cores_shared_by=k) for k in (1.0, 2.0))
    assert shared.compute_s == pytest.approx(2 * alone.compute_s)
    assert predict(mlx, "pp", 4, SLOW, backend="mpi", cores_shared_by=2).compute_s < shared.compute_s
