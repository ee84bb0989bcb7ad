"""`dpcompare diagnose` names where the frameworks part: real bugs, planted in one framework at a time
(DPCOMPARE_INJECT_BUG), are found at the right stage and module, in both directions."""

from common.train.step_record import BUGS

WHERE = {
    "rmsnorm_eps": ("forward", "model.layers.0.input_layernorm"),
    "rope_layout": ("forward", "model.layers.0.self_attn.rope"),
    "loss_mask": ("loss", "loss"),
    "adamw_bias_correction": ("update", "model.embed_tokens.weight"),
}


def test_every_planted_bug_is_tested():
    assert set(WHERE) == set(BUGS)
