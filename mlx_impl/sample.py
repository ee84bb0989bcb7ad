"""Greedy continuation for the report: `python -m mlx_impl.sample WEIGHTS_DIR OUT_JSON IDS MAX_NEW_TOKENS`.

IDS is the prompt's token ids, comma-separated (compare/samples.py tokenizes and decodes); OUT_JSON gets
{"tokens": [...]}, the new tokens only.
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

from .model import from_pretrained, generate


def main(argv: list[str] | None = None) -> int:
    weights_dir, out, ids, max_new_tokens = sys.argv[1:] if argv is None else argv
    model = from_pretrained(weights_dir)
    tokens = generate(model, [int(i) for i in ids.split(",")], int(max_new_tokens))
    Path(out).write_text(json.dumps({"tokens": tokens}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
