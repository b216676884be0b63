"""The one-line status bar at the top of every screen (red while the daemon is down)."""

from __future__ import annotations

from textual.widgets import Static


class StatusLine(Static):
    """One line of status; the ``down`` class paints it in the error colour."""
