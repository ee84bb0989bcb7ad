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

from common.config_checks import (BACKENDS, CHECKPOINT_FORMATS, COMMUNICATION_STREAMS, DEVICES,  # noqa: F401
                                  DTYPES, FRAMEWORKS, HOSTFILE_ONLY_BACKENDS, LAUNCHERS, MLX_BF16_MATMUL, MLX_BLAS,
                                  MLX_CPU_JIT, MLX_EXP, MLX_SPLIT_BACKENDS, SEQUENCE_MODES, TRACKERS, validate)
from common.config_sources import coerce, folder_spec, has_tokenizer, read_toml  # noqa: F401 (read_toml: tests)
from common.errors import UserError
from common.data.sampler import check_divisible
from common.data.shares import parse_shares, rank_sizes
from common.model.lora import Trained, trained_parameters_of
from common.model.quantize import BaseStorage, base_storage_of, folder_quantization
from common.model.spec import ModelSpec, preset
from common.recipes import with_recipe
from common.parallel.pipeline import default_pieces
from common.parallel import Layout, layout, mesh_fields

# The allowed values of the choice fields, and the checks: common/config_checks.py (re-exported here).
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
    # A recipe (common/recipes.py): a tool's whole set of the choices below; each field given overrides it.
    recipe: str = "dpcompare"
    loss_normalization: str = "global-tokens"  # or per-rank (mlx-lm's): common/train/normalization.py
    data_order: str = "dpcompare"    # or mlx-lm (length-sorted batches, ranks strided): common/data/sampler.py
    mask_convention: str = "exact"   # or mlx-lm (one padding target more a row): common/data/conventions.py
    padding_rule: str = "seq-len"    # or longest, mlx-lm (1 + 32 ceil(max / 32)): common/data/conventions.py
    # LoRA (common/model/lora.py): adapters of this rank on lora_targets ("q_proj,v_proj"; "" = those two) of the
    # last lora_layers blocks (0 = all), scale lora_alpha / rank (alpha 0 = 2 x rank); rank 0 trains every parameter.
    lora_rank: int = 0
    lora_alpha: float = 0.0
    lora_scale_convention: str = "alpha-over-rank"  # or direct: lora_alpha is the scale itself (mlx-lm's)
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
    rank_shares: str = ""            # uneven shares of each batch, "3,1" or auto (ddp; common/data/shares.py)
    rank_speed: str = ""             # emulated slow ranks, "1:0.5" (compare/launch/throttle.py)
    # Optimizer and schedule (common/train/optimizer.py, common/train/lr_schedule.py).
    optimizer: str = "adamw"         # or adam (weight decay none)
    bias_correction: bool = True     # Adam's moments divided by 1 - beta^t (torch always; MLX's default is off)
    lr_schedule: str = "cosine"      # warmup then cosine to min_lr_ratio; linear (transformers'), constant
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
    peer: str = ""                   # a peer's own trainer on that framework: mlx-lm or hf (common/peers.py)
    peer_adapted: str = ""           # the choices that peer cannot be told, set to its own (common/peers.py adapted)
    nproc: int = 1
    strategy: str = "ddp"            # ddp, fsdp, tp or pp (common/parallel/: one object each), or mesh
    mesh: str = ""                   # strategy mesh: its axes, "dp=2,tp=2" (common/parallel/mesh.py), canonical order
    pp_microbatches: int = 0         # pp: pieces each micro-step's batch is cut into; 0: pp_pieces chooses
    pp_schedule: str = "1f1b"        # pp: gpipe or 1f1b
    cp_attention: str = "ulysses"    # cp: ulysses (all-to-alls over heads) or ring (zig-zag): common/parallel/cp.py
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
        values = with_recipe(values)  # the recipe's choices under the values given (common/recipes.py)
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
        return trained_parameters_of(self.lora_rank, self.lora_alpha, self.lora_targets, self.lora_layers,
                                     self.lora_scale_convention)

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
    def rank_batch_sizes(self) -> tuple[int, ...]:
        """Sequences each data-parallel rank takes of every global batch: --rank-shares, or even."""
        shares = parse_shares(self.rank_shares) if self.data_parallel_size > 1 else ()  # one rank takes it all
        return rank_sizes(self.global_batch_size, self.data_parallel_size, shares) if shares else \
            (self.micro_batch_size * self.grad_accum,) * self.data_parallel_size

    @property
    def micro_batch_size(self) -> int:
        """The largest micro-batch a rank runs: every rank's, with even shares."""
        if parse_shares(self.rank_shares) and self.data_parallel_size > 1:
            return max(-(-n // self.grad_accum) for n in self.rank_batch_sizes)
        return check_divisible(self.global_batch_size, self.data_parallel_size, self.grad_accum)

    @property
    def resolved_backend(self) -> str:
        if self.backend != "auto":
            return self.backend
        return default_backend(self.framework, self.device, self.mesh)

    @property
    def cache_path(self) -> Path:
        return Path(self.cache_dir) if self.cache_dir else default_cache_dir()

    # ---- validation: common/config_checks.py ----------------------------------------------------
    def validate(self) -> None:
        validate(self)
