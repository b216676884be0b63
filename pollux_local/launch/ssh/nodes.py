"""One SSH node's settings (:class:`SshNodeConfig`, checked once by
:meth:`SshNodeConfig.from_table` when the daemon's config is read), the node agent's source
sent to it, and the exit codes of a node that could not be reached or could not start its
replicas."""

from __future__ import annotations

import ast
import contextlib
import functools
import importlib.resources
import shlex
import signal
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from pollux_local.api.states import ExitCode
from pollux_local.errors import PolluxError

#: Exit code of a replica whose node could not be reached (ssh's own failure code).
UNREACHABLE_EXIT_CODE: int = ExitCode.NODE_LOST
#: Exit code when the node's agent could not start the replicas (bad work dir, unshared path).
SETUP_FAILED_EXIT_CODE: int = ExitCode.NODE_SETUP


@functools.cache
@functools.lru_cache(maxsize=1)
def node_agent_source() -> str:
    """The node-side supervisor's program (``launch/node_agent.py``) as the text sent to each
    node and run there with ``python -u -c``: no installation on the node is needed.  Its
    module docstring, for readers of the file, is sent as empty lines (the lines of a
    traceback there stay the file's), which keeps the command well within one argument."""
    package = importlib.resources.files("pollux_local.launch")
    text = package.joinpath("node_agent.py").read_text(encoding="utf-8")
    first = ast.parse(text).body[0]
    if (
        isinstance(first, ast.Expr)
        and isinstance(first.value, ast.Constant)
        and isinstance(first.value.value, str)
        and first.end_lineno is not None
    ):
        lines = text.splitlines(keepends=True)
        text = "\n" * first.end_lineno + "".join(lines[first.end_lineno :])
    return text


#: The longest single argument Linux passes to a program (``MAX_ARG_STRLEN``): the command
#: an SSH node's shell runs reaches it as one (``sh -c COMMAND``), the agent's source in it.
MAX_COMMAND_BYTES = 32 * 4096


def agent_command(python: str, *args: str, unbuffered: bool = False) -> str:
    """The shell command that runs the node agent's source (``-c``) with the node's
    ``python`` and ``args``; :class:`PolluxError` in one line should it not fit in one
    argument (:data:`MAX_COMMAND_BYTES`), which ssh would fail obscurely on the node."""
    words = [python, *(["-u"] if unbuffered else []), "-c", node_agent_source(), *args]
    command = " ".join(shlex.quote(word) for word in words)
    if len(command.encode()) >= MAX_COMMAND_BYTES:
        raise PolluxError(
            f"the node agent's command is {len(command.encode())} bytes, over the"
            f" {MAX_COMMAND_BYTES} one argument may hold on Linux"
        )
    return command


#: The keys of a node's config table that the SSH launcher reads.
SSH_KEYS = frozenset({"host", "address", "workdir", "gloo_ifname", "ssh_options", "python"})


@dataclass(frozen=True)
class SshNodeConfig:
    """One node reached over SSH.

    ``host`` is an ssh destination (``[user@]name``) resolved through the user's
    ``~/.ssh/config``; ``address`` is the address the node's replicas are reached at by the
    other replicas (defaults to the host part of ``host``; used as ``MASTER_ADDR`` when rank 0
    runs there); ``workdir`` holds the replicas' log files on the node; ``gloo_ifname`` is the
    node's network interface for torch.distributed (``GLOO_SOCKET_IFNAME``); ``ssh_options``
    are extra ``ssh`` arguments (e.g. ``["-p", "2222"]``); ``python`` is the interpreter that
    runs the supervisor on the node.
    """

    name: str
    host: str
    devices: tuple[str, ...] = ("cpu:0",)
    address: str | None = None
    workdir: str = "~/.pollux-local"
    gloo_ifname: str | None = None
    ssh_options: tuple[str, ...] = ()
    python: str = "python3"

    @property
    def master_addr(self) -> str:
        """Address other nodes use to reach this one."""
        if self.address:
            return self.address
        return self.host.rsplit("@", 1)[-1]

    @classmethod
    def from_table(
        cls, name: str, table: Mapping[str, Any], devices: Sequence[str]
    ) -> SshNodeConfig:
        """Node ``name``'s settings from its config table (the :data:`SSH_KEYS` in it; its
        other keys are the scheduler's) and its ``devices``: the one check of a node's SSH
        settings, made when the daemon's config is read.  Raises ``PolluxError`` naming the
        node and the setting that is not what ssh needs."""
        host = table.get("host")
        if not isinstance(host, str) or not host or host.startswith("-"):
            raise PolluxError(f"node {name}: 'host' must be an ssh destination such as user@name")
        if not all(isinstance(d, str) and d.partition(":")[0] in ("cpu", "cuda") for d in devices):
            raise PolluxError(f"node {name}: 'devices' must list devices such as 'cuda:0'")
        options = table.get("ssh_options", ())
        if isinstance(options, str):
            options = shlex.split(options)
        if not isinstance(options, list | tuple) or not all(isinstance(o, str) for o in options):
            raise PolluxError(f"node {name}: 'ssh_options' must be a list of strings")
        for key in ("address", "workdir", "gloo_ifname", "python"):
            if key in table and not isinstance(table[key], str):
                raise PolluxError(f"node {name}: '{key}' must be a string")
        return cls(
            name=name,
            host=host,
            devices=tuple(devices),
            address=table.get("address"),
            workdir=table.get("workdir") or "~/.pollux-local",
            gloo_ifname=table.get("gloo_ifname"),
            ssh_options=tuple(options),
            python=table.get("python", "python3"),
        )


def signal_name(code: int) -> str:
    """Human-readable form of a replica exit code (``137`` -> ``SIGKILL``)."""
    if code > 128:
        with contextlib.suppress(ValueError):
            return signal.Signals(code - 128).name
    return str(code)
