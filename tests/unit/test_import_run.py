"""`dpcompare import-run` (common/imported/, compare/import_run.py): a real mlx_lm.lora run and a real Trainer +
peft run, made with the tools at tiny shapes (tests/fixtures/imported_runs/make_fixtures.py says how), read back
with every non-default choice and its source; the recipe file `--recipe` takes; bad input exits 2 in one line and
writes nothing. In process: no training, no framework imported."""
import json
import shutil
from pathlib import Path

import pytest

from common.config import RunConfig
from common.imported import read_run
from compare.cli import main

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "imported_runs"
MLX_RUN, TRAINER_RUN = FIXTURES / "mlx-lm", FIXTURES / "trainer"
MLX_LOG = MLX_RUN / "mlx-console.log"


def test_every_non_default_choice_of_a_real_mlx_lm_lora_run_is_recovered_with_its_source():
    run = read_run(MLX_RUN, MLX_LOG)
    values, sources = {**run.values(), **run.shape()}, run.sources()
    # python -m mlx_lm lora --num-layers 2 --mask-prompt -c cfg.yaml (keys q_proj, v_proj; rank 4; scale 10;
    # lr_schedule cosine_decay [1e-4, 6, 1e-5]) --batch-size 4 --iters 6 --max-seq-length 32
    assert values["lora_layers"] == 2 and sources["lora_layers"] == "adapter_config.json num_layers"
    assert values["lora_targets"] == "q_proj,v_proj" and "lora_parameters.keys" in sources["lora_targets"]
    assert values["lora_rank"] == 4 and values["lora_alpha"] == 10.0
    assert values["lora_scale_convention"] == "direct"
    assert (values["lr_schedule"], values["lr"], values["lr_decay_steps"]) == ("cosine", 1e-4, 6)
    assert values["min_lr_ratio"] == pytest.approx(0.1) and values["warmup_steps"] == 0
    assert values["mask_prompt"] is True and sources["mask_prompt"] == "adapter_config.json mask_prompt"
    assert (values["global_batch_size"], values["steps"], values["seq_len"]) == (4, 6, 31)
    # the tool's own behaviour, no setting: Adam without bias correction, no clipping, mlx-lm's data choices
    assert (values["optimizer"], values["bias_correction"], values["grad_clip"]) == ("adam", False, 0.0)
    assert "mlx's default" in sources["bias_correction"] and values["loss_normalization"] == "per-rank"
    # its console: one line per steps_per_report (2) iterations, the mean loss since the last
    assert (run.logged_steps, run.logged_loss, run.log_window) == ([2, 4, 6], [6.212, 6.063, 6.145], 2)
    assert any("ranks" in u for u in run.unknown)
    assert run.flags() == ["--lr-decay-steps", "6", "--global-batch-size", "4", "--steps", "6", "--seq-len", "31",
                           "--mask-prompt"]


def test_every_non_default_choice_of_a_real_trainer_peft_run_is_recovered_and_the_pickle_is_never_opened():
    run = read_run(TRAINER_RUN)
    values, sources = {**run.values(), **run.shape()}, run.sources()
    # LoraConfig(r=4, lora_alpha=16, target_modules=[q_proj, v_proj]); TrainingArguments(lr 1e-4, linear,
    # warmup_steps 2, max_grad_norm 1.0, 6 steps, batch 4)
    assert (values["lora_rank"], values["lora_alpha"], values["lora_scale_convention"]) == (4, 16.0, "alpha-over-rank")
    assert values["lora_targets"] == "q_proj,v_proj" and sources["lora_rank"] == "adapter_config.json r"
    assert (values["lr_schedule"], values["warmup_steps"], values["lr"]) == ("linear", 2, 1e-4)
    assert "fitted to trainer_state.json log_history learning_rate" in sources["warmup_steps"]
    assert values["grad_clip"] == 1.0 and "training_args.bin is not read" in sources["grad_clip"]
    assert (values["steps"], values["global_batch_size"], values["bias_correction"]) == (6, 4, True)
    assert run.logged_steps == [1, 2, 3, 4, 5, 6] and run.log_window == 1 and run.tool == "trainer"


def test_the_written_recipe_file_is_what_recipe_takes_and_flags_still_override_it(tmp_path, capsys):
    out = tmp_path / "recipes" / "mine.json"
    assert main(["import-run", str(TRAINER_RUN), "--out", str(out), "--set", "grad_clip=0.3"]) == 0
    printed = capsys.readouterr().out
    assert "yours (import-run --set)" in printed and "cannot be known" in printed and f"--recipe {out}" in printed
    cfg = RunConfig.from_dict({"recipe": str(out)})
    assert (cfg.lora_rank, cfg.lora_alpha, cfg.lr_schedule, cfg.warmup_steps, cfg.grad_clip) == (4, 16.0, "linear", 2, 0.3)
    assert RunConfig.from_dict({"recipe": str(out), "lr": 3e-4}).lr == 3e-4
    data = json.loads(out.read_text())
    assert data["logged"]["steps"] == [1, 2, 3, 4, 5, 6] and data["sources"]["lora_alpha"] == "adapter_config.json lora_alpha"


def _copy(src: Path, dst: Path, **changes) -> Path:
    shutil.copytree(src, dst)
    if changes:
        cfg = json.loads((dst / "adapter_config.json").read_text())
        for key, value in changes.items():
            if "." in key:
                outer, inner = key.split(".")
                cfg[outer][inner] = value
            else:
                cfg[key] = value
        (dst / "adapter_config.json").write_text(json.dumps(cfg))
    return dst


BAD = {
    "missing": (lambda t: (t / "nope", None), "does not exist"),
    "foreign folder": (lambda t: (_write(t / "f" / "notes.json", "{}"), None), "holds neither"),
    "foreign json": (lambda t: (_write(t / "g" / "adapter_config.json", "[1, 2]"), None), "JSON list"),
    "log in another format": (lambda t: (_copy(MLX_RUN, t / "m"), MLX_RUN / "adapter_config.json"), "no mlx_lm.lora report line"),
    "mlx-lm DoRA": (lambda t: (_copy(MLX_RUN, t / "d", fine_tune_type="dora"), None), "DoRA"),
    "mlx-lm full with adafactor": (lambda t: (_copy(MLX_RUN, t / "a", optimizer="adafactor"), None), "adam and adamw only"),
    "peft DoRA": (lambda t: (_copy(TRAINER_RUN, t / "p", use_dora=True), None), "DoRA"),
    "peft modules_to_save": (lambda t: (_copy(TRAINER_RUN, t / "s", modules_to_save=["lm_head"]), None), "trained whole"),
    "training_args.bin alone": (lambda t: (_write(t / "b" / "training_args.bin", "\x80\x04"), None), "never unpickles"),
}


def _write(path: Path, text: str) -> Path:
    path.parent.mkdir(parents=True)
    path.write_text(text)
    return path.parent


@pytest.mark.parametrize("case", sorted(BAD))
def test_bad_input_exits_2_in_one_line_and_writes_nothing(case, tmp_path, capsys):
    make, words = BAD[case]
    folder, log = make(tmp_path)
    before = sorted(p.name for p in folder.iterdir()) if folder.exists() else None
    out = tmp_path / "out" / "r.json"
    argv = ["import-run", str(folder), "--out", str(out)] + (["--log", str(log)] if log else [])
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and words in err, err
    assert not out.exists() and not out.parent.exists()
    assert (sorted(p.name for p in folder.iterdir()) if folder.exists() else None) == before


def test_a_recipe_file_that_is_not_one_exits_2(tmp_path):
    bad = _write(tmp_path / "x" / "r.json", '{"values": {}}') / "r.json"
    with pytest.raises(Exception, match="not a recipe file"):
        RunConfig.from_dict({"recipe": str(bad)})


RECIPE_FROM_BAD = {
    "no model folder": ((), "pass --init-from DIR"),
    "a hub name for --init-from": (("--init-from", "HuggingFaceTB/SmolLM2-135M"), "nothing is downloaded: pass a local"),
    "one framework": (("--preset", "tiny", "--frameworks", "mlx"), "--frameworks mlx,torch"),
    "with --recipes": (("--preset", "tiny", "--recipes", "mlx-lm,trl"), "drop --recipes"),
}


@pytest.mark.parametrize("case", sorted(RECIPE_FROM_BAD))
def test_compare_recipe_from_refuses_before_anything_runs_or_is_written(case, tmp_path):
    from helpers import dpcompare_here
    extra, words = RECIPE_FROM_BAD[case]
    data = tmp_path / "pairs.jsonl"
    data.write_text('{"prompt": "Q: 1+1?", "completion": " 2"}\n' * 40)
    out = tmp_path / "out"
    proc = dpcompare_here("compare", "--recipe-from", f"{MLX_RUN},{TRAINER_RUN}", "--dataset", data, *extra,
                          "--out", out, cache_dir=tmp_path / "cache")
    assert proc.returncode == 2 and len(proc.stderr.strip().splitlines()) == 1 and words in proc.stderr, proc.stderr
    assert not out.exists()


def test_mlx_lm_s_report_lines_are_read_in_both_console_formats_and_colours_are_stripped():
    from common.imported.mlx_lm import parse_log
    text = ("Iter 10: Train loss 2.345, Learning Rate 1.000e-05, It/sec 1.0, Tokens/sec 99.0, Trained Tokens 10\n"
            "Iter 10: Val loss 2.500, Val took 0.1s\n"
            "  \x1b[38;5;244m  20\x1b[0m    \x1b[1;32m2.125 \u25bc\x1b[0m    \x1b[1m   92\x1b[0m    0.1k\n")
    assert parse_log(text, "log") == ([10, 20], [2.345, 2.125])


def test_compare_recipe_from_into_an_earlier_comparison_is_refused_and_leaves_its_files_alone(tmp_path):
    from helpers import dpcompare_here
    out = tmp_path / "out"
    (out / "recipes").mkdir(parents=True)
    (out / "summary.json").write_text("{}")
    (out / "recipes" / "a-mlx-lm.json").write_text("kept")
    data = tmp_path / "pairs.jsonl"
    data.write_text('{"prompt": "Q: 1+1?", "completion": " 2"}\n' * 40)
    proc = dpcompare_here("compare", "--recipe-from", f"{MLX_RUN},{TRAINER_RUN}", "--dataset", data, "--preset",
                          "tiny", "--out", out, cache_dir=tmp_path / "cache")
    assert proc.returncode == 2 and "already holds a comparison" in proc.stderr
    assert (out / "recipes" / "a-mlx-lm.json").read_text() == "kept" and sorted(p.name for p in out.iterdir()) == \
        ["recipes", "summary.json"]


def test_mlx_lm_s_iterations_are_micro_batches_under_gradient_accumulation(tmp_path):
    folder = _copy(MLX_RUN, tmp_path / "acc", grad_accumulation_steps=2)
    run = read_run(folder, MLX_LOG)  # iterations 2, 4, 6 are updates 1, 2, 3; a report every 2 is every update
    shape = run.shape()
    assert (shape["steps"], shape["grad_accum"], shape["global_batch_size"]) == (3, 2, 8)
    assert (run.logged_steps, run.log_window) == ([1, 2, 3], 1)
