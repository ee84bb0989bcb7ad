"""Runs are paired by the content of what they read, not by its path: the same data under two absolute paths
(a run on a Mac and one on a Linux box, gathered by `dpcompare report A B`) is judged; different data under one
name is not comparable, and the difference names the input. Runs of older versions, which carry no hash,
still compare their paths. The run directories are written as compare/launch/runner.py leaves them
(unit/fake_runs.py), with the hashes where runner.py records them: the token cache's folder name,
run_config.json's tokenizer fingerprint, summary.json's init_from weights hash."""
from __future__ import annotations

from pathlib import Path

from common.metrics import read_json, write_json
from compare.cli import main
from unit.fake_runs import judged, make_run

DATA_SHA = "3f2a9c01b7e4d5aa"  # a token cache's folder name: its fingerprint's first 16 hex digits
TOKENIZER_SHA = "9b" * 32
MAC = {"home": "/Users/ana", "cache": "/Users/ana/Library/Caches/dpcompare"}
LINUX = {"home": "/home/ana", "cache": "/root/.cache/dpcompare"}


def run_on(machine: dict, root: Path, framework: str, *, data_sha: str | None = DATA_SHA,
           tokenizer_sha: str | None = TOKENIZER_SHA, weights_sha: str | None = None) -> Path:
    """A run of `framework` on `machine`: its data, tokenizer and (with weights_sha) init folder under that
    machine's home; None leaves that hash out, as a run of an older version would."""
    home = machine["home"]
    config = {"dataset": f"{home}/data/stories.txt", "tokenizer": f"{home}/models/gpt2"}
    if weights_sha:
        config["init_from"] = f"{home}/models/llama"
    run = make_run(root, framework, 1, config=config, name=f"{framework}-{home.strip('/').replace('/', '-')}")
    plan = read_json(run / "run_config.json")
    plan["token_cache"] = f"{machine['cache']}/tokens/{data_sha}" if data_sha else f"{machine['cache']}/tokens"
    plan["data"]["tokenizer"] = {"name": config["tokenizer"], "path": "tokenizer.json",
                                 **({"fingerprint": tokenizer_sha} if tokenizer_sha else {})}
    write_json(run / "run_config.json", plan)
    if weights_sha:
        summary = read_json(run / "summary.json")
        summary["init_from"] = {"path": config["init_from"], "weights_sha256": weights_sha}
        write_json(run / "summary.json", summary)
    return run


def cross_framework(*runs: Path) -> dict:
    (pair,) = judged(*runs)["cross_framework"]
    return pair


def test_the_same_data_tokenizer_and_weights_at_two_paths_are_judged(tmp_path):
    pair = cross_framework(run_on(MAC, tmp_path, "mlx", weights_sha="c4" * 32),
                           run_on(LINUX, tmp_path, "torch", weights_sha="c4" * 32))
    assert pair["differences"] == {} and pair["verdict"] == "pass"


def test_different_data_under_its_hash_is_not_comparable_and_names_the_dataset(tmp_path):
    pair = cross_framework(run_on(MAC, tmp_path, "mlx"), run_on(LINUX, tmp_path, "torch", data_sha="0" * 16))
    assert pair["verdict"] == "not comparable" and list(pair["differences"]) == ["dataset"]
    assert pair["differences"]["dataset"] == ["/Users/ana/data/stories.txt (sha 3f2a9c01b7e4)",
                                              "/home/ana/data/stories.txt (sha 000000000000)"]


def test_a_different_tokenizer_is_not_comparable_and_names_the_tokenizer(tmp_path):
    pair = cross_framework(run_on(MAC, tmp_path, "mlx"), run_on(LINUX, tmp_path, "torch", tokenizer_sha="1" * 64))
    assert pair["verdict"] == "not comparable"
    assert set(pair["differences"]) == {"tokenizer", "data.tokenizer"}


def test_different_initial_weights_are_not_comparable_and_name_init_from(tmp_path):
    pair = cross_framework(run_on(MAC, tmp_path, "mlx", weights_sha="c4" * 32),
                           run_on(LINUX, tmp_path, "torch", weights_sha="d5" * 32))
    assert pair["verdict"] == "not comparable" and list(pair["differences"]) == ["init_from"]


def test_runs_without_hashes_still_compare_their_paths(tmp_path):
    pair = cross_framework(run_on(MAC, tmp_path, "mlx", data_sha=None, tokenizer_sha=None),
                           run_on(LINUX, tmp_path, "torch", data_sha=None, tokenizer_sha=None))
    assert pair["verdict"] == "not comparable"
    assert pair["differences"]["dataset"] == ["/Users/ana/data/stories.txt", "/home/ana/data/stories.txt"]


def test_a_hash_on_one_side_only_falls_back_to_the_paths(tmp_path):
    pair = cross_framework(run_on(MAC, tmp_path, "mlx"), run_on(LINUX, tmp_path, "torch", data_sha=None))
    assert pair["verdict"] == "not comparable" and "dataset" in pair["differences"]
    assert "tokenizer" not in pair["differences"]  # both carry the tokenizer's hash, and it agrees


def test_the_same_path_with_different_content_is_not_comparable(tmp_path):
    pair = cross_framework(run_on(MAC, tmp_path / "a", "mlx"), run_on(MAC, tmp_path / "b", "torch", data_sha="e" * 16))
    assert pair["verdict"] == "not comparable" and list(pair["differences"]) == ["dataset"]


def test_dpcompare_report_over_runs_from_two_machines_judges_the_pair(tmp_path, capsys):
    """`dpcompare report A B`, in process: the runs read the same data under two paths."""
    mac, linux = run_on(MAC, tmp_path, "mlx"), run_on(LINUX, tmp_path, "torch")
    assert main(["report", str(mac), str(linux), "--out", str(tmp_path / "report")]) == 0
    out = capsys.readouterr().out
    assert "verdict: parity PASS" in out and "not comparable" not in out
    assert any(line.split()[:2] == ["PASS", "MLX"] and "mlx x1 vs torch x1" in line for line in out.splitlines())
    summary = read_json(tmp_path / "report" / "summary.json")
    assert summary["parity"]["cross_framework"][0]["verdict"] == "pass"
