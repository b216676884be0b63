"""Text a job controls, on another user's screens: a hostile lab member (alice) names her jobs
with Textual markup and makes their log lines, and so their failure reasons and the
scheduler's decisions, carry terminal escapes; another user (bob) looks at them.

* bob's TUI, over the replies the real root daemon gives *bob* (recorded over the socket as
  bob, served by ``FixedSource``), driven through ``App.run_test()``: the jobs table, the
  priority and cancel dialogs, the detail (decisions, log tail), the log view and a
  notification show every string literally, clicking a ``[@click=…]`` name runs nothing (no
  file written, the app not quit), ``[/bold]`` crashes nothing, no cell holds a control
  character (``tests/tui/hostile.py`` is the walk);
* bob's CLI: ``logs --safe`` shows the escapes as text (colours aside), and ``status``/``show``
  print the markup-looking names as they are, with no raw control character.

The real terminal (tmux) is ``tests/tui/test_tmux.py::test_a_hostile_job_in_a_real_terminal``.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from pollux_local.tui.app import PolluxApp
from pollux_local.tui.recording import recording_from_data
from pollux_local.tui.source import FixedSource
from tests.abuse.lab import CONTROL, TERMINAL, Lab, cli, submit, wait_state
from tests.labinstall import LabDaemon, LabUser
from tests.tui.hostile import (
    CLOSE_TAG_NAME,
    EVIL_LINE,
    HIDDEN_NAME,
    QUIT_NAME,
    click_name,
    walk,
    witness_dir,
)

pytestmark = [pytest.mark.timeout(240)]

#: The visible part of the evil log line (the reason quotes it; the daemon may drop escapes).
EVIL_WORDS = EVIL_LINE.rpartition("\x1b[2J")[2]

#: Run as bob with the lab's Python: his replies to what the TUI asks, as a recording.
RECORD = r"""
import json, sys, time
import msgspec
from pollux_local.api.messages import Nodes, Show, Status, Usage
from pollux_local.client import Client
from pollux_local.tui.view import tail_request

client = Client(sys.argv[1], timeout_s=20)
def frame(reply):
    return {"v": 1, "ok": True, **msgspec.to_builtins(reply)}
status = client.call(Status())
ids = [job.id for job in status.jobs]
print(json.dumps({"version": 1, "recorded_at": time.time(), "jobs": {}, "replies": {
    "status": frame(status), "nodes": frame(client.call(Nodes())),
    "usage": frame(client.call(Usage())),
    "show": {i: frame(client.call(Show(id=i))) for i in ids},
    "logs": {i: frame(client.call(tail_request(i))) for i in ids},
}}))
"""


def hostile_jobs(lab: Lab, alice: LabUser, daemon: LabDaemon, witness: Path) -> dict[str, str]:
    """alice's jobs, id -> name: three that print the evil line last and fail (so it is their
    reason), one that prints it and keeps running."""
    evil = lab.base / "evil.txt"
    evil.write_text(f"step 1\n{EVIL_LINE}\n")
    evil.chmod(0o644)
    failing = lab.script("evil_fail.sh", f"cat {evil}\nexit 1\n")
    running = lab.script("evil_run.sh", f"cat {evil}\nexec sleep 600\n")
    jobs = {}
    for name, script in ((click_name(witness), failing), (QUIT_NAME, running),
                         (CLOSE_TAG_NAME, failing), (HIDDEN_NAME, failing)):  # fmt: skip
        jobs[submit(alice, daemon, lab, "--name", name, str(script))] = name
    for job_id, name in jobs.items():
        wanted = ("running",) if name == QUIT_NAME else TERMINAL
        wait_state(daemon, job_id, wanted, timeout_s=120)
    return jobs


@pytest.mark.asyncio
async def test_another_users_tui_shows_hostile_job_text_literally(
    lab: Lab, alice: LabUser, bob: LabUser
) -> None:
    daemon = lab.daemon(devices="cpu:2")
    with witness_dir() as witness:
        jobs = hostile_jobs(lab, alice, daemon, witness)
        done = bob.python(RECORD, str(daemon.state_dir / "daemon.sock"))
        assert done.returncode == 0, done.stderr
        recording = recording_from_data(json.loads(done.stdout), "bob's replies")
        assert {job.name for job in recording.status.jobs} == set(jobs.values())
        failed = [i for i, name in jobs.items() if name != QUIT_NAME]
        assert all(EVIL_WORDS in recording.shows[i].job.reason for i in failed)
        app = PolluxApp(
            FixedSource(recording), sync=True, refresh_s=3600, clock=lambda: recording.recorded_at
        )
        async with app.run_test(size=(200, 50), notifications=True) as pilot:
            await walk(pilot, jobs, witness, EVIL_LINE, dict.fromkeys(failed, EVIL_WORDS))
        assert app.return_code is None
        assert not list(witness.iterdir()), "a [@click] name ran app.screenshot"


def test_another_users_cli_shows_hostile_job_text_literally(
    lab: Lab, alice: LabUser, bob: LabUser
) -> None:
    daemon = lab.daemon(devices="cpu:2")
    with witness_dir() as witness:
        jobs = hostile_jobs(lab, alice, daemon, witness)
    running = next(i for i, name in jobs.items() if name == QUIT_NAME)
    safe = cli(bob, daemon, "logs", running, "--safe")
    assert safe.returncode == 0, safe.stderr
    assert "\\x1b]2;PWNED-TITLE\\x1b\\\\x1b[2J" + EVIL_WORDS in safe.stdout
    assert not CONTROL & set(safe.stdout), "logs --safe let a control character through"
    raw = cli(bob, daemon, "logs", running, "--raw")
    assert EVIL_LINE in raw.stdout  # --raw (and a pipe) is the job's output as written
    status = cli(bob, daemon, "status")
    shown = [status.stdout]
    for job_id, name in jobs.items():
        assert name[:24] in status.stdout
        show = cli(bob, daemon, "show", job_id)
        assert show.returncode == 0, show.stderr
        assert f"job {job_id}  {name}  ({alice.name})" in show.stdout
        shown.append(show.stdout)
    for text in shown:
        assert not CONTROL & set(text), f"a raw control character in:\n{text}"
    failed = next(i for i, name in jobs.items() if name == HIDDEN_NAME)
    wait = cli(bob, daemon, "wait", failed, "--timeout", "30")
    assert EVIL_WORDS in wait.stdout and not CONTROL & set(wait.stdout)
