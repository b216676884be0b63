"""``pynvml`` for a daemon under test: the box of ``tests/fake_nvml.py`` described by the JSON
file named in ``$POLLUX_FAKE_NVML`` (read again at every ``nvmlInit``).

Put this directory first on the daemon's ``PYTHONPATH`` (and the repository after it)."""

from __future__ import annotations

import os
import sys
from pathlib import Path

from tests.fake_nvml import BOX_VARIABLE, FakeBox, fake_module


def _load() -> FakeBox:
    return FakeBox.from_json(Path(os.environ[BOX_VARIABLE]).read_text())


sys.modules[__name__] = fake_module(load=_load)
