"""A minimal PyTorch DDP training loop, the baseline of bench_overhead.py.

    python benchmarks/bare_torch.py --preset small --vocab 50257 --seq-len 128 --batch 8 --steps 10 --out t.json
    (under torchrun for several ranks)

Same model class and optimizer settings as a `dpcompare run`, random token batches of the same shape,
DDP with its defaults (gloo, 25 MB buckets), clipping, AdamW. No data pipeline, status files, metrics or
checkpoints. `--no-sync` runs forward/backward under `no_sync()` (no gradient all-reduce), which
bench_collectives.py uses to measure what the sync costs inside a step; `--ddp-as-suite` wraps the model
the way torch_impl/step.py does (gradient_as_bucket_view, static_graph). Rank 0 writes its step times.
"""
import argparse
import json
import os
import time

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

from common.model.spec import preset
from torch_impl.model import Llama

parser = argparse.ArgumentParser()
parser.add_argument("--preset", default="small")
parser.add_argument("--vocab", type=int, required=True)
parser.add_argument("--seq-len", type=int, required=True)
parser.add_argument("--batch", type=int, required=True, help="global batch size")
parser.add_argument("--steps", type=int, required=True)
parser.add_argument("--no-sync", action="store_true")
parser.add_argument("--ddp-as-suite", action="store_true")
parser.add_argument("--out", required=True)
args = parser.parse_args()

torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", 1)))  # torchrun would force 1
world = int(os.environ.get("WORLD_SIZE", 1))
rank = int(os.environ.get("RANK", 0))
if world > 1:
    dist.init_process_group("gloo")
model = Llama(preset(args.preset).with_(vocab_size=args.vocab))
# static_graph cannot run under no_sync() (a DDP assertion); a step that does not communicate has no use for it.
suite_options = {"gradient_as_bucket_view": True, "static_graph": not args.no_sync} if args.ddp_as_suite else {}
ddp = DDP(model, **suite_options) if world > 1 else model
optimizer = torch.optim.AdamW(model.parameters(), lr=3e-4, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)

rng = np.random.default_rng(rank)
times = []
for _ in range(args.steps):
    tokens = torch.from_numpy(rng.integers(0, args.vocab, (args.batch // world, args.seq_len + 1)))
    x, y = tokens[:, :-1], tokens[:, 1:]
    start = time.perf_counter()
    with ddp.no_sync() if args.no_sync and world > 1 else torch.enable_grad():
        loss = F.cross_entropy(ddp(x).flatten(0, 1), y.flatten())
        loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    optimizer.step()
    optimizer.zero_grad(set_to_none=not args.ddp_as_suite)  # bucket views must stay allocated
    loss.item()
    times.append(time.perf_counter() - start)

if rank == 0:
    with open(args.out, "w") as f:
        json.dump({"step_time_s": times, "tokens_per_step": args.batch * args.seq_len, "world_size": world}, f)
if world > 1:
    dist.destroy_process_group()
