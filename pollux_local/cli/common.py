"""What the job commands share: the ``--state-dir`` and ``--json`` options, the client, and
printing a typed reply as JSON."""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

import msgspec

from pollux_local.api.errors import NotFound
from pollux_local.client import Client, resolve_state_dir, socket_path_for


def state_dir_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(add_help=False)
    parser.add_argument(
        "--state-dir",
        help="the daemon's state directory (default: $POLLUX_LOCAL_STATE_DIR, "
        "else ~/.local/state/pollux-local)",
    )
    return parser


def json_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(add_help=False)
    parser.add_argument("--json", action="store_true", help="print the reply as JSON")
    return parser


def client_for(args: argparse.Namespace) -> Client:
    return Client(socket_path_for(resolve_state_dir(args.state_dir)))


def print_json(value: Any) -> None:
    """Print a typed reply (or plain data) as indented JSON with sorted keys."""
    json.dump(msgspec.to_builtins(value), sys.stdout, indent=2, sort_keys=True)
    sys.stdout.write("\n")


def job_id(text: str) -> str:
    """A job id as typed by the user; anything but digits is no job (a one-line error)."""
    cleaned = text.strip()
    if not cleaned.isdigit() or len(cleaned) > 15:
        raise NotFound(f"no job with id {text!r}")
    return cleaned
