"""Text a job or a user controls (names, command lines, reasons, log lines), made safe to show.

Every screen that shows such text goes through here: the CLI's ``status``/``show``/``nodes``/
``wait``/``logs --safe``, the TUI (``tui/literal.py`` adds the markup rule on top), and
notifications.  A terminal must never get an escape sequence from a job.
"""

from __future__ import annotations

import re

__all__ = ["printable"]

#: C0 and C1 control characters, the newline aside, and the Unicode controls that reorder or
#: hide text (bidirectional embeddings, overrides and isolates).
_CONTROL = re.compile(r"[\x00-\x09\x0b-\x1f\x7f-\x9f\u202a-\u202e\u2066-\u2069]")
_CONTROL_OR_NEWLINE = re.compile(r"[\x00-\x1f\x7f-\x9f\u202a-\u202e\u2066-\u2069]")


def _escape(match: re.Match[str]) -> str:
    code = ord(match.group())
    return f"\\x{code:02x}" if code < 0x100 else f"\\u{code:04x}"


def printable(text: str, *, newline: bool = True) -> str:
    """``text`` with every control character shown as an escape (``\\x1b``, ``\\u202e``):
    what a job controls (its command line, its last log line as a failure reason) must not
    reach another user's terminal as escape sequences.  The newline is kept unless
    ``newline=False`` (text shown on one line: a table cell, a status line)."""
    return (_CONTROL if newline else _CONTROL_OR_NEWLINE).sub(_escape, text)
