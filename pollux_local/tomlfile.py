"""Reading the project's TOML files (daemon config, job specs) with one-line errors, and the
one check of their keys (an unknown key names the closest known one)."""

from __future__ import annotations

import difflib
import tomllib
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any, BinaryIO

from pollux_local.errors import PolluxError


def read_toml(path: str | Path, what: str) -> dict[str, Any]:
    """Parse the TOML file at ``path``; ``what`` names it in errors ("job spec", "config file").

    A missing, unreadable or malformed file raises :class:`PolluxError` with one line naming
    the file and the problem.
    """
    try:
        handle = open(path, "rb")  # noqa: SIM115 - closed below, after the parse
    except FileNotFoundError:
        raise PolluxError(f"{what} {path} does not exist") from None
    except OSError as exc:
        raise PolluxError(f"cannot read {what} {path}: {exc.strerror}") from None
    with handle:
        return parse_toml(handle, path, what)


def parse_toml(handle: BinaryIO, path: str | Path, what: str) -> dict[str, Any]:
    """Parse the open TOML file ``handle`` (``path``, ``what``: its name in errors), errors
    as :func:`read_toml` words them."""
    try:
        return tomllib.load(handle)
    except tomllib.TOMLDecodeError as exc:
        raise PolluxError(f"{what} {path} is not valid TOML: {exc}") from None
    except OSError as exc:
        raise PolluxError(f"cannot read {what} {path}: {exc.strerror}") from None


def check_keys(table: Mapping[str, Any], known: Iterable[str], section: str, where: str) -> None:
    """Refuse a key the table does not know, naming the closest known one (a typo is far more
    likely than a key from a newer version, and silently ignoring it hides the mistake):
    ``WHERE: unknown key 'scirpt' in [job] (did you mean 'script'?)``.  With ``section``
    empty, ``table`` is the file's top level, whose keys are tables (``unknown table [x]``)."""
    names = sorted(known)
    for key in sorted(set(table) - set(names)):
        close = difflib.get_close_matches(key, names, n=1)
        if not section:
            hint = f" (did you mean [{close[0]}]?)" if close else f" (known: {', '.join(names)})"
            raise PolluxError(f"{where}: unknown table [{key}]{hint}")
        hint = f" (did you mean {close[0]!r}?)" if close else f" (known: {', '.join(names)})"
        raise PolluxError(f"{where}: unknown key {key!r} in [{section}]{hint}")
