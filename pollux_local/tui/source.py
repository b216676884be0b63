"""Where the TUI gets its data: the daemon (``DaemonSource``) or canned data (``FixedSource``).

Both answer ``request(type, **fields) -> dict`` with the daemon protocol's response objects
(docs/architecture.md).  A request either returns the response (``ok`` true) or raises
:class:`DaemonDown` (no daemon reachable) or :class:`SourceError` (the daemon refused).  The
calls block, so the app makes them from a worker thread.  This module does not import textual.
"""

from __future__ import annotations

import copy
import random
import threading
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, Protocol

Response = dict[str, Any]


class SourceError(Exception):
    """The daemon answered a request with an error (one line)."""


class DaemonDown(SourceError):
    """No daemon answers on the socket."""


class DataSource(Protocol):
    """Anything that answers daemon-protocol requests."""

    description: str

    def request(self, type: str, **fields: Any) -> Response: ...


class DaemonSource:
    """Talks to a running daemon through :class:`pollux_local.client.Client`.

    The client is created per request so that a daemon restart is picked up transparently.
    """

    def __init__(
        self, socket_path: str | Path, client_factory: Callable[[str], Any] | None = None
    ) -> None:
        self.socket_path = str(socket_path)
        self.description = self.socket_path
        self._client_factory = client_factory

    def _client(self) -> Any:
        if self._client_factory is not None:
            return self._client_factory(self.socket_path)
        from pollux_local.client import Client

        return Client(self.socket_path)

    def request(self, type: str, **fields: Any) -> Response:
        if not Path(self.socket_path).exists():
            raise DaemonDown(f"no daemon socket at {self.socket_path}")
        try:
            reply = self._client().request(type, **fields)
        except (ConnectionError, FileNotFoundError, TimeoutError) as exc:
            raise DaemonDown(f"daemon not reachable at {self.socket_path}: {exc}") from exc
        except OSError as exc:
            raise DaemonDown(f"daemon not reachable at {self.socket_path}: {exc}") from exc
        except Exception as exc:  # the client reports refusals as exceptions (PolluxError)
            message = str(exc).splitlines()[0] if str(exc) else exc.__class__.__name__
            if _looks_unreachable(message):
                raise DaemonDown(message) from exc
            raise SourceError(message) from exc
        if not isinstance(reply, Mapping):
            raise SourceError(f"malformed reply to {type!r}: {reply!r:.80}")
        if reply.get("ok") is False:
            raise SourceError(str(reply.get("error") or f"{type} failed"))
        return dict(reply)


def _looks_unreachable(message: str) -> bool:
    lowered = message.lower()
    return any(
        word in lowered
        for word in (
            "not running",
            "no daemon",
            "connection refused",
            "not reachable",
            "lost the connection",
            "did not answer",
        )
    )


# --------------------------------------------------------------------------------------------
# Canned data
# --------------------------------------------------------------------------------------------

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


def demo_data(
    n_jobs: int = 8, n_nodes: int = 2, devices_per_node: int = 4, seed: int = 0
) -> dict[str, Any]:
    """A deterministic, self-consistent cluster: ``{"status", "nodes", "details", "logs"}``.

    Running jobs are packed onto devices in id order; the last device of the last node that is
    up is used by a process outside the scheduler and, with three or more nodes, the last node
    is down.
    """
    rng = random.Random(seed)
    node_names = [f"ws{i + 1}" for i in range(n_nodes)]
    last_up = n_nodes - 2 if n_nodes >= 3 else n_nodes - 1
    free: list[tuple[str, str]] = []
    for index, node in enumerate(node_names):
        down = n_nodes >= 3 and index == n_nodes - 1
        if down:
            continue
        for d in range(devices_per_node):
            if index == last_up and d == devices_per_node - 1:
                continue  # the external device
            free.append((node, f"cuda:{d}"))
    holders: dict[tuple[str, str], str] = {}
    jobs: list[dict[str, Any]] = []
    details: dict[str, dict[str, Any]] = {}
    logs: dict[str, list[str]] = {}
    base_time = 1_732_320_000.0
    for j in range(n_jobs):
        job_id = f"j{j + 1:03d}"
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
        thr = total / (params["alpha_c"] + params["beta_c"] * local_batch) / accum
        goodput = thr * eff if running else 0.0
        progress = {"queued": 0.0}.get(state, rng.uniform(200.0, 20_000.0))
        job: dict[str, Any] = {
            "id": job_id,
            "name": f"{app}-{j + 1}",
            "owner": owner,
            "state": state,
            "gpus": replicas,
            "placement": placement,
            "batch_size": total if running else base_batch,
            "local_batch": local_batch if running else None,
            "accum_steps": accum if running else None,
            "replicas": replicas,
            "goodput": round(goodput, 1) if running else None,
            "efficiency": round(eff, 3) if running else None,
            "speedup": round(rng.uniform(0.7, 2.5), 2) if running else None,
            "progress": round(progress, 1),
            "eta_s": round(rng.uniform(60, 20_000)) if running else None,
            "restarts": rng.randrange(0, 5) if state != "queued" else 0,
            "priority": rng.choice((0, 0, 0, 1, 5)),
            "submit_time": base_time + 60.0 * j,
        }
        jobs.append(job)
        history = []
        for step in range(24):
            t = base_time + 60.0 * j + 120.0 * step
            history.append(
                {
                    "time": t,
                    "goodput": round(goodput * (0.6 + 0.4 * step / 23), 1),
                    "noise_scale": round(phi * (0.3 + 0.7 * step / 23), 1),
                    "replicas": max(1, min(replicas, 1 + step // 6)),
                }
            )
        profile = []
        for k in sorted({1, 2, max(replicas, 1)}):
            for m in (local_batch // 2, local_batch):
                if m <= 0:
                    continue
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
        decisions = [
            {
                "time": base_time + 60.0 * j + 300.0 * i,
                "replicas": r,
                "reason": reason,
            }
            for i, (r, reason) in enumerate(
                [
                    (1, "first start: no profile yet, linear speed-up assumed"),
                    (
                        max(replicas, 1),
                        f"predicted speedup {1.0 + 0.3 * replicas:.2f}x over fair share",
                    ),
                    (max(replicas, 1), f"kept: gain {3 + j % 7}% does not repay a 30 s restart"),
                ]
            )
        ]
        details[job_id] = {
            **job,
            "model": {"params": params, "fitted_at": base_time + 60.0 * j + 900.0},
            "bounds": {
                "base_batch": base_batch,
                "max_batch": base_batch * 32,
                "min_local": max(1, base_batch // 4),
                "max_local": base_batch * 4,
                "accumulation": True,
            },
            "profile": profile,
            "grad_stats": {"sqr": round(sqr, 4), "var": round(var, 4)},
            "noise_scale": round(phi, 1),
            "history": history,
            "decisions": decisions,
            "script": f"jobs/{app}/train.py",
        }
        logs[job_id] = [
            f"[rank 0] epoch {e} step {100 * e} loss {2.5 / (e + 1):.3f} batch {total}"
            for e in range(30)
        ]
    nodes = []
    for index, node in enumerate(node_names):
        down = n_nodes >= 3 and index == n_nodes - 1
        devices = []
        for d in range(devices_per_node):
            dev = f"cuda:{d}"
            entry: dict[str, Any] = {"id": dev, "job": holders.get((node, dev))}
            if down:
                entry["state"] = "down"
            elif index == last_up and d == devices_per_node - 1:
                entry["state"] = "external"
            else:
                entry["state"] = "busy" if entry["job"] else "free"
            devices.append(entry)
        nodes.append({"name": node, "up": not down, "devices": devices})
    return {"status": {"jobs": jobs}, "nodes": {"nodes": nodes}, "details": details, "logs": logs}


def _check_request(type: str, fields: dict[str, Any]) -> None:
    """Refuse what the daemon would refuse (its schema), when the daemon package is present."""
    try:
        from pollux_local.daemon.protocol import PROTOCOL_VERSION, validate_request
    except ImportError:
        return
    try:
        validate_request({"v": PROTOCOL_VERSION, "type": type, **fields})
    except Exception as exc:
        raise SourceError(str(exc)) from exc


class FixedSource:
    """Canned responses for tests, screenshots and benchmarks.

    Every request is recorded in ``calls`` and checked against the daemon's request schema
    (``pollux_local.daemon.protocol.validate_request``), so a request the daemon would refuse
    is refused here too.  Actions (``cancel``, ``hold``, ``release``, ``set_priority``,
    ``submit``) are applied to the canned data so that the next refresh shows them.  ``down``
    makes every request raise :class:`DaemonDown`; ``fail`` maps a request type to the error
    line it is refused with.
    """

    def __init__(self, data: Mapping[str, Any] | None = None) -> None:
        self.data: dict[str, Any] = copy.deepcopy(dict(data if data is not None else demo_data()))
        self.description = "fixed data"
        self.calls: list[tuple[str, dict[str, Any]]] = []
        self.down = False
        self.fail: dict[str, str] = {}
        self._lock = threading.Lock()

    def _jobs(self) -> list[dict[str, Any]]:
        jobs: list[dict[str, Any]] = self.data["status"]["jobs"]
        return jobs

    def _find(self, job_id: Any) -> dict[str, Any]:
        for job in self._jobs():
            if str(job.get("id")) == str(job_id):
                return job
        raise SourceError(f"no job with id {job_id}")

    def request(self, type: str, **fields: Any) -> Response:
        with self._lock:
            self.calls.append((type, dict(fields)))
            if self.down:
                raise DaemonDown("no daemon socket at /fixed/daemon.sock")
            if type in self.fail:
                raise SourceError(self.fail[type])
            _check_request(type, fields)
            return self._answer(type, fields)

    def _answer(self, type: str, fields: dict[str, Any]) -> Response:
        if type == "ping":
            return {"ok": True}
        if type == "status":
            return {"ok": True, **copy.deepcopy(self.data["status"])}
        if type == "nodes":
            return {"ok": True, **copy.deepcopy(self.data["nodes"])}
        if type == "show":
            job = self._find(fields.get("id"))
            detail = dict(self.data.get("details", {}).get(str(job["id"]), {}))
            detail.update(job)
            return {"ok": True, "job": copy.deepcopy(detail)}
        if type == "logs":
            job = self._find(fields.get("id"))
            lines = self.data.get("logs", {}).get(str(job["id"]), [])
            return {"ok": True, "lines": list(lines)}
        if type == "cancel":
            for job_id in fields["ids"]:
                self._find(job_id)["state"] = "cancelled"
            return {"ok": True}
        if type in ("hold", "release"):
            job = self._find(fields.get("id"))
            job["state"] = "held" if type == "hold" else "queued"
            return {"ok": True}
        if type == "set_priority":
            self._find(fields.get("id"))["priority"] = int(fields["priority"])
            return {"ok": True}
        if type == "submit":
            new_id = f"j{len(self._jobs()) + 1:03d}"
            script = str(fields["argv"][0])
            self._jobs().append(
                {
                    "id": new_id,
                    "name": fields.get("name") or Path(script).stem,
                    "owner": "you",
                    "state": "queued",
                    "gpus": 0,
                    "placement": {},
                    "batch_size": fields.get("batch_size"),
                    "restarts": 0,
                    "priority": fields.get("priority", 0),
                }
            )
            return {"ok": True, "id": new_id}
        raise SourceError(f"unknown request type {type!r}")
