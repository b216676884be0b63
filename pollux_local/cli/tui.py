"""``pollux-local tui``: the live terminal view (textual is imported only when it runs)."""

from __future__ import annotations

import argparse
import os
import sys


def register(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    parser = subparsers.add_parser(
        "tui",
        help="live view of the cluster, the jobs and their models (Textual)",
        description="Open the live terminal view connected to the daemon.",
    )
    parser.add_argument("--state-dir", help="the daemon's state directory")
    parser.add_argument("--socket", help="the daemon's socket (overrides --state-dir)")
    parser.add_argument(
        "--refresh", type=float, default=2.0, metavar="SECONDS", help="refresh interval (2 s)"
    )
    parser.add_argument(
        "--demo",
        action="store_true",
        help="show built-in sample data instead of connecting to a daemon",
    )
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from pollux_local.errors import PolluxError

    if not args.refresh > 0:
        raise PolluxError(f"--refresh must be positive, got {args.refresh}")
    if not sys.stdout.isatty() and not os.environ.get("POLLUX_TUI_FORCE"):
        raise PolluxError("the TUI needs a terminal (stdout is not a tty)")
    from pollux_local.tui.source import DaemonSource, DataSource, FixedSource

    source: DataSource
    if args.demo:
        import time

        from pollux_local.tui.demo import demo_recording

        source = FixedSource(
            demo_recording(n_jobs=12, n_nodes=3), now=time.time(), description="demo"
        )
    else:
        if args.socket:
            socket_path = args.socket
        else:
            from pollux_local.client import resolve_state_dir, socket_path_for

            socket_path = str(socket_path_for(resolve_state_dir(args.state_dir)))
        source = DaemonSource(socket_path)
    from pollux_local.tui.app import PolluxApp

    PolluxApp(source, refresh_s=args.refresh).run()
    return 0
