"""The Prometheus endpoint (``[metrics] prometheus = "HOST:PORT"``, the ``prometheus`` extra).

``GET /metrics`` at that address (and nowhere else) answers with what the daemon holds at the
moment of the scrape: a :class:`DaemonSnapshot` taken in the daemon's event loop (the store is
used from that thread only) and turned into metric families by :class:`DaemonCollector`:

=============================================  ==================================================
``pollux_local_devices{node,device_type}``     devices configured
``pollux_local_devices_in_use{…}``             devices held by running jobs
``pollux_local_devices_withheld{…}``           devices reserved (``[devices] reserved``) or drained
``pollux_local_jobs{state}``                   jobs in each state (every state, 0 included)
``pollux_local_queue_length``                  jobs queued (waiting for devices)
``pollux_local_job_goodput{job,name,user}``    each running job's predicted goodput (samples/s)
``pollux_local_job_devices{job,name,user}``    each running job's devices
``pollux_local_scheduling_passes_total``       scheduling passes that planned since the start
=============================================  ==================================================

Without ``prometheus-client`` installed the endpoint is not served (one line in the log says
how to install it) and the daemon runs on.

Anyone who reaches the address may connect, so the endpoint holds at most
:data:`MAX_CONNECTIONS` connections at once (one more is closed as soon as it is accepted) and
drops a client that has not sent its request within :data:`REQUEST_TIMEOUT_S`: a flood of
half-open scrapes cannot take the descriptors the daemon needs to launch and watch jobs.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

from pollux_local.api.states import PLACED_STATES, JobState
from pollux_local.daemon.config import DaemonConfig
from pollux_local.daemon.state import StateStore

log = logging.getLogger("pollux_local.daemon")

#: A request must be read whole within this (a silent client is dropped); so must the answer.
REQUEST_TIMEOUT_S = 2.0
#: Connections served at once (a scraper needs one); more are closed when accepted.
MAX_CONNECTIONS = 8
#: The longest request head (request line and headers) read.
MAX_REQUEST_BYTES = 16 * 1024
PREFIX = "pollux_local"


@dataclass(frozen=True)
class NodeDevices:
    """One node's device counts."""

    node: str
    device_type: str
    total: int
    in_use: int
    withheld: int


@dataclass(frozen=True)
class RunningJob:
    job: str
    name: str
    user: str
    devices: int
    goodput: float | None


@dataclass(frozen=True)
class DaemonSnapshot:
    """What a scrape reports, read at once from the config and the store."""

    nodes: tuple[NodeDevices, ...]
    jobs_by_state: dict[str, int]
    running: tuple[RunningJob, ...]
    passes: int

    @property
    def queue_length(self) -> int:
        return self.jobs_by_state.get(JobState.QUEUED.value, 0)


def snapshot_of(config: DaemonConfig, store: StateStore, passes: int) -> DaemonSnapshot:
    """The daemon now: devices per node (configured, held by placed jobs, withheld by
    ``[devices] reserved`` or ``drain``), jobs per state, the running jobs' goodput."""
    placed = store.jobs(PLACED_STATES)
    in_use: dict[str, set[str]] = {}
    for job in placed:
        for node_name, devices in job.placement.items():
            in_use.setdefault(node_name, set()).update(devices)
    withheld_targets = {*config.reserved, *store.withheld()}
    nodes = []
    for node in config.nodes:
        whole = node.name in withheld_targets
        withheld = [d for d in node.devices if whole or f"{node.name}:{d}" in withheld_targets]
        held = in_use.get(node.name, set())
        nodes.append(
            NodeDevices(
                node=node.name,
                device_type=node.device_type,
                total=len(node.devices),
                in_use=sum(1 for d in node.devices if d in held),
                withheld=len(withheld),
            )
        )
    counts = dict.fromkeys((state.value for state in JobState), 0)
    for state, count in store.db.execute("SELECT state, COUNT(*) FROM jobs GROUP BY state"):
        counts[str(state)] = int(count)
    running = tuple(
        RunningJob(
            job=job.job_id,
            name=job.name,
            user=job.owner_name,
            devices=job.replicas,
            goodput=_number(job.prediction.get("goodput")),
        )
        for job in placed
        if job.state == JobState.RUNNING
    )
    return DaemonSnapshot(nodes=tuple(nodes), jobs_by_state=counts, running=running, passes=passes)


def _number(value: Any) -> float | None:
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    return float(value)


class DaemonCollector:
    """A ``prometheus_client`` collector reading a fresh :class:`DaemonSnapshot` at each
    scrape (``snapshot``: called in the daemon's event loop)."""

    def __init__(self, snapshot: Callable[[], DaemonSnapshot]) -> None:
        self.snapshot = snapshot

    def describe(self) -> list[Any]:
        return []  # nothing is collected at registration (the daemon may not be up yet)

    def collect(self) -> Iterator[Any]:
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        snap = self.snapshot()
        node_labels = ["node", "device_type"]
        families = {
            "devices": GaugeMetricFamily(
                f"{PREFIX}_devices", "Devices configured.", labels=node_labels
            ),
            "in_use": GaugeMetricFamily(
                f"{PREFIX}_devices_in_use", "Devices held by running jobs.", labels=node_labels
            ),
            "withheld": GaugeMetricFamily(
                f"{PREFIX}_devices_withheld",
                "Devices reserved by the config or drained: given to no new job.",
                labels=node_labels,
            ),
        }
        for node in snap.nodes:
            labels = [node.node, node.device_type]
            families["devices"].add_metric(labels, node.total)
            families["in_use"].add_metric(labels, node.in_use)
            families["withheld"].add_metric(labels, node.withheld)
        yield from families.values()
        jobs = GaugeMetricFamily(f"{PREFIX}_jobs", "Jobs in each state.", labels=["state"])
        for state, count in snap.jobs_by_state.items():
            jobs.add_metric([state], count)
        yield jobs
        yield GaugeMetricFamily(
            f"{PREFIX}_queue_length", "Jobs queued, waiting for devices.", value=snap.queue_length
        )
        job_labels = ["job", "name", "user"]
        goodput = GaugeMetricFamily(
            f"{PREFIX}_job_goodput",
            "A running job's predicted goodput (samples per second at full efficiency).",
            labels=job_labels,
        )
        devices = GaugeMetricFamily(
            f"{PREFIX}_job_devices", "Devices a running job holds.", labels=job_labels
        )
        for job in snap.running:
            labels = [job.job, job.name, job.user]
            devices.add_metric(labels, job.devices)
            if job.goodput is not None:
                goodput.add_metric(labels, job.goodput)
        yield goodput
        yield devices
        yield CounterMetricFamily(
            f"{PREFIX}_scheduling_passes",
            "Scheduling passes that planned since the daemon started.",
            value=snap.passes,
        )


def parse_address(address: str) -> tuple[str, int]:
    """``HOST:PORT`` -> (host, port); an empty host is every interface."""
    host, _, port = address.rpartition(":")
    number = int(port)
    if not 0 < number < 65536:
        raise ValueError(f"port {number} is out of range")
    return host, number


class PrometheusEndpoint:
    """``/metrics`` served from the daemon's event loop at one address."""

    def __init__(self, server: asyncio.AbstractServer, registry: Any, address: str) -> None:
        self.server = server
        self.registry = registry
        self.address = address
        #: connections being served now (at most :data:`MAX_CONNECTIONS`)
        self.serving = 0

    @classmethod
    async def start(
        cls, address: str, snapshot: Callable[[], DaemonSnapshot]
    ) -> PrometheusEndpoint | None:
        """Serve at ``address``; ``None`` (logged in one line) when ``prometheus-client`` is
        not installed or the address cannot be bound."""
        try:
            from prometheus_client import CollectorRegistry
        except ImportError:
            log.warning(
                "[metrics] prometheus = %r: prometheus-client is not installed; install the"
                " extra (pip install 'pollux-local[prometheus]') to serve /metrics",
                address,
            )
            return None
        registry = CollectorRegistry(auto_describe=False)
        registry.register(DaemonCollector(snapshot))
        endpoint: PrometheusEndpoint | None = None

        async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            assert endpoint is not None
            if endpoint.serving >= MAX_CONNECTIONS:
                writer.close()  # its descriptor back at once
                return
            endpoint.serving += 1
            try:
                await endpoint._answer(reader, writer)
            finally:
                endpoint.serving -= 1

        try:
            host, port = parse_address(address)
            server = await asyncio.start_server(serve, host or None, port, limit=MAX_REQUEST_BYTES)
        except (OSError, ValueError) as exc:
            log.error("[metrics] prometheus = %r: cannot serve there: %s", address, exc)
            return None
        endpoint = cls(server, registry, address)
        log.info("serving Prometheus metrics at http://%s/metrics", address)
        return endpoint

    async def close(self) -> None:
        self.server.close()
        with contextlib.suppress(Exception):
            await asyncio.wait_for(self.server.wait_closed(), 5)

    def render(self) -> tuple[bytes, str]:
        """The exposition of every metric now, and its content type."""
        from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

        return generate_latest(self.registry), CONTENT_TYPE_LATEST

    def _respond(self, method: str, path: str) -> tuple[str, bytes, str]:
        """(status line, body, content type) for a request."""
        if method not in ("GET", "HEAD"):
            return "405 Method Not Allowed", b"only GET /metrics\n", "text/plain"
        if path != "/metrics":
            return "404 Not Found", b"the metrics are at /metrics\n", "text/plain"
        try:
            body, kind = self.render()
        except Exception as exc:  # a failing scrape never takes the daemon down
            log.exception("prometheus scrape failed")
            return "500 Internal Server Error", f"{exc}\n".encode(), "text/plain"
        return "200 OK", body, kind

    async def _answer(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        """One HTTP request, one answer, then the connection is closed."""
        try:
            async with asyncio.timeout(REQUEST_TIMEOUT_S):
                head = await reader.readuntil(b"\r\n\r\n")
            request_line = head.split(b"\r\n", 1)[0].decode("latin-1").split()
            method = request_line[0] if request_line else ""
            path = request_line[1].split("?", 1)[0] if len(request_line) > 1 else ""
            status, body, kind = self._respond(method, path)
            header = (
                f"HTTP/1.1 {status}\r\nContent-Type: {kind}\r\n"
                f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n"
            ).encode()
            writer.write(header if method == "HEAD" else header + body)
            async with asyncio.timeout(REQUEST_TIMEOUT_S):
                await writer.drain()
        except (
            TimeoutError,
            ConnectionError,
            asyncio.IncompleteReadError,
            asyncio.LimitOverrunError,
        ):
            pass
        finally:
            writer.close()
