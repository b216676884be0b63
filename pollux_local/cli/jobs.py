"""``pollux-local daemon | submit | status (ls) | show | logs | cancel | hold | release |
priority | nodes``: the daemon and the job commands."""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

from pollux_local.client import Client, resolve_state_dir, socket_path_for
from pollux_local.errors import PolluxError
from pollux_local.jobspec import load_job_spec

#: Variables of the submitting shell that describe *its* job, never the new one.
_LAUNCH_VARIABLES = frozenset(
    {"RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "NODE_RANK", "GROUP_RANK",
     "MASTER_ADDR", "MASTER_PORT", "CUDA_VISIBLE_DEVICES"}
)  # fmt: skip


def _client(args: argparse.Namespace) -> Client:
    return Client(socket_path_for(resolve_state_dir(args.state_dir)))


def _print_json(value: Any) -> None:
    json.dump(value, sys.stdout, indent=2, sort_keys=True)
    sys.stdout.write("\n")


# --- daemon --------------------------------------------------------------------------------


def cmd_daemon(args: argparse.Namespace) -> int:
    from pollux_local.daemon.config import load_config
    from pollux_local.daemon.server import run_daemon

    config = load_config(args.config, args.devices)
    if args.interval is not None:
        if args.interval <= 0:
            raise PolluxError(f"--interval must be positive, got {args.interval}")
        config = dataclasses.replace(config, interval_s=args.interval)
    if args.policy is not None:
        config = dataclasses.replace(config, policy=args.policy)
    return run_daemon(config, resolve_state_dir(args.state_dir), verbose=args.verbose)


# --- submit --------------------------------------------------------------------------------


def load_spec(path: str) -> dict[str, Any]:
    """A ``job.toml`` as submit fields (``pollux_local.jobspec`` reads and checks it)."""
    return load_job_spec(path).submit_fields()


def script_argv(script: str, args: list[str]) -> list[str]:
    """The command of a job: ``python -u SCRIPT ARGS`` for ``.py`` files, else the program."""
    path = Path(script).expanduser()
    if not path.exists():
        raise PolluxError(f"script {script} does not exist")
    if path.is_dir():
        raise PolluxError(f"script {script} is a directory")
    path = path.resolve()
    if path.suffix == ".py":
        return [sys.executable, "-u", str(path), *args]
    if not os.access(path, os.X_OK):
        raise PolluxError(f"script {script} is neither a .py file nor executable")
    return [str(path), *args]


def parse_env(pairs: list[str]) -> dict[str, str]:
    env: dict[str, str] = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep or not key:
            raise PolluxError(f"--env expects KEY=VALUE, got {pair!r}")
        env[key] = value
    return env


def build_submit_request(args: argparse.Namespace) -> dict[str, Any]:
    spec: dict[str, Any] = load_spec(args.spec) if args.spec else {}
    if args.script:
        script, extra = args.script, list(args.args)
    elif "script" in spec:
        script, extra = spec["script"], list(spec.get("args", [])) + list(args.args)
    elif args.spec:
        raise PolluxError(f"{args.spec}: job.script is missing (or give a SCRIPT)")
    else:
        raise PolluxError("submit needs a SCRIPT or --spec job.toml")
    if args.script and spec:
        extra = list(args.args) or list(spec.get("args", []))

    def pick(name: str) -> Any:
        value = getattr(args, name, None)
        return value if value is not None else spec.get(name)

    min_gpus = pick("min_gpus") or 1
    max_gpus = pick("max_gpus")
    if min_gpus < 1:
        raise PolluxError(f"--min-gpus must be at least 1, got {min_gpus}")
    if max_gpus is not None and max_gpus < min_gpus:
        raise PolluxError(f"min gpus {min_gpus} is greater than max gpus {max_gpus}")
    workdir = Path(args.workdir or spec.get("workdir") or os.getcwd()).expanduser().resolve()
    if not workdir.is_dir():
        raise PolluxError(f"workdir {workdir} is not a directory")
    env = {
        key: value
        for key, value in os.environ.items()
        if not key.startswith("POLLUX_") and key not in _LAUNCH_VARIABLES
    }
    env.update(spec.get("env", {}))
    env.update(parse_env(args.env or []))
    request: dict[str, Any] = {
        "argv": script_argv(script, extra),
        "workdir": str(workdir),
        "env": env,
        "min_gpus": int(min_gpus),
        "priority": int(pick("priority") or 0),
    }
    for key in ("max_gpus", "batch_size", "max_batch_size", "min_local_batch", "max_local_batch"):
        value = pick(key)
        if value is not None:
            request[key] = int(value)
    name = pick("name")
    if name:
        request["name"] = str(name)
    if spec.get("target"):
        request["target"] = spec["target"]
    if args.hold:
        request["hold"] = True
    return request


def cmd_submit(args: argparse.Namespace) -> int:
    request = build_submit_request(args)
    reply = _client(args).request("submit", **request)
    if args.json:
        _print_json(reply)
    else:
        print(f"submitted job {reply['id']} ({reply['state']})")
    return 0


# --- read commands ---------------------------------------------------------------------------


def _fmt(value: Any, spec: str = "", empty: str = "-") -> str:
    if value is None:
        return empty
    return format(value, spec) if spec else str(value)


def _duration(seconds: float | None) -> str:
    if seconds is None:
        return "-"
    seconds = int(seconds)
    if seconds >= 3600:
        return f"{seconds // 3600}h{seconds % 3600 // 60:02d}m"
    if seconds >= 60:
        return f"{seconds // 60}m{seconds % 60:02d}s"
    return f"{seconds}s"


def _where(devices: dict[str, list[str]]) -> str:
    if not devices:
        return "-"
    return " ".join(
        f"{node}:{','.join(d.partition(':')[2] for d in devs)}" for node, devs in devices.items()
    )


def _batch(job: dict[str, Any]) -> str:
    if job.get("local_batch"):
        return f"{job['local_batch']}x{job.get('accum_steps') or 1}x{job['replicas']}"
    return _fmt(job.get("batch_size"))


def format_status(jobs: list[dict[str, Any]]) -> str:
    header = ("ID", "NAME", "OWNER", "STATE", "GPUS", "WHERE", "BATCH m×s×K", "GOODPUT", "EFF",
              "PROGRESS", "ETA")  # fmt: skip
    rows = [header]
    for job in jobs:
        rows.append(
            (
                job["id"],
                str(job["name"])[:24],
                job["owner"],
                job["state"],
                str(job["gpus"]),
                _where(job["devices"]),
                _batch(job),
                _fmt(job.get("goodput"), ".1f"),
                _fmt(job.get("efficiency"), ".2f"),
                _fmt(job.get("progress"), ".0f"),
                _duration(job.get("eta_s")),
            )
        )
    widths = [max(len(row[i]) for row in rows) for i in range(len(header))]
    return "\n".join(
        "  ".join(c.ljust(w) for c, w in zip(row, widths, strict=False)).rstrip() for row in rows
    )


def cmd_status(args: argparse.Namespace) -> int:
    reply = _client(args).request("status")
    jobs = reply["jobs"]
    if args.active:
        jobs = [j for j in jobs if j["state"] not in ("succeeded", "failed", "cancelled")]
    if args.json:
        _print_json({"jobs": jobs})
    elif jobs:
        print(format_status(jobs))
    else:
        print("no jobs")
    return 0


def _time(stamp: float | None) -> str:
    if stamp is None:
        return "-"
    return datetime.datetime.fromtimestamp(stamp).strftime("%Y-%m-%d %H:%M:%S")


def cmd_show(args: argparse.Namespace) -> int:
    reply = _client(args).request("show", id=args.id)
    if args.json:
        _print_json(reply)
        return 0
    job = reply["job"]
    lines = [
        f"job {job['id']}  {job['name']}  ({job['owner']})",
        f"  state       {job['state']}" + (f"  — {job['reason']}" if job.get("reason") else ""),
        f"  command     {' '.join(job.get('argv') or [])}",
        f"  workdir     {job.get('workdir')}",
        f"  devices     {job['gpus']} ({_where(job['devices'])}), min {job['min_gpus']}, "
        f"max {_fmt(job.get('max_gpus'), empty='any')}",
        f"  batch       {_batch(job)}  (bounds {job.get('batch_bounds')})",
        f"  goodput     {_fmt(job.get('goodput'), '.1f')}  efficiency "
        f"{_fmt(job.get('efficiency'), '.2f')}  speedup {_fmt(job.get('speedup'), '.2f')}",
        f"  progress    {_fmt(job.get('progress'), '.1f')}  epoch {_fmt(job.get('epoch'))}  "
        f"metrics {job.get('metrics') or {}}",
        f"  restarts    {job['restarts']}  failures {job['failures']}",
        f"  submitted   {_time(job['submit_time'])}  started {_time(job['start_time'])}  "
        f"ended {_time(job['end_time'])}",
        f"  job dir     {job.get('job_dir')}",
        "decisions:",
    ]
    for entry in reply["decisions"]:
        lines.append(f"  {_time(entry['time'])}  {entry['kind']:<10} {entry['reason']}")
    print("\n".join(lines))
    return 0


def cmd_logs(args: argparse.Namespace) -> int:
    client = _client(args)
    offset = -abs(args.tail) if args.tail else 0
    while True:
        reply = client.request("logs", id=args.id, rank=args.rank, offset=offset)
        if reply["data"]:
            sys.stdout.write(reply["data"])
            sys.stdout.flush()
        more = reply["offset"] < reply["size"]
        offset = reply["offset"]
        if more:
            continue
        if not args.follow or reply["state"] in ("succeeded", "failed", "cancelled"):
            return 0
        time.sleep(0.5)


def cmd_nodes(args: argparse.Namespace) -> int:
    reply = _client(args).request("nodes")
    if args.json:
        _print_json(reply)
        return 0
    for node in reply["nodes"]:
        status = "up" if node["up"] else f"DOWN ({node.get('error') or 'unreachable'})"
        used = ", ".join(f"{d}→job {j}" for d, j in sorted(node["jobs"].items())) or "idle"
        load = _fmt(node.get("load"), ".2f")
        print(f"{node['name']} ({node['host']}): {status}, {len(node['devices'])} device(s) "
              f"[{', '.join(node['devices'])}], load/cpu {load}; {used}")  # fmt: skip
        if node["busy"]:
            print(f"  busy outside the scheduler: {', '.join(node['busy'])}")
    return 0


# --- changing jobs -------------------------------------------------------------------------


def cmd_cancel(args: argparse.Namespace) -> int:
    reply = _client(args).request("cancel", ids=list(args.ids))
    for job_id in reply["cancelled"]:
        print(f"cancelled job {job_id}")
    for entry in reply["skipped"]:
        print(f"job {entry['id']} had already {entry['state']}")
    return 0


def cmd_hold(args: argparse.Namespace) -> int:
    reply = _client(args).request("hold", id=args.id)
    print(f"job {reply['id']} is held")
    return 0


def cmd_release(args: argparse.Namespace) -> int:
    reply = _client(args).request("release", id=args.id)
    print(f"job {reply['id']} is queued again")
    return 0


def cmd_priority(args: argparse.Namespace) -> int:
    reply = _client(args).request("set_priority", id=args.id, priority=args.priority)
    print(f"job {reply['id']} priority {reply['priority']}")
    return 0


# --- registration ------------------------------------------------------------------------------


def register(subparsers: argparse._SubParsersAction) -> None:
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument(
        "--state-dir",
        help="the daemon's state directory (default: $POLLUX_LOCAL_STATE_DIR, "
        "else ~/.local/state/pollux-local)",
    )
    as_json = argparse.ArgumentParser(add_help=False)
    as_json.add_argument("--json", action="store_true", help="print JSON")

    p = subparsers.add_parser(
        "daemon", parents=[common], help="run the scheduler daemon (foreground)"
    )
    p.add_argument("--config", help="TOML config (nodes, devices, interval, policy)")
    p.add_argument("--devices", help="this machine's devices, e.g. cpu:2 or cuda:0,1")
    p.add_argument("--interval", type=float, help="scheduling interval in seconds")
    p.add_argument("--policy", choices=("goodput", "fifo"), help="allocation policy")
    p.add_argument("-v", "--verbose", action="store_true")
    p.set_defaults(func=cmd_daemon)

    p = subparsers.add_parser("submit", parents=[common, as_json], help="submit a training script")
    p.add_argument("script", nargs="?", help="the script (python file or executable)")
    p.add_argument("args", nargs=argparse.REMAINDER, help="arguments for the script")
    p.add_argument("--spec", help="a job.toml describing the job")
    p.add_argument("--name")
    p.add_argument("--min-gpus", type=int, dest="min_gpus")
    p.add_argument("--max-gpus", type=int, dest="max_gpus")
    p.add_argument("--batch-size", type=int, dest="batch_size", help="base batch size M0")
    p.add_argument("--max-batch-size", type=int, dest="max_batch_size")
    p.add_argument("--min-local-batch", type=int, dest="min_local_batch")
    p.add_argument("--max-local-batch", type=int, dest="max_local_batch")
    p.add_argument("--priority", type=int)
    p.add_argument("--workdir", help="working directory (default: the current one)")
    p.add_argument("--env", action="append", metavar="K=V", help="extra environment variable")
    p.add_argument("--hold", action="store_true", help="submit held")
    p.set_defaults(func=cmd_submit)

    for name, aliases in (("status", ["ls"]),):
        p = subparsers.add_parser(
            name, aliases=aliases, parents=[common, as_json], help="list jobs"
        )
        p.add_argument("--active", action="store_true", help="only jobs not finished")
        p.set_defaults(func=cmd_status)

    p = subparsers.add_parser("show", parents=[common, as_json], help="one job in detail")
    p.add_argument("id")
    p.set_defaults(func=cmd_show)

    p = subparsers.add_parser("logs", parents=[common], help="a job's output")
    p.add_argument("id")
    p.add_argument("-f", "--follow", action="store_true", help="keep printing until it ends")
    p.add_argument("--rank", type=int, default=0, help="which replica (default 0)")
    p.add_argument("--tail", type=int, metavar="BYTES", help="start this many bytes from the end")
    p.set_defaults(func=cmd_logs)

    p = subparsers.add_parser("cancel", parents=[common], help="cancel jobs")
    p.add_argument("ids", nargs="+", metavar="ID")
    p.set_defaults(func=cmd_cancel)

    p = subparsers.add_parser("hold", parents=[common], help="stop scheduling a job")
    p.add_argument("id")
    p.set_defaults(func=cmd_hold)

    p = subparsers.add_parser("release", parents=[common], help="schedule a held job again")
    p.add_argument("id")
    p.set_defaults(func=cmd_release)

    p = subparsers.add_parser("priority", parents=[common], help="set a job's priority")
    p.add_argument("id")
    p.add_argument("priority", type=int)
    p.set_defaults(func=cmd_priority)

    p = subparsers.add_parser("nodes", parents=[common, as_json], help="nodes and devices")
    p.set_defaults(func=cmd_nodes)
