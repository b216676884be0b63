"""Pausing one's own queue, with two real Unix users against a real root daemon: ``hold --all``
holds the caller's queued jobs and nobody else's (a running job keeps running), ``release
--all`` releases the caller's held ones; a user naming another with ``--user`` is refused in
one line; root (an admin) takes its own jobs unless ``--user NAME`` says whose; an id with
``--all``, or neither, is refused in one line, by the CLI and by the daemon alike."""

from __future__ import annotations

import json

import pytest

from pollux_local.api.errors import InvalidRequest
from tests.abuse.lab import Lab, cli, job, raw_request, submit, wait_state
from tests.labinstall import LabDaemon, LabUser

pytestmark = [pytest.mark.timeout(240)]


def states(daemon: LabDaemon, *ids: str) -> list[str]:
    return [job(daemon, job_id)["state"] for job_id in ids]


def test_hold_all_and_release_all_take_only_the_callers_own_jobs(
    lab: Lab, alice: LabUser, bob: LabUser
) -> None:
    daemon = lab.daemon(devices="cpu:1")
    sleeper = lab.script("sleeper.sh", "sleep 60\n")
    running = submit(alice, daemon, lab, str(sleeper))
    wait_state(daemon, running, ("running",), 30)
    a1, a2 = (submit(alice, daemon, lab, str(sleeper)) for _ in range(2))
    b1, b2 = (submit(bob, daemon, lab, str(sleeper)) for _ in range(2))
    assert states(daemon, a1, a2, b1, b2) == ["queued"] * 4

    done = cli(bob, daemon, "hold", "--all")
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == f"held 2 job(s): {b1}, {b2}"
    assert states(daemon, running, a1, a2, b1, b2) == ["running", "queued", "queued", "held",
                                                       "held"]  # fmt: skip

    refused = cli(bob, daemon, "hold", "--all", "--user", alice.name)
    assert refused.returncode != 0
    [line] = refused.stderr.strip().splitlines()
    assert "only an admin" in line and alice.name in line, line
    refused = cli(bob, daemon, "release", "--all", "--user", alice.name)
    assert refused.returncode != 0 and "only an admin" in refused.stderr
    assert states(daemon, running, a1, a2) == ["running", "queued", "queued"]

    held = json.loads(cli(alice, daemon, "hold", "--all", "--json").stdout)
    assert held == {"state": "held", "ids": [a1, a2], "refused": {}}  # not the running one
    assert states(daemon, running, a1, a2) == ["running", "held", "held"]
    nothing = cli(alice, daemon, "hold", "--all")
    assert nothing.returncode == 0 and nothing.stdout.strip() == "held no job: none was queued"

    released = json.loads(cli(alice, daemon, "release", "--all", "--json").stdout)
    assert released["state"] == "queued" and released["ids"] == [a1, a2]
    assert states(daemon, a1, a2, b1, b2) == ["queued", "queued", "held", "held"]
    for decision in daemon.client.request("show", id=a1)["decisions"]:
        if decision["kind"] == "released":
            assert decision["reason"] == f"by {alice.name}"

    # root, an admin: its own jobs (none) unless --user says whose
    mine = daemon.client.request("release", all=True)
    assert mine["ids"] == [] and states(daemon, b1, b2) == ["held", "held"]
    theirs = daemon.client.request("release", all=True, user=bob.name)
    assert theirs["ids"] == [b1, b2] and states(daemon, b1, b2) == ["queued", "queued"]
    assert states(daemon, a1, a2) == ["queued", "queued"]

    # one job by id, as before
    assert cli(bob, daemon, "hold", b1).stdout.strip() == f"job {b1} is held"
    refused = cli(bob, daemon, "hold", a1)  # another user's job, by id
    assert refused.returncode != 0 and "only its owner or an admin" in refused.stderr
    assert states(daemon, a1, b1) == ["queued", "held"]
    daemon.client.request("cancel", ids=[running, a1, a2, b1, b2])


def test_an_id_with_all_or_neither_is_refused_in_one_line(lab: Lab, bob: LabUser) -> None:
    daemon = lab.daemon(devices="cpu:1")
    queued = submit(bob, daemon, lab, "--hold", str(lab.script("noop.sh", "true\n")))
    for verb in ("hold", "release"):
        for args in ((queued, "--all"), (), ("--user", bob.name, queued)):
            done = cli(bob, daemon, verb, *args)
            assert done.returncode != 0, (verb, args)
            [line] = done.stderr.strip().splitlines()
            assert verb in line and ("--all" in line or "ID" in line), line
        for request in ({"id": queued, "all": True}, {}, {"id": queued, "user": bob.name}):
            reply = raw_request(bob, daemon, {"type": verb, **request})
            assert reply["ok"] is False and reply["code"] == InvalidRequest.code, reply
            assert "\n" not in reply["error"] and verb in reply["error"], reply
    assert job(daemon, queued)["state"] == "held"
