"""Record a real daemon's replies for the TUI's tests (``fixtures/daemon_replies.json``).

Starts ``pollux-local daemon --devices cpu:2 --interval 1`` on a fresh state directory, runs a
few jobs to the states the TUI shows (one succeeded, one failed, two running with fitted
models and reports, one queued, one held, one cancelled), then records the frames the daemon
answers to ``status``, ``nodes``, ``usage``, and ``show`` and ``logs`` for every job, exactly as
they came over the socket (``{"v": 1, "ok": true, ...}``).  Paths are rewritten to neutral ones;
nothing else is touched.  The TUI's :class:`~pollux_local.tui.source.FixedSource` serves them
decoded through the api reply types (:mod:`pollux_local.tui.recording`), and
``test_recording.py`` re-records and compares the wire shape (:func:`wire_shape`).

Run ``python tests/tui/record_replies.py`` from the repository root to refresh the fixture
(about a minute), then look at the snapshots (``pytest tests/tui/test_snapshots.py``).
"""

from __future__ import annotations

import argparse
import json
import socket
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar, cast

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

import msgspec  # noqa: E402

from pollux_local import api  # noqa: E402
from pollux_local.api import wire  # noqa: E402
from pollux_local.client import build_request  # noqa: E402
from pollux_local.jobspec import load_job_spec  # noqa: E402
from pollux_local.tui.recording import RECORDING_VERSION  # noqa: E402
from tests.daemon_process import DaemonProcess  # noqa: E402

FIXTURE = Path(__file__).resolve().parent / "fixtures" / "daemon_replies.json"
STEADY_SPEC = Path(__file__).resolve().parent / "fixtures" / "steady_job" / "job.toml"
TABULAR_SPEC = REPO / "jobs" / "tabular_mlp" / "job.toml"
#: What the recording says instead of this machine's paths.
NEUTRAL_REPO = "/home/lab/pollux-local"
NEUTRAL_STATE = "/home/lab/.local/state/pollux-local"
#: A daemon config that fails a crashing job quickly (one retry after half a second).
CONFIG = """
[daemon]
backoff_s = 0.5
max_retries = 1
"""
CRASH = "import sys\nprint('loading data', flush=True)\nsys.exit('bad input shape (3, 224)')\n"

T = TypeVar("T")


class Daemon(DaemonProcess):
    """The shared real daemon, on cpu:2 scheduling every second with :data:`CONFIG`, started
    at once and stopped by :meth:`stop`; with the scenario's helpers."""

    def __init__(self, root: Path) -> None:
        (root / "config.toml").write_text(CONFIG)
        super().__init__(
            root / "state", "--config", str(root / "config.toml"), "--devices", "cpu:2",
            "--interval", "1", env={"POLLUX_LOCAL_STATE_DIR": None}, cwd=REPO,
        )  # fmt: skip
        self.start()

    def wait(self, predicate: Callable[[], T], timeout_s: float, what: str) -> T:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            value = predicate()
            if value:
                return value
            time.sleep(0.25)
        raise RuntimeError(f"timed out waiting for {what}; daemon log:\n{self.output()}")

    def jobs(self) -> dict[str, api.JobSummary]:
        return {job.id: job for job in self.client.call(api.Status()).jobs}

    def submit(self, spec: Path | None = None, script: Path | None = None, **fields: Any) -> str:
        """Submit a job of ``spec`` (a job.toml) or ``script``, with ``fields`` on top."""
        base: dict[str, Any] = {}
        if spec is not None:
            base = load_job_spec(spec).submit_fields()
            base["elastic"] = True  # the spec jobs train with the job library
            base.setdefault("workdir", str(spec.parent))
            script = Path(base.pop("script"))
            if not script.is_absolute():
                script = Path(base["workdir"]) / script
        assert script is not None
        args = [str(a) for a in base.pop("args", [])] + [str(a) for a in fields.pop("args", [])]
        base.setdefault("workdir", str(script.parent))
        base.update(fields)
        base["argv"] = [sys.executable, "-u", str(script), *args]
        request = cast(api.Submit, build_request("submit", **base))
        return self.client.call(request).id


def raw_reply(socket_path: Path, request: api.Request) -> dict[str, Any]:
    """The daemon's reply to ``request`` as it came over the socket: one JSON object."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        sock.settimeout(30)
        sock.connect(str(socket_path))
        sock.sendall(wire.encode_request(request))
        return wire.decode_object(wire.recv_frame(sock))


def _fitted(job: api.JobSummary) -> bool:
    return job.state == "running" and job.goodput is not None and job.eta_s is not None


def run_scenario(daemon: Daemon, tmp: Path) -> dict[str, str]:
    """Bring jobs to every state the TUI shows; returns {role: job id}."""
    ids: dict[str, str] = {}
    ids["succeeded"] = daemon.submit(TABULAR_SPEC)
    crash = tmp / "preprocess.py"
    crash.write_text(CRASH)
    ids["failed"] = daemon.submit(script=crash, name="preprocess")
    daemon.wait(
        lambda: {j.state for j in daemon.jobs().values()} == {"succeeded", "failed"},
        120,
        "the first two jobs to end",
    )
    ids["running-a"] = daemon.submit(STEADY_SPEC, name="steady-a", args=["--pause", "0.01"])
    daemon.wait(lambda: _fitted(daemon.jobs()[ids["running-a"]]), 90, "steady-a to be fitted")
    ids["running-b"] = daemon.submit(STEADY_SPEC, name="steady-b", args=["--pause", "0.02"])
    ids["held"] = daemon.submit(STEADY_SPEC, name="on-hold", hold=True)
    ids["cancelled"] = daemon.submit(STEADY_SPEC, name="mistake", hold=True)
    daemon.client.call(api.Cancel(ids=[ids["cancelled"]]))
    daemon.wait(
        lambda: all(_fitted(daemon.jobs()[ids[r]]) for r in ("running-a", "running-b")),
        120,
        "steady-a and steady-b to share the devices, both fitted",
    )
    ids["queued"] = daemon.submit(STEADY_SPEC, name="wide", min_gpus=2, priority=-1)
    time.sleep(2.5)  # two scheduling passes: the wide job stays queued
    states = {role: daemon.jobs()[job_id].state for role, job_id in ids.items()}
    expected = {role: role.split("-")[0] for role in ids}
    if states != expected:
        raise RuntimeError(f"the jobs are not in the states to record: {states}")
    return ids


def record(tmp: Path) -> dict[str, Any]:
    """Run the scenario on a fresh daemon under ``tmp`` and return the recording (JSON data)."""
    daemon = Daemon(tmp)
    try:
        ids = run_scenario(daemon, tmp)
        sock = daemon.state_dir / "daemon.sock"
        replies: dict[str, Any] = {
            "status": raw_reply(sock, api.Status()),
            "nodes": raw_reply(sock, api.Nodes()),
            "usage": raw_reply(sock, api.Usage()),
            "show": {},
            "logs": {},
        }
        recorded_at = time.time()
        for job_id in sorted(ids.values(), key=int):
            replies["show"][job_id] = raw_reply(sock, api.Show(id=job_id))
            replies["logs"][job_id] = raw_reply(sock, api.Logs(id=job_id, max_bytes=1 << 20))
    finally:
        daemon.stop()
    text = json.dumps(replies)
    for path, neutral in (
        (str(daemon.state_dir), NEUTRAL_STATE),
        (str(tmp), "/tmp/recording"),
        (str(REPO), NEUTRAL_REPO),
    ):
        text = text.replace(json.dumps(path)[1:-1], neutral)
    return {
        "version": RECORDING_VERSION,
        "recorded_at": recorded_at,
        "daemon": "pollux-local daemon --devices cpu:2 --interval 1",
        "jobs": {role: ids[role] for role in sorted(ids)},
        "replies": json.loads(text),
    }


# --- the wire shape ------------------------------------------------------------------------


def wire_shape(value: Any, kind: Any, path: str = "") -> set[str]:
    """The set of field paths in ``value`` (JSON data, decoded as ``kind``, an api type).

    A struct contributes the path of each field it holds (``.name``), a list its items
    (``[]``), a map of free keys (node names, metric names, ...) its values (``{}``); a null
    contributes nothing below its path.  Two recordings of the same daemon running the same
    scenario have the same shape, whatever their times, ids and figures; a field the daemon
    gains or loses, or one it starts or stops filling in, changes it.
    """
    return _shape(value, msgspec.inspect.type_info(kind), path)


def _shape(value: Any, info: msgspec.inspect.Type, path: str) -> set[str]:
    out = {path} if path else set()
    if value is None:
        return out
    if isinstance(info, msgspec.inspect.UnionType):
        for option in info.types:
            if _fits(value, option):
                return out | _shape(value, option, path)
        return out | {f"{path} (fits none of {info})"}
    if isinstance(info, msgspec.inspect.StructType):
        names = {f.encode_name: f.type for f in info.fields}
        for key, item in value.items():
            if key not in names:
                out.add(f"{path}.{key} (not in {info.cls.__name__})")
                continue
            out |= _shape(item, names[key], f"{path}.{key}")
        return out
    if isinstance(info, msgspec.inspect.ListType):
        for item in value:
            out |= _shape(item, info.item_type, f"{path}[]")
        return out
    if isinstance(info, msgspec.inspect.DictType):
        for item in value.values():
            out |= _shape(item, info.value_type, f"{path}{{}}")
        return out
    return out


def _fits(value: Any, info: msgspec.inspect.Type) -> bool:
    if isinstance(info, msgspec.inspect.NoneType):
        return value is None
    if isinstance(info, msgspec.inspect.StructType | msgspec.inspect.DictType):
        return isinstance(value, dict)
    if isinstance(info, msgspec.inspect.ListType):
        return isinstance(value, list)
    return not isinstance(value, dict | list)


def recording_shape(data: dict[str, Any]) -> set[str]:
    """The wire shape of a whole recording: each reply's under its request's name (the frame's
    envelope, ``v`` and ``ok``, is the client's business, not the reply's)."""

    def body(frame: dict[str, Any]) -> dict[str, Any]:
        return {k: v for k, v in frame.items() if k not in ("v", "ok")}

    replies = data["replies"]
    shape = wire_shape(body(replies["status"]), api.StatusReply, "status")
    shape |= wire_shape(body(replies["nodes"]), api.NodesReply, "nodes")
    if "usage" in replies:
        shape |= wire_shape(body(replies["usage"]), api.UsageReply, "usage")
    for frame in replies["show"].values():
        shape |= wire_shape(body(frame), api.ShowReply, "show")
    for frame in replies["logs"].values():
        shape |= wire_shape(body(frame), api.LogsReply, "logs")
    return shape


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--out", type=Path, default=FIXTURE, help=f"default: {FIXTURE}")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="pollux-rec-") as tmp:
        data = record(Path(tmp))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(data, indent=1, sort_keys=True) + "\n")
    print(f"wrote {args.out} ({len(data['replies']['show'])} jobs)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
