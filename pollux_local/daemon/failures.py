"""Failures that retrying cannot fix, told from a failed replica's last log line.

A job whose replica ends with an import error, a syntax error, arguments its script refuses,
or a request for CUDA on a CPU device fails at once with a reason naming the cause, instead of
being retried with back-off (``exits.retries_allowed``; the cause cannot go away by itself).
"""

from __future__ import annotations

import re

#: (pattern on the last log line, what the user is told)
_PERMANENT: tuple[tuple[re.Pattern[str], str], ...] = (
    (
        re.compile(r"No module named '?pollux_local"),
        "the job library (ElasticTrainer) is not installed in the job's Python environment: "
        "install pollux-local there, or submit with --python",
    ),
    (
        re.compile(r"^(ModuleNotFoundError|ImportError)\b"),
        "a module is missing from the job's Python environment",
    ),
    (re.compile(r"^(SyntaxError|IndentationError|TabError)\b"), "the script does not parse"),
    (
        re.compile(r"Torch not compiled with CUDA enabled|no NVIDIA driver|no CUDA GPUs", re.I),
        "the script asks for CUDA",
    ),
    (
        re.compile(r"error: (unrecognized arguments|the following arguments are required)"),
        "the script refused its arguments",
    ),
    # what a replica that could not be set up says, the same on every launcher (this
    # machine's supervisor fails such a start at once; on SSH nodes and under Slurm it is
    # the replica's exit: review s62 saw it retried there)
    (
        re.compile(r"^cannot enter working directory "),
        "its working directory cannot be entered (as its user, where it runs)",
    ),
    (
        re.compile(
            r"^cannot execute \S.*: (No such file or directory|Permission denied"
            r"|Exec format error|Not a directory)$"
        ),
        "its command cannot be run",
    ),
)


def permanent_cause(last_line: str, on_cpu: bool) -> str | None:
    """Why a failure with this last log line cannot be fixed by a retry, or ``None``."""
    line = last_line.strip()
    for pattern, cause in _PERMANENT:
        if pattern.search(line):
            if cause == "the script asks for CUDA":
                where = "CPU devices" if on_cpu else "devices without a usable CUDA driver"
                return f"the script asks for CUDA but this job was given {where}"
            return cause
    return None
