"""Data pipeline benchmark: tokenization throughput, cached prepare time, and whether a rank's memory
stays flat as the dataset grows.

    python benchmarks/bench_data.py [--out runs/bench/data.json] [--data ../shared/data]

Throughput uses the GPT-2 tokenizer on the TinyStories sample (the builtin corpus and tokenizer when the
sample is absent). Memory: a fresh process per dataset size opens a token cache and draws random batches
of 8 x 256 over the whole split through SequenceView; its peak RSS (VmHWM on Linux, ru_maxrss on
macOS) should not depend on the size of the token file. The large caches repeat the sample's tokens,
written in the cache format and checked by TokenCache.open. A third reader, plain memmap slicing, shows
what the positioned reads of TokenSplit.read avoid.
"""
from __future__ import annotations

import argparse
import json
import platform
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from common.data.tokencache import TokenCache, prepare_tokens  # noqa: E402

DEFAULT_DATA = REPO.parent / "shared" / "data"
MEMORY_SIZES_BYTES = {"2MB": 2_000_000, "200MB": 200_000_000}
BATCHES, BATCH_SIZE, SEQ_LEN = 200, 8, 256

# Runs in a fresh interpreter, so the peak RSS belongs to reading batches alone.
RANK_READER = r"""
import json, resource, sys, time
import numpy as np
sys.path.insert(0, sys.argv[1])
from common.data.sequences import SequenceView
from common.data.tokencache import TokenCache
path, reader, batches, batch_size, seq_len = sys.argv[2], sys.argv[3], *map(int, sys.argv[4:7])


def peak_rss_bytes():
    # Linux: VmHWM, the peak of this process image alone; ru_maxrss would still hold the parent's peak,
    # which the kernel carries across fork and exec. macOS: ru_maxrss, in bytes there.
    try:
        with open("/proc/self/status") as f:
            return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmHWM:"))
    except OSError:
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss


split = TokenCache.open(path).split("train")
view = SequenceView(split, seq_len, "padding" if reader == "padding" else "packing")
rss_opened_bytes = peak_rss_bytes()
rng = np.random.default_rng(0)
started = time.perf_counter()
for _ in range(batches):
    indices = rng.integers(0, view.num_samples, batch_size)
    if reader == "memmap":  # for comparison: slicing the memmap maps the file's pages into this process
        rows = np.stack([np.asarray(split.tokens[i * seq_len:i * seq_len + seq_len + 1], dtype=np.int32)
                         for i in indices])
    else:
        inputs, targets, mask = view.batch(indices)
        assert view.real_target_count(indices) == int(mask.sum())
print(json.dumps({
    "peak_rss_bytes": peak_rss_bytes(),
    "rss_opened_bytes": rss_opened_bytes,
    "batch_ms": (time.perf_counter() - started) / batches * 1e3,
    "num_tokens": split.num_tokens,
}))
"""

PREPARE_AGAIN = r"""
import sys
sys.path.insert(0, sys.argv[1])
from common.data.tokencache import prepare_tokens
prepare_tokens(sys.argv[2], sys.argv[3], cache_dir=sys.argv[4], val_fraction=0, progress=False)
"""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("runs/bench/data.json"))
    parser.add_argument("--data", type=Path, default=DEFAULT_DATA, help="the shared real-data folder")
    args = parser.parse_args()

    with tempfile.TemporaryDirectory(prefix="bench_data_") as work:
        work = Path(work)
        throughput = bench_throughput(args.data, work)
        memory = bench_memory(Path(throughput.pop("cache_path")), work)  # a temporary folder: not reported
    result = {"machine": {"platform": platform.platform(), "python": platform.python_version(),
                          "cpus": _cpu_count()},
              "throughput": throughput, "memory": memory}
    print_table(result)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2))
    print(f"\nwrote {args.out}")


def bench_throughput(data: Path, work: Path) -> dict:
    stories, gpt2 = data / "tinystories" / "train.txt", data / "gpt2"
    if stories.is_file() and gpt2.is_dir():
        dataset, tokenizer = str(stories), str(gpt2)
    else:
        print(f"note: {data} lacks the TinyStories sample or GPT-2; measuring the builtin corpus instead")
        dataset, tokenizer = "builtin", "builtin"
    cache_dir = work / "cache"
    started = time.perf_counter()
    cache = prepare_tokens(dataset, tokenizer, cache_dir=cache_dir, val_fraction=0, progress=False)
    cold_s = time.perf_counter() - started
    started = time.perf_counter()
    prepare_tokens(dataset, tokenizer, cache_dir=cache_dir, val_fraction=0, progress=False)
    cached_s = time.perf_counter() - started

    # What `dpcompare prepare` pays on a hit in a new process: imports and loading the tokenizer to
    # fingerprint it (transformers' AutoTokenizer imports torch when it is installed).
    started = time.perf_counter()
    subprocess.run([sys.executable, "-c", PREPARE_AGAIN, str(REPO), dataset, tokenizer, str(cache_dir)], check=True)
    cached_fresh_process_s = time.perf_counter() - started

    # The sample is tokenized in a fraction of a second; eight copies give a steadier rate.
    repeated = work / "repeated.txt"
    text = Path(dataset).read_text() if dataset != "builtin" else "\n\n".join(_builtin_docs())
    separator = "\n<|endoftext|>\n" if dataset != "builtin" else "\n\n"
    repeated.write_text(separator.join([text] * 8))
    big = prepare_tokens(str(repeated), tokenizer, cache_dir=cache_dir, val_fraction=0, progress=False)
    return {
        "dataset": dataset, "tokenizer": tokenizer,
        "sample_tokens": cache.meta["num_tokens"], "sample_tokens_per_s": cache.meta["tokens_per_s"],
        "x8_tokens": big.meta["num_tokens"], "x8_tokens_per_s": big.meta["tokens_per_s"],
        "prepare_cold_s": cold_s, "prepare_cached_s": cached_s,
        "prepare_cached_fresh_process_s": cached_fresh_process_s, "cache_path": str(cache.path),
    }


def _builtin_docs() -> list[str]:
    from common.data.corpus import DEFAULT_CORPUS_BYTES, generate_stories

    return generate_stories(DEFAULT_CORPUS_BYTES, seed=0)


def bench_memory(sample_cache: Path, work: Path) -> dict:
    rows = {}
    for label, size_bytes in MEMORY_SIZES_BYTES.items():
        path = repeat_cache(sample_cache, work / f"rss_{label}", size_bytes)
        for reader in ("packing", "padding", "memmap"):
            rows[f"{reader}_{label}"] = _measure_rank(path, reader) | {"token_file_bytes": size_bytes}
        shutil.rmtree(path)
    for reader in ("packing", "padding", "memmap"):
        small, large = rows[f"{reader}_2MB"], rows[f"{reader}_200MB"]
        rows[f"{reader}_growth"] = large["peak_rss_bytes"] / small["peak_rss_bytes"] - 1
    return rows


def repeat_cache(sample: Path, path: Path, size_bytes: int) -> Path:
    """A cache whose train split repeats the sample's train documents until it holds ~size_bytes."""
    meta = json.loads((sample / "meta.json").read_text())
    source = TokenCache.open(sample).split("train")
    tokens, offsets = np.asarray(source.tokens), np.asarray(source.offsets)
    repeats = max(1, round(size_bytes / tokens.nbytes))
    path.mkdir(parents=True)
    with open(path / "train.bin", "wb") as f:
        for _ in range(repeats):
            f.write(tokens.tobytes())
    shifted = [offsets[:-1] + r * len(tokens) for r in range(repeats)] + [np.array([repeats * len(tokens)])]
    with open(path / "train.idx", "wb") as f:
        np.save(f, np.concatenate(shifted).astype(np.int64))
    for name in ("valid.bin", "valid.idx", "tokenizer.json"):
        shutil.copy(sample / name, path / name)
    train = meta["splits"]["train"]
    train.update(num_documents=train["num_documents"] * repeats, num_tokens=len(tokens) * repeats)
    meta.update(num_documents=sum(s["num_documents"] for s in meta["splits"].values()),
                num_tokens=sum(s["num_tokens"] for s in meta["splits"].values()))
    (path / "meta.json").write_text(json.dumps(meta, indent=2))
    TokenCache.open(path)  # the same checks a rank makes
    return path


def _measure_rank(path: Path, reader: str) -> dict:
    out = subprocess.run([sys.executable, "-c", RANK_READER, str(REPO), str(path), reader, str(BATCHES),
                          str(BATCH_SIZE), str(SEQ_LEN)], capture_output=True, text=True, check=True)
    return json.loads(out.stdout)


def print_table(result: dict) -> None:
    t = result["throughput"]
    print(f"tokenization ({t['tokenizer']} on {t['dataset']}, {result['machine']['cpus']} cpus)")
    print(f"  sample      {t['sample_tokens']:>12,} tokens  {t['sample_tokens_per_s'] / 1e6:6.2f} M tokens/s")
    print(f"  sample x8   {t['x8_tokens']:>12,} tokens  {t['x8_tokens_per_s'] / 1e6:6.2f} M tokens/s")
    print(f"  prepare     cold {t['prepare_cold_s']:.2f} s, cached {t['prepare_cached_s']:.3f} s "
          f"(in a new process, imports included: {t['prepare_cached_fresh_process_s']:.2f} s)")
    m = result["memory"]
    print(f"\nrank peak RSS, {BATCHES} random batches of {BATCH_SIZE}x{SEQ_LEN} (fresh process per row)")
    print(f"  {'reader':<10} {'2 MB tokens':>14} {'200 MB tokens':>14} {'growth':>8}")
    for reader in ("packing", "padding", "memmap"):
        small, large = m[f"{reader}_2MB"], m[f"{reader}_200MB"]
        note = "  (raw memmap slices, for comparison)" if reader == "memmap" else ""
        print(f"  {reader:<10} {small['peak_rss_bytes'] / 2**20:11.1f} MiB {large['peak_rss_bytes'] / 2**20:10.1f} MiB"
              f" {m[f'{reader}_growth'] * 100:7.1f}%{note}")


def _cpu_count() -> int:
    import os

    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()


if __name__ == "__main__":
    main()
