"""Accounts on a real daemon: a job is charged to an account (``submit --account``) its owner
may use, by name or by a Unix group (``[accounts.NAME]``); any other is refused in one line
on every path that queues or changes work (submit, restart, edit, release), and an account
the config dropped on every path; ``show`` reads the account and ``usage --by account`` sums each; the
config's ``[accounts]`` keys are checked.

The tests run the CLI as the user running them, who owns the daemon."""

from __future__ import annotations

import grp
import json
import os
import pwd
from pathlib import Path

import pytest

from pollux_local.daemon.config import load_config
from pollux_local.errors import PolluxError
from tests.daemon.test_groups import job, refused, run, submit, wait_state
from tests.daemon.test_operations import reload
from tests.daemon_process import DaemonFactory

pytestmark = pytest.mark.timeout(180)

ME = pwd.getpwuid(os.getuid()).pw_name
MY_GROUP = grp.getgrgid(os.getgid()).gr_name

CONFIG = f"""[scheduler]
policy = "fifo"
interval_s = 0.3

[daemon]
stop_grace_s = 2

[accounts.lab]
users = ["{ME}"]

[accounts.vision]
unix_group = "{MY_GROUP}"

[accounts.other]
users = ["nobody-of-this-lab"]
"""


def test_a_job_is_charged_to_an_account_its_owner_may_use_and_usage_sums_each(
    daemon_factory: DaemonFactory, tmp_path: Path
) -> None:
    daemon = daemon_factory(devices="cpu:2", config=CONFIG)
    lab = submit(daemon, tmp_path, "--account", "lab", "--", "sleep", "1")
    vision = submit(daemon, tmp_path, "--account", "vision", "--", "sleep", "1")
    plain = submit(daemon, tmp_path, "--", "true")
    line = refused(daemon, "submit", "--workdir", str(tmp_path), "--account", "other", "--", "true")
    assert line == (
        f"pollux-local: error: permission denied: {ME} may not charge account other (it is for"
        " nobody-of-this-lab; ask an admin to add you to [accounts.other])"
    )
    line = refused(daemon, "submit", "--workdir", str(tmp_path), "--account", "nope", "--", "true")
    assert line == "pollux-local: error: no account 'nope'; accounts: lab, vision, other"
    for job_id in (lab, vision, plain):
        wait_state(daemon, job_id, "succeeded")
    assert job(daemon, lab)["account"] == "lab"
    assert "  account     vision" in run(daemon, "show", vision).stdout
    usage = json.loads(run(daemon, "usage", "--by", "account", "--json").stdout)
    rows = {row["account"]: row for row in usage["users"]}
    assert set(rows) == {"lab", "vision", ""}
    assert [rows[name]["jobs"] for name in ("lab", "vision", "")] == [1, 1, 1]
    assert rows["lab"]["device_hours"] > 0 and rows["vision"]["device_hours"] > 0
    assert usage["total"]["jobs"] == 3
    table = run(daemon, "usage", "--by", "account").stdout
    assert "ACCOUNT" in table and "(none)" in table
    by_user = json.loads(run(daemon, "usage", "--json").stdout)["users"]
    assert [(row["user"], row["jobs"], row["account"]) for row in by_user] == [(ME, 3, None)]

    # the config drops [accounts.lab]: a restart (new work) and a release of a held job
    # charged to it are refused, naming the accounts left
    held = submit(daemon, tmp_path, "--hold", "--account", "lab", "--", "true")
    config = daemon.state_dir.parent / f"{daemon.state_dir.name}.toml"
    config.write_text(CONFIG.replace(f'[accounts.lab]\nusers = ["{ME}"]\n', ""))
    reload(daemon, "[accounts]")
    for args in (("restart", lab), ("release", held)):
        line = refused(daemon, *args)
        assert "no account 'lab'; accounts: vision, other" in line, line
    assert job(daemon, held)["state"] == "held"
    run(daemon, "restart", vision)  # an account still there: restarted as it was


def test_the_configs_accounts_are_checked(tmp_path: Path) -> None:
    path = tmp_path / "c.toml"
    for text, said in (
        ('[accounts.lab]\nuser = ["ada"]\n', "unknown key 'user' in [accounts.lab]"),
        ("[accounts.lab]\n", "names no one who may charge it"),
        ('[accounts.lab]\nusers = "ada"\n', "users must be a list of user names"),
        ("[accounts.lab]\nunix_group = 3\n", "unix_group must be a group's name"),
        ("[accounts]\nlab = 3\n", "[accounts.lab] must be a table"),
        ('[accounts."a b"]\nusers = ["ada"]\n', "an account's name is letters, digits and _.-"),
    ):
        path.write_text(text)
        with pytest.raises(PolluxError, match=said.replace("[", r"\[").replace("]", r"\]")):
            load_config(path, devices="cpu:1")
    path.write_text('[accounts.lab]\nusers = ["ada", "bob"]\n[accounts.nlp]\nunix_group = "nlp"\n')
    config = load_config(path, devices="cpu:1")
    assert [(a.name, sorted(a.users), a.unix_group) for a in config.accounts] == [
        ("lab", ["ada", "bob"], None),
        ("nlp", [], "nlp"),
    ]


def test_one_no_longer_allowed_an_account_may_not_edit_or_release_work_charged_to_it(
    daemon_factory: DaemonFactory, tmp_path: Path
) -> None:
    """Held (or queued) while its owner could charge the account, a job is not a way to go on
    charging it once they may not: an edit (a new command, more devices, a longer time) and a
    release are refused as a submit is; a cancel is not."""
    daemon = daemon_factory(devices="cpu:2", config=CONFIG)
    held = submit(daemon, tmp_path, "--hold", "--account", "lab", "--", "true")
    queued = submit(daemon, tmp_path, "--delay", "1d", "--account", "lab", "--", "true")
    config = daemon.state_dir.parent / f"{daemon.state_dir.name}.toml"
    config.write_text(CONFIG.replace(f'users = ["{ME}"]', 'users = ["someone-else"]'))
    reload(daemon, "[accounts]")
    said = f"permission denied: {ME} may not charge account lab (it is for someone-else;"
    for args in (
        ("release", held),
        ("edit", held, "--", "sleep", "100"),
        ("edit", queued, "--time", "1h"),
    ):
        line = refused(daemon, *args)
        assert said in line, line
    assert job(daemon, held)["state"] == "held"
    assert job(daemon, queued)["time_limit_s"] is None
    run(daemon, "cancel", held)
    assert job(daemon, held)["state"] == "cancelled"
