"""`dpcompare plan` (compare/plan/) in-process on fixture run directories: it writes plan.json and the
figure, refuses bad input with exit 2 and one line, reads `doctor --fabric --out` files, and `compare`'s
predictions land in the N > 1 summaries and the report."""
import json

import pytest
from costmodel_fixtures import SPEC, link_record, summary, write_run

from compare.cli import main
from compare.machine.fabric import Measured
from compare.plan import add_predictions, write_fabric
from compare.report.render import prediction_blocks


@pytest.fixture
def cmp_dir(tmp_path):
    for fw, backend in (("mlx", "ring"), ("torch", "gloo")):
        write_run(tmp_path / f"{fw}-n1", summary(fw, 1))
        write_run(tmp_path / f"{fw}-n2", summary(fw, 2, link=link_record("1gbit", backend=backend)))
        write_run(tmp_path / f"{fw}-tp-n2", summary(fw, 2, strategy="tp"))  # an older run: no link record
    write_run(tmp_path / "torch-fsdp-n2", summary("torch", 2, strategy="fsdp", link={"allreduce": {"latency_s": "?", "bandwidth_Bps": 1e9}}))
    return tmp_path


def test_plan_writes_plan_json_and_the_figure(cmp_dir, capsys):
    out = cmp_dir / "plan"
    code = main(["plan", "--from", str(cmp_dir / "torch-n1"), "--nproc", "2,4", "--link-gbps", "10",
                 "--latency-us", "50", "--device-memory-gb", "0.45", "--out", str(out)])
    printed = capsys.readouterr().out
    assert code == 0
    plan = json.loads((out / "plan.json").read_text())
    assert (out / "plan.png").stat().st_size > 10_000
    got = {(p["strategy"], p["world_size"]) for p in plan["predictions"]}
    assert got == {("ddp", 1), ("ddp", 2), ("ddp", 4), ("fsdp", 2), ("fsdp", 4), ("tp", 2), ("tp", 4)}
    tp4 = next(p for p in plan["predictions"] if (p["strategy"], p["world_size"]) == ("tp", 4))
    assert "n_kv_heads" in tp4["impossible"]  # tiny's 2 kv heads do not split over 4 ranks
    ddp1 = next(p for p in plan["predictions"] if p["world_size"] == 1)
    assert ddp1["step_s"] == pytest.approx(summary("torch", 1)["step_time_s"])
    assert {p["fits"] for p in plan["predictions"] if "fits" in p} == {True, False}  # 0.45 GB splits them
    assert plan["link"]["bandwidth_Bps"] == 10e9 / 8 and plan["link"]["hop_latency_s"] == pytest.approx(50e-6)
    assert {(m["strategy"], m["world_size"]) for m in plan["measured"]} == {("ddp", 1), ("ddp", 2), ("tp", 2),
                                                                           ("fsdp", 2)}
    for text in ("tokens/s", "efficiency", "exposed comm", "memory/rank GB", "fits", "bottleneck is"):
        assert text in printed


def test_plan_without_matplotlib_writes_its_json_and_says_there_is_no_figure(cmp_dir, capsys, monkeypatch):
    from compare.report import plots
    monkeypatch.setattr(plots, "plt", None)  # what plots.py sets where `import matplotlib` fails
    out = cmp_dir / "plan"
    assert main(["plan", "--from", str(cmp_dir / "torch-n1"), "--nproc", "2", "--out", str(out)]) == 0
    assert json.loads((out / "plan.json").read_text())["figure"] is None and not (out / "plan.png").exists()
    assert "no figure: matplotlib is not installed" in capsys.readouterr().out


def test_plan_reads_doctor_fabric_out(cmp_dir, capsys):
    fabric = cmp_dir / "fabric.json"
    rows = [Measured("mlx", "ring", 2, "cpu", latency_s=3e-4, bandwidth_Bps=9e8, large_bytes=32 * 2**20),
            Measured("torch", "gloo", 2, "cpu", latency_s=4e-4, bandwidth_Bps=1.8e9, large_bytes=32 * 2**20),
            Measured("mlx", "mpi", 2, error="skipped: the time budget is spent")]
    write_fabric(str(fabric), rows, "2 local ranks")
    data = json.loads(fabric.read_text())
    assert data["backends"][1] == {"framework": "torch", "backend": "gloo", "ranks": 2, "device": "cpu",
                                   "latency_s": 4e-4, "bandwidth_Bps": 1.8e9, "large_bytes": 32 * 2**20,
                                   "error": None}
    assert main(["plan", "--from", str(cmp_dir / "mlx-n1"), "--fabric", str(fabric), "--nproc", "2"]) == 0
    plan = json.loads((cmp_dir / "mlx-n1" / "plan" / "plan.json").read_text())
    assert plan["link"]["name"].startswith("mlx ring") and plan["link"]["chosen_by"] == "--fabric"
    # A ring all-reduce of S bytes measured as 300 µs + S / 0.9 GB/s at N=2 is 150 µs per hop and 0.9 GB/s each way
    assert plan["link"]["hop_latency_s"] == pytest.approx(1.5e-4) and plan["link"]["bandwidth_Bps"] == pytest.approx(9e8)
    write_fabric(str(fabric), rows, "2 local ranks", {"requested": "1gbit"})  # doctor --fabric --link 1gbit
    assert main(["plan", "--from", str(cmp_dir / "mlx-n1"), "--fabric", str(fabric), "--nproc", "2"]) == 0
    assert "shaped to 1gbit" in json.loads((cmp_dir / "mlx-n1" / "plan" / "plan.json").read_text())["link"]["name"]
    write_fabric(str(fabric), rows[:1], "2 local ranks")
    capsys.readouterr()
    assert main(["plan", "--from", str(cmp_dir / "torch-n1"), "--fabric", str(fabric)]) == 2
    assert "no measured torch backend" in capsys.readouterr().err


def bad_inputs(cmp_dir):
    run = str(cmp_dir / "torch-n1")
    broken = write_run(cmp_dir / "broken", {**summary("torch", 1), "breakdown": None})
    (cmp_dir / "notjson.json").write_text("{")
    (cmp_dir / "summary.json").write_text(json.dumps({"runs": [], "verdicts": {}}))  # compare's own summary
    return [
        (["plan", "--from", str(cmp_dir / "missing")], "does not exist"),
        (["plan", "--from", str(cmp_dir)], "is a comparison, not a run: pass one of its runs"),
        (["plan", "--from", str(cmp_dir / "mlx-n1" / "summary.json")], "is a file, not a directory"),
        (["plan", "--from", str(broken)], "no time breakdown"),
        (["plan", "--from", run, "--strategies", "ddp,zero"], "unknown strategy 'zero'"),
        (["plan", "--from", run, "--nproc", "2,0"], "positive whole numbers"),
        (["plan", "--from", run, "--nproc", "two"], "comma list of whole numbers"),
        (["plan", "--from", run, "--link-gbps", "-1", "--latency-us", "5"], "--link-gbps must be a positive"),
        (["plan", "--from", run, "--link-gbps", "nan", "--latency-us", "5"], "--link-gbps must be a positive"),
        (["plan", "--from", run, "--link-gbps", "10"], "go together"),
        (["plan", "--from", run, "--link-gbps", "10", "--latency-us", "-3"], "--latency-us must be 0 or more"),
        (["plan", "--from", run, "--link-gbps", "ten", "--latency-us", "3"], "invalid float value"),
        (["plan", "--from", run, "--device-memory-gb", "0"], "--device-memory-gb must be a positive"),
        (["plan", "--from", run, "--fabric", str(cmp_dir / "notjson.json")], "not a file written by"),
        (["plan", "--from", run, "--fabric", str(cmp_dir / "notjson.json"), "--link-gbps", "1", "--latency-us", "1"],
         "not both"),
        (["plan"], "--from"),
    ]


def test_plan_refuses_bad_input_with_one_line_and_exit_2(cmp_dir, capsys):
    for argv, message in bad_inputs(cmp_dir):
        try:
            code = main(argv)
        except SystemExit as parser_exit:  # argparse's own refusals (a flag's type, a missing flag)
            code = parser_exit.code
        err = capsys.readouterr().err
        assert code == 2, (argv, err)
        assert err.count("\n") == 1 and message in err and "Traceback" not in err, (argv, err)


def test_compare_writes_a_prediction_into_every_multi_rank_run_and_the_report_shows_it(cmp_dir):
    runs = sorted(p for p in cmp_dir.iterdir() if (p / "summary.json").exists())
    add_predictions(runs)
    read = {p.name: json.loads((p / "summary.json").read_text()) for p in runs}
    assert "prediction" not in read["torch-n1"]
    ddp, tp = read["mlx-n2"]["prediction"], read["mlx-tp-n2"]["prediction"]
    assert ddp["from"] == "mlx-n1" and ddp["link"] == "1gbit" and ddp["step_s"] > 0 and ddp["tokens_per_s"] > 0
    assert "link record" in ddp["link_source"]
    assert tp["from"] == "mlx-n1" and "predicted from the ddp N=1 run" in tp["note"]
    assert "assumed loopback" in tp["link_source"]  # the tp fixture has no link record, as older runs
    broken = read["torch-fsdp-n2"]["prediction"]  # a link record the model cannot read: a note, no crash
    assert broken["from"] == "torch-n1" and broken["note"].startswith("no prediction:") and "step_s" not in broken
    rows = [{"label": name, "step_time_ms": s["step_time_s"] * 1e3, "tokens_per_s": s["tokens_per_s"],
             "prediction": s.get("prediction")} for name, s in read.items()]
    blocks = prediction_blocks(rows)
    table = next(b for b in blocks if b[0] == "table")
    assert "predicted step ms" in table[1] and "measured step ms" in table[1]
    assert {r[0] for r in table[2]} == {"mlx-n2", "mlx-tp-n2", "torch-n2", "torch-tp-n2"}
    assert any("torch-fsdp-n2: no prediction" in line for b in blocks if b[0] == "ul" for line in b[1])


def test_doctor_out_is_refused_before_anything_is_measured(tmp_path, capsys):
    assert main(["doctor", "--out", str(tmp_path / "f.json")]) == 2
    assert "go with doctor --fabric" in capsys.readouterr().err
    assert main(["doctor", "--fabric", "--out", str(tmp_path / "missing" / "f.json")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "not found" in err and not (tmp_path / "missing").exists()


def test_plan_predicts_each_layout_on_the_backend_it_would_run_on(cmp_dir, capsys):
    """An MLX N=1 run ran on no backend: its one-axis layouts are predicted on ring and its meshes on mpi (the
    backend a mesh needs: common/config.py default_backend), each over its own loopback figures, or over its own
    entry of a --fabric file. torch's run on gloo keeps one backend and one link."""
    from compare.plan.links import predicted_backend
    from common.costmodel.calibrate import calibrate
    from common.costmodel.links import LOOPBACK_ALLREDUCE, loopback_link
    from common.costmodel.predict import predict
    from common.model.spec import ModelSpec

    assert [predicted_backend(summary("mlx", 1), m) for m in ("", "dp=2,tp=2")] == ["ring", "mpi"]
    assert [predicted_backend(summary("mlx", 2), m) for m in ("", "dp=2,tp=2")] == ["ring", "mpi"]
    assert predicted_backend({**summary("mlx", 2), "backend": "mpi"}) == "mpi"
    assert predicted_backend({**summary("torch", 1), "device": "cuda"}, "dp=2,tp=2") == "nccl"
    assert predicted_backend(summary("torch", 1), "dp=2,tp=2") == "gloo"

    out = cmp_dir / "mlx-plan"
    assert main(["plan", "--from", str(cmp_dir / "mlx-n1"), "--meshes", "--nproc", "4", "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    plan = json.loads((out / "plan.json").read_text())
    rows = {r["label"]: r for r in plan["predictions"] if r["world_size"] == 4}
    assert rows["dp=4"]["backend"] == "ring" and rows["dp=2,tp=2"]["backend"] == "mpi"
    by_backend = plan["links_by_backend"]
    for backend in ("ring", "mpi"):
        assert by_backend[backend]["bandwidth_Bps"] == pytest.approx(loopback_link(backend).bandwidth_Bps)
        assert f"({backend}) loopback ({backend}, assumed)" in printed
    assert LOOPBACK_ALLREDUCE["mpi"] != LOOPBACK_ALLREDUCE["ring"]
    # the mesh priced on MPI over MPI's loopback, not on ring's figures
    cal = calibrate(summary("mlx", 1), ModelSpec.from_dict(SPEC))
    on = {b: predict(cal, "mesh", 4, loopback_link(b), backend=b, mesh="dp=2,tp=2").step_s for b in ("ring", "mpi")}
    assert rows["dp=2,tp=2"]["step_s"] == pytest.approx(on["mpi"]) and on["mpi"] != pytest.approx(on["ring"])

    fabric = cmp_dir / "fabric.json"
    write_fabric(str(fabric), [Measured("mlx", "ring", 2, "cpu", latency_s=3e-4, bandwidth_Bps=9e8, large_bytes=2**25),
                               Measured("mlx", "mpi", 2, "cpu", latency_s=5e-5, bandwidth_Bps=2e9, large_bytes=2**25)],
                 "2 local ranks")
    assert main(["plan", "--from", str(cmp_dir / "mlx-n1"), "--meshes", "--nproc", "4", "--fabric", str(fabric),
                 "--out", str(out)]) == 0
    by_backend = json.loads((out / "plan.json").read_text())["links_by_backend"]
    assert by_backend["ring"]["name"].startswith("mlx ring") and by_backend["mpi"]["name"].startswith("mlx mpi")

    assert main(["plan", "--from", str(cmp_dir / "torch-n1"), "--meshes", "--nproc", "4", "--out", str(out)]) == 0
    plan = json.loads((out / "plan.json").read_text())
    assert {r["backend"] for r in plan["predictions"] if r["world_size"] == 4} == {"gloo"}
    assert "links_by_backend" not in plan and plan["backend"] == "gloo"


def test_plan_calibrates_on_a_mesh_run(cmp_dir, capsys):
    """A mesh's run is calibrated on its own layout (its config's mesh): before, `plan --from` a pp=2,dp=2 run
    refused with "--strategy mesh needs --mesh", a flag the user had given to the run, not to plan."""
    mesh = summary("torch", 2, strategy="mesh")
    mesh.update(world_size=4, config={**mesh["config"], "nproc": 4, "strategy": "mesh", "mesh": "pp=2,dp=2"})
    run = write_run(cmp_dir / "torch-pp2xdp2-n4", mesh)
    assert main(["plan", "--from", str(run), "--meshes", "--nproc", "4", "--out", str(cmp_dir / "mp")]) == 0
    plan = json.loads((cmp_dir / "mp" / "plan.json").read_text())
    assert plan["calibration"]["strategy"] == "mesh" and plan["calibration"]["world_size"] == 4
    assert {"pp=2,dp=2", "dp=4"} <= {r["label"] for r in plan["predictions"]}
