"""The job's report to the daemon: a file in the job directory and a ``report`` request.

Rank 0 writes ``$POLLUX_JOB_DIR/report.json`` atomically (temporary file + rename) and, when
``POLLUX_DAEMON_SOCKET`` is set, sends the same object over the daemon's socket from a
background thread with a short timeout.  Nothing here ever raises into training: failures are
logged once and the next report tries again.  A report is cut to the bounds the daemon accepts
(``api.report.bounded_report``: the most-timed profile rows, finite metrics) before it goes.
"""

from __future__ import annotations

import logging
import os
import threading
from pathlib import Path

import msgspec

from pollux_local.api.messages import Report
from pollux_local.api.report import REPORT_VERSION, JobReport, bounded_report

log = logging.getLogger("pollux_local.torch")

__all__ = ["REPORT_VERSION", "Reporter", "write_report_file"]

SEND_TIMEOUT_S = 2.0


def write_report_file(path: Path, report: JobReport) -> None:
    """Atomically replace ``path`` with the JSON of ``report``."""
    tmp = path.with_name(f".{path.name}.tmp.{os.getpid()}")
    tmp.write_bytes(msgspec.json.encode(report))
    os.replace(tmp, path)


def _send(socket_path: str, job_id: str, report: JobReport) -> None:
    from pollux_local.client import Client

    Client(socket_path, timeout_s=SEND_TIMEOUT_S).call(Report(job_id=job_id, report=report))


class Reporter:
    """Delivers reports without ever blocking or failing the training loop."""

    def __init__(self, job_id: str, job_dir: Path | None, socket_path: str | None) -> None:
        self.job_id = job_id
        self.job_dir = job_dir
        self.socket_path = socket_path
        self._sender: threading.Thread | None = None
        self._warned_file = False
        self._warned_socket = False
        self.sent = 0

    def submit(self, report: JobReport) -> None:
        report = bounded_report(report)
        if self.job_dir is not None:
            try:
                self.job_dir.mkdir(parents=True, exist_ok=True)
                write_report_file(self.job_dir / "report.json", report)
            except OSError as exc:
                if not self._warned_file:
                    log.warning("cannot write the job report in %s: %s", self.job_dir, exc)
                    self._warned_file = True
        if self.socket_path is None:
            return
        if self._sender is not None and self._sender.is_alive():
            return  # the previous report is still on its way; this one is skipped
        self._sender = threading.Thread(
            target=self._send_quietly, args=(report,), name="pollux-report", daemon=True
        )
        self._sender.start()

    def _send_quietly(self, report: JobReport) -> None:
        assert self.socket_path is not None
        try:
            _send(self.socket_path, self.job_id, report)
            self.sent += 1
        except Exception as exc:  # noqa: BLE001 - reporting must never stop training
            if not self._warned_socket:
                log.warning("cannot reach the daemon at %s: %s", self.socket_path, exc)
                self._warned_socket = True

    def flush(self, timeout_s: float = SEND_TIMEOUT_S) -> None:
        """Wait (bounded) for a report still being sent, e.g. before the process exits."""
        if self._sender is not None:
            self._sender.join(timeout_s)
