"""Text a job or a user controls (names, command lines, reasons, log lines), made safe to show.

Every screen that shows such text goes through here: the CLI's ``status``/``show``/``nodes``,
the TUI (which adds the markup rule in ``tui``), and notifications.  A terminal must never get
an escape sequence from a job.
"""

from __future__ import annotations

import re

__all__ = ["printable"]

#: C0 and C1 control characters, the newline aside.
_CONTROL = re.compile(r"[\x00-\x09\x0b-\x1f\x7f-\x9f]")


def printable(text: str) -> str:
    """``text`` with every control character but the newline shown as an escape (``\\x1b``):
    what a job controls (its command line, its last log line as a failure reason) must not
    reach another user's terminal as escape sequences."""
    return _CONTROL.sub(lambda m: f"\\x{ord(m.group()):02x}", text)
