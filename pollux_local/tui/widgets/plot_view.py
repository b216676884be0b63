"""A widget that draws one :class:`~pollux_local.tui.plots.PlotSpec` at its own size."""

from __future__ import annotations

from rich.text import Text
from textual.widget import Widget

from pollux_local.tui.plots import PlotSpec, render


class PlotView(Widget):
    """Shows one :class:`PlotSpec`, redrawn to the widget's size."""

    def __init__(self, spec: PlotSpec | None = None, *, id: str | None = None) -> None:
        super().__init__(id=id)
        self.spec = spec or PlotSpec("", note="loading…")
        self._cache: tuple[int, tuple[int, int], Text] | None = None

    def show(self, spec: PlotSpec) -> None:
        self.spec = spec
        self._cache = None
        self.refresh()

    def render(self) -> Text:
        size = (self.size.width, self.size.height)
        if self._cache is not None and self._cache[0] == id(self.spec) and self._cache[1] == size:
            return self._cache[2]
        text = Text.from_ansi(render(self.spec, *size))
        text.no_wrap = True
        self._cache = (id(self.spec), size, text)
        return text
