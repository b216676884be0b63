"""The daemon refuses torch's launcher as a job's command by the client's rule
(``api.torchrun``, in ``submit.validate_jobs``), whatever sent the request: a submit (an
array's task commands too) and an edit of the command, each in one line, nothing stored."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from pollux_local.api.errors import InvalidRequest
from pollux_local.api.messages import ArrayTask, Edit, Submit
from pollux_local.daemon.handlers import resubmit, submit
from pollux_local.daemon.state import StateStore
from tests.api.test_torchrun import LAUNCHERS
from tests.daemon.test_limits import ALICE, context

pytestmark = pytest.mark.timeout(120)


def _argv(launcher: list[str]) -> list[str]:
    return [*launcher, "--nproc-per-node", "2", "/w/train.py"]


@pytest.mark.parametrize(("launcher", "named"), LAUNCHERS)
def test_a_submit_of_the_launcher_is_refused(
    tmp_path: Path, launcher: list[str], named: str
) -> None:
    store = StateStore(tmp_path / "state.db")
    alice = context(store, ALICE)
    with pytest.raises(InvalidRequest) as caught:
        submit.submit(alice, Submit(argv=_argv(launcher), workdir="/", hold=True))
    line = str(caught.value)
    assert line.startswith(f"{named} would start ranks of its own inside the job; ") and (
        "pollux-local submit --gpus N /w/train.py ..." in line and "\n" not in line
    )
    # an array's task with a command of its own
    tasks = [ArrayTask(index=0), ArrayTask(index=1, argv=_argv(launcher))]
    with pytest.raises(InvalidRequest, match="would start ranks of its own"):
        submit.submit(alice, Submit(argv=["/bin/true"], workdir="/", hold=True, array=tasks))
    assert store.count_jobs() == 0
    store.close()


@pytest.mark.parametrize(("launcher", "named"), LAUNCHERS)
def test_an_edit_to_the_launcher_is_refused(
    tmp_path: Path, launcher: list[str], named: str
) -> None:
    store = StateStore(tmp_path / "state.db")
    alice = context(store, ALICE)
    job = submit.submit(alice, Submit(argv=["/bin/true"], workdir="/", hold=True))
    with pytest.raises(InvalidRequest, match=f"^{named} would start ranks of its own"):
        asyncio.run(resubmit.edit(alice, Edit(id=job.id, argv=_argv(launcher))))
    stored = store.get_job(int(job.id))
    assert stored is not None and stored.spec.argv == ["/bin/true"]
    store.close()


def test_python_running_code_that_names_the_launcher_is_taken(tmp_path: Path) -> None:
    store = StateStore(tmp_path / "state.db")
    alice = context(store, ALICE)
    argv = ["/usr/bin/python3", "-c", "import sys", "-m", "torch.distributed.run"]
    job = submit.submit(alice, Submit(argv=argv, workdir="/", hold=True))
    stored = store.get_job(int(job.id))
    assert stored is not None and stored.spec.argv == argv
    store.close()
