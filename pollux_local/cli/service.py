"""``pollux-local service --system|--user``: the systemd unit that runs the daemon.

    pollux-local service --system                 # print the lab's unit (a root daemon)
    sudo pollux-local service --system --write    # /etc/systemd/system/pollux-local.service
    pollux-local service --user --write           # ~/.config/systemd/user/pollux-local.service

``ExecStart`` names this very installation: the ``pollux-local`` script beside the running
interpreter (``python -m pollux_local`` when there is none).  ``systemctl reload`` sends
SIGHUP, which makes the daemon read its config again without stopping a job.  The units in
``deploy/`` are this command's output for the lab install (``/opt/pollux-local``).
"""

from __future__ import annotations

import argparse
import os
import re
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path

from pollux_local.api.errors import PolluxError

UNIT_NAME = "pollux-local.service"
SYSTEM_UNIT_DIR = Path("/etc/systemd/system")
SYSTEM_CONFIG = "/etc/pollux-local/config.toml"
SYSTEM_STATE_DIR = "/var/lib/pollux-local"
#: the user's state directory as systemd names it (``%S``: ``$XDG_STATE_HOME``), the CLI's
#: default state directory
USER_STATE_DIR = "%S/pollux-local"

SYSTEM_HEAD = """\
# The lab's pollux-local daemon, as root: it schedules this machine's GPUs (and any SSH nodes
# in the config) for every user and runs each job as its submitter.
#
# Install (docs/deploy.md):  pollux-local service --system --write   (writes this file to
#                            /etc/systemd/system/pollux-local.service)
#                            systemctl daemon-reload && systemctl enable --now pollux-local
# Config changed:            systemctl reload pollux-local   (SIGHUP: read again; jobs run on)
# Logs:                      journalctl -u pollux-local   (also {state_dir}/daemon.log)

[Unit]
Description=pollux-local: goodput-optimising GPU scheduler for the lab
After=network-online.target
Wants=network-online.target

[Service]
Type=simple
ExecStart={exec_start}
ExecReload=/bin/kill -HUP $MAINPID
"""

SYSTEM_STATE_DIRECTORY = """\
# {state_dir}, root's, 0755: users reach the socket, nobody else writes there
StateDirectory={name}
StateDirectoryMode=0755
"""

SYSTEM_TAIL = """\
UMask=0022
Environment=PYTHONUNBUFFERED=1
# On SIGTERM the daemon checkpoint-stops every running job that may be stopped (SIGTERM to
# each, SIGKILL after stop_grace_s = 60 s) and queues it again, waiting up to stop_grace_s +
# 15 s: give it that long; a rigid job that is not --preemptible runs on.  Each job runs under
# a supervisor process of its own that outlives the daemon (a restarted daemon adopts the jobs
# still running), so systemd signals the daemon alone and leaves the supervisors to it
# (process), also when the daemon crashes.
KillMode=process
KillSignal=SIGTERM
TimeoutStopSec=90
Restart=on-failure
RestartSec=5
# A job's --mem and --cpus are cgroups the daemon makes below its own: the unit's cgroup is
# delegated to it (ProtectControlGroups= would make /sys/fs/cgroup read-only and turn the
# limits off).
Delegate=yes
# Jobs run under this unit as their submitters, in their home directories, with the GPUs, so
# what would take those from them is left out (ProtectHome=, PrivateTmp=, PrivateDevices=,
# DevicePolicy=, ProtectClock=, which restricts devices, ProtectKernelModules= and
# NoNewPrivileges=, which stop nvidia-modprobe from loading the driver at a job's first CUDA
# call).  What no job needs is closed:
ProtectSystem=full
ProtectKernelTunables=yes
ProtectKernelLogs=yes
ProtectHostname=yes
RestrictRealtime=yes
LockPersonality=yes

[Install]
WantedBy=multi-user.target
"""

USER_UNIT = """\
# A personal pollux-local daemon, as its user: only that user's CLI may talk to it, and every
# job runs as that user.  The state dir is the CLI's default (~/.local/state/pollux-local), so
# `pollux-local status` finds it without options.
#
# Install (docs/deploy.md):  pollux-local service --user --write   (writes this file to
#                            ~/.config/systemd/user/pollux-local.service)
#                            systemctl --user daemon-reload
#                            systemctl --user enable --now pollux-local
# Config changed:            systemctl --user reload pollux-local   (SIGHUP; jobs run on)
# Logs:                      journalctl --user -u pollux-local

[Unit]
Description=pollux-local: personal GPU scheduler daemon

[Service]
Type=simple
# %S is $XDG_STATE_HOME (~/.local/state); add --devices cuda:I,J to leave the lab's GPUs alone
ExecStart={exec_start}
ExecReload=/bin/kill -HUP $MAINPID
Environment=PYTHONUNBUFFERED=1
# the daemon stops its jobs itself; their supervisors outlive a crash of it (see the system unit)
KillMode=process
KillSignal=SIGTERM
TimeoutStopSec=90
Restart=on-failure
RestartSec=5

[Install]
WantedBy=default.target
"""


def systemd_word(word: str, specifiers: bool = False) -> str:
    """``word`` as one argument of a unit's ``ExecStart=``: ``%`` and ``$`` kept literal
    (``%%``, ``$$``; with ``specifiers``, ``%`` is left for systemd to expand), quoted when
    it holds white space or quotes."""
    text = word.replace("\\", "\\\\")
    if not specifiers:
        text = text.replace("%", "%%")
    text = text.replace("$", "$$")
    if re.search(r"[\s\"';]", text) or not text:
        text = '"' + text.replace('"', '\\"') + '"'
    return text


def daemon_program() -> list[str]:
    """How to run this installation's ``pollux-local``: the script beside the running
    interpreter (not resolved: a venv's ``bin`` stays the venv's) when its ``#!`` line is that
    interpreter, else ``PYTHON -m pollux_local``."""
    python = Path(os.path.abspath(sys.executable))
    script = python.parent / "pollux-local"
    try:
        with open(script, "rb") as fh:
            first = fh.readline(4096).decode(errors="replace")
    except OSError:
        first = ""
    interpreter = first[2:].strip().split(" ")[0] if first.startswith("#!") else ""
    if interpreter and os.access(script, os.X_OK):
        try:
            if Path(interpreter).resolve() == python.resolve():
                return [str(script)]
        except OSError:
            pass
    return [str(python), "-m", "pollux_local"]


def render_unit(
    scope: str,
    program: Sequence[str],
    config: str | None = None,
    state_dir: str | None = None,
    devices: str | None = None,
) -> str:
    """The unit of a lab daemon (``scope`` ``system``: root, ``/var/lib/pollux-local``, the
    config in ``/etc/pollux-local``) or of a personal one (``user``: the user's state dir)."""
    if scope == "system":
        config = SYSTEM_CONFIG if config is None else config
        state_dir = SYSTEM_STATE_DIR if state_dir is None else state_dir
    words = [systemd_word(word) for word in (*program, "daemon")]
    if config is not None:
        words += ["--config", systemd_word(config)]
    if state_dir is None:
        words += ["--state-dir", USER_STATE_DIR]
    else:
        words += ["--state-dir", systemd_word(state_dir)]
    if devices is not None:
        words += ["--devices", systemd_word(devices)]
    exec_start = " ".join(words)
    if scope == "user":
        return USER_UNIT.format(exec_start=exec_start)
    assert state_dir is not None
    text = SYSTEM_HEAD.format(exec_start=exec_start, state_dir=state_dir)
    managed = re.fullmatch(r"/var/lib/([A-Za-z0-9_.-]+)", state_dir.rstrip("/"))
    if managed:  # systemd makes it, root's and 0755, before the daemon starts
        text += SYSTEM_STATE_DIRECTORY.format(state_dir=state_dir, name=managed.group(1))
    return text + SYSTEM_TAIL


def unit_path(scope: str) -> Path:
    """Where systemd looks for the unit: ``/etc/systemd/system``, or the user's
    ``$XDG_CONFIG_HOME/systemd/user`` (``~/.config/systemd/user``)."""
    if scope == "system":
        return SYSTEM_UNIT_DIR / UNIT_NAME
    config_home = os.environ.get("XDG_CONFIG_HOME") or os.path.expanduser("~/.config")
    return Path(config_home) / "systemd" / "user" / UNIT_NAME


def write_unit(path: Path, text: str) -> bool:
    """Write ``text`` to ``path`` (0644, atomically, its directory made); ``False`` when the
    file already held it."""
    try:
        if path.read_text() == text:
            return False
    except OSError:
        pass
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, temporary = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
        try:
            with os.fdopen(fd, "w") as fh:
                # by the descriptor: in a directory others may write to, the name could be
                # swapped for a link to any file before a chmod by path (root would chmod it)
                os.fchmod(fh.fileno(), 0o644)
                fh.write(text)
            os.replace(temporary, path)
        except BaseException:
            os.unlink(temporary)
            raise
    except OSError as exc:
        raise PolluxError(
            f"cannot write {path}: {exc.strerror or exc} (print the unit without --write, or"
            " run as a user who may write there)"
        ) from None
    return True


def _absolute(path: str | None) -> str | None:
    return None if path is None else os.path.abspath(os.path.expanduser(path))


def cmd_service(args: argparse.Namespace) -> int:
    scope = "system" if args.system else "user"
    if args.devices is not None:
        from pollux_local.daemon.config import parse_devices

        parse_devices(args.devices)  # a mistake is refused here, not at the daemon's start
    text = render_unit(
        scope,
        daemon_program(),
        config=_absolute(args.config),
        state_dir=_absolute(args.state_dir),
        devices=args.devices,
    )
    if not (args.write or args.output):
        sys.stdout.write(text)
        return 0
    path = Path(_absolute(args.output) or unit_path(scope))
    changed = write_unit(path, text)
    print(f"{'wrote' if changed else 'unchanged:'} {path}")
    config = _absolute(args.config) or (SYSTEM_CONFIG if scope == "system" else None)
    if config is not None and not os.path.exists(config):
        print(f"note: {config} does not exist yet; the daemon will not start without it"
              " (deploy/config.toml is an example)")  # fmt: skip
    systemctl = "systemctl" if scope == "system" else "systemctl --user"
    print(f"next: {systemctl} daemon-reload && {systemctl} enable --now pollux-local")
    return 0


def register(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = subparsers.add_parser(
        "service",
        help="print or write the systemd unit that runs the daemon",
        description=__doc__.split("\n\n")[0],
    )
    scope = p.add_mutually_exclusive_group(required=True)
    scope.add_argument(
        "--system", action="store_true", help="the lab's daemon, as root (a system unit)"
    )
    scope.add_argument("--user", action="store_true", help="a personal daemon (a user unit)")
    p.add_argument(
        "--write",
        action="store_true",
        help=f"write it where systemd looks ({SYSTEM_UNIT_DIR}/{UNIT_NAME}, or"
        f" ~/.config/systemd/user/{UNIT_NAME}) instead of printing it",
    )
    p.add_argument("--output", metavar="FILE", help="write it to FILE instead")
    p.add_argument(
        "--config",
        metavar="PATH",
        help=f"the daemon's config file (--system: {SYSTEM_CONFIG}; --user: none)",
    )
    p.add_argument(
        "--state-dir",
        metavar="DIR",
        help=f"the daemon's state directory (--system: {SYSTEM_STATE_DIR}; --user:"
        " ~/.local/state/pollux-local, the CLI's default)",
    )
    p.add_argument("--devices", help="the daemon's --devices, e.g. cuda:2,3")
    p.set_defaults(func=cmd_service)
