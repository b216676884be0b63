"""Replicas on other nodes through the OpenSSH client.

One ``ssh`` session per node per job incarnation runs the node-side supervisor there: the
source of ``node_agent.py`` (standard library only), sent as ``python3 -u -c <source>``, so that
the node needs no pollux-local installed.  The supervisor receives the replicas to start as one
JSON line on its stdin (so environments never appear in the node's process list), starts each
replica in its own session/process group with exactly the environment the daemon built, writes
each replica's output to a log file in the node's work dir, streams that log back to the
daemon, and reports ``PID``/``EXIT`` lines (the protocol is in ``node_agent.py``).  Commands the
daemon sends on the same stdin (``TERM``/``KILL``) signal the replicas' process groups; when the
stdin closes (daemon gone, link lost and noticed by the node's sshd) the supervisor stops its
replicas itself, so no orphan keeps running.

Each node's supervisor keeps an exit record there (``WORKDIR/run/<key>/<job id>.json``, the
key naming this daemon's state): a restarted daemon reads it over ssh
(:meth:`SshLauncher.recover`) and applies the recorded exit of a job that ended while it was
down, or waits for the replicas still stopping, rather than running a finished job again.

Connections are shared (``ControlMaster``/``ControlPersist``) under the daemon's state dir, so
that only the first contact with a node pays for a login.  ``ServerAliveInterval`` x
``ServerAliveCountMax`` bounds the time to notice a dead link: every session of that node then
exits with 255 and its replicas count as unreachable (exit code 255).

The package's rooms: ``nodes`` (a node's settings, the agent's source, the exit codes),
``group`` (a running incarnation's sessions), ``recovery`` (exit records read after a daemon
restart) and ``launcher`` (:class:`SshLauncher`).
"""

from pollux_local.launch.ssh.group import SshReplicaGroup
from pollux_local.launch.ssh.launcher import SshLauncher
from pollux_local.launch.ssh.nodes import (
    SETUP_FAILED_EXIT_CODE,
    UNREACHABLE_EXIT_CODE,
    SshNodeConfig,
    node_agent_source,
    signal_name,
)
from pollux_local.launch.ssh.recovery import SshRecordedGroup, record_token

__all__ = [
    "SETUP_FAILED_EXIT_CODE",
    "UNREACHABLE_EXIT_CODE",
    "SshLauncher",
    "SshNodeConfig",
    "SshRecordedGroup",
    "SshReplicaGroup",
    "node_agent_source",
    "record_token",
    "signal_name",
]
