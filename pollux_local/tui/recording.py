"""Recorded daemon replies: what :class:`~pollux_local.tui.source.FixedSource` serves.

A recording is a JSON file (``tests/tui/fixtures/daemon_replies.json``, made by
``tests/tui/record_replies.py`` from a real daemon)::

    {"version": 1, "recorded_at": 1732320000.0, "daemon": "...", "jobs": {role: id},
     "replies": {"status": REPLY, "nodes": REPLY, "usage": REPLY,
                 "show": {job id: REPLY}, "logs": {job id: REPLY}}}

where each ``REPLY`` is a reply frame's JSON object exactly as the daemon sent it
(``{"v": 1, "ok": true, ...}``); ``usage`` may be missing (a recording made before the daemon
had it).  :func:`load_recording` decodes every one of them with
:func:`pollux_local.api.wire.decode_reply` into its api reply type, as the client does: a
recording with a field the daemon does not send, or without one it does, is refused
(:class:`~pollux_local.api.ProtocolError`).  No textual import.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import msgspec

from pollux_local.api import wire
from pollux_local.api.errors import ProtocolError
from pollux_local.api.messages import (
    JobSummary,
    LogsReply,
    NodesReply,
    Reply,
    ShowReply,
    StatusReply,
    UsageReply,
)

RECORDING_VERSION = 1

R = TypeVar("R", bound=Reply)


@dataclass
class Recording:
    """Typed replies: one ``status``, ``nodes`` and (when recorded) ``usage``, and
    ``show``/``logs`` per job id.

    ``recorded_at`` is when the replies were taken (the ``now`` their times are relative to);
    ``roles`` names some jobs by what they show (``"running-a"`` -> id).
    """

    recorded_at: float
    status: StatusReply
    nodes: NodesReply
    shows: dict[str, ShowReply] = field(default_factory=dict)
    logs: dict[str, LogsReply] = field(default_factory=dict)
    roles: dict[str, str] = field(default_factory=dict)
    usage: UsageReply | None = None

    def copy(self) -> Recording:
        """A deep copy (the structs are mutable)."""
        return Recording(
            recorded_at=self.recorded_at,
            status=_copy(self.status),
            nodes=_copy(self.nodes),
            shows={k: _copy(v) for k, v in self.shows.items()},
            logs={k: _copy(v) for k, v in self.logs.items()},
            roles=dict(self.roles),
            usage=_copy(self.usage) if self.usage is not None else None,
        )

    def shifted(self, now: float) -> Recording:
        """A copy whose every time is moved by ``now - recorded_at`` (so it was taken ``now``).

        Durations (``run_time_s``, ``eta_s``) stay as they are.
        """
        delta = now - self.recorded_at
        out = self.copy()
        out.recorded_at = now
        if out.usage is not None and out.usage.since is not None:
            out.usage.since += delta
        for job in out.status.jobs:
            _shift_job(job, delta)
        for shown in out.shows.values():
            _shift_job(shown.job, delta)
            for decision in shown.decisions:
                decision.time += delta
            for sample in shown.job.history:
                sample.time += delta
            for pid in shown.job.pids:
                if pid.create_time is not None:
                    pid.create_time += delta
            report = shown.job.report
            if report is not None and report.time is not None:
                report.time += delta
        return out


def _copy(reply: R) -> R:
    return msgspec.json.decode(msgspec.json.encode(reply), type=type(reply))


def _shift_job(job: JobSummary, delta: float) -> None:
    """Every time of ``job`` (submitted, started, ended, expected to start and to finish)
    moved by ``delta``."""
    job.submit_time += delta
    for name in ("start_time", "end_time", "expected_start", "expected_finish"):
        value = getattr(job, name)
        if value is not None:
            setattr(job, name, value + delta)


def decode(raw: Any, reply_type: type[R], where: str) -> R:
    """One recorded reply frame's object as ``reply_type``, strictly (as the client decodes)."""
    if not isinstance(raw, dict):
        raise ProtocolError(f"{where}: a reply is a JSON object, got {type(raw).__name__}")
    try:
        return wire.decode_reply(json.dumps(raw).encode(), reply_type)
    except ProtocolError as exc:
        raise ProtocolError(f"{where}: {exc}") from None


def recording_from_data(data: Any, where: str = "recording") -> Recording:
    """A recording's JSON data (see the module's docstring) as typed replies."""
    if not isinstance(data, dict) or data.get("version") != RECORDING_VERSION:
        version = data.get("version") if isinstance(data, dict) else None
        raise ProtocolError(f"{where}: not a version-{RECORDING_VERSION} recording ({version!r})")
    replies = data.get("replies")
    if not isinstance(replies, dict):
        raise ProtocolError(f"{where}: no replies")
    shows = replies.get("show") or {}
    logs = replies.get("logs") or {}
    usage = replies.get("usage")
    recorded_at = data.get("recorded_at")
    if not isinstance(recorded_at, int | float):
        raise ProtocolError(f"{where}: recorded_at must be a time")
    return Recording(
        recorded_at=float(recorded_at),
        status=decode(replies.get("status"), StatusReply, f"{where}: status"),
        nodes=decode(replies.get("nodes"), NodesReply, f"{where}: nodes"),
        shows={str(k): decode(v, ShowReply, f"{where}: show {k}") for k, v in shows.items()},
        logs={str(k): decode(v, LogsReply, f"{where}: logs {k}") for k, v in logs.items()},
        roles={str(k): str(v) for k, v in (data.get("jobs") or {}).items()},
        usage=decode(usage, UsageReply, f"{where}: usage") if usage is not None else None,
    )


def load_recording(path: str | Path) -> Recording:
    """Read and strictly decode a recording file."""
    path = Path(path)
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise ProtocolError(f"cannot read the recording {path}: {exc}") from None
    return recording_from_data(data, str(path))
