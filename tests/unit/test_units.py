import pytest

from libra import LibraError
from libra.units import format_bytes, parse_bytes


@pytest.mark.parametrize(
    "text, expected",
    [("6GiB", 6 * 2**30), ("800MB", 800 * 10**6), ("1.5 KiB", 1536), ("4096", 4096), ("2mib", 2 * 2**20),
     (123, 123), ("10 B", 10)],
)
def test_parse(text, expected):
    assert parse_bytes(text) == expected


@pytest.mark.parametrize("bad", [0, -5, "abc", "1.5 XB", "", "50%", "-1GiB", 0.5, 2.0, True, None, "0B"])
def test_bad_budgets_say_what_to_do(bad):
    with pytest.raises(LibraError) as info:
        parse_bytes(bad)
    assert "libra.plan: budget" in str(info.value)
    assert "GiB" in str(info.value) or "bytes" in str(info.value)


def test_format():
    assert format_bytes(512) == "512 B"
    assert format_bytes(3 * 2**20) == "3.00 MiB"
    assert format_bytes(300 * 2**30) == "300.0 GiB"
