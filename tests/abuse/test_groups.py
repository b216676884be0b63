"""Groups between two users: what one user may do to the other's group and to the admin's.

As in ``test_adversarial``: a root daemon from the lab install, two ordinary Unix users
(``alice`` and ``bob``) using that install's ``pollux-local``.

* alice makes a group (``[limits] user_groups = 1``); a second one is refused in one line
  naming the key;
* bob cannot pause, resume, change or delete alice's group, nor submit a job into it (also
  not by a raw request), nor pause the admin's group; each refusal is one line naming the group
  and nothing changes;
* alice's pause holds her queued job back; root (an admin) resumes it and the job starts;
* bob's own group and the admin's group take his jobs;
* once the admin drops a group that bob's jobs are in, alice cannot make a group of that
  name, and so cannot pause or cap bob's jobs through it.
"""

from __future__ import annotations

import signal

import pytest

from tests.abuse.lab import Lab, cli, job, raw_request, submit, wait_state
from tests.labinstall import LabDaemon, LabUser, one_line, wait_until

pytestmark = [pytest.mark.timeout(240)]

CONFIG = "[limits]\nuser_groups = 1\n\n[groups.lab]\nmax_running = 2\n"


def group(user: LabUser, daemon: LabDaemon, *args: str) -> tuple[int, str]:
    """``pollux-local group ARGS`` as ``user``: its exit status, and its one line (stdout's
    first, or stderr's when it failed)."""
    command, *rest = args
    done = user.cli("group", command, "--state-dir", str(daemon.state_dir), *rest)
    if done.returncode != 0:
        return done.returncode, one_line(done.stderr)
    return 0, done.stdout.splitlines()[0] if done.stdout else ""


def groups(daemon: LabDaemon) -> dict[str, dict[str, object]]:
    return {row["name"]: row for row in daemon.client.request("groups")["groups"]}


def test_a_user_cannot_touch_another_users_group_or_the_admins(
    lab: Lab, alice: LabUser, bob: LabUser
) -> None:
    daemon = lab.daemon(devices="cpu:2", extra_toml=CONFIG)
    assert group(alice, daemon, "set", "alexp", "--max-running", "1")[0] == 0
    rc, line = group(alice, daemon, "set", "second")
    assert rc != 0 and line.endswith(
        f"limit exceeded: {alice.name} has 1 groups, the most a user may make ([limits]"
        " user_groups = 1); delete one first (group delete NAME)"
    ), line
    before = groups(daemon)
    assert before["alexp"]["owner"] == alice.name and before["alexp"]["max_running"] == 1

    for args, verb in (
        (("pause", "alexp"), "pause"),
        (("resume", "alexp"), "resume"),
        (("delete", "alexp"), "delete"),
        (("set", "alexp", "--max-running", "9"), "change"),
    ):
        rc, line = group(bob, daemon, *args)
        assert rc != 0 and f"group alexp is {alice.name}'s" in line, line
        assert f"may {verb} it" in line and "permission denied" in line, line
    rc, line = group(bob, daemon, "pause", "lab")
    assert rc != 0 and "group lab is the admin's" in line and "only an admin may pause" in line
    assert groups(daemon) == before  # nothing changed

    done = bob.cli("submit", "--state-dir", str(daemon.state_dir), "--workdir", str(lab.work),
                   "--group", "alexp", "--", "/bin/true")  # fmt: skip
    line = one_line(done.stderr)
    assert done.returncode != 0 and f"group alexp is {alice.name}'s" in line, line
    assert "only its owner's jobs may join it" in line and "may use: lab" in line, line
    reply = raw_request(
        bob, daemon, {"type": "submit", "argv": ["/bin/true"], "workdir": str(lab.work),
                      "group": "alexp"},
    )  # fmt: skip
    assert reply["ok"] is False and reply["code"] == "permission_denied", reply
    assert daemon.client.request("status")["jobs"] == []  # nothing of bob's was queued

    # alice's pause holds her job; root (an admin) may resume her group
    assert group(alice, daemon, "pause", "alexp")[0] == 0
    held_back = submit(alice, daemon, lab, "--group", "alexp", "--", "/bin/sleep", "30")
    wait_state(daemon, held_back, ("queued",), 30)
    assert groups(daemon)["alexp"]["paused"] is True
    rc, line = group(bob, daemon, "resume", "alexp")
    assert rc != 0 and "permission denied" in line
    daemon.client.request("resume_group", name="alexp")
    wait_state(daemon, held_back, ("running",), 60)

    # bob's own group and the admin's take his jobs
    assert group(bob, daemon, "set", "bobs")[0] == 0
    in_own = submit(bob, daemon, lab, "--group", "bobs", "--hold", "--", "/bin/true")
    in_lab = submit(bob, daemon, lab, "--group", "lab", "--hold", "--", "/bin/true")
    assert job(daemon, in_own)["group"] == "bobs" and job(daemon, in_lab)["group"] == "lab"
    rc, line = group(bob, daemon, "delete", "bobs")
    assert rc != 0 and "group bobs has 1 job(s) queued, held or running" in line


def test_a_dropped_admins_group_cannot_be_taken_over_with_the_jobs_still_in_it(
    lab: Lab, alice: LabUser, bob: LabUser
) -> None:
    daemon = lab.daemon(devices="cpu:2", extra_toml=CONFIG)
    held = submit(bob, daemon, lab, "--group", "lab", "--hold", "--", "/bin/true")
    waiting = submit(bob, daemon, lab, "--group", "lab", "--begin", "+1h", "--", "/bin/true")
    config = lab.base / "state.toml"
    config.write_text(config.read_text().replace("[groups.lab]\nmax_running = 2\n", ""))
    assert daemon.proc is not None
    daemon.proc.send_signal(signal.SIGHUP)
    wait_until(lambda: "lab" not in groups(daemon), 30, "the reload to drop group lab")

    rc, line = group(alice, daemon, "set", "lab", "--max-running", "1")
    assert rc != 0 and line.endswith(
        "group lab is still named by 2 queued, held or running job(s) of other users"
        " (a group the config no longer has); choose another name"
    ), line
    assert "lab" not in groups(daemon)
    rc, line = group(alice, daemon, "pause", "lab")
    assert rc != 0 and "no group 'lab'" in line, line
    assert job(daemon, held)["state"] == "held" and job(daemon, waiting)["state"] == "queued"
    assert "group" not in job(daemon, waiting)["reason"]
    # bob's held job is released: the group it named is gone, so it is in none (it was refused
    # as naming no group, and no edit could change its group)
    done = cli(bob, daemon, "release", held)
    assert done.returncode == 0, done.stderr
    assert job(daemon, held)["group"] is None
    decisions = daemon.client.request("show", id=held)["decisions"]
    # the release's decision (a pass may have started the job since: not the last one then)
    assert any(d["reason"].endswith("group lab is gone: it is in none") for d in decisions), [
        d["reason"] for d in decisions
    ]


def test_a_user_charges_only_the_accounts_the_config_lets_them(
    lab: Lab, alice: LabUser, bob: LabUser
) -> None:
    """``[accounts.NAME]`` by Unix group (alice's own group: useradd makes one per user) and by
    user name: each user charges only their own; bob's refusals (CLI, raw request, an admin
    restarting alice's job does not lend her account to bob) change nothing; taken off his
    account, bob may not release or edit a job he held while on it."""
    accounts = (
        f'[accounts.alexp]\nunix_group = "{alice.name}"\n\n'
        f'[accounts.bobgrant]\nusers = ["{bob.name}"]\n'
    )
    daemon = lab.daemon(devices="cpu:2", extra_toml=accounts)
    mine = submit(alice, daemon, lab, "--account", "alexp", "--", "/bin/true")
    wait_state(daemon, mine, ("succeeded",), 60)
    assert job(daemon, mine)["account"] == "alexp"
    done = cli(bob, daemon, "submit", "--workdir", str(lab.work), "--account", "alexp", "--",
               "/bin/true")  # fmt: skip
    line = one_line(done.stderr)
    assert done.returncode != 0 and line.endswith(
        f"permission denied: {bob.name} may not charge account alexp (it is for the members"
        f" of group {alice.name}; ask an admin to add you to [accounts.alexp])"
    ), line
    reply = raw_request(
        bob, daemon, {"type": "submit", "argv": ["/bin/true"], "workdir": str(lab.work),
                      "account": "alexp"},
    )  # fmt: skip
    assert reply["ok"] is False and reply["code"] == "permission_denied", reply
    done = cli(alice, daemon, "submit", "--workdir", str(lab.work), "--account", "bobgrant",
               "--", "/bin/true")  # fmt: skip
    assert done.returncode != 0 and f"{alice.name} may not charge account bobgrant" in done.stderr
    theirs = submit(bob, daemon, lab, "--account", "bobgrant", "--", "/bin/true")
    wait_state(daemon, theirs, ("succeeded",), 60)
    again = daemon.client.request("restart", id=mine)  # root restarts alice's job: still hers
    assert job(daemon, str(again["id"]))["owner"] == alice.name
    rows = {
        row["account"]: row["jobs"] for row in daemon.client.request("usage", by="account")["users"]
    }
    assert rows.get("alexp", 0) >= 1 and rows["bobgrant"] == 1 and "" not in rows

    # bob, taken off bobgrant (a reload), keeps no way to charge it through a job held or
    # waiting since: its release and an edit into new work are refused, and it stays held
    held = submit(bob, daemon, lab, "--account", "bobgrant", "--hold", "--", "/bin/true")
    config = lab.base / "state.toml"
    config.write_text(
        config.read_text().replace(f'users = ["{bob.name}"]', f'users = ["{alice.name}"]')
    )
    assert daemon.proc is not None
    daemon.proc.send_signal(signal.SIGHUP)
    said = f"permission denied: {bob.name} may not charge account bobgrant"

    def refused_to_bob() -> bool:
        done = cli(bob, daemon, "submit", "--workdir", str(lab.work), "--account", "bobgrant",
                   "--", "/bin/true")  # fmt: skip
        return done.returncode != 0 and said in done.stderr

    wait_until(refused_to_bob, 30, "the reload to take bob off bobgrant")
    for args in (("release", held), ("edit", held, "--", "/bin/sleep", "600")):
        done = cli(bob, daemon, *args)
        assert done.returncode != 0 and said in one_line(done.stderr), done.stderr
    reply = raw_request(bob, daemon, {"type": "release", "id": held})
    assert reply["ok"] is False and reply["code"] == "permission_denied", reply
    reply = raw_request(bob, daemon, {"type": "release", "all": True})
    assert reply["ok"] is True and reply["ids"] == [] and said in reply["refused"][held], reply
    assert job(daemon, held)["state"] == "held" and job(daemon, held)["argv"] == ["/bin/true"]
