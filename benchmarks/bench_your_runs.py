"""Your own runs (docs/your-runs.md): the recipes `import-run` reads from the real mlx_lm.lora and Trainer + peft
runs of tests/fixtures/imported_runs/, each run by its own tool's trainer (the peers, fed dpcompare's batches) and by
dpcompare on the same batches, judged per step at 1e-5 (kind peer).

    python benchmarks/bench_your_runs.py [--out runs/bench/your-runs.json]

`tiny`, the builtin tokenizer, the prompt/completion records of tests/integration/records.py with
--mask-prompt, 6 steps, one rank, each recipe's shape from its run (mlx-lm: batch 4, seq 31, cosine over 6 steps;
Trainer: batch 4); about a minute on 2 cores.
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

from benchlib import DPCOMPARE, write_result

REPO = Path(__file__).resolve().parents[1]
FIXTURES = REPO / "tests" / "fixtures" / "imported_runs"
FLAGS = ["--preset", "tiny", "--set", "builtin_corpus_bytes=400000", "--set", "builtin_vocab_size=512",
         "--eval-every", "0", "--quiet", "--profile-steps", "0", "--no-op-profile", "--no-link-probe", "--no-samples",
         "--mask-prompt", "--nproc", "1"]


def peer_pair(work: Path, recipe: Path, frameworks: str, name: str, *extra: str) -> dict:
    out = work / name
    proc = subprocess.run([*DPCOMPARE, "compare", "--recipe", str(recipe), "--frameworks", frameworks, *FLAGS,
                           "--dataset", str(work / "pairs.jsonl"), *extra, "--out", str(out)],
                          capture_output=True, text=True, cwd=REPO)
    if proc.returncode not in (0, 3):
        sys.exit(proc.stderr[-2000:])
    (pair,) = [p for p in json.loads((out / "summary.json").read_text())["verdicts"]["pairs"] if p["kind"] == "peer"]
    return {"name": name, "pair": pair["pair"], "verdict": pair["verdict"], "per_step": pair.get("per_step")}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="runs/bench/your-runs.json")
    args = parser.parse_args()
    sys.path.insert(0, str(REPO / "tests"))
    from integration.records import pairs
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        pairs(work)
        a, t = work / "a.json", work / "t.json"
        for cmd in (["import-run", str(FIXTURES / "mlx-lm"), "--log", str(FIXTURES / "mlx-lm/mlx-console.log"),
                     "--out", str(a)], ["import-run", str(FIXTURES / "trainer"), "--out", str(t)]):
            subprocess.run([*DPCOMPARE, *cmd], check=True, capture_output=True, cwd=REPO)
        shape_a = ["--global-batch-size", "4", "--seq-len", "31", "--steps", "6", "--lr-decay-steps", "6"]
        rows = [peer_pair(work, a, "mlx,mlx-lm", "mlx-lm run's recipe", *shape_a),
                peer_pair(work, t, "torch,hf", "Trainer run's recipe", "--global-batch-size", "4", "--seq-len", "32",
                          "--steps", "6")]
    for r in rows:
        print(f"{r['verdict']:<5} {r['pair']:<22} {r['per_step']}  {r['name']}")
    write_result(Path(args.out), "your-runs", {"flags": FLAGS}, rows)


if __name__ == "__main__":
    main()
