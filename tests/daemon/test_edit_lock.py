"""``edit`` waits for the daemon's mutex: a pass plans from the queue as it is (in a thread,
under the mutex) and then starts what it planned; an edit in between would start the job
changed on an allocation planned for it as it was (a rigid job's new size on the old count)."""

from __future__ import annotations

import asyncio
from pathlib import Path

from pollux_local.api.messages import Edit
from pollux_local.daemon.handlers import resubmit, submit
from pollux_local.daemon.state import StateStore
from tests.abuse.test_request_amplification import ALICE, context, held


def test_an_edit_waits_for_a_pass_in_progress(tmp_path: Path) -> None:
    store = StateStore(tmp_path / "state.db")
    alice = context(store, ALICE)
    job_id = submit.submit(alice, held(["/bin/true"])).id

    async def main() -> tuple[int, int]:
        async with alice.mutex:  # a pass between its plan and its starts
            edit = asyncio.ensure_future(resubmit.edit(alice, Edit(id=job_id, min_gpus=2)))
            await asyncio.sleep(0.05)
            during = store.get_job(int(job_id)).spec.min_gpus  # type: ignore[union-attr]
        await asyncio.wait_for(edit, 5)
        after = store.get_job(int(job_id)).spec.min_gpus  # type: ignore[union-attr]
        return during, after

    assert asyncio.run(main()) == (1, 2)
    store.close()
