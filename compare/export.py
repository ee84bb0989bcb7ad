"""`dpcompare export RUN_DIR --out DIR`: the run's latest weights as a Hugging Face Llama folder.

The folder holds the weights (config.json, model.safetensors), the run's tokenizer (tokenizer.json and
tokenizer_config.json) and a generation_config.json (greedy by default, the tokenizer's EOS), so it
opens with transformers' `pipeline("text-generation", model=DIR)` and `mlx_lm.generate --model DIR`.
config.json is the checkpoint's own (common/model/hfconfig.py), so a run started with --init-from exports the
folder's architecture, rope scaling included, and `--init-from` on the export reads back the same spec.
"""
from __future__ import annotations

import json
import shutil
from pathlib import Path

from common.checkpoint.store import latest_checkpoint
from common.errors import UserError
from common.fsutil import atomic_path, atomic_write_text
from common.checkpoint.sharded import ShardedSource, is_sharded, write_safetensors
from common.runplan import RunPlan


def write_weights(ckpt: Path, dest: Path) -> None:
    """model.safetensors from either checkpoint format: copied from an hf one, assembled from a sharded one
    one tensor at a time (common/checkpoint/sharded.py), never the whole model in memory."""
    if not is_sharded(ckpt):
        shutil.copy2(ckpt / "model.safetensors", dest)
        return
    source = ShardedSource(ckpt, "weights")
    with atomic_path(dest) as tmp:
        write_safetensors(tmp, {name: source.shape(name) for name in source.names()}, source.read,
                          metadata={"format": "pt"})


def export_run(run_dir: Path, out: Path, adapters_kind: str | None = None) -> Path:
    """Write the folder; returns the checkpoint it came from. A LoRA run (compare/lora_export.py): the fused
    folder, or with `adapters_kind` the adapters in mlx-lm's or peft's layout and the base beside them."""
    from .lora_export import adapters_of, base_config, check_kind, write_adapters, write_base, write_fused

    run_dir, out = Path(run_dir), Path(out)
    ckpt = latest_checkpoint(run_dir)
    if ckpt is None:
        raise UserError(f"{run_dir} holds no checkpoint to export")
    if out.exists() and any(out.iterdir()):
        raise UserError(f"{out} exists and is not empty; choose another --out")
    plan, adapters = adapters_of(run_dir)
    check_kind(adapters_kind, adapters, run_dir)
    if adapters is None:
        write_folder(plan, ckpt, out, lambda dest: write_weights(ckpt, dest))
    elif adapters_kind is None:
        write_folder(plan, ckpt, out, lambda dest: write_fused(plan, adapters, ckpt, dest))
    else:
        write_folder(plan, ckpt, out / "base", lambda dest: write_base(plan, dest, adapters_kind),
                     base_config(plan, adapters_kind))
        write_adapters(plan, adapters, ckpt, out, adapters_kind)
    return ckpt


def write_folder(plan: RunPlan, ckpt: Path, out: Path, write_model, extra_config: dict | None = None) -> None:
    """An HF Llama folder: the checkpoint's config.json, `write_model(out / "model.safetensors")`, the run's
    tokenizer and a greedy generation config."""
    from tokenizers import Tokenizer

    tokenizer_file, meta = plan.tokenizer_file()
    tokenizer = Tokenizer.from_file(str(tokenizer_file))
    eos_id, pad_id = int(meta["eos_id"]), int(meta["pad_id"])
    # Training put BOS before each document where the tokenizer adds one (a pretrained Llama's); otherwise
    # the EOS that separates documents also stands for BOS, as in GPT-2.
    bos_id = eos_id if meta.get("bos_id") is None else int(meta["bos_id"])
    eos, pad, bos = (tokenizer.id_to_token(i) for i in (eos_id, pad_id, bos_id))
    config = {**json.loads((ckpt / "config.json").read_text()), **(extra_config or {})}
    out.mkdir(parents=True, exist_ok=True)
    write_model(out / "model.safetensors")
    ids = {"bos_token_id": bos_id, "eos_token_id": eos_id, "pad_token_id": pad_id}
    atomic_write_text(out / "config.json", json.dumps({**config, **ids}, indent=2))
    shutil.copy2(tokenizer_file, out / "tokenizer.json")
    atomic_write_text(out / "tokenizer_config.json", json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "bos_token": bos, "eos_token": eos, "pad_token": pad,
        "unk_token": None, "model_max_length": config.get("max_position_embeddings", 2048),
        "clean_up_tokenization_spaces": False, "add_bos_token": meta.get("bos_id") is not None,
    }, indent=2))
    atomic_write_text(out / "generation_config.json", json.dumps({**ids, "do_sample": False}, indent=2))
