"""The one way text reaches a TUI screen: shown literally, never read as markup.

Textual reads a ``str`` given to ``Static``, ``Label``, ``update``, a border title or a
notification as *content markup*: ``[@click=app.quit]`` in a job's name would become a link
that runs an action of the viewer's app, ``[/bold]`` a crash, ``[red on red]`` hidden text.
And its ``Log`` strips only some control characters, so a job's log line could reach the
viewer's terminal as an escape sequence.  So every widget of ``tui/`` gets its text from here:

* :func:`literal` and :func:`literal_parts` make a :class:`rich.text.Text` (never parsed as
  markup) whose control characters are shown as escapes (:func:`~pollux_local.untrusted.
  printable`), for ``Static``/``Label``/``update`` and the screens' questions;
* :func:`plain` and :func:`plain_lines` make strings of one line each, control characters
  and newlines escaped, for what draws strings itself (the ``Log`` widgets, the jobs table's
  cells, the device grid's labels, plot titles).

``tests/tui/test_literal.py`` checks that no module of ``tui/`` hands a widget a string built
from data any other way.  No textual import here.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TypeAlias

from rich.text import Text

from pollux_local.untrusted import printable

__all__ = ["Part", "literal", "literal_parts", "plain", "plain_lines"]

#: One piece of :func:`literal_parts`: text, or (text, style).
Part: TypeAlias = str | tuple[str, str]


def literal(text: str, style: str = "") -> Text:
    """``text`` as it is, in ``style``: never markup, control characters escaped (newlines
    kept)."""
    return Text(printable(text), style=style, end="")


def literal_parts(*parts: Part) -> Text:
    """Several pieces, each literal (:func:`literal`), each in its own style."""
    out = Text(end="")
    for part in parts:
        text, style = (part, "") if isinstance(part, str) else part
        out.append_text(literal(text, style))
    return out


def plain(text: str) -> str:
    """``text`` on one line for a widget that draws strings itself: every control character,
    the newline included, shown as an escape."""
    return printable(text, newline=False)


def plain_lines(lines: Iterable[str]) -> list[str]:
    """:func:`plain` of each line (a job's log lines, for a ``Log`` widget)."""
    return [plain(line) for line in lines]
