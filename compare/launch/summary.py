"""summary.json of one run: what its ranks' status files and metrics say, with what the launcher knows (the BLAS,
the link, the machine), in one dict that compare/report reads."""
from __future__ import annotations

import shlex
from pathlib import Path

from common.config import RunConfig
from common.costmodel.probe import across_with_last_rank
from common.data.sequences import truncated_records
from common.metrics import read_json, read_metrics, throughput_stats
from common.model.precision import describe as describe_precision
from common.parallel.pipeline import split_idle
from common.runplan import PLAN_FILE

from ..machine import environment as env
from ..machine.blas import summary_fields as blas_fields
from .launchers import device_note
from .watchdog import read_ranks, watched_ranks


def summarize(cfg: RunConfig, run_dir: Path, argv: list[str], blas: str, wall_s: float,
              failure: dict | None, link: dict | None = None) -> dict:
    world = cfg.nproc * cfg.nnodes
    ranks = read_ranks(run_dir, world)
    train_rows, eval_rows = read_metrics(run_dir / "metrics.jsonl")
    mine = watched_ranks(cfg) if cfg.nnodes > 1 else list(range(world))
    rank0 = ranks.get(0, ranks.get(mine[0], {}))
    summary = {
        "framework": cfg.framework, "world_size": world, "backend": cfg.resolved_backend if world > 1 else "none",
        "device": rank0.get("device", cfg.device), "status": "failed" if failure else "ok",
        # A node other than 0 has no metrics.jsonl: its own ranks' status files say how far it got.
        "steps": train_rows[-1]["step"] if train_rows else
                 min(ranks.get(r, {}).get("step", 0) for r in mine) if cfg.nnodes > 1 else 0,
        **throughput_stats(train_rows, cfg.timing_warmup_steps), "warmup_steps": cfg.timing_warmup_steps,
        "compile_s": rank0.get("compile_s"), "time_to_first_step_s": rank0.get("time_to_first_step_s"),
        "breakdown": rank0.get("breakdown"),
        # N=1: the op classes' ms per step at the run's shapes (common/train/opprofile.py)
        "op_profile": rank0.get("op_profile"),
        # --trace: every rank's files, relative to the run dir (common/train/trace.py)
        "trace": sorted(f for r in mine for f in ranks.get(r, {}).get("trace") or []),
        "wall_s": wall_s,
        "peak_mem_bytes": [ranks.get(r, {}).get("peak_mem_bytes") for r in range(world)],
        "peak_rss_bytes": [ranks.get(r, {}).get("peak_rss_bytes") for r in range(world)],
        # Start-up and training alone, before the first checkpoint gathers the state to save it.
        "peak_rss_before_save_bytes": [ranks.get(r, {}).get("peak_rss_before_save_bytes") for r in range(world)],
        # Bytes of the starting weights each rank read (common/checkpoint/tensorsource.py): its part, not the model.
        "weights_bytes_read": [ranks.get(r, {}).get("weights_bytes_read") for r in range(world)],
        # and of AdamW's two moments, when it resumed from a checkpoint (None otherwise)
        "moments_bytes_read": [ranks.get(r, {}).get("moments_bytes_read") for r in range(world)],
        # RSS at each rank's start, before the model is built: the framework's fixed footprint (common/train/loop.py)
        "fixed_rss_bytes": [ranks.get(r, {}).get("fixed_rss_bytes") for r in range(world)],
        # What each rank holds of the training state (Trainer.state_bytes), and how FSDP reduce-scattered.
        "strategy": cfg.strategy, "reduce_scatter": rank0.get("reduce_scatter"),
        # What trains (common/model/lora.py: None = every parameter; else LoRA's rank, alpha, scale, targets, layers)
        # and how the step's loss is normalized (common/train/normalization.py).
        "adapters": cfg.trained.describe(), "loss_normalization": cfg.loss_normalization,
        # Each data-parallel rank's sequences of a global batch (--rank-shares, docs/uneven.md) and --rank-speed.
        "rank_shares": cfg.rank_shares or None, "auto_shares": rank0.get("auto_shares"),  # auto: the timings
        "rank_batch_sizes": (rank0.get("auto_shares") or {}).get("rank_batch_sizes") or list(cfg.rank_batch_sizes),
        "rank_speed": cfg.rank_speed if cfg.world_size > 1 and cfg.rank_speed else None,
        # Each rank's step without the gradient sync (its compute) and the rest of a synced step (its wait at the
        # all-reduce, communication included), from its own time breakdown (compare/report/uneven.py).
        "rank_compute_s": [(ranks.get(r, {}).get("breakdown") or {}).get("unsynced_step_s") for r in range(world)],
        "rank_wait_s": [rank_wait_s(ranks.get(r, {}).get("breakdown")) for r in range(world)],
        "base_quantization": cfg.base_storage.describe(),  # None: a float32 base (common/model/quantize.py)
        "state_bytes": {part: [ranks.get(r, {}).get("state_bytes", {}).get(part) for r in range(world)]
                        for part in ("params", "grads", "optimizer")},
        # Bytes given to all-reduce per step: counted in the step's collectives, and from the shapes.
        "comm_bytes_per_step": rank0.get("comm_bytes_per_step"),
        "comm_bytes_per_step_estimate": rank0.get("comm_bytes_per_step_estimate"),
        "blas": blas, **blas_fields(cfg.framework, cfg.mlx_blas, str(cfg.cache_path)),  # the verdict reads these
        "threads_per_rank": cfg.threads_per_rank,  # and each rank's cores (common/train/placement.py)
        "pinned_cores": [ranks.get(r, {}).get("cores") for r in range(world)],
        "dtype": cfg.dtype, "precision": describe_precision(cfg.dtype),
        "versions": env.versions(), "machine": env.machine(),
        "final_loss": train_rows[-1]["loss"] if train_rows else rank0.get("loss") if cfg.nnodes > 1 else None,
        "final_eval_loss": eval_rows[-1]["eval_loss"] if eval_rows else None,
        "tokens_per_step": train_rows[-1]["tokens"] if train_rows else None,
        "truncated_records": truncated_records(read_json(run_dir / PLAN_FILE, {}).get("token_cache"), cfg.seq_len,
                                               cfg.sequence),  # padded or instruction samples cut to seq_len + 1
        "command": shlex.join(argv), "config": cfg.to_dict(),
    }
    if cfg.init_from:  # the pretrained checkpoint the run started from, and which weights those were
        from common.model.weights import weights_digest

        summary["init_from"] = {"path": str(Path(cfg.init_from).resolve()),
                                "weights_sha256": weights_digest(Path(cfg.init_from), cfg.cache_path)}
    if link is not None:  # the path the ranks talked over, and their own all-reduce on it (common/costmodel/probe.py)
        summary["link"] = {**link, "allreduce": rank0.get("allreduce")}
        if "inner" in link:  # two levels: the ranks' all-reduce inside their groups (None where they cannot split)
            summary["link"]["inner"] = {**link["inner"], "allreduce": rank0.get("allreduce_inner")}
            # and across: one rank per machine in each group, every group at once (None where they cannot split)
            summary["link"]["allreduce_across"] = across_with_last_rank(
                [ranks.get(r, {}).get("allreduce_across") for r in range(world)])
        if rank0.get("allgather"):  # fsdp's own all-gather (common/parallel/fsdp.py measures_all_gather)
            summary["link"]["allgather"] = rank0["allgather"]
    if "pp_bubble_analytic" in rank0:  # pp (common/parallel/pipeline.py): each stage's idle fraction and what it held
        summary["pipeline"] = {
            "schedule": rank0.get("pp_schedule"), "microbatches": rank0.get("pp_microbatches"),
            "bubble": [ranks.get(r, {}).get("pp_bubble") for r in range(world)],
            "idle": split_idle([ranks.get(r, {}).get("pp_bubble") for r in range(world)]),
            "bubble_analytic": rank0.get("pp_bubble_analytic"),
            "layers": [ranks.get(r, {}).get("pp_layers") for r in range(world)],
            # the embedding group: the stages holding a tied matrix (common/parallel/embedding_group.py), [] untied
            "tied_embedding_stages": rank0.get("pp_tied_embedding_stages", []),
            "comm_bytes_per_step": [ranks.get(r, {}).get("comm_bytes_per_step") for r in range(world)]}
    if device_note(cfg):
        summary["device_note"] = device_note(cfg)
    if cfg.nnodes > 1:
        summary.update(nnodes=cfg.nnodes, node_rank=cfg.node_rank, node_ranks=mine)
    if failure:
        summary.update(failure)
    return summary


def rank_wait_s(breakdown: dict | None) -> float | None:
    """A rank's synced step minus its unsynced one: its wait for the others plus the reduction itself."""
    if not breakdown or breakdown.get("unsynced_step_s") is None:
        return None
    return max(0.0, breakdown["synced_step_s"] - breakdown["unsynced_step_s"])
