"""The one duration formatter: the exact form reads back, the table form keeps two units."""

from __future__ import annotations

import pytest

from pollux_local.cli.format import duration
from pollux_local.durations import format_duration, parse_duration


@pytest.mark.parametrize("seconds", [1, 30, 600, 5400, 86400, 93600, 90061])
def test_the_exact_form_reads_back(seconds: int) -> None:
    assert parse_duration(format_duration(seconds)) == seconds


@pytest.mark.parametrize(
    ("seconds", "shown"),
    [(None, "-"), (12.9, "12s"), (247, "4m07s"), (3900, "1h05m"), (2 * 86400 + 4 * 3600, "2d04h")],
)
def test_tables_show_two_units_and_the_cli_uses_that_form(
    seconds: float | None, shown: str
) -> None:
    assert format_duration(seconds, exact=False) == shown
    assert duration(seconds) == shown


@pytest.mark.parametrize(
    ("seconds", "shown"),
    [(45, "45s"), (247, "4m07s"), (725, "12m"), (3900, "1h05m"), (2 * 86400 + 4 * 3600, "2d04h")],
)
def test_the_brief_form_drops_seconds_from_ten_minutes_on(seconds: float, shown: str) -> None:
    assert format_duration(seconds, exact=False, brief=True) == shown
