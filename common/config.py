"""One RunConfig for every run: defaults < TOML file < CLI flags, validated up front.

A TOML file holds the same keys as RunConfig at the top level, plus an optional `[model]` table of
ModelSpec fields that override the preset. Its paths are relative to the file's own directory
(common/paths.py); the flags' paths, to the directory dpcompare was started in:

    preset = "small"
    dataset = "data/tinystories/train.txt"
    tokenizer = "data/gpt2"
    steps = 200
    [model]
    n_layers = 2

Reading the file, an --init-from folder and each value's type: common/config_sources.py.
"""
from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass, field, fields, replace
from pathlib import Path

from common.config_sources import coerce, folder_spec, has_tokenizer, read_toml
from common.errors import UserError
from common.data.sampler import check_divisible
from common.data.sequences import MASK_PROMPT_NEEDS_RECORDS
from common.model.lora import Adapters, Trained, trained_parameters_of
from common.model.quantize import BaseStorage, base_storage_of, folder_quantization
from common.model.spec import ModelSpec, preset
from common.parallel.pipeline import SCHEDULES as PP_SCHEDULES
from common.parallel.pipeline import default_pieces
from common.parallel import STRATEGIES, Layout, layout, mesh_fields
from common.placement import check_placement

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


def default_cache_dir() -> Path:
    """Token caches, tokenizers and seed checkpoints, shared by every run of this user."""
    if os.environ.get("DPCOMPARE_CACHE"):
        return Path(os.environ["DPCOMPARE_CACHE"])
    return Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "dpcompare"


def default_backend(framework: str, device: str, mesh: str = "") -> str:
    """The backend a run gets without --backend (`RunConfig.resolved_backend`), and the one `dpcompare plan`
    predicts a layout on: nccl on CUDA, else gloo for torch; for MLX ring, but mpi for a mesh, which needs
    sub-groups that the ring backend cannot make (MLX_SPLIT_BACKENDS)."""
    if device == "cuda":
        return "nccl"
    if framework == "torch":
        return "gloo"
    return "mpi" if mesh else "ring"


@dataclass
class RunConfig:
    # Model: a preset, optionally overridden field by field ([model] table in TOML).
    preset: str = "tiny"
    model: dict = field(default_factory=dict)
    # Data.
    dataset: str = "builtin"
    dataset_split: str = "train"
    text_field: str = "text"
    mask_prompt: bool = False        # instruction records: the loss on completion tokens only (common/data/instructions.py)
    streaming: bool = False
    tokenizer: str = "builtin"
    builtin_vocab_size: int = 2048
    builtin_corpus_bytes: int = 3_000_000
    val_fraction: float = 0.01
    sequence: str = "packing"
    loss_normalization: str = "global-tokens"  # or per-rank (mlx-lm's): common/train/normalization.py
    # LoRA (common/model/lora.py): adapters of this rank on lora_targets ("q_proj,v_proj"; "" = those two) of the
    # last lora_layers blocks (0 = all), scale lora_alpha / rank (alpha 0 = 2 x rank); rank 0 trains every parameter.
    lora_rank: int = 0
    lora_alpha: float = 0.0
    lora_targets: str = ""
    lora_layers: int = 0
    # QLoRA (common/model/quantize.py): the frozen base in quantize_base bits (0: float32), quantize_group_size
    # weights to a scale and bias; an --init-from folder written by mlx_lm.convert -q brings its own.
    quantize_base: int = 0
    quantize_group_size: int = 64
    seq_len: int = 128
    cache_dir: str = ""
    # Batch: the global batch is split over world_size ranks x grad_accum micro-steps.
    global_batch_size: int = 8
    grad_accum: int = 1
    # Optimizer and schedule.
    lr: float = 3e-4
    beta1: float = 0.9
    beta2: float = 0.95
    adam_eps: float = 1e-8
    weight_decay: float = 0.1
    grad_clip: float = 1.0
    warmup_steps: int = 10
    min_lr_ratio: float = 0.1
    steps: int = 100
    lr_decay_steps: int = 0          # cosine horizon; 0 = `steps`. Fix it to stop a run early and extend it.
    seed: int = 0
    # Evaluation and checkpoints (0 = only at the end).
    eval_every: int = 50
    eval_batches: int = 2
    checkpoint_every: int = 0
    checkpoint_format: str = "hf"    # hf: whole HF files (rank 0 writes); sharded: each rank its own (common/checkpoint/sharded.py)
    # Where and how it runs.
    framework: str = "mlx"
    nproc: int = 1
    strategy: str = "ddp"            # ddp, fsdp, tp or pp (common/parallel/: one object each), or mesh
    mesh: str = ""                   # strategy mesh: its axes, "dp=2,tp=2" (common/parallel/mesh.py), canonical order
    pp_microbatches: int = 0         # pp: pieces each micro-step's batch is cut into; 0: pp_pieces chooses
    pp_schedule: str = "1f1b"        # pp: gpipe or 1f1b
    backend: str = "auto"
    device: str = "auto"
    dtype: str = "float32"
    threads_per_rank: int = 1
    mlx_blas: str = "auto"
    mlx_cpu_jit: str = "auto"        # mx.compile kernel flags, Linux x86 (compare/machine/environment.py)
    mlx_exp: str = "auto"            # exp in softmax, cross-entropy and SiLU: auto, native or fused (mlx_impl/fast_exp.py)
    mlx_bf16_matmul: str = "auto"    # bf16 matmuls on a CPU: auto, native or fp32 (sgemm, one rounding; mlx_impl/kernels.py)
    all_reduce_size_mb: float = 32.0
    # MLX: the stream collectives run on. auto = the CPU stream on a Metal GPU, where a collective on the
    # GPU stream that waits ~5 s for a slow peer is killed by Metal's watchdog (mlx_impl/comm.py).
    communication_stream: str = "auto"
    bucket_cap_mb: float = 25.0
    torch_compile: bool = False
    # glibc malloc that keeps freed memory instead of unmapping it: 1.3-1.4x faster CPU steps for both
    # frameworks (fewer page faults), at up to 1.7x the peak RSS. Off by default: it changes memory figures.
    tune_malloc: bool = False
    # where one machine's ranks outnumber its cores: each framework's placement (common/train/placement.py; MLX pins
    # its ranks one core each, round-robin); off: the kernel places every rank
    pin_ranks: bool = True
    hostfile: str = ""
    nnodes: int = 1                  # several nodes, each started by hand: torch (torchrun) or MLX ring
    node_rank: int = 0
    rdzv_endpoint: str = ""
    init_from: str = ""              # an HF-format Llama dir to start from instead of the seeded init
    collective_timeout_s: float = 60.0
    # After a rank dies, hangs or fails: restart the job from its latest checkpoint, at most this many times,
    # going down to min_nproc ranks (0: nproc) when nproc cannot be had back (compare/launch/restarts.py).
    max_restarts: int = 0
    min_nproc: int = 0
    link: str = ""                   # emulate a link of this rate between local ranks (compare/launch/netns.py)
    # two levels: groups of group_size consecutive ranks (one machine each) on a link_inner link, the groups
    # joined by the `link` one (compare/launch/topology.py)
    link_inner: str = ""
    group_size: int = 0
    # a job of 2 or more ranks times its own all-reduce before training (common/costmodel/probe.py): the cost
    # model's link (summary.json link.allreduce). Off: 0.2-0.9 s less per loopback job, up to 5 s per probe over a
    # slow link, and predictions from the TCP probe's or the backend's assumed loopback figures instead.
    link_probe: bool = True
    launcher: str = "auto"           # LAUNCHERS: srun inside a Slurm allocation, or this machine's own launchers
    timing_warmup_steps: int = 3
    profile_steps: int = 8           # rounds of extra steps after the run for the time breakdown (common/train/breakdown.py); 0 = none
    op_profile: bool = True          # at N=1: the op classes timed after the run (common/train/opprofile.py)
    trace: bool = False              # then a timeline of 2 more steps per rank in RUN_DIR/trace/ (common/train/trace.py)
    out: str = ""
    resume: bool = False
    overwrite: bool = False
    quiet: bool = False
    report_to: str = ""              # comma list of TRACKERS, written from metrics.jsonl after the run

    # ---- construction -------------------------------------------------------------------------
    @classmethod
    def from_sources(cls, toml_path: str | None = None, overrides: dict | None = None) -> "RunConfig":
        values: dict = {}
        if toml_path:
            values.update(read_toml(toml_path))
        for key, value in (overrides or {}).items():
            if value is None:
                continue
            if key == "model":
                values["model"] = {**values.get("model", {}), **value}
            else:
                values[key] = value
        return cls.from_dict(values)

    @classmethod
    def from_dict(cls, values: dict) -> "RunConfig":
        known = {f.name: f for f in fields(cls)}
        for key in values:
            if key not in known:
                raise UserError(f"unknown config field {key!r}; allowed: {', '.join(sorted(known))}")
        typed = {k: coerce(k, v, str(known[k].type)) for k, v in values.items()}
        cfg = cls(**mesh_fields(typed))
        cfg.validate()
        return cfg

    def replace(self, **changes) -> "RunConfig":
        cfg = replace(self, **changes)
        cfg.validate()
        return cfg

    def to_dict(self) -> dict:
        return asdict(self)

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2)

    # ---- derived values -----------------------------------------------------------------------
    def model_spec(self, vocab_size: int | None = None) -> ModelSpec:
        """The preset with [model] overrides; the tokenizer's vocab size applies unless set explicitly.
        With init_from, the folder's config.json is the spec, and a [model] field may only restate it."""
        if self.init_from:
            spec = folder_spec(self.init_from)
            for key, value in self.model.items():
                try:
                    restated = ModelSpec.from_dict({**spec.to_dict(), key: value})
                except TypeError as err:
                    raise UserError(f"invalid [model] table: {err}") from None
                if restated != spec:
                    raise UserError(f"model.{key}={value!r} contradicts {Path(self.init_from) / 'config.json'}, "
                                    f"where it is {spec.to_dict()[key]!r}; drop it (--init-from sets the model)")
        else:
            spec = preset(self.preset)
            if vocab_size is not None and "vocab_size" not in self.model:
                spec = spec.with_(vocab_size=vocab_size)
            try:
                spec = ModelSpec.from_dict({**spec.to_dict(), **self.model})
            except TypeError as err:
                raise UserError(f"invalid [model] table: {err}") from None
        if vocab_size is not None and vocab_size > spec.vocab_size:
            raise UserError(f"the tokenizer has {vocab_size} tokens, more than the model's vocab_size "
                            f"{spec.vocab_size}")
        if self.seq_len > spec.max_seq_len:
            raise UserError(f"seq_len {self.seq_len} exceeds the model's max_seq_len {spec.max_seq_len}")
        return spec

    @property
    def resolved_tokenizer(self) -> str:
        """--tokenizer, except that with --init-from and no tokenizer named, the folder's own tokenizer."""
        if self.init_from and self.tokenizer == "builtin" and has_tokenizer(Path(self.init_from)):
            return str(Path(self.init_from))
        return self.tokenizer

    @property
    def world_size(self) -> int:
        return self.nproc * self.nnodes

    @property
    def data_parallel_size(self) -> int:
        """Ranks that read different samples: all of them, except where the strategy's ranks are one replica
        between them and all read the whole batch (tp, pp)."""
        return self.layout.dp_size

    @property
    def pp_pieces(self) -> int:
        """The pieces a pipeline cuts each micro-step's batch into: --pp-microbatches, or where it is not given the
        largest count up to 4 that divides that batch, at least one per stage for torch's schedules
        (common/parallel/pipeline.py default_pieces)."""
        if self.pp_microbatches:
            return self.pp_microbatches
        grid = self.layout.mesh
        stages = grid.axis("pp") if grid.has("pp") else 1
        rows = self.global_batch_size // max(1, self.data_parallel_size * self.grad_accum)
        return default_pieces(rows, stages, at_least_stages=self.framework == "torch")

    @property
    def trained(self) -> Trained:
        """Which parameters train (common/model/lora.py): the whole model, or adapters beside a frozen base."""
        return trained_parameters_of(self.lora_rank, self.lora_alpha, self.lora_targets, self.lora_layers)

    @property
    def base_storage(self) -> BaseStorage:
        """How the frozen base is stored (common/model/quantize.py): float32, or quantized (flags or the folder's)."""
        folder = folder_quantization(Path(self.init_from)) if self.init_from else None
        return folder or base_storage_of(self.quantize_base, self.quantize_group_size)

    @property
    def layout(self) -> Layout:
        """The strategy's object (common/parallel/): one strategy over every rank, or the mesh's composition."""
        return layout(self.strategy, self.world_size, self.mesh)

    @property
    def micro_batch_size(self) -> int:
        return check_divisible(self.global_batch_size, self.data_parallel_size, self.grad_accum)

    @property
    def resolved_backend(self) -> str:
        if self.backend != "auto":
            return self.backend
        return default_backend(self.framework, self.device, self.mesh)

    @property
    def cache_path(self) -> Path:
        return Path(self.cache_dir) if self.cache_dir else default_cache_dir()

    # ---- validation ---------------------------------------------------------------------------
    def validate(self) -> None:
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
        self.micro_batch_size  # raises when the global batch does not split
        if self.mesh and self.framework == "mlx" and self.resolved_backend not in MLX_SPLIT_BACKENDS:
            raise UserError(f"--mesh {self.mesh} needs a communicator per axis, and MLX's {self.resolved_backend} "
                            "backend cannot split its group (mlx 0.32.4 splits on mpi and nccl only): "
                            "use --backend mpi (docs/strategies.md)")
        strategy = self.layout
        strategy.check_batch(self.global_batch_size, self.grad_accum, self.pp_pieces)
        stages = strategy.mesh.axis("pp") if strategy.mesh.has("pp") else 1
        if self.framework == "torch" and 1 < stages and self.pp_pieces < stages:
            # torch.distributed.pipelining's schedules refuse it at the first step, on one rank, mid-job.
            raise UserError(f"--pp-microbatches {self.pp_pieces} is fewer than the {stages} pipeline stages; "
                            f"torch's pipeline schedules need at least one micro-batch per stage (--pp-microbatches "
                            f"{stages} or more)")
        # preset, [model] fields and seq_len checked now; and whether the strategy can split that model (the one
        # place this is checked: every RunConfig is validated when it is made, before anything is prepared)
        strategy.check(self.model_spec(vocab_size=None))
        trained = self.trained
        if isinstance(trained, Adapters):
            if not strategy.trains_adapters:
                raise UserError(f"--lora-rank trains under ddp only for now; --strategy {self.strategy} keeps every "
                                "parameter's gradient and optimizer state (docs/strategies.md)")
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


def _choice(name: str, value, allowed, where: str = "") -> None:
    if value not in allowed:
        raise UserError(f"unknown {name} {value!r}{where}; allowed: {', '.join(allowed)}")


def _positive(name: str, value) -> None:
    if value <= 0:
        raise UserError(f"{name} must be positive, got {value}")
