"""Host work per byte moved fitted on an N=2 run of a strategy (common/costmodel/fit.py), charged at N > 2 to that
strategy and to every mesh with its axis, and what compare's predictions fit on (compare/plan/predictions.py)."""
import json
from dataclasses import replace

import pytest
from costmodel_fixtures import SPEC, summary, write_run

from common.costmodel.calibrate import calibrate
from common.costmodel.fit import fit_host_costs, fit_one
from common.costmodel.links import loopback_link
from common.costmodel.predict import predict
from common.errors import UserError
from common.model.spec import ModelSpec
from compare.plan import add_predictions

SPEC4 = {**SPEC, "n_kv_heads": 4}
TINY = ModelSpec.from_dict(SPEC4)  # tp over 4 ranks splits the kv heads
PER_BYTE = 2e-9  # 2 ms per MB moved
PER_CALL = 3e-4  # 0.3 ms per collective call


def moved(collectives) -> int:
    return sum(c.calls * c.nbytes for c in collectives)


def measured_at(cal, strategy, n, extra_per_byte=0.0, mesh="", extra_per_call=0.0):
    """A summary of `strategy` x n in cal's framework whose step is the bare prediction plus `extra_per_byte` per
    byte its collectives move and `extra_per_call` per call."""
    s = summary(cal.workload.framework, 2, strategy)
    bare = predict(replace(cal, host_s_per_byte={"dp": 0.0, "tp": 0.0, "fsdp": 0.0, "pp": 0.0}), strategy, n,
                   loopback_link(s["backend"]), backend=s["backend"], mesh=mesh)
    s["world_size"] = s["config"]["nproc"] = n
    s["step_time_s"] = s["breakdown"]["step_s"] = (bare.step_s + extra_per_byte * moved(bare.collectives)
                                                   + extra_per_call * sum(c.calls for c in bare.collectives))
    return s


def test_the_fit_recovers_the_cost_per_byte_an_n2_run_pays_and_charges_it_at_n4_and_in_meshes():
    cal = calibrate(summary("mlx", 1), TINY)  # MLX's tp goes by the byte (torch's by the call: below)
    axis, seconds, note = fit_one(cal, measured_at(cal, "tp", 2, PER_BYTE), "tp2")
    assert (axis, note) == ("tp", "") and seconds == pytest.approx(PER_BYTE)
    fitted = fit_host_costs(cal, [("tp2", measured_at(cal, "tp", 2, PER_BYTE), 1.0)])
    assert fitted.fitted_on == {"tp": "tp2"}
    added = {}
    for strategy, n, mesh in (("tp", 2, ""), ("mesh", 4, "dp=2,tp=2")):
        with_fit, without = (predict(c, strategy, n, loopback_link("ring"), backend="ring", mesh=mesh) for c in (fitted, cal))
        tp = [c for c in with_fit.collectives if "activations" in c.what]
        assert tp and moved(tp) > 0
        added[mesh or strategy] = with_fit.compute_s - without.compute_s
        assert added[mesh or strategy] == pytest.approx(PER_BYTE * moved(tp))
    # the mesh's tp groups carry half the rows (dp=2 halves them) in as many calls: half the host work, where a
    # cost per call would charge it whole
    assert added["dp=2,tp=2"] == pytest.approx(added["tp"] / 2)
    # 4 ranks on 2 cores: the compute is stretched, the host work added once (docs/scaling.md)
    shared, alone = (predict(c, "tp", 4, loopback_link("ring"), cores_shared_by=2) for c in (fitted, cal))
    assert shared.compute_s > predict(fitted, "tp", 4, loopback_link("ring")).compute_s
    assert shared.compute_s - alone.compute_s == pytest.approx(PER_BYTE * moved(shared.collectives))


def test_torchs_tp_host_work_is_fitted_per_call_and_a_mesh_making_as_many_calls_pays_it_whole():
    """DTensor's dispatch around each all-reduce costs a call whatever it carries (TpLayout.host_unit): dp=2,tp=2's
    tp groups make tp x2's calls on half the rows, and pay what tp x2 paid."""
    cal = calibrate(summary("torch", 1), TINY)
    two = measured_at(cal, "tp", 2, 0.0, extra_per_call=PER_CALL)
    axis, seconds, note = fit_one(cal, two, "tp2")
    assert (axis, note) == ("tp", "") and seconds == pytest.approx(PER_CALL)
    fitted = fit_host_costs(cal, [("tp2", two, 1.0)])
    assert fitted.host_s_per_call == {"tp": pytest.approx(PER_CALL)} and "tp" not in fitted.host_s_per_byte
    added = {}
    for strategy, n, mesh in (("tp", 2, ""), ("mesh", 4, "dp=2,tp=2")):
        with_fit, without = (predict(c, strategy, n, loopback_link("gloo"), mesh=mesh) for c in (fitted, cal))
        tp = [c for c in with_fit.collectives if "activations" in c.what]
        added[mesh or strategy] = with_fit.compute_s - without.compute_s
        assert added[mesh or strategy] == pytest.approx(PER_CALL * sum(c.calls for c in tp))
    assert added["dp=2,tp=2"] == pytest.approx(added["tp"])


def test_a_fit_replaces_fsdps_constants_and_a_run_faster_than_its_bare_prediction_fits_zero():
    cal = calibrate(summary("torch", 1), TINY)
    fast = measured_at(cal, "fsdp", 2, 0.0)
    fast["step_time_s"] *= 0.9
    axis, seconds, note = fit_one(cal, fast, "fsdp2")
    assert (axis, seconds) == ("fsdp", 0.0) and "fitted as 0" in note
    zeroed = fit_host_costs(cal, [("fsdp2", fast, 1.0)])
    assert predict(zeroed, "fsdp", 4, loopback_link("gloo")).compute_s < predict(cal, "fsdp", 4,
                                                                                  loopback_link("gloo")).compute_s


@pytest.mark.parametrize("change,message", [
    (lambda s: s.update(world_size=1), "at 2 ranks or more"),
    (lambda s: s["config"].update(mesh="dp=2,tp=2"), "one strategy"),
    (lambda s: s.update(tokens_per_step=8192), "cannot be fitted against"),
    (lambda s: s.update(framework="mlx"), "cannot be fitted against"),
    (lambda s: s.update(status="failed"), "only a finished run"),
])
def test_a_run_that_cannot_be_fitted_on_is_refused_in_one_line(change, message):
    cal = calibrate(summary("torch", 1), TINY)
    s = measured_at(cal, "tp", 2, PER_BYTE)
    change(s)
    with pytest.raises(UserError, match=message):
        fit_one(cal, s, "run")


def test_compare_fits_an_n4_run_on_the_n2_run_of_its_axis_and_never_a_run_on_itself(tmp_path):
    cal = calibrate(summary("torch", 1), TINY)
    one = write_run(tmp_path / "torch-ddp-n1", summary("torch", 1), SPEC4)
    two = write_run(tmp_path / "torch-tp-n2", measured_at(cal, "tp", 2, PER_BYTE), SPEC4)
    four = write_run(tmp_path / "torch-tp-n4", measured_at(cal, "tp", 4, PER_BYTE), SPEC4)
    add_predictions([one, two, four])
    read = {d.name: json.loads((d / "summary.json").read_text())["prediction"] for d in (two, four)}
    assert read["torch-tp-n2"]["fitted_on"] == {}
    assert read["torch-tp-n4"]["fitted_on"] == {"tp": "torch-tp-n2"}
    # the N=4 run paid PER_BYTE per byte moved, as its N=2 run did: fitted, the prediction is its step
    assert read["torch-tp-n4"]["step_error"] == pytest.approx(0.0, abs=1e-9)
    assert read["torch-tp-n4"]["fit_note"] is None


def test_an_n4_run_its_comparison_cannot_fit_says_which_2_rank_runs_would_fit_it(tmp_path):
    """Without a 2-rank run of an axis's strategy the prediction is unfitted (pp=2,tp=2 on 2 shared cores: 21-49 %
    short on loopback), and the record, hence the report, names the runs that would fit it; over two levels (no
    2-rank run there), plan --fit."""
    from compare.plan.predictions import unfitted_note
    from compare.report.render import prediction_blocks

    cal = calibrate(summary("torch", 1), TINY)
    one = write_run(tmp_path / "torch-ddp-n1", summary("torch", 1), SPEC4)
    four = write_run(tmp_path / "torch-tp-n4", measured_at(cal, "tp", 4, PER_BYTE), SPEC4)
    add_predictions([one, four])
    record = json.loads((four / "summary.json").read_text())["prediction"]
    assert record["fitted_on"] == {} and "--strategies tp --nproc 1,2,4" in record["fit_note"]
    report = repr(prediction_blocks([{"label": "torch tp x4", "prediction": record, "step_time_ms": 100.0}]))
    assert "not fitted: no 2-rank tp run here" in report
    over_two_levels = measured_at(cal, "tp", 4, PER_BYTE) | {"link": {"requested": "100mbit", "group_size": 2}}
    assert "dpcompare plan --fit" in unfitted_note(over_two_levels, [])


@pytest.mark.parametrize("framework, extra, says", [("mlx", {"extra_per_byte": PER_BYTE}, "2 ms per MB"),
                                                     ("torch", {"extra_per_call": PER_CALL}, "0.3 ms per call")])
def test_the_report_says_what_a_prediction_was_fitted_on_in_its_strategys_unit(tmp_path, framework, extra, says):
    from compare.report.render import prediction_blocks

    cal = calibrate(summary(framework, 1), TINY)
    runs = [write_run(tmp_path / name, s, SPEC4) for name, s in (
        (f"{framework}-n1", summary(framework, 1)), (f"{framework}-tp-n2", measured_at(cal, "tp", 2, **extra)),
        (f"{framework}-tp-n4", measured_at(cal, "tp", 4, **extra)))]
    add_predictions(runs)
    rows = [{"label": d.name, "prediction": s.get("prediction"), "step_time_ms": 1e3 * s["step_time_s"]}
            for d in runs for s in [json.loads((d / "summary.json").read_text())]]
    text = repr(prediction_blocks(rows))
    assert f"{framework}-tp-n4: host work fitted on {framework}-tp-n2 (tp {says})" in text
    assert f"{framework}-tp-n2: host work" not in text
    # a run from before stop 47 stored every fit per call: a rebuilt report still reads it
    old = {**rows[2], "prediction": {**rows[2]["prediction"], "host_s_per_call": {"tp": 3e-3}}}
    del old["prediction"]["host_s_per_byte"]
    assert f"{framework}-tp-n4: host work fitted on {framework}-tp-n2 (tp 3 ms per call)" in \
        repr(prediction_blocks([old]))


def test_a_fit_on_ranks_that_shared_cores_is_the_same_cost_per_byte():
    """The host work is charged once, unstretched (predict.py), so a run whose ranks shared cores fits the same."""
    cal = calibrate(summary("mlx", 1), TINY)
    bare = predict(replace(cal, host_s_per_byte={"tp": 0.0}), "tp", 4, loopback_link("ring"), backend="ring",
                   cores_shared_by=2)
    s = measured_at(cal, "tp", 4, 0.0)
    s["step_time_s"] = bare.step_s + PER_BYTE * moved(bare.collectives)
    assert fit_one(cal, s, "tp4", cores_shared_by=2)[1] == pytest.approx(PER_BYTE)


def test_fitted_host_work_on_the_slow_link_between_machines_hides_behind_that_links_time():
    """dp=2,tp=2 on two machines of two: tp inside a machine (its host work added whole), dp across the slow link
    (its host work, mostly waiting, held by the link's own time: only what exceeds it is added)."""
    from common.costmodel.axes import axis_times
    from common.costmodel.levels import TwoLevelLink
    from common.costmodel.links import Link
    from common.parallel import layout

    cal = calibrate(summary("mlx", 1), TINY)  # tp per byte
    links = TwoLevelLink(Link.wire(10, 50), Link.wire(0.1, 200), 2)
    lay = layout("mesh", 4, "dp=2,tp=2")
    [dp] = [t for t in axis_times(lay, cal.workload, "native", links) if t.axis.axis == "dp"]
    assert dp.link.level == "outer"
    dp_waits = lay.axis_exposed_comm_s(cal, dp.axis, dp.link.link, dp.seconds)
    dp_bytes = moved(dp.axis.collectives)
    assert dp_waits > 0 and dp_bytes > 0
    bare = predict(cal, "mesh", 4, links, mesh="dp=2,tp=2")
    tp_bytes = moved(c for c in bare.collectives if "activations" in c.what)
    for dp_per_byte, dp_added in ((0.5 * dp_waits / dp_bytes, 0.0), (3 * dp_waits / dp_bytes, 2 * dp_waits)):
        fitted = replace(cal, host_s_per_byte={"dp": dp_per_byte, "tp": PER_BYTE})
        added = predict(fitted, "mesh", 4, links, mesh="dp=2,tp=2").compute_s - bare.compute_s
        assert added == pytest.approx(PER_BYTE * tp_bytes + dp_added)


def test_an_n2_run_is_fitted_against_the_n1_run_trained_beside_it_not_the_one_the_row_is_calibrated_on(tmp_path):
    """The machine ran 30 % slower while the fits' compare trained (the lent machine's N=1 step moved 0.139-0.214 s
    within one sitting): fitted against its own N=1 run, the N=2 run gives back the host work it paid; fitted
    against the faster N=1 of the row being predicted, that 30 % would have been taken for host work."""
    from compare.plan import fit_runs, n1_beside

    slow = summary("mlx", 1)
    slow["breakdown"] = {k: v * 1.3 if isinstance(v, float) else v for k, v in slow["breakdown"].items()}
    slow["step_time_s"] *= 1.3
    slow_cal, row_cal = calibrate(slow, TINY), calibrate(summary("mlx", 1), TINY)
    write_run(tmp_path / "fits" / "mlx-n1", slow, SPEC4)
    two = write_run(tmp_path / "fits" / "mlx-tp-n2", measured_at(slow_cal, "tp", 2, PER_BYTE), SPEC4)
    four = measured_at(row_cal, "tp", 4, PER_BYTE)
    beside = n1_beside(two, json.loads((two / "summary.json").read_text()))
    assert beside is not None and beside.forward_s == pytest.approx(slow_cal.forward_s)
    [fit] = fit_runs(four, {two: json.loads((two / "summary.json").read_text())})
    assert fit[3] is not None
    assert fit_host_costs(row_cal, [fit]).host_s_per_byte["tp"] == pytest.approx(PER_BYTE)
    assert fit_host_costs(row_cal, [fit[:3]]).host_s_per_byte["tp"] > 1.5 * PER_BYTE  # against the row's own N=1
    # no N=1 run beside it (a folder of N=2 runs alone): the row's calibration, as before
    lone = write_run(tmp_path / "lone" / "mlx-tp-n2", measured_at(row_cal, "tp", 2, PER_BYTE), SPEC4)
    assert n1_beside(lone, json.loads((lone / "summary.json").read_text())) is None


def test_a_mesh_is_fitted_on_the_n2_runs_of_its_own_backend_where_there_are_some(tmp_path):
    """MLX's meshes run on MPI and its one-axis runs on ring by default: with both at hand each axis is fitted on
    the run of the mesh's backend, and on the other's where its own has none."""
    from compare.plan import fit_runs

    cal = calibrate(summary("mlx", 1), TINY)
    candidates = {}
    for backend, extra in (("ring", 3 * PER_BYTE), ("mpi", PER_BYTE)):
        s = measured_at(cal, "tp", 2, extra)
        s["backend"] = backend
        candidates[write_run(tmp_path / backend / "mlx-tp-n2", s, SPEC4)] = s
    ddp = measured_at(cal, "ddp", 2)
    candidates[write_run(tmp_path / "ring" / "mlx-n2", ddp, SPEC4)] = ddp
    four = measured_at(cal, "mesh", 4, mesh="dp=2,tp=2")
    four["config"]["mesh"] = "dp=2,tp=2"
    for backend in ("mpi", "ring"):
        chosen = {o["strategy"]: o["backend"] for _, o, *_ in fit_runs(four | {"backend": backend}, candidates)}
        assert chosen == {"tp": backend, "ddp": "ring"}


def test_a_prediction_fitted_on_another_backend_says_so_in_the_record_and_in_plan(tmp_path, capsys):
    """MLX's mesh on MPI fitted on ring's N=2 runs (the default backend of one-axis runs) is told that a fit on MPI
    runs predicts it closer, in compare's record, its report and `plan --meshes`; fitted on MPI runs, nothing is said."""
    from compare.cli import main
    from compare.plan import fit_runs, predicted_record
    from compare.report.render import prediction_blocks

    base = summary("mlx", 1)
    source = write_run(tmp_path / "mlx-n1", base, SPEC4)
    (source / "run_config.json").write_text(json.dumps({"config": base["config"], "spec": SPEC4, "world_size": 1}))
    cal = calibrate(base, TINY)
    four = measured_at(cal, "mesh", 4, mesh="dp=2,tp=2") | {"backend": "mpi"}
    four["config"]["mesh"] = "dp=2,tp=2"
    said = {}
    for backend in ("ring", "mpi"):
        fits = {}
        for strategy in ("tp", "ddp"):
            s = measured_at(cal, strategy, 2, PER_BYTE) | {"backend": backend}
            fits[write_run(tmp_path / backend / f"mlx-{strategy}-n2", s, SPEC4)] = s
        record = predicted_record(source, four, "mesh", fit_runs(four, fits))
        said[backend] = record["fit_note"]
        report = repr(prediction_blocks([{"label": "mlx-dp2tp2-n4", "prediction": {**record, "from": source.name},
                                          "step_time_ms": 1e3 * four["step_time_s"]}]))
        assert (f"mlx-dp2tp2-n4: {said[backend]}" in report) == (backend == "ring")
        assert main(["plan", "--from", str(source), "--meshes", "--nproc", "4", "--out", str(tmp_path / backend / "p"),
                     *[a for d in fits for a in ("--fit", str(d))]]) == 0
        said[backend + " plan"] = [line for line in capsys.readouterr().err.splitlines() if "--backend mpi" in line]
    assert said["mpi"] is None and said["mpi plan"] == []
    assert "mlx-tp-n2 (ring)" in said["ring"] and "mlx-ddp-n2 (ring)" in said["ring"] and "--backend mpi" in said["ring"]
    assert len(said["ring plan"]) == 1 and said["ring plan"][0].startswith("note: MLX's meshes run on mpi or nccl")


@pytest.mark.parametrize("framework, turns", [("torch", 2), ("mlx", 1)])
def test_torchs_fsdp_host_work_takes_turns_on_shared_cores_and_a_fit_there_gives_it_back(framework, turns):
    """torch FSDP2's copies are the rank's own CPU work: 4 ranks on 2 cores pay its fitted host work twice (MLX's
    once, as every other axis's wait), and a run whose ranks shared cores fits the same cost per byte."""
    cal = calibrate(summary(framework, 1), TINY)
    s = measured_at(cal, "fsdp", 4)
    link, backend = loopback_link(s["backend"]), s["backend"]

    def at(per_byte, shared):
        return predict(replace(cal, host_s_per_byte={"fsdp": per_byte}), "fsdp", 4, link, backend=backend,
                       cores_shared_by=shared)

    host = PER_BYTE * moved(at(0.0, 1).collectives)
    assert at(PER_BYTE, 1).compute_s - at(0.0, 1).compute_s == pytest.approx(host)
    assert at(PER_BYTE, 2).compute_s - at(0.0, 2).compute_s == pytest.approx(turns * host)
    s["step_time_s"] = at(PER_BYTE, 2).step_s
    assert fit_one(cal, s, "fsdp4", cores_shared_by=2)[1] == pytest.approx(PER_BYTE)


def test_predict_runs_prints_each_run_against_compares_prediction_fitted_on_the_folders_n2_runs(tmp_path):
    """benchmarks/predict_runs.py over a folder of runs as benchmarks/mesh_table.sh leaves it: the N=4 mesh on MPI is
    predicted from the folder's N=1 run, fitted on its MPI N=2 runs (not ring/'s, which paid three times the host
    work), and comes out within 1 % where its step is the fitted cost; a missing folder exits 2 in one line."""
    import subprocess
    import sys
    from pathlib import Path

    cal = calibrate(summary("mlx", 1), TINY)
    write_run(tmp_path / "mlx-n1", summary("mlx", 1), SPEC4)
    for folder, backend, extra in ((tmp_path, "mpi", PER_BYTE), (tmp_path / "ring", "ring", 3 * PER_BYTE)):
        for strategy in ("tp", "ddp"):
            name = "mlx-tp-n2" if strategy == "tp" else "mlx-n2"
            write_run(folder / name, measured_at(cal, strategy, 2, extra) | {"backend": backend}, SPEC4)
    four = measured_at(cal, "mesh", 4, PER_BYTE, mesh="dp=2,tp=2") | {"backend": "mpi"}
    four["config"]["mesh"] = "dp=2,tp=2"
    write_run(tmp_path / "mlx-dp2tp2-loop", four, SPEC4)
    script = Path(__file__).resolve().parents[2] / "benchmarks" / "predict_runs.py"
    proc = subprocess.run([sys.executable, str(script), str(tmp_path)], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    [row] = [line for line in proc.stdout.splitlines() if line.startswith("| mlx-dp2tp2-loop ")]
    cells = [c.strip() for c in row.strip("|").split("|")]
    assert cells[1] == "mpi" and cells[2] == f"{four['step_time_s']:.2f}" and cells[3].startswith("-")
    # within 1 %: the runs were made over ring's loopback figures and are predicted over MPI's (their backend)
    assert abs(float(cells[4].split("(")[1].split()[0])) < 1 and sorted(cells[5].split(", ")) == ["ddp (mpi)", "tp (mpi)"]
    missing = subprocess.run([sys.executable, str(script), str(tmp_path / "nope")], capture_output=True, text=True)
    assert missing.returncode == 2 and len(missing.stderr.strip().splitlines()) == 1 and "nope" in missing.stderr


def test_a_fit_carried_to_another_model_charges_what_the_fit_run_paid_per_call():
    """plan --model: tiny's N=2 host work per byte, carried to a bigger model, costs what each of the fit run's
    calls cost (its bytes per call), for as many calls as the bigger model makes; the same model keeps the figure."""
    from common.costmodel.fit import carried_to
    from common.parallel import layout

    cal = calibrate(summary("torch", 1), TINY)
    fitted = fit_host_costs(cal, [("ddp2", measured_at(cal, "ddp", 2, PER_BYTE), 1.0)])
    assert carried_to(fitted, cal.workload, "gloo") == fitted
    big = replace(cal.workload, spec=TINY.with_(n_layers=8, dim=256, n_heads=4, n_kv_heads=4, ffn_dim=512))
    carried = carried_to(replace(fitted, workload=big), cal.workload, "gloo")
    small_calls, big_calls = (layout("ddp", 2).collectives(w) for w in (cal.workload, big))
    paid_by_the_fit_run = PER_BYTE * moved(small_calls) / sum(c.calls for c in small_calls)
    assert carried.host_s_per_byte["dp"] * moved(big_calls) == pytest.approx(
        paid_by_the_fit_run * sum(c.calls for c in big_calls))
    assert carried.host_s_per_byte["dp"] < fitted.host_s_per_byte["dp"]  # a bigger model's calls carry more
