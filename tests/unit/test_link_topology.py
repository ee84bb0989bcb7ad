"""The commands that build an emulated link (compare/launch/topology.py), read without root: two levels put
every rank's pair on its group's bridge at the inner rate and each group's uplink to the router at the outer
rate; one level is the pair or the hub it always was. And the flags of two levels refuse what cannot work."""
from unittest import mock

import pytest

from common.config import RunConfig
from common.errors import UserError
from compare.launch.netns import NAMESPACE, EmulatedLink, _base36, orphaned
from compare.launch.topology import Topology, bucket_bytes, peak_bytes

ADDRESSES = [f"10.232.7.{r + 1}" for r in range(8)]


def veth_pairs(cmds: list[list[str]]) -> dict[str, tuple[str, str, str]]:
    """{interface: (its namespace, its peer, the peer's namespace)} of every `ip link add ... type veth`."""
    pairs = {}
    for c in cmds:
        if c[:3] == ["ip", "link", "add"] and "veth" in c:
            a, ns_a, b, ns_b = c[3], c[5], c[c.index("name") + 1], c[-1]
            pairs[a], pairs[b] = (ns_a, b, ns_b), (ns_b, a, ns_a)
    return pairs


def shaped(cmds: list[list[str]]) -> dict[tuple[str, str], int]:
    """{(namespace, interface): rate in bits/s} of every token bucket."""
    return {(c[3], c[c.index("dev") + 1]): int(c[c.index("rate") + 1].removesuffix("bit"))
            for c in cmds if "tbf" in c}


def bridged(cmds: list[list[str]]) -> dict[tuple[str, str], bool]:
    return {(c[2], c[5]): True for c in cmds if c[:2] == ["ip", "-n"] and c[6:8] == ["master", "br0"]}


def test_two_levels_shape_pairs_inside_a_group_at_the_inner_rate_and_uplinks_at_the_outer_one():
    top = Topology("dpc7qkx0", 4, "100mbit", "1gbit", 2)
    cmds = top.commands(ADDRESSES)
    made = [c[3] for c in cmds if c[:3] == ["ip", "netns", "add"]]
    assert made == ["dpc7qkx0r0", "dpc7qkx0r1", "dpc7qkx0r2", "dpc7qkx0r3", "dpc7qkx0h", "dpc7qkx0g0", "dpc7qkx0g1"]
    assert made == top.all_namespaces and all(NAMESPACE.match(name) for name in made)
    pairs, rates, ports = veth_pairs(cmds), shaped(cmds), bridged(cmds)
    for r in range(4):  # each rank's pair ends on its group's bridge; both ends at the inner rate
        group = f"dpc7qkx0g{r // 2}"
        assert pairs[f"dpc7qkx0v{r}"] == (f"dpc7qkx0r{r}", f"dpc7qkx0p{r}", group)
        assert ports[(group, f"dpc7qkx0p{r}")]
        assert rates[(f"dpc7qkx0r{r}", f"dpc7qkx0v{r}")] == rates[(group, f"dpc7qkx0p{r}")] == 10**9
    for k in range(2):  # each group's uplink is a port of its bridge and of the router's; both ends at the outer rate
        group, uplink, router_port = f"dpc7qkx0g{k}", f"dpc7qkx0u{k}", f"dpc7qkx0q{k}"
        assert pairs[uplink] == (group, router_port, "dpc7qkx0h")
        assert ports[(group, uplink)] and ports[("dpc7qkx0h", router_port)]
        assert rates[(group, uplink)] == rates[("dpc7qkx0h", router_port)] == 10**8
    assert len(rates) == 2 * 4 + 2 * 2  # every veth end shaped exactly once
    # addresses only in the ranks' namespaces, on one subnet; a bridge exists before a port joins it
    assert [c[2] for c in cmds if "addr" in c] == top.namespaces
    first_port = next(i for i, c in enumerate(cmds) if c[6:8] == ["master", "br0"])
    assert any(c[4:6] == ["add", "br0"] and c[2] == "dpc7qkx0h" for c in cmds[:first_port])


def test_the_bucket_of_each_level_is_4_ms_at_its_rate_with_a_64_kb_floor():
    cmds = Topology("dpc1x0", 4, "100mbit", "1gbit", 2).commands(ADDRESSES)
    bursts = {int(c[c.index("rate") + 1].removesuffix("bit")): int(c[c.index("burst") + 1]) for c in cmds if "tbf" in c}
    assert bursts == {10**8: 64 * 1024, 10**9: 500_000} == {rate: bucket_bytes(rate) for rate in bursts}


def test_every_bucket_has_a_peak_bucket_of_100_us_at_a_quarter_over_its_rate_and_one_frame_at_least():
    """Without it a message that fits in the bucket crossed an idle link at the veth's speed (topology.py)."""
    cmds = Topology("dpc1x0", 4, "20mbit", "1gbit", 2).commands(ADDRESSES)
    peaks = {int(c[c.index("rate") + 1].removesuffix("bit")):
             (int(c[c.index("peakrate") + 1].removesuffix("bit")), int(c[c.index("mtu") + 1])) for c in cmds if "tbf" in c}
    assert peaks == {2 * 10**7: (25 * 10**6, 1514), 10**9: (125 * 10**7, 12_500)}
    assert {rate: peak_bytes(rate) for rate in peaks} == {rate: mtu for rate, (_, mtu) in peaks.items()}


@pytest.mark.parametrize("ranks, hub", [(2, None), (4, "dpc1x0h")])
def test_one_level_is_one_pair_at_two_ranks_and_a_hub_beyond(ranks, hub):
    top = Topology("dpc1x0", ranks, "200mbit")
    cmds = top.commands(ADDRESSES)
    assert top.hub == hub and top.all_namespaces == top.namespaces + ([hub] if hub else [])
    assert set(shaped(cmds).values()) == {2 * 10**8} and len(shaped(cmds)) == 2 * (1 if ranks == 2 else ranks)
    if ranks == 2:
        assert veth_pairs(cmds)["dpc1x0v0"] == ("dpc1x0r0", "dpc1x0v1", "dpc1x0r1")


def test_every_name_of_two_levels_fits_an_interface_and_a_dead_owners_are_orphans():
    dead = 4194303  # the kernel's largest pid
    with mock.patch("os.getpid", return_value=dead):
        link = EmulatedLink("100mbit", 16, "1gbit", 2)
    cmds = link.topology.commands(link.addresses)
    interfaces = set(veth_pairs(cmds))
    assert len(interfaces) == 2 * 16 + 2 * 8 and all(len(name) <= 15 for name in interfaces)
    assert orphaned(link.topology.all_namespaces, alive=lambda pid: pid != dead) == link.topology.all_namespaces
    assert link.outer_peer == 2 and link.hub == f"dpc{_base36(dead)}x{link.tag.split('x')[-1]}h"


@pytest.mark.parametrize("fields, message", [
    ({"link": "100mbit", "link_inner": "1gbit"}, "--link-inner and --group-size go together"),
    ({"link_inner": "1gbit", "group_size": 2}, "--link-inner 1gbit needs --link RATE"),
    ({"link": "100mbit", "link_inner": "1gbit", "group_size": 3}, "--group-size 3 must be 2 or more and divide --nproc 4"),
    ({"link": "100mbit", "link_inner": "1gbit", "group_size": 4}, "into 2 or more groups"),
    ({"link": "100mbit", "link_inner": "fast", "group_size": 2}, "give a rate such as"),
])
def test_two_level_flags_that_cannot_work_are_refused_in_one_line(fields, message):
    with pytest.raises(UserError, match=message):
        RunConfig(framework="torch", nproc=4, **fields).validate()


def test_a_one_rank_run_of_a_two_level_compare_is_not_refused():
    RunConfig(framework="torch", nproc=1, link="100mbit", link_inner="1gbit", group_size=2).validate()
