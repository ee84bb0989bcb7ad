"""Emulated links (`--link RATE`, compare/launch/netns.py): local ranks in network namespaces joined by
tc-shaped veth pairs. A shaped link carries a 32 MB all-reduce at its rate, for MLX's ring and torch's
gloo; the cost model predicts a shaped run; a run leaves none of its namespaces behind (each test checks the
names its run recorded: the other xdist worker may hold namespaces of its own meanwhile). (A killed rank and a stop signal over an emulated link are checked
by tests/integration/test_faults.py and test_stop.py, on runs they make anyway.)

Needs root and iproute2; skipped with the reason otherwise.
"""
import json

import pytest

from helpers import dpcompare, namespaces, skip_unless_links, summary
from integration.runs import LINK_RATE, LINK_RATE_BPS

RATE, RATE_BPS = "250mbit", 250e6
# The target for the cost model. Measured here: -1.3 % and -0.5 % (torch x2, tiny, 100mbit: 63.5 ms
# measured, 62.7 and 63.1 predicted; AMD EPYC Zen 5, 2 cores); small over 1gbit and 200mbit: -4 % to +6 %
# (docs/scaling.md).
TOLERANCE = 0.15


@pytest.mark.slow
def test_a_shaped_link_carries_a_32_mb_all_reduce_within_20_percent_of_its_rate(cache_dir, tmp_path):
    """250mbit, not 400: in one CI of stop 51, beside the other xdist worker's tests on 2 cores, gloo's 32 MB
    all-reduce was CPU-bound at 296 Mbit/s over 400mbit (-26 %). At 250mbit, beside test_axes.py: gloo 237 and
    236, MLX's ring 218 and 225 (AMD EPYC Zen 4). A 50 s time budget (40 s at 400mbit; with 32 s, under the
    other worker's load, torch's start-up left gloo too little of its share and its sweep stopped at 1 MB): the
    jobs fill their shares, up to --max-calls per size; 5 calls of 32 MB give the median. 26-27 s here.
    The figures are read from --out, not from the table's two decimals (0.03 GB/s at this rate)."""
    skip_unless_links()
    figures = tmp_path / "fabric.json"
    proc = dpcompare("doctor", "--fabric", "--link", RATE, "--backend", "ring,gloo", "--max-mb", 32,
                     "--max-calls", 5, "--time-budget-s", 50, "--out", figures, cache_dir=cache_dir, timeout=120)
    print(proc.stdout)
    assert f"emulated {RATE_BPS / 1e6:.0f} Mbit/s link" in proc.stdout and "delay cannot be shaped" in proc.stdout
    rows = {f"{b['framework']} {b['backend']}": b for b in json.loads(figures.read_text())["backends"]}
    assert set(rows) == {"mlx ring", "torch gloo"}, proc.stdout
    for name, row in rows.items():
        assert row["error"] is None and row["large_bytes"] == 32 * 2**20, (name, proc.stdout)
        # At N=2 a ring all-reduce sends each rank's whole buffer once each way: its algorithm bandwidth is
        # the link's.
        assert abs(row["bandwidth_Bps"] * 8 - RATE_BPS) <= 0.2 * RATE_BPS, (name, row["bandwidth_Bps"], proc.stdout)


@pytest.mark.slow
def test_the_cost_model_predicts_a_two_rank_run_over_a_shaped_link_from_the_one_rank_run(shaped_link_run):
    """Over 20 Mbit/s the gradient all-reduce (tiny: 632 KB, about 0.25 s) outlasts the compute several times
    over, so the prediction made from the 1-rank run and the link the 2-rank job measured (compare/plan.py) is
    mostly the link's time. At 100 Mbit/s the compute was a third of the step and the other xdist worker's
    runs pushed the error to 15.7 % (limit 15 %) in two of four full suites on the 2-core machine; at 20 Mbit/s
    they still moved it by -17 % to +21 %, so the run is trained alone (tests/integration/conftest.py)."""
    s = summary(shaped_link_run / "torch-n2")
    p = s["prediction"]
    print(f"torch x2 over {LINK_RATE}: measured {s['step_time_s'] * 1e3:.1f} ms, predicted {p['step_s'] * 1e3:.1f} ms "
          f"({p['step_error']:+.1%}), link {p['link_source']}")
    assert p["from"] == "torch-n1" and "link record" in p["link_source"]
    assert s["link"]["namespaces"] and not set(s["link"]["namespaces"]) & set(namespaces())  # a normal end
    # The shaped link carries no more than its rate: a bucket that held 256 KB let the 1.25 MB TCP probe
    # through at 1.18x it (the 64 KB one: 1.00x; netns.py's BUCKET_MIN_BYTES).
    assert s["link"]["tcp_bandwidth_Bps"] * 8 <= 1.08 * LINK_RATE_BPS, s["link"]
    # Nor does a message that fits the bucket, after the link idles: with the bucket alone a 64 KB message crossed
    # 20mbit at 379 Mbit/s; with the peak bucket (topology.py: 1.25x the rate) 22 (docs/links.md).
    assert 0 < s["link"]["tcp_message_Bps"] * 8 <= 1.3 * LINK_RATE_BPS, s["link"]
    assert abs(p["step_error"]) <= TOLERANCE, p


@pytest.mark.slow
def test_a_two_level_link_carries_each_levels_rate_and_leaves_no_namespace(shaped_link_run):
    """torch x4 in two groups of two (compare/launch/topology.py): the ranks' own all-reduce inside each group
    and across the groups, each turned into its per-hop rate by the ring formula, is within 20 % of that level's
    shaped rate (the issue's bar), and so is the launcher's TCP probe of each; the groups crossing at once get
    about half the outer rate each. At the issue's 1gbit inside and 100mbit between, measured at load 1-7: 953
    and 956 Mbit/s per hop, TCP 958 and 97 (AMD EPYC Zen 4, 2 cores); but at load 14 gloo's 1gbit all-reduce was
    CPU-bound at 723 Mbit/s, and at 400mbit 210. 250mbit inside gave 243 per hop (TCP 239) at load 15, but in one
    CI of stop 51 183 (TCP 241): at that rate 32 MiB does not fit the probe's 5 s, and gloo's 4 MiB all-reduce on
    2 busy cores is CPU-bound. So the test shapes 200mbit inside: 194 and 193 per hop (TCP 193), from 4 MiB too.
    100mbit between measured 81-102 per hop over five runs at load 7-16. Not slower: at 50mbit only the 1 MiB size fit the probe's 5 s, and gave 28 Mbit/s per hop
    (gloo's algorithm for that size crosses the uplink twice). Two steps, no profile rounds: the link is judged.
    16 s for the run on a quiet machine, 98 s at load 15 with a cold cache. The run (integration/runs.py's
    TWO_LEVEL_ARGS) is trained with the shaped-link compare, alone before the xdist workers start."""
    from common.costmodel.links import hop_bandwidth_Bps

    out = shaped_link_run.parent / "two-level"
    link = summary(out)["link"]
    assert link["group_size"] == 2 and len(link["namespaces"]) == 4 + 1 + 2, link
    assert not set(link["namespaces"]) & set(namespaces())  # all gone after a normal end
    for level, rate_bps in ((link, 100e6), (link["inner"], 200e6)):
        hop_bps = 8 * (hop_bandwidth_Bps(level["allreduce"]) or 0)
        print(f"{level['requested']}: all-reduce {hop_bps * 1e-6:.0f} Mbit/s per hop, TCP "
              f"{level['tcp_bandwidth_Bps'] * 8e-6:.0f} Mbit/s")
        assert abs(hop_bps - rate_bps) <= 0.2 * rate_bps, level
        assert abs(level["tcp_bandwidth_Bps"] * 8 - rate_bps) <= 0.2 * rate_bps, level
        assert 0 < level["tcp_message_Bps"] * 8 <= 1.3 * rate_bps, level  # the peak bucket holds a message to it
    # The groups that cross at once (ranks 0,2 and 1,3, as an outer mesh axis's) share each machine's uplink: each
    # gets about half of it, 36-41 Mbit/s per hop with gloo on the Zen 4 (docs/scaling.md, "Sitting 13"); a
    # topology that gave each rank its own uplink would let each near the whole 100.
    across = link["allreduce_across"]
    hop_bps = 8 * (hop_bandwidth_Bps(across) or 0)
    print(f"across, {across.get('concurrent')} groups at once: all-reduce {hop_bps * 1e-6:.0f} Mbit/s per hop")
    assert across["world_size"] == 2 and across["concurrent"] == 2, across
    assert 0.2 * 100e6 <= hop_bps <= 0.6 * 100e6, across
    # Beside rank 0's figures, each call's slowest rank fitted from every rank's calls (what a mesh's collectives
    # across the hop wait for, docs/scaling.md "Sitting 15"): at the largest size no faster than rank 0's calls.
    last, size = across["last_rank"], across["large_bytes"]
    assert last["large_bytes"] == size and len(across["times_s"][str(size)]) >= 1, across
    assert last["latency_s"] + size / last["bandwidth_Bps"] >= across["latency_s"] + size / across["bandwidth_Bps"] - 1e-6
