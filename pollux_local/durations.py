"""Durations as people write them: ``30s``, ``10m``, ``2h``, ``1h30m``, ``2d`` and Slurm's
``MM``, ``MM:SS``, ``HH:MM:SS``, ``D-HH``, ``D-HH:MM``, ``D-HH:MM:SS``."""

from __future__ import annotations

import math
import re

_UNITS = {"s": 1, "m": 60, "h": 3600, "d": 86400}
_SUFFIXED = re.compile(r"^(?:(\d+(?:\.\d+)?)([smhd]))+$")
_PART = re.compile(r"(\d+(?:\.\d+)?)([smhd])")
_SLURM = re.compile(r"^(?:(\d+)-)?(\d+)(?::(\d+))?(?::(\d+))?$")


class DurationError(ValueError):
    """Not a duration; the message names the text and the forms accepted."""


def parse_duration(text: str) -> float:
    """Seconds in ``text``: a sum of ``<number><unit>`` (units s, m, h, d), or Slurm's forms
    (a bare number is minutes; ``D-HH[:MM[:SS]]``; ``[HH:]MM:SS``)."""
    raw = text.strip().lower()
    if _SUFFIXED.match(raw):
        seconds = sum(float(n) * _UNITS[unit] for n, unit in _PART.findall(raw))
    else:
        match = _SLURM.match(raw)
        if match is None:
            raise DurationError(
                f"not a duration: {text!r} (use 30s, 10m, 2h, 1h30m, 2d, or Slurm's"
                " MM, MM:SS, HH:MM:SS, D-HH, D-HH:MM, D-HH:MM:SS)"
            )
        days, first, second, third = match.groups()
        parts = [int(x) for x in (first, second, third) if x is not None]
        if days is not None:
            # D-HH, D-HH:MM, D-HH:MM:SS
            hours, minutes, secs = (parts + [0, 0])[:3]
            seconds = int(days) * 86400 + hours * 3600 + minutes * 60 + secs
        elif len(parts) == 1:
            seconds = parts[0] * 60
        elif len(parts) == 2:
            seconds = parts[0] * 60 + parts[1]
        else:
            seconds = parts[0] * 3600 + parts[1] * 60 + parts[2]
    if not math.isfinite(seconds) or seconds <= 0:
        raise DurationError(f"a duration must be positive, got {text!r}")
    return float(seconds)


def format_duration(
    seconds: float | None, *, exact: bool = True, brief: bool = False, unknown: str = "-"
) -> str:
    """The one way a duration is written.

    ``exact`` (time limits): the shortest exact whole-unit form, ``30s``, ``10m``, ``1h30m``,
    ``2d``, ``1d2h`` (seconds rounded), which :func:`parse_duration` reads back.  Otherwise
    (elapsed and expected times) its two largest units, the second padded: ``12s``,
    ``4m07s``, ``1h05m``, ``2d04h`` (whole seconds, truncated); ``brief`` drops the seconds
    from ten minutes on (``12m``), for the TUI's narrow columns and the reasons of waiting
    jobs.  ``None`` is ``unknown``."""
    if seconds is None:
        return unknown
    if not exact:
        whole = max(0, int(seconds))
        if whole < 60:
            return f"{whole}s"
        if whole < 3600:
            if brief and whole >= 600:
                return f"{whole // 60}m"
            return f"{whole // 60}m{whole % 60:02d}s"
        if whole < 86400:
            return f"{whole // 3600}h{whole % 3600 // 60:02d}m"
        return f"{whole // 86400}d{whole % 86400 // 3600:02d}h"
    whole = max(0, round(seconds))
    if whole == 0:
        return "0s"
    parts = []
    for unit, size in (("d", 86400), ("h", 3600), ("m", 60), ("s", 1)):
        count, whole = divmod(whole, size)
        if count:
            parts.append(f"{count}{unit}")
    return "".join(parts)
