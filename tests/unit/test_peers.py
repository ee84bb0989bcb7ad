"""The peers (common/peers.py, peers/): mlx-lm's trainer and the Trainer with peft, fed dpcompare's batches. In
process: a batch in each peer's layout keeps exactly the run's targets under the peer's own loss; what a peer cannot
be told exits 2 in one line before anything starts; a peer's run pairs with its framework's (kind peer, 1e-5); and
the --init-from folder check warns on transformers 5's rope_parameters, which mlx-lm 0.32 ignores, and not on a
folder dpcompare writes. (The peers trained end to end: tests/integration/test_peers.py.)"""
from __future__ import annotations

import importlib.util
import json

import numpy as np
import pytest

from common.config import RunConfig
from common.errors import UserError
from helpers import ROOT, dpcompare_here
from peers.hf_peer import hf_batch
from peers.mlx_lm_peer import mlx_lm_batch


def a_batch(seed: int = 0, rows: int = 4, width: int = 12, vocab: int = 50):
    """(inputs, targets, mask) as SequenceView.batch gives them: a masked prompt, the answer, one extra target."""
    rng = np.random.default_rng(seed)
    tokens = rng.integers(1, vocab, size=(rows, width + 1)).astype(np.int32)
    mask = np.zeros((rows, width), dtype=np.float32)
    for row in range(rows):
        prompt, end = int(rng.integers(0, 4)), int(rng.integers(5, width + 1))
        mask[row, prompt:end] = 1.0
    return tokens[:, :-1], tokens[:, 1:], mask


def masked_mean(logits: np.ndarray, targets: np.ndarray, mask: np.ndarray) -> float:
    shifted = logits - logits.max(-1, keepdims=True)
    logp = shifted - np.log(np.exp(shifted).sum(-1, keepdims=True))
    nll = -np.take_along_axis(logp, targets[..., None], -1)[..., 0]
    return float((nll * mask).sum() / mask.sum())


def test_mlx_lm_s_own_default_loss_keeps_exactly_the_run_s_targets():
    import mlx.core as mx
    from mlx_lm.tuner.trainer import default_loss

    inputs, targets, mask = a_batch()
    logits = np.random.default_rng(1).standard_normal((*inputs.shape, 50)).astype(np.float32)
    tokens, lengths = mlx_lm_batch(inputs, targets, mask)
    assert np.array_equal(tokens[:, :-1], inputs) and np.array_equal(tokens[:, 1:], targets)
    loss, ntoks = default_loss(lambda x: mx.array(logits), mx.array(tokens), mx.array(lengths))
    assert int(ntoks.item()) == int(mask.sum())
    assert abs(loss.item() - masked_mean(logits, targets, mask)) < 1e-5


def test_a_row_whose_targets_are_not_one_run_is_refused_for_mlx_lm():
    inputs, targets, mask = a_batch()
    mask[0] = 0.0
    mask[0, [1, 3]] = 1.0
    with pytest.raises(UserError, match="not one run"):
        mlx_lm_batch(inputs, targets, mask)


def test_the_trainer_s_count_and_causal_lm_loss_keep_exactly_the_run_s_targets():
    import torch
    from transformers.loss.loss_utils import ForCausalLMLoss

    inputs, targets, mask = a_batch()
    fed = hf_batch(inputs, targets, mask)
    labels = torch.from_numpy(fed["labels"])
    assert int(labels[..., 1:].ne(-100).sum()) == int(mask.sum())  # Trainer._get_num_items_in_batch's count
    logits = np.random.default_rng(1).standard_normal((*fed["input_ids"].shape, 50)).astype(np.float32)
    loss = ForCausalLMLoss(torch.from_numpy(logits), labels, vocab_size=50, num_items_in_batch=int(mask.sum()))
    assert abs(float(loss) - masked_mean(logits[:, :-1], targets, mask)) < 1e-5


LORA = dict(lora_rank=8, dataset="pairs.jsonl", steps=4)


@pytest.mark.parametrize("peer, recipe, nproc, choice", [
    ("mlx-lm", "peft", 1, "lr-schedule"),              # no linear schedule in its lora.py: refused
    ("mlx-lm", "mlx-lm", 2, None),                     # mlx-lm's own recipe: taken
    ("hf", "mlx-lm", 1, "bias-correction"),            # torch's AdamW always corrects: not told, nor adapted here
    ("hf", "peft", 2, None),
])
def test_a_peer_takes_only_the_choices_its_trainer_has_a_setting_for(peer, recipe, nproc, choice):
    framework = {"mlx-lm": "mlx", "hf": "torch"}[peer]

    def make():
        return RunConfig.from_dict(dict(framework=framework, peer=peer, recipe=recipe, nproc=nproc, **LORA))
    if choice is None:
        make()
        return
    with pytest.raises(UserError, match=f"{peer}.*{choice}"):
        make()


@pytest.mark.parametrize("peer, recipe, nproc, asked, ran", [
    ("hf", "mlx-lm", 2, {"bias_correction": False}, {"bias_correction": True}),
    ("mlx-lm", "dpcompare", 2, {"mask_convention": "exact", "grad_clip": 1.0, "loss_normalization": "global-tokens"},
     {"mask_convention": "mlx-lm", "grad_clip": 0.0, "loss_normalization": "per-rank"}),
    ("mlx-lm", "mlx-lm", 1, {}, {}),
])
def test_a_setting_a_peer_cannot_be_told_runs_with_its_own_value_said_in_one_line_each(peer, recipe, nproc, asked,
                                                                                        ran):
    """common/peers.py adapted: compare's peer config takes the trainer's own value where it has no setting for the one
    asked, names it in peer_adapted, and says so in one line per choice; the rest of the config is untouched."""
    from common.peers import adapted, explained

    framework = {"mlx-lm": "mlx", "hf": "torch"}[peer]
    ours = RunConfig.from_dict(dict(framework=framework, recipe=recipe, nproc=nproc, warmup_steps=0,
                                    lr_schedule="constant", **LORA))
    assert {k: getattr(ours, k) for k in asked} == asked
    cfg, lines = adapted(peer, ours)
    assert {k: getattr(cfg, k) for k in ran} == ran and cfg.peer == peer
    assert cfg.peer_adapted.split(",") == (list(ran) if ran else [""])
    assert len(lines) == len(ran) and all(k.replace("_", "-") in line for k, line in zip(ran, lines)), lines
    untouched = {k for k in ours.to_dict() if k not in ran and k not in ("peer", "peer_adapted")}
    assert all(getattr(cfg, k) == getattr(ours, k) for k in untouched)
    RunConfig.from_dict(cfg.to_dict())  # what the peer's ranks read back validates
    assert all(k.replace("_", "-") in explained(cfg.to_dict()) for k in ran)


def test_mlx_lm_at_two_ranks_refuses_global_tokens_and_a_peer_refuses_another_strategy():
    with pytest.raises(UserError, match="per-rank"):
        RunConfig.from_dict(dict(framework="mlx", peer="mlx-lm", recipe="mlx-lm", nproc=2,
                                 loss_normalization="global-tokens", **LORA))
    with pytest.raises(UserError):
        RunConfig.from_dict(dict(framework="torch", peer="hf", recipe="peft", nproc=2, strategy="fsdp", **LORA))


def test_refusals_exit_2_in_one_line_before_anything_starts(tmp_path, monkeypatch):
    pairs = tmp_path / "pairs.jsonl"
    pairs.write_text('{"prompt": "Q", "completion": " A"}\n' * 40)
    flags = ("compare", "--dataset", pairs, "--mask-prompt", "--steps", 2, "--out", tmp_path / "out")
    proc = dpcompare_here(*flags, "--recipe", "peft", "--lr-schedule", "cosine", "--frameworks", "torch,hf",
                          cache_dir=tmp_path)
    assert proc.returncode == 2 and "lr-schedule" in proc.stderr and len(proc.stderr.strip().splitlines()) == 1
    real = importlib.util.find_spec
    monkeypatch.setattr("common.peers.importlib.util.find_spec",
                        lambda name, *a: None if name == "mlx_lm" else real(name, *a))
    proc = dpcompare_here(*flags, "--recipe", "mlx-lm", "--frameworks", "mlx-lm", cache_dir=tmp_path)
    assert proc.returncode == 2 and "pip install 'dpcompare[peers]'" in proc.stderr, proc.stderr
    assert not (tmp_path / "out").exists()


def test_a_peer_s_run_pairs_with_its_framework_s_as_kind_peer_within_1e_5(tmp_path):
    from compare.report.parity import Tolerances, judge, load_run
    from unit.fake_runs import make_run, reference_losses

    losses = reference_losses()
    for framework, peer, shift in (("mlx", "", 0.0), ("mlx", "mlx-lm", 3e-6), ("torch", "", 1e-7),
                                   ("torch", "hf", 2e-5)):
        make_run(tmp_path, framework, 1, [x + shift for x in losses], config={"peer": peer},
                 name=f"{peer or framework}-n1")
    parity = judge([load_run(p) for p in sorted(tmp_path.iterdir())], Tolerances())
    assert [(p["a"], p["b"]) for p in parity["cross_framework"]] == [("mlx x1", "torch x1")]
    verdicts = {(p["a"], p["b"]): p["verdict"] for p in parity["peer"]}
    assert verdicts == {("mlx-lm x1", "mlx x1"): "pass", ("hf x1", "torch x1"): "fail"}
    assert {p["checks"]["per_step"]["tolerance"] for p in parity["peer"]} == {1e-5}


def test_a_peer_that_ran_its_own_value_of_a_choice_differs_naming_it_and_otherwise_fails(tmp_path):
    """A peer run whose config names a choice it could not be told (peer_adapted) pairs with ours although that
    field differs, and a gap is called the choice's (differs, with its words in the verdict line); the same gap
    without it fails."""
    from compare.report.parity import Tolerances, judge, load_run
    from compare.report.verdict_table import pair_sentence
    from unit.fake_runs import make_run, reference_losses

    losses = reference_losses()
    make_run(tmp_path, "torch", 1, losses, config={"bias_correction": False}, name="torch-n1")
    make_run(tmp_path, "torch", 1, [x + 3e-3 for x in losses], name="hf-n1",
             config={"peer": "hf", "bias_correction": True, "peer_adapted": "bias_correction"})
    make_run(tmp_path, "torch", 1, [x + 3e-3 for x in losses], name="hf-plain",
             config={"peer": "hf", "bias_correction": False})
    runs = [load_run(tmp_path / name) for name in ("torch-n1", "hf-n1")]
    [pair] = judge(runs, Tolerances())["peer"]
    assert pair["verdict"] == "differs" and "bias-correction = True" in pair["explained_by"], pair
    assert "torch's AdamW always corrects" in pair_sentence(pair) and "3.00e-03" in pair_sentence(pair)
    [pair] = judge([runs[0], load_run(tmp_path / "hf-plain")], Tolerances())["peer"]
    assert pair["verdict"] == "fail"


def transformers_folder(tmp_path):
    spec = importlib.util.spec_from_file_location("pretrained_folder", ROOT / "benchmarks" / "pretrained_folder.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.write_folder(tmp_path / "llama3", "llama-3.2-1b", tokenizer=False)


def test_a_transformers_5_llama_3_folder_warns_of_mlx_lm_s_rope_and_a_folder_dpcompare_writes_does_not(tmp_path):
    from common.model.weights import load_pretrained, save_pretrained
    from peers.folder_check import warnings

    written = transformers_folder(tmp_path)
    assert "rope_parameters" in json.loads((written / "config.json").read_text())
    (line,) = warnings(written)
    assert "mlx-lm" in line and "rope_parameters" in line and "500000" in line, line
    save_pretrained(tmp_path / "ours", *load_pretrained(written))  # the config export writes (to_hf_config)
    assert warnings(tmp_path / "ours") == []


def test_the_speed_row_of_a_peer_gives_its_peak_rss_and_first_step_beside_ours():
    from compare.report.verdict_table import peer_cell

    assert peer_cell({"peak_rss_mb": [[310.2, 328.9], [69.0, None]], "time_to_first_step_s": [3.84, None]}) == \
        "peak RSS 310/329 vs 69 MB/rank, first step 3.8 vs ? s"
