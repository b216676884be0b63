"""``pollux-local daemon``: run the scheduler daemon in the foreground."""

from __future__ import annotations

import argparse
import dataclasses
from pathlib import Path
from typing import Any

from pollux_local.api.errors import PolluxError
from pollux_local.cli.common import state_dir_parser
from pollux_local.client import resolve_state_dir
from pollux_local.core.names import POLICY_ALIASES, canonical_policy, policy_names


def cmd_daemon(args: argparse.Namespace) -> int:
    from pollux_local.daemon.config import load_config
    from pollux_local.daemon.server import run_daemon

    config = load_config(args.config, args.devices, force=args.force)
    overrides: dict[str, Any] = {}  # the command line's settings, kept over a reload's
    if args.interval is not None:
        if args.interval <= 0:
            raise PolluxError(f"--interval must be positive, got {args.interval}")
        overrides["interval_s"] = args.interval
    if args.policy is not None:
        overrides["policy"] = canonical_policy(args.policy)
    if use_slurm(args.launcher):
        from pollux_local.daemon.config import slurm_nodes
        from pollux_local.launch.slurm import read_allocation

        # the allocation's nodes replace the config's, and stay over a reload
        overrides["nodes"] = slurm_nodes(read_allocation())
    config = dataclasses.replace(config, **overrides)
    return run_daemon(
        config,
        resolve_state_dir(args.state_dir),
        verbose=args.verbose,
        reset_state=args.reset_state,
        config_path=Path(args.config).absolute() if args.config else None,
        devices=args.devices,
        overrides=overrides,
        force_devices=args.force,
    )


def use_slurm(launcher: str) -> bool:
    """Whether the daemon's jobs run as Slurm job steps: ``--launcher slurm``, or ``auto``
    inside an allocation (``SLURM_JOB_ID`` set)."""
    if launcher == "auto":
        from pollux_local.launch.slurm import in_allocation

        return in_allocation()
    return launcher == "slurm"


def register(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = subparsers.add_parser(
        "daemon", parents=[state_dir_parser()], help="run the scheduler daemon (foreground)"
    )
    p.add_argument("--config", help="TOML config (nodes, devices, interval, policy)")
    p.add_argument("--devices", help="this machine's devices, e.g. cpu:2 or cuda:0,1")
    p.add_argument(
        "--force",
        action="store_true",
        help="schedule this machine's CUDA devices (--devices, or the config's) even when NVML "
        "does not see them (a warning in the log); without it the daemon refuses to start",
    )
    p.add_argument("--interval", type=float, help="scheduling interval in seconds")
    p.add_argument(
        "--launcher",
        choices=("auto", "config", "slurm"),
        default="auto",
        help="where jobs run: the config's nodes (config), job steps of the Slurm allocation"
        " the daemon runs in (slurm), or slurm when SLURM_JOB_ID is set (auto, the default)",
    )
    p.add_argument(
        "--policy",
        choices=(*policy_names(daemon=True), *POLICY_ALIASES),
        help="allocation policy (goodput, the default; pollux is another name for it)",
    )
    p.add_argument("-v", "--verbose", action="store_true", help="log debug messages")
    p.add_argument(
        "--reset-state",
        action="store_true",
        help="start afresh when the state database is damaged or missing: the old database and "
        "jobs/ are moved aside into reset-<time>/ (nothing is deleted)",
    )
    p.set_defaults(func=cmd_daemon)
