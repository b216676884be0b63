"""A job's host memory and CPU limits, enforced with Linux control groups (``--mem``,
``--cpus``).  Standard library only: the supervisor (``launch/supervisor.py``) imports it.

Both layouts are supported:

* the unified hierarchy (cgroup v2, ``ROOT/cgroup.controllers`` exists): one group per
  incarnation with ``memory.max``, ``memory.swap.max`` (0, when present) and ``cpu.max``;
  ``memory.events``'s ``oom_kill`` tells whether the OOM killer fired;
* the v1 controllers (``ROOT/memory``, ``ROOT/cpu``; a hybrid mount too): one group in each,
  ``memory.limit_in_bytes`` (and ``memory.memsw.limit_in_bytes`` where swap is accounted),
  ``cpu.cfs_period_us``/``cpu.cfs_quota_us``; ``memory.oom_control``'s ``oom_kill`` (older
  kernels: ``memory.failcnt`` and a replica killed by SIGKILL) tells whether it fired.

A job's groups are ``BASE/pollux-local/job-<daemon>-<id>-<incarnation>-<token>`` (``<daemon>``:
eight hex digits of the daemon's state directory, :func:`daemon_key`; ``<token>``: eight hex
digits drawn by the incarnation's supervisor) where ``BASE`` is the daemon's
own cgroup in that hierarchy (``/proc/self/cgroup``, so that it works in a container or a
delegated service) or ``[limits] cgroup_parent`` (which must exist).  On v2 a cgroup that
passes controllers to its children may hold no process: when the daemon is alone in its own
cgroup it moves itself into ``BASE/pollux-local-daemon`` first (:func:`move_aside`); when it
is not alone (or a supervisor already runs there), the limits are not usable until
``cgroup_parent`` names an empty cgroup (``mkdir /sys/fs/cgroup/pollux``).  :func:`detect` finds the layout and whether
it may be written; :class:`JobGroup` makes one incarnation's groups, writes their limits, adds
a process (the supervisor's replica child does so as root, before it drops privileges: the
groups stay root's, so a job cannot move itself out), reads whether the OOM killer fired and
removes the groups once their processes are gone (``pollux-local`` too, when it is empty).
Every write is checked; the paths built from ids are refused unless they are plain names, and
files inside a group are opened relative to it without following symlinks.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import os
import re
import signal
import time
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any

from pollux_local.launch.node_agent import (  # noqa: F401 - own_cgroups: this module's too
    Fence,
    cgroup_procs,
    cgroup_tree_procs,
    own_cgroups,
    read_own_cgroups,
)

#: Where cgroupfs is mounted unless ``[limits] cgroup_root`` says otherwise.
CGROUP_ROOT = "/sys/fs/cgroup"
#: The directory under the base cgroup that holds the job groups.
GROUP_DIR = "pollux-local"
#: The CFS period of a CPU quota, in microseconds (the kernel's default).
CPU_PERIOD_US = 100_000
#: The smallest quota the kernel takes, in microseconds.
MIN_QUOTA_US = 1_000
#: How long :meth:`JobGroup.remove` keeps trying while the kernel still counts processes.
REMOVE_TIMEOUT_S = 5.0
#: How long one :func:`sweep` (the daemon's, in its event loop, tried again and again until
#: :data:`REMOVE_TIMEOUT_S`) waits for a group's processes to end.
SWEEP_END_S = 0.1
#: The controllers a limit needs.
CONTROLLERS = ("memory", "cpu")
#: On v2, the leaf the daemon moves itself into when its own cgroup must pass the controllers
#: on to the jobs' groups (a cgroup that does may hold no process itself).
DAEMON_LEAF = "pollux-local-daemon"
#: ``job-<daemon>-<id>-<incarnation>-<token>`` (``job-<id>-<incarnation>`` and
#: ``job-<daemon>-<id>-<incarnation>`` of earlier versions, which a daemon upgraded while such
#: jobs ran still removes)
_NAME = re.compile(r"job-(?:[0-9a-f]{8}-)?[0-9]{1,19}-[0-9]{1,9}(?:-[0-9a-f]{8})?")


class CgroupError(Exception):
    """A cgroup could not be made, written or removed (one line)."""


class CgroupBusy(CgroupError):
    """On v2: a controller cannot be enabled below a cgroup that holds processes."""


@dataclass(frozen=True)
class Support:
    """What this machine offers for job limits: ``version`` 1 or 2 (0: no cgroupfs) and, per
    controller, the base directory job groups go under (``None``: not usable, ``why`` says
    why)."""

    version: int
    memory: str | None = None
    cpu: str | None = None
    memory_why: str = ""
    cpu_why: str = ""

    def base(self, controller: str) -> str | None:
        return self.memory if controller == "memory" else self.cpu

    def why(self, controller: str) -> str:
        return self.memory_why if controller == "memory" else self.cpu_why


@dataclass(frozen=True)
class Limits:
    """One incarnation's limits: ``memory`` in bytes, ``cpus`` (0.5: half a CPU), and where
    its groups go (``support``'s bases)."""

    support: Support
    memory: int | None = None
    cpus: float | None = None

    def to_json(self) -> dict[str, Any]:
        s = self.support
        return {"version": s.version, "memory_base": s.memory, "cpu_base": s.cpu,
                "memory": self.memory, "cpus": self.cpus}  # fmt: skip

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> Limits:
        memory, cpus = data.get("memory"), data.get("cpus")
        support = Support(
            int(data["version"]),
            memory=str(data["memory_base"]) if data.get("memory_base") else None,
            cpu=str(data["cpu_base"]) if data.get("cpu_base") else None,
        )
        return cls(
            support,
            memory=int(memory) if memory is not None else None,
            cpus=float(cpus) if cpus is not None else None,
        )


# --- the layout ------------------------------------------------------------------------------------


def _within(root: str, relative: str) -> str:
    """``root`` joined with a cgroup path (``/a/b``); ``..`` refused."""
    parts = [part for part in relative.split("/") if part]
    if any(part in (".", "..") for part in parts):
        raise CgroupError(f"cgroup path {relative!r} is not a plain path")
    return os.path.join(root, *parts)


def detect(
    root: str = CGROUP_ROOT, parent: str | None = None, own: Mapping[str, str] | None = None
) -> Support:
    """The layout under ``root`` and, per controller, the base job groups go under: the
    process's own cgroup there (``own``: ``/proc/self/cgroup`` as :func:`own_cgroups` reads
    it) or ``parent``.  A base is usable when ``pollux-local`` can be made in it (tried, and
    removed again if it was made here) and, on v2, the controller is (or can be) enabled for
    its children."""
    mine = read_own_cgroups() if own is None else dict(own)
    if os.path.isfile(os.path.join(root, "cgroup.controllers")):
        return _detect_v2(root, parent, mine)
    v1 = {
        name: os.path.join(root, name)
        for name in CONTROLLERS
        if os.path.isfile(os.path.join(root, name, "cgroup.procs"))
    }
    if not v1:
        why = f"no cgroup v1 memory or cpu controller and no cgroup v2 hierarchy under {root}"
        return Support(0, memory_why=why, cpu_why=why)
    bases: dict[str, str | None] = {}
    whys: dict[str, str] = {}
    for name in CONTROLLERS:
        if name not in v1:
            bases[name], whys[name] = None, f"no cgroup v1 {name} controller under {root}"
            continue
        try:
            base = _within(v1[name], parent if parent is not None else mine.get(name, "/"))
            _try_make(base)
            bases[name], whys[name] = base, ""
        except CgroupError as exc:
            bases[name], whys[name] = None, str(exc)
    return Support(1, bases["memory"], bases["cpu"], whys["memory"], whys["cpu"])


def _detect_v2(root: str, parent: str | None, mine: Mapping[str, str]) -> Support:
    own = mine.get("", "/")
    if os.path.basename(own) == DAEMON_LEAF:  # moved aside by an earlier detect
        own = os.path.dirname(own)
    try:
        base = _within(root, parent if parent is not None else own)
        available = _words(os.path.join(base, "cgroup.controllers"))
    except (CgroupError, OSError) as exc:
        why = str(exc) if isinstance(exc, CgroupError) else _os_why(exc)
        return Support(2, memory_why=why, cpu_why=why)
    bases: dict[str, str | None] = {}
    whys: dict[str, str] = {}
    for name in CONTROLLERS:
        if name not in available:
            bases[name], whys[name] = None, f"the {name} controller is not available in {base}"
            continue
        try:
            try:
                enable(base, name)
            except CgroupBusy:
                if parent is not None or not move_aside(base):
                    raise
                enable(base, name)
            _try_make(base)
            bases[name], whys[name] = base, ""
        except CgroupError as exc:
            bases[name], whys[name] = None, str(exc)
    return Support(2, bases["memory"], bases["cpu"], whys["memory"], whys["cpu"])


def _try_make(base: str) -> None:
    """Make ``BASE/pollux-local`` (and remove it again when it was made here and is empty):
    :class:`CgroupError` when it cannot be made."""
    if not os.path.isdir(base):
        raise CgroupError(f"{base} does not exist")
    path = os.path.join(base, GROUP_DIR)
    try:
        os.mkdir(path)
    except FileExistsError:
        if not _is_plain_dir(path):
            raise CgroupError(f"{path} is not a directory") from None
        return
    except OSError as exc:
        raise CgroupError(f"cannot create {path}: {_os_why(exc)}") from None
    with contextlib.suppress(OSError):
        os.rmdir(path)


def _is_plain_dir(path: str) -> bool:
    try:
        return os.path.isdir(path) and not os.path.islink(path)
    except OSError:
        return False


def _words(path: str) -> set[str]:
    with open(path) as fh:
        return set(fh.read().split())


def _os_why(exc: OSError) -> str:
    return exc.strerror or str(exc)


def enable(directory: str, controller: str) -> None:
    """On v2: ``+controller`` in ``directory``'s ``cgroup.subtree_control`` unless it is
    there already (a cgroup that holds processes itself refuses: EBUSY)."""
    control = os.path.join(directory, "cgroup.subtree_control")
    try:
        if controller in _words(control):
            return
        _write(control, f"+{controller}")
    except OSError as exc:
        if exc.errno == errno.EBUSY:
            raise CgroupBusy(
                f"cannot enable the {controller} controller below {directory}: it holds"
                " processes (set [limits] cgroup_parent to a cgroup delegated to the daemon)"
            ) from None
        raise CgroupError(
            f"cannot enable the {controller} controller below {directory}: {_os_why(exc)}"
        ) from None


def move_aside(base: str, pid: int | None = None) -> bool:
    """On v2, when the daemon (``pid``) is the only process in its own cgroup ``base``: move
    it into the leaf ``BASE/pollux-local-daemon``, so that ``base`` may pass controllers on to
    the jobs' groups (what a service with ``Delegate=yes`` is expected to do).  ``False``
    when other processes share ``base`` (then the admin names ``[limits] cgroup_parent``)."""
    me = os.getpid() if pid is None else pid
    if _procs(base) != [me]:
        return False
    leaf = os.path.join(base, DAEMON_LEAF)
    try:
        with contextlib.suppress(FileExistsError):
            os.mkdir(leaf)
        if not _is_plain_dir(leaf):
            return False
        _write(os.path.join(leaf, "cgroup.procs"), str(me))
    except OSError:
        return False
    return True


# --- writing -----------------------------------------------------------------------------------------


def _write(path: str, text: str, dir_fd: int | None = None) -> None:
    """Write ``text`` to a cgroup file (never through a symlink); the whole of it, or
    :class:`OSError`."""
    fd = os.open(path, os.O_WRONLY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=dir_fd)
    try:
        data = text.encode()
        if os.write(fd, data) != len(data):
            raise OSError(errno.EIO, f"short write of {text!r}")
    finally:
        os.close(fd)


def _read(name: str, dir_fd: int) -> str:
    fd = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=dir_fd)
    try:
        return os.read(fd, 65536).decode(errors="replace")
    finally:
        os.close(fd)


def _counter(text: str, key: str) -> int | None:
    """The value of ``key N`` in a flat keyed file (``memory.events``, ``oom_control``)."""
    for line in text.splitlines():
        parts = line.split()
        if len(parts) == 2 and parts[0] == key and parts[1].isdigit():
            return int(parts[1])
    return None


def cpu_quota_us(cpus: float) -> int:
    """The CFS quota per :data:`CPU_PERIOD_US` of ``cpus`` CPUs."""
    return max(MIN_QUOTA_US, round(cpus * CPU_PERIOD_US))


def daemon_key(state: str) -> str:
    """Eight hex digits naming the daemon whose state directory (or a directory in it) is
    ``state``: two daemons whose jobs' groups go under one base (started from one shell, or
    one service's cgroup) never share a group name, so neither takes the other's group for
    a stale one of its own."""
    return hashlib.sha1(os.path.normpath(state).encode()).hexdigest()[:8]


def group_name(job_id: str, incarnation: int, daemon: str, token: str | None = None) -> str:
    """``job-<daemon>-<id>-<incarnation>-<token>`` (``daemon``: :func:`daemon_key`;
    ``token``: eight hex digits drawn by the supervisor, so that a daemon whose state was
    reset, or one of the same state path in another container, never names a group as one of
    another's): a plain name, or :class:`CgroupError`."""
    name = f"job-{daemon}-{job_id}-{incarnation}" + (f"-{token}" if token else "")
    if not _NAME.fullmatch(name):
        raise CgroupError(f"not a cgroup name for a job: {name!r}")
    return name


@dataclass
class _Dir:
    controller: str  # "memory", "cpu", or "" for a v2 group holding both
    path: str


class JobGroup:
    """One incarnation's groups (one per hierarchy that a limit needs)."""

    def __init__(self, limits: Limits, name: str, dirs: list[_Dir]) -> None:
        self.limits = limits
        self.name = name
        self.dirs = dirs

    @property
    def paths(self) -> list[str]:
        return [d.path for d in self.dirs]

    @classmethod
    def create(cls, limits: Limits, name: str) -> JobGroup:
        """Make the groups of ``name`` (:func:`group_name`) and write ``limits`` into them;
        an empty group of that name is made again, one that holds processes is refused (they
        are not this caller's).  :class:`CgroupError` (nothing left behind) when one cannot
        be."""
        if not _NAME.fullmatch(name):
            raise CgroupError(f"not a cgroup name for a job: {name!r}")
        support = limits.support
        wanted = [c for c, value in (("memory", limits.memory), ("cpu", limits.cpus)) if value]
        bases: dict[str, list[str]] = {}  # base -> controllers
        for controller in wanted:
            base = support.base(controller)
            if base is None:
                raise CgroupError(f"no usable cgroup {controller} controller")
            bases.setdefault(base, []).append(controller)
        group = cls(limits, name, [])
        try:
            for base, controllers in bases.items():
                directory = _make_group(base, name, support.version, controllers)
                controller = controllers[0] if support.version == 1 else ""
                group.dirs.append(_Dir(controller, directory))
                group._write_limits(directory, controllers)
        except CgroupError:
            group.remove()
            raise
        return group

    def _write_limits(self, directory: str, controllers: list[str]) -> None:
        v2 = self.limits.support.version == 2
        fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
        try:
            if "memory" in controllers and self.limits.memory:
                memory = str(self.limits.memory)
                if v2:
                    self._set(fd, directory, "memory.max", memory)
                    self._set(fd, directory, "memory.swap.max", "0", optional=True)
                else:
                    self._set(fd, directory, "memory.limit_in_bytes", memory)
                    self._set(fd, directory, "memory.memsw.limit_in_bytes", memory, optional=True)
            if "cpu" in controllers and self.limits.cpus:
                quota = cpu_quota_us(self.limits.cpus)
                if v2:
                    self._set(fd, directory, "cpu.max", f"{quota} {CPU_PERIOD_US}")
                else:
                    self._set(fd, directory, "cpu.cfs_period_us", str(CPU_PERIOD_US))
                    self._set(fd, directory, "cpu.cfs_quota_us", str(quota))
        finally:
            os.close(fd)

    @staticmethod
    def _set(fd: int, directory: str, name: str, value: str, optional: bool = False) -> None:
        try:
            _write(name, value, dir_fd=fd)
        except FileNotFoundError:
            if optional:
                return
            raise CgroupError(f"cannot set {name} in {directory}: no such file") from None
        except OSError as exc:
            raise CgroupError(
                f"cannot set {name} = {value} in {directory}: {_os_why(exc)}"
            ) from None

    def add(self, pid: int) -> None:
        """Put process ``pid`` into every group of the incarnation (as root: the groups are
        root's)."""
        for d in self.dirs:
            try:
                _write(os.path.join(d.path, "cgroup.procs"), str(pid))
            except OSError as exc:
                raise CgroupError(
                    f"cannot add pid {pid} to cgroup {d.path}: {_os_why(exc)}"
                ) from None

    def memory_dir(self) -> str | None:
        for d in self.dirs:
            if d.controller in ("memory", ""):
                return d.path if self.limits.memory else None
        return None

    @contextlib.contextmanager
    def _memory_group(self) -> Iterator[int | None]:
        """The memory group's directory, opened without following a link (``None``: the job
        has no memory limit, or the directory cannot be opened)."""
        directory = self.memory_dir()
        fd = None
        if directory is not None:
            with contextlib.suppress(OSError):
                fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
        try:
            yield fd
        finally:
            if fd is not None:
                os.close(fd)

    def oom_kills(self) -> int | None:
        """How many processes the OOM killer ended in the memory group (``None``: no memory
        limit, or the kernel does not count them)."""
        with self._memory_group() as fd:
            if fd is None:
                return None
            try:
                if self.limits.support.version == 2:
                    return _counter(_read("memory.events", fd), "oom_kill")
                return _counter(_read("memory.oom_control", fd), "oom_kill")
            except OSError:
                return None

    def hit_limit(self) -> bool:
        """Did the memory group ever reach its limit (on v1 ``memory.failcnt``, that of
        ``memsw`` or the peak usage; on v2 ``memory.events``'s ``max``)?"""
        with self._memory_group() as fd:
            if fd is None:
                return False
            try:
                if self.limits.support.version == 2:
                    events = _read("memory.events", fd)
                    return bool(_counter(events, "max") or _counter(events, "oom"))
                for name in ("memory.failcnt", "memory.memsw.failcnt"):
                    with contextlib.suppress(FileNotFoundError):
                        if int(_read(name, fd).strip() or "0") > 0:
                            return True
                peak = int(_read("memory.max_usage_in_bytes", fd).strip() or "0")
                return bool(self.limits.memory) and peak >= int(self.limits.memory or 0) - 65536
            except (OSError, ValueError):
                return False

    def oom_killed(self, any_sigkill: bool) -> bool:
        """Did the OOM killer end a process of the job over its memory limit?  It killed one
        (counted by the kernel; where it is not, before Linux 4.13 on v1: a replica died of
        SIGKILL, ``any_sigkill``) and the group reached its limit (a kill of the machine's own
        OOM killer in a group below its limit is not the job's limit)."""
        kills = self.oom_kills()
        killed = kills > 0 if kills is not None else any_sigkill
        return killed and self.hit_limit()

    def pids(self) -> list[int]:
        """The processes in the groups now."""
        return sorted({pid for d in self.dirs for pid in _procs(d.path)})

    def remove(self, timeout_s: float = REMOVE_TIMEOUT_S) -> None:
        """Remove the groups (and ``pollux-local`` above them when it is left empty).  A
        process still in one is killed (checked to be in it through a pidfd, so a reused pid
        is never hit); :class:`CgroupError` when a group outlives ``timeout_s``."""
        deadline = time.monotonic() + timeout_s
        left: list[str] = []
        for d in self.dirs:
            end_as_one(d.path)
            while True:
                try:
                    os.rmdir(d.path)
                    break
                except FileNotFoundError:
                    break
                except OSError as exc:
                    if exc.errno != errno.EBUSY or time.monotonic() > deadline:
                        left.append(f"{d.path}: {_os_why(exc)}")
                        break
                for pid in _procs(d.path):
                    kill_member(pid, d.path)
                time.sleep(0.02)
            with contextlib.suppress(OSError):
                os.rmdir(os.path.dirname(d.path))  # pollux-local, when no other job uses it
        self.dirs = []
        if left:
            raise CgroupError("cannot remove cgroup " + "; ".join(left))


def _make_group(base: str, name: str, version: int, controllers: list[str]) -> str:
    """``BASE/pollux-local/NAME``, made (``pollux-local`` too; on v2 with ``controllers``
    enabled for its children); a stale one of that name emptied and made again."""
    top = os.path.join(base, GROUP_DIR)
    path = os.path.join(top, name)
    for _ in range(20):  # another supervisor may remove an empty pollux-local meanwhile
        try:
            with contextlib.suppress(FileExistsError):
                os.mkdir(top)
            if not _is_plain_dir(top):
                raise CgroupError(f"{top} is not a directory")
            if version == 2:
                for controller in controllers:
                    enable(top, controller)
            os.mkdir(path)
            return path
        except FileNotFoundError:
            if not os.path.isdir(base):
                raise CgroupError(f"cannot create cgroup {path}: {base} does not exist") from None
            continue
        except FileExistsError:
            if not _is_plain_dir(path):
                raise CgroupError(f"{path} is not a directory") from None
            if cgroup_tree_procs(path):  # (on v2 its replicas are in groups below it)
                raise CgroupError(
                    f"cannot create cgroup {path}: it exists and holds processes"
                ) from None
            stale = JobGroup(Limits(Support(version)), name, [_Dir("", path)])
            stale.remove()  # a supervisor that was killed left it behind
            continue
        except OSError as exc:
            raise CgroupError(f"cannot create cgroup {path}: {_os_why(exc)}") from None
    raise CgroupError(f"cannot create cgroup {path}: it keeps disappearing")


_procs = cgroup_procs  # the processes in a group now (none when it cannot be read)


def is_job_group(path: str) -> bool:
    """Is ``path`` (from a run file) an absolute ``.../pollux-local/job-[<daemon>-]<id>-<n>``?"""
    return (
        os.path.isabs(path)
        and os.path.basename(os.path.dirname(path)) == GROUP_DIR
        and _NAME.fullmatch(os.path.basename(path)) is not None
        and ".." not in path.split("/")
    )


def sweep(path: str) -> bool:
    """Kill every process left in the job group ``path`` and try once to remove it (and
    ``pollux-local`` above it when empty); ``True`` once it is gone.  For a group whose
    supervisor died without removing it."""
    if not is_job_group(path) or not _is_plain_dir(path):
        return True
    end_as_one(path, SWEEP_END_S)
    for pid in _procs(path):
        kill_member(pid, path)
    try:
        os.rmdir(path)
    except FileNotFoundError:
        pass
    except OSError:
        return False
    with contextlib.suppress(OSError):
        os.rmdir(os.path.dirname(path))
    return True


def end_as_one(path: str, timeout_s: float = 2.0) -> None:
    """Kill every process in the group ``path`` at once where it can be (a v2 group, or a v1
    freezer group: ``node_agent.Fence``), so that one that keeps changing its pid is ended
    too; elsewhere (v1 memory and cpu groups) the callers kill them one by one."""
    kind = Fence.kind_of(path)
    if kind is not None:  # (the groups below it, its replicas', removed too)
        Fence(path, kind, owned=False).remove(timeout_s)


def member_of(pid: int, directory: str) -> bool:
    """Is ``pid`` listed in the group ``directory``?"""
    return pid in _procs(directory)


def kill_member(pid: int, directory: str) -> None:
    """SIGKILL ``pid`` if it is (still) in the group: the pidfd pins the process, then its
    membership is checked again."""
    try:
        pidfd = os.pidfd_open(pid)
    except OSError:
        return
    try:
        if member_of(pid, directory):
            signal.pidfd_send_signal(pidfd, signal.SIGKILL)
    except OSError:
        pass
    finally:
        os.close(pidfd)
