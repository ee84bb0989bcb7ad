"""The RunConfig's allowed values and its checks, run whenever a RunConfig is made (common/config.py).

Its own module so that config.py holds the fields and what derives from them, and this one what a config may hold.
"""
from __future__ import annotations

from pathlib import Path

from common.data.sequences import MASK_PROMPT_NEEDS_RECORDS
from common.errors import UserError
from common.model.quantize import base_storage_of
from common.parallel import STRATEGIES
from common.parallel.pipeline import SCHEDULES as PP_SCHEDULES
from common.placement import check_placement
from common.recipes import RECIPES
from common.data.conventions import MASK_CONVENTIONS, PADDING_RULES
from common.data.sampler import DATA_ORDERS
from common.data.shares import check_shares, parse_speeds
from common.model.lora import SCALE_CONVENTIONS, Adapters
from common.train.lr_schedule import SCHEDULES

FRAMEWORKS = ("mlx", "torch")
# jaccl and jaccl-ring: RDMA over Thunderbolt 5 between Macs (a mesh, or a ring of neighbours), through
# mlx.launch --hostfile only.
BACKENDS = {"mlx": ("auto", "ring", "mpi", "nccl", "jaccl", "jaccl-ring"), "torch": ("auto", "gloo", "nccl")}
HOSTFILE_ONLY_BACKENDS = ("jaccl", "jaccl-ring")
# MLX backends whose group splits into sub-groups (`Group.split`), which a mesh needs: mlx 0.32.4's ring refuses
# ("[ring] Group split not supported"), jaccl is untried (docs/strategies.md "Meshes").
MLX_SPLIT_BACKENDS = ("mpi", "nccl")
COMMUNICATION_STREAMS = ("auto", "cpu", "default")  # mlx_impl/comm.py
SEQUENCE_MODES = ("packing", "padding")
DEVICES = ("auto", "cpu", "cuda", "mps", "gpu")
MLX_BLAS = ("auto", "wheel", "system", "bundled")  # compare/machine/blas.py
MLX_CPU_JIT = ("auto", "native", "baseline")
MLX_EXP = ("auto", "native", "fused")  # mlx_impl/fast_exp.py
MLX_BF16_MATMUL = ("auto", "native", "fp32")  # mlx_impl/kernels.py matmul
DTYPES = ("float32", "bfloat16")
CHECKPOINT_FORMATS = ("hf", "sharded")  # common/checkpoint/store.py, common/checkpoint/sharded.py
TRACKERS = ("tensorboard", "wandb", "trackio")  # --report-to (compare/report/tracking.py)
LAUNCHERS = ("auto", "local", "slurm")  # auto: srun inside a Slurm allocation (compare/launch/slurm.py)


def validate(self) -> None:
    """Every check of a RunConfig, run when one is made (RunConfig.validate)."""
    _choice("framework", self.framework, FRAMEWORKS)
    _choice("backend", self.backend, BACKENDS[self.framework],
            f" for framework {self.framework}")
    _choice("sequence", self.sequence, SEQUENCE_MODES)
    _choice("loss_normalization", self.loss_normalization, ("global-tokens", "per-rank"))
    _choice("device", self.device, DEVICES)
    _choice("mlx_blas", self.mlx_blas, MLX_BLAS)
    _choice("mlx_cpu_jit", self.mlx_cpu_jit, MLX_CPU_JIT)
    _choice("mlx_exp", self.mlx_exp, MLX_EXP)
    _choice("mlx_bf16_matmul", self.mlx_bf16_matmul, MLX_BF16_MATMUL)
    _choice("dtype", self.dtype, DTYPES)
    _choice("strategy", self.strategy, (*STRATEGIES, "mesh"))
    _choice("pp_schedule", self.pp_schedule, PP_SCHEDULES)
    _choice("cp_attention", self.cp_attention, ("ulysses", "ring"))  # common/parallel/cp.py CP_ATTENTIONS
    _choice("checkpoint_format", self.checkpoint_format, CHECKPOINT_FORMATS)
    _choice("communication_stream", self.communication_stream, COMMUNICATION_STREAMS)
    _choice("launcher", self.launcher, LAUNCHERS)
    for tracker in filter(None, (t.strip() for t in self.report_to.split(","))):
        _choice("report_to", tracker, ("none",) + TRACKERS)
    for name in ("seq_len", "global_batch_size", "grad_accum", "steps", "nproc", "threads_per_rank",
                 "builtin_vocab_size", "builtin_corpus_bytes", "eval_batches", "nnodes"):
        _positive(name, getattr(self, name))
    for name in ("warmup_steps", "lr_decay_steps", "eval_every", "checkpoint_every", "timing_warmup_steps", "seed",
                 "profile_steps"):
        if getattr(self, name) < 0:
            raise UserError(f"{name} must be >= 0, got {getattr(self, name)}")
    for name in ("lr", "adam_eps", "all_reduce_size_mb", "bucket_cap_mb", "collective_timeout_s"):
        if not getattr(self, name) > 0:
            raise UserError(f"{name} must be positive, got {getattr(self, name)}")
    for name in ("weight_decay", "grad_clip", "lora_rank", "lora_alpha", "lora_layers", "pp_microbatches"):
        if getattr(self, name) < 0:
            raise UserError(f"{name} must be >= 0, got {getattr(self, name)}")
    for name in ("beta1", "beta2", "min_lr_ratio"):
        if not 0 <= getattr(self, name) < 1 + (name == "min_lr_ratio"):
            raise UserError(f"{name} must be in [0, 1), got {getattr(self, name)}")
    check_placement(self)  # where the ranks run: nodes, hostfiles, links, launcher, restarts
    if not 0 <= self.node_rank < self.nnodes:
        raise UserError(f"node_rank {self.node_rank} must be in [0, nnodes={self.nnodes})")
    if not 0 <= self.val_fraction < 1:
        raise UserError(f"val_fraction must be in [0, 1), got {self.val_fraction}")
    if self.mask_prompt and (self.dataset == "builtin" or self.streaming
                             or Path(self.dataset).suffix.lower() in (".txt", ".parquet")):
        raise UserError(MASK_PROMPT_NEEDS_RECORDS)  # a .jsonl's records are known once read (prepare_inputs)
    if self.resolved_backend in HOSTFILE_ONLY_BACKENDS and self.world_size > 1 and not self.hostfile:
        raise UserError(f"--backend {self.resolved_backend} runs between Macs through mlx.launch: it needs "
                        "--hostfile FILE (mlx.distributed_config --backend "
                        f"{self.resolved_backend} --output-hostfile FILE writes one)")
    if self.resolved_backend == "nccl" and self.communication_stream == "cpu":
        raise UserError("communication_stream cpu does not work with the nccl backend (NCCL reduces GPU "
                        "memory on the GPU stream); use auto")
    check_shares(self.rank_shares, self.global_batch_size, self.data_parallel_size, self.grad_accum,
                 self.strategy, bool(self.rank_shares) and self.layout.takes_uneven_shares, self.peer,
                 self.max_restarts)  # common/data/shares.py
    parse_speeds(self.rank_speed, self.world_size)
    self.micro_batch_size  # raises when the global batch does not split
    if self.mesh and self.framework == "mlx" and self.resolved_backend not in MLX_SPLIT_BACKENDS:
        raise UserError(f"--mesh {self.mesh} needs a communicator per axis, and MLX's {self.resolved_backend} "
                        "backend cannot split its group (mlx 0.32.4 splits on mpi and nccl only): "
                        "use --backend mpi (docs/strategies.md)")
    strategy = self.layout
    strategy.check_batch(self.global_batch_size, self.grad_accum, self.pp_pieces)
    check_recipe_choices(self)  # the recipe's choices, and those a strategy cannot take
    stages = strategy.mesh.axis("pp") if strategy.mesh.has("pp") else 1
    if self.framework == "torch" and 1 < stages and self.pp_pieces < stages:
        # torch.distributed.pipelining's schedules refuse it at the first step, on one rank, mid-job.
        raise UserError(f"--pp-microbatches {self.pp_pieces} is fewer than the {stages} pipeline stages; "
                        f"torch's pipeline schedules need at least one micro-batch per stage (--pp-microbatches "
                        f"{stages} or more)")
    # preset, [model] fields and seq_len checked now; and whether the strategy can split that model (the one
    # place this is checked: every RunConfig is validated when it is made, before anything is prepared)
    strategy.check(self.model_spec(vocab_size=None), self.cp_attention)  # Ulysses splits heads, ring not
    strategy.check_sequence(self.seq_len, self.padding_rule, self.cp_attention)  # cp cuts each sequence (parallel/cp.py)
    if self.checkpoint_format == "sharded" and not strategy.writes_sharded_checkpoints:
        raise UserError(f"--checkpoint-format sharded: --strategy {self.strategy} writes hf checkpoints only (rank "
                        "0 gathers the sharded moments); use --checkpoint-format hf")
    trained = self.trained
    if isinstance(trained, Adapters):
        if not strategy.trains_adapters:
            raise UserError(f"--lora-rank trains under ddp, zero1 and zero2 only for now; --strategy {self.strategy} "
                            "splits the model, and the adapters with it (docs/strategies.md)")
        if self.checkpoint_format != "hf":
            raise UserError("--checkpoint-format sharded does not hold LoRA adapters yet; use hf (the "
                            "adapters are small: rank 0 writes them whole)")
        trained.check(self.model_spec(vocab_size=None))
    storage = self.base_storage
    if storage.bits < 32 and not isinstance(trained, Adapters):
        raise UserError("a quantized base is frozen: --quantize-base (or a quantized --init-from folder) needs "
                        "--lora-rank R, as QLoRA trains adapters beside it")
    flags = base_storage_of(self.quantize_base, self.quantize_group_size)
    if self.quantize_base and self.init_from and storage != flags:
        raise UserError(f"--init-from {self.init_from} is already quantized ({storage.describe()}); drop "
                        "--quantize-base or pass those values")
    if self.peer:  # a peer's trainer takes only the choices it has a setting for (common/peers.py)
        from common.peers import PEERS, check as check_peer

        _choice("peer", self.peer, tuple(PEERS))
        check_peer(self)


def _choice(name: str, value, allowed, where: str = "") -> None:
    if value not in allowed:
        raise UserError(f"unknown {name} {value!r}{where}; allowed: {', '.join(allowed)}")


def _positive(name: str, value) -> None:
    if value <= 0:
        raise UserError(f"{name} must be positive, got {value}")


OPTIMIZERS = ("adamw", "adam")  # mlx_impl/optimizer.py, torch_impl/optimizer.py


def check_recipe_choices(cfg) -> None:
    """The recipe's choices (common/recipes.py): each a known value, and one a strategy can take."""
    _choice("recipe", cfg.recipe, tuple(RECIPES))
    _choice("mask_convention", cfg.mask_convention, tuple(MASK_CONVENTIONS))
    _choice("padding_rule", cfg.padding_rule, tuple(PADDING_RULES))
    _choice("data_order", cfg.data_order, DATA_ORDERS)
    _choice("lr_schedule", cfg.lr_schedule, tuple(SCHEDULES))
    _choice("optimizer", cfg.optimizer, OPTIMIZERS)
    _choice("lora_scale_convention", cfg.lora_scale_convention, tuple(SCALE_CONVENTIONS))
    if cfg.optimizer == "adam" and cfg.weight_decay:
        raise UserError(f"--optimizer adam takes no weight decay here (mlx-lm's Adam has none; torch's would add "
                        f"it to the gradient); use --optimizer adamw for --weight-decay {cfg.weight_decay}, or "
                        "--weight-decay 0")
    if cfg.padding_rule != "seq-len" and cfg.layout.mesh.has("pp"):
        raise UserError(f"--padding-rule {cfg.padding_rule} changes the batch's width from step to step, and a "
                        "pipeline's stages exchange activations of one shape; use --padding-rule seq-len with pp")
