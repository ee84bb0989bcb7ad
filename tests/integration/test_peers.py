"""The peers end to end (docs/peers.md): mlx-lm's own trainer and transformers' Trainer with peft, fed dpcompare's
batches, at 1 and 2 ranks (mlx.distributed ring; DDP over gloo), in one compare beside MLX and torch. Each peer pairs
with our run of its framework (kind peer) within 1e-5 per step. The recipe is mlx-lm's with bias correction on, the
one set of choices both peers' trainers can be told (torch's AdamW always corrects): mlx-lm's mask (the Trainer's
labels keep the extra target), Adam without weight decay, a constant lr, no clipping, per-rank normalization (so
every N vs 1 row DIFFERS). At `tiny`, seq 32, 6 steps, prompt/completion records with --mask-prompt. Each peer under
its own tool's recipe, 20 steps, is measured in docs/peers.md; the batches, refusals and pairing in-process:
tests/unit/test_peers.py."""
import numpy as np
import pytest

from helpers import FAST, dpcompare, losses, summary
from integration.records import pairs

pytestmark = pytest.mark.slow


def test_each_peer_s_own_trainer_computes_what_ours_computes_at_1_and_2_ranks(cache_dir, tmp_path):
    out = tmp_path / "peers"
    dpcompare("compare", *FAST, "--dataset", pairs(tmp_path), "--mask-prompt", "--steps", 6, "--profile-steps", 0,
              "--no-samples", "--warmup-steps", 0, "--recipe", "mlx-lm", "--bias-correction", "--frameworks", "mlx,torch,mlx-lm,hf",
              "--nproc", "1,2", "--out", out, cache_dir=cache_dir, timeout=600)
    rows = {(p["kind"], p["pair"]): p for p in summary(out)["verdicts"]["pairs"]}
    for n in (1, 2):
        for peer, ours in (("mlx-lm", "mlx"), ("hf", "torch")):
            assert rows[("peer", f"{peer} x{n} vs {ours} x{n}")]["verdict"] == "pass", rows
            np.testing.assert_allclose(losses(out / f"{peer}-n{n}"), losses(out / f"{ours}-n{n}"), rtol=0, atol=1e-5)
        assert rows[("MLX vs torch", f"mlx x{n} vs torch x{n}")]["verdict"] == "pass", rows
    for framework in ("mlx", "torch", "mlx-lm", "hf"):
        assert rows[("N vs 1", f"{framework} x2 vs {framework} x1")]["verdict"] == "differs", rows
    config = summary(out / "hf-n2")["config"]
    assert (config["peer"], config["framework"], config["bias_correction"], config["loss_normalization"]) == (
        "hf", "torch", True, "per-rank")
