"""Memory sizes as people write them: ``6G``, ``512M``, ``16GiB``, ``1.5T``, or bytes."""

from __future__ import annotations

import math
import re

_UNITS = {"": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40}
_SIZE = re.compile(r"^(\d+(?:\.\d+)?)\s*([kmgt]?)(?:i?b)?$")


class SizeError(ValueError):
    """Not a size; the message names the text and the forms accepted."""


def parse_size(text: str | int) -> int:
    """Bytes in ``text``: a number with an optional unit K, M, G or T (powers of 1024; ``GB``
    and ``GiB`` mean the same), or a whole number of bytes."""
    if isinstance(text, bool):
        raise SizeError(f"not a size: {text!r}")
    if isinstance(text, int):
        value = float(text)
    else:
        match = _SIZE.match(text.strip().lower())
        if match is None:
            raise SizeError(f"not a size: {text!r} (use e.g. 6G, 512M, 16GiB or a byte count)")
        value = float(match.group(1)) * _UNITS[match.group(2)]
    if not math.isfinite(value) or value < 1 or value > 2**50:
        raise SizeError(f"a size must be between 1 byte and 1 PiB, got {text!r}")
    return int(value)


def format_size(size: int) -> str:
    """``6.0G``, ``512M``, ``1.5T``: the largest unit that keeps the number at least 1."""
    for unit, factor in (("T", 1 << 40), ("G", 1 << 30), ("M", 1 << 20), ("K", 1 << 10)):
        if size >= factor:
            value = size / factor
            return f"{value:.1f}{unit}" if value < 100 else f"{value:.0f}{unit}"
    return f"{size}B"
