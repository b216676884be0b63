"""Reading the config again without stopping a job (``SIGHUP``, ``Daemon.reload_config``).

A device the new config no longer lists (a node removed, or a device taken off a node) may
still be held by a running job: the job keeps it until it ends.  Until then the device stays in
the config the daemon uses, as a reserved device (no new job is given it), and it is dropped
once no job holds it (:func:`effective_config`, called again as jobs end).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Collection, Iterable, Mapping

from pollux_local.api.states import PLACED_STATES
from pollux_local.daemon.config import DaemonConfig, NodeConfig
from pollux_local.daemon.executor import Executor
from pollux_local.daemon.state import StateStore

#: The settings a reload may change that are worth a line in the log, with their config names.
SETTINGS = {
    "policy": "policy",
    "interval_s": "interval_s",
    "p": "p",
    "restart_cost_s": "restart_cost_s",
    "admin_group": "admin_group",
    "allow_group": "allow_group",
    "max_retries": "max_retries",
    "backoff_s": "backoff_s",
    "stop_grace_s": "stop_grace_s",
    "pg_timeout_s": "pg_timeout_s",
    "node_retry_s": "node_retry_s",
    "checkpoint_root": "checkpoint_root",
    "max_priority": "max_priority",
    "max_user_connections": "connections_per_user",
    "max_user_bytes": "mib_in_flight_per_user (bytes)",
    "max_devices_per_user": "max_devices_per_user",
    "max_running_per_user": "max_running_per_user",
    "default_time_s": "default_time (s)",
    "max_time_s": "max_time (s)",
    "reserved": "reserved",
    "notify_command": "[notify] command",
    "notify_on": "[notify] on",
    "notify_desktop": "[notify] desktop",
    "prometheus": "[metrics] prometheus",
    "share_slowdown": "share_slowdown",
    "warm_resize": "warm_resize",
    "warm_timeout_s": "warm_timeout_s",
    "max_log_bytes": "max_log_size (bytes)",
    "log_keep_free": "log_keep_free (bytes)",
    "notify_backlog_per_user": "notify_backlog_per_user",
    "max_queued_per_user": "max_queued_per_user",
    "max_array_size": "max_array_size",
    "max_command_bytes": "max_command_size (bytes)",
    "max_stored_per_user": "max_stored_per_user (bytes)",
    "max_ended_per_user": "max_ended_per_user",
    "max_ended_stored_per_user": "max_ended_stored_per_user (bytes)",
    "busy_memory": "[devices] busy_memory (bytes)",
    "groups": "[groups]",
    "accounts": "[accounts]",
    "user_groups": "user_groups",
    "default_host_memory": "default_mem (bytes)",
    "max_host_memory": "max_mem (bytes)",
    "default_cpus": "default_cpus",
    "max_cpus": "max_cpus",
    "cgroup_root": "cgroup_root",
    "cgroup_parent": "cgroup_parent",
    "max_jobs_per_device": "[devices] max_jobs_per_device",
}
#: What a reload does not name among the settings: the nodes (said apart) and where the
#: config came from.
NOT_SETTINGS = ("nodes", "source", "warnings")
#: The settings the policy object is built from (a change rebuilds it).
POLICY_SETTINGS = ("policy", "interval_s", "p", "restart_cost_s")


def held_devices(executor: Executor, store: StateStore) -> dict[str, set[str]]:
    """node -> devices held now: by the replica groups running or stopping, and by the jobs
    the store records as placed."""
    held: dict[str, set[str]] = {}
    for groups in (executor.groups, executor.stopping):
        for group in groups.values():
            for slot in group.spec.slots:
                held.setdefault(slot.node, set()).add(slot.device)
    for job in store.jobs(PLACED_STATES):
        for node, devices in job.placement.items():
            held.setdefault(node, set()).update(devices)
    return held


def effective_config(
    loaded: DaemonConfig, held: Mapping[str, Collection[str]], previous: DaemonConfig
) -> tuple[DaemonConfig, dict[str, list[str]]]:
    """The config to use: ``loaded`` (the file as read), plus each device it no longer lists
    that a job still holds (taken from ``previous``, the config in use), reserved.  Returns it
    and those kept devices (node -> devices)."""
    nodes = {node.name: node for node in loaded.nodes}
    old_nodes = {node.name: node for node in previous.nodes}
    kept: dict[str, list[str]] = {}
    for name, devices in held.items():
        listed = nodes[name].devices if name in nodes else ()
        order = old_nodes[name].devices if name in old_nodes else ()
        # in the previous config's order, then any it did not list (a start's: the config
        # the job was started under is gone)
        order = (*order, *sorted(d for d in devices if d not in order))
        missing = [d for d in order if d in devices and d not in listed]
        if not missing:
            continue
        if name in nodes:
            nodes[name] = dataclasses.replace(nodes[name], devices=(*listed, *missing))
        elif name in old_nodes:
            nodes[name] = dataclasses.replace(old_nodes[name], devices=tuple(missing))
        else:
            continue  # never configured here: nothing to keep it under
        kept[name] = missing
    if not kept:
        return loaded, kept
    extra = [f"{name}:{device}" for name, devices in kept.items() for device in devices]
    # a device of this machine kept under one local node waits for the job under any other
    # local node that now lists it too (a node renamed, a device moved to another node): it
    # is one device, and two jobs ran on it
    for name, devices in kept.items():
        if nodes[name].is_local:
            extra += [
                f"{other.name}:{device}"
                for other in loaded.nodes
                if other.is_local and other.name != name
                for device in devices
                if device in other.devices
            ]
    config = dataclasses.replace(
        loaded,
        nodes=tuple(nodes.values()),
        reserved=tuple(dict.fromkeys((*loaded.reserved, *extra))),
    )
    return config, kept


def config_changes(old: DaemonConfig, new: DaemonConfig) -> list[str]:
    """What differs between two configs, one short phrase each (for the reload's log line)."""
    changes = list(_node_changes(old.nodes, new.nodes))
    for attribute, name in SETTINGS.items():
        before, after = getattr(old, attribute), getattr(new, attribute)
        if before != after:
            changes.append(f"{name} {_show(before)} -> {_show(after)}")
    return changes


def _node_changes(old: Iterable[NodeConfig], new: Iterable[NodeConfig]) -> Iterable[str]:
    before = {node.name: node for node in old}
    after = {node.name: node for node in new}
    for name, node in after.items():
        if name not in before:
            yield f"node {name} added ({_devices(node)})"
        elif before[name] != node:
            yield f"node {name}: {_devices(before[name])} -> {_devices(node)}"
    for name in before.keys() - after.keys():
        yield f"node {name} removed"


def _devices(node: NodeConfig) -> str:
    where = f" on {node.host}" if not node.is_local else ""
    return f"{','.join(node.devices)}{where}, type {node.device_type}"


def _show(value: object) -> str:
    if isinstance(value, tuple):
        return "[" + ", ".join(map(str, value)) + "]"
    return "none" if value is None else str(value)
