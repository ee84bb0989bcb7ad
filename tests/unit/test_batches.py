"""`dpcompare batches`' step ranges (compare/batches.py); the batches themselves are checked against a real run's
metrics in tests/integration/test_lora.py."""
import pytest

from common.errors import UserError
from compare.batches import parse_steps


@pytest.mark.parametrize("text, steps", [("2:5", [2, 3, 4]), ("3", [3]), ("7:", [7, 8, 9]), (":2", [0, 1])])
def test_a_step_range_is_0_based_with_its_end_excluded(text, steps):
    assert list(parse_steps(text, 10)) == steps


@pytest.mark.parametrize("text", ["5:3", "0:11", "x", "-1:2", "10"])
def test_a_range_outside_the_run_is_refused_in_one_line(text):
    with pytest.raises(UserError, match="--steps"):
        parse_steps(text, 10)
