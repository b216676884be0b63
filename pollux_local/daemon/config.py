"""Daemon configuration: a TOML file, the embedded defaults and device discovery.

With no file the daemon schedules this machine alone: its GPUs found through NVML, or, on a
machine without any (or with ``--devices cpu:N``), N CPU-backed devices.  A file looks like::

    [scheduler]
    policy = "goodput"        # or "fifo" ("pollux": another name for "goodput")
    interval_s = 60
    p = -1.0                  # fairness exponent of the goodput policy
    restart_cost_s = 30

    [daemon]
    admin_group = "wheel"     # members may cancel/hold any job and raise priorities
    allow_group = "lab"       # a daemon not run by root serves only its own user (socket
                              # 0600); this opens it to the group's members (socket 0660)
    max_retries = 3           # crash restarts before a job fails
    backoff_s = 5             # first retry delay, doubled each time
    stop_grace_s = 60         # SIGTERM -> checkpoint exit wait before SIGKILL
    pg_timeout_s = 60         # POLLUX_PG_TIMEOUT_S given to jobs
    node_retry_s = 30         # how often a node marked down is checked again
    checkpoint_root = "/shared/ckpt"  # jobs checkpoint under ROOT/<job id> (default: the
                              # job's directory in the state dir; must be shared by all nodes)

    [[nodes]]
    name = "box2"
    host = "box2"             # an ssh destination; "localhost" or none = this machine
    devices = "cuda:0,1"      # or ["cuda:0", "cuda:1"], or "cpu:4"
    workdir = "/shared/runs"  # optional

    [limits]
    max_priority = 0          # the highest priority a user who is not an admin may give
    connections_per_user = 16 # open connections per user (root and the daemon's user: any)
    mib_in_flight_per_user = 32  # request bytes one user may have the daemon buffer at once
"""

from __future__ import annotations

import contextlib
import difflib
import grp
import socket
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pollux_local.core.names import POLICY_ALIASES
from pollux_local.errors import PolluxError
from pollux_local.tomlfile import read_toml

LOCAL_HOSTS = frozenset({"", "localhost", "127.0.0.1", "::1"})
POLICIES = ("goodput", "fifo")
#: Other names accepted for a policy: the goodput policy is Pollux's.


@dataclass(frozen=True)
class NodeConfig:
    """One node: ``host`` is ``None`` for this machine, else an ssh destination."""

    name: str
    devices: tuple[str, ...]
    host: str | None = None
    workdir: str | None = None
    raw: dict[str, Any] = field(default_factory=dict, hash=False, compare=False)

    @property
    def is_local(self) -> bool:
        return self.host is None or self.host in LOCAL_HOSTS


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
    source: str = "embedded default"
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def total_devices(self) -> int:
        return sum(len(node.devices) for node in self.nodes)

    def node(self, name: str) -> NodeConfig:
        for node in self.nodes:
            if node.name == name:
                return node
        raise KeyError(name)


def discover_gpus() -> list[str]:
    """This machine's NVIDIA GPUs as ``cuda:i``; no driver or library means no GPUs."""
    try:
        import pynvml
    except ImportError:
        return []
    try:
        pynvml.nvmlInit()
    except Exception:  # NVMLError_LibraryNotFound, driver not loaded, ...
        return []
    try:
        return [f"cuda:{i}" for i in range(pynvml.nvmlDeviceGetCount())]
    except Exception:
        return []
    finally:
        with contextlib.suppress(Exception):
            pynvml.nvmlShutdown()


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


def local_node(devices: str | None = None) -> NodeConfig:
    """This machine as a node: ``devices`` if given, else its GPUs, else two CPU devices."""
    if devices is not None:
        found = parse_devices(devices)
    else:
        found = tuple(discover_gpus()) or parse_devices("cpu:2")
    return NodeConfig(name=socket.gethostname() or "localhost", devices=found)


#: The keys each table of the config may hold (anything else is refused, with a suggestion).
KNOWN_KEYS: dict[str, frozenset[str]] = {
    "scheduler": frozenset({"policy", "interval_s", "p", "restart_cost_s"}),
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
    "limits": frozenset({"max_priority", "connections_per_user", "mib_in_flight_per_user"}),
}


def check_keys(table: dict[str, Any], known: frozenset[str], section: str, where: str) -> None:
    """Refuse a key the table does not know, naming the closest known one (a typo is far more
    likely than a key from a newer version, and silently ignoring it hides the mistake)."""
    for key in sorted(set(table) - known):
        close = difflib.get_close_matches(key, sorted(known), n=1)
        hint = (
            f" (did you mean {close[0]!r}?)" if close else f" (known: {', '.join(sorted(known))})"
        )
        raise PolluxError(f"{where}: unknown key {key!r} in [{section}]{hint}")


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


def load_config(path: str | Path | None = None, devices: str | None = None) -> DaemonConfig:
    """Read the TOML config at ``path`` (or use the embedded default); ``devices`` (the
    ``--devices`` option) replaces the local node's devices."""
    if path is None:
        return DaemonConfig(nodes=(local_node(devices),))
    where = str(path)
    data = read_toml(path, "config file")

    unknown = set(data) - {"scheduler", "daemon", "nodes", "limits"}
    if unknown:
        raise PolluxError(f"{where}: unknown section(s) {', '.join(sorted(unknown))}")
    sched = data.get("scheduler", {})
    daemon = data.get("daemon", {})
    limits = data.get("limits", {})
    if not all(isinstance(table, dict) for table in (sched, daemon, limits)):
        raise PolluxError(f"{where}: [scheduler], [daemon] and [limits] must be tables")
    policy = sched.get("policy", "goodput")
    if isinstance(policy, str):
        policy = POLICY_ALIASES.get(policy, policy)
    if policy not in POLICIES:
        raise PolluxError(f"{where}: policy must be one of {', '.join(POLICIES)}, got {policy!r}")
    admin_group = daemon.get("admin_group")
    if admin_group is not None and not isinstance(admin_group, str):
        raise PolluxError(f"{where}: admin_group must be a group name")
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
    for section, table in (("scheduler", sched), ("daemon", daemon), ("limits", limits)):
        check_keys(table, KNOWN_KEYS[section], section, where)

    raw_nodes = data.get("nodes")
    nodes: list[NodeConfig] = []
    if raw_nodes is None:
        nodes.append(local_node(devices))
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
                node_devices = local_node().devices
            else:
                raise PolluxError(f"{node_where}: a remote node needs 'devices'")
            workdir = raw.get("workdir")
            if workdir is not None and not isinstance(workdir, str):
                raise PolluxError(f"{node_where}: workdir must be a path")
            nodes.append(
                NodeConfig(name=name, devices=node_devices, host=host, workdir=workdir, raw=raw)
            )
        names = [node.name for node in nodes]
        if len(set(names)) != len(names):
            raise PolluxError(f"{where}: node names must be unique, got {names}")

    checkpoint_root = daemon.get("checkpoint_root")
    if checkpoint_root is not None and (
        not isinstance(checkpoint_root, str) or not checkpoint_root.startswith("/")
    ):
        raise PolluxError(f"{where}: checkpoint_root must be an absolute path")
    max_retries = daemon.get("max_retries", 3)
    if isinstance(max_retries, bool) or not isinstance(max_retries, int) or max_retries < 0:
        raise PolluxError(f"{where}: max_retries must be a whole number >= 0")
    return DaemonConfig(
        nodes=tuple(nodes),
        policy=policy,
        interval_s=_number(sched, "interval_s", 60.0, where, 0.05),
        p=_number(sched, "p", -1.0, where, -1e9),
        restart_cost_s=_number(sched, "restart_cost_s", 30.0, where, 0.0),
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
        source=where,
    )


def busy_gpus(own_pids: set[int]) -> set[str]:
    """GPUs of this machine running compute processes that are not the scheduler's."""
    try:
        import pynvml

        pynvml.nvmlInit()
    except Exception:
        return set()
    busy: set[str] = set()
    try:
        for index in range(pynvml.nvmlDeviceGetCount()):
            handle = pynvml.nvmlDeviceGetHandleByIndex(index)
            procs = pynvml.nvmlDeviceGetComputeRunningProcesses(handle)
            if any(proc.pid not in own_pids for proc in procs):
                busy.add(f"cuda:{index}")
    except Exception:
        return busy
    finally:
        with contextlib.suppress(Exception):
            pynvml.nvmlShutdown()
    return busy
