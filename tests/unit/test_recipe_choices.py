"""Two recipe choices checked against the arithmetic that predicts them, in-process in both frameworks:

- bias correction alone: Adam's first step moves each weight by lr g / (|g| + eps) when corrected, and by
  lr (1 - b1) g / (sqrt(1 - b2) |g| + eps) when not (MLX's default, mlx-lm's), so the update's norm shrinks by
  (1 - b1) / sqrt(1 - b2) (0.1 / sqrt(0.001) = 3.16 with mlx-lm's betas: larger, not smaller);
- the mask convention alone: mlx-lm's default_loss keeps one padding target per row (token 0, at column L - 1 of a
  row of L tokens), so the loss moves by exactly that target's share, computed here by hand from one batch;

and the padding rules, which cut trailing columns only: the kept targets' losses do not change."""
import json

import numpy as np
import pytest

from common.config import RunConfig
from common.data.conventions import MASK_CONVENTIONS, MLX_LM_PAD_TOKEN
from common.data.sequences import SequenceView
from common.data.tokencache import prepare_tokens
from common.model.spec import ModelSpec
from common.model.weights import init_weights

BETAS = (0.9, 0.999)  # mlx-lm's (mlx's Adam defaults)


def first_update(framework: str, bias_correction: bool, weights: np.ndarray, grad: np.ndarray) -> np.ndarray:
    """The change one optimizer step makes, built as the Trainer builds it (optimizer.py) from an mlx-lm config."""
    cfg = RunConfig.from_dict({"recipe": "mlx-lm", "bias_correction": bias_correction, "lr": 1e-3})
    if framework == "mlx":
        import mlx.core as mx

        from mlx_impl.optimizer import make_optimizer as make_mlx

        opt = make_mlx(cfg)
        params = {"w": mx.array(weights)}
        opt.init(params)
        return np.array(opt.apply_gradients({"w": mx.array(grad)}, params)["w"]) - weights
    import torch

    from torch_impl.optimizer import make_optimizer as make_torch

    w = torch.nn.Parameter(torch.tensor(weights))
    opt = make_torch(cfg, [{"params": [w]}])
    w.grad = torch.tensor(grad)
    opt.step()
    return w.detach().numpy() - weights


@pytest.mark.parametrize("framework", ["mlx", "torch"])
def test_without_bias_correction_the_first_update_s_norm_is_the_predicted_factor_of_the_corrected_one(framework):
    rng = np.random.default_rng(0)
    weights = rng.standard_normal(4096).astype(np.float32)
    # |g| from 1e-2 up: eps (1e-8) moves the ratio by under 1e-6
    grad = (rng.choice([-1, 1], 4096) * rng.uniform(1e-2, 1.0, 4096)).astype(np.float32)
    on = np.linalg.norm(first_update(framework, True, weights, grad))
    off = np.linalg.norm(first_update(framework, False, weights, grad))
    predicted = (1 - BETAS[0]) / np.sqrt(1 - BETAS[1])
    assert off / on == pytest.approx(predicted, rel=2e-4)  # float32 updates of a weight of ~1: ~1e-4 rel. each
    assert on == pytest.approx(1e-3 * np.sqrt(4096), rel=2e-4)  # corrected: lr sign(g), every element


def test_torch_s_written_out_uncorrected_adam_is_mlx_s_step_after_step():
    import mlx.core as mx
    import torch

    from mlx_impl.optimizer import make_optimizer as make_mlx
    from torch_impl.optimizer import make_optimizer as make_torch

    cfg = RunConfig.from_dict({"recipe": "mlx-lm", "lr": 1e-2})
    rng = np.random.default_rng(1)
    w0 = rng.standard_normal(256).astype(np.float32)
    mlx_opt, params = make_mlx(cfg), {"w": mx.array(w0)}
    mlx_opt.init(params)
    w = torch.nn.Parameter(torch.tensor(w0))
    torch_opt = make_torch(cfg, [{"params": [w]}])
    for _ in range(4):
        g = rng.standard_normal(256).astype(np.float32)
        params = mlx_opt.apply_gradients({"w": mx.array(g)}, params)
        w.grad = torch.tensor(g)
        torch_opt.step()
        np.testing.assert_allclose(np.array(params["w"]), w.detach().numpy(), rtol=0, atol=2e-6)


@pytest.fixture(scope="module")
def records(tmp_path_factory):
    """Prompt/completion records of 7 to 26 tokens under the builtin tokenizer: shorter than a 24-token row but
    for one, which fills it (no padding after it, so no extra target)."""
    tmp = tmp_path_factory.mktemp("records")
    rows = [{"prompt": "Q: " + "a b " * (i % 5), "completion": " c" * (2 + 3 * (i % 4))} for i in range(16)]
    (tmp / "pairs.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return prepare_tokens(str(tmp / "pairs.jsonl"), "builtin", cache_dir=tmp, val_fraction=0, progress=False,
                          builtin_vocab_size=512, builtin_bytes=200_000).split("train")


def token_losses(inputs: np.ndarray, targets: np.ndarray) -> np.ndarray:
    """Per-target losses of a tiny torch Llama from the seeded init (float64)."""
    import torch

    from torch_impl.model import Llama, cross_entropy, load_weights

    spec = ModelSpec(vocab_size=512, dim=32, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=64, max_seq_len=64)
    model = Llama(spec)
    load_weights(model, init_weights(spec, 0))
    with torch.no_grad():
        logits = model(torch.tensor(inputs, dtype=torch.long)).float()
        return cross_entropy(logits, torch.tensor(targets, dtype=torch.long)).double().numpy().reshape(targets.shape)


def test_mlx_lm_s_mask_moves_the_loss_by_exactly_the_padded_targets_share(records):
    indices, seq_len = list(range(8)), 24
    exact = SequenceView(records, seq_len, "padding", mask_prompt=True)
    mlx_lm = SequenceView(records, seq_len, "padding", mask_prompt=True, mask_convention="mlx-lm")
    x, y, m = exact.batch(indices)
    x2, y2, m2 = mlx_lm.batch(indices)
    lengths = np.minimum(np.diff(records.offsets)[indices], seq_len + 1)  # tokens of each row
    padded = lengths <= seq_len  # rows with padding after the record: each gets one extra target, token 0 at L - 1
    assert padded.sum() >= 6
    extra = np.zeros_like(m)
    extra[np.nonzero(padded)[0], lengths[padded] - 1] = 1.0
    np.testing.assert_array_equal(m2 - m, extra)
    assert (y2[extra == 1] == MLX_LM_PAD_TOKEN).all() and mlx_lm.real_target_count(indices) == m2.sum()
    # token 0 whatever the tokenizer pads with (mlx-lm's np.zeros; this tokenizer's pad happens to be 0 too)
    assert MASK_CONVENTIONS["mlx-lm"].extra_token(pad_id=7) == 0 and MASK_CONVENTIONS["exact"].extra_token(7) == 7
    np.testing.assert_array_equal(x2[:, :-1], x[:, :-1])  # the record's tokens are untouched
    losses = token_losses(x2, y2)  # the extra targets' inputs are the records themselves: one forward for both
    np.testing.assert_allclose(token_losses(x, y)[m == 1], losses[m == 1], rtol=1e-6)
    n, s = m.sum(), (losses * m).sum()
    share = (losses * extra).sum()  # by hand: what the padded targets add, and how many there are
    by_hand = (s + share) / (n + extra.sum()) - s / n
    assert (losses * m2).sum() / m2.sum() - s / n == pytest.approx(by_hand, rel=1e-12, abs=1e-15)
    assert abs(by_hand) > 1e-3  # the padded target is a poor guess of a random model: a visible share


@pytest.mark.parametrize("rule", ["longest", "mlx-lm"])
@pytest.mark.parametrize("convention", ["exact", "mlx-lm"])
def test_a_padding_rule_cuts_trailing_columns_and_no_kept_target_s_loss(records, rule, convention):
    indices, seq_len = [0, 1, 4, 5], 40
    full = SequenceView(records, seq_len, "padding", mask_prompt=True, mask_convention=convention)
    cut = SequenceView(records, seq_len, "padding", mask_prompt=True, mask_convention=convention, padding_rule=rule)
    x, y, m = full.batch(indices)
    xc, yc, mc = cut.batch(indices)
    longest = int(np.minimum(np.diff(records.offsets)[indices], seq_len + 1).max())
    expected = {"longest": longest - (convention == "exact"), "mlx-lm": min(32 * -(-longest // 32), seq_len)}[rule]
    assert xc.shape == yc.shape == mc.shape == (len(indices), expected)
    np.testing.assert_array_equal(mc, m[:, :expected])
    assert mc.sum() == m.sum() == cut.real_target_count(indices)
    np.testing.assert_allclose(token_losses(xc, yc)[mc == 1], token_losses(x, y)[m == 1], rtol=1e-5, atol=1e-6)


def test_under_mlx_lm_s_data_choices_the_ranks_masks_add_up_to_the_global_count(records):
    """What lets N ranks compute what one does under global-tokens: every rank's micro-batches, padded each to its
    own width with mlx-lm's extra targets, hold between them exactly the global batch's count of targets."""
    from common.data.sampler import micro_batches, sampler_for

    view = SequenceView(records, 24, "padding", mask_prompt=True, mask_convention="mlx-lm", padding_rule="mlx-lm")
    sampler = sampler_for("mlx-lm", view.num_samples, 8, 0, view.sample_lengths)
    for step in range(4):
        indices = sampler.global_batch_indices(step)
        for world, accum in ((1, 1), (2, 1), (2, 2), (4, 2)):
            held = sum(view.batch(m)[2].sum() for rank in range(world)
                       for m in micro_batches(sampler.rank_part(indices, rank, world), accum))
            assert held == view.real_target_count(indices), (step, world, accum)
