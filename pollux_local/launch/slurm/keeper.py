"""The keeper of one job step: runs ``srun`` for an incarnation, finds the step's id, and
writes what became of it to its record (``STATE_DIR/run/slurm/slurm-<job id>.json``), so that a
daemon restarted meanwhile reads the end it did not see.  Standard library only; started by
the daemon in its own session (``python keeper.py``, a script: no import of the package), its
instructions as one JSON line on stdin:

``{"srun": [argv], "env": {...}, "record": path, "log": path, "token": str, "slurm_job": id,
"step_name": name, "open_files": n, "exits": prefix, "tasks": n}``

The record: ``version``, ``token``, ``keeper_pid``, ``state`` (``running`` then ``ended``),
``step`` (the step's id once ``squeue`` shows it), and at the end ``exit_code`` (the group's:
the first failing rank's in the order srun reported them, else 0 when all exited 0, else 75;
``-N`` for signal N), ``ranks`` (rank -> status for every rank srun reported; unreported
ranks exited 0) and ``srun_code``.  srun names only the tasks that ended abnormally; when it
names none and still does not end 0 (255 when Slurm found a node not responding as the step
ended), the tasks' own ends decide, as each task's rank wrapper wrote them
(``exits`` + rank: :func:`recorded_exits`), when every task wrote one (``recorded`` true).
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import resource
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

RESCALE = 75
#: ``srun: error: NODE: task 3: Exited with exit code 2``, ``tasks 0-1: Killed``
_TASK_LINE = re.compile(r"\btasks? (?P<ranks>[\d,-]+): (?P<what>.+?)\s*$")
_EXITED = re.compile(r"Exited with exit code (\d+)")
_SIGNALS = {signal.strsignal(s) or s.name: int(s) for s in signal.Signals}


def write_record(path: Path, record: dict[str, Any]) -> None:
    """Replace the record atomically (a temp file renamed over it)."""
    tmp = path.with_name(path.name + ".tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o600)
    with os.fdopen(fd, "w") as fh:
        json.dump(record, fh)
    os.replace(tmp, path)


def _ranks(spec: str) -> list[int]:
    ranks: list[int] = []
    for part in spec.split(","):
        low, _, high = part.partition("-")
        if low.isdigit():
            ranks.extend(range(int(low), int(high or low) + 1))
    return ranks


def task_exits(text: str) -> tuple[dict[int, int], list[int]]:
    """The ranks srun reported as ending abnormally (rank -> status, ``-N`` for signal N),
    and the order it reported them in."""
    codes: dict[int, int] = {}
    order: list[int] = []
    for line in text.splitlines():
        match = _TASK_LINE.search(line)
        if not match:
            continue
        what = match["what"]
        exited = _EXITED.match(what)
        if exited:
            status = int(exited.group(1))
        elif what.split(" (")[0] in _SIGNALS:
            status = -_SIGNALS[what.split(" (")[0]]
        else:
            continue
        for rank in _ranks(match["ranks"]):
            if rank not in codes:
                codes[rank] = status
                order.append(rank)
    return codes, order


def group_code(codes: dict[int, int], order: list[int], srun_code: int) -> int:
    """The incarnation's code: its first failing rank's, else 0 or 75; srun's own code when
    it reported no rank (a step that could not start)."""
    for rank in order:
        if codes[rank] not in (0, RESCALE):
            return codes[rank]
    if not codes:
        return srun_code if srun_code >= 0 else srun_code
    return 0 if set(codes.values()) <= {0} else RESCALE


def recorded_exits(prefix: str, tasks: int) -> dict[int, int] | None:
    """rank -> code as every task's wrapper wrote it (``PREFIX<rank>``: one line, a number),
    or ``None`` unless all ``tasks`` did.  The files are the job's user's (the keeper runs as
    that user: a daemon in an allocation runs its jobs as the allocation's owner): each read
    without following a link or waiting on a FIFO, 32 bytes at most, then removed."""
    codes: dict[int, int] = {}
    for rank in range(tasks):
        path = f"{prefix}{rank}"
        try:
            fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
        except OSError:
            continue
        try:
            text = os.read(fd, 32).decode("ascii", "replace").strip()
        except OSError:
            text = ""
        finally:
            os.close(fd)
        with contextlib.suppress(OSError):
            os.unlink(path)
        if text.isdigit():
            codes[rank] = int(text)
    return codes if len(codes) == tasks and tasks > 0 else None


def find_step(slurm_job: str, name: str) -> str | None:
    """The id (``JOB.STEP``) of the running step called ``name``, from ``squeue``."""
    try:
        out = subprocess.run(
            ["squeue", "-h", "-s", "-j", slurm_job, "-o", "%i %j"],
            capture_output=True, text=True, timeout=10,
        ).stdout  # fmt: skip
    except (OSError, subprocess.SubprocessError):
        return None
    for line in out.splitlines():
        parts = line.split(None, 1)
        if len(parts) == 2 and parts[1].strip() == name:
            return parts[0]
    return None


def main() -> int:
    order = json.loads(sys.stdin.readline())
    record_path = Path(order["record"])
    record: dict[str, Any] = {
        "version": 1,
        "token": order["token"],
        "keeper_pid": os.getpid(),
        "state": "running",
        "started": time.time(),
        "slurm_job": order["slurm_job"],
        "step": None,
    }
    open_files = order.get("open_files")
    if open_files:  # what the job would get started by hand (the daemon raised its own), as
        # the local supervisor gives its replicas: srun hands its limits on to the tasks
        _, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        with contextlib.suppress(OSError, ValueError):
            resource.setrlimit(resource.RLIMIT_NOFILE, (min(int(open_files), hard), hard))
    if order.get("exits"):  # only this step's tasks' records are read at its end: none left
        # by an earlier step of the same incarnation (a start a killed daemon never recorded)
        for rank in range(int(order.get("tasks") or 0)):
            with contextlib.suppress(OSError):
                os.unlink(f"{order['exits']}{rank}")
    with open(order["log"], "wb") as log:  # this incarnation's srun only
        try:
            srun = subprocess.Popen(
                order["srun"], env=order["env"], stdin=subprocess.DEVNULL,
                stdout=log, stderr=log, cwd="/",
            )  # fmt: skip
        except OSError as exc:
            record.update(state="ended", exit_code=127, ranks={}, srun_code=127,
                          ended=time.time(), failure=f"cannot run srun: {exc.strerror}")  # fmt: skip
            write_record(record_path, record)
            return 0
        record["srun_pid"] = srun.pid
        write_record(record_path, record)
        # A stop the daemon could not send as a scancel of the step (it was not known yet).
        signal.signal(signal.SIGTERM, lambda *_: srun.send_signal(signal.SIGTERM))
        while srun.poll() is None:
            if record["step"] is None:
                step = find_step(str(order["slurm_job"]), order["step_name"])
                if step is not None:
                    record["step"] = step
                    write_record(record_path, record)
            with contextlib.suppress(subprocess.TimeoutExpired):
                srun.wait(0.3 if record["step"] is None else 2.0)
    srun_code = srun.returncode
    codes, ranks_order = task_exits(Path(order["log"]).read_text(errors="replace"))
    recorded = None
    if order.get("exits"):
        recorded = recorded_exits(str(order["exits"]), int(order.get("tasks") or 0))
    if not codes and srun_code != 0 and recorded is not None:
        # srun named no task, yet did not end 0: each task's own end decides
        codes = {rank: code for rank, code in recorded.items() if code != 0}
        ranks_order = sorted(codes)
        record["recorded"] = True
    known = 0 if record.get("recorded") else srun_code  # every task's end is known
    record.update(
        state="ended",
        exit_code=group_code(codes, ranks_order, known),
        ranks={str(rank): code for rank, code in codes.items()},
        order=ranks_order,
        srun_code=srun_code,
        ended=time.time(),
    )
    write_record(record_path, record)
    return 0


if __name__ == "__main__":
    sys.exit(main())
