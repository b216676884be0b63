"""A hostile lab member against the models the daemon fits from job reports: one test per
attack, each with two real Unix users against a real root daemon (``tests/abuse/conftest.py``).

* poisoning: alice copies bob's command, folder and batch size (all shown by ``show``),
  submits the same job and reports invented throughput for it, over the socket and in its
  ``report.json``; then sends a ``report`` naming bob's job.  Bob's model must not move, and
  the report naming his job is refused in one line.
* flooding: alice sends a report of 100,000 profile rows (11 MB), then as many reports as the
  daemon takes, each with new configurations, while bob asks for ``status``.  The big one is
  refused in one line naming the field; one report per half second is taken, what is kept of
  her points stays bounded, bob's ``status`` stays quick and, once she stops, a pass costs
  what it cost before.
"""

from __future__ import annotations

import json
import statistics
import subprocess
import time
from typing import Any

import psutil
import pytest

from tests.abuse.lab import Lab, job, raw_request, submit, wait_state
from tests.labinstall import LabDaemon, LabUser, wait_until

pytestmark = [pytest.mark.timeout(240)]

#: What a user-side script needs to talk to the daemon: one persistent connection, framed
#: requests, and profile rows (local batches ``start`` .. ``start + n - 1``).
CLIENT = r"""
import json, socket, sys, time

def connect(path):
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.settimeout(60)
    sock.connect(path)
    return sock

def recv(sock, n):
    data = b""
    while len(data) < n:
        chunk = sock.recv(n - len(data))
        if not chunk:
            raise ConnectionError("the daemon closed the connection")
        data += chunk
    return data

def call(sock, message):
    body = json.dumps({"v": 1, **message}).encode()
    sock.sendall(len(body).to_bytes(4, "big") + body)
    return json.loads(recv(sock, int.from_bytes(recv(sock, 4), "big")))

def rows(start, n, seconds_per_example=0.001):
    return [{"nodes": 1, "replicas": 1, "local_batch": m, "compute_s": seconds_per_example * m,
             "step_s": seconds_per_example * m * 1.1, "count": 5} for m in range(start, start + n)]
"""

#: alice: one report of 100,000 rows for her job; the reply printed.
HUGE_REPORT = (
    CLIENT
    + r"""
sock = connect(sys.argv[1])
report = {"profile": rows(1, 100_000), "grad_stats": {"sqr": 1.0, "var": 4.0}}
print(json.dumps(call(sock, {"type": "report", "job_id": sys.argv[2], "report": report})))
"""
)

#: alice: reports of ``per`` new configurations each, back to back for ``seconds``.
FLOOD = (
    CLIENT
    + r"""
path, job_id, seconds, per = sys.argv[1], sys.argv[2], float(sys.argv[3]), int(sys.argv[4])
deadline = time.monotonic() + seconds
sent = accepted = 0
refusals = {}
start = 1
sock = connect(path)
while time.monotonic() < deadline:
    report = {"profile": rows(start, per), "grad_stats": {"sqr": 1.0, "var": 4.0},
              "bounds": {"base_batch": 32}}
    try:
        reply = call(sock, {"type": "report", "job_id": job_id, "report": report})
    except (OSError, ConnectionError):
        sock = connect(path)
        continue
    sent += 1
    start += per
    if reply.get("ok"):
        accepted += bool(reply.get("accepted"))
    else:
        refusals[reply.get("code")] = refusals.get(reply.get("code"), 0) + 1
print(json.dumps({"sent": sent, "accepted": accepted, "refusals": refusals}))
"""
)

#: bob: ``n`` status requests, each on a new connection as the CLI makes them; seconds each.
STATUS_LATENCY = (
    CLIENT
    + r"""
latencies = []
for _ in range(int(sys.argv[2])):
    began = time.monotonic()
    sock = connect(sys.argv[1])
    reply = call(sock, {"type": "status"})
    sock.close()
    latencies.append(time.monotonic() - began)
    assert reply.get("ok"), reply
    time.sleep(0.05)
print(json.dumps(latencies))
"""
)


def sleeper(lab: Lab) -> str:
    """A job script (rigid) that only waits."""
    return str(lab.script("sleeper.sh", "exec sleep 600\n"))


def model(daemon: LabDaemon, job_id: str) -> dict[str, Any] | None:
    found = job(daemon, job_id)["model"]
    return dict(found) if found is not None else None


def cpu_seconds(daemon: LabDaemon, over_s: float) -> float:
    """CPU time (user + system) the daemon's process spends in ``over_s`` seconds."""
    proc = psutil.Process(daemon.pid)
    before = proc.cpu_times()
    time.sleep(over_s)
    after = proc.cpu_times()
    return (after.user - before.user) + (after.system - before.system)


def sock_path(daemon: LabDaemon) -> str:
    return str(daemon.state_dir / "daemon.sock")


def test_another_users_reports_never_change_a_jobs_model(
    lab: Lab, alice: LabUser, bob: LabUser
) -> None:
    daemon = lab.daemon(devices="cpu:2")
    honest = lab.base / "honest.json"
    honest.write_text(
        json.dumps(
            {
                "version": 1,
                "bounds": {"base_batch": 32, "max_batch": 512, "min_local": 8},
                "profile": [
                    {
                        "nodes": 1,
                        "replicas": 1,
                        "local_batch": 32,
                        "compute_s": 0.05,
                        "step_s": 0.05,
                        "count": 20,
                    },
                    {
                        "nodes": 1,
                        "replicas": 1,
                        "local_batch": 64,
                        "compute_s": 0.09,
                        "step_s": 0.09,
                        "count": 20,
                    },
                    {
                        "nodes": 1,
                        "replicas": 2,
                        "local_batch": 32,
                        "compute_s": 0.05,
                        "step_s": 0.07,
                        "count": 20,
                    },
                ],  # fmt: skip
                "grad_stats": {"sqr": 1.0, "var": 4.0},
                "epoch": 0,
            }
        )
    )
    honest.chmod(0o644)
    # one script for both: bob's run writes his measurements, anyone else's only waits
    script = lab.script(
        "train.sh",
        f"""if [ "$(id -u)" = "{bob.uid}" ]; then
    cat {honest} > "$POLLUX_JOB_DIR/report.json.tmp"
    mv "$POLLUX_JOB_DIR/report.json.tmp" "$POLLUX_JOB_DIR/report.json"
fi
exec sleep 600
""",
    )
    args = ("--gpus", "1", "--batch-size", "32", str(script))
    bobs = submit(bob, daemon, lab, "--name", "bobs", *args)
    wait_state(daemon, bobs, ("running",), 60)
    before = wait_until(lambda: model(daemon, bobs), 60, "bob's job to have a model")
    assert before["fitted_points"] == 3
    # alice: the same command, folder and batch size (from bob's show), her own job
    shown = job(daemon, bobs)
    assert shown["argv"] == [str(script)] and shown["workdir"] == str(lab.work)
    alices = submit(alice, daemon, lab, "--name", "copy", *args)
    wait_state(daemon, alices, ("running",), 60)
    fake = [
        {"nodes": 1, "replicas": k, "local_batch": m, "compute_s": 1e-4, "step_s": 1e-4,
         "count": 1000}
        for k, m in ((1, 8), (1, 16), (1, 128), (2, 64), (2, 128))
    ]  # fmt: skip
    report = {"bounds": {"base_batch": 32}, "profile": fake, "epoch": 0,
              "grad_stats": {"sqr": 1e-6, "var": 1e3}}  # fmt: skip
    # over the socket, for her own job: taken (it only concerns her)
    reply = raw_request(alice, daemon, {"type": "report", "job_id": alices, "report": report})
    assert reply.get("ok") and reply.get("accepted"), reply
    wait_until(
        lambda: (m := model(daemon, alices)) is not None and m["profile_points"] == 5,
        30, "alice's report to be taken",
    )  # fmt: skip
    # and in her job's report.json, read by the next passes
    alice_dir = daemon.state_dir / "jobs" / alices
    file_report = {**report, "profile": [{**row, "local_batch": row["local_batch"] * 3}
                                         for row in fake]}  # fmt: skip
    done = alice.python(
        "import json, os, sys\n"
        "tmp = os.path.join(sys.argv[1], 'report.json.tmp')\n"
        "open(tmp, 'w').write(sys.argv[2])\n"
        "os.replace(tmp, os.path.join(sys.argv[1], 'report.json'))\n",
        str(alice_dir), json.dumps(file_report),
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    wait_until(
        lambda: job(daemon, alices)["report"]["profile"][0]["local_batch"] == 24,
        30, "alice's report.json to be taken",
    )  # fmt: skip
    time.sleep(1.5)  # a few more passes (0.5 s each), each fitting every running job's model
    # a report naming bob's job: refused in one line, and nothing of it kept
    forged = raw_request(alice, daemon, {"type": "report", "job_id": bobs, "report": report})
    assert forged.get("ok") is False and forged.get("code") == "permission_denied", forged
    assert "\n" not in forged["error"] and f"job {bobs}" in forged["error"], forged
    assert job(daemon, bobs)["report"]["profile"][0]["compute_s"] == 0.05
    after = model(daemon, bobs)
    assert after == before, f"bob's model moved with alice's reports: {before} -> {after}"
    # hers reached her own job's model
    assert model(daemon, alices) != before


def test_a_report_flood_stays_bounded_and_does_not_slow_other_users(
    lab: Lab, alice: LabUser, bob: LabUser
) -> None:
    daemon = lab.daemon(devices="cpu:2")
    script = sleeper(lab)
    bobs = submit(bob, daemon, lab, "--name", "quiet", "--gpus", "1", str(script))
    alices = submit(alice, daemon, lab, "--name", "flood", "--gpus", "1", "--batch-size", "32",
                    str(script))  # fmt: skip
    wait_state(daemon, bobs, ("running",), 60)
    wait_state(daemon, alices, ("running",), 60)
    time.sleep(1.0)
    baseline_cpu = cpu_seconds(daemon, 4.0)
    # 100,000 rows (11 MB): refused in one line naming the field, nothing kept
    done = alice.python(HUGE_REPORT, sock_path(daemon), alices, timeout_s=120)
    assert done.returncode == 0, done.stderr
    reply = json.loads(done.stdout)
    assert reply.get("ok") is False and reply.get("code") == "invalid_request", reply
    assert "$.report.profile" in reply["error"] and "\n" not in reply["error"], reply
    assert job(daemon, alices)["report"] is None
    # reports within the bounds, back to back, each with 256 new configurations
    flood = alice.popen(
        lab.install.python, "-c", FLOOD, sock_path(daemon), alices, "10", "256",
        stdout=subprocess.PIPE, stderr=subprocess.PIPE,
    )  # fmt: skip
    try:
        time.sleep(1.0)
        done = bob.python(STATUS_LATENCY, sock_path(daemon), "30", timeout_s=120)
        assert done.returncode == 0, done.stderr
        latencies = sorted(json.loads(done.stdout))
        out, err = flood.communicate(timeout=60)
    finally:
        if flood.poll() is None:
            flood.kill()
    assert flood.returncode == 0, err
    sent = json.loads(out)
    assert sent["sent"] >= 20, sent  # it did flood
    # one report of a job taken per MIN_REPORT_INTERVAL_S (0.5 s); the rest answered, not kept
    assert 1 <= sent["accepted"] <= 10 / 0.5 + 2, sent
    p50 = statistics.median(latencies)
    p90 = latencies[int(0.9 * (len(latencies) - 1))]
    assert p50 < 0.25 and p90 < 0.5, f"bob's status took {latencies} during {sent}"
    # what is kept of her points is bounded: the latest report's rows and a capped pool
    kept = job(daemon, alices)
    assert len(kept["report"]["profile"]) == 256
    fitted = wait_until(lambda: model(daemon, alices), 30, "alice's model")["fitted_points"]
    assert fitted <= 2 * 256, f"{fitted} points kept after {sent['accepted']} reports"
    # once she stops, a pass costs what it cost before her reports
    time.sleep(1.0)
    after_cpu = cpu_seconds(daemon, 4.0)
    assert after_cpu < baseline_cpu + 0.6, (
        f"daemon CPU over 4 s: {baseline_cpu:.2f} s before the flood, {after_cpu:.2f} s after"
    )
