"""`dpcompare doctor --fabric`: all-reduce latency and bandwidth per backend, within its time budget, and a
host that cannot be reached ends it with one line. Tiny messages and short budgets keep these quick."""
import pytest

import common.costmodel.probe as probe
from common.costmodel.probe import Collectives, measure
from compare.machine.fabric import Measured, Workload


class Clock:
    """The probe's clock, simulated: a FakeLink's call moves it by the call's cost. A real sleep overshoots on a busy
    machine (a 1 ms call read 615 MB/s for 1 GB/s when the suite's background build shared the cores), so the
    figures here are exact whatever the load."""

    def __init__(self):
        self.now = 1000.0

    def monotonic(self) -> float:
        return self.now

    perf_counter = monotonic

    def sleep(self, seconds: float) -> None:
        self.now += seconds


@pytest.fixture(autouse=True)
def clock(monkeypatch):
    simulated = Clock()
    monkeypatch.setattr(probe, "time", simulated)
    return simulated


class FakeLink:
    """Collectives over a simulated link: each call costs latency + bytes / bandwidth (seconds of the Clock)."""

    def __init__(self, latency_s, bytes_per_s):
        self.latency_s, self.bytes_per_s, self.decisions = latency_s, bytes_per_s, []

    def collectives(self):
        def all_reduce(x):
            probe.time.sleep(self.latency_s + x / self.bytes_per_s)

        def from_rank0(value):
            self.decisions.append(value)
            return value

        def all_gather(x):  # x: the rank's part; a ring all-gather at N=2 sends it once
            probe.time.sleep(self.latency_s + x / self.bytes_per_s)

        return Collectives(rank=0, size=2, device="cpu", buffer=lambda n: n, all_reduce=all_reduce,
                           from_rank0=from_rank0, all_gather=all_gather)


def test_the_rank_measures_every_size_when_time_allows_and_skips_what_would_overrun_the_budget():
    fast = FakeLink(1e-4, 1e9)
    results = measure(fast.collectives(), [4096, 2**20], max_calls=5)
    assert [r["size_bytes"] for r in results] == [4096, 2**20] and all(len(r["times_s"]) == 5 for r in results)
    # A slow link: 64 MB would take ~0.7 s a call, far past a 0.5 s budget, so it is skipped (predicted from
    # 512 KB), and the decision (a 0 from rank 0) is made inside a collective so every rank skips it alike.
    slow = FakeLink(1e-3, 1e8)
    started = probe.time.monotonic()
    results = measure(slow.collectives(), [4096, 2**19, 2**26], max_calls=5, time_budget_s=0.5, started=started)
    assert [r["size_bytes"] for r in results] == [4096, 2**19] and probe.time.monotonic() - started < 0.6
    assert 0.0 in slow.decisions


def test_the_sync_estimate_is_a_latency_per_bucket_plus_the_bytes_at_the_measured_bandwidth():
    row = Measured("mlx", "ring", 2, latency_s=1e-4, bandwidth_Bps=1e9)
    small = Workload("small", 128, 8)
    assert row.sync_s(small.grad_bytes, 32 * 2**20) == pytest.approx(4 * 1e-4 + small.grad_bytes / 1e9)
    assert 100 * 2**20 < small.grad_bytes < 120 * 2**20  # ~28M fp32 parameters


def test_an_all_gather_probe_gives_each_rank_its_part_and_fits_the_gathered_size():
    from common.costmodel.probe import fit
    link = FakeLink(2e-3, 1e8)
    gathered = measure(link.collectives(), [4096, 2**22], max_calls=3, op="all_gather")
    reduced = measure(link.collectives(), [4096, 2**22], max_calls=3)
    # Sizes are the gathered size; each rank's buffer is its 1/N part, so the same size gathers in about half
    # the time the all-reduce takes here (sleep-based: a few ms of scheduling noise on top).
    assert [r["size_bytes"] for r in gathered] == [4096, 2**22]
    g, r = fit(gathered), fit(reduced)
    assert g["bandwidth_Bps"] == pytest.approx(2 * r["bandwidth_Bps"], rel=0.25)


def test_two_levels_time_each_group_inside_and_the_groups_across_machines_each_at_its_own_rate():
    """common/costmodel/probe.py's probe_group_allreduce: inside, every group of consecutive ranks at once; across,
    the ranks at one place in every group (one per machine), `concurrent` such groups sharing each machine's
    card. A rank's Collectives is asked for the split it needs; a backend that cannot split says so."""
    from common.costmodel.probe import probe_group_allreduce
    asked = []
    inside, across = FakeLink(1e-4, 1e9), FakeLink(1e-4, 2.5e8)  # the slow hop, shared

    def group_all_reduce(group_size, across_machines=False):
        asked.append((group_size, across_machines))
        return (across if across_machines else inside).collectives().all_reduce

    c = FakeLink(1e-4, 5e8).collectives()
    c = Collectives(rank=0, size=4, device="cpu", buffer=c.buffer, all_reduce=c.all_reduce, from_rank0=c.from_rank0,
                    group_all_reduce=group_all_reduce)
    got_inside = probe_group_allreduce(c, "mpi", 2)
    got_across = probe_group_allreduce(c, "mpi", 2, across=True)
    assert asked == [(2, False), (2, True)]
    assert got_inside["world_size"] == 2 and "concurrent" not in got_inside
    assert got_across["world_size"] == 2 and got_across["concurrent"] == 2  # 4 ranks: 2 machines, 2 groups at once
    assert got_inside["bandwidth_Bps"] == pytest.approx(1e9, rel=0.3)
    assert got_across["bandwidth_Bps"] == pytest.approx(2.5e8, rel=0.3)
    ring = Collectives(rank=0, size=4, device="cpu", buffer=c.buffer, all_reduce=c.all_reduce, from_rank0=c.from_rank0,
                       group_all_reduce=lambda group_size, across_machines=False: None)
    unsplit = probe_group_allreduce(ring, "ring", 2, across=True)
    assert unsplit["bandwidth_Bps"] is None and "cannot split" in unsplit["note"] and unsplit["world_size"] == 2


def test_the_summarys_across_figure_is_rank_0s_with_each_calls_slowest_rank_fitted_beside_it():
    """common/costmodel/probe.py's last_rank_fit: a step that syncs every group crossing the slow hop at once goes
    on when the last rank has its result, so each call's slowest rank is fitted, call by call (not the slowest
    rank's median: the slowest rank differs from call to call). Records whose calls do not line up give none."""
    from common.costmodel.probe import across_with_last_rank, fit, last_rank_fit
    small, large = "4096", "1048576"
    ranks = [{"times_s": {small: [1e-3, 1e-3, 1e-3], large: [0.15, 0.30, 0.15]}},
             {"times_s": {small: [1e-3, 2e-3, 1e-3], large: [0.25, 0.15, 0.15]}},
             {"times_s": {small: [1e-3, 1e-3, 1e-3], large: [0.15, 0.15, 0.28]}}]
    last = last_rank_fit(ranks)
    # each call's slowest: 0.25, 0.30, 0.28 -> median 0.28; every rank's own median is 0.15
    assert last == fit([{"size_bytes": 4096, "times_s": [1e-3, 2e-3, 1e-3]},
                        {"size_bytes": 2**20, "times_s": [0.25, 0.30, 0.28]}])
    assert last["bandwidth_Bps"] == pytest.approx(2**20 / (0.28 - 1e-3))
    assert all(last["bandwidth_Bps"] < fit([{"size_bytes": int(s), "times_s": t} for s, t in r["times_s"].items()])
               ["bandwidth_Bps"] for r in ranks)
    summary = across_with_last_rank([{"world_size": 2, "concurrent": 2, "bandwidth_Bps": 7e6, **ranks[0]}, *ranks[1:]])
    assert summary["bandwidth_Bps"] == 7e6 and summary["last_rank"] == last  # rank 0's figures stand beside it
    short = [ranks[0], {"times_s": {small: [1e-3], large: [0.2]}}]
    assert last_rank_fit(short) is None and "last_rank" not in across_with_last_rank(short)
    assert last_rank_fit([ranks[0], {}]) is None and across_with_last_rank([None, ranks[1]]) is None
