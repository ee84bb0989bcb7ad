"""A minimal MLX data-parallel training loop in the MLX blog's style, the baseline of bench_overhead.py.

    python benchmarks/bare_mlx.py --preset small --vocab 50257 --seq-len 128 --batch 8 --steps 10 --out t.json
    (several ranks: started by compare.launch.spawn, mlx.launch or mpirun)

Same model class and optimizer settings as a `dpcompare run`, random token batches of the same shape,
one `mx.compile`d step: forward/backward (with dpcompare's cross-entropy, so the comparison measures the
harness, not the loss formula), `nn.average_gradients`, clipping, AdamW. No data pipeline,
status files, metrics or checkpoints. `--no-sync` skips the gradient all-reduce (bench_collectives.py
uses it to measure what the sync costs inside a step). Rank 0 writes its step times to --out.
"""
import argparse
import json
import time
from functools import partial

import mlx.core as mx
import mlx.nn as nn
import mlx.optimizers as optim
import numpy as np

from common.model.spec import preset
from mlx_impl.model import Llama
from mlx_impl.step import cross_entropy  # nn.losses.cross_entropy's backward computes the exponentials again

parser = argparse.ArgumentParser()
parser.add_argument("--preset", default="small")
parser.add_argument("--vocab", type=int, required=True)
parser.add_argument("--seq-len", type=int, required=True)
parser.add_argument("--batch", type=int, required=True, help="global batch size")
parser.add_argument("--steps", type=int, required=True)
parser.add_argument("--no-sync", action="store_true")
parser.add_argument("--backend", default="any", help="ring or mpi, as the launcher started the ranks")
parser.add_argument("--out", required=True)
args = parser.parse_args()

group = mx.distributed.init(backend=args.backend)  # size 1 when started without a launcher
rank, world = group.rank(), group.size()
spec = preset(args.preset).with_(vocab_size=args.vocab)
model = Llama(spec)
mx.eval(model.parameters())
optimizer = optim.AdamW(learning_rate=3e-4, betas=[0.9, 0.95], eps=1e-8, weight_decay=0.1)


def loss_fn(model, x, y):
    return cross_entropy(model(x), y).mean()


loss_and_grad = nn.value_and_grad(model, loss_fn)
state = [model.state, optimizer.state]


@partial(mx.compile, inputs=state, outputs=state)
def step(x, y):
    loss, grads = loss_and_grad(model, x, y)
    if world > 1 and not args.no_sync:
        grads = nn.average_gradients(grads)
    grads, _ = optim.clip_grad_norm(grads, 1.0)
    optimizer.update(model, grads)
    return loss


rng = np.random.default_rng(rank)
times = []
for _ in range(args.steps):
    tokens = rng.integers(0, args.vocab, (args.batch // world, args.seq_len + 1), dtype=np.int32)
    start = time.perf_counter()
    loss = step(mx.array(tokens[:, :-1]), mx.array(tokens[:, 1:]))
    mx.eval(loss, state)
    loss.item()
    times.append(time.perf_counter() - start)

if rank == 0:
    with open(args.out, "w") as f:
        json.dump({"step_time_s": times, "tokens_per_step": args.batch * args.seq_len, "world_size": world}, f)
