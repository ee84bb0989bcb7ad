"""Instruction records the recipe and peer tests train on (test_recipes.py, test_your_runs.py, test_peers.py,
test_uneven.py): a helper module, since a test module must not import another (tests/unit/test_test_layout.py)."""
import json

import numpy as np


def pairs(tmp_path):
    """Prompt/completion records of unequal lengths, so ranks hold unequal counts of targets and rows unequal
    padding."""
    rng = np.random.default_rng(0)
    path = tmp_path / "pairs.jsonl"
    path.write_text("".join(json.dumps({"prompt": f"Q: {a}+{b}?" + " x" * int(rng.integers(0, 8)),
                                        "completion": f" {a + b}" + " y" * int(rng.integers(0, 12))}) + "\n"
                            for a, b in rng.integers(0, 10, size=(120, 2))))
    return path
