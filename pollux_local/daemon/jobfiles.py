"""Reading the files a job leaves in its directory without trusting them.

A job's directory (``STATE_DIR/jobs/<id>``) belongs to the job's user: anything in it (a log,
``report.json``) may have been swapped for a symlink to ``/etc/shadow``, a FIFO that never
delivers, a hard link, a device or a 10 GB file by the time the daemon (possibly root) reads
it.  So every read goes through :func:`open_job_file`:

* the directory is opened within ``jobs/`` with ``O_DIRECTORY | O_NOFOLLOW`` and must be a
  directory of the user the job runs as (:func:`runs_as`; ``jobs/`` itself is the daemon's,
  so the user cannot swap the directory);
* the file is opened relative to it with ``O_NOFOLLOW | O_NONBLOCK | O_NOCTTY`` (a symlink
  fails, a FIFO does not block);
* neither is ever a file system mounted there (:func:`open_within`: ``openat2`` with
  ``RESOLVE_NO_XDEV``): a user's FUSE mount could leave the daemon's request unanswered;
* ``fstat`` of the open descriptor must show a regular file with one link, owned by the user
  the job runs as, and by no one else (under a root daemon not root: a root-only file moved
  into the directory is not the job's), else :class:`UnsafeJobFile`;
* reads are capped (``max_bytes``).

The daemon never creates, chmods or chowns anything inside such a directory: it only makes
the directory itself, in a directory of its own, and gives it to the job's user
(:func:`make_owned_dir`); whatever is inside is made by the job's processes, as its user.
The directory of a job whose record is gone goes the same way: what is inside is removed as
the directory's owner, never as root (:func:`remove_job_dir`).
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import errno
import os
import stat
from collections.abc import Iterator
from pathlib import Path

from pollux_local.launch.identity import as_user_argv

#: Largest report.json the daemon reads (a real one is a few kB).
MAX_REPORT_BYTES = 1 << 20
#: The longest the removal of one job directory may take (past it, it is left as it is).
REMOVE_TIMEOUT_S = 300.0


class UnsafeJobFile(OSError):
    """A file (or directory) in a job's directory that is not what the daemon expects (a
    symlink, a FIFO, a hard link, owned by another user); the message is one line."""


def _trusted_owner(st_uid: int, owner_uid: int) -> bool:
    """Whether a job directory found in place may be taken (:func:`make_owned_dir`): the
    user's, or the daemon's own (made by it, not yet given away)."""
    return st_uid in (owner_uid, os.geteuid())


def runs_as(owner_uid: int) -> int:
    """The uid a job's processes run as, so the only owner of what they write: its owner's
    under a root daemon, the daemon's own otherwise (a personal daemon runs every job as
    itself).  A file of any other owner in a job's directory, the daemon's own under root
    included, was put there, not written by the job."""
    return owner_uid if os.geteuid() == 0 else os.geteuid()


#: openat2(2) (Linux 5.6; the same number on x86-64 and arm64) and its RESOLVE_ flags
_SYS_OPENAT2 = 437
_RESOLVE_NO_XDEV = 0x01
_RESOLVE_NO_SYMLINKS = 0x04


class _OpenHow(ctypes.Structure):
    _fields_ = [("flags", ctypes.c_uint64), ("mode", ctypes.c_uint64), ("resolve", ctypes.c_uint64)]


_libc: ctypes.CDLL | None = None
#: whether openat2 works here (``None``: not tried yet; :func:`_openat2_works`)
_have_openat2: bool | None = None


def _syscall_openat2(dir_fd: int, name: str, flags: int, resolve: int) -> tuple[int, int]:
    """openat2(dir_fd, name, {flags | O_CLOEXEC, 0, resolve}): ``(fd, 0)`` or ``(-1, errno)``."""
    global _libc
    if _libc is None:
        _libc = ctypes.CDLL(None, use_errno=True)
        _libc.syscall.restype = ctypes.c_long
    how = _OpenHow(flags | os.O_CLOEXEC, 0, resolve)
    fd = _libc.syscall(
        ctypes.c_long(_SYS_OPENAT2), ctypes.c_int(dir_fd), os.fsencode(name),
        ctypes.byref(how), ctypes.c_size_t(ctypes.sizeof(how)),
    )  # fmt: skip
    return (int(fd), 0) if fd >= 0 else (-1, ctypes.get_errno())


def _openat2_works() -> bool:
    """Whether openat2 runs here, tried once on ``/`` (a kernel before 5.6 or a seccomp
    filter refuses it: ENOSYS, EPERM); an error of a later call is then that call's own."""
    global _have_openat2
    if _have_openat2 is None:
        fd, _ = _syscall_openat2(-100, "/", os.O_PATH, 0)  # AT_FDCWD
        _have_openat2 = fd >= 0
        if fd >= 0:
            os.close(fd)
    return _have_openat2


def _openat2(dir_fd: int, name: str, flags: int, resolve: int) -> int:
    """openat2(dir_fd, name, {flags | O_CLOEXEC, 0, resolve}); ``OSError`` on failure,
    ``NotImplementedError`` where there is no openat2."""
    if not _openat2_works():
        raise NotImplementedError
    fd, err = _syscall_openat2(dir_fd, name, flags, resolve)
    if fd >= 0:
        return fd
    raise OSError(err, os.strerror(err), name)


def open_within(dir_fd: int, name: str, flags: int, shown: Path) -> int:
    """``openat(dir_fd, name, flags)`` that stays on ``dir_fd``'s mount and follows no
    symlink: openat2 with ``RESOLVE_NO_XDEV | RESOLVE_NO_SYMLINKS``.  A file system mounted on
    ``name`` (a user's FUSE mount over their own job's directory or file, possible where
    ``/etc/fuse.conf`` allows ``user_allow_other``) is :class:`UnsafeJobFile`, never entered:
    its server could leave the daemon's request unanswered, and the daemon with it.  A symlink
    is ``OSError(ELOOP)`` as with ``O_NOFOLLOW``; ``shown`` names the path in messages.
    Without openat2, a plain ``openat`` with ``O_NOFOLLOW``, refused when it landed on
    another device (a mount is then found, not avoided)."""
    try:
        return _openat2(dir_fd, name, flags, _RESOLVE_NO_XDEV | _RESOLVE_NO_SYMLINKS)
    except NotImplementedError:
        pass
    except OSError as exc:
        if exc.errno == errno.EXDEV:
            raise UnsafeJobFile(f"{shown} is a mount point") from None
        raise
    fd = os.open(name, flags | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=dir_fd)
    if os.fstat(fd).st_dev != os.fstat(dir_fd).st_dev:
        os.close(fd)
        raise UnsafeJobFile(f"{shown} is a mount point")
    return fd


def _open_directory(path: Path, name: str | None = None, dir_fd: int | None = None) -> int:
    """A descriptor of the directory ``path`` (or ``name`` relative to ``dir_fd``, then never
    on another mount: :func:`open_within`), its last component never followed: a symlink or
    a non-directory there is :class:`UnsafeJobFile`."""
    flags = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
    try:
        if name is None:
            return os.open(path, flags)
        assert dir_fd is not None
        return open_within(dir_fd, name, flags, path / name)
    except UnsafeJobFile:
        raise
    except OSError as exc:
        if exc.errno in (errno.ELOOP, errno.ENOTDIR):
            shown = path if name is None else path / name
            raise UnsafeJobFile(f"{shown} is not a directory (a symlink?)") from None
        raise


@contextlib.contextmanager
def open_job_dir(path: Path, owner_uid: int) -> Iterator[int]:
    """A descriptor of the job directory ``path`` (not followed if it is a symlink, never
    entered if a file system is mounted on it), opened within its parent, the daemon's
    ``jobs/``."""
    parent_fd = _open_directory(path.parent)
    try:
        fd = _open_directory(path.parent, path.name, dir_fd=parent_fd)
    finally:
        os.close(parent_fd)
    try:
        info = os.fstat(fd)
        if info.st_uid != runs_as(owner_uid):
            raise UnsafeJobFile(f"{path} belongs to uid {info.st_uid}, not to the job's user")
        yield fd
    finally:
        os.close(fd)


@contextlib.contextmanager
def open_job_file(directory: Path, name: str, owner_uid: int) -> Iterator[tuple[int, int]]:
    """``(fd, size)`` of the regular file ``directory/name`` opened read-only and safely (see
    the module's docstring).  ``FileNotFoundError`` when it is absent; :class:`UnsafeJobFile`
    when it is not a plain file of the job's user."""
    if "/" in name or name in ("", ".", ".."):
        raise UnsafeJobFile(f"bad file name {name!r}")
    with open_job_dir(directory, owner_uid) as dir_fd:
        flags = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_NOCTTY | os.O_CLOEXEC
        try:
            fd = open_within(dir_fd, name, flags, directory / name)
        except UnsafeJobFile:
            raise
        except OSError as exc:
            if exc.errno == errno.ELOOP:
                raise UnsafeJobFile(f"{directory / name} is a symlink") from None
            raise
        try:
            info = os.fstat(fd)
            if not stat.S_ISREG(info.st_mode):
                raise UnsafeJobFile(f"{directory / name} is not a regular file")
            if info.st_nlink != 1:
                raise UnsafeJobFile(f"{directory / name} has {info.st_nlink} links")
            if info.st_uid != runs_as(owner_uid):
                raise UnsafeJobFile(
                    f"{directory / name} belongs to uid {info.st_uid}, not to the job's user"
                )
            yield fd, info.st_size
        finally:
            os.close(fd)


def read_job_file(
    directory: Path, name: str, owner_uid: int, offset: int = 0, max_bytes: int = 1 << 16
) -> tuple[bytes, int, int]:
    """``(data, start, size)``: up to ``max_bytes`` of ``directory/name`` from ``offset``
    (negative: that many bytes before the end), opened with :func:`open_job_file`."""
    with open_job_file(directory, name, owner_uid) as (fd, size):
        start = max(0, size + offset) if offset < 0 else min(offset, size)
        data = os.pread(fd, max(0, min(max_bytes, size - start)), start)
        return data, start, size


def read_whole_job_file(
    directory: Path, name: str, owner_uid: int, max_bytes: int = MAX_REPORT_BYTES
) -> bytes:
    """All of a small file (a report); :class:`UnsafeJobFile` when it exceeds ``max_bytes``."""
    with open_job_file(directory, name, owner_uid) as (fd, size):
        if size > max_bytes:
            raise UnsafeJobFile(f"{directory / name} is {size} bytes (at most {max_bytes})")
        return os.pread(fd, size, 0)


def _stat_within(dir_fd: int, name: str, shown: Path) -> os.stat_result:
    """``lstat`` of ``name`` in ``dir_fd`` through :func:`open_within` (``O_PATH``: nothing
    is opened for reading, a FIFO does not block, no mount is entered)."""
    fd = open_within(dir_fd, name, os.O_PATH | os.O_NOFOLLOW, shown)
    try:
        return os.fstat(fd)
    finally:
        os.close(fd)


def _job_file_stat(directory: Path, name: str, owner_uid: int) -> os.stat_result:
    """``lstat`` of ``directory/name`` through :func:`open_job_dir` and :func:`_stat_within`."""
    with open_job_dir(directory, owner_uid) as dir_fd:
        return _stat_within(dir_fd, name, directory / name)


def job_file_mtime(directory: Path, name: str, owner_uid: int) -> float | None:
    """The modification time of a job file (``None`` when absent or unsafe): a cheap check
    before reading, never entering a mount or following a symlink."""
    try:
        info = _job_file_stat(directory, name, owner_uid)
    except OSError:
        return None
    if not stat.S_ISREG(info.st_mode):
        return None
    return info.st_mtime


def job_file_exists(directory: Path, name: str, owner_uid: int) -> bool:
    """Whether anything is at ``directory/name`` (a file, a link, a mount point, a directory
    of another user's), looked at as :func:`job_file_mtime` does."""
    try:
        _job_file_stat(directory, name, owner_uid)
    except FileNotFoundError:
        return False
    except OSError:
        return True
    return True


def job_dir_stat(parent: Path, name: str) -> os.stat_result:
    """``lstat`` of ``parent/name`` (a job's directory in ``jobs/``, a name under a checkpoint
    root) without entering a file system mounted there: ``FileNotFoundError`` when absent,
    :class:`UnsafeJobFile` for a mount point, ``OSError`` when it cannot be looked at.
    ``parent`` is followed as ``lstat`` followed it (the daemon's ``jobs/``, or a
    ``checkpoint_root`` an admin may give as a symlink: review s67)."""
    parent_fd = os.open(parent, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        return _stat_within(parent_fd, name, parent / name)
    finally:
        os.close(parent_fd)


def make_owned_dir(parent: Path, name: str, uid: int, gid: int) -> Path:
    """``parent/name`` as a directory of ``uid``:``gid`` that only they may enter (0700:
    ``jobs/<id>`` holds the job's logs and checkpoints, which other users read only through
    the daemon): made by the daemon in ``parent``, a directory of the daemon's own user (so no
    one else can put anything at ``name``), then given to the user through a descriptor
    opened with ``O_NOFOLLOW | O_DIRECTORY`` (``fchown``, ``fchmod``: never a path that could
    have been swapped).  A directory already there is taken if it is the user's or the
    daemon's (given to the user, closed to others); anything else is
    :class:`UnsafeJobFile`."""
    if "/" in name or name in ("", ".", ".."):
        raise UnsafeJobFile(f"bad directory name {name!r}")
    parent_fd = _open_directory(parent)
    try:
        info = os.fstat(parent_fd)
        if info.st_uid != os.geteuid() or info.st_mode & 0o022:
            raise UnsafeJobFile(f"{parent} is not a directory only the daemon's user may change")
        with contextlib.suppress(FileExistsError):
            os.mkdir(name, 0o700, dir_fd=parent_fd)
        fd = _open_directory(parent, name, dir_fd=parent_fd)
        try:
            info = os.fstat(fd)
            if not _trusted_owner(info.st_uid, uid):
                raise UnsafeJobFile(f"{parent / name} belongs to uid {info.st_uid}")
            if (info.st_uid, info.st_gid) != (uid, gid) and os.geteuid() == 0:
                os.fchown(fd, uid, gid)
            if info.st_mode & 0o077:  # one made before jobs' directories were private
                os.fchmod(fd, stat.S_IMODE(info.st_mode) & 0o700)
        finally:
            os.close(fd)
    finally:
        os.close(parent_fd)
    return parent / name


async def remove_job_dir(jobs_dir: Path, job_id: int) -> str | None:
    """Remove ``jobs_dir/<job_id>``, the directory of a job whose record is gone (its logs,
    report and checkpoints): what is inside by ``find DIR -mindepth 1 -delete`` run as the
    directory's owner (no link is followed, and a root daemon removes nothing its owner
    could not; in a process of its own, off the event loop, killed after
    :data:`REMOVE_TIMEOUT_S`), then the directory itself, which lies in the daemon's
    ``jobs/``.  ``None`` when it is gone, else why not (one line)."""
    path = jobs_dir / str(job_id)
    try:
        info = job_dir_stat(jobs_dir, str(job_id))
    except FileNotFoundError:
        return None
    except OSError as exc:
        return f"cannot look at {path}: {exc.strerror or exc}; left as it is"
    if not stat.S_ISDIR(info.st_mode):
        return f"{path} is not a directory; left as it is"
    me = os.geteuid()
    argv = ["find", str(path), "-mindepth", "1", "-delete"]
    if me == 0 and info.st_uid not in (0, me):  # as the owner, the daemon's keyring left
        argv = as_user_argv(info.st_uid, info.st_gid, [], argv)
    proc = await asyncio.create_subprocess_exec(
        *argv,
        stdin=asyncio.subprocess.DEVNULL, stdout=asyncio.subprocess.DEVNULL,
        stderr=asyncio.subprocess.DEVNULL,  # a line per entry it cannot remove: not kept
        cwd="/", env={"PATH": "/usr/bin:/bin", "LANG": "C"},
    )  # fmt: skip
    try:
        await asyncio.wait_for(proc.wait(), REMOVE_TIMEOUT_S)
    except TimeoutError:
        return f"removing what is in {path} took over {REMOVE_TIMEOUT_S:g} s; left"
    finally:
        if proc.returncode is None:  # late, or the daemon stopping: not left behind
            with contextlib.suppress(ProcessLookupError):
                proc.kill()
            with contextlib.suppress(asyncio.CancelledError):
                await asyncio.shield(proc.wait())
    try:
        os.rmdir(path)
    except FileNotFoundError:
        return None
    except OSError as exc:
        return f"cannot remove {path}: {exc.strerror} (left as it is)"
    return None
