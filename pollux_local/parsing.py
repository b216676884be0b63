"""What users type, as request fields: array specs, job-id lists, constraints, time limits,
notification URLs and dates.  Pure functions; every problem is one :class:`PolluxError` line
naming the option and the text."""

from __future__ import annotations

import datetime
import re
from collections.abc import Iterable

from pollux_local import jobspec
from pollux_local.api.errors import PolluxError
from pollux_local.api.spec import Constraint
from pollux_local.durations import DurationError, parse_duration

#: The most tasks one array may have (``api.Submit.array``).
MAX_ARRAY_TASKS = 10_000
#: The largest index a task may have (``api.ArrayTask.index``).
MAX_ARRAY_INDEX = 1_000_000
#: Time limits the daemon accepts (``api.spec.Seconds``).
MIN_TIME_S, MAX_TIME_S = 1.0, 366 * 86400.0

_RANGE = re.compile(r"^(\d+)(?:-(\d+)(?::(\d+))?)?$")
_URL = re.compile(r"^[a-z][a-z0-9+.-]*://[^\s\x00]+$")
_RELATIVE = re.compile(r"^(?:\d+(?:\.\d+)?[smhd])+$")
_ARRAY_FORMS = "use 0-9, 0-9:2, 1,4,7 or 0-3,8 (and %N for at most N running)"


def parse_array(text: str, option: str = "--array") -> tuple[list[int], int | None]:
    """An array spec as its sorted task indices and, for a trailing ``%N``, the most tasks
    that may run at once: ``0-9`` (0 to 9), ``0-9:2`` (0, 2, ..., 8), ``1,4,7``, ``0-3,8``,
    ``0-15%4``."""
    spec, percent, cap_text = text.strip().partition("%")
    cap: int | None = None
    if percent:
        if not cap_text.isdigit() or int(cap_text) < 1:
            raise PolluxError(f"{option} {text!r}: %N needs a whole number N of at least 1")
        cap = int(cap_text)
    indices: list[int] = []
    for part in spec.split(","):
        match = _RANGE.match(part.strip())
        if match is None:
            raise PolluxError(f"{option} {text!r}: {part.strip()!r} is not an index or range;"
                              f" {_ARRAY_FORMS}")  # fmt: skip
        first, last, step = match.groups()
        start = int(first)
        end = int(last) if last is not None else start
        stride = int(step) if step is not None else 1
        if end < start:
            raise PolluxError(f"{option} {text!r}: the range {part} ends before it starts")
        if stride < 1:
            raise PolluxError(f"{option} {text!r}: the step of {part} must be at least 1")
        if end > MAX_ARRAY_INDEX:
            raise PolluxError(f"{option} {text!r}: indices go up to {MAX_ARRAY_INDEX}")
        if len(indices) + (end - start) // stride + 1 > MAX_ARRAY_TASKS:
            raise PolluxError(f"{option} {text!r}: more than {MAX_ARRAY_TASKS} tasks")
        indices.extend(range(start, end + 1, stride))
    seen: set[int] = set()
    for index in indices:
        if index in seen:
            raise PolluxError(f"{option} {text!r}: index {index} is given twice")
        seen.add(index)
    return sorted(indices), cap


def compress_indices(indices: Iterable[int]) -> str:
    """Indices as the shortest list of ranges: ``0-3,8`` (the inverse of :func:`parse_array`
    for steps of one)."""
    runs: list[list[int]] = []
    for index in sorted(set(indices)):
        if runs and index == runs[-1][1] + 1:
            runs[-1][1] = index
        else:
            runs.append([index, index])
    parts = [str(first) if first == last else f"{first}-{last}" for first, last in runs]
    return ",".join(parts)


def parse_job_ids(values: Iterable[str], option: str) -> list[str]:
    """Job ids given as ``ID[,ID...]`` (the option may be repeated), in order, once each."""
    ids: list[str] = []
    for value in values:
        for part in value.split(","):
            word = part.strip()
            if not word.isdigit() or len(word) > 15:
                raise PolluxError(f"{option}: {part.strip()!r} is not a job id")
            ids.append(str(int(word)))
    if not ids:
        raise PolluxError(f"{option} needs at least one job id")
    return list(dict.fromkeys(ids))


def parse_constraint(values: Iterable[str]) -> Constraint | None:
    """``--constraint`` (repeatable): ``nodes=box1,box2``, ``type=a100``, or both joined by
    ``;`` (:func:`pollux_local.jobspec.parse_constraint`)."""
    return jobspec.parse_constraint(values, "--constraint")


def parse_time_limit(text: str, option: str = "--time") -> float:
    """A time limit in seconds (``30s``, ``10m``, ``2h``, ``1-00:00``, ...), from one second
    to 366 days."""
    try:
        seconds = parse_duration(text)
    except DurationError as exc:
        raise PolluxError(f"{option}: {exc}") from None
    if seconds < MIN_TIME_S:
        raise PolluxError(f"{option} {text}: a time limit is at least 1s")
    if seconds > MAX_TIME_S:
        raise PolluxError(f"{option} {text}: a time limit is at most 366 days")
    return seconds


def check_notify_url(url: str) -> str:
    """A notification destination: an ``apprise``-style URL (``ntfy://topic``,
    ``mailto://you@lab.org``, ``json://host/path``)."""
    if not _URL.match(url) or len(url) > 2048:
        raise PolluxError(
            f"--notify {url!r}: not a URL (e.g. ntfy://topic, mailto://you@example.org,"
            " json://host/path)"
        )
    return url


def parse_since(text: str, now: float) -> float:
    """The start of a period as a Unix time: a date (``2026-11-01``, local midnight), an ISO
    date and time (``2026-11-01T08:30``, local unless it names its zone), or a time ago
    (``7d``, ``30d``, ``12h``, ``1d12h``)."""
    raw = text.strip()
    if _RELATIVE.match(raw.lower()):
        return max(0.0, now - parse_duration(raw))
    try:
        stamp = datetime.datetime.fromisoformat(raw)
    except ValueError:
        raise PolluxError(
            f"--since {text!r}: not a date (use 2026-11-01, 2026-11-01T08:30 or a time ago"
            " such as 7d or 12h)"
        ) from None
    seconds = stamp.timestamp()  # a naive stamp is local time
    if seconds > now:
        raise PolluxError(f"--since {text!r} is in the future")
    return max(0.0, seconds)


_CLOCK = re.compile(r"^(\d{1,2})(?::(\d{2})(?::(\d{2}))?)?(am|pm)?$")
_NAMED_TIMES = {"midnight": (0, 0), "noon": (12, 0), "teatime": (16, 0)}
#: The furthest ahead a start may be put off.
MAX_BEGIN_S = 366 * 86400.0


def parse_begin(text: str, now: float, option: str = "--begin") -> float:
    """The earliest start a user asks for, as a Unix time, in Slurm's ``--begin`` forms:
    ``14:00`` (today, or tomorrow once it has passed), ``+2h`` / ``now+2h`` (a duration from
    now; a bare number is seconds), ``tomorrow`` / ``today`` / ``midnight`` / ``noon`` /
    ``teatime`` (16:00), a date ``2026-12-01`` (local midnight) or a date and time
    ``2026-12-01T08:30``.  At most 366 days ahead; a past time means now."""
    raw = text.strip().lower()
    local_now = datetime.datetime.fromtimestamp(now)
    if raw in ("now", ""):
        return now
    if raw.startswith("now+") or raw.startswith("+"):
        amount = raw.split("+", 1)[1]
        try:
            seconds = float(amount) if amount.isdigit() else parse_duration(amount)
        except DurationError as exc:
            raise PolluxError(f"{option} {text!r}: {exc}") from None
        stamp = now + seconds
    elif raw in ("today", "tomorrow"):
        midnight = local_now.replace(hour=0, minute=0, second=0, microsecond=0)
        days = 1 if raw == "tomorrow" else 0
        stamp = max(now, (midnight + datetime.timedelta(days=days)).timestamp())
    elif raw in _NAMED_TIMES or (_CLOCK.match(raw) and (":" in raw or raw[-1] == "m")):
        if raw in _NAMED_TIMES:
            hour, minute, second = *_NAMED_TIMES[raw], 0
        else:
            match = _CLOCK.match(raw)
            assert match is not None
            hour, minute = int(match.group(1)), int(match.group(2) or 0)
            second = int(match.group(3) or 0)
            if match.group(4):
                if not 1 <= hour <= 12:
                    raise PolluxError(f"{option} {text!r}: not a time of day")
                hour = hour % 12 + (12 if match.group(4) == "pm" else 0)
        if hour > 23 or minute > 59 or second > 59:
            raise PolluxError(f"{option} {text!r}: not a time of day")
        when = local_now.replace(hour=hour, minute=minute, second=second, microsecond=0)
        if when.timestamp() <= now:
            when += datetime.timedelta(days=1)
        stamp = when.timestamp()
    else:
        try:
            stamp = datetime.datetime.fromisoformat(text.strip()).timestamp()
        except ValueError:
            raise PolluxError(
                f"{option} {text!r}: not a time (use 14:00, +2h, now+30m, tomorrow, midnight,"
                " 2026-12-01 or 2026-12-01T08:30)"
            ) from None
        stamp = max(now, stamp)
    if stamp - now > MAX_BEGIN_S:
        raise PolluxError(f"{option} {text!r}: at most 366 days ahead")
    return stamp


def parse_delay(text: str, now: float, option: str = "--delay") -> float:
    """``--delay 2h``: the earliest start as a Unix time, a duration from ``now``."""
    try:
        seconds = parse_duration(text)
    except DurationError as exc:
        raise PolluxError(f"{option}: {exc}") from None
    if seconds > MAX_BEGIN_S:
        raise PolluxError(f"{option} {text!r}: at most 366 days")
    return now + seconds


def earliest_start(
    begin: str | None, delay: str | None, now: float, command: str = ""
) -> float | None:
    """The earliest start a command line asks for (``--begin`` or ``--delay``, not both), as a
    Unix time; ``None`` when it asks for neither.  ``command`` prefixes the refusal."""
    if begin is not None and delay is not None:
        prefix = f"{command}: " if command else ""
        raise PolluxError(f"{prefix}--begin and --delay both say when to start: give one")
    if begin is not None:
        return parse_begin(begin, now)
    if delay is not None:
        return parse_delay(delay, now)
    return None
