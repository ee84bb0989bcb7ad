"""Recipes (common/recipes.py): dpcompare's is today's defaults; each tool's values are the ones its own source holds
(read here from the installed mlx-lm, mlx, peft and transformers, by parsing their files: importing transformers
costs 9 s); a flag overrides its recipe; the schedules are the tools' own functions; bad input exits 2 with one line;
and compare --recipes' contributions table has a row per differing choice, summing to the whole gap."""
import ast
import inspect
import math
import sys
from pathlib import Path

import pytest

from common.config import RunConfig
from common.errors import UserError
from common.recipes import CHOICES, DPCOMPARE, PEFT, RECIPES, TRL
from common.train.lr_schedule import lr_for
from compare.report.contributions import contributions, largest_line, write_chain_figure
from unit.fake_runs import make_run
from helpers import FAST, dpcompare_here

SITE = Path(next(p for p in sys.path if p.endswith("site-packages")))


def test_the_dpcompare_recipe_is_today_s_defaults_and_every_recipe_is_a_valid_config():
    defaults = RunConfig()
    assert {k: getattr(defaults, k) for k in DPCOMPARE.values} == DPCOMPARE.values
    assert RunConfig.from_dict({}) == defaults
    for name in RECIPES:
        cfg = RunConfig.from_dict({"recipe": name})
        assert set(RECIPES[name].values) <= set(CHOICES) | {"lora_rank"} and cfg.recipe == name


def _assigned(path: Path, name: str):
    """The literal value assigned to `name` at the top of a module, read without importing it."""
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, ast.Assign) and any(getattr(t, "id", None) == name for t in node.targets):
            return ast.literal_eval(node.value)
    raise LookupError(name)


def _field_default(path: Path, cls: str, name: str):
    """The `default=` of a dataclass field `name: T = field(default=...)` (or `= value`) in class `cls`."""
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ClassDef) and node.name == cls:
            for item in node.body:
                if isinstance(item, ast.AnnAssign) and getattr(item.target, "id", None) == name:
                    value = item.value
                    if isinstance(value, ast.Call):
                        value = next(k.value for k in value.keywords if k.arg == "default")
                    return ast.literal_eval(value)
    raise LookupError(f"{cls}.{name}")


def test_each_tool_s_recipe_holds_the_defaults_of_its_installed_source():
    mlx_lm = _assigned(SITE / "mlx_lm" / "lora.py", "CONFIG_DEFAULTS")
    cfg = RunConfig.from_dict({"recipe": "mlx-lm"})
    assert (cfg.lora_rank, cfg.lora_alpha, cfg.lora_layers, cfg.lr, cfg.optimizer) == (
        mlx_lm["lora_parameters"]["rank"], mlx_lm["lora_parameters"]["scale"], mlx_lm["num_layers"],
        mlx_lm["learning_rate"], mlx_lm["optimizer"])
    assert mlx_lm["lr_schedule"] is None and cfg.lr_schedule == "constant"
    assert cfg.trained.scale == mlx_lm["lora_parameters"]["scale"]  # used directly, not over the rank
    import mlx.optimizers as optim
    adam = inspect.signature(optim.Adam.__init__).parameters
    assert (cfg.bias_correction, [cfg.beta1, cfg.beta2], cfg.adam_eps) == (
        adam["bias_correction"].default, adam["betas"].default, adam["eps"].default)

    lora = SITE / "peft" / "tuners" / "lora" / "config.py"
    args = SITE / "transformers" / "training_args.py"
    for recipe in (PEFT, TRL):
        cfg = RunConfig.from_dict({"recipe": recipe.name})
        assert (cfg.lora_rank, cfg.lora_alpha) == (_field_default(lora, "LoraConfig", "r"),
                                                   _field_default(lora, "LoraConfig", "lora_alpha"))
        assert cfg.trained.scale == cfg.lora_alpha / cfg.lora_rank
        assert (cfg.weight_decay, cfg.beta1, cfg.beta2, cfg.adam_eps, cfg.grad_clip, cfg.warmup_steps) == tuple(
            _field_default(args, "TrainingArguments", k) for k in (
                "weight_decay", "adam_beta1", "adam_beta2", "adam_epsilon", "max_grad_norm", "warmup_steps"))
        assert cfg.lr_schedule == _field_default(args, "TrainingArguments", "lr_scheduler_type")
        assert _field_default(args, "TrainingArguments", "average_tokens_across_devices") is True
        assert cfg.loss_normalization == "global-tokens"
    assert PEFT.values["lr"] == _field_default(args, "TrainingArguments", "learning_rate")
    targets = _assigned(SITE / "peft" / "utils" / "constants.py", "TRANSFORMERS_MODELS_TO_LORA_TARGET_MODULES_MAPPING")
    assert PEFT.values["lora_targets"] == ",".join(targets["llama"])
    assert TRL.values["lr"] == 2e-5  # trl/trainer/sft_config.py SFTConfig.learning_rate (trl is not installed)


def test_a_flag_overrides_its_recipe_and_the_recipe_the_defaults():
    cfg = RunConfig.from_sources(None, {"recipe": "mlx-lm", "loss_normalization": "global-tokens"})
    assert cfg.loss_normalization == "global-tokens"
    assert (cfg.mask_convention, cfg.padding_rule, cfg.lr, cfg.bias_correction) == ("mlx-lm", "mlx-lm", 1e-5, False)
    assert RunConfig.from_sources(None, {"recipe": "peft", "lora_rank": 4}).trained.scale == 2.0  # 8 / 4


def _tool_function(path: Path, name: str, **space):
    """A function of a tool's source, compiled alone, with the module names it uses given as `space`."""
    node = next(n for n in ast.walk(ast.parse(path.read_text())) if isinstance(n, ast.FunctionDef) and n.name == name)
    exec(compile(ast.Module(body=[node], type_ignores=[]), str(path), "exec"), space)
    return space[name]


@pytest.mark.parametrize("warmup", [0, 3])
def test_the_linear_and_constant_schedules_are_transformers_own(warmup):
    source = SITE / "transformers" / "optimization.py"
    linear = _tool_function(source, "_get_linear_schedule_with_warmup_lr_lambda")
    constant = _tool_function(source, "_get_constant_schedule_with_warmup_lr_lambda")
    for schedule, tool in (("linear", lambda s: linear(s, num_warmup_steps=warmup, num_training_steps=20)),
                           ("constant", lambda s: constant(s, num_warmup_steps=warmup))):
        cfg = RunConfig.from_dict({"lr_schedule": schedule, "lr": 2e-5, "warmup_steps": warmup, "steps": 20})
        assert all(math.isclose(lr_for(cfg, s), 2e-5 * tool(s), rel_tol=1e-12, abs_tol=1e-20) for s in range(20))


def test_bad_recipe_input_exits_2_with_one_line(cache_dir, tmp_path):
    run = ["run", "--framework", "mlx", *FAST, "--steps", "2", "--out", tmp_path / "r"]
    compare = ["compare", *FAST, "--steps", "2", "--out", tmp_path / "c"]
    cases = [([*run, "--recipe", "axolotl"], "unknown recipe 'axolotl'"),
             ([*compare, "--recipes", "mlx-lm"], "--recipes takes two recipe names"),
             ([*compare, "--recipes", "mlx-lm,unsloth"], "unknown recipe 'unsloth'"),
             ([*compare, "--recipes", "trl,trl"], "the two recipes are the same"),
             ([*run, "--padding-rule", "longest", "--strategy", "pp", "--nproc", "2"], "--padding-rule longest"),
             ([*run, "--optimizer", "adam", "--weight-decay", "0.1"], "--optimizer adam takes no weight decay"),
             ([*run, "--recipe", "mlx-lm", "--strategy", "fsdp", "--nproc", "2"], "--lora-rank trains under ddp"),
             ([*run, "--mask-convention", "sloppy"], "unknown mask_convention 'sloppy'")]
    for args, expected in cases:
        proc = dpcompare_here(*args, cache_dir=cache_dir)
        lines = proc.stderr.strip().splitlines()
        assert proc.returncode == 2 and len(lines) == 1 and expected in lines[0], (args, proc.stderr)
    assert not (tmp_path / "r").exists() and not (tmp_path / "c").exists()


def test_the_contributions_table_has_a_row_per_differing_choice_and_sums_to_the_gap(tmp_path):
    """A chain of four links, its curves made up: each row is its link's change, and they add up to B - A."""
    links = [{"choice": c, "a": 0, "b": 1} for c in ("mask_convention", "bias_correction", "lr", "grad_clip")]
    curves = [[5.0 - 0.1 * s for s in range(10)]]
    for shift in (0.013, -0.4, 0.0021, 0.0):  # grad_clip changes nothing: its row is 0
        curves.append([v + shift * (1 + s / 10) for s, v in enumerate(curves[-1])])
    dirs = [make_run(tmp_path / f"link{k}", "torch", 1, c, tokens_per_s=1000.0 + 10 * k) for k, c in enumerate(curves)]
    table = contributions(("mlx-lm", "trl"), links, {"torch x1": dirs})
    t = table["tables"][0]
    assert [r["choice"] for r in t["rows"]] == table["order"] == [link["choice"] for link in links]
    assert t["steps"] == {"last": 10, "middle": 5}
    for key, step in (("loss_last", 10), ("loss_middle", 5)):
        assert abs(sum(r[key] for r in t["rows"]) - (curves[-1][step - 1] - curves[0][step - 1])) < 1e-12
    assert t["sum_error"] < 1e-12 and t["rows"][3]["loss_last"] == 0.0
    assert t["rows"][0]["tokens_per_s_noise"]  # 10 tokens/s apart, inside a 3 % spread: marked, not a finding
    assert "largest contributor is bias_correction" in largest_line(table)
    assert write_chain_figure(table, {"torch x1": dirs}, tmp_path / "out") == "plots/chain.png"
    assert (tmp_path / "out" / "plots" / "chain.png").stat().st_size > 0


def test_a_chain_that_cannot_run_a_link_is_refused_before_it_trains():
    """From mlx-lm (LoRA) to dpcompare (full training by default): a link with adapters' settings and rank 0."""
    import argparse

    from compare.chain import chain_links

    args = argparse.Namespace(config=None, set=[])
    with pytest.raises(UserError, match="cannot run"):
        chain_links(args, ("mlx-lm", "dpcompare"))
    links, configs = chain_links(argparse.Namespace(config=None, set=[], lora_rank=8), ("mlx-lm", "trl"))
    assert len(configs) == len(links) + 1 and configs[-1].lr == 2e-5 and configs[0].lr == 1e-5
    # dpcompare's "" targets are peft's q_proj,v_proj: no link
    links, _ = chain_links(argparse.Namespace(config=None, set=[], lora_rank=8), ("dpcompare", "peft"))
    assert "lora_targets" not in [link["choice"] for link in links] and "lora_alpha" in [k["choice"] for k in links]


def test_mlx_lm_s_data_order_is_its_iterate_batches_at_every_rank():
    """mlx-lm's own iterate_batches (compiled from its source, without importing mlx-lm's transformers) on records
    whose first token names them: the same global batches in the same order, and rank r's part is its stride."""
    import mlx.core as mx
    import numpy as np

    from common.data.sampler import sampler_for

    class CacheDataset:  # iterate_batches asks isinstance(dataset, CacheDataset); these records are plain
        pass

    iterate = _tool_function(SITE / "mlx_lm" / "tuner" / "trainer.py", "iterate_batches", np=np, mx=mx,
                             CacheDataset=CacheDataset, rprint=print)
    rng = np.random.default_rng(3)
    lengths = rng.integers(2, 30, size=37)
    records = [([j + 1] * int(n), 0) for j, n in enumerate(lengths)]  # token j + 1 names record j
    sampler = sampler_for("mlx-lm", len(records), 8, 0, lambda: lengths)
    steps = 3 * (len(records) // 8) + 2  # past three epochs' seams
    for world in (1, 2, 4):
        for rank in range(world):
            group = type("Group", (), {"rank": lambda self, r=rank: r, "size": lambda self, w=world: w})()
            batches = iterate(records, 8, 64, loop=True, seed=0, comm_group=group)
            for step in range(steps):
                theirs = np.array(next(batches)[0])[:, 0] - 1
                mine = sampler.rank_part(sampler.global_batch_indices(step), rank, world)
                assert theirs.tolist() == mine.tolist(), (world, rank, step)
