"""The daemon and job commands: ``daemon | submit | estimate | status (ls) | show | logs | nodes | cancel |
hold | release | priority | restart | edit | wait | usage | drain | resume``, each group in its own
module."""

from __future__ import annotations

import argparse

from pollux_local.cli import admin, control, daemon, estimate, query, submit, usage, wait


def register(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    for module in (daemon, submit, estimate, query, wait, control, usage, admin):
        module.register(subparsers)
