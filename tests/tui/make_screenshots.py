"""Write an SVG screenshot of every TUI screen (the demo's sample data) to docs/screenshots/.

The demo (``pollux_local.tui.demo``) shows what one recording cannot: three nodes, one down,
a device used outside the scheduler, a dozen jobs.  Its replies are decoded through the api
reply types like a real daemon's.

Run: ``python tests/tui/make_screenshots.py`` from the repository root.
"""

from __future__ import annotations

import asyncio
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from pollux_local.tui.app import PolluxApp  # noqa: E402
from pollux_local.tui.demo import DEMO_NOW, demo_recording  # noqa: E402
from pollux_local.tui.source import FixedSource  # noqa: E402

OUT = REPO / "docs" / "screenshots"

#: file name -> keys pressed from the main screen before the shot
SHOTS: dict[str, list[str]] = {
    "main.svg": [],
    "filtered.svg": ["slash", *"state:running", "enter", "s", "s", "s", "s", "s", "s", "S"],
    "job-detail.svg": ["down", "enter"],
    "logs.svg": ["l"],
    "submit.svg": ["n", *"train.py"],
    "confirm-cancel.svg": ["c"],
    "help.svg": ["question_mark"],
    "daemon-down.svg": [],
}


async def shoot(name: str, keys: list[str]) -> None:
    source = FixedSource(demo_recording(n_jobs=14, n_nodes=3, devices_per_node=4))
    source.down = name == "daemon-down.svg"
    app = PolluxApp(source, sync=True, refresh_s=3600, clock=lambda: DEMO_NOW)
    async with app.run_test(size=(120, 40)) as pilot:
        await pilot.pause()
        if keys:
            await pilot.press(*keys)
        await pilot.pause()
        app.save_screenshot(filename=name, path=str(OUT))


def main() -> int:
    OUT.mkdir(parents=True, exist_ok=True)
    for name, keys in SHOTS.items():
        asyncio.run(shoot(name, keys))
        print(OUT / name)
    return 0


if __name__ == "__main__":
    sys.exit(main())
