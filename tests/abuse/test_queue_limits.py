"""One user against the others through the queue: what a user may queue and store, and the one
validation of a job on every path that makes or changes one.

As in ``test_adversarial``: a root daemon from the lab install, two ordinary Unix users
(``alice`` and ``bob``) using that install's ``pollux-local`` and Python.

* an array of 100 tasks carrying ~1 MB of environment grows the state by at most 2 MB (its
  environment and command are stored once), and its tasks still run with that environment;
* 100 ``restart --hold`` of one large cancelled job share its environment;
* an array over ``[limits] max_array_size`` and a user over ``max_queued_per_user`` are refused
  in one line naming the key (a restart too); another user still submits;
* the commands and environments a user's jobs keep are bounded (``max_stored_per_user``),
  an array's shared environment counted once;
* under ``[limits] max_time``: a submit without ``--time`` and ``edit --no-time`` get a bounded
  limit; ``edit --gpus 3`` of a shared job is refused with submit's message; after a reload
  lowers ``max_time``, ``release`` and ``restart`` of a job that asks for more are refused.
"""

from __future__ import annotations

import json
import signal
import sqlite3
from typing import Any

import pytest

from tests.abuse.lab import Lab, cli, job, submit, wait_state
from tests.labinstall import LabDaemon, LabUser, one_line, wait_until

pytestmark = [pytest.mark.timeout(240)]

#: ~1 MB of environment: ten variables of 100 kB (each under exec's 128 kB per string).
BIG_VARS, BIG_SIZE = 10, 100_000

#: Submit (or restart, with ``--restart N``) as the user running it, with a large environment
#: built here (too large for one argument): prints the reply, or the refusal as one line.
CLIENT = r"""
import json, sys
from pollux_local.client import Client
from pollux_local.errors import PolluxError
client = Client(sys.argv[1], timeout_s=120)
request = json.loads(sys.argv[2])
try:
    if request.pop("restart_times", None):
        times = int(sys.argv[3])
        print(json.dumps([client.request("restart", **request)["id"] for _ in range(times)]))
    else:
        n, size = int(sys.argv[3]), int(sys.argv[4])
        request["env"] = {f"BIG{i}": chr(97 + i) * size for i in range(n)}
        print(json.dumps(client.request("submit", **request)))
except PolluxError as exc:
    print(json.dumps({"error": str(exc)}))
"""


def client_call(user: LabUser, daemon: LabDaemon, request: dict[str, Any], *args: int) -> Any:
    done = user.python(
        CLIENT, str(daemon.state_dir / "daemon.sock"), json.dumps(request), *map(str, args),
        timeout_s=180,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)


def state_bytes(daemon: LabDaemon) -> int:
    """The state database's pages (WAL included: a reader sees the last commit)."""
    db = sqlite3.connect(daemon.state_dir / "state.db", timeout=30)
    try:
        db.execute("PRAGMA wal_checkpoint(PASSIVE)")
        pages = int(db.execute("PRAGMA page_count").fetchone()[0])
        return pages * int(db.execute("PRAGMA page_size").fetchone()[0])
    finally:
        db.close()


def submit_line(user: LabUser, daemon: LabDaemon, lab: Lab, *args: str) -> str:
    """The one line a refused submit (in ``lab.work``) printed."""
    return refusal(cli(user, daemon, "submit", "--workdir", str(lab.work), *args))


def refusal(done: Any) -> str:
    """The one line a refused CLI command printed (it failed)."""
    assert done.returncode != 0, done.stdout
    return one_line(done.stderr)


def test_an_arrays_large_environment_is_stored_once_and_reaches_its_tasks(
    lab: Lab, alice: LabUser
) -> None:
    daemon = lab.daemon(devices="cpu:2")
    script = lab.script(
        "show_env.sh",
        f'echo "$POLLUX_ARRAY_INDEX ${{#BIG3}} $(printf %s "$BIG3" | cut -c1-4)"'
        f" > {lab.work}/env-$POLLUX_ARRAY_INDEX\n",
    )
    before = state_bytes(daemon)
    request = {
        "argv": [str(script)], "workdir": str(lab.work), "hold": True,
        "array": [{"index": i} for i in range(100)],
    }  # fmt: skip
    reply = client_call(alice, daemon, request, BIG_VARS, BIG_SIZE)
    assert "error" not in reply, reply
    assert len(reply["ids"]) == 100
    grown = state_bytes(daemon) - before
    assert grown <= 2_000_000, f"the state grew by {grown} bytes for one array"
    # two tasks run (released: the release path checks them too) with the whole environment
    for task in (reply["ids"][0], reply["ids"][57]):
        done = cli(alice, daemon, "release", task)
        assert done.returncode == 0, done.stderr
    for task in (reply["ids"][0], reply["ids"][57]):
        wait_state(daemon, task, ("succeeded",), 120)
    assert (lab.work / "env-0").read_text().split() == ["0", str(BIG_SIZE), "dddd"]
    assert (lab.work / "env-57").read_text().split() == ["57", str(BIG_SIZE), "dddd"]
    cli(alice, daemon, "cancel", "--array", reply["id"])


def test_restarts_of_a_large_job_share_its_environment(lab: Lab, alice: LabUser) -> None:
    daemon = lab.daemon()
    request = {"argv": ["/bin/true"], "workdir": str(lab.work), "hold": True}
    first = client_call(alice, daemon, request, BIG_VARS, BIG_SIZE)
    assert "error" not in first, first
    assert cli(alice, daemon, "cancel", first["id"]).returncode == 0
    before = state_bytes(daemon)
    ids = client_call(alice, daemon, {"id": first["id"], "hold": True, "restart_times": 1}, 100)
    assert isinstance(ids, list) and len(set(ids)) == 100, ids
    grown = state_bytes(daemon) - before
    assert grown <= 2_000_000, f"100 restarts grew the state by {grown} bytes"
    shown = daemon.client.request("show", id=ids[-1])["job"]
    assert shown["env"]["BIG9"] == "j" * BIG_SIZE  # the copy has the whole environment


def test_arrays_and_queues_are_bounded_per_user_in_one_line(
    lab: Lab, alice: LabUser, bob: LabUser
) -> None:
    daemon = lab.daemon(extra_toml="[limits]\nmax_queued_per_user = 5\nmax_array_size = 10\n")
    line = submit_line(alice, daemon, lab, "--hold", "--array", "0-10", "--", "/bin/true")
    assert "an array of 11 tasks" in line and "[limits] max_array_size" in line, line
    assert daemon.client.request("status")["jobs"] == []  # nothing of it was queued
    first = submit(alice, daemon, lab, "--hold", "--array", "0-3", "--", "/bin/true")
    ended = submit(alice, daemon, lab, "--hold", "--", "/bin/true")
    line = submit_line(alice, daemon, lab, "--hold", "--", "/bin/true")
    assert line.endswith(
        f"limit exceeded: {alice.name} has 5 jobs queued or running, the most a user may have"
        " ([limits] max_queued_per_user)"
    ), line
    # an array that would pass the limit is refused whole
    assert cli(alice, daemon, "cancel", ended).returncode == 0
    line = submit_line(alice, daemon, lab, "--hold", "--array", "0-1", "--", "/bin/true")
    assert "has 4 jobs queued or running and this adds 2" in line, line
    # a restart adds a job too: counted the same way
    assert submit(alice, daemon, lab, "--hold", "--", "/bin/true")
    line = refusal(cli(alice, daemon, "restart", ended))
    assert "[limits] max_queued_per_user" in line, line
    # another user is not held back by alice's queue
    assert submit(bob, daemon, lab, "--hold", "--", "/bin/true")
    # the count goes down as alice's jobs end
    assert cli(alice, daemon, "cancel", "--array", first).returncode == 0
    assert cli(alice, daemon, "restart", "--hold", ended).returncode == 0


def test_what_a_users_jobs_keep_in_the_state_is_bounded(
    lab: Lab, alice: LabUser, bob: LabUser
) -> None:
    # 1,000 jobs of 4 MB each would be 4 GB of state: the bytes of commands and environments
    # a user's queued jobs keep are bounded too, each blob counted once
    daemon = lab.daemon(extra_toml='[limits]\nmax_stored_per_user = "1M"\n')

    def held(user: LabUser, variables: int, **extra: Any) -> Any:
        request = {"argv": ["/bin/true"], "workdir": str(lab.work), "hold": True, **extra}
        return client_call(user, daemon, request, variables, BIG_SIZE)

    assert "error" not in held(alice, 3)  # 300 kB
    five = held(alice, 5)  # 500 kB, another environment
    assert "error" not in five, five
    refused = held(alice, 4)["error"]
    assert "[limits] max_stored_per_user" in refused and "\n" not in refused, refused
    assert alice.name in refused, refused
    assert len(daemon.client.request("status")["jobs"]) == 2  # nothing of it was kept
    # an array's tasks share the environment: 50 tasks of 100 kB count 100 kB, not 5 MB
    tasks = held(alice, 1, array=[{"index": i} for i in range(50)])
    assert "error" not in tasks and len(tasks["ids"]) == 50, tasks
    # another user's budget is their own
    assert "error" not in held(bob, 5)
    # what alice's ended jobs kept no longer counts
    assert cli(alice, daemon, "cancel", five["id"]).returncode == 0
    assert "error" not in held(alice, 4)


def test_edit_restart_and_release_are_checked_as_submit_is(lab: Lab, alice: LabUser) -> None:
    daemon = lab.daemon(
        devices="cpu:4",
        extra_toml='[limits]\nmax_time = "1h"\n\n[nodes.box]\nmemory = "8G"\n',
    )
    # no --time under max_time: bounded by it, on submit and on edit --no-time
    plain = submit(alice, daemon, lab, "--hold", "--", "/bin/true")
    assert job(daemon, plain)["time_limit_s"] == 3600
    timed = submit(alice, daemon, lab, "--hold", "--time", "10m", "--", "/bin/true")
    assert cli(alice, daemon, "edit", timed, "--no-time").returncode == 0
    assert job(daemon, timed)["time_limit_s"] == 3600
    line = refusal(cli(alice, daemon, "edit", timed, "--time", "2h"))
    assert "[limits] max_time" in line, line
    # a shared job stays on one device: edit gives submit's refusal
    shared_args = ("--hold", "--shared", "--gpu-memory", "1G")
    shared = submit(alice, daemon, lab, *shared_args, "--", "/bin/true")
    on_submit = submit_line(alice, daemon, lab, *shared_args, "--gpus", "3", "--", "/bin/true")
    on_edit = refusal(cli(alice, daemon, "edit", shared, "--gpus", "3"))
    assert "a shared job runs on one device" in on_edit, on_edit
    assert on_edit == on_submit
    assert job(daemon, shared)["min_gpus"] == 1
    # max_time lowered by a reload: a held job asking for more is not released, an ended one
    # not restarted
    held = submit(alice, daemon, lab, "--hold", "--time", "50m", "--", "/bin/true")
    ended = submit(alice, daemon, lab, "--hold", "--time", "50m", "--", "/bin/true")
    assert cli(alice, daemon, "cancel", ended).returncode == 0
    config = lab.base / "state.toml"
    config.write_text(config.read_text().replace('max_time = "1h"', 'max_time = "30m"'))
    assert daemon.proc is not None
    daemon.proc.send_signal(signal.SIGHUP)
    wait_until(lambda: "max_time (s) 3600" in daemon.output(), 30, "the reload")
    line = refusal(cli(alice, daemon, "release", held))
    assert "time limit 50m" in line and "[limits] max_time" in line, line
    assert job(daemon, held)["state"] == "held"
    line = refusal(cli(alice, daemon, "restart", ended))
    assert "time limit 50m" in line and "[limits] max_time" in line, line
    # shortened, it is released
    assert cli(alice, daemon, "edit", held, "--time", "20m").returncode == 0
    assert cli(alice, daemon, "release", held).returncode == 0
