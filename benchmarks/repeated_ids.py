"""What a request naming one job many times costs the daemon's event loop.

``cancel`` with one job's id repeated (the request allows 10,000) and ``submit --after`` with
one id repeated (1,000), handled as the server handles them, on a real state database where
the job keeps a 3 MB environment.  Before each id was read once per entry (a full load with the
environment): about 4 ms an entry, 40 s for 10,000.  Prints the median of ``--rounds`` runs.

    python benchmarks/repeated_ids.py --rounds 5
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from pollux_local.api.messages import Cancel, Submit  # noqa: E402
from pollux_local.daemon.auth import Peer  # noqa: E402
from pollux_local.daemon.config import DaemonConfig, NodeConfig  # noqa: E402
from pollux_local.daemon.context import Context  # noqa: E402
from pollux_local.daemon.handlers import control, submit  # noqa: E402
from pollux_local.daemon.readmodel import MetricHistory  # noqa: E402
from pollux_local.daemon.scheduler import ModelCache  # noqa: E402
from pollux_local.daemon.state import StateStore  # noqa: E402


class _Executor:
    async def stop_job(self, job_id: int, intent: object) -> None:
        return None


def context(store: StateStore, uid: int) -> Context:
    config = DaemonConfig(nodes=(NodeConfig("n0", ("cpu:0",)),))
    return Context(
        peer=Peer(pid=1, uid=uid, gid=uid), store=store, executor=_Executor(),  # type: ignore[arg-type]
        config=replace(config), state_dir=store.path.parent, clock=time.time,
        models=ModelCache(), metrics=MetricHistory(), mutex=asyncio.Lock(),
        wake=lambda: None, daemon_uid=0, policy_name="fifo",
    )  # fmt: skip


def one_round() -> tuple[float, float]:
    with tempfile.TemporaryDirectory() as scratch:
        store = StateStore(Path(scratch) / "state.db")
        ctx = context(store, 41000)
        env = {f"V{i}": "x" * 100_000 for i in range(30)}  # ~3 MB
        job = submit.submit(ctx, Submit(argv=["/bin/true"], workdir="/", hold=True, env=env)).id
        started = time.perf_counter()
        submit.submit(ctx, Submit(argv=["/bin/true"], workdir="/", hold=True, after=[job] * 1000))
        after = time.perf_counter() - started
        started = time.perf_counter()
        asyncio.run(control.cancel(ctx, Cancel(ids=[job] * 10_000)))
        cancel = time.perf_counter() - started
        store.close()
    return cancel, after


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    runs = [one_round() for _ in range(args.rounds)]
    print(f"cancel, one id 10,000 times: {statistics.median(r[0] for r in runs) * 1000:.1f} ms")
    print(
        f"submit --after, one id 1,000 times: {statistics.median(r[1] for r in runs) * 1000:.1f} ms"
    )


if __name__ == "__main__":
    main()
