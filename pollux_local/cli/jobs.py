"""The daemon and job commands: ``daemon | submit | run | estimate | status (ls) | show | logs | nodes | cancel |
hold | release | priority | restart | edit | send | wait | usage | drain | resume | group``, each group
in its own module."""

from __future__ import annotations

import argparse

from pollux_local.cli import (
    admin,
    control,
    daemon,
    estimate,
    groups,
    query,
    run,
    send,
    submit,
    usage,
    wait,
)


def register(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    for module in (daemon, submit, run, estimate, query, wait, control, send, usage, admin, groups):
        module.register(subparsers)
