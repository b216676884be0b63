"""Retries per job and a delayed start, end to end on a real daemon (cpu:2, a pass a second,
``[daemon] max_retries = 2``, back-off 0.2 s): a plain script that crashes runs once unless
``--retries`` asks for more, an elastic one gets the admin's ``max_retries``; ``--retries``
above the cap is refused by submit and edit alike; ``--delay`` holds a job until its time
(the reason, the forecast, ``show``) and it then starts by itself; ``edit`` moves the time."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import msgspec
import pytest

from pollux_local.api.errors import LimitExceeded, PolluxError
from pollux_local.api.spec import JobSpec
from pollux_local.daemon.config import DaemonConfig, NodeConfig
from pollux_local.daemon.executor.exits import most_retries, retries_allowed
from pollux_local.daemon.jobrules import check_job
from tests.daemon.test_e2e import CONFIG, Daemon
from tests.daemon.test_operations import reload
from tests.daemon_process import DaemonFactory

pytestmark = pytest.mark.timeout(180)

#: Counts its runs in ``runs-<tag>`` beside it, says so, and exits 3.
CRASH = """
import sys
from pathlib import Path
runs = Path(__file__).with_name("runs-" + sys.argv[1])
with runs.open("a") as out:
    out.write("run\\n")
print("boom: bad input shape", flush=True)
sys.exit(3)
"""

QUICK = "print('ran', flush=True)\n"


@pytest.fixture
def daemon(tmp_path: Path, daemon_factory: DaemonFactory) -> Daemon:
    (tmp_path / "crash.py").write_text(CRASH)
    (tmp_path / "quick.py").write_text(QUICK)
    d = Daemon(daemon_factory, CONFIG)
    d.start()
    return d


def show(daemon: Daemon, job_id: str) -> dict[str, Any]:
    return dict(json.loads(daemon.cli("show", job_id, "--json").stdout))


def runs(daemon: Daemon, tag: str) -> int:
    path = daemon.root / f"runs-{tag}"
    return len(path.read_text().splitlines()) if path.exists() else 0


def ended(daemon: Daemon, job_id: str, timeout: float = 60) -> dict[str, Any]:
    jobs = daemon.wait_for(lambda j: j[job_id]["state"] in ("succeeded", "failed"), timeout)
    return jobs[job_id]


def test_a_rigid_script_runs_once_unless_asked_and_an_elastic_job_gets_max_retries(
    daemon: Daemon,
) -> None:
    once = daemon.submit("crash.py", "once")
    asked = daemon.submit("--retries", "1", "crash.py", "asked")
    elastic = daemon.submit("--elastic", "--max-gpus", "1", "crash.py", "elastic")

    reason = ended(daemon, once)["reason"]
    assert "code 3" in reason and "boom: bad input shape" in reason
    assert "not retried" in reason and "--retries" in reason, reason
    shown = show(daemon, once)
    assert (shown["job"]["retries_used"], shown["job"]["retries_allowed"]) == (0, 0)
    assert not [d for d in shown["decisions"] if d["kind"] == "crashed"]

    reason = ended(daemon, asked)["reason"]
    assert reason.endswith("gave up after 1 restart(s)"), reason
    shown = show(daemon, asked)
    crashes = [d["reason"] for d in shown["decisions"] if d["kind"] == "crashed"]
    assert len(crashes) == 1 and crashes[0].endswith("retry 1/1 in 0.2 s"), crashes
    assert (shown["job"]["retries_used"], shown["job"]["retries_allowed"]) == (1, 1)
    assert "retries 1/1" in daemon.cli("show", asked).stdout

    reason = ended(daemon, elastic)["reason"]
    assert reason.endswith("gave up after 2 restart(s)"), reason  # max_retries = 2
    assert show(daemon, elastic)["job"]["retries_allowed"] == 2

    time.sleep(1.5)  # a few passes: nothing runs a failed job again
    assert (runs(daemon, "once"), runs(daemon, "asked"), runs(daemon, "elastic")) == (1, 2, 3)


def test_retries_above_the_cap_are_refused_by_submit_and_edit(daemon: Daemon) -> None:
    refused = daemon.cli("submit", "--retries", "11", "quick.py", check=False)
    assert refused.returncode != 0
    [line] = refused.stderr.strip().splitlines()
    assert "--retries 11" in line and "10" in line and "max_retries" in line, line
    assert daemon.status() == {}  # nothing was queued

    held = daemon.submit("--hold", "quick.py")
    refused = daemon.cli("edit", held, "--retries", "50", check=False)
    assert refused.returncode != 0 and "--retries 50" in refused.stderr
    assert show(daemon, held)["job"]["retries_allowed"] == 0
    edited = daemon.cli("edit", held, "--retries", "4").stdout
    assert "retries" in edited
    shown = show(daemon, held)
    assert (shown["job"]["retries_used"], shown["job"]["retries_allowed"]) == (0, 4)
    assert "retries 0/4" in daemon.cli("show", held).stdout


def test_the_cap_is_the_larger_of_ten_and_max_retries() -> None:
    nodes = (NodeConfig("n", ("cpu:0",)),)
    spec = JobSpec(argv=["x"], workdir="/", elastic=False, retries=12)
    low, high = DaemonConfig(nodes=nodes, max_retries=2), DaemonConfig(nodes=nodes, max_retries=12)
    assert (most_retries(low), most_retries(high)) == (10, 12)
    with pytest.raises(LimitExceeded, match="--retries 12 is more than 10"):
        check_job(spec, low)
    assert check_job(spec, high).retries == 12
    # the defaults: none for a rigid job, max_retries for an elastic one; a job's own
    # retries never beyond the cap in force now (an admin lowered max_retries since)
    rigid, elastic = (
        JobSpec(argv=["x"], workdir="/", elastic=False),
        JobSpec(argv=["x"], workdir="/"),
    )
    assert (retries_allowed(rigid, high), retries_allowed(elastic, high)) == (0, 12)
    assert retries_allowed(spec, low) == 10
    assert retries_allowed(msgspec.structs.replace(spec, retries=0), high) == 0


def test_a_delayed_job_waits_for_its_time_then_starts_by_itself(daemon: Daemon) -> None:
    before = time.time()
    job_id = daemon.submit("--delay", "10s", "quick.py")  # room for a loaded machine's CLI
    begin_at = show(daemon, job_id)["job"]["begin_at"]
    assert before + 10 <= begin_at <= time.time() + 10
    waiting = daemon.wait_for(lambda j: j[job_id]["reason"].startswith("waiting: --begin"), 10)
    row = waiting[job_id]
    assert row["state"] == "queued" and row["reason"].startswith("waiting: --begin, in "), row
    # the forecast never has it start before its time
    assert row["expected_start"] is not None and row["expected_start"] >= begin_at - 0.01, row
    text = daemon.cli("show", job_id).stdout
    assert "begin" in text and "(in " in text, text
    final = ended(daemon, job_id, 30)
    assert final["state"] == "succeeded", final
    assert final["start_time"] >= begin_at, (final["start_time"], begin_at)
    assert final["start_time"] < begin_at + 5  # started by the first pass after its time
    assert "(passed)" in daemon.cli("show", job_id).stdout


def test_the_forecast_of_a_job_delayed_an_hour_starts_it_then(daemon: Daemon) -> None:
    """On an idle daemon: ``estimate`` and ``status``'s expected start are the begin time,
    not now; ``edit --begin now`` lets it run at once."""
    before = time.time()
    job_id = daemon.submit("--delay", "1h", "quick.py")
    begin_at = show(daemon, job_id)["job"]["begin_at"]
    row = daemon.wait_for(lambda j: j[job_id]["expected_start"] is not None, 10)[job_id]
    assert row["expected_start"] >= begin_at - 0.01 and row["state"] == "queued", row
    text = daemon.cli("show", job_id).stdout
    assert "(in 59m)" in text or "(in 1h" in text, text

    estimate = json.loads(daemon.cli("estimate", "--json", "--delay", "1h", "quick.py").stdout)
    [forecast] = estimate["jobs"]
    assert forecast["start"] is not None and forecast["start"] >= before + 3600, forecast
    assert forecast["waiting"].startswith("waiting: --begin, in "), forecast

    daemon.cli("edit", job_id, "--begin", "now")
    assert ended(daemon, job_id, 30)["state"] == "succeeded"


def test_a_begin_time_in_the_past_starts_at_once_and_one_out_of_range_is_refused(
    daemon: Daemon,
) -> None:
    client = daemon.process.client
    past = client.request(
        "submit", argv=["true"], workdir=str(daemon.root), begin_at=time.time() - 3600
    )
    assert ended(daemon, str(past["id"]), 30)["state"] == "succeeded"
    refused = daemon.cli("edit", str(past["id"]), "--delay", "400d", check=False)
    assert refused.returncode != 0 and "366 days" in refused.stderr
    with pytest.raises(PolluxError, match="begin_at"):
        client.request("submit", argv=["true"], workdir=str(daemon.root), begin_at=5e9)


def test_release_all_checks_each_job_against_the_config_in_force(
    tmp_path: Path, daemon_factory: DaemonFactory
) -> None:
    """``--retries 12`` passes while ``max_retries = 12``; once a reload lowers it, ``release
    --all`` leaves that job held with the reason and releases the others (validate_jobs)."""
    (tmp_path / "quick.py").write_text(QUICK)
    daemon = Daemon(daemon_factory, CONFIG.replace("max_retries = 2", "max_retries = 12"))
    daemon.start()
    many = daemon.submit("--hold", "--retries", "12", "quick.py")
    few = daemon.submit("--hold", "--retries", "5", "quick.py")
    (daemon.state_dir.parent / f"{daemon.state_dir.name}.toml").write_text(CONFIG)
    reload(daemon.process, "reloaded")
    released = json.loads(daemon.cli("release", "--all", "--json").stdout)
    assert released["ids"] == [few], released
    assert list(released["refused"]) == [many]
    assert released["refused"][many].startswith("limit exceeded: --retries 12 is more than 10")
    assert daemon.status()[many]["state"] == "held"
    assert ended(daemon, few, 30)["state"] == "succeeded"
    text = daemon.cli("release", "--all").stdout
    assert text.splitlines() == [
        "released no job",
        f"job {many} left as it was: {released['refused'][many]}",
    ]
