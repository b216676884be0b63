"""Job reports as the daemon takes them in: checked against :class:`api.JobReport`, kept as
plain data.

A report arrives two ways, a ``report`` request (already decoded as a ``JobReport``) and the
``report.json`` file rank 0 writes in its job directory.  Both end up in the job's row as
:func:`report_record` makes it.  A report that does not follow the schema is refused as a
whole with a one-line reason (:class:`InvalidReport`); the job's previous report stays.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import msgspec

from pollux_local.api.report import JobReport

_decoder = msgspec.json.Decoder(JobReport)


class InvalidReport(ValueError):
    """A report that is not JSON or does not follow the schema (the message is one line)."""


def report_record(report: JobReport) -> dict[str, Any]:
    """A report as the store keeps it and the scheduler reads it: JSON-like data without the
    fields that are unset (``None``), so that ``report.get(key, default)`` falls back as for a
    key the job never sent.  Values inside ``metrics`` are kept as they are."""

    def plain(value: Any) -> Any:
        if isinstance(value, msgspec.Struct):
            return {
                name: plain(item)
                for name in value.__struct_fields__
                if (item := getattr(value, name)) is not None
            }
        if isinstance(value, list):
            return [plain(item) for item in value]
        return value

    record: dict[str, Any] = plain(report)
    return record


def parse_report(data: bytes) -> JobReport:
    """A report's JSON text as a :class:`JobReport` (:class:`InvalidReport` otherwise)."""
    try:
        return _decoder.decode(data)
    except (msgspec.ValidationError, msgspec.DecodeError) as exc:
        raise InvalidReport(" ".join(str(exc).split())) from None


def read_report_file(path: Path) -> dict[str, Any] | None:
    """The report in ``path`` as :func:`report_record` makes it; ``None`` when the file cannot
    be read (absent, say).  Raises :class:`InvalidReport` when it does not follow the schema."""
    try:
        data = path.read_bytes()
    except OSError:
        return None
    return report_record(parse_report(data))
