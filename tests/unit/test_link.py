"""Emulated links refuse, before anything starts, what they cannot do here; rates parse as tc's units."""
from unittest import mock

import pytest

from common.errors import UserError
from common.link import describe_rate, parse_rate
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
