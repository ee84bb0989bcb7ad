"""Emulated links refuse, before anything starts, what they cannot do here; rates parse as tc's units."""
import os
import shutil
from unittest import mock

import pytest

from common.errors import UserError
from common.costmodel.rates import describe_rate, parse_rate
from helpers import FAST, dpcompare_here


@pytest.mark.parametrize("text, bits_per_s", [("200mbit", 200e6), ("1gbit", 1e9), ("10Gbit", 10e9),
                                              ("2.5gbit", 2.5e9), ("64kbit", 64e3)])
def test_rates_are_tc_units_in_bits_per_second(text, bits_per_s):
    assert parse_rate(text) == bits_per_s
    assert parse_rate(describe_rate(bits_per_s).replace(" ", "").replace("/s", "").lower()) == bits_per_s


@pytest.mark.parametrize("text", ["1gb", "fast", "0mbit", "-1gbit", ""])
def test_a_rate_without_a_bit_unit_is_refused(text):
    with pytest.raises(UserError, match="give a rate such as 200mbit"):
        parse_rate(text)


@pytest.mark.parametrize("command", [["run", "--framework", "torch"], ["compare", "--frameworks", "mlx,torch"]])
def test_without_root_an_emulated_link_is_refused_in_one_line_and_nothing_is_written(command, tmp_path, cache_dir):
    out = tmp_path / "out"
    with mock.patch("os.geteuid", return_value=1000):
        proc = dpcompare_here(*command, *FAST, "--nproc", 2, "--link", "1gbit", "--out", out, cache_dir=cache_dir)
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.strip().splitlines() == ["dpcompare: error: --link 1gbit: emulated links need root "
                                                "(network namespaces and tc); run as root or drop --link"]
    assert not out.exists()


def test_without_ip_an_emulated_link_names_the_missing_tool(tmp_path, cache_dir):
    with mock.patch("os.geteuid", return_value=0), mock.patch("shutil.which", return_value=None):
        proc = dpcompare_here("doctor", "--fabric", "--link", "1gbit", cache_dir=cache_dir)
    assert proc.returncode == 2 and "`ip` not found (Debian: apt install iproute2)" in proc.stderr, proc.stderr


def test_only_the_namespaces_of_a_dpcompare_that_no_longer_runs_are_orphans_and_names_fit_interfaces():
    from compare.launch.netns import EmulatedLink, _base36, orphaned
    dead, live = 4194303, 1234  # the kernel's largest pid: still a 15-character interface name
    names = [f"dpc{_base36(dead)}x0r0", f"dpc{_base36(dead)}x3h", f"dpc{_base36(live)}x0r1", "dpcx0r0", "mine",
             f"dpc{_base36(dead)}x0v0"]
    assert orphaned(names, alive=lambda pid: pid == live) == names[:2]
    with mock.patch("os.getpid", return_value=dead):
        link = EmulatedLink("1gbit", 12)
    assert all(len(name) <= 15 for name in link.interfaces + link.namespaces)
    assert orphaned(link.namespaces, alive=lambda pid: pid != dead) == link.namespaces  # its pid, read back


@pytest.mark.skipif(os.geteuid() != 0 or shutil.which("ip") is None, reason="needs root and ip (iproute2)")
def test_a_killed_dpcompares_namespaces_are_swept_and_nobody_elses():
    """SIGKILL runs no cleanup: the next link removes what a dead owner left, by the pid in its name."""
    import subprocess

    from compare.launch.netns import _base36, netns_names, sweep_orphans
    dead = max(int(p) for p in os.listdir("/proc") if p.isdigit()) + 1  # no process has it right now
    while os.path.exists(f"/proc/{dead}"):
        dead += 1
    stale, kept = f"dpc{_base36(dead)}x9r0", f"dpc{_base36(os.getpid())}x9r0"
    for name in (stale, kept):
        subprocess.run(["ip", "netns", "add", name], check=True)
    try:
        assert stale in sweep_orphans()
        assert stale not in netns_names() and kept in netns_names()
    finally:
        for name in (stale, kept):
            subprocess.run(["ip", "netns", "del", name], capture_output=True)


def _loopback_record(gather_Bps=None, requested=None, calls=None):
    """A fit run's link record; `calls`: its all-reduce's calls per size, as probe_allreduce records them."""
    record = {"requested": requested, "emulated": bool(requested),
              "allreduce": {"backend": "gloo", "world_size": 2, "latency_s": 3e-4, "bandwidth_Bps": 1.5e9,
                            "times_s": calls or {"4096": [4e-3, 3e-4, 4e-3], "33554432": [0.05, 0.04, 0.06]}}}
    if gather_Bps:
        record["allgather"] = {"backend": "gloo", "world_size": 2, "latency_s": 2e-4, "bandwidth_Bps": gather_Bps,
                               "times_s": {"4096": [2e-4], "33554432": [2e-4 + 33554432 / gather_Bps]}}
    return record


def test_a_one_rank_calibration_prices_its_collectives_at_the_fastest_calls_its_fit_runs_measured():
    """A run of one rank measured no link: plan takes this machine's loopback as the --fit runs of the same framework
    and backend measured it at their start, each size at its fastest call over all of them (a waiting rank's call
    is a scheduler tick or not: the median latency swings), the all-gather an fsdp fit's; never a shaped link's or
    another framework's; the backend's assumed figures where no fit recorded its calls."""
    from types import SimpleNamespace

    from common.costmodel.links import loopback_link
    from compare.plan.links import choose_link

    args = SimpleNamespace(fabric=None, link_gbps=None, latency_us=None)
    n1 = {"framework": "torch", "world_size": 1}
    fit = lambda record, framework="torch", backend="gloo": {"framework": framework, "backend": backend,  # noqa: E731
                                                             "link": record}
    ddp = fit(_loopback_record(calls={"4096": [4e-3, 4e-3], "33554432": [0.05, 0.03, 0.06]}))
    fsdp = fit(_loopback_record(gather_Bps=0.7e9, calls={"4096": [2e-4, 4e-3], "33554432": [0.05]}))
    link, how = choose_link(args, n1, "gloo", (("ddp-2", ddp), ("fsdp-2", fsdp)))
    assert "measured by the fit runs" in link.name and "ddp-2, fsdp-2" in link.source and "one rank" in how
    # the fastest 4 KB call (fsdp-2's) and the fastest 32 MiB one (ddp-2's), whatever their medians
    per_byte = (0.03 - 2e-4) / 33554432
    assert link.all_reduce_s(4096, 2) == pytest.approx(2e-4 + 4096 * per_byte)
    assert link.all_reduce_s(33554432, 2) == pytest.approx(0.03)
    assert link.all_gather_s(64e6, 2) == pytest.approx(2e-4 + 64e6 / 0.7e9)  # the measured gather, not half a ring
    alone = choose_link(args, n1, "gloo", (("ddp-2", ddp),))[0]  # no all-gather measured: priced from the all-reduce
    assert alone.all_gather_s(64e6, 2) == pytest.approx(alone.reduce_scatter_s(64e6, 2))
    assumed = loopback_link("gloo")
    refused = (("shaped", fit(_loopback_record(0.7e9, requested="1gbit"))), ("mlx", fit(_loopback_record(0.7e9), "mlx")),
               ("mpi", fit(_loopback_record(0.7e9), backend="mpi")))
    assert choose_link(args, n1, "gloo", refused)[0] == assumed
    older = fit({"requested": None, "allreduce": {"backend": "gloo", "world_size": 2, "latency_s": 3e-4,
                                                  "bandwidth_Bps": 1.5e9}})  # a record without its calls
    assert choose_link(args, n1, "gloo", (("old", older),))[0] == assumed
    # the run's own record and a link given by hand come first
    assert choose_link(args, {**n1, "link": _loopback_record()}, "gloo", (("fsdp-2", fsdp),))[1] == "the run's link record"
