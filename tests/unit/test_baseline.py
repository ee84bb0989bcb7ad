"""Golden baselines: a setup saved once is judged against later, run by run, and a change of the
numbers or of the config is named."""
import json
from pathlib import Path


from unit.fake_runs import make_run, reference_losses
from compare.report.baseline import baseline_failed, judge_against, save_baseline
from compare.report.parity import Tolerances


def runs(root: Path, losses=None, config=None) -> list[Path]:
    return [make_run(root, fw, n, losses, config=config, evals={20: 3.1, 40: 2.9})
            for fw in ("mlx", "torch") for n in (1, 2)]


def test_the_baseline_keeps_full_precision_losses_and_the_fingerprint(tmp_path):
    dirs = runs(tmp_path / "a")
    saved = save_baseline(dirs, tmp_path / "golden.json")
    on_disk = json.loads((tmp_path / "golden.json").read_text())
    assert on_disk == saved and len(on_disk["runs"]) == 4
    entry = on_disk["runs"][0]
    assert entry["loss"] == reference_losses()  # bit for bit, through JSON
    assert len(entry["grad_norm"]) == len(entry["loss"]) and entry["eval_loss"] == [3.1, 2.9]
    assert entry["config"]["lr"] == 3e-4 and "spec.dim" in entry["config"] and "out" not in entry["config"]
    assert {(r["framework"], r["strategy"], r["world_size"]) for r in on_disk["runs"]} == {
        ("mlx", "ddp", 1), ("mlx", "ddp", 2), ("torch", "ddp", 1), ("torch", "ddp", 2)}


def test_an_unchanged_setup_passes_against_its_baseline(tmp_path):
    save_baseline(runs(tmp_path / "a"), tmp_path / "golden.json")
    verdicts = judge_against(runs(tmp_path / "b"), tmp_path / "golden.json", Tolerances())
    assert [v["verdict"] for v in verdicts] == ["pass"] * 4
    assert all(v["config_differences"] == {} for v in verdicts) and not baseline_failed(verdicts)
    assert "matches its baseline" in verdicts[0]["message"]


def test_a_changed_optimizer_setting_fails_and_is_named(tmp_path):
    save_baseline(runs(tmp_path / "a"), tmp_path / "golden.json")
    moved = [x + (0.0 if s == 1 else 1e-3 * s) for s, x in enumerate(reference_losses(), start=1)]
    verdicts = judge_against(runs(tmp_path / "b", moved, {"lr": 1e-3}), tmp_path / "golden.json", Tolerances())
    assert {v["verdict"] for v in verdicts} == {"fail"} and baseline_failed(verdicts)
    assert verdicts[0]["config_differences"] == {"lr": [3e-4, 1e-3]}
    assert "lr 0.0003 -> 0.001" in verdicts[0]["message"] and "departs" in verdicts[0]["message"]
    assert verdicts[0]["checks"]["per_step"]["at_step"] == 20


def test_runs_are_matched_by_framework_strategy_and_world_size(tmp_path):
    save_baseline([make_run(tmp_path / "a", "torch", 1)], tmp_path / "golden.json")
    other = [make_run(tmp_path / "b", "torch", 2), make_run(tmp_path / "c", "torch", 1, config={"strategy": "fsdp"})]
    assert [v["verdict"] for v in judge_against(other, tmp_path / "golden.json")] == ["no baseline"] * 2
