"""benchmarks/rss_probe (the sampler bench_rss_timeline.py puts on every rank's path): a process that grows by
a known amount in a known function has its peak recorded, in that function; without DPCOMPARE_RSS_PROBE the
probe does nothing. One plain Python process each (no framework): a second or so."""
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "benchmarks"))

import bench_rss_timeline as bench  # noqa: E402

pytestmark = pytest.mark.skipif(not Path("/proc/self/statm").exists(), reason="the probe reads /proc (Linux)")

MiB = 2**20
# 96 MiB touched in a function of a file under common/ (a "project" path), held while the probe samples.
GROW = """
import time
def grow_the_heap():
    block = bytearray(96 * 2**20)
    for i in range(0, len(block), 4096):
        block[i] = 1
    time.sleep(0.3)
    return block
time.sleep(0.1)  # the probe's first sample: the size before
grow_the_heap()
"""


def run(tmp_path: Path, probe: bool) -> Path:
    probe_dir = tmp_path / "probe"
    probe_dir.mkdir()
    script = tmp_path / "common" / "grow.py"  # the probe's report keeps frames under common/, mlx_impl/, ...
    script.parent.mkdir()
    script.write_text(GROW)
    env = {"PATH": "/usr/bin:/bin", "PYTHONPATH": str(REPO / "benchmarks" / "rss_probe")}
    if probe:
        env["DPCOMPARE_RSS_PROBE"] = str(probe_dir)
    subprocess.run([sys.executable, str(script)], env=env, check=True, timeout=60)
    return probe_dir


def test_the_probe_records_the_peak_in_the_function_that_made_it(tmp_path, monkeypatch):
    files = list(run(tmp_path, probe=True).glob("*.jsonl"))
    assert len(files) == 1
    header, samples = bench.read_probe(files[0])
    assert header["argv"][0].endswith("grow.py") and samples
    top = max(samples, key=lambda s: s["rss_bytes"])
    assert top["rss_bytes"] - samples[0]["rss_bytes"] >= 90 * MiB, (samples[0], top)
    assert top["stack"][-1].endswith(" grow_the_heap"), top["stack"]
    monkeypatch.setattr(bench.benchlib, "REPO", tmp_path)  # grow.py's folder plays the project's root
    assert bench.phase(top["stack"]) == "common/grow.py:grow_the_heap"
    marks = bench.climb(samples, top["rss_bytes"])
    assert [m[0] for m in marks] == list(range(10, 101, 10)) and marks[-1][2] == "common/grow.py:grow_the_heap"


def test_without_the_variable_the_probe_writes_nothing(tmp_path):
    assert not list(run(tmp_path, probe=False).iterdir())


FORK = """
import os, time
time.sleep(0.1)
pid = os.fork()
if pid == 0:  # a rank forked from a parent that imported everything (compare.launch.spawn --fork)
    time.sleep(0.3)  # the child's probe: its first sample, the size before
    block = bytearray(64 * 2**20)
    for i in range(0, len(block), 4096):
        block[i] = 1
    time.sleep(0.3)
    os._exit(0)
os.waitpid(pid, 0)
"""


def test_a_forked_child_samples_itself_into_its_own_file(tmp_path):
    """A thread does not survive fork: the child starts its own, and its peak is in its own file."""
    probe_dir = tmp_path / "probe"
    probe_dir.mkdir()
    script = tmp_path / "fork.py"
    script.write_text(FORK)
    env = {"PATH": "/usr/bin:/bin", "PYTHONPATH": str(REPO / "benchmarks" / "rss_probe"),
           "DPCOMPARE_RSS_PROBE": str(probe_dir)}
    subprocess.run([sys.executable, str(script)], env=env, check=True, timeout=60)
    files = sorted(probe_dir.glob("*.jsonl"))
    assert len(files) == 2
    grown = [max(s["rss_bytes"] for s in samples) - samples[0]["rss_bytes"]
             for samples in (bench.read_probe(f)[1] for f in files)]
    assert max(grown) >= 60 * MiB, grown
