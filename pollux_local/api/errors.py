"""The errors every side of pollux-local raises and catches, by category, never by message text.

::

    PolluxError                      one line for the user; CLI exit code 2
    ├── DaemonUnavailable            no daemon at the socket, or it did not answer in time
    ├── ProtocolError                a frame that is not a length-prefixed UTF-8 JSON object
    │   └── InvalidRequest           a request of an unknown type or with a bad field
    ├── PermissionDenied             the caller may not do this (not the job's owner or an admin)
    ├── NotFound                     no such job (or node)
    ├── Conflict                     the job is in a state that does not allow it
    ├── LimitExceeded                a cap was reached (connections, bytes in flight, ...)
    │   └── Busy                     the connection was refused unread: trying again is safe
    └── InternalError                the daemon failed on a request (a bug: see its log)
        └── StateDiskFull            the daemon's state disk is full: nothing could be stored

The daemon replies ``{"v": 1, "ok": false, "code": CODE, "error": "one line"}``; the client
raises the class whose ``code`` matches (:func:`error_for_code`).
"""

from __future__ import annotations


class PolluxError(Exception):
    """A problem reported to the user as one line (CLI exit code 2)."""

    exit_code = 2
    code = "error"

    def __init__(self, message: str = "") -> None:
        super().__init__(" ".join(str(message).split()))


class DaemonUnavailable(PolluxError):
    """No daemon answers on the socket (not running, wrong state dir, or too slow)."""

    code = "unavailable"


class ProtocolError(PolluxError):
    """A frame or message that does not follow the wire protocol."""

    code = "protocol"


class InvalidRequest(ProtocolError):
    """A request of an unknown type, a missing or unknown field, or a value out of range."""

    code = "invalid_request"


class PermissionDenied(PolluxError):
    """The caller's Unix identity may not do what it asked."""

    code = "permission_denied"


class NotFound(PolluxError):
    """The request names a job (or node) that does not exist."""

    code = "not_found"


class Conflict(PolluxError):
    """The job's current state does not allow the request (e.g. release a job not held)."""

    code = "conflict"


class LimitExceeded(PolluxError):
    """A per-user or daemon-wide cap was reached; trying again later may succeed."""

    code = "limit_exceeded"


class Busy(LimitExceeded):
    """The daemon refused the connection before reading its request (too many connections):
    nothing of it was done, so the client tries again after a pause."""

    code = "busy"


class InternalError(PolluxError):
    """The daemon failed while answering; the request may or may not have taken effect."""

    code = "internal"


class StateDiskFull(InternalError):
    """The filesystem of the daemon's state is full: the request could not be stored (nothing
    of it was); reads still work, and the daemon records what it could not once there is
    room again."""

    code = "state_disk_full"


_BY_CODE: dict[str, type[PolluxError]] = {
    cls.code: cls
    for cls in (
        PolluxError,
        DaemonUnavailable,
        ProtocolError,
        InvalidRequest,
        PermissionDenied,
        NotFound,
        Conflict,
        LimitExceeded,
        Busy,
        InternalError,
        StateDiskFull,
    )
}


def error_for_code(code: str | None) -> type[PolluxError]:
    """The exception class for an error reply's ``code`` (``PolluxError`` when unknown)."""
    return _BY_CODE.get(code or "", PolluxError)
