"""Recipes (docs/recipes.md): mlx-lm's recipe in both frameworks at N=1 and 2, then with global-tokens, then the
chain from mlx-lm's recipe to trl's, each choice's change to the curve.

    python benchmarks/bench_recipes.py [--quick] [--out runs/bench/recipes.json]

On prompt/completion records cut from TinyStories (the prompt a story's first sentence, the completion the next
200 characters; a synthetic set where TinyStories is absent), `tiny` with 18 blocks, the builtin tokenizer,
--mask-prompt, seq 128, global batch 8, 20 steps (--quick: 10). Three compares, about 6 minutes on 2 cores:

1. --recipe mlx-lm, MLX and torch at N=1 and 2: MLX vs torch per step, N=2 vs N=1 (per-rank: "differs");
2. the same with --loss-normalization global-tokens: N=2 vs N=1 in each framework;
3. --recipes mlx-lm,trl at N=2 in both frameworks: the contributions table.
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

from benchlib import DPCOMPARE, SHARED_DATA, machine, write_result

# 18 blocks of `tiny`'s width: more than mlx-lm's 16 adapted ones, so that its num_layers acts (tiny has 2)
FLAGS = ["--preset", "tiny", "--set", "model.n_layers=18", "--tokenizer", "builtin", "--set", "builtin_vocab_size=1024", "--set",
         "builtin_corpus_bytes=1000000", "--mask-prompt", "--seq-len", "128", "--global-batch-size", "8",
         "--no-samples", "--profile-steps", "0", "--no-op-profile", "--quiet", "--eval-every", "0"]


def records(path: Path) -> Path:
    stories_file = SHARED_DATA / "tinystories" / "train.txt"
    rows = []
    if stories_file.is_file():
        for story in stories_file.read_text()[:400_000].split("<|endoftext|>"):
            first, _, rest = story.strip().partition(". ")
            if first and rest:
                rows.append({"prompt": f"Continue the story: {first}.", "completion": " " + rest[:200]})
    else:
        rows = [{"prompt": f"Q: {a}+{b}?", "completion": f" {a + b}." * (1 + (a * b) % 7)}
                for a in range(20) for b in range(20)]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows[:400]))
    return path


def compare(out: Path, *args) -> dict:
    subprocess.run([*DPCOMPARE, "compare", *FLAGS, *map(str, args), "--out", str(out), "--overwrite"], check=True)
    return json.loads((out / "summary.json").read_text())


def pairs(summary: dict) -> dict:
    return {f"{p['a']} vs {p['b']}": (p["verdict"], p["checks"]["per_step"]["max_abs_diff"]) for p in all_pairs(summary)}


def all_pairs(summary: dict) -> list[dict]:
    parity = summary["parity"]
    return [p for kind in ("cross_framework", "dp_invariance") for p in parity.get(kind, [])]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("runs/bench/recipes.json"))
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args()
    steps = 10 if args.quick else 20
    root = Path(tempfile.mkdtemp(prefix="bench-recipes-"))
    data = records(root / "pairs.jsonl")
    common = ["--dataset", data, "--steps", steps]
    per_rank = compare(root / "mlx-lm", *common, "--recipe", "mlx-lm", "--nproc", "1,2")
    global_tokens = compare(root / "global", *common, "--recipe", "mlx-lm", "--loss-normalization", "global-tokens",
                            "--nproc", "1,2")
    chain = compare(root / "chain", *common, "--recipes", "mlx-lm,trl", "--nproc", "2")
    result = {"mlx-lm": pairs(per_rank), "mlx-lm + global-tokens": pairs(global_tokens),
              "contributions": chain["contributions"]}
    for name, judged in list(result.items())[:2]:
        print(f"\n{name}, {steps} steps:")
        for pair, (verdict, diff) in judged.items():
            print(f"  {pair:24s} {verdict:8s} max |Δloss| per step {diff}")
    for t in chain["contributions"]["tables"]:
        print(f"\n{t['series']}: rows sum to the gap within {t['sum_error']:.1e}")
        for r in t["rows"]:
            print(f"  {r['choice']:22s} {str(r['a']):>10.10s} -> {str(r['b']):10.10s} last {r['loss_last']:+.3e} "
                  f"middle {r['loss_middle']:+.3e} tok/s {r['tokens_per_s'] or 0:+8.0f} RSS {r['peak_rss_mb'] or 0:+.1f}")
        print(f"  whole gap: last {t['gap']['loss_last']:+.3e} middle {t['gap']['loss_middle']:+.3e}")
    write_result(args.out, "recipes", {"steps": steps, "records": str(data)}, [], machine=machine(), **result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
