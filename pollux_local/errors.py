"""Errors that reach the user as one clear line."""


class PolluxError(Exception):
    """A problem with the user's input or environment, reported as one line, exit code 2."""

    exit_code = 2
