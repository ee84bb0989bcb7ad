"""`dpcompare doctor --fabric`: all-reduce latency and bandwidth per backend, within its time budget, and a
host that cannot be reached ends it with one line. Tiny messages and short budgets keep these quick."""
import json
import re
import time

import pytest

from helpers import dpcompare

ROW = re.compile(r"^(mlx|torch) (\w+)\s+(\d+)\s+(\S+)\s+([\d,]+) µs\s+([\d.]+) GB/s", re.M)


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
