"""Daemon configuration: a TOML file, the embedded defaults and device discovery.

With no file the daemon schedules this machine alone: its GPUs found through NVML, or, on a
machine without any (or with ``--devices cpu:N``), N CPU-backed devices.  A file looks like::

    [scheduler]
    policy = "goodput"        # or "fifo" ("pollux": another name for "goodput")
    interval_s = 60
    p = -1.0                  # fairness exponent of the goodput policy
    restart_cost_s = 30
    share_slowdown = 0.25     # jobs sharing a device: each of n runs at 1 / (1 + 0.25 (n - 1))
    warm_resize = true        # resize elastic jobs in place where they can (here or over SSH)
    warm_timeout_s = 120      # a warm resize not done by then falls back to a restart

    [daemon]
    admin_group = "wheel"     # members may cancel/hold any job and raise priorities
    allow_group = "lab"       # a daemon not run by root serves only its own user (socket
                              # 0600); this opens it to the group's members (socket 0660)
    max_retries = 3           # crash restarts before an elastic job fails (rigid: --retries)
    backoff_s = 5             # first retry delay, doubled each time
    stop_grace_s = 60         # SIGTERM -> checkpoint exit wait before SIGKILL
    pg_timeout_s = 60         # POLLUX_PG_TIMEOUT_S given to jobs
    node_retry_s = 30         # how often a node marked down is checked again
    checkpoint_root = "/shared/ckpt"  # jobs checkpoint under ROOT/<job id>-<hash> (default: the
                              # job's directory in the state dir; must be shared by all nodes)

    [[nodes]]
    name = "box2"
    host = "box2"             # an ssh destination; "localhost" or none = this machine
    devices = "cuda:0,1"      # or ["cuda:0", "cuda:1"], or "cpu:4"
    workdir = "/shared/runs"  # optional
    type = "rtx2080ti"        # the devices' type (default: "cpu" for CPU devices, else "gpu")
    memory = "11G"            # each device's memory (shared small jobs are packed by it)

    [limits]
    max_priority = 0          # the highest priority a user who is not an admin may give
    connections_per_user = 16 # open connections per user (root and the daemon's user: any)
    mib_in_flight_per_user = 32  # request bytes one user may have the daemon buffer at once
    max_devices_per_user = 4  # devices one user's jobs may hold at once (default: no cap)
    max_running_per_user = 8  # jobs of one user running at once (default: no cap)
    max_log_size = "100M"     # each replica's log; output beyond it is discarded (a note says so)
    log_keep_free = "1G"      # logs pause while their disk has less free (at most 1/10 of it)
    notify_backlog_per_user = 100  # job ends of one user waiting to be announced; older dropped
    default_time = "1d"       # the time limit of a job submitted without --time
    max_time = "7d"           # the longest --time a job may ask for
    max_queued_per_user = 1000  # jobs one user may have queued, held or running (default 1000)
    max_array_size = 1000     # tasks one array may have (default 1000)
    max_command_size = "4M"   # a job's command line and environment together (default 4M)
    max_stored_per_user = "64M"  # commands and environments of one user's jobs, all in all
    max_ended_per_user = 10000  # ended jobs kept per user, the oldest removed (0: all kept)
    max_ended_stored_per_user = "256M"  # what one user's ended jobs keep; oldest removed (0: no cap)
    user_groups = 4           # groups each user may make for their own jobs (0: none)
    default_mem = "16G"       # host memory of a job started here without --mem (default: none)
    max_mem = "64G"           # the most --mem a job may ask for (default: no cap)
    default_cpus = 4          # CPUs of a job started here without --cpus (default: none)
    max_cpus = 8              # the most --cpus a job may ask for (default: no cap)
    cgroup_root = "/sys/fs/cgroup"  # where cgroupfs is mounted (v2, or v1's memory and cpu)
    cgroup_parent = "/lab"    # jobs' cgroups go under CGROUP/pollux-local here (default:
                              # the daemon's own cgroup, in each hierarchy)

    [groups.gpu]              # a group any job may join (submit --group gpu)
    max_devices = 2           # devices its jobs hold at once (default: no cap)
    max_running = 4           # its jobs running at once (default: no cap)

    [accounts.nlp-grant]      # an account jobs are charged to (submit --account nlp-grant)
    users = ["ada", "bob"]    # who may charge it: these users,
    unix_group = "nlp"        # and the members of this group (either may be left out)

    [devices]
    reserved = ["cuda:3", "box2:cuda:0"]  # never given to a job (this machine's, or NODE:DEV)
    busy_memory = "1G"   # outside processes using this much of a GPU's memory make it busy
    max_jobs_per_device = 4  # shared jobs (submit --shared) one device may run at once

    [notify]
    command = "notify-send \"$POLLUX_JOB_NAME $POLLUX_JOB_STATE\""  # run as the job's owner
    on = "end"                # or "failure": only failed jobs
    desktop = true            # also a desktop notification where the owner has a session bus

    [metrics]
    prometheus = "127.0.0.1:9464"  # serve /metrics there (needs the prometheus extra)

``SIGHUP`` makes the daemon read the file again: nodes, limits, reserved devices and
notifications change without stopping a job (``reload_config``).

Host memory and CPUs (``--mem``, ``--cpus``) are enforced with cgroups (v2, or v1's memory
and cpu controllers: ``launch/cgroups.py``) on this machine only: a job that may be placed on
a remote node cannot ask for them.  Where the cgroups cannot be written (a daemon not run as
root), ``--mem``/``--cpus`` are refused at submit in one line, and ``default_mem`` and
``default_cpus`` are not applied (one warning in the daemon's log).  The defaults apply when a
job starts on this machine (a job started on a remote node gets none).
"""

from __future__ import annotations

import dataclasses
import grp
import os
import re
import socket
import stat
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pollux_local.core.names import POLICY_ALIASES, policy_names
from pollux_local.core.sharing import DEFAULT_MAX_JOBS_PER_DEVICE
from pollux_local.daemon import gpus
from pollux_local.durations import DurationError, parse_duration
from pollux_local.errors import PolluxError
from pollux_local.launch.slurm.allocation import Allocation, SlurmNode
from pollux_local.launch.ssh.nodes import SSH_KEYS, SshNodeConfig
from pollux_local.sizes import SizeError, format_size, parse_size
from pollux_local.tomlfile import check_keys, parse_toml, read_toml

LOCAL_HOSTS = frozenset({"", "localhost", "127.0.0.1", "::1"})
POLICIES = policy_names(daemon=True)
#: Other names accepted for a policy: the goodput policy is Pollux's.


@dataclass(frozen=True)
class NodeConfig:
    """One node: ``host`` is ``None`` for this machine, else an ssh destination, and then
    ``ssh`` its settings as the SSH launcher takes them (checked when the config was read;
    made from ``host`` and ``workdir`` alone when not given)."""

    name: str
    devices: tuple[str, ...]
    host: str | None = None
    workdir: str | None = None
    ssh: SshNodeConfig | None = None
    #: the devices' type: ``[nodes.NAME] type``, else ``cpu`` for CPU devices, ``gpu`` others
    device_type: str = ""
    #: memory of each device in bytes: ``[nodes.NAME] memory`` (``None``: not known)
    device_memory: int | None = None
    #: CPU-backed test devices: how many times slower than plain CPU they are
    #: (``[nodes.NAME] slowdown``; jobs stretch their steps by it): a second device type
    slowdown: float | None = None
    #: a node of the Slurm allocation the daemon runs in (its jobs run as job steps)
    slurm: SlurmNode | None = None

    def __post_init__(self) -> None:
        if not self.device_type:
            kind = "cpu" if all(d.startswith("cpu") for d in self.devices) else "gpu"
            object.__setattr__(self, "device_type", kind)
        if self.ssh is None and self.slurm is None and not self.is_local:
            table = (
                {"host": self.host}
                if self.workdir is None
                else {"host": self.host, "workdir": self.workdir}
            )
            object.__setattr__(
                self, "ssh", SshNodeConfig.from_table(self.name, table, self.devices)
            )

    @property
    def is_local(self) -> bool:
        return self.host is None or self.host in LOCAL_HOSTS


#: A group's name: letters, digits, ``_.-``, at most 64 characters (``api.spec.GroupName``).
GROUP_NAME = re.compile(r"^[A-Za-z0-9_.-]{1,64}$")
#: The keys of a ``[groups.NAME]`` table.
GROUP_KEYS = frozenset({"max_devices", "max_running"})
#: The keys of an ``[accounts.NAME]`` table.
ACCOUNT_KEYS = frozenset({"users", "unix_group"})


@dataclass(frozen=True)
class GroupConfig:
    """An admin's group (``[groups.NAME]``): any job may join it; its caps (``None``: none)
    are the file's, changed only by editing it (and ``SIGHUP``)."""

    name: str
    max_devices: int | None = None
    max_running: int | None = None

    def __str__(self) -> str:
        caps = f"max_devices {_cap(self.max_devices)}, max_running {_cap(self.max_running)}"
        return f"{self.name} ({caps})"


@dataclass(frozen=True)
class AccountConfig:
    """An account jobs are charged to (``[accounts.NAME]``): ``submit --account NAME`` is for
    the ``users`` named and the members of ``unix_group``; ``usage --by account`` sums each
    account's device-hours."""

    name: str
    users: frozenset[str] = frozenset()
    unix_group: str | None = None

    def __str__(self) -> str:
        who = sorted(self.users) + ([f"group {self.unix_group}"] if self.unix_group else [])
        return f"{self.name} ({', '.join(who)})"


def _cap(value: int | None) -> str:
    return "none" if value is None else str(value)


@dataclass(frozen=True)
class DaemonConfig:
    nodes: tuple[NodeConfig, ...]
    policy: str = "goodput"
    interval_s: float = 60.0
    p: float = -1.0
    restart_cost_s: float = 30.0
    admin_group: str | None = None
    max_retries: int = 3
    backoff_s: float = 5.0
    stop_grace_s: float = 60.0
    pg_timeout_s: float = 60.0
    node_retry_s: float = 30.0
    checkpoint_root: str | None = None
    #: a daemon not run by root serves this group's members too (socket 0660, this group)
    allow_group: str | None = None
    #: the highest priority a user who is not an admin may give a job
    max_priority: int = 0
    #: connections one user may hold open at once (root and the daemon's user: no cap)
    max_user_connections: int = 16
    #: request bytes one user may have the daemon buffer at once
    max_user_bytes: int = 32 * 1024 * 1024
    #: devices one user's jobs may hold at once, and jobs of one user running at once
    max_devices_per_user: int | None = None
    max_running_per_user: int | None = None
    #: a job's log is not written while its disk has less than this free (at most a tenth of
    #: the disk): what the logs leave to the state database (``[limits] log_keep_free``)
    log_keep_free: int = 1 << 30
    #: bytes of one replica's log (``[limits] max_log_size``): more output is discarded
    max_log_bytes: int = 100 * 1024 * 1024
    #: job ends of one user waiting to be announced (``[limits] notify_backlog_per_user``)
    notify_backlog_per_user: int = 100
    #: the time limit of a job submitted without one, and the longest one a job may ask for
    default_time_s: float | None = None
    max_time_s: float | None = None
    #: jobs one user may have queued, held or running at once; tasks one array may have; the
    #: bytes of one job's command line and environment (each string and its NUL, as exec
    #: counts them)
    max_queued_per_user: int = 1000
    max_array_size: int = 1000
    max_command_bytes: int = 4 * 1024 * 1024
    #: bytes of commands and environments one user's queued, held and running jobs keep in
    #: the state (each stored once: an array's tasks share theirs)
    max_stored_per_user: int = 64 * 1024 * 1024
    #: ended jobs kept per user (their newest); older ones are removed (0: every one kept)
    max_ended_per_user: int = 10_000
    #: bytes one user's ended jobs keep in the state (their rows, and the commands and
    #: environments none of the user's active jobs keeps); the oldest beyond are removed
    #: (0: no bound but the count)
    max_ended_stored_per_user: int = 256 * 1024 * 1024
    #: the admin's groups (``[groups.NAME]``), and how many groups each user may make
    groups: tuple[GroupConfig, ...] = ()
    #: the accounts jobs may be charged to (``[accounts.NAME]``; ``submit --account``)
    accounts: tuple[AccountConfig, ...] = ()
    user_groups: int = 4
    #: host memory (bytes) and CPUs of a job started here without ``--mem``/``--cpus``, and
    #: the most a job may ask for (``None``: none, no cap); where the cgroups that enforce
    #: them are (``cgroup_root``) and the cgroup jobs' groups go under (``cgroup_parent``;
    #: ``None``: the daemon's own)
    default_host_memory: int | None = None
    max_host_memory: int | None = None
    default_cpus: float | None = None
    max_cpus: float | None = None
    cgroup_root: str = "/sys/fs/cgroup"
    cgroup_parent: str | None = None
    #: devices never given to a job, as ``node:device``
    reserved: tuple[str, ...] = ()
    #: a GPU counts as busy when processes outside the scheduler use this much of its memory
    busy_memory: int = gpus.DEFAULT_BUSY_BYTES
    #: shared jobs (``submit --shared``) one device may run at once
    max_jobs_per_device: int = DEFAULT_MAX_JOBS_PER_DEVICE
    #: a shell command run as a job's owner when it ends (``notify_on`` ``failure``: only when
    #: it failed), and whether to send a desktop notification too
    notify_command: str | None = None
    notify_on: str = "end"
    notify_desktop: bool = False
    #: ``host:port`` of the Prometheus endpoint (``None``: none)
    prometheus: str | None = None
    #: the slowdown beta of jobs sharing a device: each of n runs at 1 / (1 + beta (n - 1))
    share_slowdown: float = 0.25
    #: resize elastic jobs of this machine in place (``executor/warm.py``), and how long
    #: joining replicas get to be ready and the job to report at its new size before the
    #: resize falls back to a checkpoint-restart
    warm_resize: bool = True
    warm_timeout_s: float = 120.0
    source: str = "embedded default"
    #: what the daemon logs as it starts with this config (this machine's CUDA devices NVML
    #: does not see, scheduled with ``--force``)
    warnings: tuple[str, ...] = ()

    @property
    def total_devices(self) -> int:
        return sum(len(node.devices) for node in self.nodes)

    def node(self, name: str) -> NodeConfig:
        for node in self.nodes:
            if node.name == name:
                return node
        raise KeyError(name)

    def device_type_of(self, node_name: str) -> str:
        """The type of a node's devices (``gpu`` for a node no longer configured)."""
        try:
            return self.node(node_name).device_type
        except KeyError:
            return "gpu"


def discover_gpus() -> list[str]:
    """This machine's NVIDIA GPUs as ``cuda:i``; no driver or library means no GPUs."""
    return [gpu.device for gpu in gpus.discover()]


def check_local_devices_once(nodes: list[NodeConfig], where: str, devices: str | None) -> None:
    """Each device of this machine belongs to one local node: two listing the same one ran
    two jobs on it at once."""
    seen: dict[str, str] = {}
    for node in nodes:
        if not node.is_local:
            continue
        for device in node.devices:
            if device in seen:
                given = (
                    f" (--devices {devices} gives every local node its devices)" if devices else ""
                )
                raise PolluxError(
                    f"{where}: device {device} is listed by both local nodes {seen[device]} and"
                    f" {node.name}{given}: a device of this machine belongs to one node"
                )
            seen[device] = node.name


def parse_devices(spec: str | Sequence[str] | int, where: str = "--devices") -> tuple[str, ...]:
    """``"cpu:4"`` -> four CPU devices; ``"cuda:0,2"`` or ``["cuda:0", "cuda:2"]`` -> those GPUs."""
    if isinstance(spec, (bool, int)):
        raise PolluxError(f"{where}: give devices as 'cpu:N' or 'cuda:I,J', not {spec!r}")
    if isinstance(spec, str):
        kind, sep, rest = spec.strip().partition(":")
        if not sep or kind not in ("cpu", "cuda") or not rest:
            raise PolluxError(f"{where}: expected 'cpu:N' or 'cuda:I,J,...', got {spec!r}")
        if kind == "cpu":
            try:
                count = int(rest)
            except ValueError:
                raise PolluxError(f"{where}: 'cpu:N' needs a whole number, got {spec!r}") from None
            if count <= 0:
                raise PolluxError(f"{where}: need at least one CPU device, got {spec!r}")
            return tuple(f"cpu:{i}" for i in range(count))
        try:
            indices = [int(part) for part in rest.split(",")]
        except ValueError:
            raise PolluxError(f"{where}: GPU indices must be whole numbers, got {spec!r}") from None
        devices = tuple(f"cuda:{i}" for i in indices)
    else:
        devices = tuple(spec)
        for device in devices:
            kind, _, index = str(device).partition(":")
            if kind not in ("cpu", "cuda") or not index.isdigit():
                raise PolluxError(f"{where}: bad device {device!r} (expected 'cpu:I' or 'cuda:I')")
    if len(set(devices)) != len(devices):
        raise PolluxError(f"{where}: a device is listed twice in {spec!r}")
    if not devices:
        raise PolluxError(f"{where}: no devices given")
    return devices


def slurm_nodes(allocation: Allocation) -> tuple[NodeConfig, ...]:
    """The nodes of a Slurm allocation as the daemon schedules them (``--launcher slurm``:
    they replace the config's nodes): each with the GPUs the allocation holds there, typed by
    their gres type (``gpu:a100:4``), or its allocated CPUs."""
    return tuple(
        NodeConfig(
            name=node.name,
            devices=node.devices,
            host=node.address,
            device_type=node.gpu_type or "",
            slurm=node,
        )
        for node in allocation.nodes
    )


def local_node(devices: str | None = None) -> NodeConfig:
    """This machine as one node: the first of :func:`local_nodes`."""
    return local_nodes(devices)[0]


def local_nodes(devices: str | None = None) -> tuple[NodeConfig, ...]:
    """This machine as nodes: ``devices`` if given, else its GPUs, else two CPU devices; GPUs
    of several types are one node per type (:func:`split_by_gpu_type`)."""
    if devices is not None:
        found = parse_devices(devices)
    else:
        found = tuple(discover_gpus()) or parse_devices("cpu:2")
    return split_by_gpu_type(NodeConfig(name=socket.gethostname() or "localhost", devices=found))


def split_by_gpu_type(node: NodeConfig) -> tuple[NodeConfig, ...]:
    """A local node whose type was not declared, typed by its GPUs (NVML's names, as
    :mod:`pollux_local.daemon.gpus` normalises them).  A node's devices share one type, so a box
    with GPUs of several types becomes one node per type: the type of its first device keeps
    the node's name, each other type is ``<name>-<type>`` (2x A100 + 4x T4 on ``box``: ``box``
    with ``cuda:0,1`` typed ``a100-40gb`` and ``box-t4`` with ``cuda:2-5``).  Devices keep
    their physical ``cuda:<index>``; CPU devices and GPUs NVML does not describe keep the
    node's default type.  A node's memory, unless declared, is its smallest GPU's."""
    if not any(device.startswith("cuda:") for device in node.devices):
        return (node,)
    described = {gpu.device: gpu for gpu in gpus.discover()}
    groups: dict[str, list[str]] = {}
    for device in node.devices:
        gpu = described.get(device)
        groups.setdefault(gpu.device_type if gpu else node.device_type, []).append(device)
    split = []
    for rank, (device_type, members) in enumerate(groups.items()):
        totals = [described[d].total_bytes for d in members if d in described]
        split.append(
            dataclasses.replace(
                node,
                name=node.name if rank == 0 else f"{node.name}-{device_type}",
                devices=tuple(members),
                device_type=device_type,
                device_memory=node.device_memory or (min(totals) if totals else None),
            )
        )
    return tuple(split)


#: The keys of a node's table: the scheduler's and the SSH launcher's (``launch.ssh.SSH_KEYS``).
NODE_KEYS = frozenset({"name", "devices", "device_type", "type", "memory", "slowdown"}) | SSH_KEYS

#: The keys each table of the config may hold (anything else is refused, with a suggestion).
KNOWN_KEYS: dict[str, frozenset[str]] = {
    "scheduler": frozenset(
        {
            "policy",
            "interval_s",
            "p",
            "restart_cost_s",
            "share_slowdown",
            "warm_resize",
            "warm_timeout_s",
        }
    ),
    "daemon": frozenset(
        {
            "admin_group",
            "allow_group",
            "checkpoint_root",
            "max_retries",
            "backoff_s",
            "stop_grace_s",
            "pg_timeout_s",
            "node_retry_s",
        }
    ),  # fmt: skip
    "limits": frozenset(
        {
            "max_priority",
            "connections_per_user",
            "mib_in_flight_per_user",
            "max_devices_per_user",
            "max_running_per_user",
            "max_log_size",
            "notify_backlog_per_user",
            "default_time",
            "max_time",
            "max_queued_per_user",
            "max_array_size",
            "max_command_size",
            "max_stored_per_user",
            "max_ended_per_user",
            "max_ended_stored_per_user",
            "user_groups",
            "default_mem",
            "max_mem",
            "default_cpus",
            "max_cpus",
            "cgroup_root",
            "cgroup_parent",
            "log_keep_free",
        }
    ),
    "devices": frozenset({"reserved", "busy_memory", "max_jobs_per_device"}),
    "notify": frozenset({"command", "on", "desktop"}),
    "metrics": frozenset({"prometheus"}),
}
SECTIONS = (
    "scheduler",
    "daemon",
    "nodes",
    "limits",
    "devices",
    "notify",
    "metrics",
    "groups",
    "accounts",
)


def _number(table: dict[str, Any], key: str, default: float, where: str, minimum: float) -> float:
    value = table.get(key, default)
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise PolluxError(f"{where}: {key} must be a number, got {value!r}")
    if value < minimum:
        raise PolluxError(f"{where}: {key} must be at least {minimum:g}, got {value!r}")
    return float(value)


def _whole(
    table: dict[str, Any], key: str, default: int, where: str, minimum: int, maximum: int
) -> int:
    value = table.get(key, default)
    if isinstance(value, bool) or not isinstance(value, int):
        raise PolluxError(f"{where}: {key} must be a whole number, got {value!r}")
    if not minimum <= value <= maximum:
        raise PolluxError(f"{where}: {key} must be between {minimum} and {maximum}, got {value}")
    return value


def changeable_by_others(path: Path) -> str | None:
    """Why a user other than root and this process's could change what ``path`` holds (the
    file, a link on the way to it or where one leads, or a directory any of them is in that
    another user owns or may write to; a sticky directory's entries only their owners may
    replace), or ``None``."""
    return _walk_unchangeable(path)[0]


#: links followed on the way to a file at most (the kernel's own limit)
_MAX_LINKS = 40


def _walk_unchangeable(path: Path) -> tuple[str | None, os.stat_result | None]:
    """Follow ``path`` one component and one link at a time, as the kernel does, checking
    each directory entered, each link and the file reached (:func:`_changeable`): why
    another user could change it (or ``None``), and the file reached (``None``: nothing
    there).  A link is read where it is: a link in another user's directory, however its
    target looks, is refused (that user could point it elsewhere once it was checked)."""
    todo = list(reversed(Path(os.path.abspath(path)).parts[1:]))
    current = Path("/")
    try:
        info = os.lstat(current)
    except OSError as exc:
        return f"cannot check /: {exc.strerror}", None
    problem = _changeable(current, info, last=not todo)
    if problem is not None:
        return problem, None
    links = 0
    while todo:
        name = todo.pop()
        if name in ("", "."):
            continue
        if name == "..":
            current = current.parent
            continue
        part = current / name
        try:
            info = os.lstat(part)
        except FileNotFoundError:
            return None, None  # nothing there to change (reading it says so)
        except OSError as exc:
            return f"cannot check {part}: {exc.strerror}", None
        problem = _changeable(part, info, last=not todo)
        if problem is not None:
            return problem, None
        if stat.S_ISLNK(info.st_mode):
            links += 1
            if links > _MAX_LINKS:
                return f"{path}: too many levels of links", None
            try:
                target = os.readlink(part)
            except OSError as exc:
                return f"cannot check {part}: {exc.strerror}", None
            parts = Path(target).parts
            if target.startswith("/"):
                current, parts = Path("/"), parts[1:]
            todo.extend(reversed(parts))
            continue
        if todo and not stat.S_ISDIR(info.st_mode):
            return f"cannot check {part}: not a directory", None
        current = part
    return None, info


def _changeable(part: Path, info: os.stat_result, last: bool) -> str | None:
    """Why another user could change the entry ``part`` (``info``, not followed): theirs,
    or writable by them; a directory on the way (not ``last``) that is sticky keeps its
    entries their owners' (each checked in turn)."""
    if info.st_uid not in (0, os.geteuid()):
        return f"{part} belongs to uid {info.st_uid}"
    if stat.S_ISLNK(info.st_mode):
        return None  # a link's mode means nothing; its directory is checked
    sticky = stat.S_ISDIR(info.st_mode) and bool(info.st_mode & stat.S_ISVTX)
    if not last and sticky:
        return None
    if info.st_mode & 0o002:
        return f"{part} is writable by every user"
    if info.st_mode & 0o020 and info.st_gid != 0:
        return f"{part} is writable by group {info.st_gid}"
    return None


def read_unchangeable_toml(path: Path, what: str) -> dict[str, Any]:
    """Read the TOML file at ``path`` as a daemon run as root does: only when no user other
    than root and this process's could change it (:func:`changeable_by_others`), from one
    descriptor that ``fstat`` shows is the very file checked (a link repointed once it was
    checked is refused, never read), a regular file."""
    where = str(path)
    problem, checked = _walk_unchangeable(path)
    if problem is not None:
        raise PolluxError(
            f"{where}: a daemon run as root reads only a {what} no other user can change: {problem}"
        )
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NONBLOCK | os.O_NOCTTY)
    except FileNotFoundError:
        raise PolluxError(f"{what} {path} does not exist") from None
    except OSError as exc:
        raise PolluxError(f"cannot read {what} {path}: {exc.strerror}") from None
    info = os.fstat(fd)
    if not stat.S_ISREG(info.st_mode):  # a directory cannot even be opened as a file object
        os.close(fd)
        raise PolluxError(f"cannot read {what} {path}: not a regular file")
    with os.fdopen(fd, "rb") as handle:
        if checked is None or (info.st_dev, info.st_ino) != (checked.st_dev, checked.st_ino):
            raise PolluxError(
                f"{where}: a daemon run as root reads only a {what} no other user can change:"
                " it changed while it was checked"
            )
        return parse_toml(handle, path, what)


def load_config(
    path: str | Path | None = None, devices: str | None = None, force: bool = False
) -> DaemonConfig:
    """Read the TOML config at ``path`` (or use the embedded default); ``devices`` (the
    ``--devices`` option) replaces the local node's devices.  CUDA devices of this machine
    that NVML does not see are refused unless ``force`` (:func:`check_local_gpus`)."""
    if path is None:
        local = local_nodes(devices)
        return DaemonConfig(nodes=local, warnings=check_local_gpus(local, "--devices", force))
    where = str(path)
    if os.geteuid() == 0:  # read from the file checked, once: never again by its path
        data = read_unchangeable_toml(Path(path), "config file")
    else:
        data = read_toml(path, "config file")

    unknown = set(data) - set(SECTIONS)
    if unknown:
        raise PolluxError(f"{where}: unknown section(s) {', '.join(sorted(unknown))}")
    sched = data.get("scheduler", {})
    daemon = data.get("daemon", {})
    limits = data.get("limits", {})
    devices_table = data.get("devices", {})
    notify = data.get("notify", {})
    metrics = data.get("metrics", {})
    tables = (sched, daemon, limits, devices_table, notify, metrics)
    if not all(isinstance(table, dict) for table in tables):
        raise PolluxError(
            f"{where}: [scheduler], [daemon], [limits], [devices], [notify] and [metrics]"
            " must be tables"
        )
    policy = sched.get("policy", "goodput")
    if isinstance(policy, str):
        policy = POLICY_ALIASES.get(policy, policy)
    if policy not in POLICIES:
        raise PolluxError(f"{where}: policy must be one of {', '.join(POLICIES)}, got {policy!r}")
    admin_group = daemon.get("admin_group")
    if admin_group is not None and (not isinstance(admin_group, str) or not admin_group):
        raise PolluxError(f"{where}: admin_group must be a group name")
    warnings: list[str] = []
    if admin_group is not None:
        try:
            grp.getgrnam(admin_group)
        except KeyError:  # it may be made later (looked up at each request): said, not refused
            warnings.append(
                f"{where}: admin_group {admin_group!r} is not a group on this machine: until it"
                " is, only root and the daemon's user are admins"
            )
    allow_group = daemon.get("allow_group")
    if allow_group is not None:
        if not isinstance(allow_group, str) or not allow_group:
            raise PolluxError(f"{where}: allow_group must be a group name")
        try:
            grp.getgrnam(allow_group)
        except KeyError:
            raise PolluxError(
                f"{where}: allow_group {allow_group!r} is not a group on this machine"
            ) from None
    for section, table in zip(
        ("scheduler", "daemon", "limits", "devices", "notify", "metrics"), tables, strict=True
    ):
        check_keys(table, KNOWN_KEYS[section], section, where)

    raw_nodes = data.get("nodes")
    nodes: list[NodeConfig] = []
    if raw_nodes is None:
        nodes.extend(local_nodes(devices))
    else:
        if isinstance(raw_nodes, dict):  # [nodes.NAME] tables
            raw_nodes = [
                {"name": key, **value} if isinstance(value, dict) else value
                for key, value in raw_nodes.items()
            ]
        if not isinstance(raw_nodes, list) or not raw_nodes:
            raise PolluxError(f"{where}: nodes must be [nodes.NAME] tables or [[nodes]] entries")
        for index, raw in enumerate(raw_nodes):
            node_where = f"{where}: nodes[{index}]"
            if not isinstance(raw, dict):
                raise PolluxError(f"{node_where} must be a table")
            host = raw.get("host")
            if host is not None and not isinstance(host, str):
                raise PolluxError(f"{node_where}: host must be a string")
            is_local = host is None or host in LOCAL_HOSTS
            name = raw.get("name") or (host if host and not is_local else socket.gethostname())
            if not isinstance(name, str):
                raise PolluxError(f"{node_where}: name must be a string")
            check_keys(raw, NODE_KEYS, f"nodes.{name}", where)
            if is_local and devices is not None:
                node_devices = parse_devices(devices)
            elif isinstance(raw.get("devices"), int) and not isinstance(raw["devices"], bool):
                kind = raw.get("device_type", "cuda")
                if kind not in ("cpu", "cuda") or raw["devices"] <= 0:
                    raise PolluxError(f"{node_where}: need devices > 0 and device_type cpu|cuda")
                node_devices = tuple(f"{kind}:{i}" for i in range(raw["devices"]))
            elif "devices" in raw:
                node_devices = parse_devices(raw["devices"], f"{node_where}.devices")
            elif is_local:
                node_devices = tuple(discover_gpus()) or parse_devices("cpu:2")
            else:
                raise PolluxError(f"{node_where}: a remote node needs 'devices'")
            workdir = raw.get("workdir")
            if workdir is not None and not isinstance(workdir, str):
                raise PolluxError(f"{node_where}: workdir must be a path")
            node_type = raw.get("type", "")
            if not isinstance(node_type, str) or (
                node_type and not re.fullmatch(r"[A-Za-z0-9_.+-]{1,64}", node_type)
            ):
                raise PolluxError(
                    f"{node_where}: type must be a short name (letters, digits, _.+-),"
                    f" got {node_type!r}"
                )
            slowdown = raw.get("slowdown")
            if slowdown is not None:
                if any(not d.startswith("cpu") for d in node_devices):
                    raise PolluxError(f"{node_where}: slowdown is for CPU-backed devices only")
                slowdown = _number(raw, "slowdown", 1.0, node_where, 1.0)
            memory = raw.get("memory")
            if memory is not None:
                try:
                    memory = parse_size(memory)
                except SizeError as exc:
                    raise PolluxError(f"{node_where}: memory: {exc}") from None
            ssh = None
            if not is_local:
                try:
                    ssh = SshNodeConfig.from_table(name, raw, node_devices)
                except PolluxError as exc:
                    raise PolluxError(f"{where}: {exc}") from None
            node = NodeConfig(
                name=name,
                devices=node_devices,
                host=host,
                workdir=workdir,
                ssh=ssh,
                device_type=node_type,
                device_memory=memory,
                slowdown=slowdown,
            )
            nodes.extend(split_by_gpu_type(node) if is_local and not node_type else (node,))
        names = [node.name for node in nodes]
        if len(set(names)) != len(names):
            raise PolluxError(f"{where}: node names must be unique, got {names}")
        check_local_devices_once(nodes, where, devices)

    checkpoint_root = daemon.get("checkpoint_root")
    if checkpoint_root is not None and (
        not isinstance(checkpoint_root, str) or not checkpoint_root.startswith("/")
    ):
        raise PolluxError(f"{where}: checkpoint_root must be an absolute path")
    max_retries = daemon.get("max_retries", 3)
    if isinstance(max_retries, bool) or not isinstance(max_retries, int) or max_retries < 0:
        raise PolluxError(f"{where}: max_retries must be a whole number >= 0")
    default_time = _duration(limits, "default_time", where)
    max_time = _duration(limits, "max_time", where)
    if default_time is not None and max_time is not None and default_time > max_time:
        raise PolluxError(f"{where}: default_time is longer than max_time")
    notify_command = notify.get("command")
    if notify_command is not None and (not isinstance(notify_command, str) or not notify_command):
        raise PolluxError(f"{where}: [notify] command must be a shell command line")
    notify_on = notify.get("on", "end")
    if notify_on not in ("end", "failure"):
        raise PolluxError(f"{where}: [notify] on must be 'end' or 'failure', got {notify_on!r}")
    warm_resize = sched.get("warm_resize", True)
    if not isinstance(warm_resize, bool):
        raise PolluxError(f"{where}: [scheduler] warm_resize must be true or false")
    desktop = notify.get("desktop", False)
    if not isinstance(desktop, bool):
        raise PolluxError(f"{where}: [notify] desktop must be true or false")
    prometheus = metrics.get("prometheus")
    if prometheus is not None and (
        not isinstance(prometheus, str) or not re.fullmatch(r"[^\s:]*:\d{1,5}", prometheus)
    ):
        raise PolluxError(f"{where}: [metrics] prometheus must be 'HOST:PORT', got {prometheus!r}")
    return DaemonConfig(
        nodes=tuple(nodes),
        policy=policy,
        interval_s=_number(sched, "interval_s", 60.0, where, 0.05),
        p=_number(sched, "p", -1.0, where, -1e9),
        restart_cost_s=_number(sched, "restart_cost_s", 30.0, where, 0.0),
        share_slowdown=_number(sched, "share_slowdown", 0.25, where, 0.0),
        warm_resize=warm_resize,
        warm_timeout_s=_number(sched, "warm_timeout_s", 120.0, where, 1.0),
        admin_group=admin_group,
        max_retries=max_retries,
        backoff_s=_number(daemon, "backoff_s", 5.0, where, 0.0),
        stop_grace_s=_number(daemon, "stop_grace_s", 60.0, where, 0.1),
        pg_timeout_s=_number(daemon, "pg_timeout_s", 60.0, where, 1.0),
        node_retry_s=_number(daemon, "node_retry_s", 30.0, where, 0.1),
        checkpoint_root=checkpoint_root,
        allow_group=allow_group,
        max_priority=_whole(limits, "max_priority", 0, where, 0, 1000),
        max_user_connections=_whole(limits, "connections_per_user", 16, where, 1, 256),
        max_user_bytes=_whole(limits, "mib_in_flight_per_user", 32, where, 16, 4096) << 20,
        max_devices_per_user=_optional_whole(limits, "max_devices_per_user", where),
        max_running_per_user=_optional_whole(limits, "max_running_per_user", where),
        max_log_bytes=_size(limits, "limits", "max_log_size", "100M", where, least=4096),
        log_keep_free=_size(limits, "limits", "log_keep_free", "1G", where),
        notify_backlog_per_user=_whole(limits, "notify_backlog_per_user", 100, where, 1, 1_000_000),
        default_time_s=default_time,
        max_time_s=max_time,
        max_queued_per_user=_whole(limits, "max_queued_per_user", 1000, where, 1, 10_000_000),
        max_array_size=_whole(limits, "max_array_size", 1000, where, 1, 10_000),
        # above the 2 MiB that exec takes with Linux's usual 8 MiB stack: no job that could
        # run is refused
        max_command_bytes=_size(limits, "limits", "max_command_size", "4M", where),
        max_stored_per_user=_size(limits, "limits", "max_stored_per_user", "64M", where),
        max_ended_per_user=_whole(limits, "max_ended_per_user", 10_000, where, 0, 100_000_000),
        max_ended_stored_per_user=(
            0  # no bound but the count
            if limits.get("max_ended_stored_per_user") in (0, "0")
            else _size(limits, "limits", "max_ended_stored_per_user", "256M", where, least=4096)
        ),
        groups=admin_groups(data.get("groups", {}), where),
        accounts=account_tables(data.get("accounts", {}), where),
        user_groups=_whole(limits, "user_groups", 4, where, 0, 1000),
        **host_limits(limits, where),
        reserved=reserved_devices(devices_table.get("reserved", []), nodes, where),
        busy_memory=_size(devices_table, "devices", "busy_memory", "1G", where),
        max_jobs_per_device=_whole(
            devices_table, "max_jobs_per_device", DEFAULT_MAX_JOBS_PER_DEVICE, where, 1, 64
        ),
        notify_command=notify_command,
        notify_on=notify_on,
        notify_desktop=desktop,
        prometheus=prometheus,
        source=where,
        warnings=(
            *warnings,
            *check_local_gpus(
                nodes, "--devices" if devices is not None else f"{where}: nodes", force
            ),
        ),
    )


def _size(
    table: dict[str, Any], section: str, key: str, default: str, where: str, least: int = 1
) -> int:
    """``[section] key``, a size written as people do (``"1G"``, ``"512M"``, or a number of
    bytes), in bytes; at least ``least``."""
    try:
        size = parse_size(table.get(key, default))
    except SizeError as exc:
        raise PolluxError(f"{where}: [{section}] {key}: {exc}") from None
    if size < least:
        raise PolluxError(
            f"{where}: [{section}] {key} must be at least {format_size(least)}, got {size} bytes"
        )
    return size


def host_limits(limits: dict[str, Any], where: str) -> dict[str, Any]:
    """``[limits]``'s host memory and CPU keys as :class:`DaemonConfig` fields (a default
    above its cap refused)."""
    found: dict[str, Any] = {}
    for key, field in (("default_mem", "default_host_memory"), ("max_mem", "max_host_memory")):
        if key in limits:
            found[field] = _size(limits, "limits", key, "", where, least=4 << 20)
    for key in ("default_cpus", "max_cpus"):
        if key in limits:
            found[key] = _number(limits, key, 0.0, where, 0.01)
    for default, cap, name in (
        ("default_host_memory", "max_host_memory", "default_mem"),
        ("default_cpus", "max_cpus", "default_cpus"),
    ):
        low, high = found.get(default), found.get(cap)
        if low is not None and high is not None and low > high:
            raise PolluxError(f"{where}: [limits] {name} is more than its cap")
    for key in ("cgroup_root", "cgroup_parent"):
        value = limits.get(key)
        if value is not None:
            if not isinstance(value, str) or not value.startswith("/") or ".." in value.split("/"):
                raise PolluxError(f"{where}: [limits] {key} must be an absolute path")
            found[key] = value
    return found


def admin_groups(raw: Any, where: str) -> tuple[GroupConfig, ...]:
    """``[groups.NAME]`` tables, each with an optional ``max_devices`` and ``max_running``."""
    if not isinstance(raw, dict):
        raise PolluxError(f"{where}: groups must be [groups.NAME] tables")
    groups = []
    for name, table in raw.items():
        if not GROUP_NAME.match(name):
            raise PolluxError(
                f"{where}: [groups.{name}]: a group's name is letters, digits and _.- (at most 64)"
            )
        if not isinstance(table, dict):
            raise PolluxError(f"{where}: [groups.{name}] must be a table")
        check_keys(table, GROUP_KEYS, f"groups.{name}", where)
        groups.append(
            GroupConfig(
                name=name,
                max_devices=_optional_whole(table, "max_devices", f"{where}: [groups.{name}]"),
                max_running=_optional_whole(table, "max_running", f"{where}: [groups.{name}]"),
            )
        )
    return tuple(groups)


def account_tables(raw: Any, where: str) -> tuple[AccountConfig, ...]:
    """``[accounts.NAME]`` tables, each naming who may charge it: ``users`` (user names) and
    ``unix_group`` (a group's members)."""
    if not isinstance(raw, dict):
        raise PolluxError(f"{where}: accounts must be [accounts.NAME] tables")
    found = []
    for name, table in raw.items():
        at = f"{where}: [accounts.{name}]"
        if not GROUP_NAME.match(name):
            raise PolluxError(f"{at}: an account's name is letters, digits and _.- (at most 64)")
        if not isinstance(table, dict):
            raise PolluxError(f"{at} must be a table")
        check_keys(table, ACCOUNT_KEYS, f"accounts.{name}", where)
        users = table.get("users", [])
        if not isinstance(users, list) or not all(
            isinstance(user, str) and user and user.isprintable() for user in users
        ):
            raise PolluxError(f"{at}: users must be a list of user names")
        group = table.get("unix_group")
        if group is not None and (not isinstance(group, str) or not group.isprintable()):
            raise PolluxError(f"{at}: unix_group must be a group's name")
        if not users and group is None:
            raise PolluxError(f"{at}: names no one who may charge it (give users or unix_group)")
        found.append(AccountConfig(name=name, users=frozenset(users), unix_group=group or None))
    return tuple(found)


def _optional_whole(table: dict[str, Any], key: str, where: str) -> int | None:
    if key not in table:
        return None
    return _whole(table, key, 0, where, 1, 1_000_000)


def _duration(table: dict[str, Any], key: str, where: str) -> float | None:
    value = table.get(key)
    if value is None:
        return None
    if not isinstance(value, str):
        raise PolluxError(f'{where}: {key} must be a duration such as "2h", got {value!r}')
    try:
        return parse_duration(value)
    except DurationError as exc:
        raise PolluxError(f"{where}: {key}: {exc}") from None


def resolve_target(target: str, nodes: Sequence[NodeConfig]) -> str:
    """A drain target or reserved device as ``node`` or ``node:device``: a node's name, a
    device of this machine (``cuda:3``: the first local node's) or ``node:device``;
    :class:`PolluxError` naming it when it is none of these."""
    names = {node.name: node for node in nodes}
    if target in names:
        return target
    local = next((node for node in nodes if node.is_local and target in node.devices), None)
    if local is not None:
        return f"{local.name}:{target}"
    node_name, sep, device = target.partition(":")
    node = names.get(node_name)
    if sep and node is not None and device in node.devices:
        return f"{node.name}:{device}"
    raise PolluxError(f"no node or device {target!r} (nodes: {', '.join(names)})")


def reserved_devices(raw: Any, nodes: Sequence[NodeConfig], where: str) -> tuple[str, ...]:
    """``[devices] reserved`` as ``node:device`` entries (each must name a configured device)."""
    if not isinstance(raw, list) or not all(isinstance(item, str) for item in raw):
        raise PolluxError(f"{where}: [devices] reserved must be a list of devices")
    resolved = []
    for item in raw:
        try:
            target = resolve_target(item, nodes)
        except PolluxError as exc:
            raise PolluxError(f"{where}: [devices] reserved: {exc}") from None
        if ":" not in target:
            raise PolluxError(f"{where}: [devices] reserved lists devices, not node {item!r}")
        resolved.append(target)
    return tuple(dict.fromkeys(resolved))


def check_local_gpus(nodes: Sequence[NodeConfig], where: str, force: bool) -> tuple[str, ...]:
    """This machine's CUDA devices (``--devices`` or a local node's ``devices``) that NVML does
    not see (no driver, no such GPU): refused in one line, or with ``force`` scheduled anyway
    and said in a warning (returned).  A remote node's devices are not checked from here."""
    wanted = [d for node in nodes if node.is_local for d in node.devices if d.startswith("cuda:")]
    if not wanted:
        return ()
    seen = set(discover_gpus())
    unseen = [device for device in wanted if device not in seen]
    if not unseen:
        return ()
    what = (
        f"{where}: {', '.join(unseen)} not seen by NVML on this machine"
        f" ({len(seen)} GPU(s) seen: no NVIDIA driver, or no such GPU)"
    )
    if not force:
        raise PolluxError(f"{what}; daemon --force schedules them anyway")
    return (f"{what}; scheduling them anyway (--force)",)


def busy_gpus(own_pids: set[int], min_bytes: int = gpus.DEFAULT_BUSY_BYTES) -> set[str]:
    """GPUs of this machine where compute processes that are not the scheduler's use at least
    ``min_bytes`` (``[devices] busy_memory``) of memory together."""
    return {f"cuda:{index}" for index in gpus.processes_outside(own_pids, min_bytes)}
