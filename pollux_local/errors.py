"""Errors that reach the user as one clear line (defined in :mod:`pollux_local.api.errors`)."""

from pollux_local.api.errors import PolluxError

__all__ = ["PolluxError"]
