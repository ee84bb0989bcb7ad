"""torch_impl/adamw.py: torch's AdamW update without a torch.optim.Optimizer, which would import torch._dynamo
at every torch rank's start (1.1 s, AMD EPYC Zen 4)."""
import subprocess
import sys
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

from torch_impl.adamw import AdamW  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("set_to_none", [True, False])
def test_the_update_equals_torch_optim_adamw_bit_for_bit(set_to_none):
    """Two groups, a parameter left without a gradient in one step, a changing learning rate, 4 steps: every
    parameter and moment equals torch.optim.AdamW's exactly."""
    torch.manual_seed(0)
    shapes = [(7, 5), (5,), (3, 4, 2)]
    ours = [torch.nn.Parameter(torch.randn(s)) for s in shapes]
    theirs = [torch.nn.Parameter(p.detach().clone()) for p in ours]
    kwargs = dict(lr=3e-3, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
    mine = AdamW([{"params": ours[:2]}, {"params": ours[2:]}], **kwargs)
    reference = torch.optim.AdamW([{"params": theirs[:2]}, {"params": theirs[2:]}], **kwargs)
    for step in range(4):
        grads = [torch.randn(s) for s in shapes]
        skip = 1 if step == 2 else None  # a parameter without a gradient keeps its state and its step count
        for params, opt in ((ours, mine), (theirs, reference)):
            for i, (p, g) in enumerate(zip(params, grads)):
                if i != skip:
                    p.grad = g.clone() if p.grad is None else p.grad.copy_(g)
            for group in opt.param_groups:
                group["lr"] = 3e-3 * (1 + step)
            opt.step()
            opt.zero_grad(set_to_none=set_to_none)
        for a, b in zip(ours, theirs):
            assert torch.equal(a, b)
            assert (a.grad is None) == (b.grad is None) == set_to_none
            for key in ("step", "exp_avg", "exp_avg_sq"):
                assert torch.equal(mine.state[a][key], reference.state[b][key]), key


def test_a_ddp_trainer_trains_without_importing_dynamo_dtensor_or_pipelining():
    """A ddp rank's start-up imports none of what only fsdp, tp, pp, meshes or torch.optim need (step.py's lazy
    STRATEGIES, adamw.py): 1.1 s of every torch rank's start."""
    code = """
import sys
import numpy as np
from common.config import RunConfig
from common.model.spec import ModelSpec
from common.model.weights import init_weights
from common.train.loop import World
from torch_impl.step import Trainer
spec = ModelSpec(vocab_size=97, dim=32, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=64, max_seq_len=32)
trainer = Trainer(RunConfig(framework="torch", lr=3e-3), spec, init_weights(spec, 0), World())
rows = np.random.default_rng(0).integers(0, 97, size=(4, 17), dtype=np.int32)
for step in range(2):
    loss, norm = trainer.train_step([(rows[:, :-1], rows[:, 1:], np.ones((4, 16), np.float32))], 3e-3, 64)
assert loss > 0 and norm > 0 and trainer.optimizer.state
print(",".join(m for m in ("torch._dynamo", "torch.distributed.tensor", "torch.distributed.pipelining")
               if m in sys.modules))
"""
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() == "", f"a ddp Trainer imported {out.stdout.strip()}"
