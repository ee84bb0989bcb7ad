"""`--init-from DIR` read by the peers' own loaders: do mlx-lm and transformers open the folder as dpcompare does?

`python -m peers.folder_check DIR` (compare/launch/folders.py starts it before any rank) opens DIR with dpcompare's
torch model (torch_impl.model.from_pretrained), transformers' `AutoModelForCausalLM.from_pretrained` and mlx-lm's
`mlx_lm.utils.load_model`, where each is installed, runs each on the same few tokens, and prints a JSON list of
warnings: one per library whose logits part from ours by more than `ATOL`, naming the cause where it is known.
Known: mlx-lm 0.32 reads only the old `rope_theta`/`rope_scaling` keys, and transformers 5 writes `rope_parameters`
instead, so such a folder loads there with rope_theta 10000 and no rope scaling (mlx-lm PR 953, for the new key, was
closed). Folders dpcompare exports carry the old keys, and read alike.
"""
from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import numpy as np

ATOL = 1e-3  # MLX's and torch's float32 logits of one folder differ by up to 4e-5 (tests/unit/test_pretrained.py)
TOKENS = 16


def known_cause(directory: Path, library: str) -> str:
    config = json.loads((directory / "config.json").read_text())
    if library == "mlx-lm" and "rope_parameters" in config and "rope_theta" not in config:
        params = config["rope_parameters"] or {}
        scaling = params.get("rope_type", "default")
        return (f"mlx-lm 0.32 ignores the rope_parameters key that transformers 5 writes, so it loads rope_theta "
                f"10000 instead of {params.get('rope_theta')}" + (f" and no {scaling} scaling" if scaling != "default"
                                                                    else "") +
                " (dpcompare export writes rope_theta and rope_scaling, which it reads)")
    return "cause unknown: compare its config.json reading with dpcompare's (common/model/hfconfig.py)"


def logits(directory: Path, tokens: np.ndarray) -> dict[str, np.ndarray]:
    """Each loader's logits of `tokens` (1, T); a library that is not installed is left out."""
    import torch

    from torch_impl.model import from_pretrained

    out = {}
    with torch.no_grad():
        out["dpcompare"] = from_pretrained(directory)(torch.from_numpy(tokens)).float().numpy()
        if importlib.util.find_spec("transformers"):
            from transformers import AutoModelForCausalLM

            model = AutoModelForCausalLM.from_pretrained(str(directory), dtype=torch.float32).eval()
            out["transformers"] = model(torch.from_numpy(tokens)).logits.float().numpy()
    if importlib.util.find_spec("mlx_lm"):
        import mlx.core as mx
        from mlx_lm.utils import load_model

        model, _ = load_model(directory)
        out["mlx-lm"] = np.array(model(mx.array(tokens)).astype(mx.float32))
    return out


def warnings(directory: Path) -> list[str]:
    directory = Path(directory)
    config = json.loads((directory / "config.json").read_text())
    if config.get("quantization"):  # an mlx_lm.convert -q folder: transformers does not read MLX's layout
        return []
    tokens = np.random.default_rng(0).integers(0, config["vocab_size"], size=(1, TOKENS)).astype(np.int64)
    found = logits(directory, tokens)
    ours = found.pop("dpcompare")
    lines = []
    for library, theirs in found.items():
        gap = float(np.max(np.abs(theirs - ours)))
        if gap > ATOL:
            lines.append(f"--init-from {directory}: {library} reads this folder differently: its logits are "
                         f"{gap:.1e} from dpcompare's on {TOKENS} tokens; {known_cause(directory, library)}")
    return lines


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    print(json.dumps(warnings(Path(argv[0]))))
    return 0


if __name__ == "__main__":
    from common.train.process_exit import exit_now

    exit_now(main())  # no interpreter teardown: 1-1.5 s of a torch process (common/train/process_exit.py)
