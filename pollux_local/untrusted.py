"""Text a job or a user controls (names, command lines, reasons, log lines), made safe to show.

Every screen that shows such text goes through here: the CLI's ``status``/``show``/``nodes``/
``wait``/``logs --safe``, the TUI (``tui/literal.py`` adds the markup rule on top), and
notifications.  A terminal must never get an escape sequence from a job.  Stdlib only: the
supervisor (``launch/supervisor.py``), which runs alone, imports it too.
"""

from __future__ import annotations

import re
import unicodedata

__all__ = [
    "PartialEscape",
    "cells",
    "cells_at_most",
    "one_line",
    "printable",
    "printable_log",
    "wrap_cells",
]

#: The Unicode controls that reorder text: bidirectional embeddings, overrides and isolates
#: (escaped wherever a job's text is shown, its log too).
_REORDER = r"\u202a-\u202e\u2066-\u2069"
#: Besides, in text that names a job or a user (names, command lines, reasons): characters that
#: hide text or break a line, with which one name could pass for another (zero-width space,
#: the bidirectional marks, the line separators, the invisible operators, the byte-order
#: mark).  The zero-width joiners stay: Persian, Indic scripts and emoji need them.
_INVISIBLE = r"\u061c\u200b\u200e\u200f\u2028\u2029\u2060-\u2064\ufeff"
#: On one line (a table's cell, a status line), also the blanks other than the space (no-break,
#: ideographic, the typographic spaces): with them a note could pass for a row's columns.
_BLANKS = r"\u00a0\u1680\u2000-\u200a\u202f\u205f\u3000"
#: C0 and C1 control characters, the newline aside, and both sets above.
_CONTROL = re.compile(rf"[\x00-\x09\x0b-\x1f\x7f-\x9f{_REORDER}{_INVISIBLE}]")
_CONTROL_OR_NEWLINE = re.compile(rf"[\x00-\x1f\x7f-\x9f{_REORDER}{_INVISIBLE}{_BLANKS}]")


def one_line(text: object, limit: int = 500) -> str:
    """``text`` (an error, a process's output) as one line of a log or a reason: control
    characters as spaces, runs of blanks as one, at most ``limit`` characters (a cut one ends
    in ``...``)."""
    cleaned = "".join(ch if ch.isprintable() else " " for ch in str(text))
    cleaned = " ".join(cleaned.split())
    return cleaned if len(cleaned) <= limit else cleaned[: limit - 3] + "..."


def _escape(match: re.Match[str]) -> str:
    code = ord(match.group())
    return f"\\x{code:02x}" if code < 0x100 else f"\\u{code:04x}"


def printable(text: str, *, newline: bool = True) -> str:
    """``text`` with every control character shown as an escape (``\\x1b``, ``\\u202e``):
    what a job controls (its command line, its last log line as a failure reason) must not
    reach another user's terminal as escape sequences.  The newline is kept unless
    ``newline=False`` (text shown on one line: a table cell, a status line, where the blanks
    other than the space are escaped too)."""
    return (_CONTROL if newline else _CONTROL_OR_NEWLINE).sub(_escape, text)


def cells(text: str) -> int:
    """The terminal columns ``text`` takes, as a table aligns it: 2 for a wide or full-width
    character (East Asian width W or F), 0 for a mark drawn over the one before it (Unicode
    category Mn or Me), 1 for any other.  Where a line must fit a width (a note beside its row,
    a wrapped line) :func:`cells_at_most` counts instead: a line measured short is wrapped by
    the terminal, and what follows the wrap starts at column 0, where it could pass for a row
    of its own."""
    if text.isascii():  # the usual case, a column each
        return len(text)
    return sum(
        0
        if unicodedata.category(ch) in ("Mn", "Me")
        else 2
        if unicodedata.east_asian_width(ch) in "WF"
        else 1
        for ch in text
    )


def cells_at_most(text: str) -> int:
    """The most terminal columns ``text`` can take, whatever the terminal's own table of
    widths: every character at least 1 (marks, joiners and zero-width characters included),
    2 for a wide, full-width or ambiguous one (East Asian width W, F or A: a terminal set up
    for East Asian text draws the ambiguous ones wide).  Review s55 forged a row with spacing
    marks (U+302E) that a count of 0 for every combining character took as taking no room."""
    if text.isascii():
        return len(text)
    return sum(2 if unicodedata.east_asian_width(ch) in "WFA" else 1 for ch in text)


def wrap_cells(text: str, width: int, indent: str) -> list[str]:
    """``text`` (one line) as lines of at most ``width`` columns (:func:`cells_at_most`),
    each starting with ``indent``, broken at spaces; a word wider than a line is cut."""
    room = max(width - cells_at_most(indent), 1)
    lines: list[str] = []
    line, used = "", 0
    for word in text.split(" "):
        size = cells_at_most(word)
        if line and used + 1 + size <= room:
            line, used = f"{line} {word}", used + 1 + size
            continue
        if line:
            lines.append(line)
        line, used = "", 0
        while size > room:  # a word wider than a line: cut it
            head, head_size = "", 0
            for ch in word:
                if head_size + cells_at_most(ch) > room:
                    break
                head, head_size = head + ch, head_size + cells_at_most(ch)
            head = head or word[0]
            lines.append(head)
            word = word[len(head) :]
            size = cells_at_most(word)
        line, used = word, size
    if line:
        lines.append(line)
    return [indent + line for line in lines]


#: In a job's log: a colour (SGR) sequence, kept, or any other control character but the
#: newline and the tab, escaped.
_LOG = re.compile(rf"(\x1b\[[0-9;:]{{0,64}}m)|[\x00-\x08\x0b-\x1f\x7f-\x9f{_REORDER}]")
#: The end of a chunk that may be the start of a colour sequence cut by the chunk's end.
_PARTIAL_SGR = re.compile(r"\x1b(\[[0-9;:]{0,64})?$")


def printable_log(text: str) -> str:
    """A job's log as ``logs --safe`` prints it: colours (``ESC [ ... m``) kept, as ``less -R``
    keeps them; every other control character (window titles, cursor moves, clear screen,
    ``\\r``) shown as an escape; newlines and tabs kept."""
    return _LOG.sub(lambda m: m.group(1) or _escape(m), text)


class PartialEscape:
    """:func:`printable_log` over a stream of chunks: a colour sequence cut by a chunk's end
    is held back until the next chunk completes it."""

    def __init__(self) -> None:
        self._held = ""

    def feed(self, chunk: str) -> str:
        text = self._held + chunk
        cut = _PARTIAL_SGR.search(text)
        self._held = text[cut.start() :] if cut else ""
        return printable_log(text[: cut.start()] if cut else text)

    def flush(self) -> str:
        held, self._held = self._held, ""
        return printable_log(held)
