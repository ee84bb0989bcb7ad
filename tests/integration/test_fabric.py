"""`dpcompare doctor --fabric`: all-reduce latency and bandwidth per backend, within its time budget, and a
host that cannot be reached ends it with one line. Tiny messages and short budgets keep these quick."""
import json
import re
import time

import pytest

from common.fabric import Collectives, measure
from compare.machine.fabric import Measured, Workload
from helpers import dpcompare

ROW = re.compile(r"^(mlx|torch) (\w+)\s+(\d+)\s+(\S+)\s+([\d,]+) µs\s+([\d.]+) GB/s", re.M)


class FakeLink:
    """Collectives over a simulated link: each call costs latency + bytes / bandwidth (seconds)."""

    def __init__(self, latency_s, bytes_per_s):
        self.latency_s, self.bytes_per_s, self.decisions = latency_s, bytes_per_s, []

    def collectives(self):
        def all_reduce(x):
            time.sleep(self.latency_s + x / self.bytes_per_s)

        def from_rank0(value):
            self.decisions.append(value)
            return value

        return Collectives(rank=0, size=2, device="cpu", buffer=lambda n: n, all_reduce=all_reduce,
                           from_rank0=from_rank0)


def test_the_rank_measures_every_size_when_time_allows_and_skips_what_would_overrun_the_budget():
    fast = FakeLink(1e-4, 1e9)
    results = measure(fast.collectives(), [4096, 2**20], max_calls=5)
    assert [r["size_bytes"] for r in results] == [4096, 2**20] and all(len(r["times_s"]) == 5 for r in results)
    # A slow link: 64 MB would take ~0.7 s a call, far past a 0.5 s budget, so it is skipped (predicted from
    # 512 KB), and the decision (a 0 from rank 0) is made inside a collective so every rank skips it alike.
    slow = FakeLink(1e-3, 1e8)
    started = time.monotonic()
    results = measure(slow.collectives(), [4096, 2**19, 2**26], max_calls=5, time_budget_s=0.5, started=started)
    assert [r["size_bytes"] for r in results] == [4096, 2**19] and time.monotonic() - started < 0.6
    assert 0.0 in slow.decisions


def test_the_sync_estimate_is_a_latency_per_bucket_plus_the_bytes_at_the_measured_bandwidth():
    row = Measured("mlx", "ring", 2, latency_s=1e-4, bandwidth_Bps=1e9)
    small = Workload("small", 128, 8)
    assert row.sync_s(small.grad_bytes, 32 * 2**20) == pytest.approx(4 * 1e-4 + small.grad_bytes / 1e9)
    assert 100 * 2**20 < small.grad_bytes < 120 * 2**20  # ~28M fp32 parameters


def rows(text):
    return {f"{m[1]} {m[2]}": m for m in ROW.finditer(text)}


@pytest.mark.slow
def test_doctor_fabric_measures_latency_and_bandwidth_of_both_frameworks_on_two_local_ranks(cache_dir):
    started = time.time()
    proc = dpcompare("doctor", "--fabric", "--backend", "mlx:ring,torch:gloo", "--max-mb", 1,
                     "--time-budget-s", 40, cache_dir=cache_dir, timeout=90)
    found = rows(proc.stdout)
    assert set(found) == {"mlx ring", "torch gloo"}, proc.stdout
    for match in found.values():
        assert match[3] == "2" and float(match[5].replace(",", "")) > 0 and float(match[6]) > 0
    assert "gradient sync per optimizer step for small" in proc.stdout
    assert re.search(r"mlx ring\s+~[\d,.]+ ms", proc.stdout) and re.search(r"torch gloo\s+~[\d,.]+ ms", proc.stdout)
    assert time.time() - started < 60


@pytest.mark.slow
def test_doctor_fabric_across_a_hostfile_starts_the_ranks_through_mlx_launch(cache_dir, tmp_path):
    hostfile = tmp_path / "hosts.json"  # mlx.launch runs 127.0.0.1 hosts locally, without ssh
    local = {"ssh": "127.0.0.1", "ips": ["127.0.0.1"]}
    hostfile.write_text(json.dumps({"backend": "ring", "envs": [], "hosts": [local, local]}))
    proc = dpcompare("doctor", "--fabric", "--hostfile", hostfile, "--max-mb", 1, "--time-budget-s", 30,
                     cache_dir=cache_dir, timeout=60)
    assert set(rows(proc.stdout)) == {"mlx ring"} and f"across the hosts of {hostfile}" in proc.stdout


def test_doctor_fabric_exits_nonzero_with_one_line_when_a_host_cannot_be_reached(cache_dir, tmp_path):
    hostfile = tmp_path / "hosts.json"
    hostfile.write_text(json.dumps([{"ssh": "127.0.0.1", "ips": ["127.0.0.1"]},
                                    {"ssh": "mac2.invalid", "ips": ["192.0.2.1"]}]))
    started = time.time()
    proc = dpcompare("doctor", "--fabric", "--hostfile", hostfile, "--time-budget-s", 20, cache_dir=cache_dir,
                     check=False, timeout=60)
    assert proc.returncode != 0 and proc.stdout == ""
    assert proc.stderr.count("\n") == 1 and "mac2.invalid cannot be reached" in proc.stderr
    assert time.time() - started < 20
