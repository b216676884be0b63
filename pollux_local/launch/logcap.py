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

from pollux_local.launch.identity import settle_ids

__all__ = [
    "COPIER_NAME",
    "capped_log",
    "copy_capped",
    "disk_note",
    "floor_of",
    "free_bytes",
    "live_copiers",
    "resumed_note",
    "truncation_note",
]

#: The copier's process name (``/proc/PID/comm``).
COPIER_NAME = "pollux-logcap"
#: Bytes read from the pipe at a time.
CHUNK = 65536
_PR_SET_NAME = 15


def _size_text(size: int) -> str:
    if size >= 1 << 20:
        return f"{size / (1 << 20):g} MB"
    if size >= 1 << 10:
        return f"{size / (1 << 10):g} KB"
    return f"{size} bytes"


def truncation_note(limit: int) -> bytes:
    """The line that ends a log cut at ``limit`` bytes."""
    return (
        f"\n[pollux-local: log truncated at {_size_text(limit)}; further output discarded]\n"
    ).encode()


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


def disk_note(keep_free: int) -> bytes:
    """The line a log gets where its output starts being discarded to keep its disk's last
    ``keep_free`` bytes free."""
    return (
        f"\n[pollux-local: the log's disk has under {_size_text(keep_free)} free; output"
        " discarded until it has room]\n"
    ).encode()


def resumed_note(dropped: int) -> bytes:
    """The line a log gets where output is written again after ``dropped`` bytes were
    discarded for lack of room."""
    return f"[pollux-local: {dropped} bytes of output were discarded; logging again]\n".encode()


def floor_of(fd: int, keep_free: int) -> int:
    """The free bytes below which a log on ``fd``'s filesystem is not written: ``keep_free``,
    but at most a tenth of the filesystem (so that a small disk still takes logs)."""
    try:
        info = os.fstatvfs(fd)
    except OSError:
        return 0
    return min(keep_free, info.f_blocks * info.f_frsize // 10)


def free_bytes(fd: int) -> int | None:
    """Bytes an unprivileged writer may still use on ``fd``'s filesystem (``None``: unknown)."""
    try:
        info = os.fstatvfs(fd)
    except OSError:
        return None
    return info.f_bavail * info.f_frsize


def copy_capped(source: int, log_fd: int, limit: int, keep_free: int = 0) -> None:
    """Copy ``source`` to ``log_fd`` until the log holds ``limit`` bytes (what it held already
    counts), then the truncation note once; read the rest to its end and discard it.  While
    the log's disk has under ``keep_free`` bytes free (:func:`floor_of`), output is
    discarded too, with a note, and written again once the disk has twice that free: a job's
    log never takes the room the state database needs."""
    try:
        written = os.fstat(log_fd).st_size
    except OSError:
        written = 0
    floor = floor_of(log_fd, keep_free) if keep_free else 0
    noted = False
    dropped: int | None = None  # bytes discarded for lack of room, while it lasts
    while True:
        try:
            data = os.read(source, CHUNK)
        except InterruptedError:
            continue
        if not data:
            return
        if noted:
            continue
        if floor:
            free = free_bytes(log_fd)
            if dropped is None and free is not None and free - len(data) < floor:
                _write_all(log_fd, disk_note(floor))
                dropped = 0
            elif dropped is not None and (free is None or free >= 2 * floor + len(data)):
                _write_all(log_fd, resumed_note(dropped))
                dropped = None
            if dropped is not None:
                dropped += len(data)
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


def capped_log(log_fd: int, limit: int, keep: tuple[int, ...] = (), keep_free: int = 0) -> int:
    """Fork the copier of ``log_fd`` (capped at ``limit`` bytes, and writing only while its
    disk keeps ``keep_free`` bytes free) and return the write end of its pipe, for the
    replica's stdout and stderr; ``log_fd`` is closed here (the copier keeps it).  ``keep``:
    descriptors the copier leaves open (none is needed)."""
    read_end, write_end = os.pipe()
    pid = os.fork()
    if pid == 0:  # the copier
        code = 0
        try:
            for signum in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGPIPE):
                signal.signal(signum, signal.SIG_IGN)
            _name_process(COPIER_NAME)
            os.close(write_end)
            for fd in range(3, max(read_end, log_fd, *keep, 1023) + 1):  # the report pipe too
                if fd not in (read_end, log_fd, *keep):
                    with contextlib.suppress(OSError):
                        os.close(fd)
            for fd in (0, 1, 2):
                with contextlib.suppress(OSError):
                    os.close(fd)
            # forked during a replica's setup: the user's alone, for good, once it holds
            # nothing of the setup's (a stop of the user's must not hold the supervisor)
            settle_ids()
            copy_capped(read_end, log_fd, limit, keep_free)
        except BaseException:  # noqa: BLE001 - the copier never returns into the job's code
            code = 1
        os._exit(code)
    os.close(read_end)
    os.close(log_fd)
    return write_end
