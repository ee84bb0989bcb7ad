"""The run plan: what the launcher decided for a run, written once to RUN_DIR/run_config.json and read by
every rank (and by `dpcompare export`, `sample`, `diagnose --from`), typed instead of a dict of strings.

    launcher (compare/launch/runner.py)  RunPlan(cfg, spec, token cache, seed checkpoint, data).write(run_dir)
    rank (common/train/loop.py)                RunPlan.read(run_dir).config / .spec / .token_cache / ...

The file keeps the layout users and older runs have: {"config", "spec", "token_cache", "seed_checkpoint",
"world_size", "backend", "data"}, and "initial_adapters" for a LoRA run. `world_size` and `backend` are written for a reader of the file alone;
the rank takes them from the config (`cfg.world_size`, `cfg.resolved_backend`), which decides them.
The report reads run_config.json as a plain dict on purpose: it must render runs of older versions too.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from common.config import RunConfig
from common.errors import UserError
from common.metrics import read_json, write_json
from common.model.spec import ModelSpec

PLAN_FILE = "run_config.json"
DATA_FIELDS = ("num_documents", "num_tokens", "vocab_size", "tokenizer")  # of the token cache's meta


@dataclass(frozen=True)
class RunPlan:
    config: RunConfig        # resolved: an MLX hostfile's backend already applied
    spec: ModelSpec          # the model, with the token cache's vocabulary size
    token_cache: Path        # the prepared tokens every rank reads (common/data/tokencache.py)
    seed_checkpoint: Path    # the initial weights, the same file for every rank and framework
    data: dict = field(default_factory=dict)  # the cache's sizes and tokenizer, for the report
    initial_adapters: Path | None = None  # LoRA's starting values (common/model/lora.py), beside the seed checkpoint

    @classmethod
    def of(cls, cfg: RunConfig, spec: ModelSpec, token_cache: Path, seed_checkpoint: Path,
           cache_meta: dict) -> "RunPlan":
        from common.model.lora import initial_adapters_file

        return cls(cfg, spec, Path(token_cache), Path(seed_checkpoint), {k: cache_meta.get(k) for k in DATA_FIELDS},
                   initial_adapters_file(cfg.trained, spec, cfg.seed, cfg.cache_path))

    def to_dict(self) -> dict:
        return {"config": self.config.to_dict(), "spec": self.spec.to_dict(), "token_cache": str(self.token_cache),
                "seed_checkpoint": str(self.seed_checkpoint), "world_size": self.config.world_size,
                "backend": self.config.resolved_backend, "data": self.data,
                **({"initial_adapters": str(self.initial_adapters)} if self.initial_adapters else {})}

    def write(self, run_dir: Path) -> Path:
        path = Path(run_dir) / PLAN_FILE
        write_json(path, self.to_dict())
        return path

    @classmethod
    def read(cls, run_dir: Path) -> "RunPlan":
        """The plan of a run directory; a missing or unreadable one is the user's error, not a traceback."""
        raw = read_json(Path(run_dir) / PLAN_FILE, None)
        if not isinstance(raw, dict) or "config" not in raw:
            raise UserError(f"{run_dir} holds no readable {PLAN_FILE}: not a run directory")
        return cls(RunConfig.from_dict(raw["config"]), ModelSpec.from_dict(raw["spec"]), Path(raw["token_cache"]),
                   Path(raw["seed_checkpoint"]), raw.get("data") or {},
                   Path(raw["initial_adapters"]) if raw.get("initial_adapters") else None)

    def tokenizer_file(self) -> tuple[Path, dict]:
        """The run's tokenizer.json (kept in its token cache) and the cache's meta (eos_id, pad_id)."""
        meta = read_json(self.token_cache / "meta.json", None)
        if meta is None or not (self.token_cache / meta["tokenizer"]["path"]).is_file():
            raise UserError(f"the run's token cache {self.token_cache} (with its tokenizer) is gone; run "
                            "`dpcompare prepare` with the run's --dataset and --tokenizer to rebuild it")
        return self.token_cache / meta["tokenizer"]["path"], meta
