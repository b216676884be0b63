"""A replica's log with a size limit: its output goes through a pipe to a small copier that
writes it to the log until the log holds ``limit`` bytes, then appends one line::

    [pollux-local: log truncated at 100 MB; further output discarded]

and reads on, discarding, so that the job never blocks nor fails on a write.  A write the disk
refuses (full, over quota) is dropped the same way.  The copier is forked by the replica's child
after it became the job's user and opened the log, so it has only that user's rights; it
ignores SIGTERM (the job's stop) and ends when the last writer of the pipe is gone.  Its
process name is :data:`COPIER_NAME` (the supervisor lets it finish copying before it kills
what is left of the job).

The standard library only: the supervisor imports it.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import os
import signal

__all__ = ["COPIER_NAME", "capped_log", "copy_capped", "live_copiers", "truncation_note"]

#: The copier's process name (``/proc/PID/comm``).
COPIER_NAME = "pollux-logcap"
#: Bytes read from the pipe at a time.
CHUNK = 65536
_PR_SET_NAME = 15


def truncation_note(limit: int) -> bytes:
    """The line that ends a log cut at ``limit`` bytes."""
    if limit >= 1 << 20:
        size = f"{limit / (1 << 20):g} MB"
    elif limit >= 1 << 10:
        size = f"{limit / (1 << 10):g} KB"
    else:
        size = f"{limit} bytes"
    return f"\n[pollux-local: log truncated at {size}; further output discarded]\n".encode()


def _write_all(fd: int, data: bytes) -> bool:
    """Write ``data``; ``False`` when the disk refused it (the rest is dropped)."""
    view = memoryview(data)
    while view:
        try:
            view = view[os.write(fd, view) :]
        except InterruptedError:
            continue
        except OSError as exc:
            if exc.errno in (errno.ENOSPC, errno.EDQUOT, errno.EFBIG, errno.EIO):
                return False
            raise
    return True


def copy_capped(source: int, log_fd: int, limit: int) -> None:
    """Copy ``source`` to ``log_fd`` until the log holds ``limit`` bytes (what it held already
    counts), then the truncation note once; read the rest to its end and discard it."""
    try:
        written = os.fstat(log_fd).st_size
    except OSError:
        written = 0
    noted = False
    while True:
        try:
            data = os.read(source, CHUNK)
        except InterruptedError:
            continue
        if not data:
            return
        if noted:
            continue
        room = limit - written
        if len(data) <= room:
            if _write_all(log_fd, data):
                written += len(data)
            continue
        if room > 0:
            _write_all(log_fd, data[:room])
        _write_all(log_fd, truncation_note(limit))
        noted = True


def live_copiers(pids: list[int]) -> list[int]:
    """Those of ``pids`` that are copiers still running (not zombies)."""
    found = []
    for pid in pids:
        try:
            with open(f"/proc/{pid}/stat", "rb") as fh:
                head, _, rest = fh.read().rpartition(b")")
        except OSError:
            continue
        name = head.partition(b"(")[2].decode(errors="replace")
        if name == COPIER_NAME and rest.split()[:1] != [b"Z"]:
            found.append(pid)
    return found


def _name_process(name: str) -> None:
    with contextlib.suppress(Exception):
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(_PR_SET_NAME, name.encode()[:15], 0, 0, 0)


def capped_log(log_fd: int, limit: int, keep: tuple[int, ...] = ()) -> int:
    """Fork the copier of ``log_fd`` (capped at ``limit`` bytes) and return the write end of
    its pipe, for the replica's stdout and stderr; ``log_fd`` is closed here (the copier
    keeps it).  ``keep``: descriptors the copier leaves open (none is needed)."""
    read_end, write_end = os.pipe()
    pid = os.fork()
    if pid == 0:  # the copier
        code = 0
        try:
            for signum in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGPIPE):
                signal.signal(signum, signal.SIG_IGN)
            _name_process(COPIER_NAME)
            os.close(write_end)
            for fd in range(3, 1024):
                if fd not in (read_end, log_fd, *keep):
                    with contextlib.suppress(OSError):
                        os.close(fd)
            for fd in (0, 1, 2):
                with contextlib.suppress(OSError):
                    os.close(fd)
            copy_capped(read_end, log_fd, limit)
        except BaseException:  # noqa: BLE001 - the copier never returns into the job's code
            code = 1
        os._exit(code)
    os.close(read_end)
    os.close(log_fd)
    return write_end
