"""Sample data for ``pollux-local tui --demo``, the docs' screenshots and the render benchmark.

:func:`demo_recording` makes a deterministic, self-consistent cluster of any size as reply
frames shaped like the daemon's, and decodes them through the api reply types exactly as a
recording from a real daemon is decoded (:func:`~pollux_local.tui.recording.recording_from_data`),
so the demo cannot show a shape the daemon never sends.  The TUI's tests use a real daemon's
recorded replies instead (``tests/tui/fixtures/daemon_replies.json``).  No textual import.
"""

from __future__ import annotations

import random
from typing import Any

from pollux_local.tui.recording import RECORDING_VERSION, Recording, recording_from_data

#: When the demo cluster is looked at.
DEMO_NOW = 1_732_323_000.0

_NAMES = ("resnet", "bert", "cifar10", "yolov3", "deepspeech2", "ncf", "imagenet", "gpt2")
_OWNERS = ("alice", "bob", "carol", "dave")
_APPS: dict[str, dict[str, float]] = {
    # rough per-app parameters in the throughput model's units (s, s/example)
    "resnet": {"alpha_c": 0.02, "beta_c": 0.0009, "alpha_r": 0.01, "beta_r": 0.002},
    "bert": {"alpha_c": 0.05, "beta_c": 0.02, "alpha_r": 0.04, "beta_r": 0.006},
    "cifar10": {"alpha_c": 0.01, "beta_c": 0.0002, "alpha_r": 0.006, "beta_r": 0.001},
    "yolov3": {"alpha_c": 0.08, "beta_c": 0.04, "alpha_r": 0.05, "beta_r": 0.01},
    "deepspeech2": {"alpha_c": 0.06, "beta_c": 0.01, "alpha_r": 0.03, "beta_r": 0.004},
    "ncf": {"alpha_c": 0.004, "beta_c": 0.00001, "alpha_r": 0.01, "beta_r": 0.001},
    "imagenet": {"alpha_c": 0.1, "beta_c": 0.002, "alpha_r": 0.05, "beta_r": 0.008},
    "gpt2": {"alpha_c": 0.09, "beta_c": 0.03, "alpha_r": 0.08, "beta_r": 0.01},
}
_ENDED = {"succeeded": "finished", "failed": "replica exited with code 1; gave up after 3 restarts"}


def demo_recording(
    n_jobs: int = 8, n_nodes: int = 2, devices_per_node: int = 4, seed: int = 0
) -> Recording:
    """A cluster of ``n_nodes`` x ``devices_per_node`` GPUs and ``n_jobs`` jobs, taken at
    :data:`DEMO_NOW`.

    Running jobs are packed onto devices in id order; the last device of the last node that is
    up is used by a process outside the scheduler and, with three or more nodes, the last node
    is down.
    """
    return recording_from_data(demo_data(n_jobs, n_nodes, devices_per_node, seed), "demo")


def demo_data(
    n_jobs: int = 8, n_nodes: int = 2, devices_per_node: int = 4, seed: int = 0
) -> dict[str, Any]:
    """The recording of :func:`demo_recording` as JSON data (reply frames)."""
    rng = random.Random(seed)
    node_names = [f"ws{i + 1}" for i in range(n_nodes)]
    last_up = n_nodes - 2 if n_nodes >= 3 else n_nodes - 1
    down_node = node_names[-1] if n_nodes >= 3 else None
    external = (node_names[last_up], f"cuda:{devices_per_node - 1}")
    free = [
        (node, f"cuda:{d}")
        for node in node_names
        if node != down_node
        for d in range(devices_per_node)
        if (node, f"cuda:{d}") != external
    ]
    holders: dict[tuple[str, str], str] = {}
    jobs: list[dict[str, Any]] = []
    shows: dict[str, dict[str, Any]] = {}
    logs: dict[str, dict[str, Any]] = {}
    base_time = DEMO_NOW - 3000.0
    for j in range(n_jobs):
        job_id = str(j + 1)
        app = _NAMES[j % len(_NAMES)]
        owner = _OWNERS[rng.randrange(len(_OWNERS))]
        want = rng.choice((1, 1, 2, 2, 3, 4))
        state = "queued"
        placement: dict[str, list[str]] = {}
        if len(free) >= want and rng.random() < 0.85:
            state = "running" if rng.random() < 0.9 else "rescaling"
            for _ in range(want):
                node, dev = free.pop(0)
                placement.setdefault(node, []).append(dev)
                holders[(node, dev)] = job_id
        elif rng.random() < 0.25:
            state = rng.choice(("held", "succeeded", "failed"))
        replicas = sum(len(v) for v in placement.values())
        base_batch = rng.choice((32, 64, 128))
        local_batch = base_batch * rng.choice((1, 2))
        accum = rng.choice((1, 1, 2))
        total = max(replicas, 1) * local_batch * accum
        params = dict(_APPS[app])
        params.update(alpha_n=params["alpha_r"] * 1.6, beta_n=params["beta_r"] * 1.5, gamma=1.4)
        phi = base_batch * rng.uniform(0.5, 12.0)
        sqr = rng.uniform(0.5, 3.0)
        var = phi * sqr / base_batch
        eff = (phi + base_batch) / (phi + total)
        running = state in ("running", "rescaling")
        started = state != "queued"
        thr = total / (params["alpha_c"] + params["beta_c"] * local_batch) / accum
        goodput = thr * eff if running else 0.0
        progress = rng.uniform(200.0, 20_000.0) if started else None
        submit_time = base_time + 60.0 * j
        ended = state in _ENDED
        epoch = int(progress // 500) if progress is not None else None
        job: dict[str, Any] = {
            "id": job_id,
            "name": f"{app}-{j + 1}",
            "owner": owner,
            "state": state,
            "gpus": replicas,
            "devices": placement,
            "nodes": sorted(placement),
            "batch_size": total if running else base_batch,
            "local_batch": local_batch if running else None,
            "accum_steps": accum if running else None,
            "replicas": replicas,
            "goodput": round(goodput, 1) if running else None,
            "efficiency": round(eff, 3) if running else None,
            "speedup": round(rng.uniform(0.7, 2.5), 2) if running else None,
            "progress": round(progress, 1) if progress is not None else None,
            "epoch": epoch,
            "metrics": {"loss": round(2.5 / (1 + (epoch or 0)), 3)} if started else {},
            "eta_s": round(rng.uniform(60, 20_000)) if running else None,
            "min_gpus": 1,
            "max_gpus": 4,
            "priority": rng.choice((0, 0, 0, 1, 5)),
            "restarts": rng.randrange(0, 5) if started else 0,
            "failures": 3 if state == "failed" else 0,
            "submit_time": submit_time,
            "start_time": submit_time + 30.0 if started else None,
            "end_time": submit_time + 1200.0 if ended else None,
            "run_time_s": 1170.0 if ended else (DEMO_NOW - submit_time - 30.0 if started else 0.0),
            "reason": _ENDED.get(state, "held by request" if state == "held" else ""),
            "target": None,
        }
        jobs.append(job)
        history = [
            {
                "time": submit_time + 120.0 * step,
                "goodput": round(goodput * (0.6 + 0.4 * step / 23), 1),
                "noise_scale": round(phi * (0.3 + 0.7 * step / 23), 1),
            }
            for step in range(24)
        ]
        profile = []
        for k in sorted({1, 2, max(replicas, 1)}):
            for m in (local_batch // 2, local_batch):
                t_c = params["alpha_c"] + params["beta_c"] * m
                t_n = 0.0 if k == 1 else params["alpha_r"] + params["beta_r"] * (k - 2)
                noise = 1.0 + rng.uniform(-0.06, 0.06)
                t_s = (t_c ** params["gamma"] + t_n ** params["gamma"]) ** (1 / params["gamma"])
                profile.append(
                    {
                        "nodes": 1,
                        "replicas": k,
                        "local_batch": m,
                        "compute_s": round(t_c * noise, 5),
                        "step_s": round(t_s * noise, 5),
                        "count": 20 + 5 * k,
                    }
                )
        size = max(replicas, 1)
        where = placement or {node_names[0]: ["cuda:0"]}
        decisions = [
            {
                "time": submit_time + 300.0 * i,
                "job_id": job_id,
                "kind": kind,
                "placement": where if kind != "submitted" else {},
                "batch": (
                    {"local_batch": local_batch, "accum_steps": accum, "replicas": r}
                    if kind != "submitted"
                    else {}
                ),
                "reason": reason,
            }
            for i, (kind, r, reason) in enumerate(
                [
                    ("submitted", 0, f"by {owner}"),
                    ("start", 1, "first start: no profile yet, linear speed-up assumed"),
                    (
                        "resize",
                        size,
                        f"predicted speedup {1.0 + 0.3 * replicas:.2f}x over fair share; "
                        f"gain {3 + j % 7}% repays a 30 s restart",
                    ),
                ]
            )
        ]
        report = {
            "version": 1,
            "job_id": job_id,
            "time": DEMO_NOW - 5.0,
            "bounds": {
                "base_batch": base_batch,
                "max_batch": base_batch * 32,
                "min_local": max(1, base_batch // 4),
                "max_local": base_batch * 4,
                "accumulation": True,
            },
            "profile": profile,
            "grad_stats": {"sqr": round(sqr, 4), "var": round(var, 4)},
            "progress": job["progress"],
            "epoch": epoch,
            "epochs": 90,
            "batch": {"local_batch": local_batch, "accum_steps": accum, "replicas": size},
            "metrics": job["metrics"],
            "eta_s": None,
        }
        shows[job_id] = {
            "v": 1,
            "ok": True,
            "job": {
                **job,
                "argv": ["python", "-u", f"jobs/{app}/train.py"],
                "workdir": f"/home/{owner}/{app}",
                "batch_bounds": {
                    "batch_size": base_batch,
                    "max_batch_size": base_batch * 32,
                    "min_local_batch": max(1, base_batch // 4),
                    "max_local_batch": base_batch * 4,
                },
                "job_dir": f"/var/lib/pollux-local/jobs/{job_id}",
                "pids": [
                    {"rank": r, "pid": 4000 + 10 * j + r, "node": node, "create_time": None}
                    for r, node in enumerate(n for n, devs in placement.items() for _ in devs)
                ],
                "report": report if started else None,
                "noise_scale": round(phi, 1) if started else None,
                "model": (
                    {
                        "params": params,
                        "profile_points": len(profile),
                        "fitted_points": 12,
                        "base_batch": base_batch,
                    }
                    if started
                    else None
                ),  # fmt: skip
                "history": history if started else [],
                "env": None,
            },
            "decisions": decisions if started else decisions[:1],
        }
        text = "".join(
            f"[rank 0] epoch {e} step {100 * e} loss {2.5 / (e + 1):.3f} batch {total}\n"
            for e in range(30)
        )
        logs[job_id] = {
            "v": 1,
            "ok": True,
            "data": text,
            "offset": len(text.encode()),
            "size": len(text.encode()),
            "state": state,
        }
    nodes = [
        {
            "name": node,
            "host": node,
            "local": index == 0,
            "up": node != down_node,
            "error": "ssh: connect to host timed out" if node == down_node else None,
            "devices": [f"cuda:{d}" for d in range(devices_per_node)],
            "busy": [external[1]] if node == external[0] else [],
            "jobs": {dev: job for (n, dev), job in holders.items() if n == node},
            "load": None if node == down_node else round(0.2 + 0.1 * index, 2),
        }
        for index, node in enumerate(node_names)
    ]
    return {
        "version": RECORDING_VERSION,
        "recorded_at": DEMO_NOW,
        "daemon": "demo",
        "jobs": {},
        "replies": {
            "status": {"v": 1, "ok": True, "jobs": jobs},
            "nodes": {"v": 1, "ok": True, "nodes": nodes},
            "show": shows,
            "logs": logs,
        },
    }
