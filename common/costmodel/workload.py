"""What a step trains, as the cost model sees it: the model, the global batch, the precision and the
framework's buckets; from a run's summary.json or by hand (benchmarks/plan_on_paper.py)."""
from __future__ import annotations

from dataclasses import dataclass

from common.model.spec import ModelSpec

# summary.json's config field that holds ddp's all-reduce chunk (MiB), per framework
BUCKET_FIELD = {"mlx": "all_reduce_size_mb", "torch": "bucket_cap_mb"}


@dataclass(frozen=True)
class Workload:
    """What a step trains: the model, the global batch, the precision and the framework's buckets."""
    spec: ModelSpec
    seq_len: int
    global_batch_size: int
    grad_accum: int = 1
    dtype: str = "float32"
    framework: str = "torch"
    bucket_bytes: int | None = None  # ddp's all-reduce chunks: MLX all_reduce_size_mb, torch bucket_cap_mb
    target_tokens: int | None = None  # real target tokens per step where a run counted them (padding has fewer)
    pp_microbatches: int = 4          # pp: pieces per micro-step (RunConfig.pp_microbatches)
    pp_schedule: str = "1f1b"         # pp: the order of a stage's pieces (RunConfig.pp_schedule)
    trained_elements: int | None = None  # what has gradients to reduce (LoRA: the adapters); None: every parameter
    head_held: tuple[float, float] | None = None  # what the head holds at its peak, measured by plan's probe
    #   (common/costmodel/probed.py head_held): float32 logits-sized buffers of a micro-batch, and bytes beside them
    #   (its vocabulary matrices' gradients); model_memory.py's head phase. None: not measured

    @property
    def tokens_per_step(self) -> int:
        return self.target_tokens or self.global_batch_size * self.seq_len

    def micro_rows(self, data_parallel_size: int) -> float:
        """Sequences per rank per micro-step, where `data_parallel_size` ranks split the batch (a strategy
        object's `dp_size`: tp and pp ranks all read the whole batch, 1)."""
        return self.global_batch_size / (data_parallel_size * self.grad_accum)


def workload_of(summary: dict, spec: ModelSpec) -> Workload:
    """The Workload a run's summary.json describes."""
    cfg = summary.get("config") or {}
    framework = summary.get("framework", cfg.get("framework", "torch"))
    bucket_mb = cfg.get(BUCKET_FIELD.get(framework, BUCKET_FIELD["torch"]))
    return Workload(spec, int(cfg.get("seq_len", 128)), int(cfg.get("global_batch_size", 8)),
                    int(cfg.get("grad_accum", 1)), summary.get("dtype", cfg.get("dtype", "float32")), framework,
                    int(bucket_mb * 2**20) if bucket_mb else None, summary.get("tokens_per_step"),
                    int(cfg.get("pp_microbatches") or (summary.get("pipeline") or {}).get("microbatches") or 4),
                    str(cfg.get("pp_schedule") or "1f1b"), lora_elements(cfg, spec))


def lora_elements(cfg: dict, spec: ModelSpec) -> int | None:
    """A LoRA run's adapter elements (what its ddp all-reduces), from its config; None for a full fine-tune."""
    if not int(cfg.get("lora_rank") or 0):
        return None
    from common.model.lora import trained_parameters_of

    trained = trained_parameters_of(int(cfg["lora_rank"]), float(cfg.get("lora_alpha") or 0.0),
                                    str(cfg.get("lora_targets") or ""), int(cfg.get("lora_layers") or 0))
    return int(trained.trained_parameters(spec))
