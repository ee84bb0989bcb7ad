"""A short greedy continuation of a fixed prompt from a run's final weights, written to <run_dir>/sample.json.

`dpcompare compare` calls write_samples once its runs have trained; the report only reads the files
(compare/report/samples.py). The run's own framework generates (`python -m {mlx,torch}_impl.sample`, one
process), from the run's latest checkpoint (a LoRA run's: its adapters over the frozen base it trained on,
common/train/generate.py), and the run's tokenizer encodes the prompt and decodes the answer. Greedy decoding
from weights that agree in fp32 gives the same tokens in both frameworks, so different texts point at different
weights (or, rarely, at a near-tie between the two most likely tokens).
"""
from __future__ import annotations

import json
import subprocess
import sys
import tempfile
from pathlib import Path

from common.checkpoint.store import latest_checkpoint
from common.errors import UserError
from common.metrics import write_json
from common.runplan import RunPlan

from ..machine import environment as env
from ..report.samples import SAMPLE_FILE

PROJECT_ROOT = Path(__file__).resolve().parents[2]
PROMPT = "Once upon a time"
MAX_NEW_TOKENS = 24
TIMEOUT_S = 600


def continuation(run_dir: Path, prompt: str = PROMPT, max_new_tokens: int = MAX_NEW_TOKENS) -> dict:
    """{"prompt", "text", "tokens", "framework", "checkpoint"}: `text` is the continuation alone
    (decoded new tokens), `tokens` their ids."""
    from tokenizers import Tokenizer

    run_dir = Path(run_dir)
    ckpt = latest_checkpoint(run_dir)
    if ckpt is None:
        raise UserError(f"{run_dir} holds no checkpoint to sample from")
    plan = RunPlan.read(run_dir)
    framework = plan.config.framework
    tokenizer_file, meta = plan.tokenizer_file()
    tokenizer = Tokenizer.from_file(str(tokenizer_file))
    ids = tokenizer.encode(prompt, add_special_tokens=False).ids
    if not ids:
        raise UserError(f"the prompt {prompt!r} encodes to no tokens")
    if meta.get("bos_id") is not None:  # a document starts with BOS in training (common/data/tokencache.py)
        ids = [int(meta["bos_id"]), *ids]
    extra = env.thread_env(plan.config.threads_per_rank)
    if framework == "mlx":
        extra.update(env.mlx_blas(plan.config.mlx_blas)[1])
    child_env = env.child_env(extra)
    with tempfile.TemporaryDirectory(prefix="dpcompare-sample-") as tmp:
        out = Path(tmp) / "sample.json"
        proc = subprocess.run([sys.executable, "-m", f"{framework}_impl.sample", str(run_dir), str(ckpt), str(out),
                               ",".join(map(str, ids)), str(max_new_tokens)],
                              capture_output=True, text=True, env=child_env, cwd=PROJECT_ROOT, timeout=TIMEOUT_S)
        if proc.returncode != 0 or not out.exists():
            lines = (proc.stderr or proc.stdout).strip().splitlines()
            raise RuntimeError(f"{framework} sampling failed: {lines[-1] if lines else proc.returncode}")
        tokens = json.loads(out.read_text())["tokens"]
    return {"prompt": prompt, "text": tokenizer.decode(tokens, skip_special_tokens=False), "tokens": tokens,
            "framework": framework, "checkpoint": str(ckpt)}


def write_samples(run_dirs: list[Path], **kwargs) -> None:
    """<run_dir>/sample.json for each run: its continuation, or {"prompt", "error", "checkpoint"} when it
    cannot be sampled (which does not stop the others)."""
    for run_dir in map(Path, run_dirs):
        try:
            found = continuation(run_dir, **kwargs)
        except (UserError, RuntimeError, OSError, subprocess.TimeoutExpired) as err:
            ckpt = latest_checkpoint(run_dir)
            found = {"prompt": kwargs.get("prompt", PROMPT), "error": str(err),
                     "checkpoint": str(ckpt) if ckpt else None}
        write_json(run_dir / SAMPLE_FILE, found)
