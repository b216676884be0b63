"""One user's loop of ``estimate`` requests (each a forecast of the whole queue) is paced:
the daemon keeps its time for the scheduling passes and the other users."""

from __future__ import annotations

import json

import pytest

from pollux_local.daemon.pacing import ESTIMATES_PER_MINUTE
from tests.abuse.lab import Lab, raw_request
from tests.labinstall import LabUser

pytestmark = [pytest.mark.timeout(300)]

#: As a user: N ``estimate`` frames, one connection each, as fast as replies come; prints
#: each reply's ``ok`` and error message as JSON lines.
ESTIMATE_LOOP = r"""
import json, socket, sys
path, body, count = sys.argv[1], sys.argv[2].encode(), int(sys.argv[3])
def recv(sock, n):
    data = b""
    while len(data) < n:
        chunk = sock.recv(n - len(data))
        if not chunk:
            raise SystemExit("closed")
        data += chunk
    return data
for _ in range(count):
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.settimeout(30)
    sock.connect(path)
    sock.sendall(len(body).to_bytes(4, "big") + body)
    reply = json.loads(recv(sock, int.from_bytes(recv(sock, 4), "big")))
    sock.close()
    print(json.dumps({"ok": reply["ok"], "code": reply.get("code"),
                      "message": reply.get("error", "")}))
"""


def test_a_loop_of_estimates_is_paced_per_user(lab: Lab, alice: LabUser, bob: LabUser) -> None:
    daemon = lab.daemon("cpu:1")
    request = {
        "v": 1,
        "type": "estimate",
        "submit": {"argv": ["/bin/true"], "workdir": str(lab.work)},
    }
    done = bob.python(
        ESTIMATE_LOOP,
        str(daemon.state_dir / "daemon.sock"),
        json.dumps(request),
        str(ESTIMATES_PER_MINUTE + 5),
        timeout_s=240,
    )
    assert done.returncode == 0, done.stderr
    replies = [json.loads(line) for line in done.stdout.splitlines()]
    answered = [reply for reply in replies if reply["ok"]]
    refused = [reply for reply in replies if not reply["ok"]]
    # the first ones are answered; past the minute's budget every one is refused, in one line
    assert len(answered) == ESTIMATES_PER_MINUTE, replies[:3]
    assert replies[:ESTIMATES_PER_MINUTE] == answered
    assert len(refused) == 5
    for reply in refused:
        assert reply["code"] == "limit_exceeded"
        assert f"at most {ESTIMATES_PER_MINUTE} a minute per user" in reply["message"]
        assert "\n" not in reply["message"]
    # alice's budget is her own
    mine = raw_request(alice, daemon, {k: v for k, v in request.items() if k != "v"})
    assert mine["ok"] is True and mine["jobs"][0]["name"] == "true"
