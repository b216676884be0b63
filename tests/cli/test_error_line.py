"""The CLI's one error line is printed as untrusted text: a daemon's refusal may quote what
another user's job controls (a release or restart of a job queued before the daemon refused
torch's launcher is refused with its script's name), and an admin's terminal must get it as
escapes, on one line."""

from __future__ import annotations

from typing import Any

import pytest

from pollux_local.api.errors import InvalidRequest
from pollux_local.api.torchrun import torchrun_refusal
from pollux_local.cli import control, main

HOSTILE = "x\x1b]2;owned\x07\x1b[2J\njob 9 is released\u202e.py"


class Refusing:
    def call(self, request: Any) -> Any:
        refused = torchrun_refusal(["python", "-u", "-m", "torch.distributed.run", HOSTILE])
        assert refused is not None
        raise InvalidRequest(refused)


def test_a_refusal_quoting_a_jobs_command_reaches_the_terminal_escaped_on_one_line(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(control, "client_for", lambda args: Refusing())
    code = main(["release", "9"])
    out, err = capsys.readouterr()
    assert code != 0 and out == ""
    assert err.count("\n") == 1 and err.startswith("pollux-local: error: python -m torch")
    assert not any(ch in err[:-1] for ch in "\x1b\x07\n\u202e"), err
    assert "\\x1b]2;owned\\x07" in err
