"""Reading the project's TOML files (daemon config, job specs) with one-line errors."""

from __future__ import annotations

import tomllib
from pathlib import Path
from typing import Any

from pollux_local.errors import PolluxError


def read_toml(path: str | Path, what: str) -> dict[str, Any]:
    """Parse the TOML file at ``path``; ``what`` names it in errors ("job spec", "config file").

    A missing, unreadable or malformed file raises :class:`PolluxError` with one line naming
    the file and the problem.
    """
    try:
        with open(path, "rb") as handle:
            return tomllib.load(handle)
    except FileNotFoundError:
        raise PolluxError(f"{what} {path} does not exist") from None
    except tomllib.TOMLDecodeError as exc:
        raise PolluxError(f"{what} {path} is not valid TOML: {exc}") from None
    except OSError as exc:
        raise PolluxError(f"cannot read {what} {path}: {exc.strerror}") from None
