"""FSDP (--strategy fsdp) computes what DDP computes, in both frameworks, while each rank holds 1/N of
the state: losses and gradients equal DDP's step by step, MLX and torch agree, and checkpoints stay full
so a run switches strategy (and framework) at a checkpoint. The runs are in tests/integration/test_fsdp.py."""
import pytest

from common.errors import UserError
from common.spec import preset
from common.strategy import check_strategy


def test_the_shape_check_names_the_parameter_and_passes_shardable_models():
    check_strategy("fsdp", preset("base"), 2)  # 50000-token vocabulary, every block dimension even
    check_strategy("fsdp", preset("small"), 4)  # 50257 tokens do not divide: replicated, not refused
    check_strategy("ddp", preset("tiny"), 1)
    with pytest.raises(UserError, match=r"model.layers.0.input_layernorm.weight of shape \(768,\) over 5 ranks"):
        check_strategy("fsdp", preset("base"), 5)
    with pytest.raises(UserError, match="needs 2 or more"):
        check_strategy("fsdp", preset("tiny"), 1)
