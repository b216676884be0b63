"""One exit-code table (``api.states.ExitCode``): the modules that run alone, stdlib only
(the local supervisor, the SSH node agent, which ships as source text, the Slurm step's
keeper, run as a script), keep literals, and
this keeps them equal to the table."""

from __future__ import annotations

import re

from pollux_local.api.states import ExitCode
from pollux_local.launch import node_agent, supervisor
from pollux_local.launch.slurm import keeper
from tests.paths import REPO_ROOT

PACKAGE = REPO_ROOT / "pollux_local"


def test_the_stdlib_only_launch_modules_agree_with_the_table() -> None:
    assert supervisor.RESCALE_EXIT_CODE == ExitCode.RESCALE
    assert supervisor.WORKDIR_EXIT_CODE == ExitCode.WORKDIR
    assert supervisor.SETUP_EXIT_CODE == ExitCode.SETUP
    assert supervisor.EXEC_EXIT_CODE == ExitCode.EXEC_FAILED
    assert node_agent.SETUP_FAILED_EXIT_CODE == ExitCode.NODE_SETUP
    assert node_agent.NOT_STARTED_EXIT_CODE == ExitCode.EXEC_FAILED
    assert node_agent.WORKDIR_EXIT_CODE == ExitCode.WORKDIR
    assert keeper.RESCALE == ExitCode.RESCALE


def test_the_launch_modules_agree_on_the_state_of_a_record_whose_replicas_all_ended() -> None:
    """``"exited"``: every replica's exit is in the record, its helper's clean-up not done
    (``launch.base.settles`` takes it for the result once the helper is gone)."""
    from pollux_local.launch import base

    assert supervisor.EXITED == node_agent.EXITED == base.EXITED


def test_no_other_module_spells_an_exit_code_of_the_table() -> None:
    """A literal of the table assigned to a name happens only in the stdlib-only modules."""
    allowed = {
        "api/states.py",
        "launch/supervisor.py",
        "launch/node_agent.py",
        "launch/slurm/keeper.py",
    }
    codes = "|".join(str(int(code)) for code in ExitCode if int(code) > 3)
    assignment = re.compile(rf"^\s*[A-Z_]+(?::[^=]+)?\s*=\s*({codes})\b", re.MULTILINE)
    found = [
        str(path.relative_to(PACKAGE))
        for path in PACKAGE.rglob("*.py")
        if str(path.relative_to(PACKAGE)) not in allowed and assignment.search(path.read_text())
    ]
    assert found == []
