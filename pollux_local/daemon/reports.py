"""Job reports as the daemon takes them in: checked against :class:`api.JobReport`, kept as
one.

A report arrives two ways, a ``report`` request (already decoded as a ``JobReport``) and the
``report.json`` file rank 0 writes in its job directory (:func:`parse_report`).  Both end up
in the job's row as that ``JobReport``, which every reader takes by its typed fields.  A report that does not follow the schema (bounds included:
rows, metrics, finite numbers) is refused as a whole with a one-line reason
(:class:`InvalidReport`); the job's previous report stays.  The file is read through
:mod:`.jobfiles` (no symlink followed, a FIFO never waited on, the job's owner's plain file, at
most ``jobfiles.MAX_REPORT_BYTES``): an unsafe one is refused the same way, its content never
read.

Who may report for a job is one rule, :func:`check_reporter`, applied to both ways: the
sender (the peer of a request, the owner of a file) must be the job's user, root or the
daemon's own user, and the job must not have ended.  Requests for one job are taken at most
every :data:`MIN_REPORT_INTERVAL_S` (:class:`ReportPace`); one sooner is answered, not taken,
so that a job sending reports back to back costs the daemon little more than reading them.
"""

from __future__ import annotations

import os
import time
import weakref
from pathlib import Path

import msgspec

from pollux_local.api.errors import PermissionDenied
from pollux_local.api.report import JobReport
from pollux_local.api.states import PLACED_STATES, TERMINAL_STATES
from pollux_local.daemon.jobfiles import (
    UnsafeJobFile,
    job_dir_stat,
    read_whole_job_file,
    runs_as,
)
from pollux_local.daemon.state import JobRecord
from pollux_local.untrusted import one_line

_decoder = msgspec.json.Decoder(JobReport)

#: The shortest time between two reports of one job the daemon takes over the socket (the job
#: library reports every 10 s by default; its probe every second).
MIN_REPORT_INTERVAL_S = 0.5
#: Reports over the socket taken per second for all the jobs of one user together (each is a
#: write to the state database), and the burst allowed above that rate: a user's thousand
#: jobs each at the per-job pace were 583 writes a second, and other users' requests waited.
USER_REPORTS_PER_S = 20.0
USER_REPORT_BURST = 40.0
#: The most characters of why a report was refused (it may quote what the job wrote).
MAX_REASON_CHARS = 300


class ReportPace:
    """When each job's last report over the socket was taken (monotonic seconds), per daemon
    (:func:`pace_of` its store), and each user's budget of reports: a token bucket per owner,
    refilled at ``per_user_s`` a second up to ``burst``.  Entries older than they matter are
    dropped as the tables grow."""

    def __init__(
        self,
        interval_s: float = MIN_REPORT_INTERVAL_S,
        per_user_s: float = USER_REPORTS_PER_S,
        burst: float = USER_REPORT_BURST,
    ) -> None:
        self.interval_s = interval_s
        self.per_user_s = per_user_s
        self.burst = burst
        self._taken: dict[int, float] = {}
        #: owner uid -> (tokens, when they were counted)
        self._budget: dict[int, tuple[float, float]] = {}

    def take(self, job_id: int, owner_uid: int = -1, now: float | None = None) -> bool:
        """Whether a report of ``job_id`` (a job of ``owner_uid``) arriving now is taken
        (then it is noted): not sooner than ``interval_s`` after the job's last one, and only
        while its owner has a token (tokens = min(burst, tokens + per_user_s * elapsed))."""
        now = time.monotonic() if now is None else now
        last = self._taken.get(job_id)
        if last is not None and now - last < self.interval_s:
            return False
        tokens, counted = self._budget.get(owner_uid, (self.burst, now))
        tokens = min(self.burst, tokens + self.per_user_s * max(0.0, now - counted))
        if tokens < 1.0:
            self._budget[owner_uid] = (tokens, now)
            return False
        self._budget[owner_uid] = (tokens - 1.0, now)
        self._taken[job_id] = now
        if len(self._taken) > 1024:
            self._taken = {k: t for k, t in self._taken.items() if now - t < self.interval_s}
        if len(self._budget) > 1024:  # a full bucket is what an absent entry means
            refill = self.burst / self.per_user_s
            self._budget = {k: v for k, v in self._budget.items() if now - v[1] < refill}
        return True


_paces: weakref.WeakKeyDictionary[object, ReportPace] = weakref.WeakKeyDictionary()


def pace_of(owner: object) -> ReportPace:
    """The :class:`ReportPace` of one daemon, keyed by an object it holds (its store)."""
    pace = _paces.get(owner)
    if pace is None:
        pace = _paces[owner] = ReportPace()
    return pace


class InvalidReport(ValueError):
    """A report that is not JSON or does not follow the schema (the message is one line)."""


def check_reporter(job: JobRecord, sender_uid: int, daemon_uid: int) -> bool:
    """May ``sender_uid`` report for ``job`` now?  Only the job's own user (whom its processes
    run as), root and the daemon's own user report for a job; anyone else is refused with
    :class:`PermissionDenied` (one line; an admin group does not widen this: a report is the
    job's word about itself, not an administrative act).  ``False`` (nothing refused, nothing
    taken) when no process of the job runs: it ended, or it is queued or held and none of its
    processes is still stopping (its recorded pids, kept until they are gone: a preempted
    job's last reports come while it checkpoints).  Review s60 gave 990 held jobs that never
    ran a report each, each of their ``status`` rows 25 KB."""
    if sender_uid not in (job.owner_uid, 0, daemon_uid):
        raise PermissionDenied(
            f"permission denied: job {job.id} belongs to {job.owner_name}; only its own"
            " processes may report for it"
        )
    return job.state in PLACED_STATES or (bool(job.pids) and job.state not in TERMINAL_STATES)


def parse_report(data: bytes) -> JobReport:
    """A report's JSON text as a :class:`JobReport` (:class:`InvalidReport` otherwise)."""
    try:
        return _decoder.decode(data)
    except (msgspec.ValidationError, msgspec.DecodeError) as exc:
        # msgspec quotes what it refused (an unknown field's whole name): one short line
        raise InvalidReport(one_line(exc, MAX_REASON_CHARS)) from None


def read_report_file(path: Path, owner_uid: int | None = None) -> JobReport | None:
    """The report in ``path`` (``JOB_DIR/report.json``); ``None`` when there is none (or it cannot be read).  Raises :class:`InvalidReport` when it
    does not follow the schema or is not a plain file of the job's user ``owner_uid``
    (without it: the user owning the job's directory, which only root can change)."""
    directory = path.parent
    if owner_uid is None:
        try:
            owner_uid = job_dir_stat(directory.parent, directory.name).st_uid
        except OSError:
            return None
    try:
        data = read_whole_job_file(directory, path.name, owner_uid)
    except UnsafeJobFile as exc:
        raise InvalidReport(f"unsafe report file: {exc}") from None
    except OSError:
        return None
    return parse_report(data)


def read_job_report(directory: Path, job: JobRecord) -> JobReport | None:
    """``job``'s ``report.json`` in ``directory``, taken
    under :func:`check_reporter` like a request (the sender is the file's owner, whom
    :mod:`.jobfiles` requires to be the job's user); ``None`` when there is none, it cannot be
    read or the job has ended.  :class:`InvalidReport` as :func:`read_report_file`."""
    if not check_reporter(job, runs_as(job.owner_uid), os.geteuid()):
        return None
    return read_report_file(directory / "report.json", job.owner_uid)
