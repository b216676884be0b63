"""The TUI's submit form offers a job's retries and earliest start: the request it sends
carries them as ``submit --retries N --begin WHEN`` would, and a time it cannot read is one
line naming the field, with nothing sent.  The form still fits a 120x40 terminal."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pytest
from textual.widgets import Input

from pollux_local import api
from pollux_local.tui.screens.submit import SubmitScreen
from pollux_local.tui.source import FixedSource

pytestmark = [pytest.mark.asyncio, pytest.mark.timeout(60)]

SIZE = (120, 40)


async def test_the_form_sends_retries_and_the_earliest_start(
    source: FixedSource, make_app: Any, tmp_path: Path
) -> None:
    (tmp_path / "train.py").write_text("print('plain script')\n")
    app = make_app(source, sync=True, workdir=str(tmp_path))
    async with app.run_test(size=SIZE) as pilot:
        await pilot.pause()
        await pilot.press("n")
        form = app.screen
        assert isinstance(form, SubmitScreen)
        form.query_one("#f-script", Input).value = "train.py"
        form.query_one("#f-retries", Input).value = "2"
        form.query_one("#f-begin", Input).value = "25:99"
        await pilot.pause(0.3)
        await pilot.click("#submit")
        assert isinstance(app.screen, SubmitScreen)
        error = str(form.query_one("#error").render())
        assert "Start at '25:99'" in error, error
        assert not [call for call in source.calls if isinstance(call, api.Submit)]
        form.query_one("#f-begin", Input).value = "+2h"
        before = time.time()
        await pilot.pause(0.3)
        await pilot.click("#submit")
        await pilot.pause()
        assert not isinstance(app.screen, SubmitScreen)
        [sent] = [call for call in source.calls if isinstance(call, api.Submit)]
        assert sent.retries == 2 and not sent.elastic
        assert sent.begin_at is not None and before + 7200 <= sent.begin_at <= time.time() + 7200
